//! A checkpoint's chat template, rendered with minijinja configured like transformers'
//! `_compile_jinja_template` (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
//! Python-style `tojson`, Python string/dict methods).

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;

use super::error::{read_json, read_optional_json, read_to_string, InputError, LoadError};
use super::pyjson;

const TEMPLATE_NAME: &str = "chat_template";

/// Special-token strings HF passes to every template (`tokenizer.special_tokens_map`).
const SPECIAL_TOKEN_KEYS: [&str; 4] = ["bos_token", "eos_token", "pad_token", "unk_token"];

/// One message as chat templates see it: HF's `{"role": ..., "content": ...}` shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TemplateMessage {
    pub role: String,
    pub content: TemplateContent,
}

/// A VLM processor's templates read a list of typed parts; a text model's tokenizer templates
/// concatenate `message['content']` as a string.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TemplateContent {
    Parts(Vec<TemplatePart>),
    Text(String),
}

/// A content part: `{"type": "text", "text": ...}` or `{"type": "image"}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum TemplatePart {
    Text { text: String },
    Image,
}

impl From<Vec<TemplatePart>> for TemplateContent {
    fn from(parts: Vec<TemplatePart>) -> Self {
        Self::Parts(parts)
    }
}

/// A compiled chat template plus the special-token variables it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    special_tokens: BTreeMap<String, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Loads the template the way HF's processor finds it (see [`find_template_source`]).
    /// Special-token variables come from `tokenizer_config.json` when it exists.
    pub fn from_model_dir(dir: &Path) -> Result<Self, LoadError> {
        let tokenizer_config = read_optional_json(&dir.join("tokenizer_config.json"))?;
        let source = find_template_source(dir, tokenizer_config.as_ref())?;
        let mut template = Self::from_source(source)?;
        if let Some(config) = &tokenizer_config {
            template.special_tokens = special_tokens_of(config);
        }
        Ok(template)
    }

    /// Compiles a template from its source text.
    pub fn from_source(source: impl Into<String>) -> Result<Self, LoadError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", pyjson::tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.into())
            .map_err(|e| LoadError::TemplateSyntax { reason: describe(&e) })?;
        Ok(Self { env, special_tokens: BTreeMap::new() })
    }

    /// Renders `messages` (anything serializing to HF's message list, e.g. `[TemplateMessage]`)
    /// like `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`.
    pub fn render(
        &self,
        messages: &impl Serialize,
        add_generation_prompt: bool,
    ) -> Result<String, InputError> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| template_error(&e))?;
        let mut ctx: BTreeMap<&str, Value> = self
            .special_tokens
            .iter()
            .map(|(key, text)| (key.as_str(), Value::from(text.as_str())))
            .collect();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        template.render(ctx).map_err(|e| template_error(&e))
    }
}

/// Exposed to templates; HF raises `TemplateError(message)`.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn template_error(err: &Error) -> InputError {
    InputError::Template { reason: describe(err) }
}

/// The error's own message (what `raise_exception` said) and where in the template it happened.
fn describe(err: &Error) -> String {
    let what = err.detail().map_or_else(|| err.kind().to_string(), str::to_string);
    match err.line() {
        Some(line) => format!("{what} (template line {line})"),
        None => what,
    }
}

/// HF's processor order: `processor_config.json`'s `chat_template`, the legacy
/// `chat_template.json`, then `chat_template.jinja`; the tokenizer's template last.
fn find_template_source(
    dir: &Path,
    tokenizer_config: Option<&serde_json::Value>,
) -> Result<String, LoadError> {
    let processor_config = read_optional_json(&dir.join("processor_config.json"))?;
    if let Some(source) = processor_config.as_ref().and_then(template_field) {
        return Ok(source);
    }
    let json_path = dir.join("chat_template.json");
    if json_path.exists() {
        let json = read_json(&json_path)?;
        return template_field(&json).ok_or_else(|| LoadError::InvalidConfig {
            path: json_path,
            reason: "no usable chat_template".into(),
        });
    }
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return read_to_string(&jinja);
    }
    tokenizer_config
        .and_then(template_field)
        .ok_or_else(|| LoadError::NoChatTemplate { dir: dir.to_path_buf() })
}

/// `chat_template` is either the source, or a list of `{name, template}` of which HF uses
/// `default`.
fn template_field(json: &serde_json::Value) -> Option<String> {
    match json.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => None,
    }
}

/// A special token in `tokenizer_config.json`: a string or an added-token `{"content": ...}`.
pub(crate) fn token_text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// The `bos_token` & co. variables HF passes to templates.
fn special_tokens_of(config: &serde_json::Value) -> BTreeMap<String, String> {
    let mut tokens = BTreeMap::new();
    for key in SPECIAL_TOKEN_KEYS {
        if let Some(text) = config.get(key).and_then(token_text) {
            tokens.insert(key.to_string(), text);
        }
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(parts: Vec<TemplatePart>) -> TemplateMessage {
        TemplateMessage { role: "user".into(), content: parts.into() }
    }

    #[test]
    fn renders_with_hf_whitespace_rules() {
        let source = "{% for m in messages %}\n  <{{ m.role }}>\n{% for c in m.content %}{% if c.type == 'image' %}[img]{% else %}{{ c.text }}{% endif %}{% endfor %}\n{% endfor %}{% if add_generation_prompt %}GO{% endif %}";
        let t = ChatTemplate::from_source(source).unwrap();
        let msgs = [user(vec![TemplatePart::Image, TemplatePart::Text { text: "hi".into() }])];
        // What jinja2 renders with HF's settings (checked with transformers 5.24).
        assert_eq!(t.render(&msgs, true).unwrap(), "  <user>\n[img]hiGO");
    }

    #[test]
    fn supports_python_methods_loop_controls_and_raise() {
        let source = "{% for m in messages %}{% if loop.index0 > 0 %}{% break %}{% endif %}{{ m.content[0].text.strip().split(',')[-1].startswith('b') }}{% endfor %}{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}";
        let t = ChatTemplate::from_source(source).unwrap();
        let one = [user(vec![TemplatePart::Text { text: " a,b ".into() }])];
        assert_eq!(t.render(&one, false).unwrap(), "True");
        let two = [one[0].clone(), one[0].clone()];
        let err = t.render(&two, false).unwrap_err();
        assert!(err.to_string().contains("only one message"), "{err}");
    }

    #[test]
    fn parts_serialize_in_hf_shape() {
        let json =
            serde_json::to_value(user(vec![TemplatePart::Text { text: "x".into() }, TemplatePart::Image]))
                .unwrap();
        assert_eq!(
            json,
            serde_json::json!({"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image"}]})
        );
    }
}
