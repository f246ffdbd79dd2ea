//! Adaptive draft trees (OPT-Tree, Wang et al., arXiv 2406.17276): each round's tree is the one
//! that maximises the expected number of accepted tokens for the node budget, from the
//! candidates of Token Recycling and context lookup rated by how often such candidates were
//! right.
//!
//! The expected accepted length of a tree is the sum over its nodes of the probability that
//! the node's whole path is accepted, and a path's probability is the product of its edges'
//! (the chance that the target picks this token after its parent). Path probabilities only
//! shrink along a path, so taking candidates best-first by path probability builds the optimal
//! tree for any budget. Where a static shape spends the same nodes after a confident and an
//! unsure token, this tree runs deep along confident candidates and spreads out where the
//! target hesitated.
//!
//! An edge's probability is learnt online per kind of edge: a recycled candidate by its rank
//! and the target's confidence when it was recorded (the gap between its logit and the best
//! one's), a lookup step by the n-gram length it matched and how far along the match it is, and
//! tokens both sources propose; a lookahead head's children of the root
//! ([`Drafter::suggest`]) by the head's rank and probability, and whether another source
//! proposes the same token; continuations from an n-gram store of the model's own writing
//! ([`OptTree::with_store`]) by the context length matched, rank and share. Every verified row tells, for every candidate offered after
//! that row (drafted or not), whether it was the target's choice (when sampling: its
//! probability in the distribution the row's token was drawn from, [`Drafter::drawn`], so that
//! trees are sized by the acceptance sampling really gets); rates forget slowly so they follow
//! the task at hand.

use std::collections::BinaryHeap;
use std::sync::Arc;

use super::ngram_store::{self, NgramStore};
use super::{ContextLookup, DrafterState, Likely, RoundCost, TokenRecycling, TreeShape};
use crate::drafter::{Drafter, Suggestion};
use crate::error::{CoreError, Result};
use crate::tree::DraftTree;

/// Upper bounds of the logit-gap bins of recycled candidates (the last bin is open).
const GAP_BINS: [f32; 5] = [0.5, 1.0, 2.0, 3.0, 5.0];
/// Recycled ranks rated separately; deeper ranks share the last rate.
const RANKS: usize = 8;
/// Lookup n-gram lengths and steps rated separately; longer ones share the last rate.
const LOOKUP_NS: usize = 3;
const LOOKUP_STEPS: usize = 4;
/// Recycled ranks rated separately when lookup proposes the same token.
const BOTH_RANKS: usize = 3;
/// Upper bounds of the probability bins of a lookahead head's children (the last bin is open).
const HEAD_BINS: [f64; 4] = [0.1, 0.3, 0.5, 0.8];
/// Prior rates of the head's children by probability bin: alone, and agreeing with another source.
const HEAD_PRIOR: [f64; 5] = [0.05, 0.2, 0.4, 0.65, 0.9];
const HEAD_AGREES_PRIOR: [f64; 5] = [0.3, 0.45, 0.6, 0.75, 0.9];
/// Head ranks rated separately; deeper ranks share the last rate.
const HEAD_RANKS: usize = 4;
/// Kinds of head edge: ranks and agreement, by probability bin, below the root and deeper.
const HEAD_EDGES: usize = 2 * (HEAD_RANKS + 1) * (HEAD_BINS.len() + 1);
/// Upper bounds of the share bins of retrieved continuations (the last bin is open), and the
/// prior rates of the bins.
const SHARE_BINS: [f32; 3] = [0.25, 0.5, 0.8];
const SHARE_PRIOR: [f64; 4] = [0.1, 0.25, 0.4, 0.6];
/// Context lengths of retrieved continuations rated separately.
const STORE_ORDERS: usize = 2;
/// Pseudo-observations of each rate's prior.
const PRIOR_WEIGHT: f64 = 8.0;
/// Weight kept by earlier observations of a rate at each new one (about the last 200 count).
const FORGET: f64 = 0.995;

/// The kind of a candidate edge, the unit whose acceptance rate is learnt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Edge {
    /// The recycled candidate of `rank`, recorded with its logit gap in bin `gap`.
    Recycled { rank: usize, gap: usize },
    /// Step `step` (0: the first drafted token) of a lookup continuation matched on `n` tokens.
    Lookup { n: usize, step: usize },
    /// A lookup token that is also the recycled candidate of `rank`.
    Both { n: usize, rank: usize },
    /// A lookahead head's child of `rank` among its siblings, with its probability in bin
    /// `bin`; `deep` below a node the head drafted itself (its own state fed back), rather
    /// than below the root.
    Head { deep: bool, rank: usize, bin: usize },
    /// A head's child (probability bin `bin`) that recycling or lookup also proposes.
    HeadAgrees { deep: bool, bin: usize },
    /// A continuation of the n-gram store after a context of `n` tokens, of `rank` among them,
    /// with its share of the context's occurrences in bin `bin`.
    Retrieved { n: usize, rank: usize, bin: usize },
}

impl Edge {
    const COUNT: usize = RANKS * (GAP_BINS.len() + 1)
        + LOOKUP_NS * LOOKUP_STEPS
        + LOOKUP_NS * BOTH_RANKS
        + HEAD_EDGES
        + STORE_ORDERS * ngram_store::TOP * (SHARE_BINS.len() + 1);

    /// The bin of a head probability.
    fn head_bin(probability: f64) -> usize {
        HEAD_BINS
            .iter()
            .position(|&b| probability < b)
            .unwrap_or(HEAD_BINS.len())
    }

    fn retrieved(n: usize, rank: usize, share: f32) -> Edge {
        let bin = SHARE_BINS
            .iter()
            .position(|&b| share < b)
            .unwrap_or(SHARE_BINS.len());
        Edge::Retrieved { n, rank, bin }
    }

    fn recycled(rank: usize, gap: f32) -> Edge {
        let gap = GAP_BINS
            .iter()
            .position(|&b| gap < b)
            .unwrap_or(GAP_BINS.len());
        Edge::Recycled { rank, gap }
    }

    fn index(self) -> usize {
        // Each kind of edge has its run of indices, in the order of `COUNT`'s terms.
        let recycled = RANKS * (GAP_BINS.len() + 1);
        let lookup = recycled + LOOKUP_NS * LOOKUP_STEPS;
        let head = lookup + LOOKUP_NS * BOTH_RANKS;
        let store = head + HEAD_EDGES;
        let n_index = |n: usize| n.clamp(1, LOOKUP_NS) - 1;
        match self {
            Edge::Recycled { rank, gap } => rank.min(RANKS - 1) * (GAP_BINS.len() + 1) + gap,
            Edge::Lookup { n, step } => {
                recycled + n_index(n) * LOOKUP_STEPS + step.min(LOOKUP_STEPS - 1)
            }
            Edge::Both { n, rank } => lookup + n_index(n) * BOTH_RANKS + rank.min(BOTH_RANKS - 1),
            Edge::Head { deep, rank, bin } => {
                head + usize::from(deep) * HEAD_EDGES / 2
                    + rank.min(HEAD_RANKS - 1) * (HEAD_BINS.len() + 1)
                    + bin
            }
            Edge::HeadAgrees { deep, bin } => {
                head + usize::from(deep) * HEAD_EDGES / 2 + HEAD_RANKS * (HEAD_BINS.len() + 1) + bin
            }
            Edge::Retrieved { n, rank, bin } => {
                let order = n.clamp(*ngram_store::ORDERS.start(), *ngram_store::ORDERS.end())
                    - ngram_store::ORDERS.start();
                let rank = rank.min(ngram_store::TOP - 1);
                store + (order * ngram_store::TOP + rank) * (SHARE_BINS.len() + 1) + bin
            }
        }
    }

    /// The rate assumed before any observation.
    fn prior(self) -> f64 {
        match self {
            Edge::Recycled { rank, .. } => {
                TreeShape::RANK_PRIOR.get(rank).copied().unwrap_or(0.005)
            }
            Edge::Lookup { .. } => 0.4,
            Edge::Both { .. } => 0.6,
            Edge::Head { bin, .. } => HEAD_PRIOR[bin],
            Edge::HeadAgrees { bin, .. } => HEAD_AGREES_PRIOR[bin],
            Edge::Retrieved { bin, .. } => SHARE_PRIOR[bin],
        }
    }
}

/// Acceptance rates per kind of edge: a Beta posterior mean with slow forgetting.
#[derive(Debug, Clone)]
struct EdgeRates {
    hits: Vec<f64>,
    seen: Vec<f64>,
}

impl EdgeRates {
    fn new() -> Self {
        EdgeRates {
            hits: vec![0.0; Edge::COUNT],
            seen: vec![0.0; Edge::COUNT],
        }
    }

    fn rate(&self, edge: Edge) -> f64 {
        let i = edge.index();
        (self.hits[i] + edge.prior() * PRIOR_WEIGHT) / (self.seen[i] + PRIOR_WEIGHT)
    }

    /// One trial of `edge` that was accepted with probability `hit` (1 or 0 for the target's
    /// argmax; the sampling distribution's probability of the token when sampling).
    fn record(&mut self, edge: Edge, hit: f64) {
        let i = edge.index();
        self.hits[i] = self.hits[i] * FORGET + hit.clamp(0.0, 1.0);
        self.seen[i] = self.seen[i] * FORGET + 1.0;
    }
}

/// A candidate child: its token, its kind of edge, its step along the lookup continuation
/// when lookup proposed it, and its index among the suggestions when a head proposed it.
type Offer = (u32, Edge, Option<usize>, Option<usize>);

/// What the last proposal offered after each of its rows (0: the root, `i + 1`: node `i`).
#[derive(Debug, Clone)]
struct Proposal {
    tree: DraftTree,
    offered: Vec<Vec<Offer>>,
}

impl Proposal {
    /// The proposal's row for each row of the verified `tree` (which may be cut shorter or
    /// merged with others' nodes), matched by path; `None` where the proposal had no such node.
    fn rows_of(&self, tree: &DraftTree) -> Vec<Option<usize>> {
        let mut own: Vec<Option<usize>> = Vec::with_capacity(tree.len() + 1);
        own.push(Some(0));
        for (i, &token) in tree.tokens().iter().enumerate() {
            let parent = match tree.parents()[i] {
                None => Some(None),
                Some(p) => own[p + 1].map(|row| Some(row - 1)),
            };
            own.push(
                parent
                    .and_then(|p| self.tree.child(p, token))
                    .map(|node| node + 1),
            );
        }
        own
    }
}

/// A candidate node of the best-first search: its parent in the tree and what is offered.
type Candidate = Likely<(Option<usize>, Offer)>;

/// The adaptive tree drafter: Token Recycling and context lookup candidates, rated online and
/// selected best-first by path probability.
#[derive(Debug, Clone)]
pub struct OptTree {
    recycling: TokenRecycling,
    lookup: ContextLookup,
    rates: EdgeRates,
    /// The last proposal, until a round's rates learn from it ([`Drafter::drawn`] when
    /// sampling, else [`Drafter::verified`]), which takes it.
    last: Option<Proposal>,
    /// Round times by rows, when trees are sized by them ([`OptTree::timed`]).
    cost: Option<RoundCost>,
    /// A lookahead head's nodes below the next root ([`Drafter::suggest`]).
    suggested: Vec<Suggestion>,
    /// Continuations of the model's usual phrases ([`OptTree::with_store`]).
    store: Option<Arc<NgramStore>>,
}

impl OptTree {
    /// A drafter for a vocabulary of `vocab` tokens, recycling `k` candidates per token and
    /// following lookup continuations of up to `lookup_len` tokens.
    pub fn new(vocab: usize, k: usize, lookup_len: usize) -> Self {
        OptTree {
            recycling: TokenRecycling::new(vocab, k),
            lookup: ContextLookup::new(3, 1, lookup_len, 1),
            rates: EdgeRates::new(),
            last: None,
            cost: None,
            suggested: Vec::new(),
            store: None,
        }
    }

    /// Adds the continuations of `store` (shared, read-only) to every node's candidates,
    /// looked up by the last tokens of the node's path.
    pub fn with_store(mut self, store: Arc<NgramStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Sizes each tree by time: of the best-first tree of the budget, only as many nodes as
    /// maximise the expected accepted tokens per second of the round, with round times
    /// measured as it runs ([`RoundCost`]). Where extra rows cost little (f32 weights on a
    /// CPU) that is the whole tree; where every row costs its own arithmetic (4-bit weights),
    /// few nodes or none.
    pub fn timed(mut self) -> Self {
        self.cost = Some(RoundCost::new());
        self
    }

    /// The recycling matrix (it carries over between prompts).
    pub fn recycling(&self) -> &TokenRecycling {
        &self.recycling
    }

    /// The learnt probability that a recycled candidate of `rank`, recorded with logit gap
    /// `gap`, is the target's next token.
    pub fn recycled_rate(&self, rank: usize, gap: f32) -> f64 {
        self.rates.rate(Edge::recycled(rank, gap))
    }

    /// The candidates after `token` (the last of `tail`, the path's last tokens): recycled
    /// ones, `lookup` = (token, n, step) from the lookup continuation, merged when they agree,
    /// and the store's continuations of `tail` that neither offers.
    fn offers(&self, token: u32, lookup: Option<(u32, usize, usize)>, tail: &[u32]) -> Vec<Offer> {
        let mut offers: Vec<Offer> = self
            .recycling
            .scored(token)
            .enumerate()
            .map(|(rank, (c, gap))| (c, Edge::recycled(rank, gap), None, None))
            .collect();
        if let Some((t, n, step)) = lookup {
            match offers.iter_mut().enumerate().find(|(_, o)| o.0 == t) {
                Some((rank, offer)) => *offer = (t, Edge::Both { n, rank }, Some(step), None),
                None => offers.push((t, Edge::Lookup { n, step }, Some(step), None)),
            }
        }
        // Only what no other source offers: a store candidate that recycling or lookup also
        // proposes is accepted far more often than one of its own, and one rate for both would
        // overrate the latter.
        if let Some((n, found)) = self.store.as_ref().and_then(|s| s.continuations(tail)) {
            for (rank, c) in found.iter().enumerate() {
                if !offers.iter().any(|o| o.0 == c.token) {
                    offers.push((c.token, Edge::retrieved(n, rank, c.share), None, None));
                }
            }
        }
        offers
    }
}

/// Adds to `offers` (a node's candidates) the suggestions whose parent is `parent` (`None`:
/// the root's children): a token another source offers too becomes a head-agrees edge, the
/// others head edges of their rank among the suggested siblings.
fn add_suggestions(offers: &mut Vec<Offer>, suggestions: &[Suggestion], parent: Option<usize>) {
    let deep = parent.is_some();
    let children = suggestions
        .iter()
        .enumerate()
        .filter(|(_, s)| s.parent == parent);
    for (rank, (index, s)) in children.enumerate() {
        let bin = Edge::head_bin(s.probability);
        match offers.iter_mut().find(|o| o.0 == s.token) {
            Some(offer) => {
                offer.1 = Edge::HeadAgrees { deep, bin };
                offer.3 = Some(index);
            }
            None => offers.push((s.token, Edge::Head { deep, rank, bin }, None, Some(index))),
        }
    }
}

impl Drafter for OptTree {
    fn name(&self) -> String {
        "opt".into()
    }

    fn propose(&mut self, context: &[u32], budget: usize) -> DraftTree {
        let mut tree = DraftTree::new();
        let Some(&root) = context.last() else {
            self.last = None;
            return tree;
        };
        let (n, continuation) = match self.lookup.matches(context).next() {
            Some((n, at)) => (
                n,
                &context[at..(at + self.lookup.max_len()).min(context.len())],
            ),
            None => (0, &context[..0]),
        };
        let lookup_at = |step: usize| continuation.get(step).map(|&t| (t, n, step));

        // The last tokens of each row's path (0: the root, `i + 1`: node `i`), for the store.
        let keep = *ngram_store::ORDERS.end();
        let mut tails: Vec<Vec<u32>> = vec![context[context.len().saturating_sub(keep)..].to_vec()];
        let suggested = std::mem::take(&mut self.suggested);
        let mut root_offers = self.offers(root, lookup_at(0), &tails[0]);
        add_suggestions(&mut root_offers, &suggested, None);
        let mut offered = vec![root_offers];
        let mut heap: BinaryHeap<Candidate> = offered[0]
            .iter()
            .map(|&offer| Candidate {
                probability: self.rates.rate(offer.1),
                item: (None, offer),
            })
            .collect();
        // Path probability of each node, in the order they were added.
        let mut probabilities = Vec::with_capacity(budget);
        while tree.len() < budget {
            let Some(Likely { probability, item }) = heap.pop() else {
                break;
            };
            let (parent, (token, _, step, suggestion)) = item;
            if tree.child(parent, token).is_some() {
                continue;
            }
            let node = tree.push(token, parent);
            probabilities.push(probability);
            let mut tail = tails[parent.map_or(0, |p| p + 1)].clone();
            tail.push(token);
            tail.drain(..tail.len().saturating_sub(keep));
            let mut offers = self.offers(token, step.and_then(|s| lookup_at(s + 1)), &tail);
            if suggestion.is_some() {
                add_suggestions(&mut offers, &suggested, suggestion);
            }
            tails.push(tail);
            heap.extend(offers.iter().map(|&offer| Candidate {
                probability: probability * self.rates.rate(offer.1),
                item: (Some(node), offer),
            }));
            offered.push(offers);
        }
        let size = self
            .cost
            .as_ref()
            .map_or(tree.len(), |cost| cost.best_size(&probabilities));
        self.last = Some(Proposal {
            tree: tree.clone(),
            offered,
        });
        if size < tree.len() {
            // Nodes were added parents first, so the first `size` form a tree; `verified`
            // matches the verified rows to this proposal by path.
            let mut cut = DraftTree::new();
            cut.merge(&tree, size);
            return cut;
        }
        tree
    }

    fn candidates_wanted(&self) -> usize {
        self.recycling.candidates_wanted()
    }

    fn observe(&mut self, token: u32, candidates: &[u32], logits: &[f32]) {
        self.recycling.observe(token, candidates, logits);
    }

    fn suggest(&mut self, suggestions: &[Suggestion]) -> bool {
        self.suggested = suggestions.to_vec();
        true
    }

    /// The recycling matrix and the edge rates (round times are not kept: they are this run's).
    fn state(&self) -> Option<DrafterState> {
        Some(DrafterState::Opt {
            recycling: self.recycling.clone(),
            hits: self.rates.hits.clone(),
            seen: self.rates.seen.clone(),
        })
    }

    fn restore(&mut self, state: DrafterState) -> Result<()> {
        let DrafterState::Opt {
            recycling,
            hits,
            seen,
        } = state
        else {
            return Err(state.refused_by(&self.name()));
        };
        let counts_fit = hits.len() == Edge::COUNT
            && seen.len() == Edge::COUNT
            && hits
                .iter()
                .zip(&seen)
                .all(|(&h, &s)| h.is_finite() && s.is_finite() && 0.0 <= h && h <= s);
        if !counts_fit {
            return Err(CoreError::InvalidConfig(format!(
                "drafter opt: edge counts must be {} pairs with 0 <= hits <= trials",
                Edge::COUNT
            )));
        }
        self.recycling.restore(DrafterState::Recycling(recycling))?;
        self.rates = EdgeRates { hits, seen };
        Ok(())
    }

    fn round_time(&mut self, rows: usize, seconds: f64) {
        if let Some(cost) = &mut self.cost {
            cost.record(rows, seconds);
        }
    }

    fn verified(&mut self, tree: &DraftTree, best: &[u32]) {
        // After `drawn` (sampling) the proposal is gone: the round has taught the rates.
        let Some(last) = self.last.take() else {
            return;
        };
        let own = last.rows_of(tree);
        // Edges count after rows the target reached: the root and the nodes whose whole path
        // it confirmed (what follows a rejected node is not what a path probability needs).
        let mut reached = vec![false; tree.len() + 1];
        reached[0] = true;
        for (i, &token) in tree.tokens().iter().enumerate() {
            let parent_row = tree.parents()[i].map_or(0, |p| p + 1);
            reached[i + 1] = reached[parent_row] && best.get(parent_row) == Some(&token);
        }
        for (row, mine) in own.iter().enumerate() {
            let (Some(mine), Some(&choice), true) = (mine, best.get(row), reached[row]) else {
                continue;
            };
            for &(token, edge, _, _) in &last.offered[*mine] {
                self.rates
                    .record(edge, f64::from(u8::from(token == choice)));
            }
        }
    }

    /// The rows the target drew from are the ones it reached; each candidate offered after
    /// one counts as accepted with its probability in that draw's distribution.
    fn drawn(&mut self, tree: &DraftTree, rows: &[usize], distributions: &[Vec<f32>]) {
        let Some(last) = self.last.take() else {
            return;
        };
        let own = last.rows_of(tree);
        for (&row, distribution) in rows.iter().zip(distributions) {
            let Some(Some(mine)) = own.get(row) else {
                continue;
            };
            for &(token, edge, _, _) in &last.offered[*mine] {
                let p = distribution.get(token as usize).copied().unwrap_or(0.0);
                self.rates.record(edge, f64::from(p));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edge_kinds_have_distinct_indices() {
        let mut seen = [false; Edge::COUNT];
        for rank in 0..RANKS {
            for gap in 0..=GAP_BINS.len() {
                seen[Edge::Recycled { rank, gap }.index()] = true;
            }
        }
        for n in 1..=LOOKUP_NS {
            for step in 0..LOOKUP_STEPS {
                seen[Edge::Lookup { n, step }.index()] = true;
            }
            for rank in 0..BOTH_RANKS {
                seen[Edge::Both { n, rank }.index()] = true;
            }
        }
        for deep in [false, true] {
            for bin in 0..=HEAD_BINS.len() {
                for rank in 0..HEAD_RANKS {
                    seen[Edge::Head { deep, rank, bin }.index()] = true;
                }
                seen[Edge::HeadAgrees { deep, bin }.index()] = true;
            }
        }
        for n in ngram_store::ORDERS {
            for rank in 0..ngram_store::TOP {
                for bin in 0..=SHARE_BINS.len() {
                    let i = Edge::Retrieved { n, rank, bin }.index();
                    assert!(!seen[i], "{n} {rank} {bin}");
                    seen[i] = true;
                }
            }
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(
            Edge::retrieved(3, 0, 0.9),
            Edge::Retrieved {
                n: 3,
                rank: 0,
                bin: 3
            }
        );
        assert_eq!(Edge::head_bin(0.05), 0);
        assert_eq!(Edge::head_bin(0.95), HEAD_BINS.len());
        assert_eq!(Edge::recycled(0, 0.2), Edge::Recycled { rank: 0, gap: 0 });
        assert_eq!(Edge::recycled(1, 9.0), Edge::Recycled { rank: 1, gap: 5 });
    }

    #[test]
    fn store_continuations_extend_the_tree_along_the_path() {
        // The corpus always continues 5 6 with 7 8 9.
        let corpus: Vec<u32> = [1, 5, 6, 7, 8, 9, 2].repeat(3);
        let store = Arc::new(NgramStore::from_sequences([corpus.as_slice()]));
        let mut d = OptTree::new(32, 4, 8).with_store(store);
        // Nothing recycled or looked up: the store alone drafts 7, then 8 (after 6 7), then 9.
        let tree = d.propose(&[3, 5, 6], 3);
        assert_eq!(tree.path(2), vec![7, 8, 9]);
        // Verification rates the store's edges: the first two right, then wrong.
        d.verified(&tree, &[7, 8, 4, 0]);
        let rate = |d: &OptTree| d.rates.rate(Edge::retrieved(2, 0, 1.0));
        let before = OptTree::new(32, 4, 8);
        assert!(rate(&d) > rate(&before));
        // Without the store the same context drafts nothing.
        assert!(OptTree::new(32, 4, 8).propose(&[3, 5, 6], 3).is_empty());
    }

    #[test]
    fn trees_follow_the_probable_paths_and_learn_from_verification() {
        let mut d = OptTree::new(32, 4, 8);
        assert!(d.propose(&[], 4).is_empty());
        assert!(d.propose(&[1], 4).is_empty());
        // After 1 the target was sure of 2 (gap 6), after 2 unsure between 3 and 4.
        d.observe(1, &[2, 5], &[10.0, 4.0]);
        d.observe(2, &[3, 4], &[1.0, 0.9]);
        d.observe(3, &[6], &[8.0]);
        let tree = d.propose(&[9, 1], 3);
        assert_eq!(tree.path(0), vec![2]);
        assert_eq!(tree.len(), 3);
        // Context lookup: "7 1" was followed by 8 8; lookup and recycling are both offered.
        let tree = d.propose(&[7, 1, 8, 8, 7, 1], 6);
        let paths: Vec<Vec<u32>> = (0..tree.len()).map(|i| tree.path(i)).collect();
        assert!(
            paths.contains(&vec![8]) && paths.contains(&vec![2]),
            "{paths:?}"
        );

        // Verification says the confident rank-0 candidates after 1 are always right and lookup
        // never is: the rates follow.
        let before = d.recycled_rate(0, 6.0);
        for _ in 0..200 {
            let tree = d.propose(&[7, 1, 8, 8, 7, 1], 2);
            d.verified(&tree, &[2, 3, 6]);
        }
        assert!(d.recycled_rate(0, 6.0) > 0.9 && before < 0.9);
        let tree = d.propose(&[7, 1, 8, 8, 7, 1], 2);
        assert_eq!(tree.path(1), vec![2, 3], "{:?}", tree.tokens());
        // Verifying a tree that is not (all) the proposal's is harmless.
        d.verified(&DraftTree::chain(&[5, 5, 5]), &[0, 0, 0, 0]);
        d.verified(&DraftTree::new(), &[]);
    }

    /// When sampling, a candidate counts as accepted with its probability in each reached row's
    /// draw (not as the argmax's 1 or 0): a rank-0 candidate the target always ranks first but
    /// draws a quarter of the time is rated near 0.25, where argmax verification rates it near
    /// 1; rows the draws did not reach teach nothing, and `verified` adds nothing after `drawn`.
    #[test]
    fn sampled_rounds_rate_candidates_by_their_probability() {
        let mut greedy = OptTree::new(32, 4, 8);
        greedy.observe(1, &[2, 5], &[10.0, 4.0]);
        greedy.observe(2, &[3, 4], &[10.0, 7.5]);
        let mut sampled = greedy.clone();
        let mut quarter = vec![0f32; 32];
        (quarter[2], quarter[5], quarter[9]) = (0.25, 0.25, 0.5);
        for _ in 0..300 {
            let tree = greedy.propose(&[9, 1], 2);
            greedy.verified(&tree, &[2, 3, 3]);
            let tree = sampled.propose(&[9, 1], 2);
            assert!(tree.tokens().contains(&2), "{:?}", tree.tokens());
            // The root's draw gave 9: the walk stopped there, node 2's row was not drawn from.
            sampled.drawn(&tree, &[0], std::slice::from_ref(&quarter));
            sampled.verified(&tree, &[2, 3, 3]);
        }
        let (g, s) = (greedy.recycled_rate(0, 6.0), sampled.recycled_rate(0, 6.0));
        assert!(g > 0.9, "{g}");
        assert!((s - 0.25).abs() < 0.05, "{s}");
        // The rank-1 candidate (5, offered after the root) learnt its quarter too.
        assert!((sampled.recycled_rate(1, 6.0) - 0.25).abs() < 0.05);
        // Node 2's row was never drawn from: its candidate (3, gap 2.5) kept the prior.
        let fresh = OptTree::new(32, 4, 8);
        assert_eq!(sampled.recycled_rate(0, 2.5), fresh.recycled_rate(0, 2.5));
        assert!(greedy.recycled_rate(0, 2.5) > fresh.recycled_rate(0, 2.5));
    }

    /// A timed tree keeps the whole budget while rows are cheap and shrinks when they are dear,
    /// and verification of the cut tree still teaches the rates.
    #[test]
    fn timed_trees_shrink_when_rows_are_dear() {
        let mut d = OptTree::new(32, 4, 8).timed();
        d.observe(1, &[2, 5, 6, 7], &[10.0, 4.0, 3.0, 2.0]);
        d.observe(2, &[3, 4], &[1.0, 0.9]);
        d.observe(3, &[6], &[8.0]);
        let full = d.propose(&[9, 1], 6);
        assert_eq!(full.len(), 6);
        // Cheap rows: all of them.
        for rows in 1..=7 {
            d.round_time(rows, 0.010);
        }
        assert_eq!(d.propose(&[9, 1], 6).len(), 6);
        // Every row as dear as the first: no node is worth its row.
        let mut dear = OptTree::new(32, 4, 8).timed();
        dear.observe(1, &[2, 5, 6, 7], &[10.0, 4.0, 3.0, 2.0]);
        for rows in 1..=7 {
            dear.round_time(rows, 0.010 * rows as f64);
        }
        assert!(dear.propose(&[9, 1], 6).is_empty());
        // Rows at a quarter of the first's price: the likeliest nodes only.
        let mut some = d.clone();
        some.cost = Some(RoundCost::new());
        for rows in 1..=7 {
            some.round_time(rows, 0.010 * (1.0 + 0.25 * (rows - 1) as f64));
        }
        let cut = some.propose(&[9, 1], 6);
        assert!((1..6).contains(&cut.len()), "{}", cut.len());
        assert_eq!(cut.path(0), vec![2]);
        let before = some.recycled_rate(0, 6.0);
        some.verified(&cut, &[2, 3, 6]);
        assert!(some.recycled_rate(0, 6.0) > before);
    }

    /// A head's suggestions enter the root's children, the first draft only, and their rates
    /// learn from verification like any other edge.
    #[test]
    fn suggested_children_join_the_tree_and_are_rated() {
        let mut d = OptTree::new(32, 4, 8);
        d.observe(1, &[2], &[1.0]);
        let head = |children: &[(u32, f64)]| -> Vec<Suggestion> {
            children
                .iter()
                .map(|&(t, p)| Suggestion::child(t, p))
                .collect()
        };
        assert!(d.suggest(&head(&[(7, 0.9), (2, 0.05)])));
        let tree = d.propose(&[9, 1], 2);
        let firsts: Vec<u32> = (0..tree.len())
            .filter(|&i| tree.parents()[i].is_none())
            .map(|i| tree.tokens()[i])
            .collect();
        assert!(firsts.contains(&7) && firsts.contains(&2), "{firsts:?}");
        // Suggestions last one round.
        assert!(!d.propose(&[9, 1], 4).tokens().contains(&7));
        // The head's confident child is always wrong: its rate falls below recycling's.
        let confident = Edge::Head {
            deep: false,
            rank: 0,
            bin: 4,
        };
        let before = d.rates.rate(confident);
        for _ in 0..100 {
            d.suggest(&head(&[(7, 0.9)]));
            let tree = d.propose(&[9, 1], 2);
            d.verified(&tree, &[2, 3, 3]);
        }
        assert!(d.rates.rate(confident) < 0.2 && before > 0.8);
        d.suggest(&head(&[(7, 0.9)]));
        assert_eq!(d.propose(&[9, 1], 1).tokens(), &[2]);
    }

    /// A head's nodes below its own children follow them into the tree, and their rates are
    /// learnt apart from the root's children.
    #[test]
    fn deeper_suggestions_follow_their_parents() {
        let mut d = OptTree::new(32, 4, 8);
        let path = [
            Suggestion::child(7, 0.9),
            Suggestion {
                token: 8,
                probability: 0.9,
                parent: Some(0),
            },
            Suggestion {
                token: 9,
                probability: 0.9,
                parent: Some(1),
            },
        ];
        assert!(d.suggest(&path));
        let tree = d.propose(&[5, 1], 3);
        assert_eq!(tree.tokens(), &[7, 8, 9]);
        assert_eq!(tree.parents(), &[None, Some(0), Some(1)]);
        // Verification confirms 7 and rejects 8 each time: the deeper edge's rate falls apart
        // from the root child's, which a one-node budget still takes.
        let deep = Edge::Head {
            deep: true,
            rank: 0,
            bin: 4,
        };
        let before = d.rates.rate(deep);
        for _ in 0..100 {
            d.suggest(&path);
            let tree = d.propose(&[5, 1], 3);
            d.verified(&tree, &[7, 3, 3, 3]);
        }
        assert!(d.rates.rate(deep) < 0.2 && before > 0.8);
        d.suggest(&path);
        assert_eq!(d.propose(&[5, 1], 1).tokens(), &[7]);
    }
}
