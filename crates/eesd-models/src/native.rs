//! Weight matrices kept in their file's quantized block format ([`WeightDType::Native`]).
//!
//! A module keeps its burn parameters (so training, other backends and checkpoints see ordinary
//! tensors), but with native weights those parameters are lazy: nothing dense exists until
//! something asks for the tensor (`Param::val`), which dequantizes it to f32 then. The flex CPU
//! kernels instead multiply by the [`QuantMatrix`] the module holds here, tied to the parameter
//! it stands for by the parameter's id.
//!
//! [`WeightDType::Native`]: crate::WeightDType::Native

use std::sync::Arc;

use burn::module::{Param, ParamId};
use burn::tensor::{Device, Shape, Tensor, TensorData};

use crate::cpu::QuantMatrix;

/// The quantized matrices of one module, each tied to a parameter.
///
/// A clone is empty: a cloned module is usually about to be changed (an exit head initialised
/// from a layer, then trained), and a stale quantized copy must never stand in for changed
/// weights. The clone's parameters still hold the same weights (dequantized when first used).
#[derive(Default)]
pub struct NativeWeights {
    entries: Vec<(ParamId, Arc<QuantMatrix>)>,
}

impl Clone for NativeWeights {
    fn clone(&self) -> Self {
        NativeWeights::default()
    }
}

impl std::fmt::Debug for NativeWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NativeWeights({} matrices)", self.entries.len())
    }
}

impl NativeWeights {
    /// The quantized matrix standing for `param`, if this module holds one.
    pub fn get(&self, param: &Param<Tensor<2>>) -> Option<&Arc<QuantMatrix>> {
        self.entries
            .iter()
            .find(|(id, _)| *id == param.id)
            .map(|(_, m)| m)
    }

    /// Ties `matrix` to `param`.
    pub fn insert(&mut self, param: &Param<Tensor<2>>, matrix: Arc<QuantMatrix>) {
        self.entries.retain(|(id, _)| *id != param.id);
        self.entries.push((param.id, matrix));
    }

    /// Bytes held by the quantized matrices.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|(_, m)| m.bytes()).sum()
    }
}

/// A parameter whose dense f32 value is made from `matrix` only when first asked for.
pub fn lazy_param(matrix: Arc<QuantMatrix>, device: &Device) -> Param<Tensor<2>> {
    let shape = Shape::new([matrix.out(), matrix.k()]);
    Param::uninitialized(
        ParamId::new(),
        move |device: &Device, _| {
            let values = matrix.dequantize();
            Tensor::from_data(TensorData::new(values, [matrix.out(), matrix.k()]), device)
        },
        device.clone(),
        false,
        shape,
    )
}

/// `x · wᵀ` for `x: [b, k]` on flex with the quantized kernel, or `None` when `x` is not an f32
/// flex tensor (another backend, autodiff) or does not match.
pub fn quant_linear(x: &Tensor<2>, w: &QuantMatrix) -> Option<Tensor<2>> {
    #[cfg(feature = "flex")]
    {
        let [b, k] = x.dims();
        if k != w.k() {
            return None;
        }
        let flex = crate::cpu::flex_f32(x)?;
        let y = w.product(flex.as_slice::<f32>()?).ok()?;
        Some(Tensor::from_data(
            TensorData::new(y, [b, w.out()]),
            &x.device(),
        ))
    }
    #[cfg(not(feature = "flex"))]
    {
        let _ = (x, w);
        None
    }
}
