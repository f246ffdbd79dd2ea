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
//! - `train` (cargo feature `train`): self-distillation of exit heads; inference builds
//!   leave it and autodiff out and load trained heads through [`models::load_layer_head`].
//!
//! ```no_run
//! use std::ops::ControlFlow;
//!
//! use eesd::bandit::CostAwareTs;
//! use eesd::core::{Backend, GenerationConfig, Generator, Mode};
//! use eesd::models::{LoadOptions, LoadedModel, NormHead, fetch};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let device = Backend::Flex.device()?; // or "tch".parse::<Backend>()?.device()?
//! let path = fetch::resolve_model(None)?; // $EESD_MODEL, the cache, or PyPI on first use
//! let lm = LoadedModel::load(&path, &device, &LoadOptions::default())?;
//! let prompt = lm.chat_prompt("What is speculative decoding?")?;
//!
//! let head = NormHead::new(); // or a trained LayerHead: eesd::models::load_layer_head(...)
//! let mut generator = Generator::new(&lm.model).with_head(&head).with_policy(CostAwareTs::new(0));
//! let config = GenerationConfig {
//!     mode: Mode::Eesd,
//!     exit_layer: Some(8),
//!     max_new_tokens: 64,
//!     stop_tokens: lm.tokenizer.eos_token_id().into_iter().collect(),
//!     ..Default::default()
//! };
//! let out = generator.generate(&prompt, &config, |tokens| {
//!     print!("{}", lm.tokenizer.decode(tokens, true).unwrap_or_default());
//!     ControlFlow::Continue(())
//! })?;
//! println!("\n{:.1} tokens/s, {:.2} tokens per round", out.stats.tokens_per_second, out.stats.mean_accepted);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub use eesd_bandit as bandit;
pub use eesd_core as core;
pub use eesd_models as models;
#[cfg(feature = "train")]
pub use eesd_train as train;

/// Path prefix of the exit head shipped for SmolLM2-135M-Instruct (`PREFIX.safetensors`, f16,
/// and `PREFIX.json`), trained by `examples/train_exit_head.rs`; load it with
/// [`models::load_layer_head`]. The checkpoint records the base model's SHA-256, so loading it
/// for another model is an error.
pub const SHIPPED_HEAD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/assets/heads/smollm2-135m-instruct"
);

/// Path prefix of the lookahead head shipped for SmolLM2-135M-Instruct (EAGLE-style input: the
/// last layer's state and the next token's embedding; drafts each tree root's children beside a
/// train-free drafter, through [`core::drafters::HeadDrafter`]); load it with
/// [`models::load_lookahead_head`]. Tied to the base model's SHA-256 like [`SHIPPED_HEAD`].
pub const SHIPPED_LOOKAHEAD_HEAD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/assets/heads/smollm2-135m-instruct-lookahead"
);
