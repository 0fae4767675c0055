//! Stand-in drafters for the decoding tests, in process: each round's tree is made by a function
//! of the committed context, the pending root and the budget (a scripted oracle, a poor drafter,
//! the target's own top tokens), through the verifier's real `DraftProvider` / `DraftSession`
//! contract. No tap states are read.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use glance_spec::tree::Tree;
use verifier_svc::speculative::{DraftFailure, DraftProvider, DraftRound, DraftSession, Drafted};

/// Makes a round's tree from (the committed tokens before the root, the root, the budget).
pub type TreeMaker = dyn FnMut(&[i64], i64, usize) -> Tree;

/// A provider whose sessions draft with one shared tree maker.
pub struct FnProvider {
    make: Rc<RefCell<Box<TreeMaker>>>,
    max_depth: usize,
}

impl FnProvider {
    pub fn new(max_depth: usize, make: impl FnMut(&[i64], i64, usize) -> Tree + 'static) -> Self {
        Self { make: Rc::new(RefCell::new(Box::new(make))), max_depth }
    }
}

struct FnSession {
    make: Rc<RefCell<Box<TreeMaker>>>,
    /// Every position the verifier has sent, in order.
    context: Vec<i64>,
    ready: Option<Drafted>,
}

impl DraftProvider for FnProvider {
    fn open(&mut self) -> Option<Box<dyn DraftSession>> {
        Some(Box::new(FnSession { make: Rc::clone(&self.make), context: Vec::new(), ready: None }))
    }

    fn tap_layers(&self) -> &[usize] {
        &[]
    }

    fn max_depth(&self) -> usize {
        self.max_depth
    }
}

impl DraftSession for FnSession {
    fn context_len(&self) -> usize {
        self.context.len()
    }

    fn send(&mut self, round: DraftRound) -> Result<(), DraftFailure> {
        self.context.truncate(round.first_position);
        self.context.extend_from_slice(round.tokens);
        let tree = (self.make.borrow_mut())(&self.context, round.root_token, round.budget);
        self.ready = Some(Drafted { tree, ..Default::default() });
        Ok(())
    }

    fn receive(&mut self, _wait: Duration) -> Result<Option<Drafted>, DraftFailure> {
        Ok(self.ready.take())
    }

    fn bytes_sent(&self) -> u64 {
        0
    }
}

/// A drafter that follows a script (the stream it expects: prompt + continuation): below each
/// root it proposes the script's next `depth` tokens as a path, each node (when `siblings`) with
/// one sibling that is some other token, so that the walk meets both.
pub fn scripted(script: Vec<i64>, depth: usize, siblings: bool, vocab: u32) -> FnProvider {
    FnProvider::new(depth, move |context, _root, budget| {
        let mut tree = Tree::default();
        let mut parent = -1;
        let root_position = context.len();
        for (d, &token) in script.iter().skip(root_position + 1).take(depth.min(budget)).enumerate() {
            let token = token as u32 % vocab;
            if siblings && tree.len() + 2 <= budget {
                tree.push((token + 1 + d as u32 * 7) % vocab, parent, 0.0);
            }
            if tree.len() >= budget {
                break;
            }
            parent = tree.push(token, parent, 0.0);
        }
        tree
    })
}
