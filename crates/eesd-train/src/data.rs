//! Self-generated training data: the frozen model's own answers to training prompts, greedy
//! or sampled.
//!
//! Decoding is memory-bound, so answers are generated for several prompts at once
//! ([`Llama::decode_batch`]): each step streams the weights once for every active sequence.
//! Slots are refilled as soon as a sequence finishes (continuous batching), so a long answer
//! does not hold the others back.

use burn::tensor::Tensor;
use eesd_core::sampling::{Sampler, SamplingParams};
use eesd_models::{KvCache, Llama};

use crate::distill::Sequence;
use crate::error::{Result, TrainError};

/// Settings of [`generate_answers`].
#[derive(Debug, Clone)]
pub struct AnswerConfig {
    /// Answer length cap in tokens.
    pub max_new_tokens: usize,
    /// Tokens that end an answer (kept in the sequence).
    pub stop_tokens: Vec<u32>,
    /// Sequences decoded together (1 = one at a time).
    pub batch: usize,
    /// How each answer token is chosen: greedy (the default) or sampled, e.g. at temperature
    /// 0.8 for a second, more varied copy of the data.
    pub sampling: SamplingParams,
}

impl Default for AnswerConfig {
    fn default() -> Self {
        AnswerConfig {
            max_new_tokens: 128,
            stop_tokens: Vec::new(),
            batch: 8,
            sampling: SamplingParams::greedy(),
        }
    }
}

/// A prompt to answer: its token ids and the seed of its own random draws (used only when
/// sampling). Each prompt draws from its own seeded source, so a sampled answer depends on the
/// prompt and its seed alone, not on which prompts share its batch or on the order they finish:
/// a resumed run that answers the missing prompts gets the answers a full run would have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerPrompt {
    /// Prompt token ids (chat template applied).
    pub tokens: Vec<u32>,
    /// Seed of this prompt's sampled answer.
    pub seed: u64,
}

impl From<Vec<u32>> for AnswerPrompt {
    /// A prompt with seed 0 (all a greedy answer needs).
    fn from(tokens: Vec<u32>) -> Self {
        AnswerPrompt { tokens, seed: 0 }
    }
}

/// One sequence being answered.
struct Slot {
    index: usize,
    tokens: Vec<u32>,
    prompt_len: usize,
    cache: KvCache,
    sampler: Sampler,
}

/// Answers every prompt with the frozen `model` (greedy, or sampled under `config.sampling`
/// with each prompt's own seed) and hands each finished [`Sequence`] (prompt + answer) to
/// `on_sequence` with the prompt's index in `prompts`, in completion order. Prompts must be
/// non-empty and leave room for the answer inside the model's context.
pub fn generate_answers<P: Into<AnswerPrompt>>(
    model: &Llama,
    prompts: impl IntoIterator<Item = P>,
    config: &AnswerConfig,
    mut on_sequence: impl FnMut(usize, Sequence) -> Result<()>,
) -> Result<()> {
    if config.batch == 0 || config.max_new_tokens == 0 {
        return Err(TrainError::InvalidConfig(
            "answer generation needs batch ≥ 1 and max_new_tokens ≥ 1".into(),
        ));
    }
    config
        .sampling
        .validate()
        .map_err(|e| TrainError::InvalidConfig(e.to_string()))?;
    let context = model.config().context_length;
    let mut prompts = prompts.into_iter().enumerate();
    let mut slots: Vec<Slot> = Vec::with_capacity(config.batch);
    loop {
        // Refill free slots: prefill the prompt and take its first answer token.
        while slots.len() < config.batch {
            let Some((index, prompt)) = prompts.next() else {
                break;
            };
            let AnswerPrompt {
                tokens: prompt,
                seed,
            } = prompt.into();
            if prompt.is_empty() || prompt.len() + config.max_new_tokens > context {
                return Err(TrainError::InvalidConfig(format!(
                    "a prompt of {} tokens plus {} answer tokens does not fit the context of {context}",
                    prompt.len(),
                    config.max_new_tokens
                )));
            }
            let mut cache = model.new_cache();
            let logits = model.forward_last(&prompt, &mut cache)?;
            let mut slot = Slot {
                index,
                prompt_len: prompt.len(),
                tokens: prompt,
                cache,
                sampler: Sampler::new(seed),
            };
            let row = host_rows(logits.unsqueeze_dim(0))?;
            let first = slot.sampler.sample(&row[0], &config.sampling);
            slot.tokens.push(first);
            if finished(&slot, config) {
                on_sequence(slot.index, into_sequence(slot))?;
            } else {
                slots.push(slot);
            }
        }
        if slots.is_empty() {
            return Ok(());
        }
        // One token for every active sequence.
        let last: Vec<u32> = slots.iter().map(|s| s.tokens[s.tokens.len() - 1]).collect();
        let mut caches: Vec<KvCache> = slots
            .iter_mut()
            .map(|s| std::mem::replace(&mut s.cache, KvCache::new(0)))
            .collect();
        let logits = host_rows(model.decode_batch(&last, &mut caches)?)?;
        let mut kept = Vec::with_capacity(slots.len());
        for ((mut slot, cache), row) in slots.into_iter().zip(caches).zip(&logits) {
            slot.cache = cache;
            let token = slot.sampler.sample(row, &config.sampling);
            slot.tokens.push(token);
            if finished(&slot, config) {
                on_sequence(slot.index, into_sequence(slot))?;
            } else {
                kept.push(slot);
            }
        }
        slots = kept;
    }
}

fn finished(slot: &Slot, config: &AnswerConfig) -> bool {
    let answer = &slot.tokens[slot.prompt_len..];
    answer.len() >= config.max_new_tokens
        || answer
            .last()
            .is_some_and(|t| config.stop_tokens.contains(t))
}

fn into_sequence(slot: Slot) -> Sequence {
    Sequence {
        tokens: slot.tokens,
        prompt_len: slot.prompt_len,
    }
}

/// The rows of a `[rows, vocab]` logits tensor on the host.
fn host_rows(logits: Tensor<2>) -> Result<Vec<Vec<f32>>> {
    let [_, vocab] = logits.dims();
    let values = logits
        .into_data()
        .try_into_vec::<f32>()
        .map_err(|e| TrainError::TensorData(format!("{e:?}")))?;
    Ok(values.chunks(vocab.max(1)).map(<[f32]>::to_vec).collect())
}
