//! Self-distillation of early-exit heads from the frozen full model.
//!
//! - [`checkpoint`]: trained head weights (safetensors) with JSON metadata that binds them to a
//!   base model (file SHA-256), an exit layer and a vocabulary subset.
//! - [`data`]: the frozen model's own greedy answers to training prompts, many decoded at once.
//! - [`distill`]: the training loop (KL to the frozen model, AdamW, warm-up + cosine) and
//!   held-out evaluation (top-1 agreement, expected accepted tokens per round); whole sequences
//!   are packed into one block per step ([`distill::pack`]).
//! - [`state`]: resumable training (head weights, optimizer moments, step).

#![warn(missing_docs)]

pub mod checkpoint;
pub mod data;
pub mod distill;
pub mod error;
pub mod state;

pub use checkpoint::{HeadMetadata, file_sha256, load_layer_head, read_metadata, save_layer_head};
pub use data::{AnswerConfig, generate_answers};
pub use distill::{DistillConfig, Distiller, EvalMetrics, Sequence, pack};
pub use error::{Result, TrainError};
pub use state::{TrainingState, read_state, state_path};
