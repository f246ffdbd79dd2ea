//! The flex attention kernel alone: one forward's worth of layers at several cached lengths and
//! block sizes, against the machine's roofline measured in the same run.
//!
//! ```text
//! cargo bench --bench attention_cost -- [--contexts 0,512,1000,4000] [--rows 1,2,4,8,16]
//!     [--kv f32,f16] [--json]
//! ```
//! The default shape is SmolLM2-135M's (30 layers, 9 query and 3 key-value heads of 64). Each
//! layer gets a store of its own so that the caches do not flatter the long contexts. A block
//! of `r` rows at `c` cached positions reads every key and value once (`2 × (c + r) × kv × d`
//! values per layer, 4 or 2 bytes each by `--kv`) and does `2 × 2 × q × d` flops per (row, position) it sees (scores and
//! weighted values; row `i` of the block sees `c + i + 1` positions). Time is the best of
//! `--reps` forwards, the configurations taken round in turn so that a noisy host affects all.

#[path = "common/output.rs"]
mod output;

use anyhow::{Result, ensure};
use clap::Parser;
use eesd::models::cpu::attention::{Heads, HostKv, KvDtype, attend};
use eesd::models::cpu::{Pool, Roofline, roofline};
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    /// Cached positions before the block.
    #[arg(long, value_delimiter = ',', default_value = "0,512,1000,4000")]
    contexts: Vec<usize>,
    /// Rows per block.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    rows: Vec<usize>,
    /// Stored key/value types: f32 (f32 models) and f16 (quantized, f16 and bf16 models).
    #[arg(long, value_delimiter = ',', default_value = "f32,f16")]
    kv: Vec<KvDtype>,
    /// Layers per forward.
    #[arg(long, default_value_t = 30)]
    layers: usize,
    /// Query heads.
    #[arg(long, default_value_t = 9)]
    q_heads: usize,
    /// Key-value heads (divides the query heads).
    #[arg(long, default_value_t = 3)]
    kv_heads: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Timed forwards per configuration (the best counts).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    #[command(flatten)]
    output: output::Output,
}

/// One configuration: its layer stores, its queries and the best time so far.
struct Case {
    kv: KvDtype,
    context: usize,
    rows: usize,
    stores: Vec<HostKv>,
    queries: Vec<f32>,
    out: Vec<f32>,
    best: f64,
}

/// Deterministic values in [-0.5, 0.5): enough spread for a realistic softmax.
fn values(n: usize, mul: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (i.wrapping_mul(mul) % 1000) as f32 / 1000.0 - 0.5)
        .collect()
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        args.kv_heads > 0 && args.q_heads % args.kv_heads == 0 && args.head_dim > 0,
        "query heads ({}) must be a multiple of key-value heads ({})",
        args.q_heads,
        args.kv_heads
    );
    let heads = Heads {
        q: args.q_heads,
        kv: args.kv_heads,
        d: args.head_dim,
    };
    let pool = Pool::global();
    let before = Roofline::measure();
    let width = heads.kv * heads.d;
    let mut cases = Vec::new();
    for &kv in &args.kv {
        for &context in &args.contexts {
            for &rows in &args.rows {
                let total = context + rows;
                let (keys, vals) = (values(total * width, 7919), values(total * width, 104729));
                let stores = (0..args.layers)
                    .map(|_| HostKv::from_rows(kv, heads.kv, heads.d, &keys, &vals))
                    .collect();
                cases.push(Case {
                    kv,
                    context,
                    rows,
                    stores,
                    queries: values(rows * heads.q * heads.d, 31),
                    out: vec![0.0; rows * heads.q * heads.d],
                    best: f64::MAX,
                });
            }
        }
    }
    for _ in 0..args.reps.max(1) {
        for case in &mut cases {
            let start = Instant::now();
            let (q, stride, first) = (&case.queries, heads.q * heads.d, case.context);
            for store in &case.stores {
                match store {
                    HostKv::F32(s) => attend(q, stride, s, first, heads, None, &mut case.out, pool),
                    HostKv::F16(s) => attend(q, stride, s, first, heads, None, &mut case.out, pool),
                }
            }
            case.best = case.best.min(start.elapsed().as_secs_f64());
        }
    }
    let machine = before.best_with(&Roofline::measure());
    if !args.output.json {
        println!("{machine}");
    }
    let mut results = Vec::new();
    for case in &cases {
        let layers = args.layers as f64;
        let total = (case.context + case.rows) as f64;
        let bytes = layers * 2.0 * total * (width * case.kv.bytes()) as f64;
        // Row i sees context + i + 1 positions.
        let seen = case.rows as f64 * (case.context as f64 + (case.rows as f64 + 1.0) / 2.0);
        let flops = layers * seen * 2.0 * 2.0 * (heads.q * heads.d) as f64;
        let limit = machine.seconds(bytes, flops, 0.0);
        let efficiency = limit / case.best;
        if !args.output.json {
            println!(
                "kv {} context {:5} rows {:2}: {:7.3} ms ({:5.1} GB/s, {:6.1} GFLOP/s), roofline {:6.3} ms ({}-bound), efficiency {efficiency:.2}",
                case.kv.name(),
                case.context,
                case.rows,
                case.best * 1e3,
                bytes / case.best / 1e9,
                flops / case.best / 1e9,
                limit * 1e3,
                machine.bound(bytes, flops, 0.0),
            );
        }
        results.push(serde_json::json!({
            "kv": case.kv.name(), "context": case.context, "rows": case.rows, "ms": case.best * 1e3,
            "bytes": bytes, "flops": flops, "roofline_ms": limit * 1e3,
            "efficiency": efficiency,
        }));
    }
    if args.output.json {
        println!(
            "{}",
            serde_json::json!({
                "cpu": roofline::cpu_name(), "machine": machine, "layers": args.layers,
                "heads": {"q": heads.q, "kv": heads.kv, "d": heads.d}, "results": results,
            })
        );
    }
    Ok(())
}
