//! The two error boundaries of the input pipeline: what a client sent ([`InputError`], always the
//! client's fault, maps to INVALID_ARGUMENT) and what the model directory holds ([`LoadError`], the
//! operator's fault, fails server start-up).

use std::path::PathBuf;

/// A request that cannot be turned into model inputs. Every message starts with the request field
/// it is about (e.g. `messages[0].content[1].image: corrupt PNG data: ...`), so a client can find
/// the culprit without reading server logs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InputError {
    #[error("messages: the conversation is empty")]
    EmptyConversation,

    #[error("{field}: role {role:?} is not one of system, user, assistant")]
    InvalidRole { field: String, role: String },

    #[error("messages: {count} images in one request, at most {limit} are allowed")]
    TooManyImages { count: usize, limit: usize },

    #[error("{field}: text contains the reserved placeholder {token:?}; images must be sent as image parts")]
    ReservedToken { field: String, token: String },

    #[error(
        "{field}: unsupported mime type {mime:?}; expected image/png, image/jpeg or image/webp (or empty to detect)"
    )]
    UnsupportedMime { field: String, mime: String },

    #[error("{field}: unsupported image format {format}; expected PNG, JPEG or WebP")]
    UnsupportedImageFormat { field: String, format: String },

    #[error("{field}: corrupt {format} data: {reason}")]
    CorruptImage { field: String, format: &'static str, reason: String },

    #[error("{field}: image is {width}x{height} pixels, more than the {limit} pixels allowed")]
    TooManyPixels { field: String, width: u64, height: u64, limit: u64 },

    #[error("{field}: image is {width}x{height}; absolute aspect ratio must be smaller than 200")]
    ExtremeAspectRatio { field: String, height: usize, width: usize },

    #[error("{field}: image has no pixels ({width}x{height})")]
    EmptyImage { field: String, height: usize, width: usize },

    #[error(
        "{field}: image is {width}x{height}, not a multiple of {factor} pixels, and this model does not resize"
    )]
    NotPatchAligned { field: String, height: usize, width: usize, factor: usize },

    #[error("{field}: this model is text-only ({model_type}) and takes no images")]
    ImagesUnsupported { field: String, model_type: String },

    #[error("messages: chat template failed: {reason}")]
    Template { reason: String },

    #[error(
        "messages: the chat template placed {placeholders} image placeholders for {images} images (this model's template may ignore images in some roles)"
    )]
    ImagePlaceholderMismatch { placeholders: usize, images: usize },

    #[error("messages: tokenization failed: {reason}")]
    Tokenize { reason: String },

    #[error("input_ids: {reason}")]
    ImageTokenLayout { reason: String },
}

impl InputError {
    /// Re-anchors an error raised by a field-agnostic helper (e.g. [`super::decode_image`], which
    /// reports against `image`) at the request field it came from.
    pub fn at_field(mut self, path: impl Into<String>) -> Self {
        if let Some(field) = self.field_mut() {
            *field = path.into();
        }
        self
    }

    fn field_mut(&mut self) -> Option<&mut String> {
        match self {
            Self::InvalidRole { field, .. }
            | Self::ImagesUnsupported { field, .. }
            | Self::ReservedToken { field, .. }
            | Self::UnsupportedMime { field, .. }
            | Self::UnsupportedImageFormat { field, .. }
            | Self::CorruptImage { field, .. }
            | Self::TooManyPixels { field, .. }
            | Self::ExtremeAspectRatio { field, .. }
            | Self::EmptyImage { field, .. }
            | Self::NotPatchAligned { field, .. } => Some(field),
            Self::EmptyConversation
            | Self::TooManyImages { .. }
            | Self::Template { .. }
            | Self::ImagePlaceholderMismatch { .. }
            | Self::Tokenize { .. }
            | Self::ImageTokenLayout { .. } => None,
        }
    }
}

/// A model directory whose input-side files (tokenizer, chat template, preprocessor and model
/// configs) are missing or malformed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },

    #[error("{}: invalid JSON: {source}", path.display())]
    Json { path: PathBuf, source: serde_json::Error },

    #[error("{}: {reason}", path.display())]
    InvalidConfig { path: PathBuf, reason: String },

    #[error(
        "{}: no chat template (looked in processor_config.json, chat_template.json, chat_template.jinja and tokenizer_config.json)",
        dir.display()
    )]
    NoChatTemplate { dir: PathBuf },

    #[error("chat template does not compile: {reason}")]
    TemplateSyntax { reason: String },

    #[error("{}: cannot load tokenizer: {reason}", path.display())]
    Tokenizer { path: PathBuf, reason: String },

    #[error("invalid option {name}: {reason}")]
    InvalidOption { name: &'static str, reason: String },
}

pub(crate) fn read_to_string(path: &std::path::Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|source| LoadError::Io { path: path.to_path_buf(), source })
}

pub(crate) fn read_json(path: &std::path::Path) -> Result<serde_json::Value, LoadError> {
    let text = read_to_string(path)?;
    serde_json::from_str(&text).map_err(|source| LoadError::Json { path: path.to_path_buf(), source })
}

pub(crate) fn read_optional_json(path: &std::path::Path) -> Result<Option<serde_json::Value>, LoadError> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}
