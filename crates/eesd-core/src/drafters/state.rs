//! What drafters learn that outlives a generation, as one serialisable value: a command-line
//! run can save it and the next run start warm (Token Recycling's matrix is worth ≈ 7% more
//! tokens per round once it has seen a few thousand positions; see `spec_bench --warm`).

use serde::{Deserialize, Serialize};

use super::TokenRecycling;
use crate::error::CoreError;

/// The learnt state of a drafter ([`crate::Drafter::state`]), restored into a drafter of the
/// same kind with [`crate::Drafter::restore`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DrafterState {
    /// Token Recycling's adjacency matrix.
    Recycling(TokenRecycling),
    /// The adaptive tree's matrix and the decayed hit and trial counts of its kinds of edge.
    Opt {
        /// The recycling matrix.
        recycling: TokenRecycling,
        /// Hits per kind of edge.
        hits: Vec<f64>,
        /// Trials per kind of edge.
        seen: Vec<f64>,
    },
    /// The states of the drafters inside a fusion or a Thompson Sampling choice, in order
    /// (`None` for one that keeps nothing).
    Parts(Vec<Option<DrafterState>>),
}

impl DrafterState {
    /// What the state holds, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            DrafterState::Recycling(_) => "a recycling matrix",
            DrafterState::Opt { .. } => "an adaptive tree's matrix and rates",
            DrafterState::Parts(_) => "the states of several drafters",
        }
    }

    /// The error of drafter `drafter`, which cannot take this state.
    pub fn refused_by(&self, drafter: &str) -> CoreError {
        CoreError::InvalidConfig(format!("drafter {drafter} cannot take {}", self.kind()))
    }
}
