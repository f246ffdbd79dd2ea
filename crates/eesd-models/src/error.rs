//! Errors of model loading, tokenization and inference.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
///
/// Every variant is reachable from user input (a file, a config, a prompt) and names what was wrong
/// and where, so callers can report it without a backtrace.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// Reading a file failed at the operating-system level.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file being read.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file does not start with the GGUF magic bytes.
    #[error("not a GGUF file: bad magic {found:02x?} (expected \"GGUF\")")]
    BadMagic {
        /// The first four bytes found.
        found: [u8; 4],
    },
    /// A GGUF version this reader does not understand.
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    /// The file ended before a structure it announced was complete.
    #[error("file is truncated: needed {needed} bytes at offset {offset}, file has {len}")]
    Truncated {
        /// Offset where the read started.
        offset: u64,
        /// Number of bytes needed.
        needed: u64,
        /// Total file length.
        len: u64,
    },
    /// A structurally invalid file (bad value type, absurd count, invalid UTF-8 ...).
    #[error("malformed model file: {0}")]
    Malformed(String),
    /// A tensor element type this crate cannot dequantize.
    #[error("tensor `{name}` has unsupported type {kind}")]
    UnsupportedTensorType {
        /// Tensor name.
        name: String,
        /// The type, as named by the file format.
        kind: String,
    },
    /// A tensor the architecture needs is absent.
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    /// A tensor has a different shape from what the config implies.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Tensor name.
        name: String,
        /// Shape required by the config.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A required metadata key or config field is absent.
    #[error("missing metadata key `{0}`")]
    MissingMetadata(String),
    /// A metadata key holds a value of the wrong type.
    #[error("metadata key `{key}` should be {expected}")]
    MetadataType {
        /// The key.
        key: String,
        /// What was expected.
        expected: &'static str,
    },
    /// The file describes an architecture other than LLaMA.
    #[error("unsupported architecture `{0}` (supported: llama)")]
    UnsupportedArchitecture(String),
    /// The config is internally inconsistent or out of range.
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// Tokenizer vocabulary and embedding matrix disagree.
    #[error("tokenizer has {tokenizer} tokens but the embedding has {embedding} rows")]
    VocabMismatch {
        /// Token count of the tokenizer.
        tokenizer: usize,
        /// Rows of the embedding matrix.
        embedding: usize,
    },
    /// A tokenizer that cannot be built or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A chat template that does not parse or render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange {
        /// Offending id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A forward pass would run past the model's context length or its cache.
    #[error("context overflow: {needed} positions needed, the context holds {limit}")]
    ContextOverflow {
        /// Positions that would be needed.
        needed: usize,
        /// Positions available.
        limit: usize,
    },
    /// An invalid argument to a model method (empty token block, bad layer range ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A head checkpoint file that cannot be parsed.
    #[error("malformed head checkpoint {path}: {reason}")]
    MalformedHead {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A head checkpoint made for another base model, exit layer or architecture.
    #[error("checkpoint does not fit this model: {0}")]
    HeadMismatch(String),
    /// A drafter state file that cannot be parsed (see [`crate::drafter_state`]).
    #[error("malformed drafter state {path}: {reason}")]
    MalformedDrafterState {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A drafter state learnt with another model file.
    #[error(
        "drafter state {path} was learnt with another model file (SHA-256 {found}); give \
         another file or remove it"
    )]
    DrafterStateMismatch {
        /// The file.
        path: PathBuf,
        /// The SHA-256 it records.
        found: String,
    },
    /// A failure reading a tensor back from the device.
    #[error("tensor data: {0}")]
    TensorData(String),
}

/// Result alias of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
