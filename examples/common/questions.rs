//! Spec-Bench questions for the examples: the first ones of each category.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Deserialize;

/// One Spec-Bench question (jsonl with question_id, category, turns).
#[derive(Deserialize)]
pub struct Question {
    pub question_id: u64,
    pub category: String,
    pub turns: Vec<String>,
}

/// The first `per_category` questions of each category (of `categories` only, unless it is
/// empty), in file order. A category named there but absent from the file, or choosing no
/// question at all, is an error.
pub fn load(path: &Path, per_category: usize, categories: &[String]) -> Result<Vec<Question>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading questions {}", path.display()))?;
    let all: Vec<Question> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .with_context(|| format!("parsing questions {}", path.display()))?;
    if let Some(missing) = categories
        .iter()
        .find(|c| !all.iter().any(|q| &q.category == *c))
    {
        anyhow::bail!("no category {missing:?} in {}", path.display());
    }
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let chosen: Vec<Question> = all
        .into_iter()
        .filter(|q| categories.is_empty() || categories.contains(&q.category))
        .filter(|q| {
            let n = seen.entry(q.category.clone()).or_default();
            *n += 1;
            *n <= per_category
        })
        .collect();
    if chosen.is_empty() {
        anyhow::bail!(
            "no questions chosen from {} (per category: {per_category})",
            path.display()
        );
    }
    Ok(chosen)
}
