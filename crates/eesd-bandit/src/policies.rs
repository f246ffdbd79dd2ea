//! The draft-length policies: fixed baselines and Thompson Sampling controllers.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::{BanditError, Result};
use crate::policy::{Decision, DraftPolicy, DraftStep, RoundOutcome, best_fixed_length};
use crate::posterior::{BetaPosterior, BinnedPosterior};

/// Default hard cap on drafted tokens per round.
pub const DEFAULT_MAX_DRAFT: usize = 8;
/// Default draft/verify cost ratio before the loop has measured one.
pub const DEFAULT_COST_RATIO: f64 = 0.2;

fn check_cap(max_draft: usize) -> Result<()> {
    if max_draft == 0 {
        return Err(BanditError::InvalidParameter(
            "max_draft must be at least 1".into(),
        ));
    }
    Ok(())
}

fn check_discount(discount: f64) -> Result<()> {
    if !(discount > 0.0 && discount <= 1.0) {
        return Err(BanditError::InvalidParameter(format!(
            "discount {discount} must be in (0, 1]"
        )));
    }
    Ok(())
}

/// Always draft `k` tokens (the classic speculative-decoding baseline).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fixed {
    k: usize,
}

impl Fixed {
    /// Drafts exactly `k` tokens per round (`k = 0`: plain decoding).
    pub fn new(k: usize) -> Result<Self> {
        Ok(Fixed { k })
    }
}

impl DraftPolicy for Fixed {
    fn name(&self) -> String {
        format!("fixed:{}", self.k)
    }
    fn max_draft(&self) -> usize {
        self.k
    }
    fn begin_round(&mut self) -> Decision {
        if self.k > 0 {
            Decision::Continue
        } else {
            Decision::Stop
        }
    }
    fn decide(&mut self, step: &DraftStep) -> Decision {
        if step.position + 1 < self.k {
            Decision::Continue
        } else {
            Decision::Stop
        }
    }
    fn observe(&mut self, _: &RoundOutcome) {}
}

/// Stop when the draft's confidence in its token falls below τ (Kangaroo-style), or at the cap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfidenceThreshold {
    tau: f32,
    max_draft: usize,
}

impl ConfidenceThreshold {
    /// Threshold τ ∈ [0, 1] and a hard cap.
    pub fn new(tau: f32, max_draft: usize) -> Result<Self> {
        check_cap(max_draft)?;
        if !(0.0..=1.0).contains(&tau) {
            return Err(BanditError::InvalidParameter(format!(
                "threshold {tau} must be in [0, 1]"
            )));
        }
        Ok(ConfidenceThreshold { tau, max_draft })
    }
}

impl DraftPolicy for ConfidenceThreshold {
    fn name(&self) -> String {
        format!("threshold:{}", self.tau)
    }
    fn max_draft(&self) -> usize {
        self.max_draft
    }
    fn decide(&mut self, step: &DraftStep) -> Decision {
        if step.confidence >= self.tau && step.position + 1 < self.max_draft {
            Decision::Continue
        } else {
            Decision::Stop
        }
    }
    fn observe(&mut self, _: &RoundOutcome) {}
}

/// Seeded randomness that survives serialisation exactly: draw `n` comes from a generator seeded
/// with `(seed, n)`, so a saved and restored policy continues the same stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Draws {
    seed: u64,
    counter: u64,
}

impl Draws {
    fn new(seed: u64) -> Self {
        Draws { seed, counter: 0 }
    }

    fn rng(&mut self) -> StdRng {
        self.counter += 1;
        StdRng::seed_from_u64(self.seed ^ self.counter.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

/// Online estimate of the draft/verify cost ratio (exponential moving average of measurements).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct CostRatio(f64);

impl CostRatio {
    fn update(&mut self, measured: Option<f64>) {
        if let Some(r) = measured.filter(|r| r.is_finite() && *r > 0.0) {
            self.0 += 0.1 * (r - self.0);
        }
    }
}

/// How a Thompson Sampling policy turns a posterior draw into continue/stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum StepRule {
    /// The paper's literal rule: each step draw θ̃ and χ ~ Bernoulli(θ̃); continue when χ = 1.
    /// Simple and cost-blind; in simulation it reaches 84–95% of the best fixed length on
    /// stationary processes (draft lengths vary geometrically around the optimum).
    Bernoulli,
    /// Thompson Sampling proper: act optimally for the drawn θ̃ — continue while one more draft
    /// adds more expected tokens than it costs at the current rate.
    #[default]
    Optimal,
}

/// Beta-TS: a Beta posterior over the acceptance probability θ of a drafted token.
///
/// Sampled: θ̃ ~ Beta(α, β) at the start of each round ([`StepRule::Optimal`]: the round drafts the
/// length that maximises `(1 + Σ_{j≤k} θ̃^j) / (1 + k·r)` for the current cost ratio r) or at each
/// step ([`StepRule::Bernoulli`]). Updated: each accepted token is a success, the first rejected
/// token a failure; tokens after it were never judged and a fully accepted round adds no failure
/// (censoring). Optional discount γ < 1 forgets old rounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BetaTs {
    posterior: BetaPosterior,
    discount: f64,
    max_draft: usize,
    rule: StepRule,
    cost: CostRatio,
    draws: Draws,
    /// This round's target length (Optimal rule).
    #[serde(skip)]
    target: Option<usize>,
}

impl BetaTs {
    /// Beta(1, 1) prior, no discount, the default cap, [`StepRule::Optimal`].
    pub fn new(seed: u64) -> Self {
        BetaTs {
            posterior: BetaPosterior::new(1.0, 1.0).expect("valid prior"),
            discount: 1.0,
            max_draft: DEFAULT_MAX_DRAFT,
            rule: StepRule::Optimal,
            cost: CostRatio(DEFAULT_COST_RATIO),
            draws: Draws::new(seed),
            target: None,
        }
    }

    /// Sets the Beta prior.
    pub fn with_prior(mut self, alpha: f64, beta: f64) -> Result<Self> {
        self.posterior = BetaPosterior::new(alpha, beta)?;
        Ok(self)
    }

    /// Sets the step rule.
    pub fn with_rule(mut self, rule: StepRule) -> Self {
        self.rule = rule;
        self
    }

    /// The posterior.
    pub fn posterior(&self) -> &BetaPosterior {
        &self.posterior
    }
}

fn check_ratio(ratio: f64) -> Result<()> {
    if !(ratio.is_finite() && ratio > 0.0) {
        return Err(BanditError::InvalidParameter(format!(
            "cost ratio {ratio} must be positive"
        )));
    }
    Ok(())
}

impl DraftPolicy for BetaTs {
    fn name(&self) -> String {
        match (self.rule, self.discount < 1.0) {
            (StepRule::Bernoulli, _) => "beta-ts-bernoulli".into(),
            (_, true) => format!("beta-ts(γ={})", self.discount),
            _ => "beta-ts".into(),
        }
    }
    fn max_draft(&self) -> usize {
        self.max_draft
    }
    fn begin_round(&mut self) -> Decision {
        let theta = self.posterior.sample(&mut self.draws.rng());
        let target = best_fixed_length(theta, self.cost.0, self.max_draft).0;
        self.target = Some(target);
        match self.rule {
            StepRule::Optimal if target == 0 => Decision::Stop,
            _ => Decision::Continue,
        }
    }
    fn decide(&mut self, step: &DraftStep) -> Decision {
        let go = step.position + 1 < self.max_draft
            && match self.rule {
                StepRule::Optimal => {
                    if self.target.is_none() {
                        self.begin_round();
                    }
                    step.position + 1 < self.target.unwrap_or(0)
                }
                StepRule::Bernoulli => {
                    let mut rng = self.draws.rng();
                    rng.random::<f64>() < self.posterior.sample(&mut rng)
                }
            };
        if go {
            Decision::Continue
        } else {
            Decision::Stop
        }
    }
    fn observe(&mut self, outcome: &RoundOutcome) {
        self.posterior.decay(self.discount);
        for (_, seen) in outcome.token_outcomes() {
            if let Some(accepted) = seen {
                self.posterior.record(accepted);
            }
        }
        self.cost.update(outcome.cost_ratio);
        self.target = None;
    }
}

/// The stopping rule of the calibrated policies: draft one more token while its expected extra
/// tokens (`gain`) cover its price at the current rate (`ratio × rate` verification units) and
/// fewer than `cap` tokens are drafted.
fn marginal_rule(gain: f64, ratio: f64, rate: f64, drafted: usize, cap: usize) -> Decision {
    if pays(gain, ratio, rate) && drafted < cap {
        Decision::Continue
    } else {
        Decision::Stop
    }
}

/// What a look at one draft costs, as a share of a draft's price: only the exit head runs
/// (measured ≈ 0.27 on SmolLM2-135M with an 8k-token draft vocabulary at exit layer 6; the rest
/// of a draft step is the token's pass through the first N layers).
const PEEK_SHARE: f64 = 0.3;

/// Whether to draft a first token: when drafting pays on average (`next ≥ price`), or when the
/// drafts worth keeping pay for looking at every first draft (`surplus ≥ PEEK_SHARE · price`;
/// the others are dropped because verifying them does not pay).
fn begin_rule(next: f64, surplus: f64, price: f64, cap: usize) -> Decision {
    if cap > 0 && (next >= price || surplus >= PEEK_SHARE * price) {
        Decision::Continue
    } else {
        Decision::Stop
    }
}

/// Whether `gain` expected extra tokens cover a price of `ratio × rate` verification units —
/// for drafting one more token, and for verifying a token just drafted (its gain is the
/// survival of the prefix times its own acceptance under the draw; if it does not pay it is
/// dropped: the head's work is spent either way, its pass through the first N layers and its
/// verification row are saved).
fn pays(gain: f64, ratio: f64, rate: f64) -> bool {
    gain >= ratio * rate
}

/// State of a calibrated round: the drawn curve, the survival of the drafted prefix, and the
/// predicted acceptance and rate of tokens not drafted yet.
#[derive(Debug, Clone, PartialEq, Default)]
struct CalibratedRound {
    thetas: Vec<f64>,
    survival: f64,
    next: f64,
    rate: f64,
}

/// Calibration-TS: acceptance modelled as a function of the draft's confidence in its token.
///
/// Posterior: independent Beta posteriors per confidence bin (a non-parametric calibration curve
/// θ(c)). Sampled: one curve θ̃(·) per round. Decision after drafting token i with confidence c_i:
/// the prefix survives with S̃_i = Π_{j≤i} θ̃(c_j); one more draft adds S̃_i · θ̃_next expected
/// tokens (θ̃_next = θ̃ averaged over the observed confidence distribution) for r verification
/// units, so continue iff `S̃_i · θ̃_next ≥ r · ρ̃`, with ρ̃ the best fixed-length rate under the
/// draw. A confident prefix is extended, a doubtful one is verified at once.
/// Updated: accepted tokens are successes and the first rejection a failure in their own bins.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibratedTs {
    posterior: BinnedPosterior,
    discount: f64,
    max_draft: usize,
    cost: CostRatio,
    draws: Draws,
    #[serde(skip)]
    round: CalibratedRound,
}

impl CalibratedTs {
    /// Ten bins with Beta(1, 1) priors, no discount, the default cap.
    pub fn new(seed: u64) -> Self {
        CalibratedTs {
            posterior: BinnedPosterior::new(10, 1.0, 1.0).expect("valid prior"),
            discount: 1.0,
            max_draft: DEFAULT_MAX_DRAFT,
            cost: CostRatio(DEFAULT_COST_RATIO),
            draws: Draws::new(seed),
            round: CalibratedRound::default(),
        }
    }

    /// The calibration posterior.
    pub fn posterior(&self) -> &BinnedPosterior {
        &self.posterior
    }
}

impl DraftPolicy for CalibratedTs {
    fn name(&self) -> String {
        "calibrated-ts".into()
    }
    fn max_draft(&self) -> usize {
        self.max_draft
    }
    fn begin_round(&mut self) -> Decision {
        let thetas = self.posterior.sample(&mut self.draws.rng());
        let next = self.posterior.expected_next(&thetas);
        let rate = best_fixed_length(next, self.cost.0, self.max_draft).1;
        let surplus = self.posterior.expected_surplus(&thetas, self.cost.0 * rate);
        self.round = CalibratedRound {
            thetas,
            survival: 1.0,
            next,
            rate,
        };
        begin_rule(next, surplus, self.cost.0 * rate, self.max_draft)
    }
    fn decide(&mut self, step: &DraftStep) -> Decision {
        if self.round.thetas.is_empty() {
            self.begin_round();
        }
        let r = &mut self.round;
        let theta = r.thetas[self.posterior.bin(step.confidence)];
        if !pays(r.survival * theta, self.cost.0, r.rate) {
            return Decision::Discard;
        }
        r.survival *= theta;
        marginal_rule(
            r.survival * r.next,
            self.cost.0,
            r.rate,
            step.position + 1,
            self.max_draft,
        )
    }
    fn observe(&mut self, outcome: &RoundOutcome) {
        self.posterior.update(outcome, self.discount);
        self.cost.update(outcome.cost_ratio);
        self.round = CalibratedRound::default();
    }
}

/// Cost-aware TS (beyond the paper): the calibrated posterior, a fresh draw at every step, and a
/// stopping rule priced in measured time rather than in the model's own prediction.
///
/// Decision after token i: draw θ̃ for its confidence bin and θ̃_next for a token not drafted yet;
/// continue while the expected extra tokens `S̃_i · θ̃_next` exceed `r̂ · ρ̂`, where r̂ is the
/// draft/verify cost ratio measured by the decoding loop and ρ̂ the realised rate (tokens per
/// verification-cost unit, exponential moving average over rounds). Stopping when the marginal
/// rate falls below the achieved rate is the optimal-stopping condition for maximising tokens
/// per unit time (a Dinkelbach iteration), so the policy adapts as the measured costs move.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostAwareTs {
    posterior: BinnedPosterior,
    discount: f64,
    max_draft: usize,
    cost: CostRatio,
    rate: f64,
    draws: Draws,
    /// Survival of this round's drafted prefix under the draws so far.
    #[serde(skip, default = "one")]
    survival: f64,
}

fn one() -> f64 {
    1.0
}

impl CostAwareTs {
    /// Ten bins with Beta(1, 1) priors, no discount, the default cap and cost ratio.
    pub fn new(seed: u64) -> Self {
        CostAwareTs {
            posterior: BinnedPosterior::new(10, 1.0, 1.0).expect("valid prior"),
            discount: 1.0,
            max_draft: DEFAULT_MAX_DRAFT,
            cost: CostRatio(DEFAULT_COST_RATIO),
            rate: 1.0,
            draws: Draws::new(seed),
            survival: 1.0,
        }
    }
}

impl DraftPolicy for CostAwareTs {
    fn name(&self) -> String {
        "cost-ts".into()
    }
    fn max_draft(&self) -> usize {
        self.max_draft
    }
    fn begin_round(&mut self) -> Decision {
        self.survival = 1.0;
        let thetas = self.posterior.sample(&mut self.draws.rng());
        let next = self.posterior.expected_next(&thetas);
        let price = self.cost.0 * self.rate;
        let surplus = self.posterior.expected_surplus(&thetas, price);
        begin_rule(next, surplus, price, self.max_draft)
    }
    fn decide(&mut self, step: &DraftStep) -> Decision {
        if step.position == 0 {
            self.survival = 1.0;
        }
        let mut rng = self.draws.rng();
        let bin = self.posterior.bin(step.confidence);
        let theta = self.posterior.posterior(bin).sample(&mut rng);
        if !pays(self.survival * theta, self.cost.0, self.rate) {
            return Decision::Discard;
        }
        self.survival *= theta;
        let thetas = self.posterior.sample(&mut rng);
        let next = self.posterior.expected_next(&thetas);
        marginal_rule(
            self.survival * next,
            self.cost.0,
            self.rate,
            step.position + 1,
            self.max_draft,
        )
    }
    fn observe(&mut self, outcome: &RoundOutcome) {
        self.posterior.update(outcome, self.discount);
        self.cost.update(outcome.cost_ratio);
        let tokens = outcome.accepted as f64 + 1.0;
        let cost = 1.0 + self.cost.0 * outcome.drafted as f64;
        self.rate += 0.05 * (tokens / cost - self.rate);
        self.survival = 1.0;
    }
}

/// The builder methods every Thompson Sampling policy shares (same field names in each).
macro_rules! ts_builders {
    ($ty:ty) => {
        impl $ty {
            /// Sets the discount γ ∈ (0, 1] (1: no forgetting).
            pub fn with_discount(mut self, discount: f64) -> Result<Self> {
                check_discount(discount)?;
                self.discount = discount;
                Ok(self)
            }

            /// Sets the hard cap on drafted tokens per round.
            pub fn with_max_draft(mut self, max_draft: usize) -> Result<Self> {
                check_cap(max_draft)?;
                self.max_draft = max_draft;
                Ok(self)
            }

            /// Sets the draft/verify cost ratio assumed until the loop reports measurements.
            pub fn with_cost_ratio(mut self, ratio: f64) -> Result<Self> {
                check_ratio(ratio)?;
                self.cost = CostRatio(ratio);
                Ok(self)
            }
        }
    };
    ($ty:ty, binned) => {
        ts_builders!($ty);

        impl $ty {
            /// Sets the number of confidence bins and their Beta prior.
            pub fn with_bins(mut self, bins: usize, alpha: f64, beta: f64) -> Result<Self> {
                self.posterior = BinnedPosterior::new(bins, alpha, beta)?;
                Ok(self)
            }
        }
    };
}

ts_builders!(BetaTs);
ts_builders!(CalibratedTs, binned);
ts_builders!(CostAwareTs, binned);

/// Any of this crate's policies, as one serialisable value (save a tuned posterior, reload it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Policy {
    /// [`Fixed`].
    Fixed(Fixed),
    /// [`ConfidenceThreshold`].
    Threshold(ConfidenceThreshold),
    /// [`BetaTs`].
    BetaTs(BetaTs),
    /// [`CalibratedTs`].
    CalibratedTs(CalibratedTs),
    /// [`CostAwareTs`].
    CostTs(CostAwareTs),
}

impl Policy {
    /// Parses `fixed:K`, `threshold:T`, `beta-ts`, `calibrated-ts` or `cost-ts` (each TS with an
    /// optional `:γ` discount, e.g. `beta-ts:0.95`), with the default cap and the given seed.
    pub fn parse(spec: &str, seed: u64) -> Result<Policy> {
        let (kind, arg) = match spec.split_once(':') {
            Some((k, a)) => (k, Some(a)),
            None => (spec, None),
        };
        let number = |a: Option<&str>| -> Result<Option<f64>> {
            a.map(|a| {
                a.parse::<f64>()
                    .map_err(|_| BanditError::UnknownPolicy(spec.into()))
            })
            .transpose()
        };
        Ok(match kind {
            "fixed" => {
                let k = arg
                    .and_then(|a| a.parse().ok())
                    .ok_or_else(|| BanditError::UnknownPolicy(spec.into()))?;
                Policy::Fixed(Fixed::new(k)?)
            }
            "threshold" => {
                let t = number(arg)?.ok_or_else(|| BanditError::UnknownPolicy(spec.into()))?;
                Policy::Threshold(ConfidenceThreshold::new(t as f32, DEFAULT_MAX_DRAFT)?)
            }
            "beta-ts" => {
                Policy::BetaTs(BetaTs::new(seed).with_discount(number(arg)?.unwrap_or(1.0))?)
            }
            "calibrated-ts" => Policy::CalibratedTs(
                CalibratedTs::new(seed).with_discount(number(arg)?.unwrap_or(1.0))?,
            ),
            "cost-ts" => {
                Policy::CostTs(CostAwareTs::new(seed).with_discount(number(arg)?.unwrap_or(1.0))?)
            }
            _ => return Err(BanditError::UnknownPolicy(spec.into())),
        })
    }

    fn inner(&mut self) -> &mut dyn DraftPolicy {
        match self {
            Policy::Fixed(p) => p,
            Policy::Threshold(p) => p,
            Policy::BetaTs(p) => p,
            Policy::CalibratedTs(p) => p,
            Policy::CostTs(p) => p,
        }
    }

    fn inner_ref(&self) -> &dyn DraftPolicy {
        match self {
            Policy::Fixed(p) => p,
            Policy::Threshold(p) => p,
            Policy::BetaTs(p) => p,
            Policy::CalibratedTs(p) => p,
            Policy::CostTs(p) => p,
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = BanditError;
    fn from_str(s: &str) -> Result<Self> {
        Policy::parse(s, 0)
    }
}

impl DraftPolicy for Policy {
    fn name(&self) -> String {
        self.inner_ref().name()
    }
    fn max_draft(&self) -> usize {
        self.inner_ref().max_draft()
    }
    fn begin_round(&mut self) -> Decision {
        self.inner().begin_round()
    }
    fn decide(&mut self, step: &DraftStep) -> Decision {
        self.inner().decide(step)
    }
    fn observe(&mut self, outcome: &RoundOutcome) {
        self.inner().observe(outcome)
    }
}
