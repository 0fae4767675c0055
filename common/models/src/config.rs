//! A target checkpoint's `config.json`, parsed once into typed structs that the model families,
//! the input pipeline, the draft head and the fingerprint all read. Both spellings transformers
//! writes are accepted: 5.x nests a VLM's language model under `text_config` and spells rope
//! settings `rope_parameters`; 4.x hub files keep them at the top level as `rope_scaling` +
//! `rope_theta`. A text-only checkpoint (Llama, Qwen3) is flat. Each family resolves the
//! language-model section with its own defaults ([`TargetConfig::text_config`]), so there is one
//! rule for every derived value (`head_dim` among them).

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::layers::Activation;
use crate::text::{MropeLayout, RopeScaling, TextConfig};
use crate::ModelError;

/// The supported families: two vision-language models and two text-only ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Qwen3Vl,
    Qwen25Vl,
    /// `LlamaForCausalLM` (Llama 2/3, SmolLM2).
    Llama,
    /// `Qwen3ForCausalLM`.
    Qwen3,
}

impl Family {
    pub const ALL: [Family; 4] = [Self::Qwen3Vl, Self::Qwen25Vl, Self::Llama, Self::Qwen3];

    pub fn model_type(self) -> &'static str {
        match self {
            Self::Qwen3Vl => "qwen3_vl",
            Self::Qwen25Vl => "qwen2_5_vl",
            Self::Llama => "llama",
            Self::Qwen3 => "qwen3",
        }
    }

    fn from_model_type(model_type: &str) -> Result<Self, ModelError> {
        Self::ALL
            .into_iter()
            .find(|family| family.model_type() == model_type)
            .ok_or_else(|| ModelError::UnsupportedModel(model_type.to_string()))
    }

    /// Whether the family has a vision tower (and takes images).
    pub fn is_multimodal(self) -> bool {
        matches!(self, Self::Qwen3Vl | Self::Qwen25Vl)
    }

    /// transformers' default `rope_theta` for the family's text config.
    fn default_rope_theta(self) -> f64 {
        match self {
            Self::Qwen3Vl => 500_000.0,
            Self::Qwen25Vl => 1_000_000.0,
            Self::Llama | Self::Qwen3 => 10_000.0,
        }
    }

    /// Qwen3 language model (q/k norm, `head_dim` key, optional attention bias) rather than
    /// Qwen2 (q/k/v bias, head_dim = hidden / heads) or Llama (optional bias everywhere).
    fn qwen3_text(self) -> bool {
        matches!(self, Self::Qwen3Vl | Self::Qwen3)
    }
}

/// `config.json` of a target model directory.
#[derive(Clone, Debug)]
pub struct TargetConfig {
    pub family: Family,
    /// The language-model section: `text_config`, else the top level.
    pub text: TextSection,
    /// Multimodal token ids and the other top-level keys.
    pub top: TopLevel,
    /// The vision tower's section, typed by the family that owns it.
    pub vision_config: Value,
}

/// The language-model keys as written; [`TargetConfig::text_config`] resolves the defaults.
#[derive(Clone, Debug, Deserialize)]
pub struct TextSection {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: usize,
    pub num_attention_heads: i64,
    pub num_key_value_heads: Option<i64>,
    pub head_dim: Option<i64>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    /// 5.x spelling of the rope settings.
    pub rope_parameters: Option<RopeSection>,
    /// 4.x spelling.
    pub rope_scaling: Option<RopeSection>,
    pub max_position_embeddings: Option<usize>,
    pub hidden_act: Option<String>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    /// Llama: bias on gate/up/down.
    pub mlp_bias: Option<bool>,
    /// Qwen3: sliding-window attention on the upper layers (unsupported when true).
    pub use_sliding_window: Option<bool>,
    pub eos_token_id: Option<IdList>,
}

/// `rope_parameters` / `rope_scaling`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct RopeSection {
    pub rope_theta: Option<f64>,
    pub mrope_section: Option<Vec<usize>>,
    pub mrope_interleaved: Option<bool>,
    /// default, linear, llama3, mrope…; early 4.x files spell it `type` (some write both).
    pub rope_type: Option<String>,
    #[serde(rename = "type")]
    pub legacy_type: Option<String>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<f64>,
}

/// The top-level keys besides the sections.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct TopLevel {
    #[serde(default)]
    pub model_type: String,
    pub image_token_id: Option<u32>,
    pub video_token_id: Option<u32>,
    pub vision_start_token_id: Option<u32>,
    pub vision_end_token_id: Option<u32>,
    pub tie_word_embeddings: Option<bool>,
    pub eos_token_id: Option<IdList>,
}

/// A token id or a list of them (`eos_token_id` is either).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum IdList {
    One(u32),
    Many(Vec<u32>),
}

impl IdList {
    pub fn ids(&self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![*id],
            Self::Many(ids) => ids.clone(),
        }
    }
}

impl TargetConfig {
    /// Reads `dir/config.json`.
    pub fn read(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let err = |reason: String| ModelError::Config { path: path.display().to_string(), reason };
        let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
        let root: Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        Self::from_json(&root).map_err(|e| match e {
            ModelError::Config { path: section, reason } => err(format!("{section}: {reason}")),
            other => other,
        })
    }

    /// From the parsed JSON of a `config.json`.
    pub fn from_json(root: &Value) -> Result<Self, ModelError> {
        let top: TopLevel = section(root, "top level")?;
        let family = Family::from_model_type(&top.model_type)?;
        let text = section(root.get("text_config").unwrap_or(root), "text_config")?;
        let vision_config = root.get("vision_config").cloned().unwrap_or(Value::Null);
        Ok(Self { family, text, top, vision_config })
    }

    /// The language model's hyper-parameters with the family's defaults.
    pub fn text_config(&self) -> Result<TextConfig, ModelError> {
        let (t, family) = (&self.text, self.family);
        let rope = t.rope_parameters.as_ref().or(t.rope_scaling.as_ref()).cloned().unwrap_or_default();
        let head_dim = self.head_dim();
        let mrope = self.rope_layout(&rope, head_dim)?;
        if t.use_sliding_window == Some(true) {
            return Err(invalid(
                "text_config",
                "use_sliding_window (sliding-window attention is not supported)",
            ));
        }
        let attention_bias = t.attention_bias.unwrap_or(false);
        let max_position_embeddings = t.max_position_embeddings.unwrap_or(32768);
        let activation = t.hidden_act.as_deref().unwrap_or("silu");
        Ok(TextConfig {
            vocab_size: t.vocab_size,
            hidden_size: t.hidden_size,
            intermediate_size: t.intermediate_size,
            num_layers: t.num_hidden_layers,
            num_heads: t.num_attention_heads,
            num_kv_heads: t.num_key_value_heads.unwrap_or(t.num_attention_heads),
            head_dim,
            rms_norm_eps: t.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope.rope_theta.or(t.rope_theta).unwrap_or(family.default_rope_theta()),
            rope_scaling: rope_scaling(&rope, max_position_embeddings)?,
            mrope,
            max_position_embeddings,
            activation: Activation::from_name(activation)
                .ok_or_else(|| invalid("text_config", "hidden_act"))?,
            tie_word_embeddings: self.tie_word_embeddings(),
            qkv_bias: if family == Family::Qwen25Vl { true } else { attention_bias },
            o_bias: family != Family::Qwen25Vl && attention_bias,
            mlp_bias: family == Family::Llama && t.mlp_bias.unwrap_or(false),
            qk_norm: family.qwen3_text(),
        })
    }

    /// Which position axis each rotary pair reads: M-RoPE sections for the VLMs, one axis for the
    /// text families.
    fn rope_layout(&self, rope: &RopeSection, head_dim: i64) -> Result<MropeLayout, ModelError> {
        if !self.family.is_multimodal() {
            return Ok(MropeLayout::Single);
        }
        let sections = rope.mrope_section.clone().ok_or_else(|| invalid("text_config", "mrope_section"))?;
        if sections.iter().sum::<usize>() as i64 != head_dim / 2 {
            return Err(invalid("text_config", "mrope_section (must sum to head_dim/2)"));
        }
        Ok(if rope.mrope_interleaved.unwrap_or(self.family.qwen3_text()) {
            MropeLayout::Interleaved(sections)
        } else {
            MropeLayout::Sectioned(sections)
        })
    }

    /// Width of one attention head: Qwen3 and Llama read `head_dim` (the text-only Qwen3's
    /// default is transformers' 128), Qwen2 derives it.
    pub fn head_dim(&self) -> i64 {
        let derived = self.text.hidden_size / self.text.num_attention_heads.max(1);
        match self.family {
            Family::Qwen3Vl | Family::Llama => self.text.head_dim.unwrap_or(derived),
            Family::Qwen3 => self.text.head_dim.unwrap_or(128),
            Family::Qwen25Vl => derived,
        }
    }

    /// The top level's `tie_word_embeddings` wins over the text section's.
    pub fn tie_word_embeddings(&self) -> bool {
        self.top.tie_word_embeddings.or(self.text.tie_word_embeddings).unwrap_or(false)
    }

    /// `eos_token_id` of the top level, then of the text section (either may be a list), each id
    /// once.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = Vec::new();
        for id in
            [&self.top.eos_token_id, &self.text.eos_token_id].into_iter().flatten().flat_map(IdList::ids)
        {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// `vision_config.spatial_merge_size` when the file states it.
    pub fn spatial_merge_size(&self) -> Option<usize> {
        self.vision_config.get("spatial_merge_size").and_then(Value::as_u64).map(|m| m as usize)
    }

    /// The vision section in the family's typed form.
    pub fn vision<T: serde::de::DeserializeOwned>(&self) -> Result<T, ModelError> {
        section(&self.vision_config, "vision_config")
    }
}

/// The frequency scaling of a Llama-style `rope_scaling` (or `rope_parameters`) object, as the
/// target models read theirs: for config files of other kinds (a draft head's).
pub fn parse_rope_scaling(value: &Value, max_position_embeddings: usize) -> Result<RopeScaling, ModelError> {
    if value.is_null() {
        return Ok(RopeScaling::None);
    }
    let rope: RopeSection = section(value, "rope_scaling")?;
    rope_scaling(&rope, max_position_embeddings)
}

/// The frequency scaling `rope_type` names. `mrope` and `default` scale nothing; the long-context
/// types this engine does not implement (yarn, dynamic, longrope) are refused rather than run
/// with the wrong frequencies.
fn rope_scaling(rope: &RopeSection, max_position_embeddings: usize) -> Result<RopeScaling, ModelError> {
    let factor = || rope.factor.ok_or_else(|| invalid("rope_parameters", "factor"));
    match rope.rope_type.as_deref().or(rope.legacy_type.as_deref()).unwrap_or("default") {
        "default" | "mrope" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: rope
                .low_freq_factor
                .ok_or_else(|| invalid("rope_parameters", "low_freq_factor"))?,
            high_freq_factor: rope
                .high_freq_factor
                .ok_or_else(|| invalid("rope_parameters", "high_freq_factor"))?,
            original_max_position_embeddings: rope
                .original_max_position_embeddings
                .unwrap_or(max_position_embeddings as f64),
        }),
        other => Err(ModelError::Config {
            path: "config.json (rope_parameters)".into(),
            reason: format!("rope_type {other:?} is not supported (supported: default, linear, llama3)"),
        }),
    }
}

/// Deserializes one section, naming it in the error.
fn section<T: serde::de::DeserializeOwned>(value: &Value, name: &str) -> Result<T, ModelError> {
    T::deserialize(value)
        .map_err(|e| ModelError::Config { path: format!("config.json ({name})"), reason: e.to_string() })
}

fn invalid(section: &str, key: &str) -> ModelError {
    ModelError::Config {
        path: format!("config.json ({section})"),
        reason: format!("missing or invalid key {key:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen25_hub() -> Value {
        serde_json::json!({
            "model_type": "qwen2_5_vl", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 300, "rope_theta": 1000.0, "head_dim": 99,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "image_token_id": 7, "vision_start_token_id": 5, "eos_token_id": [1, 2],
            "vision_config": {"spatial_merge_size": 2}
        })
    }

    #[test]
    fn the_4x_layout_resolves_with_qwen2_rules() {
        let config = TargetConfig::from_json(&qwen25_hub()).unwrap();
        let text = config.text_config().unwrap();
        assert_eq!(config.family, Family::Qwen25Vl);
        // Qwen2 ignores a stray head_dim key: 64 / 4.
        assert_eq!(text.head_dim, 16);
        assert_eq!(text.rope_theta, 1000.0);
        assert!(text.qkv_bias && !text.qk_norm);
        assert!(matches!(text.mrope, MropeLayout::Sectioned(_)));
        assert_eq!(config.eos_token_ids(), [1, 2]);
        assert_eq!(config.spatial_merge_size(), Some(2));
    }

    #[test]
    fn the_5x_layout_reads_text_config_and_rope_parameters() {
        let root = serde_json::json!({
            "model_type": "qwen3_vl", "image_token_id": 7, "vision_start_token_id": 5,
            "tie_word_embeddings": true,
            "text_config": {
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "head_dim": 8, "vocab_size": 300, "eos_token_id": 3,
                "rope_parameters": {"rope_theta": 5000.0, "mrope_section": [2, 1, 1]}
            }
        });
        let config = TargetConfig::from_json(&root).unwrap();
        let text = config.text_config().unwrap();
        assert_eq!((text.head_dim, text.num_kv_heads, text.rope_theta), (8, 4, 5000.0));
        assert!(text.tie_word_embeddings && text.qk_norm && !text.qkv_bias);
        assert!(matches!(text.mrope, MropeLayout::Interleaved(_)));
        assert_eq!(config.eos_token_ids(), [3]);
    }

    #[test]
    fn bad_files_are_named_errors() {
        let mut root = qwen25_hub();
        root["model_type"] = "llava".into();
        assert!(matches!(TargetConfig::from_json(&root), Err(ModelError::UnsupportedModel(_))));
        let mut root = qwen25_hub();
        root.as_object_mut().unwrap().remove("hidden_size");
        let err = TargetConfig::from_json(&root).unwrap_err().to_string();
        assert!(err.contains("text_config") && err.contains("hidden_size"), "{err}");
        let mut root = qwen25_hub();
        root["rope_scaling"]["mrope_section"] = serde_json::json!([1, 1, 1]);
        assert!(TargetConfig::from_json(&root).unwrap().text_config().is_err());
    }
}
