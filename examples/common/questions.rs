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

/// The first `per_category` questions of each category, in file order.
pub fn load(path: &Path, per_category: usize) -> Result<Vec<Question>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let all: Vec<Question> = text
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .with_context(|| format!("{}", path.display()))?;
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    Ok(all
        .into_iter()
        .filter(|q| {
            let n = seen.entry(q.category.clone()).or_default();
            *n += 1;
            *n <= per_category
        })
        .collect())
}
