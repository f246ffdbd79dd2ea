//! Token Recycling (Luo et al., arXiv 2408.08696): the candidates the target model itself ranked
//! highest after each token, recycled as drafts.
//!
//! An adjacency matrix holds, per token id, the target's `k` most likely next tokens the last
//! time it verified a position holding that token (every verified position counts: accepted,
//! rejected tree nodes and prompt positions). A draft tree follows a static shape of rank
//! paths from the root: rank 0 is the best candidate after the parent's token. The matrix is
//! the drafter's whole memory; it carries over from one prompt to the next and serialises with
//! serde.

use std::collections::BinaryHeap;

use serde::{Deserialize, Serialize};

use super::{DrafterState, Likely};
use crate::drafter::Drafter;
use crate::error::{CoreError, Result};
use crate::tree::DraftTree;

/// Marks an adjacency entry that was never observed.
const UNKNOWN: u32 = u32::MAX;
/// The logit gap of a candidate recorded without logits (finite, so it serialises as JSON).
const UNKNOWN_GAP: f32 = f32::MAX;

/// A static tree of rank paths: node `i` is candidate `rank` after node `parent` (`None`: the
/// root), parents before children, best-first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeShape {
    nodes: Vec<(Option<usize>, usize)>,
}

impl TreeShape {
    /// How likely the candidate of each rank is to be the target's token, for choosing shapes
    /// (measured on SmolLM2-135M with a recycled matrix; it decays the same way on other
    /// models).
    pub const RANK_PRIOR: [f64; 8] = [0.45, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01];

    /// The `nodes` rank paths of highest prior probability (the product of their ranks'
    /// priors) using ranks below `k`: a tree that is deep along rank 0 and bushy near the root.
    pub fn best_first(nodes: usize, k: usize) -> Self {
        let prior = |rank: usize| Self::RANK_PRIOR.get(rank).copied().unwrap_or(0.005);
        let mut heap: BinaryHeap<Likely<(Option<usize>, usize)>> = (0..k)
            .map(|rank| Likely {
                probability: prior(rank),
                item: (None, rank),
            })
            .collect();
        let mut shape = Vec::with_capacity(nodes);
        while shape.len() < nodes {
            let Some(Likely { probability, item }) = heap.pop() else {
                break;
            };
            shape.push(item);
            let me = shape.len() - 1;
            heap.extend((0..k).map(|r| Likely {
                probability: probability * prior(r),
                item: (Some(me), r),
            }));
        }
        TreeShape { nodes: shape }
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the shape has no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// `(parent, rank)` of each node.
    pub fn nodes(&self) -> &[(Option<usize>, usize)] {
        &self.nodes
    }
}

/// The Token Recycling drafter. It serialises as its observed rows only ([`SparseMatrix`]), and
/// a deserialised matrix is checked (ids inside the vocabulary, row lengths within `k`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(into = "SparseMatrix", try_from = "SparseMatrix")]
pub struct TokenRecycling {
    /// Candidates kept per token.
    k: usize,
    vocab: usize,
    /// `[vocab][k]` next-token candidates, best first; [`UNKNOWN`] where none was seen.
    next: Vec<u32>,
    /// `[vocab][k]` how far each candidate's logit fell below the best one's (for the best:
    /// how far the second fell below it), the target's confidence when it was recorded.
    gaps: Vec<f32>,
    /// Shapes by budget, computed on first use.
    shapes: Vec<TreeShape>,
}

/// Most candidates per token a deserialised matrix may keep (the paper uses 8).
const MAX_K: usize = 64;

/// Largest vocabulary a deserialised matrix may claim (its dense form is allocated).
const MAX_VOCAB: usize = 1 << 22;

/// The serialised form of [`TokenRecycling`]: only the rows that were observed (a few
/// thousand of a vocabulary's tens of thousands after a few prompts).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SparseMatrix {
    /// Candidates kept per token.
    pub k: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// `(token, candidates best first, their logit gaps)` per observed row, by token.
    pub rows: Vec<(u32, Vec<u32>, Vec<f32>)>,
}

impl From<TokenRecycling> for SparseMatrix {
    fn from(m: TokenRecycling) -> Self {
        let rows = (0..m.vocab as u32)
            .filter(|&t| !m.candidates(t).is_empty())
            .map(|t| {
                let (next, gaps) = m.scored(t).unzip();
                (t, next, gaps)
            })
            .collect();
        SparseMatrix {
            k: m.k,
            vocab: m.vocab,
            rows,
        }
    }
}

impl TryFrom<SparseMatrix> for TokenRecycling {
    type Error = String;

    fn try_from(s: SparseMatrix) -> std::result::Result<Self, String> {
        if s.k == 0 || s.k > MAX_K || s.vocab == 0 || s.vocab > MAX_VOCAB {
            return Err(format!(
                "recycling matrix of k = {} and vocabulary {}: k must be 1..={MAX_K} and the \
                 vocabulary 1..={MAX_VOCAB}",
                s.k, s.vocab
            ));
        }
        let mut m = TokenRecycling::new(s.vocab, s.k);
        for (token, next, gaps) in s.rows {
            let in_vocab = |t: u32| (t as usize) < s.vocab;
            if !in_vocab(token)
                || next.len() > s.k
                || gaps.len() != next.len()
                || !next.iter().all(|&t| in_vocab(t))
            {
                return Err(format!(
                    "recycling matrix row of token {token}: ids must be below {}, at most {} \
                     candidates with one gap each",
                    s.vocab, s.k
                ));
            }
            let at = token as usize * s.k;
            m.next[at..at + next.len()].copy_from_slice(&next);
            m.gaps[at..at + gaps.len()].copy_from_slice(&gaps);
        }
        Ok(m)
    }
}

impl TokenRecycling {
    /// An empty matrix for a vocabulary of `vocab` tokens keeping `k` candidates each (the paper
    /// uses 8).
    pub fn new(vocab: usize, k: usize) -> Self {
        let k = k.max(1);
        TokenRecycling {
            k,
            vocab,
            next: vec![UNKNOWN; vocab * k],
            gaps: vec![UNKNOWN_GAP; vocab * k],
            shapes: Vec::new(),
        }
    }

    /// Candidates kept per token.
    pub fn k(&self) -> usize {
        self.k
    }

    /// The recorded candidates after `token`, best first.
    pub fn candidates(&self, token: u32) -> &[u32] {
        let t = token as usize;
        if t >= self.vocab {
            return &[];
        }
        let row = &self.next[t * self.k..(t + 1) * self.k];
        let known = row.iter().position(|&c| c == UNKNOWN).unwrap_or(self.k);
        &row[..known]
    }

    /// The recorded candidates after `token`, best first, each with its logit gap: how far
    /// its logit fell below the best candidate's, and for the best how far the second fell
    /// below it ([`f32::MAX`] when unknown, e.g. in a matrix saved without gaps).
    pub fn scored(&self, token: u32) -> impl Iterator<Item = (u32, f32)> + '_ {
        let start = token as usize * self.k;
        let gaps = self.gaps.get(start..start + self.k).unwrap_or(&[]);
        let gap = move |rank: usize| gaps.get(rank).copied().unwrap_or(UNKNOWN_GAP);
        self.candidates(token)
            .iter()
            .enumerate()
            .map(move |(rank, &c)| (c, gap(rank)))
    }

    /// The tree shape used for `budget` nodes.
    pub fn shape(&mut self, budget: usize) -> &TreeShape {
        let i = self.shape_index(budget);
        &self.shapes[i]
    }

    /// Index in `shapes` of the shape of `budget` nodes, computed on first use.
    fn shape_index(&mut self, budget: usize) -> usize {
        match self.shapes.iter().position(|s| s.len() == budget) {
            Some(i) => i,
            None => {
                self.shapes.push(TreeShape::best_first(budget, self.k));
                self.shapes.len() - 1
            }
        }
    }
}

impl Drafter for TokenRecycling {
    fn name(&self) -> String {
        "recycle".into()
    }

    fn propose(&mut self, context: &[u32], budget: usize) -> DraftTree {
        let mut tree = DraftTree::new();
        let Some(&root) = context.last() else {
            return tree;
        };
        let index = self.shape_index(budget);
        let shape = &self.shapes[index];
        // Tree node of each shape node (None: not drafted, nor its subtree).
        let mut placed: Vec<Option<usize>> = Vec::with_capacity(shape.len());
        for &(parent, rank) in shape.nodes() {
            let (after, parent_node) = match parent {
                None => (root, None),
                Some(p) => match placed[p] {
                    Some(node) => (tree.tokens()[node], Some(node)),
                    None => {
                        placed.push(None);
                        continue;
                    }
                },
            };
            let node = self
                .candidates(after)
                .get(rank)
                .map(|&token| tree.push(token, parent_node));
            placed.push(node);
        }
        tree
    }

    fn candidates_wanted(&self) -> usize {
        self.k
    }

    fn state(&self) -> Option<DrafterState> {
        Some(DrafterState::Recycling(self.clone()))
    }

    /// Takes over a matrix of the same vocabulary and candidate count.
    fn restore(&mut self, state: DrafterState) -> Result<()> {
        match state {
            DrafterState::Recycling(m) if (m.vocab, m.k) == (self.vocab, self.k) => {
                (self.next, self.gaps) = (m.next, m.gaps);
                Ok(())
            }
            DrafterState::Recycling(m) => Err(CoreError::InvalidConfig(format!(
                "recycling matrix of vocabulary {} and k = {} does not fit a drafter of \
                 vocabulary {} and k = {}",
                m.vocab, m.k, self.vocab, self.k
            ))),
            other => Err(other.refused_by(&self.name())),
        }
    }

    fn observe(&mut self, token: u32, candidates: &[u32], logits: &[f32]) {
        let t = token as usize;
        if t >= self.vocab {
            return;
        }
        let (k, vocab) = (self.k, self.vocab);
        let row = &mut self.next[t * k..(t + 1) * k];
        let gaps = &mut self.gaps[t * k..(t + 1) * k];
        row.fill(UNKNOWN);
        gaps.fill(UNKNOWN_GAP);
        let logit = |i: usize| logits.get(i).copied().unwrap_or(f32::NAN);
        let valid = (0..candidates.len()).filter(|&i| (candidates[i] as usize) < vocab);
        for (rank, i) in valid.take(k).enumerate() {
            row[rank] = candidates[i];
            // The best candidate's gap is its lead over the runner-up.
            let gap = match i {
                0 => logit(0) - logit(1),
                _ => logit(0) - logit(i),
            };
            gaps[rank] = if gap.is_nan() { UNKNOWN_GAP } else { gap };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_first_shape_is_deep_along_rank_zero() {
        let s = TreeShape::best_first(16, 8);
        assert_eq!(s.len(), 16);
        assert_eq!(s.nodes()[0], (None, 0));
        assert_eq!(s.nodes()[1], (Some(0), 0));
        for (i, &(p, _)) in s.nodes().iter().enumerate() {
            assert!(p.is_none_or(|p| p < i));
        }
        assert_eq!(
            TreeShape::best_first(3, 1).nodes(),
            &[(None, 0), (Some(0), 0), (Some(1), 0)]
        );
    }

    #[test]
    fn drafts_follow_recycled_candidates_and_skip_unknown_ones() {
        let mut r = TokenRecycling::new(10, 2);
        assert!(r.propose(&[1], 4).is_empty());
        r.observe(1, &[2, 3], &[5.0, 4.5]);
        r.observe(2, &[4], &[1.0]);
        let tree = r.propose(&[7, 1], 8);
        let paths: Vec<Vec<u32>> = (0..tree.len()).map(|n| tree.path(n)).collect();
        assert!(paths.contains(&vec![2, 4]) && paths.contains(&vec![3]));
        assert_eq!(tree.len(), 3);
        // Out-of-vocabulary ids are ignored, never stored.
        r.observe(99, &[1], &[0.0]);
        r.observe(1, &[42, 5, 3], &[9.0, 6.0, 2.0]);
        assert_eq!(r.candidates(1), &[5, 3]);
        assert_eq!(r.scored(1).collect::<Vec<_>>(), vec![(5, 3.0), (3, 7.0)]);
        assert_eq!(r.scored(2).collect::<Vec<_>>(), vec![(4, f32::MAX)]);
        let json = serde_json::to_string(&r).unwrap();
        let back: TokenRecycling = serde_json::from_str(&json).unwrap();
        assert_eq!(back.candidates(2), &[4]);
        assert_eq!(back.scored(1).collect::<Vec<_>>(), vec![(5, 3.0), (3, 7.0)]);
        assert!(back.candidates(0).is_empty());
    }

    #[test]
    fn a_saved_matrix_is_checked_when_it_is_read() {
        let read = |json: &str| serde_json::from_str::<TokenRecycling>(json);
        assert!(read(r#"{"k":2,"vocab":10,"rows":[[1,[2,3],[0.5,1.0]]]}"#).is_ok());
        for bad in [
            r#"{"k":0,"vocab":10,"rows":[]}"#,
            r#"{"k":2,"vocab":0,"rows":[]}"#,
            r#"{"k":2,"vocab":99999999999,"rows":[]}"#,
            r#"{"k":100000,"vocab":10,"rows":[]}"#,
            r#"{"k":2,"vocab":10,"rows":[[10,[2],[0.5]]]}"#,
            r#"{"k":2,"vocab":10,"rows":[[1,[2,30],[0.5,1.0]]]}"#,
            r#"{"k":2,"vocab":10,"rows":[[1,[2,3,4],[0.5,1.0,1.0]]]}"#,
            r#"{"k":2,"vocab":10,"rows":[[1,[2,3],[0.5]]]}"#,
            r#"{"k":2,"vocab":10}"#,
        ] {
            assert!(read(bad).is_err(), "{bad}");
        }
    }
}
