//! Verification: which drafted tokens the full model accepts, and the token it adds.
//!
//! Greedy: the longest prefix where the draft equals the target's argmax, then the target's own
//! token. Sampling (Leviathan et al. / Chen et al.): accept draft `x` with probability
//! `min(1, p(x)/q(x))`; at the first rejection draw from `normalize(max(0, p − q))`; when every draft
//! is accepted draw the bonus token from the last `p`. Each emitted token is then distributed
//! exactly as autoregressive sampling from `p` would draw it. Trees: [`accept_tree`].

use crate::sampling::{Sampler, argmax};
use crate::tree::DraftTree;

/// The verdict on one drafted block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Number of drafted tokens accepted (a prefix).
    pub accepted: usize,
    /// The token the target adds after them (correction or bonus).
    pub next: u32,
}

/// Greedy verification. `target_logits` has one row per drafted token plus the bonus row.
pub fn accept_greedy<R: AsRef<[f32]>>(drafts: &[u32], target_logits: &[R]) -> Verdict {
    debug_assert_eq!(target_logits.len(), drafts.len() + 1);
    for (i, &d) in drafts.iter().enumerate() {
        let best = argmax(target_logits[i].as_ref()) as u32;
        if best != d {
            return Verdict {
                accepted: i,
                next: best,
            };
        }
    }
    Verdict {
        accepted: drafts.len(),
        next: argmax(target_logits[drafts.len()].as_ref()) as u32,
    }
}

/// Speculative sampling. `draft_probs[i]` is the distribution `q_i` the i-th draft was drawn from,
/// `target_probs[i]` the target distribution `p_i` at the same position (one more row: the bonus).
pub fn accept_sampling(
    drafts: &[u32],
    draft_probs: &[Vec<f32>],
    target_probs: &[Vec<f32>],
    sampler: &mut Sampler,
) -> Verdict {
    debug_assert_eq!(target_probs.len(), drafts.len() + 1);
    for (i, &d) in drafts.iter().enumerate() {
        let (p, q) = (&target_probs[i], &draft_probs[i]);
        let (px, qx) = (p[d as usize], q[d as usize]);
        // qx > 0 for a token drawn from q; the guard keeps a zero-probability draft rejected.
        if qx > 0.0 && sampler.uniform() < (px / qx).min(1.0) {
            continue;
        }
        let residual: Vec<f32> = p.iter().zip(q).map(|(p, q)| (p - q).max(0.0)).collect();
        let next = if residual.iter().any(|&r| r > 0.0) {
            sampler.categorical(&residual)
        } else {
            sampler.categorical(p)
        };
        return Verdict {
            accepted: i,
            next: next as u32,
        };
    }
    Verdict {
        accepted: drafts.len(),
        next: sampler.categorical(&target_probs[drafts.len()]) as u32,
    }
}

/// The verdict on a verified tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeVerdict {
    /// Accepted nodes, root to leaf (a path of the tree; empty when no draft was accepted).
    pub path: Vec<usize>,
    /// The token the target adds after them.
    pub next: u32,
}

/// Walks a verified tree from the root: `choose(row)` is the target's token at a block row (row
/// 0 the root, row `i + 1` node `i`); the walk descends into the child carrying it and stops at
/// the first row with no such child, whose token becomes [`TreeVerdict::next`].
///
/// With `choose` = argmax this is greedy verification (the longest path of argmax matches).
/// With `choose` = a draw from the target distribution at that row it is lossless sampling for
/// trees of *deterministic* drafts (Token Recycling, lookup, top-k heads): each emitted token is
/// drawn from the target distribution of its own context, exactly as AR would draw it, and a
/// draft is accepted exactly when the draw hits it (the best any rule can do for drafts that
/// carry no draft distribution).
pub fn accept_tree(tree: &DraftTree, mut choose: impl FnMut(usize) -> u32) -> TreeVerdict {
    let mut path = Vec::new();
    let mut row = 0;
    loop {
        let token = choose(row);
        match tree.child(path.last().copied(), token) {
            Some(node) => {
                path.push(node);
                row = node + 1;
            }
            None => return TreeVerdict { path, next: token },
        }
    }
}
