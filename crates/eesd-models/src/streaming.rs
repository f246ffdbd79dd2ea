//! Weight-streaming product `x · wᵀ` for blocks of a few rows on the flex CPU backend.
//!
//! Why: decoding is memory-bound — every weight is read once per forward pass — so verifying a
//! block of `b` drafted tokens should cost about as much as decoding one. burn-flex's gemm packs
//! its operands for every call and, for a handful of rows, ends up compute-bound: a 4-token
//! block costs ≈ 1.8× one token (measured with `cargo run --release --example block_cost`),
//! which eats most of what early-exit drafting saves. This kernel reads each weight row once and
//! multiplies it with all `b` rows of `x` while the row sits in L1, so the cost of a block stays
//! close to the cost of streaming the weights.
//!
//! Every output element `y[j, o] = Σ_i x[j, i] · w[o, i]` is summed in the same fixed order no
//! matter how many rows the block has or which thread computes it, so a block forward gives
//! bit-identical results to running its rows one at a time — verification agrees exactly with
//! plain decoding.
//!
//! Used for f32 weights on flex outside autodiff, for blocks of at most [`MAX_STREAMING_ROWS`]
//! rows; anything else goes to burn's matmul.

use burn::tensor::{DType, Tensor, TensorData};
use burn_flex::Flex;
use rayon::prelude::*;

/// Largest block (rows of `x`) computed by the streaming kernel; larger ones (prefill) use gemm,
/// which is compute-efficient there.
pub const MAX_STREAMING_ROWS: usize = 16;

/// Weight rows per parallel task.
const ROWS_PER_TASK: usize = 128;
/// Register tile: weight rows × rows of `x` whose dot products advance together, so each
/// loaded chunk feeds several FMAs (16 independent accumulators hide the FMA latency).
const TILE_W: usize = 4;
const TILE_X: usize = 4;
/// How many weight rows ahead the kernel prefetches.
const PREFETCH_ROWS: usize = 8;

/// `x · wᵀ` for `x: [b, in]`, `w: [out, in]` through the streaming kernel, or `None` when the
/// tensors are not f32 flex tensors (other backend, autodiff, other dtype) or the block is
/// larger than [`MAX_STREAMING_ROWS`]; callers then use burn's matmul.
pub fn streaming_linear(x: &Tensor<2>, w: &Tensor<2>) -> Option<Tensor<2>> {
    let [b, k] = x.dims();
    let [out, k_w] = w.dims();
    if b == 0 || b > MAX_STREAMING_ROWS || k == 0 || k != k_w {
        return None;
    }
    if x.dtype() != DType::F32 || w.dtype() != DType::F32 {
        return None;
    }
    let device = x.device();
    let w_flex = w.clone().try_into_primitive::<Flex>().ok()?;
    let x_flex = x.clone().try_into_primitive::<Flex>().ok()?;
    let weights = w_flex.as_slice::<f32>()?;
    let x_flex = if x_flex.is_contiguous() {
        x_flex
    } else {
        x_flex.to_contiguous()
    };
    let rows = x_flex.as_slice::<f32>()?;
    // y is produced as [out, b] (contiguous per weight row) and returned transposed.
    let mut y = vec![0f32; out * b];
    multiply(weights, rows, k, b, &mut y);
    let y = Tensor::<2>::from_data(TensorData::new(y, [out, b]), &device);
    Some(y.transpose())
}

/// Fills `y[o * b + j] = dot(w[o], x[j])`, weight rows split across the rayon pool.
fn multiply(w: &[f32], x: &[f32], k: usize, b: usize, y: &mut [f32]) {
    debug_assert!(w.len().is_multiple_of(k) && x.len() == b * k && y.len() == w.len() / k * b);
    y.par_chunks_mut(ROWS_PER_TASK * b)
        .enumerate()
        .for_each(|(task, y_chunk)| {
            let first = task * ROWS_PER_TASK;
            let n_rows = y_chunk.len() / b;
            rows_dispatch(&w[first * k..(first + n_rows) * k], x, k, b, y_chunk);
        });
}

/// Picks the widest SIMD instruction set this CPU has; the arithmetic is the same in each.
fn rows_dispatch(w: &[f32], x: &[f32], k: usize, b: usize, y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports the features the function is compiled for.
            return unsafe { simd::rows_avx512(w, x, k, b, y) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: as above.
            return unsafe { simd::rows_avx2(w, x, k, b, y) };
        }
    }
    // SAFETY: the scalar lanes use no special instructions.
    unsafe { rows::<f32>(w, x, k, b, y) }
}

/// A SIMD register of f32 lanes (or one plain f32).
trait Lanes: Copy {
    const WIDTH: usize;
    unsafe fn zero() -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self;
    /// Horizontal sum in a fixed order.
    unsafe fn sum(self) -> f32;
    /// Hints that the cache line at `p` will be read soon.
    #[inline(always)]
    unsafe fn prefetch(_p: *const f32) {}
}

impl Lanes for f32 {
    const WIDTH: usize = 1;
    unsafe fn zero() -> Self {
        0.0
    }
    unsafe fn load(p: *const f32) -> Self {
        unsafe { *p }
    }
    unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self {
        a * b + acc
    }
    unsafe fn sum(self) -> f32 {
        self
    }
}

/// All weight rows of `w` against all rows of `x`, in `TILE_W × TILE_X` tiles with 1-wide edges.
///
/// # Safety
/// `V`'s instructions must be supported; slice sizes as in [`multiply`].
#[inline(always)]
unsafe fn rows<V: Lanes>(w: &[f32], x: &[f32], k: usize, b: usize, y: &mut [f32]) {
    // Measured: one row streams fastest on the hardware prefetcher alone; for blocks the
    // software prefetch keeps memory busy while the FMAs run.
    if b == 1 {
        unsafe { rows_with::<V, false>(w, x, k, b, y) }
    } else {
        unsafe { rows_with::<V, true>(w, x, k, b, y) }
    }
}

/// [`rows`] with or without software prefetching.
///
/// # Safety
/// As [`rows`].
#[inline(always)]
unsafe fn rows_with<V: Lanes, const PREFETCH: bool>(
    w: &[f32],
    x: &[f32],
    k: usize,
    b: usize,
    y: &mut [f32],
) {
    let out = w.len() / k;
    let mut o = 0;
    while o < out {
        let tile_w = if o + TILE_W <= out { TILE_W } else { 1 };
        let mut j = 0;
        while j < b {
            let tile_x = if j + TILE_X <= b { TILE_X } else { 1 };
            // SAFETY: o + tile_w ≤ out and j + tile_x ≤ b keep every access inside the slices.
            unsafe {
                match (tile_w, tile_x) {
                    (TILE_W, TILE_X) => tile::<V, PREFETCH, TILE_W, TILE_X>(w, x, k, b, o, j, y),
                    (TILE_W, _) => tile::<V, PREFETCH, TILE_W, 1>(w, x, k, b, o, j, y),
                    (_, TILE_X) => tile::<V, PREFETCH, 1, TILE_X>(w, x, k, b, o, j, y),
                    _ => tile::<V, PREFETCH, 1, 1>(w, x, k, b, o, j, y),
                }
            }
            j += tile_x;
        }
        o += tile_w;
    }
}

/// `y[(o + r) * b + j + g] = dot(w[o + r], x[j + g])` for `r < R`, `g < G`. Each dot product is
/// one `V`-wide accumulator over `V::WIDTH`-wide chunks, a fixed-order horizontal sum, then the
/// scalar tail — the same sequence whatever `R`, `G`, `b` or the thread.
///
/// # Safety
/// `o + R ≤ out`, `j + G ≤ b`, and `V`'s instructions are supported.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<V: Lanes, const PREFETCH: bool, const R: usize, const G: usize>(
    w: &[f32],
    x: &[f32],
    k: usize,
    b: usize,
    o: usize,
    j: usize,
    y: &mut [f32],
) {
    let wp = w.as_ptr();
    let xp = x.as_ptr();
    let full = k / V::WIDTH * V::WIDTH;
    unsafe {
        let mut acc = [[V::zero(); G]; R];
        let mut i = 0;
        while i < full {
            let mut xs = [V::zero(); G];
            for (g, xg) in xs.iter_mut().enumerate() {
                *xg = V::load(xp.add((j + g) * k + i));
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                // Pull the next tile's weights while this one computes.
                if PREFETCH {
                    V::prefetch(wp.wrapping_add((o + r + PREFETCH_ROWS) * k + i));
                }
                let wr = V::load(wp.add((o + r) * k + i));
                for (acc_rg, xg) in acc_r.iter_mut().zip(xs) {
                    *acc_rg = V::mul_add(wr, xg, *acc_rg);
                }
            }
            i += V::WIDTH;
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (g, acc_rg) in acc_r.iter().enumerate() {
                let mut sum = acc_rg.sum();
                for t in full..k {
                    sum += *wp.add((o + r) * k + t) * *xp.add((j + g) * k + t);
                }
                *y.get_unchecked_mut((o + r) * b + j + g) = sum;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{Lanes, rows};
    use std::arch::x86_64::*;

    impl Lanes for __m512 {
        const WIDTH: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self {
            unsafe { _mm512_fmadd_ps(a, b, acc) }
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            let mut lanes = [0f32; 16];
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), self) };
            fixed_order_sum(&lanes)
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const f32) {
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
    }

    impl Lanes for __m256 {
        const WIDTH: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn mul_add(a: Self, b: Self, acc: Self) -> Self {
            unsafe { _mm256_fmadd_ps(a, b, acc) }
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            let mut lanes = [0f32; 8];
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), self) };
            fixed_order_sum(&lanes)
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const f32) {
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
    }

    /// Pairwise sum of the lanes (a fixed tree, so results do not depend on the caller).
    #[inline(always)]
    fn fixed_order_sum(lanes: &[f32]) -> f32 {
        let mut width = lanes.len();
        let mut buf = [0f32; 16];
        buf[..width].copy_from_slice(lanes);
        while width > 1 {
            width /= 2;
            for l in 0..width {
                buf[l] += buf[l + width];
            }
        }
        buf[0]
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn rows_avx512(w: &[f32], x: &[f32], k: usize, b: usize, y: &mut [f32]) {
        unsafe { rows::<__m512>(w, x, k, b, y) }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_avx2(w: &[f32], x: &[f32], k: usize, b: usize, y: &mut [f32]) {
        unsafe { rows::<__m256>(w, x, k, b, y) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(w: &[f32], x: &[f32], k: usize, b: usize) -> Vec<f32> {
        let out = w.len() / k;
        let mut y = vec![0f32; out * b];
        for o in 0..out {
            for j in 0..b {
                y[o * b + j] = (0..k)
                    .map(|i| (w[o * k + i] * x[j * k + i]) as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    #[test]
    fn matches_a_naive_product_for_every_block_size_and_tail() {
        for k in [1, 31, 32, 33, 96, 100] {
            let out = 300;
            let w = values(out * k, 7);
            for b in 1..=9 {
                let x = values(b * k, 11 + b as u32);
                let mut y = vec![0f32; out * b];
                multiply(&w, &x, k, b, &mut y);
                for (got, want) in y.iter().zip(naive(&w, &x, k, b)) {
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "k={k} b={b}"
                    );
                }
            }
        }
    }

    #[test]
    fn each_row_is_bit_identical_to_computing_it_alone() {
        let (k, out, b) = (96, 300, 7);
        let w = values(out * k, 3);
        let x = values(b * k, 5);
        let mut block = vec![0f32; out * b];
        multiply(&w, &x, k, b, &mut block);
        for j in 0..b {
            let mut single = vec![0f32; out];
            multiply(&w, &x[j * k..(j + 1) * k], k, 1, &mut single);
            for o in 0..out {
                assert_eq!(block[o * b + j].to_bits(), single[o].to_bits());
            }
        }
    }
}
