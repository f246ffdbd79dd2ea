//! Self-distillation and head checkpoints on a tiny random LLaMA.

use std::ops::ControlFlow;

use burn::tensor::Tensor;
use eesd_bandit::Policy;
use eesd_core::sampling::SamplingParams;
use eesd_core::{DraftHead, GenerationConfig, Generator, LookaheadHead, Mode};
use eesd_models::testing::{
    assert_rows_match, assert_scalar_match, tiny_config, tiny_gguf_bytes, values,
};
use eesd_models::{
    AttentionContext, HeadKind, LayerHead, Llama, LoadOptions, LoadedModel, ModelError, VocabSubset,
};
use eesd_train::checkpoint::FORMAT_VERSION;
use eesd_train::{
    AnswerConfig, AnswerPrompt, DistillConfig, Distiller, EvalSet, HeadMetadata, Sequence, Teacher,
    TrainError, generate_answers, load_layer_head, pack, save_layer_head, state_path,
};

fn tiny(seed: u64) -> Llama {
    tiny_with(&tiny_config(), seed)
}

fn tiny_with(config: &eesd_models::LlamaConfig, seed: u64) -> Llama {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, tiny_gguf_bytes(config, seed)).unwrap();
    let device = eesd_models::testing::test_device().unwrap();
    LoadedModel::load(&path, &device, &LoadOptions::default())
        .unwrap()
        .model
}

/// Sequences the model writes itself (greedy), from varied short prompts.
fn self_generated(model: &Llama, n: usize, len: usize) -> Vec<Sequence> {
    self_sampled(model, n, len, SamplingParams::greedy(), |_| 0)
}

/// Sequences the model writes itself by plain AR decoding under `sampling`, prompt `i` with
/// seed `seed(i)`.
fn self_sampled(
    model: &Llama,
    n: usize,
    len: usize,
    sampling: SamplingParams,
    seed: impl Fn(u32) -> u64,
) -> Vec<Sequence> {
    let mut g = Generator::new(model);
    (0..n as u32)
        .map(|i| {
            let prompt = vec![257, 65 + i % 26, 97 + (i * 7) % 26, 48 + i % 10];
            let config = GenerationConfig {
                max_new_tokens: len,
                sampling,
                seed: seed(i),
                ..Default::default()
            };
            let out = g
                .generate(&prompt, &config, |_| ControlFlow::Continue(()))
                .unwrap();
            Sequence {
                prompt_len: prompt.len(),
                tokens: prompt.into_iter().chain(out.tokens).collect(),
            }
        })
        .collect()
}

#[test]
fn distillation_lowers_the_held_out_kl() {
    for (kind, ce_weight) in [
        (HeadKind::Layer, 0.0),
        (HeadKind::Adapter, 0.0),
        (HeadKind::Layer, 0.5),
        (HeadKind::Lookahead, 0.5),
    ] {
        distillation_lowers_the_held_out_kl_for(kind, ce_weight);
    }
    let bad = DistillConfig {
        ce_weight: -1.0,
        ..Default::default()
    };
    assert!(matches!(bad.validate(), Err(TrainError::InvalidConfig(_))));
}

fn distillation_lowers_the_held_out_kl_for(kind: HeadKind, ce_weight: f32) {
    let model = tiny(21);
    let data = self_generated(&model, 40, 20);
    // A tiny random model's own answers fall into easy loops, so score every position here
    // (`prompt_len: 0`); on a real model only answer positions are scored.
    let data: Vec<Sequence> = data
        .into_iter()
        .map(|s| Sequence { prompt_len: 0, ..s })
        .collect();
    let (train, held_out) = data.split_at(32);
    // A deliberately poor start: layer 3's weights used as the exit head of layer 1.
    let head = LayerHead::from_model(&model, kind, 1, 3, None).unwrap();
    let config = DistillConfig {
        learning_rate: 3e-3,
        warmup_steps: 5,
        total_steps: 96,
        ce_weight,
        ..Default::default()
    };
    let mut d = Distiller::new(&model, head, config).unwrap();
    // The teacher passes kept once serve every evaluation, with the same figures.
    let set = EvalSet::new(&model, held_out, &[1, 2]).unwrap();
    assert_eq!(set.len(), held_out.len());
    let before = d.evaluate(held_out, 4).unwrap();
    assert_eq!(d.evaluate_set(&set, 4).unwrap(), before);
    for step in 0..96 {
        d.train_step(&[&train[step % train.len()].tokens]).unwrap();
    }
    let after = d.evaluate(held_out, 4).unwrap();
    assert_eq!(d.evaluate_set(&set, 4).unwrap(), after);
    assert!(
        after.kl < 0.7 * before.kl,
        "{kind:?}: held-out KL {} -> {}",
        before.kl,
        after.kl
    );
    assert!(
        after.top1_agreement >= before.top1_agreement,
        "{before:?} -> {after:?}"
    );
    assert!(after.expected_accepted >= 1.0 && after.expected_accepted <= 5.0);
    // Only the positions predicting answer tokens count: the last prompt position onwards.
    let seq = Sequence {
        prompt_len: 5,
        ..held_out[0].clone()
    };
    let m = d.evaluate(std::slice::from_ref(&seq), 4).unwrap();
    assert_eq!(m.positions, seq.tokens.len() - 4);
}

fn metadata(model: &Llama, kind: HeadKind, exit: usize, subset: Option<Vec<u32>>) -> HeadMetadata {
    HeadMetadata {
        format_version: FORMAT_VERSION,
        head_kind: kind.name().into(),
        base_model_sha256: "abc".into(),
        base_model_name: "tiny.gguf".into(),
        exit_layer: exit,
        hidden_size: model.config().hidden_size,
        vocab_subset: subset,
        training: serde_json::json!({}),
        metrics: serde_json::json!({}),
    }
}

/// The head's draft logits after `tokens` (a lookahead head's: for the token after the last
/// one, from the states of all but the last and the tokens after each).
fn draft(model: &Llama, head: &LayerHead, tokens: &[u32]) -> Vec<f32> {
    let n = DraftHead::exit_layer(head).unwrap();
    let mut cache = model.new_cache();
    let logits: Tensor<2> = match head.kind() {
        HeadKind::Lookahead => {
            let (last, before) = tokens.split_last().unwrap();
            let h = model
                .forward_layers(model.embed(before).unwrap(), 0..n, &mut cache)
                .unwrap();
            let mut hc = LookaheadHead::new_cache(head, model);
            let next: Vec<u32> = tokens[1..].to_vec();
            let _ = last;
            head.lookahead(model, h, &next, &mut hc)
                .unwrap()
                .draft
                .logits
        }
        _ => {
            let h = model
                .forward_layers(model.embed(tokens).unwrap(), 0..n, &mut cache)
                .unwrap();
            let mut hc = DraftHead::new_cache(head, model);
            head.draft_logits(model, h, &mut hc).unwrap().logits
        }
    };
    logits
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

/// The largest absolute difference between two equally long lists of logits.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn checkpoints_round_trip_and_refuse_other_models() {
    for kind in [HeadKind::Layer, HeadKind::Adapter, HeadKind::Lookahead] {
        checkpoints_round_trip_for(kind);
    }
}

fn checkpoints_round_trip_for(kind: HeadKind) {
    let model = tiny(22);
    let subset = VocabSubset::new((0..100).collect(), 259).unwrap();
    let mut d = Distiller::new(
        &model,
        LayerHead::from_model(&model, kind, 2, 2, Some(&subset)).unwrap(),
        DistillConfig::default(),
    )
    .unwrap();
    d.train_step(&[&[257, 72, 101, 108, 108, 111]]).unwrap();
    let head = d.into_head().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("head");
    let tokens = [257, 80, 81, 82, 83];
    let reference = draft(&model, &head, &tokens);

    save_layer_head(
        &prefix,
        &head,
        &metadata(&model, kind, 2, Some((0..100).collect())),
        false,
    )
    .unwrap();
    let (loaded, meta) = load_layer_head(&prefix, &model, Some("abc")).unwrap();
    assert_eq!(meta.exit_layer, 2);
    assert_eq!(loaded.kind(), kind);
    // f32 checkpoints restore the weights bit for bit; the logits may differ in the last bits
    // only because a fresh tensor's memory layout can change the kernel's summation order.
    let bits = |h: &LayerHead| {
        h.weights()
            .layer
            .wqkv
            .val()
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap()
    };
    assert_eq!(bits(&loaded), bits(&head), "f32 checkpoints are exact");
    let diff = max_diff(&draft(&model, &loaded, &tokens), &reference);
    assert!(diff < 1e-4, "f32 checkpoint logits differ by {diff}");

    save_layer_head(
        &prefix,
        &head,
        &metadata(&model, kind, 2, Some((0..100).collect())),
        true,
    )
    .unwrap();
    let (loaded, _) = load_layer_head(&prefix, &model, None).unwrap();
    let diff = max_diff(&draft(&model, &loaded, &tokens), &reference);
    assert!(diff < 0.05, "f16 checkpoint differs by {diff}");

    // Another base model, another layer count, a broken file: typed errors.
    assert!(matches!(
        load_layer_head(&prefix, &model, Some("def")),
        Err(ModelError::HeadMismatch(_))
    ));
    save_layer_head(&prefix, &head, &metadata(&model, kind, 7, None), true).unwrap();
    assert!(matches!(
        load_layer_head(&prefix, &model, None),
        Err(ModelError::HeadMismatch(_))
    ));
    save_layer_head(&prefix, &head, &metadata(&model, kind, 2, None), true).unwrap();
    let st = prefix.with_extension("safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 3]).unwrap();
    assert!(matches!(
        load_layer_head(&prefix, &model, None),
        Err(ModelError::MalformedHead { .. })
    ));
    std::fs::write(prefix.with_extension("json"), "{").unwrap();
    assert!(matches!(
        load_layer_head(&prefix, &model, None),
        Err(ModelError::MalformedHead { .. })
    ));
    assert!(matches!(
        load_layer_head(&dir.path().join("none"), &model, None),
        Err(ModelError::Io { .. })
    ));
}

#[test]
fn a_trained_reduced_vocabulary_head_keeps_eesd_lossless() {
    let model = tiny(23);
    let data = self_generated(&model, 12, 16);
    let subset = VocabSubset::new((0..259).step_by(3).collect(), 259).unwrap();
    let head = LayerHead::from_model(&model, HeadKind::Adapter, 2, 2, Some(&subset)).unwrap();
    let mut d = Distiller::new(
        &model,
        head,
        DistillConfig {
            learning_rate: 2e-3,
            ..Default::default()
        },
    )
    .unwrap();
    for seq in &data {
        d.train_step(&[&seq.tokens]).unwrap();
    }
    let head = d.into_head().unwrap();
    let prompt = [257, 84, 104, 101];
    let base = GenerationConfig {
        max_new_tokens: 40,
        ..Default::default()
    };
    let ar = Generator::new(&model)
        .generate(&prompt, &base, |_| ControlFlow::Continue(()))
        .unwrap();
    for policy in ["fixed:3", "cost-ts"] {
        let mut g = Generator::new(&model)
            .with_head(&head)
            .with_policy(Policy::parse(policy, 1).unwrap());
        let config = GenerationConfig {
            mode: Mode::Eesd,
            ..base.clone()
        };
        let out = g
            .generate(&prompt, &config, |_| ControlFlow::Continue(()))
            .unwrap();
        assert_eq!(out.tokens, ar.tokens, "{policy}");
    }
}

/// A run cut short (or lengthened) re-plans its end: the decay runs toward the new total from
/// the current step; an end at or before the steps taken or within the warm-up is refused.
#[test]
fn a_run_can_be_re_planned_to_end_elsewhere() {
    let model = tiny(8);
    let head = LayerHead::from_model(&model, HeadKind::Layer, 1, 3, None).unwrap();
    let config = DistillConfig {
        learning_rate: 1.0,
        warmup_steps: 2,
        total_steps: 100,
        ..Default::default()
    };
    let mut d = Distiller::new(&model, head, config).unwrap();
    let seq = self_generated(&model, 1, 8);
    for _ in 0..3 {
        d.train_step(&[&seq[0].tokens]).unwrap();
    }
    assert!(d.set_total_steps(3).is_err());
    assert!(d.set_total_steps(2).is_err());
    d.set_total_steps(4).unwrap();
    assert_eq!(d.config().total_steps, 4);
    // The last step of the new plan runs at the end of the decay.
    assert!((d.config().learning_rate_at(4) - 0.1).abs() < 1e-12);
    d.train_step(&[&seq[0].tokens]).unwrap();
    assert_eq!(d.step(), 4);
}

#[test]
fn schedule_warms_up_then_decays() {
    let c = DistillConfig {
        learning_rate: 1.0,
        warmup_steps: 10,
        total_steps: 110,
        ..Default::default()
    };
    assert!((c.learning_rate_at(0) - 0.1).abs() < 1e-9);
    assert!((c.learning_rate_at(9) - 1.0).abs() < 1e-9);
    assert!((c.learning_rate_at(10) - 1.0).abs() < 1e-9);
    assert!((c.learning_rate_at(110) - 0.1).abs() < 1e-9);
    assert!(c.learning_rate_at(60) < 0.6 && c.learning_rate_at(60) > 0.5);
    assert!(
        DistillConfig {
            total_steps: 0,
            ..c
        }
        .validate()
        .is_err()
    );
}

#[test]
fn batched_answer_generation_equals_one_at_a_time_generation() {
    let model = tiny(5);
    let expected = self_generated(&model, 7, 12);
    let prompts: Vec<Vec<u32>> = expected
        .iter()
        .map(|s| s.tokens[..s.prompt_len].to_vec())
        .collect();
    let greedy: Vec<AnswerPrompt> = prompts.iter().cloned().map(Into::into).collect();
    answers_at_every_batch(&model, &greedy, SamplingParams::greedy(), &expected);
    // A stop token ends an answer early, and bad settings are errors.
    let stop = expected[0].tokens[expected[0].prompt_len + 2];
    let config = AnswerConfig {
        max_new_tokens: 12,
        stop_tokens: vec![stop],
        batch: 2,
        ..Default::default()
    };
    generate_answers(&model, prompts[..1].to_vec(), &config, |_, seq| {
        assert_eq!(seq.tokens.last(), Some(&stop));
        assert!(seq.tokens.len() <= expected[0].prompt_len + 3);
        Ok(())
    })
    .unwrap();
    let bad = AnswerConfig { batch: 0, ..config };
    assert!(matches!(
        generate_answers(&model, prompts, &bad, |_, _| Ok(())),
        Err(TrainError::InvalidConfig(_))
    ));
}

/// `generate_answers` on `prompts` (12 tokens each) in batches of 1, 3 and 16 gives `expected`.
fn answers_at_every_batch(
    model: &Llama,
    prompts: &[AnswerPrompt],
    sampling: SamplingParams,
    expected: &[Sequence],
) {
    for batch in [1, 3, 16] {
        let config = AnswerConfig {
            max_new_tokens: 12,
            batch,
            sampling,
            ..Default::default()
        };
        let mut got = vec![None; prompts.len()];
        generate_answers(model, prompts.to_vec(), &config, |i, seq| {
            got[i] = Some(seq);
            Ok(())
        })
        .unwrap();
        let got: Vec<Sequence> = got.into_iter().map(Option::unwrap).collect();
        assert_eq!(got, expected, "batch {batch}");
    }
}

/// Sampled answers are the model's own AR samples: each prompt draws from its own seed, so
/// the answers do not depend on which prompts are decoded together.
#[test]
fn sampled_answers_are_ar_samples_whatever_the_batch() {
    let model = tiny(6);
    let sampling = SamplingParams {
        temperature: 4.0,
        top_k: 0,
        top_p: 1.0,
    };
    let seed = |i: u32| 1000 + 17 * i as u64;
    let expected = self_sampled(&model, 7, 12, sampling, seed);
    assert_ne!(
        expected,
        self_generated(&model, 7, 12),
        "sampling at a high temperature leaves the greedy answers somewhere"
    );
    let prompts: Vec<AnswerPrompt> = expected
        .iter()
        .zip(0u32..)
        .map(|(s, i)| AnswerPrompt {
            tokens: s.tokens[..s.prompt_len].to_vec(),
            seed: seed(i),
        })
        .collect();
    answers_at_every_batch(&model, &prompts, sampling, &expected);
    // A bad temperature is an error before any work.
    let bad = AnswerConfig {
        sampling: SamplingParams {
            temperature: -1.0,
            ..sampling
        },
        ..Default::default()
    };
    assert!(matches!(
        generate_answers(&model, prompts, &bad, |_, _| Ok(())),
        Err(TrainError::InvalidConfig(_))
    ));
}

/// The student runs on the autodiff device through burn's operations (not the fused CPU
/// path): a packed block must give each sequence what it gives alone there too.
#[test]
fn a_packed_student_block_computes_each_sequence_as_if_alone() {
    use burn::module::Module;
    let model = tiny(25);
    let c = model.config();
    let seqs: [&[u32]; 3] = [
        &[257, 72, 101, 108, 108],
        &[257, 80, 81, 82, 83, 84, 85],
        &[257, 90],
    ];
    let train = model.device().clone().autodiff();
    let rope = eesd_models::rope::Rope::new(c, &train);
    let weights = LayerHead::from_model(&model, HeadKind::Layer, 2, 3, None)
        .unwrap()
        .into_weights()
        .fork(&train);
    let hidden = |s: &[u32]| {
        model
            .forward_layers(model.embed(s).unwrap(), 0..2, &mut model.new_cache())
            .unwrap()
            .to_device(&train)
    };
    let lengths: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
    let ctx = AttentionContext::packed(&rope, c, &lengths).unwrap();
    let block = Tensor::cat(seqs.iter().map(|s| hidden(s)).collect(), 0);
    let packed = values(weights.forward(block, &rope, &ctx, None, c).unwrap());
    let mut row = 0;
    for s in seqs {
        let ctx = AttentionContext::for_config(&rope, c, 0, s.len());
        let alone = values(weights.forward(hidden(s), &rope, &ctx, None, c).unwrap());
        let part = &packed[row * c.hidden_size..(row + s.len()) * c.hidden_size];
        let diff = alone
            .iter()
            .zip(part)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-4, "sequence at row {row} differs by {diff}");
        row += s.len();
    }
}

#[test]
fn a_packed_block_computes_each_sequence_as_if_alone() {
    let model = tiny(24);
    let seqs: [&[u32]; 3] = [
        &[257, 72, 101, 108],
        &[257, 80, 81, 82, 83, 84, 85],
        &[257, 90],
    ];
    let lengths: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
    let ctx = AttentionContext::packed(model.rope(), model.config(), &lengths).unwrap();
    let packed = model
        .forward_packed(model.embed(&seqs.concat()).unwrap(), 0..4, &ctx)
        .unwrap();
    let mut row = 0;
    for s in seqs {
        let mut cache = model.new_cache();
        let alone = values(
            model
                .forward_layers(model.embed(s).unwrap(), 0..4, &mut cache)
                .unwrap(),
        );
        let part = values(packed.clone().narrow(0, row, s.len()));
        let diff = alone
            .iter()
            .zip(&part)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-4, "sequence at row {row} differs by {diff}");
        row += s.len();
    }
    // Mismatched contexts, empty sequences and a cache with a packed block are errors.
    let short = AttentionContext::packed(model.rope(), model.config(), &[4, 7]).unwrap();
    assert!(
        model
            .forward_packed(model.embed(&seqs.concat()).unwrap(), 0..4, &short)
            .is_err()
    );
    assert!(AttentionContext::packed(model.rope(), model.config(), &[3, 0]).is_err());
    assert!(AttentionContext::packed(model.rope(), model.config(), &[]).is_err());
    assert!(AttentionContext::packed(model.rope(), model.config(), &[100_000]).is_err());
    let mut cache = eesd_models::LayerCache::new();
    assert!(
        model.layers()[0]
            .forward(packed, model.rope(), &ctx, Some(&mut cache), 128)
            .is_err()
    );
}

/// A packed block of trees (`AttentionContext::packed_trees`, what a lookahead head's deeper
/// levels train on) computes each tree as if alone, and each row as the causal sequence of its
/// ancestors: bit for bit on flex between packed and alone.
#[test]
fn a_packed_block_of_trees_computes_each_tree_as_if_alone() {
    let model = tiny(26);
    // Tree rows: a trunk (each row the child of the one before), then rows hanging off it.
    let trees: [(&[u32], Vec<Option<usize>>); 2] = [
        (
            &[257, 72, 101, 108, 111, 33, 44],
            vec![None, Some(0), Some(1), Some(2), Some(0), Some(4), Some(3)],
        ),
        (&[257, 80, 81, 82], vec![None, Some(0), Some(1), Some(0)]),
    ];
    let masks: Vec<_> = trees
        .iter()
        .map(|(_, parents)| {
            std::sync::Arc::new(eesd_core::TreeMask::try_new(parents.clone()).unwrap())
        })
        .collect();
    let tokens: Vec<u32> = trees.iter().flat_map(|(t, _)| t.to_vec()).collect();
    let ctx = AttentionContext::packed_trees(model.rope(), model.config(), &masks).unwrap();
    let packed = model
        .forward_packed(model.embed(&tokens).unwrap(), 0..4, &ctx)
        .unwrap();
    let mut row = 0;
    for ((t, _), mask) in trees.iter().zip(&masks) {
        let one = AttentionContext::tree(model.rope(), model.config(), 0, mask.clone());
        let alone = model
            .forward_packed(model.embed(t).unwrap(), 0..4, &one)
            .unwrap();
        let part = values(packed.clone().narrow(0, row, t.len()));
        assert_rows_match(&values(alone), &part, "a tree packed and alone");
        // Each row is the last of the causal sequence of its ancestors.
        for r in 0..t.len() {
            let path: Vec<u32> = mask.ancestors(r).iter().map(|&a| t[a]).collect();
            let mut cache = model.new_cache();
            let causal = model
                .forward_layers(model.embed(&path).unwrap(), 0..4, &mut cache)
                .unwrap();
            let want = values(causal.narrow(0, path.len() - 1, 1));
            let got = values(packed.clone().narrow(0, row + r, 1));
            assert!(max_diff(&want, &got) < 1e-4, "tree row {r}");
        }
        row += t.len();
    }
    assert!(AttentionContext::packed_trees(model.rope(), model.config(), &[]).is_err());
}

#[test]
fn a_packed_batch_loss_is_the_mean_over_its_sequences() {
    let model = tiny(25);
    let data = self_generated(&model, 3, 12);
    let fresh = || {
        let head = LayerHead::from_model(&model, HeadKind::Layer, 2, 3, None).unwrap();
        let config = DistillConfig {
            ce_weight: 0.5,
            ..Default::default()
        };
        Distiller::new(&model, head, config).unwrap()
    };
    // The loss is computed before the update, so fresh distillers see the same weights.
    let alone: Vec<f64> = data
        .iter()
        .map(|s| fresh().train_step(&[&s.tokens]).unwrap())
        .collect();
    let batch: Vec<&[u32]> = data.iter().map(|s| s.tokens.as_slice()).collect();
    let packed = fresh().train_step(&batch).unwrap();
    // KL is a mean over positions; CE a mean over (here: all) positions too.
    let total: usize = data.iter().map(|s| s.tokens.len()).sum();
    let weighted: f64 = data
        .iter()
        .zip(&alone)
        .map(|(s, l)| l * s.tokens.len() as f64)
        .sum::<f64>()
        / total as f64;
    assert!(
        (packed - weighted).abs() < 1e-3 * weighted.abs().max(1.0),
        "packed loss {packed} vs weighted mean of alone {weighted}"
    );
    assert!(matches!(
        fresh().train_step(&[]),
        Err(TrainError::InvalidConfig(_))
    ));
    assert!(matches!(
        fresh().train_step(&[&[257]]),
        Err(TrainError::InvalidConfig(_))
    ));
}

#[test]
fn heads_sharing_one_teacher_pass_train_as_they_would_alone() {
    let model = tiny(26);
    let data = self_generated(&model, 4, 12);
    let fresh = |layer: usize| {
        let head = LayerHead::from_model(&model, HeadKind::Layer, layer, 3, None).unwrap();
        Distiller::new(&model, head, DistillConfig::default()).unwrap()
    };
    let wqkv = |d: Distiller| values(d.into_head().unwrap().weights().layer.wqkv.val());
    let (mut alone1, mut alone2) = (fresh(1), fresh(2));
    let (mut shared1, mut shared2) = (fresh(1), fresh(2));
    for s in &data {
        let batch = [s.tokens.as_slice()];
        let a = (
            alone1.train_step(&batch).unwrap(),
            alone2.train_step(&batch).unwrap(),
        );
        let teacher = Teacher::new(&model, &batch, &[2, 1]).unwrap();
        assert_eq!(teacher.positions(), s.tokens.len());
        let b = (
            shared1.train_step_on(&teacher).unwrap(),
            shared2.train_step_on(&teacher).unwrap(),
        );
        // Off flex the shared pass sums in another order.
        assert_scalar_match(b.0, a.0, 1e-4, "layer 1 loss");
        assert_scalar_match(b.1, a.1, 1e-4, "layer 2 loss");
    }
    assert_rows_match(&wqkv(alone1), &wqkv(shared1), "layer 1 head");
    assert_rows_match(&wqkv(alone2), &wqkv(shared2), "layer 2 head");
    // A teacher without the head's layer, or with a layer outside the model: typed errors.
    let batch = [data[0].tokens.as_slice()];
    let teacher = Teacher::new(&model, &batch, &[1]).unwrap();
    assert!(matches!(
        fresh(2).train_step_on(&teacher),
        Err(TrainError::InvalidConfig(_))
    ));
    for bad in [0, model.num_layers() + 1] {
        assert!(matches!(
            Teacher::new(&model, &batch, &[bad]),
            Err(TrainError::InvalidConfig(_))
        ));
    }
    // The last layer is there for lookahead heads: the states before the final norm.
    let all = model.num_layers();
    assert!(Teacher::new(&model, &batch, &[1, all]).is_ok());
}

#[test]
fn packing_keeps_order_and_the_token_budget() {
    assert_eq!(
        pack(&[3, 4, 5, 10, 2, 1], 8),
        vec![vec![0, 1], vec![2], vec![3], vec![4, 5]]
    );
    assert!(pack(&[], 8).is_empty());
}

#[test]
fn a_resumed_run_continues_exactly() {
    for kind in [HeadKind::Layer, HeadKind::Adapter, HeadKind::Lookahead] {
        a_resumed_run_continues_exactly_for(kind, 0, &[]);
    }
    // Heads of two layers resume with both; a lookahead head with its mix layers.
    for kind in [HeadKind::Layer, HeadKind::Lookahead] {
        a_resumed_run_continues_exactly_for(kind, 1, &[]);
    }
    a_resumed_run_continues_exactly_for(HeadKind::Lookahead, 0, &[1]);
}

fn a_resumed_run_continues_exactly_for(kind: HeadKind, extra_layers: usize, mix: &[usize]) {
    let model = tiny(26);
    let data = self_generated(&model, 4, 10);
    let subset = VocabSubset::new((0..200).collect(), 259).unwrap();
    let config = DistillConfig {
        learning_rate: 2e-3,
        warmup_steps: 2,
        total_steps: 6,
        ..Default::default()
    };
    let start = || {
        let head = LayerHead::from_model(&model, kind, 2, 2, Some(&subset)).unwrap();
        let head = head.deepened(&model, extra_layers).unwrap();
        let head = head.with_mix_layers(&model, mix).unwrap();
        Distiller::new(&model, head, config.clone()).unwrap()
    };
    let step = |d: &mut Distiller, i: usize| d.train_step(&[&data[i % data.len()].tokens]);
    let mut straight = start();
    let mut straight_losses = Vec::new();
    for i in 0..6 {
        straight_losses.push(step(&mut straight, i).unwrap());
    }

    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("run");
    let mut first = start();
    for i in 0..2 {
        step(&mut first, i).unwrap();
    }
    first
        .save_state(&prefix, serde_json::json!({"note": 1}))
        .unwrap();
    step(&mut first, 2).unwrap();
    first
        .save_state(&prefix, serde_json::json!({"note": 2}))
        .unwrap();
    drop(first);
    // Only the latest state's files are kept.
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(files, 3, "state json + head + optimizer");

    let (mut resumed, extra) = Distiller::resume(&model, &prefix).unwrap();
    assert_eq!(extra["note"], 2);
    assert_eq!(resumed.step(), 3);
    let mut resumed_losses = Vec::new();
    for i in 3..6 {
        resumed_losses.push(step(&mut resumed, i).unwrap());
    }
    assert_eq!(
        resumed_losses,
        straight_losses[3..],
        "{kind:?}: a resumed run must see the same losses"
    );
    let last_wo = |d: Distiller| {
        let head = d.into_head().unwrap();
        let w = head.weights();
        assert_eq!(w.depth(), 1 + extra_layers);
        values(w.deeper.last().unwrap_or(&w.layer).wo.val())
    };
    assert_eq!(
        last_wo(resumed),
        last_wo(straight),
        "{kind:?}: same weights"
    );

    // Another model shape, a broken state file, no state at all: typed errors.
    let other = tiny_with(
        &eesd_models::LlamaConfig {
            num_layers: 2,
            ..tiny_config()
        },
        1,
    );
    assert!(matches!(
        Distiller::resume(&other, &prefix),
        Err(TrainError::Model(ModelError::HeadMismatch(_)))
    ));
    std::fs::write(state_path(&prefix), "{").unwrap();
    assert!(matches!(
        Distiller::resume(&model, &prefix),
        Err(TrainError::Malformed { .. })
    ));
    assert!(matches!(
        Distiller::resume(&model, &dir.path().join("none")),
        Err(TrainError::Io { .. })
    ));
}

/// A head deepened by a layer whose output projections start at zero begins where the
/// one-layer head is (same loss) and then trains that layer, its zeroed projections included.
#[test]
fn a_deepened_head_starts_where_it_was_and_trains_its_new_layer() {
    let model = tiny(27);
    let data = self_generated(&model, 3, 10);
    let config = DistillConfig {
        learning_rate: 2e-3,
        warmup_steps: 1,
        total_steps: 4,
        ..Default::default()
    };
    for kind in [HeadKind::Layer, HeadKind::Lookahead] {
        let head = || LayerHead::from_model(&model, kind, 2, 3, None).unwrap();
        let mut one = Distiller::new(&model, head(), config.clone()).unwrap();
        let deeper = head().deepened(&model, 1).unwrap();
        let zero = values(deeper.weights().deeper[0].w_down.val());
        assert!(zero.iter().all(|&v| v == 0.0));
        let mut two = Distiller::new(&model, deeper, config.clone()).unwrap();
        let (a, b) = (
            one.train_step(&[&data[0].tokens]).unwrap(),
            two.train_step(&[&data[0].tokens]).unwrap(),
        );
        assert_scalar_match(b, a, 1e-5, &format!("{kind:?}: first loss"));
        for s in &data {
            two.train_step(&[&s.tokens]).unwrap();
        }
        let trained = two.into_head().unwrap();
        let second = &trained.weights().deeper[0];
        for (name, w) in [("wo", &second.wo), ("w_down", &second.w_down)] {
            let moved = values(w.val()).iter().any(|&v| v != 0.0);
            assert!(moved, "{kind:?}: the new layer's {name} did not train");
        }
    }
}

/// With native weights a model's layers hold lazy, frozen stand-ins for their quantized
/// blocks; a head initialised from one must still train every matrix (it once trained only its
/// norm gain).
#[test]
fn a_head_from_a_quantized_model_trains_all_its_weights() {
    use eesd_models::testing::tiny_quantized_gguf_bytes;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-q.gguf");
    std::fs::write(&path, tiny_quantized_gguf_bytes(&tiny_config(), 5)).unwrap();
    let device = eesd_models::testing::test_device().unwrap();
    let model = LoadedModel::load(&path, &device, &LoadOptions::default())
        .unwrap()
        .model;
    assert!(
        model.layers()[3].native.bytes() > 0,
        "the layers are held quantized"
    );
    let head = LayerHead::from_model(&model, HeadKind::Layer, 2, 3, None).unwrap();
    let matrices = |h: &LayerHead| {
        let l = &h.weights().layer;
        [&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down].map(|w| values(w.val()))
    };
    let before = matrices(&head);
    let mut d = Distiller::new(&model, head, DistillConfig::default()).unwrap();
    for _ in 0..3 {
        d.train_step(&[&[257, 72, 101, 108, 108, 111]]).unwrap();
    }
    let after = matrices(&d.into_head().unwrap());
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        assert!(a != b, "matrix {i} of the head's layer did not train");
    }
    // A head whose layer shares the model's frozen parameters is refused, not half-trained.
    let shared = eesd_models::LayerHeadWeights {
        layer: model.layers()[3].clone(),
        deeper: Vec::new(),
        norm: burn::module::Param::from_tensor(model.final_norm().clone()),
        fuse: None,
        kind: HeadKind::Layer,
        mix_layers: Vec::new(),
    };
    let head = LayerHead::from_weights(&model, 2, shared, None).unwrap();
    assert!(matches!(
        Distiller::new(&model, head, DistillConfig::default()),
        Err(TrainError::InvalidConfig(_))
    ));
}

/// A lookahead head mixing earlier layers' states learns their columns of its fusion (which
/// start at zero), on the model's states and, drafting deeper, on its own; the teacher's pass
/// must keep those layers.
#[test]
fn a_mixing_lookahead_head_learns_its_mix_columns() {
    let model = tiny(28);
    let (layers, d) = (model.num_layers(), model.config().hidden_size);
    let data = self_generated(&model, 4, 10);
    let batch = [data[0].tokens.as_slice(), data[1].tokens.as_slice()];
    let head = LayerHead::from_model(&model, HeadKind::Lookahead, layers, layers - 1, None)
        .unwrap()
        .with_mix_layers(&model, &[1, 2])
        .unwrap();
    let config = DistillConfig {
        levels: 2,
        warmup_steps: 0,
        ..Default::default()
    };
    let mut distiller = Distiller::new(&model, head, config).unwrap();
    assert_eq!(distiller.teacher_layers(), vec![1, 2, layers]);
    let without_mix = eesd_train::Teacher::new(&model, &batch, &[layers]).unwrap();
    assert!(distiller.train_step_on(&without_mix).is_err());
    for _ in 0..3 {
        let loss = distiller.train_step(&batch).unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{loss}");
    }
    let head = distiller.into_head().unwrap();
    assert_eq!(head.feature_layers(), vec![1, 2, layers]);
    let fuse = head.weights().fuse.as_ref().unwrap().val();
    let mix = values(fuse.narrow(1, 2 * d, 2 * d));
    assert!(mix.iter().any(|&v| v != 0.0), "the mix columns trained");
}

/// A lookahead head may read the last layer; it trains, saves and loads there, drafts only
/// through [`LookaheadHead`] (a chain loop gets an error, not wrong drafts), and chain heads
/// refuse to run as lookahead heads.
#[test]
fn a_lookahead_head_reads_the_last_layer_and_refuses_chains() {
    let model = tiny(27);
    let layers = model.num_layers();
    let data = self_generated(&model, 4, 10);
    let head =
        LayerHead::from_model(&model, HeadKind::Lookahead, layers, layers - 1, None).unwrap();
    let mut d = Distiller::new(&model, head, DistillConfig::default()).unwrap();
    let loss = d.train_step(&[&data[0].tokens, &data[1].tokens]).unwrap();
    assert!(loss.is_finite() && loss > 0.0, "{loss}");
    let head = d.into_head().unwrap();
    let tokens = [257, 80, 81, 82, 83];
    let reference = draft(&model, &head, &tokens);
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("head");
    let meta = metadata(&model, HeadKind::Lookahead, layers, None);
    save_layer_head(&prefix, &head, &meta, false).unwrap();
    let (loaded, _) = load_layer_head(&prefix, &model, None).unwrap();
    assert_eq!(loaded.kind(), HeadKind::Lookahead);
    assert_eq!(loaded.feature_layers(), vec![layers]);
    let diff = max_diff(&draft(&model, &loaded, &tokens), &reference);
    assert!(diff < 1e-4, "{diff}");

    // Chains need a chain head, and the other way round.
    let mut cache = model.new_cache();
    let h = model
        .forward_layers(model.embed(&tokens).unwrap(), 0..layers, &mut cache)
        .unwrap();
    let mut hc = DraftHead::new_cache(&loaded, &model);
    assert!(loaded.draft_logits(&model, h.clone(), &mut hc).is_err());
    let chain = LayerHead::from_model(&model, HeadKind::Layer, 2, 2, None).unwrap();
    assert!(eesd_models::load_lookahead_head(&prefix, &model, None).is_ok());
    let chain_prefix = dir.path().join("chain");
    let chain_meta = metadata(&model, HeadKind::Layer, 2, None);
    save_layer_head(&chain_prefix, &chain, &chain_meta, false).unwrap();
    assert!(matches!(
        eesd_models::load_lookahead_head(&chain_prefix, &model, None),
        Err(ModelError::HeadMismatch(_))
    ));
    let mut hc = LookaheadHead::new_cache(&chain, &model);
    assert!(
        chain
            .lookahead(&model, h.clone(), &tokens, &mut hc)
            .is_err()
    );
    // Mismatched states and tokens, and chain heads at layer L, are refused.
    let mut hc = LookaheadHead::new_cache(&loaded, &model);
    assert!(loaded.lookahead(&model, h, &tokens[1..], &mut hc).is_err());
    assert!(LayerHead::from_model(&model, HeadKind::Layer, layers, 0, None).is_err());
    assert!(LayerHead::from_model(&model, HeadKind::Lookahead, layers + 1, 0, None).is_err());
}

#[test]
fn training_on_answers_only_scores_the_positions_evaluation_scores() {
    let model = tiny(27);
    let data: Vec<Sequence> = self_generated(&model, 3, 12)
        .into_iter()
        .enumerate()
        .map(|(i, s)| Sequence {
            prompt_len: 2 + i,
            ..s
        })
        .collect();
    for kind in [HeadKind::Layer, HeadKind::Lookahead] {
        let exit = if kind == HeadKind::Lookahead { 4 } else { 2 };
        let fresh = |answers_only: bool| {
            let head = LayerHead::from_model(&model, kind, exit, 3, None).unwrap();
            let config = DistillConfig {
                answers_only,
                ..Default::default()
            };
            Distiller::new(&model, head, config).unwrap()
        };
        let teacher = |seqs: &[Sequence]| {
            let tokens: Vec<&[u32]> = seqs.iter().map(|s| s.tokens.as_slice()).collect();
            Teacher::new(&model, &tokens, &[exit]).unwrap()
        };
        let prompts = |seqs: &[Sequence]| seqs.iter().map(|s| s.prompt_len).collect::<Vec<_>>();
        // The loss (taken before the update) is the KL evaluation reports on the same rows.
        let mut alone = Vec::new();
        for s in &data {
            let one = std::slice::from_ref(s);
            let eval = fresh(true).evaluate(one, 4).unwrap();
            let t = teacher(one).with_prompt_lengths(prompts(one)).unwrap();
            let loss = fresh(true).train_step_on(&t).unwrap();
            assert!(
                (loss - eval.kl).abs() < 1e-4 * eval.kl.max(1.0),
                "{kind:?}: loss {loss} vs evaluated KL {}",
                eval.kl
            );
            alone.push((loss, eval.positions));
        }
        // Packed: the mean over all the block's answer rows.
        let t = teacher(&data).with_prompt_lengths(prompts(&data)).unwrap();
        let packed = fresh(true).train_step_on(&t).unwrap();
        let rows: usize = alone.iter().map(|a| a.1).sum();
        let mean = alone.iter().map(|(l, n)| l * *n as f64).sum::<f64>() / rows as f64;
        assert!(
            (packed - mean).abs() < 1e-4 * mean.max(1.0),
            "{packed} vs {mean}"
        );
        // Without prompt lengths, or with lengths that do not fit, it refuses.
        assert!(matches!(
            fresh(true).train_step_on(&teacher(&data)),
            Err(TrainError::InvalidConfig(_))
        ));
        assert!(matches!(
            teacher(&data).with_prompt_lengths(vec![1, 1]),
            Err(TrainError::InvalidConfig(_))
        ));
        assert!(matches!(
            teacher(&data).with_prompt_lengths(vec![1, 1, 99]),
            Err(TrainError::InvalidConfig(_))
        ));
        // Every position scored: the loss of training on all of them.
        let all = teacher(&data[..1]);
        let with_all = teacher(&data[..1]).with_prompt_lengths(vec![1]).unwrap();
        let (a, b) = (
            fresh(false).train_step_on(&all).unwrap(),
            fresh(true).train_step_on(&with_all).unwrap(),
        );
        assert_eq!(a, b, "{kind:?}");
    }
}

/// Training a lookahead head on its own states scores, at level `d`, exactly the draft that
/// drafting `d` levels deep computes (`HeadDrafter::with_levels`): the head's cache holds the
/// model-state rows before the root, each deeper row reads the head's state of the level
/// before and the next true token. Three sequences packed in one block, three levels.
#[test]
fn deeper_levels_learn_what_drafting_deeper_computes() {
    let model = tiny(23);
    let layers = model.num_layers();
    let new_head =
        || LayerHead::from_model(&model, HeadKind::Lookahead, layers, layers - 1, None).unwrap();
    let config = DistillConfig {
        levels: 3,
        ..Default::default()
    };
    let distiller = Distiller::new(&model, new_head(), config).unwrap();
    let head = new_head();
    // The middle one is too short for the third level: its rows are keys for no deeper row.
    let sequences: [&[u32]; 3] = [
        &[257, 65, 97, 48, 12, 40, 99, 3, 71],
        &[257, 66, 67],
        &[257, 70, 80, 90, 100],
    ];
    let teacher = Teacher::new(&model, &sequences, &[layers]).unwrap();
    let levels = distiller.level_log_probs(&teacher).unwrap();
    assert_eq!(levels.len(), 3);
    let mut checked = 0;
    let mut start = 0;
    for tokens in sequences {
        let mut cache = model.new_cache();
        let h = model
            .forward_layers(model.embed(tokens).unwrap(), 0..layers, &mut cache)
            .unwrap();
        // Teacher row `r` of this sequence is learnt at every level `d` with `r ≥ d`.
        for r in 1..tokens.len() {
            for (d, (logp, rows)) in levels.iter().enumerate() {
                let depth = d + 1;
                let Some(at) = rows.iter().position(|&row| row == start + r) else {
                    assert!(r < depth, "level {depth} misses row {r}");
                    continue;
                };
                // Model-state rows before the root, then one pass per level below it.
                let m = r + 1 - depth;
                let mut hc = LookaheadHead::new_cache(&head, &model);
                let mut draft = head
                    .lookahead(&model, h.clone().narrow(0, 0, m), &tokens[1..=m], &mut hc)
                    .unwrap();
                for j in 1..depth {
                    draft = head
                        .lookahead(&model, draft.state, &[tokens[m + j]], &mut hc)
                        .unwrap();
                }
                let want = values(burn::tensor::activation::log_softmax(draft.draft.logits, 1));
                let got = values(logp.clone().narrow(0, at, 1));
                assert!(
                    max_diff(&got, &want) < 1e-3,
                    "level {depth}, row {r}: off by {}",
                    max_diff(&got, &want)
                );
                checked += 1;
            }
        }
        start += tokens.len();
    }
    // Rows 1.. of each sequence at level 1, 2.. at level 2, 3.. at level 3.
    assert_eq!(checked, (8 + 7 + 6) + (2 + 1) + (4 + 3 + 2));
    // The head's own state is not the model's: level 2 drafts differ from level 1's.
    let (first, second) = (&levels[0], &levels[1]);
    let at = first.1.iter().position(|&r| r == second.1[0]).unwrap();
    let (one, two) = (
        values(first.0.clone().narrow(0, at, 1)),
        values(second.0.clone().narrow(0, 0, 1)),
    );
    assert!(max_diff(&one, &two) > 1e-3);
    // Training on two levels runs and reports the second level's held-out agreement.
    let two_levels = DistillConfig {
        levels: 2,
        learning_rate: 1e-3,
        ..Default::default()
    };
    let mut trainer = Distiller::new(&model, new_head(), two_levels).unwrap();
    for _ in 0..3 {
        assert!(trainer.train_step(&sequences).unwrap().is_finite());
    }
    let held = self_generated(&model, 2, 6);
    let metrics = trainer.evaluate(&held, 4).unwrap();
    assert_eq!(metrics.deeper_top1.len(), 1);
    assert!((0.0..=1.0).contains(&metrics.deeper_top1[0]));
    // Only lookahead heads read their own states, and the levels are bounded.
    let chain = LayerHead::from_model(&model, HeadKind::Layer, 2, 1, None).unwrap();
    let three = DistillConfig {
        levels: 3,
        ..Default::default()
    };
    assert!(matches!(
        Distiller::new(&model, chain, three),
        Err(TrainError::InvalidConfig(_))
    ));
    let too_many = DistillConfig {
        levels: eesd_train::MAX_LEVELS + 1,
        ..Default::default()
    };
    assert!(matches!(
        Distiller::new(&model, new_head(), too_many),
        Err(TrainError::InvalidConfig(_))
    ));
}

/// A head with a draft vocabulary, widened to the whole vocabulary, keeps its weights: its
/// logits at the draft vocabulary's tokens are the narrow head's, and the rest are there too.
#[test]
fn a_head_widened_to_the_whole_vocabulary_keeps_its_drafts() {
    let model = tiny(27);
    let vocab = model.config().vocab_size;
    let subset = VocabSubset::new((0..vocab as u32).step_by(3).collect(), vocab).unwrap();
    for kind in [HeadKind::Layer, HeadKind::Lookahead] {
        let exit = match kind {
            HeadKind::Lookahead => model.num_layers(),
            _ => 2,
        };
        let narrow = LayerHead::from_model(&model, kind, exit, 3, Some(&subset)).unwrap();
        let wide = narrow.with_full_vocabulary(&model).unwrap();
        assert_eq!(narrow.token_ids().map(<[u32]>::len), Some(subset.len()));
        assert!(wide.token_ids().is_none());
        let tokens = [257, 72, 101, 108, 108];
        let (some, all) = (
            draft(&model, &narrow, &tokens),
            draft(&model, &wide, &tokens),
        );
        // The last row's logits (a chain head drafts at every row): the subset's columns, then
        // (a lookahead head, fed the tokens) those of the tokens the subset lacks: 101.
        let rows = all.len() / vocab;
        let width = some.len() / rows;
        let extra: Vec<u32> = match kind {
            HeadKind::Lookahead => vec![101],
            _ => Vec::new(),
        };
        assert_eq!(width, subset.len() + extra.len(), "{kind:?}");
        let (some, all) = (&some[some.len() - width..], &all[all.len() - vocab..]);
        let ids = subset.ids().iter().chain(&extra);
        let picked: Vec<f32> = ids.map(|&id| all[id as usize]).collect();
        assert!(max_diff(some, &picked) < 1e-4, "{kind:?}");
    }
}
