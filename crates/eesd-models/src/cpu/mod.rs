//! CPU kernels for the flex default: batch-invariant block products at the memory/FMA roofline,
//! one persistent thread pool, run-time SIMD dispatch, and the probes that measure the roofline.
//!
//! The kernels are pure Rust on slices; [`PackedCache`] and [`packed_linear`] connect them to
//! burn-flex tensors (used by [`crate::layer::linear`]).

// Declared first: the modules below use its macro.
#[macro_use]
mod dispatch;

pub mod attention;
#[cfg(feature = "flex")]
pub(crate) mod decoder;
#[cfg(feature = "flex")]
mod flex;
mod huge_pages;
pub mod isa;
mod l1;
pub(crate) mod lanes;
mod line;
pub mod matmul;
pub mod packed;
pub mod pool;
pub mod q8;
pub mod qformat;
pub mod qmatmul;
mod qpanel;
pub mod roofline;
pub mod rows;
pub mod steps;

#[cfg(feature = "flex")]
pub(crate) use flex::flex_f32;
#[cfg(feature = "flex")]
pub use flex::{PackedCache, packed_linear};
pub use isa::Isa;
pub use lanes::WeightElement;
pub use matmul::ShapeError;
pub use packed::{PANEL, PackedMatrix, PackedWeight};
pub use pool::Pool;
pub use q8::Q8Rows;
pub use qformat::QuantFormat;
pub use qmatmul::QuantMatrix;
pub use roofline::Roofline;

/// Without the flex backend there is nothing to pack: an empty stand-in keeps module layouts
/// the same in every build.
#[cfg(not(feature = "flex"))]
#[derive(Debug, Clone, Default)]
pub struct PackedCache {
    _private: (),
}

/// Inputs shared by the kernels' tests.
#[cfg(test)]
pub(crate) mod test_inputs {
    use super::Isa;

    /// `n` deterministic values in [-1, 1].
    pub(crate) fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32 ^ seed)
                    .wrapping_mul(2_654_435_761)
                    .rotate_left(13);
                (h % 20001) as f32 / 10000.0 - 1.0
            })
            .collect()
    }

    /// The same floats, bit for bit (batch invariance is exact equality, not closeness).
    pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// Every ISA this CPU has (the portable path always).
    pub(crate) fn isas() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|isa| isa.supported() == *isa)
            .collect()
    }
}
