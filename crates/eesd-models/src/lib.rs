//! LLaMA-family models for early-exit speculative decoding on burn.
//!
//! - [`Llama`]: a LLaMA decoder whose layers run in ranges (`[0, N)` then `[N, L)`), with a
//!   per-layer [`KvCache`] that truncates in O(1).
//! - Loading: [`GgufFile`] (GGUF v2/v3, F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K) and Hugging Face
//!   safetensors directories, through [`Checkpoint`].
//! - [`Tokenizer`] from `tokenizer.json` or GGUF metadata, and [`ChatTemplate`] rendering.
//! - Exit heads ([`heads`]) and their trained checkpoints ([`checkpoint`]), loadable without the
//!   training crate.

#![warn(missing_docs)]

pub mod cache;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod cpu;
pub mod draft_vocab;
pub mod drafter_state;
pub mod error;
pub mod fetch;
pub mod file_bytes;
pub mod fuzz;
pub mod gguf;
pub mod heads;
pub mod layer;
pub mod layered;
pub mod llama;
pub mod loader;
pub mod native;
pub mod quant;
pub mod rope;
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use cache::{KvCache, LayerCache};
pub use chat::{ChatMessage, ChatTemplate};
pub use checkpoint::{
    HeadMetadata, file_sha256, load_layer_head, load_lookahead_head, read_metadata,
    save_layer_head, write_atomically,
};
pub use config::{Llama3RopeScaling, LlamaConfig};
pub use draft_vocab::{ContextTokens, VocabSubset};
pub use drafter_state::{SavedDrafterState, read_drafter_state, write_drafter_state};
pub use error::{ModelError, Result};
pub use gguf::{GgufFile, GgufTensorInfo, GgufValue};
pub use heads::{
    AnyHead, AnyHeadCache, HeadKind, LayerHead, LayerHeadCache, LayerHeadWeights, MAX_HEAD_LAYERS,
    NormHead,
};
pub use layer::{AttentionContext, DecoderLayer};
pub use llama::{ForwardCost, Llama, LmHeadRows, WeightDType};
pub use loader::{LoadOptions, LoadedModel};
pub use quant::GgmlType;
pub use tokenizer::{TextStream, Tokenizer};
pub use weights::{Checkpoint, HostTensor, QuantizedTensor, WeightName};
