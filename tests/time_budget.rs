//! `train_exit_head --time-budget`: a run whose budget is spent is re-planned to end early,
//! with its schedule, metadata and saved state saying where it ended, and a resumed run with
//! a larger `--steps` continues it.

use std::path::Path;
use std::process::Output;

mod common;
use common::{run_train_exit_head, tiny_model, write_prompts};

fn run(model: &Path, prompts: &Path, out: &Path, extra: &[&str]) -> Output {
    let tiny = [
        "--exit-layer",
        "1",
        "--num-prompts",
        "8",
        "--answer-tokens",
        "12",
        "--held-out",
        "2",
        "--vocab",
        "48",
    ];
    run_train_exit_head(model, prompts, out, &[&tiny[..], extra].concat())
}

fn schedule(prefix: &Path, field: &str) -> u64 {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(prefix.with_extension("json")).unwrap())
            .unwrap();
    meta["training"]["distill"][field].as_u64().unwrap()
}

fn total_steps(prefix: &Path) -> u64 {
    schedule(prefix, "total_steps")
}

fn warmup_steps(prefix: &Path) -> u64 {
    schedule(prefix, "warmup_steps")
}

#[test]
fn a_spent_time_budget_ends_the_run_early_and_resume_continues_it() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 5);
    let prompts = dir.path().join("prompts.jsonl");
    write_prompts(&prompts, (0..8).map(|i| format!("Name {i} colours.")));
    let out = dir.path().join("head");

    // A zero budget is spent from the start: the step time is known after 8 steps, and the
    // run ends one step later instead of at step 100, its 5-step warm-up shrunk to a
    // twentieth of 9 steps (none).
    let first = run(
        &model,
        &prompts,
        &out,
        &["--steps", "100", "--time-budget", "0"],
    );
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert_eq!(total_steps(&out), 9);
    assert_eq!(warmup_steps(&out), 0);
    let result: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&first.stdout).trim()).unwrap();
    assert!(result["after"]["top1_agreement"].is_number());

    // An ample budget leaves the plan alone; resuming with more steps continues the run.
    let more = run(
        &model,
        &prompts,
        &out,
        &["--steps", "12", "--time-budget", "3600", "--resume"],
    );
    assert!(
        more.status.success(),
        "{}",
        String::from_utf8_lossy(&more.stderr)
    );
    assert_eq!(total_steps(&out), 12);
    assert!(String::from_utf8_lossy(&more.stderr).contains("resuming at step 9"));

    // A budget that is no number of seconds is refused before anything is written.
    for bad in ["nan", "inf", "-1"] {
        let other = dir.path().join("other");
        let budget = format!("--time-budget={bad}");
        let refused = run(&model, &prompts, &other, &["--steps", "20", &budget]);
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(
            !refused.status.success() && stderr.contains("give a number of seconds"),
            "{stderr}"
        );
        assert!(!other.with_extension("safetensors").exists());
    }
}
