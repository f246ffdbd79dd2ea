//! The dense product alone (`PackedMatrix`: f32, f16 or bf16 weights) by matrix size: how close
//! one product gets to the machine's roofline, measured in the same run, when it is small (a
//! layer's matrices, 0.4–3.5 MB in f32) and when it is large (the LM head).
//!
//! ```text
//! cargo bench --bench matmul_cost -- [--outs 192,576,1536,3072,12288,49152] [--rows 1,8]
//!     [--dtype f32] [--mb 160] [--json]
//! ```
//! For each output count `out` (inner dimension `--k`, 576 by default as in SmolLM2-135M) the
//! bench makes as many distinct `[out, k]` matrices as fill `--mb` megabytes, so that the
//! weights stream from memory, and times one product per matrix back to back. A product's
//! roofline is its weight bytes over the read bandwidth or its `2 · rows · out · k` flops over
//! the FMA peak, whichever is longer; efficiency = roofline / measured. Each line also gives
//! the product's rate as a fraction of the FMA peak: with `--mb 1` the matrices stay in the
//! caches, and that fraction is the kernel's arithmetic efficiency, which the memory roofline
//! does not describe there. The host's bandwidth can move from second to second (a 2-core EPYC
//! VM read 35 or 61 GB/s), so the time is the best of `--reps` passes, the sizes and row counts
//! taken round in turn, and the roofline is the best of two probes, before and after.

#[path = "common/output.rs"]
mod output;

use anyhow::{Result, bail};
use clap::Parser;
use eesd::models::cpu::{PackedMatrix, Roofline, WeightElement};
use half::{bf16, f16};
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    /// Output rows of the matrices, one size per entry.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "192,576,1536,3072,12288,49152"
    )]
    outs: Vec<usize>,
    /// Inner dimension.
    #[arg(long, default_value_t = 576)]
    k: usize,
    /// Activation rows per product.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    rows: Vec<usize>,
    /// Weight type: f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Megabytes of distinct matrices per size (more than the last-level cache).
    #[arg(long, default_value_t = 160)]
    mb: usize,
    /// Timed passes (the best counts).
    #[arg(long, default_value_t = 10)]
    reps: usize,
    #[command(flatten)]
    output: output::Output,
}

/// Best seconds per product for each (size, row count), sizes outermost.
fn timings<E: WeightElement>(args: &Args, to_weight: fn(f32) -> E) -> Result<Vec<f64>> {
    let k = args.k;
    let sets = (args.outs.iter())
        .map(|&out| {
            let count = (args.mb << 20).div_ceil(out * k * size_of::<E>()).max(1);
            (0..count)
                .map(|s| {
                    let w: Vec<E> = (0..out * k)
                        .map(|i| to_weight(((i * 7919 + s * 104_729) % 1000) as f32 / 5e4))
                        .collect();
                    PackedMatrix::pack(&w, out, k)
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let widest = args.rows.iter().max().copied().unwrap_or(1) * k;
    let x: Vec<f32> = (0..widest).map(|i| (i % 97) as f32 / 97.0 - 0.5).collect();
    let mut best = vec![f64::MAX; args.outs.len() * args.rows.len()];
    for _ in 0..args.reps.max(1) {
        for (s, set) in sets.iter().enumerate() {
            for (r, &rows) in args.rows.iter().enumerate() {
                let start = Instant::now();
                for m in set {
                    std::hint::black_box(m.matmul_to_vec(&x[..rows * k])?);
                }
                let per = start.elapsed().as_secs_f64() / set.len() as f64;
                let slot = &mut best[s * args.rows.len() + r];
                *slot = slot.min(per);
            }
        }
    }
    Ok(best)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.k == 0 || args.outs.contains(&0) || args.rows.contains(&0) {
        bail!("--k, --outs and --rows must be positive");
    }
    let before = Roofline::measure();
    let (best, bytes_per_weight) = match args.dtype.as_str() {
        "f32" => (timings::<f32>(&args, |v| v)?, 4),
        "f16" => (timings::<f16>(&args, f16::from_f32)?, 2),
        "bf16" => (timings::<bf16>(&args, bf16::from_f32)?, 2),
        other => bail!("unknown --dtype `{other}` (expected f32, f16 or bf16)"),
    };
    let machine = before.best_with(&Roofline::measure());
    let mut results = Vec::new();
    if !args.output.json {
        println!("{machine}");
    }
    for (s, &out) in args.outs.iter().enumerate() {
        for (r, &rows) in args.rows.iter().enumerate() {
            let seconds = best[s * args.rows.len() + r];
            let bytes = (out * args.k * bytes_per_weight) as f64;
            let flops = 2.0 * (rows * out * args.k) as f64;
            let limit = machine.seconds(bytes, flops, 0.0);
            let (us, gb_s, efficiency) = (seconds * 1e6, bytes / seconds / 1e9, limit / seconds);
            let bound = machine.bound(bytes, flops, 0.0);
            let of_fma_peak = flops / seconds / 1e9 / machine.fma_gflop_s;
            if !args.output.json {
                println!(
                    "{} out {out:>6} rows {rows:>2}: {us:9.1} us per product, {gb_s:5.1} GB/s, \
                     roofline {:8.1} us ({bound}), efficiency {efficiency:.2}, \
                     {of_fma_peak:.2} of the FMA peak",
                    args.dtype,
                    limit * 1e6
                );
            }
            results.push(serde_json::json!({
                "dtype": args.dtype, "out": out, "k": args.k, "rows": rows,
                "weight_mb": bytes / 1e6, "us": us, "gb_s": gb_s,
                "roofline_us": limit * 1e6, "bound": bound, "efficiency": efficiency,
                "of_fma_peak": of_fma_peak,
            }));
        }
    }
    if args.output.json {
        let report = serde_json::json!({ "machine": machine, "products": results });
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}
