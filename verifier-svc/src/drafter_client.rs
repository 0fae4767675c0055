//! The verifier's side of the internal Drafter protocol: a handshake that refuses a drafter built
//! for another target, one bidirectional stream per generation, a deadline on every round, and
//! reconnection with backoff. Every failure turns into "no tree this round", never a lost request.
//!
//! The drafter URL may name a pool: a Kubernetes headless Service is one DNS name resolving to
//! every ready drafter pod. The host is resolved to all its addresses, each pod's handshake is
//! checked on its own, and the pods that pass are balanced by one `Channel` (tonic's
//! power-of-two-choices balancer; tonic reports every connection's load as 0, so in effect a pod
//! is drawn at random for each new stream). A Draft stream is one HTTP/2 stream on one
//! connection, so a session stays on its pod for the whole generation (the pod holds its context
//! and draft cache); only new sessions go elsewhere. The name is resolved again every
//! [`RE_RESOLVE_INTERVAL`]: new pods join once their handshake passes, vanished ones leave (their
//! open streams finish on their own connections). A pod that dies while still resolving fails the
//! streams pinned to it; the drafter is then marked failed and reconnected, which re-checks every
//! pod and leaves the dead one out until it answers again.
//!
//! Tests on one host, where no name resolves to several loopback addresses, set
//! `GLANCE_DRAFTER_RESOLVE=NAME=IP[,IP...]` (like curl's `--resolve`): NAME then resolves to those
//! addresses, with the URL's port, instead of asking the system resolver.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use glance_codec as codec;
use glance_proto::drafter::v1 as pb;
use glance_proto::drafter::v1::drafter_client::DrafterClient;
use glance_proto::drafter::HOP_WINDOW;
use tch::Kind;
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tonic::transport::channel::Change;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint, Uri};

use crate::speculative::{DraftFailure, DraftProvider, DraftRound, DraftSession, Drafted};

/// Largest tap-state payload in one message; a larger prefill context goes as several chunks.
const MAX_CHUNK_BYTES: usize = 4 << 20;
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// How often the drafter's host name is resolved again to follow the pool's pods.
pub const RE_RESOLVE_INTERVAL: Duration = Duration::from_secs(5);
/// A pod whose handshake takes longer is left out of the pool: it would not meet round deadlines,
/// and a reconnect (bounded at 2 s) must not wait on it.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Test-only resolver override, `NAME=IP[,IP...]`.
pub const RESOLVE_OVERRIDE_ENV: &str = "GLANCE_DRAFTER_RESOLVE";
/// Pool changes queued for the balancer.
const CHANGES_CAPACITY: usize = 64;

/// Why a drafter cannot serve this verifier.
#[derive(Clone, Debug, thiserror::Error)]
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
    /// For an `https` URL: the CA the drafters' certificates chain to, the name they carry, and
    /// this verifier's client certificate (mTLS).
    tls: Option<ClientTlsConfig>,
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
/// How long one reconnection attempt (resolve, handshake every pod) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

impl ConnectionState {
    /// After a failed attempt: the next one waits, twice as long each time up to the maximum.
    fn back_off(&mut self) {
        self.next_attempt = Instant::now() + self.backoff;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }
}

impl RemoteDrafter {
    pub fn new(
        url: String,
        tls: Option<ClientTlsConfig>,
        runtime: Handle,
        target: TargetDescription,
        round_deadline: Duration,
    ) -> Arc<Self> {
        Arc::new(Self {
            url,
            tls,
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

    /// Connects and checks the handshake now (start-up), reporting a mismatch also when only one
    /// pod of the pool is mismatched (the caller logs it loudly; the pods that fit are used).
    pub async fn connect_now(&self) -> Result<DrafterInfo, DrafterError> {
        let pool = connect(&self.url, self.tls.as_ref(), &self.target).await?;
        if let Some(refused) = pool.refused.into_iter().next() {
            return Err(refused);
        }
        let info = pool.info;
        let mut state = self.state.lock().expect("drafter state lock");
        state.client = Some((pool.client, info.clone()));
        state.known = Some(info.clone());
        state.backoff = MIN_BACKOFF;
        Ok(info)
    }

    /// The current client, reconnecting when the backoff allows. Never blocks long: a failed
    /// attempt pushes the next one further out.
    ///
    /// The state lock is not held across the attempt: the attempt's I/O and timers run on the
    /// runtime's workers, and a worker that locks the state (`model_info` asks `is_connected`)
    /// would wait for an attempt that waits for it, with a single worker for ever.
    fn client(&self) -> Option<(DrafterClient<Channel>, DrafterInfo)> {
        {
            let mut state = self.state.lock().expect("drafter state lock");
            if let Some(client) = &state.client {
                return Some(client.clone());
            }
            if Instant::now() < state.next_attempt {
                return None;
            }
            // One attempt at a time: meanwhile the other callers see a backoff.
            state.next_attempt = Instant::now() + CONNECT_TIMEOUT + state.backoff;
        }
        let attempt = self.runtime.block_on(async {
            tokio::time::timeout(CONNECT_TIMEOUT, connect(&self.url, self.tls.as_ref(), &self.target)).await
        });
        let mut state = self.state.lock().expect("drafter state lock");
        match attempt {
            Ok(Ok(pool)) => {
                tracing::info!(url = %self.url, "drafter connected");
                for refused in &pool.refused {
                    tracing::warn!(error = %refused, "drafter pod left out of the pool");
                }
                let connected = (pool.client, pool.info);
                state.backoff = MIN_BACKOFF;
                state.next_attempt = Instant::now();
                state.client = Some(connected.clone());
                state.known = Some(connected.1.clone());
                Some(connected)
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "drafter not available");
                state.back_off();
                None
            }
            Err(_) => {
                state.back_off();
                None
            }
        }
    }

    /// A stream's error: FAILED_PRECONDITION means a pod refused this target (a mismatch the
    /// pool's handshakes did not catch); either way the pool is rebuilt, re-checking every pod.
    fn stream_failed(&self, status: &tonic::Status) {
        if status.code() == tonic::Code::FailedPrecondition {
            count_mismatch();
            tracing::warn!(url = %self.url, reason = status.message(), "drafter pod does not fit this target");
        }
        self.mark_failed();
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

/// A freshly connected pool: the balanced client, the handshake its pods share, and the pods
/// refused for not fitting (reported, not fatal, except at start-up).
struct Pool {
    client: DrafterClient<Channel>,
    info: DrafterInfo,
    refused: Vec<DrafterError>,
}

/// Resolves the URL's host, checks every pod's handshake, and balances over the pods that pass;
/// a background task follows the name from then on.
async fn connect(
    url: &str,
    tls: Option<&ClientTlsConfig>,
    target: &TargetDescription,
) -> Result<Pool, DrafterError> {
    let unreachable = |reason: String| DrafterError::Unreachable { url: url.to_string(), reason };
    let address = PoolAddress::parse(url, tls.cloned()).map_err(unreachable)?;
    let resolved = address.resolve().await.map_err(unreachable)?;
    let probes = probe_all(&address, &resolved, target).await;
    let info = reference_handshake(url, &probes)?;
    let (members, refused) = admit(&info, probes);
    let (channel, changes) = Channel::balance_channel(CHANGES_CAPACITY);
    for &addr in &members {
        let endpoint = address.endpoint(addr).map_err(unreachable)?;
        changes.send(Change::Insert(addr, endpoint)).await.map_err(|e| unreachable(e.to_string()))?;
    }
    tokio::spawn(keep_resolving(
        address,
        target.clone(),
        info.clone(),
        members.into_iter().collect(),
        changes,
    ));
    Ok(Pool { client: drafter_client(channel), info, refused })
}

fn drafter_client(channel: Channel) -> DrafterClient<Channel> {
    DrafterClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// The drafter URL, split into what resolving and dialing each pod needs.
struct PoolAddress {
    url: String,
    scheme: String,
    /// Requests carry the URL's authority (the service name), not a pod's address.
    origin: Uri,
    /// As written in the URL (`[::1]` for an IPv6 literal).
    host: String,
    port: u16,
    /// Addresses from [`RESOLVE_OVERRIDE_ENV`] when it names this host.
    pinned: Option<Vec<IpAddr>>,
    /// Every pod's connection is TLS with this configuration (its server name is the URL's
    /// host, not the pod's address).
    tls: Option<ClientTlsConfig>,
}

impl PoolAddress {
    fn parse(url: &str, tls: Option<ClientTlsConfig>) -> Result<Self, String> {
        let origin: Uri = url.parse().map_err(|e| format!("invalid URL: {e}"))?;
        let host = origin.host().ok_or("the URL names no host")?.to_string();
        let scheme = origin.scheme_str().unwrap_or("http").to_string();
        let port = origin.port_u16().unwrap_or(if scheme == "https" { 443 } else { 80 });
        let pinned = match std::env::var(RESOLVE_OVERRIDE_ENV) {
            Ok(spec) => parse_resolve_override(&spec, &host)?,
            Err(_) => None,
        };
        if (scheme == "https") != tls.is_some() {
            return Err(format!(
                "an {scheme} URL {} TLS settings",
                if tls.is_some() { "takes no" } else { "needs" }
            ));
        }
        Ok(Self { url: url.to_string(), scheme, origin, host, port, pinned, tls })
    }

    /// Every address of the host; an IP literal is its own single address.
    async fn resolve(&self) -> Result<BTreeSet<SocketAddr>, String> {
        if let Some(ips) = &self.pinned {
            return Ok(ips.iter().map(|&ip| SocketAddr::new(ip, self.port)).collect());
        }
        let found = tokio::net::lookup_host(format!("{}:{}", self.host, self.port))
            .await
            .map_err(|e| format!("cannot resolve {}: {e}", self.host))?;
        Ok(found.collect())
    }

    /// One pod's endpoint, with the timeouts every drafter connection has.
    fn endpoint(&self, addr: SocketAddr) -> Result<Endpoint, String> {
        let endpoint =
            Endpoint::from_shared(format!("{}://{addr}", self.scheme)).map_err(|e| e.to_string())?;
        // Every round sends tap states (the prompt's all at once); HTTP/2's default 64 KiB windows
        // would stall those sends on window updates.
        let endpoint = endpoint
            .origin(self.origin.clone())
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(HOP_WINDOW))
            .initial_connection_window_size(Some(HOP_WINDOW));
        match &self.tls {
            Some(tls) => endpoint.tls_config(tls.clone()).map_err(|e| format!("TLS: {e}")),
            None => Ok(endpoint),
        }
    }

    /// How errors name one pod.
    fn pod_name(&self, addr: SocketAddr) -> String {
        format!("{} ({addr})", self.url)
    }
}

/// `NAME=IP[,IP...]`: the addresses when NAME is `host`, None for another host.
fn parse_resolve_override(spec: &str, host: &str) -> Result<Option<Vec<IpAddr>>, String> {
    let bad = |why: &str| format!("{RESOLVE_OVERRIDE_ENV}={spec:?}: {why}; expected NAME=IP[,IP...]");
    let (name, ips) = spec.split_once('=').ok_or_else(|| bad("no '='"))?;
    if !name.trim().eq_ignore_ascii_case(host) {
        return Ok(None);
    }
    let ips: Vec<IpAddr> = ips
        .split(',')
        .map(|ip| ip.trim().parse().map_err(|_| bad(&format!("{ip:?} is not an IP address"))))
        .collect::<Result<_, _>>()?;
    Ok(Some(ips))
}

type Probe = (SocketAddr, Result<DrafterInfo, DrafterError>);

/// Every pod's own handshake, all at once.
async fn probe_all<'a>(
    address: &PoolAddress,
    addrs: impl IntoIterator<Item = &'a SocketAddr>,
    target: &TargetDescription,
) -> Vec<Probe> {
    let probes = addrs.into_iter().map(|&addr| async move { (addr, probe(address, addr, target).await) });
    futures::future::join_all(probes).await
}

/// Connects to one pod directly (not through the balancer) and checks its handshake.
async fn probe(
    address: &PoolAddress,
    addr: SocketAddr,
    target: &TargetDescription,
) -> Result<DrafterInfo, DrafterError> {
    let name = address.pod_name(addr);
    let unreachable = |reason: String| DrafterError::Unreachable { url: name.clone(), reason };
    let endpoint = address.endpoint(addr).map_err(unreachable)?;
    let answered = tokio::time::timeout(PROBE_TIMEOUT, async {
        let channel = endpoint.connect().await.map_err(|e| unreachable(e.to_string()))?;
        handshake(&mut drafter_client(channel), &name, target).await
    })
    .await;
    let probed =
        answered.unwrap_or_else(|_| Err(unreachable(format!("no handshake within {PROBE_TIMEOUT:?}"))));
    if matches!(probed, Err(DrafterError::Mismatch { .. })) {
        count_mismatch();
    }
    probed
}

/// A drafter pod that does not fit this target (or the pool) was seen: left out, and counted.
fn count_mismatch() {
    metrics::counter!(crate::metrics::DRAFTER_MISMATCHES).increment(1);
}

async fn handshake(
    client: &mut DrafterClient<Channel>,
    url: &str,
    target: &TargetDescription,
) -> Result<DrafterInfo, DrafterError> {
    let request = pb::HandshakeRequest { target_fingerprint: target.fingerprint.clone() };
    let handshake = match client.handshake(request).await {
        Ok(r) => r.into_inner(),
        Err(status) if status.code() == tonic::Code::FailedPrecondition => {
            return Err(DrafterError::Mismatch { url: url.to_string(), reason: status.message().to_string() })
        }
        Err(status) => {
            return Err(DrafterError::Unreachable { url: url.to_string(), reason: status.to_string() })
        }
    };
    check_handshake(url, handshake, target)
}

/// The handshake the pool is built around: the first pod (in address order) that fits the
/// target. With none, the pool's error: a mismatch if any pod answered one, else unreachable.
fn reference_handshake(url: &str, probes: &[Probe]) -> Result<DrafterInfo, DrafterError> {
    let mut mismatch = None;
    let mut reasons = Vec::new();
    for (_, probe) in probes {
        match probe {
            Ok(info) => return Ok(info.clone()),
            Err(e @ DrafterError::Mismatch { .. }) => mismatch = mismatch.or(Some(e.clone())),
            Err(e) => reasons.push(e.to_string()),
        }
    }
    if let Some(mismatch) = mismatch {
        return Err(mismatch);
    }
    let reason =
        if reasons.is_empty() { "the name resolved to no address".to_string() } else { reasons.join("; ") };
    Err(DrafterError::Unreachable { url: url.to_string(), reason })
}

/// Splits probed pods into members (they fit `reference`: a generation's taps and block size
/// must not depend on which pod its stream lands on) and refused ones. Unreachable pods are
/// neither: they are probed again at the next resolution.
fn admit(reference: &DrafterInfo, probes: Vec<Probe>) -> (Vec<SocketAddr>, Vec<DrafterError>) {
    let mut members = Vec::new();
    let mut refused = Vec::new();
    for (addr, probe) in probes {
        match probe {
            Ok(info) => match differs_from(reference, &info) {
                None => members.push(addr),
                Some(reason) => {
                    count_mismatch();
                    refused.push(DrafterError::Mismatch { url: addr.to_string(), reason })
                }
            },
            Err(e @ DrafterError::Mismatch { .. }) => refused.push(e),
            Err(e) => tracing::debug!(error = %e, "drafter pod not reachable; not in the pool for now"),
        }
    }
    (members, refused)
}

/// Why a pod's handshake does not fit the pool's, if it does not.
fn differs_from(reference: &DrafterInfo, info: &DrafterInfo) -> Option<String> {
    if info.tap_layers != reference.tap_layers {
        return Some(format!("tap layers {:?} vs the pool's {:?}", info.tap_layers, reference.tap_layers));
    }
    let (ours, theirs) = (reference.handshake.block_size, info.handshake.block_size);
    (ours != theirs).then(|| format!("block size {theirs} vs the pool's {ours}"))
}

/// Follows the pool's name until the balanced channel is dropped: vanished pods leave, new ones
/// join once their handshake fits. A failed resolution keeps the pool as it is.
async fn keep_resolving(
    address: PoolAddress,
    target: TargetDescription,
    reference: DrafterInfo,
    mut members: BTreeSet<SocketAddr>,
    changes: mpsc::Sender<Change<SocketAddr, Endpoint>>,
) {
    loop {
        tokio::select! {
            _ = changes.closed() => return,
            _ = tokio::time::sleep(RE_RESOLVE_INTERVAL) => {}
        }
        let resolved = match address.resolve().await {
            Ok(resolved) => resolved,
            Err(reason) => {
                tracing::warn!(%reason, "drafter pool not re-resolved; keeping its pods");
                continue;
            }
        };
        let updated = update_members(&address, &target, &reference, &mut members, &resolved, &changes).await;
        if updated.is_err() {
            return;
        }
    }
}

/// The balancer is gone: the channel was dropped.
struct PoolClosed;

async fn update_members(
    address: &PoolAddress,
    target: &TargetDescription,
    reference: &DrafterInfo,
    members: &mut BTreeSet<SocketAddr>,
    resolved: &BTreeSet<SocketAddr>,
    changes: &mpsc::Sender<Change<SocketAddr, Endpoint>>,
) -> Result<(), PoolClosed> {
    let vanished: Vec<SocketAddr> = members.difference(resolved).copied().collect();
    for addr in vanished {
        changes.send(Change::Remove(addr)).await.map_err(|_| PoolClosed)?;
        members.remove(&addr);
        tracing::info!(%addr, "drafter pod left the pool");
    }
    let newcomers: Vec<SocketAddr> = resolved.difference(members).copied().collect();
    let (joining, refused) = admit(reference, probe_all(address, &newcomers, target).await);
    for e in refused {
        tracing::warn!(error = %e, "drafter pod left out of the pool");
    }
    for addr in joining {
        let Ok(endpoint) = address.endpoint(addr) else { continue };
        changes.send(Change::Insert(addr, endpoint)).await.map_err(|_| PoolClosed)?;
        members.insert(addr);
        tracing::info!(%addr, "drafter pod joined the pool");
    }
    Ok(())
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
        let (client, info) = self.drafter.client()?;
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
        glance_telemetry::inject_trace_context(&tracing::Span::current(), request.metadata_mut());
        // The stream opens in the background (overlapping the target's prefill) and a task
        // collects its replies, stamped with their arrival: the verifier looks for a tree when it
        // suits it (between greedy steps), and the round trip is still measured to the arrival.
        // The inbox is a std channel: the engine thread waits on it with a plain timed futex wait,
        // where a tokio timer would wake the runtime's driver thread to register it. It needs no
        // bound: the drafter answers each round once.
        let (replies, inbox) = std::sync::mpsc::channel();
        let reader = self.drafter.runtime.spawn(read_replies(client, request, replies));
        Some(Box::new(RemoteSession {
            drafter: Arc::clone(&self.drafter),
            outbound,
            inbox,
            reader,
            sent: None,
            context_len: 0,
            bytes_sent: 0,
            wire_kind: info.wire_kind,
        }))
    }

    fn tap_layers(&self) -> &[usize] {
        &self.info.tap_layers
    }

    fn max_depth(&self) -> usize {
        self.info.handshake.block_size as usize - 1
    }
}

/// A reply of the draft stream and when it arrived.
type Arrival = (Instant, Result<pb::DraftResponse, tonic::Status>);

/// Opens the draft stream and forwards its replies until it ends or the session is dropped.
async fn read_replies(
    mut client: DrafterClient<Channel>,
    request: tonic::Request<tokio_stream::wrappers::ReceiverStream<pb::DraftRequest>>,
    replies: std::sync::mpsc::Sender<Arrival>,
) {
    let mut stream = match client.draft(request).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            let _ = replies.send((Instant::now(), Err(status)));
            return;
        }
    };
    loop {
        let reply = match stream.message().await {
            Ok(Some(response)) => Ok(response),
            Ok(None) => Err(tonic::Status::unavailable("stream ended")),
            Err(status) => Err(status),
        };
        let ended = reply.is_err();
        if replies.send((Instant::now(), reply)).is_err() || ended {
            return;
        }
    }
}

struct RemoteSession {
    drafter: Arc<RemoteDrafter>,
    outbound: mpsc::Sender<pb::DraftRequest>,
    /// Replies as they arrive (see [`read_replies`]).
    inbox: std::sync::mpsc::Receiver<Arrival>,
    reader: tokio::task::JoinHandle<()>,
    /// When the round in flight was sent.
    sent: Option<Instant>,
    context_len: usize,
    bytes_sent: u64,
    wire_kind: Kind,
}

impl Drop for RemoteSession {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Why a round's messages were not queued.
enum Queued {
    Closed,
    Timeout,
}

impl RemoteSession {
    /// Queues a round's messages for the stream. The queue is almost never full (it fills only
    /// while the stream is back-pressured), so each message is tried without waiting first: no
    /// timer, whose registration would wake the runtime's driver thread. A full queue is waited on
    /// up to the round deadline.
    fn enqueue(&self, messages: Vec<pb::DraftRequest>) -> Result<(), Queued> {
        let mut pending = messages.into_iter();
        while let Some(message) = pending.next() {
            match self.outbound.try_send(message) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Closed(_)) => return Err(Queued::Closed),
                Err(mpsc::error::TrySendError::Full(message)) => {
                    return self.enqueue_waiting(std::iter::once(message).chain(pending).collect())
                }
            }
        }
        Ok(())
    }

    fn enqueue_waiting(&self, messages: Vec<pb::DraftRequest>) -> Result<(), Queued> {
        let (outbound, deadline) = (self.outbound.clone(), self.drafter.round_deadline);
        let queued = self.drafter.runtime.block_on(async move {
            tokio::time::timeout(deadline, async move {
                for message in messages {
                    outbound.send(message).await.map_err(|_| Queued::Closed)?;
                }
                Ok(())
            })
            .await
        });
        queued.unwrap_or(Err(Queued::Timeout))
    }

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
                    states: round
                        .states
                        .map(|s| codec::encode(&s.narrow(0, from as i64, count as i64), self.wire_kind)),
                }
            })
            .collect()
    }
}

impl DraftSession for RemoteSession {
    fn context_len(&self) -> usize {
        self.context_len
    }

    fn send(&mut self, round: DraftRound) -> Result<(), DraftFailure> {
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
                spine: round.spine,
                end_tokens: round.reach.ends.clone(),
                max_depth: codec::wire_max_depth(round.reach.max_depth),
            });
        }
        self.bytes_sent += messages.iter().map(|m| prost::Message::encoded_len(m) as u64).sum::<u64>();
        let sent = Instant::now();
        match self.enqueue(messages) {
            Ok(()) => {}
            Err(Queued::Closed) => return Err(DraftFailure::Unavailable("draft stream closed".into())),
            Err(Queued::Timeout) => return Err(DraftFailure::Timeout),
        }
        self.sent = Some(sent);
        self.context_len = round.root_position;
        Ok(())
    }

    fn receive(&mut self, wait: Duration) -> Result<Option<Drafted>, DraftFailure> {
        let sent = self.sent.ok_or_else(|| DraftFailure::Unavailable("no round in flight".into()))?;
        let deadline = sent + self.drafter.round_deadline;
        let arrival = match self.inbox.try_recv() {
            Ok(arrival) => arrival,
            Err(TryRecvError::Disconnected) => {
                return Err(DraftFailure::Unavailable("draft stream ended".into()))
            }
            Err(TryRecvError::Empty) => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(DraftFailure::Timeout);
                }
                if wait.is_zero() {
                    return Ok(None);
                }
                match self.inbox.recv_timeout((deadline - now).min(wait)) {
                    Ok(arrival) => arrival,
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(DraftFailure::Unavailable("draft stream ended".into()))
                    }
                    Err(RecvTimeoutError::Timeout) if Instant::now() >= deadline => {
                        return Err(DraftFailure::Timeout)
                    }
                    Err(RecvTimeoutError::Timeout) => return Ok(None),
                }
            }
        };
        let (arrived, reply) = arrival;
        let response = match reply {
            Ok(response) => response,
            Err(status) => {
                self.drafter.stream_failed(&status);
                return Err(DraftFailure::Unavailable(status.message().to_string()));
            }
        };
        // An answer after the deadline is refused like a missing one, so a slow drafter cannot
        // hold rounds back by answering just late.
        if arrived > deadline {
            return Err(DraftFailure::Timeout);
        }
        self.sent = None;
        let draft_time = Duration::from_secs_f64(response.draft_ms.max(0.0) / 1e3);
        let round_trip = arrived.saturating_duration_since(sent);
        Ok(Some(Drafted { tree: codec::response_tree(response), draft_time, round_trip }))
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(taps: &[u32], block_size: u32) -> DrafterInfo {
        let handshake = pb::HandshakeResponse { tap_layers: taps.to_vec(), block_size, ..Default::default() };
        DrafterInfo {
            handshake,
            tap_layers: taps.iter().map(|&l| l as usize).collect(),
            wire_kind: Kind::Float,
        }
    }

    fn addr(last: u8) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, last], 50061))
    }

    #[test]
    fn the_resolve_override_applies_to_its_name_only() {
        let spec = "drafters.test=127.0.0.2, 127.0.0.3";
        let ips = parse_resolve_override(spec, "Drafters.test").unwrap().unwrap();
        assert_eq!(ips, [addr(2).ip(), addr(3).ip()]);
        assert_eq!(parse_resolve_override(spec, "other").unwrap(), None);
        assert!(parse_resolve_override("drafters.test", "drafters.test").is_err());
        assert!(parse_resolve_override("drafters.test=127.0.0.2,pod-b", "drafters.test").is_err());
    }

    #[test]
    fn pods_that_differ_from_the_pool_are_refused_and_unreachable_ones_skipped() {
        let reference = info(&[0, 1], 16);
        let unreachable = DrafterError::Unreachable { url: "pod-d".into(), reason: "refused".into() };
        let mismatch = DrafterError::Mismatch { url: "pod-e".into(), reason: "fingerprint".into() };
        let probes = vec![
            (addr(2), Ok(info(&[0, 1], 16))),
            (addr(3), Ok(info(&[0, 2], 16))),
            (addr(4), Ok(info(&[0, 1], 8))),
            (addr(5), Err(unreachable)),
            (addr(6), Err(mismatch)),
        ];
        let (members, refused) = admit(&reference, probes);
        assert_eq!(members, [addr(2)]);
        assert_eq!(refused.len(), 3);
        assert!(refused.iter().all(|e| matches!(e, DrafterError::Mismatch { .. })));
    }

    #[test]
    fn a_pool_without_a_fitting_pod_reports_a_mismatch_before_unreachability() {
        let unreachable = || DrafterError::Unreachable { url: "pod".into(), reason: "refused".into() };
        let mismatch = DrafterError::Mismatch { url: "pod".into(), reason: "fingerprint".into() };
        let probes = vec![(addr(2), Err(unreachable())), (addr(3), Err(mismatch))];
        assert!(matches!(reference_handshake("u", &probes), Err(DrafterError::Mismatch { .. })));
        let probes = vec![(addr(2), Err(unreachable())), (addr(3), Err(unreachable()))];
        assert!(matches!(reference_handshake("u", &probes), Err(DrafterError::Unreachable { .. })));
        assert!(matches!(reference_handshake("u", &[]), Err(DrafterError::Unreachable { .. })));
    }
}
