//! An in-process drafter: a drafting engine of `glance-spec` run inside the verifier (prompt
//! lookup needs no weights and no network).

use std::sync::Arc;
use std::time::{Duration, Instant};

use glance_spec::session::{DraftEngine, DraftError, RoundInput, Session};
use glance_spec::tree::TokenId;

use crate::speculative::{DraftFailure, DraftProvider, DraftRound, DraftSession, Drafted};

pub struct LocalProvider {
    engine: Arc<dyn DraftEngine>,
    tap_layers: Vec<usize>,
    max_depth: usize,
}

impl LocalProvider {
    pub fn new(engine: Arc<dyn DraftEngine>) -> Self {
        let handshake = engine.handshake();
        Self {
            tap_layers: handshake.tap_layers.clone(),
            max_depth: handshake.block_size.saturating_sub(1),
            engine,
        }
    }
}

impl DraftProvider for LocalProvider {
    fn open(&mut self) -> Option<Box<dyn DraftSession>> {
        Some(Box::new(LocalSession { session: self.engine.new_session(), context_len: 0, ready: None }))
    }

    fn tap_layers(&self) -> &[usize] {
        &self.tap_layers
    }

    fn max_depth(&self) -> usize {
        self.max_depth
    }
}

/// Drafts in the verifier's own thread: `send` computes the tree at once, `receive` hands it over.
struct LocalSession {
    session: Box<dyn Session>,
    context_len: usize,
    ready: Option<Result<Drafted, DraftFailure>>,
}

impl LocalSession {
    fn draft(&mut self, round: DraftRound) -> Result<Drafted, DraftFailure> {
        let started = Instant::now();
        let tokens: Vec<TokenId> = round.tokens.iter().map(|&t| t as TokenId).collect();
        let failed = |e: DraftError| DraftFailure::Unavailable(e.to_string());
        self.session
            .append_context(round.first_position, &tokens, round.states.map(|s| s.shallow_clone()))
            .map_err(failed)?;
        let input = RoundInput {
            root_token: round.root_token as TokenId,
            root_position: round.root_position,
            budget: round.budget,
            branch_k: round.branch_k,
            spine: round.spine,
            reach: round.reach.clone(),
        };
        let tree = self.session.draft(&input).map_err(failed)?;
        let elapsed = started.elapsed();
        Ok(Drafted { tree, draft_time: elapsed, round_trip: elapsed })
    }
}

impl DraftSession for LocalSession {
    fn context_len(&self) -> usize {
        self.context_len
    }

    fn send(&mut self, round: DraftRound) -> Result<(), DraftFailure> {
        self.context_len = round.root_position;
        let drafted = self.draft(round);
        self.ready = Some(drafted);
        Ok(())
    }

    fn receive(&mut self, _wait: Duration) -> Result<Option<Drafted>, DraftFailure> {
        self.ready.take().ok_or_else(|| DraftFailure::Unavailable("no round in flight".into()))?.map(Some)
    }

    fn bytes_sent(&self) -> u64 {
        0
    }
}
