//! Token trees: what drafters propose and what one verification pass checks.
//!
//! A [`DraftTree`] holds drafted tokens as `(token, parent)` nodes in topological order (a
//! parent always comes before its children); nodes without a parent continue the last committed
//! token, the *root*. Siblings never repeat a token, so merging trees by common prefix is plain
//! insertion. [`TreeMask`] is the model's view of the same tree: block row 0 is the root, row
//! `i + 1` is node `i`, and each row attends to the cache and to its ancestors only.

/// A tree of drafted tokens, parents before children.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftTree {
    tokens: Vec<u32>,
    parents: Vec<Option<usize>>,
    depths: Vec<usize>,
}

impl DraftTree {
    /// An empty tree (the round verifies the root alone, like an AR step).
    pub fn new() -> Self {
        Self::default()
    }

    /// A chain: each token continues the previous one.
    pub fn chain(tokens: &[u32]) -> Self {
        let mut tree = DraftTree::new();
        let mut parent = None;
        for &t in tokens {
            parent = Some(tree.push(t, parent));
        }
        tree
    }

    /// Adds `token` as a child of `parent` (`None`: of the root) and returns its node; when
    /// that parent already has a child with this token, returns the existing node instead.
    ///
    /// # Panics
    /// If `parent` is not a node of the tree (a drafter's bug, never user input).
    pub fn push(&mut self, token: u32, parent: Option<usize>) -> usize {
        assert!(
            parent.is_none_or(|p| p < self.tokens.len()),
            "parent {parent:?} of a tree with {} nodes",
            self.tokens.len()
        );
        if let Some(existing) = self.child(parent, token) {
            return existing;
        }
        self.tokens.push(token);
        self.parents.push(parent);
        self.depths.push(parent.map_or(1, |p| self.depths[p] + 1));
        self.tokens.len() - 1
    }

    /// The child of `parent` (`None`: the root) carrying `token`, if any.
    pub fn child(&self, parent: Option<usize>, token: u32) -> Option<usize> {
        (0..self.tokens.len()).find(|&i| self.parents[i] == parent && self.tokens[i] == token)
    }

    /// Number of drafted nodes (the root not counted).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether nothing was drafted.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Drafted tokens, node order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Parent of each node (`None`: the root).
    pub fn parents(&self) -> &[Option<usize>] {
        &self.parents
    }

    /// Depth of `node` (children of the root have depth 1).
    pub fn depth(&self, node: usize) -> usize {
        self.depths[node]
    }

    /// Greatest depth (0 for an empty tree).
    pub fn max_depth(&self) -> usize {
        self.depths.iter().copied().max().unwrap_or(0)
    }

    /// The tokens on the path from the root to `node`, root excluded.
    pub fn path(&self, node: usize) -> Vec<u32> {
        let mut path = Vec::with_capacity(self.depths[node]);
        let mut at = Some(node);
        while let Some(n) = at {
            path.push(self.tokens[n]);
            at = self.parents[n];
        }
        path.reverse();
        path
    }

    /// Inserts every node of `other` (by common prefix: shared paths are stored once) while
    /// the tree has fewer than `budget` nodes; `other`'s node order is its priority.
    pub fn merge(&mut self, other: &DraftTree, budget: usize) {
        let mut mapped: Vec<Option<usize>> = Vec::with_capacity(other.len());
        for (i, &token) in other.tokens.iter().enumerate() {
            let parent = match other.parents[i] {
                None => None,
                Some(p) => match mapped[p] {
                    Some(m) => Some(m),
                    // The parent did not fit, so neither does its subtree.
                    None => {
                        mapped.push(None);
                        continue;
                    }
                },
            };
            let node = match self.child(parent, token) {
                Some(existing) => Some(existing),
                None if self.len() < budget => Some(self.push(token, parent)),
                None => None,
            };
            mapped.push(node);
        }
    }

    /// Keeps the nodes of depth at most `depth` (and their order).
    pub fn limit_depth(&self, depth: usize) -> DraftTree {
        let mut out = DraftTree::new();
        let mut mapped = vec![None; self.len()];
        for i in 0..self.len() {
            if self.depths[i] > depth {
                continue;
            }
            let parent = self.parents[i].and_then(|p| mapped[p]);
            if self.parents[i].is_some() && parent.is_none() {
                continue;
            }
            mapped[i] = Some(out.push(self.tokens[i], parent));
        }
        out
    }

    /// The verification layout: the root followed by the nodes.
    pub fn mask(&self) -> TreeMask {
        TreeMask::new(
            std::iter::once(None)
                .chain(self.parents.iter().map(|p| Some(p.map_or(0, |p| p + 1))))
                .collect(),
        )
    }
}

/// The rows of a tree-verification block and who attends to whom.
///
/// Row 0 is the root; every other row has a parent row before it. A row sits at position
/// `cached + depth` (its depth in the tree) and attends to every cached position and to its
/// ancestors' rows, itself included, so each row sees exactly the context it would see in
/// plain decoding had its path been accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeMask {
    parents: Vec<Option<usize>>,
    depths: Vec<usize>,
    /// Rows each row attends to, ascending, flattened; `starts[r]..starts[r + 1]`.
    ancestors: Vec<usize>,
    starts: Vec<usize>,
}

impl TreeMask {
    /// A layout from each row's parent row. Row 0 must be the only row without a parent and
    /// every parent must come before its child; anything else is an error message.
    pub fn try_new(parents: Vec<Option<usize>>) -> Result<Self, String> {
        for (r, p) in parents.iter().enumerate() {
            match (r, p) {
                (0, None) => {}
                (0, Some(_)) => return Err("row 0 (the root) has a parent".into()),
                (_, Some(p)) if *p < r => {}
                (_, p) => return Err(format!("row {r} has parent {p:?}, not an earlier row")),
            }
        }
        let mut depths = Vec::with_capacity(parents.len());
        let mut ancestors = Vec::new();
        let mut starts = vec![0];
        for (r, p) in parents.iter().enumerate() {
            depths.push(p.map_or(0, |p| depths[p] + 1));
            let mut chain = vec![r];
            let mut at = *p;
            while let Some(a) = at {
                chain.push(a);
                at = parents[a];
            }
            chain.reverse();
            ancestors.extend(chain);
            starts.push(ancestors.len());
        }
        Ok(TreeMask {
            parents,
            depths,
            ancestors,
            starts,
        })
    }

    fn new(parents: Vec<Option<usize>>) -> Self {
        match Self::try_new(parents) {
            Ok(mask) => mask,
            Err(e) => unreachable!("a DraftTree is topologically ordered: {e}"),
        }
    }

    /// A chain of `rows` rows (ordinary causal attention).
    pub fn chain(rows: usize) -> Self {
        Self::new((0..rows).map(|r| r.checked_sub(1)).collect())
    }

    /// Rows of the block.
    pub fn rows(&self) -> usize {
        self.parents.len()
    }

    /// Parent row of `row` (`None` for the root).
    pub fn parent(&self, row: usize) -> Option<usize> {
        self.parents[row]
    }

    /// Depth of each row (the root 0): its position offset after the cache.
    pub fn depths(&self) -> &[usize] {
        &self.depths
    }

    /// The rows `row` attends to: its ancestors and itself, ascending.
    pub fn ancestors(&self, row: usize) -> &[usize] {
        &self.ancestors[self.starts[row]..self.starts[row + 1]]
    }

    /// Whether every row's parent is the row before it (a plain causal block).
    pub fn is_chain(&self) -> bool {
        self.parents
            .iter()
            .enumerate()
            .all(|(r, p)| *p == r.checked_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_dedupes_siblings_and_merge_follows_common_prefixes() {
        let mut a = DraftTree::chain(&[5, 6, 7]);
        assert_eq!(a.push(5, None), 0);
        let b8 = a.push(8, Some(0));
        assert_eq!((a.len(), a.depth(b8), a.path(b8)), (4, 2, vec![5, 8]));

        // [5 6 9] shares 5 6 with a; [4] is new.
        let mut b = DraftTree::chain(&[5, 6, 9]);
        b.push(4, None);
        let mut fused = a.clone();
        fused.merge(&b, 100);
        assert_eq!(fused.len(), 6);
        assert_eq!(fused.path(4), vec![5, 6, 9]);
        assert_eq!(fused.path(5), vec![4]);

        // Under a budget: nodes whose parent did not fit are dropped with it.
        let mut small = DraftTree::chain(&[1]);
        small.merge(&DraftTree::chain(&[2, 3, 4]), 2);
        assert_eq!(small.tokens(), &[1, 2]);
    }

    #[test]
    fn mask_rows_attend_to_their_ancestors() {
        let mut t = DraftTree::chain(&[5, 6]);
        t.push(7, None);
        t.push(8, Some(2));
        let m = t.mask();
        assert_eq!(m.rows(), 5);
        assert_eq!(m.depths(), &[0, 1, 2, 1, 2]);
        assert_eq!(m.ancestors(2), &[0, 1, 2]);
        assert_eq!(m.ancestors(4), &[0, 3, 4]);
        assert!(!m.is_chain());
        assert!(TreeMask::chain(4).is_chain());
        assert_eq!(t.limit_depth(1).tokens(), &[5, 7]);
        assert!(TreeMask::try_new(vec![None, Some(2), Some(0)]).is_err());
        assert!(TreeMask::try_new(vec![None, None]).is_err());
    }
}
