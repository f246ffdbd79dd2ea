//! Causal grouped-query attention of a block of new rows against keys and values on the host.
//!
//! Row `r` of a block whose first row sits at position `first` attends to positions
//! `0..=first + r`. Keys are stored transposed in blocks of 8 positions
//! (`[position / 8][kv_head][d][position % 8]`), so the scores of 8 positions come from one
//! register: a fused multiply-add chain over the head dimension per lane, the query value
//! broadcast, as in the matrix kernel. Values are stored `[position][kv_head][d]` and summed the
//! same way over positions. Every score and output element is one chain in a fixed order that
//! does not depend on the other rows, so a block gives the same bits as its rows one at a time
//! (and the portable path the same bits as AVX2).

use std::cell::RefCell;

use super::isa::Isa;
use super::lanes::{Lanes, Soft};
use super::pool::{Disjoint, Pool};
use super::rows::{exp, max, sum};
use eesd_core::TreeMask;

/// Positions per key block (the f32 lanes of one AVX2 register).
const BLOCK: usize = 8;

/// Head counts and width of an attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    /// Query heads.
    pub q: usize,
    /// Key/value heads (each serves `q / kv` query heads).
    pub kv: usize,
    /// Width of a head.
    pub d: usize,
}

impl Heads {
    /// Whether [`attend`] handles this geometry: whole 8-wide vectors per head and at most 8
    /// query heads per kv head.
    pub fn supported(&self) -> bool {
        self.kv > 0
            && self.q.is_multiple_of(self.kv)
            && self.q / self.kv <= 8
            && self.d > 0
            && self.d.is_multiple_of(BLOCK)
    }
}

/// Keys and values of one layer on the host, in the layout [`attend`] reads.
#[derive(Debug, Clone, Default)]
pub struct KvStore {
    /// `[position / 8][kv_head][d][position % 8]`.
    k: Vec<f32>,
    /// `[position][kv_head][d]`.
    v: Vec<f32>,
    kv_heads: usize,
    d: usize,
}

impl KvStore {
    /// An empty store for `kv_heads` heads of width `d`.
    pub fn new(kv_heads: usize, d: usize) -> Self {
        KvStore {
            kv_heads,
            d,
            ..KvStore::default()
        }
    }

    /// `(kv_heads, d)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.kv_heads, self.d)
    }

    /// Positions there is room for.
    pub fn capacity(&self) -> usize {
        self.v.len() / (self.kv_heads * self.d).max(1)
    }

    /// Makes room for at least `positions` (keeping what is stored).
    pub fn reserve(&mut self, positions: usize) {
        let positions = positions.div_ceil(BLOCK) * BLOCK;
        let width = self.kv_heads * self.d;
        if self.v.len() < positions * width {
            self.k.resize(positions * width, 0.0);
            self.v.resize(positions * width, 0.0);
        }
    }

    /// Stores position `pos`'s keys and values (`[kv_head][d]` each); `pos` must be below
    /// [`KvStore::capacity`].
    pub fn write(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let (heads, d) = (self.kv_heads, self.d);
        let width = heads * d;
        self.v[pos * width..(pos + 1) * width].copy_from_slice(v);
        let block = &mut self.k[pos / BLOCK * width * BLOCK..][..width * BLOCK];
        for (c, &value) in k.iter().enumerate() {
            block[c * BLOCK + pos % BLOCK] = value;
        }
    }

    /// Copies position `from`'s keys and values to position `to` (both below the capacity).
    pub fn copy_position(&mut self, from: usize, to: usize) {
        let width = self.kv_heads * self.d;
        self.v
            .copy_within(from * width..(from + 1) * width, to * width);
        let (fb, tb) = (from / BLOCK * width * BLOCK, to / BLOCK * width * BLOCK);
        for c in 0..width {
            self.k[tb + c * BLOCK + to % BLOCK] = self.k[fb + c * BLOCK + from % BLOCK];
        }
    }

    /// The first `len` positions as `[position][kv_head][d]` rows: `(keys, values)`.
    pub fn rows(&self, len: usize) -> (Vec<f32>, Vec<f32>) {
        let width = self.kv_heads * self.d;
        let keys = (0..len * width)
            .map(|at| {
                let (pos, c) = (at / width, at % width);
                self.k[pos / BLOCK * width * BLOCK + c * BLOCK + pos % BLOCK]
            })
            .collect();
        (keys, self.v[..len * width].to_vec())
    }

    /// A store holding `[position][kv_head][d]` rows of keys and values.
    pub fn from_rows(kv_heads: usize, d: usize, keys: &[f32], values: &[f32]) -> Self {
        let width = kv_heads * d;
        let mut store = KvStore::new(kv_heads, d);
        let len = values.len() / width.max(1);
        store.reserve(len);
        for pos in 0..len {
            let at = pos * width..(pos + 1) * width;
            store.write(pos, &keys[at.clone()], &values[at]);
        }
        store
    }
}

/// Writes `out[r] = attention(q[r])` for each row `r` of the block: `q` rows hold the query
/// heads at the start of rows `q_stride` apart, `out` rows are `heads.q · d` wide. `kv` must
/// hold at least `first + rows` positions and `heads` must be [`Heads::supported`] and match
/// the store.
///
/// Without `tree`, row `r` attends to positions `0..=first + r` (a causal block). With it, row
/// `r` attends to `0..first` and to the block rows [`TreeMask::ancestors`] names: its scores
/// are computed as in the causal case and then compacted to those positions, and the value
/// sum runs over them in the same order, so the row gets the bits it would get in a causal
/// block holding only its path.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    q_stride: usize,
    kv: &KvStore,
    first: usize,
    heads: Heads,
    tree: Option<&TreeMask>,
    out: &mut [f32],
    pool: &Pool,
) {
    let Heads { q: nh, kv: nkv, d } = heads;
    let rows = out.len() / (nh * d);
    debug_assert!(heads.supported() && kv.shape() == (nkv, d));
    debug_assert!(kv.capacity() >= first + rows && q.len() >= (rows - 1) * q_stride + nh * d);
    debug_assert!(tree.is_none_or(|t| t.rows() == rows));
    let group = nh / nkv;
    let isa = Isa::detect();
    // Row tiles: the rows of a tile read each key and value block once, from L1, instead of
    // once per row from L2/L3 (long caches do not fit L2). At least two tasks per thread.
    let tiles = (2 * pool.threads())
        .div_ceil(nkv)
        .max(rows.div_ceil(MAX_TILE_ROWS))
        .min(rows);
    let per_tile = rows.div_ceil(tiles);
    let tiles = rows.div_ceil(per_tile);
    let out_ptr = Disjoint(out.as_mut_ptr());
    // Tasks of one kv head are consecutive, so the threads share its keys and values in cache.
    pool.run(tiles * nkv, &|task| {
        let (t, g) = (task % tiles, task / tiles);
        let r0 = t * per_tile;
        let n = (per_tile).min(rows - r0);
        let padded = (first + r0 + n).div_ceil(BLOCK) * BLOCK;
        SCORES.with_borrow_mut(|scores| {
            scores.resize(n * group * padded, 0.0);
            let job = Tile {
                q: &q[r0 * q_stride + g * group * d..],
                q_stride,
                group,
                rows: n,
                kv,
                head: g,
                first,
                r0,
                tree,
                padded,
            };
            // SAFETY: task (t, g) writes only group g's query heads of the tile's rows, inside
            // `out` (rows r0..r0 + n of nh · d values).
            let os = unsafe { out_ptr.ptr().add(r0 * nh * d + g * group * d) };
            tile_for(isa, &job, scores, os, nh * d);
        });
    });
}

/// Most rows per attention task.
const MAX_TILE_ROWS: usize = 8;

/// Positions per chunk of the shared value sum: the chunk's value rows stay in L1 while every
/// row of the tile adds them.
const VALUE_CHUNK: usize = 64;

thread_local! {
    /// Score buffer reused by every call on this thread.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The query heads that share kv head `head`, for block rows `r0..r0 + rows`: row `r0 + i`
/// attends causally to `0..=first + r0 + i`, or with `tree` to `0..first` and its ancestors.
struct Tile<'a> {
    /// The tile's first row's queries of this group; rows `q_stride` apart.
    q: &'a [f32],
    q_stride: usize,
    /// Query heads per kv head.
    group: usize,
    rows: usize,
    kv: &'a KvStore,
    head: usize,
    first: usize,
    r0: usize,
    tree: Option<&'a TreeMask>,
    /// Score row length (whole key blocks of the tile's last row).
    padded: usize,
}

impl Tile<'_> {
    /// Positions row `i` of the tile scores: the causal ones up to its own.
    fn scored(&self, i: usize) -> usize {
        self.first + self.r0 + i + 1
    }

    /// `(contiguous, tail)`: row `i` sums values over positions `0..contiguous`, then over
    /// `first + tail[j]` (its ancestors, for a tree row).
    fn used(&self, i: usize) -> (usize, &[usize]) {
        match self.tree {
            Some(tree) => (self.first, tree.ancestors(self.r0 + i)),
            None => (self.scored(i), &[]),
        }
    }
}

fn tile_for(isa: Isa, job: &Tile<'_>, scores: &mut [f32], out: *mut f32, out_stride: usize) {
    match isa.supported() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(job: &Tile<'_>, scores: &mut [f32], out: *mut f32, stride: usize) {
                unsafe { group_tiled::<std::arch::x86_64::__m256>(job, scores, out, stride) }
            }
            // SAFETY: the CPU has AVX2 and FMA; `out` as promised by `attend`.
            unsafe { avx2(job, scores, out, out_stride) }
        }
        // SAFETY: portable lanes need no special instructions; `out` as promised by `attend`.
        _ => unsafe { group_tiled::<Soft<8>>(job, scores, out, out_stride) },
    }
}

/// Picks register tiles for the group size: `G` query heads, `T` key blocks per score tile and
/// `C` value columns (of 8) per output tile, so that accumulators, broadcast queries and one
/// loaded vector fit the 16 registers of AVX2. The tiles change only which independent chains
/// run side by side, never the order within a chain.
///
/// # Safety
/// As [`group`].
#[inline(always)]
unsafe fn group_tiled<V: Lanes>(job: &Tile<'_>, scores: &mut [f32], out: *mut f32, stride: usize) {
    unsafe {
        match job.group {
            1 => group::<V, 1, 8, 8>(job, scores, out, stride),
            2 => group::<V, 2, 4, 4>(job, scores, out, stride),
            3 => group::<V, 3, 3, 4>(job, scores, out, stride),
            4 => group::<V, 4, 2, 2>(job, scores, out, stride),
            5 => group::<V, 5, 2, 2>(job, scores, out, stride),
            6 => group::<V, 6, 1, 1>(job, scores, out, stride),
            7 => group::<V, 7, 1, 1>(job, scores, out, stride),
            _ => group::<V, 8, 1, 1>(job, scores, out, stride),
        }
    }
}

/// Scores (`scores: [rows][G][padded]`), softmax and weighted values of one [`Tile`] of `G`
/// query heads per row into `out` (row `i` at `out + i · stride`, `G · d` values).
///
/// Each score and each output element is one chain over positions in the order a single row
/// would use: the tile only shares loads (key blocks across rows, value chunks across rows,
/// partial sums parked in `out` between chunks, which is exact).
///
/// # Safety
/// `V` has 8 lanes and its instructions are supported; the store, slices and `out` match
/// (see [`attend`]).
#[inline(always)]
unsafe fn group<V: Lanes, const G: usize, const T: usize, const C: usize>(
    job: &Tile<'_>,
    scores: &mut [f32],
    out: *mut f32,
    stride: usize,
) {
    debug_assert_eq!(V::WIDTH, BLOCK);
    let (heads, d) = job.kv.shape();
    let padded = job.padded;
    let scale = 1.0 / (d as f32).sqrt();
    unsafe {
        // Scores, 8 positions per register: s[p] = Σ_c q[c] · k[p][c], one chain per lane; a
        // tile of T key blocks serves every row of the tile while it is in L1.
        let keys = job.kv.k.as_ptr().add(job.head * d * BLOCK);
        let block_stride = heads * d * BLOCK;
        let sp = scores.as_mut_ptr();
        let row_q = |i: usize| job.q.as_ptr().add(i * job.q_stride);
        let row_s = |i: usize| sp.add(i * G * padded);
        let mut block = 0;
        while block < padded / BLOCK {
            for i in 0..job.rows {
                let blocks = job.scored(i).div_ceil(BLOCK);
                if block + T <= blocks {
                    score_tile::<V, G, T>(row_q(i), d, keys, block_stride, block, row_s(i), padded);
                } else {
                    for b in block..blocks {
                        score_tile::<V, G, 1>(row_q(i), d, keys, block_stride, b, row_s(i), padded);
                    }
                }
            }
            block += T;
        }
        // Per row: a tree row keeps the scores of its ancestors only, in order (positions
        // first..first + tail.len() then stand for the rows listed in tail); then the softmax
        // per head over the used positions (unnormalised; the sum divides at the end).
        let mut inv = [[0f32; G]; MAX_TILE_ROWS];
        for (i, inv) in inv.iter_mut().enumerate().take(job.rows) {
            let (contiguous, tail) = job.used(i);
            let used = contiguous + tail.len();
            for (h, inv) in inv.iter_mut().enumerate() {
                let s = &mut scores[(i * G + h) * padded..(i * G + h + 1) * padded];
                if job.tree.is_some() {
                    for (j, &row) in tail.iter().enumerate() {
                        s[contiguous + j] = s[contiguous + row];
                    }
                }
                let s = &mut s[..used];
                for x in s.iter_mut() {
                    *x *= scale;
                }
                let max = max(s);
                for x in s.iter_mut() {
                    *x = exp(*x - max);
                }
                *inv = 1.0 / sum(s);
            }
        }
        // out[h][c] = Σ_p prob[h][p] · v[p][c], C columns of 8 at a time: the cached positions
        // in chunks shared by all rows, then each row's own positions.
        let values = job.kv.v.as_ptr().add(job.head * d);
        let width = heads * d;
        let sums = |i: usize| {
            let (contiguous, tail) = job.used(i);
            ValueSums {
                probs: sp.add(i * G * padded),
                padded,
                contiguous,
                tail,
                values,
                width,
            }
        };
        let cols = d / BLOCK;
        // A single row gains nothing from chunks: one pass over its positions.
        let chunk_len = if job.rows == 1 {
            job.first
        } else {
            VALUE_CHUNK
        };
        let mut col = 0;
        while col < cols {
            let wide = col + C <= cols;
            let mut chunk = 0;
            while chunk < job.first {
                let end = (chunk + chunk_len).min(job.first);
                for i in 0..job.rows {
                    let o = out.add(i * stride);
                    match wide {
                        true => value_tile::<V, G, C>(&sums(i), chunk..end, false, col, o, d),
                        false => value_tile::<V, G, 1>(&sums(i), chunk..end, false, col, o, d),
                    }
                }
                chunk = end;
            }
            for i in 0..job.rows {
                let (s, o) = (sums(i), out.add(i * stride));
                let own = job.first..s.contiguous;
                match wide {
                    true => value_tile::<V, G, C>(&s, own, true, col, o, d),
                    false => value_tile::<V, G, 1>(&s, own, true, col, o, d),
                }
            }
            col += if wide { C } else { 1 };
        }
        for (i, inv) in inv.iter().enumerate().take(job.rows) {
            for (h, inv) in inv.iter().enumerate() {
                let row = std::slice::from_raw_parts_mut(out.add(i * stride + h * d), d);
                for v in row {
                    *v *= inv;
                }
            }
        }
    }
}

/// Scores of `G` heads against key blocks `block..block + T`.
///
/// # Safety
/// As [`group`].
#[inline(always)]
unsafe fn score_tile<V: Lanes, const G: usize, const T: usize>(
    q: *const f32,
    d: usize,
    keys: *const f32,
    block_stride: usize,
    block: usize,
    scores: *mut f32,
    padded: usize,
) {
    unsafe {
        let mut acc = [[V::zero(); G]; T];
        for c in 0..d {
            let mut qs = [V::zero(); G];
            for (h, q_h) in qs.iter_mut().enumerate() {
                *q_h = V::splat(q.add(h * d + c));
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let k = V::load(keys.add((block + t) * block_stride + c * BLOCK));
                for (a, q_h) in acc.iter_mut().zip(&qs) {
                    *a = V::mul_add(*q_h, k, *a);
                }
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            for (h, a) in acc.iter().enumerate() {
                a.store(scores.add(h * padded + (block + t) * BLOCK));
            }
        }
    }
}

/// `acc[h] += prob[h][p] · v[row][col..col + C]`, one fused multiply-add per element.
///
/// # Safety
/// As [`group`].
#[inline(always)]
unsafe fn add_row<V: Lanes, const G: usize, const C: usize>(
    acc: &mut [[V; C]; G],
    s: &ValueSums<'_>,
    p: usize,
    row: usize,
    col: usize,
) {
    unsafe {
        let row = s.values.add(row * s.width + col * BLOCK);
        let mut weights = [V::zero(); G];
        for (h, w) in weights.iter_mut().enumerate() {
            *w = V::splat(s.probs.add(h * s.padded + p));
        }
        for j in 0..C {
            let v = V::load(row.add(j * BLOCK));
            for (acc, w) in acc.iter_mut().zip(&weights) {
                acc[j] = V::mul_add(*w, v, acc[j]);
            }
        }
    }
}

/// Where a value sum reads: probabilities `probs: [G][padded]` and value rows `width` apart;
/// positions `0..contiguous` are rows `0..contiguous`, then position `contiguous + j` is row
/// `contiguous + tail[j]` (a tree row's ancestors).
struct ValueSums<'a> {
    probs: *const f32,
    padded: usize,
    contiguous: usize,
    tail: &'a [usize],
    values: *const f32,
    width: usize,
}

/// Adds positions `range` (and, with `tail`, the tail positions) of [`ValueSums`] into the
/// weighted sums of `G` heads over value columns `col..col + C` (each 8 wide) at `out`,
/// continuing the sums stored there unless `range` starts at position 0.
///
/// # Safety
/// As [`group`].
#[inline(always)]
unsafe fn value_tile<V: Lanes, const G: usize, const C: usize>(
    s: &ValueSums<'_>,
    range: std::ops::Range<usize>,
    tail: bool,
    col: usize,
    out: *mut f32,
    d: usize,
) {
    unsafe {
        let mut acc = [[V::zero(); C]; G];
        if range.start > 0 {
            for (h, acc) in acc.iter_mut().enumerate() {
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = V::load(out.add(h * d + (col + j) * BLOCK));
                }
            }
        }
        for p in range {
            add_row::<V, G, C>(&mut acc, s, p, p, col);
        }
        if tail {
            for (j, &row) in s.tail.iter().enumerate() {
                add_row::<V, G, C>(&mut acc, s, s.contiguous + j, s.contiguous + row, col);
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            for (j, a) in acc.iter().enumerate() {
                a.store(out.add(h * d + (col + j) * BLOCK));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32 ^ seed).wrapping_mul(2_654_435_761) >> 20) as f32 / 4096.0 - 0.5)
            .collect()
    }

    /// Straightforward f64 attention over `[position][kv_head][d]` rows.
    fn reference(q: &[f32], k: &[f32], v: &[f32], first: usize, h: Heads) -> Vec<f64> {
        let rows = q.len() / (h.q * h.d);
        let mut out = vec![0f64; rows * h.q * h.d];
        for r in 0..rows {
            for hq in 0..h.q {
                let g = hq / (h.q / h.kv);
                let n = first + r + 1;
                let s: Vec<f64> = (0..n)
                    .map(|i| {
                        (0..h.d)
                            .map(|c| {
                                q[r * h.q * h.d + hq * h.d + c] as f64
                                    * k[(i * h.kv + g) * h.d + c] as f64
                            })
                            .sum::<f64>()
                            / (h.d as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..h.d {
                    out[r * h.q * h.d + hq * h.d + c] = (0..n)
                        .map(|i| e[i] / z * v[(i * h.kv + g) * h.d + c] as f64)
                        .sum();
                }
            }
        }
        out
    }

    fn run(
        isa_portable: bool,
        q: &[f32],
        kv: &KvStore,
        first: usize,
        h: Heads,
        pool: &Pool,
    ) -> Vec<f32> {
        let mut out = vec![0f32; q.len()];
        if isa_portable {
            // One row per tile, the portable lanes.
            let w = h.q * h.d;
            for r in 0..q.len() / w {
                let group = h.q / h.kv;
                for g in 0..h.kv {
                    let padded = (first + r + 1).div_ceil(BLOCK) * BLOCK;
                    let mut scores = vec![0f32; group * padded];
                    let job = Tile {
                        q: &q[r * w + g * group * h.d..],
                        q_stride: w,
                        group,
                        rows: 1,
                        kv,
                        head: g,
                        first: first + r,
                        r0: 0,
                        tree: None,
                        padded,
                    };
                    let o = out[r * w + g * group * h.d..].as_mut_ptr();
                    tile_for(Isa::Portable, &job, &mut scores, o, w);
                }
            }
        } else {
            attend(q, h.q * h.d, kv, first, h, None, &mut out, pool);
        }
        out
    }

    #[test]
    fn matches_reference_rows_are_batch_invariant_and_simd_equals_portable() {
        // Every group size has its own register tiles; d = 24 leaves partial column tiles.
        for (q, kv, d) in [
            (6, 2, 24),
            (3, 3, 64),
            (4, 2, 16),
            (8, 2, 8),
            (10, 2, 24),
            (8, 1, 32),
        ] {
            check(Heads { q, kv, d });
        }
    }

    fn check(h: Heads) {
        // A short cache, and one longer than a value chunk with rows over several tiles.
        check_block(h, 13, 5);
        check_block(h, 150, 19);
    }

    fn check_block(h: Heads, first: usize, rows: usize) {
        assert!(h.supported());
        let pool = Pool::new(3);
        let n = first + rows;
        let k = values(n * h.kv * h.d, 1);
        let v = values(n * h.kv * h.d, 2);
        let kv = KvStore::from_rows(h.kv, h.d, &k, &v);
        assert_eq!(kv.rows(n), (k.clone(), v.clone()));
        let q = values(rows * h.q * h.d, 3);
        let block = run(false, &q, &kv, first, h, &pool);
        for (got, want) in block.iter().zip(reference(&q, &k, &v, first, h)) {
            assert!((*got as f64 - want).abs() < 1e-5, "{got} vs {want}");
        }
        assert_eq!(run(true, &q, &kv, first, h, &pool), block);
        let w = h.q * h.d;
        for r in 0..rows {
            let alone = run(
                false,
                &q[r * w..(r + 1) * w],
                &kv,
                first + r,
                h,
                &Pool::new(1),
            );
            assert_eq!(alone, block[r * w..(r + 1) * w]);
        }
    }

    #[test]
    fn a_tree_row_equals_its_path_as_a_causal_block() {
        let h = Heads { q: 9, kv: 3, d: 64 };
        let w = h.q * h.d;
        let kvw = h.kv * h.d;
        // Root, two children, a grandchild of the second, and a deeper chain under it.
        let mask =
            TreeMask::try_new(vec![None, Some(0), Some(0), Some(2), Some(3), Some(1)]).unwrap();
        let (first, rows) = (70, mask.rows());
        let k = values((first + rows) * kvw, 4);
        let v = values((first + rows) * kvw, 5);
        let kv = KvStore::from_rows(h.kv, h.d, &k, &v);
        let q = values(rows * w, 6);
        let mut out = vec![0f32; rows * w];
        attend(&q, w, &kv, first, h, Some(&mask), &mut out, &Pool::new(2));
        for r in 0..rows {
            let path = mask.ancestors(r);
            let slots: Vec<usize> = (0..first).chain(path.iter().map(|a| first + a)).collect();
            let gather = |x: &[f32]| -> Vec<f32> {
                slots
                    .iter()
                    .flat_map(|&p| x[p * kvw..(p + 1) * kvw].to_vec())
                    .collect()
            };
            let alone = KvStore::from_rows(h.kv, h.d, &gather(&k), &gather(&v));
            let last = slots.len() - 1;
            let mut want = vec![0f32; w];
            let row_q = &q[r * w..(r + 1) * w];
            attend(row_q, w, &alone, last, h, None, &mut want, &Pool::new(1));
            assert_eq!(out[r * w..(r + 1) * w], want[..], "row {r}");
        }
    }
}
