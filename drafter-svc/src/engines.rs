//! The GLANCE block-head engine behind the service: one draft pass per round, then the best-first
//! tree from the per-offset marginals. (Prompt lookup is in `glance_spec::prompt_lookup`.)

use std::path::Path;
use std::sync::Arc;

use glance_models::kv_cache::KvCache;
use glance_models::TargetConfig;
use glance_spec::session::{
    DraftEngine, DraftError, DrafterKind, Handshake, RoundInput, Session, TokenHistory, MAX_TREE_NODES,
};
use glance_spec::tree::{build_budget_tree, Marginals, TokenId, Tree};
use tch::{Device, Kind, Tensor};

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
}

impl BlockHeadEngine {
    pub fn load(
        head_dir: &Path,
        target_dir: &Path,
        kind: Kind,
        device: Device,
        max_context: usize,
    ) -> Result<Self, HeadError> {
        let head = DraftHead::load(head_dir, target_dir, kind, device)?;
        let fingerprint =
            glance_models::weights::target_fingerprint(target_dir, &TargetConfig::read(target_dir)?)?;
        Ok(Self::new(head, fingerprint, max_context))
    }

    pub fn new(mut head: DraftHead, fingerprint: String, max_context: usize) -> Self {
        head.precompute_rotary(max_context + head.block_size());
        Self { head: Arc::new(SharedHead(head)), fingerprint, max_context }
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
            cache: self.head.new_cache(capacity),
            history: TokenHistory::default(),
            pending: Vec::new(),
            max_context: self.max_context,
        })
    }
}

struct BlockHeadSession {
    head: Arc<SharedHead>,
    /// Draft K/V of every context position the head has consumed; block rows never stay.
    cache: KvCache,
    history: TokenHistory,
    /// Tap states received but not yet run through the head (consumed at the next round).
    pending: Vec<Tensor>,
    max_context: usize,
}

impl Session for BlockHeadSession {
    fn append_context(
        &mut self,
        first: usize,
        tokens: &[TokenId],
        states: Option<Tensor>,
    ) -> Result<(), DraftError> {
        let states = states.ok_or_else(|| DraftError::States("the block head needs tap states".into()))?;
        let width = (self.head.tap_layers().len() as i64) * self.head.hidden_size();
        if states.size() != [tokens.len() as i64, width] {
            return Err(DraftError::States(format!(
                "shape {:?}, expected [{}, {width}]",
                states.size(),
                tokens.len()
            )));
        }
        if first + tokens.len() > self.max_context {
            return Err(DraftError::Capacity(format!(
                "{} positions, past the session's context limit of {}",
                first + tokens.len(),
                self.max_context
            )));
        }
        self.history.append(first, tokens)?;
        // States that come from the host (an in-process caller; drafter-svc uploads its own) go up
        // without blocking.
        let device = self.head.device();
        let states =
            if states.device() == device { states } else { glance_models::upload_tensor(&states, device) };
        self.pending.push(states);
        Ok(())
    }

    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError> {
        self.history.check_root(round)?;
        let context = match self.pending.len() {
            0 => {
                let width = (self.head.tap_layers().len() as i64) * self.head.hidden_size();
                Tensor::zeros([0, width], (self.head.kind(), self.head.device()))
            }
            _ => Tensor::cat(&std::mem::take(&mut self.pending), 0),
        };
        let logits = self
            .head
            .draft(&mut self.cache, &context, round.root_token as i64, round.root_position)
            .map_err(|e| DraftError::Internal(e.to_string()))?;
        let marginals =
            Marginals::top_k(&logits, round.branch_k).map_err(|e| DraftError::Internal(e.to_string()))?;
        Ok(build_budget_tree(&marginals, round.budget.min(MAX_TREE_NODES), round.branch_k))
    }
}
