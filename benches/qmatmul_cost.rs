//! The quantized product alone (`QuantMatrix`, native weights): one forward's worth of
//! SmolLM2-135M's layer matrices against blocks of activation rows, against the machine's
//! roofline measured in the same run.
//!
//! ```text
//! cargo bench --bench qmatmul_cost -- [--rows 1,2,4,8,16,32] [--format q4_1] [--resident] [--threads N] [--json]
//! ```
//! Per layer: the fused q/k/v projection (960 × 576), the output projection (576 × 576), the
//! fused gate/up projection (3072 × 576) and the down projection (576 × 1536), in `--format`
//! with deterministic codes and scales. By default every layer has matrices of its own, so the
//! weights stream from memory as in a forward pass; with `--resident` one layer's matrices serve
//! every layer, so they come from the caches and the time is the kernel's arithmetic. A block of
//! `r` rows does `r` multiply-adds per weight (2 int8 operations each). Time is the best of
//! `--reps` passes, the row counts taken round in turn. With `--threads` below the machine's
//! cores, the roofline's arithmetic peak is that share of the measured one.

#[path = "common/output.rs"]
mod output;

use anyhow::{Result, bail};
use clap::Parser;
use eesd::models::cpu::{Isa, Pool, QuantFormat, QuantMatrix, Roofline, roofline};
use std::time::Instant;

/// `(output rows, inner dimension)` of one layer's products.
const SHAPES: [(usize, usize); 4] = [(960, 576), (576, 576), (3072, 576), (576, 1536)];

/// [`SHAPES`] for `format`: K-quants' blocks hold 256 weights, so an inner dimension of 576
/// becomes 768.
fn shapes(format: QuantFormat) -> [(usize, usize); 4] {
    SHAPES.map(|(out, k)| (out, k.next_multiple_of(format.block_len())))
}

#[derive(Parser, Debug)]
struct Args {
    /// Activation rows per product.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    rows: Vec<usize>,
    /// Weight format: q4_0, q4_1, q8_0, q4_k or q6_k (K-quants need `k` a multiple of 256:
    /// SmolLM2's 576 is not, so their shapes round `k` up to 768 and 1536).
    #[arg(long, default_value = "q4_1")]
    format: String,
    /// Layers per pass.
    #[arg(long, default_value_t = 30)]
    layers: usize,
    /// One layer's matrices for every layer (weights from the caches).
    #[arg(long)]
    resident: bool,
    /// Threads (default: the kernels' pool, one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Timed passes per row count (the best counts).
    #[arg(long, default_value_t = 20)]
    reps: usize,
    #[command(flatten)]
    output: output::Output,
}

/// `blocks` GGUF blocks of `format` with pseudo-random codes and small positive scales.
fn blocks(format: QuantFormat, blocks: usize, seed: u32) -> Vec<u8> {
    let bytes = format.block_bytes();
    let mut data = vec![0u8; blocks * bytes];
    let mut h = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    for block in data.chunks_exact_mut(bytes) {
        for b in block.iter_mut() {
            h = h.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            *b = (h >> 24) as u8;
        }
        // f16 scale 2⁻⁷ (and for Q4_1 an offset of −2⁻⁷, for Q4_K a minimum of 2⁻¹⁰) where
        // the format keeps them.
        match format {
            QuantFormat::Q6K => block[208..].copy_from_slice(&0x2000u16.to_le_bytes()),
            _ => block[..2].copy_from_slice(&0x2000u16.to_le_bytes()),
        }
        match format {
            QuantFormat::Q4_1 => block[2..4].copy_from_slice(&0xa000u16.to_le_bytes()),
            QuantFormat::Q4K => block[2..4].copy_from_slice(&0x1400u16.to_le_bytes()),
            _ => {}
        }
    }
    data
}

fn main() -> Result<()> {
    let args = Args::parse();
    let format = match args.format.to_ascii_lowercase().as_str() {
        "q4_0" => QuantFormat::Q4_0,
        "q4_1" => QuantFormat::Q4_1,
        "q8_0" => QuantFormat::Q8_0,
        "q4_k" => QuantFormat::Q4K,
        "q6_k" => QuantFormat::Q6K,
        other => bail!("unknown format `{other}` (expected q4_0, q4_1, q8_0, q4_k or q6_k)"),
    };
    let own_pool = args.threads.map(|t| Pool::new(t.max(1)));
    let pool = own_pool.as_ref().unwrap_or(Pool::global());
    let isa = Isa::detect();
    let before = Roofline::measure();
    let distinct = if args.resident { 1 } else { args.layers };
    let shapes = shapes(format);
    let mut matrices = Vec::new();
    for layer in 0..distinct {
        for (i, &(out, k)) in shapes.iter().enumerate() {
            let blocks_n = out * k / format.block_len();
            let data = blocks(format, blocks_n, (layer * shapes.len() + i) as u32);
            matrices.push(QuantMatrix::new(format, data, out, k)?);
        }
    }
    let repeats = args.layers / distinct;
    let widest = shapes.iter().map(|s| s.0.max(s.1)).max().unwrap_or(0);
    let macs_per_row = (shapes.iter().map(|&(o, k)| o * k).sum::<usize>() * args.layers) as f64;
    let bytes = (matrices.iter().map(QuantMatrix::bytes).sum::<usize>() * repeats) as f64;
    // Each row count's activations and outputs, made once.
    let mut io: Vec<(usize, Vec<f32>, Vec<f32>)> = (args.rows.iter())
        .map(|&rows| {
            let x = (0..rows * widest)
                .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
                .collect();
            (rows, x, vec![0f32; rows * widest])
        })
        .collect();
    let mut best = vec![f64::MAX; args.rows.len()];
    for _ in 0..args.reps.max(1) {
        for ((rows, x, y), best) in io.iter_mut().zip(&mut best) {
            let rows = *rows;
            let start = Instant::now();
            for _ in 0..repeats {
                for m in &matrices {
                    let (out, k) = (m.out(), m.k());
                    m.matmul_with(isa, pool, &x[..rows * k], &mut y[..rows * out])?;
                }
            }
            *best = best.min(start.elapsed().as_secs_f64());
        }
    }
    let mut machine = before.best_with(&Roofline::measure());
    // Fewer threads than the probes used have that share of the arithmetic peak.
    if pool.threads() < machine.threads {
        machine.int8_gop_s *= pool.threads() as f64 / machine.threads as f64;
        machine.fma_gflop_s *= pool.threads() as f64 / machine.threads as f64;
        machine.threads = pool.threads();
    }
    if !args.output.json {
        println!("{machine}");
        println!(
            "{format}, {} layers ({}), {} threads",
            args.layers,
            if args.resident {
                "resident"
            } else {
                "streamed"
            },
            pool.threads()
        );
    }
    let mut results = Vec::new();
    for (&rows, &seconds) in args.rows.iter().zip(&best) {
        let macs = macs_per_row * rows as f64;
        // Resident weights come from the caches: only the arithmetic bounds them.
        let streamed = if args.resident { 0.0 } else { bytes };
        let limit = machine.seconds(streamed, 0.0, 2.0 * macs);
        let (gmacs, efficiency) = (macs / seconds / 1e9, limit / seconds);
        if !args.output.json {
            println!(
                "rows {rows:2}: {:7.3} ms ({gmacs:6.1} G multiply-adds/s, {:5.1} GB/s), roofline {:6.3} ms, efficiency {efficiency:.2}",
                seconds * 1e3,
                bytes / seconds / 1e9,
                limit * 1e3,
            );
        }
        results.push(serde_json::json!({
            "rows": rows, "ms": seconds * 1e3, "gmac_s": gmacs, "bytes": bytes,
            "roofline_ms": limit * 1e3, "efficiency": efficiency,
        }));
    }
    if args.output.json {
        println!(
            "{}",
            serde_json::json!({
                "cpu": roofline::cpu_name(), "machine": machine, "format": format.to_string(),
                "layers": args.layers, "resident": args.resident, "threads": pool.threads(),
                "isa": isa.name(), "results": results,
            })
        );
    }
    Ok(())
}
