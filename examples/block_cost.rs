//! Measures the cost of one forward pass of the model over blocks of 1..=16 new tokens, after a
//! prompt: the asymmetry speculative decoding relies on (verifying k tokens ≈ decoding one).
//!
//! ```text
//! cargo run --release --example block_cost -- [--device flex] [--dtype f32] [--json]
//! ```

use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use eesd::core::Backend;
use eesd::models::{LoadOptions, LoadedModel, WeightDType, fetch};

#[derive(Parser, Debug)]
struct Args {
    /// Backend.
    #[arg(long, default_value = "flex")]
    device: Backend,
    /// Weight dtype: f32 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Repetitions per block size.
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dtype = if args.dtype == "f16" {
        WeightDType::F16
    } else {
        WeightDType::F32
    };
    let lm = LoadedModel::load(
        fetch::resolve_model(None)?,
        &args.device.device()?,
        &LoadOptions {
            dtype,
            context_length: Some(1024),
        },
    )?;
    let m = &lm.model;
    let prompt = lm.chat_prompt("Write a short poem about the sea.")?;
    let mut rows = Vec::new();
    let mut base = None;
    for block in [1usize, 2, 3, 4, 6, 8, 12, 16] {
        let mut cache = m.new_cache();
        m.forward(&prompt, &mut cache)?;
        let p = prompt.len();
        let tokens: Vec<u32> = (0..block as u32).map(|i| 100 + i).collect();
        let mut best = f64::INFINITY;
        for _ in 0..args.reps {
            cache.truncate(p);
            let t = Instant::now();
            let logits = m.forward(&tokens, &mut cache)?;
            let _ = logits.into_data();
            best = best.min(t.elapsed().as_secs_f64());
        }
        let b = *base.get_or_insert(best);
        if !args.json {
            println!(
                "block {block:>2}: {:7.2} ms ({:.2}x one token)",
                best * 1e3,
                best / b
            );
        }
        rows.push(serde_json::json!({ "block": block, "ms": best * 1e3, "ratio": best / b }));
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "device": args.device.name(), "dtype": args.dtype, "blocks": rows })
        );
    }
    Ok(())
}
