//! Drafters named on command lines: `recycle@16`, `lookup@8`, `fused@16`, `fused@32:8`, `opt@8`,
//! `opt@16:auto`, and Thompson Sampling over several of them: `ts:opt@16:auto|lookup@8`.

use std::fmt;
use std::str::FromStr;

use std::sync::Arc;

use super::{ContextLookup, Fused, NgramStore, OptTree, ThompsonDrafters, TokenRecycling};
use crate::drafter::Drafter;
use crate::error::CoreError;

/// Candidates per token of the recycling matrix (as in the Token Recycling paper).
const RECYCLE_K: usize = 8;

/// Seed of the drafter choice's posterior draws (runs repeat exactly).
const TS_SEED: u64 = 0x7453;

/// Which drafter, and the node budget of its trees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrafterSpec {
    /// The drafter.
    pub kind: DrafterKind,
    /// Most nodes per tree.
    pub budget: usize,
}

/// The drafters a [`DrafterSpec`] can name.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// [`ThompsonDrafters`]: one of these drafters per round, by measured tokens per second
    /// (the budget is the largest of theirs).
    Thompson(Vec<DrafterSpec>),
}

impl DrafterSpec {
    /// A fresh drafter for a vocabulary of `vocab` tokens.
    pub fn build(&self, vocab: usize) -> Box<dyn Drafter + Send> {
        self.build_with(vocab, None)
    }

    /// A fresh drafter whose adaptive trees (`opt`, also inside `ts:`) add the continuations
    /// of `store` ([`OptTree::with_store`]); the other drafters ignore it.
    pub fn build_with(
        &self,
        vocab: usize,
        store: Option<&Arc<NgramStore>>,
    ) -> Box<dyn Drafter + Send> {
        let lookup = |len: usize| ContextLookup::new(3, 1, len, 1);
        match self.kind {
            DrafterKind::Recycle => Box::new(TokenRecycling::new(vocab, RECYCLE_K)),
            DrafterKind::Lookup => Box::new(lookup(self.budget)),
            DrafterKind::Fused { lookup: cap } => Box::new(Fused::new(vec![
                (Box::new(lookup(cap)), cap),
                (Box::new(TokenRecycling::new(vocab, RECYCLE_K)), self.budget),
            ])),
            DrafterKind::Opt { timed } => {
                let mut tree = OptTree::new(vocab, RECYCLE_K, self.budget);
                if let Some(store) = store {
                    tree = tree.with_store(store.clone());
                }
                Box::new(if timed { tree.timed() } else { tree })
            }
            DrafterKind::Thompson(ref arms) => {
                let arms = arms
                    .iter()
                    .map(|a| (a.build_with(vocab, store), a.budget))
                    .collect();
                // Fails only without arms (parsing admits none): then nothing is drafted.
                match ThompsonDrafters::new(arms, TS_SEED) {
                    Ok(ts) => Box::new(ts),
                    Err(_) => Box::new(Fused::new(Vec::new())),
                }
            }
        }
    }
}

impl FromStr for DrafterSpec {
    type Err = CoreError;

    /// `recycle@B`, `lookup@B`, `fused@B[:L]` (lookup capped at `L` nodes, default `B / 2`),
    /// `opt@B` or `opt@B:auto` (at most `B` nodes, as many as pay for their rows); `B`
    /// defaults to 16. `ts:A|B|...` chooses among the drafters `A`, `B`, ... each round.
    fn from_str(s: &str) -> Result<Self, CoreError> {
        if let Some(arms) = s.strip_prefix("ts:") {
            let arms = arms
                .split('|')
                .map(|a| match a.starts_with("ts:") {
                    true => Err(CoreError::InvalidConfig(format!(
                        "drafter `{s}`: a choice among choices (`{a}`) is not supported"
                    ))),
                    false => a.parse::<DrafterSpec>(),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let budget = arms.iter().map(|a| a.budget).max().unwrap_or(0);
            return Ok(DrafterSpec {
                kind: DrafterKind::Thompson(arms),
                budget,
            });
        }
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
        match &self.kind {
            DrafterKind::Recycle => write!(f, "recycle@{}", self.budget),
            DrafterKind::Lookup => write!(f, "lookup@{}", self.budget),
            DrafterKind::Fused { lookup } => write!(f, "fused@{}:{lookup}", self.budget),
            DrafterKind::Opt { timed: false } => write!(f, "opt@{}", self.budget),
            DrafterKind::Opt { timed: true } => write!(f, "opt@{}:auto", self.budget),
            DrafterKind::Thompson(arms) => {
                let arms: Vec<String> = arms.iter().map(|a| a.to_string()).collect();
                write!(f, "ts:{}", arms.join("|"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drafters::DrafterState;

    #[test]
    fn parses_and_prints_specs() {
        for s in [
            "recycle@16",
            "lookup@8",
            "fused@32:8",
            "opt@8",
            "opt@16:auto",
            "ts:opt@16:auto|lookup@8",
            "ts:fused@8:4",
        ] {
            assert_eq!(s.parse::<DrafterSpec>().unwrap().to_string(), s);
        }
        let ts: DrafterSpec = "ts:opt@16:auto|lookup@24|recycle@4".parse().unwrap();
        assert_eq!(ts.budget, 24);
        assert_eq!(ts.build(100).name(), "ts(opt|lookup|recycle)");
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
            "ts:",
            "ts:opt@8|",
            "ts:ts:opt@8",
            "ts:lookup@8|ts:opt@8",
        ] {
            assert!(bad.parse::<DrafterSpec>().is_err(), "{bad}");
        }
        assert_eq!(fused.build(100).name(), "lookup:8+recycle:16");
    }

    /// Feeds a drafter a few rounds of a repetitive text, as the generator would.
    fn train(d: &mut dyn Drafter) {
        let text: Vec<u32> = (0..60).map(|i| (i * 7 % 13) as u32).collect();
        for end in 2..text.len() {
            let context = &text[..end];
            let tree = d.propose(context, 8);
            let best: Vec<u32> = (0..=tree.len()).map(|i| text[(end + i) % 60]).collect();
            d.verified(&tree, &best);
            let next = text[end % 60];
            d.observe(context[end - 1], &[next, (next + 1) % 13], &[2.0, 1.0]);
            d.emitted(1);
        }
    }

    #[test]
    fn learnt_state_survives_json_and_restores_into_the_same_spec() {
        for spec in [
            "recycle@8",
            "opt@8",
            "opt@16:auto",
            "fused@8:4",
            "ts:opt@8|lookup@8",
        ] {
            let spec: DrafterSpec = spec.parse().unwrap();
            let mut trained = spec.build(13);
            train(&mut trained);
            let state = trained.state().expect("keeps state");
            let json = serde_json::to_string(&state).unwrap();
            let mut fresh = spec.build(13);
            fresh.restore(serde_json::from_str(&json).unwrap()).unwrap();
            let again = serde_json::to_string(&fresh.state().unwrap()).unwrap();
            assert_eq!(again, json, "{spec}");
            if !matches!(spec.kind, DrafterKind::Thompson(_)) {
                let context = [3, 10, 4];
                assert_eq!(
                    fresh.propose(&context, 8),
                    trained.propose(&context, 8),
                    "{spec}"
                );
            }
        }
        // Lookup learns nothing lasting; states of another kind or shape are refused.
        let mut lookup = "lookup@8".parse::<DrafterSpec>().unwrap().build(13);
        assert!(lookup.state().is_none());
        let mut opt = "opt@8".parse::<DrafterSpec>().unwrap().build(13);
        train(&mut opt);
        let state = opt.state().unwrap();
        assert!(lookup.restore(state.clone()).is_err());
        let mut recycle = "recycle@8".parse::<DrafterSpec>().unwrap().build(13);
        assert!(recycle.restore(state.clone()).is_err());
        assert!(recycle.state().unwrap_or_else(|| unreachable!()).kind() == "a recycling matrix");
        let mut fused = "fused@8:4".parse::<DrafterSpec>().unwrap().build(13);
        assert!(fused.restore(DrafterState::Parts(vec![None])).is_err());
        let mut wider = "opt@8".parse::<DrafterSpec>().unwrap().build(14);
        assert!(wider.restore(state).is_err());
    }
}
