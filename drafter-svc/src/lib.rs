//! drafter-svc: the GLANCE drafter. Holds the block-diffusion draft head (DFlash architecture)
//! that reads the target's tap states, keeps a draft KV cache per session, turns the per-offset
//! marginals into a best-first candidate tree, and serves the internal `glance.drafter.v1.Drafter`
//! API; it also initializes and trains heads. The EAGLE-3 head (the matched peer), prompt lookup
//! and the test drafters share the same service.

pub mod draft_vocab;
pub mod eagle3;
pub mod engines;
pub mod head;
pub mod init;
pub mod metrics;
pub mod service;
pub mod sharegpt;
pub mod testing;
pub mod train;
pub mod train_eagle3;
