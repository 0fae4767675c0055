//! Llama (`LlamaForCausalLM`: Llama 2 and 3, SmolLM2): a text-only decoder with GQA, SwiGLU,
//! 1-D RoPE (with Llama 3.1's frequency scaling when `rope_type` is `llama3`), optional
//! `attention_bias` on q/k/v/o and `mlp_bias` on the MLP, `head_dim` read or derived. The layers
//! are the shared language model of `text`; this file says how a Llama checkpoint maps onto it.

use super::text::TextModel;
use super::ModelError;
use crate::config::TargetConfig;
use crate::weights::Checkpoint;

/// Checkpoint name of the decoder (`model.layers.*`, `model.embed_tokens`, `model.norm`).
const TEXT_PREFIX: &str = "model";

/// Loads the decoder and LM head (tied to the embedding when `tie_word_embeddings` says so).
pub fn load(config: &TargetConfig, ckpt: &mut Checkpoint) -> Result<TextModel, ModelError> {
    Ok(TextModel::load(ckpt, TEXT_PREFIX, config.text_config()?, super::NO_IMAGE_TOKEN)?)
}
