//! Trains an EESD exit head for a model by self-distillation, from the model's own answers to
//! `train_prompts.jsonl` (never the benchmark questions).
//!
//! ```text
//! cargo run --release --features train --example train_exit_head -- --exit-layer 6 --vocab 8192 \
//!     --prompts ../shared/data/train_prompts.jsonl --num-prompts 300 --steps 600 --out heads/smollm2-l6
//! ```
//! Stages, each resumable: (1) the frozen model answers the prompts through its chat template
//! (greedy, plus `--sampled K` answers per prompt drawn at `--temperature`; `--batch` prompts
//! decoded together; saved as `{"prompt": i, "sample": s, "tokens": [...], "prompt_len": n}`
//! lines in `OUT.data.jsonl`, sample 0 the greedy answer, appended as answers finish); (2) the draft
//! vocabulary = the most frequent tokens of those answers; (3) training with held-out evaluation,
//! whole sequences packed into blocks of `--tokens-per-step` tokens, the state (weights, AdamW
//! moments, step) saved every `--save-every` steps — rerun with the same arguments and
//! `--resume` to continue an interrupted run exactly; (4) `OUT.safetensors` (f16) + `OUT.json`
//! (metadata: base model SHA-256, layer, vocabulary, config, metrics).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;
use eesd::core::{Backend, DraftHead, SamplingParams};
use eesd::models::{
    HeadKind, LayerHead, Llama, LoadOptions, LoadedModel, VocabSubset, fetch, load_layer_head,
};
use eesd::train::checkpoint::FORMAT_VERSION;
use eesd::train::{
    AnswerConfig, AnswerPrompt, CacheOutcome, DistillConfig, Distiller, EvalMetrics, EvalSet,
    HeadMetadata, LineIndex, Sequence, Teacher, TeacherCache, TrainError, file_sha256,
    generate_answers, pack, save_layer_head, state_path,
};
use indicatif::{ProgressBar, ProgressStyle};

#[path = "common/prompts.rs"]
mod prompts;

#[derive(Parser, Debug)]
struct Args {
    /// Model file or directory (default: the cached SmolLM2, fetched if absent).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Backend: flex, tch, tch-cuda, cuda or vulkan.
    #[arg(long, default_value = "flex")]
    device: Backend,
    /// Exit layer N; several (`3,6,9,12`) train one head per layer from one shared teacher
    /// pass per step, each written to `OUT-lN` (one layer: `OUT`).
    #[arg(long, value_delimiter = ',', default_value = "6")]
    exit_layer: Vec<usize>,
    /// Head kind: `layer` (EESD, a whole decoder layer), `adapter` (Kangaroo, attention only)
    /// or `lookahead` (EAGLE-style input: a position's layer-N state and the next token's
    /// embedding; drafts the first level of trees, `spec_bench --methods opt@8+OUT`; its
    /// layer N may be the last one).
    #[arg(long, default_value = "layer")]
    head: HeadKind,
    /// Earlier layers a lookahead head reads beside its layer N (`10,20`: EAGLE-3's mix of
    /// low, middle and high features, all from the verification pass). Their columns of the
    /// head's input fusion start at zero, so a head from `--init-head` drafts as before at
    /// step 0 and learns to use them.
    #[arg(long, value_delimiter = ',')]
    mix_layers: Vec<usize>,
    /// Model layer whose weights initialise each head's layer (default: its N, or the last
    /// layer for a lookahead head reading layer L).
    #[arg(long)]
    init_layer: Option<usize>,
    /// Decoder layers in the head's block (`layer` and `lookahead` heads). The layers after
    /// the first start as copies of it whose output projections are zero, so they add nothing
    /// until trained: a head from `--init-head` with fewer layers is deepened that way and
    /// drafts exactly as before at step 0. Default: the initial head's depth (1 for new heads).
    #[arg(long)]
    head_layers: Option<usize>,
    /// Start from a trained head (checkpoint prefix, e.g. `assets/heads/smollm2-135m-instruct`)
    /// instead of a copy of a model layer: its weights and draft vocabulary, fresh optimizer
    /// moments and learning-rate schedule (fine-tuning, or more training for a head whose run
    /// state is gone). It must be a `--head` head at the one `--exit-layer`, made for this model
    /// file.
    #[arg(long)]
    init_head: Option<PathBuf>,
    /// Draft vocabulary size (0 = full vocabulary; ignored with `--init-head`, whose vocabulary
    /// is kept).
    #[arg(long, default_value_t = 8192)]
    vocab: usize,
    /// Training prompts (jsonl with a `prompt` field).
    #[arg(long, default_value = "../shared/data/train_prompts.jsonl")]
    prompts: PathBuf,
    /// How many prompts to answer.
    #[arg(long, default_value_t = 300)]
    num_prompts: usize,
    /// Answer length cap.
    #[arg(long, default_value_t = 128)]
    answer_tokens: usize,
    /// Prompts answered together while generating data (decoding streams the weights once for
    /// all of them).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Sampled answers per prompt besides the greedy one (more varied data from the same
    /// prompts; the held-out prompts' samples are never trained on).
    #[arg(long, default_value_t = 0)]
    sampled: usize,
    /// Temperature of the sampled answers.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Top-p of the sampled answers.
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Seed of the sampled answers (each prompt and sample draws from its own stream, so a
    /// resumed run samples what a full run would have).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Optimisation steps.
    #[arg(long, default_value_t = 600)]
    steps: usize,
    /// Whole sequences are packed into one block per step up to this many tokens (a longer
    /// sequence gets a step of its own; 0 = one sequence per step, the default). On a CPU a
    /// packed step costs what its sequences cost one by one and takes fewer optimiser steps,
    /// so it learns less per token (measured: 21.7% vs 27.0% held-out agreement after the
    /// same 230 s); pack (e.g. 8192) where the device runs large blocks for little more.
    #[arg(long, default_value_t = 0)]
    tokens_per_step: usize,
    /// Continue the run saved in `OUT.state.json` (same data, configuration and batches)
    /// instead of starting over (with no state saved yet, training starts from step 0; the
    /// answers already in the data file are always kept). A different `--steps` re-plans the
    /// run's end: the learning rate decays from the current step toward the new one.
    #[arg(long)]
    resume: bool,
    /// Save the training state (`OUT.state.json` + weights + optimizer moments) every this many
    /// steps (0 = only at the end).
    #[arg(long, default_value_t = 100)]
    save_every: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 5e-4)]
    lr: f64,
    /// Weight of the extra cross-entropy term on the full model's greedy token (0 = KL only).
    #[arg(long, default_value_t = 0.0)]
    ce_weight: f32,
    /// Train on the positions that predict answer tokens only (what drafting meets), not on
    /// the prompts' positions (by default both).
    #[arg(long)]
    answers_only: bool,
    /// Tree levels a lookahead head learns to draft: level 2 and deeper read the head's own
    /// state of the level before, as `opt@B+HEAD:LEVELS` drafting does (1 = the model's states
    /// only).
    #[arg(long, default_value_t = 1)]
    levels: usize,
    /// Weight in the loss of each level below the first (`--levels`).
    #[arg(long, default_value_t = 0.5)]
    deep_weight: f32,
    /// Prompts held out for evaluation (the first ones): their greedy answers are evaluated,
    /// none of their answers is trained on.
    #[arg(long, default_value_t = 40)]
    held_out: usize,
    /// Evaluate the held-out answers every this many steps (0 = only before and after).
    #[arg(long, default_value_t = 100)]
    eval_every: usize,
    /// Training data file (default `OUT.data.jsonl`); several runs (e.g. an exit-layer sweep)
    /// can share one.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Keep the frozen model's states per training block in this directory, so that passes
    /// after the first over the data skip its forward pass (most of a step on a CPU; the head
    /// trained is the same, bit for bit). Costs 4 × hidden × (exit layers below the last + 1)
    /// bytes per position: ≈ 4 GB for one head over SmolLM2's 1.7M tokens of answers.
    #[arg(long)]
    teacher_cache: Option<PathBuf>,
    /// Wall-clock seconds the training may take (held-out evaluations during it included;
    /// loading, answer generation and the final evaluation not), for a machine lent for a fixed
    /// time: as the step time becomes known the run is re-planned to end within it (the
    /// learning rate decaying toward the new end, as with a changed `--steps` on `--resume`),
    /// never beyond `--steps` (the warm-up shrinks with it, to at most a twentieth).
    #[arg(long)]
    time_budget: Option<f64>,
    /// Context the model is loaded with (bounds the caches; at most the model's own).
    #[arg(long, default_value_t = 2048)]
    context_length: usize,
    /// Output prefix.
    #[arg(long, default_value = "heads/smollm2-head")]
    out: PathBuf,
    /// Only write the chat prompts' token ids (`{"prompt": i, "tokens": [...]}` per line, cut
    /// as for answering) to this file and exit: for answering them elsewhere, e.g. with
    /// `scripts/torch_answers.py` on a CUDA GPU, and training on the answers with `--data`.
    #[arg(long)]
    export_prompts: Option<PathBuf>,
}

/// Longest prompt answered, in tokens (longer chat prompts are cut to their start).
const MAX_PROMPT_TOKENS: usize = 1024;

/// The token ids a prompt is answered from: its chat template, cut to `MAX_PROMPT_TOKENS`.
fn chat_tokens(lm: &LoadedModel, prompt: &str) -> Result<Vec<u32>> {
    let mut ids = lm.chat_prompt(prompt)?;
    ids.truncate(MAX_PROMPT_TOKENS);
    Ok(ids)
}

/// Writes the chat prompts' token ids, one json line per prompt (`--export-prompts`).
fn export_prompts(lm: &LoadedModel, prompts: &[String], path: &Path) -> Result<()> {
    let mut lines = String::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let tokens = chat_tokens(lm, prompt)?;
        lines += &serde_json::to_string(&serde_json::json!({ "prompt": i, "tokens": tokens }))?;
        lines.push('\n');
    }
    std::fs::write(path, lines).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {} chat prompts to {}", prompts.len(), path.display());
    Ok(())
}

/// The model layer a head for exit layer `n` starts from.
fn init_layer(args: &Args, m: &Llama, n: usize) -> usize {
    args.init_layer.unwrap_or(n.min(m.num_layers() - 1))
}

/// One line of `OUT.data.jsonl`: a prompt's index in the prompt file, which answer (0 the
/// greedy one, 1.. sampled; files written before sampling have none: greedy) and the sequence.
#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    prompt: usize,
    #[serde(default)]
    sample: usize,
    #[serde(flatten)]
    sequence: Sequence,
}

/// What training keeps in memory of a line of the data file.
struct Key {
    prompt: usize,
    sample: usize,
    /// Tokens of the sequence.
    len: usize,
    /// Within `--num-prompts` and `--sampled` (lines beyond them are kept in the file, unused).
    used: bool,
}

/// The seed of sampled answer `sample` to prompt `prompt`: a stream of its own.
fn answer_seed(seed: u64, prompt: usize, sample: usize) -> u64 {
    let key = ((prompt as u64) << 16) ^ sample as u64;
    seed ^ key.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(b) = args.time_budget.filter(|b| !(b.is_finite() && *b >= 0.0)) {
        bail!("--time-budget {b}: give a number of seconds, 0 or more");
    }
    let started = Instant::now();
    let path = fetch::resolve_model(args.model.as_deref())?;
    let device = args.device.device()?;
    let options = LoadOptions {
        context_length: Some(args.context_length),
        ..Default::default()
    };
    let lm = LoadedModel::load(&path, &device, &options)?;
    let m = &lm.model;
    if let Some(path) = &args.export_prompts {
        let prompts = prompts::load(&args.prompts, args.num_prompts)?;
        return export_prompts(&lm, &prompts, path);
    }

    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }

    // (1) The model's own answers, resumable.
    let data_path = args
        .data
        .clone()
        .unwrap_or_else(|| args.out.with_extension("data.jsonl"));
    // Lines are written as answers finish (batched generation finishes out of order), each
    // tagged with its prompt, so a resumed run answers exactly the missing prompts.
    // A run killed mid-line leaves a torn last line: it is cut off and that prompt answered again.
    let done: std::collections::HashSet<(usize, usize)> =
        LineIndex::recover(&data_path, |r: &Record| (r.prompt, r.sample))?
            .keys()
            .copied()
            .collect();
    let prompts = prompts::load(&args.prompts, args.num_prompts)?;
    let wanted = prompts.len();
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: 0,
        top_p: args.top_p,
    };
    if args.sampled > 0 {
        sampling.validate()?;
    }
    if args.sampled > MAX_SAMPLED {
        bail!(
            "--sampled {} is more than {MAX_SAMPLED} answers per prompt",
            args.sampled
        );
    }
    // Greedy answers first, then each round of samples.
    let missing: Vec<(usize, usize)> = (0..=args.sampled)
        .flat_map(|s| (0..wanted).map(move |i| (i, s)))
        .filter(|key| !done.contains(key))
        .collect();
    let (mut answer_tokens, generation_started) = (0usize, Instant::now());
    if !missing.is_empty() {
        let bar = ProgressBar::new((wanted * (args.sampled + 1)) as u64);
        bar.set_style(ProgressStyle::with_template(
            "answering {bar:40} {pos}/{len} [{elapsed_precise} < {eta_precise}]",
        )?);
        bar.set_position((wanted * (args.sampled + 1) - missing.len()) as u64);
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&data_path)?;
        for greedy in [true, false] {
            let todo: Vec<(usize, usize)> = missing
                .iter()
                .copied()
                .filter(|&(_, s)| (s == 0) == greedy)
                .collect();
            if todo.is_empty() {
                continue;
            }
            let config = AnswerConfig {
                max_new_tokens: args.answer_tokens,
                stop_tokens: lm.tokenizer.eos_token_id().into_iter().collect(),
                batch: args.batch,
                sampling: if greedy {
                    SamplingParams::greedy()
                } else {
                    sampling
                },
            };
            let inputs = todo
                .iter()
                .map(|&(i, s)| {
                    Ok(AnswerPrompt {
                        tokens: chat_tokens(&lm, &prompts[i])?,
                        seed: answer_seed(args.seed, i, s),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            generate_answers(m, inputs, &config, |n, sequence| {
                let (prompt, sample) = todo[n];
                answer_tokens += sequence.tokens.len() - sequence.prompt_len;
                let record = Record {
                    prompt,
                    sample,
                    sequence,
                };
                // One write per line, so a kill tears at most the last line.
                let line = serde_json::to_string(&record).map_err(std::io::Error::other);
                line.and_then(|line| file.write_all(format!("{line}\n").as_bytes()))
                    .map_err(|source| TrainError::Io {
                        path: data_path.clone(),
                        source,
                    })?;
                bar.inc(1);
                Ok(())
            })?;
        }
        bar.finish();
    }
    let generation_seconds = generation_started.elapsed().as_secs_f64();
    if answer_tokens > 0 {
        eprintln!(
            "generated {answer_tokens} answer tokens in {generation_seconds:.0} s ({:.0} tokens/s)",
            answer_tokens as f64 / generation_seconds
        );
    }

    // (2) The data, read once, streaming: each line's key and length stay in memory (training
    // reads a step's sequences back from the file), and the tokens are counted for the draft
    // vocabulary: the most frequent tokens of the data, EOS always included.
    let vocab = m.config().vocab_size;
    let mut counts = vec![0u64; vocab];
    let mut out_of_range = None;
    let index = LineIndex::recover(&data_path, |r: &Record| {
        let used = r.prompt < wanted && r.sample <= args.sampled;
        for &t in r.sequence.tokens.iter().filter(|_| used) {
            match counts.get_mut(t as usize) {
                Some(c) => *c += 1,
                None => out_of_range = Some(t),
            }
        }
        Key {
            prompt: r.prompt,
            sample: r.sample,
            len: r.sequence.tokens.len(),
            used,
        }
    })?;
    if let Some(t) = out_of_range {
        bail!(
            "{} holds token {t}, outside the model's vocabulary of {vocab}",
            data_path.display()
        );
    }
    // Lines by (prompt, sample), the first of any repeated answer.
    let mut lines: Vec<usize> = (0..index.len())
        .filter(|&i| index.key(i).is_some_and(|k| k.used))
        .collect();
    let key_of = |i: usize| index.key(i).map(|k| (k.prompt, k.sample));
    lines.sort_by_key(|&i| (key_of(i), i));
    lines.dedup_by_key(|i| key_of(*i));
    let eos: Vec<u32> = lm.tokenizer.eos_token_id().into_iter().collect();
    let subset = (args.vocab > 0)
        .then(|| VocabSubset::most_frequent(&counts, args.vocab, &eos))
        .transpose()?;
    if let Some(s) = &subset {
        let covered: u64 = s.ids().iter().map(|&i| counts[i as usize]).sum();
        eprintln!(
            "draft vocabulary: {} tokens cover {:.1}% of the data",
            s.len(),
            100.0 * covered as f64 / counts.iter().sum::<u64>() as f64
        );
    }

    // (3) Train, holding the first `--held-out` prompts out: their greedy answers are the
    // evaluation set, and none of their answers (sampled ones included) is trained on.
    let held = args.held_out.clamp(1, wanted.saturating_sub(1).max(1));
    let (held_lines, train): (Vec<usize>, Vec<usize>) = lines
        .into_iter()
        .partition(|&i| index.key(i).is_some_and(|k| k.prompt < held));
    let held_out = held_lines
        .into_iter()
        .filter(|&i| index.key(i).is_some_and(|k| k.sample == 0))
        .map(|i| Ok(index.read::<Record>(i)?.sequence))
        .collect::<Result<Vec<Sequence>>>()?;
    if held_out.is_empty() || train.is_empty() {
        bail!(
            "{} held-out and {} training sequences: answer more prompts",
            held_out.len(),
            train.len()
        );
    }
    let held_out = held_out.as_slice();
    let config = DistillConfig {
        learning_rate: args.lr,
        ce_weight: args.ce_weight,
        answers_only: args.answers_only,
        levels: args.levels,
        deep_weight: args.deep_weight,
        warmup_steps: args.steps / 20,
        total_steps: args.steps,
        ..Default::default()
    };
    let lengths: Vec<usize> = train
        .iter()
        .map(|&i| index.key(i).map_or(0, |k| k.len))
        .collect();
    let batches = pack(&lengths, args.tokens_per_step);
    // Training tokens seen after `step` steps (batches repeat in order, so this is exact for a
    // resumed run too): the x axis of `eval_exit_head --svg`.
    let batch_tokens: Vec<usize> = batches
        .iter()
        .map(|b| b.iter().map(|&i| lengths[i]).sum())
        .collect();
    let tokens_seen = |step: usize| -> usize {
        let (full, rest) = (step / batch_tokens.len(), step % batch_tokens.len());
        full * batch_tokens.iter().sum::<usize>() + batch_tokens[..rest].iter().sum::<usize>()
    };
    eprintln!(
        "{} training sequences in {} packed batches of at most {} tokens",
        train.len(),
        batches.len(),
        args.tokens_per_step
    );
    let sha = file_sha256(&path)?;
    let mut layers = args.exit_layer.clone();
    layers.sort_unstable();
    layers.dedup();
    if layers.is_empty() {
        bail!("--exit-layer names no layer");
    }
    // Layers whose states the frozen model's passes keep: the heads' and those they mix in.
    let with_mix = |heads: &[usize]| {
        let mut kept: Vec<usize> = heads.iter().chain(&args.mix_layers).copied().collect();
        kept.sort_unstable();
        kept.dedup();
        kept
    };
    // The frozen model's passes over the held-out answers, made once for every evaluation.
    let eval_set = EvalSet::new(m, held_out, &with_mix(&layers))?;
    let mut runs = layers
        .iter()
        .map(|&n| {
            let out = if layers.len() == 1 {
                args.out.clone()
            } else {
                let stem = args.out.file_name().unwrap_or_default().to_string_lossy();
                args.out.with_file_name(format!("{stem}-l{n}"))
            };
            let mut run =
                HeadRun::start(&args, m, n, out, &sha, subset.as_ref(), &config, &eval_set)?;
            run.generation_seconds += generation_seconds;
            Ok(run)
        })
        .collect::<Result<Vec<_>>>()?;
    let total = runs.iter().map(|r| r.total()).max().unwrap_or(0);
    let cache = args
        .teacher_cache
        .as_ref()
        .map(|dir| {
            // The key/value store's element type is part of the teacher's numerics (f16 beside
            // non-f32 weights since 2026-11-26): caches made before that are recomputed.
            let kv = m.kv_dtype().name();
            let identity = format!("{sha} {:?} {:?} kv {kv}", args.device, options.dtype);
            TeacherCache::open(dir, identity)
        })
        .transpose()?;
    let mut cache_reads = 0;
    let bar = ProgressBar::new(total as u64);
    bar.set_style(ProgressStyle::with_template(
        "training {bar:40} {pos}/{len} loss {msg} [{elapsed_precise} < {eta_precise}]",
    )?);
    let (train_started, first_step) = (
        Instant::now(),
        runs.iter().map(|r| r.distiller.step()).min().unwrap_or(0),
    );
    // Heads saved at different steps (a run killed between their saves) catch up one by one;
    // heads at the same step share the frozen model's pass over the step's batch.
    while let Some(step) = runs
        .iter()
        .filter(|r| r.distiller.step() < r.total())
        .map(|r| r.distiller.step())
        .min()
    {
        bar.set_position(step as u64);
        let sequences = batches[step % batches.len()]
            .iter()
            .map(|&i| Ok(index.read::<Record>(train[i])?.sequence))
            .collect::<Result<Vec<Sequence>>>()?;
        let batch: Vec<&[u32]> = sequences.iter().map(|s| s.tokens.as_slice()).collect();
        let due: Vec<usize> = runs
            .iter()
            .filter(|r| r.distiller.step() == step && step < r.total())
            .map(|r| r.exit_layer)
            .collect();
        // With a cache, every layer of the run is kept, so that the file serves any heads due.
        let teacher = match &cache {
            Some(cache) => {
                let key = format!("block-{:06}", step % batches.len());
                let (teacher, outcome) = cache.teacher(m, &key, &batch, &with_mix(&layers))?;
                cache_reads += usize::from(outcome == CacheOutcome::Hit);
                teacher
            }
            None => Teacher::new(m, &batch, &with_mix(&due))?,
        }
        .with_prompt_lengths(sequences.iter().map(|s| s.prompt_len).collect())?;
        for run in runs.iter_mut().filter(|r| due.contains(&r.exit_layer)) {
            let loss = run.distiller.train_step_on(&teacher)?;
            let smooth = run.running.map_or(loss, |r| 0.95 * r + 0.05 * loss);
            run.running = Some(smooth);
            // The last step is evaluated and saved once, below.
            let done = step + 1;
            if args.eval_every > 0 && done % args.eval_every == 0 && done < run.total() {
                let metrics = run.distiller.evaluate_set(&eval_set, EVAL_K)?;
                bar.suspend(|| eprintln!("layer {} step {done}: {metrics:?}", run.exit_layer));
                run.record(done, tokens_seen(done), &metrics);
            }
            if args.save_every > 0 && done % args.save_every == 0 && done < run.total() {
                run.save(started)?;
            }
        }
        if let Some(budget) = args.time_budget {
            let taken = step + 1 - first_step;
            let elapsed = train_started.elapsed().as_secs_f64();
            for run in runs.iter_mut() {
                if let Some((end, warmup)) =
                    budget_plan(budget, elapsed, taken, &run.distiller, args.steps)
                {
                    run.distiller.set_schedule(end, warmup)?;
                }
            }
            bar.set_length(runs.iter().map(|r| r.total()).max().unwrap_or(0) as u64);
        }
        let losses: Vec<String> = runs
            .iter()
            .filter_map(|r| Some(format!("l{} {:.3}", r.exit_layer, r.running?)))
            .collect();
        bar.set_message(losses.join(" "));
    }
    bar.finish();
    let total = runs.iter().map(|r| r.total()).max().unwrap_or(0);
    // Tokens through the shared teacher pass and every head, per second of this run's training
    // (held-out evaluations included).
    let trained = tokens_seen(total) - tokens_seen(first_step.min(total));
    let train_tokens_per_second = trained as f64 / train_started.elapsed().as_secs_f64().max(1e-9);
    if trained > 0 {
        eprintln!("trained on {trained} tokens at {train_tokens_per_second:.0} tokens/s");
    }
    if let Some(dir) = &args.teacher_cache {
        let steps = total - first_step.min(total);
        eprintln!(
            "teacher cache {}: {cache_reads} of {steps} steps read their block from it",
            dir.display()
        );
    }

    // (4) Checkpoints.
    for mut run in runs {
        let after = run.distiller.evaluate_set(&eval_set, EVAL_K)?;
        let total = run.total();
        // A resumed run that had already finished has its final entry.
        if run
            .history
            .last()
            .map(|h| h["step"] != total)
            .unwrap_or(true)
        {
            eprintln!("layer {} step {total}: {after:?}", run.exit_layer);
            run.record(total, tokens_seen(total), &after);
        }
        run.save(started)?;
        let config = run.distiller.config().clone();
        let init = init_layer(&args, m, run.exit_layer);
        let (out, before, history) = (run.out, run.before, run.history);
        let seconds = run.seconds_before + started.elapsed().as_secs_f64();
        let head = run.distiller.into_head()?;
        let meta = HeadMetadata {
            format_version: FORMAT_VERSION,
            head_kind: head.kind().name().into(),
            base_model_sha256: sha.clone(),
            base_model_name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            exit_layer: DraftHead::exit_layer(&head).unwrap_or(run.exit_layer),
            hidden_size: m.config().hidden_size,
            vocab_subset: head.token_ids().map(<[u32]>::to_vec),
            training: serde_json::json!({
                "distill": config, "init_layer": args.init_head.is_none().then_some(init), "init_head": args.init_head.as_ref().map(|p| p.display().to_string()), "prompts": args.num_prompts, "sequences": held_out.len() + train.len(), "sampled_per_prompt": args.sampled, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
                "held_out": held, "answer_tokens": args.answer_tokens, "tokens_per_step": args.tokens_per_step, "loss": format!("KL(teacher || student) over the draft vocabulary + {} x CE(greedy token), on {}{}", args.ce_weight, if config.answers_only { "answer positions" } else { "all positions" }, if config.levels > 1 { format!("; levels 2..={} on the head's own states, weight {} each", config.levels, config.deep_weight) } else { String::new() }),
                "exit_layers_trained_together": layers, "head_layers": head.weights().depth(), "mix_layers": head.weights().mix_layers, "generation_seconds": run.generation_seconds, "train_tokens_per_second": train_tokens_per_second, "total_seconds": seconds,
            }),
            metrics: serde_json::json!({ "before": before, "after": after, "history": history }),
        };
        save_layer_head(&out, &head, &meta, true)?;
        println!(
            "{}",
            serde_json::json!({ "out": out.display().to_string(), "exit_layer": meta.exit_layer, "before": before, "after": after, "seconds": started.elapsed().as_secs_f64(), "train_tokens_per_second": train_tokens_per_second })
        );
    }
    Ok(())
}

/// The head saved under `prefix`, checked against the run's model file, head kind and exit
/// layer (`--init-head`).
fn trained_head(
    args: &Args,
    m: &Llama,
    model_sha: &str,
    exit_layer: usize,
    prefix: &Path,
) -> Result<LayerHead> {
    let (head, meta) = load_layer_head(prefix, m, Some(model_sha))?;
    if head.kind() != args.head || meta.exit_layer != exit_layer {
        bail!(
            "{} is a `{}` head at layer {}; this run trains a `{}` head at layer {exit_layer}",
            prefix.display(),
            meta.head_kind,
            meta.exit_layer,
            args.head.name()
        );
    }
    eprintln!(
        "layer {exit_layer}: starting from {} ({} draft tokens)",
        prefix.display(),
        head.token_ids().map_or(m.config().vocab_size, <[u32]>::len)
    );
    Ok(head)
}

/// Where a run under `--time-budget` should end, and its warm-up, when that changes: after
/// `taken` steps in `elapsed` seconds, the step that the mean step time so far reaches within
/// `budget`, capped by `max_steps` (re-planned after 8 steps, then every 25, and at once when
/// the budget is spent); the warm-up shrinks to at most a twentieth of the new length, as for a
/// run planned that long. `None` keeps the current plan.
fn budget_plan(
    budget: f64,
    elapsed: f64,
    taken: usize,
    distiller: &Distiller<'_>,
    max_steps: usize,
) -> Option<(usize, usize)> {
    let (step, total) = (distiller.step(), distiller.config().total_steps);
    let warmup = distiller.config().warmup_steps;
    let spent = elapsed >= budget;
    if step >= total || taken < 8 || (!taken.is_multiple_of(25) && taken != 8 && !spent) {
        return None;
    }
    let per_step = elapsed / taken as f64;
    let more = ((budget - elapsed) / per_step).floor().max(0.0) as usize;
    // One more step when the budget is spent (the last step is evaluated and saved).
    let end = (step + more.max(1)).min(max_steps).max(step + 1);
    let shorter = warmup.min(end / 20);
    (end != total || shorter != warmup).then_some((end, shorter))
}

/// Most sampled answers per prompt (`--sampled`).
const MAX_SAMPLED: usize = 1000;

/// Draft length of the held-out evaluation's expected tokens per round.
const EVAL_K: usize = 4;

/// One head being trained: its distiller, output prefix and evaluation history.
struct HeadRun<'m> {
    exit_layer: usize,
    out: PathBuf,
    distiller: Distiller<'m>,
    before: EvalMetrics,
    history: Vec<serde_json::Value>,
    /// Training time of earlier (interrupted) runs.
    seconds_before: f64,
    /// Answer generation time, that of the runs it resumes and (once added) this run's.
    generation_seconds: f64,
    /// Smoothed training loss.
    running: Option<f64>,
}

impl<'m> HeadRun<'m> {
    /// A fresh head, or with `--resume` the state saved under `out` (configuration,
    /// evaluation history and time so far); `--resume` with no state yet starts over.
    #[allow(clippy::too_many_arguments)]
    fn start(
        args: &Args,
        m: &'m Llama,
        exit_layer: usize,
        out: PathBuf,
        model_sha: &str,
        subset: Option<&VocabSubset>,
        config: &DistillConfig,
        eval_set: &EvalSet,
    ) -> Result<Self> {
        let saved = args.resume && state_path(&out).exists();
        if args.resume && !saved {
            eprintln!(
                "no saved state at {}: starting the training from step 0",
                state_path(&out).display()
            );
        }
        let (distiller, before, history, seconds_before, generated_before) = if saved {
            let (mut d, extra) = Distiller::resume(m, &out)?;
            eprintln!(
                "layer {exit_layer}: resuming at step {} of {}",
                d.step(),
                d.config().total_steps
            );
            if args.steps != d.config().total_steps {
                d.set_total_steps(args.steps)?;
                eprintln!(
                    "layer {exit_layer}: the run now ends at step {} (--steps), the learning \
                     rate decaying toward it from here",
                    args.steps
                );
            }
            let before: EvalMetrics = serde_json::from_value(extra["before"].clone())?;
            let history: Vec<serde_json::Value> = serde_json::from_value(extra["history"].clone())?;
            let seconds = extra["seconds"].as_f64().unwrap_or(0.0);
            let generated = extra["generation_seconds"].as_f64().unwrap_or(0.0);
            (d, before, history, seconds, generated)
        } else {
            let head = match &args.init_head {
                Some(prefix) => trained_head(args, m, model_sha, exit_layer, prefix)?,
                None => {
                    let init = init_layer(args, m, exit_layer);
                    LayerHead::from_model(m, args.head, exit_layer, init, subset)?
                }
            };
            let depth = head.weights().depth();
            let wanted = args.head_layers.unwrap_or(depth);
            if wanted < depth {
                bail!("--head-layers {wanted}: the initial head already has {depth} layers");
            }
            let head = head.deepened(m, wanted - depth)?;
            let head = match args.mix_layers.as_slice() {
                [] => head,
                mix if head.weights().mix_layers == mix => head,
                mix => head.with_mix_layers(m, mix)?,
            };
            let d = Distiller::new(m, head, config.clone())?;
            let before = d.evaluate_set(eval_set, EVAL_K)?;
            (d, before, Vec::new(), 0.0, 0.0)
        };
        eprintln!("layer {exit_layer} before: {before:?}");
        Ok(HeadRun {
            exit_layer,
            out,
            distiller,
            before,
            history,
            seconds_before,
            generation_seconds: generated_before,
            running: None,
        })
    }

    /// Adds an evaluation after `step` steps (`tokens_seen` training tokens) to the history,
    /// with the smoothed training loss.
    fn record(&mut self, step: usize, tokens_seen: usize, eval: &EvalMetrics) {
        self.history.push(serde_json::json!({
            "step": step, "tokens_seen": tokens_seen, "train_loss": self.running, "eval": eval,
        }));
    }

    /// Steps this head trains for (a resumed run keeps its saved configuration).
    fn total(&self) -> usize {
        self.distiller.config().total_steps
    }

    /// Saves the training state with what a resumed run needs back.
    fn save(&self, started: Instant) -> Result<()> {
        let extra = serde_json::json!({
            "before": self.before, "history": self.history,
            "seconds": self.seconds_before + started.elapsed().as_secs_f64(),
            "generation_seconds": self.generation_seconds,
        });
        Ok(self.distiller.save_state(&self.out, extra)?)
    }
}
