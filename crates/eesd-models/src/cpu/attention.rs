//! Causal grouped-query attention of a block of new rows against keys and values on the host.
//!
//! Keys and values are stored `[position][kv_head][head_dim]`. Row `r` of a block whose first
//! row sits at position `first` attends to positions `0..=first + r`. Each (row, kv head) pair
//! is one task: its query heads' scores, softmax and weighted sum of values are computed in a
//! fixed order that does not depend on the other rows, so a block gives the same bits as its
//! rows one at a time.

use std::cell::RefCell;

use super::pool::Pool;
use super::rows::{exp, tree_sum};

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

/// Keys and values of positions `0..len`, `[position][kv_head][d]` each.
#[derive(Debug, Clone, Copy)]
pub struct KvRows<'a> {
    /// Keys.
    pub k: &'a [f32],
    /// Values.
    pub v: &'a [f32],
}

/// Writes `out[r] = attention(q[r])` for each row `r` of the block: `q` rows hold the query
/// heads at the start of rows `q_stride` apart, `out` rows are `heads.q · d` wide. `kv` must
/// hold at least `first + rows` positions.
pub fn attend(
    q: &[f32],
    q_stride: usize,
    kv: KvRows<'_>,
    first: usize,
    heads: Heads,
    out: &mut [f32],
    pool: &Pool,
) {
    let Heads { q: nh, kv: nkv, d } = heads;
    let rows = out.len() / (nh * d);
    debug_assert!(kv.k.len() >= (first + rows) * nkv * d && q.len() >= rows * q_stride);
    let group = nh / nkv;
    let scale = 1.0 / (d as f32).sqrt();
    let out_ptr = SharedOut(out.as_mut_ptr());
    pool.run(rows * nkv, &|task| {
        let (r, g) = (task / nkv, task % nkv);
        let positions = first + r + 1;
        SCORES.with_borrow_mut(|scores| {
            scores.resize(positions, 0.0);
            for hq in g * group..(g + 1) * group {
                let qh = &q[r * q_stride + hq * d..][..d];
                // SAFETY: task (r, g) writes only row r's heads of group g.
                let oh = unsafe { out_ptr.slice(r * nh * d + hq * d, d) };
                head(qh, kv, g * d, nkv * d, scale, scores, oh);
            }
        });
    });
}

thread_local! {
    /// Score buffer reused by every call on this thread.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One query head over `scores.len()` positions of the kv head at column `col` (rows `width`
/// apart).
fn head(
    q: &[f32],
    kv: KvRows<'_>,
    col: usize,
    width: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = q.len();
    let mut max = f32::NEG_INFINITY;
    for (i, s) in scores.iter_mut().enumerate() {
        *s = dot(q, &kv.k[i * width + col..][..d]) * scale;
        max = max.max(*s);
    }
    let mut partial = [0f32; 8];
    for (i, s) in scores.iter_mut().enumerate() {
        *s = exp(*s - max);
        partial[i % 8] += *s;
    }
    let inv = 1.0 / tree_sum(partial);
    out.fill(0.0);
    for (i, &p) in scores.iter().enumerate() {
        let v = &kv.v[i * width + col..][..d];
        for (o, &vv) in out.iter_mut().zip(v) {
            *o += p * vv;
        }
    }
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// `Σ a·b` in eight partial sums (fixed tree), then the tail in order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = tree_sum(acc);
    for (x, y) in ta.iter().zip(tb) {
        s += x * y;
    }
    s
}

/// The output buffer, shared by tasks that write disjoint heads.
struct SharedOut(*mut f32);

// SAFETY: tasks write disjoint ranges.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    /// The range is inside the buffer and no other task touches it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
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

    /// Straightforward f64 attention.
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

    #[test]
    fn matches_reference_and_rows_are_batch_invariant() {
        let h = Heads { q: 6, kv: 2, d: 20 };
        let pool = Pool::new(3);
        let (first, rows) = (13, 5);
        let n = first + rows;
        let k = values(n * h.kv * h.d, 1);
        let v = values(n * h.kv * h.d, 2);
        let q = values(rows * h.q * h.d, 3);
        let kv = KvRows { k: &k, v: &v };
        let mut block = vec![0f32; rows * h.q * h.d];
        attend(&q, h.q * h.d, kv, first, h, &mut block, &pool);
        for (got, want) in block.iter().zip(reference(&q, &k, &v, first, h)) {
            assert!((*got as f64 - want).abs() < 1e-5, "{got} vs {want}");
        }
        let w = h.q * h.d;
        for r in 0..rows {
            let mut alone = vec![0f32; w];
            attend(
                &q[r * w..(r + 1) * w],
                w,
                kv,
                first + r,
                h,
                &mut alone,
                &Pool::new(1),
            );
            assert_eq!(alone, block[r * w..(r + 1) * w]);
        }
    }
}
