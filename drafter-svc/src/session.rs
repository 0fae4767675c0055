//! Drafting engines and their per-generation sessions. An engine holds what sessions share
//! (weights, a reference table); a session holds one generation's context (token history, draft
//! KV cache) and answers one tree per round.

use glance_proto::v1 as pb;
use tch::Tensor;

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

/// A candidate tree in packed order (parents before children).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tree {
    pub tokens: Vec<u32>,
    pub parents: Vec<i32>,
    pub depths: Vec<u32>,
    pub log_probs: Vec<f32>,
}

impl Tree {
    /// A single path: each node the child of the previous one.
    pub fn chain(tokens: &[u32]) -> Self {
        Self {
            tokens: tokens.to_vec(),
            parents: (0..tokens.len() as i32).map(|i| i - 1).collect(),
            depths: (1..=tokens.len() as u32).collect(),
            log_probs: vec![0.0; tokens.len()],
        }
    }

    pub fn push(&mut self, token: u32, parent: i32, log_prob: f32) -> i32 {
        let depth = if parent < 0 { 1 } else { self.depths[parent as usize] + 1 };
        self.tokens.push(token);
        self.parents.push(parent);
        self.depths.push(depth);
        self.log_probs.push(log_prob);
        (self.tokens.len() - 1) as i32
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// What a round asks for.
#[derive(Clone, Copy, Debug)]
pub struct RoundInput {
    pub root_token: u32,
    pub root_position: usize,
    pub budget: usize,
    pub branch_k: usize,
}

/// Shared by all sessions of one drafter process.
pub trait DraftEngine: Send + Sync {
    fn handshake(&self) -> pb::HandshakeResponse;
    fn new_session(&self) -> Box<dyn Session>;
}

/// One generation.
pub trait Session: Send {
    /// Appends committed positions. `states` (rows, taps·hidden) for engines that read them.
    fn append_context(
        &mut self,
        first_position: usize,
        tokens: &[u32],
        states: Option<Tensor>,
    ) -> Result<(), DraftError>;
    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError>;
}

/// The token history every session keeps, with the gap and root checks all engines need.
#[derive(Default)]
pub struct TokenHistory {
    pub tokens: Vec<u32>,
}

impl TokenHistory {
    pub fn append(&mut self, first_position: usize, tokens: &[u32]) -> Result<(), DraftError> {
        if first_position != self.tokens.len() {
            return Err(DraftError::ContextGap { expected: self.tokens.len(), got: first_position });
        }
        self.tokens.extend_from_slice(tokens);
        Ok(())
    }

    pub fn check_root(&self, round: &RoundInput) -> Result<(), DraftError> {
        if round.root_position != self.tokens.len() {
            return Err(DraftError::RootPosition { root: round.root_position, context: self.tokens.len() });
        }
        Ok(())
    }

    /// History with the root appended: the sequence the next tokens continue.
    pub fn with_root(&self, root: u32) -> Vec<u32> {
        let mut all = self.tokens.clone();
        all.push(root);
        all
    }
}
