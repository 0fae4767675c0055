//! Speculative decoding rounds on the verifier: send the drafter the tap states of the positions
//! just committed, get a candidate tree, verify root + tree in ONE target forward with an
//! ancestor-only mask, walk the target's own argmax through matching children, commit that path
//! plus the bonus token, and compact the KV cache to it. The committed tokens are exactly the
//! greedy ones. When no drafter answers, a round is a plain greedy step, and drafting resumes
//! (with the whole missed context re-sent) as soon as a drafter is back. In auto mode the round
//! policy (`crate::policy`) decides per round whether to draft and how much of the tree to verify,
//! and the verifier does not wait idle for a tree: it takes greedy steps while the drafter works
//! (the two run on their own devices), then verifies the subtree below the tokens those steps
//! committed (`Tree::descend`), so a slow or wrong draft costs no more than the steps it hid.

use std::time::{Duration, Instant};

use glance_models::decode::{
    prefill_with_taps, Emitted, FinishKind, Generation, GreedyParams, ModelInputs, StepControl,
};
use glance_models::kv_cache::KvCache;
use glance_models::readout::{read_rows, Reads, RowsRead, TokenLogprob};
use glance_models::sampling::{Draw, Sampling};
use glance_models::{LogitRows, ModelError, StepInput, TargetModel};
use glance_spec::prompt_lookup::{IndexedHistory, PromptLookup};
use glance_spec::tree::{Reach, TokenId, Tree, TreeLimits};
use glance_telemetry::ROUND_SPANS;
use tch::{Kind, Tensor};

use crate::policy::{Grafted, PolicyStats, RoundPolicy, VerifyCost};

/// A drafter's answer to one round: the tree as sent (not yet trusted), the drafter-side time, and
/// the round trip from sending the round to the tree's arrival.
#[derive(Clone, Debug, Default)]
pub struct Drafted {
    pub tree: Tree,
    pub draft_time: Duration,
    pub round_trip: Duration,
}

/// What the verifier sends in one round.
pub struct DraftRound<'a> {
    /// Stream index of the first context row.
    pub first_position: usize,
    /// Tokens at the context positions.
    pub tokens: &'a [i64],
    /// Tap states of the context positions (rows, taps·hidden), when the drafter reads them.
    pub states: Option<&'a Tensor>,
    pub root_token: i64,
    pub root_position: usize,
    pub budget: usize,
    pub branch_k: usize,
    /// Also the tree's spine to the block's last offset (auto: its policy picks the nodes).
    pub spine: bool,
    /// What the round could commit: the drafter spends no budget past it.
    pub reach: &'a Reach,
}

#[derive(Debug, thiserror::Error)]
pub enum DraftFailure {
    #[error("drafter unavailable: {0}")]
    Unavailable(String),
    #[error("drafter missed the round deadline")]
    Timeout,
}

/// One generation's drafting session (a stream to drafter-svc, or an in-process drafter). A round
/// is sent, and its tree collected later, so that the verifier can take greedy steps while the
/// drafter works; at most one round is in flight.
pub trait DraftSession {
    /// Context positions the drafter holds or has been sent; the next round sends from here on.
    fn context_len(&self) -> usize;
    /// Sends one round: new context rows plus the root. Wire bytes sent are reported through
    /// `bytes_sent`.
    fn send(&mut self, round: DraftRound) -> Result<(), DraftFailure>;
    /// The tree of the round in flight, waiting at most `wait` for it (`Duration::ZERO` only
    /// looks): `Ok(None)` while it has not arrived, `Err(Timeout)` once the round's deadline has
    /// passed without it (a late answer would desynchronize the stream: the session is over).
    fn receive(&mut self, wait: Duration) -> Result<Option<Drafted>, DraftFailure>;
    /// Serialized bytes sent so far (for the stats).
    fn bytes_sent(&self) -> u64;
}

/// Opens drafting sessions; `None` while no drafter is reachable.
pub trait DraftProvider {
    fn open(&mut self) -> Option<Box<dyn DraftSession>>;
    /// Target layers whose outputs the drafter reads (empty: none, e.g. prompt lookup).
    fn tap_layers(&self) -> &[usize];
    /// Largest depth a tree may have (block size − 1).
    fn max_depth(&self) -> usize;
}

/// A provider with no drafter behind it: every round is a greedy step.
pub struct NoDrafter;

impl DraftProvider for NoDrafter {
    fn open(&mut self) -> Option<Box<dyn DraftSession>> {
        None
    }

    fn tap_layers(&self) -> &[usize] {
        &[]
    }

    fn max_depth(&self) -> usize {
        1
    }
}

/// Per-request speculative settings.
#[derive(Clone, Copy, Debug)]
pub struct SpecParams {
    /// Most best-first nodes a tree may have (auto also asks for the spine below them to the
    /// block's last offset, and verifies the nodes its calibration says pay).
    pub budget: usize,
    pub branch_k: usize,
    /// Record each drafted round's root entropy and accepted count.
    pub log_rounds: bool,
    /// How each committed token is chosen (greedy, or drawn: see `glance_models::sampling`).
    pub sampling: Sampling,
}

/// One drafted round, for the entropy law.
#[derive(Clone, Copy, Debug)]
pub struct RoundLog {
    /// Entropy (nats) of the target's distribution at the root.
    pub root_entropy: f32,
    pub accepted: usize,
    pub tree_size: usize,
}

/// What the speculative run measured, for the response and the benchmarks.
#[derive(Clone, Debug, Default)]
pub struct SpecStats {
    /// Verify rounds with a tree (drafted rounds).
    pub rounds: usize,
    /// Rounds decoded as plain greedy steps because no drafter answered.
    pub fallback_rounds: usize,
    /// Trees refused as malformed.
    pub rejected_trees: usize,
    /// accepted_per_depth[d] = rounds that accepted a node at depth d+1.
    pub accepted_per_depth: Vec<u64>,
    /// Tokens committed by drafted rounds (accepted + bonus), for τ.
    pub committed_in_rounds: usize,
    /// Tree nodes sent through verification.
    pub draft_tokens: usize,
    /// Accepted draft tokens that were committed (a stop inside an accepted run cuts the rest).
    pub accepted_committed: usize,
    /// Per drafted round, when asked for.
    pub round_logs: Vec<RoundLog>,
    pub draft_time: Duration,
    pub hop_time: Duration,
    pub verify_time: Duration,
    pub bytes_sent: u64,
    /// What the auto policy chose (auto mode only).
    pub policy: Option<PolicyStats>,
}

impl SpecStats {
    /// Mean tokens committed per drafted round (accepted + bonus).
    pub fn tau(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            self.committed_in_rounds as f64 / self.rounds as f64
        }
    }
}

/// The committed-position history the drafter reads: token and tap states of every position. The
/// states live on the host, whatever the target's device: they are staged down with the pass that
/// computed them ([`TapRows`]) and go to the drafter from here, so sending a round costs no host
/// sync of its own.
struct History {
    tokens: Vec<i64>,
    /// (capacity, taps·hidden) in the model's dtype, on the host; rows past `len` are unwritten.
    states: Option<Tensor>,
    len: usize,
}

impl History {
    fn new(capacity: usize, width: i64, kind: Kind) -> Self {
        // Uninitialized: the pages of a long context limit are touched only as rows are written.
        let states = (width > 0).then(|| Tensor::empty([capacity as i64, width], (kind, tch::Device::Cpu)));
        Self { tokens: Vec::with_capacity(capacity), states, len: 0 }
    }

    /// Appends the prompt's positions; `states` are on the host (staged, and read back since).
    fn push(&mut self, tokens: &[i64], states: Option<&Tensor>) {
        if let (Some(mut block), Some(rows)) = (self.next_rows(tokens.len()), states) {
            block.copy_(rows);
        }
        self.extend(tokens);
    }

    /// Appends the positions a round committed, their tap states gathered from the pass's staged
    /// outputs into the store.
    fn push_rows(&mut self, tokens: &[i64], rows: &TapRows) {
        debug_assert_eq!(tokens.len(), rows.len());
        if let Some(block) = self.next_rows(tokens.len()) {
            rows.write_into(&block);
        }
        self.extend(tokens);
    }

    /// The store's rows for the next `count` positions, when states are kept.
    fn next_rows(&self, count: usize) -> Option<Tensor> {
        self.states.as_ref().map(|s| s.narrow(0, self.len as i64, count as i64))
    }

    fn extend(&mut self, tokens: &[i64]) {
        self.tokens.extend_from_slice(tokens);
        self.len += tokens.len();
    }

    fn states_from(&self, start: usize) -> Option<Tensor> {
        self.states.as_ref().map(|s| s.narrow(0, start as i64, (self.len - start) as i64))
    }
}

/// Commits tokens exactly as autoregressive decoding would, reporting whether generation ended.
struct Committer<'a, F: FnMut(Emitted<'_>) -> StepControl> {
    tokens: Vec<i64>,
    /// Each token's log-probability, when asked for.
    logprobs: Vec<TokenLogprob>,
    params: &'a GreedyParams<'a>,
    on_token: F,
    finish: Option<FinishKind>,
    prompt_len: usize,
    /// Prompt + generated positions allowed (the greedy decoder's cache capacity).
    limit: usize,
    /// The tokens that end the generation, as the drafter's trees hold them.
    ends: Vec<TokenId>,
}

impl<'a, F: FnMut(Emitted<'_>) -> StepControl> Committer<'a, F> {
    /// Whether committing `tokens` ends the generation by the checks that do not depend on the
    /// client (end of sequence, the token limit, the context): [`Committer::commit`]'s own, ahead
    /// of it.
    fn surely_ends(&self, tokens: &[i64]) -> bool {
        tokens.iter().any(|t| self.params.eos_token_ids.contains(t)) || tokens.len() >= self.tokens_left()
    }

    /// Tokens [`Committer::commit`] takes before the length or the context limit ends the
    /// generation (the last of them ends it).
    fn tokens_left(&self) -> usize {
        let committed = self.tokens.len();
        let by_length = self.params.max_new_tokens.saturating_sub(committed);
        // The cache then holds the prompt and all but the last token, at most `limit` positions.
        let by_context = (self.limit + 1).saturating_sub(self.prompt_len + committed);
        by_length.min(by_context)
    }

    /// What of a tree a round could still commit: the depth the length and context limits leave
    /// (a round commits its accepted path and the bonus token, so a node deeper than the tokens
    /// left minus one adds nothing), and the tokens that end the generation. At least the first
    /// level: a round at the very last token still verifies the root's children, so every tree
    /// that arrives is verified (or declined by auto) and counted as a round.
    fn reach(&self) -> Reach {
        self.reach_after(0)
    }

    /// [`Committer::reach`] once `pending` more tokens are committed (a round is asked for before
    /// the last round's tokens are).
    fn reach_after(&self, pending: usize) -> Reach {
        let left = self.tokens_left().saturating_sub(pending);
        Reach { max_depth: left.saturating_sub(1).max(1), ends: self.ends.clone() }
    }

    /// Commits one token (with its log-probability when asked for) with the autoregressive
    /// decoder's checks in its order; returns false once generation has ended.
    fn commit(&mut self, token: i64, logprob: Option<TokenLogprob>) -> bool {
        self.tokens.push(token);
        self.logprobs.extend(logprob);
        // What the greedy decoder's cache would hold now: the prompt and all but this token.
        let cache_len = self.prompt_len + self.tokens.len() - 1;
        let emitted = Emitted { token, logprob: self.logprobs.last() };
        self.finish = if self.params.eos_token_ids.contains(&token) {
            Some(FinishKind::Eos)
        } else if (self.on_token)(emitted) == StepControl::Stop {
            Some(FinishKind::Stopped)
        } else if self.tokens.len() >= self.params.max_new_tokens {
            Some(FinishKind::Length)
        } else if cache_len >= self.limit {
            Some(FinishKind::Context)
        } else {
            None
        };
        self.finish.is_none()
    }
}

/// Speculative generation. Produces exactly the tokens of [`glance_models::decode::generate`] with
/// the same sampling: the greedy tokens, or with a temperature the same draws (each generated
/// index has its own uniform, whichever pass draws it). With a `policy` (auto mode) each round
/// may be a greedy step or verify only the nodes of the tree that pay (a tree of their own); what
/// is committed is the target's own choice either way.
pub fn speculative_generate(
    model: &TargetModel,
    inputs: &ModelInputs,
    params: &GreedyParams,
    spec: SpecParams,
    provider: &mut dyn DraftProvider,
    mut policy: Option<&mut RoundPolicy>,
    on_token: impl FnMut(Emitted<'_>) -> StepControl,
) -> Result<(Generation, SpecStats), ModelError> {
    let _no_grad = tch::no_grad_guard();
    let started = Instant::now();
    let prompt_len = inputs.input_ids.len();
    let limit = params.capacity(prompt_len)?;
    let taps: Vec<usize> = provider.tap_layers().to_vec();
    let max_depth = provider.max_depth();
    let vocab = model.text_config().vocab_size as usize;
    // Auto asks for the spine to the block's last offset beside the budget's nodes.
    let max_nodes = spec.budget + if policy.is_some() { max_depth } else { 0 };
    let limits = TreeLimits { vocab, max_nodes, max_depth };
    let mut lookup = Lookup::new(spec.budget.min(max_depth));
    // The verify pass appends root + tree before compaction: room for the largest tree, which
    // for auto is the drafter's with a prompt-lookup tree grafted on.
    let grafted_rows = if policy.is_some() { lookup.lookup.max_nodes } else { 0 };
    let max_rows = 1 + max_nodes + grafted_rows;
    let mut cache = model.new_cache(limit + max_rows);
    let mut mask = TreeMask::new(max_rows, cache.capacity(), model.kind(), model.device());
    let width = taps.len() as i64 * model.text_config().hidden_size;
    // A round may accept a whole path past the limit (the committer stops at the limit): room for
    // the deepest one.
    let mut history = History::new(limit + max_depth + 1, width, model.kind());
    // Opened before the prefill: a remote drafter's stream opens while the target prefills.
    let mut drafting =
        Drafting { session: provider.open(), in_flight: None, retry: Retry::default(), decided: None };
    let prefill_span = tracing::info_span!("prefill", prompt_tokens = prompt_len).entered();
    let (logits, prompt_states) = prefill_with_taps(model, inputs, &mut cache, &taps)?;
    drop(prefill_span);
    // The prompt's tap states come down with the root's read-back: one host sync.
    let prompt_states = prompt_states.as_ref().map(glance_models::stage_to_host);
    // The root and, for the policy, the target's entropy there (what it predicts a round from).
    let first = Draw { sampling: spec.sampling, index: 0 };
    let numerators = first.upload_single_row(model.device());
    // the last row's (1, vocab) logits
    let reads = Reads { entropy: policy.is_some(), logprobs: params.logprobs };
    let read = read_rows(&logits, &spec.sampling, numerators.as_ref(), reads);
    history.push(&inputs.input_ids, prompt_states.as_ref());
    let mut root = read.choices[0];
    let mut root_entropy = read.entropies.first().map(|&e| f64::from(e));
    let prefill_time = started.elapsed();
    let decode_started = Instant::now();
    let mut stats = SpecStats { accepted_per_depth: vec![0; max_depth], ..Default::default() };
    let mut committer = Committer {
        tokens: Vec::new(),
        logprobs: Vec::new(),
        params,
        on_token,
        finish: None,
        prompt_len,
        limit,
        // An id no tree can hold (none is negative) can end no drafted path.
        ends: params.eos_token_ids.iter().filter_map(|&t| TokenId::try_from(t).ok()).collect(),
    };
    let mut alive = committer.commit(root, read.logprobs.into_iter().next());
    // How long the verifier last sat idle waiting for a tree.
    let mut idle = Duration::ZERO;
    while alive {
        let start = cache.len();
        let _round = tracing::info_span!(target: ROUND_SPANS, "round", position = start).entered();
        let reach = committer.reach();
        // Why this round is a greedy step if it ends up one (only a missing drafter is a fallback).
        let ask = Ask { history: &history, root, start, root_entropy, reach: &reach };
        let mut greedy = drafting.decide(ask, policy.as_deref_mut(), spec, max_depth, &mut stats);
        let mut round = None;
        if let (Some(flight), Some(s)) = (drafting.in_flight.as_ref(), drafting.session.as_mut()) {
            // Auto takes greedy steps while the drafter works; the fixed modes wait for the tree.
            let overlap = policy.as_deref().is_some_and(|p| {
                p.step_while_drafting(flight.context_rows, flight.sent.elapsed().as_secs_f64())
            });
            let waited = Instant::now();
            let reply = {
                let _wait =
                    (!overlap).then(|| tracing::info_span!(target: ROUND_SPANS, "draft_wait").entered());
                s.receive(if overlap { Duration::ZERO } else { Duration::MAX })
            };
            match reply {
                Ok(None) => greedy = Greedy::WhileDrafting,
                Ok(Some(drafted)) => {
                    idle = waited.elapsed();
                    let flight = drafting.in_flight.take().expect("a round in flight");
                    record_draft(&drafted, &mut stats);
                    if let Some(p) = policy.as_deref_mut() {
                        p.observe_draft(flight.context_rows, drafted.round_trip.as_secs_f64());
                    }
                    if valid(&drafted.tree, limits, &mut stats) {
                        greedy = Greedy::TreeUnused;
                        let path = committed_since(&history, flight.root_position, root);
                        let stepped =
                            Stepped { path: &path, root_entropy: flight.root_entropy, horizon: max_depth };
                        let looked_up =
                            policy.is_some().then(|| lookup.find(&history, root, &reach)).flatten();
                        round = to_verify(drafted.tree, stepped, &reach, policy.as_deref_mut(), looked_up);
                    }
                }
                Err(e) => drafting.fail(&mut stats, e),
            }
        }
        // A step auto takes without asking the drafter may verify a prompt-lookup tree instead (a
        // tree that arrived had the lookup grafted on). Not while a tree is being drafted: the
        // policy asked for it as the better bet, and tokens committed past its root by lookups
        // shorten what it can still add.
        if let (None, Some(p), Greedy::NotAsked) = (&round, policy.as_deref_mut(), greedy) {
            if let Some((ngram, chain)) = lookup.propose(&history, root, &reach, p) {
                round = Some((chain, Source::Lookup(ngram)));
            }
        }
        let verify_started = Instant::now();
        let verify_span = tracing::info_span!(target: ROUND_SPANS, "verify", nodes = round.as_ref().map_or(0, |(t, _)| t.len()));
        let entered = verify_span.enter();
        let drafted = round.is_some();
        let rows = 1 + round.as_ref().map_or(0, |(t, _)| t.len());
        let round_entropy = policy.is_some();
        // The root row draws the next generated token.
        let draw = Draw { sampling: spec.sampling, index: committer.tokens.len() as u64 };
        let (committed, logprobs, tap_rows, next_entropy) = match round {
            Some((tree, source)) => {
                stats.draft_tokens += tree.tokens.len();
                let reads = RoundReads {
                    root_entropy: spec.log_rounds,
                    next_entropy: round_entropy,
                    logprobs: params.logprobs,
                };
                let verified = verify_round(
                    model,
                    &mut cache,
                    &mut mask,
                    inputs.rope_delta,
                    root,
                    &tree,
                    &taps,
                    reads,
                    draw,
                )?;
                // committed = [root, accepted…, bonus]: this round committed all but the root.
                let accepted = verified.path.len();
                learn_from_round(
                    &tree,
                    source,
                    &verified.path,
                    policy.as_deref_mut(),
                    RoundFacts {
                        root_entropy,
                        logged_entropy: verified.root_entropy,
                        horizon: max_depth,
                        idle: idle.as_secs_f64(),
                        logs: &mut stats.round_logs,
                    },
                );
                stats.rounds += 1;
                stats.committed_in_rounds += accepted + 1;
                for count in &mut stats.accepted_per_depth[..accepted] {
                    *count += 1;
                }
                (verified.committed, verified.logprobs, verified.tap_rows, verified.next_entropy)
            }
            None => {
                match (greedy, policy.as_deref_mut()) {
                    (Greedy::NoDrafter, _) => stats.fallback_rounds += 1,
                    (Greedy::NotAsked, Some(p)) => p.observe_greedy_step(),
                    _ => {}
                }
                let entropy = policy.as_deref().is_some_and(RoundPolicy::wants_step_entropy);
                let reads = Reads { entropy, logprobs: params.logprobs };
                plain_step(model, &mut cache, inputs.rope_delta, root, &taps, reads, draw)?
            }
        };
        let verify_time = verify_started.elapsed();
        stats.verify_time += verify_time;
        if let Some(p) = policy.as_deref_mut() {
            // A step beside the working drafter is costed apart from one taken alone.
            match (drafted, greedy) {
                (false, Greedy::WhileDrafting) => p.observe_overlapped_step(verify_time.as_secs_f64()),
                _ => p.observe_verify(rows, verify_time.as_secs_f64()),
            }
        }
        root_entropy = next_entropy.map(f64::from);
        drop(entered);
        // committed = [root, accepted…, bonus]; the cache now holds root + accepted.
        let new_positions = committed.len() - 1;
        history.push_rows(&committed[..new_positions], &tap_rows);
        root = *committed.last().expect("a round commits at least the bonus");
        // The next round's tree is asked for before the tokens go to the client (detokenizing,
        // stop strings, the stream), so the drafter starts on it that much earlier. Unless this
        // round certainly ends the generation; a stop string found below wastes only the draft.
        if !committer.surely_ends(&committed[1..]) {
            let reach = committer.reach_after(new_positions);
            let ask = Ask { history: &history, root, start: cache.len(), root_entropy, reach: &reach };
            drafting.decide(ask, policy.as_deref_mut(), spec, max_depth, &mut stats);
        }
        let _commit = tracing::info_span!(target: ROUND_SPANS, "commit", tokens = new_positions).entered();
        let mut logprobs = logprobs.into_iter();
        for (i, &token) in committed[1..].iter().enumerate() {
            // Every token but the last of a drafted round is an accepted draft token.
            if drafted && i + 2 < committed.len() {
                stats.accepted_committed += 1;
            }
            alive = committer.commit(token, logprobs.next());
            if !alive {
                break;
            }
        }
        if alive {
            drafting.reconnect(provider);
        }
    }
    if let Some(s) = &drafting.session {
        stats.bytes_sent += s.bytes_sent();
    }
    stats.policy = policy.map(|p| p.final_stats());
    let generation = Generation {
        tokens: committer.tokens,
        logprobs: committer.logprobs,
        finish: committer.finish.unwrap_or(FinishKind::Length),
        prefill_time,
        decode_time: decode_started.elapsed(),
    };
    Ok((generation, stats))
}

/// Whether a received tree may be verified; a malformed one is counted and logged.
fn valid(tree: &Tree, limits: TreeLimits, stats: &mut SpecStats) -> bool {
    match tree.validate(limits) {
        Ok(()) => true,
        Err(reason) => {
            tracing::warn!(%reason, "drafter sent a malformed tree; decoding this round without it");
            stats.rejected_trees += 1;
            false
        }
    }
}

/// The auto policy's start-up sweep: the time of a target pass over 1, 2, 4 … `max_rows` new rows
/// after a context of `CALIBRATION_CONTEXT` positions (the best of three after a warm-up, the argmax read
/// included, so a GPU pass is timed to completion). Online measurements refine it per request.
pub fn measure_verify_costs(model: &TargetModel, max_rows: usize) -> Result<VerifyCost, ModelError> {
    const CALIBRATION_CONTEXT: usize = 256;
    const SLOW_PASS_SECS: f64 = 0.5;
    let _no_grad = tch::no_grad_guard();
    let device = model.device();
    let mut cache = model.new_cache(CALIBRATION_CONTEXT + max_rows);
    let forward = |cache: &mut KvCache, rows: usize| -> Result<(), ModelError> {
        let (start, n) = (cache.len() as i64, rows as i64);
        let ids = Tensor::zeros([n], (Kind::Int64, device));
        let positions = Tensor::arange_start(start, start + n, (Kind::Int64, device))
            .view([1, n])
            .expand([3, n], false)
            .contiguous();
        let step = StepInput {
            token_ids: &ids,
            positions: &positions,
            mask: None,
            vision: None,
            taps: &[],
            logits: LogitRows::All,
        };
        let logits = model.forward(&step, cache)?.logits.expect("logits were requested");
        let _ = glance_models::read_i64(&logits.argmax(-1, false));
        Ok(())
    };
    forward(&mut cache, CALIBRATION_CONTEXT)?;
    let mut costs = VerifyCost::default();
    let mut rows = 1;
    while rows <= max_rows {
        let mut best = f64::INFINITY;
        // The first pass of a new shape also pays for libtorch's kernel selection: not timed.
        for attempt in 0..4 {
            let timer = Instant::now();
            forward(&mut cache, rows)?;
            if attempt > 0 {
                best = best.min(timer.elapsed().as_secs_f64());
            }
            cache.truncate(CALIBRATION_CONTEXT);
        }
        costs.observe(rows, best);
        // A slow target (a large model on a CPU) would spend minutes here: larger passes are
        // extrapolated until requests measure them.
        if best > SLOW_PASS_SECS {
            break;
        }
        rows *= 2;
    }
    Ok(costs)
}

/// When to try a drafter again after it failed: after 1, 2, 4 … 32 greedy rounds, so a drafter
/// that keeps timing out does not get the whole context re-sent every round.
#[derive(Default)]
struct Retry {
    wait: u32,
    streak: u32,
}

impl Retry {
    fn failed(&mut self) {
        self.streak = (self.streak + 1).min(6);
        self.wait = 1 << (self.streak - 1);
    }

    fn succeeded(&mut self) {
        self.streak = 0;
        self.wait = 0;
    }

    /// Counts one greedy round down; true once the wait is over.
    fn due(&mut self) -> bool {
        self.wait = self.wait.saturating_sub(1);
        self.wait == 0
    }
}

/// A round sent to the drafter whose tree has not been collected yet.
struct InFlight {
    /// Stream position of the round's root: greedy steps taken since committed the tokens after it.
    root_position: usize,
    /// The target's entropy at that root, when known (what the policy predicted the round from).
    root_entropy: Option<f64>,
    context_rows: usize,
    sent: Instant,
}

/// Why a round is a plain greedy step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Greedy {
    /// No drafter answered (a fallback round).
    NoDrafter,
    /// The policy did not ask for a tree.
    NotAsked,
    /// A tree arrived and the policy verified none of it (declined, or the steps left it).
    TreeUnused,
    /// The drafter is still working on a tree (auto steps meanwhile).
    WhileDrafting,
}

/// Sends the drafter the context it lacks plus the root at `start`.
fn send_round(
    session: &mut dyn DraftSession,
    history: &History,
    root: i64,
    start: usize,
    spec: SpecParams,
    spine: bool,
    reach: &Reach,
) -> Result<(), DraftFailure> {
    let from = session.context_len();
    let states = history.states_from(from);
    let round = DraftRound {
        first_position: from,
        tokens: &history.tokens[from..history.len],
        states: states.as_ref(),
        root_token: root,
        root_position: start,
        budget: spec.budget,
        branch_k: spec.branch_k,
        spine,
        reach,
    };
    let _span =
        tracing::info_span!(target: ROUND_SPANS, "draft", context_rows = history.len - from, budget = spec.budget).entered();
    session.send(round)
}

/// A tree's drafter-side time and hop, in the stats and the metrics.
fn record_draft(drafted: &Drafted, stats: &mut SpecStats) {
    metrics::histogram!(crate::metrics::DRAFTER_ROUND_LATENCY).record(drafted.round_trip.as_secs_f64());
    stats.draft_time += drafted.draft_time;
    stats.hop_time += drafted.round_trip.saturating_sub(drafted.draft_time);
}

/// The verifier's side of drafting for one generation: the session (while a drafter answers),
/// the round in flight, when to try a failed drafter again, and the last position decided.
struct Drafting {
    session: Option<Box<dyn DraftSession>>,
    /// The round sent whose tree has not been collected yet.
    in_flight: Option<InFlight>,
    retry: Retry,
    /// The position whose draft-or-not decision was taken, and what it made of its round.
    decided: Option<(usize, Greedy)>,
}

/// Where a round would start: the committed history, the pending root at `start`, and the
/// target's entropy there when known.
struct Ask<'a> {
    history: &'a History,
    root: i64,
    start: usize,
    root_entropy: Option<f64>,
    reach: &'a Reach,
}

impl Drafting {
    /// The draft-or-not decision for the round at `ask.start`, taken once per position (it may
    /// come early, before the previous round's tokens are committed): with no round in flight,
    /// sends one unless the policy declines. Returns why the round is a greedy step if it ends up
    /// one.
    fn decide(
        &mut self,
        ask: Ask,
        policy: Option<&mut RoundPolicy>,
        spec: SpecParams,
        max_depth: usize,
        stats: &mut SpecStats,
    ) -> Greedy {
        if let Some((position, greedy)) = self.decided {
            if position == ask.start {
                return greedy;
            }
        }
        let spine = policy.is_some();
        let greedy = match (&self.in_flight, self.session.as_mut()) {
            (Some(_), _) | (None, None) => Greedy::NoDrafter,
            (None, Some(s)) => {
                let rows = ask.history.len - s.context_len();
                if policy.is_none_or(|p| p.should_draft(ask.root_entropy, max_depth, rows)) {
                    match send_round(s.as_mut(), ask.history, ask.root, ask.start, spec, spine, ask.reach) {
                        Ok(()) => {
                            let sent = Instant::now();
                            self.in_flight = Some(InFlight {
                                root_position: ask.start,
                                root_entropy: ask.root_entropy,
                                context_rows: rows,
                                sent,
                            });
                        }
                        Err(e) => self.fail(stats, e),
                    }
                    Greedy::NoDrafter
                } else {
                    Greedy::NotAsked
                }
            }
        };
        self.decided = Some((ask.start, greedy));
        greedy
    }

    /// A failed session is dropped (its round with it); a fresh one is tried after a few greedy
    /// rounds.
    fn fail(&mut self, stats: &mut SpecStats, error: DraftFailure) {
        tracing::warn!(error = %error, "drafting failed; decoding without a drafter for now");
        if let Some(s) = self.session.take() {
            stats.bytes_sent += s.bytes_sent();
        }
        self.in_flight = None;
        self.retry.failed();
    }

    /// After a round: counts a greedy round towards the next attempt at a failed drafter and
    /// opens a fresh session once the wait is over.
    fn reconnect(&mut self, provider: &mut dyn DraftProvider) {
        if self.session.is_some() {
            self.retry.succeeded();
        } else if self.retry.due() {
            self.session = provider.open();
            match self.session {
                // The next round may ask the fresh session (an early decision found none).
                Some(_) => self.decided = None,
                None => self.retry.failed(),
            }
        }
    }
}

/// Auto's second source of drafts: prompt lookup over the committed history, free to propose (no
/// drafter, no states), so a greedy step auto takes without asking the drafter may verify the
/// chain instead when the policy expects that to pay more. On chat, where answers
/// repeat the question's words, it is what pays most where the head is weak.
struct Lookup {
    lookup: PromptLookup,
    /// The history's tokens as drafts spell them, indexed, kept in step with it.
    indexed: IndexedHistory,
}

impl Lookup {
    fn new(max_draft: usize) -> Self {
        let lookup = PromptLookup::new(max_draft);
        Self { indexed: IndexedHistory::new(lookup.max_ngram), lookup }
    }

    /// The n-gram length that matched and the lookup tree's best-first prefix to verify in place
    /// of a step, if any pays.
    fn propose(
        &mut self,
        history: &History,
        root: i64,
        reach: &Reach,
        policy: &mut RoundPolicy,
    ) -> Option<(usize, Tree)> {
        let (ngram, mut tree) = self.find(history, root, reach)?;
        tree.truncate(policy.choose_lookup_nodes(ngram, &tree));
        (!tree.is_empty()).then_some((ngram, tree))
    }

    /// The n-gram length that matched and the lookup tree after the pending `root`, all of it
    /// that a round could commit (`reach`).
    fn find(&mut self, history: &History, root: i64, reach: &Reach) -> Option<(usize, Tree)> {
        let synced = self.indexed.len();
        for &token in &history.tokens[synced..history.len] {
            self.indexed.push(token as TokenId);
        }
        let (ngram, tree) = self.lookup.find_after(&mut self.indexed, root as TokenId)?;
        Some((ngram, tree.within(reach)))
    }
}

/// The greedy steps taken past a tree's root while it was drafted: the tokens they committed, the
/// target's entropy at that root and the deepest a tree may go.
struct Stepped<'a> {
    path: &'a [TokenId],
    root_entropy: Option<f64>,
    horizon: usize,
}

/// What a round's verification is learnt with beside its tree and accepted path.
struct RoundFacts<'a> {
    /// The target's entropy at the round's root, as the policy predicted from it.
    root_entropy: Option<f64>,
    /// The same read by the verify pass, for the round log (when the request asked for one).
    logged_entropy: Option<f32>,
    horizon: usize,
    /// Seconds the verifier sat idle waiting for the tree.
    idle: f64,
    logs: &'a mut Vec<RoundLog>,
}

/// Tells the policy (auto) what a verified round accepted of each source, and logs the drafter's
/// rounds for the entropy law: lookup rounds stay out of the log, and a grafted round's entry
/// counts only what the drafter's own nodes accepted, so the law stays the drafter's.
fn learn_from_round(
    tree: &Tree,
    source: Source,
    path: &[usize],
    policy: Option<&mut RoundPolicy>,
    facts: RoundFacts,
) {
    let accepted: Vec<TokenId> = path.iter().map(|&i| tree.tokens[i]).collect();
    let drafter_accepted = match &source {
        Source::Lookup(_) => None,
        Source::Drafter => Some(path.len()),
        Source::Grafted(grafted) => Some(grafted.drafted.followed(&accepted)),
    };
    if let (Some(root_entropy), Some(accepted)) = (facts.logged_entropy, drafter_accepted) {
        facts.logs.push(RoundLog { root_entropy, accepted, tree_size: tree.len() });
    }
    let Some(p) = policy else { return };
    let (entropy, horizon, idle) = (facts.root_entropy, facts.horizon, facts.idle);
    match source {
        Source::Lookup(ngram) => p.observe_lookup_round(ngram, tree, tree.len(), path),
        Source::Drafter => p.observe_round(tree, tree.len(), path, entropy, horizon, idle),
        Source::Grafted(grafted) => p.observe_grafted(&grafted, &accepted, entropy, horizon, idle),
    }
}

/// Where a verified round's tree came from: what its verification teaches the policy.
enum Source {
    /// The drafter's tree (or the part of it the policy chose).
    Drafter,
    /// A prompt-lookup tree in place of a greedy step; the length of the n-gram it matched.
    Lookup(usize),
    /// The drafter's tree with a prompt-lookup tree grafted on.
    Grafted(Grafted),
}

/// What of a (valid) tree drafted at an earlier root to verify now that `stepped.path` has been
/// committed past that root: the subtree below the path that the generation could still commit
/// (`reach`), cut by the auto policy to the nodes that pay, with the prompt-lookup tree
/// `looked_up` found at the current root (auto only) grafted on. `None`: nothing (the steps left
/// the tree or passed its depth, or the policy declined). A tree the steps left
/// still tells the policy how much of it held.
fn to_verify(
    tree: Tree,
    stepped: Stepped,
    reach: &Reach,
    policy: Option<&mut RoundPolicy>,
    looked_up: Option<(usize, Tree)>,
) -> Option<(Tree, Source)> {
    let followed = tree.followed(stepped.path);
    // The cut keeps the first level, so a subtree that is left stays non-empty.
    let below = tree.descend(stepped.path).filter(|t| !t.is_empty()).map(|t| t.within(reach));
    let (tree, source) = match (below, policy) {
        (None, Some(p)) => {
            p.observe_stale_tree(followed, stepped.root_entropy, stepped.horizon);
            return None;
        }
        (tree, None) => (tree?, Source::Drafter),
        (Some(tree), Some(p)) => match looked_up {
            Some((ngram, looked_up)) => {
                let (union, grafted) = p.choose_grafted(&tree, ngram, &looked_up);
                (union, Source::Grafted(grafted))
            }
            None => (tree.select(&p.choose_nodes(&tree)), Source::Drafter),
        },
    };
    (!tree.is_empty()).then_some((tree, source))
}

/// The tokens committed after the position `from` up to the pending `root`: the path from a
/// tree drafted at `from` to the current root.
fn committed_since(history: &History, from: usize, root: i64) -> Vec<TokenId> {
    if history.len <= from {
        return Vec::new();
    }
    history.tokens[from + 1..history.len]
        .iter()
        .chain(std::iter::once(&root))
        .map(|&t| t as TokenId)
        .collect()
}

/// The additive tree mask of a request's verify passes, (1+N, prefix+1+N) per round: every row
/// sees the whole prefix, and inside the pack only itself and its ancestors. It lives in one
/// preallocated device buffer of zeros; a round writes only its (1+N)² pack block and the next
/// round clears it, so no round allocates or copies the prefix part.
pub struct TreeMask {
    /// (max_rows, capacity) in the model dtype, zero outside the last written block.
    buffer: Tensor,
    /// (rows, first column) of the block written last.
    written: Option<(i64, i64)>,
}

impl TreeMask {
    pub fn new(max_rows: usize, capacity: usize, kind: Kind, device: tch::Device) -> Self {
        Self { buffer: Tensor::zeros([max_rows as i64, capacity as i64], (kind, device)), written: None }
    }

    /// The mask for root + `tree` after `prefix` cached positions. `blocked`: (1+N, 1+N) bool,
    /// true where a row must not see a column of the pack.
    fn for_pack(&mut self, prefix: usize, blocked: &Tensor) -> Result<Tensor, ModelError> {
        let pack = blocked.size()[0];
        let prefix = prefix as i64;
        let (max_rows, capacity) = (self.buffer.size()[0], self.buffer.size()[1]);
        if pack > max_rows || prefix + pack > capacity {
            return Err(ModelError::Input(format!(
                "a pack of {pack} rows after {prefix} positions exceeds the tree mask ({max_rows} x {capacity})"
            )));
        }
        if let Some((rows, column)) = self.written.take() {
            let _ = self.buffer.narrow(0, 0, rows).narrow(1, column, rows).fill_(0.0);
        }
        let _ =
            self.buffer.narrow(0, 0, pack).narrow(1, prefix, pack).masked_fill_(blocked, f64::NEG_INFINITY);
        self.written = Some((pack, prefix));
        Ok(self.buffer.narrow(0, 0, pack).narrow(1, 0, prefix + pack))
    }
}

/// What one verify pass produced.
pub struct Verified {
    /// [root, accepted…, bonus]
    pub committed: Vec<i64>,
    /// Of [accepted…, bonus] (each from the row that chose it), when asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// Node indices of the accepted path.
    pub path: Vec<usize>,
    /// Tap states of [root, accepted…], in the pass's outputs staged on the host.
    pub tap_rows: TapRows,
    /// Entropy (nats) of the target at the root, when asked for.
    pub root_entropy: Option<f32>,
    /// Entropy at the bonus token (the next round's root), when asked for.
    pub next_entropy: Option<f32>,
}

/// What a verify pass reads back besides the rows' choices (all in its one read-back).
#[derive(Clone, Copy, Debug, Default)]
pub struct RoundReads {
    /// The target's entropy at the round's root (the round log of the entropy law).
    pub root_entropy: bool,
    /// The entropy at the bonus token, the next round's root (the auto policy's prediction).
    pub next_entropy: bool,
    /// Each committed token's log-probability with this many alternatives.
    pub logprobs: Option<usize>,
}

/// One target pass over root + tree, the acceptance walk and the KV compaction (`bench_round`
/// times it as the verify cost). One host upload (ids, positions, the pack's visibility and, when
/// sampling, each row's uniform) that does not block, and one host sync: every row's tap states
/// are staged to the host, then every row's choice (and entropy and log-probabilities when asked)
/// is read back, which waits for both. The walk follows, from the root, the child holding the
/// row's choice: the argmax, or the token drawn from the target's processed distribution at that
/// node.
#[allow(clippy::too_many_arguments)]
pub fn verify_round(
    model: &TargetModel,
    cache: &mut KvCache,
    mask: &mut TreeMask,
    rope_delta: i64,
    root: i64,
    tree: &Tree,
    taps: &[usize],
    reads: RoundReads,
    draw: Draw,
) -> Result<Verified, ModelError> {
    let start = cache.len();
    let device = model.device();
    let n = tree.len() + 1;
    let host: Vec<i64> = std::iter::once(root)
        .chain(tree.tokens.iter().map(|&t| i64::from(t)))
        .chain(
            std::iter::once(0)
                .chain(tree.depths.iter().map(|&d| d as i64))
                .map(|d| start as i64 + d + rope_delta),
        )
        .chain(tree.ancestor_visibility().iter().map(|&v| i64::from(!v)))
        .chain(draw.numerators(std::iter::once(0).chain(tree.depths.iter().map(|&d| d as usize))))
        .collect();
    let uploaded = glance_models::upload(&host, device);
    let n64 = n as i64;
    let ids = uploaded.narrow(0, 0, n64);
    let positions = uploaded.narrow(0, n64, n64).view([1, n64]).expand([3, n64], false);
    let blocked = uploaded.narrow(0, 2 * n64, n64 * n64).view([n64, n64]).eq(1);
    let numerators = (!draw.sampling.is_greedy()).then(|| uploaded.narrow(0, 2 * n64 + n64 * n64, n64));
    let mask = mask.for_pack(start, &blocked)?;
    let step = StepInput {
        token_ids: &ids,
        positions: &positions,
        mask: Some(&mask),
        vision: None,
        taps,
        logits: LogitRows::All,
    };
    let out = model.forward(&step, cache)?;
    let logits = out.logits.expect("logits were requested");
    let staged = stage_taps(&out.taps);
    let row_reads = Reads { entropy: reads.root_entropy || reads.next_entropy, logprobs: reads.logprobs };
    let RowsRead { choices, entropies, logprobs } =
        read_rows(&logits, &draw.sampling, numerators.as_ref(), row_reads);
    let choices: Vec<TokenId> = choices.iter().map(|&c| c as TokenId).collect();
    let (path, bonus) = tree.accepted_path(&choices);
    let bonus_row = path.last().map_or(0, |&i| i + 1);
    let root_entropy = reads.root_entropy.then(|| entropies.first().copied()).flatten();
    let next_entropy = reads.next_entropy.then(|| entropies.get(bonus_row).copied()).flatten();
    let keep: Vec<usize> = std::iter::once(0).chain(path.iter().map(|&i| i + 1)).collect();
    // The row of each committed token's choice is the row of the token before it.
    let logprobs = committed_logprobs(logprobs, &keep);
    cache.keep_rows(start, &keep)?;
    let tap_rows = TapRows { taps: staged, keep };
    let mut committed = vec![root];
    committed.extend(path.iter().map(|&i| i64::from(tree.tokens[i])));
    committed.push(i64::from(bonus));
    Ok(Verified { committed, logprobs, path, tap_rows, root_entropy, next_entropy })
}

/// The log-probabilities of the kept rows' choices, in order (empty when none were read).
fn committed_logprobs(rows: Vec<TokenLogprob>, keep: &[usize]) -> Vec<TokenLogprob> {
    if rows.is_empty() {
        return rows;
    }
    let mut rows: Vec<Option<TokenLogprob>> = rows.into_iter().map(Some).collect();
    keep.iter().filter_map(|&row| rows[row].take()).collect()
}

/// Every tap output of a pass on its way to the host, ahead of the pass's read-back (whose sync
/// they ride on).
fn stage_taps(taps: &[Tensor]) -> Vec<Tensor> {
    taps.iter().map(glance_models::stage_to_host).collect()
}

/// What one greedy step committed ([root, next]), `next`'s log-probability (when asked), the
/// root's tap states, and (when asked) the target's entropy at `next`.
type Step = (Vec<i64>, Vec<TokenLogprob>, TapRows, Option<f32>);

/// One plain step (no drafter): forward the root, keep its tap states; the next token is the
/// argmax or `draw`'s.
fn plain_step(
    model: &TargetModel,
    cache: &mut KvCache,
    rope_delta: i64,
    root: i64,
    taps: &[usize],
    reads: Reads,
    draw: Draw,
) -> Result<Step, ModelError> {
    let numerators = draw.upload_single_row(model.device());
    let out = glance_models::decode::forward_token(model, cache, root, rope_delta, taps)?;
    let logits = out.logits.as_ref().expect("logits were requested");
    let staged = stage_taps(&out.taps);
    let read = read_rows(logits, &draw.sampling, numerators.as_ref(), reads);
    let entropy = read.entropies.first().copied();
    Ok((vec![root, read.choices[0]], read.logprobs, TapRows { taps: staged, keep: vec![0] }, entropy))
}

/// The tap outputs of one target pass, staged on the host, and which of its rows were committed.
/// They are gathered straight into the history's store ([`TapRows::write_into`]: one call per
/// tap), never concatenated into a tensor of their own first.
pub struct TapRows {
    /// One (rows, hidden) host tensor per tapped layer, in the drafter's tap order. Staged: readable
    /// once the pass's read-back has returned (every `TapRows` is built after it).
    taps: Vec<Tensor>,
    /// Rows of the pass kept, strictly increasing: [0] for a greedy step, [root, accepted…] for a
    /// verify pass.
    keep: Vec<usize>,
}

impl TapRows {
    /// Rows committed.
    pub fn len(&self) -> usize {
        self.keep.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keep.is_empty()
    }

    /// Writes the kept rows into `store` (keep, taps·hidden, on the host), the taps side by side:
    /// one `cat` into the store when the kept rows are a prefix of the pass (a greedy step, or a
    /// chain accepted from the first children), else a `cat` of the pass and one `index_select`
    /// into the store. Host to host: nothing crosses to the device. Few calls on purpose: auto
    /// writes a row after every greedy step, and a small target's step is mostly call overhead.
    pub fn write_into(&self, store: &Tensor) {
        let rows = self.keep.len() as i64;
        let is_prefix = self.keep.iter().enumerate().all(|(i, &k)| i == k);
        if is_prefix {
            let kept: Vec<Tensor> = self
                .taps
                .iter()
                .map(|tap| if tap.size()[0] == rows { tap.shallow_clone() } else { tap.narrow(0, 0, rows) })
                .collect();
            let _ = Tensor::cat_out(store, &kept, 1);
        } else {
            let index = glance_models::host_tensor(&self.keep.iter().map(|&k| k as i64).collect::<Vec<_>>());
            let _ = Tensor::cat(&self.taps, 1).index_select_out(store, 0, &index);
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests build and read host tensors freely
mod tests {
    use super::*;

    #[test]
    fn tap_rows_gather_the_kept_rows_into_their_column_blocks() {
        let taps = [
            Tensor::randn([5, 3], (Kind::Float, tch::Device::Cpu)),
            Tensor::randn([5, 2], (Kind::Float, tch::Device::Cpu)),
        ];
        for keep in [vec![0], vec![0, 1, 2], vec![0, 2, 3], vec![1, 4]] {
            let index = Tensor::from_slice(&keep.iter().map(|&k| k as i64).collect::<Vec<_>>());
            let expected =
                Tensor::cat(&[taps[0].index_select(0, &index), taps[1].index_select(0, &index)], 1);
            // The rows land in the middle of a larger store, as in the history.
            let store = Tensor::full([keep.len() as i64 + 2, 5], -7.0, (Kind::Float, tch::Device::Cpu));
            let rows = TapRows { taps: taps.iter().map(Tensor::shallow_clone).collect(), keep: keep.clone() };
            rows.write_into(&store.narrow(0, 1, keep.len() as i64));
            assert!(store.narrow(0, 1, keep.len() as i64).equal(&expected), "keep {keep:?}");
            assert!(
                store.narrow(0, 0, 1).eq(-7.0).all().int64_value(&[]) == 1,
                "the row before is untouched"
            );
            assert!(store.narrow(0, keep.len() as i64 + 1, 1).eq(-7.0).all().int64_value(&[]) == 1);
        }
    }

    #[test]
    fn tree_mask_shows_prefix_and_ancestors_only() {
        let mut tree = Tree::default();
        tree.push(1, -1, 0.0);
        tree.push(2, -1, 0.0);
        tree.push(3, 0, 0.0);
        let blocked = |tree: &Tree| {
            let visible: Vec<bool> = tree.ancestor_visibility();
            let pack = tree.len() as i64 + 1;
            Tensor::from_slice(&visible).view([pack, pack]).logical_not()
        };
        let visible = |mask: &Tensor, rows: i64, cols: i64| -> Vec<Vec<bool>> {
            (0..rows).map(|r| (0..cols).map(|c| mask.double_value(&[r, c]) == 0.0).collect()).collect()
        };
        let mut masks = TreeMask::new(8, 16, Kind::Float, tch::Device::Cpu);
        let mask = masks.for_pack(2, &blocked(&tree)).unwrap();
        assert_eq!(mask.size(), [4, 6]);
        let seen = visible(&mask, 4, 6);
        assert_eq!(seen[0], [true, true, true, false, false, false]);
        assert_eq!(seen[1], [true, true, true, true, false, false]);
        assert_eq!(seen[2], [true, true, true, false, true, false]);
        assert_eq!(seen[3], [true, true, true, true, false, true]);
        // The next round (two positions later, a chain of two) sees the old block as prefix.
        let mut chain = Tree::default();
        chain.push(4, -1, 0.0);
        chain.push(5, 0, 0.0);
        let mask = masks.for_pack(4, &blocked(&chain)).unwrap();
        assert_eq!(mask.size(), [3, 7]);
        let seen = visible(&mask, 3, 7);
        assert_eq!(seen[0], [true, true, true, true, true, false, false]);
        assert_eq!(seen[1], [true, true, true, true, true, true, false]);
        assert_eq!(seen[2], [true; 7]);
        // A pack that does not fit is an error, not a panic.
        assert!(masks.for_pack(15, &blocked(&chain)).is_err());
    }
}
