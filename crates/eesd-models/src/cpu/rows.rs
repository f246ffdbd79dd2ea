//! Per-row operations of a decoder layer on host f32 rows: RMSNorm, RoPE and SiLU gating (with
//! the vectorisable `exp` of [`eesd_core::math`]).
//!
//! Each function treats one row at a time with plain IEEE operations in a fixed order (sums in
//! eight explicit partial sums, no fused multiply-adds), so a row's result never depends on the
//! rows around it or on how the compiler vectorises the loop: blocks stay bit-identical to rows
//! computed alone.

simd_fn! {
    /// `out = x / sqrt(mean(x²) + eps) · gamma` for one row.
    pub fn rms_norm(x: &[f32], gamma: &[f32], eps: f32, out: &mut [f32]) {
        let mean = sum_of_squares(x) / x.len() as f32;
        let rms = (mean + eps).sqrt();
        for ((o, &v), &g) in out.iter_mut().zip(x).zip(gamma) {
            *o = v / rms * g;
        }
    }
}

/// `x += y`, element by element (a residual addition).
#[inline(always)]
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

/// The largest value of `x` (−∞ when empty; NaNs are passed over): [`max_each`] of one slice.
#[inline(always)]
pub fn max(x: &[f32]) -> f32 {
    let [m] = max_each([x]);
    m
}

/// `Σ x` in eight partial sums added in a fixed tree, then the tail in order: [`sum_each`] of
/// one slice.
#[inline(always)]
pub fn sum(x: &[f32]) -> f32 {
    let [s] = sum_each([x]);
    s
}

/// The largest value of each of `N` slices of one length (−∞ when empty; NaNs are passed
/// over), in eight lanes per slice that the compiler turns into vector max instructions. Each
/// slice's lanes and order are the same whatever `N` (the same value as alone); several slices
/// at once give `N` times the independent chains, so short slices (a softmax's per-head
/// scores) are not bound by the latency of one chain.
#[inline(always)]
pub fn max_each<const N: usize>(xs: [&[f32]; N]) -> [f32; N] {
    let len = xs.first().map_or(0, |x| x.len());
    debug_assert!(xs.iter().all(|x| x.len() == len));
    let whole = len / 8 * 8;
    let mut lanes = [[f32::NEG_INFINITY; 8]; N];
    for at in (0..whole).step_by(8) {
        for (lanes, x) in lanes.iter_mut().zip(xs) {
            let c = &x[at..at + 8];
            for l in 0..8 {
                lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
            }
        }
    }
    std::array::from_fn(|i| {
        lanes[i]
            .into_iter()
            .chain(xs[i][whole..].iter().copied())
            .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
    })
}

/// `Σ x` of each of `N` slices of one length, in eight partial sums per slice added in a fixed
/// tree, then the tail in order: the same value whatever `N`, with `N` times the independent
/// chains.
#[inline(always)]
pub fn sum_each<const N: usize>(xs: [&[f32]; N]) -> [f32; N] {
    let len = xs.first().map_or(0, |x| x.len());
    debug_assert!(xs.iter().all(|x| x.len() == len));
    let whole = len / 8 * 8;
    let mut acc = [[0f32; 8]; N];
    for at in (0..whole).step_by(8) {
        for (acc, x) in acc.iter_mut().zip(xs) {
            let c = &x[at..at + 8];
            for l in 0..8 {
                acc[l] += c[l];
            }
        }
    }
    std::array::from_fn(|i| {
        let mut s = tree_sum(acc[i]);
        for &v in &xs[i][whole..] {
            s += v;
        }
        s
    })
}

/// The unnormalised softmax of each of `N` score slices of one length, in place:
/// `x ← e^(x·scale − m)`, with `m` the slice's largest scaled value; returns each slice's `m`
/// and the sum of its exponentials ([`sum_each`]).
///
/// Three passes where scaling first took four: the maximum is found on the raw scores and
/// then scaled, which is the same number, as rounding is monotonic and `scale > 0`
/// (`max(x·s) = max(x)·s` exactly; only where a tiny negative score scales to −0 beside a +0
/// can the zero maximum's sign differ, which no exponential sees). Each pass runs over a whole
/// slice, so that it vectorises.
#[inline(always)]
pub fn softmax_each<const N: usize>(mut xs: [&mut [f32]; N], scale: f32) -> ([f32; N], [f32; N]) {
    debug_assert!(scale > 0.0);
    let maxes = max_each(std::array::from_fn(|i| &*xs[i])).map(|m| m * scale);
    for (x, &max) in xs.iter_mut().zip(&maxes) {
        for v in x.iter_mut() {
            *v = exp(*v * scale - max);
        }
    }
    (maxes, sum_each(xs.map(|x| &*x)))
}

/// `Σ x²` in eight partial sums added in a fixed tree, then the tail in order.
#[inline(always)]
pub fn sum_of_squares(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l] * c[l];
        }
    }
    let mut s = tree_sum(acc);
    for &v in tail {
        s += v * v;
    }
    s
}

/// `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`: the upper half added onto the lower.
#[inline(always)]
pub fn tree_sum(mut a: [f32; 8]) -> f32 {
    for l in 0..4 {
        a[l] += a[l + 4];
    }
    for l in 0..2 {
        a[l] += a[l + 2];
    }
    a[0] + a[1]
}

simd_fn! {
    /// Rotates each head of `row: [heads · d]` by the position's tables `cos, sin: [d]` (halves
    /// duplicated), rotate-half convention: `x·cos + [−x₂, x₁]·sin`.
    pub fn rope(row: &mut [f32], d: usize, cos: &[f32], sin: &[f32]) {
        let half = d / 2;
        // Zipped slices (no index checks in the loop), so that it vectorises.
        let (cos1, cos2) = cos[..d].split_at(half);
        let (sin1, sin2) = sin[..d].split_at(half);
        for head in row.chunks_exact_mut(d) {
            let (x1, x2) = head.split_at_mut(half);
            let pairs = x1.iter_mut().zip(x2.iter_mut());
            let tables = cos1.iter().zip(sin1).zip(cos2.iter().zip(sin2));
            for ((x1, x2), ((&c1, &s1), (&c2, &s2))) in pairs.zip(tables) {
                let (a, b) = (*x1, *x2);
                *x1 = a * c1 + (-b) * s1;
                *x2 = b * c2 + a * s2;
            }
        }
    }
}

simd_fn! {
    /// `out = silu(gate) · up`, `silu(g) = g / (1 + e^−g)`.
    pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + exp(-g)) * u;
        }
    }
}

/// The vectorisable `e^x` of the sampler, shared (it lives in eesd-core, the lower crate).
pub use eesd_core::math::exp;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_inputs::same_bits;

    /// What [`max`] promises, one value at a time: lane `i % 8` over the whole groups of eight,
    /// then the lanes and the tail folded in order.
    fn max_by_rule(x: &[f32]) -> f32 {
        let whole = x.len() / 8 * 8;
        let mut lanes = [f32::NEG_INFINITY; 8];
        for (i, &v) in x[..whole].iter().enumerate() {
            if v > lanes[i % 8] {
                lanes[i % 8] = v;
            }
        }
        lanes
            .into_iter()
            .chain(x[whole..].iter().copied())
            .fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
    }

    /// What [`sum`] promises, one value at a time: lane `i % 8` over the whole groups of eight,
    /// the lanes added in the fixed tree, then the tail in order.
    fn sum_by_rule(x: &[f32]) -> f32 {
        let whole = x.len() / 8 * 8;
        let mut lanes = [0f32; 8];
        for (i, &v) in x[..whole].iter().enumerate() {
            lanes[i % 8] += v;
        }
        x[whole..].iter().fold(tree_sum(lanes), |s, &v| s + v)
    }

    /// `len` deterministic values in `offset .. offset + 2^24 · step`.
    fn scores(len: usize, seed: u32, step: f32, offset: f32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| ((i ^ seed).wrapping_mul(2_654_435_761) >> 8) as f32 * step + offset)
            .collect()
    }

    #[test]
    fn reductions_of_several_slices_equal_each_alone() {
        for len in [0, 1, 7, 8, 9, 64, 100, 128] {
            let row = |seed| scores(len, seed, 1e-6, -5.0);
            let (mut a, b, mut c) = (row(1), row(2), row(3));
            if len > 8 {
                // NaN is passed over by the maximum; infinities win it.
                a[3] = f32::NAN;
                c[len - 1] = f32::INFINITY;
            }
            let each = max_each([&a[..], &b, &c]);
            let alone = [max(&a), max(&b), max(&c)];
            assert!(same_bits(&each, &alone), "max, {len}");
            let rule = [max_by_rule(&a), max_by_rule(&b), max_by_rule(&c)];
            assert!(same_bits(&alone, &rule), "max rule, {len}");
            let each = sum_each([&a[..], &b, &c]);
            let alone = [sum(&a), sum(&b), sum(&c)];
            assert!(same_bits(&each, &alone), "sum, {len}");
            let rule = [sum_by_rule(&a), sum_by_rule(&b), sum_by_rule(&c)];
            assert!(same_bits(&alone, &rule), "sum rule, {len}");
        }
    }

    #[test]
    fn the_softmax_equals_its_four_passes() {
        for len in [0, 1, 7, 8, 9, 64, 100, 128] {
            let row = |seed| scores(len, seed, 1e-5, -60.0);
            let scale = 0.125;
            let (mut a, mut b, mut c) = (row(1), row(2), row(3));
            if len > 8 {
                a[3] = f32::NAN;
                c[len - 1] = f32::NEG_INFINITY;
            }
            let mut want = [a.clone(), b.clone(), c.clone()];
            want.iter_mut().flatten().for_each(|x| *x *= scale);
            let maxes = max_each([&want[0][..], &want[1], &want[2]]);
            for (w, &m) in want.iter_mut().zip(&maxes) {
                w.iter_mut().for_each(|x| *x = exp(*x - m));
            }
            let sums = sum_each([&want[0][..], &want[1], &want[2]]);
            let (got_max, got_sum) = softmax_each([&mut a[..], &mut b, &mut c], scale);
            assert!(same_bits(&got_max, &maxes), "max, {len}");
            assert!(same_bits(&got_sum, &sums), "sum, {len}");
            for (got, want) in [a, b, c].iter().zip(&want) {
                assert!(same_bits(got, want), "values, {len}");
            }
        }
    }

    #[test]
    fn rms_norm_matches_its_definition() {
        let x: Vec<f32> = (0..37).map(|i| i as f32 * 0.1 - 1.5).collect();
        let g: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut out = vec![0f32; 37];
        rms_norm(&x, &g, 1e-5, &mut out);
        let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 37.0;
        for i in 0..37 {
            let want = x[i] as f64 / (ms + 1e-5).sqrt() * g[i] as f64;
            assert!((out[i] as f64 - want).abs() < 1e-5);
        }
    }

    #[test]
    fn rope_rotates_pairs_of_halves() {
        let d = 4;
        let mut row = vec![1.0, 2.0, 3.0, 4.0];
        let (c, s) = (0.5f32, 0.75f32);
        rope(&mut row, d, &[c; 4], &[s; 4]);
        assert_eq!(
            row,
            vec![
                1.0 * c - 3.0 * s,
                2.0 * c - 4.0 * s,
                3.0 * c + 1.0 * s,
                4.0 * c + 2.0 * s
            ]
        );
    }
}
