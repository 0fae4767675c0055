//! drafter-svc: the GLANCE drafter. Holds the block-diffusion draft head (DFlash architecture)
//! that reads the target's tap states, keeps a draft KV cache per session, turns the per-offset
//! marginals into a best-first candidate tree, and serves the internal `glance.v1.Drafter` API.
//! Prompt-lookup drafting and two test drafters share the same service.

pub mod engines;
pub mod head;
pub mod init;
pub mod metrics;
pub mod pld;
pub mod service;
pub mod session;
pub mod testing;
pub mod train;
pub mod tree;
