//! Q4_0, Q4_1, Q8_0, Q4_K and Q6_K weights regrouped once at load into *panels* of 8 output
//! rows, so that one 256-bit register holds 4 consecutive codes of each of the 8 rows and every
//! integer multiply, conversion and scaling serves 8 outputs at once.
//!
//! Why: in the file's row-major blocks, each (output, activation row, sub-block of 32) costs
//! its own `maddubs`, `madd`, conversion, scale product and FMA, so a block of 8 or 16 rows
//! took 4–8× the time of one. In a panel the 8 partial products of a sub-block add up in 16-bit
//! lanes (4-bit codes: at most 8 · 2 · 15 · 127 = 30 480) or 32-bit lanes (8-bit codes), one
//! `madd` turns them into the 8 outputs' exact integer dot products, and the float work is one
//! conversion, one scale product and one or two FMAs per 8 outputs: ≈ 2.7× less time per row.
//!
//! Layout of one panel sub-block (the 32 weights `n·32..n·32+32` of rows `8p..8p+8`):
//! - the 8 rows' f16 scales `d` (16 bytes), then for Q4_1 their f16 offsets `m` (16 bytes);
//!   for Q4_K the sub-block's f32 scales `d · sc` then f32 offsets `−dmin · m` (64 bytes: the
//!   products of an f16 and a 6-bit integer, exact in f32 and not in f16), so that a Q4_K
//!   sub-block runs as a Q4_1 one; for Q6_K the f32 scales `d · sc` of its first 16 weights,
//!   then of its last 16 (64 bytes);
//! - Q4_0 / Q4_1 / Q4_K: 4 × 32 bytes of codes, vector `t` holding byte `4o + e` =
//!   `v[o][8t + e] | v[o][8t + 4 + e] << 4` (the low nibbles give weights `8t..8t+4` of every
//!   row, the high nibbles `8t+4..8t+8`);
//! - Q8_0 and Q6_K: 8 × 32 bytes, vector `i` holding byte `4o + e` = `q[o][4i + e]` (Q6_K's
//!   6-bit codes `0..64` in a byte each).
//!
//! The bytes per row are the file's (18, 20 or 34 per 32 weights; Q4_K 24 where the file has 18
//! and Q6_K 40 where it has 26.25, their block heads kept aside to give back the file's
//! blocks); a last panel with fewer than 8 rows is padded with zero blocks, whose outputs are
//! never stored.
//!
//! Where the CPU has AVX-512 VNNI, the wide kernel takes two neighbouring panels at once in
//! 512-bit registers (16 outputs) and forms each sub-block's dot products with `vpdpbusd`
//! (4 unsigned × signed byte products summed into 32-bit lanes in one instruction; Q8_0's signed
//! codes read as `w + 128`, the sum starting at `−128 · Σ q_x`): ≈ 2.3× the AVX2 kernel's rate
//! per core on a Zen 5 with the panels in L1. The integer sums are exact either way, so the
//! results are the same bits.
//!
//! Arithmetic (the same on every instruction set, for every block size and row grouping, hence
//! batch-invariant): output `(j, o)` starts at 0 and, for each sub-block `n` in order, takes
//! `acc = fma(float(Σ q·q_x), d_w · d_x, acc)` with the exact integer dot product, then for
//! Q4_0 (`m = −8·d_w`), Q4_1 and Q4_K `acc = fma(m, d_x · Σ q_x, acc)`. Q6_K takes its two
//! halves in turn, each `acc = fma(float(Σ (q − 32)·q_x), d_h · d_x, acc)` with the exact
//! integer sum over the half's 16 weights.

use super::q8::{Q8Rows, half_index, sum_index};
use super::qformat::{QuantFormat, SUB, f16_at};

/// Output rows per panel.
pub(crate) const ROWS: usize = 8;

/// Most activation rows one kernel call takes: each row holds a 16-bit sum and an f32
/// accumulator in registers beside the weights, and AVX2 has 16 (at 8 rows the compiler spills;
/// 4, 6 and 8 rows measured alike on the AMD EPYC).
pub(crate) const MAX_ACTS: usize = 6;

/// One call's results: `tile[m][o]` for activation row `j + m` and panel row `o`.
pub(crate) type Tile = [[f32; ROWS]; MAX_ACTS];

/// Activation rows per call of the wide (AVX-512 VNNI) kernel: 32 registers hold each row's
/// 16 integer sums and 16 f32 accumulators beside the weights.
pub(crate) const WIDE_ACTS: usize = 8;

/// One wide call's results: `tile[m][h · 8 + o]` for activation row `j + m` and row `o` of the
/// call's panel `h` (0 or 1).
pub(crate) type WideTile = [[f32; 2 * ROWS]; WIDE_ACTS];

/// Whether products with `isa` take two panels per call with AVX-512 VNNI (`vpdpbusd` on
/// 512-bit registers: 64 multiply-adds into 16 exact 32-bit sums in one instruction, where
/// AVX2 needs `maddubs`, an add and a `madd` for 32). Same arithmetic, same bits.
pub(crate) fn wide(isa: super::Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        isa.avx512_bw_vl() && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

/// The bytes of each file block that a panel does not keep as they are (Q4_K's leading `d`,
/// `dmin` and packed 6-bit scales, Q6_K's trailing 8-bit scales and `d`; the panels hold
/// their f32 products), kept aside per block to give the file's blocks back.
pub(crate) const fn head(format: QuantFormat) -> std::ops::Range<usize> {
    match format {
        QuantFormat::Q4K => 0..16,
        QuantFormat::Q6K => 192..210,
        _ => 0..0,
    }
}

/// Bytes of [`head`].
pub(crate) const fn head_bytes(format: QuantFormat) -> usize {
    let range = head(format);
    range.end - range.start
}

/// Activation rows per kernel call for `format` (Q8_0 keeps 32-bit sums per row, Q6_K two:
/// fewer fit).
pub(crate) const fn max_acts(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q8_0 | QuantFormat::Q6K => 4,
        _ => MAX_ACTS,
    }
}

/// Bytes of scales (and offsets) at the start of a panel sub-block.
const fn header(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q4_1 => 32,
        QuantFormat::Q4K | QuantFormat::Q6K => 64,
        _ => 16,
    }
}

/// Bytes of one panel sub-block: 8 rows × the file's bytes per 32 weights (Q4_K: f32 scales
/// and offsets, then 16 bytes of codes per row; Q6_K: f32 scales of both halves, then 32
/// bytes of codes per row).
pub(crate) const fn sub_bytes(format: QuantFormat) -> usize {
    match format {
        QuantFormat::Q4K => header(format) + ROWS * 16,
        QuantFormat::Q6K => header(format) + ROWS * SUB,
        _ => ROWS * format.block_bytes(),
    }
}

/// Rows `[rows, k]` in the file's blocks (`k` a multiple of the format's block length, `data`
/// of matching length) as panels, and the file blocks' heads that the panels do not keep
/// ([`head_bytes`] per block, row-major; empty for most formats).
pub(crate) fn repack(
    format: QuantFormat,
    data: &[u8],
    rows: usize,
    k: usize,
) -> (Vec<u8>, Vec<u8>) {
    let (subs, bb, sb) = (k / SUB, format.block_bytes(), sub_bytes(format));
    let per_block = format.block_len() / SUB;
    let hb = head_bytes(format);
    let mut panels = vec![0u8; rows.div_ceil(ROWS) * subs * sb];
    let mut heads = Vec::with_capacity(rows * k / format.block_len() * hb);
    for (r, row) in data
        .chunks_exact(k / format.block_len() * bb)
        .enumerate()
        .take(rows)
    {
        let (p, o) = (r / ROWS, r % ROWS);
        for (b, block) in row.chunks_exact(bb).enumerate() {
            heads.extend_from_slice(&block[head(format)]);
            for s in 0..per_block {
                let sub = &mut panels[(p * subs + b * per_block + s) * sb..][..sb];
                match format {
                    QuantFormat::Q4K | QuantFormat::Q6K => {
                        let sc = format.scales(block, s);
                        // Q4_K: scale and offset; Q6_K: its halves' scales (the offsets are
                        // −32 × those, applied to the integer sums).
                        let second = match sc.offset {
                            super::qformat::Offset::Whole(m) => m,
                            _ => sc.scale[1],
                        };
                        sub[4 * o..4 * o + 4].copy_from_slice(&sc.scale[0].to_le_bytes());
                        sub[32 + 4 * o..32 + 4 * o + 4].copy_from_slice(&second.to_le_bytes());
                    }
                    _ => {
                        sub[2 * o..2 * o + 2].copy_from_slice(&block[..2]);
                        if format == QuantFormat::Q4_1 {
                            sub[16 + 2 * o..16 + 2 * o + 2].copy_from_slice(&block[2..4]);
                        }
                    }
                }
                let codes = &mut sub[header(format)..];
                for (i, &v) in format.values(block, s).iter().enumerate() {
                    let (at, high) = code_at(format, o, i);
                    if high {
                        codes[at] |= (v as u8) << 4;
                    } else {
                        codes[at] |= v as u8;
                    }
                }
            }
        }
    }
    (panels, heads)
}

/// The file's block `b` of row `r` (of the part), rebuilt from its panels (and for the
/// K-quants its head kept aside, `heads` as [`repack`] gave them) into `block`
/// (`format.block_bytes()` long).
pub(crate) fn file_block(
    format: QuantFormat,
    panels: &[u8],
    heads: &[u8],
    k: usize,
    r: usize,
    b: usize,
    block: &mut [u8],
) {
    let (subs, sb) = (k / SUB, sub_bytes(format));
    let per_block = format.block_len() / SUB;
    let (p, o) = (r / ROWS, r % ROWS);
    block.fill(0);
    let hb = head_bytes(format);
    if hb > 0 {
        let blocks = k / format.block_len();
        block[head(format)].copy_from_slice(&heads[(r * blocks + b) * hb..][..hb]);
    }
    for s in 0..per_block {
        let sub = &panels[(p * subs + b * per_block + s) * sb..][..sb];
        if hb == 0 {
            block[..2].copy_from_slice(&sub[2 * o..2 * o + 2]);
            if format == QuantFormat::Q4_1 {
                block[2..4].copy_from_slice(&sub[16 + 2 * o..16 + 2 * o + 2]);
            }
        }
        for i in 0..SUB {
            let v = panel_value(format, sub, o, i);
            match format {
                QuantFormat::Q8_0 => block[2 + i] = v as u8,
                // Sub-block s: the low (even s) or high nibbles of 32 bytes after the head.
                QuantFormat::Q4K => block[16 + 32 * (s / 2) + i] |= (v as u8) << (4 * (s % 2)),
                // Sub-block s = 4·half + quarter: low 4 bits in `ql`, high 2 in `qh` (as
                // `QuantFormat::values` reads them).
                QuantFormat::Q6K => {
                    let (half, quarter) = (s / 4, s % 4);
                    let v = v as u8;
                    block[64 * half + 32 * (quarter % 2) + i] |= (v & 0x0f) << (4 * (quarter / 2));
                    block[128 + 32 * half + i] |= (v >> 4) << (2 * quarter);
                }
                _ => {
                    let qs = format.block_bytes() - 16;
                    block[qs + i % 16] |= (v as u8) << (4 * (i / 16));
                }
            }
        }
    }
}

/// Where code `i` of panel row `o` lives in the codes after the header: the byte, and
/// whether it is the high nibble.
#[inline(always)]
fn code_at(format: QuantFormat, o: usize, i: usize) -> (usize, bool) {
    match format {
        QuantFormat::Q8_0 | QuantFormat::Q6K => (32 * (i / 4) + 4 * o + i % 4, false),
        _ => {
            let (t, within) = (i / 8, i % 8);
            (32 * t + 4 * o + within % 4, within >= 4)
        }
    }
}

/// Code `i` of panel row `o` in panel sub-block `sub`, as the integer the kernel multiplies.
#[inline(always)]
fn panel_value(format: QuantFormat, sub: &[u8], o: usize, i: usize) -> i32 {
    let (at, high) = code_at(format, o, i);
    let byte = sub[header(format) + at];
    match format {
        QuantFormat::Q8_0 => byte as i8 as i32,
        QuantFormat::Q6K => byte as i32,
        _ if high => (byte >> 4) as i32,
        _ => (byte & 0x0f) as i32,
    }
}

/// Scale and offset of panel row `o` in a sub-block (offset 0 for Q8_0; for Q6_K the scales
/// of its two halves).
#[inline(always)]
fn scale_offset(format: QuantFormat, sub: &[u8], o: usize) -> (f32, f32) {
    let f32_at = |at: usize| f32::from_le_bytes([sub[at], sub[at + 1], sub[at + 2], sub[at + 3]]);
    if matches!(format, QuantFormat::Q4K | QuantFormat::Q6K) {
        return (f32_at(4 * o), f32_at(32 + 4 * o));
    }
    let d = f16_at(sub, 2 * o);
    match format {
        QuantFormat::Q4_0 => (d, d * -8.0),
        QuantFormat::Q4_1 => (d, f16_at(sub, 16 + 2 * o)),
        _ => (d, 0.0),
    }
}

/// Panel `panel` (its `k / 32` sub-blocks) against activation rows `j..j + m` into
/// `tile[..m]`, with the instruction set's kernel.
///
/// # Safety
/// `isa` is supported; `format` is a panel format; `panel` holds `k / 32` sub-blocks;
/// `m ≤ max_acts(format)` and rows `j..j + m` exist in `acts`.
pub(crate) unsafe fn tile(
    isa: super::Isa,
    format: QuantFormat,
    panel: &[u8],
    acts: &Q8Rows,
    j: usize,
    m: usize,
    tile: &mut Tile,
) {
    macro_rules! rows {
        // Formats with two sums per row (Q8_0's 32-bit lanes, Q6_K's halves): 4 rows at most.
        ($kernel:ident, $f:literal, four) => {
            match m {
                4 => $kernel::<$f, 4>(panel, acts, j, tile),
                3 => $kernel::<$f, 3>(panel, acts, j, tile),
                2 => $kernel::<$f, 2>(panel, acts, j, tile),
                _ => $kernel::<$f, 1>(panel, acts, j, tile),
            }
        };
        ($kernel:ident, $f:literal) => {
            match m {
                6 => $kernel::<$f, 6>(panel, acts, j, tile),
                5 => $kernel::<$f, 5>(panel, acts, j, tile),
                4 => $kernel::<$f, 4>(panel, acts, j, tile),
                3 => $kernel::<$f, 3>(panel, acts, j, tile),
                2 => $kernel::<$f, 2>(panel, acts, j, tile),
                _ => $kernel::<$f, 1>(panel, acts, j, tile),
            }
        };
        ($kernel:ident) => {
            match format {
                QuantFormat::Q4_0 => rows!($kernel, 0),
                QuantFormat::Q4_1 => rows!($kernel, 1),
                QuantFormat::Q4K => rows!($kernel, 3),
                QuantFormat::Q6K => rows!($kernel, 4, four),
                _ => rows!($kernel, 2, four),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if isa != super::Isa::Portable {
        // SAFETY: the caller checked that the CPU has AVX2, FMA and F16C.
        unsafe { rows!(avx2_tile) };
        return;
    }
    let _ = isa;
    rows!(portable_tile);
}

/// Panels `a` and `b` (each `k / 32` sub-blocks; `b` may repeat `a` when a part has an odd
/// panel left) against activation rows `j..j + m` into `tile[..m]`, with AVX-512 VNNI.
///
/// # Safety
/// [`wide`] holds for the CPU; `format` is a panel format; `m ≤ WIDE_ACTS` and rows
/// `j..j + m` exist in `acts`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn wide_tile(
    format: QuantFormat,
    a: &[u8],
    b: &[u8],
    acts: &Q8Rows,
    j: usize,
    m: usize,
    tile: &mut WideTile,
) {
    macro_rules! rows {
        ($f:literal) => {
            match m {
                8 => x86::vnni_tile::<$f, 8>(a, b, acts, j, tile),
                7 => x86::vnni_tile::<$f, 7>(a, b, acts, j, tile),
                6 => x86::vnni_tile::<$f, 6>(a, b, acts, j, tile),
                5 => x86::vnni_tile::<$f, 5>(a, b, acts, j, tile),
                4 => x86::vnni_tile::<$f, 4>(a, b, acts, j, tile),
                3 => x86::vnni_tile::<$f, 3>(a, b, acts, j, tile),
                2 => x86::vnni_tile::<$f, 2>(a, b, acts, j, tile),
                _ => x86::vnni_tile::<$f, 1>(a, b, acts, j, tile),
            }
        };
    }
    // SAFETY: the caller checked `wide`, which implies every feature the kernel enables.
    unsafe {
        match format {
            QuantFormat::Q4_0 => rows!(0),
            QuantFormat::Q4_1 => rows!(1),
            QuantFormat::Q4K => rows!(3),
            QuantFormat::Q6K => rows!(4),
            _ => rows!(2),
        }
    }
}

/// The panel formats by index (a constant the compiler folds into each kernel instance).
const FORMATS: [QuantFormat; 5] = [
    QuantFormat::Q4_0,
    QuantFormat::Q4_1,
    QuantFormat::Q8_0,
    QuantFormat::Q4K,
    QuantFormat::Q6K,
];

/// The reference kernel: the module's arithmetic one output at a time.
fn portable_tile<const F: usize, const M: usize>(
    panel: &[u8],
    acts: &Q8Rows,
    j: usize,
    tile: &mut Tile,
) {
    let format = FORMATS[F];
    let (k, subs, sb) = (acts.k, acts.k / SUB, sub_bytes(format));
    for (m, out) in tile.iter_mut().enumerate().take(M) {
        let x = &acts.q[(j + m) * k..][..k];
        for (o, y) in out.iter_mut().enumerate() {
            let mut acc = 0f32;
            for n in 0..subs {
                let sub = &panel[n * sb..][..sb];
                if format == QuantFormat::Q6K {
                    let (a, c) = scale_offset(format, sub, o);
                    let dx = acts.d[(j + m) * subs + n];
                    for (h, scale) in [a, c].into_iter().enumerate() {
                        let dot: i32 = (16 * h..16 * h + 16)
                            .map(|i| (panel_value(format, sub, o, i) - 32) * x[n * SUB + i] as i32)
                            .sum();
                        acc = (dot as f32).mul_add(scale * dx, acc);
                    }
                    continue;
                }
                let dot: i32 = (0..SUB)
                    .map(|i| panel_value(format, sub, o, i) * x[n * SUB + i] as i32)
                    .sum();
                let (d, offset) = scale_offset(format, sub, o);
                acc = (dot as f32).mul_add(d * acts.d[(j + m) * subs + n], acc);
                if format != QuantFormat::Q8_0 {
                    acc = offset.mul_add(acts.sum[sum_index(subs, j + m, n)], acc);
                }
            }
            *y = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
use x86::avx2_tile;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{
        FORMATS, Q8Rows, QuantFormat, SUB, Tile, WideTile, half_index, header, sub_bytes, sum_index,
    };
    use std::arch::x86_64::*;

    /// How far ahead of the sub-block being read the kernel prefetches, in bytes (a task's
    /// panels are one sequential stream).
    const PREFETCH: usize = 1536;

    /// How far ahead the wide kernel prefetches, in bytes, into L2: its two panels are
    /// neighbours, so a call reads one stream twice as fast as the AVX2 kernel, and 1536 bytes
    /// ahead into L1 left a core waiting on memory (one row: 19-24 GB/s of a measured 35-63).
    /// Prefetching 8 KiB ahead (the latency of memory at a core's share of the bandwidth) into
    /// L2 took one forward of SmolLM2's Q4_1 layers alone from 3.3 to 2.2 ms for one row, and the
    /// whole model from 5.1 to 3.6 ms (1 row), 7.9 to 6.4 ms (8 rows) on a Zen 4 EPYC VM (plateau
    /// from 6 to 16 KiB; the L1 prefetchers take it from L2 on).
    const WIDE_PREFETCH: usize = 8192;

    /// The 4 codes `x[at..at + 4]` of an activation row in every 32-bit lane.
    #[inline(always)]
    unsafe fn four(x: *const i8, at: usize) -> __m256i {
        unsafe { _mm256_set1_epi32(x.add(at).cast::<i32>().read_unaligned()) }
    }

    /// AVX2 kernel for `M` activation rows (see the module's arithmetic).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; as [`super::tile`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)]
    pub(super) unsafe fn avx2_tile<const F: usize, const M: usize>(
        panel: &[u8],
        acts: &Q8Rows,
        j: usize,
        tile: &mut Tile,
    ) {
        let format = FORMATS[F];
        let (k, subs, sb) = (acts.k, acts.k / SUB, sub_bytes(format));
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let low4 = _mm256_set1_epi8(0x0f);
            let mut acc = [_mm256_setzero_ps(); M];
            let xq = acts.q.as_ptr().add(j * k);
            let dx = acts.d.as_ptr().add(j * subs);
            let (sums, biases) = (acts.sum.as_ptr(), acts.half_bias.as_ptr());
            for n in 0..subs {
                let sub = panel.as_ptr().add(n * sb);
                let ahead = sub.wrapping_add(PREFETCH);
                for line in 0..sb.div_ceil(64) {
                    // Prefetches never fault, past the end included.
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast());
                }
                let codes = sub.add(header(format));
                let x0 = n * SUB;
                if format == QuantFormat::Q6K {
                    // Each half of 16 weights from its bias (−32 · Σ q_x) on: the exact
                    // Σ (q − 32) · q_x, then scaled by the half's own scale.
                    let mut halves = [[_mm256_setzero_si256(); M]; 2];
                    for half in 0..2 {
                        for m in 0..M {
                            let at = half_index(subs, j + m, n, half);
                            halves[half][m] = _mm256_set1_epi32(*biases.add(at));
                        }
                        for i in 4 * half..4 * half + 4 {
                            let w = _mm256_loadu_si256(codes.add(32 * i).cast());
                            for m in 0..M {
                                let pairs = _mm256_maddubs_epi16(w, four(xq, m * k + x0 + 4 * i));
                                let quads = _mm256_madd_epi16(pairs, ones);
                                halves[half][m] = _mm256_add_epi32(halves[half][m], quads);
                            }
                        }
                    }
                    for (half, at) in [0usize, 32].into_iter().enumerate() {
                        let d = _mm256_loadu_ps(sub.add(at).cast());
                        for m in 0..M {
                            let scale =
                                _mm256_mul_ps(d, _mm256_broadcast_ss(&*dx.add(m * subs + n)));
                            let sum = _mm256_cvtepi32_ps(halves[half][m]);
                            acc[m] = _mm256_fmadd_ps(sum, scale, acc[m]);
                        }
                    }
                    continue;
                }
                // Exact integer dot products, one 32-bit lane per panel row.
                let mut dots = [_mm256_setzero_si256(); M];
                if format == QuantFormat::Q8_0 {
                    for i in 0..8 {
                        let w = _mm256_loadu_si256(codes.add(32 * i).cast());
                        let abs = _mm256_sign_epi8(w, w);
                        for m in 0..M {
                            let x = _mm256_sign_epi8(four(xq, m * k + x0 + 4 * i), w);
                            let pairs = _mm256_maddubs_epi16(abs, x);
                            let quads = _mm256_madd_epi16(pairs, ones);
                            dots[m] = _mm256_add_epi32(dots[m], quads);
                        }
                    }
                } else {
                    // 16-bit sums of the 4 vectors (at most 30 480), widened once.
                    let mut sums = [_mm256_setzero_si256(); M];
                    for t in 0..4 {
                        let packed = _mm256_loadu_si256(codes.add(32 * t).cast());
                        let lo = _mm256_and_si256(packed, low4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(packed), low4);
                        for m in 0..M {
                            let x = xq.add(m * k);
                            let p = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, four(x, x0 + 8 * t)),
                                _mm256_maddubs_epi16(hi, four(x, x0 + 8 * t + 4)),
                            );
                            sums[m] = if t == 0 {
                                p
                            } else {
                                _mm256_add_epi16(sums[m], p)
                            };
                        }
                    }
                    for m in 0..M {
                        dots[m] = _mm256_madd_epi16(sums[m], ones);
                    }
                }
                let d = match format {
                    QuantFormat::Q4K => _mm256_loadu_ps(sub.cast()),
                    _ => _mm256_cvtph_ps(_mm_loadu_si128(sub.cast())),
                };
                let offset = match format {
                    QuantFormat::Q4_0 => Some(_mm256_mul_ps(d, _mm256_set1_ps(-8.0))),
                    QuantFormat::Q4_1 => Some(_mm256_cvtph_ps(_mm_loadu_si128(sub.add(16).cast()))),
                    QuantFormat::Q4K => Some(_mm256_loadu_ps(sub.add(32).cast())),
                    _ => None,
                };
                for m in 0..M {
                    let scale = _mm256_mul_ps(d, _mm256_broadcast_ss(&*dx.add(m * subs + n)));
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[m]), scale, acc[m]);
                    if let Some(offset) = offset {
                        let sx = _mm256_broadcast_ss(&*sums.add(sum_index(subs, j + m, n)));
                        acc[m] = _mm256_fmadd_ps(offset, sx, acc[m]);
                    }
                }
            }
            for m in 0..M {
                _mm256_storeu_ps(tile[m].as_mut_ptr(), acc[m]);
            }
        }
    }

    /// The 4 codes `x[at..at + 4]` of an activation row in every 32-bit lane of 512 bits.
    #[inline(always)]
    unsafe fn four_wide(x: *const i8, at: usize) -> __m512i {
        unsafe { _mm512_set1_epi32(x.add(at).cast::<i32>().read_unaligned()) }
    }

    /// 32 bytes of panel `a` then 32 of panel `b`, from offset `at` of their sub-blocks.
    #[inline(always)]
    unsafe fn join(a: *const u8, b: *const u8, at: usize) -> __m512i {
        unsafe {
            let low = _mm512_castsi256_si512(_mm256_loadu_si256(a.add(at).cast()));
            _mm512_inserti64x4::<1>(low, _mm256_loadu_si256(b.add(at).cast()))
        }
    }

    /// The 8 f16 values at offset `at` of panel `a`'s sub-block, then panel `b`'s, as f32.
    #[inline(always)]
    unsafe fn join_f16(a: *const u8, b: *const u8, at: usize) -> __m512 {
        unsafe {
            let low = _mm256_castsi128_si256(_mm_loadu_si128(a.add(at).cast()));
            let both = _mm256_inserti128_si256::<1>(low, _mm_loadu_si128(b.add(at).cast()));
            _mm512_cvtph_ps(both)
        }
    }

    /// The 8 f32 values at offset `at` of panel `a`'s sub-block, then panel `b`'s.
    #[inline(always)]
    unsafe fn join_f32(a: *const u8, b: *const u8, at: usize) -> __m512 {
        unsafe {
            let low = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a.add(at).cast())));
            let high = _mm256_castps_pd(_mm256_loadu_ps(b.add(at).cast()));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(low, high))
        }
    }

    /// AVX-512 VNNI kernel for `M` activation rows against two panels: the 16 outputs' exact
    /// integer dot products by `vpdpbusd` (unsigned weights × signed activations; Q8_0's
    /// signed weights read as `w + 128`, the sum starting at `−128 · Σ q_x`), then the module's
    /// float arithmetic, lane for lane as [`avx2_tile`].
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; as [`super::wide_tile`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)]
    pub(super) unsafe fn vnni_tile<const F: usize, const M: usize>(
        a: &[u8],
        b: &[u8],
        acts: &Q8Rows,
        j: usize,
        tile: &mut WideTile,
    ) {
        let format = FORMATS[F];
        let (k, subs, sb) = (acts.k, acts.k / SUB, sub_bytes(format));
        unsafe {
            let low4 = _mm512_set1_epi8(0x0f);
            let flip = _mm512_set1_epi8(i8::MIN);
            let mut acc = [_mm512_setzero_ps(); M];
            let xq = acts.q.as_ptr().add(j * k);
            let dx = acts.d.as_ptr().add(j * subs);
            let (sums, biases) = (acts.sum.as_ptr(), acts.half_bias.as_ptr());
            let int_sums = acts.int_sum.as_ptr();
            let h = header(format);
            for n in 0..subs {
                let (sa, sb_) = (a.as_ptr().add(n * sb), b.as_ptr().add(n * sb));
                for line in 0..sb.div_ceil(64) {
                    // Prefetches never fault, past the end included.
                    _mm_prefetch::<_MM_HINT_T1>(sa.wrapping_add(WIDE_PREFETCH + 64 * line).cast());
                    _mm_prefetch::<_MM_HINT_T1>(sb_.wrapping_add(WIDE_PREFETCH + 64 * line).cast());
                }
                let x0 = n * SUB;
                if format == QuantFormat::Q6K {
                    // As the AVX2 kernel: each half from its bias on, scaled on its own.
                    let mut halves = [[_mm512_setzero_si512(); M]; 2];
                    for half in 0..2 {
                        for m in 0..M {
                            let at = half_index(subs, j + m, n, half);
                            halves[half][m] = _mm512_set1_epi32(*biases.add(at));
                        }
                        for i in 4 * half..4 * half + 4 {
                            let w = join(sa, sb_, h + 32 * i);
                            for m in 0..M {
                                let x = four_wide(xq, m * k + x0 + 4 * i);
                                halves[half][m] = _mm512_dpbusd_epi32(halves[half][m], w, x);
                            }
                        }
                    }
                    for (half, at) in [0usize, 32].into_iter().enumerate() {
                        let d = join_f32(sa, sb_, at);
                        for m in 0..M {
                            let scale = _mm512_mul_ps(d, _mm512_set1_ps(*dx.add(m * subs + n)));
                            let sum = _mm512_cvtepi32_ps(halves[half][m]);
                            acc[m] = _mm512_fmadd_ps(sum, scale, acc[m]);
                        }
                    }
                    continue;
                }
                let mut dots = [_mm512_setzero_si512(); M];
                if format == QuantFormat::Q8_0 {
                    for m in 0..M {
                        let sum = *int_sums.add(sum_index(subs, j + m, n));
                        dots[m] = _mm512_set1_epi32(-128 * sum);
                    }
                    for i in 0..8 {
                        let w = _mm512_xor_si512(join(sa, sb_, h + 32 * i), flip);
                        for m in 0..M {
                            let x = four_wide(xq, m * k + x0 + 4 * i);
                            dots[m] = _mm512_dpbusd_epi32(dots[m], w, x);
                        }
                    }
                } else {
                    // Two chains per row (low and high nibbles), added at the end: exact
                    // integers, so the same sums. One chain of 8 `vpdpbusd` (latency 5) per
                    // row left the core waiting on it: the compiler orders the tile row by
                    // row, and 10 chains must be in flight to fill two ports (Q4_1 tile in
                    // cache, one thread, Xeon with VNNI: 0.39 → 0.44 of the int8 peak;
                    // Q8_0's chain split the same way gained nothing).
                    let mut highs = [_mm512_setzero_si512(); M];
                    for t in 0..4 {
                        let packed = join(sa, sb_, h + 32 * t);
                        let lo = _mm512_and_si512(packed, low4);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(packed), low4);
                        for m in 0..M {
                            let x = xq.add(m * k);
                            dots[m] = _mm512_dpbusd_epi32(dots[m], lo, four_wide(x, x0 + 8 * t));
                            highs[m] =
                                _mm512_dpbusd_epi32(highs[m], hi, four_wide(x, x0 + 8 * t + 4));
                        }
                    }
                    for m in 0..M {
                        dots[m] = _mm512_add_epi32(dots[m], highs[m]);
                    }
                }
                let d = match format {
                    QuantFormat::Q4K => join_f32(sa, sb_, 0),
                    _ => join_f16(sa, sb_, 0),
                };
                let offset = match format {
                    QuantFormat::Q4_0 => Some(_mm512_mul_ps(d, _mm512_set1_ps(-8.0))),
                    QuantFormat::Q4_1 => Some(join_f16(sa, sb_, 16)),
                    QuantFormat::Q4K => Some(join_f32(sa, sb_, 32)),
                    _ => None,
                };
                for m in 0..M {
                    let scale = _mm512_mul_ps(d, _mm512_set1_ps(*dx.add(m * subs + n)));
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[m]), scale, acc[m]);
                    if let Some(offset) = offset {
                        let sx = _mm512_set1_ps(*sums.add(sum_index(subs, j + m, n)));
                        acc[m] = _mm512_fmadd_ps(offset, sx, acc[m]);
                    }
                }
            }
            for m in 0..M {
                _mm512_storeu_ps(tile[m].as_mut_ptr(), acc[m]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::qformat::test_blocks;

    #[test]
    fn panels_give_back_the_file_blocks() {
        for format in QuantFormat::ALL {
            let (rows, k) = (13, 3 * format.block_len());
            let blocks = k / format.block_len();
            let data = test_blocks(format, rows * blocks, 4);
            let (panels, heads) = repack(format, &data, rows, k);
            assert_eq!(panels.len(), 2 * (k / SUB) * sub_bytes(format));
            assert_eq!(heads.len(), rows * blocks * head_bytes(format));
            let bb = format.block_bytes();
            let mut block = vec![0u8; bb];
            for r in 0..rows {
                for b in 0..blocks {
                    file_block(format, &panels, &heads, k, r, b, &mut block);
                    assert_eq!(
                        block,
                        data[(r * blocks + b) * bb..][..bb],
                        "{format} {r} {b}"
                    );
                }
            }
        }
    }
}
