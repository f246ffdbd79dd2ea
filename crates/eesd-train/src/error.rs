//! Errors of head training and checkpoints.

use std::path::PathBuf;

/// Everything that can go wrong while training a head or resuming a run (head checkpoints report
/// [`eesd_models::ModelError`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// File I/O failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A training-state file that cannot be parsed.
    #[error("malformed training state {path}: {reason}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A training setting out of range.
    #[error("invalid training config: {0}")]
    InvalidConfig(String),
    /// Tensor data could not be read back as the expected element type.
    #[error("tensor data: {0}")]
    TensorData(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] eesd_models::ModelError),
}

/// Result alias of this crate.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

impl TrainError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TrainError::Io {
            path: path.into(),
            source,
        }
    }
}
