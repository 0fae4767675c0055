//! glance-common: what both services share — the target VLMs in libtorch (Qwen3-VL, Qwen2.5-VL),
//! their preallocated KV cache, checkpoint loading, and the input pipeline (images, chat template,
//! tokens, M-RoPE positions) that turns a chat request into model inputs.

pub mod decode;
pub mod input;
pub mod kv_cache;
pub mod law;
pub mod models;
pub mod telemetry;
pub mod toyworld;
pub mod train;
pub mod weights;
pub mod wire;
