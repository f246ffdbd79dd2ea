//! Drafters named on command lines: `recycle@16`, `lookup@8`, `fused@16`, `fused@32:8`, `opt@8`,
//! `opt@16:auto`.

use std::fmt;
use std::str::FromStr;

use super::{ContextLookup, Fused, OptTree, TokenRecycling};
use crate::drafter::Drafter;
use crate::error::CoreError;

/// Candidates per token of the recycling matrix (as in the Token Recycling paper).
const RECYCLE_K: usize = 8;

/// Which drafter, and the node budget of its trees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrafterSpec {
    /// The drafter.
    pub kind: DrafterKind,
    /// Most nodes per tree.
    pub budget: usize,
}

/// The drafters a [`DrafterSpec`] can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrafterKind {
    /// [`TokenRecycling`] with 8 candidates per token.
    Recycle,
    /// [`ContextLookup`]: n-grams of 3 to 1 tokens, one continuation.
    Lookup,
    /// Context lookup (at most `lookup` nodes, first) fused with Token Recycling.
    Fused {
        /// Node cap of the lookup chain.
        lookup: usize,
    },
    /// [`OptTree`]: recycling and lookup candidates rated online, the tree of most expected
    /// accepted tokens.
    Opt {
        /// Only as many of the budget's nodes as pay for their rows ([`OptTree::timed`]).
        timed: bool,
    },
}

impl DrafterSpec {
    /// A fresh drafter for a vocabulary of `vocab` tokens.
    pub fn build(&self, vocab: usize) -> Box<dyn Drafter + Send> {
        let lookup = |len: usize| ContextLookup::new(3, 1, len, 1);
        match self.kind {
            DrafterKind::Recycle => Box::new(TokenRecycling::new(vocab, RECYCLE_K)),
            DrafterKind::Lookup => Box::new(lookup(self.budget)),
            DrafterKind::Fused { lookup: cap } => Box::new(Fused::new(vec![
                (Box::new(lookup(cap)), cap),
                (Box::new(TokenRecycling::new(vocab, RECYCLE_K)), self.budget),
            ])),
            DrafterKind::Opt { timed } => {
                let tree = OptTree::new(vocab, RECYCLE_K, self.budget);
                Box::new(if timed { tree.timed() } else { tree })
            }
        }
    }
}

impl FromStr for DrafterSpec {
    type Err = CoreError;

    /// `recycle@B`, `lookup@B`, `fused@B[:L]` (lookup capped at `L` nodes, default `B / 2`),
    /// `opt@B` or `opt@B:auto` (at most `B` nodes, as many as pay for their rows); `B`
    /// defaults to 16.
    fn from_str(s: &str) -> Result<Self, CoreError> {
        let bad = |why: &str| {
            CoreError::InvalidConfig(format!(
                "drafter `{s}`: {why} (expected recycle@B, lookup@B, fused@B[:L], opt@B or opt@B:auto)"
            ))
        };
        let (name, rest) = s.split_once('@').unwrap_or((s, "16"));
        let (budget, lookup) = match rest.split_once(':') {
            Some((b, l)) => (b, Some(l)),
            None => (rest, None),
        };
        let budget: usize = budget.parse().map_err(|_| bad("bad node budget"))?;
        let cap = |l: Option<&str>| {
            l.map(|l| l.parse::<usize>().map_err(|_| bad("bad lookup cap")))
                .transpose()
        };
        let kind = match (name, lookup) {
            ("recycle", None) => DrafterKind::Recycle,
            ("lookup", None) => DrafterKind::Lookup,
            ("opt", None) => DrafterKind::Opt { timed: false },
            ("opt", Some("auto")) => DrafterKind::Opt { timed: true },
            ("opt", Some(_)) => return Err(bad("the only option of opt is `auto`")),
            ("fused", l) => DrafterKind::Fused {
                lookup: cap(l)?.unwrap_or(budget / 2).min(budget),
            },
            _ => return Err(bad("unknown drafter")),
        };
        Ok(DrafterSpec { kind, budget })
    }
}

impl fmt::Display for DrafterSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            DrafterKind::Recycle => write!(f, "recycle@{}", self.budget),
            DrafterKind::Lookup => write!(f, "lookup@{}", self.budget),
            DrafterKind::Fused { lookup } => write!(f, "fused@{}:{lookup}", self.budget),
            DrafterKind::Opt { timed: false } => write!(f, "opt@{}", self.budget),
            DrafterKind::Opt { timed: true } => write!(f, "opt@{}:auto", self.budget),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_specs() {
        for s in [
            "recycle@16",
            "lookup@8",
            "fused@32:8",
            "opt@8",
            "opt@16:auto",
        ] {
            assert_eq!(s.parse::<DrafterSpec>().unwrap().to_string(), s);
        }
        let fused: DrafterSpec = "fused@16".parse().unwrap();
        assert_eq!(fused.kind, DrafterKind::Fused { lookup: 8 });
        assert_eq!("recycle".parse::<DrafterSpec>().unwrap().budget, 16);
        for bad in [
            "tree@4",
            "recycle@x",
            "lookup@4:2",
            "fused@8:y",
            "opt@8:2",
            "opt@8:fast",
        ] {
            assert!(bad.parse::<DrafterSpec>().is_err(), "{bad}");
        }
        assert_eq!(fused.build(100).name(), "lookup:8+recycle:16");
    }
}
