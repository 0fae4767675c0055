//! Test drafters that exercise the verifier's extremes through the real protocol:
//! - `oracle`: knows the greedy continuation of each prompt (from a reference file) and returns it
//!   as the top branch, with random siblings: accepted length at the block limit, deep commits,
//!   compaction of long paths, stop handling inside an accepted run.
//! - `garbage`: random trees, and with `malformed_rate` > 0 some trees that break the protocol
//!   (bad parent, token out of the vocabulary, too many nodes) and must be refused.

use std::sync::Arc;

use tch::Tensor;

use glance_spec::session::{
    DraftEngine, DraftError, DrafterKind, Handshake, RoundInput, Session, TokenHistory,
};
use glance_spec::tree::{TokenId, Tree};
use glance_train::rng::Rng;

pub struct OracleEngine {
    /// Full sequences: prompt tokens followed by the greedy output.
    sequences: Arc<Vec<Vec<TokenId>>>,
    block_size: usize,
    vocab_size: u32,
    seed: u64,
}

impl OracleEngine {
    /// `sequences_json`: a JSON array of token arrays (prompt + greedy continuation).
    pub fn from_json(text: &str, block_size: usize, vocab_size: u32, seed: u64) -> Result<Self, String> {
        let sequences: Vec<Vec<TokenId>> = serde_json::from_str(text).map_err(|e| e.to_string())?;
        Ok(Self { sequences: Arc::new(sequences), block_size, vocab_size, seed })
    }
}

impl DraftEngine for OracleEngine {
    fn handshake(&self) -> Handshake {
        Handshake::stateless(DrafterKind::TestOracle, self.block_size, self.vocab_size as usize)
    }

    fn new_session(&self) -> Box<dyn Session> {
        Box::new(OracleSession {
            sequences: Arc::clone(&self.sequences),
            history: TokenHistory::default(),
            block_size: self.block_size,
            vocab_size: self.vocab_size,
            rng: Rng::new(self.seed),
        })
    }
}

struct OracleSession {
    sequences: Arc<Vec<Vec<TokenId>>>,
    history: TokenHistory,
    block_size: usize,
    vocab_size: u32,
    rng: Rng,
}

impl Session for OracleSession {
    fn append_context(
        &mut self,
        first: usize,
        tokens: &[TokenId],
        _: Option<Tensor>,
    ) -> Result<(), DraftError> {
        self.history.append(first, tokens)
    }

    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError> {
        self.history.check_root(round)?;
        let sequence = self.history.with_root(round.root_token);
        let truth: Vec<TokenId> = self
            .sequences
            .iter()
            .find(|s| s.len() > sequence.len() && s.starts_with(&sequence))
            .map(|s| s[sequence.len()..].iter().take(self.block_size - 1).copied().collect())
            .unwrap_or_default();
        // The true path first, then random siblings hung off it until the budget is spent.
        let mut tree = Tree::default();
        let mut spine = Vec::new();
        let mut parent = -1;
        for &token in truth.iter().take(round.budget) {
            parent = tree.push(token, parent, 0.0);
            spine.push(parent);
        }
        while tree.len() < round.budget && !spine.is_empty() {
            let at = *self.rng.pick(&spine);
            let parent = tree.parents[at as usize];
            let token = self.rng.below(self.vocab_size.max(1) as usize) as TokenId;
            if token != tree.tokens[at as usize] {
                tree.push(token, parent, -5.0);
            }
        }
        // Packed order requires parents first: siblings of spine nodes only reference earlier
        // nodes (a spine node's parent precedes it), so the order above is already valid.
        Ok(tree)
    }
}

pub struct GarbageEngine {
    block_size: usize,
    vocab_size: u32,
    seed: u64,
    /// Share of rounds answered with a tree that breaks the protocol, in [0, 1].
    malformed_rate: f64,
}

impl GarbageEngine {
    pub fn new(block_size: usize, vocab_size: u32, seed: u64, malformed_rate: f64) -> Self {
        Self { block_size, vocab_size, seed, malformed_rate }
    }
}

impl DraftEngine for GarbageEngine {
    fn handshake(&self) -> Handshake {
        Handshake::stateless(DrafterKind::TestGarbage, self.block_size, self.vocab_size as usize)
    }

    fn new_session(&self) -> Box<dyn Session> {
        Box::new(GarbageSession {
            history: TokenHistory::default(),
            block_size: self.block_size,
            vocab_size: self.vocab_size,
            malformed_rate: self.malformed_rate,
            rng: Rng::new(self.seed),
        })
    }
}

struct GarbageSession {
    history: TokenHistory,
    block_size: usize,
    vocab_size: u32,
    malformed_rate: f64,
    rng: Rng,
}

impl Session for GarbageSession {
    fn append_context(
        &mut self,
        first: usize,
        tokens: &[TokenId],
        _: Option<Tensor>,
    ) -> Result<(), DraftError> {
        self.history.append(first, tokens)
    }

    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError> {
        self.history.check_root(round)?;
        let mut tree = Tree::default();
        let nodes = 1 + self.rng.below(round.budget.max(1));
        for i in 0..nodes {
            let parent = if i == 0 { -1 } else { self.rng.below(i + 1) as i32 - 1 };
            if parent >= 0 && tree.depths[parent as usize] as usize >= self.block_size - 1 {
                continue;
            }
            let token = self.rng.below(self.vocab_size.max(1) as usize) as TokenId;
            tree.push(token, parent, -1.0);
        }
        if self.rng.uniform() <= self.malformed_rate {
            self.break_tree(&mut tree, round.budget);
        }
        Ok(tree)
    }
}

impl GarbageSession {
    fn break_tree(&mut self, tree: &mut Tree, budget: usize) {
        match self.rng.below(3) {
            0 => tree.parents[0] = tree.len() as i32 + 3,
            1 => tree.tokens[0] = self.vocab_size + 7,
            _ => {
                while tree.len() <= budget {
                    tree.push(1, -1, -1.0);
                }
            }
        }
    }
}

/// Wraps an engine to inject faults: every `stall_every`-th round of a session stalls for `stall`
/// first (the verifier's per-round deadline and fallback under a slow drafter), and every
/// `panic_every`-th round panics inside the engine (the service's INTERNAL answer). 0: never.
pub struct FaultyEngine {
    pub inner: Box<dyn DraftEngine>,
    pub stall_every: usize,
    pub stall: std::time::Duration,
    pub panic_every: usize,
}

impl DraftEngine for FaultyEngine {
    fn handshake(&self) -> Handshake {
        self.inner.handshake()
    }

    fn new_session(&self) -> Box<dyn Session> {
        Box::new(FaultySession {
            inner: self.inner.new_session(),
            stall_every: self.stall_every,
            stall: self.stall,
            panic_every: self.panic_every,
            rounds: 0,
        })
    }
}

struct FaultySession {
    inner: Box<dyn Session>,
    stall_every: usize,
    stall: std::time::Duration,
    panic_every: usize,
    rounds: usize,
}

/// Whether the `round`-th round (from 1) is one of every `every` (0: none).
fn every(round: usize, every: usize) -> bool {
    every > 0 && round.is_multiple_of(every)
}

impl Session for FaultySession {
    fn append_context(
        &mut self,
        first: usize,
        tokens: &[TokenId],
        states: Option<Tensor>,
    ) -> Result<(), DraftError> {
        self.inner.append_context(first, tokens, states)
    }

    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError> {
        self.rounds += 1;
        if every(self.rounds, self.stall_every) {
            std::thread::sleep(self.stall);
        }
        if every(self.rounds, self.panic_every) {
            panic!("injected fault: round {} of this session", self.rounds);
        }
        self.inner.draft(round)
    }
}

/// Wraps an engine to blind it (the paper's ablation): every tap state it receives is zeroed, so
/// a head that reads the target's states drafts from the tokens alone.
pub struct ZeroStatesEngine {
    pub inner: Box<dyn DraftEngine>,
}

impl DraftEngine for ZeroStatesEngine {
    fn handshake(&self) -> Handshake {
        self.inner.handshake()
    }

    fn new_session(&self) -> Box<dyn Session> {
        Box::new(ZeroStatesSession { inner: self.inner.new_session() })
    }
}

struct ZeroStatesSession {
    inner: Box<dyn Session>,
}

impl Session for ZeroStatesSession {
    fn append_context(
        &mut self,
        first: usize,
        tokens: &[TokenId],
        states: Option<Tensor>,
    ) -> Result<(), DraftError> {
        self.inner.append_context(first, tokens, states.map(|s| s.zeros_like()))
    }

    fn draft(&mut self, round: &RoundInput) -> Result<Tree, DraftError> {
        self.inner.draft(round)
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests build and read host tensors freely
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// One `append_context` call: first position, tokens, states.
    type Appended = (usize, Vec<TokenId>, Option<Tensor>);

    /// Records what its sessions are given.
    #[derive(Default)]
    struct Recorder {
        seen: Arc<Mutex<Vec<Appended>>>,
    }

    impl DraftEngine for Recorder {
        fn handshake(&self) -> Handshake {
            Handshake::stateless(DrafterKind::TestOracle, 4, 16)
        }

        fn new_session(&self) -> Box<dyn Session> {
            Box::new(Recorder { seen: Arc::clone(&self.seen) })
        }
    }

    impl Session for Recorder {
        fn append_context(
            &mut self,
            first: usize,
            tokens: &[TokenId],
            states: Option<Tensor>,
        ) -> Result<(), DraftError> {
            self.seen.lock().unwrap().push((first, tokens.to_vec(), states));
            Ok(())
        }

        fn draft(&mut self, _round: &RoundInput) -> Result<Tree, DraftError> {
            Ok(Tree::default())
        }
    }

    #[test]
    fn the_blinded_head_gets_the_tokens_and_zero_states() {
        let recorder = Recorder::default();
        let seen = Arc::clone(&recorder.seen);
        let blind = ZeroStatesEngine { inner: Box::new(recorder) };
        let mut session = blind.new_session();
        let states = Tensor::from_slice(&[1.5f32, -2.0, 3.0, 0.25]).view([2, 2]);
        session.append_context(7, &[3, 4], Some(states.shallow_clone())).unwrap();
        session.append_context(9, &[5], None).unwrap();
        let seen = seen.lock().unwrap();
        let (first, tokens, zeroed) = &seen[0];
        assert_eq!((*first, tokens.as_slice()), (7, [3, 4].as_slice()));
        let zeroed = zeroed.as_ref().expect("states passed on");
        assert_eq!(zeroed.size(), states.size());
        assert_eq!(zeroed.abs().sum(tch::Kind::Float).double_value(&[]), 0.0);
        assert!(seen[1].2.is_none(), "no states stay no states");
        assert_eq!(
            states.abs().sum(tch::Kind::Float).double_value(&[]),
            6.75,
            "the caller's tensor is untouched"
        );
    }
}
