//! Heads of several decoder layers ([`LayerHead::deepened`]) on tiny random LLaMA models: a
//! deepened head drafts exactly as before until trained; deeper heads with layers of their own
//! keep EESD chains and lookahead trees token-identical to AR, with f32 and native weights;
//! checkpoints keep every layer, and malformed or oversized ones are refused.

mod common;

use std::ops::ControlFlow;

use burn::module::Param;
use burn::tensor::{Distribution, Tensor};
use common::{assert_rows_match, tiny, tiny_quantized};
use eesd_bandit::Policy;
use eesd_core::drafters::{DrafterSpec, HeadDrafter};
use eesd_core::{
    DraftHead, Drafter, GenerationConfig, GenerationOutput, Generator, LookaheadHead, Mode,
};
use eesd_models::checkpoint::{
    FORMAT_VERSION, HeadMetadata, load_layer_head, read_metadata, save_layer_head,
};
use eesd_models::{HeadKind, LayerHead, Llama, MAX_HEAD_LAYERS, ModelError, VocabSubset};

const PROMPT: [u32; 6] = [257, 72, 101, 108, 108, 111];

/// The layer-`n` states of the prompt's positions.
fn states(model: &Llama, n: usize) -> Tensor<2> {
    let mut cache = model.new_cache();
    let h = model.embed(&PROMPT).unwrap();
    model.forward_layers(h, 0..n, &mut cache).unwrap()
}

/// A head's drafts for the prompt's positions at its exit layer: chain logits of every
/// position, or a lookahead head's draft after the last one.
fn drafts(model: &Llama, head: &LayerHead, n: usize) -> Vec<f32> {
    let logits = match head.kind() {
        HeadKind::Lookahead => {
            let mut cache = LookaheadHead::new_cache(head, model);
            let rows = states(model, n).narrow(0, 0, PROMPT.len() - 1);
            head.lookahead(model, rows, &PROMPT[1..], &mut cache)
                .unwrap()
                .draft
                .logits
        }
        _ => {
            let mut cache = DraftHead::new_cache(head, model);
            head.draft_logits(model, states(model, n), &mut cache)
                .unwrap()
                .logits
        }
    };
    logits
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

/// `head` deepened by one layer whose weights are random and non-zero: a second layer that
/// changes every draft.
fn with_random_second_layer(model: &Llama, head: LayerHead, n: usize) -> LayerHead {
    let ids = head.token_ids().map(<[u32]>::to_vec);
    let mut w = head.deepened(model, 1).unwrap().into_weights();
    let random = |p: &Param<Tensor<2>>| {
        let dims = p.val().dims();
        Param::from_tensor(Tensor::random(
            dims,
            Distribution::Normal(0.0, 0.05),
            model.device(),
        ))
    };
    let second = &mut w.deeper[0];
    second.wo = random(&second.wo);
    second.w_down = random(&second.w_down);
    let subset = ids.map(|ids| VocabSubset::new(ids, model.config().vocab_size).unwrap());
    LayerHead::from_weights(model, n, w, subset.as_ref()).unwrap()
}

#[test]
fn a_deepened_head_drafts_as_before_until_trained() {
    for model in [tiny(0), tiny_quantized(3)] {
        let layers = model.num_layers();
        let subset = VocabSubset::new((0..64).collect(), model.config().vocab_size).unwrap();
        for (kind, n) in [(HeadKind::Layer, 2), (HeadKind::Lookahead, layers)] {
            let init = n.min(layers - 1);
            let head = LayerHead::from_model(&model, kind, n, init, Some(&subset)).unwrap();
            let before = drafts(&model, &head, n);
            let deeper = head.deepened(&model, 2).unwrap();
            assert_eq!(deeper.weights().depth(), 3);
            assert_eq!(deeper.token_ids(), Some(subset.ids()));
            assert_rows_match(&before, &drafts(&model, &deeper, n), &format!("{kind:?}"));
        }
        // Adapters stay one attention half; no head grows past the limit.
        let adapter = LayerHead::from_model(&model, HeadKind::Adapter, 2, 2, None).unwrap();
        assert!(matches!(
            adapter.deepened(&model, 1),
            Err(ModelError::InvalidArgument(_))
        ));
        let head = LayerHead::from_model(&model, HeadKind::Layer, 2, 2, None).unwrap();
        assert!(head.deepened(&model, MAX_HEAD_LAYERS).is_err());
    }
}

fn eesd(model: &Llama, head: &LayerHead, n: usize, config: &GenerationConfig) -> Vec<u32> {
    let mut g = Generator::new(model)
        .with_head(head)
        .with_policy(Policy::parse("fixed:3", 0).unwrap());
    let config = GenerationConfig {
        mode: Mode::Eesd,
        exit_layer: Some(n),
        ..config.clone()
    };
    g.generate(&PROMPT, &config, |_| ControlFlow::Continue(()))
        .unwrap()
        .tokens
}

fn generate(
    model: &Llama,
    drafter: Option<Box<dyn Drafter + '_>>,
    config: &GenerationConfig,
) -> GenerationOutput {
    let mut g = Generator::new(model);
    if let Some(d) = drafter {
        g = g.with_drafter(d);
    }
    g.generate(&PROMPT, config, |_| ControlFlow::Continue(()))
        .unwrap()
}

#[test]
fn deeper_heads_keep_chains_and_trees_lossless() {
    for model in [tiny(1), tiny_quantized(4)] {
        let (vocab, layers) = (model.config().vocab_size, model.num_layers());
        let ar_config = GenerationConfig {
            max_new_tokens: 40,
            ..Default::default()
        };
        let ar = generate(&model, None, &ar_config).tokens;
        for n in [1, 3] {
            let head = LayerHead::from_model(&model, HeadKind::Layer, n, n, None).unwrap();
            let head = with_random_second_layer(&model, head, n);
            assert_eq!(eesd(&model, &head, n, &ar_config), ar, "chain head at {n}");
        }
        let head =
            LayerHead::from_model(&model, HeadKind::Lookahead, layers, layers - 1, None).unwrap();
        let head = with_random_second_layer(&model, head, layers);
        for (budget, levels) in [(4, 1), (16, 3)] {
            let config = GenerationConfig {
                mode: Mode::Tree,
                tree_budget: budget,
                ..ar_config.clone()
            };
            let spec: DrafterSpec = format!("opt@{budget}").parse().unwrap();
            let d = HeadDrafter::new(&model, &head, spec.build(vocab)).with_levels(levels);
            let out = generate(&model, Some(Box::new(d)), &config);
            assert_eq!(
                out.tokens, ar,
                "lookahead tree of {budget}, {levels} levels"
            );
        }
    }
}

fn metadata(model: &Llama, head: &LayerHead, n: usize) -> HeadMetadata {
    HeadMetadata {
        format_version: FORMAT_VERSION,
        head_kind: head.kind().name().into(),
        base_model_sha256: "0".repeat(64),
        base_model_name: "tiny.gguf".into(),
        exit_layer: n,
        hidden_size: model.config().hidden_size,
        vocab_subset: head.token_ids().map(<[u32]>::to_vec),
        training: serde_json::json!({}),
        metrics: serde_json::json!({}),
    }
}

#[test]
fn checkpoints_keep_every_layer_and_refuse_bad_ones() {
    let model = tiny(2);
    let dir = tempfile::tempdir().unwrap();
    let layers = model.num_layers();
    for (kind, n) in [(HeadKind::Layer, 2), (HeadKind::Lookahead, layers)] {
        let head = LayerHead::from_model(&model, kind, n, n.min(layers - 1), None).unwrap();
        let one_layer = drafts(&model, &head, n);
        let head = with_random_second_layer(&model, head, n);
        assert_ne!(one_layer, drafts(&model, &head, n), "the second layer runs");
        let prefix = dir.path().join(format!("{kind:?}"));
        save_layer_head(&prefix, &head, &metadata(&model, &head, n), false).unwrap();
        let (loaded, _) = load_layer_head(&prefix, &model, None).unwrap();
        assert_eq!(loaded.weights().depth(), 2);
        let (a, b) = (drafts(&model, &head, n), drafts(&model, &loaded, n));
        assert_rows_match(&a, &b, &format!("{kind:?} reloaded"));
    }
    let prefix = dir.path().join("Layer");
    let (st, _) = eesd_models::checkpoint::checkpoint_paths(&prefix);
    let saved = tensors_of(&std::fs::read(&st).unwrap());
    // An adapter (one attention half) with a second layer is refused.
    let (_, json) = eesd_models::checkpoint::checkpoint_paths(&prefix);
    let layer_meta = std::fs::read_to_string(&json).unwrap();
    let adapter_meta = layer_meta.replace("\"head_kind\": \"layer\"", "\"head_kind\": \"adapter\"");
    assert_ne!(adapter_meta, layer_meta);
    std::fs::write(&json, adapter_meta).unwrap();
    assert!(matches!(
        load_layer_head(&prefix, &model, None),
        Err(ModelError::MalformedHead { .. })
    ));
    std::fs::write(&json, layer_meta).unwrap();
    // More layers than a head may have (`layer1.*` copied up to `layer8.*`) are refused.
    let mut deep = saved.clone();
    for i in 2..=MAX_HEAD_LAYERS {
        for (name, shape, bytes) in &saved {
            if let Some(field) = name.strip_prefix("layer1.") {
                deep.push((format!("layer{i}.{field}"), shape.clone(), bytes.clone()));
            }
        }
    }
    std::fs::write(&st, serialize(&deep)).unwrap();
    assert!(matches!(
        load_layer_head(&prefix, &model, None),
        Err(ModelError::MalformedHead { .. })
    ));
    // A second layer whose matrix has the wrong shape is refused, not half-loaded.
    let mut bad = saved;
    let wo = bad.iter_mut().find(|(n, _, _)| n == "layer1.wo").unwrap();
    wo.1[0] -= 1;
    let row = 4 * wo.1[1];
    wo.2.truncate(wo.2.len() - row);
    std::fs::write(&st, serialize(&bad)).unwrap();
    assert!(read_metadata(&prefix).is_ok());
    assert!(matches!(
        load_layer_head(&prefix, &model, None),
        Err(ModelError::HeadMismatch(_))
    ));
}

/// A safetensors file's tensors as (name, shape, f32 bytes).
fn tensors_of(bytes: &[u8]) -> Vec<(String, Vec<usize>, Vec<u8>)> {
    let tensors = safetensors::SafeTensors::deserialize(bytes).unwrap();
    tensors
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, v.shape().to_vec(), v.data().to_vec()))
        .collect()
}

fn serialize(tensors: &[(String, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views = tensors.iter().map(|(n, s, b)| {
        let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
        (n.clone(), v.unwrap())
    });
    safetensors::serialize(views.collect::<Vec<_>>(), None).unwrap()
}
