//! Greedy autoregressive decoding speed (tokens/s) per backend and weight dtype.
//!
//! ```text
//! cargo bench --bench ar_decode -- [--backends flex,tch] [--dtypes f32,f16] [--max-new-tokens 128] [--json]
//! ```
//! Prompts are the first questions of a few Spec-Bench categories, through the chat template.
//! Each configuration runs every prompt once after one warm-up generation.

use std::ops::ControlFlow;

use anyhow::{Context, Result};
use clap::Parser;
use eesd::core::{Backend, GenerationConfig, Generator};
use eesd::models::{LoadOptions, LoadedModel, WeightDType, fetch};

#[derive(Parser, Debug)]
struct Args {
    /// Backends to measure.
    #[arg(long, value_delimiter = ',', default_value = "flex")]
    backends: Vec<Backend>,
    /// Weight dtypes to measure (f32, f16, bf16).
    #[arg(long, value_delimiter = ',', default_value = "f32,f16")]
    dtypes: Vec<String>,
    /// New tokens per prompt.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// cargo bench passes --bench; accept and ignore it.
    #[arg(long, hide = true)]
    bench: bool,
}

const PROMPTS: [&str; 4] = [
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences and must-see attractions.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "A farmer has 17 sheep and all but 9 run away. How many are left? Explain your reasoning.",
];

fn main() -> Result<()> {
    let args = Args::parse();
    let path = fetch::resolve_model(None)?;
    let mut results = Vec::new();
    for backend in &args.backends {
        for dtype in &args.dtypes {
            let wdt = match dtype.as_str() {
                "f32" => WeightDType::F32,
                "f16" => WeightDType::F16,
                "bf16" => WeightDType::Bf16,
                other => anyhow::bail!("unknown dtype {other}"),
            };
            let device = backend.device()?;
            let options = LoadOptions {
                dtype: wdt,
                context_length: Some(1024),
            };
            let lm = LoadedModel::load(&path, &device, &options).context("load")?;
            let config = GenerationConfig {
                max_new_tokens: args.max_new_tokens,
                ..Default::default()
            };
            let warm = lm.chat_prompt(PROMPTS[0])?;
            let mut generator = Generator::new(&lm.model);
            let warm_config = GenerationConfig {
                max_new_tokens: 8,
                ..config.clone()
            };
            generator.generate(&warm, &warm_config, |_| ControlFlow::Continue(()))?;
            let (mut tokens, mut seconds, mut decode_seconds) = (0usize, 0f64, 0f64);
            for p in PROMPTS {
                let ids = lm.chat_prompt(p)?;
                let out = generator.generate(&ids, &config, |_| ControlFlow::Continue(()))?;
                tokens += out.stats.new_tokens;
                seconds += out.stats.seconds;
                decode_seconds += out.stats.seconds - out.stats.prefill_seconds;
            }
            let row = serde_json::json!({
                "backend": backend.name(), "dtype": dtype, "new_tokens": tokens,
                "tokens_per_second": tokens as f64 / seconds,
                "decode_tokens_per_second": (tokens - PROMPTS.len()) as f64 / decode_seconds,
            });
            if !args.json {
                println!(
                    "{:>8} {:>5}: {:6.1} tokens/s overall, {:6.1} tokens/s decoding ({} tokens)",
                    backend.name(),
                    dtype,
                    row["tokens_per_second"].as_f64().unwrap_or(0.0),
                    row["decode_tokens_per_second"].as_f64().unwrap_or(0.0),
                    tokens
                );
            }
            results.push(row);
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "model": path.display().to_string(), "results": results })
        );
    }
    Ok(())
}
