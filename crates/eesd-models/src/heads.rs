//! Exit heads: from the hidden state after layer N to draft logits.

use burn::tensor::Tensor;
use eesd_core::{DraftHead, DraftLogits};

use crate::error::Result;
use crate::llama::Llama;

/// The parameter-free head: the model's own final RMSNorm and LM head applied to the layer-N
/// hidden state (the LayerSkip-style baseline). Works after any layer; needs no training.
#[derive(Debug, Clone, Copy, Default)]
pub struct NormHead;

impl DraftHead<Llama> for NormHead {
    type Cache = usize;

    fn exit_layer(&self) -> Option<usize> {
        None
    }

    fn new_cache(&self, _: &Llama) -> usize {
        0
    }

    fn draft_logits(
        &self,
        model: &Llama,
        hidden: Tensor<2>,
        seen: &mut usize,
    ) -> Result<DraftLogits> {
        *seen += hidden.dims()[0];
        Ok(DraftLogits {
            logits: model.logits(hidden),
            token_ids: None,
        })
    }

    fn extend(&self, _: &Llama, hidden: Tensor<2>, seen: &mut usize) -> Result<()> {
        *seen += hidden.dims()[0];
        Ok(())
    }

    fn cached_len(&self, seen: &usize) -> usize {
        *seen
    }

    fn truncate(&self, seen: &mut usize, len: usize) {
        *seen = (*seen).min(len);
    }
}
