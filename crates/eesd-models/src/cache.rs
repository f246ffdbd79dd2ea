//! A per-layer key/value cache that grows in place and truncates in O(1).
//!
//! Speculative decoding appends drafted tokens and then rolls back the rejected ones; truncation
//! only moves a length counter, and the next append overwrites the stale rows in place. Each
//! layer keeps its own length, so the first N layers (advanced token by token while drafting)
//! and the last M layers (advanced a block at a time while verifying) can run separately.

use burn::tensor::{Device, Tensor};

use crate::error::{ModelError, Result};

/// Initial capacity (positions) of a layer cache; doubled on demand up to the context length.
const INITIAL_CAPACITY: usize = 256;

/// Keys and values of one attention layer: `[kv_heads, capacity, head_dim]` buffers.
#[derive(Debug, Clone)]
pub struct LayerCache {
    kv: Option<(Tensor<3>, Tensor<3>)>,
    len: usize,
}

impl Default for LayerCache {
    fn default() -> Self {
        Self::new()
    }
}

impl LayerCache {
    /// An empty cache.
    pub fn new() -> Self {
        LayerCache { kv: None, len: 0 }
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position from `len` on. O(1): the buffers are kept and overwritten later.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Appends `k, v: [kv_heads, t, head_dim]` and returns views of all cached keys and values.
    pub(crate) fn append(
        &mut self,
        k: Tensor<3>,
        v: Tensor<3>,
        limit: usize,
    ) -> Result<(Tensor<3>, Tensor<3>)> {
        let [heads, t, dim] = k.dims();
        let end = self.len + t;
        if end > limit {
            return Err(ModelError::ContextOverflow { needed: end, limit });
        }
        let device = k.device();
        let (mut kb, mut vb) = match self.kv.take() {
            Some(buffers) => buffers,
            None => {
                let cap = INITIAL_CAPACITY.max(end).min(limit);
                (
                    zeros(heads, cap, dim, &device),
                    zeros(heads, cap, dim, &device),
                )
            }
        };
        let capacity = kb.dims()[1];
        if end > capacity {
            let cap = (capacity * 2).max(end).min(limit);
            let keep = self.len;
            let grow = |old: Tensor<3>| {
                zeros(heads, cap, dim, &device)
                    .slice_assign([0..heads, 0..keep, 0..dim], old.narrow(1, 0, keep))
            };
            kb = grow(kb);
            vb = grow(vb);
        }
        let range = [0..heads, self.len..end, 0..dim];
        kb = kb.slice_assign(range.clone(), k);
        vb = vb.slice_assign(range, v);
        let views = (kb.clone().narrow(1, 0, end), vb.clone().narrow(1, 0, end));
        self.kv = Some((kb, vb));
        self.len = end;
        Ok(views)
    }
}

fn zeros(heads: usize, cap: usize, dim: usize, device: &Device) -> Tensor<3> {
    Tensor::zeros([heads, cap, dim], device)
}

/// The caches of every layer of a model.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerCache>,
}

impl KvCache {
    /// An empty cache for `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        KvCache {
            layers: (0..num_layers).map(|_| LayerCache::new()).collect(),
        }
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The cache of layer `i`.
    pub fn layer(&self, i: usize) -> Option<&LayerCache> {
        self.layers.get(i)
    }

    pub(crate) fn layer_mut(&mut self, i: usize) -> Option<&mut LayerCache> {
        self.layers.get_mut(i)
    }

    /// Positions cached by layer `i` (0 if it does not exist).
    pub fn len_of(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, LayerCache::len)
    }

    /// Truncates every layer to at most `len` positions.
    pub fn truncate(&mut self, len: usize) {
        self.layers.iter_mut().for_each(|l| l.truncate(len));
    }

    /// Truncates the layers in `range` to at most `len` positions.
    pub fn truncate_layers(&mut self, range: std::ops::Range<usize>, len: usize) {
        for l in self.layers.iter_mut().take(range.end).skip(range.start) {
            l.truncate(len);
        }
    }
}
