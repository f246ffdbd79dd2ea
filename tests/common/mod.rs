//! Helpers shared by the integration tests that run example binaries.
// Each test crate compiles this module and uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The example binary `name` that `cargo test` built beside the running test
/// (`target/<profile>/examples/`).
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is built by `cargo test --features train`",
        path.display()
    );
    path
}

/// The `train_exit_head` example binary.
pub fn train_exit_head() -> PathBuf {
    example("train_exit_head")
}

/// Runs `train_exit_head` on `model` and `prompts` into the prefix `out`, with the settings of a
/// quick tiny-model run (no evaluation or state saving during it, a 128-token context) and then
/// `args`.
pub fn run_train_exit_head(model: &Path, prompts: &Path, out: &Path, args: &[&str]) -> Output {
    Command::new(train_exit_head())
        .arg("--model")
        .arg(model)
        .arg("--prompts")
        .arg(prompts)
        .arg("--out")
        .arg(out)
        .args(["--eval-every", "1000", "--save-every", "0"])
        .args(["--context-length", "128"])
        .args(args)
        .output()
        .unwrap()
}

/// Writes the tiny test model (`tiny_config`, weights drawn from `seed`) to `dir/tiny.gguf`.
pub fn tiny_model(dir: &Path, seed: u64) -> PathBuf {
    let model = dir.join("tiny.gguf");
    eesd::models::testing::write_tiny_gguf(&model, &eesd::models::testing::tiny_config(), seed)
        .unwrap();
    model
}

/// Writes `prompts` to `path` as a prompt file (`{"prompt": ...}` lines).
pub fn write_prompts(path: &Path, prompts: impl IntoIterator<Item = String>) {
    let lines: Vec<String> = prompts
        .into_iter()
        .map(|p| serde_json::json!({ "prompt": p }).to_string() + "\n")
        .collect();
    std::fs::write(path, lines.concat()).unwrap();
}
