//! Spec-Bench: AR against EESD and tree speculation methods on the same questions, in one run;
//! greedy by default, or sampled (`--temperature`).
//!
//! ```text
//! cargo run --release --example spec_bench -- --questions ../shared/data/spec_bench.jsonl \
//!     --per-category 2 --max-new-tokens 128 [--methods norm@8/cost-ts,norm@12/fixed:2] \
//!     [--temperature 0.7 --top-p 0.95 --seed 1] [--json] [--out DIR]
//! ```
//! A method is `HEAD[@LAYER]/POLICY`; HEAD is `shipped`, the path prefix of a trained head
//! checkpoint, `norm@LAYER` (parameter-free), or `oracle:A[+HEAD]` — the work of HEAD (default
//! the shipped head) with drafts that agree with AR at rate A (see `oracle.rs`; it measures the
//! ceiling a head of that quality would reach). Tree speculation methods name a drafter instead:
//! `recycle@B`, `lookup@B`, `fused@B[:L]`, `opt@B`, `opt@B:auto` or Thompson Sampling over
//! several, `ts:opt@16:auto|lookup@8` (`DrafterSpec`), optionally
//! `+HEAD` with the checkpoint prefix of a lookahead head whose drafts of each root's children
//! join the tree (`opt@8+heads/lookahead`; `opt@8+shipped`: the one in `assets/heads`;
//! `opt@8+shipped:3`: three levels along the head's best child). For every question the methods run right after
//! AR on the same prompt (first turn, chat template), so machine drift cancels in the speedup, and
//! every method's tokens are compared with AR's: `divergences` must be 0. The JSON's `host`
//! names the CPU and, probed before each question, the round trip of a cache line between two
//! threads (`core_to_core_ns`): on a VM whose vCPUs move between one core complex and two, it
//! says which placement each question ran on.
//!
//! Sampled runs (`--temperature`) seed AR and every method alike. Tree speculation then draws
//! AR's very tokens: it samples each emitted token once, from the same target row and with the
//! sampler's next draw, as AR does, so its `divergences` must be 0 there too. EESD chains keep
//! AR's distribution but not its draws (speculative sampling draws more randomness; the tests
//! check the distribution), so theirs is `null`; `oracle:` methods, which steer drafts toward
//! AR's tokens, are refused.

#[path = "../common/bench_model.rs"]
mod bench_model;
#[path = "../common/cli.rs"]
mod cli;
#[path = "../common/heads.rs"]
mod heads;
#[path = "../common/ngrams.rs"]
mod ngrams;
mod oracle;
#[path = "../common/plots.rs"]
mod plots;
#[path = "../common/prompts.rs"]
mod prompts;
#[path = "../common/questions.rs"]
mod questions;
#[path = "../common/sampling.rs"]
mod sampling;

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::Path;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use eesd::bandit::Policy;
use eesd::core::drafters::{DrafterSpec, HeadDrafter};
use eesd::core::{GenerationConfig, GenerationOutput, Generator, Mode};
use eesd::models::cpu::Pool;
use eesd::models::cpu::roofline::{core_to_core_round_trip, cpu_name};
use eesd::models::{AnyHead, LayerHead, Llama, LoadedModel, NormHead};
use eesd::models::{load_layer_head, load_lookahead_head};
use indicatif::{ProgressBar, ProgressStyle};
use oracle::{BenchHead, Oracle};

#[derive(Parser, Debug)]
struct Args {
    /// Heads draft from their dense f32 weights on a dense model, instead of from Q8_0 copies
    /// (`LayerHead::with_q8_0_drafts`, the default; native models' heads always use Q8_0).
    #[arg(long)]
    dense_heads: bool,
    /// Spec-Bench questions (jsonl with question_id, category, turns).
    #[arg(long, default_value = "../shared/data/spec_bench.jsonl")]
    questions: PathBuf,
    /// Questions per category (the first ones of each).
    #[arg(long, default_value_t = 2, value_parser = cli::at_least_one)]
    per_category: usize,
    /// Only these categories, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    categories: Vec<String>,
    /// New tokens per answer.
    #[arg(long, default_value_t = 128, value_parser = cli::at_least_one)]
    max_new_tokens: usize,
    /// Methods besides AR, comma-separated `HEAD[@LAYER]/POLICY`: HEAD is `shipped` (the
    /// trained head in assets/heads), a checkpoint prefix, `norm@LAYER` (the parameter-free
    /// baseline) or `oracle:A[+HEAD]` (HEAD's cost, default shipped; AR's token with
    /// probability A); POLICY as `Policy::parse` (fixed:K, threshold:T, beta-ts, calibrated-ts,
    /// cost-ts). Or a tree drafter: `recycle@B`, `lookup@B`, `fused@B[:L]`, `opt@B`,
    /// `opt@B:auto`, `ts:A|B|...` (one of those per round, by Thompson Sampling), with `+HEAD`
    /// a lookahead head checkpoint whose drafts join its trees (`opt@8+PATH`, `opt@8+shipped`;
    /// `+HEAD:LEVELS` drafts that many levels along the head's best child), and/or `+ngrams` (adaptive trees add continuations from the `--ngrams` store).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "shipped/cost-ts,shipped/calibrated-ts,shipped/beta-ts,shipped/threshold:0.6,shipped/fixed:1,shipped/fixed:2,shipped/fixed:4,norm@12/cost-ts"
    )]
    methods: Vec<String>,
    /// Before the questions, tree drafters learn from the model's answers to this many
    /// training prompts (`--warm-prompts`, never benchmark questions), as a drafter state
    /// saved from earlier use would give them.
    #[arg(long, default_value_t = 0)]
    warm: usize,
    /// Training prompts for `--warm` (jsonl with a `prompt` field).
    #[arg(long, default_value = "../shared/data/train_prompts.jsonl")]
    warm_prompts: PathBuf,
    /// Answers (`train_exit_head`'s `OUT.data.jsonl`, never benchmark answers) whose n-grams
    /// `+ngrams` methods draft from.
    #[arg(long)]
    ngrams: Option<PathBuf>,
    /// Sampling (greedy unless `--temperature`); AR and every method draw with `--seed` on
    /// every question.
    #[command(flatten)]
    sampling: sampling::SamplingArgs,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Also write results.md and results.json into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
    #[command(flatten)]
    model: bench_model::ModelArgs,
}

struct Method {
    name: String,
    kind: Kind,
}

enum Kind {
    /// EESD: an exit head after `exit_layer`, draft lengths from `policy`.
    Eesd {
        exit_layer: usize,
        policy: Policy,
        head: BenchHead,
    },
    /// Tree speculation with a train-free drafter, a lookahead head's drafts if given, and
    /// the n-gram store's continuations if `ngrams`.
    Tree {
        spec: DrafterSpec,
        head: Option<Box<LayerHead>>,
        /// Levels the head drafts below each root (`+HEAD:LEVELS`, default 1).
        levels: usize,
        ngrams: bool,
    },
}

/// One generator per method; tree generators carry their drafter (and what it learned).
enum Runner<'a> {
    Eesd(Generator<'a, Llama, BenchHead>),
    Tree(Generator<'a, Llama>),
}

/// `HEAD[@LAYER]/POLICY`: HEAD is `norm` (needs `@LAYER`), `shipped` (the head in
/// `assets/heads`), a checkpoint prefix or `oracle:A[+HEAD]`; a trained head's layer defaults to
/// its own.
fn parse_method(
    name: &str,
    seed: u64,
    lm: &LoadedModel,
    model_sha: &str,
    dense_heads: bool,
) -> Result<Method> {
    let drafts = |head: LayerHead| match dense_heads {
        true => Ok(head),
        false => head.with_q8_0_drafts(),
    };
    let (spec, ngrams) = match name.strip_suffix("+ngrams") {
        Some(rest) => (rest, true),
        None => (name, false),
    };
    // Tree drafters name no policy, and may add a lookahead head (whose path may hold '/').
    if let Some((drafter, head)) = spec.split_once('+')
        && let Ok(drafter) = drafter.parse::<DrafterSpec>()
    {
        // `+HEAD:LEVELS` drafts that many levels with the head.
        let (head, levels) = match head.rsplit_once(':') {
            Some((h, l)) if l.parse::<usize>().is_ok_and(|l| l > 0) => (h, l.parse()?),
            _ => (head, 1),
        };
        let (head, _) = load_lookahead_head(heads::lookahead(head), &lm.model, Some(model_sha))
            .with_context(|| {
                format!("head `{head}` of method `{spec}` (chain heads: HEAD/POLICY)")
            })?;
        let head = drafts(head)?;
        return Ok(Method {
            name: name.to_string(),
            kind: Kind::Tree {
                spec: drafter,
                head: Some(Box::new(head)),
                levels,
                ngrams,
            },
        });
    }
    // Exit-head methods name a policy after a '/'; tree drafters never do.
    if !spec.contains('/') {
        return Ok(Method {
            name: name.to_string(),
            kind: Kind::Tree {
                spec: spec.parse()?,
                head: None,
                levels: 1,
                ngrams,
            },
        });
    }
    // The policy follows the last '/' (checkpoint prefixes are paths).
    let (head, policy) = spec
        .rsplit_once('/')
        .context("method must be HEAD[@LAYER]/POLICY")?;
    let (head, layer) = match head.rsplit_once('@') {
        Some((h, l)) => (h, Some(l.parse::<usize>()?)),
        None => (head, None),
    };
    // `oracle:A` steers the shipped head, `oracle:A+HEAD` another one.
    let (head, oracle) = match head.strip_prefix("oracle:") {
        Some(rest) => {
            let (agreement, base) = rest.split_once('+').unwrap_or((rest, "shipped"));
            let agreement = agreement
                .parse::<f64>()
                .with_context(|| format!("oracle agreement `{agreement}` of method `{spec}`"))?;
            (base, Some(Oracle::new(agreement)?))
        }
        None => (head, None),
    };
    let (head, exit_layer) = if head == "norm" {
        let layer = layer.context("the norm head needs an exit layer: norm@LAYER/POLICY")?;
        (AnyHead::Norm(NormHead::new()), layer)
    } else {
        let (h, meta) = load_layer_head(heads::chain(head), &lm.model, Some(model_sha))
            .with_context(|| format!("head `{head}` of method `{spec}`"))?;
        if layer.is_some_and(|l| l != meta.exit_layer) {
            bail!(
                "head `{head}` was trained for layer {}, method `{spec}` asks for another",
                meta.exit_layer
            );
        }
        (
            AnyHead::Layer(Box::new(h.with_q8_0_drafts()?)),
            meta.exit_layer,
        )
    };
    let head = BenchHead { head, oracle };
    Ok(Method {
        name: spec.to_string(),
        kind: Kind::Eesd {
            exit_layer,
            policy: Policy::parse(policy, seed)?,
            head,
        },
    })
}

/// Sums over a set of runs.
#[derive(Default, Clone, serde::Serialize)]
struct Totals {
    runs: usize,
    tokens: usize,
    seconds: f64,
    rounds: usize,
    drafted: usize,
    discarded: usize,
    prefill_seconds: f64,
    draft_seconds: f64,
    verify_seconds: f64,
    divergences: usize,
    accepted_histogram: Vec<usize>,
    drafted_histogram: Vec<usize>,
    /// Rounds per drafter of a drafter choice (`ts:`), by drafter name.
    choices: BTreeMap<String, u64>,
}

fn add_histogram(total: &mut Vec<usize>, add: &[usize]) {
    if total.len() < add.len() {
        total.resize(add.len(), 0);
    }
    for (t, n) in total.iter_mut().zip(add) {
        *t += n;
    }
}

impl Totals {
    fn add(&mut self, out: &GenerationOutput, diverged: bool) {
        let s = &out.stats;
        self.runs += 1;
        self.tokens += s.new_tokens;
        self.seconds += s.seconds;
        self.rounds += s.rounds;
        self.drafted += s.drafted;
        self.discarded += s.discarded;
        self.prefill_seconds += s.prefill_seconds;
        self.draft_seconds += s.draft_seconds;
        self.verify_seconds += s.verify_seconds;
        self.divergences += diverged as usize;
        add_histogram(&mut self.accepted_histogram, &s.accepted_histogram);
        add_histogram(&mut self.drafted_histogram, &s.drafted_histogram);
    }

    fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.seconds.max(1e-9)
    }

    /// The totals as JSON; `compared`: whether outputs were checked against AR's, else
    /// `divergences` is `null`.
    fn summary(&self, ar: &Totals, compared: bool) -> serde_json::Value {
        serde_json::json!({
            "tokens_per_second": self.tokens_per_second(),
            "speedup": self.tokens_per_second() / ar.tokens_per_second(),
            "mean_accepted": self.tokens as f64 / self.rounds.max(1) as f64,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
            "drafted": self.drafted, "discarded": self.discarded,
            "drafted_per_round": self.drafted as f64 / self.rounds.max(1) as f64,
            // Per verification round (AR: per token). The draft phase includes the last
            // accepted token's pass through layers [0, N), which plain decoding does too.
            "draft_ms_per_round": 1e3 * self.draft_seconds / self.rounds.max(1) as f64,
            "verify_ms_per_round": 1e3 * self.verify_seconds / self.rounds.max(1) as f64,
            "divergences": compared.then_some(self.divergences), "tokens": self.tokens, "runs": self.runs,
            "accepted_histogram": self.accepted_histogram,
            "drafted_histogram": self.drafted_histogram,
            "drafter_rounds": self.choices,
        })
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let questions = questions::load(&args.questions, args.per_category, &args.categories)?;
    let sampling = args.sampling.params()?;
    let greedy = sampling.is_greedy();
    let (lm, path, sha) = args.model.load()?;
    let methods: Vec<Method> = args
        .methods
        .iter()
        .map(|m| parse_method(m, 1, &lm, &sha, args.dense_heads))
        .collect::<Result<_>>()?;
    if !greedy
        && let Some(m) = methods
            .iter()
            .find(|m| matches!(&m.kind, Kind::Eesd { head, .. } if head.oracle.is_some()))
    {
        bail!(
            "`{}` steers drafts toward AR's tokens, which only greedy decoding fixes: run it without --temperature",
            m.name
        );
    }
    // One generator per method, alive for the whole run, so learning policies carry over.
    let vocab = lm.model.config().vocab_size;
    let wants_store = methods
        .iter()
        .any(|m| matches!(m.kind, Kind::Tree { ngrams: true, .. }));
    let store = match (&args.ngrams, wants_store) {
        (Some(path), true) => Some(ngrams::load(path, vocab)?),
        (None, true) => bail!("`+ngrams` methods need --ngrams ANSWERS.jsonl"),
        (_, false) => None,
    };
    let mut generators: Vec<Runner<'_>> = methods
        .iter()
        .map(|m| match &m.kind {
            Kind::Eesd { policy, head, .. } => Runner::Eesd(
                Generator::new(&lm.model)
                    .with_head(head)
                    .with_policy(policy.clone()),
            ),
            Kind::Tree {
                spec,
                head,
                levels,
                ngrams,
            } => {
                let drafter = spec.build_with(vocab, store.as_ref().filter(|_| *ngrams));
                Runner::Tree(match head {
                    None => Generator::new(&lm.model).with_drafter(drafter),
                    Some(head) => Generator::new(&lm.model).with_drafter(
                        HeadDrafter::new(&lm.model, head.as_ref(), drafter).with_levels(*levels),
                    ),
                })
            }
        })
        .collect();
    let mut ar_gen = Generator::new(&lm.model);
    let eos: Vec<u32> = lm.tokenizer.eos_token_id().into_iter().collect();
    if args.warm > 0 {
        let prompts = prompts::load(&args.warm_prompts, args.warm)?;
        let warming = ProgressBar::new((prompts.len() * generators.len()) as u64);
        for text in &prompts {
            let prompt = lm.chat_prompt(text)?;
            let config = GenerationConfig {
                mode: Mode::Tree,
                max_new_tokens: args.max_new_tokens,
                stop_tokens: eos.clone(),
                ..Default::default()
            };
            for (m, g) in methods.iter().zip(generators.iter_mut()) {
                if let (Kind::Tree { spec, .. }, Runner::Tree(g)) = (&m.kind, g) {
                    let config = GenerationConfig {
                        tree_budget: spec.budget,
                        ..config.clone()
                    };
                    g.generate(&prompt, &config, |_| ControlFlow::Continue(()))?;
                }
                warming.inc(1);
            }
        }
        warming.finish_and_clear();
    }

    let bar = ProgressBar::new((questions.len() * (methods.len() + 1)) as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
    )?);
    // totals[method][category]; method 0 is AR. Whether a method's tokens must equal AR's: all
    // of them when greedy; when sampling, tree speculation's (see the module docs).
    let compared: Vec<bool> = std::iter::once(true)
        .chain(
            methods
                .iter()
                .map(|m| greedy || matches!(m.kind, Kind::Tree { .. })),
        )
        .collect();
    let mut totals: Vec<BTreeMap<String, Totals>> = vec![BTreeMap::new(); methods.len() + 1];
    let mut round_trips: Vec<f64> = Vec::with_capacity(questions.len());
    for q in &questions {
        let prompt = lm.chat_prompt(&q.turns[0])?;
        let base = GenerationConfig {
            max_new_tokens: args.max_new_tokens,
            stop_tokens: eos.clone(),
            sampling,
            seed: args.sampling.seed,
            ..Default::default()
        };
        // Where the host's vCPUs sit now (one core complex or two) changes every figure.
        round_trips.extend(core_to_core_round_trip());
        bar.set_message(format!("q{} {} ar", q.question_id, q.category));
        let ar = ar_gen.generate(&prompt, &base, |_| ControlFlow::Continue(()))?;
        bar.inc(1);
        for t in [&q.category, "overall"] {
            totals[0].entry(t.to_string()).or_default().add(&ar, false);
        }
        for (i, (m, g)) in methods.iter().zip(generators.iter_mut()).enumerate() {
            bar.set_message(format!("q{} {} {}", q.question_id, q.category, m.name));
            let go = |_: &[u32]| ControlFlow::Continue(());
            let out = match (&m.kind, g) {
                (
                    Kind::Eesd {
                        exit_layer, head, ..
                    },
                    Runner::Eesd(g),
                ) => {
                    let config = GenerationConfig {
                        mode: Mode::Eesd,
                        exit_layer: Some(*exit_layer),
                        ..base.clone()
                    };
                    head.set_target(&prompt, &ar.tokens);
                    g.generate(&prompt, &config, go)?
                }
                (Kind::Tree { spec, .. }, Runner::Tree(g)) => {
                    let config = GenerationConfig {
                        mode: Mode::Tree,
                        tree_budget: spec.budget,
                        ..base.clone()
                    };
                    let before = g.drafter().map(|d| d.choices()).unwrap_or_default();
                    let out = g.generate(&prompt, &config, go)?;
                    let after = g.drafter().map(|d| d.choices()).unwrap_or_default();
                    for t in [&q.category, "overall"] {
                        let choices = &mut totals[i + 1].entry(t.to_string()).or_default().choices;
                        for (j, (name, rounds)) in after.iter().enumerate() {
                            let earlier = before.get(j).map_or(0, |b| b.1);
                            *choices.entry(name.clone()).or_default() += rounds - earlier;
                        }
                    }
                    out
                }
                _ => unreachable!("runners are built from their methods"),
            };
            let diverged = compared[i + 1] && out.tokens != ar.tokens;
            if diverged {
                bar.println(format!(
                    "DIVERGENCE: question {} with {}",
                    q.question_id, m.name
                ));
            }
            for t in [&q.category, "overall"] {
                totals[i + 1]
                    .entry(t.to_string())
                    .or_default()
                    .add(&out, diverged);
            }
            bar.inc(1);
        }
    }
    bar.finish_and_clear();

    let names: Vec<String> = std::iter::once("ar".to_string())
        .chain(methods.iter().map(|m| m.name.clone()))
        .collect();
    let mut per_method = serde_json::Map::new();
    for ((name, t), &compared) in names.iter().zip(&totals).zip(&compared) {
        let cats: serde_json::Map<String, serde_json::Value> = t
            .iter()
            .map(|(c, v)| (c.clone(), v.summary(&totals[0][c], compared)))
            .collect();
        per_method.insert(name.clone(), cats.into());
    }
    let best = (1..names.len()).max_by(|&a, &b| {
        totals[a]["overall"]
            .tokens_per_second()
            .total_cmp(&totals[b]["overall"].tokens_per_second())
    });
    let divergences: usize = totals.iter().map(|t| t["overall"].divergences).sum();
    let overall = match best {
        Some(best) => {
            let mut s = totals[best]["overall"].summary(&totals[0]["overall"], compared[best]);
            s["method"] = names[best].clone().into();
            // Over every method whose tokens must equal AR's.
            s["divergences"] = divergences.into();
            s
        }
        None => totals[0]["overall"].summary(&totals[0]["overall"], true),
    };
    let report = serde_json::json!({
        "model": path.display().to_string(), "device": args.model.device.name(), "dtype": args.model.dtype.name(),
        "questions": questions.len(), "sampling": sampling, "seed": args.sampling.seed,
        "max_new_tokens": args.max_new_tokens, "overall": overall, "methods": per_method,
        "host": {
            "cpu": cpu_name(), "threads": Pool::global().threads(),
            // Probed before each question: tens of ns with both vCPUs on one core complex,
            // hundreds on two (docs/results.md).
            "core_to_core_ns": round_trips.iter().map(|ns| ns.round()).collect::<Vec<_>>(),
        },
    });

    let mut table = String::from(
        "| method | category | tokens/s | speedup | mean accepted | draft + verify ms per round | divergences |\n|---|---|---|---|---|---|---|\n",
    );
    for ((name, t), &compared) in names.iter().zip(&totals).zip(&compared) {
        for (cat, v) in t {
            let ar = &totals[0][cat];
            table += &format!(
                "| {name} | {cat} | {:.1} | {:.2}x | {:.2} | {:.1} + {:.1} | {} |\n",
                v.tokens_per_second(),
                v.tokens_per_second() / ar.tokens_per_second(),
                v.tokens as f64 / v.rounds.max(1) as f64,
                1e3 * v.draft_seconds / v.rounds.max(1) as f64,
                1e3 * v.verify_seconds / v.rounds.max(1) as f64,
                match compared {
                    true => v.divergences.to_string(),
                    false => "-".to_string(),
                }
            );
        }
    }
    for (name, t) in names.iter().zip(&totals) {
        let choices = &t["overall"].choices;
        if !choices.is_empty() {
            let rounds: Vec<String> = choices.iter().map(|(d, n)| format!("{d} {n}")).collect();
            table += &format!("\n`{name}`: rounds per drafter: {}\n", rounds.join(", "));
        }
    }
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("results.md"), &table)?;
        std::fs::write(
            dir.join("results.json"),
            serde_json::to_string_pretty(&report)?,
        )?;
        write_plots(dir, &names, &totals, greedy)?;
    }
    if args.json {
        println!("{report}");
    } else {
        println!("{table}");
        println!("divergences from AR: {divergences}");
        if !greedy {
            println!(
                "sampled (temperature {}, top-p {}, top-k {}, seed {}): tree methods must draw AR's tokens; EESD chains keep AR's distribution, not its draws (-)",
                sampling.temperature, sampling.top_p, sampling.top_k, args.sampling.seed
            );
        }
    }
    Ok(())
}

/// `speedup.svg` (per category and method), `accepted.svg` (tokens accepted per round) and
/// `draft_length.svg` (drafts per round chosen by each method's policy).
fn write_plots(
    dir: &Path,
    names: &[String],
    totals: &[BTreeMap<String, Totals>],
    greedy: bool,
) -> Result<()> {
    let categories: Vec<String> = totals[0].keys().cloned().collect();
    let speedups: Vec<(String, Vec<f64>)> = names[1..]
        .iter()
        .zip(&totals[1..])
        .map(|(name, t)| {
            let v = categories
                .iter()
                .map(|c| t[c].tokens_per_second() / totals[0][c].tokens_per_second())
                .collect();
            (name.clone(), v)
        })
        .collect();
    plots::grouped_bars(
        &dir.join("speedup.svg"),
        match greedy {
            true => "EESD speedup over AR (same run, greedy)",
            false => "EESD speedup over AR (same run, sampled)",
        },
        &categories,
        "tokens/s ÷ AR tokens/s",
        &speedups,
    )?;
    for (file, title, desc, pick) in [
        (
            "accepted.svg",
            "Accepted drafts per round",
            "fraction of rounds",
            (|t: &Totals| t.accepted_histogram.clone()) as fn(&Totals) -> Vec<usize>,
        ),
        (
            "draft_length.svg",
            "Draft length chosen per round",
            "fraction of rounds",
            |t: &Totals| t.drafted_histogram.clone(),
        ),
    ] {
        let histograms: Vec<Vec<usize>> = totals[1..].iter().map(|t| pick(&t["overall"])).collect();
        let bins = histograms.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let series = names[1..]
            .iter()
            .zip(&histograms)
            .map(|(n, h)| (n.clone(), plots::fractions(h, bins)))
            .collect::<Vec<_>>();
        let labels: Vec<String> = (0..bins).map(|i| i.to_string()).collect();
        plots::grouped_bars(&dir.join(file), title, &labels, desc, &series)?;
    }
    Ok(())
}
