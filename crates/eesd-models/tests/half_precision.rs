//! Every weight dtype on the real model: a block forward gives its rows' logits bit for bit (the
//! kernels' batch invariance, which lossless verification rests on), and greedy EESD is
//! token-identical to greedy AR with f16 and bf16 weights, on the golden prompts and 20
//! Spec-Bench questions.

mod common;

use std::ops::ControlFlow;

use common::*;
use eesd_bandit::Policy;
use eesd_core::{DraftHead, GenerationConfig, GenerationOutput, Generator, Mode};
use eesd_models::{Llama, LoadedModel, NormHead, WeightDType};

fn logits_of(m: &LoadedModel, prefix: &[u32], block: &[u32], one_at_a_time: bool) -> Vec<f32> {
    let mut cache = m.model.new_cache();
    m.model.forward(prefix, &mut cache).unwrap();
    let blocks: Vec<&[u32]> = if one_at_a_time {
        block.chunks(1).collect()
    } else {
        vec![block]
    };
    let mut out = Vec::new();
    for b in blocks {
        let logits = m.model.forward(b, &mut cache).unwrap();
        out.extend(
            logits
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .unwrap(),
        );
    }
    out
}

#[test]
fn a_block_forward_equals_its_rows_bit_for_bit_in_every_dtype() {
    let g = &golden()[1];
    // Block sizes a verification sends: a chain of a few drafts, a tree, the kernel's row-group
    // boundaries (6 and 12 rows) crossed.
    let mut continuation = g.greedy_ids.clone();
    continuation.extend(&g.prompt_ids);
    for dtype in WeightDType::ALL {
        let m = model_in(dtype);
        for size in [2, 7, 13, 40] {
            let block = &continuation[..size];
            let rows = logits_of(m, &g.prompt_ids, block, true);
            let whole = logits_of(m, &g.prompt_ids, block, false);
            assert_eq!(rows.len(), whole.len());
            if on_flex() {
                let differing = rows
                    .iter()
                    .zip(&whole)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(differing, 0, "{dtype}, block of {size}: logits differ");
            } else {
                let diff = rows
                    .iter()
                    .zip(&whole)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(diff < 5e-2, "{dtype}, block of {size}: {diff}");
            }
        }
    }
}

fn generate<H: DraftHead<Llama>>(
    m: &LoadedModel,
    head: &H,
    policy: &str,
    prompt: &[u32],
    config: &GenerationConfig,
) -> GenerationOutput {
    let mut g = Generator::new(&m.model)
        .with_head(head)
        .with_policy(Policy::parse(policy, 11).unwrap());
    g.generate(prompt, config, |_| ControlFlow::Continue(()))
        .unwrap()
}

#[test]
fn greedy_eesd_is_token_identical_to_ar_with_f16_and_bf16_weights() {
    let layers = [4, 8, 12, 20];
    for dtype in [WeightDType::F16, WeightDType::Bf16] {
        let m = model_in(dtype);
        let random = RandomHead::new(&m.model, 4096, 3);
        let eos: Vec<u32> = m.tokenizer.eos_token_id().into_iter().collect();
        let mut prompts: Vec<(String, Vec<u32>)> = golden()
            .into_iter()
            .map(|g| (g.text, g.prompt_ids))
            .collect();
        for q in spec_bench(20) {
            let ids = m.chat_prompt(&q.turns[0]).unwrap();
            prompts.push((format!("question {} ({})", q.question_id, q.category), ids));
        }
        for (c, (name, prompt)) in prompts.iter().enumerate() {
            let base = GenerationConfig {
                max_new_tokens: identity_tokens(),
                stop_tokens: eos.clone(),
                ..Default::default()
            };
            let ar = generate(m, &NormHead::new(), "fixed:1", prompt, &base);
            // One EESD configuration per prompt, cycling through layers, policies and heads.
            let exit = layers[c % layers.len()];
            let policy = POLICIES[c % POLICIES.len()];
            let config = GenerationConfig {
                mode: Mode::Eesd,
                exit_layer: Some(exit),
                ..base
            };
            let (out, head) = if c % 2 == 0 {
                (
                    generate(m, &NormHead::new(), policy, prompt, &config),
                    "norm",
                )
            } else {
                (generate(m, &random, policy, prompt, &config), "random")
            };
            assert_eq!(
                out.tokens, ar.tokens,
                "{dtype}: {name}, layer {exit}, {policy}, {head} head"
            );
        }
    }
}
