//! Thompson Sampling over whole drafters: each round one of several drafters proposes the
//! tree, chosen by the tokens per second its own rounds achieved ([`RewardTs`]).
//!
//! Why: which drafter pays depends on the text (lookup wins where the answer copies the
//! prompt, recycling where it repeats the model's habits) and on the machine (what a verified
//! row costs). Measuring each round's tokens per second judges both at once, and the discount
//! lets the choice move when the prompt changes. Every drafter keeps learning from every
//! verified row ([`Drafter::observe`]); only the chosen one hears how its tree fared.

use eesd_bandit::RewardTs;

use crate::accept::accept_tree;
use crate::drafter::Drafter;
use crate::error::{CoreError, Result};
use crate::tree::DraftTree;

/// Several drafters (each with its own node cap), one chosen per round by Thompson Sampling
/// on the round's accepted tokens (plus the target's own) per second of wall time.
pub struct ThompsonDrafters {
    arms: Vec<super::Capped>,
    ts: RewardTs,
    /// The arm that proposed the current round's tree.
    chosen: usize,
    /// Tokens the current round emits (accepted drafts and the target's token).
    emitted: usize,
    /// Rounds drafted by each arm.
    rounds: Vec<u64>,
}

impl ThompsonDrafters {
    /// Drafters with their node caps; `seed` seeds the posterior draws.
    pub fn new(arms: Vec<(Box<dyn Drafter + Send>, usize)>, seed: u64) -> Result<Self> {
        let ts = RewardTs::new(arms.len(), seed)
            .map_err(|e| CoreError::InvalidConfig(format!("drafter choice: {e}")))?;
        Ok(ThompsonDrafters {
            rounds: vec![0; arms.len()],
            arms,
            ts,
            chosen: 0,
            emitted: 0,
        })
    }

    /// Rounds drafted by each drafter so far, in order.
    pub fn rounds(&self) -> &[u64] {
        &self.rounds
    }

    /// Each drafter's discounted mean tokens per second, once it has drafted a round.
    pub fn rates(&self) -> Vec<Option<f64>> {
        self.ts.arms().iter().map(|a| a.mean()).collect()
    }
}

impl std::fmt::Debug for ThompsonDrafters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl Drafter for ThompsonDrafters {
    /// The arms' states (the bandit's posteriors are rewards in tokens/s of this run, and
    /// start afresh).
    fn state(&self) -> Option<super::DrafterState> {
        super::part_states(&self.arms)
    }

    fn restore(&mut self, state: super::DrafterState) -> crate::error::Result<()> {
        let name = self.name();
        super::restore_parts(&name, &mut self.arms, state)
    }

    fn name(&self) -> String {
        let names: Vec<String> = self.arms.iter().map(|(d, _)| d.name()).collect();
        format!("ts({})", names.join("|"))
    }

    fn propose(&mut self, context: &[u32], budget: usize) -> DraftTree {
        self.chosen = self.ts.choose();
        self.rounds[self.chosen] += 1;
        self.emitted = 1;
        let (drafter, cap) = &mut self.arms[self.chosen];
        drafter.propose(context, (*cap).min(budget))
    }

    fn candidates_wanted(&self) -> usize {
        super::most_wanted(&self.arms)
    }

    fn observe(&mut self, token: u32, candidates: &[u32], logits: &[f32]) {
        super::observe_each(&mut self.arms, token, candidates, logits);
    }

    fn verified(&mut self, tree: &DraftTree, best: &[u32]) {
        // The greedy walk of the target's best tokens: what the round emits unless
        // [`Drafter::emitted`] says otherwise.
        let path = accept_tree(tree, |row| best.get(row).copied().unwrap_or(u32::MAX)).path;
        self.emitted = path.len() + 1;
        self.arms[self.chosen].0.verified(tree, best);
    }

    fn drawn(&mut self, tree: &DraftTree, rows: &[usize], distributions: &[Vec<f32>]) {
        self.arms[self.chosen].0.drawn(tree, rows, distributions);
    }

    fn emitted(&mut self, tokens: usize) {
        self.emitted = tokens;
        self.arms[self.chosen].0.emitted(tokens);
    }

    /// Each drafter as `name@cap`: drafters of one kind with different caps (`ts:opt@4|opt@8`)
    /// stay apart.
    fn choices(&self) -> Vec<(String, u64)> {
        let names = self
            .arms
            .iter()
            .map(|(d, cap)| format!("{}@{cap}", d.name()));
        names.zip(self.rounds.iter().copied()).collect()
    }

    fn round_time(&mut self, rows: usize, seconds: f64) {
        self.arms[self.chosen].0.round_time(rows, seconds);
        if seconds > 0.0 {
            self.ts.record(self.chosen, self.emitted as f64 / seconds);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Proposes a fixed chain; counts the calls it gets.
    #[derive(Default)]
    struct Chain {
        tokens: Vec<u32>,
        verified: usize,
        timed: usize,
        observed: usize,
    }

    impl Drafter for std::sync::Arc<std::sync::Mutex<Chain>> {
        fn name(&self) -> String {
            format!("chain{}", self.lock().unwrap().tokens.len())
        }
        fn propose(&mut self, _context: &[u32], budget: usize) -> DraftTree {
            let tokens = self.lock().unwrap().tokens.clone();
            DraftTree::chain(&tokens[..budget.min(tokens.len())])
        }
        fn candidates_wanted(&self) -> usize {
            2
        }
        fn observe(&mut self, _token: u32, _candidates: &[u32], _logits: &[f32]) {
            self.lock().unwrap().observed += 1;
        }
        fn verified(&mut self, _tree: &DraftTree, _best: &[u32]) {
            self.lock().unwrap().verified += 1;
        }
        fn round_time(&mut self, _rows: usize, _seconds: f64) {
            self.lock().unwrap().timed += 1;
        }
    }

    /// Two chains, the target always continuing 1, 2, 3, ...: the long right chain emits 4
    /// tokens a round, the wrong one 1; rounds cost the same. The right one takes over, only
    /// the chosen drafter hears about its round, and every drafter observes every row.
    #[test]
    fn the_drafter_emitting_more_per_second_takes_over() {
        let right = std::sync::Arc::new(std::sync::Mutex::new(Chain {
            tokens: vec![1, 2, 3],
            ..Chain::default()
        }));
        let wrong = std::sync::Arc::new(std::sync::Mutex::new(Chain {
            tokens: vec![7, 8, 9],
            ..Chain::default()
        }));
        let mut ts = ThompsonDrafters::new(
            vec![(Box::new(wrong.clone()), 8), (Box::new(right.clone()), 2)],
            5,
        )
        .unwrap();
        assert_eq!(ts.name(), "ts(chain3|chain3)");
        assert_eq!(ts.candidates_wanted(), 2);
        for _ in 0..200 {
            let tree = ts.propose(&[0], 16);
            assert!(tree.len() <= 3);
            let best = [1, 2, 3, 4];
            ts.verified(&tree, &best[..tree.len() + 1]);
            ts.observe(0, &[1, 5, 6], &[0.5, 0.2, 0.1]);
            ts.round_time(tree.len() + 1, 0.01);
        }
        let rounds = ts.rounds().to_vec();
        assert_eq!(rounds.iter().sum::<u64>(), 200);
        let names = ["chain3@8".to_string(), "chain3@2".to_string()];
        assert_eq!(
            ts.choices(),
            names.into_iter().zip(rounds.clone()).collect::<Vec<_>>()
        );
        assert!(rounds[1] > 180, "{rounds:?}");
        // The right chain is capped at 2 nodes: 3 tokens per 0.01 s; the wrong one emits 1.
        let rates = ts.rates();
        assert!((rates[1].unwrap() - 300.0).abs() < 1e-6, "{rates:?}");
        assert!((rates[0].unwrap() - 100.0).abs() < 1e-6, "{rates:?}");
        for (chain, n) in [(&wrong, rounds[0]), (&right, rounds[1])] {
            let c = chain.lock().unwrap();
            assert_eq!((c.verified as u64, c.timed as u64), (n, n));
            assert_eq!(c.observed, 200);
        }
        assert!(ThompsonDrafters::new(Vec::new(), 0).is_err());
    }

    /// A sampled round emits what the loop reports, not what the best tokens would accept.
    #[test]
    fn the_reported_emitted_tokens_are_the_reward() {
        let chain = std::sync::Arc::new(std::sync::Mutex::new(Chain {
            tokens: vec![1, 2, 3],
            ..Chain::default()
        }));
        let mut ts = ThompsonDrafters::new(vec![(Box::new(chain), 8)], 1).unwrap();
        let tree = ts.propose(&[0], 8);
        ts.verified(&tree, &[1, 2, 3, 4]);
        ts.emitted(2);
        ts.round_time(4, 0.5);
        assert_eq!(ts.rates(), vec![Some(4.0)]);
    }
}
