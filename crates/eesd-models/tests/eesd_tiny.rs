//! EESD on tiny random LLaMA models (fast): greedy output equals AR for every exit layer, policy
//! and head; rollback leaves caches as if only accepted tokens were seen; sampling has the AR
//! distribution; context limits stop cleanly.

mod common;

use std::ops::ControlFlow;

use burn::tensor::Tensor;
use common::{
    POLICIES, RandomHead, assert_same_distribution, sampled_histogram, tiny, tiny_quantized,
};
use eesd_bandit::Policy;
use eesd_core::{
    CoreError, DraftHead, GenerationConfig, GenerationOutput, Generator, LayeredModel, Mode,
    StopReason,
};
use eesd_models::{HeadKind, LayerHead, Llama, NormHead, VocabSubset};

fn run<H: DraftHead<Llama>>(
    model: &Llama,
    head: &H,
    policy: &str,
    prompt: &[u32],
    config: &GenerationConfig,
) -> GenerationOutput {
    let mut g = Generator::new(model)
        .with_head(head)
        .with_policy(Policy::parse(policy, 3).unwrap());
    g.generate(prompt, config, |_| ControlFlow::Continue(()))
        .unwrap()
}

const PROMPT: [u32; 6] = [257, 72, 101, 108, 108, 111];

#[test]
fn greedy_eesd_equals_ar_for_every_layer_policy_and_head() {
    // Seeds 0..3 with f32 weights, 3..5 with Q4_1/Q8_0 weights run natively.
    for seed in 0..5 {
        let model = match seed {
            0..3 => tiny(seed),
            _ => tiny_quantized(seed),
        };
        let ar_config = GenerationConfig {
            max_new_tokens: 40,
            ..Default::default()
        };
        let ar = run(&model, &NormHead::new(), "fixed:1", &PROMPT, &ar_config);
        assert_eq!(ar.tokens.len(), 40);
        let random = RandomHead::new(&model, 32, seed);
        let subset =
            VocabSubset::new((0..64).map(|i| (i * 3 + seed as u32) % 259).collect(), 259).unwrap();
        let small_norm = NormHead::with_vocab(&model, &subset).unwrap();
        for exit in 1..model.num_layers() {
            for policy in POLICIES {
                let config = GenerationConfig {
                    mode: Mode::Eesd,
                    exit_layer: Some(exit),
                    ..ar_config.clone()
                };
                let norm = run(&model, &NormHead::new(), policy, &PROMPT, &config);
                assert_eq!(
                    norm.tokens, ar.tokens,
                    "seed {seed}, layer {exit}, {policy}, norm head"
                );
                let bad = run(&model, &random, policy, &PROMPT, &config);
                assert_eq!(
                    bad.tokens, ar.tokens,
                    "seed {seed}, layer {exit}, {policy}, random head"
                );
                assert_eq!(bad.stats.new_tokens, 40);
                // A trainable head (its own layer and KV cache) over a reduced vocabulary.
                for kind in [HeadKind::Layer, HeadKind::Adapter] {
                    let head =
                        LayerHead::from_model(&model, kind, exit, exit, Some(&subset)).unwrap();
                    let out = run(&model, &head, policy, &PROMPT, &config);
                    assert_eq!(
                        out.tokens, ar.tokens,
                        "seed {seed}, layer {exit}, {policy}, {kind:?} head"
                    );
                }
                let out = run(&model, &small_norm, policy, &PROMPT, &config);
                assert_eq!(
                    out.tokens, ar.tokens,
                    "seed {seed}, layer {exit}, {policy}, subset norm head"
                );
            }
        }
    }
}

fn to_vec(t: Tensor<2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

#[test]
fn rollback_leaves_caches_as_if_only_accepted_tokens_were_seen() {
    use rand::{RngExt, SeedableRng};
    let model = tiny(4);
    let (n, layers) = (2, model.num_layers());
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let mut cache = model.new_cache();
    let mut committed: Vec<u32> = PROMPT.to_vec();
    // Prefill all but the last prompt token through both halves.
    let h = model
        .forward_layers(model.embed(&committed[..5]).unwrap(), 0..n, &mut cache)
        .unwrap();
    model.forward_layers(h, n..layers, &mut cache).unwrap();
    for round in 0..12 {
        // t0 and k random drafts through the lower half, then the block through the upper half.
        let k = rng.random_range(0..5usize);
        let drafts: Vec<u32> = (0..k).map(|_| rng.random_range(0..256u32)).collect();
        let t0 = *committed.last().unwrap();
        let block: Vec<u32> = std::iter::once(t0).chain(drafts.iter().copied()).collect();
        let mut hidden = Vec::new();
        for &t in &block {
            hidden.push(
                model
                    .forward_layers(model.embed(&[t]).unwrap(), 0..n, &mut cache)
                    .unwrap(),
            );
        }
        model
            .forward_layers(Tensor::cat(hidden, 0), n..layers, &mut cache)
            .unwrap();
        // Any accept/reject pattern: keep `a` drafts, then a fresh token.
        let a = rng.random_range(0..=k);
        let keep = committed.len() + a;
        model.truncate(&mut cache, 0..n, keep);
        model.truncate(&mut cache, n..layers, keep);
        committed.extend_from_slice(&drafts[..a]);
        committed.push(rng.random_range(0..256u32));
        // The rolled-back cache must give the logits of a model that saw only `committed`.
        let mut probe = cache.clone();
        let ours = to_vec(model.forward(&committed[keep..], &mut probe).unwrap());
        let fresh = to_vec(model.forward(&committed, &mut model.new_cache()).unwrap());
        let tail = &fresh[fresh.len() - ours.len()..];
        let diff = ours
            .iter()
            .zip(tail)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            diff < 1e-4,
            "round {round}: k={k}, a={a}: max logit difference {diff}"
        );
    }
}

/// Counts of the tokens at `position` over many seeded generations, drafting 3 tokens a round.
fn histogram<H: DraftHead<Llama>>(
    model: &Llama,
    head: &H,
    mode: Mode,
    position: usize,
    runs: u64,
) -> Vec<usize> {
    let mut g = Generator::new(model)
        .with_head(head)
        .with_policy(Policy::parse("fixed:3", 0).unwrap());
    let base = GenerationConfig {
        mode,
        exit_layer: Some(2),
        ..Default::default()
    };
    let vocab = model.config().vocab_size;
    sampled_histogram(&mut g, &PROMPT, &base, vocab, position, runs, mode as u64)
}

#[test]
fn eesd_sampling_has_the_ar_distribution() {
    let model = tiny(5);
    let random = RandomHead::new(&model, 40, 2);
    let subset = VocabSubset::new((0..40).chain(100..140).collect(), 259).unwrap();
    let small = NormHead::with_vocab(&model, &subset).unwrap();
    for position in [0, 2] {
        let ar = histogram(&model, &NormHead::new(), Mode::Ar, position, 3000);
        for (name, eesd) in [
            (
                "norm head",
                histogram(&model, &NormHead::new(), Mode::Eesd, position, 3000),
            ),
            (
                "random head",
                histogram(&model, &random, Mode::Eesd, position, 3000),
            ),
            (
                "subset norm head",
                histogram(&model, &small, Mode::Eesd, position, 3000),
            ),
        ] {
            assert_same_distribution(&ar, &eesd, &format!("token {position}, {name}"));
        }
    }
}

#[test]
fn context_limits_stop_cleanly_or_error() {
    let model = tiny(6);
    let context = model.config().context_length;
    let norm = NormHead::new();
    let mut g = Generator::new(&model)
        .with_head(&norm)
        .with_policy(Policy::parse("fixed:4", 0).unwrap());
    let long = vec![65u32; context];
    for mode in [Mode::Ar, Mode::Eesd] {
        let config = GenerationConfig {
            mode,
            exit_layer: Some(2),
            max_new_tokens: 500,
            ..Default::default()
        };
        let err = g
            .generate(&long, &config, |_| ControlFlow::Continue(()))
            .unwrap_err();
        assert!(matches!(err, CoreError::PromptTooLong { .. }), "{err}");
        assert!(
            g.generate(&[], &config, |_| ControlFlow::Continue(()))
                .is_err()
        );
        assert!(
            g.generate(&[99_999], &config, |_| ControlFlow::Continue(()))
                .is_err()
        );
    }
    // A prompt that nearly fills the context: both modes stop at the same place with ContextFull.
    let prompt = vec![66u32; context - 10];
    let mut out = |mode| {
        let config = GenerationConfig {
            mode,
            exit_layer: Some(2),
            max_new_tokens: 500,
            ..Default::default()
        };
        g.generate(&prompt, &config, |_| ControlFlow::Continue(()))
            .unwrap()
    };
    let (ar, eesd) = (out(Mode::Ar), out(Mode::Eesd));
    assert_eq!(ar.stop_reason, StopReason::ContextFull);
    assert_eq!(eesd.stop_reason, StopReason::ContextFull);
    assert_eq!(ar.tokens, eesd.tokens);
    assert!(prompt.len() + ar.tokens.len() <= context + 1);
}

#[test]
fn stop_tokens_strings_and_callbacks_end_generation_mid_block() {
    let model = tiny(7);
    let base = GenerationConfig {
        max_new_tokens: 30,
        ..Default::default()
    };
    let ar = run(&model, &NormHead::new(), "fixed:1", &PROMPT, &base);
    let stop = ar.tokens[9];
    let first = ar.tokens.iter().position(|&t| t == stop).unwrap();
    for mode in [Mode::Ar, Mode::Eesd] {
        let config = GenerationConfig {
            mode,
            exit_layer: Some(1),
            stop_tokens: vec![stop],
            ..base.clone()
        };
        let out = run(&model, &NormHead::new(), "fixed:4", &PROMPT, &config);
        assert_eq!(out.tokens, ar.tokens[..=first], "{mode:?}");
        assert_eq!(out.stop_reason, StopReason::StopToken);

        let norm = NormHead::new();
        let mut g = Generator::new(&model)
            .with_head(&norm)
            .with_policy(Policy::parse("fixed:4", 0).unwrap());
        let mut streamed = Vec::new();
        let config = GenerationConfig {
            mode,
            exit_layer: Some(1),
            ..base.clone()
        };
        let out = g
            .generate(&PROMPT, &config, |ids| {
                streamed.extend_from_slice(ids);
                if streamed.len() >= 5 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .unwrap();
        assert_eq!(out.stop_reason, StopReason::Callback);
        assert_eq!(out.tokens, streamed);
        assert_eq!(out.tokens, ar.tokens[..out.tokens.len()]);

        // Stop strings need a detokenizer; with one they end generation.
        let config = GenerationConfig {
            mode,
            exit_layer: Some(1),
            stop_strings: vec!["x".into()],
            ..base.clone()
        };
        assert!(
            g.generate(&PROMPT, &config, |_| ControlFlow::Continue(()))
                .is_err()
        );
        let target = ar.tokens[4];
        let mut g = g.with_detokenizer(move |ids: &[u32]| {
            ids.iter()
                .map(|&t| {
                    if t == target {
                        "STOP".to_string()
                    } else {
                        "a".to_string()
                    }
                })
                .collect()
        });
        let config = GenerationConfig {
            stop_strings: vec!["STOP".into()],
            ..config
        };
        let out = g
            .generate(&PROMPT, &config, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(out.stop_reason, StopReason::StopString);
        assert!(out.tokens.contains(&target));
    }
}

#[test]
fn eesd_needs_a_valid_head_and_layer() {
    let model = tiny(8);
    let mut ar_only = Generator::new(&model);
    let config = GenerationConfig {
        mode: Mode::Eesd,
        exit_layer: Some(2),
        ..Default::default()
    };
    assert!(
        ar_only
            .generate(&PROMPT, &config, |_| ControlFlow::Continue(()))
            .is_err()
    );
    let norm = NormHead::new();
    let mut g = Generator::new(&model).with_head(&norm);
    for bad in [None, Some(0), Some(4), Some(99)] {
        let config = GenerationConfig {
            mode: Mode::Eesd,
            exit_layer: bad,
            ..Default::default()
        };
        assert!(
            g.generate(&PROMPT, &config, |_| ControlFlow::Continue(()))
                .is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn vocab_subsets_and_head_layers_are_validated() {
    assert!(VocabSubset::new(vec![], 10).is_err());
    assert!(VocabSubset::new(vec![1, 2, 1], 10).is_err());
    assert!(VocabSubset::new(vec![1, 10], 10).is_err());
    let s = VocabSubset::most_frequent(&[5, 0, 9, 1, 7], 3, &[1]).unwrap();
    assert_eq!(s.ids(), &[1, 2, 4]);
    let model = tiny(9);
    assert!(LayerHead::from_model(&model, HeadKind::Layer, 0, 0, None).is_err());
    assert!(LayerHead::from_model(&model, HeadKind::Layer, 2, 7, None).is_err());
    // A head trained for layer 2 refuses to run at layer 3.
    let head = LayerHead::from_model(&model, HeadKind::Adapter, 2, 2, None).unwrap();
    let mut g = Generator::new(&model).with_head(&head);
    let config = GenerationConfig {
        mode: Mode::Eesd,
        exit_layer: Some(3),
        ..Default::default()
    };
    assert!(
        g.generate(&PROMPT, &config, |_| ControlFlow::Continue(()))
            .is_err()
    );
    let config = GenerationConfig {
        mode: Mode::Eesd,
        exit_layer: None,
        max_new_tokens: 5,
        ..Default::default()
    };
    assert_eq!(
        g.generate(&PROMPT, &config, |_| ControlFlow::Continue(()))
            .unwrap()
            .tokens
            .len(),
        5
    );
}

/// A head whose logits do not match its token ids: an error, not a panic.
struct BrokenHead;

impl DraftHead<Llama> for BrokenHead {
    type Cache = usize;
    fn exit_layer(&self) -> Option<usize> {
        Some(2)
    }
    fn new_cache(&self, _: &Llama) -> usize {
        0
    }
    fn draft_logits(
        &self,
        _: &Llama,
        hidden: Tensor<2>,
        seen: &mut usize,
    ) -> eesd_models::Result<eesd_core::DraftLogits> {
        *seen += hidden.dims()[0];
        let logits = hidden.narrow(1, 0, 3);
        Ok(eesd_core::DraftLogits {
            logits,
            token_ids: Some(std::sync::Arc::new(vec![1, 2, 999_999])),
            context_columns: 0,
        })
    }
    fn cached_len(&self, seen: &usize) -> usize {
        *seen
    }
    fn truncate(&self, seen: &mut usize, len: usize) {
        *seen = (*seen).min(len);
    }
}

#[test]
fn a_head_with_inconsistent_outputs_is_an_error() {
    let model = tiny(10);
    let mut g = Generator::new(&model)
        .with_head(&BrokenHead)
        .with_policy(Policy::parse("fixed:2", 0).unwrap());
    let config = GenerationConfig {
        mode: Mode::Eesd,
        ..Default::default()
    };
    let err = g
        .generate(&PROMPT, &config, |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(matches!(err, CoreError::InvalidConfig(_)), "{err}");
}

/// A head that logs, for every layer-N row it is given, the position its cache assigns to that
/// row. If the generator let the head's cache fall out of step with the committed sequence (a
/// position skipped or seen twice), some row would be logged at the wrong position.
struct RecordingHead {
    log: std::sync::Mutex<Vec<(usize, Vec<f32>)>>,
}

impl DraftHead<Llama> for RecordingHead {
    type Cache = usize;
    fn exit_layer(&self) -> Option<usize> {
        None
    }
    fn new_cache(&self, _: &Llama) -> usize {
        0
    }
    fn draft_logits(
        &self,
        model: &Llama,
        hidden: Tensor<2>,
        seen: &mut usize,
    ) -> eesd_models::Result<eesd_core::DraftLogits> {
        let rows = hidden.dims()[0];
        let mut log = self.log.lock().unwrap();
        for i in 0..rows {
            log.push((*seen + i, to_vec(hidden.clone().narrow(0, i, 1))));
        }
        *seen += rows;
        Ok(eesd_core::DraftLogits {
            logits: model.logits(hidden.narrow(0, rows - 1, 1)),
            token_ids: None,
            context_columns: 0,
        })
    }
    fn cached_len(&self, seen: &usize) -> usize {
        *seen
    }
    fn truncate(&self, seen: &mut usize, len: usize) {
        *seen = (*seen).min(len);
    }
}

/// Declines to draft on some rounds (plain steps), drafts 1–3 tokens on others, and drops its
/// last draft unverified on some.
struct Intermittent {
    round: usize,
}

impl eesd_bandit::DraftPolicy for Intermittent {
    fn name(&self) -> String {
        "intermittent".into()
    }
    fn max_draft(&self) -> usize {
        3
    }
    fn begin_round(&mut self) -> eesd_bandit::Decision {
        self.round += 1;
        if self.round.is_multiple_of(3) || self.round.is_multiple_of(7) {
            eesd_bandit::Decision::Stop
        } else {
            eesd_bandit::Decision::Continue
        }
    }
    fn decide(&mut self, step: &eesd_bandit::DraftStep) -> eesd_bandit::Decision {
        if self.round % 4 == 1 && step.position == self.round % 3 {
            return eesd_bandit::Decision::Discard;
        }
        if step.position + 1 < 1 + self.round % 3 {
            eesd_bandit::Decision::Continue
        } else {
            eesd_bandit::Decision::Stop
        }
    }
    fn observe(&mut self, _: &eesd_bandit::RoundOutcome) {}
}

#[test]
fn the_head_stays_in_step_across_plain_rounds_discards_and_full_acceptances() {
    let model = tiny(4);
    let config = GenerationConfig {
        max_new_tokens: 60,
        ..Default::default()
    };
    let ar = run(&model, &NormHead::new(), "fixed:1", &PROMPT, &config);
    let head = RecordingHead {
        log: Default::default(),
    };
    let mut g = Generator::new(&model)
        .with_head(&head)
        .with_policy(Intermittent { round: 0 });
    let eesd = GenerationConfig {
        mode: Mode::Eesd,
        exit_layer: Some(2),
        ..config
    };
    let out = g
        .generate(&PROMPT, &eesd, |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(out.tokens, ar.tokens);
    let plain_rounds = out.stats.drafted_histogram.first().copied().unwrap_or(0);
    assert!(
        plain_rounds > 5 && out.stats.drafted > 10,
        "{:?}",
        out.stats
    );
    // The true layer-2 states of the committed sequence, computed afresh.
    let sequence: Vec<u32> = PROMPT.iter().copied().chain(out.tokens).collect();
    let mut cache = model.new_cache();
    let truth = model
        .forward_layers(model.embed(&sequence).unwrap(), 0..2, &mut cache)
        .unwrap();
    let log = head.log.lock().unwrap();
    let mut checked = 0;
    for (position, row) in log.iter() {
        let want = to_vec(truth.clone().narrow(0, *position, 1));
        let close = row.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-3);
        if close {
            checked += 1;
        } else {
            // A mismatch is only allowed for a rejected draft, which the head saw and the
            // generator then truncated away; a later row must re-occupy that position.
            assert!(
                log.iter().any(|(p, r)| p == position
                    && r.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-3)),
                "the head saw a wrong state at position {position}"
            );
        }
    }
    // No gaps: the head saw every position up to the last one it drafted from (states still
    // pending when generation ends are never needed).
    let seen: std::collections::BTreeSet<usize> = log.iter().map(|(p, _)| *p).collect();
    let last = seen.last().copied().unwrap_or(0);
    assert!(checked > 0 && last + 8 > sequence.len());
    assert!(
        (0..=last).all(|p| seen.contains(&p)),
        "the head missed positions: {:?}",
        (0..=last).filter(|p| !seen.contains(p)).collect::<Vec<_>>()
    );
}
