//! Drafters: anything that proposes a tree of tokens for one verification round.
//!
//! A drafter sees the committed context (prompt and generated tokens; the last one is the
//! tree's root) and a node budget, and returns a [`DraftTree`]. Drafters that learn from the
//! target model (Token Recycling) ask for the target's best next tokens at every verified
//! position, off-path tree nodes and prompt positions included, through
//! [`Drafter::observe`]. Drafters in this crate cost microseconds per round; see
//! [`crate::drafters`].

use burn::tensor::Tensor;

use crate::drafters::DrafterState;
use crate::error::Result;
use crate::tree::DraftTree;

/// A node another source (a lookahead head) proposes below the next root.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Suggestion {
    /// The drafted token.
    pub token: u32,
    /// The source's probability of it after its parent.
    pub probability: f64,
    /// Its parent's index among the suggestions; `None` for a child of the root.
    pub parent: Option<usize>,
}

impl Suggestion {
    /// A child of the root.
    pub fn child(token: u32, probability: f64) -> Self {
        Suggestion {
            token,
            probability,
            parent: None,
        }
    }
}

/// Proposes draft trees and learns from verification.
pub trait Drafter {
    /// A short name for reports (`recycle`, `lookup`, ...).
    fn name(&self) -> String;

    /// A tree of at most `budget` nodes continuing `context` (non-empty; its last token is the
    /// root, which is not part of the tree).
    fn propose(&mut self, context: &[u32], budget: usize) -> DraftTree;

    /// How many of the target's most likely next tokens per verified position this drafter
    /// wants in [`Drafter::observe`] (0: it never observes, and the loop skips the work).
    fn candidates_wanted(&self) -> usize {
        0
    }

    /// The target's most likely next tokens (best first) after `token` at one verified
    /// position, with their logits (`logits[i]` is `candidates[i]`'s). Called for every row
    /// the target computed, accepted or not.
    fn observe(&mut self, token: u32, candidates: &[u32], logits: &[f32]) {
        let _ = (token, candidates, logits);
    }

    /// After a round's verification: the tree that was verified (the one this drafter proposed,
    /// possibly cut shorter) and the target's most likely token at each of its rows (`best[0]`
    /// after the root, `best[i + 1]` after node `i`). Called before that round's
    /// [`Drafter::observe`] calls.
    fn verified(&mut self, tree: &DraftTree, best: &[u32]) {
        let _ = (tree, best);
    }

    /// Sampling only, right before [`Drafter::verified`]: the rows the target's token was drawn
    /// from (`rows[0]` is the root's row 0, then the accepted nodes' rows `node + 1`, in order)
    /// and the distribution each draw used (`distributions[i]` over the vocabulary, for
    /// `rows[i]`). A candidate's chance of acceptance after such a row is its probability
    /// there, where `verified`'s argmax tokens would count it accepted or not outright, which
    /// overstates acceptance when sampling: drafters that rate candidates learn from these.
    fn drawn(&mut self, tree: &DraftTree, rows: &[usize], distributions: &[Vec<f32>]) {
        let _ = (tree, rows, distributions);
    }

    /// The tokens a round emits: the accepted drafts plus the target's own (in sampling mode
    /// the accepted path is drawn, so [`Drafter::verified`]'s best tokens do not tell it).
    /// Called after [`Drafter::verified`] and before [`Drafter::round_time`].
    fn emitted(&mut self, tokens: usize) {
        let _ = tokens;
    }

    /// The wall time of a whole round (drafting, verification, observation) that verified
    /// `rows` rows, the root included; for drafters that size their trees by what rows cost
    /// (see [`crate::drafters::RoundCost`]). Called after the round's other calls.
    fn round_time(&mut self, rows: usize, seconds: f64) {
        let _ = (rows, seconds);
    }

    /// For a drafter that picks one of several drafters each round
    /// ([`crate::drafters::ThompsonDrafters`]): a label of each one (unique among them) and the
    /// rounds it drafted so far, in order; empty for every other drafter.
    fn choices(&self) -> Vec<(String, u64)> {
        Vec::new()
    }

    /// The layers whose hidden states this drafter reads ([`Drafter::features`]), ascending,
    /// each in `1..=num_layers`; empty (the default) for drafters that read tokens only.
    fn feature_layers(&self) -> Vec<usize> {
        Vec::new()
    }

    /// Newly committed positions `position..position + t`: `hidden: [t, k·hidden]` their
    /// states after each of the `k` [`Drafter::feature_layers`], side by side in that order, and
    /// `next[i]` the token that follows position `position + i` (the last one is the next
    /// round's root). Called only when feature layers are named: at prefill for every prompt
    /// position but the last (`position` 0: a new sequence), then after each round for the rows
    /// it kept.
    fn features(&mut self, position: usize, hidden: Tensor<2>, next: &[u32]) -> Result<()> {
        let _ = (position, hidden, next);
        Ok(())
    }

    /// Candidate nodes below the next root from another source (a lookahead head), for the
    /// next [`Drafter::propose`] only: parents before their children, siblings best first.
    /// Returns whether this drafter weighs them into its tree (the default ignores them).
    fn suggest(&mut self, suggestions: &[Suggestion]) -> bool {
        let _ = suggestions;
        false
    }

    /// What this drafter has learnt that is worth keeping for a later run (Token Recycling's
    /// matrix, the adaptive tree's rates), or `None` when it learns nothing lasting (the
    /// default).
    fn state(&self) -> Option<DrafterState> {
        None
    }

    /// Takes over `state`, saved by [`Drafter::state`] of a drafter of the same spec and
    /// vocabulary. A state that does not fit (another kind of drafter, vocabulary or candidate
    /// count) is an error and changes nothing; the default keeps no state and refuses any.
    fn restore(&mut self, state: DrafterState) -> Result<()> {
        Err(state.refused_by(&self.name()))
    }
}

impl<D: Drafter + ?Sized> Drafter for Box<D> {
    fn name(&self) -> String {
        (**self).name()
    }
    fn propose(&mut self, context: &[u32], budget: usize) -> DraftTree {
        (**self).propose(context, budget)
    }
    fn candidates_wanted(&self) -> usize {
        (**self).candidates_wanted()
    }
    fn observe(&mut self, token: u32, candidates: &[u32], logits: &[f32]) {
        (**self).observe(token, candidates, logits)
    }
    fn verified(&mut self, tree: &DraftTree, best: &[u32]) {
        (**self).verified(tree, best)
    }
    fn drawn(&mut self, tree: &DraftTree, rows: &[usize], distributions: &[Vec<f32>]) {
        (**self).drawn(tree, rows, distributions)
    }
    fn emitted(&mut self, tokens: usize) {
        (**self).emitted(tokens)
    }
    fn round_time(&mut self, rows: usize, seconds: f64) {
        (**self).round_time(rows, seconds)
    }
    fn choices(&self) -> Vec<(String, u64)> {
        (**self).choices()
    }
    fn feature_layers(&self) -> Vec<usize> {
        (**self).feature_layers()
    }
    fn features(&mut self, position: usize, hidden: Tensor<2>, next: &[u32]) -> Result<()> {
        (**self).features(position, hidden, next)
    }
    fn suggest(&mut self, suggestions: &[Suggestion]) -> bool {
        (**self).suggest(suggestions)
    }
    fn state(&self) -> Option<DrafterState> {
        (**self).state()
    }
    fn restore(&mut self, state: DrafterState) -> Result<()> {
        (**self).restore(state)
    }
}

/// The `k` largest values' indices of `values`, largest first (ties: lower index first; NaN
/// never counts).
///
/// Runs once per verified row over the whole vocabulary, so it skips blocks of values whose
/// maximum (found in vector registers) cannot enter the `k` kept so far: a vocabulary of
/// 49,152 costs ≈ 13 µs instead of ≈ 44 µs, with the same result.
pub fn top_k(values: &[f32], k: usize) -> Vec<u32> {
    use crate::sampling::{BLOCK, block_max};
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for (b, block) in values.chunks(BLOCK).enumerate() {
        if best.len() == k && block_max(block) <= best[k - 1].0 {
            continue;
        }
        for (j, &v) in block.iter().enumerate() {
            if v.is_nan() || (best.len() == k && v <= best[k - 1].0) {
                continue;
            }
            let at = best.partition_point(|&(b, _)| b >= v);
            best.insert(at, (v, (b * BLOCK + j) as u32));
            best.truncate(k);
        }
    }
    best.into_iter().map(|(_, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::top_k;

    /// The definition [`top_k`] must match: insertion of every value into the sorted best `k`.
    fn top_k_reference(values: &[f32], k: usize) -> Vec<u32> {
        let k = k.min(values.len());
        let mut best: Vec<(f32, u32)> = Vec::new();
        for (i, &v) in values.iter().enumerate() {
            if v.is_nan() || (best.len() == k && v <= best[k - 1].0) {
                continue;
            }
            let at = best.partition_point(|&(b, _)| b >= v);
            best.insert(at, (v, i as u32));
            best.truncate(k);
        }
        best.into_iter().map(|(_, i)| i).collect()
    }

    #[test]
    fn top_k_matches_its_definition() {
        for row in crate::sampling::tests::awkward_rows() {
            for k in [1, 2, 8, 40] {
                assert_eq!(top_k(&row, k), top_k_reference(&row, k), "k = {k}: {row:?}");
            }
        }
    }

    #[test]
    fn top_k_is_sorted_and_stable() {
        assert_eq!(top_k(&[1.0, 5.0, 3.0, 5.0, -1.0], 3), vec![1, 3, 2]);
        assert_eq!(top_k(&[2.0], 4), vec![0]);
        assert!(top_k(&[], 2).is_empty());
        assert!(top_k(&[1.0], 0).is_empty());
    }
}
