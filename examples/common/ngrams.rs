//! The n-gram store of `+ngrams` tree methods, built from an answers file: the JSON lines
//! `train_exit_head` writes (`OUT.data.jsonl`: `{"tokens": [...], "prompt_len": n, ...}`), of
//! which the answer tokens (after `prompt_len`) are the corpus.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use eesd::core::drafters::NgramStore;

#[derive(serde::Deserialize)]
struct Line {
    tokens: Vec<u32>,
    #[serde(default)]
    prompt_len: usize,
}

/// The store of the answers in `path`, checked against a vocabulary of `vocab` tokens. A last
/// line without its newline that does not parse is what a killed `train_exit_head` leaves
/// behind: it is skipped with a warning (and the file left as it is: a run may be appending).
pub fn load(path: &Path, vocab: usize) -> Result<Arc<NgramStore>> {
    let started = std::time::Instant::now();
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("n-gram corpus {}", path.display()))?;
    let mut answers = Vec::new();
    for (i, line) in text.split_inclusive('\n').enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed: serde_json::Result<Line> = serde_json::from_str(line);
        let Line { tokens, prompt_len } = match parsed {
            Ok(line) => line,
            Err(e) if !line.ends_with('\n') => {
                eprintln!(
                    "n-gram store: skipping the torn last line {} of {} ({e})",
                    i + 1,
                    path.display()
                );
                break;
            }
            Err(e) => return Err(e).with_context(|| format!("{} line {}", path.display(), i + 1)),
        };
        answers.push(tokens[prompt_len.min(tokens.len())..].to_vec());
    }
    let store = NgramStore::from_sequences(answers.iter().map(Vec::as_slice));
    store.check_vocab(vocab)?;
    eprintln!(
        "n-gram store: {} contexts from {} answer tokens of {} in {:.1} s",
        store.contexts(),
        store.corpus_tokens(),
        path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(Arc::new(store))
}
