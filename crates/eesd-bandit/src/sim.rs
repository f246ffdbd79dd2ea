//! A simulator of draft-acceptance processes, to compare policies without a model.
//!
//! Every policy sees the same random rounds (common random numbers: round `r` is generated from
//! `(seed, r)`), so differences between policies are not sampling noise of the process.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Beta, Distribution};
use serde::{Deserialize, Serialize};

use crate::error::{BanditError, Result};
use crate::policies::Fixed;
use crate::policy::{Decision, DraftPolicy, DraftStep, RoundOutcome};

/// How drafted tokens get accepted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Process {
    /// Every token is accepted with probability θ; confidences are uniform and uninformative.
    Stationary {
        /// Acceptance probability.
        theta: f64,
    },
    /// Confidence c ~ Beta(a, b); the token is accepted with probability c^power (power 1: the
    /// draft is calibrated; > 1: over-confident).
    ConfidenceDependent {
        /// Beta shape a of the confidence distribution.
        a: f64,
        /// Beta shape b of the confidence distribution.
        b: f64,
        /// Exponent of the acceptance curve.
        power: f64,
    },
    /// θ switches between values every `segment` rounds (topic changes in long text).
    Switching {
        /// The acceptance probabilities, visited in turn.
        thetas: Vec<f64>,
        /// Rounds per segment.
        segment: usize,
    },
}

impl Process {
    /// Checks parameters.
    pub fn validate(&self) -> Result<()> {
        let ok = match self {
            Process::Stationary { theta } => (0.0..=1.0).contains(theta),
            Process::ConfidenceDependent { a, b, power } => *a > 0.0 && *b > 0.0 && *power > 0.0,
            Process::Switching { thetas, segment } => {
                *segment > 0 && !thetas.is_empty() && thetas.iter().all(|t| (0.0..=1.0).contains(t))
            }
        };
        if ok {
            Ok(())
        } else {
            Err(BanditError::InvalidParameter(format!(
                "invalid process {self:?}"
            )))
        }
    }

    /// A short label.
    pub fn label(&self) -> String {
        match self {
            Process::Stationary { theta } => format!("stationary(θ={theta})"),
            Process::ConfidenceDependent { a, b, power } => {
                format!("confidence(c~Beta({a},{b}), p=c^{power})")
            }
            Process::Switching { thetas, segment } => {
                format!("switching({thetas:?} every {segment})")
            }
        }
    }

    /// (confidence, accepted) of the `i`-th potential draft of a round.
    fn token(&self, round: usize, rng: &mut StdRng) -> (f32, bool) {
        match self {
            Process::Stationary { theta } => (rng.random::<f32>(), rng.random::<f64>() < *theta),
            Process::ConfidenceDependent { a, b, power } => {
                let c: f64 = Beta::new(*a, *b).map(|d| d.sample(rng)).unwrap_or(0.5);
                (c as f32, rng.random::<f64>() < c.powf(*power))
            }
            Process::Switching { thetas, segment } => {
                let theta = thetas[(round / segment) % thetas.len()];
                (rng.random::<f32>(), rng.random::<f64>() < theta)
            }
        }
    }
}

/// Costs of one draft step and one verification step (any unit).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Costs {
    /// Cost of drafting one token.
    pub draft: f64,
    /// Cost of one verification pass.
    pub verify: f64,
    /// Cost of a draft dropped unverified ([`Decision::Discard`]): only the exit head ran, not
    /// the token's pass through the first N layers (`draft` is an upper bound).
    pub discard: f64,
}

/// What a simulation measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// Policy name.
    pub policy: String,
    /// Rounds simulated.
    pub rounds: usize,
    /// Tokens produced: accepted drafts plus the verifier's token each round.
    pub tokens: f64,
    /// Total cost: drafted × draft cost + rounds × verify cost.
    pub cost: f64,
    /// tokens / cost — what the policy maximises.
    pub score: f64,
    /// Mean drafted tokens per round.
    pub mean_draft: f64,
    /// Mean accepted drafts per round.
    pub mean_accepted: f64,
}

/// Runs `policy` for `rounds` rounds of `process`.
pub fn simulate(
    policy: &mut dyn DraftPolicy,
    process: &Process,
    rounds: usize,
    costs: Costs,
    seed: u64,
) -> SimReport {
    let (mut tokens, mut cost, mut drafted_total, mut accepted_total) = (0.0, 0.0, 0usize, 0usize);
    let ratio = costs.draft / costs.verify;
    for round in 0..rounds {
        let mut rng =
            StdRng::seed_from_u64(seed ^ (round as u64).wrapping_mul(0x2545_F491_4F6C_DD1D));
        let cap = policy.max_draft();
        // A policy that declines to draft makes this round a plain decoding step.
        let mut drafting = policy.begin_round() == Decision::Continue && cap > 0;
        let mut confidences = Vec::new();
        let mut oks = Vec::new();
        let mut discarded = 0;
        while drafting {
            let (c, ok) = process.token(round, &mut rng);
            let position = confidences.len();
            confidences.push(c);
            oks.push(ok);
            let step = DraftStep {
                position,
                confidence: c,
                entropy: None,
            };
            let decision = policy.decide(&step);
            if decision == Decision::Discard {
                // Dropped unverified; its draft cost is still paid.
                confidences.pop();
                oks.pop();
                discarded += 1;
            }
            drafting = confidences.len() < cap && decision == Decision::Continue;
        }
        let accepted = oks.iter().take_while(|&&ok| ok).count();
        let drafted = confidences.len();
        policy.observe(&RoundOutcome {
            drafted,
            accepted,
            confidences,
            cost_ratio: Some(ratio),
        });
        tokens += accepted as f64 + 1.0;
        cost += drafted as f64 * costs.draft + discarded as f64 * costs.discard + costs.verify;
        drafted_total += drafted;
        accepted_total += accepted;
    }
    SimReport {
        policy: policy.name(),
        rounds,
        tokens,
        cost,
        score: tokens / cost,
        mean_draft: drafted_total as f64 / rounds.max(1) as f64,
        mean_accepted: accepted_total as f64 / rounds.max(1) as f64,
    }
}

/// The best fixed draft length in hindsight, by exhaustive search over `0..=max_k` on the same
/// rounds (0: plain decoding, one token per verification).
pub fn oracle_fixed(
    process: &Process,
    rounds: usize,
    costs: Costs,
    seed: u64,
    max_k: usize,
) -> SimReport {
    (1..=max_k.max(1))
        .map(|k| {
            simulate(
                &mut Fixed::new(k).expect("k >= 1"),
                process,
                rounds,
                costs,
                seed,
            )
        })
        .max_by(|a, b| a.score.total_cmp(&b.score))
        .expect("at least one k")
}
