//! Glue between burn-flex tensors and the CPU kernels.
//!
//! A module keeps, in a [`PackedCache`], the panel-order copy ([`PackedWeight`]) of each weight
//! it multiplies by on flex. Each copy is tied to the exact tensor buffer it was made from (a
//! weak reference to burn-flex's shared storage, plus the view's offset and shape): a weight
//! that is replaced — trained, reloaded, moved to another device — is a different buffer and is
//! repacked, never served stale. Clones of a module share the packed copies (they are
//! read-only) but fill their own caches.

use std::sync::{Arc, Mutex, Weak};

use burn::tensor::{Bytes, DType, Tensor, TensorData, bf16, f16};
use burn_flex::{Flex, FlexTensor};

use super::packed::{PackedMatrix, PackedWeight};

/// Packed copies of the weights one module multiplies by on flex.
#[derive(Default)]
pub struct PackedCache {
    entries: Mutex<Vec<Entry>>,
}

#[derive(Clone)]
struct Entry {
    source: Weak<Bytes>,
    view: (usize, [usize; 2]),
    packed: Arc<PackedWeight>,
}

impl Clone for PackedCache {
    fn clone(&self) -> Self {
        PackedCache {
            entries: Mutex::new(self.lock().clone()),
        }
    }
}

impl std::fmt::Debug for PackedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PackedCache({} weights)", self.lock().len())
    }
}

impl PackedCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The packed copy of `w: [out, k]`, made on first use; `None` when `w` is not an f32, f16
    /// or bf16 tensor on flex (another backend, autodiff): callers then use burn's matmul.
    pub fn get(&self, w: &Tensor<2>) -> Option<Arc<PackedWeight>> {
        let flex = w.clone().try_into_primitive::<Flex>().ok()?;
        let source = flex.data_arc();
        let view = (flex.layout().start_offset(), w.dims());
        let mut entries = self.lock();
        if let Some(e) = entries
            .iter()
            .find(|e| e.view == view && std::ptr::eq(e.source.as_ptr(), Arc::as_ptr(&source)))
        {
            return Some(e.packed.clone());
        }
        let packed = Arc::new(pack(&flex, view.1)?);
        // Entries of buffers that no longer exist only hold memory.
        entries.retain(|e| e.source.strong_count() > 0);
        entries.push(Entry {
            source: Arc::downgrade(&source),
            view,
            packed: packed.clone(),
        });
        Some(packed)
    }
}

/// The flex storage of an f32 tensor in row-major order, or `None` for any other tensor
/// (another backend, autodiff, another dtype).
pub(crate) fn flex_f32<const D: usize>(t: &Tensor<D>) -> Option<FlexTensor> {
    let flex = t.clone().try_into_primitive::<Flex>().ok()?;
    (flex.dtype() == DType::F32).then(|| contiguous(flex))
}

/// `flex` in row-major order (itself when it already is).
fn contiguous(flex: FlexTensor) -> FlexTensor {
    match flex.is_contiguous() {
        true => flex,
        false => flex.to_contiguous(),
    }
}

fn pack(flex: &FlexTensor, [out, k]: [usize; 2]) -> Option<PackedWeight> {
    let flex = contiguous(flex.clone());
    Some(match flex.dtype() {
        DType::F32 => PackedWeight::F32(PackedMatrix::pack(flex.as_slice::<f32>()?, out, k).ok()?),
        DType::F16 => PackedWeight::F16(PackedMatrix::pack(flex.as_slice::<f16>()?, out, k).ok()?),
        DType::BF16 => {
            PackedWeight::Bf16(PackedMatrix::pack(flex.as_slice::<bf16>()?, out, k).ok()?)
        }
        _ => return None,
    })
}

/// `x · wᵀ` for `x: [b, k]` (f32) and `w: [out, k]` through the packed kernel, or `None` when
/// the tensors are not flex tensors the kernel takes (see [`PackedCache::get`]).
pub fn packed_linear(x: &Tensor<2>, w: &Tensor<2>, cache: &PackedCache) -> Option<Tensor<2>> {
    let [b, k] = x.dims();
    let [out, k_w] = w.dims();
    if k != k_w {
        return None;
    }
    let x_flex = flex_f32(x)?;
    let packed = cache.get(w)?;
    let y = packed.matmul_to_vec(x_flex.as_slice::<f32>()?).ok()?;
    Some(Tensor::from_data(TensorData::new(y, [b, out]), &x.device()))
}
