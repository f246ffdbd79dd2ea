//! Drafters that cost almost nothing: Token Recycling, context lookup, their fusion, the
//! adaptive tree built from both (and from an n-gram store of the model's own writing), a
//! lookahead head's drafts weighed into it, and Thompson Sampling over whole drafters by their
//! measured tokens per second.

mod fused;
mod lookahead;
mod lookup;
mod ngram_store;
mod opt_tree;
mod recycling;
mod round_cost;
mod spec;
mod state;
mod thompson;

pub use fused::Fused;
pub use lookahead::HeadDrafter;
pub use lookup::ContextLookup;
pub use ngram_store::{Continuation, NgramStore};
pub use opt_tree::OptTree;
pub use recycling::{SparseMatrix, TokenRecycling, TreeShape};
pub use round_cost::RoundCost;
pub use spec::{DrafterKind, DrafterSpec};
pub use state::DrafterState;
pub use thompson::ThompsonDrafters;

/// Drafters that share the rounds of one generator, each with its node cap ([`Fused`],
/// [`ThompsonDrafters`]).
type Capped = (Box<dyn crate::drafter::Drafter + Send>, usize);

/// The states of `drafters`, in order, or `None` when none keeps any.
fn part_states(drafters: &[Capped]) -> Option<DrafterState> {
    let states: Vec<Option<DrafterState>> = drafters.iter().map(|(d, _)| d.state()).collect();
    states
        .iter()
        .any(Option::is_some)
        .then_some(DrafterState::Parts(states))
}

/// Restores each of `drafters` from its part of `state` (from [`part_states`] of drafters of
/// the same spec).
fn restore_parts(
    name: &str,
    drafters: &mut [Capped],
    state: DrafterState,
) -> Result<(), crate::CoreError> {
    let parts = match state {
        DrafterState::Parts(parts) if parts.len() == drafters.len() => parts,
        DrafterState::Parts(parts) => {
            return Err(crate::CoreError::InvalidConfig(format!(
                "drafter {name} has {} drafters, the state {}",
                drafters.len(),
                parts.len()
            )));
        }
        other => return Err(other.refused_by(name)),
    };
    for ((drafter, _), part) in drafters.iter_mut().zip(parts) {
        if let Some(part) = part {
            drafter.restore(part)?;
        }
    }
    Ok(())
}

/// The most candidates per verified row any of `drafters` wants.
fn most_wanted(drafters: &[Capped]) -> usize {
    drafters
        .iter()
        .map(|(d, _)| d.candidates_wanted())
        .max()
        .unwrap_or(0)
}

/// Shows one verified row to every drafter that observes, with as many of the candidates as it
/// wants.
fn observe_each(drafters: &mut [Capped], token: u32, candidates: &[u32], logits: &[f32]) {
    for (drafter, _) in drafters {
        let wanted = drafter.candidates_wanted();
        if wanted > 0 {
            let n = wanted.min(candidates.len()).min(logits.len());
            drafter.observe(token, &candidates[..n], &logits[..n]);
        }
    }
}

/// A candidate of a best-first tree search, ordered by the probability that its path is
/// accepted (a max-heap pops the most probable first).
struct Likely<T> {
    probability: f64,
    item: T,
}

impl<T> PartialEq for Likely<T> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl<T> Eq for Likely<T> {}
impl<T> PartialOrd for Likely<T> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for Likely<T> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.probability.total_cmp(&other.probability)
    }
}
