//! Arguments that would measure nothing or divide by zero are refused (or mean "never") in the
//! example binaries instead of panicking or printing NaN ratios.

use std::process::Command;

mod common;
use common::{example, tiny_model, train_exit_head, write_prompts};

#[test]
fn zero_counts_are_refused_with_a_message() {
    for (bin, args) in [
        ("spec_bench", ["--per-category", "0"]),
        ("spec_bench", ["--max-new-tokens", "0"]),
        ("eval_exit_head", ["--levels", "0"]),
        ("eval_exit_head", ["--max-new-tokens", "0"]),
        ("block_cost", ["--reps", "0"]),
    ] {
        let out = Command::new(example(bin)).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bin} {args:?}: {stderr}");
        assert!(
            stderr.contains("must be at least 1"),
            "{bin} {args:?}: {stderr}"
        );
    }
}

#[test]
fn a_question_file_that_yields_no_question_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    // Refused before any model is loaded.
    let out = Command::new(example("spec_bench"))
        .arg("--questions")
        .arg(&empty)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("no questions chosen"), "{stderr}");
}

#[test]
fn eval_every_zero_evaluates_only_before_and_after() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 3);
    let prompts = dir.path().join("prompts.jsonl");
    write_prompts(&prompts, (0..6).map(|i| format!("Count to {i}.")));
    let out = dir.path().join("head");
    // `run_train_exit_head` would pass its own `--eval-every`.
    let run = Command::new(train_exit_head())
        .arg("--model")
        .arg(&model)
        .arg("--prompts")
        .arg(&prompts)
        .arg("--out")
        .arg(&out)
        .args([
            "--exit-layer",
            "1",
            "--num-prompts",
            "6",
            "--answer-tokens",
            "8",
        ])
        .args([
            "--held-out",
            "2",
            "--vocab",
            "48",
            "--context-length",
            "128",
        ])
        .args(["--steps", "3", "--save-every", "0", "--eval-every", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(
        !stderr.contains("step 1:") && !stderr.contains("step 2:"),
        "{stderr}"
    );
    assert!(out.with_extension("safetensors").exists(), "{stderr}");
}
