//! Turning logits into a next-token distribution (temperature, top-k, top-p) and drawing from it.
//!
//! The same [`SamplingParams`] are applied to draft and target logits, which is what speculative
//! sampling needs to reproduce the autoregressive distribution exactly.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};
use crate::math::{exp, sum_f64};

/// Below this exponent [`exp`] saturates (at 2^−126): the distribution gives such tokens 0.
const EXP_FLOOR: f32 = -87.3;

/// How a token is chosen from logits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `k` most likely tokens (`0` = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (`1` = all).
    pub top_p: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams::greedy()
    }
}

impl SamplingParams {
    /// Argmax decoding.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }

    /// Whether this is argmax decoding.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(CoreError::InvalidConfig(format!(
                "temperature {} must be >= 0",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(CoreError::InvalidConfig(format!(
                "top_p {} must be in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }

    /// The distribution these params define over `logits` (sums to 1; zeros outside top-k/top-p).
    /// Greedy params give a one-hot distribution on the argmax.
    pub fn distribution(&self, logits: &[f32]) -> Vec<f32> {
        let mut probs = vec![0f32; logits.len()];
        if logits.is_empty() {
            return probs;
        }
        if self.is_greedy() {
            probs[argmax(logits)] = 1.0;
            return probs;
        }
        let inv_t = 1.0 / self.temperature;
        let max = block_max(logits);
        // A pass the compiler vectorises (a libm `exp` per token cost ≈ 0.2 ms per draw, 6% of
        // a decoding step); tokens far below the maximum (a −∞ logit among them) get exactly 0,
        // where this `exp` would saturate at 2^−126.
        for (p, &l) in probs.iter_mut().zip(logits) {
            let x = (l - max) * inv_t;
            *p = if x < EXP_FLOOR { 0.0 } else { exp(x) };
        }
        let mut sum = sum_f64(&probs);
        let restrict = self.top_k > 0 && self.top_k < logits.len() || self.top_p < 1.0;
        if restrict {
            let k = if self.top_k == 0 {
                logits.len()
            } else {
                self.top_k.min(logits.len())
            };
            let (order, cut) = nucleus(&probs, k, self.top_p as f64 * sum);
            let mut kept = vec![false; probs.len()];
            order[..cut].iter().for_each(|&i| kept[i] = true);
            for (p, keep) in probs.iter_mut().zip(kept) {
                if !keep {
                    *p = 0.0;
                }
            }
            sum = order[..cut].iter().map(|&i| probs[i] as f64).sum();
        }
        let inv = (1.0 / sum) as f32;
        probs.iter_mut().for_each(|p| *p *= inv);
        probs
    }
}

/// The tokens top-k / top-p keep: the most probable first (ties by id), as many as reach `mass`
/// of (unnormalised) probability, at most `k`. Returns the ranked tokens (the best of them at
/// least: at most `k` are ranked) and how many are kept.
///
/// Ranking the whole vocabulary costs ≈ 2 ms for 49,152 tokens, half a decoding step of
/// SmolLM2-135M on two cores, while the nucleus is usually a few hundred tokens. So only the
/// tokens above a probability threshold are ranked, the threshold lowered until they hold the
/// cut: every token below it ranks after all of them, so the kept tokens, their order and their
/// sum are those of ranking everything (tested against that definition).
fn nucleus(probs: &[f32], k: usize, mass: f64) -> (Vec<usize>, usize) {
    let top = probs.iter().copied().fold(0f32, f32::max);
    let mut threshold = top;
    loop {
        threshold /= 64.0;
        if threshold < f32::MIN_POSITIVE {
            threshold = 0.0;
        }
        let mut order: Vec<usize> = (0..probs.len())
            .filter(|&i| probs[i] >= threshold)
            .collect();
        // One strict order (ties by id), so the first k after a selection are the first k of a
        // full sort; only they can be kept, so a top-k ranks k tokens, not every candidate.
        let rank = |&a: &usize, &b: &usize| probs[b].total_cmp(&probs[a]).then(a.cmp(&b));
        if order.len() > k {
            order.select_nth_unstable_by(k - 1, rank);
            order.truncate(k);
        }
        order.sort_unstable_by(rank);
        let mut kept = 0f64;
        for (rank, &i) in order.iter().enumerate().take(k) {
            kept += probs[i] as f64;
            if kept >= mass {
                return (order, rank + 1);
            }
        }
        // Not reached within these tokens: the cut is the k-th token if they hold k (or all).
        if order.len() >= k || threshold == 0.0 {
            let cut = k.min(order.len());
            return (order, cut);
        }
    }
}

/// Index of the largest value (the first one on ties; NaN never counts, except that a NaN
/// first value is kept, nothing being larger).
///
/// Every decoded token scans the vocabulary once per verified row, so the scan goes by blocks
/// of 256 values, each reduced to its maximum in vector registers, and only the block
/// holding the answer is searched: ≈ 3 µs for 49,152 values instead of ≈ 28 µs one by one,
/// with the same index (tested against the one-by-one definition).
pub fn argmax(values: &[f32]) -> usize {
    let Some(&first) = values.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    let (mut top, mut at) = (first, 0);
    for (b, block) in values.chunks(BLOCK).enumerate() {
        let m = block_max(block);
        if m > top {
            (top, at) = (m, b);
        }
    }
    let block = &values[at * BLOCK..values.len().min((at + 1) * BLOCK)];
    at * BLOCK + block.iter().position(|&v| v == top).unwrap_or(0)
}

/// The largest logit and the softmax's normaliser `Σ e^(l − max)` (f64), or `None` when the
/// largest logit is not finite (no logits, all NaN or −∞, or a +∞ among them). Draft
/// confidences take it once per row of head logits with the vectorisable [`exp`]: a lookahead
/// head's four children of 8,192 logits (this and their top-k) cost 15 µs a round, 44 µs with
/// a libm `exp` per logit, a tenth of the head's pass. Only drafts' weights depend on it, never
/// the output.
pub(crate) fn softmax_normaliser(logits: &[f32]) -> Option<(f32, f64)> {
    let max = block_max(logits);
    if !max.is_finite() {
        return None;
    }
    let exps: Vec<f32> = logits.iter().map(|&l| exp(l - max)).collect();
    Some((max, sum_f64(&exps)))
}

/// Values per block of [`block_max`] scans.
pub(crate) const BLOCK: usize = 256;

/// The largest value that is not NaN (−∞ when there is none), lane by lane in 16 independent
/// maxima so that the compiler keeps them in vector registers.
pub(crate) fn block_max(values: &[f32]) -> f32 {
    const LANES: usize = 16;
    let larger = |m: f32, v: f32| if v > m { v } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for i in 0..LANES {
            lanes[i] = larger(lanes[i], chunk[i]);
        }
    }
    let tail = tail.iter().copied().fold(f32::NEG_INFINITY, larger);
    lanes.into_iter().fold(tail, larger)
}

/// A seeded random source for sampling, deterministic under a seed.
#[derive(Debug)]
pub struct Sampler {
    rng: StdRng,
}

impl Sampler {
    /// A sampler seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Sampler {
            rng: StdRng::seed_from_u64(seed),
        }
    }

    /// A uniform draw in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        self.rng.random::<f32>()
    }

    /// Draws an index from a distribution (weights need not be normalised).
    pub fn categorical(&mut self, weights: &[f32]) -> usize {
        let total = sum_f64(weights);
        let mut u = self.rng.random::<f64>() * total;
        let mut last_positive = 0;
        for (i, &w) in weights.iter().enumerate() {
            if w > 0.0 {
                last_positive = i;
                if u < w as f64 {
                    return i;
                }
                u -= w as f64;
            }
        }
        last_positive
    }

    /// Chooses a token from logits under `params`.
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams) -> u32 {
        if params.is_greedy() {
            return argmax(logits) as u32;
        }
        self.draw(logits, params).0
    }

    /// [`Sampler::sample`] with sampling params (not greedy), also returning the distribution
    /// the token was drawn from: the same token and the same use of the random source.
    pub fn draw(&mut self, logits: &[f32], params: &SamplingParams) -> (u32, Vec<f32>) {
        let distribution = params.distribution(logits);
        (self.categorical(&distribution) as u32, distribution)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The definition [`argmax`] must match: the first value larger than every one before.
    fn argmax_reference(values: &[f32]) -> usize {
        let mut best = 0;
        for (i, &v) in values.iter().enumerate() {
            if v > values[best] {
                best = i;
            }
        }
        best
    }

    /// `distribution`'s top-k / top-p as first written: rank the whole vocabulary.
    fn restricted_reference(params: &SamplingParams, logits: &[f32]) -> Vec<f32> {
        let inv_t = 1.0 / params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // The same exponentials and total as `distribution` (what differs is the ranking).
        let mut probs: Vec<f32> = logits
            .iter()
            .map(|&l| match (l - max) * inv_t {
                x if x < EXP_FLOOR => 0.0,
                x => exp(x),
            })
            .collect();
        let mut sum = sum_f64(&probs);
        let restrict = params.top_k > 0 && params.top_k < logits.len() || params.top_p < 1.0;
        if !restrict {
            let inv = (1.0 / sum) as f32;
            return probs.iter().map(|p| p * inv).collect();
        }
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_unstable_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
        let k = if params.top_k == 0 {
            logits.len()
        } else {
            params.top_k.min(logits.len())
        };
        let (mut kept, mut cut) = (0f64, k);
        for (rank, &i) in order.iter().enumerate().take(k) {
            kept += probs[i] as f64;
            if kept >= params.top_p as f64 * sum {
                cut = rank + 1;
                break;
            }
        }
        for &i in &order[cut..] {
            probs[i] = 0.0;
        }
        sum = order[..cut].iter().map(|&i| probs[i] as f64).sum();
        let inv = (1.0 / sum) as f32;
        probs.iter_mut().for_each(|p| *p *= inv);
        probs
    }

    /// Ranking only the tokens above a threshold keeps exactly the distribution of ranking all:
    /// peaked and flat rows, ties, underflowing tails, top-k alone, top-p alone and both.
    #[test]
    fn nucleus_matches_ranking_the_whole_vocabulary() {
        let mut rng = StdRng::seed_from_u64(11);
        for row in 0..60 {
            let n = [5, 300, 49_152][row % 3];
            let spread = [0.1f32, 3.0, 40.0][row / 3 % 3];
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    // Rounded values give ties.
                    let v: f32 = rng.random::<f32>() * spread;
                    if row % 2 == 0 {
                        (v * 4.0).round() / 4.0
                    } else {
                        v
                    }
                })
                .collect();
            for (temperature, top_k, top_p) in [
                (0.8, 0, 0.95),
                (1.0, 0, 0.5),
                (0.7, 40, 1.0),
                (1.3, 4, 0.9),
                (0.05, 0, 0.99),
                (2.0, 1000, 0.999),
            ] {
                let params = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                };
                let got = params.distribution(&logits);
                let want = restricted_reference(&params, &logits);
                assert_eq!(got, want, "row {row}, {params:?}");
            }
        }
    }

    /// Rows of awkward values: few distinct ones (ties), NaN, ±∞, ±0, lengths around the block
    /// and lane sizes.
    pub(crate) fn awkward_rows() -> Vec<Vec<f32>> {
        let mut rng = StdRng::seed_from_u64(7);
        let pool = [
            -1.0,
            0.5,
            2.0,
            -0.0,
            0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let mut rows = Vec::new();
        for len in [0, 1, 2, 15, 16, 17, 255, 256, 257, 700, 49_152] {
            for distinct in [1, 3, 5, 8] {
                for _ in 0..4 {
                    rows.push(
                        (0..len)
                            .map(|_| match rng.random_range(0..10) {
                                0 => pool[rng.random_range(0..distinct)],
                                _ => rng.random_range(-3i32..4) as f32 * 0.25,
                            })
                            .collect(),
                    );
                }
            }
        }
        rows.push(vec![f32::NAN; 300]);
        rows.push((0..1000).map(|i| i as f32).collect());
        rows.push((0..1000).map(|i| -(i as f32)).collect());
        rows
    }

    #[test]
    fn argmax_matches_its_definition() {
        for row in awkward_rows() {
            assert_eq!(argmax(&row), argmax_reference(&row), "{row:?}");
        }
    }

    #[test]
    fn softmax_normaliser_matches_its_definition() {
        let row: Vec<f32> = (0..8_192)
            .map(|i| ((i * 7_919) % 1_000) as f32 / 37.0)
            .collect();
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let want: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
        let (got_max, got) = softmax_normaliser(&row).unwrap();
        assert_eq!(got_max, max);
        assert!((got / want - 1.0).abs() < 1e-5, "{got} vs {want}");
        let with_holes = [f32::NEG_INFINITY, 1.0, f32::NAN, 1.0];
        assert_eq!(softmax_normaliser(&with_holes).map(|(m, _)| m), Some(1.0));
        for none in [
            &[][..],
            &[f32::NAN; 3],
            &[f32::NEG_INFINITY; 2],
            &[0.0, f32::INFINITY],
        ] {
            assert!(softmax_normaliser(none).is_none(), "{none:?}");
        }
    }

    #[test]
    fn greedy_is_one_hot() {
        let p = SamplingParams::greedy().distribution(&[0.1, 3.0, 2.0]);
        assert_eq!(p, vec![0.0, 1.0, 0.0]);
    }

    #[test]
    fn top_k_and_top_p_truncate() {
        let logits = [4.0, 3.0, 2.0, 1.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
        }
        .distribution(&logits);
        assert!(p[2] == 0.0 && p[3] == 0.0);
        assert!((p[0] + p[1] - 1.0).abs() < 1e-6);
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.5,
        }
        .distribution(&logits);
        assert_eq!(p[0], 1.0, "{p:?}");
    }

    #[test]
    fn sampling_is_deterministic_under_seed() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 0.95,
        };
        let draw = |seed| {
            let mut s = Sampler::new(seed);
            (0..20)
                .map(|_| s.sample(&logits, &params))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn invalid_params_are_rejected() {
        assert!(
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
    }
}
