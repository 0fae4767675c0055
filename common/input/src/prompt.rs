//! Turns a chat request into model inputs the way transformers' Qwen-VL processor does with
//! `apply_chat_template(..., tokenize=True)`: images preprocessed, template rendered, each image
//! placeholder expanded to one token per merged patch, tokens and M-RoPE positions computed. For
//! a text-only model it is the tokenizer's `apply_chat_template`: each message's content is one
//! string, positions count tokens, and an image part is refused.

use std::path::Path;

use glance_models::config::TargetConfig;
use glance_models::decode::ModelInputs;
use tokenizers::Tokenizer;

use super::chat::{token_text, ChatTemplate, TemplateContent, TemplateMessage, TemplatePart};
use super::error::{read_optional_json, InputError, LoadError};
use super::image::{
    decode_image_with_limit, preprocess_image, Alpha, ImageBackend, ImageProcessorConfig, PreparedImage,
    DEFAULT_MAX_DECODED_PIXELS,
};
use super::rope_index::{mrope_position_ids, MropePositions};

const ROLES: [&str; 3] = ["system", "user", "assistant"];
/// Placeholder strings the processor treats as media slots; user text may not contain them.
const DEFAULT_IMAGE_TOKEN: &str = "<|image_pad|>";
const DEFAULT_VIDEO_TOKEN: &str = "<|video_pad|>";
const DEFAULT_VISION_START_TOKEN: &str = "<|vision_start|>";

/// A chat message as the service receives it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: Vec<ContentPart>,
}

/// One part of a message: text, or an encoded image with its declared mime type (empty to
/// detect it from the bytes).
#[derive(Debug, Clone, PartialEq)]
pub enum ContentPart {
    Text(String),
    Image { data: Vec<u8>, mime_type: String },
}

/// Server-side knobs over what the checkpoint's files say.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptOptions {
    /// Overrides the preprocessor's `min_pixels` (`size.shortest_edge`).
    pub min_pixels: Option<usize>,
    /// Overrides the preprocessor's `max_pixels` (`size.longest_edge`).
    pub max_pixels: Option<usize>,
    /// Most images accepted in one request.
    pub max_images: usize,
    /// Largest encoded image (width x height) accepted for decoding.
    pub max_decoded_pixels: u64,
    /// What transparency becomes (composited onto white by default).
    pub alpha: Alpha,
    /// Whose resize and normalization the pixels reproduce (torchvision's by default).
    pub image_backend: ImageBackend,
}

impl Default for PromptOptions {
    fn default() -> Self {
        Self {
            min_pixels: None,
            max_pixels: None,
            max_images: 16,
            max_decoded_pixels: DEFAULT_MAX_DECODED_PIXELS,
            alpha: Alpha::default(),
            image_backend: ImageBackend::default(),
        }
    }
}

/// Token ids the input pipeline and the model must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialTokens {
    pub image_token_id: u32,
    pub vision_start_token_id: u32,
    /// The image placeholder as text, as the chat template writes it.
    pub image_token: String,
    /// Other placeholder strings refused in user text (video, which this pipeline lacks).
    pub reserved: Vec<String>,
    /// The vision tower's `spatial_merge_size`.
    pub spatial_merge_size: usize,
}

/// Everything the model needs for a prefill.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    /// The rendered chat template, before image placeholders are expanded.
    pub text: String,
    /// Token ids with each image's placeholder expanded to `n_tokens` image tokens.
    pub input_ids: Vec<u32>,
    /// The request's images in order of appearance.
    pub images: Vec<PreparedImage>,
    pub positions: MropePositions,
    pub rope_delta: i64,
    /// Total image tokens in `input_ids`.
    pub image_token_count: usize,
}

impl Prompt {
    /// The model's inputs: token ids, positions and all images' patches, in order.
    pub fn model_inputs(&self) -> ModelInputs {
        let pixels: Vec<f32> = self.images.iter().flat_map(|im| im.pixel_values.iter().copied()).collect();
        let pixel_values = (!self.images.is_empty()).then(|| {
            let patch_dim = self.images[0].patch_dim as i64;
            glance_models::host_tensor(&pixels).view([-1, patch_dim])
        });
        ModelInputs {
            input_ids: self.input_ids.iter().map(|&i| i as i64).collect(),
            positions: [self.positions.t.clone(), self.positions.h.clone(), self.positions.w.clone()],
            rope_delta: self.rope_delta,
            pixel_values,
            image_grids: self.images.iter().map(|im| im.grid_thw.map(|g| g as i64)).collect(),
        }
    }
}

/// Tokenizer, chat template and (for a VLM) image processor and special tokens of one checkpoint.
#[derive(Debug)]
pub struct PromptBuilder {
    tokenizer: Tokenizer,
    template: ChatTemplate,
    /// `None` for a text-only model.
    vision: Option<VisionInputs>,
    /// `config.json`'s `model_type`, named when images are refused.
    model_type: String,
    eos_token_ids: Vec<u32>,
    bos_token: Option<String>,
    options: PromptOptions,
    /// UTF-8 length of the longest vocabulary entry (see [`PromptBuilder::max_text_bytes`]).
    longest_token_bytes: usize,
}

/// How much a tokenizer's normalizer may shorten text before it is split: NFC composition shrinks
/// at most 3x (a Hangul L+V+T jamo triple, 9 bytes, becomes one 3-byte syllable); 4 leaves room.
const NORMALIZATION_SLACK: usize = 4;

/// What a VLM's prompts need beyond the tokenizer.
#[derive(Debug)]
struct VisionInputs {
    image_config: ImageProcessorConfig,
    special: SpecialTokens,
}

impl PromptBuilder {
    /// Loads `tokenizer.json`, the chat template, `config.json`, for a VLM the image processor
    /// settings, and (if present) `tokenizer_config.json` and `generation_config.json` from a
    /// Hugging Face checkpoint directory.
    pub fn from_model_dir(dir: &Path, options: PromptOptions) -> Result<Self, LoadError> {
        let tokenizer = load_tokenizer(&dir.join("tokenizer.json"))?;
        let template = ChatTemplate::from_model_dir(dir)?;
        let config_path = dir.join("config.json");
        let config = TargetConfig::read(dir)
            .map_err(|e| LoadError::InvalidConfig { path: config_path.clone(), reason: e.to_string() })?;
        let vision = match config.family.is_multimodal() {
            true => Some(VisionInputs::load(dir, &config, &tokenizer, &options)?),
            false => None,
        };
        let tokenizer_config = read_optional_json(&dir.join("tokenizer_config.json"))?;
        let eos_token_ids = eos_token_ids(dir, &config, tokenizer_config.as_ref(), &tokenizer)?;
        let longest_token_bytes = tokenizer.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1);
        Ok(Self {
            longest_token_bytes,
            tokenizer,
            template,
            vision,
            model_type: config.family.model_type().to_string(),
            eos_token_ids,
            bos_token: tokenizer_config.as_ref().and_then(|c| token_text(c.get("bos_token")?)),
            options,
        })
    }

    /// Builds the model inputs for a conversation, ending with the assistant's turn prompt.
    pub fn build(&self, messages: &[ChatMessage]) -> Result<Prompt, InputError> {
        self.validate(messages)?;
        let Some(vision) = &self.vision else {
            let text = self.template.render(&text_messages(messages), true)?;
            let input_ids = self.tokenize(&text)?;
            let positions = MropePositions::text(input_ids.len());
            return Ok(Prompt {
                text,
                input_ids,
                images: vec![],
                positions,
                rope_delta: 0,
                image_token_count: 0,
            });
        };
        let images = self.prepare_images(vision, messages)?;
        let text = self.template.render(&template_messages(messages), true)?;
        let ids = self.tokenize(&text)?;
        let input_ids = expand_image_tokens(&ids, &images, vision.special.image_token_id)?;
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        let (positions, rope_delta) = mrope_position_ids(
            &input_ids,
            &grids,
            vision.special.spatial_merge_size,
            vision.special.image_token_id,
            vision.special.vision_start_token_id,
        )?;
        let image_token_count = images.iter().map(|i| i.n_tokens).sum();
        Ok(Prompt { text, input_ids, images, positions, rope_delta, image_token_count })
    }

    /// Most bytes of message text a prompt of `context_window` tokens can hold, so that longer
    /// text is refused before any tokenizing. A token never stands for more text bytes than its
    /// vocabulary entry's UTF-8 length (byte-level BPE writes each byte as a char of 1 or 2 UTF-8
    /// bytes; SentencePiece writes a space as the 3-byte `▁` and a fallback byte as `<0xAB>`), so
    /// text of B bytes makes at least B / longest tokens, allowing for the normalizer (see
    /// `NORMALIZATION_SLACK`).
    pub fn max_text_bytes(&self, context_window: usize) -> usize {
        context_window.saturating_mul(self.longest_token_bytes).saturating_mul(NORMALIZATION_SLACK)
    }

    /// Whether the model takes images.
    pub fn takes_images(&self) -> bool {
        self.vision.is_some()
    }

    /// Detokenizes generated ids.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, InputError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| InputError::Tokenize { reason: e.to_string() })
    }

    /// Ids that end generation: `generation_config.json`'s, then `config.json`'s.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }

    /// The image processor settings (`None` for a text-only model).
    pub fn image_config(&self) -> Option<&ImageProcessorConfig> {
        self.vision.as_ref().map(|v| &v.image_config)
    }

    /// The multimodal special tokens (`None` for a text-only model).
    pub fn special_tokens(&self) -> Option<&SpecialTokens> {
        self.vision.as_ref().map(|v| &v.special)
    }

    fn validate(&self, messages: &[ChatMessage]) -> Result<(), InputError> {
        if messages.is_empty() {
            return Err(InputError::EmptyConversation);
        }
        let mut images = 0;
        for (m, message) in messages.iter().enumerate() {
            if !ROLES.contains(&message.role.as_str()) {
                return Err(InputError::InvalidRole {
                    field: format!("messages[{m}].role"),
                    role: message.role.clone(),
                });
            }
            for (p, part) in message.content.iter().enumerate() {
                match part {
                    ContentPart::Image { .. } if self.vision.is_none() => {
                        return Err(InputError::ImagesUnsupported {
                            field: format!("messages[{m}].content[{p}].image"),
                            model_type: self.model_type.clone(),
                        })
                    }
                    ContentPart::Image { .. } => images += 1,
                    ContentPart::Text(text) => self.check_text(text, m, p)?,
                }
            }
        }
        if images > self.options.max_images {
            return Err(InputError::TooManyImages { count: images, limit: self.options.max_images });
        }
        Ok(())
    }

    /// HF's processor would pair a placeholder typed by the user with the next real image.
    fn check_text(&self, text: &str, message: usize, part: usize) -> Result<(), InputError> {
        let Some(vision) = &self.vision else { return Ok(()) };
        let reserved = std::iter::once(&vision.special.image_token).chain(&vision.special.reserved);
        match reserved.into_iter().find(|token| text.contains(token.as_str())) {
            Some(token) => Err(InputError::ReservedToken {
                field: format!("messages[{message}].content[{part}].text"),
                token: token.clone(),
            }),
            None => Ok(()),
        }
    }

    fn prepare_images(
        &self,
        vision: &VisionInputs,
        messages: &[ChatMessage],
    ) -> Result<Vec<PreparedImage>, InputError> {
        let mut images = Vec::new();
        for (m, message) in messages.iter().enumerate() {
            for (p, part) in message.content.iter().enumerate() {
                if let ContentPart::Image { data, mime_type } = part {
                    let field = format!("messages[{m}].content[{p}].image");
                    let prepared = decode_image_with_limit(data, mime_type, self.options.max_decoded_pixels)
                        .and_then(|img| preprocess_image(&img, &vision.image_config));
                    images.push(prepared.map_err(|e| e.at_field(field))?);
                }
            }
        }
        Ok(images)
    }

    /// Like the processor's tokenizer call, special tokens are added unless the prompt already
    /// starts with the BOS token (Qwen's tokenizers add none either way).
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, InputError> {
        let add_special = !self.bos_token.as_deref().is_some_and(|bos| text.starts_with(bos));
        let encoding = self
            .tokenizer
            .encode(text, add_special)
            .map_err(|e| InputError::Tokenize { reason: e.to_string() })?;
        Ok(encoding.get_ids().to_vec())
    }
}

/// Replaces the i-th image placeholder token with image i's `n_tokens` copies. Equivalent to
/// HF's expansion in the text because the placeholder is an added token, which the tokenizer
/// splits off before anything else.
fn expand_image_tokens(
    ids: &[u32],
    images: &[PreparedImage],
    image_token: u32,
) -> Result<Vec<u32>, InputError> {
    let placeholders = ids.iter().filter(|&&id| id == image_token).count();
    if placeholders != images.len() {
        return Err(InputError::ImagePlaceholderMismatch { placeholders, images: images.len() });
    }
    let extra: usize = images.iter().map(|i| i.n_tokens.saturating_sub(1)).sum();
    let mut expanded = Vec::with_capacity(ids.len() + extra);
    let mut next_image = images.iter();
    for &id in ids {
        if id == image_token {
            let n_tokens = next_image.next().map_or(1, |image| image.n_tokens);
            expanded.extend(std::iter::repeat_n(id, n_tokens));
        } else {
            expanded.push(id);
        }
    }
    Ok(expanded)
}

fn template_messages(messages: &[ChatMessage]) -> Vec<TemplateMessage> {
    messages
        .iter()
        .map(|m| TemplateMessage {
            role: m.role.clone(),
            content: TemplateContent::Parts(m.content.iter().map(template_part).collect()),
        })
        .collect()
}

/// A text model's messages: the text parts of each joined by newlines (as vLLM does for a
/// template that reads `content` as a string).
fn text_messages(messages: &[ChatMessage]) -> Vec<TemplateMessage> {
    fn text_of(part: &ContentPart) -> Option<&str> {
        match part {
            ContentPart::Text(text) => Some(text),
            ContentPart::Image { .. } => None,
        }
    }
    messages
        .iter()
        .map(|m| TemplateMessage {
            role: m.role.clone(),
            content: TemplateContent::Text(
                m.content.iter().filter_map(text_of).collect::<Vec<_>>().join("\n"),
            ),
        })
        .collect()
}

fn template_part(part: &ContentPart) -> TemplatePart {
    match part {
        ContentPart::Text(text) => TemplatePart::Text { text: text.clone() },
        ContentPart::Image { .. } => TemplatePart::Image,
    }
}

fn load_tokenizer(path: &Path) -> Result<Tokenizer, LoadError> {
    Tokenizer::from_file(path)
        .map_err(|e| LoadError::Tokenizer { path: path.to_path_buf(), reason: e.to_string() })
}

impl VisionInputs {
    fn load(
        dir: &Path,
        config: &TargetConfig,
        tokenizer: &Tokenizer,
        options: &PromptOptions,
    ) -> Result<Self, LoadError> {
        let mut image_config = ImageProcessorConfig::from_model_dir(dir)?
            .with_pixel_bounds(options.min_pixels, options.max_pixels)
            .map_err(|reason| LoadError::InvalidOption { name: "min_pixels/max_pixels", reason })?;
        image_config.alpha = options.alpha;
        image_config.backend = options.image_backend;
        let special = special_tokens(config, tokenizer, &image_config)
            .map_err(|reason| LoadError::InvalidConfig { path: dir.join("config.json"), reason })?;
        Ok(Self { image_config, special })
    }
}

/// Special ids are top-level keys of `config.json` in both VLM families; fall back to the
/// tokenizer's standard placeholder strings like HF's processor does.
fn special_tokens(
    config: &TargetConfig,
    tokenizer: &Tokenizer,
    image_config: &ImageProcessorConfig,
) -> Result<SpecialTokens, String> {
    let id_of = |id: Option<u32>, key: &str, default_text: &str| {
        id.or_else(|| tokenizer.token_to_id(default_text))
            .ok_or_else(|| format!("no {key} (and the tokenizer has no {default_text})"))
    };
    let image_token_id = id_of(config.top.image_token_id, "image_token_id", DEFAULT_IMAGE_TOKEN)?;
    let vision_start_token_id =
        id_of(config.top.vision_start_token_id, "vision_start_token_id", DEFAULT_VISION_START_TOKEN)?;
    let image_token = tokenizer
        .id_to_token(image_token_id)
        .ok_or_else(|| format!("image_token_id {image_token_id} is not in the tokenizer"))?;
    let video_token = config
        .top
        .video_token_id
        .and_then(|id| tokenizer.id_to_token(id))
        .unwrap_or_else(|| DEFAULT_VIDEO_TOKEN.to_string());
    let spatial_merge_size = spatial_merge_size(config, image_config)?;
    Ok(SpecialTokens {
        image_token_id,
        vision_start_token_id,
        image_token,
        reserved: vec![video_token],
        spatial_merge_size,
    })
}

/// The processor expands placeholders with its own `merge_size` while the model positions them
/// with the vision config's; a checkpoint where they differ cannot work.
fn spatial_merge_size(config: &TargetConfig, image_config: &ImageProcessorConfig) -> Result<usize, String> {
    let model = config.spatial_merge_size().unwrap_or(image_config.merge_size);
    if model != image_config.merge_size {
        return Err(format!(
            "vision_config.spatial_merge_size {model} differs from the preprocessor's merge_size {}",
            image_config.merge_size
        ));
    }
    Ok(model)
}

fn eos_token_ids(
    dir: &Path,
    config: &TargetConfig,
    tokenizer_config: Option<&serde_json::Value>,
    tokenizer: &Tokenizer,
) -> Result<Vec<u32>, LoadError> {
    let generation = read_optional_json(&dir.join("generation_config.json"))?;
    let mut ids: Vec<u32> =
        generation.as_ref().and_then(|g| g.get("eos_token_id")).map(id_list).unwrap_or_default();
    ids.extend(config.eos_token_ids());
    if ids.is_empty() {
        let eos_text = tokenizer_config.and_then(|c| token_text(c.get("eos_token")?));
        ids.extend(eos_text.and_then(|t| tokenizer.token_to_id(&t)));
    }
    let mut seen = std::collections::HashSet::new();
    ids.retain(|id| seen.insert(*id));
    if ids.is_empty() {
        return Err(LoadError::InvalidConfig {
            path: dir.join("generation_config.json"),
            reason: "no eos_token_id in generation_config.json, config.json or tokenizer_config.json".into(),
        });
    }
    Ok(ids)
}

/// `eos_token_id` is an int or a list of ints.
fn id_list(value: &serde_json::Value) -> Vec<u32> {
    let to_id = |v: &serde_json::Value| v.as_u64().and_then(|id| u32::try_from(id).ok());
    match value {
        serde_json::Value::Array(items) => items.iter().filter_map(to_id).collect(),
        single => to_id(single).into_iter().collect(),
    }
}
