//! Weight matrices in panel order, the layout the CPU block kernel reads.
//!
//! A matrix `w: [out, k]` is cut into panels of [`PANEL`] consecutive output rows; a panel is
//! stored `[k][PANEL]`, so the 16 weights that meet one activation value are adjacent (one
//! 64-byte line in f32) and the whole matrix is read front to back exactly once per product.
//! The last panel is padded with zero rows. The panels live on huge pages where the OS offers
//! them (module `huge_pages`).

use half::{bf16, f16};

use super::huge_pages::HugeBuf;
use super::lanes::WeightElement;
use super::matmul::ShapeError;
use super::pool::Pool;

/// Output rows per panel.
pub const PANEL: usize = 16;

/// A weight matrix `[out, k]` repacked into panels of [`PANEL`] output rows.
#[derive(PartialEq)]
pub struct PackedMatrix<E> {
    data: HugeBuf<E>,
    out: usize,
    k: usize,
}

impl<E: WeightElement> Clone for PackedMatrix<E> {
    fn clone(&self) -> Self {
        PackedMatrix {
            data: self.data.clone(),
            out: self.out,
            k: self.k,
        }
    }
}

impl<E> std::fmt::Debug for PackedMatrix<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("out", &self.out)
            .field("k", &self.k)
            .field("dtype", &std::any::type_name::<E>())
            .finish()
    }
}

impl<E: WeightElement> PackedMatrix<E> {
    /// Repacks a row-major `w: [out, k]`.
    pub fn pack(w: &[E], out: usize, k: usize) -> Result<Self, ShapeError> {
        if out.checked_mul(k) != Some(w.len()) || k == 0 {
            return Err(ShapeError::Weights {
                len: w.len(),
                out,
                k,
            });
        }
        let panels = out.div_ceil(PANEL);
        let mut data = HugeBuf::filled(panels * k * PANEL, E::default());
        Pool::global().for_each_chunk(&mut data, k * PANEL, &|p, panel| {
            let rows = (out - p * PANEL).min(PANEL);
            for c in 0..rows {
                let row = &w[(p * PANEL + c) * k..(p * PANEL + c + 1) * k];
                for (i, &v) in row.iter().enumerate() {
                    panel[i * PANEL + c] = v;
                }
            }
        });
        Ok(PackedMatrix { data, out, k })
    }

    /// The matrix back in row-major order `[out, k]`.
    pub fn unpack(&self) -> Vec<E> {
        let mut w = vec![E::default(); self.out * self.k];
        for (o, row) in w.chunks_exact_mut(self.k).enumerate() {
            let panel = &self.data[o / PANEL * self.k * PANEL..];
            for (i, v) in row.iter_mut().enumerate() {
                *v = panel[i * PANEL + o % PANEL];
            }
        }
        w
    }

    /// Output rows.
    pub fn out(&self) -> usize {
        self.out
    }

    /// Inner dimension.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<E>()
    }

    /// The panel data: panel `p` starts at `p · k · PANEL`.
    pub(crate) fn data(&self) -> &[E] {
        &self.data
    }
}

/// A [`PackedMatrix`] of whichever weight type the model stores.
#[derive(Debug, Clone, PartialEq)]
pub enum PackedWeight {
    /// f32 weights.
    F32(PackedMatrix<f32>),
    /// f16 weights.
    F16(PackedMatrix<f16>),
    /// bf16 weights.
    Bf16(PackedMatrix<bf16>),
}

impl PackedWeight {
    /// `y = x · wᵀ` (see [`PackedMatrix::matmul`]).
    pub fn matmul(&self, x: &[f32], y: &mut [f32]) -> Result<(), ShapeError> {
        match self {
            PackedWeight::F32(m) => m.matmul(x, y),
            PackedWeight::F16(m) => m.matmul(x, y),
            PackedWeight::Bf16(m) => m.matmul(x, y),
        }
    }

    /// [`PackedMatrix::matmul_to_vec`].
    pub fn matmul_to_vec(&self, x: &[f32]) -> Result<Vec<f32>, ShapeError> {
        match self {
            PackedWeight::F32(m) => m.matmul_to_vec(x),
            PackedWeight::F16(m) => m.matmul_to_vec(x),
            PackedWeight::Bf16(m) => m.matmul_to_vec(x),
        }
    }

    /// Output rows.
    pub fn out(&self) -> usize {
        match self {
            PackedWeight::F32(m) => m.out(),
            PackedWeight::F16(m) => m.out(),
            PackedWeight::Bf16(m) => m.out(),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            PackedWeight::F32(m) => m.bytes(),
            PackedWeight::F16(m) => m.bytes(),
            PackedWeight::Bf16(m) => m.bytes(),
        }
    }
}
