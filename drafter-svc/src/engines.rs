//! The production drafting engines behind the service: the GLANCE block head (one draft pass per
//! round, best-first tree from the per-offset marginals) and prompt lookup.

use std::path::Path;
use std::sync::Arc;

use glance_common::kv_cache::KvCache;
use glance_proto::v1 as pb;
use tch::{Device, Kind, Tensor};

use crate::head::{DraftHead, HeadError};
use crate::pld::PromptLookup;
use crate::session::{DraftEngine, DraftError, RoundInput, Session, TokenHistory, Tree};
use crate::tree::{build_budget_tree, top_k_log_probs, TreeNode};

/// Most nodes a tree may have, whatever a request asks.
pub const MAX_TREE_NODES: usize = 1024;

fn to_tree(nodes: &[TreeNode]) -> Tree {
    let mut tree = Tree::default();
    for node in nodes {
        tree.push(node.token as u32, node.parent, node.log_prob as f32);
    }
    tree
}

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
        let fingerprint = glance_common::weights::target_fingerprint(target_dir)?;
        Ok(Self::new(head, fingerprint, max_context))
    }

    pub fn new(head: DraftHead, fingerprint: String, max_context: usize) -> Self {
        Self { head: Arc::new(SharedHead(head)), fingerprint, max_context }
    }
}

impl DraftEngine for BlockHeadEngine {
    fn handshake(&self) -> pb::HandshakeResponse {
        let head = &self.head;
        pb::HandshakeResponse {
            kind: pb::DrafterKind::BlockHead as i32,
            block_size: head.block_size() as u32,
            mask_token_id: head.mask_token_id() as u32,
            tap_layers: head.tap_layers().iter().map(|&l| l as u32).collect(),
            hidden_size: head.hidden_size() as u32,
            vocab_size: head.vocab_size() as u32,
            dtype: glance_common::wire::kind_name(head.kind()).to_string(),
            target_fingerprint: self.fingerprint.clone(),
            max_tree_nodes: MAX_TREE_NODES as u32,
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
        tokens: &[u32],
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
                "{} positions over {}",
                first + tokens.len(),
                self.max_context
            )));
        }
        self.history.append(first, tokens)?;
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
        let (ids, log_probs) =
            top_k_log_probs(&logits, round.branch_k).map_err(|e| DraftError::Internal(e.to_string()))?;
        let budget = round.budget.min(MAX_TREE_NODES);
        Ok(to_tree(&build_budget_tree(&ids, &log_probs, budget, round.branch_k)))
    }
}

pub struct PromptLookupEngine {
    lookup: PromptLookup,
    block_size: usize,
    vocab_size: u32,
}

impl PromptLookupEngine {
    /// Prompt lookup for a target: only its vocabulary size is needed (for the handshake).
    pub fn for_target(target_dir: &Path, block_size: usize) -> Result<Self, String> {
        let config = std::fs::read_to_string(target_dir.join("config.json")).map_err(|e| e.to_string())?;
        let root: serde_json::Value = serde_json::from_str(&config).map_err(|e| e.to_string())?;
        let vocab = root
            .get("text_config")
            .and_then(|t| t.get("vocab_size"))
            .or_else(|| root.get("vocab_size"))
            .and_then(serde_json::Value::as_u64)
            .ok_or("config.json has no vocab_size")?;
        Ok(Self::new(block_size, vocab as u32))
    }

    pub fn new(block_size: usize, vocab_size: u32) -> Self {
        Self { lookup: PromptLookup::new(block_size.saturating_sub(1)), block_size, vocab_size }
    }
}

impl DraftEngine for PromptLookupEngine {
    fn handshake(&self) -> pb::HandshakeResponse {
        pb::HandshakeResponse {
            kind: pb::DrafterKind::PromptLookup as i32,
            block_size: self.block_size as u32,
            vocab_size: self.vocab_size,
            dtype: "f32".into(),
            max_tree_nodes: MAX_TREE_NODES as u32,
            ..Default::default()
        }
    }

    fn new_session(&self) -> Box<dyn Session> {
        Box::new(PromptLookupSession { lookup: self.lookup.clone(), history: TokenHistory::default() })
    }
}

struct PromptLookupSession {
    lookup: PromptLookup,
    history: TokenHistory,
}

impl Session for PromptLookupSession {
    fn append_context(&mut self, first: usize, tokens: &[u32], _: Option<Tensor>) -> Result<(), DraftError> {
        self.history.append(first, tokens)
    }

    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError> {
        self.history.check_root(round)?;
        let history: Vec<i64> = self.history.with_root(round.root_token).iter().map(|&t| t as i64).collect();
        let mut nodes = self.lookup.propose(&history);
        nodes.truncate(round.budget);
        Ok(to_tree(&nodes))
    }
}
