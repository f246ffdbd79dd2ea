//! Fusion (as in RASD): several drafters' trees merged by common prefix into one tree under one
//! node budget.

use crate::drafter::Drafter;
use crate::tree::DraftTree;

/// Drafters whose trees are merged in order: each proposes at most its own cap of nodes, and
/// paths they share are verified once.
pub struct Fused {
    parts: Vec<super::Capped>,
}

impl Fused {
    /// Drafters with their node caps, in priority order.
    pub fn new(parts: Vec<(Box<dyn Drafter + Send>, usize)>) -> Self {
        Fused { parts }
    }
}

impl std::fmt::Debug for Fused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl Drafter for Fused {
    fn state(&self) -> Option<super::DrafterState> {
        super::part_states(&self.parts)
    }

    fn restore(&mut self, state: super::DrafterState) -> crate::error::Result<()> {
        let name = self.name();
        super::restore_parts(&name, &mut self.parts, state)
    }

    fn name(&self) -> String {
        let names: Vec<String> = self
            .parts
            .iter()
            .map(|(d, cap)| format!("{}:{cap}", d.name()))
            .collect();
        names.join("+")
    }

    fn propose(&mut self, context: &[u32], budget: usize) -> DraftTree {
        let mut tree = DraftTree::new();
        for (drafter, cap) in &mut self.parts {
            if tree.len() >= budget {
                break;
            }
            tree.merge(&drafter.propose(context, (*cap).min(budget)), budget);
        }
        tree
    }

    fn candidates_wanted(&self) -> usize {
        super::most_wanted(&self.parts)
    }

    fn observe(&mut self, token: u32, candidates: &[u32], logits: &[f32]) {
        super::observe_each(&mut self.parts, token, candidates, logits);
    }

    fn verified(&mut self, tree: &DraftTree, best: &[u32]) {
        for (drafter, _) in &mut self.parts {
            drafter.verified(tree, best);
        }
    }

    fn drawn(&mut self, tree: &DraftTree, rows: &[usize], distributions: &[Vec<f32>]) {
        for (drafter, _) in &mut self.parts {
            drafter.drawn(tree, rows, distributions);
        }
    }

    fn emitted(&mut self, tokens: usize) {
        for (drafter, _) in &mut self.parts {
            drafter.emitted(tokens);
        }
    }

    fn round_time(&mut self, rows: usize, seconds: f64) {
        for (drafter, _) in &mut self.parts {
            drafter.round_time(rows, seconds);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drafters::{ContextLookup, TokenRecycling};

    #[test]
    fn merges_in_order_under_one_budget() {
        let mut recycle = TokenRecycling::new(16, 2);
        recycle.observe(2, &[9, 3], &[2.0, 1.0]);
        let mut f = Fused::new(vec![
            (Box::new(ContextLookup::new(1, 1, 4, 1)), 3),
            (Box::new(recycle), 8),
        ]);
        // Lookup: 2 → 9 5 (from "2 9 5"); recycling: 2 → {9, 3}, 9 shared with lookup.
        let tree = f.propose(&[2, 9, 5, 2], 4);
        assert_eq!(tree.tokens(), &[9, 5, 2, 3]);
        assert_eq!(f.propose(&[2, 9, 5, 2], 2).len(), 2);
        assert_eq!(f.candidates_wanted(), 2);
        assert_eq!(f.name(), "lookup:3+recycle:8");
        f.observe(5, &[1, 2, 3], &[3.0, 2.0, 1.0]);
        assert_eq!(f.propose(&[4, 5], 8).tokens(), &[1, 2, 9]);
    }
}
