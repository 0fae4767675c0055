//! The engines behind the service: the GLANCE block head (one draft pass per round, then the
//! best-first tree from the per-offset marginals) and the EAGLE-3 head (a pass over the new
//! context, then one pass per tree depth). (Prompt lookup is in `glance_spec::prompt_lookup`.)

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use glance_models::kv_cache::KvCache;
use glance_models::TargetConfig;
use glance_spec::session::{
    DraftEngine, DraftError, DrafterKind, Handshake, RoundInput, Session, TokenHistory, MAX_TREE_NODES,
};
use glance_spec::tree::{build_budget_tree, extend_spine, TokenId, Tree};
use tch::{Device, Kind, Tensor};

use crate::draft_vocab::DraftVocabChoice;
use crate::eagle3::{Eagle3Head, TreeShape};
use crate::head::{DraftHead, HeadError};

/// The head shared by concurrent sessions.
struct SharedHead(DraftHead);

// SAFETY: after loading, the head's tensors are never written; sessions only run forward passes
// that read them, which libtorch allows from several threads at once. Each session's mutable state
// (its draft KV cache) is its own.
unsafe impl Sync for SharedHead {}

impl std::ops::Deref for SharedHead {
    type Target = DraftHead;

    fn deref(&self) -> &DraftHead {
        &self.0
    }
}

pub struct BlockHeadEngine {
    head: Arc<SharedHead>,
    fingerprint: String,
    max_context: usize,
    last_pass: Arc<LastPass>,
}

/// When any session of the engine last ran the head: a session opening after the head has sat
/// idle warms it ([`Session::warm`]); one opening while others draft finds it warm already.
struct LastPass {
    epoch: Instant,
    /// Microseconds since `epoch` at the end of the last pass.
    micros: AtomicU64,
}

impl LastPass {
    /// Idle longer than this, the head's weights are taken to have left the caches (a 10 ms
    /// pause cost the toy head's next pass about 0.3 ms).
    const COLD_AFTER: Duration = Duration::from_millis(5);

    fn new() -> Self {
        Self { epoch: Instant::now(), micros: AtomicU64::new(0) }
    }

    fn record(&self) {
        self.micros.store(self.epoch.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    fn is_cold(&self) -> bool {
        let idle =
            self.epoch.elapsed().saturating_sub(Duration::from_micros(self.micros.load(Ordering::Relaxed)));
        idle > Self::COLD_AFTER
    }
}

impl BlockHeadEngine {
    /// `draft_vocab`: which tokens the head scores ([`crate::draft_vocab`]).
    pub fn load(
        head_dir: &Path,
        target_dir: &Path,
        kind: Kind,
        device: Device,
        max_context: usize,
        draft_vocab: DraftVocabChoice,
    ) -> Result<Self, HeadError> {
        let mut head = DraftHead::load(head_dir, target_dir, kind, device)?;
        if let Some((tokens, coverage)) = draft_vocab.resolve(head_dir)? {
            head.restrict_vocab(&tokens)?;
            tracing::info!(
                tokens = head.draft_vocab_size(),
                of = head.vocab_size(),
                training_coverage = coverage,
                "draft vocabulary: the head scores the most frequent tokens of its training responses"
            );
        }
        let fingerprint =
            glance_models::weights::target_fingerprint(target_dir, &TargetConfig::read(target_dir)?)?;
        Ok(Self::new(head, fingerprint, max_context))
    }

    pub fn new(mut head: DraftHead, fingerprint: String, max_context: usize) -> Self {
        head.precompute_rotary(max_context + head.block_size());
        Self {
            head: Arc::new(SharedHead(head)),
            fingerprint,
            max_context,
            last_pass: Arc::new(LastPass::new()),
        }
    }
}

impl DraftEngine for BlockHeadEngine {
    fn handshake(&self) -> Handshake {
        let head = &self.head;
        Handshake {
            kind: DrafterKind::BlockHead,
            block_size: head.block_size(),
            mask_token_id: head.mask_token_id() as TokenId,
            tap_layers: head.tap_layers().to_vec(),
            hidden_size: head.hidden_size() as usize,
            vocab_size: head.vocab_size() as usize,
            dtype: head.kind(),
            target_fingerprint: self.fingerprint.clone(),
            max_tree_nodes: MAX_TREE_NODES,
        }
    }

    fn new_session(&self) -> Box<dyn Session> {
        let capacity = self.max_context + self.head.block_size();
        Box::new(BlockHeadSession {
            head: Arc::clone(&self.head),
            last_pass: Arc::clone(&self.last_pass),
            cache: self.head.new_cache(capacity),
            history: TokenHistory::default(),
            pending: Vec::new(),
            max_context: self.max_context,
        })
    }
}

struct BlockHeadSession {
    head: Arc<SharedHead>,
    last_pass: Arc<LastPass>,
    /// Draft K/V of every context position the head has consumed; block rows never stay.
    cache: KvCache,
    history: TokenHistory,
    /// Tap states received but not yet run through the head (consumed at the next round).
    pending: Vec<Tensor>,
    max_context: usize,
}

impl BlockHeadSession {
    /// Zero context rows, (0, taps·hidden): a round whose context the head has consumed already.
    fn no_context(&self) -> Tensor {
        let width = (self.head.tap_layers().len() as i64) * self.head.hidden_size();
        Tensor::zeros([0, width], (self.head.kind(), self.head.device()))
    }

    /// The context rows received and not yet run through the head, as one tensor; `None` if
    /// there are none.
    fn take_pending(&mut self) -> Option<Tensor> {
        (!self.pending.is_empty()).then(|| Tensor::cat(&std::mem::take(&mut self.pending), 0))
    }
}

/// A context append as a session receives it: `rows` positions from `first`, with tap states
/// `width` wide per row for `head`.
struct Append {
    head: &'static str,
    first: usize,
    rows: usize,
    width: i64,
}

impl Append {
    /// The states, once they are present, [rows, width], and within the session's context limit.
    fn checked(&self, states: Option<Tensor>, max_context: usize) -> Result<Tensor, DraftError> {
        let states = states.ok_or_else(|| DraftError::States(format!("{} needs tap states", self.head)))?;
        if states.size() != [self.rows as i64, self.width] {
            return Err(DraftError::States(format!(
                "shape {:?}, expected [{}, {}]",
                states.size(),
                self.rows,
                self.width
            )));
        }
        if self.first + self.rows > max_context {
            return Err(DraftError::Capacity(format!(
                "{} positions, past the session's context limit of {max_context}",
                self.first + self.rows
            )));
        }
        Ok(states)
    }
}

impl Session for BlockHeadSession {
    /// On a CPU, when the head has sat idle, a throwaway draft of one block with no context into a
    /// scratch cache: idle, the head's weights (a few MB) leave the caches, and the session's first
    /// round, the one that also carries the prompt's rows, would run them in cold.
    fn warm(&mut self) {
        if self.head.device() != Device::Cpu || !self.last_pass.is_cold() {
            return;
        }
        let mut scratch = self.head.new_cache(self.head.block_size());
        let _ = self.head.draft(&mut scratch, &self.no_context(), self.head.mask_token_id(), 0);
        self.last_pass.record();
    }

    fn append_context(
        &mut self,
        first: usize,
        tokens: &[TokenId],
        states: Option<Tensor>,
    ) -> Result<(), DraftError> {
        let width = (self.head.tap_layers().len() as i64) * self.head.hidden_size();
        let append = Append { head: "the block head", first, rows: tokens.len(), width };
        let states = append.checked(states, self.max_context)?;
        self.history.append(first, tokens)?;
        // States that come from the host (an in-process caller; drafter-svc uploads its own) go up
        // without blocking.
        let device = self.head.device();
        let states =
            if states.device() == device { states } else { glance_models::upload_tensor(&states, device) };
        self.pending.push(states);
        Ok(())
    }

    /// The pending rows' keys and values into the draft cache now, while the rest of the context
    /// is on its way.
    fn ingest(&mut self) -> Result<(), DraftError> {
        let Some(context) = self.take_pending() else { return Ok(()) };
        self.head.ingest(&mut self.cache, &context).map_err(|e| DraftError::Internal(e.to_string()))?;
        self.last_pass.record();
        Ok(())
    }

    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError> {
        self.history.check_root(round)?;
        let context = self.take_pending().unwrap_or_else(|| self.no_context());
        let marginals = self
            .head
            .draft_marginals(
                &mut self.cache,
                &context,
                round.root_token as i64,
                round.root_position,
                round.branch_k,
            )
            .map_err(|e| DraftError::Internal(e.to_string()))?;
        self.last_pass.record();
        let budget = round.budget.min(MAX_TREE_NODES);
        let mut tree = build_budget_tree(&marginals, budget, round.branch_k, &round.reach);
        if round.spine {
            extend_spine(&mut tree, &marginals, &round.reach);
        }
        Ok(tree)
    }
}

/// The EAGLE-3 head shared by concurrent sessions.
struct SharedEagle3(Eagle3Head);

// SAFETY: as for [`SharedHead`]: after loading the head's tensors are only read; each session's
// draft KV cache is its own.
unsafe impl Sync for SharedEagle3 {}

pub struct Eagle3Engine {
    head: Arc<SharedEagle3>,
    fingerprint: String,
    max_context: usize,
    /// Passes per tree after the first: a round drafts at most `expansions + 1` tokens deep.
    expansions: usize,
}

/// The widest EAGLE-3 expansion (children per node and nodes expanded per depth): EAGLE's own
/// settings use 8 to 10, and each is one row of every pass.
const MAX_EAGLE3_TOP_K: usize = 64;

impl Eagle3Engine {
    pub fn load(
        head_dir: &Path,
        target_dir: &Path,
        kind: Kind,
        device: Device,
        max_context: usize,
        expansions: usize,
    ) -> Result<Self, HeadError> {
        let head = Eagle3Head::load(head_dir, target_dir, kind, device)?;
        let fingerprint =
            glance_models::weights::target_fingerprint(target_dir, &TargetConfig::read(target_dir)?)?;
        Ok(Self { head: Arc::new(SharedEagle3(head)), fingerprint, max_context, expansions })
    }
}

impl DraftEngine for Eagle3Engine {
    fn handshake(&self) -> Handshake {
        let c = self.head.0.config();
        Handshake {
            kind: DrafterKind::Eagle3,
            // A tree is at most `expansions + 1` deep: the block of a drafter that deep.
            block_size: self.expansions + 2,
            mask_token_id: 0,
            tap_layers: c.tap_layers.clone(),
            hidden_size: c.target_hidden_size as usize,
            vocab_size: c.vocab_size as usize,
            dtype: self.head.0.kind(),
            target_fingerprint: self.fingerprint.clone(),
            max_tree_nodes: MAX_TREE_NODES,
        }
    }

    fn new_session(&self) -> Box<dyn Session> {
        let capacity = self.max_context + self.expansions * MAX_EAGLE3_TOP_K;
        Box::new(Eagle3Session {
            head: Arc::clone(&self.head),
            cache: self.head.0.new_cache(capacity),
            history: TokenHistory::default(),
            pending: Vec::new(),
            last: None,
            max_context: self.max_context,
            expansions: self.expansions,
        })
    }
}

struct Eagle3Session {
    head: Arc<SharedEagle3>,
    /// One row per committed position p: the pair (target state at p, token p+1).
    cache: KvCache,
    history: TokenHistory,
    /// Target states of positions not yet in the cache (their next token is not known until the
    /// next round's root, or the next context rows).
    pending: Vec<Tensor>,
    /// The head's output at the last cached position (its tree grows from there).
    last: Option<Tensor>,
    max_context: usize,
    expansions: usize,
}

impl Session for Eagle3Session {
    fn append_context(
        &mut self,
        first: usize,
        tokens: &[TokenId],
        states: Option<Tensor>,
    ) -> Result<(), DraftError> {
        let head = &self.head.0;
        let width = 3 * head.config().target_hidden_size;
        let append = Append { head: "the EAGLE-3 head", first, rows: tokens.len(), width };
        let states = append.checked(states, self.max_context)?;
        self.history.append(first, tokens)?;
        let device = head.device();
        let states =
            if states.device() == device { states } else { glance_models::upload_tensor(&states, device) };
        self.pending.push(states);
        Ok(())
    }

    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError> {
        self.history.check_root(round)?;
        let internal = |e: HeadError| DraftError::Internal(e.to_string());
        self.consume_context(round.root_token).map_err(internal)?;
        let last =
            self.last.as_ref().ok_or_else(|| DraftError::States("no context before the root".into()))?;
        let shape = TreeShape {
            top_k: round.branch_k.clamp(1, MAX_EAGLE3_TOP_K),
            expansions: self.expansions,
            budget: round.budget.min(MAX_TREE_NODES),
        };
        // Drafted pass by pass, the tree is cut to the reach afterwards.
        let tree =
            self.head.0.grow_tree(&mut self.cache, last, round.root_position, shape).map_err(internal)?;
        Ok(tree.within(&round.reach))
    }
}

impl Eagle3Session {
    /// Runs the pending target states through the head, each paired with the next token (the
    /// last one with the round's root), and keeps the output at the last position.
    fn consume_context(&mut self, root: TokenId) -> Result<(), HeadError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let head = &self.head.0;
        let states = Tensor::cat(&std::mem::take(&mut self.pending), 0);
        let rows = states.size()[0] as usize;
        let start = self.cache.len();
        self.cache.ensure_room(rows)?;
        let next: Vec<i64> = self.history.tokens[start + 1..]
            .iter()
            .chain(std::iter::once(&root))
            .map(|&t| i64::from(t))
            .collect();
        let tokens = glance_models::upload(&next, head.device());
        let positions =
            Tensor::arange_start(start as i64, (start + rows) as i64, (Kind::Int64, head.device()));
        let visible = head.causal_visibility(start, rows);
        let out = head.forward(&mut self.cache, &states, &tokens, &positions, &visible);
        self.cache.advance(rows);
        self.last = Some(out.narrow(0, rows as i64 - 1, 1));
        Ok(())
    }
}
