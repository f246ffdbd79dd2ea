//! Beta posteriors of draft-token acceptance, with optional forgetting.

use rand::Rng;
use rand_distr::{Beta, Distribution};
use serde::{Deserialize, Serialize};

use crate::error::{BanditError, Result};

/// A Beta(α, β) posterior over the probability that a drafted token is accepted.
///
/// Update with `s` accepted and `f` rejected tokens: `α ← α₀ + γ(α − α₀) + s`,
/// `β ← β₀ + γ(β − β₀) + f`, where γ ∈ (0, 1] is the discount (γ = 1: no forgetting; γ < 1: old
/// evidence decays towards the prior, so the posterior tracks non-stationary text with an
/// effective memory of about 1 / (1 − γ) rounds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BetaPosterior {
    /// Current α (prior + discounted successes).
    pub alpha: f64,
    /// Current β (prior + discounted failures).
    pub beta: f64,
    prior_alpha: f64,
    prior_beta: f64,
}

impl BetaPosterior {
    /// A posterior at its prior Beta(α₀, β₀).
    pub fn new(prior_alpha: f64, prior_beta: f64) -> Result<Self> {
        if !(prior_alpha > 0.0
            && prior_beta > 0.0
            && prior_alpha.is_finite()
            && prior_beta.is_finite())
        {
            return Err(BanditError::InvalidParameter(format!(
                "Beta prior ({prior_alpha}, {prior_beta}) must be positive and finite"
            )));
        }
        Ok(BetaPosterior {
            alpha: prior_alpha,
            beta: prior_beta,
            prior_alpha,
            prior_beta,
        })
    }

    /// Posterior mean α / (α + β).
    pub fn mean(&self) -> f64 {
        self.alpha / (self.alpha + self.beta)
    }

    /// The central credible interval holding `level` of the posterior mass (e.g. 0.95).
    pub fn credible_interval(&self, level: f64) -> (f64, f64) {
        use statrs::distribution::{Beta as BetaDist, ContinuousCDF};
        let tail = (1.0 - level.clamp(0.0, 1.0)) / 2.0;
        match BetaDist::new(self.alpha, self.beta) {
            Ok(d) => (d.inverse_cdf(tail), d.inverse_cdf(1.0 - tail)),
            Err(_) => (0.0, 1.0),
        }
    }

    /// A draw θ ~ Beta(α, β).
    pub fn sample(&self, rng: &mut impl Rng) -> f64 {
        match Beta::new(self.alpha, self.beta) {
            Ok(d) => d.sample(rng),
            Err(_) => self.mean(),
        }
    }

    /// Decays old evidence towards the prior by `discount` (1 = keep everything).
    pub fn decay(&mut self, discount: f64) {
        self.alpha = self.prior_alpha + discount * (self.alpha - self.prior_alpha);
        self.beta = self.prior_beta + discount * (self.beta - self.prior_beta);
    }

    /// Adds one observation.
    pub fn record(&mut self, accepted: bool) {
        if accepted {
            self.alpha += 1.0;
        } else {
            self.beta += 1.0;
        }
    }
}

/// Beta posteriors of acceptance per draft-confidence bin: a non-parametric calibration curve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BinnedPosterior {
    bins: Vec<BetaPosterior>,
    /// How many drafted tokens fell into each bin (discounted like the posteriors); estimates the
    /// distribution of confidences, used to predict a token not drafted yet.
    counts: Vec<f64>,
}

impl BinnedPosterior {
    /// `n` equal-width bins over [0, 1], each with the prior Beta(α₀, β₀).
    pub fn new(n: usize, prior_alpha: f64, prior_beta: f64) -> Result<Self> {
        if n == 0 {
            return Err(BanditError::InvalidParameter(
                "at least one confidence bin is needed".into(),
            ));
        }
        let prior = BetaPosterior::new(prior_alpha, prior_beta)?;
        Ok(BinnedPosterior {
            bins: vec![prior; n],
            counts: vec![0.0; n],
        })
    }

    /// Number of bins.
    pub fn len(&self) -> usize {
        self.bins.len()
    }

    /// Whether there are no bins (never true for a constructed value).
    pub fn is_empty(&self) -> bool {
        self.bins.is_empty()
    }

    /// The bin of a confidence.
    pub fn bin(&self, confidence: f32) -> usize {
        let c = if confidence.is_finite() {
            confidence.clamp(0.0, 1.0)
        } else {
            0.0
        };
        ((c * self.bins.len() as f32) as usize).min(self.bins.len() - 1)
    }

    /// The posterior of one bin.
    pub fn posterior(&self, bin: usize) -> &BetaPosterior {
        &self.bins[bin]
    }

    /// One draw of the whole calibration curve.
    pub fn sample(&self, rng: &mut impl Rng) -> Vec<f64> {
        self.bins.iter().map(|b| b.sample(rng)).collect()
    }

    /// Acceptance of a token not drafted yet: `thetas` averaged over the observed confidence
    /// distribution (add-one smoothed).
    pub fn expected_next(&self, thetas: &[f64]) -> f64 {
        let total: f64 = self.counts.iter().map(|c| c + 1.0).sum();
        self.counts
            .iter()
            .zip(thetas)
            .map(|(c, t)| (c + 1.0) * t)
            .sum::<f64>()
            / total
    }

    /// Expected surplus of a first draft that is verified only when worth its `price`:
    /// `Σ_bins P(bin) · max(0, θ_bin − price)` over the observed confidence distribution. This is
    /// what looking at a draft before deciding to verify it ([`crate::Decision::Discard`]) gains.
    pub fn expected_surplus(&self, thetas: &[f64], price: f64) -> f64 {
        let total: f64 = self.counts.iter().map(|c| c + 1.0).sum();
        self.counts
            .iter()
            .zip(thetas)
            .map(|(c, t)| (c + 1.0) * (t - price).max(0.0))
            .sum::<f64>()
            / total
    }

    /// Applies one round's evidence (after discounting the old by `discount`).
    pub fn update(&mut self, outcome: &crate::RoundOutcome, discount: f64) {
        self.bins.iter_mut().for_each(|b| b.decay(discount));
        self.counts.iter_mut().for_each(|c| *c *= discount);
        for (c, seen) in outcome.token_outcomes() {
            let b = self.bin(c);
            self.counts[b] += 1.0;
            if let Some(accepted) = seen {
                self.bins[b].record(accepted);
            }
        }
    }
}
