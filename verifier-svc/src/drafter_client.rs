//! The verifier's side of the internal Drafter protocol: a handshake that refuses a drafter built
//! for another target, one bidirectional stream per generation, a deadline on every round, and
//! reconnection with backoff. Every failure turns into "no tree this round", never a lost request.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use glance_proto::v1 as pb;
use glance_proto::v1::drafter_client::DrafterClient;
use tch::Kind;
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

use crate::speculative::{DraftFailure, DraftProvider, DraftRound, DraftSession, DraftTree};

/// Largest tap-state payload in one message; a larger prefill context goes as several chunks.
const MAX_CHUNK_BYTES: usize = 4 << 20;
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Why a drafter cannot serve this verifier.
#[derive(Debug, thiserror::Error)]
pub enum DrafterError {
    #[error("drafter at {url} is unreachable: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("drafter at {url} does not fit this target: {reason}")]
    Mismatch { url: String, reason: String },
}

/// What the verifier knows about its target, to check a drafter against.
#[derive(Clone, Debug)]
pub struct TargetDescription {
    pub fingerprint: String,
    pub hidden_size: u32,
    pub vocab_size: u32,
    pub num_layers: u32,
    pub kind: Kind,
}

/// A checked drafter endpoint and what its handshake said.
#[derive(Clone, Debug)]
pub struct DrafterInfo {
    pub handshake: pb::HandshakeResponse,
    pub tap_layers: Vec<usize>,
    pub wire_kind: Kind,
}

/// Shared by all generations: the endpoint, the last good handshake, and the reconnect backoff.
pub struct RemoteDrafter {
    url: String,
    runtime: Handle,
    target: TargetDescription,
    state: Mutex<ConnectionState>,
    /// Per-round deadline: a tree later than this is not waited for.
    pub round_deadline: Duration,
}

struct ConnectionState {
    client: Option<(DrafterClient<Channel>, DrafterInfo)>,
    /// The last handshake seen, kept across disconnects: a request that starts while the drafter
    /// is away still computes the tap states it will need once the drafter is back.
    known: Option<DrafterInfo>,
    next_attempt: Instant,
    backoff: Duration,
}

const MIN_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

impl RemoteDrafter {
    pub fn new(
        url: String,
        runtime: Handle,
        target: TargetDescription,
        round_deadline: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            url,
            runtime,
            target,
            state: Mutex::new(ConnectionState {
                client: None,
                known: None,
                next_attempt: Instant::now(),
                backoff: MIN_BACKOFF,
            }),
            round_deadline,
        })
    }

    /// Connects and checks the handshake now (start-up): a mismatch is an error the caller
    /// reports before serving.
    pub async fn connect_now(&self) -> Result<DrafterInfo, DrafterError> {
        let (client, info) = connect(&self.url, &self.target).await?;
        let mut state = self.state.lock().expect("drafter state lock");
        state.client = Some((client, info.clone()));
        state.known = Some(info.clone());
        state.backoff = MIN_BACKOFF;
        Ok(info)
    }

    /// The current client, reconnecting when the backoff allows. Never blocks long: a failed
    /// attempt pushes the next one further out.
    fn client(&self) -> Option<(DrafterClient<Channel>, DrafterInfo)> {
        let mut state = self.state.lock().expect("drafter state lock");
        if let Some(client) = &state.client {
            return Some(client.clone());
        }
        if Instant::now() < state.next_attempt {
            return None;
        }
        let attempt = self.runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(2), connect(&self.url, &self.target)).await
        });
        match attempt {
            Ok(Ok(connected)) => {
                tracing::info!(url = %self.url, "drafter connected");
                state.backoff = MIN_BACKOFF;
                state.client = Some(connected.clone());
                state.known = Some(connected.1.clone());
                Some(connected)
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "drafter not available");
                state.next_attempt = Instant::now() + state.backoff;
                state.backoff = (state.backoff * 2).min(MAX_BACKOFF);
                None
            }
            Err(_) => {
                state.next_attempt = Instant::now() + state.backoff;
                state.backoff = (state.backoff * 2).min(MAX_BACKOFF);
                None
            }
        }
    }

    /// Forgets the connection after a failure, so the next session reconnects.
    fn mark_failed(&self) {
        let mut state = self.state.lock().expect("drafter state lock");
        state.client = None;
        state.next_attempt = Instant::now() + state.backoff;
    }

    /// The drafter's handshake: the live one, else the last one seen, else a fresh attempt.
    pub fn info(&self) -> Option<DrafterInfo> {
        if let Some(known) = self.state.lock().ok().and_then(|s| s.known.clone()) {
            return Some(known);
        }
        self.client().map(|(_, info)| info)
    }

    /// Reconnects when the backoff allows (the health poller calls this, so readiness recovers
    /// without traffic); returns whether a drafter is connected.
    pub fn ensure_connected(&self) -> bool {
        let Some((mut client, _)) = self.client() else { return false };
        let request = pb::HandshakeRequest { target_fingerprint: self.target.fingerprint.clone() };
        let answered = self.runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(1), client.handshake(request)).await
        });
        let alive = matches!(answered, Ok(Ok(_)));
        if !alive {
            self.mark_failed();
        }
        alive
    }

    /// Whether a compatible drafter is connected right now.
    pub fn is_connected(&self) -> bool {
        self.state.lock().map(|s| s.client.is_some()).unwrap_or(false)
    }
}

async fn connect(
    url: &str,
    target: &TargetDescription,
) -> Result<(DrafterClient<Channel>, DrafterInfo), DrafterError> {
    let unreachable = |reason: String| DrafterError::Unreachable { url: url.to_string(), reason };
    let endpoint = Endpoint::from_shared(url.to_string())
        .map_err(|e| unreachable(e.to_string()))?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true);
    let channel = endpoint.connect().await.map_err(|e| unreachable(e.to_string()))?;
    let mut client = DrafterClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let request = pb::HandshakeRequest { target_fingerprint: target.fingerprint.clone() };
    let handshake = match client.handshake(request).await {
        Ok(r) => r.into_inner(),
        Err(status) if status.code() == tonic::Code::FailedPrecondition => {
            return Err(DrafterError::Mismatch { url: url.to_string(), reason: status.message().to_string() })
        }
        Err(status) => return Err(unreachable(status.to_string())),
    };
    let info = check_handshake(url, handshake, target)?;
    Ok((client, info))
}

/// Refuses a drafter whose vocabulary, width, taps or target fingerprint don't fit.
pub fn check_handshake(
    url: &str,
    handshake: pb::HandshakeResponse,
    target: &TargetDescription,
) -> Result<DrafterInfo, DrafterError> {
    let mismatch = |reason: String| Err(DrafterError::Mismatch { url: url.to_string(), reason });
    if handshake.vocab_size != target.vocab_size {
        return mismatch(format!(
            "vocabulary {} vs the target's {}",
            handshake.vocab_size, target.vocab_size
        ));
    }
    let reads_states = !handshake.tap_layers.is_empty();
    if reads_states && handshake.hidden_size != target.hidden_size {
        return mismatch(format!(
            "hidden size {} vs the target's {}",
            handshake.hidden_size, target.hidden_size
        ));
    }
    if let Some(&bad) = handshake.tap_layers.iter().find(|&&l| l >= target.num_layers) {
        return mismatch(format!("tap layer {bad} but the target has {} layers", target.num_layers));
    }
    if !handshake.target_fingerprint.is_empty() && handshake.target_fingerprint != target.fingerprint {
        return mismatch(format!(
            "built for target {} but this target is {}",
            handshake.target_fingerprint, target.fingerprint
        ));
    }
    if handshake.block_size < 2 {
        return mismatch(format!("block size {}", handshake.block_size));
    }
    // The states are computed in the target's dtype: bf16/f16 targets send half the bytes, and
    // sending wider than computed would add nothing. The drafter converts to its own dtype.
    let wire_kind = target.kind;
    let tap_layers = handshake.tap_layers.iter().map(|&l| l as usize).collect();
    Ok(DrafterInfo { handshake, tap_layers, wire_kind })
}

/// Provider for one generation: sessions over the shared connection.
pub struct RemoteProvider {
    drafter: Arc<RemoteDrafter>,
    info: DrafterInfo,
}

impl RemoteProvider {
    /// The taps are fixed for the whole generation from the drafter's handshake; `None` when no
    /// drafter has ever answered one.
    pub fn new(drafter: Arc<RemoteDrafter>) -> Option<Self> {
        let info = drafter.info()?;
        Some(Self { drafter, info })
    }
}

impl DraftProvider for RemoteProvider {
    fn open(&mut self) -> Option<Box<dyn DraftSession>> {
        let (mut client, info) = self.drafter.client()?;
        if info.tap_layers != self.info.tap_layers
            || info.handshake.block_size != self.info.handshake.block_size
        {
            tracing::warn!(
                "drafter changed its taps or block size mid-generation; not using it for this request"
            );
            return None;
        }
        let (outbound, receiver) = mpsc::channel::<pb::DraftRequest>(16);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(receiver));
        // The drafter's spans join this request's trace.
        glance_common::telemetry::inject_trace_context(&tracing::Span::current(), request.metadata_mut());
        let opened = self.drafter.runtime.block_on(async {
            tokio::time::timeout(
                self.drafter.round_deadline.max(Duration::from_secs(1)),
                client.draft(request),
            )
            .await
        });
        match opened {
            Ok(Ok(response)) => Some(Box::new(RemoteSession {
                drafter: Arc::clone(&self.drafter),
                outbound,
                inbound: response.into_inner(),
                context_len: 0,
                bytes_sent: 0,
                wire_kind: info.wire_kind,
            })),
            _ => {
                self.drafter.mark_failed();
                None
            }
        }
    }

    fn tap_layers(&self) -> &[usize] {
        &self.info.tap_layers
    }

    fn max_depth(&self) -> usize {
        self.info.handshake.block_size as usize - 1
    }
}

struct RemoteSession {
    drafter: Arc<RemoteDrafter>,
    outbound: mpsc::Sender<pb::DraftRequest>,
    inbound: tonic::Streaming<pb::DraftResponse>,
    context_len: usize,
    bytes_sent: u64,
    wire_kind: Kind,
}

impl RemoteSession {
    /// The context rows as messages: all but the last are context-only chunks.
    fn context_messages(&self, round: &DraftRound) -> Vec<pb::ContextRows> {
        let rows = round.tokens.len();
        if rows == 0 {
            return vec![pb::ContextRows {
                first_position: round.first_position as u64,
                ..Default::default()
            }];
        }
        let row_bytes = round.states.map(|s| s.size()[1] as usize * 4).unwrap_or(4).max(1);
        let per_chunk = (MAX_CHUNK_BYTES / row_bytes).max(1);
        (0..rows)
            .step_by(per_chunk)
            .map(|from| {
                let count = per_chunk.min(rows - from);
                pb::ContextRows {
                    first_position: (round.first_position + from) as u64,
                    tokens: round.tokens[from..from + count].iter().map(|&t| t as u32).collect(),
                    states: round.states.map(|s| {
                        glance_common::wire::encode(&s.narrow(0, from as i64, count as i64), self.wire_kind)
                    }),
                }
            })
            .collect()
    }
}

impl DraftSession for RemoteSession {
    fn context_len(&self) -> usize {
        self.context_len
    }

    fn draft(&mut self, round: DraftRound) -> Result<DraftTree, DraftFailure> {
        let mut messages: Vec<pb::DraftRequest> = self
            .context_messages(&round)
            .into_iter()
            .map(|c| pb::DraftRequest { context: Some(c), round: None })
            .collect();
        if let Some(last) = messages.last_mut() {
            last.round = Some(pb::RoundRequest {
                root_token: round.root_token as u32,
                root_position: round.root_position as u64,
                tree_budget: round.budget as u32,
                branch_k: round.branch_k as u32,
            });
        }
        let sent: u64 = messages.iter().map(|m| prost::Message::encoded_len(m) as u64).sum();
        let deadline = self.drafter.round_deadline;
        let outbound = self.outbound.clone();
        let inbound = &mut self.inbound;
        let reply = self.drafter.runtime.block_on(async move {
            tokio::time::timeout(deadline, async move {
                for message in messages {
                    outbound.send(message).await.map_err(|_| "stream closed".to_string())?;
                }
                inbound.message().await.map_err(|s| s.to_string())?.ok_or_else(|| "stream ended".to_string())
            })
            .await
        });
        self.bytes_sent += sent;
        let response = match reply {
            Ok(Ok(response)) => response,
            Ok(Err(reason)) => {
                self.drafter.mark_failed();
                return Err(DraftFailure::Unavailable(reason));
            }
            // A late answer would desynchronize the stream: this session is over.
            Err(_) => return Err(DraftFailure::Timeout),
        };
        self.context_len = round.root_position;
        Ok(DraftTree {
            tokens: response.tokens.iter().map(|&t| t as i64).collect(),
            parents: response.parents,
            depths: response.depths,
            draft_time: Duration::from_secs_f64(response.draft_ms.max(0.0) / 1e3),
        })
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }
}
