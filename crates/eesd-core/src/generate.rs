//! The generation API: configuration, streaming loop and statistics.
//!
//! Plain autoregressive (AR) decoding lives here; early-exit speculative decoding plugs into the
//! same [`GenerationConfig`] / [`GenerationOutput`] so the two are compared on equal terms.

use std::ops::ControlFlow;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};
use crate::sampling::{Sampler, SamplingParams};

/// What the AR decoding loop needs from a model.
pub trait CausalModel {
    /// Per-sequence state (KV cache).
    type Cache;
    /// The model's error type.
    type Error: std::error::Error + Send + Sync + 'static;

    /// A fresh, empty cache.
    fn new_cache(&self) -> Self::Cache;
    /// Maximum positions (prompt + generated).
    fn context_length(&self) -> usize;
    /// Feeds `tokens` after what the cache holds and returns the logits of the last one.
    fn forward_last(
        &self,
        tokens: &[u32],
        cache: &mut Self::Cache,
    ) -> Result<Vec<f32>, Self::Error>;
}

/// Settings of one generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationConfig {
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
    /// Tokens that end generation (emitted, then stop).
    pub stop_tokens: Vec<u32>,
    /// Token selection.
    pub sampling: SamplingParams,
    /// Seed of the sampler.
    pub seed: u64,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        GenerationConfig {
            max_new_tokens: 128,
            stop_tokens: Vec::new(),
            sampling: SamplingParams::greedy(),
            seed: 0,
        }
    }
}

impl GenerationConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate()
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// A stop token was generated.
    StopToken,
    /// The context is full.
    ContextFull,
    /// The token callback asked to stop.
    Callback,
}

/// Timing and counts of one generation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationStats {
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub new_tokens: usize,
    /// Wall time of the whole call (prefill + decoding).
    pub seconds: f64,
    /// Wall time of the prompt pass (it also yields the first token).
    pub prefill_seconds: f64,
    /// `new_tokens / seconds`.
    pub tokens_per_second: f64,
}

/// Result of one generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationOutput {
    /// Generated ids (stop token included when one ended generation).
    pub tokens: Vec<u32>,
    /// Why generation ended.
    pub stop_reason: StopReason,
    /// Counts and timings.
    pub stats: GenerationStats,
}

/// Plain autoregressive generation, streaming each token to `on_token` as it is chosen.
///
/// Errors on an empty prompt or one that leaves no room in the context; stops cleanly with
/// [`StopReason::ContextFull`] when the context fills up during generation.
pub fn generate_ar<M: CausalModel>(
    model: &M,
    prompt: &[u32],
    config: &GenerationConfig,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<GenerationOutput> {
    config.validate()?;
    let context = model.context_length();
    if prompt.is_empty() {
        return Err(CoreError::InvalidConfig("empty prompt".into()));
    }
    if prompt.len() >= context {
        return Err(CoreError::PromptTooLong {
            prompt: prompt.len(),
            context,
        });
    }
    let start = Instant::now();
    let mut sampler = Sampler::new(config.seed);
    let mut cache = model.new_cache();
    let mut tokens = Vec::with_capacity(config.max_new_tokens);
    let mut prefill_seconds = 0.0;
    let mut stop_reason = StopReason::MaxTokens;
    let mut input: Vec<u32> = prompt.to_vec();
    while tokens.len() < config.max_new_tokens {
        if prompt.len() + tokens.len() >= context {
            stop_reason = StopReason::ContextFull;
            break;
        }
        let logits = model
            .forward_last(&input, &mut cache)
            .map_err(CoreError::model)?;
        if tokens.is_empty() {
            prefill_seconds = start.elapsed().as_secs_f64();
        }
        let next = sampler.sample(&logits, &config.sampling);
        tokens.push(next);
        if config.stop_tokens.contains(&next) {
            stop_reason = StopReason::StopToken;
            break;
        }
        if on_token(next).is_break() {
            stop_reason = StopReason::Callback;
            break;
        }
        input.clear();
        input.push(next);
    }
    let seconds = start.elapsed().as_secs_f64();
    let stats = GenerationStats {
        prompt_tokens: prompt.len(),
        new_tokens: tokens.len(),
        seconds,
        prefill_seconds,
        tokens_per_second: tokens.len() as f64 / seconds.max(1e-9),
    };
    Ok(GenerationOutput {
        tokens,
        stop_reason,
        stats,
    })
}
