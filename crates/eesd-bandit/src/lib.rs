//! Draft-length policies for speculative decoding: when to stop drafting and verify.
//!
//! After each drafted token a [`DraftPolicy`] answers continue or stop; after verification it
//! observes how many drafted tokens were accepted. Thompson Sampling policies keep a Bayesian
//! posterior of acceptance ([`BetaTs`], confidence-conditioned [`CalibratedTs`], and the
//! time-priced [`CostAwareTs`]); [`Fixed`] and [`ConfidenceThreshold`] are the baselines.
//! [`sim`] simulates acceptance processes to compare them against the best fixed length.
//! [`RewardTs`] chooses among whole alternatives (drafters) by a measured reward per round.
//!
//! Pure Rust: no tensors, no burn.

#![warn(missing_docs)]

pub mod arms;
pub mod error;
pub mod policies;
pub mod policy;
pub mod posterior;
pub mod sim;

pub use arms::{DEFAULT_ARM_DISCOUNT, RewardArm, RewardTs};
pub use error::{BanditError, Result};
pub use policies::{
    BetaTs, CalibratedTs, ConfidenceThreshold, CostAwareTs, DEFAULT_COST_RATIO, DEFAULT_MAX_DRAFT,
    Fixed, Policy, StepRule,
};
pub use policy::{
    Decision, DraftPolicy, DraftStep, RoundOutcome, best_fixed_length, expected_tokens,
};
pub use posterior::{BetaPosterior, BinnedPosterior};
pub use sim::{Costs, Process, SimReport, oracle_fixed, simulate};
