//! verifier-svc: owns the target VLM, decodes (greedy now; speculative rounds come with the
//! drafter) and serves the public `glance.v1.Generation` gRPC API with health and reflection.

pub mod config;
pub mod drafter_client;
pub mod engine;
pub mod error;
pub mod local_drafter;
pub mod metrics;
pub mod server;
pub mod service;
pub mod speculative;
pub mod stop;
