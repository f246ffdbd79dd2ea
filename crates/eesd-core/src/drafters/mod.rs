//! Drafters that cost almost nothing: Token Recycling, context lookup, and their fusion.

mod fused;
mod lookup;
mod recycling;
mod spec;

pub use fused::Fused;
pub use lookup::ContextLookup;
pub use recycling::{TokenRecycling, TreeShape};
pub use spec::{DrafterKind, DrafterSpec};
