//! Verification: which drafted tokens the full model accepts, and the token it adds.
//!
//! Greedy: the longest prefix where the draft equals the target's argmax, then the target's own
//! token. Sampling (Leviathan et al. / Chen et al.): accept draft `x` with probability
//! `min(1, p(x)/q(x))`; at the first rejection draw from `normalize(max(0, p − q))`; when every draft
//! is accepted draw the bonus token from the last `p`. Each emitted token is then distributed
//! exactly as autoregressive sampling from `p` would draw it.

use crate::sampling::{Sampler, argmax};

/// The verdict on one drafted block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Number of drafted tokens accepted (a prefix).
    pub accepted: usize,
    /// The token the target adds after them (correction or bonus).
    pub next: u32,
}

/// Greedy verification. `target_logits` has one row per drafted token plus the bonus row.
pub fn accept_greedy(drafts: &[u32], target_logits: &[Vec<f32>]) -> Verdict {
    debug_assert_eq!(target_logits.len(), drafts.len() + 1);
    for (i, &d) in drafts.iter().enumerate() {
        let best = argmax(&target_logits[i]) as u32;
        if best != d {
            return Verdict {
                accepted: i,
                next: best,
            };
        }
    }
    Verdict {
        accepted: drafts.len(),
        next: argmax(&target_logits[drafts.len()]) as u32,
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
