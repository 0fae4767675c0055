//! verifier-svc: owns the target VLM, decodes greedily or with speculative rounds (the verify round
//! in `speculative`, the drafter client in `drafter_client`), and serves the public
//! `glance.v1.Generation` gRPC API with health, reflection and the one error mapping (`error`).

pub mod config;
pub mod drafter_client;
pub mod engine;
pub mod error;
pub mod local_drafter;
pub mod metrics;
pub mod policy;
pub mod policy_memory;
pub mod server;
pub mod service;
pub mod speculative;
pub mod stop;
