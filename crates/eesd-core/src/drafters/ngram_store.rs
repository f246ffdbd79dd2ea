//! A datastore of what the model tends to write (retrieval drafting, as in REST and RASD): the
//! most frequent continuations of every 2- and 3-token context in a corpus of token sequences,
//! such as the model's own answers to training prompts (the data self-distillation uses).
//!
//! Context lookup only finds n-grams of the prompt and the output so far, and Token Recycling
//! knows one token of context; a corpus of the model's own writing knows how its usual phrases
//! go on. Lookups are a hash probe per node, so retrieved candidates cost nothing to draft;
//! [`super::OptTree`] rates them by order and rank like its other sources.

use std::collections::HashMap;

use crate::error::{CoreError, Result};

/// Context lengths stored, longest first when drafting.
pub(crate) const ORDERS: std::ops::RangeInclusive<usize> = 2..=3;
/// Continuations kept per context.
pub(crate) const TOP: usize = 3;
/// Token ids are packed 21 bits each into a context key; larger ids are never stored.
const TOKEN_BITS: u32 = 21;
/// Fewest occurrences of a continuation worth keeping (one sighting is weak evidence and most
/// of the table).
const MIN_COUNT: u32 = 2;

/// One stored continuation: a token and the share of the context's occurrences it followed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Continuation {
    /// The next token.
    pub token: u32,
    /// Fraction of the context's occurrences in the corpus that this token followed.
    pub share: f32,
}

/// Most frequent continuations of 2- and 3-token contexts of a corpus.
#[derive(Debug, Clone, Default)]
pub struct NgramStore {
    /// Per order (index `n - 2`): context key → continuations, most frequent first.
    tables: Vec<HashMap<u64, Vec<Continuation>>>,
    /// Tokens the store was built from.
    tokens: usize,
}

fn key(context: &[u32]) -> Option<u64> {
    context.iter().try_fold(0u64, |k, &t| {
        (t < 1 << TOKEN_BITS).then_some((k << TOKEN_BITS) | u64::from(t))
    })
}

impl NgramStore {
    /// Counts every 2- and 3-token context of `sequences` and keeps, for each, its 3
    /// most frequent continuations seen at least twice. Memory while building is about 24
    /// bytes per corpus token; the store keeps only contexts with a repeated continuation.
    pub fn from_sequences<'s>(sequences: impl IntoIterator<Item = &'s [u32]>) -> Self {
        let mut pairs: Vec<Vec<(u64, u32)>> = ORDERS.map(|_| Vec::new()).collect();
        let mut tokens = 0;
        for s in sequences {
            tokens += s.len();
            for (o, n) in ORDERS.enumerate() {
                pairs[o].extend(s.windows(n + 1).filter_map(|w| Some((key(&w[..n])?, w[n]))));
            }
        }
        let tables = pairs
            .into_iter()
            .map(|mut p| {
                p.sort_unstable();
                let mut table = HashMap::new();
                for group in p.chunk_by(|a, b| a.0 == b.0) {
                    let total = group.len() as f32;
                    let mut counts: Vec<(u32, u32)> = group
                        .chunk_by(|a, b| a.1 == b.1)
                        .map(|run| (run.len() as u32, run[0].1))
                        .filter(|&(c, _)| c >= MIN_COUNT)
                        .collect();
                    if counts.is_empty() {
                        continue;
                    }
                    // Most frequent first; ties by token id, so the store is deterministic.
                    counts.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
                    let best = counts
                        .iter()
                        .take(TOP)
                        .map(|&(c, token)| Continuation {
                            token,
                            share: c as f32 / total,
                        })
                        .collect();
                    table.insert(group[0].0, best);
                }
                table
            })
            .collect();
        NgramStore { tables, tokens }
    }

    /// The continuations of the longest stored context ending `context`, with that context's
    /// length (`None`: no stored context matches).
    pub fn continuations(&self, context: &[u32]) -> Option<(usize, &[Continuation])> {
        ORDERS.rev().find_map(|n| {
            let tail = context.get(context.len().checked_sub(n)?..)?;
            let found = self.tables.get(n - ORDERS.start())?.get(&key(tail)?)?;
            Some((n, found.as_slice()))
        })
    }

    /// Contexts stored, all orders together.
    pub fn contexts(&self) -> usize {
        self.tables.iter().map(HashMap::len).sum()
    }

    /// Corpus tokens the store was built from.
    pub fn corpus_tokens(&self) -> usize {
        self.tokens
    }

    /// An error unless every stored token is below `vocab` (a store built from another
    /// tokenizer's ids would draft tokens the model does not have).
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        let too_large = self
            .tables
            .iter()
            .flat_map(HashMap::values)
            .flatten()
            .find(|c| c.token as usize >= vocab);
        match too_large {
            Some(c) => Err(CoreError::InvalidConfig(format!(
                "n-gram store holds token {} outside the vocabulary of {vocab}",
                c.token
            ))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_context_wins_and_single_sightings_are_dropped() {
        let a: &[u32] = &[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 9, 2, 3, 7, 9, 2, 3, 7];
        let store = NgramStore::from_sequences([a]);
        // After (1, 2, 3): 4 twice, 5 once (dropped).
        let (n, c) = store.continuations(&[0, 1, 2, 3]).unwrap();
        assert_eq!(n, 3);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].token, 4);
        assert!((c[0].share - 2.0 / 3.0).abs() < 1e-6);
        // After (9, 2, 3): 7 twice.
        assert_eq!(store.continuations(&[9, 2, 3]).unwrap().1[0].token, 7);
        // (8, 2, 3) is unknown: back off to (2, 3): 4 and 7 twice each, 5 once; ties by id.
        let (n, c) = store.continuations(&[8, 2, 3]).unwrap();
        assert_eq!(n, 2);
        assert_eq!(c.iter().map(|c| c.token).collect::<Vec<_>>(), [4, 7]);
        assert!(store.continuations(&[3]).is_none());
        assert!(store.continuations(&[]).is_none());
        assert!(store.continuations(&[5, 6]).is_none());
        assert_eq!(store.corpus_tokens(), a.len());
        assert!(store.check_vocab(10).is_ok());
        assert!(store.check_vocab(7).is_err());
        // Ids too large to pack are skipped, not wrapped.
        let big = NgramStore::from_sequences([&[1u32 << 22, 1, 2, 1 << 22, 1, 2][..]]);
        assert!(big.continuations(&[1 << 22, 1]).is_none());
    }
}
