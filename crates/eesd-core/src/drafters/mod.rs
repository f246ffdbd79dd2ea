//! Drafters that cost almost nothing: Token Recycling, context lookup, their fusion, the
//! adaptive tree built from both, a lookahead head's drafts weighed into it, and Thompson
//! Sampling over whole drafters by their measured tokens per second.

mod fused;
mod lookahead;
mod lookup;
mod opt_tree;
mod recycling;
mod round_cost;
mod spec;
mod thompson;

pub use fused::Fused;
pub use lookahead::HeadDrafter;
pub use lookup::ContextLookup;
pub use opt_tree::OptTree;
pub use recycling::{TokenRecycling, TreeShape};
pub use round_cost::RoundCost;
pub use spec::{DrafterKind, DrafterSpec};
pub use thompson::ThompsonDrafters;

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
