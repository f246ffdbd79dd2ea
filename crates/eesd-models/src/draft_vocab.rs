//! A head's draft vocabulary: the rows of the model's LM head it projects onto. All of them, a
//! [`VocabSubset`] (the most frequent tokens of its training answers), and for one sequence the
//! subset widened by that sequence's own tokens ([`ContextTokens`]).
//!
//! A subset of 8,192 tokens keeps a draft's projection a sixth of the full one, but it misses
//! the rare tokens a prompt brings and the model then copies: names, the words of a text to
//! translate or summarise, a story's invented words. A head therefore also projects onto every
//! token of the sequence so far that its subset lacks (typically tens to a few hundred rows,
//! taken from the LM head when they first appear). Verification always uses the whole
//! vocabulary, so this changes the drafts only, never the output.

use std::collections::HashSet;
use std::sync::Arc;

use burn::module::Param;
use burn::tensor::Tensor;
use eesd_core::DraftLogits;

use crate::cpu::{PackedCache, QuantFormat, QuantMatrix};
use crate::error::{ModelError, Result};
use crate::layer::linear;
use crate::llama::Llama;
use crate::native::{lazy_param, quant_linear};
use crate::quant::quantize_q8_0;

/// A set of token ids the draft projects onto (e.g. the most frequent ones).
#[derive(Debug, Clone, PartialEq)]
pub struct VocabSubset {
    ids: Arc<Vec<u32>>,
    /// `members[t]`: token `t` is among `ids`.
    members: Arc<Vec<bool>>,
}

impl VocabSubset {
    /// Validates ids against the vocabulary size: non-empty, in range, no duplicates.
    pub fn new(ids: Vec<u32>, vocab_size: usize) -> Result<Self> {
        if ids.is_empty() {
            return Err(ModelError::InvalidArgument(
                "empty vocabulary subset".into(),
            ));
        }
        let mut seen = vec![false; vocab_size];
        for &id in &ids {
            let slot = seen
                .get_mut(id as usize)
                .ok_or(ModelError::TokenOutOfRange {
                    id,
                    vocab: vocab_size,
                })?;
            if std::mem::replace(slot, true) {
                return Err(ModelError::InvalidArgument(format!(
                    "token {id} appears twice in the vocabulary subset"
                )));
            }
        }
        Ok(VocabSubset {
            ids: Arc::new(ids),
            members: Arc::new(seen),
        })
    }

    /// The `n` most frequent ids of `counts` (index = token id), always including `always`
    /// (e.g. the end-of-sequence token).
    pub fn most_frequent(counts: &[u64], n: usize, always: &[u32]) -> Result<Self> {
        let mut order: Vec<u32> = (0..counts.len() as u32).collect();
        order.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        let mut ids: Vec<u32> = always.to_vec();
        ids.extend(
            order
                .into_iter()
                .filter(|id| !always.contains(id))
                .take(n.saturating_sub(always.len())),
        );
        Self::new(ids, counts.len())
    }

    /// The ids, in projection order.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the subset is empty (never true for a constructed value).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// The output projection of a head: the model's LM head, whole or restricted to a subset.
///
/// With native weights it is the LM head's own quantized rows ([`QuantMatrix::select_rows`]):
/// a draft then reads ≈ 1/4 of the bytes of an f32 copy, and its logits are exactly the
/// model's logits for those tokens. The dense form is made only where the quantized kernel
/// does not apply (another backend).
#[derive(Debug, Clone)]
pub(crate) struct Projection {
    pub(crate) weight: Param<Tensor<2>>,
    pub(crate) native: Option<Arc<QuantMatrix>>,
    pub(crate) ids: Option<Arc<Vec<u32>>>,
    /// `members[t]`: token `t` is among `ids` (subset projections only).
    members: Option<Arc<Vec<bool>>>,
    packed: PackedCache,
}

impl Projection {
    pub(crate) fn new(model: &Llama, subset: Option<&VocabSubset>) -> Result<Self> {
        Ok(match subset {
            Some(s) => Projection {
                members: Some(s.members.clone()),
                ..Self::rows(model, s.ids.clone())?
            },
            None => {
                let (native, weight) = match model.native_lm_head() {
                    Some(q) => (Some(q.clone()), lazy_param(q.clone(), model.device())),
                    None => (None, Param::from_tensor(model.lm_head().clone())),
                };
                Projection {
                    weight,
                    native,
                    ids: None,
                    members: None,
                    packed: PackedCache::default(),
                }
            }
        })
    }

    /// The LM head's rows of `ids` (validated against the vocabulary by the model).
    fn rows(model: &Llama, ids: Arc<Vec<u32>>) -> Result<Self> {
        let (native, weight) = model.lm_head_rows(&ids)?.into_parts();
        Ok(Projection {
            weight,
            native,
            ids: Some(ids),
            members: None,
            packed: PackedCache::default(),
        })
    }

    /// Projects from Q8_0 copies of the rows where it does not already.
    pub(crate) fn quantize_q8_0(&mut self) -> Result<()> {
        if self.native.is_none() {
            self.native = Some(Arc::new(q8_0_matrix(self.weight.val())?));
        }
        Ok(())
    }

    /// Logits over the projection's tokens.
    pub(crate) fn logits(&self, normed: Tensor<2>) -> DraftLogits {
        let quantized = self.native.as_ref().and_then(|q| quant_linear(&normed, q));
        DraftLogits {
            logits: quantized.unwrap_or_else(|| linear(normed, &self.weight.val(), &self.packed)),
            token_ids: self.ids.clone(),
            context_columns: 0,
        }
    }

    /// Logits over the projection's tokens, then over `context`'s tokens that it lacks (their
    /// rows made from the LM head the first time they are needed).
    pub(crate) fn logits_with(
        &self,
        model: &Llama,
        normed: Tensor<2>,
        context: &mut ContextTokens,
    ) -> Result<DraftLogits> {
        if context.seen.is_empty() {
            return Ok(self.logits(normed));
        }
        let (rows, ids) = match context.rows.take() {
            Some(made) => made,
            None => {
                let extra: Vec<u32> = context.seen.iter().map(|&(t, _)| t).collect();
                let mut rows = Self::rows(model, Arc::new(extra.clone()))?;
                if self.native.is_some() {
                    rows.quantize_q8_0()?;
                }
                let mut ids = self.ids.as_deref().cloned().unwrap_or_default();
                ids.extend(extra);
                (rows, Arc::new(ids))
            }
        };
        let base = self.logits(normed.clone());
        let logits = Tensor::cat(vec![base.logits, rows.logits(normed).logits], 1);
        let draft = DraftLogits {
            logits,
            token_ids: Some(ids.clone()),
            context_columns: context.seen.len(),
        };
        context.rows = Some((rows, ids));
        Ok(draft)
    }

    /// Whether `token` is outside the projection (never, for the whole vocabulary).
    fn lacks(&self, token: u32) -> bool {
        self.members
            .as_ref()
            .is_some_and(|m| !m.get(token as usize).copied().unwrap_or(false))
    }
}

/// A dense `[out, k]` matrix in Q8_0 blocks.
pub(crate) fn q8_0_matrix(t: Tensor<2>) -> Result<QuantMatrix> {
    let [out, k] = t.dims();
    let values = t
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| ModelError::InvalidArgument(format!("head weights: {e:?}")))?;
    QuantMatrix::new(QuantFormat::Q8_0, quantize_q8_0(&values), out, k)
        .map_err(|e| ModelError::InvalidArgument(format!("head weights: {e}")))
}

/// The tokens of one sequence that a head's draft vocabulary lacks, each with the position
/// where it first appeared, and the LM head's rows for them: part of a head's state
/// ([`crate::LayerHeadCache`]), so that forgetting positions forgets the tokens first seen
/// there and a new sequence starts from the subset alone.
#[derive(Debug, Clone, Default)]
pub struct ContextTokens {
    /// `(token, position)` in the order first seen.
    seen: Vec<(u32, usize)>,
    known: HashSet<u32>,
    /// The rows of `seen`'s tokens and the projection's ids followed by them; `None` until
    /// the next draft needs them after `seen` changed. Rebuilt whole (a copy of each row): in
    /// decoding at most once a round, and only in rounds that brought a new token.
    rows: Option<(Projection, Arc<Vec<u32>>)>,
}

impl ContextTokens {
    /// Notes `tokens`, at positions `first..`, that `projection` lacks and that were not seen
    /// before. A token outside the vocabulary is an error (nothing is noted then).
    pub(crate) fn record(
        &mut self,
        projection: &Projection,
        model: &Llama,
        first: usize,
        tokens: &[u32],
    ) -> Result<()> {
        model.check_token_ids(tokens)?;
        for (i, &token) in tokens.iter().enumerate() {
            if projection.lacks(token) && self.known.insert(token) {
                self.seen.push((token, first + i));
                self.rows = None;
            }
        }
        Ok(())
    }

    /// Forgets the tokens first seen at positions `len..`.
    pub(crate) fn truncate(&mut self, len: usize) {
        let (before, known) = (self.seen.len(), &mut self.known);
        self.seen.retain(|&(token, p)| {
            let keep = p < len;
            if !keep {
                known.remove(&token);
            }
            keep
        });
        if self.seen.len() < before {
            self.rows = None;
        }
    }

    /// The tokens added to the draft vocabulary, in column order (after the subset's).
    pub fn tokens(&self) -> impl Iterator<Item = u32> + '_ {
        self.seen.iter().map(|&(t, _)| t)
    }

    /// How many tokens were added.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether none were.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}
