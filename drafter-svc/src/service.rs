//! The internal `glance.drafter.v1.Drafter` gRPC service: a handshake that states what this drafter is
//! (and refuses a verifier whose target it was not built for), and one bidirectional stream per
//! generation whose session drafts on the runtime worker that received its request. The peer is not trusted: every message is
//! checked before it reaches the engine (tokens inside the vocabulary, positions inside the context
//! limit, tensors the codec accepts), a panic in a session becomes an INTERNAL status instead of a
//! silently ended stream, sessions are admitted up to a limit, and an idle one is closed.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use glance_codec as codec;
use glance_proto::drafter::v1 as pb;
use glance_spec::session::{DraftEngine, DraftError, RoundInput, Session};
use glance_telemetry::ROUND_SPANS;
use tch::Device;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::metrics as names;

/// What one drafter-svc admits.
#[derive(Clone, Copy, Debug)]
pub struct SessionLimits {
    /// Draft sessions open at once (each holds a draft KV cache, and a runtime worker while it drafts).
    pub max_sessions: usize,
    /// Context positions one session may hold.
    pub max_context: usize,
    /// A session that receives nothing for this long is closed and its cache freed.
    pub idle_timeout: Duration,
}

pub struct DrafterService {
    engine: Arc<dyn DraftEngine>,
    /// What every session checks its messages against.
    checks: Checks,
    /// One permit per session that may open.
    admission: Arc<Semaphore>,
    drain: SessionDrain,
}

impl DrafterService {
    /// `device`: where the tap states are moved before drafting.
    pub fn new(engine: Arc<dyn DraftEngine>, device: Device, limits: SessionLimits) -> Self {
        metrics::gauge!(names::SESSIONS_LIMIT).set(limits.max_sessions as f64);
        let admission = Arc::new(Semaphore::new(limits.max_sessions));
        let checks = Checks { device, vocab: engine.handshake().vocab_size, limits };
        Self { engine, checks, admission, drain: SessionDrain::default() }
    }

    /// The service's shutdown control (SIGTERM).
    pub fn drain(&self) -> SessionDrain {
        self.drain.clone()
    }
}

/// How a drafter shuts down: [`SessionDrain::begin`] refuses new sessions with UNAVAILABLE (the
/// verifier decodes that request greedily and its next session goes to another pod) while open
/// sessions go on; [`SessionDrain::expire`] (the drain timeout) ends those with UNAVAILABLE at
/// their next message.
#[derive(Clone)]
pub struct SessionDrain {
    draining: Arc<std::sync::atomic::AtomicBool>,
    expired: tokio::sync::watch::Sender<bool>,
}

impl Default for SessionDrain {
    fn default() -> Self {
        Self { draining: Arc::default(), expired: tokio::sync::watch::Sender::new(false) }
    }
}

impl SessionDrain {
    pub fn begin(&self) {
        self.draining.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn expire(&self) {
        self.expired.send_replace(true);
    }

    fn is_draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The gRPC status of a failed round.
fn status_of(e: DraftError) -> Status {
    match e {
        DraftError::ContextGap { .. }
        | DraftError::RootPosition { .. }
        | DraftError::States(_)
        | DraftError::Capacity(_) => Status::invalid_argument(e.to_string()),
        DraftError::Internal(_) => Status::internal(e.to_string()),
    }
}

#[tonic::async_trait]
impl pb::drafter_server::Drafter for DrafterService {
    async fn handshake(
        &self,
        request: Request<pb::HandshakeRequest>,
    ) -> Result<Response<pb::HandshakeResponse>, Status> {
        let theirs = request.into_inner().target_fingerprint;
        let ours = self.engine.handshake();
        if !ours.target_fingerprint.is_empty() && !theirs.is_empty() && theirs != ours.target_fingerprint {
            return Err(Status::failed_precondition(format!(
                "this drafter was built for target {}, the verifier serves {theirs}",
                ours.target_fingerprint
            )));
        }
        Ok(Response::new(codec::handshake_response(ours)))
    }

    type DraftStream = ReceiverStream<Result<pb::DraftResponse, Status>>;

    async fn draft(
        &self,
        request: Request<Streaming<pb::DraftRequest>>,
    ) -> Result<Response<Self::DraftStream>, Status> {
        // The session's spans join the verifier's trace (traceparent in the stream's metadata).
        let span = tracing::info_span!("draft_session");
        glance_telemetry::continue_trace(&span, request.metadata());
        if self.drain.is_draining() {
            return Err(Status::unavailable(
                "this drafter is shutting down; open the session on another pod",
            ));
        }
        let permit = Arc::clone(&self.admission).try_acquire_owned().map_err(|_| {
            metrics::counter!(names::SESSIONS_REFUSED).increment(1);
            Status::resource_exhausted(format!(
                "all {} draft sessions of this drafter are open (--max-sessions, GLANCE_DRAFTER_MAX_SESSIONS)",
                self.checks.limits.max_sessions
            ))
        })?;
        let inbound = request.into_inner();
        let (replies, stream) = mpsc::channel(4);
        let session = self.engine.new_session();
        // The session is a task of this runtime, not a thread of its own: a request wakes it on
        // the worker that read the request off the connection, it drafts right there, and its
        // reply leaves from that same thread. A session thread cost two thread hand-offs per round
        // trip (connection → session → connection), about half the loopback hop. Drafting blocks
        // the worker, so the runtime has a worker per admitted session and spares for I/O
        // (`worker_threads`).
        let expired = self.drain.expired.subscribe();
        tokio::spawn(run_session(session, inbound, replies, self.checks, expired, span, permit));
        Ok(Response::new(ReceiverStream::new(stream)))
    }
}

/// Worker threads a drafter runtime needs: one per session that may be drafting at once, and two
/// that never draft (the connections, health, handshakes, metrics).
pub fn worker_threads(max_sessions: usize) -> usize {
    max_sessions + 2
}

/// The next request; `None` once the verifier ends the stream. A message the transport refused
/// (too large, undecodable) is its status, and so is a session idle past the timeout.
async fn next_request(
    inbound: &mut Streaming<pb::DraftRequest>,
    idle_timeout: Duration,
) -> Option<Result<pb::DraftRequest, Status>> {
    match tokio::time::timeout(idle_timeout, inbound.message()).await {
        Ok(message) => message.transpose(),
        Err(_) => Some(Err(Status::deadline_exceeded(format!(
            "draft session idle for {idle_timeout:?}: closed (--session-idle-timeout-s)"
        )))),
    }
}

/// Resolves once the drain timeout has passed (never, if the sender is gone without it).
async fn drain_expired(expired: &mut tokio::sync::watch::Receiver<bool>) {
    if expired.wait_for(|expired| *expired).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// What a session checks each message against before the engine sees it.
#[derive(Clone, Copy)]
struct Checks {
    device: Device,
    /// Token ids must be below this (0: the engine has no vocabulary).
    vocab: usize,
    limits: SessionLimits,
}

/// A session: every message answered in order until the stream ends or fails, or the drain
/// timeout ends it. After an error the stream's state is unknown, so it is reported and the
/// session ends.
async fn run_session(
    mut session: Box<dyn Session>,
    mut inbound: Streaming<pb::DraftRequest>,
    replies: mpsc::Sender<Result<pb::DraftResponse, Status>>,
    checks: Checks,
    mut expired: tokio::sync::watch::Receiver<bool>,
    span: tracing::Span,
    _permit: OwnedSemaphorePermit,
) {
    metrics::gauge!(names::SESSIONS_OPEN).increment(1.0);
    let _closed = scopeguard(|| metrics::gauge!(names::SESSIONS_OPEN).decrement(1.0));
    // The verifier opens the session while its target prefills: time to warm the engine. A
    // failure here is the first round's to report.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let _no_grad = tch::no_grad_guard();
        session.warm();
    }));
    loop {
        let message = tokio::select! {
            message = next_request(&mut inbound, checks.limits.idle_timeout) => message,
            () = drain_expired(&mut expired) => {
                let reason = "this drafter is shutting down and its drain timeout passed; open a new session";
                let _ = replies.send(Err(Status::unavailable(reason))).await;
                return;
            }
        };
        let Some(message) = message else { return };
        match message.and_then(|message| answer(session.as_mut(), message, checks, &span)) {
            Ok(None) => {}
            Ok(Some(response)) => {
                metrics::counter!(names::ROUNDS).increment(1);
                metrics::histogram!(names::DRAFT_LATENCY).record(response.draft_ms / 1e3);
                if replies.send(Ok(response)).await.is_err() {
                    return;
                }
            }
            Err(status) => {
                metrics::counter!(names::FAILED_ROUNDS).increment(1);
                let _ = replies.send(Err(status)).await;
                return;
            }
        }
    }
}

/// One message, handled on this thread. A panic anywhere in it (the engine, the codec, libtorch)
/// is answered as INTERNAL: the stream never just ends as if the verifier had closed it.
fn answer(
    session: &mut dyn Session,
    message: pb::DraftRequest,
    checks: Checks,
    span: &tracing::Span,
) -> Result<Option<pb::DraftResponse>, Status> {
    let rows = message.context.as_ref().map_or(0, |c| c.tokens.len());
    let round_span = tracing::info_span!(target: ROUND_SPANS, parent: span, "draft_round", rows);
    let handled = catch_unwind(AssertUnwindSafe(|| {
        // Grad mode is per thread, and the task may run on another worker each round.
        let _no_grad = tch::no_grad_guard();
        round_span.in_scope(|| handle(session, message, checks))
    }));
    handled.unwrap_or_else(|panic| {
        let reason = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        tracing::error!(%reason, "draft session panicked");
        Err(Status::internal(format!("draft session failed: {reason}")))
    })
}

/// Runs `f` when dropped.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

/// The message's tokens and positions against the vocabulary and the context limit.
fn check_message(message: &pb::DraftRequest, checks: Checks) -> Result<(), Status> {
    let limit = checks.limits.max_context as u64;
    let vocab = checks.vocab as u64;
    let in_vocab = |field: &str, token: u32| {
        if vocab == 0 || u64::from(token) < vocab {
            Ok(())
        } else {
            Err(Status::invalid_argument(format!(
                "{field}: token {token} is outside the vocabulary of {vocab}"
            )))
        }
    };
    if let Some(context) = &message.context {
        let end = context.first_position.saturating_add(context.tokens.len() as u64);
        if end > limit {
            return Err(Status::invalid_argument(format!(
                "context rows reach position {end}, past the session's context limit of {limit} (--max-context)"
            )));
        }
        context.tokens.iter().try_for_each(|&t| in_vocab("context.tokens", t))?;
    }
    if let Some(round) = &message.round {
        if round.root_position >= limit {
            return Err(Status::invalid_argument(format!(
                "round.root_position {} is past the session's context limit of {limit} (--max-context)",
                round.root_position
            )));
        }
        in_vocab("round.root_token", round.root_token)?;
    }
    Ok(())
}

/// Appends the context rows and, on a round message, drafts a tree; context rows without a round
/// are the engine's to take in at once.
fn handle(
    session: &mut dyn Session,
    message: pb::DraftRequest,
    checks: Checks,
) -> Result<Option<pb::DraftResponse>, Status> {
    let started = Instant::now();
    check_message(&message, checks)?;
    if let Some(context) = message.context {
        let states = match &context.states {
            Some(data) => {
                let host = codec::decode(data).map_err(|e| Status::invalid_argument(e.to_string()))?;
                Some(glance_models::upload_tensor(&host, checks.device))
            }
            None => None,
        };
        if let Some(states) = &states {
            if states.size().first().copied() != Some(context.tokens.len() as i64) {
                return Err(Status::invalid_argument(format!(
                    "context has {} tokens but states of shape {:?}",
                    context.tokens.len(),
                    states.size()
                )));
            }
        }
        session
            .append_context(context.first_position as usize, &context.tokens, states)
            .map_err(status_of)?;
    }
    let Some(round) = message.round else {
        session.ingest().map_err(status_of)?;
        return Ok(None);
    };
    let input = RoundInput {
        root_token: round.root_token,
        root_position: round.root_position as usize,
        budget: round.tree_budget.max(1) as usize,
        branch_k: round.branch_k.max(1) as usize,
        spine: round.spine,
        reach: codec::round_reach(&round),
    };
    let tree = session.draft(&input).map_err(status_of)?;
    Ok(Some(codec::tree_response(tree, started.elapsed().as_secs_f64() * 1e3)))
}

#[cfg(test)]
mod fuzz {
    //! The request handler under arbitrary messages (property tests on stable Rust): every
    //! message sequence a peer can send is answered or refused, never a panic, with the committed
    //! toy head drafting. `GLANCE_FUZZ_CASES` sets the number of cases.

    use std::path::PathBuf;
    use std::sync::OnceLock;

    use proptest::prelude::*;

    use super::*;
    use crate::engines::BlockHeadEngine;

    fn cases(default: u32) -> u32 {
        std::env::var("GLANCE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
    }

    fn engine() -> &'static BlockHeadEngine {
        static ENGINE: OnceLock<BlockHeadEngine> = OnceLock::new();
        ENGINE.get_or_init(|| {
            let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
            BlockHeadEngine::load(
                &models.join("toy-head"),
                &models.join("toy-target"),
                tch::Kind::Float,
                Device::Cpu,
                512,
                crate::draft_vocab::DraftVocabChoice::All,
            )
            .expect("the committed toy head")
        })
    }

    /// One message, usually well formed for a session holding `len` positions, sometimes not.
    #[derive(Clone, Debug)]
    struct Plan {
        rows: usize,
        position_offset: Option<u64>,
        token_noise: Option<u32>,
        states: StatesPlan,
        round: Option<(u32, Option<u64>, u32, u32)>,
    }

    #[derive(Clone, Debug)]
    enum StatesPlan {
        Right,
        Missing,
        Raw(String, Vec<u64>, usize),
    }

    fn plan() -> impl Strategy<Value = Plan> {
        let states = prop_oneof![
            6 => Just(StatesPlan::Right),
            1 => Just(StatesPlan::Missing),
            1 => ("[a-z0-9]{0,4}", prop::collection::vec(prop_oneof![0u64..40, any::<u64>()], 0..4), 0usize..2000)
                .prop_map(|(d, s, n)| StatesPlan::Raw(d, s, n)),
        ];
        let round = (any::<u32>(), prop::option::weighted(0.1, any::<u64>()), 0u32..2000, 0u32..100);
        (
            0usize..24,
            prop::option::weighted(0.1, any::<u64>()),
            prop::option::weighted(0.1, any::<u32>()),
            states,
            prop::option::weighted(0.7, round),
        )
            .prop_map(|(rows, position_offset, token_noise, states, round)| Plan {
                rows,
                position_offset,
                token_noise,
                states,
                round,
            })
    }

    fn message(plan: &Plan, len: u64, width: u64, vocab: u32) -> pb::DraftRequest {
        let tokens: Vec<u32> = (0..plan.rows as u32).map(|i| plan.token_noise.unwrap_or(i % vocab)).collect();
        let states = match &plan.states {
            StatesPlan::Right => Some(codec::encode(
                &tch::Tensor::randn([plan.rows as i64, width as i64], (tch::Kind::Float, Device::Cpu)),
                tch::Kind::Float,
            )),
            StatesPlan::Missing => None,
            StatesPlan::Raw(dtype, shape, bytes) => Some(pb::TensorData {
                dtype: dtype.clone(),
                shape: shape.clone(),
                data: vec![1u8; *bytes].into(),
            }),
        };
        let first_position = plan.position_offset.unwrap_or(len);
        let end = len + plan.rows as u64;
        let round = plan.round.map(|(root, position, budget, k)| pb::RoundRequest {
            root_token: root % (vocab + 8),
            root_position: position.unwrap_or(end),
            tree_budget: budget,
            branch_k: k,
            spine: false,
            end_tokens: Vec::new(),
            max_depth: 0,
        });
        pb::DraftRequest { context: Some(pb::ContextRows { first_position, tokens, states }), round }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: cases(300), failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn any_message_sequence_is_answered_or_refused(plans in prop::collection::vec(plan(), 1..6)) {
            let engine = engine();
            let handshake = engine.handshake();
            let width = (handshake.tap_layers.len() * handshake.hidden_size) as u64;
            let vocab = handshake.vocab_size as u32;
            let limits = SessionLimits { max_sessions: 1, max_context: 512, idle_timeout: Duration::from_secs(1) };
            let checks = Checks { device: Device::Cpu, vocab: handshake.vocab_size, limits };
            let mut session = engine.new_session();
            let mut len = 0u64;
            let _no_grad = tch::no_grad_guard();
            for plan in &plans {
                let request = message(plan, len, width, vocab);
                let rows = request.context.as_ref().map_or(0, |c| c.tokens.len() as u64);
                match handle(session.as_mut(), request, checks) {
                    Ok(reply) => {
                        len += rows;
                        if let Some(reply) = reply {
                            let tree = codec::response_tree(reply);
                            let tree_limits = glance_spec::tree::TreeLimits {
                                vocab: handshake.vocab_size,
                                max_nodes: glance_spec::session::MAX_TREE_NODES,
                                max_depth: handshake.block_size - 1,
                            };
                            prop_assert!(tree.validate(tree_limits).is_ok(), "the drafter's own tree is valid");
                        }
                    }
                    // As the service does: an error ends the session.
                    Err(status) => {
                        prop_assert!(!status.message().is_empty());
                        break;
                    }
                }
            }
        }
    }
}
