//! The head shipped in `assets/heads` loads for the real model and keeps EESD lossless:
//! greedy EESD with it is token-identical to AR on Spec-Bench questions, for several policies.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use eesd::bandit::Policy;
use eesd::core::{Backend, GenerationConfig, Generator, Mode};
use eesd::models::{HeadKind, LoadOptions, LoadedModel, fetch};
use eesd::models::{file_sha256, load_layer_head, read_metadata};

#[derive(serde::Deserialize)]
struct Question {
    category: String,
    turns: Vec<String>,
}

/// One question from each of the first `n` categories of the benchmark file.
fn questions(n: usize) -> Vec<Question> {
    let shared = std::env::var_os("EESD_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared"));
    let text = std::fs::read_to_string(shared.join("data/spec_bench.jsonl")).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    text.lines()
        .map(|l| serde_json::from_str::<Question>(l).unwrap())
        .filter(|q| seen.insert(q.category.clone()))
        .take(n)
        .collect()
}

#[test]
fn shipped_head_is_lossless_on_the_real_model() {
    let meta = read_metadata(Path::new(eesd::SHIPPED_HEAD)).unwrap();
    let path = fetch::resolve_model(None).unwrap();
    assert_eq!(meta.base_model_sha256, file_sha256(&path).unwrap());
    let device = Backend::default_compiled().unwrap().device().unwrap();
    let options = LoadOptions {
        context_length: Some(4096),
        ..Default::default()
    };
    let lm = LoadedModel::load(&path, &device, &options).unwrap();
    let (head, meta) = load_layer_head(
        Path::new(eesd::SHIPPED_HEAD),
        &lm.model,
        Some(&meta.base_model_sha256),
    )
    .unwrap();
    assert!(matches!(head.kind(), HeadKind::Layer | HeadKind::Adapter));
    assert!(
        head.token_ids().is_some(),
        "the shipped head drafts over a vocabulary subset"
    );

    let eos: Vec<u32> = lm.tokenizer.eos_token_id().into_iter().collect();
    let base = GenerationConfig {
        max_new_tokens: 64,
        stop_tokens: eos,
        ..Default::default()
    };
    let mut ar = Generator::new(&lm.model);
    let policies = ["fixed:3", "cost-ts", "beta-ts"];
    let mut generators: Vec<_> = policies
        .iter()
        .map(|p| {
            Generator::new(&lm.model)
                .with_head(&head)
                .with_policy(Policy::parse(p, 7).unwrap())
        })
        .collect();
    let mut drafted = 0;
    for q in questions(6) {
        let prompt = lm.chat_prompt(&q.turns[0]).unwrap();
        let want = ar
            .generate(&prompt, &base, |_| ControlFlow::Continue(()))
            .unwrap();
        for (policy, g) in policies.iter().zip(generators.iter_mut()) {
            let config = GenerationConfig {
                mode: Mode::Eesd,
                exit_layer: Some(meta.exit_layer),
                ..base.clone()
            };
            let got = g
                .generate(&prompt, &config, |_| ControlFlow::Continue(()))
                .unwrap();
            assert_eq!(got.tokens, want.tokens, "{} with {policy}", q.category);
            drafted += got.stats.drafted;
        }
    }
    assert!(drafted > 0, "the fixed policy drafts");
}
