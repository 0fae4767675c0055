//! The auto round policy (`DECODING_MODE_AUTO`; the arithmetic is `shared/research/round-policy.md`):
//! before each round, whether to ask the drafter at all; once it has answered, how many of the
//! tree's best-first nodes to verify; and for a greedy step taken without the drafter, how much
//! of a prompt-lookup tree to verify instead. All maximise expected committed tokens per second,
//! from costs the server measures on itself and acceptance probabilities calibrated online, so the
//! same binary verifies small trees where a wide pass is dear (one CPU core, a tiny in-cache
//! target) and wide ones where it is nearly free (a memory-bound target, a GPU).
//!
//! The policy only changes what is verified, never what is committed: every token still comes
//! from the target's own argmax, so auto is as lossless as every other mode.

use std::collections::VecDeque;

use glance_spec::law::{self, Form, Round};
use glance_spec::tree::Tree;
use glance_spec::TokenId;

/// The weight a request's acceptance evidence keeps in the next request (the calibration's and
/// the law's scale): enough to start where the last one ended, little enough that a request of
/// another kind turns it within a round or two.
const CARRIED_EVIDENCE: f64 = 0.25;

/// An exponentially weighted mean (the first observation sets it).
#[derive(Clone, Copy, Debug, Default)]
pub struct Ewma {
    value: Option<f64>,
}

impl Ewma {
    /// Weight of a new observation.
    const ALPHA: f64 = 0.2;

    pub fn observe(&mut self, x: f64) {
        self.value = Some(match self.value {
            None => x,
            Some(v) => v + Self::ALPHA * (x - v),
        });
    }

    pub fn get(&self) -> Option<f64> {
        self.value
    }
}

/// Seconds from sending a round to its tree arriving (drafter compute and hop), as a cost per
/// round plus a cost per context row: a request's first round carries the whole prompt's tap
/// states, later ones a few rows, and the step-while-drafting choice needs both. The small rounds
/// and the large ones are averaged apart and the per-row cost read off the two, so that the
/// server's very first round (a prompt, before any small one) never stands for a small round's
/// cost.
#[derive(Clone, Copy, Debug, Default)]
pub struct DraftCost {
    /// Rounds of at most `FEW_ROWS` context rows.
    small: Ewma,
    /// Larger rounds: their seconds and their rows.
    large: Ewma,
    large_rows: Ewma,
    /// |observed − estimated| seconds of the small rounds: how far a round may come in earlier
    /// than expected.
    error: Ewma,
}

impl DraftCost {
    const FEW_ROWS: usize = 32;

    pub fn observe(&mut self, rows: usize, secs: f64) {
        if rows > Self::FEW_ROWS {
            self.large.observe(secs);
            self.large_rows.observe(rows as f64);
            return;
        }
        // The error of the usual (small) rounds; a prompt-sized one is rarer.
        if let Some(expected) = self.small.get() {
            self.error.observe((secs - expected).abs());
        }
        self.small.observe(secs);
    }

    pub fn estimate(&self, rows: usize) -> Option<f64> {
        match (self.small.get(), self.large.get()) {
            (Some(base), _) if rows <= Self::FEW_ROWS => Some(base),
            (Some(base), _) => Some(base + self.per_row().unwrap_or(0.0) * rows as f64),
            // Only prompt-sized rounds seen: their time bounds a smaller round's from above.
            (None, Some(large)) => Some(large * (rows as f64 / self.large_rows.get()?).max(1.0)),
            (None, None) => None,
        }
    }

    /// Seconds a round's time grows by per context row, once both kinds of round are measured.
    pub fn per_row(&self) -> Option<f64> {
        let (base, large, rows) = (self.small.get()?, self.large.get()?, self.large_rows.get()?);
        Some(((large - base) / rows).max(0.0))
    }

    /// The typical error of [`DraftCost::estimate`], seconds (0 until two rounds are seen).
    pub fn error(&self) -> f64 {
        self.error.get().unwrap_or(0.0)
    }
}

/// Seconds one target pass over `rows` new rows takes, by power-of-two bucket of rows (1, 2, 4, …).
/// Estimates come from the measured buckets made non-decreasing in rows (pool-adjacent-violators:
/// a noisy bucket never makes a larger pass look cheaper than a smaller one), interpolated between
/// them, extrapolated upwards in proportion to the rows (an upper bound for a cost a + b·rows) and
/// held flat downwards, so an unmeasured size never looks cheaper than it is.
#[derive(Clone, Debug, Default)]
pub struct VerifyCost {
    buckets: Vec<Ewma>,
}

impl VerifyCost {
    fn bucket(rows: usize) -> usize {
        rows.max(1).next_power_of_two().trailing_zeros() as usize
    }

    pub fn observe(&mut self, rows: usize, secs: f64) {
        let b = Self::bucket(rows);
        if self.buckets.len() <= b {
            self.buckets.resize(b + 1, Ewma::default());
        }
        // Normalized to the bucket's own size, so a pass of 5 rows informs the bucket of 8.
        self.buckets[b].observe(secs * (1usize << b) as f64 / rows.max(1) as f64);
    }

    /// (rows, seconds) of the measured buckets, made non-decreasing.
    fn monotone(&self) -> Vec<(f64, f64)> {
        // Blocks of pooled buckets: (first rows, last rows, mean cost, weight).
        let mut blocks: Vec<(f64, f64, f64, f64)> = Vec::new();
        for (b, e) in self.buckets.iter().enumerate() {
            let Some(cost) = e.get() else { continue };
            let rows = (1usize << b) as f64;
            blocks.push((rows, rows, cost, 1.0));
            while blocks.len() > 1 && blocks[blocks.len() - 2].2 > blocks[blocks.len() - 1].2 {
                let (last, prev) = (blocks.pop().expect("two blocks"), blocks.pop().expect("two blocks"));
                let weight = prev.3 + last.3;
                blocks.push((prev.0, last.1, (prev.2 * prev.3 + last.2 * last.3) / weight, weight));
            }
        }
        let mut points = Vec::new();
        for (first, last, cost, _) in blocks {
            points.push((first, cost));
            if last > first {
                points.push((last, cost));
            }
        }
        points
    }

    pub fn estimate(&self, rows: usize) -> Option<f64> {
        let rows = rows.max(1) as f64;
        let points = self.monotone();
        let below = points.iter().rev().find(|(r, _)| *r <= rows);
        let above = points.iter().find(|(r, _)| *r >= rows);
        match (below, above) {
            (Some(&(r0, c0)), Some(&(r1, c1))) if r1 > r0 => Some(c0 + (c1 - c0) * (rows - r0) / (r1 - r0)),
            (Some(&(_, c)), Some(_)) => Some(c),
            (Some(&(r0, c0)), None) => Some(c0 * rows / r0),
            (None, Some(&(_, c1))) => Some(c1),
            (None, None) => None,
        }
    }
}

/// Per depth, how often a source's path probability turns out right: the calibrated acceptance
/// of a node is `clamp(α_d · q, 0, 1)` with `α_d` = accepted nodes / Σ q at depth d, both decayed
/// so that the estimate follows the request.
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    /// (Σ q, accepted) per depth − 1.
    depths: Vec<(f64, f64)>,
}

impl Calibration {
    const DECAY: f64 = 0.97;
    /// Pseudo-observations at each depth that start its α at the depth above's (at depth 1: at 1,
    /// trusting the source until shown otherwise). A depth seldom verified is thus taken to be
    /// claimed as truthfully as the one above it, not as the source claims: a prompt-lookup
    /// run's claims halve with each depth while its acceptance does not (a copied passage goes
    /// on), and at α = 1 its deeper nodes looked too poor to verify, so nothing ever showed
    /// otherwise; a drafter's overclaim grows with depth, and its deep nodes start no more
    /// trusted than the shallower ones proved.
    const PRIOR: f64 = 0.5;

    /// α_d for depth `depth` (≥ 1): the tests' view of what [`Calibration::acceptance`] scales by.
    #[cfg(test)]
    pub fn factor(&self, depth: usize) -> f64 {
        self.factors(depth).last().copied().unwrap_or(1.0)
    }

    /// α_1 … α_deepest.
    fn factors(&self, deepest: usize) -> Vec<f64> {
        let mut above = 1.0;
        (0..deepest)
            .map(|d| {
                let (claimed, accepted) = self.depths.get(d).copied().unwrap_or_default();
                above = (accepted + Self::PRIOR * above) / (claimed + Self::PRIOR);
                above
            })
            .collect()
    }

    /// Calibrated acceptance probability of each node (a path never more likely than its parent).
    pub fn acceptance(&self, tree: &Tree) -> Vec<f64> {
        let factors = self.factors(tree.depths.iter().copied().max().unwrap_or(0) as usize);
        let mut out: Vec<f64> = Vec::with_capacity(tree.len());
        for i in 0..tree.len() {
            let q = tree.log_probs[i].exp();
            let a = (factors[tree.depths[i] as usize - 1] * q).clamp(0.0, 1.0);
            let parent = usize::try_from(tree.parents[i]).ok().map_or(1.0, |p| out[p]);
            out.push(a.min(parent));
        }
        out
    }

    /// This calibration as the next request's: the evidence weighed down to a quarter, so that a
    /// request of another kind (a chart after documents the head keeps missing, with the same
    /// confident claims) is not judged for long by the last one's acceptance.
    pub fn for_new_request(&self) -> Self {
        Self {
            depths: self.depths.iter().map(|&(q, a)| (q * CARRIED_EVIDENCE, a * CARRIED_EVIDENCE)).collect(),
        }
    }

    /// Records the verified nodes `0..verified` and which of them were accepted.
    pub fn observe(&mut self, tree: &Tree, verified: usize, accepted: &[usize]) {
        for entry in &mut self.depths {
            entry.0 *= Self::DECAY;
            entry.1 *= Self::DECAY;
        }
        for i in 0..verified.min(tree.len()) {
            let d = tree.depths[i] as usize - 1;
            if self.depths.len() <= d {
                self.depths.resize(d + 1, (0.0, 0.0));
            }
            self.depths[d].0 += tree.log_probs[i].exp();
            if accepted.contains(&i) {
                self.depths[d].1 += 1.0;
            }
        }
    }
}

/// The nodes of a tree in the order the policy would verify them: by calibrated `acceptance`,
/// highest first, ties in packed order. A node is never more likely than its parent, which comes
/// earlier in the packed order, so every prefix of this order is a tree (each node's parent in
/// it).
fn by_acceptance(acceptance: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..acceptance.len()).collect();
    order.sort_by(|&a, &b| acceptance[b].total_cmp(&acceptance[a]).then(a.cmp(&b)));
    order
}

/// The entropy law fitted online on the rounds seen (a window that spans requests): per-token
/// match probability p = σ(b0 − b1·H) at root entropy H, so a round is expected to commit
/// 1 + Σ_{ℓ≤L} p^ℓ tokens. The fit pools every kind of request, and one kind may sit far off the
/// pooled curve (on the toy world, a document the target reads with certainty while the head
/// keeps missing: root entropy near 0, as on charts, yet one token in two accepted). So its
/// predictions are scaled by how the recent rounds compared with them (`bias`, decayed fast
/// enough to turn within a request).
#[derive(Clone, Debug, Default)]
pub struct OnlineLaw {
    rounds: VecDeque<Round>,
    fit: Option<(f64, f64)>,
    since_fit: usize,
    /// Decayed (Σ accepted, Σ predicted accepted) of the rounds observed under a fit.
    bias: (f64, f64),
}

impl OnlineLaw {
    const WINDOW: usize = 256;
    const REFIT_EVERY: usize = 8;
    const MIN_ROUNDS: usize = 8;
    /// Per observed round: half the weight is gone after 2.4 rounds (a short request's probes
    /// must be enough to turn it; the back-off, not this scale, smooths single rounds).
    const BIAS_DECAY: f64 = 0.75;
    /// Pseudo-tokens that start the scale at 1 (trust the fit until shown otherwise).
    const BIAS_PRIOR: f64 = 1.0;

    pub fn observe(&mut self, entropy: f64, accepted: usize, horizon: usize) {
        if let Some(predicted) = self.predicted_accepted(entropy, horizon) {
            self.bias = (
                self.bias.0 * Self::BIAS_DECAY + accepted as f64,
                self.bias.1 * Self::BIAS_DECAY + predicted,
            );
        }
        if self.rounds.len() == Self::WINDOW {
            self.rounds.pop_front();
        }
        self.rounds.push_back(Round { entropy, accepted: accepted as f64 });
        self.since_fit += 1;
        if self.rounds.len() >= Self::MIN_ROUNDS && self.since_fit >= Self::REFIT_EVERY {
            let rounds: Vec<Round> = self.rounds.iter().copied().collect();
            self.fit = law::fit(Form::FiniteHorizon, &rounds, horizon).map(|f| (f.b0, f.b1));
            self.since_fit = 0;
        }
    }

    pub fn is_fitted(&self) -> bool {
        self.fit.is_some()
    }

    /// This law as the next request's: the fit kept, the scale's evidence weighed down to a
    /// quarter, so that a request of another kind turns it with its first round or two while one
    /// of the same kind starts where the last one ended.
    pub fn for_new_request(&self) -> Self {
        Self { bias: (self.bias.0 * CARRIED_EVIDENCE, self.bias.1 * CARRIED_EVIDENCE), ..self.clone() }
    }

    /// What the recent rounds accepted over what the fit predicted for them (1 with no evidence).
    pub fn scale(&self) -> f64 {
        (self.bias.0 + Self::BIAS_PRIOR) / (self.bias.1 + Self::BIAS_PRIOR)
    }

    /// Accepted tokens the fit alone predicts at `entropy` (bonus excluded).
    fn predicted_accepted(&self, entropy: f64, horizon: usize) -> Option<f64> {
        let (b0, b1) = self.fit?;
        Some(law::expected_accepted(Form::FiniteHorizon, b0, b1, entropy, horizon))
    }

    /// Expected committed tokens (bonus included) at root entropy `entropy`, once fitted: the
    /// fit's accepted tokens scaled by the recent rounds, at most the horizon.
    pub fn expected_commit(&self, entropy: f64, horizon: usize) -> Option<f64> {
        let accepted = self.predicted_accepted(entropy, horizon)? * self.scale();
        Some(1.0 + accepted.min(horizon as f64))
    }
}

/// What the policy decided, counted for the stats.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PolicyStats {
    /// Rounds where the drafter was not asked (the prediction said a greedy step pays more).
    pub greedy_steps: usize,
    /// Drafted rounds whose tree was not verified at all (n* = 0).
    pub declined_trees: usize,
    /// Drafted rounds verified with n* ≥ 1 nodes, and their nodes.
    pub verified_rounds: usize,
    pub verified_nodes: usize,
    /// Σ |predicted − observed| committed tokens over verified rounds.
    pub abs_error: f64,
    /// Greedy steps taken while the drafter was working on a tree (no time lost to waiting).
    pub overlapped_steps: usize,
    /// Trees that arrived after those steps had left them (their path did not contain the
    /// committed tokens), so nothing of them was verified.
    pub stale_trees: usize,
    /// Rounds that verified a prompt-lookup tree in place of a greedy step, their verified
    /// nodes, and the nodes accepted.
    pub lookup_rounds: usize,
    pub lookup_nodes: usize,
    pub lookup_accepted: usize,
    /// Drafted rounds that verified prompt-lookup nodes grafted onto the tree, those nodes (the
    /// ones the drafter had not proposed), and the tokens accepted past the drafter's own path.
    pub grafted_rounds: usize,
    pub grafted_nodes: usize,
    pub grafted_accepted: usize,
    /// At the request's end: what the policy took a greedy step alone and one taken while the
    /// drafter works to cost, seconds (0 where not measured).
    pub step_secs: f64,
    pub overlapped_step_secs: f64,
}

impl PolicyStats {
    pub fn mean_nodes(&self) -> f64 {
        if self.verified_rounds == 0 {
            0.0
        } else {
            self.verified_nodes as f64 / self.verified_rounds as f64
        }
    }

    /// Mean absolute error of the predicted committed tokens per verified round.
    pub fn calibration_error(&self) -> f64 {
        if self.verified_rounds == 0 {
            0.0
        } else {
            self.abs_error / self.verified_rounds as f64
        }
    }
}

/// When to verify a prompt-lookup tree that the calibration declines anyway: its first node, as a
/// probe. Acceptance is learnt only from verified nodes, and a lookup calibration is carried from
/// request to request, so without probes a matched n-gram length whose first few lookups failed
/// would never be tried again on this server, however well the text it serves later repeats
/// itself (on the toy world's doc request the lookups that do get verified add about 3%). The
/// probes back off as the drafter's do: 1, 2, 4 … `RoundPolicy::MAX_WAIT` declined lookups apart
/// while they keep failing, at most a verify pass of two rows in place of a step each time.
#[derive(Clone, Copy, Debug, Default)]
struct LookupProbe {
    wait: u32,
    streak: u32,
}

impl LookupProbe {
    /// A declined lookup: whether to probe it now (and if so, how long to wait for the next).
    fn due(&mut self) -> bool {
        if self.wait > 0 {
            self.wait -= 1;
            return false;
        }
        (self.wait, self.streak) = back_off_after(self.streak);
        true
    }

    /// A lookup the calibration chose to verify: the back-off starts over.
    fn reset(&mut self) {
        *self = Self::default();
    }
}

/// A round's tree grafted from the drafter's and a prompt lookup's
/// ([`RoundPolicy::choose_grafted`]): the verified nodes each source proposed, as trees of their
/// own (a node both proposed is in both).
#[derive(Clone, Debug)]
pub struct Grafted {
    pub drafted: Tree,
    pub looked_up: Tree,
    /// The length of the suffix n-gram the lookup matched.
    pub ngram: usize,
    /// How many of the verified nodes only the lookup proposed.
    pub lookup_only: usize,
}

/// What a verified round's cycle holds beyond the round itself: tokens, and seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Cycle {
    tokens: f64,
    secs: f64,
}

/// What a verified round is judged in beside its nodes: the target's entropy at its root, the
/// deepest a tree may go, and how long the verifier sat idle waiting for the tree, seconds.
#[derive(Clone, Copy, Debug)]
struct RoundSetting {
    root_entropy: Option<f64>,
    horizon: usize,
    idle: f64,
}

/// What the last verified round expected, to be compared with what it committed.
#[derive(Clone, Copy, Debug)]
struct Pending {
    expected: f64,
}

/// The auto policy of one generation.
#[derive(Clone, Debug, Default)]
pub struct RoundPolicy {
    /// Greedy step (one row) and verify pass costs, seconds.
    pub verify: VerifyCost,
    /// Drafter compute and hop per drafted round, seconds.
    pub draft: DraftCost,
    pub calibration: Calibration,
    /// The same for prompt-lookup trees, indexed by the length of the matched suffix n-gram
    /// (from the prior of [`glance_spec::prompt_lookup::lookup_tree`] to each depth's observed
    /// acceptance). Carried whole from request to request: how often text repeats itself is the
    /// workload's, and a lookup round that does not pay costs a verify pass each time it is
    /// relearnt.
    lookup: Vec<Calibration>,
    /// When to verify a lookup tree the calibration declines anyway, per matched n-gram length.
    lookup_probes: Vec<LookupProbe>,
    pub law: OnlineLaw,
    /// Committed tokens per drafted, verified round, when the law has no fit yet.
    recent_commit: Ewma,
    /// Nodes verified per round, for the pre-draft estimate.
    recent_nodes: Ewma,
    /// Whether a tree's first node was accepted (1) or not (0, a stale tree included): the
    /// chance a greedy step taken while drafting leaves the tree.
    first_accepted: Ewma,
    /// A greedy step taken while the drafter works, seconds. Where the two services share a
    /// machine's cores, caches or memory bandwidth it costs more than a step alone (`verify`'s
    /// one-row bucket), and the steps a draft overlaps are not free: the policy charges the
    /// difference to the round.
    overlapped_step: Ewma,
    /// Greedy steps taken while the tree now in flight was drafted.
    steps_in_flight: usize,
    /// Greedy steps left before the next probe, and the current back-off exponent.
    wait: u32,
    streak: u32,
    /// The next drafted round verifies its whole tree (a probe: acceptance is learnt only from
    /// verified nodes, so declining every tree would never find out that trees pay).
    explore: bool,
    /// Whole-tree rounds verified so far (up to WARM_UP_ROUNDS).
    warm_up_rounds: usize,
    pending: Option<Pending>,
    pub stats: PolicyStats,
}

impl RoundPolicy {
    /// Longest wait between probes, in greedy steps: a probe that does not pay costs a draft and a
    /// verify pass, a few percent of this many steps.
    const MAX_WAIT: u32 = 64;

    /// Rounds that verify their whole tree before the policy trusts its calibration (the first
    /// ones the server ever drafts: the state carries over from request to request).
    const WARM_UP_ROUNDS: usize = 2;

    /// A fresh policy with a verify cost curve (the start-up sweep).
    pub fn with_costs(verify: VerifyCost) -> Self {
        Self { verify, ..Self::default() }
    }

    /// This policy as the next request's starting point: what was learnt (costs, calibration, the
    /// entropy law, recent acceptance, how long probes have kept failing) kept, the evidence of
    /// the calibration and the law's scale weighed down, the request's stats zeroed. A request
    /// opens with a probe: it may be one where drafting pays (a chart after a page of random
    /// words); if the probe does not pay, the carried back-off is long at once. The probe never
    /// holds up the steps ([`RoundPolicy::step_while_drafting`]).
    pub fn for_new_request(&self) -> Self {
        Self {
            wait: 0,
            explore: true,
            pending: None,
            steps_in_flight: 0,
            law: self.law.for_new_request(),
            calibration: self.calibration.for_new_request(),
            stats: PolicyStats::default(),
            ..self.clone()
        }
    }

    /// This policy, the one the last request of the same instruction ended with, as the next such
    /// request's starting point: as [`RoundPolicy::for_new_request`], but without the opening
    /// probe, the probe back-off going on where that request left it, and with `now`'s costs (the
    /// machine's, measured since by any request). A request of an instruction never seen opens
    /// with a probe because nobody knows whether its trees pay; for a known one the instruction's
    /// own rounds say so. Another page of random words is no easier to draft than the last: where
    /// trees did not pay, the next probe waits out its turn across requests instead of opening
    /// each one (on a 30-token answer, an opening probe's context rows and the steps taken beside
    /// the drafter cost a few percent); where they paid, the first round drafts at once.
    pub fn for_same_instruction(&self, now: &RoundPolicy) -> Self {
        Self {
            wait: self.wait,
            explore: false,
            verify: now.verify.clone(),
            draft: now.draft,
            overlapped_step: now.overlapped_step,
            ..self.for_new_request()
        }
    }

    /// Whether a greedy step should read back the target's entropy at its token: only when the
    /// next decision will read it, i.e. the law can use it and that decision is neither a wait
    /// step nor a probe (a verify round always reads it, to feed the law).
    pub fn wants_step_entropy(&self) -> bool {
        self.law.is_fitted() && self.wait == 0 && !self.explore
    }

    /// Before a round: ask the drafter, or take a greedy step? `root_entropy` is the target's at
    /// the pending root (nats), when known; `horizon` the deepest a tree may go; `context_rows`
    /// the rows the request will carry. The drafting overlaps greedy steps (see
    /// [`RoundPolicy::step_while_drafting`]), so a round is worth asking for when its cycle (those
    /// steps' tokens and what the tree adds beyond them, over the steps' time beside the drafter,
    /// the idle rest of the draft and the verify pass) beats greedy decoding.
    pub fn should_draft(&mut self, root_entropy: Option<f64>, horizon: usize, context_rows: usize) -> bool {
        if self.wait > 0 {
            self.wait -= 1;
            // The round after a wait is a probe.
            self.explore = self.wait == 0;
            return false;
        }
        if self.explore {
            return true;
        }
        let (Some(step), Some(draft)) = (self.verify.estimate(1), self.draft.estimate(context_rows)) else {
            return true; // nothing measured yet: probe
        };
        let expected = root_entropy
            .and_then(|h| self.law.expected_commit(h, horizon))
            .or(self.recent_commit.get())
            .unwrap_or(f64::INFINITY);
        let Some(verify) = self.typical_verify() else { return true };
        // The cycle's tokens (the greedy steps beside the drafter, then the round below them: the
        // law and the recent commits are of rounds verified after their steps) over its time,
        // against greedy decoding's rate, as the round is settled.
        let cycle = self.draft_cycle(draft, step);
        if (cycle.tokens + expected) / (cycle.secs + verify) >= 1.0 / step {
            return true;
        }
        self.back_off();
        false
    }

    /// What a greedy step costs while the drafter works: as measured, else a step's `step`.
    fn overlapped_step_cost(&self, step: f64) -> f64 {
        self.overlapped_step.get().unwrap_or(step)
    }

    /// The request's stats, with the step costs the policy ended it with.
    pub fn final_stats(&self) -> PolicyStats {
        PolicyStats {
            step_secs: self.verify.estimate(1).unwrap_or(0.0),
            overlapped_step_secs: self.overlapped_step.get().unwrap_or(0.0),
            ..self.stats
        }
    }

    /// A greedy step taken because the drafter was not asked (counted where it is taken: a
    /// prompt-lookup round may take its place).
    pub fn observe_greedy_step(&mut self) {
        self.stats.greedy_steps += 1;
    }

    /// While a tree is being drafted (sent `elapsed` seconds ago with `context_rows` rows): take a
    /// greedy step rather than wait?
    pub fn step_while_drafting(&self, context_rows: usize, elapsed: f64) -> bool {
        // A probe is asked for because nobody knows whether trees pay: waiting for it would
        // charge greedy decoding for the doubt. Stepped past, it costs only what it verifies.
        if self.explore {
            return true;
        }
        match (self.verify.estimate(1), self.draft.estimate(context_rows)) {
            // Pessimistic about the remaining time: a step that runs past the tree's arrival is
            // the one loss stepping can make.
            (Some(step), Some(draft)) => {
                self.steps_at(draft - self.draft.error() - elapsed, self.overlapped_step_cost(step))
            }
            // Nothing measured yet: a step is the safe guess.
            _ => true,
        }
    }

    /// Whether to step (a step costing `step` while the drafter works) with `remaining` seconds of
    /// draft time expected. A step whose token the tree would have accepted first anyway loses
    /// only the time it runs past the tree's arrival (nothing when at least a step remains); one
    /// whose token the tree lacks saves the wait and the verify pass that would have committed
    /// just the bonus. So step when at least a step remains, else when
    /// (1 − a)·(wait + verify − step) > a·(step − wait), with `a` the recent chance that a tree's
    /// first node is accepted.
    fn steps_at(&self, remaining: f64, step: f64) -> bool {
        let wait = remaining.max(0.0);
        if wait >= step {
            return true;
        }
        let a = self.first_accepted.get().unwrap_or(0.5);
        let verify = self.typical_verify().unwrap_or(step);
        (1.0 - a) * (wait + verify - step) > a * (step - wait)
    }

    /// A verify pass of the size rounds have recently verified (root + nodes), seconds.
    fn typical_verify(&self) -> Option<f64> {
        let nodes = self.recent_nodes.get().unwrap_or(1.0).round().max(1.0) as usize;
        self.verify.estimate(nodes + 1)
    }

    /// How a draft of `draft` seconds overlaps greedy steps of `step` seconds under
    /// [`RoundPolicy::step_while_drafting`]: the steps taken before the tree arrives (a tree that
    /// has arrived is taken, not stepped past) and the idle rest.
    fn overlap(&self, draft: f64, step: f64) -> (usize, f64) {
        let mut steps = 0;
        while draft - steps as f64 * step > 0.0 && self.steps_at(draft - steps as f64 * step, step) {
            steps += 1;
        }
        (steps, (draft - steps as f64 * step).max(0.0))
    }

    /// A greedy step taken while the drafter worked, and its time (kept apart from the steps
    /// taken alone: see `overlapped_step`).
    pub fn observe_overlapped_step(&mut self, secs: f64) {
        self.stats.overlapped_steps += 1;
        self.steps_in_flight += 1;
        self.overlapped_step.observe(secs);
    }

    /// Whether a drafted round paid: its `committed` tokens (the overlapped steps' included) in its
    /// time (those steps, the `idle` wait for the tree and a `verify` pass) against greedy
    /// decoding's. A back-off when not; the steps of the next flight are counted afresh. A stale
    /// tree (`verify` None: nothing verified) never pays: it backs off when its steps were
    /// dearer than steps alone, else leaves the back-off as it was.
    fn settle_flight(&mut self, committed: f64, idle: f64, verify: Option<f64>) {
        let steps = std::mem::take(&mut self.steps_in_flight) as f64;
        // (Measured whenever a verify pass is: the curve holds flat downwards.)
        let Some(step) = self.verify.estimate(1) else { return };
        let overlapped = steps * self.overlapped_step_cost(step);
        match verify {
            Some(verify) if (steps + committed) / (overlapped + idle + verify) >= 1.0 / step => {
                self.streak = 0
            }
            None if overlapped <= steps * step => {}
            _ => self.back_off(),
        }
    }

    /// A tree that arrived after the overlapped steps had left it, or had passed its whole depth:
    /// nothing of it is verified, but it is an observation all the same. Its path held the first
    /// `followed` step tokens, so verified at once it would have accepted `followed` nodes; the
    /// law and the recent commit learn that, or a drafter whose trees keep going stale would keep
    /// being asked on the strength of older, verified rounds.
    pub fn observe_stale_tree(&mut self, followed: usize, root_entropy: Option<f64>, horizon: usize) {
        // A probe that went stale has been answered too.
        self.explore = false;
        self.stats.stale_trees += 1;
        self.first_accepted.observe(if followed == 0 { 0.0 } else { 1.0 });
        self.recent_commit.observe((followed + 1) as f64);
        if let Some(h) = root_entropy {
            self.law.observe(h, followed, horizon);
        }
        self.settle_flight(0.0, 0.0, None);
    }

    /// After the drafter answered: which of the tree's nodes to verify (ascending; none: the
    /// round is a greedy step), the n most likely ones by the calibrated acceptance (a tree of
    /// its own, [`Tree::select`]). While drafting goes on, every verified round is followed by
    /// the next draft, and the wider the round, the fewer drafts per token: so n maximises the
    /// tokens of the cycle (the round's E(n), and the greedy steps the next draft overlaps) over
    /// its time (t_verify(1 + n) and that draft's), against a greedy step's rate. When no cycle
    /// beats greedy decoding, drafting will stop, and this draft is paid already: then the verify
    /// pass is weighed alone, argmax over n of E(n) / t_verify(1 + n).
    pub fn choose_nodes(&mut self, tree: &Tree) -> Vec<usize> {
        let acceptance = self.calibration.acceptance(tree);
        self.choose_by_acceptance(&acceptance)
    }

    /// [`RoundPolicy::choose_nodes`] for the drafted tree with the prompt-lookup tree found at the
    /// same root (matched n-gram length `ngram`) grafted on ([`Tree::graft`]): one verify pass
    /// checks both, so a round gains the lookup's long runs where the text repeats itself and the
    /// head's guesses elsewhere, for the rows it adds. Each source's nodes are calibrated on their
    /// own; a node both propose counts with the likelier claim. Returns the nodes to verify and
    /// each source's share of them, which its calibration learns from
    /// ([`RoundPolicy::observe_grafted`]).
    pub fn choose_grafted(&mut self, drafted: &Tree, ngram: usize, looked_up: &Tree) -> (Tree, Grafted) {
        let (union, index) = drafted.graft(looked_up);
        let mut acceptance = self.calibration.acceptance(drafted);
        acceptance.resize(union.len(), 0.0);
        let claims = self.lookup_acceptance(ngram, looked_up);
        for (&i, claim) in index.iter().zip(claims) {
            acceptance[i] = acceptance[i].max(claim);
        }
        // A path is never more likely than its parent's, whichever source claimed which.
        for i in 0..union.len() {
            if let Ok(parent) = usize::try_from(union.parents[i]) {
                acceptance[i] = acceptance[i].min(acceptance[parent]);
            }
        }
        let chosen = self.choose_by_acceptance(&acceptance);
        let is_chosen = |i: usize| chosen.binary_search(&i).is_ok();
        let drafted_kept: Vec<usize> = (0..drafted.len()).filter(|&i| is_chosen(i)).collect();
        if drafted_kept.is_empty() && !chosen.is_empty() {
            // The lookup alone pays: the drafter backs off as after a declined tree, and the round
            // counts as a lookup round in place of a step ([`RoundPolicy::observe_grafted`]).
            self.back_off_drafting();
        }
        let looked_up_kept: Vec<usize> = (0..looked_up.len()).filter(|&j| is_chosen(index[j])).collect();
        let grafted = Grafted {
            drafted: drafted.select(&drafted_kept),
            looked_up: looked_up.select(&looked_up_kept),
            ngram,
            lookup_only: chosen.len() - drafted_kept.len(),
        };
        (union.select(&chosen), grafted)
    }

    /// The nodes to verify of a tree whose nodes have the calibrated `acceptance` (each no more
    /// than its parent's, parents first), ascending: see [`RoundPolicy::choose_nodes`].
    fn choose_by_acceptance(&mut self, acceptance: &[f64]) -> Vec<usize> {
        // Probes after a back-off choose like any round: depths never verified are trusted as the
        // depth above them proved to be ([`Calibration`]), so they are tried as soon as they
        // could pay.
        self.explore = false;
        if self.warm_up_rounds < Self::WARM_UP_ROUNDS {
            self.warm_up_rounds += 1;
            let expected = 1.0 + acceptance.iter().sum::<f64>();
            self.pending = Some(Pending { expected });
            return (0..acceptance.len()).collect();
        }
        let order = by_acceptance(acceptance);
        let sorted: Vec<f64> = order.iter().map(|&i| acceptance[i]).collect();
        let mut choice = self.best_prefix(&sorted, self.next_draft().unwrap_or_default());
        if choice.0 == 0 {
            choice = self.best_prefix(&sorted, Cycle::default());
        }
        let (best, best_expected) = choice;
        tracing::debug!(
            nodes = best,
            of = acceptance.len(),
            expected = best_expected,
            step_ms = self.verify.estimate(1).unwrap_or(0.0) * 1e3,
            verify_ms = self.verify.estimate(best + 1).unwrap_or(0.0) * 1e3,
            "auto: nodes to verify"
        );
        if best == 0 {
            self.stats.declined_trees += 1;
            self.back_off_drafting();
            self.pending = None;
        } else {
            self.pending = Some(Pending { expected: best_expected });
        }
        let mut chosen = order[..best].to_vec();
        chosen.sort_unstable();
        chosen
    }

    /// A drafted tree none of whose nodes pays: the draft was not worth asking for.
    fn back_off_drafting(&mut self) {
        self.steps_in_flight = 0;
        self.back_off();
    }

    /// What the next draft adds to a verified round's cycle, as the policy expects it.
    fn next_draft(&self) -> Option<Cycle> {
        Some(self.draft_cycle(self.draft.estimate(1)?, self.verify.estimate(1)?))
    }

    /// A draft of `draft` seconds with greedy steps of `step` seconds alone: the steps it
    /// overlaps (at their cost beside the drafter), and its time (those steps and the idle rest).
    fn draft_cycle(&self, draft: f64, step: f64) -> Cycle {
        let overlapped = self.overlapped_step_cost(step);
        let (steps, idle) = self.overlap(draft, overlapped);
        Cycle { tokens: steps as f64, secs: steps as f64 * overlapped + idle }
    }

    /// The first n nodes (of acceptance probabilities `acceptance`, in the order they would be
    /// verified) that maximise expected committed tokens per second of their round with `cycle`
    /// added to it (n = 0 being the greedy step, which has no cycle), and the tokens the round is
    /// expected to commit. With a cost not yet measured, the whole tree (so its cost gets
    /// measured).
    fn best_prefix(&self, acceptance: &[f64], cycle: Cycle) -> (usize, f64) {
        let (mut best, mut best_rate, mut best_expected) = (0usize, f64::NEG_INFINITY, 1.0);
        let mut expected = 1.0;
        for n in 0..=acceptance.len() {
            if n > 0 {
                expected += acceptance[n - 1];
            }
            let Some(cost) = self.verify.estimate(n + 1) else {
                return (acceptance.len(), expected + acceptance[n..].iter().sum::<f64>());
            };
            let rate = match n {
                0 => expected / cost,
                _ => (expected + cycle.tokens) / (cost + cycle.secs),
            };
            if rate > best_rate {
                (best, best_rate, best_expected) = (n, rate, expected);
            }
        }
        (best, best_expected)
    }

    /// A prompt-lookup tree ([`glance_spec::prompt_lookup::lookup_tree`], whose claims halve with
    /// each depth: an unproven lookup is expected to add about one token, not to be accepted
    /// whole) found by a suffix n-gram of length `ngram`, in place of a greedy step: how many of
    /// its best-first nodes to verify (0: none, the step is taken). Free to propose, so only its
    /// verify pass is weighed.
    /// Where none pays, the first node now and then all the same ([`LookupProbe`]).
    pub fn choose_lookup_nodes(&mut self, ngram: usize, tree: &Tree) -> usize {
        let acceptance = self.lookup_acceptance(ngram, tree);
        let best = self.best_prefix(&acceptance, Cycle::default()).0;
        if self.lookup_probes.len() <= ngram {
            self.lookup_probes.resize(ngram + 1, LookupProbe::default());
        }
        let probe = &mut self.lookup_probes[ngram];
        if best > 0 {
            probe.reset();
            best
        } else {
            usize::from(!tree.is_empty() && probe.due())
        }
    }

    /// A verified prompt-lookup round: the tree's `verified` first nodes, and the accepted path.
    pub fn observe_lookup_round(&mut self, ngram: usize, tree: &Tree, verified: usize, path: &[usize]) {
        self.lookup_calibration(ngram).observe(tree, verified, path);
        self.stats.lookup_rounds += 1;
        self.stats.lookup_nodes += verified;
        self.stats.lookup_accepted += path.len();
    }

    /// Calibrated acceptance of a lookup tree's nodes for a match of `ngram` tokens (the prior
    /// where that length was never verified).
    fn lookup_acceptance(&self, ngram: usize, tree: &Tree) -> Vec<f64> {
        self.lookup.get(ngram).map_or_else(
            || Calibration::default().acceptance(tree),
            |calibration| calibration.acceptance(tree),
        )
    }

    fn lookup_calibration(&mut self, ngram: usize) -> &mut Calibration {
        if self.lookup.len() <= ngram {
            self.lookup.resize(ngram + 1, Calibration::default());
        }
        &mut self.lookup[ngram]
    }

    /// A drafted round's drafter-side time (compute + hop, from sending to the tree's arrival),
    /// seconds, for a round of `context_rows` rows.
    pub fn observe_draft(&mut self, context_rows: usize, secs: f64) {
        self.draft.observe(context_rows, secs);
    }

    /// A verify pass (or greedy step) over `rows` rows took `secs`.
    pub fn observe_verify(&mut self, rows: usize, secs: f64) {
        self.verify.observe(rows, secs);
    }

    /// A verified round: the tree, how many of its nodes were verified, the accepted path, the
    /// target's entropy at the round's root, and how long the verifier sat idle waiting for the
    /// tree (the draft time the overlapped greedy steps did not hide).
    pub fn observe_round(
        &mut self,
        tree: &Tree,
        verified: usize,
        path: &[usize],
        root_entropy: Option<f64>,
        horizon: usize,
        idle: f64,
    ) {
        self.settle_expectation(path.len() + 1);
        self.learn_from_drafted(tree, verified, path, RoundSetting { root_entropy, horizon, idle });
    }

    /// A verified round of a grafted tree ([`RoundPolicy::choose_grafted`]) that accepted the
    /// tokens `accepted`. The drafter is judged on its own nodes (the lookup would have been
    /// verified without it, in place of a greedy step), the lookup's calibration on its own.
    pub fn observe_grafted(
        &mut self,
        grafted: &Grafted,
        accepted: &[TokenId],
        root_entropy: Option<f64>,
        horizon: usize,
        idle: f64,
    ) {
        self.settle_expectation(accepted.len() + 1);
        let drafted_path = grafted.drafted.nodes_along(accepted);
        let looked_up_path = grafted.looked_up.nodes_along(accepted);
        self.lookup_calibration(grafted.ngram).observe(
            &grafted.looked_up,
            grafted.looked_up.len(),
            &looked_up_path,
        );
        let drafted = &grafted.drafted;
        if drafted.is_empty() {
            // None of the drafter's nodes was verified ([`RoundPolicy::choose_grafted`]): a lookup
            // round in place of a step, which says nothing of what the drafter would have committed.
            self.stats.lookup_rounds += 1;
            self.stats.lookup_nodes += grafted.looked_up.len();
            self.stats.lookup_accepted += accepted.len();
            return;
        }
        if grafted.lookup_only > 0 {
            self.stats.grafted_rounds += 1;
            self.stats.grafted_nodes += grafted.lookup_only;
            self.stats.grafted_accepted += accepted.len() - drafted_path.len();
        }
        let setting = RoundSetting { root_entropy, horizon, idle };
        self.learn_from_drafted(drafted, drafted.len(), &drafted_path, setting);
    }

    /// Compares what the last chosen round was expected to commit with what it did.
    fn settle_expectation(&mut self, committed: usize) {
        if let Some(pending) = self.pending.take() {
            self.stats.abs_error += (pending.expected - committed as f64).abs();
        }
    }

    /// What a verified round says of the drafter: `verified` nodes of its `tree` checked, the
    /// accepted `path` among them.
    fn learn_from_drafted(&mut self, tree: &Tree, verified: usize, path: &[usize], setting: RoundSetting) {
        let RoundSetting { root_entropy, horizon, idle } = setting;
        self.calibration.observe(tree, verified, path);
        let committed = (path.len() + 1) as f64;
        self.stats.verified_rounds += 1;
        self.stats.verified_nodes += verified;
        self.recent_commit.observe(committed);
        self.recent_nodes.observe(verified as f64);
        self.first_accepted.observe(if path.is_empty() { 0.0 } else { 1.0 });
        if let Some(h) = root_entropy {
            self.law.observe(h, path.len(), horizon);
        }
        match self.verify.estimate(verified + 1) {
            Some(verify) => self.settle_flight(committed, idle, Some(verify)),
            // A pass not measured yet cannot be judged: the round counts as paid.
            None => {
                self.steps_in_flight = 0;
                self.streak = 0;
            }
        }
    }

    /// Waits 1, 2, 4 … MAX_WAIT greedy steps before the next probe, doubling on each failure.
    fn back_off(&mut self) {
        (self.wait, self.streak) = back_off_after(self.streak);
    }
}

/// The probes' back-off (the drafter's and the lookups'): after `streak` failures in a row, the
/// wait before the next probe (1, 2, 4 … `RoundPolicy::MAX_WAIT`) and the streak with this one.
fn back_off_after(streak: u32) -> (u32, u32) {
    let wait = (1u32 << streak).min(RoundPolicy::MAX_WAIT);
    (wait, (streak + 1).min(RoundPolicy::MAX_WAIT.trailing_zeros()))
}

/// Synthetic drafters and cost curves the policy's tests (and its memory's) drive it with.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// A chain of `len` nodes whose path log-probabilities claim `q` per step.
    pub(crate) fn chain(len: usize, q: f64) -> Tree {
        let mut tree = Tree::default();
        for d in 0..len {
            tree.push(d as u32, d as i32 - 1, (d + 1) as f64 * q.ln());
        }
        tree
    }

    /// A verify cost curve: `base` seconds for one row plus `per_row` for each further row.
    pub(crate) fn costs(base: f64, per_row: f64) -> VerifyCost {
        let mut verify = VerifyCost::default();
        for rows in [1, 2, 4, 8, 16, 32, 64] {
            verify.observe(rows, base + per_row * (rows - 1) as f64);
        }
        verify
    }

    /// Runs `rounds` rounds against a drafter whose chain of `len` nodes claims `claimed` per
    /// token while the target accepts the first `accepted` nodes of every verified prefix.
    pub(crate) fn simulate(
        policy: &mut RoundPolicy,
        rounds: usize,
        len: usize,
        claimed: f64,
        accepted: usize,
    ) {
        for _ in 0..rounds {
            if !policy.should_draft(None, len, 1) {
                policy.observe_greedy_step();
                continue;
            }
            policy.observe_draft(1, 0.001);
            let tree = chain(len, claimed);
            let n = policy.choose_nodes(&tree).len();
            if n == 0 {
                continue;
            }
            let path: Vec<usize> = (0..accepted.min(n)).collect();
            policy.observe_round(&tree, n, &path, None, len, 0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{chain, costs, simulate};
    use super::*;

    #[test]
    fn verify_costs_interpolate_and_never_extrapolate_downwards() {
        let mut verify = VerifyCost::default();
        verify.observe(1, 1.0);
        verify.observe(8, 2.0);
        assert_eq!(verify.estimate(1), Some(1.0));
        assert!((verify.estimate(4).unwrap() - (1.0 + 3.0 / 7.0)).abs() < 1e-9);
        assert_eq!(verify.estimate(16), Some(4.0));
        let mut sparse = VerifyCost::default();
        sparse.observe(16, 3.0);
        assert_eq!(sparse.estimate(2), Some(3.0));
        assert_eq!(VerifyCost::default().estimate(4), None);
        // A noisy middle bucket is pooled with its neighbour: the curve never goes down.
        let mut noisy = VerifyCost::default();
        for (rows, cost) in [(1, 1.0), (2, 5.0), (4, 3.0), (8, 6.0)] {
            noisy.observe(rows, cost);
        }
        let curve: Vec<f64> = [1, 2, 3, 4, 6, 8].iter().map(|&r| noisy.estimate(r).unwrap()).collect();
        assert!(curve.windows(2).all(|w| w[0] <= w[1]), "{curve:?}");
        assert_eq!(noisy.estimate(2), Some(4.0));
    }

    #[test]
    fn drafting_overlaps_greedy_steps_while_a_step_remains_and_beyond_for_a_poor_drafter() {
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.0001));
        assert!(policy.step_while_drafting(1, 0.0), "nothing measured: step");
        policy.observe_draft(4, 0.0035);
        assert!(policy.step_while_drafting(4, 0.0));
        assert!(policy.step_while_drafting(4, 0.0025), "a whole step remains");
        // Less than a step remains: step only if the tree's first node is often wrong.
        for _ in 0..20 {
            policy.first_accepted.observe(1.0);
        }
        assert!(!policy.step_while_drafting(4, 0.0031));
        assert_eq!(policy.overlap(0.0035, 0.001).0, 3);
        for _ in 0..20 {
            policy.first_accepted.observe(0.0);
        }
        assert!(policy.step_while_drafting(4, 0.0031));
        // Draft times that vary make the rule keep a margin: with rounds of 3 and 5 ms, at 2.2 ms
        // the mean leaves 1.8 ms (more than a step) but a round may come in within the step.
        let mut noisy = RoundPolicy::with_costs(costs(0.001, 0.0001));
        for _ in 0..20 {
            noisy.first_accepted.observe(1.0);
        }
        for i in 0..40 {
            noisy.observe_draft(4, if i % 2 == 0 { 0.003 } else { 0.005 });
        }
        assert!(noisy.draft.error() > 0.0005, "{}", noisy.draft.error());
        assert!(noisy.step_while_drafting(4, 0.0));
        assert!(!noisy.step_while_drafting(4, 0.0022));
        // A prompt-sized first round: the per-row cost learnt from it makes the next one longer.
        policy.observe_draft(104, 0.0135);
        assert!((policy.draft.estimate(104).unwrap() - 0.0135).abs() < 1e-9);
        assert!((policy.draft.estimate(4).unwrap() - 0.0035).abs() < 1e-9);
        let (steps, idle) = policy.overlap(0.0135, 0.001);
        assert!(steps >= 13 && idle < 0.0005, "{steps} steps, {idle} s idle");
    }

    #[test]
    fn a_prompt_sized_first_round_does_not_stand_for_a_small_one() {
        let mut cost = DraftCost::default();
        cost.observe(104, 0.0135);
        assert_eq!(cost.estimate(4), Some(0.0135), "only a prompt seen: an upper bound");
        assert_eq!(cost.estimate(208), Some(0.027));
        assert_eq!(cost.per_row(), None);
        cost.observe(4, 0.0035);
        assert_eq!(cost.estimate(4), Some(0.0035));
        assert!((cost.per_row().unwrap() - 0.01 / 104.0).abs() < 1e-12);
        assert!((cost.estimate(104).unwrap() - 0.0135).abs() < 1e-12);
    }

    #[test]
    fn steps_beside_the_working_drafter_are_charged_to_its_round() {
        // Three steps taken while a tree was drafted, then the tree: verified (two of its four
        // nodes accepted, three tokens committed) or stale (nothing of it verified).
        let settle = |overlapped: f64, stale: bool| {
            let mut policy = RoundPolicy::with_costs(costs(0.001, 0.0001));
            for _ in 0..3 {
                policy.observe_overlapped_step(overlapped);
            }
            if stale {
                policy.observe_stale_tree(3, None, 4);
            } else {
                policy.observe_round(&chain(4, 0.9), 4, &[0, 1], None, 4, 0.0);
            }
            (policy.wait, policy.final_stats())
        };
        let (wait, stats) = settle(0.001, false);
        assert_eq!(wait, 0, "6 tokens in 3 + 1.4 ms pay at 1 ms a step");
        assert_eq!((stats.step_secs, stats.overlapped_step_secs), (0.001, 0.001));
        assert!(settle(0.003, false).0 > 0, "6 tokens in 9 + 1.4 ms do not");
        assert_eq!(settle(0.001, true).0, 0, "steps as fast as alone lose nothing to a stale tree");
        assert!(settle(0.0015, true).0 > 0, "dearer steps lose their difference");
        // And a slow step beside the drafter makes the rule to step keep a margin: with 1.5 ms of
        // draft left, a 1 ms step fits, a 2 ms one runs past the tree.
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.0001));
        policy.observe_draft(4, 0.0035);
        for _ in 0..20 {
            policy.first_accepted.observe(1.0);
        }
        assert!(policy.step_while_drafting(4, 0.002));
        policy.overlapped_step.observe(0.002);
        assert!(!policy.step_while_drafting(4, 0.002));
    }

    #[test]
    fn a_draft_the_greedy_steps_hide_is_asked_for_when_the_round_below_them_pays() {
        // 1 ms a step alone and beside the drafter, 0.1 ms a node; a prompt-sized draft of 3 ms,
        // so three steps run beside it; rounds of 12 nodes (a 2.1 ms pass). A round committing 4
        // tokens below those steps makes a cycle of 7 tokens in 5.1 ms: ask. One committing 1.5
        // (4.5 tokens in 5.1 ms) does not pay.
        let policy_committing = |commit: f64| {
            let mut policy = RoundPolicy::with_costs(costs(0.001, 0.0001));
            policy.warm_up_rounds = RoundPolicy::WARM_UP_ROUNDS;
            policy.observe_draft(50, 0.003);
            policy.recent_nodes.observe(12.0);
            policy.recent_commit.observe(commit);
            policy
        };
        assert_eq!(policy_committing(4.0).draft_cycle(0.003, 0.001).tokens, 3.0);
        assert!(policy_committing(4.0).should_draft(None, 15, 50));
        assert!(!policy_committing(1.5).should_draft(None, 15, 50));
    }

    #[test]
    fn a_round_verifies_wider_when_the_next_draft_is_dear() {
        // 1 ms a step, 0.1 ms a node; a chain whose nodes hold at 0.9 per depth. Its pass alone
        // pays best near ten nodes; a 20 ms draft to follow makes each round's tokens worth more.
        let mut quick = RoundPolicy::with_costs(costs(0.001, 0.0001));
        quick.warm_up_rounds = RoundPolicy::WARM_UP_ROUNDS;
        let mut slow = quick.clone();
        quick.observe_draft(1, 0.0001);
        slow.observe_draft(1, 0.02);
        let tree = chain(15, 0.9);
        let (narrow, wide) = (quick.choose_nodes(&tree).len(), slow.choose_nodes(&tree).len());
        assert!((9..=12).contains(&narrow), "{narrow}");
        assert_eq!(wide, 15);
    }

    #[test]
    fn a_drafter_never_accepted_leads_to_greedy_steps() {
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.0001));
        simulate(&mut policy, 400, 15, 0.9, 0);
        // Probes back off to one every 64 steps: nearly all rounds are greedy steps.
        let probes = policy.stats.verified_rounds + policy.stats.declined_trees;
        assert!(policy.stats.greedy_steps > 300, "{:?}", policy.stats);
        assert!(probes < 40, "{:?}", policy.stats);
    }

    #[test]
    fn trees_the_steps_keep_leaving_lead_to_greedy_steps() {
        // Learnt on earlier requests: chains of 15 accepted whole.
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.0001));
        simulate(&mut policy, 50, 15, 0.9, 15);
        let mut policy = policy.for_new_request();
        // Now (sampling, say) every tree's first node misses the step taken while it was drafted,
        // so no tree is ever verified: only the stale trees can tell.
        let mut asked = 0;
        for round in 0..400 {
            if policy.should_draft(Some(0.5), 15, 4) {
                asked += 1;
                policy.observe_draft(4, 0.0035);
                policy.observe_stale_tree(0, Some(0.5), 15);
            } else {
                policy.observe_greedy_step();
            }
            assert!(round < 40 || policy.stats.verified_rounds == 0);
        }
        assert_eq!(policy.stats.stale_trees, asked);
        assert!(asked < 40, "{asked} rounds asked the drafter: {:?}", policy.stats);
        assert!(policy.stats.greedy_steps > 350, "{:?}", policy.stats);
    }

    #[test]
    fn greedy_steps_read_the_entropy_only_for_a_decision_that_uses_it() {
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.0001));
        simulate(&mut policy, 400, 15, 0.9, 0);
        // Never accepted: the policy waits between probes, and a wait step or a probe does not
        // look at the entropy, so no step reads it back (fitted law or not).
        assert!(policy.wait > 0 || policy.explore);
        assert!(!policy.wants_step_entropy());
        let mut fresh = policy.for_new_request();
        assert!(!fresh.wants_step_entropy(), "a request opens with a probe");
        fresh.explore = false;
        fresh.wait = 0;
        assert_eq!(fresh.wants_step_entropy(), fresh.law.is_fitted());
    }

    #[test]
    fn a_steep_verify_cost_turns_drafting_off() {
        // Each row costs as much as a whole step and half of each tree is accepted: no tree pays.
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.001));
        simulate(&mut policy, 200, 15, 0.99, 7);
        assert!(policy.stats.greedy_steps + policy.stats.declined_trees > 150, "{:?}", policy.stats);
    }

    #[test]
    fn nearly_free_verification_and_high_acceptance_take_the_whole_tree() {
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.000_001));
        simulate(&mut policy, 50, 15, 0.95, 15);
        assert_eq!(policy.stats.greedy_steps, 0, "{:?}", policy.stats);
        assert!(policy.stats.mean_nodes() > 14.0, "{:?}", policy.stats);
    }

    #[test]
    fn the_nodes_verified_are_the_likeliest_and_form_a_tree() {
        // A spine the target always accepts, each node with a sibling it never does; packed
        // best-first by the drafter's claims, so spine and siblings alternate, and the spine's
        // tail (as auto asks for it) comes last.
        let mut tree = Tree::default();
        let (mut tip, mut spine) = (-1, Vec::new());
        for depth in 0..6 {
            let base = usize::try_from(tip).map_or(0.0, |t| tree.log_probs[t]);
            let next = tree.push(2 * depth, tip, base + 0.7f64.ln());
            tree.push(2 * depth + 1, tip, base + 0.25f64.ln());
            spine.push(next as usize);
            tip = next;
        }
        for depth in 6..10 {
            tip = tree.push(2 * depth, tip, tree.log_probs[tip as usize] + 0.7f64.ln());
            spine.push(tip as usize);
        }
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.000_4));
        policy.observe_draft(1, 0.002);
        for _ in 0..30 {
            policy.observe_round(&tree, tree.len(), &spine, None, 10, 0.0);
        }
        policy.warm_up_rounds = RoundPolicy::WARM_UP_ROUNDS;
        let chosen = policy.choose_nodes(&tree);
        // The spine as deep as it pays, its tail (packed after every sibling) included, and no
        // sibling: not a prefix of the packed order.
        let acceptance = policy.calibration.acceptance(&tree);
        assert!(chosen.len() > 6 && chosen[..] == spine[..chosen.len()], "{chosen:?} {acceptance:?}");
        let limits = glance_spec::tree::TreeLimits { vocab: 32, max_nodes: 32, max_depth: 10 };
        assert_eq!(tree.select(&chosen).validate(limits), Ok(()));
    }

    #[test]
    fn prompt_lookup_chains_are_verified_as_far_as_they_pay() {
        // A 16-row pass costs 1.5 steps (a memory-bound target).
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.000_033));
        let chain = glance_spec::prompt_lookup::lookup_tree(&[&[5; 8]]);
        // Nothing known yet: the prior (each token half as likely as its parent) verifies a few.
        let first = policy.choose_lookup_nodes(3, &chain);
        assert!((1..=4).contains(&first), "{first}");
        // Trigram matches whose first four tokens are always right: about four verified.
        for _ in 0..30 {
            policy.observe_lookup_round(3, &chain, 8, &[0, 1, 2, 3]);
        }
        let n = policy.choose_lookup_nodes(3, &chain);
        assert!((4..=5).contains(&n), "{n}");
        // Unigram matches that never hold: the step is taken, but for a one-node probe now and
        // then.
        for _ in 0..30 {
            policy.observe_lookup_round(1, &chain, 8, &[]);
        }
        assert_eq!(policy.stats.lookup_rounds, 60);
        assert_eq!(policy.stats.lookup_accepted, 120);
        assert_probes_back_off(&mut policy, 1, &chain);
        // On a target where each row costs a step, even the good matches do not pay.
        let mut steep = RoundPolicy::with_costs(costs(0.001, 0.001));
        for _ in 0..30 {
            steep.observe_lookup_round(3, &chain, 8, &[0]);
        }
        assert_probes_back_off(&mut steep, 3, &chain);
    }

    /// Over 200 lookups the calibration declines, with probes that fail: the first one probed at
    /// once, then ever fewer (1, 2, 4 … 64 apart), never more than the first node.
    fn assert_probes_back_off(policy: &mut RoundPolicy, ngram: usize, tree: &Tree) {
        let choices: Vec<usize> = (0..200)
            .map(|_| {
                let n = policy.choose_lookup_nodes(ngram, tree);
                if n > 0 {
                    policy.observe_lookup_round(ngram, tree, n, &[]);
                }
                n
            })
            .collect();
        let probes: Vec<usize> = (0..choices.len()).filter(|&i| choices[i] > 0).collect();
        assert!(choices.iter().all(|&n| n <= 1), "{choices:?}");
        assert_eq!(probes[..8], [0, 2, 5, 10, 19, 36, 69, 134], "{probes:?}");
        assert_eq!(probes.len(), 9, "{probes:?}");
    }

    #[test]
    fn a_lookup_grafted_onto_a_weak_tree_adds_its_run_and_each_source_learns_its_own() {
        // A 16-row pass costs 1.5 steps (a memory-bound target).
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.000_033));
        policy.observe_draft(1, 0.002);
        policy.warm_up_rounds = RoundPolicy::WARM_UP_ROUNDS;
        // The drafter's chain (tokens 0, 1, 2, 3) claims 0.6 a token and is accepted one round
        // in three; trigram lookups (tokens 7 … 12) always hold for four tokens.
        let drafted = chain(4, 0.6);
        let looked_up = glance_spec::prompt_lookup::lookup_tree(&[&[7, 8, 9, 10, 11, 12]]);
        for round in 0..30 {
            let path: &[usize] = if round % 3 == 0 { &[0] } else { &[] };
            policy.observe_round(&drafted, drafted.len(), path, None, 16, 0.0);
            policy.observe_lookup_round(3, &looked_up, looked_up.len(), &[0, 1, 2, 3]);
        }
        let (stats_before, drafter_depth_1) = (policy.stats, policy.calibration.factor(1));
        let (tree, grafted) = policy.choose_grafted(&drafted, 3, &looked_up);
        let limits = glance_spec::tree::TreeLimits { vocab: 16, max_nodes: 16, max_depth: 8 };
        assert_eq!(tree.validate(limits), Ok(()));
        // The lookup's run as far as it pays, and the drafter's likelier first node beside it.
        assert_eq!(grafted.looked_up.tokens[..4], [7, 8, 9, 10], "{tree:?}");
        assert_eq!(grafted.drafted.tokens, [0], "{tree:?}");
        assert_eq!(tree.len(), grafted.drafted.len() + grafted.looked_up.len());
        assert_eq!(grafted.ngram, 3);
        // The lookup's run held: the drafter is judged on its own node (missed), the lookup on its.
        policy.observe_grafted(&grafted, &[7, 8, 9, 10], None, 16, 0.0);
        assert_eq!(policy.stats.grafted_rounds, 1);
        assert_eq!(policy.stats.grafted_nodes, grafted.looked_up.len());
        assert_eq!(policy.stats.grafted_accepted, 4);
        assert_eq!(policy.stats.verified_rounds, stats_before.verified_rounds + 1);
        assert_eq!(
            policy.stats.lookup_rounds, stats_before.lookup_rounds,
            "a grafted round is not a lookup round"
        );
        assert!(policy.calibration.factor(1) < drafter_depth_1);
        // A lookup that proposes the drafter's own tokens adds no node and no grafted round.
        let (same, grafted) = policy.choose_grafted(&drafted, 3, &Tree::chain(&[0, 1]));
        assert!(same.len() <= drafted.len() && grafted.drafted.len() == same.len(), "{same:?}");
        policy.observe_grafted(&grafted, &[0], None, 16, 0.0);
        assert_eq!(policy.stats.grafted_rounds, 1);
        // A drafter that stopped being accepted: the lookup alone is verified, a lookup round in
        // place of a step, not a round the drafter missed; drafting backs off.
        for _ in 0..60 {
            policy.observe_round(&drafted, drafted.len(), &[], None, 16, 0.0);
        }
        let stats_before = policy.stats;
        (policy.wait, policy.streak) = (0, 0);
        let (tree, grafted) = policy.choose_grafted(&drafted, 3, &looked_up);
        assert!(grafted.drafted.is_empty() && tree.tokens[..4] == [7, 8, 9, 10], "{tree:?}");
        assert!(policy.wait > 0, "drafting did not back off");
        policy.observe_grafted(&grafted, &[7, 8, 9, 10], None, 16, 0.0);
        assert_eq!(policy.stats.verified_rounds, stats_before.verified_rounds);
        assert_eq!(policy.stats.declined_trees, stats_before.declined_trees);
        assert_eq!(policy.stats.grafted_rounds, stats_before.grafted_rounds);
        assert_eq!(policy.stats.lookup_rounds, stats_before.lookup_rounds + 1);
        assert_eq!(policy.stats.lookup_accepted, stats_before.lookup_accepted + 4);
    }

    #[test]
    fn a_lookup_length_declined_early_comes_back_once_its_probes_hold() {
        let mut policy = RoundPolicy::with_costs(costs(0.001, 0.000_033));
        let chain = glance_spec::prompt_lookup::lookup_tree(&[&[5; 8]]);
        // A server's first unigram lookups all fail: declined (but for the first probe).
        for _ in 0..30 {
            policy.observe_lookup_round(1, &chain, 8, &[]);
        }
        assert_eq!(policy.choose_lookup_nodes(1, &chain), 1);
        policy.observe_lookup_round(1, &chain, 1, &[]);
        assert_eq!(policy.choose_lookup_nodes(1, &chain), 0);
        // Then the text starts repeating itself: the next probe's token holds, and from then on
        // the calibration verifies the lookups by itself, every time.
        let verified: Vec<usize> = (0..20)
            .map(|_| {
                let n = policy.choose_lookup_nodes(1, &chain);
                if n > 0 {
                    policy.observe_lookup_round(1, &chain, n, &(0..n.min(3)).collect::<Vec<_>>());
                }
                n
            })
            .collect();
        assert_eq!(verified[0], 1, "the probe is due: {verified:?}");
        assert!(verified[1..].iter().all(|&n| n >= 1), "{verified:?}");
    }

    #[test]
    fn calibration_converges_to_a_known_overclaim() {
        // The drafter claims 0.9 at depth 1; the target accepts depth 1 half the time.
        let mut calibration = Calibration::default();
        let tree = chain(1, 0.9);
        for round in 0..400 {
            let path: &[usize] = if round % 2 == 0 { &[0] } else { &[] };
            calibration.observe(&tree, 1, path);
        }
        let acceptance = calibration.acceptance(&tree)[0];
        assert!((acceptance - 0.5).abs() < 0.05, "calibrated acceptance {acceptance}");
        assert!((calibration.factor(1) - 0.5 / 0.9).abs() < 0.06);
    }

    #[test]
    fn a_depth_never_verified_is_trusted_as_the_one_above_it() {
        // A prompt-lookup run claims 1/2, 1/4, 1/8, 1/16 down its chain; verified to depth 3, it
        // is accepted whole every time.
        let mut calibration = Calibration::default();
        let tree = chain(4, 0.5);
        for _ in 0..40 {
            calibration.observe(&tree, 3, &[0, 1, 2]);
        }
        let a = calibration.acceptance(&tree);
        assert!(a[2] > 0.9, "{a:?}");
        // Depth 4 was never verified: its claim counts as depth 3's did (α_3 ≈ 8), not at face
        // value (1/16), so it is worth verifying the next time.
        assert!((calibration.factor(4) - calibration.factor(3)).abs() < 1e-9);
        assert!(calibration.factor(3) > 7.0 && a[3] > 0.4, "{a:?}");
        // A drafter that overclaims at depth 1 is not trusted more below it.
        let mut drafter = Calibration::default();
        for round in 0..100 {
            drafter.observe(&chain(1, 0.9), 1, if round % 4 == 0 { &[0] } else { &[] });
        }
        assert!(drafter.factor(2) < 0.4 && drafter.factor(5) < 0.4, "{}", drafter.factor(2));
    }

    #[test]
    fn a_child_is_never_more_likely_than_its_parent() {
        let mut calibration = Calibration::default();
        let tree = chain(2, 0.8);
        // Depth 2 always accepted when verified, depth 1 rarely: α_2 > α_1.
        for _ in 0..50 {
            calibration.observe(&tree, 2, &[0, 1]);
        }
        for _ in 0..50 {
            calibration.observe(&chain(1, 0.8), 1, &[]);
        }
        let a = calibration.acceptance(&tree);
        assert!(a[1] <= a[0], "{a:?}");
    }

    #[test]
    fn the_law_follows_a_kind_of_request_that_sits_off_its_curve() {
        // Fitted on sure rounds that accept a lot (charts, say) …
        let mut law = OnlineLaw::default();
        for i in 0..64 {
            let low = i % 2 == 0;
            law.observe(if low { 0.01 } else { 3.0 }, if low { 12 } else { 0 }, 15);
        }
        let fitted = law.expected_commit(0.01, 15).unwrap();
        assert!(fitted > 8.0, "{fitted}");
        // … then a document at the same entropy whose rounds accept nothing: within a few rounds
        // the prediction falls below a greedy step's worth of two tokens.
        for _ in 0..8 {
            law.observe(0.01, 0, 15);
        }
        let doc = law.expected_commit(0.01, 15).unwrap();
        assert!(doc < 2.0, "{doc} (scale {})", law.scale());
        // And back: charts again restore it.
        for _ in 0..6 {
            law.observe(0.01, 12, 15);
        }
        assert!(law.expected_commit(0.01, 15).unwrap() > 8.0);
    }

    #[test]
    fn the_law_predicts_more_at_low_entropy_once_fitted() {
        let mut law = OnlineLaw::default();
        for i in 0..64 {
            let low = i % 2 == 0;
            law.observe(if low { 0.05 } else { 3.0 }, if low { 12 } else { 0 }, 15);
        }
        let (sure, unsure) = (law.expected_commit(0.05, 15).unwrap(), law.expected_commit(3.0, 15).unwrap());
        assert!(sure > 5.0 && unsure < 2.0, "{sure} vs {unsure}");
    }
}
