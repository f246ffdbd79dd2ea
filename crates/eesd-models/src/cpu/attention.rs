//! Causal grouped-query attention of a block of new rows against keys and values on the host.
//!
//! Row `r` of a block whose first row sits at position `first` attends to positions
//! `0..=first + r`. Each kv head's keys are stored transposed in blocks of `B` positions
//! (`[kv_head][position / B][d][position % B]`, `B` the f32 lanes of the kernel's register: 16
//! with AVX-512, else 8), so the scores of `B` positions come from one register: a fused
//! multiply-add chain over the head dimension per lane, the query value broadcast, as in the
//! matrix kernel. Values are stored `[kv_head][position][d]` and summed the
//! same way over positions. A row's positions are cut into fixed chunks of [`CHUNK`], each with
//! its own softmax, folded in order (as in flash-decoding): a long cache then splits into tasks
//! for every thread even for a single row. Every score, partial and output element is one chain
//! in a fixed order that depends only on the row's own positions, so a block gives the same bits
//! as its rows one at a time, and the register width (8 or 16 lanes, portable or SIMD) changes
//! only how many chains run side by side: every path gives the same bits.
//!
//! Keys and values are stored in f32 or f16 ([`KvDtype`]): f16 halves what a decoding step
//! streams from a long cache (with 4-bit weights the cache of 1,000 positions is a third of a
//! step's bytes) and converts exactly to f32 when loaded, so the arithmetic is unchanged.

use std::cell::RefCell;

use super::huge_pages::HugeBuf;
use super::isa::Isa;
use super::l1::l1_data_bytes;
use super::lanes::sealed::Kind;
use super::lanes::{Lanes, Soft, WeightElement};
use super::line::{LINE, LINE_FLOATS, line_aligned};
use super::pool::{Disjoint, Pool};
use super::rows::{exp, softmax_each};
use eesd_core::TreeMask;

/// Positions per key block where AVX-512 is absent (the f32 lanes of one AVX2 register).
const NARROW: usize = 8;

/// Positions per key block with AVX-512 (the f32 lanes of one 512-bit register).
const WIDE: usize = 16;

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
            && self.d.is_multiple_of(NARROW)
    }
}

/// Keys and values of one layer on the host, in the layout [`attend`] reads: each kv head's
/// keys and values are one contiguous run, so a task reading a head's chunk streams memory in
/// order (long caches come from DRAM, where scattered runs leave the prefetchers idle).
///
/// `E` is the stored element (`f32` or [`half::f16`]): values are rounded to it when written
/// and read back exactly as f32.
#[derive(Debug)]
pub struct KvStore<E = f32> {
    /// `[kv_head][position / 8][d][position % 8]`, `capacity` positions per head.
    k: HugeBuf<E>,
    /// `[kv_head][position][d]`, `capacity` positions per head.
    v: HugeBuf<E>,
    kv_heads: usize,
    d: usize,
    capacity: usize,
    /// Positions per key block: the lanes of the register that reads them.
    block: usize,
}

impl<E: WeightElement> Clone for KvStore<E> {
    fn clone(&self) -> Self {
        KvStore {
            k: self.k.clone(),
            v: self.v.clone(),
            ..*self
        }
    }
}

impl<E: WeightElement> Default for KvStore<E> {
    /// An empty store of no heads.
    fn default() -> Self {
        Self::with_block(0, 0, NARROW)
    }
}

impl<E: WeightElement> KvStore<E> {
    /// An empty store for `kv_heads` heads of width `d`, in the key layout of this CPU's
    /// widest kernel (blocks of 16 positions with AVX-512 where `d` is a multiple of 16, else 8).
    pub fn new(kv_heads: usize, d: usize) -> Self {
        let wide = Isa::detect().supported() == Isa::Avx512 && d.is_multiple_of(WIDE);
        Self::with_block(kv_heads, d, if wide { WIDE } else { NARROW })
    }

    /// An empty store with keys in blocks of `block` positions (8 or 16; others give 8).
    fn with_block(kv_heads: usize, d: usize, block: usize) -> Self {
        let block = if block == WIDE && d.is_multiple_of(WIDE) {
            WIDE
        } else {
            NARROW
        };
        KvStore {
            k: HugeBuf::filled(0, E::default()),
            v: HugeBuf::filled(0, E::default()),
            kv_heads,
            d,
            capacity: 0,
            block,
        }
    }

    /// `(kv_heads, d)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.kv_heads, self.d)
    }

    /// Positions there is room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Makes room for at least `positions` (keeping what is stored).
    pub fn reserve(&mut self, positions: usize) {
        let positions = positions.div_ceil(self.block) * self.block;
        if positions <= self.capacity {
            return;
        }
        let (old, d) = (self.capacity * self.d, self.d);
        let mut k = HugeBuf::filled(self.kv_heads * positions * d, E::default());
        let mut v = HugeBuf::filled(self.kv_heads * positions * d, E::default());
        for h in 0..self.kv_heads {
            let (from, to) = (h * old, h * positions * d);
            k[to..to + old].copy_from_slice(&self.k[from..from + old]);
            v[to..to + old].copy_from_slice(&self.v[from..from + old]);
        }
        (self.k, self.v, self.capacity) = (k, v, positions);
    }

    /// Index of key element `c` of head `h` at `pos` in `k`.
    fn key_at(&self, h: usize, pos: usize, c: usize) -> usize {
        let b = self.block;
        (h * self.capacity + pos / b * b) * self.d + c * b + pos % b
    }

    /// Index of value row `pos` of head `h` in `v`.
    fn value_at(&self, h: usize, pos: usize) -> usize {
        (h * self.capacity + pos) * self.d
    }

    /// Stores position `pos`'s keys and values (`[kv_head][d]` each); `pos` must be below
    /// [`KvStore::capacity`].
    pub fn write(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let d = self.d;
        // A head's values, then its keys, converted as slices ([`to_stored_slice`]).
        let mut head = [E::default(); STAGED];
        for h in 0..self.kv_heads {
            let at = self.value_at(h, pos);
            to_stored_slice(&v[h * d..(h + 1) * d], &mut self.v[at..at + d]);
            for (keys, from) in k[h * d..(h + 1) * d]
                .chunks(STAGED)
                .zip((0..d).step_by(STAGED))
            {
                let staged = &mut head[..keys.len()];
                to_stored_slice(keys, staged);
                for (c, &value) in (from..).zip(staged.iter()) {
                    let at = self.key_at(h, pos, c);
                    self.k[at] = value;
                }
            }
        }
    }

    /// Copies position `from`'s keys and values to position `to` (both below the capacity).
    pub fn copy_position(&mut self, from: usize, to: usize) {
        let d = self.d;
        for h in 0..self.kv_heads {
            let (f, t) = (self.value_at(h, from), self.value_at(h, to));
            self.v.copy_within(f..f + d, t);
            for c in 0..d {
                let (f, t) = (self.key_at(h, from, c), self.key_at(h, to, c));
                self.k[t] = self.k[f];
            }
        }
    }

    /// The first `len` positions as `[position][kv_head][d]` f32 rows: `(keys, values)`.
    pub fn rows(&self, len: usize) -> (Vec<f32>, Vec<f32>) {
        let (heads, d) = (self.kv_heads, self.d);
        let mut keys = Vec::with_capacity(len * heads * d);
        let mut values = Vec::with_capacity(len * heads * d);
        for pos in 0..len {
            for h in 0..heads {
                keys.extend((0..d).map(|c| self.k[self.key_at(h, pos, c)].to_f32()));
                let at = self.value_at(h, pos);
                values.extend(self.v[at..at + d].iter().map(|v| v.to_f32()));
            }
        }
        (keys, values)
    }

    /// A store holding `[position][kv_head][d]` rows of keys and values (rounded to `E`).
    pub fn from_rows(kv_heads: usize, d: usize, keys: &[f32], values: &[f32]) -> Self {
        Self::from_rows_in(KvStore::new(kv_heads, d), keys, values)
    }

    /// `store` (empty) filled with `[position][kv_head][d]` rows of keys and values.
    fn from_rows_in(mut store: KvStore<E>, keys: &[f32], values: &[f32]) -> Self {
        let width = store.kv_heads * store.d;
        let len = values.len() / width.max(1);
        store.reserve(len);
        for pos in 0..len {
            let at = pos * width..(pos + 1) * width;
            store.write(pos, &keys[at.clone()], &values[at]);
        }
        store
    }
}

/// Values per slice conversion of [`to_stored_slice`] on the stack (a head of SmolLM2: 64).
const STAGED: usize = 128;

/// `values` as stored elements into `out` (equal lengths): rounded to nearest and, in f16, held
/// to its largest finite value (±65,504) rather than overflowing to infinity, which would make
/// a softmax NaN. Converted as slices ([`WeightElement::from_f32_slice`]: F16C where present),
/// not one call per value.
fn to_stored_slice<E: WeightElement>(values: &[f32], out: &mut [E]) {
    match E::KIND {
        Kind::F16 => {
            let mut held = [0f32; STAGED];
            for (values, out) in values.chunks(STAGED).zip(out.chunks_mut(STAGED)) {
                let held = &mut held[..values.len()];
                for (h, &v) in held.iter_mut().zip(values) {
                    *h = v.clamp(-65_504.0, 65_504.0);
                }
                E::from_f32_slice(held, out);
            }
        }
        _ => E::from_f32_slice(values, out),
    }
}

/// The element type of a host key/value store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    /// f32: what an f32 model computes, kept exactly.
    F32,
    /// f16 (as llama.cpp stores its cache): half the bytes per position.
    F16,
}

impl KvDtype {
    /// Bytes per stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }

    /// `f32` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            other => Err(format!("unknown key/value type `{other}` (f32 or f16)")),
        }
    }
}

/// A host key/value store of either [`KvDtype`].
#[derive(Debug, Clone)]
pub enum HostKv {
    /// f32 keys and values.
    F32(KvStore<f32>),
    /// f16 keys and values.
    F16(KvStore<half::f16>),
}

impl HostKv {
    /// An empty store of `dtype` (see [`KvStore::new`]).
    pub fn new(dtype: KvDtype, kv_heads: usize, d: usize) -> Self {
        match dtype {
            KvDtype::F32 => HostKv::F32(KvStore::new(kv_heads, d)),
            KvDtype::F16 => HostKv::F16(KvStore::new(kv_heads, d)),
        }
    }

    /// A store of `dtype` holding `[position][kv_head][d]` rows of keys and values.
    pub fn from_rows(dtype: KvDtype, kv_heads: usize, d: usize, k: &[f32], v: &[f32]) -> Self {
        match dtype {
            KvDtype::F32 => HostKv::F32(KvStore::from_rows(kv_heads, d, k, v)),
            KvDtype::F16 => HostKv::F16(KvStore::from_rows(kv_heads, d, k, v)),
        }
    }

    /// The stored element type.
    pub fn dtype(&self) -> KvDtype {
        match self {
            HostKv::F32(_) => KvDtype::F32,
            HostKv::F16(_) => KvDtype::F16,
        }
    }

    /// `(kv_heads, d)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            HostKv::F32(s) => s.shape(),
            HostKv::F16(s) => s.shape(),
        }
    }

    /// Positions there is room for.
    pub fn capacity(&self) -> usize {
        match self {
            HostKv::F32(s) => s.capacity(),
            HostKv::F16(s) => s.capacity(),
        }
    }

    /// [`KvStore::reserve`].
    pub fn reserve(&mut self, positions: usize) {
        match self {
            HostKv::F32(s) => s.reserve(positions),
            HostKv::F16(s) => s.reserve(positions),
        }
    }

    /// [`KvStore::copy_position`].
    pub fn copy_position(&mut self, from: usize, to: usize) {
        match self {
            HostKv::F32(s) => s.copy_position(from, to),
            HostKv::F16(s) => s.copy_position(from, to),
        }
    }

    /// [`KvStore::rows`].
    pub fn rows(&self, len: usize) -> (Vec<f32>, Vec<f32>) {
        match self {
            HostKv::F32(s) => s.rows(len),
            HostKv::F16(s) => s.rows(len),
        }
    }
}

/// Writes `out[r] = attention(q[r])` for each row `r` of the block: `q` rows hold the query
/// heads at the start of rows `q_stride` apart, `out` rows are `heads.q · d` wide. `kv` must
/// hold at least `first + rows` positions and `heads` must be [`Heads::supported`] and match
/// the store.
///
/// Without `tree`, row `r` attends to positions `0..=first + r` (a causal block). With it, row
/// `r` attends to `0..first` and to the block rows [`TreeMask::ancestors`] names, in that order:
/// position `first + j` of its sequence stands for block row `ancestors[j]`, so the row gets the
/// bits it would get in a causal block holding only its path.
///
/// A row's sequence is cut into chunks of [`CHUNK`] positions (by position, whatever the block):
/// each chunk gets its own softmax (maximum, sum and weighted values), and the chunks are folded
/// in order. Short sequences are one chunk; long ones give every thread work even for one row
/// (a decoding step), since chunks of one row run as separate tasks.
#[allow(clippy::too_many_arguments)]
pub fn attend<E: WeightElement>(
    q: &[f32],
    q_stride: usize,
    kv: &KvStore<E>,
    first: usize,
    heads: Heads,
    tree: Option<&TreeMask>,
    out: &mut [f32],
    pool: &Pool,
) {
    let Heads { q: nh, kv: nkv, d } = heads;
    let rows = out.len() / (nh * d).max(1);
    if rows == 0 {
        return;
    }
    debug_assert!(heads.supported() && kv.shape() == (nkv, d));
    debug_assert!(kv.capacity() >= first + rows && q.len() >= (rows - 1) * q_stride + nh * d);
    debug_assert!(tree.is_none_or(|t| t.rows() == rows));
    let group = nh / nkv;
    let isa = Isa::detect();
    let len = |r: usize| match tree {
        Some(t) => first + t.ancestors(r).len(),
        None => first + r + 1,
    };
    let chunks = (0..rows).map(|r| len(r).div_ceil(CHUNK)).max().unwrap_or(1);
    let threads = pool.threads();
    // Row tiles: the rows of a tile read each key and value block once, from L1, instead of
    // once per row from L2/L3. One chunk per row: split the rows further so that every thread
    // has at least two tasks. Several: full tiles, and chunks as tasks where tiles are few.
    let tiles = match chunks {
        1 => (2 * threads)
            .div_ceil(nkv)
            .max(rows.div_ceil(MAX_TILE_ROWS))
            .min(rows),
        _ => rows.div_ceil(MAX_TILE_ROWS),
    };
    let per_tile = rows.div_ceil(tiles);
    let tiles = rows.div_ceil(per_tile);
    let split = chunks > 1 && tiles * nkv < 2 * threads && rows <= MAX_SPLIT_ROWS;
    let job = |t: usize, g: usize| {
        let r0 = t * per_tile;
        Tile {
            q: &q[r0 * q_stride + g * group * d..],
            q_stride,
            group,
            rows: per_tile.min(rows - r0),
            kv,
            head: g,
            first,
            r0,
            tree,
        }
    };
    let out_ptr = Disjoint(out.as_mut_ptr());
    if !split {
        // Tasks of one kv head are consecutive, so the threads share its keys and values.
        pool.run(tiles * nkv, &|task| {
            let (t, g) = (task % tiles, task / tiles);
            let job = job(t, g);
            // SAFETY: task (t, g) writes only group g's query heads of the tile's rows, inside
            // `out` (rows r0..r0 + n of nh · d values).
            let os = unsafe { out_ptr.ptr().add(job.r0 * nh * d + g * group * d) };
            tile_for(
                isa,
                &job,
                Work::Fold {
                    out: os,
                    stride: nh * d,
                },
            );
        });
        return;
    }
    // Chunks as tasks: each writes its partial softmax per row and query head, then the
    // partials are folded in chunk order, exactly as a task holding every chunk folds them.
    let part = part_len(d);
    PARTS.with_borrow_mut(|parts| {
        let parts = line_aligned(parts, rows * nh * chunks * part);
        let parts_ptr = Disjoint(parts.as_mut_ptr());
        // Runs of consecutive chunks per task ([`SPLIT_TASKS_PER_THREAD`]): longer streams
        // for the prefetchers, the same partials.
        let run = (chunks * nkv * tiles / (SPLIT_TASKS_PER_THREAD * threads)).max(1);
        let runs = chunks.div_ceil(run);
        pool.run(runs * nkv * tiles, &|task| {
            let (t, g, j) = (task % tiles, task / tiles % nkv, task / (tiles * nkv));
            let job = job(t, g);
            for c in j * run..((j + 1) * run).min(job.chunks()) {
                let at = Parts {
                    // SAFETY: task (t, g, j) writes only chunks of run j of group g's heads
                    // of the tile's rows, inside `parts` (rows · nh · chunks slots of `part`).
                    base: unsafe {
                        parts_ptr
                            .ptr()
                            .add(((job.r0 * nh + g * group) * chunks + c) * part)
                    },
                    row: nh * chunks * part,
                    head: chunks * part,
                };
                tile_for(
                    isa,
                    &job,
                    Work::Chunk {
                        chunk: c,
                        parts: at,
                    },
                );
            }
        });
        let fold_group = |task: usize| {
            let (r, g) = (task / nkv, task % nkv);
            let n = len(r).div_ceil(CHUNK);
            for h in g * group..(g + 1) * group {
                let slots = (r * nh + h) * chunks * part;
                // SAFETY: task (r, g) reads its own partials and writes only row r's heads of
                // group g.
                let (mine, o) = unsafe {
                    (
                        std::slice::from_raw_parts(parts_ptr.ptr().add(slots), n * part),
                        std::slice::from_raw_parts_mut(out_ptr.ptr().add((r * nh + h) * d), d),
                    )
                };
                fold_for(isa, mine, o);
            }
        };
        // Folding is light: on this thread unless there is much of it.
        if rows * chunks <= SERIAL_FOLDS {
            (0..rows * nkv).for_each(fold_group);
        } else {
            pool.run(rows * nkv, &fold_group);
        }
    });
}

/// Positions per softmax chunk (a multiple of the key block of 8 and the value chunk).
pub const CHUNK: usize = 128;

/// Key blocks widened to f32 at once for the rows of a tile (16 KiB with AVX-512).
const WIDE_KEY_BLOCKS: usize = 4;

/// Fewest rows of a tile for which 16-bit keys and values are widened to f32 first: with two,
/// the conversion is paid for twice and costs more than it saves (one layer at 300-1,000 cached
/// positions +17% on an Intel Xeon); from four on it gains.
const WIDEN_MIN_ROWS: usize = 4;

/// Most rows per attention task.
const MAX_TILE_ROWS: usize = 8;

/// Most rows of a block whose chunks run as separate tasks (their partials are kept).
const MAX_SPLIT_ROWS: usize = 64;

/// About how many tasks per thread a block whose chunks run as tasks is cut into, as runs of
/// consecutive chunks of one kv head. Few and long: a task then reads the key blocks and value
/// rows its own prefetches asked for (the next chunk is its own), and the threads hand tasks
/// over less often, which costs ≈ 0.4 µs a time between the core complexes of a Zen 5 EPYC.
/// There, one row at 1,000 cached positions took 0.66–0.69 ms with about eight tasks per
/// thread and 0.48 ms with three (vCPUs on one complex), 0.93 → 0.56–0.59 ms on two;
/// one task per thread left a thread idle (3 kv heads on 2 threads): slower than eight.
const SPLIT_TASKS_PER_THREAD: usize = 3;

/// Most row chunks whose partials the calling thread folds alone.
const SERIAL_FOLDS: usize = 64;

/// Positions per chunk of the shared value sum: the chunk's value rows stay in L1 while every
/// row of the tile adds them.
const VALUE_CHUNK: usize = 64;

/// How many bytes the kernel asks for into L1 ahead of what it reads: a quarter of the L1
/// data cache. Value rows are asked for this far ahead of the row being summed; a key tile of
/// at most this size asks for the next one into L1, a larger one into L2. The cache's rows
/// come from memory (or another core's cache) after each layer's weights, and the hardware
/// prefetchers alone left a step's attention at ≈ 25 GB/s (SmolLM2 at 1,000 cached positions,
/// f16: one row 0.91 → 0.68 ms with the value and key prefetches on a Zen 5 EPYC, 16 rows
/// −15–20%; 4–16 KiB ahead alike for f16, 12–16 KiB best for f32; docs/results.md).
fn l1_ahead_bytes() -> usize {
    l1_data_bytes() / 4
}

/// Floats per chunk partial `[values (d), maximum, sum]`, padded to whole cache lines so that
/// every partial's values start on one.
fn part_len(d: usize) -> usize {
    (d + 2).next_multiple_of(LINE_FLOATS)
}

thread_local! {
    /// Scratch of a task (widened keys or values, scores, partials, a tree row's own scores),
    /// reused by every call on this thread.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Partials of a block whose chunks run as separate tasks, on the calling thread.
    static PARTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The query heads that share kv head `head`, for block rows `r0..r0 + rows`: row `r0 + i`
/// attends causally to `0..=first + r0 + i`, or with `tree` to `0..first` and its ancestors.
struct Tile<'a, E> {
    /// The tile's first row's queries of this group; rows `q_stride` apart.
    q: &'a [f32],
    q_stride: usize,
    /// Query heads per kv head.
    group: usize,
    rows: usize,
    kv: &'a KvStore<E>,
    head: usize,
    first: usize,
    r0: usize,
    tree: Option<&'a TreeMask>,
}

impl<E> Tile<'_, E> {
    /// Positions of row `i`'s sequence.
    fn len(&self, i: usize) -> usize {
        match self.tree {
            Some(t) => self.first + t.ancestors(self.r0 + i).len(),
            None => self.first + self.r0 + i + 1,
        }
    }

    /// Positions of row `i`'s sequence that are the store's positions (the rest are `tail`).
    fn contiguous(&self, i: usize) -> usize {
        match self.tree {
            Some(_) => self.first,
            None => self.len(i),
        }
    }

    /// The block rows after `contiguous` of a tree row (its ancestors, itself last).
    fn tail(&self, i: usize) -> &[usize] {
        self.tree.map_or(&[], |t| t.ancestors(self.r0 + i))
    }

    /// Chunks of the tile's longest sequence.
    fn chunks(&self) -> usize {
        (0..self.rows)
            .map(|i| self.len(i).div_ceil(CHUNK))
            .max()
            .unwrap_or(0)
    }

    /// Store row of position `p` of row `i`'s sequence.
    fn store_row(&self, i: usize, p: usize) -> usize {
        match p < self.contiguous(i) {
            true => p,
            false => self.first + self.tail(i)[p - self.first],
        }
    }
}

/// Where a chunk's partials go: `[values (d), maximum, sum]` of row `i`, head `h` at
/// `base + i · row + h · head`.
#[derive(Clone, Copy)]
struct Parts {
    base: *mut f32,
    row: usize,
    head: usize,
}

impl Parts {
    fn at(&self, i: usize, h: usize) -> *mut f32 {
        self.base.wrapping_add(i * self.row + h * self.head)
    }
}

/// What a task does with its tile.
#[derive(Clone, Copy)]
enum Work {
    /// Every chunk, folded in order into the outputs (row `i` at `out + i · stride`).
    Fold { out: *mut f32, stride: usize },
    /// One chunk's partials.
    Chunk { chunk: usize, parts: Parts },
}

fn tile_for<E: WeightElement>(isa: Isa, job: &Tile<'_, E>, work: Work) {
    SCRATCH.with_borrow_mut(|scratch| {
        let own = match job.tree {
            Some(_) => own_span(job, job.rows - 1),
            None => 0,
        };
        let (d, g, n) = (job.kv.d, job.group, job.rows);
        let widened = widened_len(d, job.kv.block);
        let scratch = line_aligned(scratch, widened + n * g * (CHUNK + part_len(d) + own));
        // `group_tiled` compiled for one register type with the instructions it needs.
        #[cfg(target_arch = "x86_64")]
        macro_rules! with_features {
            ($name:ident, $features:literal, $lanes:ty) => {
                #[target_feature(enable = $features)]
                unsafe fn $name<E: WeightElement>(
                    job: &Tile<'_, E>,
                    scratch: &mut [f32],
                    work: Work,
                ) {
                    unsafe { group_tiled::<$lanes, E>(job, scratch, work) }
                }
            };
        }
        // The register is as wide as the store's key blocks.
        match (isa.supported(), job.kv.block) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, WIDE) => {
                with_features!(avx512, "avx512f,avx2,fma,f16c", std::arch::x86_64::__m512);
                // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C; `work` as promised by
                // `attend`.
                unsafe { avx512(job, scratch, work) }
            }
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2 | Isa::Avx512, NARROW) => {
                with_features!(avx2, "avx2,fma,f16c", std::arch::x86_64::__m256);
                // SAFETY: the CPU has AVX2, FMA and F16C; `work` as promised by `attend`.
                unsafe { avx2(job, scratch, work) }
            }
            // SAFETY: portable lanes need no special instructions; `work` as promised.
            (_, WIDE) => unsafe { group_tiled::<Soft<WIDE>, E>(job, scratch, work) },
            // SAFETY: as above.
            _ => unsafe { group_tiled::<Soft<NARROW>, E>(job, scratch, work) },
        }
    });
}

/// Folds the partials `parts` (`[values, maximum, sum]` per chunk, in order) into `out`.
fn fold_for(isa: Isa, parts: &[f32], out: &mut [f32]) {
    let d = out.len();
    match isa.supported() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(parts: &[f32], out: &mut [f32], d: usize) {
                fold_all(parts, out, d)
            }
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { avx2(parts, out, d) }
        }
        _ => fold_all(parts, out, d),
    }
}

#[inline(always)]
fn fold_all(parts: &[f32], out: &mut [f32], d: usize) {
    let mut chunks = parts.chunks_exact(part_len(d));
    let Some(head) = chunks.next() else { return };
    out.copy_from_slice(&head[..d]);
    let (mut m, mut l) = (head[d], head[d + 1]);
    for part in chunks {
        fold(&mut m, &mut l, out, part);
    }
    finish(l, out);
}

/// Adds a chunk's partial `[values, maximum, sum]` to the running `(m, l, out)` of the chunks
/// before it: both rescaled to the larger maximum.
#[inline(always)]
fn fold(m: &mut f32, l: &mut f32, out: &mut [f32], part: &[f32]) {
    let d = out.len();
    let (pm, pl) = (part[d], part[d + 1]);
    let top = if pm > *m { pm } else { *m };
    let (a, b) = (exp(*m - top), exp(pm - top));
    *m = top;
    *l = pl.mul_add(b, *l * a);
    for (o, &v) in out.iter_mut().zip(&part[..d]) {
        *o = v.mul_add(b, *o * a);
    }
}

/// `out /= l`, as one multiplication by `1 / l`.
#[inline(always)]
fn finish(l: f32, out: &mut [f32]) {
    let inv = 1.0 / l;
    for v in out {
        *v *= inv;
    }
}

/// Scores of a tree row `i`'s own block positions: from the key block holding `first` to its own
/// row (whole blocks).
fn own_span<E: WeightElement>(job: &Tile<'_, E>, i: usize) -> usize {
    let b = job.kv.block;
    (job.first + job.r0 + i + 1).div_ceil(b) * b - job.first / b * b
}

/// Picks register tiles for the group size: `G` query heads, `T` key blocks per score tile and
/// `C` value columns (of `V::WIDTH`) per output tile, so that accumulators, broadcast queries
/// and one loaded vector fit the registers (16 of 8 lanes with AVX2, 32 of 16 with AVX-512).
/// The tiles change only which independent chains run side by side, never the order within a
/// chain.
///
/// # Safety
/// As [`run`].
#[inline(always)]
unsafe fn group_tiled<V: Lanes, E: WeightElement>(
    job: &Tile<'_, E>,
    scratch: &mut [f32],
    work: Work,
) {
    unsafe {
        if V::WIDTH == WIDE {
            return match job.group {
                1 => run::<V, E, 1, 8, 4>(job, scratch, work),
                2 => run::<V, E, 2, 8, 4>(job, scratch, work),
                3 => run::<V, E, 3, 8, 4>(job, scratch, work),
                4 => run::<V, E, 4, 6, 4>(job, scratch, work),
                5 => run::<V, E, 5, 4, 4>(job, scratch, work),
                6 => run::<V, E, 6, 4, 4>(job, scratch, work),
                7 => run::<V, E, 7, 3, 2>(job, scratch, work),
                _ => run::<V, E, 8, 2, 2>(job, scratch, work),
            };
        }
        match job.group {
            1 => run::<V, E, 1, 8, 8>(job, scratch, work),
            2 => run::<V, E, 2, 4, 4>(job, scratch, work),
            3 => run::<V, E, 3, 3, 4>(job, scratch, work),
            4 => run::<V, E, 4, 2, 2>(job, scratch, work),
            5 => run::<V, E, 5, 2, 2>(job, scratch, work),
            6 => run::<V, E, 6, 1, 1>(job, scratch, work),
            7 => run::<V, E, 7, 1, 1>(job, scratch, work),
            _ => run::<V, E, 8, 1, 1>(job, scratch, work),
        }
    }
}

/// Does `work` for one [`Tile`] of `G` query heads per row.
///
/// # Safety
/// `V` has 8 lanes and its instructions are supported; `scratch` is as [`tile_for`] sizes it;
/// the pointers of `work` are as [`attend`] promises.
#[inline(always)]
unsafe fn run<V: Lanes, E: WeightElement, const G: usize, const T: usize, const C: usize>(
    job: &Tile<'_, E>,
    scratch: &mut [f32],
    work: Work,
) {
    let d = job.kv.d;
    let (n, part) = (job.rows, part_len(d));
    let (widened, scratch) = scratch.split_at_mut(widened_len(d, job.kv.block));
    let (scores, rest) = scratch.split_at_mut(n * G * CHUNK);
    let (partials, own) = rest.split_at_mut(n * G * part);
    unsafe {
        match work {
            Work::Chunk { chunk: c, parts } => {
                chunk::<V, E, G, T, C>(job, c, widened, scores, own, parts, true)
            }
            Work::Fold { out, stride } => {
                let parts = Parts {
                    base: partials.as_mut_ptr(),
                    row: G * part,
                    head: part,
                };
                let mut state = [[(0f32, 0f32); G]; MAX_TILE_ROWS];
                for c in 0..job.chunks() {
                    chunk::<V, E, G, T, C>(job, c, widened, scores, own, parts, false);
                    for (i, state) in state.iter_mut().enumerate().take(n) {
                        if job.len(i) <= c * CHUNK {
                            continue;
                        }
                        for (h, (m, l)) in state.iter_mut().enumerate() {
                            let p = std::slice::from_raw_parts(parts.at(i, h), part);
                            let o = std::slice::from_raw_parts_mut(out.add(i * stride + h * d), d);
                            match c {
                                0 => {
                                    o.copy_from_slice(&p[..d]);
                                    (*m, *l) = (p[d], p[d + 1]);
                                }
                                _ => fold(m, l, o, p),
                            }
                        }
                    }
                }
                for (i, state) in state.iter().enumerate().take(n) {
                    for (h, &(_, l)) in state.iter().enumerate() {
                        finish(
                            l,
                            std::slice::from_raw_parts_mut(out.add(i * stride + h * d), d),
                        );
                    }
                }
            }
        }
    }
}

/// Chunk `c` of every row of the tile that reaches it: scores, softmax (maximum, exponentials
/// and their sum) and the weighted values, written to `parts`.
///
/// Each score and each output element is one chain over positions in the order a single row
/// would use: the tile only shares loads (key blocks across rows, value chunks across rows,
/// partial sums parked in `parts` between value chunks, which is exact).
/// `alone`: the chunk is a task of its own (not one of a task walking every chunk in order).
///
/// # Safety
/// As [`run`]; `widened` holds [`widened_len`] values, `scores` `rows · G · CHUNK` and `own`
/// (tree tiles) `rows · G ·` [`own_span`] values.
#[inline(always)]
unsafe fn chunk<V: Lanes, E: WeightElement, const G: usize, const T: usize, const C: usize>(
    job: &Tile<'_, E>,
    c: usize,
    widened: &mut [f32],
    scores: &mut [f32],
    own: &mut [f32],
    parts: Parts,
    alone: bool,
) {
    const { assert!(V::WIDTH == NARROW || V::WIDTH == WIDE) };
    debug_assert_eq!(V::WIDTH, job.kv.block);
    let lanes = V::WIDTH;
    let d = job.kv.d;
    let scale = 1.0 / (d as f32).sqrt();
    let lo = c * CHUNK;
    let n = job.rows;
    // Row i's positions in this chunk: lo..hi(i); lo..stored(i) are store positions read by
    // key blocks, the rest (a tree row's tail) come from its own scores.
    let hi = |i: usize| job.len(i).clamp(lo, lo + CHUNK);
    let stored = |i: usize| job.contiguous(i).clamp(lo, hi(i));
    unsafe {
        let keys = job.kv.k.as_ptr().add(job.kv.key_at(job.head, 0, 0));
        let block_stride = d * lanes;
        let sp = scores.as_mut_ptr();
        let row_q = |i: usize| job.q.as_ptr().add(i * job.q_stride);
        let row_s = |i: usize| sp.add(i * G * CHUNK);
        // Scores, 8 positions per register: s[p] = Σ_c q[c] · k[p][c], one chain per lane; a
        // tile of T key blocks serves every row of the tile while it is in L1.
        let end = (0..n).map(stored).max().unwrap_or(lo);
        // A chunk run as a task of its own starts cold, and its value rows are read only after
        // its scores: ask for them now, so that their fetch overlaps the scores instead of
        // following them (one row at 300-1,000 positions ≈ 10% faster on an Intel Xeon). A
        // task walking all of a row's chunks is left to the hardware prefetchers, which
        // follow it (prefetching there was 3-11% slower).
        if alone {
            let first = job
                .kv
                .v
                .as_ptr()
                .add(job.kv.value_at(job.head, lo))
                .cast::<u8>();
            let bytes = end.saturating_sub(lo) * d * size_of::<E>();
            for line in (0..bytes).step_by(64) {
                V::prefetch_l2(first.add(line));
            }
        }
        // The key blocks after each tile, up to the furthest row's last (into the next chunk,
        // which this task or another reads next), are asked for while the tile is scored: into
        // L1 where a tile is small beside it, else into L2.
        let last_block = (0..n)
            .map(|i| job.contiguous(i))
            .max()
            .unwrap_or(0)
            .div_ceil(lanes);
        let to_l1 = T * block_stride * size_of::<E>() <= l1_ahead_bytes();
        // With 16-bit keys and `WIDEN_MIN_ROWS` rows or more, each tile of key blocks is first
        // widened to f32 (exactly) in `widened`: the rows' score tiles then read f32 instead of
        // converting every key again, conversions that took the multiply-add ports (8-16 rows
        // −9-13% on an Intel Xeon, docs/results.md).
        let widen = E::KIND != Kind::F32 && n >= WIDEN_MIN_ROWS;
        let tile = if widen { T.min(WIDE_KEY_BLOCKS) } else { T };
        let mut block = lo / lanes;
        while block * lanes < end {
            let count = |i: usize| stored(i).div_ceil(lanes).saturating_sub(block).min(tile);
            let k = keys.add(block * block_stride);
            let next_blocks = last_block.saturating_sub(block + tile).min(tile);
            if widen {
                let w = widened.as_mut_ptr();
                let most = (0..n).map(count).max().unwrap_or(0);
                let next = k.wrapping_add(tile * block_stride);
                widen_into::<V, E>(
                    k,
                    most * block_stride,
                    w,
                    next,
                    next_blocks * block_stride,
                    false,
                );
                for i in (0..n).filter(|&i| count(i) > 0) {
                    let s = row_s(i).add(block * lanes - lo);
                    let (stride, none) = (block_stride, Ahead::NONE);
                    score_blocks::<V, f32, G, T>(row_q(i), d, w, stride, s, CHUNK, count(i), none);
                }
            } else {
                let mut ahead = Ahead {
                    blocks: next_blocks,
                    to_l1,
                };
                for i in (0..n).filter(|&i| count(i) > 0) {
                    let s = row_s(i).add(block * lanes - lo);
                    score_blocks::<V, E, G, T>(
                        row_q(i),
                        d,
                        k,
                        block_stride,
                        s,
                        CHUNK,
                        count(i),
                        ahead,
                    );
                    // The first row to score the tile asks for the next one.
                    ahead.blocks = 0;
                }
            }
            block += tile;
        }
        // A tree row's tail: its own block positions' scores, then the ancestors' in order.
        if job.tree.is_some() {
            let base = job.first / lanes;
            let span = own_span(job, n - 1);
            for i in (0..n).filter(|&i| hi(i) > stored(i)) {
                let o = own.as_mut_ptr().add(i * G * span);
                let count = (job.first + job.r0 + i + 1).div_ceil(lanes) - base;
                let k = keys.add(base * block_stride);
                let none = Ahead::NONE;
                score_blocks::<V, E, G, T>(row_q(i), d, k, block_stride, o, span, count, none);
                for h in 0..G {
                    for p in stored(i)..hi(i) {
                        let row = job.store_row(i, p);
                        *row_s(i).add(h * CHUNK + p - lo) = *o.add(h * span + row - base * lanes);
                    }
                }
            }
        }
        // Per row and head: the softmax over the chunk's positions (unnormalised; the sum
        // divides at the end), its maximum and sum kept with the partial.
        // The row's G heads go through each reduction together (independent chains, each
        // head's value exactly as alone).
        for i in (0..n).filter(|&i| hi(i) > lo) {
            let len = hi(i) - lo;
            // The heads' scores are disjoint slices of `scores`.
            let head = |h: usize| std::slice::from_raw_parts_mut(row_s(i).add(h * CHUNK), len);
            let (maxes, sums) = softmax_each::<G>(std::array::from_fn(head), scale);
            for (h, (&max, &sum)) in maxes.iter().zip(&sums).enumerate() {
                let p = parts.at(i, h);
                *p.add(d) = max;
                *p.add(d + 1) = sum;
            }
        }
        // out[h][c] = Σ_p prob[h][p] · v[p][c], C columns of 8 at a time: the store positions
        // in value chunks shared by all rows, then each tree row's tail.
        let values = job.kv.v.as_ptr().add(job.kv.value_at(job.head, 0));
        let width = d;
        let sums = |i: usize| ValueSums {
            probs: row_s(i),
            values,
            width,
            head: parts.head,
            stored: last_block * lanes,
        };
        let cols = d / lanes;
        // A single row gains nothing from value chunks: one pass over its positions.
        let step = if n == 1 { CHUNK } else { VALUE_CHUNK };
        let mut col = 0;
        while col < cols {
            let wide = col + C <= cols;
            let mut from = lo;
            while from < end {
                let to = (from + step).min(end);
                // 16-bit values of as many rows: this chunk's columns widened to f32 once,
                // as the keys are.
                if widen {
                    let w = widened.as_mut_ptr();
                    let len = if wide { C } else { 1 } * lanes;
                    for p in from..to {
                        let (src, at) = (values.add(p * width + col * lanes), (p - from) * width);
                        let ahead = if p + step < end { len } else { 0 };
                        let next = src.wrapping_add(step * width);
                        widen_into::<V, E>(src, len, w.add(at + col * lanes), next, ahead, true);
                    }
                    // (The widening asked for the next chunk: nothing more ahead.)
                    let sums = |i: usize| ValueSums {
                        probs: row_s(i),
                        values: w.cast_const(),
                        width,
                        head: parts.head,
                        stored: 0,
                    };
                    value_rows::<V, f32, G, C>(
                        &sums, n, from, to, lo, from, &stored, parts, col, wide,
                    );
                } else {
                    value_rows::<V, E, G, C>(&sums, n, from, to, lo, 0, &stored, parts, col, wide);
                }
                from = to;
            }
            for i in (0..n).filter(|&i| hi(i) > stored(i)) {
                let rows = (stored(i)..hi(i)).map(|p| (p - lo, job.store_row(i, p)));
                let (s, o) = ([sums(i)], [parts.at(i, 0)]);
                match wide {
                    true => value_tile::<V, E, G, C, 1, _>(&s, rows, stored(i) > lo, col, o),
                    false => value_tile::<V, E, G, 1, 1, _>(&s, rows, stored(i) > lo, col, o),
                }
            }
            col += if wide { C } else { 1 };
        }
    }
}

/// Adds store positions `from..to` into the value sums of the tile's `n` rows (each up to where
/// its stored positions end), columns `col..` (`C` of them where `wide`, else one): two rows
/// share each value load where the registers hold both tiles. Position `p` is read at value row
/// `p - shift` of `sums`.
///
/// # Safety
/// As [`run`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn value_rows<V: Lanes, X: WeightElement, const G: usize, const C: usize>(
    sums: &impl Fn(usize) -> ValueSums<X>,
    n: usize,
    from: usize,
    to: usize,
    lo: usize,
    shift: usize,
    stored: &impl Fn(usize) -> usize,
    parts: Parts,
    col: usize,
    wide: bool,
) {
    unsafe {
        let mut i = 0;
        while i < n {
            // Two rows share each value load where the registers hold both tiles: over
            // the positions both reach, then the longer row alone (its sums continue
            // from what the pair stored, so every chain keeps its order).
            let end_i = to.min(stored(i));
            let end_j = if i + 1 < n {
                to.min(stored(i + 1))
            } else {
                from
            };
            let both = end_i.min(end_j);
            if pairs::<V, G, C>() && wide && both > from {
                let rows = (from..both).map(|p| (p - lo, p - shift));
                let (s, o) = ([sums(i), sums(i + 1)], [parts.at(i, 0), parts.at(i + 1, 0)]);
                value_tile::<V, X, G, C, 2, _>(&s, rows, from > lo, col, o);
                for (r, end) in [(i, end_i), (i + 1, end_j)] {
                    if end > both {
                        let rows = (both..end).map(|p| (p - lo, p - shift));
                        let (s, o) = ([sums(r)], [parts.at(r, 0)]);
                        value_tile::<V, X, G, C, 1, _>(&s, rows, true, col, o);
                    }
                }
                i += 2;
                continue;
            }
            let range = from..end_i;
            i += 1;
            if range.is_empty() {
                continue;
            }
            let rows = range.map(|p| (p - lo, p - shift));
            let (s, o) = ([sums(i - 1)], [parts.at(i - 1, 0)]);
            match wide {
                true => value_tile::<V, X, G, C, 1, _>(&s, rows, from > lo, col, o),
                false => value_tile::<V, X, G, 1, 1, _>(&s, rows, from > lo, col, o),
            }
        }
    }
}

/// Floats of a task's widened keys or values: a tile of key blocks or a chunk of value rows.
fn widened_len(d: usize, block: usize) -> usize {
    (WIDE_KEY_BLOCKS * block).max(VALUE_CHUNK) * d
}

/// `dst[..len] = src[..len]` widened to f32 (exact), asking meanwhile for the first `ahead`
/// elements from `next` (into L1 where `to_l1`, else L2).
///
/// # Safety
/// `len` is a multiple of `V::WIDTH`, `src` holds `len` elements and `dst` room for them.
#[inline(always)]
unsafe fn widen_into<V: Lanes, E: WeightElement>(
    src: *const E,
    len: usize,
    dst: *mut f32,
    next: *const E,
    ahead: usize,
    to_l1: bool,
) {
    let per_line = LINE / size_of::<E>();
    for e in (0..len).step_by(V::WIDTH) {
        if e < ahead && e.is_multiple_of(per_line) {
            // (Never dereferenced; prefetches do not fault.)
            let at = next.wrapping_add(e).cast::<u8>();
            // SAFETY: prefetches never fault.
            unsafe { V::prefetch_into(at, to_l1) };
        }
        // SAFETY: e + WIDTH <= len elements, as the caller promises.
        unsafe { V::load_weights(src.add(e)).store(dst.add(e)) };
    }
}

/// Scores of `G` heads against the `T` key blocks from `keys` (blocks `block_stride` apart),
/// stored at `scores + h · padded + t · 8`.
///
/// # Safety
/// As [`run`].
#[inline(always)]
unsafe fn score_tile<V: Lanes, E: WeightElement, const G: usize, const T: usize>(
    q: *const f32,
    d: usize,
    keys: *const E,
    block_stride: usize,
    scores: *mut f32,
    padded: usize,
    ahead: Ahead,
) {
    unsafe {
        let mut acc = [[V::zero(); G]; T];
        let next = keys.wrapping_add(T * block_stride);
        let per_line = LINE / size_of::<E>();
        for c in 0..d {
            // One line of each of the next tile's blocks where this step starts a line of
            // them (never dereferenced; prefetches do not fault).
            if ahead.blocks > 0 && (c * V::WIDTH).is_multiple_of(per_line) {
                for t in 0..ahead.blocks {
                    let at = next
                        .wrapping_add(t * block_stride + c * V::WIDTH)
                        .cast::<u8>();
                    V::prefetch_into(at, ahead.to_l1);
                }
            }
            let mut qs = [V::zero(); G];
            for (h, q_h) in qs.iter_mut().enumerate() {
                *q_h = V::splat(q.add(h * d + c));
            }
            for (t, acc) in acc.iter_mut().enumerate() {
                let k = V::load_weights(keys.add(t * block_stride + c * V::WIDTH));
                for (a, q_h) in acc.iter_mut().zip(&qs) {
                    *a = V::mul_add(*q_h, k, *a);
                }
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            for (h, a) in acc.iter().enumerate() {
                a.store(scores.add(h * padded + t * V::WIDTH));
            }
        }
    }
}

/// Scores of `G` heads against `count` consecutive key blocks from `keys`, stored as
/// [`score_tile`] stores them: in tiles of `T` blocks, then of 4, 2 and 1 (never more than `T`)
/// for what is left, so that the blocks at the end of a row still run several chains each (one
/// block alone leaves only `G`, too few to hide the multiply-add latency).
///
/// # Safety
/// As [`score_tile`], with `count` blocks at `keys` and room for their scores.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn score_blocks<V: Lanes, E: WeightElement, const G: usize, const T: usize>(
    q: *const f32,
    d: usize,
    keys: *const E,
    block_stride: usize,
    scores: *mut f32,
    padded: usize,
    count: usize,
    ahead: Ahead,
) {
    let mut t = 0;
    while t < count {
        let left = count - t;
        // Only a whole tile asks for the next (a shorter one is a row's last).
        let none = Ahead::NONE;
        // SAFETY: blocks t.. are among the `count` promised.
        unsafe {
            let (k, s) = (keys.add(t * block_stride), scores.add(t * V::WIDTH));
            t += if left >= T {
                score_tile::<V, E, G, T>(q, d, k, block_stride, s, padded, ahead);
                T
            } else if T >= 4 && left >= 4 {
                score_tile::<V, E, G, 4>(q, d, k, block_stride, s, padded, none);
                4
            } else if T >= 2 && left >= 2 {
                score_tile::<V, E, G, 2>(q, d, k, block_stride, s, padded, none);
                2
            } else {
                score_tile::<V, E, G, 1>(q, d, k, block_stride, s, padded, none);
                1
            };
        }
    }
}

/// The key blocks a score tile asks for while it runs: `blocks` blocks after its own (at most
/// its own count), into L1 (`to_l1`) or L2.
#[derive(Clone, Copy)]
struct Ahead {
    blocks: usize,
    to_l1: bool,
}

impl Ahead {
    const NONE: Ahead = Ahead {
        blocks: 0,
        to_l1: false,
    };
}

/// Where a value sum reads and writes: probabilities `probs: [G][CHUNK]` (indexed from the
/// chunk's start), value rows `width` apart, and the heads' sums `head` apart; rows from
/// `stored` on are not asked for ahead of time (past the sequences of the tile).
struct ValueSums<E> {
    probs: *const f32,
    values: *const E,
    width: usize,
    head: usize,
    stored: usize,
}

/// Whether two rows' value tiles (`2 · G · C` accumulators, `2 · G` broadcast probabilities
/// and a loaded value vector) fit the registers: only with AVX-512's 32.
const fn pairs<V: Lanes, const G: usize, const C: usize>() -> bool {
    V::WIDTH == WIDE && 2 * G * C + 2 * G < 32
}

/// Adds `(probability index, value row)` pairs `rows` into the weighted sums of `G` heads over
/// value columns `col..col + C` (each one register wide) of `R` block rows at once (`s[r]`
/// and `out[r]`: row `r`'s probabilities and sums; the value rows are the same for all),
/// continuing the sums stored there when `more`. Each value load serves all `R` rows; every
/// sum is still its own chain over the positions in order.
///
/// # Safety
/// As [`run`].
#[inline(always)]
unsafe fn value_tile<
    V: Lanes,
    E: WeightElement,
    const G: usize,
    const C: usize,
    const R: usize,
    I: Iterator<Item = (usize, usize)>,
>(
    s: &[ValueSums<E>; R],
    rows: I,
    more: bool,
    col: usize,
    out: [*mut f32; R],
) {
    unsafe {
        let (values, width, head) = (s[0].values, s[0].width, s[0].head);
        let mut acc = [[[V::zero(); C]; G]; R];
        if more {
            for (acc, out) in acc.iter_mut().zip(out) {
                for (h, acc) in acc.iter_mut().enumerate() {
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a = V::load(out.add(h * head + (col + j) * V::WIDTH));
                    }
                }
            }
        }
        // Value rows [`l1_ahead_bytes`] on, this call's columns of them.
        let row_bytes = width * size_of::<E>();
        let ahead = l1_ahead_bytes().div_ceil(row_bytes);
        let lines = (C * V::WIDTH * size_of::<E>()).div_ceil(LINE);
        for (p, row) in rows {
            let v_row = values.add(row * width + col * V::WIDTH);
            if row + ahead < s[0].stored {
                // (Never dereferenced; prefetches do not fault.)
                let at = v_row.wrapping_add(ahead * width).cast::<u8>();
                for line in 0..lines {
                    V::prefetch(at.wrapping_add(line * LINE));
                }
            }
            let mut weights = [[V::zero(); G]; R];
            for (weights, s) in weights.iter_mut().zip(s) {
                for (h, w) in weights.iter_mut().enumerate() {
                    *w = V::splat(s.probs.add(h * CHUNK + p));
                }
            }
            for j in 0..C {
                let v = V::load_weights(v_row.add(j * V::WIDTH));
                for (acc, weights) in acc.iter_mut().zip(&weights) {
                    for (acc, w) in acc.iter_mut().zip(weights) {
                        acc[j] = V::mul_add(*w, v, acc[j]);
                    }
                }
            }
        }
        for (acc, out) in acc.iter().zip(out) {
            for (h, acc) in acc.iter().enumerate() {
                for (j, a) in acc.iter().enumerate() {
                    a.store(out.add(h * head + (col + j) * V::WIDTH));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_inputs::same_bits;

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

    /// `x` rounded to `E` and back.
    fn rounded<E: WeightElement>(x: &[f32]) -> Vec<f32> {
        x.iter().map(|&v| E::from_f32(v).to_f32()).collect()
    }

    fn run<E: WeightElement>(
        isa_portable: bool,
        q: &[f32],
        kv: &KvStore<E>,
        first: usize,
        h: Heads,
        pool: &Pool,
    ) -> Vec<f32> {
        let mut out = vec![0f32; q.len()];
        if isa_portable {
            // One row per tile, the portable lanes, every chunk folded in one task.
            let w = h.q * h.d;
            for r in 0..q.len() / w {
                let group = h.q / h.kv;
                for g in 0..h.kv {
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
                    };
                    let o = out[r * w + g * group * h.d..].as_mut_ptr();
                    tile_for(Isa::Portable, &job, Work::Fold { out: o, stride: w });
                }
            }
        } else {
            attend(q, h.q * h.d, kv, first, h, None, &mut out, pool);
        }
        out
    }

    #[test]
    fn matches_reference_rows_are_batch_invariant_and_simd_equals_portable() {
        // Every group size has its own register tiles (in both widths: d a multiple of 16
        // also runs 16-lane blocks); d = 24 leaves partial column tiles.
        for (q, kv, d) in [
            (6, 2, 24),
            (3, 3, 64),
            (9, 3, 64),
            (4, 2, 16),
            (8, 2, 8),
            (10, 2, 24),
            (8, 1, 32),
            (4, 4, 32),
            (8, 2, 16),
            (10, 2, 16),
            (12, 2, 16),
            (7, 1, 16),
        ] {
            check(Heads { q, kv, d });
        }
    }

    fn check(h: Heads) {
        // A short cache (one softmax chunk); one longer than a value chunk with rows over
        // several tiles and two chunks; several chunks, rows crossing a chunk boundary; rows
        // ending 5-7 key blocks into a chunk (tiles of 4, 2 and 1 blocks after the last whole
        // tile).
        check_block(h, 13, 5);
        check_block(h, 70, 40);
        check_block(h, 150, 19);
        check_block(h, 3 * CHUNK - 2, 5);
    }

    fn check_block(h: Heads, first: usize, rows: usize) {
        check_block_of::<f32>(h, first, rows);
        check_block_of::<half::f16>(h, first, rows);
    }

    /// As [`check_block`] for keys and values stored as `E` (the reference reads them rounded).
    fn check_block_of<E: WeightElement>(h: Heads, first: usize, rows: usize) {
        assert!(h.supported());
        let pool = Pool::new(3);
        let n = first + rows;
        let k = rounded::<E>(&values(n * h.kv * h.d, 1));
        let v = rounded::<E>(&values(n * h.kv * h.d, 2));
        let q = values(rows * h.q * h.d, 3);
        let want = reference(&q, &k, &v, first, h);
        let mut first_layout: Option<Vec<f32>> = None;
        // Both key layouts (8 and, where d allows, 16 positions per block), each read by the
        // portable lanes and by SIMD where the CPU has the matching width: the same bits.
        for layout in [NARROW, WIDE] {
            let empty = KvStore::<E>::with_block(h.kv, h.d, layout);
            let kv = KvStore::from_rows_in(empty, &k, &v);
            assert_eq!(kv.rows(n), (k.clone(), v.clone()));
            let block = run(false, &q, &kv, first, h, &pool);
            for (got, want) in block.iter().zip(&want) {
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
            match &first_layout {
                None => first_layout = Some(block),
                Some(narrow) => assert!(same_bits(narrow, &block), "layout {layout}"),
            }
        }
    }

    #[test]
    fn a_tree_row_equals_its_path_as_a_causal_block() {
        // A cache of one chunk, a path crossing into the next chunk, and several chunks; both
        // key layouts.
        for layout in [NARROW, WIDE] {
            for first in [70, CHUNK - 3, 2 * CHUNK + 5] {
                check_tree(first, layout);
            }
        }
    }

    fn check_tree(first: usize, layout: usize) {
        check_tree_of::<f32>(first, layout);
        check_tree_of::<half::f16>(first, layout);
    }

    fn check_tree_of<E: WeightElement>(first: usize, layout: usize) {
        let h = Heads { q: 9, kv: 3, d: 64 };
        let w = h.q * h.d;
        let kvw = h.kv * h.d;
        // Root, two children, a grandchild of the second, and a deeper chain under it.
        let mask = TreeMask::try_new(vec![
            None,
            Some(0),
            Some(0),
            Some(2),
            Some(3),
            Some(1),
            Some(4),
            Some(6),
        ])
        .unwrap();
        let rows = mask.rows();
        let k = values((first + rows) * kvw, 4);
        let v = values((first + rows) * kvw, 5);
        let store = || KvStore::<E>::with_block(h.kv, h.d, layout);
        let kv = KvStore::from_rows_in(store(), &k, &v);
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
            let alone = KvStore::from_rows_in(store(), &gather(&k), &gather(&v));
            let last = slots.len() - 1;
            let mut want = vec![0f32; w];
            let row_q = &q[r * w..(r + 1) * w];
            attend(row_q, w, &alone, last, h, None, &mut want, &Pool::new(1));
            assert_eq!(
                out[r * w..(r + 1) * w],
                want[..],
                "first {first}, row {r}, layout {layout}"
            );
        }
    }

    #[test]
    fn an_f16_store_rounds_to_nearest_and_reads_back_exactly() {
        let (heads, d) = (2, 16);
        // Values with more bits than f16 holds (`values` gives multiples of 2^-12).
        let fine = |seed| -> Vec<f32> {
            values(3 * heads * d, seed)
                .iter()
                .map(|x| x * 1.0001 + 3e-5)
                .collect()
        };
        let (k, v) = (fine(9), fine(10));
        let f16 = HostKv::from_rows(KvDtype::F16, heads, d, &k, &v);
        assert_eq!(f16.dtype(), KvDtype::F16);
        let (k16, v16) = f16.rows(3);
        assert_eq!(
            (k16, v16),
            (rounded::<half::f16>(&k), rounded::<half::f16>(&v))
        );
        assert_ne!(rounded::<half::f16>(&k), k, "the test values need rounding");
        let f32 = HostKv::from_rows(KvDtype::F32, heads, d, &k, &v);
        assert_eq!(f32.rows(3), (k, v));
        // Beyond f16's range: the largest finite value, not infinity; NaN stays NaN.
        let mut big = vec![1.0f32; heads * d];
        (big[0], big[1], big[2]) = (1e6, -7e4, f32::NAN);
        let (kb, vb) = HostKv::from_rows(KvDtype::F16, heads, d, &big, &big).rows(1);
        assert_eq!(
            (kb[0], kb[1], vb[0], vb[1]),
            (65_504.0, -65_504.0, 65_504.0, -65_504.0)
        );
        assert!(kb[2].is_nan() && vb[2].is_nan());
    }

    #[test]
    fn the_store_keeps_its_positions_when_it_grows_and_copies() {
        for layout in [NARROW, WIDE] {
            check_store::<f32>(layout);
            check_store::<half::f16>(layout);
        }
    }

    fn check_store<E: WeightElement>(layout: usize) {
        let (heads, d) = (3, 16);
        let width = heads * d;
        let k = rounded::<E>(&values(40 * width, 7));
        let v = rounded::<E>(&values(40 * width, 8));
        let empty = KvStore::<E>::with_block(heads, d, layout);
        let mut store = KvStore::from_rows_in(empty, &k[..20 * width], &v[..20 * width]);
        store.reserve(40);
        assert!(store.capacity() >= 40);
        for pos in 20..40 {
            store.write(pos, &k[pos * width..][..width], &v[pos * width..][..width]);
        }
        assert_eq!(store.rows(40), (k.clone(), v.clone()));
        store.copy_position(33, 21);
        let (k2, v2) = store.rows(40);
        assert_eq!(k2[21 * width..22 * width], k[33 * width..34 * width]);
        assert_eq!(v2[21 * width..22 * width], v[33 * width..34 * width]);
        assert_eq!(k2[20 * width..21 * width], k[20 * width..21 * width]);
    }
}
