//! The sampler alone: one draw from a row of logits the size of SmolLM2's vocabulary
//! (temperature, top-k, top-p), the work every sampled token costs on top of the forward pass.
//!
//! ```text
//! cargo bench --bench sampling_cost -- [--vocab 49152] [--reps 300] [--json]
//! ```
//! The rows are peaked like a language model's (a few likely tokens over a long tail of logits
//! spread over ≈ 20 nats) and flat (every token alike: the largest nucleus). Time is the mean
//! of `--reps` draws per sampler, after one warm-up draw.

#[path = "common/output.rs"]
mod output;

use anyhow::Result;
use clap::Parser;
use eesd::core::{Sampler, SamplingParams};
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    /// Logits per row.
    #[arg(long, default_value_t = 49_152)]
    vocab: usize,
    /// Draws timed per sampler and row.
    #[arg(long, default_value_t = 300)]
    reps: usize,
    #[command(flatten)]
    output: output::Output,
}

/// Deterministic logits: `peaked` rows have a handful of tokens 8–12 nats above a tail spread
/// over [−10, 0]; flat rows are all within 0.01 of each other.
fn row(vocab: usize, peaked: bool) -> Vec<f32> {
    let mut state = 0x9e37_79b9u32;
    (0..vocab)
        .map(|i| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let u = (state >> 8) as f32 / (1u32 << 24) as f32;
            match (peaked, i % 9973) {
                (true, 0) => 8.0 + 4.0 * u,
                (true, _) => -10.0 * u,
                (false, _) => 0.01 * u,
            }
        })
        .collect()
}

fn main() -> Result<()> {
    let args = Args::parse();
    let samplers = [
        (
            "T 1",
            SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
            },
        ),
        (
            "T 0.7, top-p 0.95",
            SamplingParams {
                temperature: 0.7,
                top_k: 0,
                top_p: 0.95,
            },
        ),
        (
            "T 0.8, top-k 40",
            SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 1.0,
            },
        ),
    ];
    let mut results = Vec::new();
    for (shape, peaked) in [("peaked", true), ("flat", false)] {
        let logits = row(args.vocab, peaked);
        for (name, params) in &samplers {
            params.validate()?;
            let mut sampler = Sampler::new(1);
            let mut check = sampler.sample(&logits, params) as u64;
            let start = Instant::now();
            for _ in 0..args.reps {
                check += sampler.sample(&logits, params) as u64;
            }
            let ms = 1e3 * start.elapsed().as_secs_f64() / args.reps.max(1) as f64;
            if !args.output.json {
                println!("{shape:6} row, {name:18}: {ms:.3} ms per draw (checksum {check})");
            }
            results.push(serde_json::json!({
                "row": shape, "sampler": name, "params": params, "ms_per_draw": ms,
            }));
        }
    }
    if args.output.json {
        let report =
            serde_json::json!({ "vocab": args.vocab, "reps": args.reps, "results": results });
        println!("{report}");
    }
    Ok(())
}
