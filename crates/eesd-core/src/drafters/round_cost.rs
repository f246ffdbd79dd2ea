//! What a round of tree speculation costs, by the number of rows it verifies, learnt from the
//! rounds' wall times; and the tree size that buys the most accepted tokens per second.
//!
//! Why: a node pays off only while its chance of being accepted outweighs what its row adds to
//! the round. That price depends on the machine and the weights: with f32 weights on a CPU a
//! block of 9 rows costs what one row costs, with 4-bit weights every row costs its own integer
//! arithmetic, and on a GPU a round is bound by kernel launches. A fixed node budget is right
//! for one of them at most; measuring the rounds is right for all.
//!
//! Sizes never measured are estimated optimistically, so that they get tried: a size above a
//! measured one is assumed to cost what that one did, a size below the smallest measured one
//! proportionally less. A measured size that turns out dear is then avoided, one that turns out
//! cheap kept.

/// Weight of the newest measurement of a size in its running mean.
const NEWEST: f64 = 0.2;

/// Running mean round time per number of verified rows.
#[derive(Debug, Clone, Default)]
pub struct RoundCost {
    /// `seconds[rows]`: mean round time of rounds that verified `rows` rows, if any did.
    seconds: Vec<Option<f64>>,
}

impl RoundCost {
    /// No rounds measured yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a round that verified `rows` rows (the root included) in `seconds`.
    pub fn record(&mut self, rows: usize, seconds: f64) {
        if rows == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        if self.seconds.len() <= rows {
            self.seconds.resize(rows + 1, None);
        }
        let mean = &mut self.seconds[rows];
        *mean = Some(match *mean {
            Some(m) => m + NEWEST * (seconds - m),
            None => seconds,
        });
    }

    /// The estimated time of a round of `rows` rows (see the module docs), `None` before any
    /// round was measured.
    pub fn estimate(&self, rows: usize) -> Option<f64> {
        let measured = || {
            self.seconds
                .iter()
                .enumerate()
                .filter_map(|(r, s)| s.map(|s| (r, s)))
        };
        // A round costs at least what any smaller one did.
        let below = measured()
            .take_while(|&(r, _)| r <= rows)
            .map(|(_, s)| s)
            .reduce(f64::max);
        below.or_else(|| {
            let (smallest, s) = measured().next()?;
            Some(s * rows as f64 / smallest as f64)
        })
    }

    /// How many of a best-first tree's nodes to verify: with `path_probabilities[i]` the
    /// chance that node `i` and its whole path are accepted (nodes in the order they were
    /// added, parents first), the count `n` whose rounds are expected to yield the most tokens
    /// per second, `(1 + Σ_{i<n} p_i) / time(n + 1 rows)`. Every node before any round was
    /// measured.
    pub fn best_size(&self, path_probabilities: &[f64]) -> usize {
        let mut best = (path_probabilities.len(), f64::NEG_INFINITY);
        let mut expected = 1.0;
        for n in 0..=path_probabilities.len() {
            if n > 0 {
                expected += path_probabilities[n - 1];
            }
            let Some(seconds) = self.estimate(n + 1) else {
                return path_probabilities.len();
            };
            let rate = expected / seconds;
            if rate > best.1 {
                best = (n, rate);
            }
        }
        best.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmeasured_sizes_are_estimated_optimistically() {
        let mut cost = RoundCost::new();
        assert_eq!(cost.estimate(4), None);
        cost.record(5, 0.010);
        // Below the smallest measured size: proportionally less.
        assert_eq!(cost.estimate(1), Some(0.002));
        // Above: what the largest measured size below it cost.
        assert_eq!(cost.estimate(9), Some(0.010));
        cost.record(3, 0.012);
        // Never less than a smaller round cost.
        assert_eq!(cost.estimate(5), Some(0.012));
        assert_eq!(cost.estimate(4), Some(0.012));
    }

    #[test]
    fn measurements_are_running_means() {
        let mut cost = RoundCost::new();
        cost.record(2, 1.0);
        cost.record(2, 2.0);
        assert!((cost.estimate(2).unwrap() - 1.2).abs() < 1e-12);
        // Nonsense times are ignored.
        cost.record(2, f64::NAN);
        cost.record(2, -1.0);
        cost.record(0, 1.0);
        assert!((cost.estimate(2).unwrap() - 1.2).abs() < 1e-12);
    }

    #[test]
    fn the_best_size_trades_acceptance_against_time() {
        let p = [0.8, 0.5, 0.3, 0.1, 0.05];
        let mut cost = RoundCost::new();
        // Nothing measured: the whole tree.
        assert_eq!(cost.best_size(&p), 5);
        // Rows cost nothing extra (f32 on a CPU, few rows): the whole tree.
        for rows in 1..=6 {
            cost.record(rows, 0.020);
        }
        assert_eq!(cost.best_size(&p), 5);
        // Every row costs as much as the first (the arithmetic, not the bytes, sets the
        // time): a node would pay only if it were surer than certain, so none does.
        let mut linear = RoundCost::new();
        for rows in 1..=6 {
            linear.record(rows, 0.010 * rows as f64);
        }
        assert_eq!(linear.best_size(&p), 0);
        // Half a row's price per extra row: tokens per unit of time 1, 1.8 / 1.5 = 1.2,
        // 2.3 / 2 = 1.15, 2.6 / 2.5 = 1.04, ...: one node.
        let mut half = RoundCost::new();
        for rows in 1..=6 {
            half.record(rows, 0.010 * (1.0 + 0.5 * (rows - 1) as f64));
        }
        assert_eq!(half.best_size(&p), 1);
    }
}
