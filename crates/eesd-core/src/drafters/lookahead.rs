//! A lookahead head inside a tree drafter: the head's best children of each root, weighed into
//! another drafter's tree (RASD-style fusion of a model's drafts with train-free ones).
//!
//! The head reads the layer-N states that verification computes for every row anyway
//! ([`LookaheadHead`]), so its drafts cost one pass of the head per round and never a pass
//! through the model's first layers. By default it drafts the first level only and the inner
//! drafter continues below its candidates (Token Recycling's matrix knows what usually follows
//! them); [`HeadDrafter::with_levels`] drafts deeper along the head's best child, feeding the
//! head its own state (EAGLE-style), one more pass of the head per level.

use burn::tensor::Tensor;

use crate::drafter::{Drafter, Suggestion, top_k};
use crate::error::{CoreError, Result};
use crate::generator::host;
use crate::math::exp;
use crate::model::{LayeredModel, LookaheadHead};
use crate::sampling::softmax_normaliser;
use crate::tree::DraftTree;

/// Children of each root the head offers.
const HEAD_CHILDREN: usize = 4;

/// A drafter that asks a [`LookaheadHead`] for the root's likely children and hands them to
/// `inner` ([`Drafter::suggest`]); an inner drafter that ignores suggestions gets the head's
/// best child merged ahead of its own tree.
pub struct HeadDrafter<'a, M: LayeredModel, H: LookaheadHead<M>, D> {
    model: &'a M,
    head: &'a H,
    cache: H::Cache,
    inner: D,
    /// Levels drafted below the root (1: the root's children only).
    levels: usize,
    /// The head's nodes below the next root, with their draft probabilities, and that root's
    /// position (nodes of another position are stale: a new sequence began).
    suggested: Vec<Suggestion>,
    root: usize,
}

impl<'a, M: LayeredModel, H: LookaheadHead<M>, D: Drafter> HeadDrafter<'a, M, H, D> {
    /// `head` (for `model`) feeding `inner`.
    pub fn new(model: &'a M, head: &'a H, inner: D) -> Self {
        HeadDrafter {
            model,
            head,
            cache: head.new_cache(model),
            inner,
            levels: 1,
            suggested: Vec::new(),
            root: 0,
        }
    }

    /// Drafts `levels` levels below each root (at least 1): below the root's children, the
    /// children of the head's best child, and so on, each level one pass of the head on its
    /// own state of the level before.
    pub fn with_levels(mut self, levels: usize) -> Self {
        self.levels = levels.max(1);
        self
    }

    /// The inner drafter.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The head's nodes below the next root: its children best first, then deeper levels.
    pub fn suggested(&self) -> &[Suggestion] {
        &self.suggested
    }
}

/// The `k` most probable tokens of one row of draft logits (columns mapped to token ids when
/// the head projects onto a subset), with their softmax probabilities.
fn most_probable(logits: &[f32], ids: Option<&[u32]>, k: usize) -> Vec<(u32, f64)> {
    let Some((max, total)) = softmax_normaliser(logits) else {
        return Vec::new();
    };
    top_k(logits, k)
        .into_iter()
        .map(|c| {
            let token = ids.map_or(c, |ids| ids[c as usize]);
            (token, f64::from(exp(logits[c as usize] - max)) / total)
        })
        .collect()
}

impl<M: LayeredModel, H: LookaheadHead<M>, D: Drafter> Drafter for HeadDrafter<'_, M, H, D> {
    fn name(&self) -> String {
        format!("{}+head", self.inner.name())
    }

    fn propose(&mut self, context: &[u32], budget: usize) -> DraftTree {
        let mut suggested = std::mem::take(&mut self.suggested);
        if context.len() != self.root + 1 {
            suggested.clear();
        }
        if self.inner.suggest(&suggested) {
            return self.inner.propose(context, budget);
        }
        // The head's best path first, then the inner drafter's tree.
        let mut tree = DraftTree::new();
        let mut parent = None;
        for (i, s) in suggested.iter().enumerate() {
            if s.parent == parent.map(|(index, _)| index) && tree.len() < budget {
                let node = tree.push(s.token, parent.map(|(_, node)| node));
                parent = Some((i, node));
            }
        }
        tree.merge(&self.inner.propose(context, budget), budget);
        tree
    }

    fn candidates_wanted(&self) -> usize {
        self.inner.candidates_wanted()
    }

    fn observe(&mut self, token: u32, candidates: &[u32], logits: &[f32]) {
        self.inner.observe(token, candidates, logits);
    }

    fn verified(&mut self, tree: &DraftTree, best: &[u32]) {
        self.inner.verified(tree, best);
    }

    fn drawn(&mut self, tree: &DraftTree, rows: &[usize], distributions: &[Vec<f32>]) {
        self.inner.drawn(tree, rows, distributions);
    }

    fn emitted(&mut self, tokens: usize) {
        self.inner.emitted(tokens);
    }

    fn round_time(&mut self, rows: usize, seconds: f64) {
        self.inner.round_time(rows, seconds);
    }

    fn choices(&self) -> Vec<(String, u64)> {
        self.inner.choices()
    }

    fn state(&self) -> Option<super::DrafterState> {
        self.inner.state()
    }

    fn restore(&mut self, state: super::DrafterState) -> Result<()> {
        self.inner.restore(state)
    }

    fn feature_layers(&self) -> Vec<usize> {
        self.head.feature_layers()
    }

    fn features(&mut self, position: usize, hidden: Tensor<2>, next: &[u32]) -> Result<()> {
        // A new sequence (or one that went back) starts over; a gap would misplace positions.
        let cached = self.head.cached_len(&self.cache);
        if position > cached {
            return Err(CoreError::InvalidConfig(format!(
                "lookahead head: positions from {position} after {cached} cached ones"
            )));
        }
        self.head.truncate(&mut self.cache, position);
        self.suggested.clear();
        self.root = position + next.len();
        let mut draft = self
            .head
            .lookahead(self.model, hidden, next, &mut self.cache)
            .map_err(CoreError::model)?;
        let mut parent = None;
        for level in 1..=self.levels {
            let logits = host(draft.draft.logits)?;
            let ids = draft.draft.token_ids.as_deref().map(Vec::as_slice);
            let first = self.suggested.len();
            self.suggested
                .extend(most_probable(&logits, ids, HEAD_CHILDREN).into_iter().map(
                    |(token, probability)| Suggestion {
                        token,
                        probability,
                        parent,
                    },
                ));
            // One level deeper below the best child: the head's own state stands in for the
            // model's at the child's parent, in a row at the next position (inside the context).
            let room = self.head.cached_len(&self.cache) < self.model.context_length();
            let Some(best) = self
                .suggested
                .get(first)
                .filter(|_| level < self.levels && room)
            else {
                break;
            };
            let token = best.token;
            parent = Some(first);
            draft = self
                .head
                .lookahead(self.model, draft.state, &[token], &mut self.cache)
                .map_err(CoreError::model)?;
        }
        // Only committed positions stay in the head's cache.
        self.head.truncate(&mut self.cache, self.root);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_are_the_most_probable_tokens_with_their_probabilities() {
        let logits = [0.0, 2.0, 1.0, f32::NEG_INFINITY];
        let kids = most_probable(&logits, Some(&[10, 11, 12, 13]), 2);
        let total = 1.0 + 2f64.exp() + 1f64.exp();
        assert_eq!(kids.iter().map(|k| k.0).collect::<Vec<_>>(), vec![11, 12]);
        assert!((kids[0].1 - 2f64.exp() / total).abs() < 1e-6);
        assert!((kids[1].1 - 1f64.exp() / total).abs() < 1e-6);
        assert!(most_probable(&[f32::NAN; 3], None, 2).is_empty());
    }
}
