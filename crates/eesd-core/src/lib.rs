//! Backend-generic early-exit speculative decoding (EESD) on burn.
//!
//! - [`generate`]: the generation API shared by plain autoregressive decoding and EESD, so both
//!   are measured on equal terms.
//! - [`sampling`]: temperature / top-k / top-p distributions and a seeded sampler.
//! - [`backend`]: picking a burn device by name (`flex`, `tch`, `tch-cuda`, `cuda`).

pub mod backend;
pub mod error;
pub mod generate;
pub mod sampling;

pub use backend::Backend;
pub use burn::tensor::Device;
pub use error::{CoreError, Result};
pub use generate::{
    CausalModel, GenerationConfig, GenerationOutput, GenerationStats, StopReason, generate_ar,
};
pub use sampling::{Sampler, SamplingParams, argmax};
