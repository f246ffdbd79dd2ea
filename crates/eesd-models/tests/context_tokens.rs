//! A head with a draft vocabulary also drafts the tokens its sequence brought
//! ([`eesd_models::ContextTokens`]), on tiny random LLaMA models with f32 and native weights:
//! their columns follow the subset's in the order the sequence brought them, hold the logits a
//! full-vocabulary head gives those tokens (bit for bit), appear from the position where a
//! token first arrives and go when the head forgets that position; a lookahead head adds its
//! `next` tokens itself; a head without a subset adds nothing, nor one made
//! [`eesd_models::LayerHead::without_context_tokens`]; EESD and trees with such heads stay
//! token-identical to AR.

mod common;

use std::ops::ControlFlow;

use burn::tensor::Tensor;
use common::{tiny, tiny_quantized};
use eesd_bandit::Policy;
use eesd_core::drafters::{DrafterSpec, HeadDrafter};
use eesd_core::{DraftHead, DraftLogits, GenerationConfig, Generator, LookaheadHead, Mode};
use eesd_models::testing::values;
use eesd_models::{HeadKind, LayerHead, Llama, ModelError, VocabSubset};

/// Token 257 is a special token, the rest bytes; 108 comes twice.
const PROMPT: [u32; 6] = [257, 72, 101, 108, 108, 111];

/// The subset every head here projects onto: tokens 0..16, none of the prompt's.
fn subset(model: &Llama) -> VocabSubset {
    VocabSubset::new((0..16).collect(), model.config().vocab_size).unwrap()
}

/// The layer-`n` states of the prompt's positions.
fn states(model: &Llama, n: usize) -> Tensor<2> {
    let h = model.embed(&PROMPT).unwrap();
    model
        .forward_layers(h, 0..n, &mut model.new_cache())
        .unwrap()
}

/// Each row of `draft` against the full-vocabulary logits `full` (same rows): the subset's
/// columns and then the context's hold exactly the full head's values for their tokens.
fn assert_columns_are_the_full_heads(draft: &DraftLogits, full: Tensor<2>, context: &[u32]) {
    let ids = draft.token_ids.as_deref().unwrap();
    assert_eq!(ids[..16], (0..16).collect::<Vec<u32>>());
    assert_eq!(ids[16..], *context);
    assert_eq!(draft.context_columns, context.len());
    let [_, vocab] = full.dims();
    let (got, full) = (values(draft.logits.clone()), values(full));
    for (row, want) in got.chunks(ids.len()).zip(full.chunks(vocab)) {
        let picked: Vec<f32> = ids.iter().map(|&t| want[t as usize]).collect();
        assert_eq!(row, picked.as_slice());
    }
}

#[test]
fn a_chain_head_drafts_the_tokens_its_sequence_brought() {
    for model in [tiny(0), tiny_quantized(3)] {
        for q8 in [false, true] {
            let head = LayerHead::from_model(&model, HeadKind::Layer, 2, 2, Some(&subset(&model)))
                .unwrap();
            let full = head.with_full_vocabulary(&model).unwrap();
            let (head, full) = match q8 {
                true => (
                    head.with_q8_0_drafts().unwrap(),
                    full.with_q8_0_drafts().unwrap(),
                ),
                false => (head, full),
            };
            let reference = full
                .draft_logits(
                    &model,
                    states(&model, 2),
                    &mut DraftHead::new_cache(&full, &model),
                )
                .unwrap();
            // A full-vocabulary head has nothing to add.
            let mut cache = DraftHead::new_cache(&full, &model);
            full.observe_tokens(&model, &mut cache, 0, &PROMPT).unwrap();
            assert!(cache.context_tokens().is_empty());

            let mut cache = DraftHead::new_cache(&head, &model);
            let plain = head
                .draft_logits(&model, states(&model, 2), &mut cache)
                .unwrap();
            assert_eq!(plain.logits.dims(), [6, 16]);
            assert_eq!(plain.context_columns, 0);
            let mut cache = DraftHead::new_cache(&head, &model);
            head.observe_tokens(&model, &mut cache, 0, &PROMPT).unwrap();
            let context = [257, 72, 101, 108, 111];
            assert_eq!(cache.context_tokens().tokens().collect::<Vec<_>>(), context);
            let draft = head
                .draft_logits(&model, states(&model, 2), &mut cache)
                .unwrap();
            assert_columns_are_the_full_heads(&draft, reference.logits.clone(), &context);
            // Forgetting positions 3.. forgets 108 and 111, first seen there.
            DraftHead::truncate(&head, &mut cache, 3);
            assert_eq!(DraftHead::cached_len(&head, &cache), 3);
            // The same positions again: the same logits, in fewer columns.
            let rows = reference.logits.clone().narrow(0, 3, 3);
            let draft = head
                .draft_logits(&model, states(&model, 2).narrow(0, 3, 3), &mut cache)
                .unwrap();
            assert_columns_are_the_full_heads(&draft, rows, &context[..3]);
            // A token outside the vocabulary is refused and adds nothing.
            let vocab = model.config().vocab_size as u32;
            assert!(matches!(
                head.observe_tokens(&model, &mut cache, 3, &[111, vocab]),
                Err(ModelError::TokenOutOfRange { .. })
            ));
            assert_eq!(cache.context_tokens().len(), 3);
        }
    }
}

#[test]
fn a_head_without_context_tokens_drafts_its_subset_alone() {
    for model in [tiny(2), tiny_quantized(5)] {
        let head = || {
            LayerHead::from_model(&model, HeadKind::Layer, 2, 2, Some(&subset(&model)))
                .unwrap()
                .with_q8_0_drafts()
                .unwrap()
        };
        let (head, plain) = (head(), head().without_context_tokens());
        assert!(head.drafts_context_tokens());
        let mut cache = DraftHead::new_cache(&head, &model);
        let widened = head
            .draft_logits(&model, states(&model, 2), &mut cache)
            .unwrap();
        assert!(!plain.drafts_context_tokens());
        let mut cache = DraftHead::new_cache(&plain, &model);
        plain
            .observe_tokens(&model, &mut cache, 0, &PROMPT)
            .unwrap();
        assert!(cache.context_tokens().is_empty());
        let draft = plain
            .draft_logits(&model, states(&model, 2), &mut cache)
            .unwrap();
        // The subset's columns, as the head gives them before its sequence brings a token.
        assert_eq!(draft.context_columns, 0);
        assert_eq!(draft.token_ids, widened.token_ids);
        assert_eq!(values(draft.logits), values(widened.logits));
        // Tokens outside the vocabulary are still refused.
        let vocab = model.config().vocab_size as u32;
        assert!(matches!(
            plain.observe_tokens(&model, &mut cache, 6, &[vocab]),
            Err(ModelError::TokenOutOfRange { .. })
        ));
        // A lookahead head likewise ignores its `next` tokens.
        let n = model.num_layers();
        let tree =
            LayerHead::from_model(&model, HeadKind::Lookahead, n, n - 1, Some(&subset(&model)))
                .unwrap()
                .without_context_tokens();
        let mut cache = LookaheadHead::new_cache(&tree, &model);
        let rows = states(&model, n).narrow(0, 0, 5);
        let draft = tree
            .lookahead(&model, rows, &PROMPT[1..], &mut cache)
            .unwrap();
        assert_eq!(draft.draft.token_ids.as_deref().map(Vec::len), Some(16));
        assert!(cache.context_tokens().is_empty());
    }
}

#[test]
fn a_lookahead_head_adds_its_next_tokens_at_their_rows() {
    for model in [tiny(1), tiny_quantized(4)] {
        let n = model.num_layers();
        let head =
            LayerHead::from_model(&model, HeadKind::Lookahead, n, n - 1, Some(&subset(&model)))
                .unwrap();
        let full = head.with_full_vocabulary(&model).unwrap();
        let rows = states(&model, n).narrow(0, 0, 5);
        let next = &PROMPT[1..];
        let reference = full
            .lookahead(
                &model,
                rows.clone(),
                next,
                &mut LookaheadHead::new_cache(&full, &model),
            )
            .unwrap();
        let mut cache = LookaheadHead::new_cache(&head, &model);
        let draft = head
            .lookahead(&model, rows.clone(), next, &mut cache)
            .unwrap();
        // Row i holds next[i]: 108 first at row 2.
        let context = [72, 101, 108, 111];
        assert_columns_are_the_full_heads(&draft.draft, reference.draft.logits, &context);
        LookaheadHead::truncate(&head, &mut cache, 2);
        assert_eq!(
            cache.context_tokens().tokens().collect::<Vec<_>>(),
            context[..2]
        );
        // Rows again from position 2: the same tokens come back in the same columns.
        let again = head
            .lookahead(&model, rows.narrow(0, 2, 3), &next[2..], &mut cache)
            .unwrap();
        assert_eq!(again.draft.token_ids, draft.draft.token_ids);
        assert_eq!(values(again.draft.logits), values(draft.draft.logits));
    }
}

#[test]
fn heads_with_context_tokens_keep_eesd_and_trees_lossless() {
    for model in [tiny(2), tiny_quantized(5)] {
        let n = model.num_layers();
        let config = GenerationConfig {
            max_new_tokens: 24,
            ..Default::default()
        };
        let want = Generator::new(&model)
            .generate(&PROMPT, &config, |_| ControlFlow::Continue(()))
            .unwrap()
            .tokens;
        let chain =
            LayerHead::from_model(&model, HeadKind::Layer, 2, 2, Some(&subset(&model))).unwrap();
        let mut g = Generator::new(&model)
            .with_head(&chain)
            .with_policy(Policy::parse("fixed:3", 0).unwrap());
        let eesd = GenerationConfig {
            mode: Mode::Eesd,
            exit_layer: Some(2),
            ..config.clone()
        };
        let got = g
            .generate(&PROMPT, &eesd, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(got.tokens, want, "EESD");
        let lookahead =
            LayerHead::from_model(&model, HeadKind::Lookahead, n, n - 1, Some(&subset(&model)))
                .unwrap();
        let spec: DrafterSpec = "opt@8".parse().unwrap();
        let inner = spec.build(model.config().vocab_size);
        let drafter = HeadDrafter::new(&model, &lookahead, inner).with_levels(2);
        let tree = GenerationConfig {
            mode: Mode::Tree,
            tree_budget: 8,
            ..config.clone()
        };
        let got = Generator::new(&model)
            .with_drafter(drafter)
            .generate(&PROMPT, &tree, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(got.tokens, want, "tree");
    }
}
