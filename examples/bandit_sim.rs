//! Compares draft-length policies on simulated acceptance processes.
//!
//! ```text
//! cargo run --release --example bandit_sim -- [--json] [--rounds 20000] [--draft-cost 0.15]
//! ```
//! For each process: every policy's score (tokens per unit cost), its ratio to the best fixed
//! draft length found by exhaustive search on the same rounds, and its mean draft length.

use clap::Parser;
use eesd::bandit::{
    BetaTs, CalibratedTs, ConfidenceThreshold, CostAwareTs, Costs, DraftPolicy, Process, StepRule,
    oracle_fixed, simulate,
};

#[derive(Parser, Debug)]
struct Args {
    /// Cost of a dropped (unverified) draft as a share of a draft step: only the head ran.
    #[arg(long, default_value_t = 0.27)]
    discard_share: f64,
    /// Rounds per simulation.
    #[arg(long, default_value_t = 20_000)]
    rounds: usize,
    /// Cost of one draft step relative to one verification step.
    #[arg(long, default_value_t = 0.15)]
    draft_cost: f64,
    /// Seed of the processes and policies.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn policies(seed: u64, ratio: f64) -> anyhow::Result<Vec<Box<dyn DraftPolicy>>> {
    Ok(vec![
        Box::new(ConfidenceThreshold::new(0.5, 8)?),
        Box::new(BetaTs::new(seed).with_cost_ratio(ratio)?),
        Box::new(
            BetaTs::new(seed)
                .with_cost_ratio(ratio)?
                .with_rule(StepRule::Bernoulli),
        ),
        Box::new(
            BetaTs::new(seed)
                .with_cost_ratio(ratio)?
                .with_discount(0.98)?,
        ),
        Box::new(CalibratedTs::new(seed).with_cost_ratio(ratio)?),
        Box::new(CostAwareTs::new(seed).with_cost_ratio(ratio)?),
    ])
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let costs = Costs {
        draft: args.draft_cost,
        verify: 1.0,
        discard: args.draft_cost * args.discard_share,
    };
    let processes = [
        Process::Stationary { theta: 0.15 },
        Process::Stationary { theta: 0.5 },
        Process::Stationary { theta: 0.75 },
        Process::Stationary { theta: 0.9 },
        Process::ConfidenceDependent {
            a: 0.6,
            b: 0.4,
            power: 1.0,
        },
        // A weak but calibrated head (like a small model's early exit): mostly unconfident
        // drafts, accepted about as often as their confidence says.
        Process::ConfidenceDependent {
            a: 0.3,
            b: 1.2,
            power: 1.0,
        },
        Process::Switching {
            thetas: vec![0.9, 0.3],
            segment: 300,
        },
    ];
    let mut rows = Vec::new();
    for process in &processes {
        let oracle = oracle_fixed(process, args.rounds, costs, args.seed, 8);
        if !args.json {
            println!(
                "\n{}  (best fixed: {}, score {:.3})",
                process.label(),
                oracle.policy,
                oracle.score
            );
            println!(
                "  {:<22} {:>7} {:>8} {:>10} {:>12}",
                "policy", "score", "ratio", "mean draft", "mean accepted"
            );
        }
        for mut p in policies(args.seed, args.draft_cost)? {
            let r = simulate(p.as_mut(), process, args.rounds, costs, args.seed);
            let ratio = r.score / oracle.score;
            if !args.json {
                println!(
                    "  {:<22} {:>7.3} {:>8.3} {:>10.2} {:>12.2}",
                    r.policy, r.score, ratio, r.mean_draft, r.mean_accepted
                );
            }
            rows.push(serde_json::json!({
                "process": process.label(), "policy": r.policy, "score": r.score,
                "ratio_to_best_fixed": ratio, "best_fixed": oracle.policy, "best_fixed_score": oracle.score,
                "mean_draft": r.mean_draft, "mean_accepted": r.mean_accepted,
            }));
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "rounds": args.rounds, "costs": costs, "results": rows })
        );
    }
    Ok(())
}
