//! The cost of one forward pass over a block of b new tokens, against this machine's roofline:
//! the asymmetry speculative decoding relies on (verifying b tokens ≈ decoding one).
//!
//! ```text
//! cargo run --release --example block_cost -- [--dtypes native,f32,f16,bf16] [--blocks 1,2,4,8,16,32,64] [--json]
//! ```
//! In the same run it measures the machine's read bandwidth, FMA peak and 8-bit integer
//! multiply-add peak (on the kernels' threads and instruction set; the best of a probe before and
//! one after the blocks) and reports, per weight dtype and block size: the time of a full forward
//! pass (best of `--reps`, taken round the block sizes, each after `--warm` untimed passes of
//! the same block, after a chat prompt), its ratio to one token, the roofline time
//! `max(bytes / bandwidth, flops / FMA peak + int8 ops / int8 peak)` (int8 ops: the natively
//! quantized matrices' products) and efficiency = roofline / measured.
//! The median pass of each block comes beside the best: on a shared host the gap between them
//! says how far the host moved during the run (efficiency is taken from the best).
//! With `--steps` (flex) it also splits the best pass of each block by step of the decoder
//! layers (norms, products, RoPE, attention, gating, residuals, summed over the layers) and
//! the rest outside them (embedding, final norm, LM head).

#[path = "common/cli.rs"]
mod cli;

use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use eesd::core::Backend;
use eesd::models::cpu::{Roofline, roofline, steps};
use eesd::models::{LoadOptions, LoadedModel, WeightDType, fetch};

#[derive(Parser, Debug)]
struct Args {
    /// Backend: flex, tch, tch-cuda, cuda or vulkan.
    #[arg(long, default_value = "flex")]
    device: Backend,
    /// Weight dtypes.
    #[arg(long, value_delimiter = ',', default_value = "native,f32,f16,bf16")]
    dtypes: Vec<WeightDType>,
    /// Block sizes (rows per forward pass).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    blocks: Vec<usize>,
    /// Cached positions before the block: the chat prompt, repeated up to this length (0: the
    /// prompt once).
    #[arg(long, default_value_t = 0)]
    context: usize,
    /// Repetitions per block size (the best is kept).
    #[arg(long, default_value_t = 10, value_parser = cli::at_least_one)]
    reps: usize,
    /// Untimed passes of the same block before each timed one, so that each block is timed as
    /// a decoding loop repeating it runs (a 2-core Intel Xeon VM streamed native weights 30%
    /// slower for a few passes after a 64-row pass: one row 4.8 ms, 3.8 ms after 4 like it).
    #[arg(long, default_value_t = 4)]
    warm: usize,
    /// Time each step of the decoder layers in the best pass of each block (flex).
    #[arg(long)]
    steps: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = args.device.device()?;
    // The CPU roofline applies to the CPU backends only.
    let cpu = matches!(args.device, Backend::Flex | Backend::Tch);
    let before = cpu.then(Roofline::measure);
    let path = fetch::resolve_model(None)?;
    // (dtype, block, past, best seconds, median seconds, cost, steps of the best pass) per
    // measurement.
    let mut timings = Vec::new();
    steps::record(args.steps);
    for &dtype in &args.dtypes {
        let options = LoadOptions {
            dtype,
            context_length: Some((args.context + 128).max(1024)),
        };
        let lm = LoadedModel::load(&path, &device, &options)?;
        let m = &lm.model;
        let prompt = lm.chat_prompt("Write a short poem about the sea.")?;
        let prompt: Vec<u32> = prompt
            .iter()
            .copied()
            .cycle()
            .take(args.context.max(prompt.len()))
            .collect();
        let mut cache = m.new_cache();
        m.forward(&prompt, &mut cache)?;
        let past = prompt.len();
        // Repetitions go round the block sizes, so that a spell of stolen time on a shared
        // host spoils one repetition of each size rather than every repetition of one.
        let mut best = vec![(f64::INFINITY, Vec::new()); args.blocks.len()];
        let mut all = vec![Vec::with_capacity(args.reps); args.blocks.len()];
        for _ in 0..args.reps {
            for ((&block, best), all) in args.blocks.iter().zip(best.iter_mut()).zip(&mut all) {
                let tokens: Vec<u32> = (0..block as u32).map(|i| 100 + i).collect();
                for _ in 0..args.warm {
                    cache.truncate(past);
                    let _ = m.forward(&tokens, &mut cache)?.into_data();
                }
                cache.truncate(past);
                let _ = steps::take();
                let start = Instant::now();
                let logits = m.forward(&tokens, &mut cache)?;
                let _ = logits.into_data();
                let seconds = start.elapsed().as_secs_f64();
                let steps = steps::take();
                all.push(seconds);
                if seconds < best.0 {
                    *best = (seconds, steps);
                }
            }
        }
        for ((&block, (best, steps)), all) in args.blocks.iter().zip(best).zip(all) {
            let cost = m.forward_cost(block, past);
            timings.push((dtype, block, past, best, median(all), cost, steps));
        }
    }
    // The machine's limits: the best of a measurement before and one after the blocks.
    let machine = before.map(|b| b.best_with(&Roofline::measure()));
    if let (Some(m), false) = (&machine, args.json) {
        println!("{m}");
    }
    let mut rows = Vec::new();
    let mut one = None;
    for (dtype, block, past, best, median, cost, steps) in timings {
        if block == args.blocks[0] {
            one = Some(best);
        }
        let base = one.unwrap_or(best);
        let mut row = serde_json::json!({
            "dtype": dtype.name(), "block": block, "past": past, "ms": best * 1e3,
            "ms_median": median * 1e3, "ratio": best / base,
            "weight_mb": cost.weight_bytes / 1e6, "cache_mb": cost.cache_bytes / 1e6,
            "gflop": cost.flops / 1e9,
            "int8_gop": cost.int8_ops / 1e9,
        });
        let mut line = format!(
            "{:>4} block {block:>2}: {:7.2} ms ({:.2}x one token, median {:.2} ms)",
            dtype.name(),
            best * 1e3,
            best / base,
            median * 1e3
        );
        if let Some(machine) = &machine {
            let limit = machine.seconds(cost.bytes(), cost.flops, cost.int8_ops);
            let bound = machine.bound(cost.bytes(), cost.flops, cost.int8_ops);
            row["roofline_ms"] = (limit * 1e3).into();
            row["efficiency"] = (limit / best).into();
            row["bound"] = bound.into();
            line += &format!(
                "  roofline {:6.2} ms ({bound}), efficiency {:.2}",
                limit * 1e3,
                limit / best
            );
        }
        if args.steps {
            let inside: f64 = steps.iter().map(|(_, s)| s).sum();
            let mut split = serde_json::Map::new();
            let mut text = String::from("      steps ms:");
            for (step, s) in &steps {
                split.insert(step.name().into(), (s * 1e3).into());
                text += &format!(" {} {:.2}", step.name(), s * 1e3);
            }
            split.insert("outside_layers".into(), ((best - inside) * 1e3).into());
            text += &format!(", outside the layers {:.2}", (best - inside) * 1e3);
            row["steps_ms"] = split.into();
            line += &format!("\n{text}");
        }
        if !args.json {
            println!("{line}");
        }
        rows.push(row);
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "device": args.device.name(), "cpu": roofline::cpu_name(),
                "machine": machine, "warm_passes": args.warm, "blocks": rows,
            })
        );
    }
    Ok(())
}

/// The middle value of `seconds` (the mean of the two middle ones for an even count).
fn median(mut seconds: Vec<f64>) -> f64 {
    seconds.sort_by(f64::total_cmp);
    let n = seconds.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => seconds[n / 2],
        _ => (seconds[n / 2 - 1] + seconds[n / 2]) / 2.0,
    }
}
