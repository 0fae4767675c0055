//! Drafting engines and their per-generation sessions, as both services drive them: drafter-svc
//! behind its gRPC stream, the verifier in process (prompt lookup). An engine holds what sessions
//! share (weights, a reference table); a session holds one generation's context (token history,
//! draft KV cache) and answers one tree per round.

use tch::{Kind, Tensor};

use crate::tree::{Reach, TokenId, Tree};

#[derive(Debug, thiserror::Error)]
pub enum DraftError {
    #[error("context rows start at position {got}, the session holds {expected}")]
    ContextGap { expected: usize, got: usize },
    #[error("root at position {root}, but the session's context ends at {context}")]
    RootPosition { root: usize, context: usize },
    #[error("context states: {0}")]
    States(String),
    #[error("draft session is out of room: {0}")]
    Capacity(String),
    #[error("drafting failed: {0}")]
    Internal(String),
}

/// What kind of drafter an engine is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrafterKind {
    /// The GLANCE block head reading the target's tap states.
    BlockHead,
    /// The EAGLE-3 head: autoregressive drafting over three target layers' states.
    Eagle3,
    /// Prompt-lookup n-gram drafting: no weights, no tap states.
    PromptLookup,
    /// Test drafters: the known greedy continuation, or random trees.
    TestOracle,
    TestGarbage,
}

/// What an engine is, so that a verifier can refuse a drafter that does not fit its target.
#[derive(Clone, Debug, PartialEq)]
pub struct Handshake {
    pub kind: DrafterKind,
    /// Block size B: a round drafts at most B−1 tokens past the root.
    pub block_size: usize,
    pub mask_token_id: TokenId,
    /// Target decoder layers whose outputs the engine reads (empty: none).
    pub tap_layers: Vec<usize>,
    /// Width of each tap (the target's hidden size); 0 when no taps are read.
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// Dtype the engine wants the tap states in (f32, bf16 or f16).
    pub dtype: Kind,
    /// Fingerprint of the target the engine was built for; empty for any target.
    pub target_fingerprint: String,
    /// Largest tree the engine returns.
    pub max_tree_nodes: usize,
}

impl Handshake {
    /// A drafter that reads no tap states and works with any target.
    pub fn stateless(kind: DrafterKind, block_size: usize, vocab_size: usize) -> Self {
        Self {
            kind,
            block_size,
            mask_token_id: 0,
            tap_layers: Vec::new(),
            hidden_size: 0,
            vocab_size,
            dtype: Kind::Float,
            target_fingerprint: String::new(),
            max_tree_nodes: MAX_TREE_NODES,
        }
    }
}

/// Most nodes a tree may have, whatever a request asks.
pub const MAX_TREE_NODES: usize = 1024;

/// What a round asks for.
#[derive(Clone, Debug)]
pub struct RoundInput {
    pub root_token: TokenId,
    pub root_position: usize,
    pub budget: usize,
    pub branch_k: usize,
    /// Also the spine to the block's last offset ([`crate::tree::extend_spine`]): asked by the
    /// auto policy, which picks the nodes to verify itself. Engines whose trees are not drawn
    /// from per-offset marginals (EAGLE-3, prompt lookup) ignore it.
    pub spine: bool,
    /// How far the round could still commit: the block head builds its tree within it, EAGLE-3
    /// and prompt lookup cut theirs to it (and the verifier cuts every tree it receives).
    pub reach: Reach,
}

/// Shared by all sessions of one drafter process.
pub trait DraftEngine: Send + Sync {
    fn handshake(&self) -> Handshake;
    fn new_session(&self) -> Box<dyn Session>;
}

/// One generation.
pub trait Session: Send {
    /// Appends committed positions. `states` (rows, taps·hidden) for engines that read them.
    fn append_context(
        &mut self,
        first_position: usize,
        tokens: &[TokenId],
        states: Option<Tensor>,
    ) -> Result<(), DraftError>;
    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError>;
    /// Called after context rows that came without a round (a context too large for one message
    /// comes in several, the round with the last): an engine may take them in now, while the
    /// rest is on its way, so the round's own pass carries only the rows after them. By default
    /// they wait for the round.
    fn ingest(&mut self) -> Result<(), DraftError> {
        Ok(())
    }
    /// Called once when the session opens, before its first message: an engine whose first
    /// round would run cold may run a throwaway pass here (the verifier opens the session while
    /// its target prefills, so this costs the drafter's idle time, not the round's).
    fn warm(&mut self) {}
}

/// Context appended at `first_position` must continue a history of `len` tokens, without a gap.
pub fn check_continues(len: usize, first_position: usize) -> Result<(), DraftError> {
    if first_position != len {
        return Err(DraftError::ContextGap { expected: len, got: first_position });
    }
    Ok(())
}

/// A round's root must sit right after a history of `len` tokens.
pub fn check_root_at(len: usize, round: &RoundInput) -> Result<(), DraftError> {
    if round.root_position != len {
        return Err(DraftError::RootPosition { root: round.root_position, context: len });
    }
    Ok(())
}

/// The token history every session keeps, with the gap and root checks all engines need.
#[derive(Default)]
pub struct TokenHistory {
    pub tokens: Vec<TokenId>,
}

impl TokenHistory {
    pub fn append(&mut self, first_position: usize, tokens: &[TokenId]) -> Result<(), DraftError> {
        check_continues(self.tokens.len(), first_position)?;
        self.tokens.extend_from_slice(tokens);
        Ok(())
    }

    pub fn check_root(&self, round: &RoundInput) -> Result<(), DraftError> {
        check_root_at(self.tokens.len(), round)
    }

    /// History with the root appended: the sequence the next tokens continue.
    pub fn with_root(&self, root: TokenId) -> Vec<TokenId> {
        let mut all = self.tokens.clone();
        all.push(root);
        all
    }
}
