//! Self-distillation of early-exit heads from the frozen full model.
//!
//! - head checkpoints (saving and loading) live in [`eesd_models::checkpoint`], so inference
//!   builds load heads without this crate; they are re-exported here.
//! - [`data`]: the frozen model's own answers to training prompts (greedy or sampled), many
//!   decoded at once.
//! - [`distill`]: the training loop (KL to the frozen model, AdamW, warm-up + cosine) and
//!   held-out evaluation (top-1 agreement, expected accepted tokens per round); whole sequences
//!   are packed into one block per step ([`distill::pack`]); one [`Teacher`] pass over a block
//!   serves heads at several exit layers ([`Distiller::train_step_on`]).
//! - [`jsonl`]: the append-only answer logs, cut clean after a kill and read a line at a time.
//! - [`state`]: resumable training (head weights, optimizer moments, step).
//! - [`teacher_cache`]: the frozen model's states per training block kept on disk, so that
//!   passes after the first over the data skip its forward pass.

#![warn(missing_docs)]

pub mod data;
pub mod distill;
pub mod error;
pub mod fuzz;
pub mod jsonl;
pub mod state;
pub mod teacher_cache;

pub use data::{AnswerConfig, AnswerPrompt, generate_answers};
pub use distill::{
    DistillConfig, Distiller, EvalMetrics, EvalSet, MAX_LEVELS, Sequence, Teacher, pack,
};
pub use eesd_models::checkpoint::{
    self, HeadMetadata, file_sha256, load_layer_head, read_metadata, save_layer_head,
};
pub use error::{Result, TrainError};
pub use jsonl::{LineIndex, recover_jsonl};
pub use state::{TrainingState, read_state, state_path};
pub use teacher_cache::{CacheOutcome, TeacherCache};
