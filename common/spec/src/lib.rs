//! glance-spec: what the verifier and the drafter agree on, with no transport in it — the one
//! candidate tree (build, validate, walk, mask layout), the drafting engine and session traits,
//! prompt lookup (an engine both can run), and the entropy law that relates the target's root
//! entropy to the accepted length.

pub mod law;
pub mod prompt_lookup;
pub mod session;
pub mod tree;

pub use session::{DraftEngine, DraftError, DrafterKind, Handshake, RoundInput, Session, TokenHistory};
pub use tree::{TokenId, Tree, TreeError, TreeLimits};
