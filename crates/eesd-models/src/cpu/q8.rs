//! Activation rows quantized to 8 bits per sub-block of 32, the other operand of the quantized
//! kernel (as llama.cpp quantizes activations for its integer dot products).
//!
//! Each row is quantized on its own, by a fixed rule (scale `max|x| / 127`, round to nearest
//! even), so a row's codes never depend on the other rows of its block: the kernel stays
//! batch-invariant.

use super::pool::Disjoint;
use super::qformat::SUB;
use std::marker::PhantomData;

/// `b` rows of `k` activations as signed 8-bit codes with one f32 scale per sub-block.
#[derive(Debug, Clone, Default)]
pub struct Q8Rows {
    pub(crate) k: usize,
    pub(crate) rows: usize,
    /// Codes `[rows][k]`.
    pub(crate) q: Vec<i8>,
    /// Scales `[rows][k / 32]`.
    pub(crate) d: Vec<f32>,
    /// `d · Σ q` per sub-block, `[rows][k / 32]` ([`sum_index`]).
    pub(crate) sum: Vec<f32>,
    /// The exact `Σ q` per sub-block, `[rows][k / 32]` ([`sum_index`]): the VNNI kernel's
    /// correction for Q8_0 weights it reads as unsigned (`w + 128`).
    pub(crate) int_sum: Vec<i32>,
    /// `−32 · Σ q` per half sub-block (exact), `[rows][k / 32][2]` ([`half_index`]): where the
    /// panel kernels' sums start for Q6_K codes, stored as `q + 32`.
    pub(crate) half_bias: Vec<i32>,
}

/// Where `sum` and `int_sum` hold row `r`'s sums of sub-block `s`, for rows of `subs`
/// sub-blocks: row-major like the scales, so a kernel finds a row's scale and sum at one
/// offset, and rows (made by different threads) share a cache line only where one ends and
/// the next begins. (Sub-block-major sums, `[k / 32][rows]`, put all rows' sums of a
/// sub-block in one line, which the threads bounced between the cores at every row.)
#[inline(always)]
pub(crate) fn sum_index(subs: usize, r: usize, s: usize) -> usize {
    r * subs + s
}

/// Where `half_bias` holds half `h` (0 or 1) of row `r`'s sub-block `s` ([`sum_index`]'s
/// layout, two values per sub-block).
#[inline(always)]
pub(crate) fn half_index(subs: usize, r: usize, s: usize, h: usize) -> usize {
    2 * sum_index(subs, r, s) + h
}

impl Q8Rows {
    /// Rows of `k` values (`k` a multiple of 32, `x.len()` a multiple of `k`), reusing `self`'s
    /// buffers.
    pub fn quantize_into(&mut self, x: &[f32], k: usize) {
        debug_assert!(k.is_multiple_of(SUB) && x.len().is_multiple_of(k));
        let rows = x.len() / k;
        let writer = self.writer(rows, k);
        for (r, row) in x.chunks_exact(k).enumerate() {
            // SAFETY: one row at a time, each below `rows`.
            unsafe { writer.row(r, row) };
        }
    }

    /// Room for `rows` rows of `k` values (`k` a multiple of 32), and a handle that quantizes
    /// them one by one, from any thread: the rows a block's pieces produce in parallel tasks
    /// (norms, gating) are quantized where they are made, not afterwards on one thread.
    pub(crate) fn writer(&mut self, rows: usize, k: usize) -> RowWriter<'_> {
        debug_assert!(k.is_multiple_of(SUB));
        let subs = k / SUB;
        self.k = k;
        self.rows = rows;
        self.q.resize(rows * k, 0);
        self.d.resize(rows * subs, 0.0);
        self.sum.clear();
        self.sum.resize(rows * subs, 0.0);
        self.int_sum.clear();
        self.int_sum.resize(rows * subs, 0);
        self.half_bias.clear();
        self.half_bias.resize(rows * 2 * subs, 0);
        RowWriter {
            q: Disjoint(self.q.as_mut_ptr()),
            d: Disjoint(self.d.as_mut_ptr()),
            sum: Disjoint(self.sum.as_mut_ptr()),
            int_sum: Disjoint(self.int_sum.as_mut_ptr()),
            half_bias: Disjoint(self.half_bias.as_mut_ptr()),
            rows,
            k,
            _rows: PhantomData,
        }
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Values per row.
    pub fn k(&self) -> usize {
        self.k
    }
}

/// Writes the rows of a [`Q8Rows`] sized by [`Q8Rows::writer`]; shared by the tasks that
/// make the rows, each quantizing its own.
pub(crate) struct RowWriter<'a> {
    q: Disjoint<i8>,
    d: Disjoint<f32>,
    sum: Disjoint<f32>,
    int_sum: Disjoint<i32>,
    half_bias: Disjoint<i32>,
    rows: usize,
    k: usize,
    _rows: PhantomData<&'a mut Q8Rows>,
}

impl RowWriter<'_> {
    /// Quantizes `x` (`k` values) as row `r`: the same codes, scales and sums whichever
    /// thread runs it and whatever the other rows are.
    ///
    /// # Safety
    /// `r` is below the writer's row count, and no other call writes row `r` at the same time.
    pub(crate) unsafe fn row(&self, r: usize, x: &[f32]) {
        let k = self.k;
        let subs = k / SUB;
        debug_assert!(r < self.rows && x.len() == k);
        // SAFETY: row r's codes, scales and sums are its own slices (`sum_index` and
        // `half_index` of row r), which no other row touches.
        unsafe {
            let q = std::slice::from_raw_parts_mut(self.q.ptr().add(r * k), k);
            let d = std::slice::from_raw_parts_mut(self.d.ptr().add(r * subs), subs);
            quantize_row(x, q, d);
            // The exact sums of each half sub-block, a stack buffer's worth at a time.
            let mut halves = [0i32; 2 * SUMMED];
            for first in (0..subs).step_by(SUMMED) {
                let n = SUMMED.min(subs - first);
                half_sums(&q[first * SUB..(first + n) * SUB], &mut halves[..2 * n]);
                for (s, pair) in (first..).zip(halves[..2 * n].chunks_exact(2)) {
                    let (a, c) = (pair[0], pair[1]);
                    *self.int_sum.ptr().add(sum_index(subs, r, s)) = a + c;
                    *self.sum.ptr().add(sum_index(subs, r, s)) = d[s] * (a + c) as f32;
                    *self.half_bias.ptr().add(half_index(subs, r, s, 0)) = -32 * a;
                    *self.half_bias.ptr().add(half_index(subs, r, s, 1)) = -32 * c;
                }
            }
        }
    }
}

/// `1.5·2²³`: adding it to an integer of magnitude below 2²² puts the integer in the low
/// mantissa bits.
const MAGIC: f32 = 12_582_912.0;

/// Quantizes one row: per sub-block, `d = max|x| / 127` and `q = round(x · 127 / max|x|)`
/// ([`quantize_row_portable`] is the definition; the AVX2 path gives the same codes and scales).
fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::Isa::detect() != super::Isa::Portable {
        // SAFETY: `detect` reports AVX2 only when the CPU has it.
        unsafe { quantize_row_avx2(x, q, d) };
        return;
    }
    quantize_row_portable(x, q, d);
}

/// [`quantize_row`]'s definition, one value at a time.
fn quantize_row_portable(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    for ((x, q), d) in x
        .chunks_exact(SUB)
        .zip(q.chunks_exact_mut(SUB))
        .zip(d.iter_mut())
    {
        // The maximum as compare-and-select in 8 lanes, then across them (a NaN never wins a
        // comparison, and the lanes never hold one: any order gives the same maximum).
        let mut lanes = [0f32; 8];
        for c in x.chunks_exact(8) {
            for (m, &v) in lanes.iter_mut().zip(c) {
                let a = v.abs();
                *m = if a > *m { a } else { *m };
            }
        }
        let amax = lanes.iter().fold(0f32, |m, &v| if v > m { v } else { m });
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        *d = amax / 127.0;
        for (q, &v) in q.iter_mut().zip(x) {
            let r = (v * inv).round_ties_even().clamp(-127.0, 127.0);
            // `r` is a small integer, so `r + 1.5·2²³` is exact and its low mantissa bits
            // hold it (the low byte of `MAGIC`'s bits is 0).
            *q = ((r + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32) as i8;
        }
    }
}

/// [`quantize_row`] with AVX2, sub-block by sub-block in four registers of 8: the same
/// operations lane for lane (`max(a, m)` is `a > m ? a : m`, the clamp keeps NaN as `clamp`
/// does, and a code is the low byte of `r + 1.5·2²³`), so the same codes and scales; the
/// compiler left the maximum scalar, ≈ 0.6 ns a value.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_avx2(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    use std::arch::x86_64::*;
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let magic = _mm256_set1_ps(MAGIC);
    // The low byte of each 32-bit lane, gathered in each 128-bit half.
    let low_bytes = _mm256_setr_epi8(
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, //
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
    );
    for ((x, q), d) in x
        .chunks_exact(SUB)
        .zip(q.chunks_exact_mut(SUB))
        .zip(d.iter_mut())
    {
        // SAFETY: `x` holds 32 values, read 8 at a time.
        let v: [__m256; 4] =
            std::array::from_fn(|c| unsafe { _mm256_loadu_ps(x[8 * c..].as_ptr()) });
        let mut lanes = _mm256_setzero_ps();
        for v in v {
            lanes = _mm256_max_ps(_mm256_and_ps(v, abs), lanes);
        }
        let half = _mm_max_ps(
            _mm256_castps256_ps128(lanes),
            _mm256_extractf128_ps::<1>(lanes),
        );
        let pair = _mm_max_ps(half, _mm_movehl_ps(half, half));
        let amax = _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        *d = amax / 127.0;
        let inv = _mm256_set1_ps(inv);
        let codes: [__m256i; 4] = v.map(|v| {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(v, inv),
            );
            let r = _mm256_min_ps(hi, _mm256_max_ps(lo, r));
            _mm256_shuffle_epi8(_mm256_castps_si256(_mm256_add_ps(r, magic)), low_bytes)
        });
        // Each register's 8 codes sit in bytes 0..4 of either half: join them in order.
        let fours: [i32; 8] = std::array::from_fn(|i| {
            let c = codes[i / 2];
            match i % 2 {
                0 => _mm256_extract_epi32::<0>(c),
                _ => _mm256_extract_epi32::<4>(c),
            }
        });
        // SAFETY: `q` holds 32 codes, written as 8 groups of 4 bytes.
        unsafe {
            _mm256_storeu_si256(
                q.as_mut_ptr().cast(),
                _mm256_loadu_si256(fours.as_ptr().cast()),
            )
        };
    }
}

/// Sub-blocks per call of [`half_sums`] in [`RowWriter::row`].
const SUMMED: usize = 64;

/// `sums[i]` = the sum of codes `16·i..16·i + 16` (exact in i32; `q` holds whole sub-blocks).
fn half_sums(q: &[i8], sums: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if super::Isa::detect() != super::Isa::Portable {
        // SAFETY: `detect` reports AVX2 only when the CPU has it.
        unsafe { half_sums_avx2(q, sums) };
        return;
    }
    for (codes, sum) in q.chunks_exact(SUB / 2).zip(sums.iter_mut()) {
        *sum = codes.iter().map(|&v| v as i32).sum();
    }
}

/// [`half_sums`] with AVX2: per sub-block, `maddubs` by ones sums byte pairs, `madd` by ones
/// sums fours, two horizontal adds leave each half's sum in its 128-bit lane (all exact).
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn half_sums_avx2(q: &[i8], sums: &mut [i32]) {
    use std::arch::x86_64::*;
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    for (codes, pair) in q.chunks_exact(SUB).zip(sums.chunks_exact_mut(2)) {
        // SAFETY: `codes` holds 32 bytes.
        let v = unsafe { _mm256_loadu_si256(codes.as_ptr().cast()) };
        let fours = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16);
        let twos = _mm256_hadd_epi32(fours, fours);
        let ones = _mm256_hadd_epi32(twos, twos);
        pair[0] = _mm256_cvtsi256_si32(ones);
        pair[1] = _mm256_extract_epi32::<4>(ones);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 quantizer gives the definition's codes and scales, bit for bit, on ordinary
    /// and awkward values (NaN, ±∞, ±0, subnormals, ties at .5, values past ±127 steps).
    #[test]
    fn avx2_quantizer_matches_the_definition() {
        #[cfg(target_arch = "x86_64")]
        if super::super::Isa::detect() != super::super::Isa::Portable {
            let mut rows: Vec<Vec<f32>> = vec![
                (0..4 * SUB)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.031)
                    .collect(),
                (0..SUB).map(|i| i as f32 * 0.5 - 8.0).collect(),
                vec![0.0; SUB],
                vec![-0.0; SUB],
                (0..SUB)
                    .map(|i| {
                        if i % 3 == 0 {
                            f32::MIN_POSITIVE / 4.0
                        } else {
                            -1e-40
                        }
                    })
                    .collect(),
            ];
            for special in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN, 3e38] {
                let mut row: Vec<f32> = (0..SUB).map(|i| (i as f32 - 15.5) * 0.25).collect();
                row[7] = special;
                row[30] = -special;
                rows.push(row);
            }
            for x in rows {
                let n = x.len() / SUB;
                let (mut q0, mut d0) = (vec![0i8; x.len()], vec![0f32; n]);
                let (mut q1, mut d1) = (vec![1i8; x.len()], vec![1f32; n]);
                quantize_row_portable(&x, &mut q0, &mut d0);
                // SAFETY: the CPU has AVX2 (checked above).
                unsafe { quantize_row_avx2(&x, &mut q1, &mut d1) };
                assert_eq!(q0, q1, "{x:?}");
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&d0), bits(&d1), "{x:?}");
            }
        }
    }

    #[test]
    fn half_sums_are_exact() {
        // Extremes and a spread of codes, 5 sub-blocks.
        let q: Vec<i8> = (0..5 * SUB)
            .map(|i| match i % 7 {
                0 => 127,
                1 => -127,
                _ => ((i * 53) % 255) as i32 as i8,
            })
            .collect();
        let mut got = vec![0i32; 10];
        half_sums(&q, &mut got);
        let want: Vec<i32> = q
            .chunks_exact(16)
            .map(|c| c.iter().map(|&v| v as i32).sum())
            .collect();
        assert_eq!(got, want);
        for v in [127, -127, -128] {
            let mut s = [0; 2];
            half_sums(&[v; SUB], &mut s);
            assert_eq!(s, [16 * v as i32; 2]);
        }
    }

    /// Rows longer than one stack buffer of sums keep exact sums.
    #[test]
    fn sums_of_long_rows_are_exact() {
        let k = 70 * SUB;
        let x: Vec<f32> = (0..k).map(|i| ((i * 53) % 255) as f32 - 127.0).collect();
        let mut rows = Q8Rows::default();
        rows.quantize_into(&x, k);
        for s in 0..70 {
            let codes = &rows.q[s * SUB..(s + 1) * SUB];
            let half =
                |h: usize| -> i32 { codes[h * 16..h * 16 + 16].iter().map(|&v| v as i32).sum() };
            assert_eq!(
                rows.int_sum[sum_index(70, 0, s)],
                half(0) + half(1),
                "sub-block {s}"
            );
            assert_eq!(rows.half_bias[half_index(70, 0, s, 0)], -32 * half(0));
            assert_eq!(rows.half_bias[half_index(70, 0, s, 1)], -32 * half(1));
        }
    }

    #[test]
    fn codes_reconstruct_the_rows() {
        let k = 64;
        let x: Vec<f32> = (0..3 * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut q = Q8Rows::default();
        q.quantize_into(&x, k);
        assert_eq!((q.rows(), q.k()), (3, k));
        for r in 0..3 {
            for i in 0..k {
                let back = q.q[r * k + i] as f32 * q.d[r * 2 + i / SUB];
                let amax = 50.0 / 7.0;
                assert!((back - x[r * k + i]).abs() <= amax / 254.0 + 1e-5);
            }
        }
    }

    #[test]
    fn a_row_quantizes_the_same_in_any_block() {
        let k = 96;
        let x: Vec<f32> = (0..5 * k).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut block = Q8Rows::default();
        block.quantize_into(&x, k);
        for r in 0..5 {
            let mut alone = Q8Rows::default();
            alone.quantize_into(&x[r * k..(r + 1) * k], k);
            assert_eq!(alone.q, block.q[r * k..(r + 1) * k]);
            assert_eq!(alone.d, block.d[r * 3..(r + 1) * 3]);
            for s in 0..3 {
                assert_eq!(alone.sum[sum_index(3, 0, s)], block.sum[sum_index(3, r, s)]);
                let codes = &alone.q[s * SUB..(s + 1) * SUB];
                let exact: i32 = codes.iter().map(|&v| v as i32).sum();
                assert_eq!(alone.int_sum[sum_index(3, 0, s)], exact);
                assert_eq!(block.int_sum[sum_index(3, r, s)], exact);
                for h in 0..2 {
                    let half: i32 = codes[16 * h..][..16].iter().map(|&v| v as i32).sum();
                    assert_eq!(block.half_bias[half_index(3, r, s, h)], -32 * half);
                }
            }
        }
    }

    /// The vectorised conversion gives what `as` gives, ties (to even) and extremes included.
    #[test]
    fn codes_are_the_rounded_clamped_scaled_values() {
        // Amax 127 makes the scale 1, so x.5 values are exact ties.
        let mut x: Vec<f32> = (0..2 * SUB).map(|i| i as f32 * 2.5 - 79.5).collect();
        x[0] = 127.0;
        x[SUB] = -127.0;
        x[SUB + 1] = 126.5;
        x[SUB + 2] = -0.5;
        let mut q = Q8Rows::default();
        q.quantize_into(&x, 2 * SUB);
        for (i, &v) in x.iter().enumerate() {
            let amax = x[i / SUB * SUB..][..SUB]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            let want = (v * (127.0 / amax)).round_ties_even().clamp(-127.0, 127.0) as i8;
            assert_eq!(q.q[i], want, "{v}");
        }
        assert_eq!(q.q[SUB + 1], 126);
        assert_eq!(q.q[SUB + 2], 0);
    }

    #[test]
    fn zero_rows_have_zero_codes() {
        let mut q = Q8Rows::default();
        q.quantize_into(&[0.0; 32], 32);
        assert!(q.q.iter().all(|&v| v == 0));
        assert_eq!(q.d, vec![0.0]);
    }
}
