//! Context lookup (prompt lookup decoding): if the last few tokens occurred earlier in the
//! prompt or the output, what followed them then is drafted now.
//!
//! Strong where answers copy from the prompt (summaries, retrieval, translation of names and
//! code); free to draft: a scan of the context per round.

use crate::drafter::Drafter;
use crate::tree::DraftTree;

/// The context-lookup drafter: n-gram matches, longest `n` first, most recent first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextLookup {
    max_ngram: usize,
    min_ngram: usize,
    max_len: usize,
    branches: usize,
}

impl Default for ContextLookup {
    /// n-grams of 3 down to 1 token, one continuation of up to 8 tokens.
    fn default() -> Self {
        ContextLookup::new(3, 1, 8, 1)
    }
}

impl ContextLookup {
    /// Matches the last `max_ngram` down to `min_ngram` tokens (at least 1) and drafts up to
    /// `branches` distinct continuations of at most `max_len` tokens each, as one tree.
    pub fn new(max_ngram: usize, min_ngram: usize, max_len: usize, branches: usize) -> Self {
        let min_ngram = min_ngram.max(1);
        ContextLookup {
            max_ngram: max_ngram.max(min_ngram),
            min_ngram,
            max_len,
            branches: branches.max(1),
        }
    }
}

impl ContextLookup {
    /// Earlier occurrences of the context's last `n` tokens, longest `n` first and latest
    /// first: `(n, start)`, where what followed the occurrence begins at `context[start]`
    /// (always before the end of the context).
    pub fn matches<'c>(&self, context: &'c [u32]) -> impl Iterator<Item = (usize, usize)> + 'c {
        let len = context.len();
        let longest = self.max_ngram.min(len.saturating_sub(1));
        (self.min_ngram..=longest).rev().flat_map(move |n| {
            let pattern = &context[len - n..];
            (0..len - n)
                .rev()
                .filter(move |&i| &context[i..i + n] == pattern)
                .map(move |i| (n, i + n))
        })
    }

    /// The longest continuation drafted per match.
    pub fn max_len(&self) -> usize {
        self.max_len
    }
}

impl Drafter for ContextLookup {
    fn name(&self) -> String {
        "lookup".into()
    }

    fn propose(&mut self, context: &[u32], budget: usize) -> DraftTree {
        let mut tree = DraftTree::new();
        let mut branches = 0;
        for (_, at) in self.matches(context) {
            let follow = &context[at..(at + self.max_len).min(context.len())];
            let before = tree.len();
            tree.merge(&DraftTree::chain(follow), budget);
            branches += usize::from(tree.len() > before);
            if branches >= self.branches || tree.len() >= budget {
                break;
            }
        }
        tree
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_latest_longest_match() {
        let mut l = ContextLookup::new(2, 1, 3, 1);
        // "1 2" occurred at 0 (→ 3 4 5) and at 5 (→ 9); the latest wins.
        let ctx = [1, 2, 3, 4, 5, 1, 2, 9, 7, 1, 2];
        assert_eq!(l.propose(&ctx, 8).tokens(), &[9, 7, 1]);
        assert_eq!(l.propose(&ctx, 2).tokens(), &[9, 7]);
        let mut two = ContextLookup::new(2, 1, 3, 2);
        let tree = two.propose(&ctx, 8);
        assert_eq!(tree.len(), 6);
        assert_eq!(tree.path(5), vec![3, 4, 5]);
        // No match, or nothing to match: no drafts.
        assert!(l.propose(&[4, 5, 6], 8).is_empty());
        assert!(l.propose(&[4], 8).is_empty());
        let found: Vec<_> = l.matches(&ctx).collect();
        assert_eq!(found[..3], [(2, 7), (2, 2), (1, 7)]);
    }
}
