//! glance-input: the input pipeline — a chat request (messages with text and encoded images)
//! becomes token ids, normalized image patches and M-RoPE positions, matching Hugging Face
//! transformers' Qwen2.5-VL and Qwen3-VL processors (and, for a text-only model, its tokenizer's
//! `apply_chat_template`). The pipeline works on plain `Vec`s; only
//! [`Prompt::model_inputs`] turns a prompt into the model's tensors.

mod chat;
mod error;
mod image;
mod jpeg;
mod prompt;
mod pyjson;
mod resample;
mod rope_index;

pub use self::chat::{ChatTemplate, TemplateContent, TemplateMessage, TemplatePart};
pub use self::error::{InputError, LoadError};
pub use self::image::{
    decode_image, decode_image_with_limit, flatten_alpha, patchify, preprocess_image, resize_for_model,
    smart_resize, to_rgb8, Alpha, ImageBackend, ImageProcessorConfig, PreparedImage,
    DEFAULT_MAX_DECODED_PIXELS,
};
pub use self::prompt::{ChatMessage, ContentPart, Prompt, PromptBuilder, PromptOptions, SpecialTokens};
pub use self::resample::{resize_bicubic, resize_bicubic_torchvision};
pub use self::rope_index::{decode_position, decode_positions, mrope_position_ids, MropePositions};
