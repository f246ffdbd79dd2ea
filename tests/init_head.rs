//! `train_exit_head --init-head`: training continues from a saved head (its weights and draft
//! vocabulary) instead of a copy of a model layer, and a head that does not fit the run is
//! refused with a clear message.

use std::path::Path;
use std::process::Output;

mod common;
use common::{run_train_exit_head, tiny_model, write_prompts};

fn run(model: &Path, prompts: &Path, out: &Path, extra: &[&str]) -> Output {
    let tiny = [
        "--exit-layer",
        "1",
        "--num-prompts",
        "12",
        "--answer-tokens",
        "16",
        "--held-out",
        "3",
    ];
    run_train_exit_head(model, prompts, out, &[&tiny[..], extra].concat())
}

fn metadata(prefix: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(prefix.with_extension("json")).unwrap()).unwrap()
}

#[test]
fn training_continues_from_a_saved_head_and_refuses_one_that_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 3);
    let prompts = dir.path().join("prompts.jsonl");
    write_prompts(&prompts, (0..12).map(|i| format!("Count to {i}, please.")));
    let data = dir.path().join("answers.jsonl");
    let data = data.to_str().unwrap();

    let first = dir.path().join("first");
    // The first head starts from layer 0, so that it differs from the layer (1) a fresh head at
    // exit layer 1 copies.
    let first_args = [
        "--init-layer",
        "0",
        "--steps",
        "20",
        "--vocab",
        "48",
        "--data",
        data,
    ];
    let out = run(&model, &prompts, &first, &first_args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first_meta = metadata(&first);

    // The continued run starts where the first one ended (its weights, saved in f16), not
    // from the model's layer, and keeps the saved draft vocabulary (not `--vocab`'s 64).
    let second = dir.path().join("second");
    let init = [
        "--init-head",
        first.to_str().unwrap(),
        "--steps",
        "2",
        "--lr",
        "1e-7",
    ];
    let out = run(
        &model,
        &prompts,
        &second,
        &[&init[..], &["--data", data]].concat(),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let second_meta = metadata(&second);
    assert_eq!(second_meta["vocab_subset"], first_meta["vocab_subset"]);
    assert_eq!(
        second_meta["vocab_subset"].as_array().map(Vec::len),
        Some(48)
    );
    let loaded = eesd::models::LoadedModel::load(
        &model,
        &eesd::core::Backend::Flex.device().unwrap(),
        &Default::default(),
    )
    .unwrap();
    let wqkv = |prefix: &Path| -> Vec<f32> {
        let (head, _) = eesd::models::load_layer_head(prefix, &loaded.model, None).unwrap();
        head.weights()
            .layer
            .wqkv
            .val()
            .into_data()
            .try_into_vec::<f32>()
            .unwrap()
    };
    let model_layer: Vec<f32> = loaded.model.layers()[1]
        .wqkv
        .val()
        .into_data()
        .try_into_vec::<f32>()
        .unwrap();
    let (a, b) = (wqkv(&first), wqkv(&second));
    let most = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    };
    assert!(
        most(&a, &b) < 1e-3,
        "moved {} from the saved head",
        most(&a, &b)
    );
    assert!(most(&b, &model_layer) > 1e-2, "still the model's layer");
    assert_eq!(
        second_meta["training"]["init_head"].as_str(),
        first.to_str()
    );

    // Another kind of head, another exit layer, another model file: refused, nothing written.
    let other_model = dir.path().join("other.gguf");
    eesd::models::testing::write_tiny_gguf(&other_model, &eesd::models::testing::tiny_config(), 4)
        .unwrap();
    for (model, extra, says) in [
        (
            &model,
            &["--head", "adapter"][..],
            "`layer` head at layer 1",
        ),
        (
            &model,
            &["--exit-layer", "2"][..],
            "this run trains a `layer` head at layer 2",
        ),
        (&other_model, &[][..], "sha256"),
    ] {
        let refused = dir.path().join("refused");
        let args = [&init[..], &["--data", data], extra].concat();
        let out = run(model, &prompts, &refused, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{stderr}");
        assert!(!refused.with_extension("safetensors").exists());
    }
}
