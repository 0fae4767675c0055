//! Writing what training produces: a model directory's `config.json` and safetensors files, with
//! the failing path in the error.

use std::path::{Path, PathBuf};

use tch::Tensor;

#[derive(Debug, thiserror::Error)]
#[error("cannot write {path}: {reason}")]
pub struct SaveError {
    pub path: PathBuf,
    pub reason: String,
}

impl SaveError {
    fn at(path: &Path, e: impl std::fmt::Display) -> Self {
        Self { path: path.to_path_buf(), reason: e.to_string() }
    }
}

/// Creates `dir` and its parents.
pub fn create_dir(dir: &Path) -> Result<(), SaveError> {
    std::fs::create_dir_all(dir).map_err(|e| SaveError::at(dir, e))
}

/// Pretty-printed JSON with a final newline, as `save_pretrained` writes it.
pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), SaveError> {
    let text = serde_json::to_string_pretty(value).expect("a JSON value always serializes");
    std::fs::write(path, text + "\n").map_err(|e| SaveError::at(path, e))
}

pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), SaveError> {
    Tensor::write_safetensors(tensors, path).map_err(|e| SaveError::at(path, e))
}

pub fn copy_file(from: &Path, to: &Path) -> Result<(), SaveError> {
    std::fs::copy(from, to).map(|_| ()).map_err(|e| SaveError::at(to, e))
}
