//! A per-layer key/value cache that grows in place and truncates in O(1).
//!
//! Speculative decoding appends drafted tokens and then rolls back the rejected ones; truncation
//! only moves a length counter, and the next append overwrites the stale rows in place. Each
//! layer keeps its own length, so the first N layers (advanced token by token while drafting)
//! and the last M layers (advanced a block at a time while verifying) can run separately.
//!
//! Keys and values live either in burn tensors (any backend) or, for the fused CPU layer on
//! flex, in a host store ([`HostKv`]: f32, or f16 for models whose weights are not f32); a
//! cache converts itself when the other kind of forward pass uses it, so the two never
//! disagree.

use burn::tensor::{Device, Int, Tensor, TensorData};

use crate::cpu::attention::{HostKv, KvDtype};
use crate::error::{ModelError, Result};

/// Initial capacity (positions) of a layer cache; doubled on demand up to the context length.
const INITIAL_CAPACITY: usize = 256;

/// Keys and values of one attention layer.
#[derive(Debug, Clone)]
pub struct LayerCache {
    store: Store,
    len: usize,
}

#[derive(Debug, Clone)]
enum Store {
    Empty,
    /// `[kv_heads, capacity, head_dim]` buffers.
    Tensors(Box<(Tensor<3>, Tensor<3>)>),
    #[cfg_attr(not(feature = "flex"), allow(dead_code))] // used by the flex decoder only
    Host(HostKv),
}

impl Default for LayerCache {
    fn default() -> Self {
        Self::new()
    }
}

impl LayerCache {
    /// An empty cache.
    pub fn new() -> Self {
        LayerCache {
            store: Store::Empty,
            len: 0,
        }
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

    /// Keeps, of the positions from `first` on, only `first + rows[i]` (strictly ascending),
    /// moved to `first + i`: the accepted path of a verified tree. O(kept positions).
    pub fn keep(&mut self, first: usize, rows: &[usize]) -> Result<()> {
        let ascending = rows.windows(2).all(|w| w[0] < w[1]);
        if !ascending || rows.last().is_some_and(|&r| first + r >= self.len) {
            return Err(ModelError::InvalidArgument(format!(
                "keep rows {rows:?} after position {first} of a cache of {}",
                self.len
            )));
        }
        let moved = rows.iter().enumerate().any(|(i, &r)| r != i);
        match &mut self.store {
            Store::Host(host) if moved => {
                for (i, &r) in rows.iter().enumerate() {
                    host.copy_position(first + r, first + i);
                }
            }
            Store::Tensors(kv) if moved => {
                let (k, v) = &mut **kv;
                let [heads, _, dim] = k.dims();
                let ids: Vec<i32> = rows.iter().map(|&r| (first + r) as i32).collect();
                let device = k.device();
                let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [rows.len()]), &device);
                let range = [0..heads, first..first + rows.len(), 0..dim];
                let pick = |t: &Tensor<3>| t.clone().select(1, ids.clone());
                *k = k.clone().slice_assign(range.clone(), pick(k));
                *v = v.clone().slice_assign(range, pick(v));
            }
            _ => {}
        }
        self.len = first + rows.len();
        Ok(())
    }

    /// Appends `k, v: [kv_heads, t, head_dim]` and returns views of all cached keys and values.
    pub(crate) fn append(
        &mut self,
        k: Tensor<3>,
        v: Tensor<3>,
        limit: usize,
    ) -> Result<(Tensor<3>, Tensor<3>)> {
        let [heads, t, dim] = k.dims();
        if t == 0 {
            return Err(ModelError::InvalidArgument(
                "appending no positions to a cache".into(),
            ));
        }
        let end = self.len + t;
        if end > limit {
            return Err(ModelError::ContextOverflow { needed: end, limit });
        }
        let device = k.device();
        let store = std::mem::replace(&mut self.store, Store::Empty);
        let (mut kb, mut vb) = match store {
            Store::Tensors(kv) => *kv,
            Store::Host(host) => to_tensors(&host, self.len, &device),
            Store::Empty => {
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
            // A cache truncated to nothing (a new prompt) has nothing to carry over.
            let grow = |old: Tensor<3>| match keep {
                0 => zeros(heads, cap, dim, &device),
                _ => zeros(heads, cap, dim, &device)
                    .slice_assign([0..heads, 0..keep, 0..dim], old.narrow(1, 0, keep)),
            };
            kb = grow(kb);
            vb = grow(vb);
        }
        let range = [0..heads, self.len..end, 0..dim];
        kb = kb.slice_assign(range.clone(), k);
        vb = vb.slice_assign(range, v);
        let views = (kb.clone().narrow(1, 0, end), vb.clone().narrow(1, 0, end));
        self.store = Store::Tensors(Box::new((kb, vb)));
        self.len = end;
        Ok(views)
    }

    /// The host store of `dtype` for `kv_heads` heads of width `d`, with room for positions up
    /// to `end`; the caller writes positions `len()..end` and then calls
    /// [`LayerCache::set_len`]. A store of the other dtype is converted.
    #[cfg_attr(not(feature = "flex"), allow(dead_code))] // used by the flex decoder only
    pub(crate) fn host_store(
        &mut self,
        kv_heads: usize,
        d: usize,
        end: usize,
        limit: usize,
        dtype: KvDtype,
    ) -> Result<&mut HostKv> {
        if end > limit {
            return Err(ModelError::ContextOverflow { needed: end, limit });
        }
        let shape = match &self.store {
            Store::Empty => None,
            Store::Host(host) => Some(host.shape()),
            Store::Tensors(kv) => {
                let [h, _, w] = kv.0.dims();
                Some((h, w))
            }
        };
        if let Some((h, w)) = shape.filter(|&s| s != (kv_heads, d)) {
            return Err(ModelError::InvalidArgument(format!(
                "a cache of {h} heads × {w} used by a layer of {kv_heads} × {d}"
            )));
        }
        let store = std::mem::replace(&mut self.store, Store::Empty);
        let mut host = match store {
            Store::Host(host) if host.dtype() == dtype => host,
            Store::Host(host) => {
                let (k, v) = host.rows(self.len);
                let (h, w) = host.shape();
                HostKv::from_rows(dtype, h, w, &k, &v)
            }
            Store::Tensors(kv) => match from_tensors(&kv.0, &kv.1, self.len, dtype) {
                Ok(host) => host,
                Err(e) => {
                    // Keep the positions for the burn path.
                    self.store = Store::Tensors(kv);
                    return Err(e);
                }
            },
            Store::Empty => HostKv::new(dtype, kv_heads, d),
        };
        if host.capacity() < end {
            // Grow geometrically.
            let cap = (host.capacity() * 2)
                .max(end)
                .max(INITIAL_CAPACITY)
                .min(limit);
            host.reserve(cap);
        }
        Ok(self.store.insert_host(host))
    }

    /// Sets the number of cached positions after [`LayerCache::host_store`] was filled.
    #[cfg_attr(not(feature = "flex"), allow(dead_code))] // used by the flex decoder only
    pub(crate) fn set_len(&mut self, len: usize) {
        self.len = len;
    }
}

impl Store {
    #[cfg_attr(not(feature = "flex"), allow(dead_code))] // used by the flex decoder only
    fn insert_host(&mut self, host: HostKv) -> &mut HostKv {
        *self = Store::Host(host);
        match self {
            Store::Host(host) => host,
            _ => unreachable!("just stored"),
        }
    }
}

/// A host store of `dtype` of the first `len` positions of `[kv_heads, capacity, head_dim]`
/// tensors.
#[cfg_attr(not(feature = "flex"), allow(dead_code))] // used by the flex decoder only
fn from_tensors(k: &Tensor<3>, v: &Tensor<3>, len: usize, dtype: KvDtype) -> Result<HostKv> {
    let [heads, _, dim] = k.dims();
    let rows = |t: &Tensor<3>| -> Result<Vec<f32>> {
        let data = t.clone().narrow(1, 0, len).swap_dims(0, 1).into_data();
        data.convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| ModelError::InvalidArgument(format!("kv cache: {e:?}")))
    };
    Ok(HostKv::from_rows(dtype, heads, dim, &rows(k)?, &rows(v)?))
}

/// `[heads, len, dim]` tensors of the first `len` positions of a host store.
fn to_tensors(host: &HostKv, len: usize, device: &Device) -> (Tensor<3>, Tensor<3>) {
    let (heads, dim) = host.shape();
    let (k, v) = host.rows(len);
    let tensor = |rows: Vec<f32>| {
        Tensor::<3>::from_data(TensorData::new(rows, [len, heads, dim]), device).swap_dims(0, 1)
    };
    (tensor(k), tensor(v))
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

    /// Every layer's cache, in order.
    pub(crate) fn layers_mut(&mut self) -> &mut [LayerCache] {
        &mut self.layers
    }

    /// Positions cached by layer `i` (0 if it does not exist).
    pub fn len_of(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, LayerCache::len)
    }

    /// Truncates every layer to at most `len` positions.
    pub fn truncate(&mut self, len: usize) {
        self.layers.iter_mut().for_each(|l| l.truncate(len));
    }

    /// [`LayerCache::keep`] on the layers in `range`.
    pub fn keep_layers(
        &mut self,
        range: std::ops::Range<usize>,
        first: usize,
        rows: &[usize],
    ) -> Result<()> {
        for l in self.layers.iter_mut().take(range.end).skip(range.start) {
            l.keep(first, rows)?;
        }
        Ok(())
    }

    /// Truncates the layers in `range` to at most `len` positions.
    pub fn truncate_layers(&mut self, range: std::ops::Range<usize>, len: usize) {
        for l in self.layers.iter_mut().take(range.end).skip(range.start) {
            l.truncate(len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(heads: usize, t: usize, dim: usize, base: f32, device: &Device) -> Tensor<3> {
        let data: Vec<f32> = (0..heads * t * dim).map(|i| base + i as f32).collect();
        Tensor::from_data(TensorData::new(data, [heads, t, dim]), device)
    }

    /// The burn-tensor path (every backend but flex's fused layer): a cache emptied for a new
    /// prompt grows past its capacity without copying positions it no longer holds.
    #[test]
    fn a_truncated_cache_grows_for_a_longer_prompt() {
        let device = crate::testing::test_device().unwrap();
        let mut cache = LayerCache::new();
        cache
            .append(
                rows(2, 10, 4, 0.0, &device),
                rows(2, 10, 4, 0.5, &device),
                4096,
            )
            .unwrap();
        cache.truncate(0);
        let t = INITIAL_CAPACITY + 44;
        let (k, v) = cache
            .append(
                rows(2, t, 4, 1.0, &device),
                rows(2, t, 4, 2.0, &device),
                4096,
            )
            .unwrap();
        assert_eq!(cache.len(), t);
        assert_eq!(k.dims(), [2, t, 4]);
        k.into_data()
            .assert_eq(&rows(2, t, 4, 1.0, &device).into_data(), true);
        v.into_data()
            .assert_eq(&rows(2, t, 4, 2.0, &device).into_data(), true);
    }

    /// A cache moves between the burn path and host stores of either dtype, keeping its
    /// positions (rounded once to f16 where a store holds f16).
    #[test]
    fn host_stores_convert_between_dtypes_and_tensors() {
        let device = crate::testing::test_device().unwrap();
        let (heads, t, dim) = (2, 5, 16);
        let fine = |base: f32| -> Vec<f32> {
            (0..heads * t * dim)
                .map(|i| base + i as f32 * 1.0001e-3)
                .collect()
        };
        let (k, v) = (fine(0.1), fine(-0.3));
        let as_tensor = |x: &[f32]| {
            // [t, heads, dim] rows as the [heads, t, dim] tensor `append` takes.
            Tensor::<3>::from_data(TensorData::new(x.to_vec(), [t, heads, dim]), &device)
                .swap_dims(0, 1)
        };
        let mut cache = LayerCache::new();
        cache.append(as_tensor(&k), as_tensor(&v), 4096).unwrap();
        let f32_rows = cache
            .host_store(heads, dim, t, 4096, KvDtype::F32)
            .unwrap()
            .rows(t);
        assert_eq!(f32_rows, (k.clone(), v.clone()));
        let f16 = cache.host_store(heads, dim, t, 4096, KvDtype::F16).unwrap();
        assert_eq!(f16.dtype(), KvDtype::F16);
        let round = |x: &[f32]| -> Vec<f32> {
            x.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
        };
        assert_eq!(f16.rows(t), (round(&k), round(&v)));
        assert_ne!(round(&k), k);
        let wrong = cache.host_store(heads + 1, dim, t, 4096, KvDtype::F16);
        assert!(matches!(wrong, Err(ModelError::InvalidArgument(_))));
        let beyond = cache.host_store(heads, dim, 5000, 4096, KvDtype::F16);
        assert!(matches!(beyond, Err(ModelError::ContextOverflow { .. })));
        // The failed calls lost nothing; back on the burn path the positions are the rounded
        // ones.
        let one = |x: &[f32]| {
            Tensor::<3>::from_data(
                TensorData::new(x[..heads * dim].to_vec(), [heads, 1, dim]),
                &device,
            )
        };
        let (kt, vt) = cache.append(one(&k), one(&v), 4096).unwrap();
        assert_eq!(kt.dims(), [heads, t + 1, dim]);
        let first = |x: Tensor<3>| -> Vec<f32> {
            x.narrow(1, 0, t)
                .swap_dims(0, 1)
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
        };
        assert_eq!((first(kt), first(vt)), (round(&k), round(&v)));
    }

    #[test]
    fn appending_nothing_is_an_error_not_a_panic() {
        let device = crate::testing::test_device().unwrap();
        let mut cache = LayerCache::new();
        let empty = || Tensor::<3>::zeros([2, 0, 4], &device);
        assert!(matches!(
            cache.append(empty(), empty(), 4096),
            Err(ModelError::InvalidArgument(_))
        ));
        assert!(cache.is_empty());
    }
}
