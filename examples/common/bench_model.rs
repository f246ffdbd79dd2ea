//! The model as the benchmark examples load it: by name or the cached SmolLM2, in the asked
//! dtype, with room for long answers, and its file's SHA-256 (trained heads are tied to it).

use std::path::PathBuf;

use anyhow::Result;
use eesd::core::Backend;
use eesd::models::{LoadOptions, LoadedModel, WeightDType, fetch, file_sha256};

/// The command-line flags that choose the model, its weight format and the backend.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// Weights: native (the file's quantized blocks), f32, f16 or bf16.
    #[arg(long, default_value = "native")]
    pub dtype: WeightDType,
    /// Model file or directory (default: the cached SmolLM2, fetched if absent).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Backend: flex, tch, tch-cuda, cuda or vulkan.
    #[arg(long, default_value = "flex")]
    pub device: Backend,
}

impl ModelArgs {
    /// The loaded model, its file and the file's SHA-256.
    pub fn load(&self) -> Result<(LoadedModel, PathBuf, String)> {
        let device = self.device.device()?;
        let path = fetch::resolve_model(self.model.as_deref())?;
        let lm = LoadedModel::load(
            &path,
            &device,
            &LoadOptions {
                dtype: self.dtype,
                context_length: Some(4096),
            },
        )?;
        let sha = file_sha256(&path)?;
        Ok((lm, path, sha))
    }
}
