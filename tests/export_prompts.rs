//! Answers made elsewhere: `train_exit_head --export-prompts` writes the chat prompts' token ids
//! (what `scripts/torch_answers.py` answers on a GPU), and a run given a data file that already
//! holds every wanted answer (greedy and sampled) trains on it without answering anything.

use std::path::Path;

mod common;
use common::{run_train_exit_head, tiny_model, write_prompts};

#[test]
fn exported_prompts_answered_elsewhere_are_trained_on_as_they_are() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 3);
    let prompts = dir.path().join("prompts.jsonl");
    let texts: Vec<String> = (0..8).map(|i| format!("Count to {i}, please.")).collect();
    write_prompts(&prompts, texts.clone());
    let out = dir.path().join("head");

    let ids = dir.path().join("ids.jsonl");
    let run = |args: &[&str]| {
        let result = run_train_exit_head(&model, &prompts, &out, args);
        assert!(
            result.status.success(),
            "{}",
            String::from_utf8_lossy(&result.stderr)
        );
    };
    run(&[
        "--exit-layer",
        "1",
        "--num-prompts",
        "6",
        "--export-prompts",
        ids.to_str().unwrap(),
    ]);
    assert!(
        !out.with_extension("data.jsonl").exists(),
        "exporting answers nothing"
    );

    // The ids are the chat prompts the trainer itself would answer, first `--num-prompts` only.
    let loaded = eesd::models::LoadedModel::load(
        &model,
        &eesd::core::Backend::Flex.device().unwrap(),
        &Default::default(),
    )
    .unwrap();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&ids)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["prompt"], i);
        let want = loaded.chat_prompt(&texts[i]).unwrap();
        let got: Vec<u32> = serde_json::from_value(line["tokens"].clone()).unwrap();
        assert_eq!(got, want, "prompt {i}");
    }

    // Answer them "elsewhere" (a fixed made-up continuation per sample) and train on them.
    let data = dir.path().join("answers.jsonl");
    let mut answers = String::new();
    for sample in 0..2u32 {
        for line in &lines {
            let mut tokens: Vec<u32> = serde_json::from_value(line["tokens"].clone()).unwrap();
            let prompt_len = tokens.len();
            tokens.extend([5 + sample, 6, 7 + sample]);
            let record = serde_json::json!({
                "prompt": line["prompt"], "sample": sample, "tokens": tokens, "prompt_len": prompt_len
            });
            answers += &(record.to_string() + "\n");
        }
    }
    std::fs::write(&data, &answers).unwrap();
    run(&[
        "--exit-layer",
        "1",
        "--num-prompts",
        "6",
        "--held-out",
        "2",
        "--sampled",
        "1",
        "--steps",
        "4",
        "--vocab",
        "32",
        "--data",
        data.to_str().unwrap(),
    ]);
    assert_eq!(
        std::fs::read_to_string(&data).unwrap(),
        answers,
        "every wanted answer was there: none is generated"
    );
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.with_extension("json")).unwrap())
            .unwrap();
    // 4 prompts trained on, two answers each (the held-out prompts' answers never are).
    assert_eq!(meta["training"]["sequences"], 10, "{meta}");
    assert!(Path::new(&out.with_extension("safetensors")).exists());
}
