//! Greedy autoregressive decoding speed (tokens/s) per backend and weight dtype.
//!
//! ```text
//! cargo bench --bench ar_decode -- [--backends flex,tch] [--dtypes native,f32,f16,bf16] [--max-new-tokens 128] [--prefill-tokens 512] [--json]
//! ```
//! Prompts are the first questions of a few Spec-Bench categories, through the chat template.
//! Each configuration runs every prompt once after one warm-up generation. On the CPU backends
//! the machine's roofline is measured in the same run (read bandwidth, FMA peak; the best of a
//! probe before and one after the runs): each decoding step streams every weight once, so its
//! limit is `weight bytes / bandwidth` (plus the KV cache read), and efficiency = that limit /
//! the measured decoding time. Prefill speed is measured apart, as llama.cpp's `pp512`: a prompt
//! of `--prefill-tokens` ids (spread over the vocabulary, no template) through the whole model
//! and the last row's logits, the best of three.

#[path = "common/output.rs"]
mod output;

use std::ops::ControlFlow;

use anyhow::{Context, Result};
use clap::Parser;
use eesd::core::{Backend, GenerationConfig, Generator, LayeredModel};
use eesd::models::cpu::{Roofline, roofline};
use eesd::models::{LoadOptions, LoadedModel, WeightDType, fetch};

#[derive(Parser, Debug)]
struct Args {
    /// Backends to measure.
    #[arg(long, value_delimiter = ',', default_value = "flex")]
    backends: Vec<Backend>,
    /// Weight dtypes to measure (native, f32, f16, bf16).
    #[arg(long, value_delimiter = ',', default_value = "native,f32,f16,bf16")]
    dtypes: Vec<WeightDType>,
    /// New tokens per prompt.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Prompt length of the prefill measurement (0: none).
    #[arg(long, default_value_t = 512)]
    prefill_tokens: usize,
    #[command(flatten)]
    output: output::Output,
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
    let cpu = args
        .backends
        .iter()
        .any(|b| matches!(b, Backend::Flex | Backend::Tch));
    let before = cpu.then(Roofline::measure);
    let file_bytes = std::fs::metadata(&path)?.len();
    let mut results = Vec::new();
    for backend in &args.backends {
        let on_cpu = matches!(backend, Backend::Flex | Backend::Tch);
        for &dtype in &args.dtypes {
            let device = backend.device()?;
            let options = LoadOptions {
                dtype,
                context_length: Some(1024),
            };
            let rss_before = resident_bytes();
            let lm = LoadedModel::load(&path, &device, &options).context("load")?;
            // Memory the loaded model added to the process (load-time buffers already freed).
            let model_rss = resident_bytes().saturating_sub(rss_before);
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
            // The bytes, flops and int8 ops of the decoding steps (every token after the
            // prefill's first), for their roofline time.
            let mut steps = Vec::new();
            for p in PROMPTS {
                let ids = lm.chat_prompt(p)?;
                let out = generator.generate(&ids, &config, |_| ControlFlow::Continue(()))?;
                tokens += out.stats.new_tokens;
                seconds += out.stats.seconds;
                decode_seconds += out.stats.seconds - out.stats.prefill_seconds;
                for past in ids.len()..ids.len() + out.stats.new_tokens.saturating_sub(1) {
                    let cost = lm.model.forward_cost(1, past);
                    steps.push((cost.bytes(), cost.flops, cost.int8_ops));
                }
            }
            let decode_tps = (tokens - PROMPTS.len()) as f64 / decode_seconds;
            let prefill_tps =
                prefill_speed(&mut generator, lm.model.vocab_size(), args.prefill_tokens)?;
            let row = serde_json::json!({
                "backend": backend.name(), "dtype": dtype.name(), "new_tokens": tokens,
                "tokens_per_second": tokens as f64 / seconds,
                "decode_tokens_per_second": decode_tps,
                "prefill_tokens": args.prefill_tokens,
                "prefill_tokens_per_second": prefill_tps,
                "weight_bytes": lm.model.weight_bytes(), "file_bytes": file_bytes,
                "model_resident_bytes": model_rss,
            });
            results.push((row, steps, decode_seconds, tokens - PROMPTS.len(), on_cpu));
        }
    }
    // The machine's limits: the best of a measurement before and one after the runs.
    let machine = before.map(|b| b.best_with(&Roofline::measure()));
    if let (Some(m), false) = (&machine, args.output.json) {
        println!("{m}");
    }
    let mut rows = Vec::new();
    for (mut row, steps, decode_seconds, decoded, on_cpu) in results {
        let mut line = format!(
            "{:>8} {:>6}: {:6.1} tokens/s overall, {:6.1} tokens/s decoding ({} tokens), prefill {:6.1} tokens/s, weights {:.0} MB (file {:.0} MB, resident +{:.0} MB)",
            row["backend"].as_str().unwrap_or_default(),
            row["dtype"].as_str().unwrap_or_default(),
            row["tokens_per_second"].as_f64().unwrap_or_default(),
            row["decode_tokens_per_second"].as_f64().unwrap_or_default(),
            row["new_tokens"],
            row["prefill_tokens_per_second"]
                .as_f64()
                .unwrap_or_default(),
            row["weight_bytes"].as_f64().unwrap_or_default() / 1e6,
            row["file_bytes"].as_f64().unwrap_or_default() / 1e6,
            row["model_resident_bytes"].as_f64().unwrap_or_default() / 1e6,
        );
        if let Some(m) = machine.filter(|_| on_cpu) {
            let limit_seconds: f64 = steps.iter().map(|&(b, f, i)| m.seconds(b, f, i)).sum();
            let efficiency = limit_seconds / decode_seconds;
            let limit_tps = decoded as f64 / limit_seconds;
            row["roofline_tokens_per_second"] = limit_tps.into();
            row["efficiency"] = efficiency.into();
            line += &format!(", roofline {limit_tps:6.1} tokens/s, efficiency {efficiency:.2}");
        }
        if !args.output.json {
            println!("{line}");
        }
        rows.push(row);
    }
    if args.output.json {
        println!(
            "{}",
            serde_json::json!({
                "model": path.display().to_string(), "cpu": roofline::cpu_name(),
                "machine": machine, "results": rows,
            })
        );
    }
    Ok(())
}

/// Prompt tokens per second of prefilling `tokens` ids spread over the vocabulary (the best of
/// three; 0 when `tokens` is 0).
fn prefill_speed<M: LayeredModel>(
    generator: &mut Generator<'_, M>,
    vocab: usize,
    tokens: usize,
) -> Result<f64> {
    if tokens == 0 {
        return Ok(0.0);
    }
    let ids: Vec<u32> = (0..tokens)
        .map(|i| ((100 + i * 7919) % vocab.max(1)) as u32)
        .collect();
    let config = GenerationConfig {
        max_new_tokens: 1,
        ..Default::default()
    };
    let mut best = 0f64;
    for _ in 0..3 {
        let out = generator
            .generate(&ids, &config, |_| ControlFlow::Continue(()))
            .context("prefill")?;
        best = best.max(tokens as f64 / out.stats.prefill_seconds);
    }
    Ok(best)
}

/// Resident memory of this process (Linux `VmRSS`; 0 elsewhere).
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?.to_owned();
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib * 1024)
}
