//! `y = x · wᵀ` for a block of f32 activation rows `x: [b, k]` against a weight matrix
//! `w: [out, k]` held as a [`PackedMatrix`] of f32, f16 or bf16; f32 results `y: [b, out]`.
//!
//! Why this shape: decoding streams every weight once per forward pass, so the kernel is built
//! around the weights. A register tile covers `M` activation rows × 16 or 32 outputs (one or two
//! panels): per step of the inner dimension it loads the panel's 16 weights as vectors once and
//! broadcasts each row's activation value against them, so `M` rows share every weight load.
//! One row is then bound by memory bandwidth, and a block of many by the FMA units: the
//! roofline. (A dot-product form, vectorised along `k` on the `[out, k]` rows, needs a vector
//! load of both operands per multiply-add and stalls on the L2 cache at ~65% of the FMA peak.)
//!
//! Batch invariance: every output element is one chain of fused multiply-adds over `i = 0..k`
//! in order, starting from zero, in a single lane. Nothing in that chain depends on the block
//! size, the tile shape, the thread, the task split or even the instruction set, so a block of
//! rows gives bit-identical results to its rows one at a time (verification agrees exactly with
//! plain decoding), on AVX2, AVX-512 and the portable path alike.

use super::isa::Isa;
use super::l1::l1_data_bytes;
use super::lanes::{Lanes, Soft, WeightElement};
use super::line::{LINE, LINE_FLOATS, to_line};

use super::packed::{PANEL, PackedMatrix};
use super::pool::Pool;

/// Activation rows per pass over the weights: a pass keeps its rows (`rows · k · 4` bytes) in
/// the L2 cache while the weights stream through once. Larger blocks (prefill) take several
/// passes.
const X_BYTES_PER_PASS: usize = 256 * 1024;

/// At most this many activation rows per pass (bounds the partial-sum scratch on the stack).
const MAX_PASS_ROWS: usize = 96;

/// Steps of the inner dimension per chunk: a chunk of one or two panels (8 or 16 KiB in f32)
/// stays in L1 while every row group of the pass uses it, and the next chunk is prefetched
/// meanwhile, spread over all row groups so that memory stays busy while the FMAs run: into
/// L1 where both chunks and a row group's activations fit there, else into L2 (two 16 KiB
/// chunks on a 32 KiB L1 evicted the chunk being read: 8 f32 rows took ≈ 18.5 ms there with
/// L1 prefetches, ≈ 16.5 ms with L2 ones; docs/results.md).
const CHUNK: usize = 128;

/// How many cache lines of each panel ahead of its reads a pass of one row group asks for
/// into L1 ([`NEAR_LINES`]) and into L2 ([`FAR_LINES`]), continuing into the next panels of
/// its range at a panel's end. This replaces, for such passes, the next chunk's prefetches
/// (128 lines ahead in f32): a prefetch into L1 that has to go to memory holds one of the
/// core's few line-fill buffers until its line arrives, and so many of them, that far ahead,
/// held one f32 row's stream at ≈ 30 GB/s on a 2-core Intel Xeon (model 167) that reads 36-37
/// GB/s. Near L1 prefetches find their lines on the way into L2 and free their buffers soon
/// (`matmul_cost --outs 1536,49152 --rows 1,4,8 --mb 1600`, alternated twice: one row over
/// the LM head 3.48-3.54 → 2.91-3.02 ms (39 GB/s), 1,536 outputs 123-124 → 110-112 µs, 4
/// rows −7-10%, 8 rows −2-5%; AVX2 1 and 4 rows −9-15%; 12/32, 24/48 and 32/64 lines
/// alike, 192 steps into L2 as before slower; docs/results.md). Passes of several groups keep
/// the next chunk's prefetches spread over their groups: there the first group's far
/// prefetches held the cores back (the same Xeon, `matmul_cost --outs 1536 --mb 800`: 16 rows
/// 184 → 158 µs, 32 rows 267 → 231 µs without them), and near ones from the first group
/// too (16 and 32 rows +10-15%).
const NEAR_LINES: usize = 16;

/// See [`NEAR_LINES`].
const FAR_LINES: usize = 48;

/// Blocks of at most this many rows with 16-bit weights take four panels at a time on
/// AVX-512 (6 rows × 4 panels = 24 accumulators + 4 weight registers + a broadcast of 32). A
/// step over two 16-bit panels reads one cache line where f32 reads two, for the same work per
/// step (the broadcasts, the prefetch schedule, two FMA chains a row): on a 2-core Zen 4 EPYC
/// one f16 row streamed its layers at ≈ 28 GB/s where f32 reached ≈ 38. Four panels per step,
/// in the model (`block_cost`, alternated in one process, six runs): f16 one row −10–16% in
/// five (10.0 → 8.5 ms), −2% in one; 2–4 rows −3–16%, 5–6 rows −4–7%, bf16 0–18%; f32 level,
/// so it keeps two. (AVX2, whose registers hold half a panel, gained nothing from four: its
/// step already has 4 chains a row.)
const WIDE_ROWS: usize = 6;

/// Passes of at most this many rows per byte of a weight (24 in f32, 12 in f16/bf16: where
/// the product is bound by the weight stream more than by the FMAs) store their finished sums
/// past the caches (see [`Sums`]). Beyond, the products are bound by the FMAs, and the sums'
/// readers found them in memory instead of the caches: f16 and bf16 blocks of 16-64 rows took
/// 2-7% longer with them (`block_cost`, alternated twice).
const STREAM_ROWS_PER_WEIGHT_BYTE: usize = 6;

/// Floats in the partial-sum scratch of a pass: `MAX_PASS_ROWS` rows of two panels, or
/// [`WIDE_ROWS`] rows of four.
const SCRATCH: usize = MAX_PASS_ROWS * 2 * PANEL;
const _: () = assert!(WIDE_ROWS * 4 * PANEL <= SCRATCH);

/// Inconsistent operand sizes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// A row-major weight buffer that is not `out · k` long.
    #[error("weights: {len} values for a [{out}, {k}] matrix")]
    Weights {
        /// Values given.
        len: usize,
        /// Output rows.
        out: usize,
        /// Inner dimension.
        k: usize,
    },
    /// Activations or results that do not match the matrix.
    #[error(
        "matmul: x has {x} values and y {y} for a [{out}, {k}] matrix (need x = b·{k}, y = b·{out})"
    )]
    Operands {
        /// Length of `x`.
        x: usize,
        /// Length of `y`.
        y: usize,
        /// Output rows of the matrix.
        out: usize,
        /// Inner dimension.
        k: usize,
    },
}

impl<E: WeightElement> PackedMatrix<E> {
    /// `y[j·out + o] = Σ_i x[j·k + i] · w[o, i]` on the process-wide [`Pool`] with the detected
    /// [`Isa`].
    pub fn matmul(&self, x: &[f32], y: &mut [f32]) -> Result<(), ShapeError> {
        self.matmul_with(Isa::detect(), Pool::global(), x, y)
    }

    /// [`PackedMatrix::matmul`] into a new vector `[b, out]` (never zero-filled: the kernel
    /// writes every element).
    pub fn matmul_to_vec(&self, x: &[f32]) -> Result<Vec<f32>, ShapeError> {
        let b = x.len() / self.k();
        let len = b * self.out();
        // The product goes to the first 64-byte boundary in the vector, where its rows take
        // whole-line stores past the caches (see `Sums`), and then moves to its start.
        let mut y: Vec<f32> = Vec::with_capacity(len + LINE_FLOATS);
        let off = to_line(y.as_ptr());
        // SAFETY: `y` has room for `off + len` values; the kernel writes all `len` of them at
        // `off`, and they are moved to the start before `set_len`.
        unsafe {
            self.matmul_raw(
                Isa::detect(),
                Pool::global(),
                x,
                y.as_mut_ptr().add(off),
                len,
            )?;
            if off > 0 {
                std::ptr::copy(y.as_ptr().add(off), y.as_mut_ptr(), len);
            }
            y.set_len(len);
        }
        Ok(y)
    }

    /// [`PackedMatrix::matmul`] with an explicit instruction set and pool. An `isa` this CPU
    /// lacks falls back to the best one it has (the results are the same).
    pub fn matmul_with(
        &self,
        isa: Isa,
        pool: &Pool,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), ShapeError> {
        // SAFETY: `y` is a valid buffer of its length.
        unsafe { self.matmul_raw(isa, pool, x, y.as_mut_ptr(), y.len()) }
    }

    /// The product into `y_len` floats at `y` (written, never read).
    ///
    /// # Safety
    /// `y` is valid for `y_len` writes.
    unsafe fn matmul_raw(
        &self,
        isa: Isa,
        pool: &Pool,
        x: &[f32],
        y: *mut f32,
        y_len: usize,
    ) -> Result<(), ShapeError> {
        let (out, k) = (self.out(), self.k());
        let b = x.len() / k;
        if !x.len().is_multiple_of(k) || b.checked_mul(out) != Some(y_len) {
            return Err(ShapeError::Operands {
                x: x.len(),
                y: y_len,
                out,
                k,
            });
        }
        if b == 0 {
            return Ok(());
        }
        let isa = isa.supported();
        let problem = Problem {
            w: self.data().as_ptr(),
            x: x.as_ptr(),
            y,
            k,
            b,
            out,
        };
        let panels = out.div_ceil(PANEL);
        // Two panels per scheduling unit (an AVX-512 tile); a range's panels stream (and
        // prefetch) as one run ([`Pool::run_product`]).
        pool.run_product(out, panels.div_ceil(2), &|units| {
            let (p0, p1) = (units.start * 2, (units.end * 2).min(panels));
            // SAFETY: the sizes were checked above; tasks write disjoint output columns.
            unsafe { panels_for(isa, &problem, p0, p1) }
        });
        Ok(())
    }
}

/// The operands of one product, shared by its tasks.
struct Problem<E> {
    w: *const E,
    x: *const f32,
    y: *mut f32,
    k: usize,
    b: usize,
    out: usize,
}

// SAFETY: tasks read `w` and `x` and write disjoint parts of `y`.
unsafe impl<E> Sync for Problem<E> {}

/// Panels `p0..p1` against every activation row with `isa`'s kernel.
///
/// # Safety
/// `p` describes valid buffers and `isa` is supported by this CPU.
unsafe fn panels_for<E: WeightElement>(isa: Isa, p: &Problem<E>, p0: usize, p1: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::panels_avx512(p, p0, p1) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::panels_avx2(p, p0, p1) },
        _ => unsafe { panels::<Soft<8>, E, 6, 1>(p, p0, p1) },
    }
    // The task's non-temporal stores (see [`Sums`]) reach memory before the pool reports it
    // done: they are not ordered by the pool's release.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Panels `p0..p1`, `P` at a time, against activation rows in groups of at most `M`.
///
/// # Safety
/// As [`panels_for`], with `V`'s instructions supported.
#[inline(always)]
unsafe fn panels<V: Lanes, E: WeightElement, const M: usize, const P: usize>(
    p: &Problem<E>,
    p0: usize,
    p1: usize,
) {
    let pass = (X_BYTES_PER_PASS / (4 * p.k)).clamp(M, MAX_PASS_ROWS);
    let mut j0 = 0;
    while j0 < p.b {
        let j1 = (j0 + pass).min(p.b);
        let mut q = p0;
        unsafe {
            // One or two rows against one panel are 2-4 FMA chains, too few to hide the FMA
            // latency (decoding f16 was bound by it): take two panels at a time instead.
            if P == 1 && j1 - j0 <= 2 && V::WIDTH < PANEL {
                panel_runs::<V, E, 2, 2>(p, &mut q, j0, j1, p1);
            }
            // A few rows of 16-bit weights in 512-bit registers: four panels per step.
            if P == 2 && j1 - j0 <= WIDE_ROWS && V::WIDTH == PANEL && size_of::<E>() == 2 {
                panel_runs::<V, E, WIDE_ROWS, 4>(p, &mut q, j0, j1, p1);
            }
            panel_runs::<V, E, M, P>(p, &mut q, j0, j1, p1);
            panel_runs::<V, E, M, 1>(p, &mut q, j0, j1, p1);
        }
        j0 = j1;
    }
}

/// Panels from `*q`, `P` at a time while `P` of them remain before `end`, against activation
/// rows `j0..j1` in groups of at most `M`; `*q` is left at the first panel not taken.
///
/// # Safety
/// As [`panel_rows`].
#[inline(always)]
unsafe fn panel_runs<V: Lanes, E: WeightElement, const M: usize, const P: usize>(
    p: &Problem<E>,
    q: &mut usize,
    j0: usize,
    j1: usize,
    end: usize,
) {
    while *q + P <= end {
        unsafe { panel_rows::<V, E, M, P>(p, *q, j0, j1, end) };
        *q += P;
    }
}

/// `rows` activation rows split into `⌈rows / most⌉` consecutive groups as evenly as
/// possible (8 rows by at most 6: 4 + 4, not 6 + 2), as ranges of rows in order. Every block
/// kernel tiles its rows this way.
pub(crate) fn row_groups(
    rows: usize,
    most: usize,
) -> impl ExactSizeIterator<Item = std::ops::Range<usize>> + Clone {
    let groups = rows.div_ceil(most);
    let (base, extra) = (rows / groups.max(1), rows % groups.max(1));
    (0..groups).map(move |g| {
        let start = g * base + g.min(extra);
        start..start + base + usize::from(g < extra)
    })
}

/// `P` panels from `q` against activation rows `j0..j1`: the inner dimension in chunks of
/// [`CHUNK`], each chunk against every row group, partial sums kept exactly (f32) in a scratch
/// tile between chunks. `end` is the first panel not to prefetch.
///
/// Rows are split into groups by [`row_groups`]: a group of few rows has too few independent
/// FMA chains to hide the FMA latency.
///
/// # Safety
/// As [`panels`], with `q + P ≤ end` panels, `j1 - j0 ≤ MAX_PASS_ROWS` and
/// `(j1 - j0) · P · PANEL ≤ SCRATCH`.
#[inline(always)]
unsafe fn panel_rows<V: Lanes, E: WeightElement, const M: usize, const P: usize>(
    p: &Problem<E>,
    q: usize,
    j0: usize,
    j1: usize,
    end: usize,
) {
    let k = p.k;
    let rows = j1 - j0;
    let groups = row_groups(rows, M);
    // Partial sums between chunks (every row written by the first chunk before it is read).
    // Rows of `P · PANEL` floats.
    let mut scratch = std::mem::MaybeUninit::<[f32; SCRATCH]>::uninit();
    let scratch = scratch.as_mut_ptr().cast::<f32>();
    let cols = P * PANEL;
    debug_assert!(rows * cols <= SCRATCH);
    // The last chunk's sums go straight to `y` when the tile's panels hold only real outputs
    // (the last panel of a matrix may be padded).
    let col0 = q * PANEL;
    let valid = (p.out - col0).min(P * PANEL);
    let direct = valid == P * PANEL;
    // Past the caches when every row's registers in the output are whole lines.
    let stream = rows <= STREAM_ROWS_PER_WEIGHT_BYTE * size_of::<E>()
        && (p.y as usize).is_multiple_of(LINE)
        && (p.out * size_of::<f32>()).is_multiple_of(LINE);
    // The bytes after this tile's chunk: the rest of the panel(s), then the next panels.
    let chunk_lines = (CHUNK * PANEL * size_of::<E>()).div_ceil(LINE);
    let footprint = 2 * P * chunk_lines * LINE + rows.min(M) * CHUNK * size_of::<f32>();
    let to_l2 = footprint > l1_data_bytes();
    let next_panels = end.min(q + 2 * P) - q;
    let count = groups.len();
    unsafe {
        let w = p.w.add(q * k * PANEL);
        let mut i0 = 0;
        while i0 < k {
            let i1 = (i0 + CHUNK).min(k);
            // Prefetch the next chunk's lines (of each of the P panels, or of the next panels
            // after the last chunk), spread evenly over the row groups.
            // (Pointers past the matrix are only formed, with wrapping arithmetic; the tile
            // prefetches the first P.)
            let next: [*const E; 4] = if i1 < k {
                std::array::from_fn(|pp| w.wrapping_add(pp * k * PANEL + i1 * PANEL))
            } else if next_panels > P {
                std::array::from_fn(|pp| w.wrapping_add((P + pp) * k * PANEL))
            } else {
                [std::ptr::null(); 4]
            };
            for (g, group) in groups.clone().enumerate() {
                let (j, m) = (j0 + group.start, group.len());
                let ahead = count == 1;
                let pf = Prefetch {
                    next,
                    first: g * chunk_lines / count,
                    lines: match ahead {
                        true => 0,
                        false => (g + 1) * chunk_lines / count - g * chunk_lines / count,
                    },
                    steps: i1 - i0,
                    to_l2,
                    panels_after: next_panels - P,
                };
                let sums = scratch.add((j - j0) * cols);
                let dst = match direct && i1 == k {
                    true => Sums {
                        at: p.y.add(j * p.out + col0),
                        stride: p.out,
                        stream,
                    },
                    false => Sums {
                        at: sums,
                        stride: cols,
                        stream: false,
                    },
                };
                macro_rules! tile_of {
                    ($($r:literal)*) => {
                        match (m, ahead) {
                            $(
                                ($r, true) if $r <= M => {
                                    tile::<V, E, $r, P, true>(p, w, j, i0, i1, sums, dst, &pf)
                                }
                                ($r, false) if $r <= M => {
                                    tile::<V, E, $r, P, false>(p, w, j, i0, i1, sums, dst, &pf)
                                }
                            )*
                            _ => {}
                        }
                    };
                }
                tile_of!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16);
            }
            i0 = i1;
        }
        // Copy the finished sums of a padded panel.
        if !direct {
            for r in 0..rows {
                let row = scratch.add(r * cols);
                std::ptr::copy_nonoverlapping(row, p.y.add((j0 + r) * p.out + col0), valid);
            }
        }
    }
}

/// Where a tile stores its sums: `M` rows of `stride` floats from `at`; `stream`: the
/// finished sums in the product's output, whose rows' registers are whole lines, stored past
/// the caches (non-temporal).
///
/// Why: each finished tile writes a line or two in each of its rows, and the rows of an output
/// lie a page or more apart. Stored as usual, every such line is first read from memory and
/// the reads hold the core's line-fill buffers, which the weight stream needs: on a 2-core
/// Xeon (model 167) an output of 49,152 columns cost 8 rows 3.65-3.74 ms where one row took
/// 2.95, and 2.82-2.93 ms stored past the caches (`matmul_cost --outs 49152 --rows 8 --mb
/// 1600`; 16 rows 4.46-4.59 → 3.74-3.78 ms; docs/results.md). A C probe of a 12-row tile
/// streaming its weights ran at the stream's speed alone, 50% slower with its sums stored
/// into such an output, 2-7% slower with them stored past the caches.
#[derive(Clone, Copy)]
struct Sums {
    at: *mut f32,
    stride: usize,
    stream: bool,
}

/// The prefetches one row group issues during one chunk: `lines` cache lines from line
/// `first` of each of the first `P` areas in `next` (the next chunk), spread over `steps`
/// steps, into L1 or (`to_l2`) into L2 only; or, in a tile that streams ahead (the pass's
/// only group, which then has no `lines`), each panel's line [`NEAR_LINES`] ahead of the step
/// into L1 and [`FAR_LINES`] ahead into L2, past a panel's end into the panel `P` further on
/// while that is one of the `panels_after` this tile's panels in the task's range.
struct Prefetch<E> {
    next: [*const E; 4],
    first: usize,
    lines: usize,
    steps: usize,
    to_l2: bool,
    panels_after: usize,
}

/// Step `s` of panel `pp` of the tile whose `P` panels of `k` steps start at `w`, where `s`
/// may pass the panel's end: then the same step of panel `pp + P` less `k`, if that is one of
/// the `panels_after` panels after the tile in its task's range. Formed with wrapping
/// arithmetic, for prefetches only.
#[inline(always)]
fn stream_at<E, const P: usize>(
    w: *const E,
    k: usize,
    pp: usize,
    s: usize,
    panels_after: usize,
) -> Option<*const E> {
    match s < k {
        true => Some(w.wrapping_add((pp * k + s) * PANEL)),
        false => (pp < panels_after).then(|| w.wrapping_add(((pp + P) * k + s - k) * PANEL)),
    }
}

/// Continues the `M × (P·16)` sums of activation rows `j..j+M` with panels at `w` over steps
/// `i0..i1` (from zero at `i0 = 0`, else from `acc_rows`: rows of `P · PANEL` floats) and
/// stores them to `dst`. `AHEAD`: the pass's only group, which streams its panels ahead (see
/// [`Prefetch`]); a constant, so that the step loop of several groups carries no test of it.
///
/// # Safety
/// As [`panels`], with `j + M ≤ b`, `i1 ≤ k`, `acc_rows` and `dst` holding `M` rows, and `P`
/// panels at `w`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<V: Lanes, E: WeightElement, const M: usize, const P: usize, const AHEAD: bool>(
    p: &Problem<E>,
    w: *const E,
    j: usize,
    i0: usize,
    i1: usize,
    acc_rows: *const f32,
    dst: Sums,
    pf: &Prefetch<E>,
) {
    let k = p.k;
    // Vectors per panel row; the tile holds P panels × `per` vectors per activation row.
    let per = PANEL / V::WIDTH;
    let vecs = P * per;
    debug_assert!(vecs <= 4);
    unsafe {
        let x = p.x.add(j * k);
        // One base pointer per row: a broadcast is then one addressing mode, no arithmetic
        // (≈ 2-7% on AVX2's 6-row tile). Made opaque to the optimiser, which would otherwise
        // rebuild each from the first; not for AVX-512's 12 rows, which would run out of
        // general registers.
        let xs: [*const f32; M] = std::array::from_fn(|m| x.add(m * k));
        let xs = if M <= 8 { std::hint::black_box(xs) } else { xs };
        let mut acc = [[V::zero(); 4]; M];
        if i0 > 0 {
            for (m, acc_m) in acc.iter_mut().enumerate() {
                for (c, a) in acc_m.iter_mut().enumerate().take(vecs) {
                    *a = V::load(acc_rows.add(m * P * PANEL + c * V::WIDTH));
                }
            }
        }
        // Prefetch schedule: one line every `every` steps.
        let every = if pf.lines == 0 || pf.next[0].is_null() {
            usize::MAX
        } else {
            (pf.steps / pf.lines).max(1)
        };
        let (mut countdown, mut line) = (every, pf.first);
        // Steps per cache line of a panel (1 in f32, 2 in f16/bf16).
        let steps_per_line = (LINE / (PANEL * size_of::<E>())).max(1);
        for i in i0..i1 {
            if AHEAD && i % steps_per_line == 0 {
                for pp in 0..P {
                    // Pointers past the matrix are only formed (wrapping), never dereferenced;
                    // prefetches do not fault.
                    let near = i + NEAR_LINES * steps_per_line;
                    if let Some(at) = stream_at::<E, P>(w, k, pp, near, pf.panels_after) {
                        V::prefetch(at.cast());
                    }
                    let far = i + FAR_LINES * steps_per_line;
                    if let Some(at) = stream_at::<E, P>(w, k, pp, far, pf.panels_after) {
                        V::prefetch_l2(at.cast());
                    }
                }
            }
            countdown -= 1;
            if countdown == 0 {
                countdown = every;
                if line < pf.first + pf.lines {
                    for area in pf.next.iter().take(P) {
                        let at = area.cast::<u8>().wrapping_add(line * LINE);
                        V::prefetch_into(at, !pf.to_l2);
                    }
                    line += 1;
                }
            }
            let mut wv = [V::zero(); 4];
            for (c, v) in wv.iter_mut().enumerate().take(vecs) {
                let (pp, lane0) = (c / per, c % per * V::WIDTH);
                *v = V::load_weights(w.add(pp * k * PANEL + i * PANEL + lane0));
            }
            for (m, acc_m) in acc.iter_mut().enumerate() {
                let xv = V::splat(xs[m].add(i));
                for (a, &wc) in acc_m.iter_mut().zip(&wv).take(vecs) {
                    *a = V::mul_add(xv, wc, *a);
                }
            }
        }
        // One test for the tile (a test per store kept a 12-row tile's sums in memory
        // inside the step loop), so that both store sequences unroll.
        if dst.stream {
            for (m, acc_m) in acc.iter().enumerate() {
                for (c, a) in acc_m.iter().enumerate().take(vecs) {
                    a.store_stream(dst.at.add(m * dst.stride + c * V::WIDTH));
                }
            }
        } else {
            for (m, acc_m) in acc.iter().enumerate() {
                for (c, a) in acc_m.iter().enumerate().take(vecs) {
                    a.store(dst.at.add(m * dst.stride + c * V::WIDTH));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Problem, WeightElement, panels};
    use std::arch::x86_64::{__m256, __m512};

    /// AVX2: 6 rows × one panel (2 registers) = 12 accumulators, + 2 weight registers and one
    /// broadcast: 15 of 16 registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn panels_avx2<E: WeightElement>(p: &Problem<E>, p0: usize, p1: usize) {
        unsafe { panels::<__m256, E, 6, 1>(p, p0, p1) }
    }

    /// AVX-512: 12 rows × two panels (one register each) = 24 accumulators of 32 registers
    /// (few rows of 16-bit weights: 6 × four panels, see [`super::WIDE_ROWS`]).
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn panels_avx512<E: WeightElement>(p: &Problem<E>, p0: usize, p1: usize) {
        unsafe { panels::<__m512, E, 12, 2>(p, p0, p1) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_inputs::{isas, same_bits, values};

    #[test]
    fn row_groups_split_evenly_and_in_order() {
        let split = |rows, most| row_groups(rows, most).collect::<Vec<_>>();
        assert_eq!(split(8, 6), vec![0..4, 4..8]);
        assert_eq!(split(13, 4), vec![0..4, 4..7, 7..10, 10..13]);
        assert_eq!(split(3, 8), vec![0..3]);
        assert!(split(0, 4).is_empty());
        assert_eq!(row_groups(16, 12).len(), 2);
    }
    use half::{bf16, f16};

    fn naive<E: WeightElement>(x: &[f32], w: &[E], k: usize) -> Vec<f64> {
        let (b, out) = (x.len() / k, w.len() / k);
        let mut y = vec![0f64; b * out];
        for j in 0..b {
            for o in 0..out {
                y[j * out + o] = (0..k)
                    .map(|i| w[o * k + i].to_f32() as f64 * x[j * k + i] as f64)
                    .sum();
            }
        }
        y
    }

    /// The exact sequence the kernels promise: one FMA chain per output, in order.
    fn chain<E: WeightElement>(x: &[f32], w: &[E], k: usize) -> Vec<f32> {
        let (b, out) = (x.len() / k, w.len() / k);
        let mut y = vec![0f32; b * out];
        for j in 0..b {
            for o in 0..out {
                y[j * out + o] = (0..k).fold(0f32, |acc, i| {
                    x[j * k + i].mul_add(w[o * k + i].to_f32(), acc)
                });
            }
        }
        y
    }

    /// The product into a buffer that starts on a cache line (whole-line rows take stores
    /// past the caches) and into one a float past it (they cannot); both must agree.
    fn product<E: WeightElement>(
        isa: Isa,
        pool: &Pool,
        x: &[f32],
        w: &PackedMatrix<E>,
    ) -> Vec<f32> {
        let len = x.len() / w.k() * w.out();
        let mut buffer = vec![f32::NAN; len + LINE_FLOATS + 1];
        let line = to_line(buffer.as_ptr());
        let mut results = [line, line + 1].map(|at| {
            let y = &mut buffer[at..at + len];
            y.fill(f32::NAN);
            w.matmul_with(isa, pool, x, y).unwrap();
            y.to_vec()
        });
        assert!(
            same_bits(&results[0], &results[1]),
            "{isa:?}: aligned and not differ"
        );
        std::mem::take(&mut results[0])
    }

    /// Each ISA computes exactly the FMA chain, which is close to the exact product.
    fn exact_chain_close_to_naive<E: WeightElement>() {
        let pool = Pool::new(3);
        // k = 300: several chunks; 61 and 64 outputs: four panels, the last padded or not.
        for k in [1, 7, 16, 33, 100, 300] {
            for out in [1, 5, 16, 17, 37, 61, 64] {
                let w: Vec<E> = values(out * k, 7).into_iter().map(E::from_f32).collect();
                let packed = PackedMatrix::pack(&w, out, k).unwrap();
                assert_eq!(packed.unpack(), w);
                for b in [1, 2, 3, 5, 6, 7, 12, 13, 25] {
                    let x = values(b * k, 11 + b as u32);
                    let want = chain(&x, &w, k);
                    for (y, exact) in want.iter().zip(naive(&x, &w, k)) {
                        let tol = 1e-5 * k as f64 * (1.0 + exact.abs());
                        assert!((*y as f64 - exact).abs() < tol, "k={k}: {y} vs {exact}");
                    }
                    for isa in isas() {
                        let got = product(isa, &pool, &x, &packed);
                        let same = same_bits(&got, &want);
                        assert!(same, "{isa:?} k={k} out={out} b={b}");
                    }
                }
            }
        }
    }

    #[test]
    fn f32_is_the_exact_chain() {
        exact_chain_close_to_naive::<f32>();
    }

    #[test]
    fn f16_is_the_exact_chain() {
        exact_chain_close_to_naive::<f16>();
    }

    #[test]
    fn bf16_is_the_exact_chain() {
        exact_chain_close_to_naive::<bf16>();
    }

    /// The heart of lossless verification: a block's rows equal the rows computed alone, bit
    /// for bit, for every block size (including several passes over the weights) and thread
    /// count.
    fn rows_are_batch_invariant<E: WeightElement>() {
        let k = 1000; // passes of 65 rows: blocks of 150 take several
        let out = 75;
        let w: Vec<E> = values(out * k, 3).into_iter().map(E::from_f32).collect();
        let w = PackedMatrix::pack(&w, out, k).unwrap();
        let one = Pool::new(1);
        let three = Pool::new(3);
        for isa in isas() {
            for b in [2, 3, 8, 16, 31, 64, 150] {
                let x = values(b * k, 5 + b as u32);
                let block = product(isa, &three, &x, &w);
                for j in 0..b {
                    let alone = product(isa, &one, &x[j * k..(j + 1) * k], &w);
                    let same = same_bits(&block[j * out..(j + 1) * out], &alone);
                    assert!(same, "{isa:?} b={b} row {j}");
                }
            }
        }
    }

    #[test]
    fn f32_rows_are_batch_invariant() {
        rows_are_batch_invariant::<f32>();
    }

    #[test]
    fn f16_rows_are_batch_invariant() {
        rows_are_batch_invariant::<f16>();
    }

    #[test]
    fn bf16_rows_are_batch_invariant() {
        rows_are_batch_invariant::<bf16>();
    }

    #[test]
    fn rejects_inconsistent_shapes() {
        let pool = Pool::new(1);
        assert!(PackedMatrix::pack(&[0f32; 12], 3, 5).is_err());
        assert!(PackedMatrix::pack(&[0f32; 0], 0, 0).is_err());
        let w = PackedMatrix::pack(&[0f32; 12], 3, 4).unwrap();
        let mut y = vec![0f32; 6];
        assert!(
            w.matmul_with(Isa::Portable, &pool, &[0f32; 8], &mut y)
                .is_ok()
        );
        assert!(
            w.matmul_with(Isa::Portable, &pool, &[0f32; 7], &mut y)
                .is_err()
        );
        assert!(
            w.matmul_with(Isa::Portable, &pool, &[0f32; 12], &mut y)
                .is_err()
        );
    }
}
