//! Drafters that cost almost nothing: Token Recycling, context lookup, their fusion, and the
//! adaptive tree built from both.

mod fused;
mod lookup;
mod opt_tree;
mod recycling;
mod spec;

pub use fused::Fused;
pub use lookup::ContextLookup;
pub use opt_tree::OptTree;
pub use recycling::{TokenRecycling, TreeShape};
pub use spec::{DrafterKind, DrafterSpec};
