//! Writes the seed corpora of the fuzz targets (`fuzz/`): small generated model files of every
//! kind, and the real model's metadata and chat template when the model is in the cache.
//!
//! ```text
//! cargo run --release --features train --example fuzz_seeds -- fuzz/corpus
//! ```
//! Each target gets `OUT/<target>/<seed name>`; `scripts/fuzz.sh` runs this before a campaign.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use eesd::models::fetch;

#[derive(Parser, Debug)]
struct Args {
    /// Output directory (one sub-directory per target).
    out: PathBuf,
    /// Model file whose metadata seeds the GGUF and chat-template corpora (default: the cached
    /// SmolLM2 when present; nothing is fetched).
    #[arg(long)]
    model: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let model = args
        .model
        .or_else(|| Some(fetch::cached_smollm2()).filter(|p| p.exists()));
    let real = model
        .as_ref()
        .map(|p| std::fs::read(p).with_context(|| p.display().to_string()))
        .transpose()?;
    let mut corpora = Vec::new();
    for target in eesd::models::fuzz::TARGETS {
        corpora.push((target, eesd::models::fuzz::seeds(target, real.as_deref())?));
    }
    corpora.push(("train_state", eesd::train::fuzz::seeds()?));
    for (target, seeds) in corpora {
        let dir = args.out.join(target);
        std::fs::create_dir_all(&dir)?;
        for (name, bytes) in seeds {
            std::fs::write(dir.join(&name), &bytes)?;
            println!("{target}/{name}: {} bytes", bytes.len());
        }
    }
    Ok(())
}
