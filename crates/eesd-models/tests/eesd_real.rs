//! Lossless on the real model: greedy EESD is token-identical to greedy AR on SmolLM2-135M, for
//! the golden prompts and 20 Spec-Bench questions × `identity_tokens()` new tokens (64; more
//! with `EESD_IDENTITY_TOKENS`), at several exit layers, with every policy, and with a
//! deliberately bad random head.

mod common;

use std::ops::ControlFlow;

use common::*;
use eesd_bandit::Policy;
use eesd_core::{DraftHead, GenerationConfig, GenerationOutput, Generator, Mode};
use eesd_models::{Llama, NormHead};

fn generate<H: DraftHead<Llama>>(
    head: &H,
    policy: &str,
    prompt: &[u32],
    config: &GenerationConfig,
) -> GenerationOutput {
    let m = model();
    let mut g = Generator::new(&m.model)
        .with_head(head)
        .with_policy(Policy::parse(policy, 11).unwrap());
    g.generate(prompt, config, |_| ControlFlow::Continue(()))
        .unwrap()
}

#[test]
fn greedy_eesd_matches_the_golden_continuations() {
    let random = RandomHead::new(&model().model, 2048, 1);
    for (i, g) in golden().iter().enumerate() {
        let n = g.reliable_len();
        let policy = POLICIES[i % POLICIES.len()];
        for (exit, head_name) in [(6, "norm"), (15, "random")] {
            let config = GenerationConfig {
                mode: Mode::Eesd,
                exit_layer: Some(exit),
                ..greedy_config(g.greedy_ids.len())
            };
            let out = if head_name == "norm" {
                generate(&NormHead::new(), policy, &g.prompt_ids, &config)
            } else {
                generate(&random, policy, &g.prompt_ids, &config)
            };
            assert_eq!(
                out.tokens[..n],
                g.greedy_ids[..n],
                "{:?}, layer {exit}, {policy}, {head_name} head",
                g.text
            );
        }
    }
}

#[test]
fn greedy_eesd_is_token_identical_to_ar_on_spec_bench() {
    let m = model();
    let random = RandomHead::new(&m.model, 4096, 2);
    let layers = [4, 8, 12, 20];
    let mut checked = 0;
    for (i, q) in spec_bench(20).iter().enumerate() {
        let prompt = m.chat_prompt(&q.turns[0]).unwrap();
        let base = greedy_config(identity_tokens());
        let ar = generate(&NormHead::new(), "fixed:1", &prompt, &base);
        // Two EESD configurations per question, cycling through layers × policies × heads so that
        // every combination of policy and head appears across the set.
        for j in 0..2 {
            let c = 2 * i + j;
            let exit = layers[c % layers.len()];
            let policy = POLICIES[c % POLICIES.len()];
            let config = GenerationConfig {
                mode: Mode::Eesd,
                exit_layer: Some(exit),
                ..base.clone()
            };
            let (out, head) = if c % 2 == 0 {
                (generate(&NormHead::new(), policy, &prompt, &config), "norm")
            } else {
                (generate(&random, policy, &prompt, &config), "random")
            };
            assert_eq!(
                out.tokens, ar.tokens,
                "question {} ({}), layer {exit}, {policy}, {head} head",
                q.question_id, q.category
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 40);
}
