//! The sampling flags of the examples that decode (`generate`, `spec_bench`).

use eesd::core::SamplingParams;

/// `--temperature`, `--top-p`, `--top-k` and `--seed`.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Top-k sampling (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The sampler these flags ask for, checked.
    pub fn params(&self) -> eesd::core::Result<SamplingParams> {
        let params = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
        };
        params.validate()?;
        Ok(params)
    }
}
