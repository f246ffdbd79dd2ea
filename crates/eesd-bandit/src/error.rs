//! Errors of policy construction and parsing.

/// A policy that cannot be built as specified.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum BanditError {
    /// A parameter out of its range.
    #[error("invalid policy parameter: {0}")]
    InvalidParameter(String),
    /// A policy string that does not parse.
    #[error(
        "unknown policy `{0}` (expected fixed:K, threshold:T, beta-ts, calibrated-ts or cost-ts)"
    )]
    UnknownPolicy(String),
}

/// Result alias of this crate.
pub type Result<T, E = BanditError> = std::result::Result<T, E>;
