//! Training prompts for the examples: jsonl with a `prompt` field per line (blank lines
//! skipped), never benchmark questions.

use std::path::Path;

use anyhow::{Context, Result};

/// The first `n` prompts of `path`.
pub fn load(path: &Path, n: usize) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading prompts {}", path.display()))?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .enumerate()
        .map(|(i, l)| {
            let v: serde_json::Value = serde_json::from_str(l)
                .with_context(|| format!("{} line {}", path.display(), i + 1))?;
            v["prompt"]
                .as_str()
                .map(str::to_owned)
                .with_context(|| format!("{} line {} has no prompt", path.display(), i + 1))
        })
        .collect()
}
