//! Checkpoint access: a Hugging Face model directory's safetensors (single file or sharded with
//! `model.safetensors.index.json`), looked up by checkpoint name under both naming layouts found on
//! the hub, converted to the requested dtype and device, with shapes checked.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("model directory {0} has neither model.safetensors nor model.safetensors.index.json")]
    NoWeights(PathBuf),
    #[error("cannot read {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("tensor {name} is missing from the checkpoint (also looked for {alternatives:?})")]
    Missing {
        name: String,
        alternatives: Vec<String>,
    },
    #[error("tensor {name} has shape {actual:?}, the config implies {expected:?}")]
    Shape {
        name: String,
        expected: Vec<i64>,
        actual: Vec<i64>,
    },
}

/// Parses a dtype name as used on the command line and in configs.
pub fn parse_kind(name: &str) -> Option<Kind> {
    match name.to_ascii_lowercase().as_str() {
        "f32" | "float32" | "float" => Some(Kind::Float),
        "bf16" | "bfloat16" => Some(Kind::BFloat16),
        "f16" | "float16" | "half" => Some(Kind::Half),
        _ => None,
    }
}

/// Parses `cpu`, `cuda` or `cuda:N`.
pub fn parse_device(name: &str) -> Option<Device> {
    match name {
        "cpu" => Some(Device::Cpu),
        "cuda" => Some(Device::Cuda(0)),
        _ => name.strip_prefix("cuda:")?.parse().ok().map(Device::Cuda),
    }
}

/// All tensors of a checkpoint, held on the CPU until taken.
pub struct Checkpoint {
    tensors: HashMap<String, Tensor>,
    kind: Kind,
    device: Device,
}

impl Checkpoint {
    /// Reads every safetensors file of `dir`. Tensors are converted when taken, one at a time, so
    /// the peak memory is the checkpoint plus one converted tensor.
    pub fn open(dir: &Path, kind: Kind, device: Device) -> Result<Self, WeightsError> {
        let mut tensors = HashMap::new();
        for file in weight_files(dir)? {
            let loaded = Tensor::read_safetensors(&file).map_err(|e| WeightsError::Read {
                path: file.clone(),
                reason: e.to_string(),
            })?;
            tensors.extend(loaded);
        }
        Ok(Self {
            tensors,
            kind,
            device,
        })
    }

    /// Takes a weight by its transformers-5.x name (`model.language_model.*`, `model.visual.*`,
    /// `lm_head.*`), falling back to the 4.x hub names (`model.*`, `visual.*`), and checks its shape.
    pub fn take(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, WeightsError> {
        let tensor = self.take_any_shape(name)?;
        if tensor.size() != shape {
            return Err(WeightsError::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                actual: tensor.size(),
            });
        }
        Ok(tensor)
    }

    /// Like [`Checkpoint::take`] for tensors whose shape the caller checks itself.
    pub fn take_any_shape(&mut self, name: &str) -> Result<Tensor, WeightsError> {
        let alternatives = legacy_names(name);
        let found = std::iter::once(name.to_string())
            .chain(alternatives.iter().cloned())
            .find_map(|candidate| self.tensors.remove(&candidate));
        match found {
            Some(t) => Ok(t.to_device(self.device).to_kind(self.kind)),
            None => Err(WeightsError::Missing {
                name: name.to_string(),
                alternatives,
            }),
        }
    }

    /// Whether a tensor exists under either layout (optional weights such as biases, lm_head).
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
            || legacy_names(name)
                .iter()
                .any(|n| self.tensors.contains_key(n))
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Names left after the model took what it needs (reported at load as a consistency warning).
    pub fn remaining(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        names
    }
}

/// The safetensors files of a model directory: the index's shards, or the single file.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, WeightsError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| WeightsError::Read {
            path: index.clone(),
            reason: e.to_string(),
        })?;
        let parsed: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| WeightsError::Read {
                path: index.clone(),
                reason: e.to_string(),
            })?;
        let map = parsed
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| WeightsError::Read {
                path: index.clone(),
                reason: "no weight_map object".into(),
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(WeightsError::NoWeights(dir.to_path_buf()))
}

/// The transformers-4.x hub names of a 5.x weight name.
fn legacy_names(name: &str) -> Vec<String> {
    if let Some(rest) = name.strip_prefix("model.language_model.") {
        vec![format!("model.{rest}")]
    } else if let Some(rest) = name.strip_prefix("model.visual.") {
        vec![format!("visual.{rest}")]
    } else {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_names_cover_both_towers() {
        assert_eq!(
            legacy_names("model.language_model.norm.weight"),
            vec!["model.norm.weight"]
        );
        assert_eq!(
            legacy_names("model.visual.merger.ln_q.weight"),
            vec!["visual.merger.ln_q.weight"]
        );
        assert!(legacy_names("lm_head.weight").is_empty());
    }

    #[test]
    fn parses_devices_and_kinds() {
        assert_eq!(parse_device("cuda:1"), Some(Device::Cuda(1)));
        assert_eq!(parse_device("cpu"), Some(Device::Cpu));
        assert_eq!(parse_device("tpu"), None);
        assert_eq!(parse_kind("bf16"), Some(Kind::BFloat16));
        assert_eq!(parse_kind("int8"), None);
    }
}
