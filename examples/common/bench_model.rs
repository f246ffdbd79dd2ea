//! The model as the benchmark examples load it: by name or the cached SmolLM2, in the asked
//! dtype, with room for long answers, and its file's SHA-256 (trained heads are tied to it).

use std::path::{Path, PathBuf};

use anyhow::Result;
use eesd::core::Backend;
use eesd::models::{LoadOptions, LoadedModel, WeightDType, fetch, file_sha256};

/// The loaded model, its file and the file's SHA-256.
pub fn load(
    backend: Backend,
    model: Option<&Path>,
    dtype: WeightDType,
) -> Result<(LoadedModel, PathBuf, String)> {
    let device = backend.device()?;
    let path = fetch::resolve_model(model)?;
    let lm = LoadedModel::load(
        &path,
        &device,
        &LoadOptions {
            dtype,
            context_length: Some(4096),
        },
    )?;
    let sha = file_sha256(&path)?;
    Ok((lm, path, sha))
}
