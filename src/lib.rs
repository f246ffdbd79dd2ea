//! # eesd — early-exiting self-speculative decoding on burn
//!
//! The first N layers of a LLaMA model plus a small exit head draft tokens; the full model
//! verifies them in one pass that reuses the first N layers' work. Greedy output is identical to
//! plain autoregressive decoding, sampling has exactly its distribution.
//!
//! This crate re-exports the workspace crates:
//! - [`bandit`]: draft-length policies (Thompson Sampling and baselines), pure Rust.
//! - [`core`]: the generation API, verify/accept and the decoding loop.
//! - [`models`]: LLaMA, exit heads, weight loading (GGUF, safetensors), tokenizer, chat template.
//! - [`train`]: self-distillation of exit heads and head checkpoints.

pub use eesd_bandit as bandit;
pub use eesd_core as core;
pub use eesd_models as models;
pub use eesd_train as train;
