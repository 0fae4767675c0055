//! The internal `glance.drafter.v1.Drafter` gRPC service: a handshake that states what this drafter is
//! (and refuses a verifier whose target it was not built for), and one bidirectional stream per
//! generation whose session runs on its own thread.

use std::sync::Arc;
use std::time::Instant;

use glance_codec as codec;
use glance_proto::drafter::v1 as pb;
use glance_spec::session::{DraftEngine, DraftError, RoundInput, Session};
use tch::Device;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::metrics as names;

pub struct DrafterService {
    engine: Arc<dyn DraftEngine>,
    /// Device the tap states are moved to before drafting.
    device: Device,
}

impl DrafterService {
    pub fn new(engine: Arc<dyn DraftEngine>, device: Device) -> Self {
        Self { engine, device }
    }
}

/// The gRPC status of a failed round.
fn status_of(e: DraftError) -> Status {
    match e {
        DraftError::ContextGap { .. } | DraftError::RootPosition { .. } | DraftError::States(_) => {
            Status::invalid_argument(e.to_string())
        }
        DraftError::Capacity(_) => Status::resource_exhausted(e.to_string()),
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
        let inbound = request.into_inner();
        let (replies, stream) = mpsc::channel(4);
        let session = self.engine.new_session();
        let device = self.device;
        let runtime = tokio::runtime::Handle::current();
        // The session (and its draft KV cache) lives on this thread until the stream ends. The
        // thread reads the stream itself: a request wakes it straight from the connection's task,
        // with no forwarding task and queue in between (one thread hand-off less per round).
        std::thread::Builder::new()
            .name("draft-session".into())
            .spawn(move || run_session(session, Requests { inbound, runtime }, replies, device, span))
            .map_err(|e| Status::resource_exhausted(format!("cannot start a draft session: {e}")))?;
        Ok(Response::new(ReceiverStream::new(stream)))
    }
}

/// The draft stream's requests, read on the session thread.
struct Requests {
    inbound: Streaming<pb::DraftRequest>,
    runtime: tokio::runtime::Handle,
}

impl Iterator for Requests {
    type Item = pb::DraftRequest;

    /// The next request; `None` once the verifier ends the stream (or it breaks).
    fn next(&mut self) -> Option<pb::DraftRequest> {
        match self.runtime.block_on(self.inbound.message()) {
            Ok(message) => message,
            Err(status) => {
                tracing::debug!(%status, "draft stream ended by the verifier");
                None
            }
        }
    }
}

fn run_session(
    mut session: Box<dyn Session>,
    queue: Requests,
    replies: mpsc::Sender<Result<pb::DraftResponse, Status>>,
    device: Device,
    span: tracing::Span,
) {
    let _no_grad = tch::no_grad_guard();
    metrics::gauge!(names::SESSIONS_OPEN).increment(1.0);
    let _closed = scopeguard(|| metrics::gauge!(names::SESSIONS_OPEN).decrement(1.0));
    for message in queue {
        let round_span = tracing::info_span!(parent: &span, "draft_round", rows = message.context.as_ref().map_or(0, |c| c.tokens.len()));
        let answer = round_span.in_scope(|| handle(session.as_mut(), message, device));
        match answer {
            Ok(None) => {}
            Ok(Some(response)) => {
                metrics::counter!(names::ROUNDS).increment(1);
                metrics::histogram!(names::DRAFT_LATENCY).record(response.draft_ms / 1e3);
                if replies.blocking_send(Ok(response)).is_err() {
                    return;
                }
            }
            Err(status) => {
                // The stream's state is unknown after an error: report it and end the session.
                metrics::counter!(names::FAILED_ROUNDS).increment(1);
                let _ = replies.blocking_send(Err(status));
                return;
            }
        }
    }
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

/// Appends the context rows and, on a round message, drafts a tree.
fn handle(
    session: &mut dyn Session,
    message: pb::DraftRequest,
    device: Device,
) -> Result<Option<pb::DraftResponse>, Status> {
    let started = Instant::now();
    if let Some(context) = message.context {
        let states = match &context.states {
            Some(data) => {
                let host = codec::decode(data).map_err(|e| Status::invalid_argument(e.to_string()))?;
                Some(glance_models::upload_tensor(&host, device))
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
        return Ok(None);
    };
    let input = RoundInput {
        root_token: round.root_token,
        root_position: round.root_position as usize,
        budget: round.tree_budget.max(1) as usize,
        branch_k: round.branch_k.max(1) as usize,
    };
    let tree = session.draft(&input).map_err(status_of)?;
    Ok(Some(codec::tree_response(tree, started.elapsed().as_secs_f64() * 1e3)))
}
