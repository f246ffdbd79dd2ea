//! [`eesd_core::LayeredModel`] for [`Llama`]: the bridge from the decoding loop to the network.

use std::ops::Range;

use burn::tensor::Tensor;
use eesd_core::{LayeredModel, TreeMask};

use crate::cache::KvCache;
use crate::error::{ModelError, Result};
use crate::llama::Llama;

impl LayeredModel for Llama {
    type Cache = KvCache;
    type Error = ModelError;

    fn num_layers(&self) -> usize {
        Llama::num_layers(self)
    }

    fn context_length(&self) -> usize {
        self.config().context_length
    }

    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }

    fn new_cache(&self) -> KvCache {
        Llama::new_cache(self)
    }

    fn cached_len(&self, cache: &KvCache, layer: usize) -> usize {
        cache.len_of(layer)
    }

    fn embed(&self, tokens: &[u32]) -> Result<Tensor<2>> {
        Llama::embed(self, tokens)
    }

    fn forward_layers(
        &self,
        hidden: Tensor<2>,
        layers: Range<usize>,
        cache: &mut KvCache,
    ) -> Result<Tensor<2>> {
        Llama::forward_layers(self, hidden, layers, cache)
    }

    fn forward_tree(
        &self,
        hidden: Tensor<2>,
        layers: Range<usize>,
        cache: &mut KvCache,
        tree: &TreeMask,
    ) -> Result<Tensor<2>> {
        Llama::forward_tree(self, hidden, layers, cache, tree)
    }

    fn keep_rows(
        &self,
        cache: &mut KvCache,
        layers: Range<usize>,
        first: usize,
        rows: &[usize],
    ) -> Result<()> {
        cache.keep_layers(layers, first, rows)
    }

    fn logits(&self, hidden: Tensor<2>) -> Tensor<2> {
        Llama::logits(self, hidden)
    }

    fn truncate(&self, cache: &mut KvCache, layers: Range<usize>, len: usize) {
        cache.truncate_layers(layers, len);
    }
}
