//! The generation API shared by plain autoregressive (AR) decoding and EESD, so that both are
//! measured on equal terms: one [`GenerationConfig`], one streaming callback, one
//! [`GenerationStats`].

use std::ops::ControlFlow;

use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};
use crate::sampling::SamplingParams;

/// How tokens are produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// One full forward pass per token.
    #[default]
    Ar,
    /// Early-exiting speculative decoding: draft through the first N layers and an exit head,
    /// verify the block through the remaining layers.
    Eesd,
    /// Tree speculation: a [`crate::Drafter`] proposes a token tree, the full model verifies it
    /// in one pass with tree attention, and the longest matching path is kept.
    Tree,
}

impl std::str::FromStr for Mode {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "ar" => Ok(Mode::Ar),
            "eesd" => Ok(Mode::Eesd),
            "tree" => Ok(Mode::Tree),
            _ => Err(CoreError::InvalidConfig(format!(
                "unknown mode `{s}` (expected ar, eesd or tree)"
            ))),
        }
    }
}

/// Settings of one generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationConfig {
    /// Upper bound on generated tokens.
    pub max_new_tokens: usize,
    /// Tokens that end generation (emitted, then stop).
    pub stop_tokens: Vec<u32>,
    /// Strings that end generation once the decoded output contains them (needs a detokenizer,
    /// see [`crate::Generator::with_detokenizer`]).
    pub stop_strings: Vec<String>,
    /// Token selection (greedy when the temperature is 0).
    pub sampling: SamplingParams,
    /// Seed of the sampler.
    pub seed: u64,
    /// AR or EESD.
    pub mode: Mode,
    /// Exit layer N for EESD; `None` uses the head's own layer (required for heads that work
    /// after any layer).
    pub exit_layer: Option<usize>,
    /// Most drafted nodes verified per round in [`Mode::Tree`].
    #[serde(default = "default_tree_budget")]
    pub tree_budget: usize,
}

fn default_tree_budget() -> usize {
    16
}

impl Default for GenerationConfig {
    fn default() -> Self {
        GenerationConfig {
            max_new_tokens: 128,
            stop_tokens: Vec::new(),
            stop_strings: Vec::new(),
            sampling: SamplingParams::greedy(),
            seed: 0,
            mode: Mode::Ar,
            exit_layer: None,
            tree_budget: default_tree_budget(),
        }
    }
}

impl GenerationConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<()> {
        if self.stop_strings.iter().any(String::is_empty) {
            return Err(CoreError::InvalidConfig(
                "an empty stop string would stop at once".into(),
            ));
        }
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
    /// A stop string appeared in the output.
    StopString,
    /// The context is full.
    ContextFull,
    /// The token callback asked to stop.
    Callback,
}

/// Counts and timings of one generation.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationStats {
    /// AR or EESD.
    pub mode: Mode,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub new_tokens: usize,
    /// Wall time of the whole call (prefill + decoding).
    pub seconds: f64,
    /// Wall time of the prompt pass.
    pub prefill_seconds: f64,
    /// `new_tokens / seconds`.
    pub tokens_per_second: f64,
    /// Verification rounds (EESD) or decoding steps (AR: one per token).
    pub rounds: usize,
    /// Drafted tokens in all rounds.
    pub drafted: usize,
    /// Drafts the policy dropped unverified ([`eesd_bandit::Decision::Discard`]).
    pub discarded: usize,
    /// Accepted drafted tokens in all rounds.
    pub accepted: usize,
    /// `accepted_histogram[a]` = rounds in which exactly `a` drafted tokens were accepted.
    pub accepted_histogram: Vec<usize>,
    /// `drafted_histogram[k]` = rounds that drafted exactly `k` tokens.
    pub drafted_histogram: Vec<usize>,
    /// Mean tokens emitted per verification round: accepted drafts + the target's own token
    /// (Spec-Bench's "mean accepted tokens"; 1.0 for AR).
    pub mean_accepted: f64,
    /// Time spent drafting (first N layers + exit head), seconds.
    pub draft_seconds: f64,
    /// Time spent verifying (last M layers + LM head over the block), seconds.
    pub verify_seconds: f64,
    /// Name of the draft-length policy (EESD).
    pub policy: Option<String>,
}

impl GenerationStats {
    pub(crate) fn record_round(&mut self, drafted: usize, accepted: usize) {
        self.rounds += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        bump(&mut self.accepted_histogram, accepted);
        bump(&mut self.drafted_histogram, drafted);
    }

    pub(crate) fn finish(&mut self, seconds: f64) {
        self.seconds = seconds;
        self.tokens_per_second = self.new_tokens as f64 / seconds.max(1e-9);
        self.mean_accepted = if self.rounds == 0 {
            0.0
        } else {
            self.new_tokens as f64 / self.rounds as f64
        };
    }
}

fn bump(histogram: &mut Vec<usize>, i: usize) {
    if histogram.len() <= i {
        histogram.resize(i + 1, 0);
    }
    histogram[i] += 1;
}

/// Result of one generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationOutput {
    /// Generated ids (the stop token included when one ended generation).
    pub tokens: Vec<u32>,
    /// Why generation ended.
    pub stop_reason: StopReason,
    /// Counts and timings.
    pub stats: GenerationStats,
}

/// Turns token ids into text (for stop strings).
pub type Detokenizer<'a> = dyn Fn(&[u32]) -> String + 'a;

/// Collects emitted tokens, applies the stop conditions and streams to the callback.
pub(crate) struct Emitter<'c, F> {
    pub tokens: Vec<u32>,
    config: &'c GenerationConfig,
    detokenize: Option<&'c Detokenizer<'c>>,
    on_tokens: F,
}

impl<'c, F: FnMut(&[u32]) -> ControlFlow<()>> Emitter<'c, F> {
    pub fn new(
        config: &'c GenerationConfig,
        detokenize: Option<&'c Detokenizer<'c>>,
        on_tokens: F,
    ) -> Result<Self> {
        if !config.stop_strings.is_empty() && detokenize.is_none() {
            return Err(CoreError::InvalidConfig(
                "stop_strings need a detokenizer".into(),
            ));
        }
        Ok(Emitter {
            // `max_new_tokens` is a bound, not a size (it may be `usize::MAX`).
            tokens: Vec::with_capacity(config.max_new_tokens.min(4096)),
            config,
            detokenize,
            on_tokens,
        })
    }

    /// Tokens still allowed.
    pub fn remaining(&self) -> usize {
        self.config.max_new_tokens.saturating_sub(self.tokens.len())
    }

    /// Emits a block; returns why to stop, if generation must end.
    pub fn emit(&mut self, block: &[u32]) -> Option<StopReason> {
        let mut block = &block[..block.len().min(self.remaining())];
        let mut reason = None;
        if let Some(i) = block
            .iter()
            .position(|t| self.config.stop_tokens.contains(t))
        {
            block = &block[..=i];
            reason = Some(StopReason::StopToken);
        }
        let start = self.tokens.len();
        self.tokens.extend_from_slice(block);
        if reason.is_none()
            && let Some(decode) = self.detokenize
            && !self.config.stop_strings.is_empty()
        {
            // Only text that includes a new token can newly contain a stop string, and a token
            // is at least one character: the tail as long as the longest stop string suffices.
            let longest = self.config.stop_strings.iter().map(String::len).max();
            let tail_from = start.saturating_sub(longest.unwrap_or(0));
            let contains_stop = |end: usize| {
                let text = decode(&self.tokens[tail_from..end]);
                self.config
                    .stop_strings
                    .iter()
                    .any(|s| text.contains(s.as_str()))
            };
            // Generation ends at the first token that completes a stop string, as one token at a
            // time (AR) would, however many tokens the round accepted.
            if contains_stop(self.tokens.len())
                && let Some(k) = (1..=block.len()).find(|&k| contains_stop(start + k))
            {
                block = &block[..k];
                self.tokens.truncate(start + k);
                reason = Some(StopReason::StopString);
            }
        }
        if (self.on_tokens)(block).is_break() && reason.is_none() {
            reason = Some(StopReason::Callback);
        }
        if reason.is_none() && self.remaining() == 0 {
            reason = Some(StopReason::MaxTokens);
        }
        reason
    }
}
