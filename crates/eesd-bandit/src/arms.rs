//! Thompson Sampling over a few alternatives by a measured reward per use: which of several
//! drafters to draft a round with, judged by the tokens per second its rounds achieved.
//!
//! Each arm keeps a discounted mean and variance of its rewards; a choice draws one plausible
//! mean per arm from a normal posterior (the mean's standard error shrinks with the arm's
//! rounds) and takes the largest. Every record discounts *all* arms, so evidence about an arm
//! that is no longer chosen fades and it gets tried again once it is uncertain enough: text
//! changes from prompt to prompt, and so does which drafter pays.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Normal};
use serde::Serialize;

use crate::error::{BanditError, Result};

/// Default discount per recorded round: an effective memory of ≈ 100 rounds (one answer of
/// a few hundred tokens).
pub const DEFAULT_ARM_DISCOUNT: f64 = 0.99;

/// Rounds each arm gets before the posterior decides (and again whenever an arm's discounted
/// count falls below it).
const MIN_ROUNDS: f64 = 2.0;

/// Smallest standard deviation of one reward assumed, relative to the arm's mean: two equal
/// rewards do not make an arm certain.
const MIN_RELATIVE_SD: f64 = 0.05;

/// Discounted reward statistics of one arm.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct RewardArm {
    /// Discounted number of rewards.
    pub weight: f64,
    /// Discounted sum of rewards.
    pub sum: f64,
    /// Discounted sum of squared rewards.
    pub sum_sq: f64,
}

impl RewardArm {
    /// The discounted mean reward, once the arm has any.
    pub fn mean(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.sum / self.weight)
    }

    /// The standard error of the mean (at least [`MIN_RELATIVE_SD`] of the mean per reward).
    fn standard_error(&self, mean: f64) -> f64 {
        let variance = (self.sum_sq / self.weight - mean * mean).max(0.0);
        let floor = (MIN_RELATIVE_SD * mean.abs()).powi(2);
        (variance.max(floor) / self.weight).sqrt()
    }
}

/// Thompson Sampling over `arms` alternatives by their rewards (larger is better).
#[derive(Debug)]
pub struct RewardTs {
    arms: Vec<RewardArm>,
    discount: f64,
    rng: StdRng,
}

impl RewardTs {
    /// A sampler over `arms ≥ 1` alternatives, none tried yet.
    pub fn new(arms: usize, seed: u64) -> Result<Self> {
        if arms == 0 {
            return Err(BanditError::InvalidParameter(
                "Thompson Sampling needs at least one arm".into(),
            ));
        }
        Ok(RewardTs {
            arms: vec![RewardArm::default(); arms],
            discount: DEFAULT_ARM_DISCOUNT,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    /// Sets the discount per recorded reward, in (0, 1] (1: never forget).
    pub fn with_discount(mut self, discount: f64) -> Result<Self> {
        if !(discount > 0.0 && discount <= 1.0) {
            return Err(BanditError::InvalidParameter(format!(
                "discount {discount} must be in (0, 1]"
            )));
        }
        self.discount = discount;
        Ok(self)
    }

    /// The arms' statistics, in order.
    pub fn arms(&self) -> &[RewardArm] {
        &self.arms
    }

    /// The arm to use next: the least tried one while any has fewer than two (discounted)
    /// rewards, else the largest of one posterior draw per arm.
    pub fn choose(&mut self) -> usize {
        let least = (0..self.arms.len())
            .min_by(|&a, &b| self.arms[a].weight.total_cmp(&self.arms[b].weight))
            .unwrap_or(0);
        if self.arms[least].weight < MIN_ROUNDS {
            return least;
        }
        let mut best = (0, f64::NEG_INFINITY);
        for (i, arm) in self.arms.iter().enumerate() {
            let mean = arm.mean().unwrap_or(0.0);
            let draw = match Normal::new(mean, arm.standard_error(mean)) {
                Ok(normal) => normal.sample(&mut self.rng),
                Err(_) => mean,
            };
            if draw > best.1 {
                best = (i, draw);
            }
        }
        best.0
    }

    /// Records `reward` of `arm` after discounting every arm's evidence; a reward that is not
    /// finite, or an arm out of range, is ignored.
    pub fn record(&mut self, arm: usize, reward: f64) {
        if arm >= self.arms.len() || !reward.is_finite() {
            return;
        }
        for a in &mut self.arms {
            a.weight *= self.discount;
            a.sum *= self.discount;
            a.sum_sq *= self.discount;
        }
        let a = &mut self.arms[arm];
        a.weight += 1.0;
        a.sum += reward;
        a.sum_sq += reward * reward;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rewards ~ Normal(means[arm], sd); returns how often each arm was chosen.
    fn play(ts: &mut RewardTs, means: &[f64], sd: f64, rounds: usize, seed: u64) -> Vec<usize> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut chosen = vec![0; means.len()];
        for _ in 0..rounds {
            let arm = ts.choose();
            chosen[arm] += 1;
            let reward = Normal::new(means[arm], sd).unwrap().sample(&mut rng);
            ts.record(arm, reward);
        }
        chosen
    }

    #[test]
    fn settles_on_the_best_arm() {
        for seed in 0..5 {
            let mut ts = RewardTs::new(3, seed).unwrap();
            let chosen = play(&mut ts, &[100.0, 120.0, 135.0], 25.0, 2000, 100 + seed);
            assert!(chosen[2] > 1400, "seed {seed}: {chosen:?}");
            // Every arm was tried, and the worst least.
            assert!(
                chosen.iter().all(|&c| c >= 2) && chosen[0] < chosen[1],
                "{chosen:?}"
            );
        }
    }

    #[test]
    fn follows_a_change_of_the_best_arm() {
        let mut ts = RewardTs::new(2, 7).unwrap();
        let first = play(&mut ts, &[140.0, 100.0], 20.0, 1000, 1);
        let second = play(&mut ts, &[100.0, 140.0], 20.0, 1000, 2);
        assert!(first[0] > 850, "{first:?}");
        assert!(second[1] > 700, "{second:?}");
        // Without forgetting, the old evidence holds the first arm much longer.
        let mut stubborn = RewardTs::new(2, 7).unwrap().with_discount(1.0).unwrap();
        play(&mut stubborn, &[140.0, 100.0], 20.0, 1000, 1);
        let late = play(&mut stubborn, &[100.0, 140.0], 20.0, 1000, 2);
        assert!(late[1] < second[1], "{late:?} vs {second:?}");
    }

    #[test]
    fn equal_arms_share_and_bad_input_is_refused_or_ignored() {
        let mut ts = RewardTs::new(2, 3).unwrap();
        let chosen = play(&mut ts, &[50.0, 50.0], 5.0, 2000, 4);
        assert!(chosen.iter().all(|&c| c > 300), "{chosen:?}");
        assert!(RewardTs::new(0, 1).is_err());
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            assert!(RewardTs::new(2, 1).unwrap().with_discount(bad).is_err());
        }
        let before = ts.arms().to_vec();
        ts.record(2, 1.0);
        ts.record(0, f64::NAN);
        ts.record(1, f64::INFINITY);
        assert_eq!(ts.arms(), &before[..]);
        let one = RewardTs::new(1, 0).unwrap().choose();
        assert_eq!(one, 0);
    }
}
