//! What a round of tree speculation costs, by the number of rows it verifies, learnt from the
//! rounds' wall times; and the tree size that buys the most accepted tokens per second.
//!
//! Why: a node pays off only while its chance of being accepted outweighs what its row adds to
//! the round. That price depends on the machine and the weights: with f32 weights on a CPU a
//! block of 9 rows costs what one row costs, with 4-bit weights every row costs its own integer
//! arithmetic, and on a GPU a round is bound by kernel launches. A fixed node budget is right
//! for one of them at most; measuring the rounds is right for all.
//!
//! Every size is judged by its own measured rounds, a little optimistically while it has few
//! (the fewer, the more), so that a size measured once at an unlucky moment gets tried again
//! rather than avoided for good. Sizes never measured are interpolated between measured ones,
//! assumed to cost what the largest measured one did above it, and proportionally less below
//! the smallest: they get tried, and kept if they turn out cheap.

/// Weight of the newest measurement of a size in its running mean.
const NEWEST: f64 = 0.2;

/// How much cheaper than measured a size is assumed to be after one round, shrinking with the
/// square root of its rounds (UCB-style optimism).
const OPTIMISM: f64 = 0.3;

/// Running mean round time per number of verified rows.
#[derive(Debug, Clone, Default)]
pub struct RoundCost {
    /// `sizes[rows]`: mean round time and number of rounds that verified `rows` rows.
    sizes: Vec<Option<(f64, u32)>>,
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
        if self.sizes.len() <= rows {
            self.sizes.resize(rows + 1, None);
        }
        let size = &mut self.sizes[rows];
        *size = Some(match *size {
            Some((mean, n)) => (mean + NEWEST * (seconds - mean), n.saturating_add(1)),
            None => (seconds, 1),
        });
    }

    /// The mean measured time of rounds of `rows` rows, if any was measured.
    pub fn measured(&self, rows: usize) -> Option<f64> {
        self.sizes
            .get(rows)
            .copied()
            .flatten()
            .map(|(mean, _)| mean)
    }

    /// The time a round of `rows` rows is assumed to take when sizing trees (see the module
    /// docs), `None` before any round was measured.
    pub fn estimate(&self, rows: usize) -> Option<f64> {
        let optimistic = |r: usize| {
            self.sizes
                .get(r)
                .copied()
                .flatten()
                .map(|(mean, n)| mean * (1.0 - OPTIMISM / f64::from(n).sqrt()))
        };
        if let Some(t) = optimistic(rows) {
            return Some(t);
        }
        let below = (1..rows.min(self.sizes.len()))
            .rev()
            .find_map(|r| Some((r, optimistic(r)?)));
        let above = (rows + 1..self.sizes.len()).find_map(|r| Some((r, optimistic(r)?)));
        match (below, above) {
            (Some((r0, t0)), Some((r1, t1))) => {
                let w = (rows - r0) as f64 / (r1 - r0) as f64;
                Some(t0 + w * (t1 - t0))
            }
            (Some((_, t0)), None) => Some(t0),
            (None, Some((r1, t1))) => Some(t1 * rows as f64 / r1 as f64),
            (None, None) => None,
        }
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
        let once = 0.010 * (1.0 - OPTIMISM);
        assert_eq!(cost.estimate(5), Some(once));
        // Below the smallest measured size: proportionally less; above: the same.
        assert!((cost.estimate(1).unwrap() - once / 5.0).abs() < 1e-15);
        assert_eq!(cost.estimate(9), Some(once));
        // Between two measured sizes: interpolated.
        cost.record(1, 0.006);
        let low = 0.006 * (1.0 - OPTIMISM);
        let mid = cost.estimate(3).unwrap();
        assert!((mid - (low + 0.5 * (once - low))).abs() < 1e-15);
    }

    #[test]
    fn measurements_are_running_means_and_optimism_fades() {
        let mut cost = RoundCost::new();
        cost.record(2, 1.0);
        cost.record(2, 2.0);
        assert!((cost.measured(2).unwrap() - 1.2).abs() < 1e-12);
        // Nonsense times are ignored.
        cost.record(2, f64::NAN);
        cost.record(2, -1.0);
        cost.record(0, 1.0);
        assert!((cost.measured(2).unwrap() - 1.2).abs() < 1e-12);
        let two = cost.estimate(2).unwrap();
        for _ in 0..98 {
            cost.record(2, 1.2);
        }
        let hundred = cost.estimate(2).unwrap();
        assert!(two < hundred && hundred < 1.2, "{two} {hundred}");
    }

    #[test]
    fn the_best_size_trades_acceptance_against_time() {
        let p = [0.8, 0.5, 0.3, 0.1, 0.05];
        let cost = RoundCost::new();
        // Nothing measured: the whole tree.
        assert_eq!(cost.best_size(&p), 5);
        // Rows cost nothing extra (f32 on a CPU, few rows): the whole tree.
        let mut flat = RoundCost::new();
        for rows in 1..=6 {
            flat.record(rows, 0.020);
        }
        assert_eq!(flat.best_size(&p), 5);
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
