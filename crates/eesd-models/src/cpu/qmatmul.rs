//! `y = x · wᵀ` with `w: [out, k]` kept in its GGUF block format ([`QuantMatrix`]) and f32
//! activation rows `x: [b, k]`, quantized per row to 8 bits ([`Q8Rows`]) for integer dot
//! products (AVX2 `maddubs`, AVX-512 VNNI `vpdpbusd`), as llama.cpp runs quantized models.
//!
//! Why: decoding streams every weight once per token; in Q4_1 that is 5 bits per weight
//! instead of 32, and a block of rows reads each weight block once for all of them.
//!
//! Q4_0, Q4_1 and Q8_0 are regrouped at load into panels of 8 rows (module `qpanel`, whose
//! kernel serves 8 outputs per instruction); the K-quants stay in the file's row-major blocks.
//!
//! Batch invariance of the row-major kernel: output `(j, o)` is, for each sub-block `n` of 32
//! in order, the exact integer dot product of the codes in 8 lanes of 4, each lane accumulated
//! in f32 as `acc = fma(dot, s_w · d_x, acc)`, the offsets in their own chain
//! `c = fma(m_w, d_x·Σq_x, c)`, and finally `y = ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)) + c`.
//! Nothing there depends on the block size, the row grouping, the thread or the instruction set
//! (the portable path computes the same operations one lane at a time), so a block's rows equal
//! the rows computed alone, bit for bit.

use super::huge_pages::HugeBuf;
use super::isa::Isa;
use super::matmul::{ShapeError, row_groups};
use super::pool::Pool;
use super::q8::Q8Rows;
use super::qformat::{Offset, QuantFormat, SUB};
use super::qpanel;
use std::borrow::Cow;

/// Activation rows per register tile (AVX2: 2 outputs × 4 rows = 8 accumulators).
const MAX_ROWS: usize = 4;

/// Output rows per tile.
const OUTS: usize = 2;

/// How far ahead of the weights being read the kernel prefetches, in bytes: enough lines in
/// flight to keep memory busy (the hardware prefetchers alone reach a third of the bandwidth).
const PREFETCH: usize = 1536;

/// A weight matrix `[out, k]` in GGUF blocks, rows front to back, as stacked parts that may
/// use different formats (a fused q/k/v projection of a mixed-quantization file).
#[derive(Clone, PartialEq)]
pub struct QuantMatrix {
    parts: Vec<Part>,
    out: usize,
    k: usize,
}

#[derive(Clone, PartialEq)]
struct Part {
    format: QuantFormat,
    /// First output row.
    first: usize,
    rows: usize,
    /// The blocks, in panels for the formats `qpanel` takes, else as in the file; on huge
    /// pages where the OS offers them ([`super::huge_pages`]).
    data: HugeBuf<u8>,
    /// The file blocks' heads that the panels do not keep ([`qpanel::head_bytes`]; Q4_K), to
    /// give the file's blocks back; never read by the kernels.
    heads: Vec<u8>,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let formats: Vec<String> = self.parts.iter().map(|p| p.format.to_string()).collect();
        f.debug_struct("QuantMatrix")
            .field("out", &self.out)
            .field("k", &self.k)
            .field("formats", &formats)
            .finish()
    }
}

impl QuantMatrix {
    /// A matrix of `out` rows of `k` weights from `data` (row-major blocks, as in a GGUF file).
    pub fn new(
        format: QuantFormat,
        data: Vec<u8>,
        out: usize,
        k: usize,
    ) -> Result<Self, ShapeError> {
        let mut m = QuantMatrix {
            parts: Vec::new(),
            out: 0,
            k,
        };
        m.push(format, data, out)?;
        Ok(m)
    }

    /// Appends `rows` more output rows in `format`.
    pub fn push(
        &mut self,
        format: QuantFormat,
        data: Vec<u8>,
        rows: usize,
    ) -> Result<(), ShapeError> {
        let k = self.k;
        let row_bytes = k / format.block_len() * format.block_bytes();
        if k == 0
            || !k.is_multiple_of(format.block_len())
            || rows.checked_mul(row_bytes) != Some(data.len())
        {
            return Err(ShapeError::Weights {
                len: data.len(),
                out: rows,
                k,
            });
        }
        let (data, heads) = if qpanel::supports(format) {
            let (panels, heads) = qpanel::repack(format, &data, rows, k);
            (HugeBuf::from_slice(&panels), heads)
        } else {
            (HugeBuf::from_slice(&data), Vec::new())
        };
        self.parts.push(Part {
            format,
            first: self.out,
            rows,
            data,
            heads,
        });
        self.out += rows;
        Ok(())
    }

    /// Output rows.
    pub fn out(&self) -> usize {
        self.out
    }

    /// Inner dimension.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes the kernels read (the file's bytes, plus the padding of a last panel of fewer
    /// than 8 rows; for Q4_K panels 24 bytes per 32 weights where the file has 18).
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data.len()).sum()
    }

    /// The formats of the parts, in row order.
    pub fn formats(&self) -> Vec<QuantFormat> {
        self.parts.iter().map(|p| p.format).collect()
    }

    /// The format and the file's bytes of output row `o` (rebuilt from its panel where the
    /// part is stored in panels).
    fn row(&self, o: usize) -> Option<(QuantFormat, Cow<'_, [u8]>)> {
        let p = self
            .parts
            .iter()
            .find(|p| (p.first..p.first + p.rows).contains(&o))?;
        let (r, bb) = (o - p.first, p.format.block_bytes());
        let bytes = self.k / p.format.block_len() * bb;
        if !qpanel::supports(p.format) {
            return Some((p.format, Cow::Borrowed(&p.data[r * bytes..][..bytes])));
        }
        let mut row = vec![0u8; bytes];
        for (b, block) in row.chunks_exact_mut(bb).enumerate() {
            qpanel::file_block(p.format, &p.data, &p.heads, self.k, r, b, block);
        }
        Some((p.format, Cow::Owned(row)))
    }

    /// Output row `o` dequantized to f32 (by [`crate::quant::GgmlType::dequantize`], so the
    /// values equal those of a dequantizing load).
    pub fn dequantize_row(&self, o: usize, out: &mut [f32]) -> Result<(), ShapeError> {
        let bad = ShapeError::Operands {
            x: out.len(),
            y: o,
            out: self.out,
            k: self.k,
        };
        let Some((format, bytes)) = self.row(o).filter(|_| out.len() == self.k) else {
            return Err(bad);
        };
        let values = format
            .ggml()
            .dequantize("row", &bytes, self.k)
            .map_err(|_| bad)?;
        out.copy_from_slice(&values);
        Ok(())
    }

    /// The whole matrix dequantized, row-major `[out, k]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.out * self.k];
        for (o, row) in w.chunks_exact_mut(self.k).enumerate() {
            // Every row exists and has length k.
            let _ = self.dequantize_row(o, row);
        }
        w
    }

    /// The matrix of rows `ids` (in that order), e.g. an LM head restricted to a vocabulary
    /// subset.
    pub fn select_rows(&self, ids: &[u32]) -> Result<QuantMatrix, ShapeError> {
        let mut m = QuantMatrix {
            parts: Vec::new(),
            out: 0,
            k: self.k,
        };
        // Runs of rows in one format, each becoming one part.
        let mut runs: Vec<(QuantFormat, Vec<u8>, usize)> = Vec::new();
        for &id in ids {
            let (format, bytes) = self.row(id as usize).ok_or(ShapeError::Operands {
                x: id as usize,
                y: 0,
                out: self.out,
                k: self.k,
            })?;
            match runs.last_mut() {
                Some((f, data, rows)) if *f == format => {
                    data.extend_from_slice(&bytes);
                    *rows += 1;
                }
                _ => runs.push((format, bytes.into_owned(), 1)),
            }
        }
        for (format, data, rows) in runs {
            m.push(format, data, rows)?;
        }
        Ok(m)
    }

    /// `y[j·out + o] = Σ_i x[j·k + i] · w[o, i]` (with `x` quantized per row to 8 bits) on the
    /// process-wide [`Pool`] with the detected [`Isa`].
    pub fn matmul(&self, x: &[f32], y: &mut [f32]) -> Result<(), ShapeError> {
        self.matmul_with(Isa::detect(), Pool::global(), x, y)
    }

    /// [`QuantMatrix::matmul`] with an explicit instruction set and pool.
    pub fn matmul_with(
        &self,
        isa: Isa,
        pool: &Pool,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), ShapeError> {
        let k = self.k;
        let b = x.len() / k.max(1);
        if !x.len().is_multiple_of(k) || b.checked_mul(self.out) != Some(y.len()) {
            return Err(ShapeError::Operands {
                x: x.len(),
                y: y.len(),
                out: self.out,
                k,
            });
        }
        if b == 0 {
            return Ok(());
        }
        ACTS.with_borrow_mut(|acts| {
            acts.quantize_into(x, k);
            self.matmul_q8(isa, pool, acts, y);
        });
        Ok(())
    }

    /// The product with already quantized rows (`acts.k() == self.k()`, `y: [rows, out]`).
    fn matmul_q8(&self, isa: Isa, pool: &Pool, acts: &Q8Rows, y: &mut [f32]) {
        let isa = isa.supported();
        let y_ptr = super::pool::Disjoint(y.as_mut_ptr());
        // Units of 8 or 16 output rows inside one part ([`unit_rows`]), in shrinking
        // ranges ([`super::pool::Guided`]): the threads finish together.
        let units: usize = self
            .parts
            .iter()
            .map(|p| p.rows.div_ceil(unit_rows(isa, p.format)))
            .sum();
        pool.run_ranges(units, &|range| {
            let mut first = 0;
            for part in &self.parts {
                let n = part.rows.div_ceil(unit_rows(isa, part.format));
                let (a, z) = (range.start.max(first), range.end.min(first + n));
                if a < z {
                    // SAFETY: tasks write disjoint output columns of `y`, which has
                    // `rows · out` elements (checked by the caller).
                    unsafe { part_units(isa, part, self, acts, a - first..z - first, y_ptr.ptr()) };
                }
                first += n;
            }
        });
    }
}

/// Output rows per unit of work: one panel, or two where the wide kernel takes them at once.
fn unit_rows(isa: Isa, format: QuantFormat) -> usize {
    if qpanel::supports(format) && qpanel::wide(isa) {
        2 * qpanel::ROWS
    } else {
        qpanel::ROWS
    }
}

/// Units `units` of `part` (rows `u · unit..(u + 1) · unit` of the part, [`unit_rows`]) against
/// every activation row.
///
/// # Safety
/// `y` holds `acts.rows · m.out` floats and no other thread writes these units' columns.
unsafe fn part_units(
    isa: Isa,
    part: &Part,
    m: &QuantMatrix,
    acts: &Q8Rows,
    units: std::ops::Range<usize>,
    y: *mut f32,
) {
    let (k, out) = (m.k, m.out);
    if !qpanel::supports(part.format) {
        let o0 = part.first + units.start * qpanel::ROWS;
        let o1 = part.first + (units.end * qpanel::ROWS).min(part.rows);
        // SAFETY: as this function's.
        unsafe { part_rows(isa, part, k, acts, o0, o1, out, y) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if qpanel::wide(isa) {
        // SAFETY: as this function's; the CPU has what the wide kernel needs.
        unsafe { wide_units(part, m, acts, units, y) };
        return;
    }
    let panel_bytes = k / SUB * qpanel::sub_bytes(part.format);
    let groups = row_groups(acts.rows, qpanel::max_acts(part.format));
    let mut tile = [[0f32; qpanel::ROWS]; qpanel::MAX_ACTS];
    for p in units {
        let panel = &part.data[p * panel_bytes..][..panel_bytes];
        let o = part.first + p * qpanel::ROWS;
        let valid = (part.rows - p * qpanel::ROWS).min(qpanel::ROWS);
        for rows in groups.clone() {
            let (j, count) = (rows.start, rows.len());
            // SAFETY: `isa` is supported, the part is in panels, `count ≤ max_acts`.
            unsafe { qpanel::tile(isa, part.format, panel, acts, j, count, &mut tile) };
            // SAFETY: as this function's; rows `j..j + count` exist.
            unsafe { store_tile(&tile[..count], y, out, j, o, valid) };
        }
    }
}

/// [`part_units`] for a panel part with the wide kernel: unit `u` is panels `2u` and `2u + 1`
/// (a part's odd last panel goes alone, the kernel reading it twice).
///
/// # Safety
/// As [`part_units`]; [`qpanel::wide`] holds and `part` is in panels.
#[cfg(target_arch = "x86_64")]
unsafe fn wide_units(
    part: &Part,
    m: &QuantMatrix,
    acts: &Q8Rows,
    units: std::ops::Range<usize>,
    y: *mut f32,
) {
    let (k, out, rows) = (m.k, m.out, qpanel::ROWS);
    let panel_bytes = k / SUB * qpanel::sub_bytes(part.format);
    let panels = part.rows.div_ceil(rows);
    let groups = row_groups(acts.rows, qpanel::WIDE_ACTS);
    let mut tile = [[0f32; 2 * qpanel::ROWS]; qpanel::WIDE_ACTS];
    for u in units {
        let (p, q) = (2 * u, (2 * u + 1).min(panels - 1));
        let a = &part.data[p * panel_bytes..][..panel_bytes];
        let b = &part.data[q * panel_bytes..][..panel_bytes];
        let o = part.first + p * rows;
        let valid = (part.rows - p * rows).min(if q > p { 2 * rows } else { rows });
        for group in groups.clone() {
            let (j, count) = (group.start, group.len());
            // SAFETY: the part is in panels, `count ≤ WIDE_ACTS`, the caller checked the CPU.
            unsafe { qpanel::wide_tile(part.format, a, b, acts, j, count, &mut tile) };
            // SAFETY: as this function's; rows `j..j + count` exist.
            unsafe { store_tile(&tile[..count], y, out, j, o, valid) };
        }
    }
}

/// The first `valid` values of each row of `tile` into rows `j..` of `y` (`out` columns), from
/// column `o` on.
///
/// # Safety
/// `y` holds rows `j..j + tile.len()` of `out` floats, `o + valid ≤ out`, and no other thread
/// writes those columns.
unsafe fn store_tile<const N: usize>(
    tile: &[[f32; N]],
    y: *mut f32,
    out: usize,
    j: usize,
    o: usize,
    valid: usize,
) {
    for (i, values) in tile.iter().enumerate() {
        // SAFETY: row `j + i` of `y` has `out` columns from `o` on, `valid` of them ours.
        let dst = unsafe { std::slice::from_raw_parts_mut(y.add((j + i) * out + o), valid) };
        dst.copy_from_slice(&values[..valid]);
    }
}

thread_local! {
    /// The quantized activations of the current product (reused: no allocation per call).
    static ACTS: std::cell::RefCell<Q8Rows> = std::cell::RefCell::new(Q8Rows::default());
}

/// Output rows `o0..o1` (inside `part`) against every activation row.
///
/// # Safety
/// `y` holds `acts.rows · out` floats and no other thread writes columns `o0..o1`.
#[allow(clippy::too_many_arguments)]
unsafe fn part_rows(
    isa: Isa,
    part: &Part,
    k: usize,
    acts: &Q8Rows,
    o0: usize,
    o1: usize,
    out: usize,
    y: *mut f32,
) {
    let row_bytes = k / part.format.block_len() * part.format.block_bytes();
    let groups = row_groups(acts.rows, MAX_ROWS);
    let mut o = o0;
    while o < o1 {
        let outs = (o1 - o).min(OUTS);
        let w = &part.data[(o - part.first) * row_bytes..][..outs * row_bytes];
        for rows in groups.clone() {
            let (j, m) = (rows.start, rows.len());
            let mut tile = [[0f32; MAX_ROWS]; OUTS];
            unsafe { tile_for(isa, part.format, w, row_bytes, outs, acts, j, m, &mut tile) };
            for (r, tile_r) in tile.iter().enumerate().take(outs) {
                for (i, &v) in tile_r.iter().enumerate().take(m) {
                    unsafe { *y.add((j + i) * out + o + r) = v };
                }
            }
        }
        o += outs;
    }
}

/// Dispatches one tile to the instruction set's kernel, monomorphised per format and size.
///
/// # Safety
/// `isa` is supported; `w` holds `outs` rows of `row_bytes`; rows `j..j+m` exist in `acts`.
#[allow(clippy::too_many_arguments)]
unsafe fn tile_for(
    isa: Isa,
    format: QuantFormat,
    w: &[u8],
    row_bytes: usize,
    outs: usize,
    acts: &Q8Rows,
    j: usize,
    m: usize,
    tile: &mut [[f32; MAX_ROWS]; OUTS],
) {
    // One instance per format (the index into `QuantFormat::ALL`, a constant the compiler
    // folds) and tile size.
    macro_rules! sizes {
        ($kernel:ident, $f:literal) => {
            match (outs, m) {
                (2, 4) => $kernel::<$f, 2, 4>(w, row_bytes, acts, j, tile),
                (2, 3) => $kernel::<$f, 2, 3>(w, row_bytes, acts, j, tile),
                (2, 2) => $kernel::<$f, 2, 2>(w, row_bytes, acts, j, tile),
                (2, _) => $kernel::<$f, 2, 1>(w, row_bytes, acts, j, tile),
                (_, 4) => $kernel::<$f, 1, 4>(w, row_bytes, acts, j, tile),
                (_, 3) => $kernel::<$f, 1, 3>(w, row_bytes, acts, j, tile),
                (_, 2) => $kernel::<$f, 1, 2>(w, row_bytes, acts, j, tile),
                (_, _) => $kernel::<$f, 1, 1>(w, row_bytes, acts, j, tile),
            }
        };
        ($kernel:ident) => {
            match format {
                QuantFormat::Q4_0 => sizes!($kernel, 0),
                QuantFormat::Q4_1 => sizes!($kernel, 1),
                QuantFormat::Q8_0 => sizes!($kernel, 2),
                QuantFormat::Q4K => sizes!($kernel, 3),
                QuantFormat::Q6K => sizes!($kernel, 4),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Portable {
        // SAFETY: the caller checked that the CPU has AVX2.
        unsafe { sizes!(avx2_tile) };
        return;
    }
    let _ = isa;
    sizes!(portable_tile);
}

/// The 8-lane sum in the kernels' fixed order.
#[inline(always)]
fn lane_sum(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// The reference kernel: the same operations as the SIMD ones, one lane at a time.
// Indexed loops keep the row/output/lane structure of the SIMD kernel visible.
#[allow(clippy::needless_range_loop)]
fn portable_tile<const F: usize, const R: usize, const M: usize>(
    w: &[u8],
    row_bytes: usize,
    acts: &Q8Rows,
    j: usize,
    tile: &mut [[f32; MAX_ROWS]; OUTS],
) {
    let format = QuantFormat::ALL[F];
    let (k, subs, stride) = (acts.k, acts.k / SUB, acts.stride);
    let per_block = format.block_len() / SUB;
    for r in 0..R {
        let row = &w[r * row_bytes..][..row_bytes];
        for m in 0..M {
            let x = &acts.q[(j + m) * k..][..k];
            let (mut acc, mut c) = ([0f32; 8], 0f32);
            for n in 0..subs {
                let block = &row[n / per_block * format.block_bytes()..][..format.block_bytes()];
                let q = format.values(block, n % per_block);
                let sc = format.scales(block, n % per_block);
                let dx = acts.d[(j + m) * subs + n];
                let xq = &x[n * SUB..][..SUB];
                for (l, a) in acc.iter_mut().enumerate() {
                    let dot: i32 = (4 * l..4 * l + 4).map(|e| q[e] * xq[e] as i32).sum();
                    *a = (dot as f32).mul_add(sc.scale[l / 4] * dx, *a);
                }
                match sc.offset {
                    Offset::None => {}
                    Offset::Whole(o) => c = o.mul_add(acts.sum[n * stride + j + m], c),
                    Offset::Halves(a, b) => {
                        c = a.mul_add(acts.half[2 * n * stride + j + m], c);
                        c = b.mul_add(acts.half[(2 * n + 1) * stride + j + m], c);
                    }
                }
            }
            tile[r][m] = lane_sum(acc) + c;
        }
    }
}

#[cfg(target_arch = "x86_64")]
use x86::avx2_tile;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::qformat::{Offset, QuantFormat, SUB};
    use super::{MAX_ROWS, OUTS, PREFETCH, Q8Rows};
    use std::arch::x86_64::*;

    /// 32 unsigned 4-bit values from 16 bytes: low nibbles, then high nibbles (the 16 bytes in
    /// both halves, the upper half shifted right by 4).
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        unsafe {
            let b = _mm256_broadcastsi128_si256(_mm_loadu_si128(p.cast()));
            let shifted = _mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4));
            _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f))
        }
    }

    /// The 32 integer values of sub-block `s` of the block at `b` (as [`QuantFormat::values`]).
    #[inline(always)]
    unsafe fn values(format: QuantFormat, b: *const u8, s: usize) -> __m256i {
        unsafe {
            let low4 = _mm256_set1_epi8(0x0f);
            match format {
                QuantFormat::Q4_0 => nibbles(b.add(2)),
                QuantFormat::Q4_1 => nibbles(b.add(4)),
                QuantFormat::Q8_0 => _mm256_loadu_si256(b.add(2).cast()),
                QuantFormat::Q4K => {
                    let v = _mm256_loadu_si256(b.add(16 + 32 * (s / 2)).cast());
                    match s % 2 {
                        0 => _mm256_and_si256(v, low4),
                        _ => _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4),
                    }
                }
                QuantFormat::Q6K => {
                    let (half, quarter) = (s / 4, s % 4);
                    let ql = _mm256_loadu_si256(b.add(64 * half + 32 * (quarter % 2)).cast());
                    let qh = _mm256_loadu_si256(b.add(128 + 32 * half).cast());
                    let lo = match quarter / 2 {
                        0 => _mm256_and_si256(ql, low4),
                        _ => _mm256_and_si256(_mm256_srli_epi16::<4>(ql), low4),
                    };
                    let hi = match quarter {
                        0 => qh,
                        1 => _mm256_srli_epi16::<2>(qh),
                        2 => _mm256_srli_epi16::<4>(qh),
                        _ => _mm256_srli_epi16::<6>(qh),
                    };
                    let hi = _mm256_slli_epi16::<4>(_mm256_and_si256(hi, _mm256_set1_epi8(3)));
                    _mm256_or_si256(lo, hi)
                }
            }
        }
    }

    /// The f16 at `p` as f32 in lane 0 (F16C; exact, as every conversion of an f16 is).
    #[inline(always)]
    unsafe fn f16_lane(p: *const u8) -> __m128 {
        unsafe { _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<u16>().read_unaligned() as i32)) }
    }

    /// Lane scales and offsets (broadcast) of sub-block `s` of the block at `b`: the values of
    /// [`QuantFormat::scales`], computed with F16C instead of a call per f16.
    #[inline(always)]
    unsafe fn scales(format: QuantFormat, b: *const u8, s: usize) -> (__m256, Offset<__m128>) {
        unsafe {
            match format {
                QuantFormat::Q4_0 => {
                    let d = _mm_broadcastss_ps(f16_lane(b));
                    let o = _mm_mul_ps(d, _mm_set1_ps(-8.0));
                    (_mm256_broadcastss_ps(d), Offset::Whole(o))
                }
                QuantFormat::Q4_1 => {
                    // d and m are adjacent: one conversion for both.
                    let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(b.cast::<i32>().read_unaligned()));
                    let m = _mm_shuffle_ps::<0b0101_0101>(dm, dm);
                    (_mm256_broadcastss_ps(dm), Offset::Whole(m))
                }
                QuantFormat::Q8_0 => (_mm256_broadcastss_ps(f16_lane(b)), Offset::None),
                QuantFormat::Q4K | QuantFormat::Q6K => {
                    let block = std::slice::from_raw_parts(b, format.block_bytes());
                    let sc = format.scales(block, s);
                    let (a, c) = (_mm_set1_ps(sc.scale[0]), _mm_set1_ps(sc.scale[1]));
                    let offset = match sc.offset {
                        Offset::None => Offset::None,
                        Offset::Whole(o) => Offset::Whole(_mm_set1_ps(o)),
                        Offset::Halves(x, y) => Offset::Halves(_mm_set1_ps(x), _mm_set1_ps(y)),
                    };
                    (_mm256_set_m128(c, a), offset)
                }
            }
        }
    }

    /// Lane sums `Σ w·x` over each 4 of the 32 values (exact in 32 bits: no 16-bit pair sum
    /// exceeds 2·128·127).
    #[inline(always)]
    unsafe fn dot(format: QuantFormat, w: __m256i, x: __m256i) -> __m256i {
        unsafe {
            let pairs = if format.signed() {
                _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
            } else {
                _mm256_maddubs_epi16(w, x)
            };
            _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
        }
    }

    #[inline(always)]
    unsafe fn lane_sum(v: __m256) -> f32 {
        unsafe {
            let four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
            _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps::<1>(two, two)))
        }
    }

    /// AVX2 tile of `R` outputs × `M` rows (see the module's arithmetic contract).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `w` holds `R` rows of `row_bytes`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn avx2_tile<const F: usize, const R: usize, const M: usize>(
        w: &[u8],
        row_bytes: usize,
        acts: &Q8Rows,
        j: usize,
        tile: &mut [[f32; MAX_ROWS]; OUTS],
    ) {
        unsafe { tile_impl::<R, M>(QuantFormat::ALL[F], w, row_bytes, acts, j, tile) }
    }

    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn tile_impl<const R: usize, const M: usize>(
        format: QuantFormat,
        w: &[u8],
        row_bytes: usize,
        acts: &Q8Rows,
        j: usize,
        tile: &mut [[f32; MAX_ROWS]; OUTS],
    ) {
        let (k, subs, stride) = (acts.k, acts.k / SUB, acts.stride);
        let per_block = format.block_len() / SUB;
        let block_bytes = format.block_bytes();
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); M]; R];
            // Offsets of rows j..j+4, one lane per row.
            let mut c = [_mm_setzero_ps(); R];
            let xq = acts.q.as_ptr().add(j * k);
            let dx = acts.d.as_ptr().add(j * subs);
            for n in 0..subs {
                let (blk, s) = (n / per_block, n % per_block);
                let mut wq = [_mm256_setzero_si256(); R];
                let mut ws = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    let block = w.as_ptr().add(r * row_bytes + blk * block_bytes);
                    // The rows of a task are one stream; fetch well ahead of it (prefetches
                    // never fault, past the end included). Each sub-block moves the address on
                    // by its share of the block, so every line of a K-quant block (144 or 210
                    // bytes, 8 sub-blocks) is fetched, not only its first (Q6_K: one row 13.3
                    // -> 9.3 ms per forward of SmolLM2-sized layers, Q4_K 12.0 -> 11.8 ms; Zen
                    // 5 EPYC).
                    let ahead = w.as_ptr().add(r * row_bytes + n * block_bytes / per_block);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(PREFETCH).cast());
                    wq[r] = values(format, block, s);
                    let (scale, offset) = scales(format, block, s);
                    ws[r] = scale;
                    match offset {
                        Offset::None => {}
                        Offset::Whole(o) => {
                            let xs = _mm_loadu_ps(acts.sum.as_ptr().add(n * stride + j));
                            c[r] = _mm_fmadd_ps(o, xs, c[r]);
                        }
                        Offset::Halves(a, b) => {
                            let xa = _mm_loadu_ps(acts.half.as_ptr().add(2 * n * stride + j));
                            let xb = _mm_loadu_ps(acts.half.as_ptr().add((2 * n + 1) * stride + j));
                            c[r] = _mm_fmadd_ps(a, xa, c[r]);
                            c[r] = _mm_fmadd_ps(b, xb, c[r]);
                        }
                    }
                }
                for m in 0..M {
                    let x = _mm256_loadu_si256(xq.add(m * k + n * SUB).cast());
                    let d = _mm256_broadcast_ss(&*dx.add(m * subs + n));
                    for r in 0..R {
                        let dots = _mm256_cvtepi32_ps(dot(format, wq[r], x));
                        acc[r][m] = _mm256_fmadd_ps(dots, _mm256_mul_ps(ws[r], d), acc[r][m]);
                    }
                }
            }
            for r in 0..R {
                let mut offsets = [0f32; 4];
                _mm_storeu_ps(offsets.as_mut_ptr(), c[r]);
                for m in 0..M {
                    tile[r][m] = lane_sum(acc[r][m]) + offsets[m];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_inputs::{isas, same_bits, values};

    fn blocks(format: QuantFormat, blocks: usize, seed: u32) -> Vec<u8> {
        super::super::qformat::test_blocks(format, blocks, seed)
    }

    fn product(isa: Isa, pool: &Pool, m: &QuantMatrix, x: &[f32]) -> Vec<f32> {
        let mut y = vec![f32::NAN; x.len() / m.k() * m.out()];
        m.matmul_with(isa, pool, x, &mut y).unwrap();
        y
    }

    /// Close to the exact product of the dequantized weights and the 8-bit activations, and
    /// the same bits on every instruction set.
    #[test]
    fn every_format_matches_the_dequantized_product() {
        let pool = Pool::new(3);
        for format in QuantFormat::ALL {
            let k = 2 * format.block_len();
            for out in [1, 2, 5, 16] {
                let row_bytes = k / format.block_len() * format.block_bytes();
                let m = QuantMatrix::new(
                    format,
                    blocks(format, out * k / format.block_len(), 3),
                    out,
                    k,
                )
                .unwrap();
                let held = if qpanel::supports(format) {
                    out.div_ceil(8) * (k / SUB) * qpanel::sub_bytes(format)
                } else {
                    out * row_bytes
                };
                assert_eq!(m.bytes(), held);
                let w = m.dequantize();
                let bytes = blocks(format, out * k / format.block_len(), 3);
                let want_w = format.ggml().dequantize("t", &bytes, out * k).unwrap();
                assert_eq!(w, want_w);
                assert_eq!(w.len(), want_w.len());
                for b in [1, 2, 3, 5, 9] {
                    let x = values(b * k, 7 + b as u32);
                    let mut acts = Q8Rows::default();
                    acts.quantize_into(&x, k);
                    let reference = product(Isa::Portable, &pool, &m, &x);
                    for j in 0..b {
                        for o in 0..out {
                            let exact: f64 = (0..k)
                                .map(|i| {
                                    let xq = acts.q[j * k + i] as f64
                                        * acts.d[j * (k / SUB) + i / SUB] as f64;
                                    w[o * k + i] as f64 * xq
                                })
                                .sum();
                            let mag: f64 = (0..k)
                                .map(|i| (w[o * k + i] as f64 * x[j * k + i] as f64).abs())
                                .sum();
                            let got = reference[j * out + o] as f64;
                            assert!(
                                (got - exact).abs() <= 1e-5 * (1.0 + mag),
                                "{format} b={b} ({j},{o}): {got} vs {exact}"
                            );
                        }
                    }
                    for isa in isas() {
                        let got = product(isa, &pool, &m, &x);
                        let same = same_bits(&got, &reference);
                        assert!(same, "{isa:?} {format} out={out} b={b}");
                    }
                }
            }
        }
    }

    /// A block's rows equal the rows alone, bit for bit, for every block size and thread count.
    #[test]
    fn rows_are_batch_invariant() {
        let one = Pool::new(1);
        let three = Pool::new(3);
        for format in QuantFormat::ALL {
            let k = 3 * 256;
            let out = 37;
            let m = QuantMatrix::new(
                format,
                blocks(format, out * k / format.block_len(), 5),
                out,
                k,
            )
            .unwrap();
            for isa in isas() {
                for b in [2, 3, 7, 8, 16, 33] {
                    let x = values(b * k, 11 + b as u32);
                    let block = product(isa, &three, &m, &x);
                    for j in 0..b {
                        let alone = product(isa, &one, &m, &x[j * k..(j + 1) * k]);
                        let same = same_bits(&block[j * out..(j + 1) * out], &alone);
                        assert!(same, "{isa:?} {format} b={b} row {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn stacked_parts_and_selected_rows() {
        let k = 256;
        let pool = Pool::new(2);
        let a = blocks(QuantFormat::Q4K, 3, 1);
        let b = blocks(QuantFormat::Q6K, 2, 2);
        let mut m = QuantMatrix::new(QuantFormat::Q4K, a.clone(), 3, k).unwrap();
        m.push(QuantFormat::Q6K, b.clone(), 2).unwrap();
        assert_eq!(
            (m.out(), m.formats()),
            (5, vec![QuantFormat::Q4K, QuantFormat::Q6K])
        );
        let only_a = QuantMatrix::new(QuantFormat::Q4K, a, 3, k).unwrap();
        let only_b = QuantMatrix::new(QuantFormat::Q6K, b, 2, k).unwrap();
        let x = values(2 * k, 4);
        let (y, ya, yb) = (
            product(Isa::detect(), &pool, &m, &x),
            product(Isa::detect(), &pool, &only_a, &x),
            product(Isa::detect(), &pool, &only_b, &x),
        );
        for j in 0..2 {
            assert_eq!(y[j * 5..j * 5 + 3], ya[j * 3..j * 3 + 3]);
            assert_eq!(y[j * 5 + 3..j * 5 + 5], yb[j * 2..j * 2 + 2]);
        }
        let picked = m.select_rows(&[4, 0]).unwrap();
        let yp = product(Isa::detect(), &pool, &picked, &x);
        for j in 0..2 {
            assert_eq!([yp[j * 2], yp[j * 2 + 1]], [y[j * 5 + 4], y[j * 5]]);
        }
        assert!(m.select_rows(&[5]).is_err());
    }

    #[test]
    fn rejects_inconsistent_shapes() {
        assert!(QuantMatrix::new(QuantFormat::Q4_1, vec![0; 19], 1, 32).is_err());
        assert!(QuantMatrix::new(QuantFormat::Q4K, vec![0; 144], 1, 128).is_err());
        let m = QuantMatrix::new(QuantFormat::Q4_1, vec![0; 40], 2, 32).unwrap();
        let mut y = vec![0f32; 2];
        assert!(m.matmul(&[0.0; 31], &mut y).is_err());
        assert!(m.matmul(&[0.0; 32], &mut y[..1]).is_err());
        assert!(m.matmul(&[0.0; 32], &mut y).is_ok());
    }
}
