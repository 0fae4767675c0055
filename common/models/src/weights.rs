//! Checkpoint access: a Hugging Face model directory's safetensors (single file or sharded with
//! `model.safetensors.index.json`), looked up by checkpoint name under both naming layouts found on
//! the hub, converted to the requested dtype and device, with shapes checked.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::config::TargetConfig;

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("model directory {0} has neither model.safetensors nor model.safetensors.index.json")]
    NoWeights(PathBuf),
    #[error("cannot read {path}: {reason}")]
    Read { path: PathBuf, reason: String },
    #[error("tensor {name} is missing from the checkpoint (also looked for {alternatives:?})")]
    Missing { name: String, alternatives: Vec<String> },
    #[error("tensor {name} has shape {actual:?}, the config implies {expected:?}")]
    Shape { name: String, expected: Vec<i64>, actual: Vec<i64> },
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
    /// Fresh weights instead of stored ones (training from scratch).
    random: Option<RandomInit>,
    /// Trainable: every tensor taken requires grad and is recorded, under its name.
    trainable: bool,
    taken: Vec<(String, Tensor)>,
}

/// How fresh weights are drawn: norms 1, biases 0, everything else N(0, std²), in the order the
/// model takes them (seeded, so the same config and seed give the same weights).
#[derive(Clone, Copy, Debug)]
pub struct RandomInit {
    pub std: f64,
}

impl Checkpoint {
    /// Reads every safetensors file of `dir`. Tensors are converted when taken, one at a time, so
    /// the peak memory is the checkpoint plus one converted tensor.
    pub fn open(dir: &Path, kind: Kind, device: Device) -> Result<Self, WeightsError> {
        let mut tensors = HashMap::new();
        for file in weight_files(dir)? {
            let loaded = Tensor::read_safetensors(&file)
                .map_err(|e| WeightsError::Read { path: file.clone(), reason: e.to_string() })?;
            tensors.extend(loaded);
        }
        Ok(Self { tensors, kind, device, random: None, trainable: false, taken: Vec::new() })
    }

    /// A checkpoint that makes up its weights as they are taken (see [`RandomInit`]); seed torch
    /// (`tch::manual_seed`) first for reproducible weights.
    pub fn random(init: RandomInit, kind: Kind, device: Device) -> Self {
        Self {
            tensors: HashMap::new(),
            kind,
            device,
            random: Some(init),
            trainable: false,
            taken: Vec::new(),
        }
    }

    /// Makes every tensor taken from now on a trainable parameter (requires grad, recorded).
    pub fn into_trainable(mut self) -> Self {
        self.trainable = true;
        self
    }

    /// The trainable parameters taken so far, by checkpoint name (5.x names), in load order.
    pub fn parameters(&self) -> &[(String, Tensor)] {
        &self.taken
    }

    /// Takes a weight by its transformers-5.x name (`model.language_model.*`, `model.visual.*`,
    /// `lm_head.*`), falling back to the 4.x hub names (`model.*`, `visual.*`), and checks its shape.
    pub fn take(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, WeightsError> {
        if let Some(init) = self.random {
            let tensor = fresh_tensor(name, shape, init, self.kind, self.device);
            return Ok(self.record(name, tensor));
        }
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

    /// [`Checkpoint::take`] for the (out, in) matrix of a linear map: a frozen one is kept in the
    /// layout its matmul runs fastest from ([`crate::layers::gemm_layout`]); a trainable one is the
    /// recorded parameter itself.
    pub fn take_matrix(&mut self, name: &str, shape: &[i64]) -> Result<Tensor, WeightsError> {
        let matrix = self.take(name, shape)?;
        Ok(if self.trainable { matrix } else { crate::layers::gemm_layout(matrix) })
    }

    /// A stored tensor as it is, on the checkpoint's device but in its own dtype (integer tables
    /// such as a draft vocabulary's index map), under exactly `name`.
    pub fn take_raw(&mut self, name: &str) -> Result<Tensor, WeightsError> {
        match self.tensors.remove(name) {
            Some(t) => Ok(t.to_device(self.device)),
            None => Err(WeightsError::Missing { name: name.to_string(), alternatives: Vec::new() }),
        }
    }

    /// Like [`Checkpoint::take`] for tensors whose shape the caller checks itself.
    pub fn take_any_shape(&mut self, name: &str) -> Result<Tensor, WeightsError> {
        let alternatives = legacy_names(name);
        let found = std::iter::once(name.to_string())
            .chain(alternatives.iter().cloned())
            .find_map(|candidate| self.tensors.remove(&candidate));
        match found {
            Some(t) => {
                let tensor = t.to_device(self.device).to_kind(self.kind);
                Ok(self.record(name, tensor))
            }
            None => Err(WeightsError::Missing { name: name.to_string(), alternatives }),
        }
    }

    fn record(&mut self, name: &str, tensor: Tensor) -> Tensor {
        if !self.trainable {
            return tensor;
        }
        let tensor = tensor.set_requires_grad(true);
        // A shallow clone shares the tensor (and its gradient) with the model.
        self.taken.push((name.to_string(), tensor.shallow_clone()));
        tensor
    }

    /// Whether a tensor exists under either layout (optional weights such as biases, lm_head).
    pub fn contains(&self, name: &str) -> bool {
        if self.random.is_some() {
            // Fresh models get an untied LM head and no optional biases.
            return name == "lm_head.weight" || !name.ends_with(".bias");
        }
        self.tensors.contains_key(name) || legacy_names(name).iter().any(|n| self.tensors.contains_key(n))
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Whether taken tensors are trainable parameters (then models keep them as stored, unfused).
    pub fn is_trainable(&self) -> bool {
        self.trainable
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

/// A fresh weight by the role its name gives it.
fn fresh_tensor(name: &str, shape: &[i64], init: RandomInit, kind: Kind, device: Device) -> Tensor {
    let is_norm = name.contains("norm") || name.contains("ln_q");
    let tensor = if name.ends_with(".bias") {
        Tensor::zeros(shape, (Kind::Float, device))
    } else if is_norm && shape.len() == 1 {
        Tensor::ones(shape, (Kind::Float, device))
    } else {
        Tensor::randn(shape, (Kind::Float, device)) * init.std
    };
    tensor.to_kind(kind)
}

/// The safetensors files of a model directory: the index's shards, or the single file.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, WeightsError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| WeightsError::Read { path: index.clone(), reason: e.to_string() })?;
        let parsed: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| WeightsError::Read { path: index.clone(), reason: e.to_string() })?;
        let map = parsed.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| WeightsError::Read {
            path: index.clone(),
            reason: "no weight_map object".into(),
        })?;
        let mut files: Vec<String> = map.values().filter_map(|v| v.as_str().map(String::from)).collect();
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

/// A transformers-5.x weight name followed by its 4.x hub spellings: the names to try, in order,
/// for a tensor of a checkpoint saved by either.
pub fn spellings(name: &str) -> Vec<String> {
    std::iter::once(name.to_string()).chain(legacy_names(name)).collect()
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

/// Reads only `names` from a model directory (single or sharded safetensors), seeking to each
/// tensor's bytes instead of loading whole files: the drafter needs two matrices of a target
/// whose checkpoint may be many gigabytes. Names the checkpoint lacks are simply absent from the
/// result (callers try alternative spellings). BF16, F16, F32 and F64 are converted to `kind` on
/// `device`.
pub fn read_named_tensors(
    dir: &Path,
    names: &[&str],
    kind: Kind,
    device: Device,
) -> Result<HashMap<String, Tensor>, WeightsError> {
    let mut found = HashMap::new();
    for file in weight_files(dir)? {
        let header = SafetensorsHeader::read(&file)?;
        for &name in names {
            if found.contains_key(name) {
                continue;
            }
            if let Some(entry) = header.entry(name)? {
                let tensor = header.read_tensor(&entry, None)?;
                found.insert(name.to_string(), tensor.to_device(device).to_kind(kind));
            }
        }
    }
    Ok(found)
}

/// A short, deterministic identity of a target model: FNV-1a (64-bit, hex) over its model_type,
/// language-model hidden size, layer count and vocabulary size, and the values (as f32) of the
/// first row of its input embedding. Cheap (reads one embedding row), independent of the storage
/// dtype when the values are exactly representable, and the same for the 4.x and 5.x layouts.
pub fn target_fingerprint(dir: &Path, config: &TargetConfig) -> Result<String, WeightsError> {
    let text = &config.text;
    let summary = format!(
        "{};hidden_size={};num_hidden_layers={};vocab_size={};",
        config.top.model_type, text.hidden_size, text.num_hidden_layers, text.vocab_size
    );
    let mut hash = fnv1a(0xcbf2_9ce4_8422_2325, summary.as_bytes());
    let row = first_embedding_row(dir)?;
    let row_bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
    hash = fnv1a(hash, &row_bytes);
    Ok(format!("{hash:016x}"))
}

/// 64-bit FNV-1a continued from `hash` (std's hashers are not guaranteed stable across releases).
fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// Row 0 of the input embedding (5.x or 4.x name) as f32 values, read without the rest.
fn first_embedding_row(dir: &Path) -> Result<Vec<f32>, WeightsError> {
    const NAME: &str = "model.language_model.embed_tokens.weight";
    let candidates = spellings(NAME);
    for file in weight_files(dir)? {
        let header = SafetensorsHeader::read(&file)?;
        for name in &candidates {
            if let Some(entry) = header.entry(name)? {
                let row = header.read_tensor(&entry, Some(1))?;
                return Vec::<f32>::try_from(row.to_kind(Kind::Float).flatten(0, -1))
                    .map_err(|e| WeightsError::Read { path: file.clone(), reason: e.to_string() });
            }
        }
    }
    Err(WeightsError::Missing { name: NAME.into(), alternatives: legacy_names(NAME) })
}

/// The JSON header of one safetensors file: where each tensor's bytes are.
struct SafetensorsHeader {
    path: PathBuf,
    data_start: u64,
    file_len: u64,
    entries: serde_json::Map<String, serde_json::Value>,
}

/// One tensor's dtype, shape and absolute byte range in its file.
struct SafetensorsEntry {
    name: String,
    kind: Kind,
    shape: Vec<i64>,
    begin: u64,
    end: u64,
}

impl SafetensorsHeader {
    /// Headers larger than this are refused rather than allocated (real ones are a few MB).
    const MAX_HEADER: u64 = 256 << 20;

    fn read(path: &Path) -> Result<Self, WeightsError> {
        use std::io::Read;
        let err = |reason: String| WeightsError::Read { path: path.to_path_buf(), reason };
        let mut file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
        let file_len = file.metadata().map_err(|e| err(e.to_string()))?.len();
        let mut len_bytes = [0u8; 8];
        file.read_exact(&mut len_bytes).map_err(|e| err(e.to_string()))?;
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > Self::MAX_HEADER || 8 + header_len > file_len {
            return Err(err(format!("implausible header length {header_len}")));
        }
        let mut json = vec![0u8; header_len as usize];
        file.read_exact(&mut json).map_err(|e| err(e.to_string()))?;
        let entries = serde_json::from_slice(&json).map_err(|e| err(e.to_string()))?;
        Ok(Self { path: path.to_path_buf(), data_start: 8 + header_len, file_len, entries })
    }

    /// The entry for `name`, `None` when this file does not hold it.
    fn entry(&self, name: &str) -> Result<Option<SafetensorsEntry>, WeightsError> {
        let Some(value) = self.entries.get(name) else {
            return Ok(None);
        };
        let err = |reason: &str| WeightsError::Read {
            path: self.path.clone(),
            reason: format!("tensor {name}: {reason}"),
        };
        let kind = match value.get("dtype").and_then(|d| d.as_str()) {
            Some("F32") => Kind::Float,
            Some("BF16") => Kind::BFloat16,
            Some("F16") => Kind::Half,
            Some("F64") => Kind::Double,
            other => return Err(err(&format!("unsupported dtype {other:?}"))),
        };
        let numbers = |key: &str| -> Option<Vec<u64>> {
            value.get(key)?.as_array()?.iter().map(|v| v.as_u64()).collect()
        };
        let shape = numbers("shape").ok_or_else(|| err("bad shape"))?;
        let offsets = numbers("data_offsets").ok_or_else(|| err("bad data_offsets"))?;
        let [begin, end] = offsets[..] else {
            return Err(err("data_offsets must have two entries"));
        };
        let (begin, end) = (self.data_start + begin, self.data_start + end);
        let elements = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| err("shape overflows"))?;
        let expected = elements.checked_mul(kind.elt_size_in_bytes() as u64);
        if begin > end || end > self.file_len || expected != Some(end - begin) {
            return Err(err("byte range does not match shape and dtype"));
        }
        Ok(Some(SafetensorsEntry {
            name: name.to_string(),
            kind,
            shape: shape.iter().map(|&d| d as i64).collect(),
            begin,
            end,
        }))
    }

    /// Reads the tensor, or only its first `rows` rows (along dim 0), on the CPU.
    fn read_tensor(&self, entry: &SafetensorsEntry, rows: Option<i64>) -> Result<Tensor, WeightsError> {
        use std::io::{Read, Seek, SeekFrom};
        let err = |reason: String| WeightsError::Read {
            path: self.path.clone(),
            reason: format!("tensor {}: {reason}", entry.name),
        };
        let mut shape = entry.shape.clone();
        let mut len = entry.end - entry.begin;
        if let (Some(rows), Some(first)) = (rows, shape.first_mut()) {
            let kept = rows.min(*first).max(0);
            if *first > 0 {
                len = len / *first as u64 * kept as u64;
            }
            *first = kept;
        }
        let mut file = std::fs::File::open(&self.path).map_err(|e| err(e.to_string()))?;
        file.seek(SeekFrom::Start(entry.begin)).map_err(|e| err(e.to_string()))?;
        let mut bytes = vec![0u8; len as usize];
        file.read_exact(&mut bytes).map_err(|e| err(e.to_string()))?;
        // safetensors stores little-endian data, which is the host order on every target we build.
        Tensor::f_from_data_size(&bytes, &shape, entry.kind).map_err(|e| err(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_names_cover_both_towers() {
        assert_eq!(legacy_names("model.language_model.norm.weight"), vec!["model.norm.weight"]);
        assert_eq!(legacy_names("model.visual.merger.ln_q.weight"), vec!["visual.merger.ln_q.weight"]);
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
