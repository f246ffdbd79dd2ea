//! A measuring instrument, not a decoding method: the shipped head's work with a chosen
//! quality. An oracle head runs the real head (so drafting costs exactly what it costs) and then
//! drafts AR's own next token with probability `agreement` (a fixed pseudo-random draw per
//! position), a wrong token otherwise. Verification is untouched, so outputs stay identical to
//! AR. Sweeping `agreement` shows what speedup a head of that quality would give on this
//! backend — the ceiling that head training is chasing.

use std::cell::RefCell;

use burn::tensor::{Tensor, TensorData};
use eesd::core::{DraftHead, DraftLogits};
use eesd::models::{AnyHead, AnyHeadCache, Llama, ModelError};

/// An oracle's quality and the sequence it knows (prompt + AR's answer).
pub struct Oracle {
    agreement: f64,
    target: RefCell<Vec<u32>>,
}

impl Oracle {
    /// An oracle agreeing with AR at a rate of `agreement` in [0, 1].
    pub fn new(agreement: f64) -> anyhow::Result<Self> {
        anyhow::ensure!(
            (0.0..=1.0).contains(&agreement),
            "oracle agreement {agreement} must lie in [0, 1]"
        );
        Ok(Oracle {
            agreement,
            target: RefCell::new(Vec::new()),
        })
    }

    /// Whether the draft predicting `position` agrees (a fixed draw per position).
    fn agrees(&self, position: usize) -> bool {
        // SplitMix64 of the position: uniform, reproducible, independent of the policy.
        let mut z = (position as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((z >> 11) as f64 / (1u64 << 53) as f64) < self.agreement
    }
}

/// A benchmark head: a real head, optionally steered by an [`Oracle`].
pub struct BenchHead {
    /// The head doing the work.
    pub head: AnyHead,
    /// When set, the drafts come from the oracle.
    pub oracle: Option<Oracle>,
}

impl BenchHead {
    /// Tells the oracle (if any) the sequence AR produced for the next question.
    pub fn set_target(&self, prompt: &[u32], answer: &[u32]) {
        if let Some(o) = &self.oracle {
            *o.target.borrow_mut() = prompt.iter().chain(answer).copied().collect();
        }
    }
}

impl DraftHead<Llama> for BenchHead {
    type Cache = AnyHeadCache;

    fn exit_layer(&self) -> Option<usize> {
        self.head.exit_layer()
    }

    fn new_cache(&self, model: &Llama) -> AnyHeadCache {
        self.head.new_cache(model)
    }

    fn draft_logits(
        &self,
        model: &Llama,
        hidden: Tensor<2>,
        cache: &mut AnyHeadCache,
    ) -> Result<DraftLogits, ModelError> {
        let past = self.head.cached_len(cache);
        let rows = hidden.dims()[0];
        let real = self.head.draft_logits(model, hidden, cache)?;
        let Some(oracle) = &self.oracle else {
            return Ok(real);
        };
        let [_, n] = real.logits.dims();
        let target = oracle.target.borrow();
        let mut values = vec![0f32; rows * n];
        for r in 0..rows {
            // The row at position p predicts the token at p + 1.
            let next = past + r + 1;
            let column = target.get(next).and_then(|&t| match &real.token_ids {
                Some(ids) => ids.iter().position(|&id| id == t),
                None => Some(t as usize),
            });
            let pick = match column {
                Some(c) if oracle.agrees(next) => c,
                Some(c) => (c + 1) % n,
                None => 0,
            };
            values[r * n + pick] = 30.0;
        }
        let device = real.logits.device();
        Ok(DraftLogits {
            logits: Tensor::from_data(TensorData::new(values, [rows, n]), &device),
            token_ids: real.token_ids,
            context_columns: real.context_columns,
        })
    }

    fn extend(
        &self,
        model: &Llama,
        hidden: Tensor<2>,
        cache: &mut AnyHeadCache,
    ) -> Result<(), ModelError> {
        self.head.extend(model, hidden, cache)
    }

    fn observe_tokens(
        &self,
        model: &Llama,
        cache: &mut AnyHeadCache,
        first: usize,
        tokens: &[u32],
    ) -> Result<(), ModelError> {
        self.head.observe_tokens(model, cache, first, tokens)
    }

    fn cached_len(&self, cache: &AnyHeadCache) -> usize {
        self.head.cached_len(cache)
    }

    fn truncate(&self, cache: &mut AnyHeadCache, len: usize) {
        self.head.truncate(cache, len)
    }
}
