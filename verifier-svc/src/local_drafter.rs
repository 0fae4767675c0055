//! An in-process drafter: a drafter-svc engine run inside the verifier (prompt lookup needs no
//! weights and no network), and the adapter tests use to drive any engine without a process.

use std::sync::Arc;
use std::time::Instant;

use drafter_svc::session::{DraftEngine, RoundInput, Session};

use crate::speculative::{DraftFailure, DraftProvider, DraftRound, DraftSession, DraftTree};

pub struct LocalProvider {
    engine: Arc<dyn DraftEngine>,
    tap_layers: Vec<usize>,
    max_depth: usize,
}

impl LocalProvider {
    pub fn new(engine: Arc<dyn DraftEngine>) -> Self {
        let handshake = engine.handshake();
        Self {
            tap_layers: handshake.tap_layers.iter().map(|&l| l as usize).collect(),
            max_depth: handshake.block_size.saturating_sub(1) as usize,
            engine,
        }
    }
}

impl DraftProvider for LocalProvider {
    fn open(&mut self) -> Option<Box<dyn DraftSession>> {
        Some(Box::new(LocalSession { session: self.engine.new_session(), context_len: 0 }))
    }

    fn tap_layers(&self) -> &[usize] {
        &self.tap_layers
    }

    fn max_depth(&self) -> usize {
        self.max_depth
    }
}

struct LocalSession {
    session: Box<dyn Session>,
    context_len: usize,
}

impl DraftSession for LocalSession {
    fn context_len(&self) -> usize {
        self.context_len
    }

    fn draft(&mut self, round: DraftRound) -> Result<DraftTree, DraftFailure> {
        let started = Instant::now();
        let tokens: Vec<u32> = round.tokens.iter().map(|&t| t as u32).collect();
        let failed = |e: drafter_svc::session::DraftError| DraftFailure::Unavailable(e.to_string());
        self.session
            .append_context(round.first_position, &tokens, round.states.map(|s| s.shallow_clone()))
            .map_err(failed)?;
        self.context_len = round.root_position;
        let input = RoundInput {
            root_token: round.root_token as u32,
            root_position: round.root_position,
            budget: round.budget,
            branch_k: round.branch_k,
        };
        let tree = self.session.draft(&input).map_err(failed)?;
        Ok(DraftTree {
            tokens: tree.tokens.iter().map(|&t| t as i64).collect(),
            parents: tree.parents,
            depths: tree.depths,
            draft_time: started.elapsed(),
        })
    }

    fn bytes_sent(&self) -> u64 {
        0
    }
}
