//! The interface between a decoding loop and a draft-length policy.

use serde::{Deserialize, Serialize};

/// What is known right after a token has been drafted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DraftStep {
    /// Index of this draft in the round (0 for the first drafted token).
    pub position: usize,
    /// The draft model's probability of the token it drafted (its top-1 probability under greedy).
    pub confidence: f32,
    /// Entropy of the draft distribution, when the loop computes it.
    pub entropy: Option<f32>,
}

/// A policy's answer after a drafted token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// Draft one more token.
    Continue,
    /// Stop drafting and verify.
    Stop,
    /// Stop drafting and verify the drafts before this one; this last draft is dropped
    /// unverified. Running the exit head is cheap, a verified row is not (it costs its pass
    /// through the first N layers and a row of verification), so a policy may look at a draft's
    /// confidence and refuse to pay for a likely rejection.
    Discard,
}

/// What verification revealed about one round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundOutcome {
    /// Number of drafted tokens.
    pub drafted: usize,
    /// Length of the accepted prefix (`<= drafted`). Tokens after the first rejection are
    /// unobserved; `accepted == drafted` is censored (the next one was never tried).
    pub accepted: usize,
    /// The draft confidence of each drafted token (`drafted` entries).
    pub confidences: Vec<f32>,
    /// Measured cost of one draft step divided by the cost of one verification step, when known.
    pub cost_ratio: Option<f64>,
}

impl RoundOutcome {
    /// Per drafted token: `Some(true)` accepted, `Some(false)` the first rejection, `None` unobserved.
    pub fn token_outcomes(&self) -> impl Iterator<Item = (f32, Option<bool>)> + '_ {
        self.confidences.iter().enumerate().map(move |(i, &c)| {
            let seen = if i < self.accepted {
                Some(true)
            } else if i == self.accepted {
                Some(false)
            } else {
                None
            };
            (c, seen)
        })
    }
}

/// A draft-length controller, driven by the decoding loop.
///
/// Per round: [`begin_round`](DraftPolicy::begin_round) says whether to draft at all (a round
/// without drafts is a plain autoregressive step, the fallback when drafting does not pay); after
/// each drafted token [`decide`](DraftPolicy::decide) says whether to draft another (the loop also
/// stops at [`max_draft`](DraftPolicy::max_draft)); after verification,
/// [`observe`](DraftPolicy::observe) (also for rounds without drafts).
pub trait DraftPolicy: Send {
    /// A short name for reports (`beta-ts`, `fixed:4`, ...).
    fn name(&self) -> String;
    /// Hard cap on drafted tokens per round.
    fn max_draft(&self) -> usize;
    /// Called before a round: [`Decision::Continue`] drafts a first token, [`Decision::Stop`]
    /// makes the round a plain decoding step.
    fn begin_round(&mut self) -> Decision {
        Decision::Continue
    }
    /// Called after each drafted token.
    fn decide(&mut self, step: &DraftStep) -> Decision;
    /// Called with the verification result of the round.
    fn observe(&mut self, outcome: &RoundOutcome);
}

impl<P: DraftPolicy + ?Sized> DraftPolicy for Box<P> {
    fn name(&self) -> String {
        (**self).name()
    }
    fn max_draft(&self) -> usize {
        (**self).max_draft()
    }
    fn begin_round(&mut self) -> Decision {
        (**self).begin_round()
    }
    fn decide(&mut self, step: &DraftStep) -> Decision {
        (**self).decide(step)
    }
    fn observe(&mut self, outcome: &RoundOutcome) {
        (**self).observe(outcome)
    }
}

/// Expected tokens per round (accepted drafts + the verifier's own token) when the drafted tokens
/// survive with probabilities `p_1, p_2, ...`: `1 + Σ_j Π_{i≤j} p_i`.
pub fn expected_tokens(survival_steps: impl IntoIterator<Item = f64>) -> f64 {
    let mut survival = 1.0;
    let mut total = 1.0;
    for p in survival_steps {
        survival *= p;
        total += survival;
    }
    total
}

/// The best fixed draft length `k ∈ [0, cap]` (0: no drafting) and its rate (tokens per verification-cost unit)
/// when every token is accepted with probability `theta` and a draft step costs `ratio` of a
/// verification step.
pub fn best_fixed_length(theta: f64, ratio: f64, cap: usize) -> (usize, f64) {
    let mut best = (0, 1.0);
    let (mut survival, mut tokens) = (1.0, 1.0);
    for k in 1..=cap {
        survival *= theta;
        tokens += survival;
        let rate = tokens / (1.0 + ratio * k as f64);
        if rate > best.1 {
            best = (k, rate);
        }
    }
    best
}
