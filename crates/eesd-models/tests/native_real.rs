//! Native quantized weights on the real model (Q4_1 layers, Q8_0 embedding, run by the
//! quantized kernel with 8-bit activations): close to the f32 reference, lossless for EESD and
//! tree speculation (greedy output token-identical to greedy AR with the same weights) on the
//! golden prompts and 20 Spec-Bench questions × `identity_tokens()` new tokens (64; more with
//! `EESD_IDENTITY_TOKENS`), and small in memory.

mod common;

use std::ops::ControlFlow;

use common::*;
use eesd_bandit::Policy;
use eesd_core::DraftHead;
use eesd_core::drafters::DrafterSpec;
use eesd_core::{GenerationConfig, GenerationOutput, Generator, Mode};
use eesd_models::{LoadedModel, NormHead, VocabSubset, WeightDType};

fn native() -> &'static LoadedModel {
    model_in(WeightDType::Native)
}

fn ar(prompt: &[u32], config: &GenerationConfig) -> GenerationOutput {
    Generator::new(&native().model)
        .generate(prompt, config, |_| ControlFlow::Continue(()))
        .unwrap()
}

#[test]
fn native_weights_stay_in_their_blocks() {
    let m = &native().model;
    let file = std::fs::metadata(&native().source).unwrap().len() as f64;
    let held = m.weight_bytes() as f64;
    // The file's blocks plus f32 norm gains; nothing dense.
    assert!(
        held <= 1.01 * file,
        "{held} bytes held for a {file}-byte file"
    );
    assert!(m.native_lm_head().is_some());
}

#[test]
fn a_subset_projection_gives_the_model_logits_of_its_tokens_bit_for_bit() {
    // With native weights a head projects with the LM head's own quantized rows.
    let m = &native().model;
    let vocab = m.config().vocab_size as u32;
    let ids: Vec<u32> = (0..600).map(|i| (i * 7919 + 11) % vocab).collect();
    let head =
        NormHead::with_vocab(m, &VocabSubset::new(ids.clone(), vocab as usize).unwrap()).unwrap();
    let prompt = &golden()[0].prompt_ids;
    let hidden = m
        .forward_layers(m.embed(prompt).unwrap(), 0..30, &mut m.new_cache())
        .unwrap();
    let full = m.logits(hidden.clone());
    let drafted = head.draft_logits(m, hidden, &mut 0).unwrap();
    for i in 0..prompt.len() {
        let (want, got) = (row(&full, i), row(&drafted.logits, i));
        for (j, &id) in ids.iter().enumerate() {
            assert_eq!(
                got[j].to_bits(),
                want[id as usize].to_bits(),
                "row {i} token {id}"
            );
        }
    }
}

#[test]
fn native_logits_are_close_to_the_f32_reference() {
    let m = &native().model;
    for g in golden() {
        let logits = m.forward(&g.prompt_ids, &mut m.new_cache()).unwrap();
        let last = row(&logits, g.prompt_ids.len() - 1);
        let (top_id, top_value) = g.last_logits_top5[0];
        let second = g.last_logits_top5[1].1;
        // 8-bit activations move logits by up to a few percent (0.6 of 25 measured); a clear
        // winner stays.
        if top_value - second > 1.0 {
            assert_eq!(argmax(&last), top_id, "{:?}", g.text);
        }
        for &(id, value) in &g.last_logits_top5 {
            let got = last[id as usize];
            let tol = 0.04 * value.abs() + 0.1;
            assert!(
                (got - value).abs() < tol,
                "{:?}: logit {id} {got} vs {value}",
                g.text
            );
        }
    }
}

#[test]
fn greedy_speculation_is_token_identical_to_ar_with_native_weights() {
    let m = native();
    let vocab = m.model.config().vocab_size;
    let mut tree =
        Generator::new(&m.model).with_drafter("opt@8".parse::<DrafterSpec>().unwrap().build(vocab));
    let mut prompts: Vec<Vec<u32>> = golden().into_iter().map(|g| g.prompt_ids).collect();
    prompts.extend(
        spec_bench(20)
            .iter()
            .map(|q| m.chat_prompt(&q.turns[0]).unwrap()),
    );
    let layers = [4, 8, 12, 20];
    for (i, prompt) in prompts.iter().enumerate() {
        let base = greedy_config(identity_tokens());
        let want = ar(prompt, &base);
        let eesd_config = GenerationConfig {
            mode: Mode::Eesd,
            exit_layer: Some(layers[i % layers.len()]),
            ..base.clone()
        };
        let policy = POLICIES[i % POLICIES.len()];
        let eesd = Generator::new(&m.model)
            .with_head(&NormHead::new())
            .with_policy(Policy::parse(policy, 5).unwrap())
            .generate(prompt, &eesd_config, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(eesd.tokens, want.tokens, "prompt {i}, EESD {policy}");
        let tree_config = GenerationConfig {
            mode: Mode::Tree,
            tree_budget: 8,
            ..base
        };
        let out = tree
            .generate(prompt, &tree_config, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(out.tokens, want.tokens, "prompt {i}, tree opt@8");
    }
}
