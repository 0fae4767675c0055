//! Qwen3 (`Qwen3ForCausalLM`): the text-only Qwen3 decoder, Qwen3-VL's language model without
//! M-RoPE: per-head q/k RMSNorm before a 1-D rotary embedding, `head_dim` from the config (128 by
//! default in transformers, so it need not equal hidden / heads), no bias unless
//! `attention_bias`. Sliding-window layers (`use_sliding_window`) are refused at config time.

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
