//! Backend-generic early-exit speculative decoding (EESD) on burn.
//!
//! - [`model`]: the model-side traits — [`LayeredModel`] (layers in ranges, truncatable cache)
//!   and [`DraftHead`] (exit heads).
//! - [`Generator`]: AR and EESD decoding behind one API ([`GenerationConfig`],
//!   [`GenerationOutput`], streaming callback).
//! - [`accept`]: the verification rules (greedy prefix match, speculative sampling, trees).
//! - [`Drafter`], [`drafters`] and [`tree`]: draft trees from Token Recycling, context lookup
//!   and their fusion, verified in one pass.
//! - [`head_eval`]: teacher-forced agreement of exit heads and the acceptance it implies.
//! - [`sampling`]: temperature / top-k / top-p distributions and a seeded sampler.
//! - [`math`]: a vectorisable `exp` (the sampler's and the CPU kernels').
//! - [`backend`]: picking a burn device by name (`flex`, `tch`, `tch-cuda`, `cuda`).

#![warn(missing_docs)]

pub mod accept;
pub mod backend;
pub mod drafter;
pub mod drafters;
pub mod error;
pub mod generate;
pub mod generator;
pub mod head_eval;
pub mod math;
pub mod model;
pub mod sampling;
pub mod tree;

pub use backend::Backend;
pub use burn::tensor::Device;
pub use drafter::{Drafter, Suggestion};
pub use eesd_bandit as bandit;
pub use error::{CoreError, Result};
pub use generate::{GenerationConfig, GenerationOutput, GenerationStats, Mode, StopReason};
pub use generator::{Generator, NoHead};
pub use model::{DraftHead, DraftLogits, LayeredModel, LookaheadDraft, LookaheadHead};
pub use sampling::{Sampler, SamplingParams, argmax};
pub use tree::{DraftTree, TreeMask};
