//! Evaluates exit heads the way speculation uses them: teacher-forced on the model's own greedy
//! answers to Spec-Bench questions (never trained on), per head and per category: how often
//! the full model's token is the head's top 1 / top k, and the tokens per verification round
//! that a greedy chain of k drafts or a tree of the head's top-w tokens would reach.
//!
//! ```text
//! cargo run --release --example eval_exit_head -- --heads shipped,norm@6,norm@12 \
//!     --per-category 5 [--json] [--svg agreement.svg]
//! ```
//! HEAD is `shipped` (the head in `assets/heads`), a checkpoint prefix, or `norm@LAYER` (the
//! parameter-free logit lens). `--lookahead shipped[,PREFIX...] [--levels 3]` also scores tree
//! (lookahead) heads level by level: level 1 drafts the root's children, each deeper level
//! drafts from the head's own state of the level before (`opt@B+HEAD:LEVELS`), and the path
//! column is the tokens per round of drafting the head's best path alone. All chain heads share
//! one teacher pass per answer (`eesd::core::head_eval`), and the replay is exact: tests check
//! it against the generator's own accepted counts, for chains and for a lookahead head's path. `--svg` plots each trained head's held-out agreement against training
//! tokens seen, from the history in its checkpoint. Heads draft as they do in decoding, their
//! draft vocabulary widened by the tokens each answer's sequence has brought so far
//! (`eesd::models::ContextTokens`). `--full-vocab` also scores each trained head projecting
//! onto the whole vocabulary (`NAME:full`, same weights): what its draft vocabulary costs in
//! agreement; `--subset-only` scores each trained head on its draft vocabulary alone
//! (`NAME:subset`, without the sequence's tokens): what widening it gains.

#[path = "common/bench_model.rs"]
mod bench_model;
#[path = "common/cli.rs"]
mod cli;
#[path = "common/heads.rs"]
mod heads;
#[path = "common/plots.rs"]
mod plots;
#[path = "common/questions.rs"]
mod questions;

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use eesd::core::head_eval::{Agreement, Ranks, lookahead_ranks, teacher_forced_ranks};
use eesd::core::{GenerationConfig, Generator};
use eesd::models::{
    AnyHead, HeadMetadata, LayerHead, LoadedModel, NormHead, load_layer_head, load_lookahead_head,
};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser, Debug)]
struct Args {
    /// Heads, comma-separated: `shipped`, a checkpoint prefix, or `norm@LAYER`.
    #[arg(long, value_delimiter = ',', default_value = "shipped")]
    heads: Vec<String>,
    /// Lookahead (tree) heads, comma-separated: `shipped` or a checkpoint prefix.
    #[arg(long, value_delimiter = ',')]
    lookahead: Vec<String>,
    /// Levels a lookahead head drafts, each from its own state of the level before.
    #[arg(long, default_value_t = 3, value_parser = cli::at_least_one)]
    levels: usize,
    /// Spec-Bench questions (jsonl with question_id, category, turns).
    #[arg(long, default_value = "../shared/data/spec_bench.jsonl")]
    questions: PathBuf,
    /// Questions per category (the first ones of each).
    #[arg(long, default_value_t = 5, value_parser = cli::at_least_one)]
    per_category: usize,
    /// Only these categories, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    categories: Vec<String>,
    /// Length of the greedy answers the heads are scored on.
    #[arg(long, default_value_t = 128, value_parser = cli::at_least_one)]
    max_new_tokens: usize,
    /// Also score each trained head projecting onto the whole vocabulary instead of its draft
    /// vocabulary (named `NAME:full`; same weights, no retraining).
    #[arg(long)]
    full_vocab: bool,
    /// Also score each trained head drafting from its draft vocabulary alone, without the
    /// tokens each sequence brought (named `NAME:subset`; same weights).
    #[arg(long)]
    subset_only: bool,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
    /// Write an SVG of held-out agreement against training tokens seen (trained heads).
    #[arg(long)]
    svg: Option<PathBuf>,
    #[command(flatten)]
    model: bench_model::ModelArgs,
}

/// A head to evaluate, its exit layer and, for a trained head, its checkpoint metadata.
struct Candidate {
    name: String,
    head: AnyHead,
    exit_layer: usize,
    meta: Option<HeadMetadata>,
}

fn parse_head(spec: &str, lm: &LoadedModel, sha: &str) -> Result<Candidate> {
    if let Some(layer) = spec.strip_prefix("norm@") {
        let exit_layer = layer
            .parse()
            .with_context(|| format!("exit layer of head `{spec}`"))?;
        return Ok(Candidate {
            name: spec.into(),
            head: AnyHead::Norm(NormHead::new()),
            exit_layer,
            meta: None,
        });
    }
    let (head, meta) = load_chain(spec, lm, sha)?;
    Ok(Candidate {
        name: spec.into(),
        head: AnyHead::Layer(Box::new(head.with_q8_0_drafts()?)),
        exit_layer: meta.exit_layer,
        meta: Some(meta),
    })
}

/// The trained chain head `spec` (`shipped` or a checkpoint prefix) for `lm`.
fn load_chain(spec: &str, lm: &LoadedModel, sha: &str) -> Result<(LayerHead, HeadMetadata)> {
    load_layer_head(heads::chain(spec), &lm.model, Some(sha))
        .with_context(|| format!("head `{spec}`"))
}

/// Another draft vocabulary for a trained head, on the same weights.
#[derive(Clone, Copy)]
enum Variant {
    /// The whole vocabulary (`--full-vocab`).
    FullVocabulary,
    /// The draft vocabulary without the sequence's tokens (`--subset-only`).
    SubsetOnly,
}

impl Variant {
    /// The variants the command line asks for, each with the suffix of its name.
    fn wanted(args: &Args) -> Vec<(Variant, &'static str)> {
        [
            (args.full_vocab, Variant::FullVocabulary, "full"),
            (args.subset_only, Variant::SubsetOnly, "subset"),
        ]
        .into_iter()
        .filter_map(|(wanted, variant, name)| wanted.then_some((variant, name)))
        .collect()
    }

    /// `head` (loaded for the variant) so, drafting from Q8_0 copies as the evaluated heads
    /// do.
    fn of(self, head: LayerHead, lm: &LoadedModel) -> Result<LayerHead> {
        let head = match self {
            Variant::FullVocabulary => head.with_full_vocabulary(&lm.model)?,
            Variant::SubsetOnly => head.without_context_tokens(),
        };
        Ok(head.with_q8_0_drafts()?)
    }
}

/// A lookahead head's ranks over many sequences: per level, and its best path's acceptance.
#[derive(Clone, Default)]
struct PathAgreement {
    levels: Vec<Agreement>,
    /// Rounds (scored positions) and tokens of drafting the head's best path from each.
    rounds: usize,
    tokens: usize,
}

impl PathAgreement {
    /// Adds one sequence's ranks per level ([`lookahead_ranks`]).
    fn push(&mut self, ranks: Vec<Ranks>) {
        self.levels.resize(ranks.len(), Agreement::default());
        for k in 0..ranks.first().map_or(0, Vec::len) {
            let hits = ranks
                .iter()
                .take_while(|level| level.get(k) == Some(&Some(0)))
                .count();
            self.rounds += 1;
            self.tokens += 1 + hits;
        }
        for (level, r) in self.levels.iter_mut().zip(ranks) {
            level.push(r);
        }
    }

    fn extend(&mut self, other: &PathAgreement) {
        self.levels.resize(other.levels.len(), Agreement::default());
        for (level, o) in self.levels.iter_mut().zip(&other.levels) {
            level.extend(o);
        }
        self.rounds += other.rounds;
        self.tokens += other.tokens;
    }

    fn path_tokens_per_round(&self) -> f64 {
        self.tokens as f64 / self.rounds.max(1) as f64
    }

    fn summary(&self) -> serde_json::Value {
        let levels: Vec<serde_json::Value> = self
            .levels
            .iter()
            .map(|a| serde_json::json!({"positions": a.positions(), "top1": a.top_k(1), "top4": a.top_k(4)}))
            .collect();
        serde_json::json!({
            "positions": self.rounds, "levels": levels,
            "path_tokens_per_round": self.path_tokens_per_round(),
        })
    }
}

/// Chain lengths and tree shapes (width, depth) reported.
const CHAINS: [usize; 4] = [1, 2, 4, 8];
const TREES: [(u32, usize); 2] = [(2, 3), (4, 2)];

fn summary(a: &Agreement) -> serde_json::Value {
    let chain: serde_json::Map<String, serde_json::Value> = CHAINS
        .iter()
        .map(|&k| (k.to_string(), a.tokens_per_round(1, k).into()))
        .collect();
    let trees: Vec<serde_json::Value> = TREES
        .iter()
        .map(|&(w, d)| {
            serde_json::json!({
                "width": w, "depth": d, "nodes": Agreement::tree_nodes(w, d),
                "tokens_per_round": a.tokens_per_round(w, d),
            })
        })
        .collect();
    serde_json::json!({
        "positions": a.positions(),
        "top1": a.top_k(1), "top2": a.top_k(2), "top4": a.top_k(4), "top8": a.top_k(8),
        "chain_tokens_per_round": chain,
        "tree_tokens_per_round": trees,
    })
}

/// Held-out agreement against tokens seen, from a checkpoint's training history (entries
/// written before tokens were recorded are skipped).
fn history(meta: &HeadMetadata) -> Vec<(f64, f64)> {
    let entries = meta.metrics["history"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut points: Vec<(f64, f64)> = entries
        .iter()
        .filter_map(|h| {
            Some((
                h["tokens_seen"].as_f64()?,
                h["eval"]["top1_agreement"].as_f64()?,
            ))
        })
        .collect();
    // The untrained start, when the curve has points at all.
    if let Some(before) = meta.metrics["before"]["top1_agreement"].as_f64()
        && !points.is_empty()
    {
        points.insert(0, (0.0, before));
    }
    points
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.heads.is_empty() && args.lookahead.is_empty() {
        bail!("--heads and --lookahead name no head");
    }
    let questions = questions::load(&args.questions, args.per_category, &args.categories)?;
    let (lm, path, sha) = args.model.load()?;
    let mut candidates: Vec<Candidate> = Vec::new();
    for spec in &args.heads {
        let candidate = parse_head(spec, &lm, &sha)?;
        let mut variants = Vec::new();
        if let AnyHead::Layer(_) = &candidate.head {
            for (variant, name) in Variant::wanted(&args) {
                let (head, _) = load_chain(spec, &lm, &sha)?;
                variants.push(Candidate {
                    name: format!("{spec}:{name}"),
                    head: AnyHead::Layer(Box::new(variant.of(head, &lm)?)),
                    exit_layer: candidate.exit_layer,
                    meta: None,
                });
            }
        }
        candidates.push(candidate);
        candidates.extend(variants);
    }
    let heads: Vec<(&AnyHead, usize)> =
        candidates.iter().map(|c| (&c.head, c.exit_layer)).collect();
    let (mut trees, mut tree_names): (Vec<LayerHead>, Vec<String>) = (Vec::new(), Vec::new());
    for h in &args.lookahead {
        let load = || {
            load_lookahead_head(heads::lookahead(h), &lm.model, Some(&sha))
                .map(|(head, _)| head)
                .with_context(|| format!("lookahead head `{h}`"))
        };
        let head = load()?;
        let mut variants = Vec::new();
        for (variant, name) in Variant::wanted(&args) {
            variants.push((variant.of(load()?, &lm)?, format!("{h}:{name}")));
        }
        trees.push(head.with_q8_0_drafts()?);
        tree_names.push(h.clone());
        for (variant, name) in variants {
            trees.push(variant);
            tree_names.push(name);
        }
    }
    let mut paths: Vec<BTreeMap<String, PathAgreement>> = vec![BTreeMap::new(); trees.len()];
    let eos: Vec<u32> = lm.tokenizer.eos_token_id().into_iter().collect();
    let config = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        stop_tokens: eos,
        ..Default::default()
    };

    // agreement[head][category]; "overall" is added after the loop.
    let mut agreement: Vec<BTreeMap<String, Agreement>> = vec![BTreeMap::new(); candidates.len()];
    let bar = ProgressBar::new(questions.len() as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
    )?);
    let mut ar = Generator::new(&lm.model);
    for q in &questions {
        bar.set_message(format!("q{} {}", q.question_id, q.category));
        let prompt = lm.chat_prompt(&q.turns[0])?;
        let answer = ar.generate(&prompt, &config, |_| ControlFlow::Continue(()))?;
        if answer.tokens.is_empty() {
            bar.inc(1);
            continue;
        }
        let p = prompt.len();
        let tokens = [prompt, answer.tokens].concat();
        // The positions that predict the answer's tokens.
        let score = p - 1..tokens.len() - 1;
        let ranks = teacher_forced_ranks(&lm.model, &heads, &tokens, score.clone())?;
        for (per_head, r) in agreement.iter_mut().zip(ranks) {
            per_head.entry(q.category.clone()).or_default().push(r);
        }
        for (per_head, head) in paths.iter_mut().zip(&trees) {
            let ranks = lookahead_ranks(&lm.model, head, &tokens, score.clone(), args.levels)?;
            per_head.entry(q.category.clone()).or_default().push(ranks);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    for per_head in &mut agreement {
        let mut overall = Agreement::default();
        per_head.values().for_each(|a| overall.extend(a));
        per_head.insert("overall".into(), overall);
    }
    for per_head in &mut paths {
        let mut overall = PathAgreement::default();
        per_head.values().for_each(|a| overall.extend(a));
        per_head.insert("overall".into(), overall);
    }
    let tree_results: Vec<serde_json::Value> = tree_names
        .iter()
        .zip(&paths)
        .map(|(name, per_cat)| {
            let categories: serde_json::Map<String, serde_json::Value> = per_cat
                .iter()
                .map(|(k, a)| (k.clone(), a.summary()))
                .collect();
            serde_json::json!({"head": name, "levels": args.levels, "categories": categories})
        })
        .collect();

    let results: Vec<serde_json::Value> = candidates
        .iter()
        .zip(&agreement)
        .map(|(c, per_cat)| {
            let categories: serde_json::Map<String, serde_json::Value> = per_cat
                .iter()
                .map(|(k, a)| (k.clone(), summary(a)))
                .collect();
            serde_json::json!({
                "head": c.name, "exit_layer": c.exit_layer, "categories": categories,
                "head_layers": match &c.head {
                    AnyHead::Layer(h) => h.weights().depth(),
                    AnyHead::Norm(_) => 0,
                },
                "tokens_seen": c.meta.as_ref().and_then(|m| history(m).last().map(|p| p.0)),
            })
        })
        .collect();
    if let Some(svg) = &args.svg {
        let series: Vec<(String, Vec<(f64, f64)>)> = candidates
            .iter()
            .filter_map(|c| {
                let points = history(c.meta.as_ref()?);
                (!points.is_empty())
                    .then(|| (format!("{} (layer {})", c.name, c.exit_layer), points))
            })
            .collect();
        if series.is_empty() {
            eprintln!("no head records tokens seen in its training history: no plot written");
        } else {
            plots::lines(
                svg,
                "Exit head: held-out top-1 agreement while training",
                "training tokens seen",
                "top-1 agreement",
                &series,
            )?;
        }
    }
    let report = serde_json::json!({
        "model": path.display().to_string(), "dtype": format!("{:?}", args.model.dtype),
        "questions": questions.len(), "max_new_tokens": args.max_new_tokens, "heads": results,
        "lookahead_heads": tree_results,
    });
    if args.json {
        println!("{report}");
        return Ok(());
    }
    for (c, per_cat) in candidates.iter().zip(&agreement) {
        println!("\n## {} (exit layer {})\n", c.name, c.exit_layer);
        let trees: String = TREES
            .iter()
            .map(|&(w, d)| format!(" tree {w}^{d} ({} nodes) |", Agreement::tree_nodes(w, d)))
            .collect();
        let chains: String = CHAINS.iter().map(|k| format!(" chain {k} |")).collect();
        println!("| category | positions | top-1 | top-4 |{chains}{trees}");
        println!(
            "|---|---|---|---|{}",
            "---|".repeat(CHAINS.len() + TREES.len())
        );
        // Categories alphabetically, the whole set last.
        let rows = per_cat.iter().filter(|(c, _)| *c != "overall");
        for (cat, a) in rows.chain(per_cat.get_key_value("overall")) {
            let chains: String = CHAINS
                .iter()
                .map(|&k| format!(" {:.2} |", a.tokens_per_round(1, k)))
                .collect();
            let trees: String = TREES
                .iter()
                .map(|&(w, d)| format!(" {:.2} |", a.tokens_per_round(w, d)))
                .collect();
            println!(
                "| {cat} | {} | {:.1}% | {:.1}% |{chains}{trees}",
                a.positions(),
                100.0 * a.top_k(1),
                100.0 * a.top_k(4)
            );
        }
    }
    println!("\n(chain k / tree w^d: tokens per verification round, drafts accepted + 1)");
    for (name, per_cat) in tree_names.iter().zip(&paths) {
        println!("\n## lookahead head {name}, {} levels\n", args.levels);
        let levels: String = (1..=args.levels)
            .map(|l| format!(" level {l} top-1 / top-4 |"))
            .collect();
        println!("| category | positions |{levels} path |");
        println!("|---|---|{}---|", "---|".repeat(args.levels));
        let rows = per_cat.iter().filter(|(c, _)| *c != "overall");
        for (cat, a) in rows.chain(per_cat.get_key_value("overall")) {
            let levels: String = a
                .levels
                .iter()
                .map(|l| format!(" {:.1}% / {:.1}% |", 100.0 * l.top_k(1), 100.0 * l.top_k(4)))
                .collect();
            println!(
                "| {cat} | {} |{levels} {:.2} |",
                a.rounds,
                a.path_tokens_per_round()
            );
        }
    }
    if !paths.is_empty() {
        println!(
            "\n(level l: the head's rank of the model's token l after the root, given the true \
             tokens before it; path: tokens per round drafting the head's best path alone)"
        );
    }
    Ok(())
}
