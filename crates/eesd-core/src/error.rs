//! Errors of the decoding loop.

/// Everything that can go wrong while generating.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// The model failed (bad token, cache inconsistency ...).
    #[error("model: {0}")]
    Model(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A generation setting is out of range.
    #[error("invalid generation config: {0}")]
    InvalidConfig(String),
    /// The prompt alone does not fit in the model's context.
    #[error("prompt of {prompt} tokens does not fit the context of {context} positions")]
    PromptTooLong {
        /// Prompt length.
        prompt: usize,
        /// Context length.
        context: usize,
    },
    /// Reading tensor data back from the device failed.
    #[error("tensor data: {0}")]
    TensorData(String),
    /// A backend that was not compiled in, or an unknown backend name.
    #[error("backend `{name}` is unavailable: {reason}")]
    Backend {
        /// Requested backend.
        name: String,
        /// Why it cannot be used.
        reason: String,
    },
}

impl CoreError {
    /// Wraps a model error.
    pub fn model(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        CoreError::Model(Box::new(e))
    }
}

/// Result alias of this crate.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;
