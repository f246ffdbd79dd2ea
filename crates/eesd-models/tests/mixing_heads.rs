//! Lookahead heads that read earlier layers' states beside their layer N's (EAGLE-3's mix of
//! low, middle and high features, [`LayerHead::with_mix_layers`]) on tiny random LLaMA models:
//! a head given mix layers drafts as before until trained, and hands back its own state in the
//! layout of its input; bad layer lists and state widths are errors; checkpoints keep the
//! layers, and a weights file naming bad ones is refused. (Trees with mixing heads stay
//! token-identical to AR: `tree_tiny.rs`.)

mod common;

use burn::module::Param;
use burn::tensor::{Distribution, Tensor};
use common::{tiny, tiny_quantized};
use eesd_core::LookaheadHead;
use eesd_models::checkpoint::{FORMAT_VERSION, HeadMetadata, load_layer_head, save_layer_head};
use eesd_models::{HeadKind, LayerHead, Llama, ModelError};

const PROMPT: [u32; 6] = [257, 72, 101, 108, 108, 111];

/// The prompt's states after each of `layers` (ascending), side by side.
fn states(model: &Llama, layers: &[usize]) -> Tensor<2> {
    let mut cache = model.new_cache();
    let mut x = model.embed(&PROMPT).unwrap();
    let (mut done, mut kept) = (0, Vec::new());
    for &l in layers {
        x = model.forward_layers(x, done..l, &mut cache).unwrap();
        kept.push(x.clone());
        done = l;
    }
    Tensor::cat(kept, 1)
}

fn values(t: Tensor<2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

/// A lookahead head's draft after the prompt (from the states of every position but the last,
/// each with the token after it) and the state it hands back for drafting deeper.
fn draft(model: &Llama, head: &LayerHead) -> (Vec<f32>, Tensor<2>) {
    let mut cache = LookaheadHead::new_cache(head, model);
    let rows = states(model, &head.feature_layers()).narrow(0, 0, PROMPT.len() - 1);
    let out = head
        .lookahead(model, rows, &PROMPT[1..], &mut cache)
        .unwrap();
    (values(out.draft.logits), out.state)
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 * (1.0 + x.abs()),
            "{what}: {i}: {x} vs {y}"
        );
    }
}

fn lookahead(model: &Llama) -> LayerHead {
    let n = model.num_layers();
    LayerHead::from_model(model, HeadKind::Lookahead, n, n - 1, None).unwrap()
}

/// `head` with random columns for its mix layers, so that they move its drafts.
fn with_random_mix(model: &Llama, head: LayerHead) -> LayerHead {
    let n = model.num_layers();
    let mut weights = head.into_weights();
    let fuse = weights.fuse.take().unwrap().val();
    let noise = fuse.random_like(Distribution::Normal(0.0, 0.05));
    weights.fuse = Some(Param::from_tensor(fuse + noise));
    LayerHead::from_weights(model, n, weights, None).unwrap()
}

#[test]
fn a_head_given_mix_layers_drafts_as_before_until_trained() {
    for model in [tiny(0), tiny_quantized(3)] {
        let (n, d) = (model.num_layers(), model.config().hidden_size);
        let head = lookahead(&model);
        assert_eq!(head.feature_layers(), vec![n]);
        let (before, state) = draft(&model, &head);
        let mixed = head.with_mix_layers(&model, &[1, 2]).unwrap();
        assert_eq!(mixed.feature_layers(), vec![1, 2, n]);
        assert_eq!(
            mixed.weights().fuse.as_ref().unwrap().val().dims(),
            [d, 4 * d]
        );
        let (after, own) = draft(&model, &mixed);
        assert_close(&before, &after, "drafts");
        // Its own state comes back in the layout of its input: layer N's place, zeros before.
        assert_eq!(own.dims(), [1, 3 * d]);
        assert!(
            values(own.clone().narrow(1, 0, 2 * d))
                .iter()
                .all(|&v| v == 0.0)
        );
        assert_close(
            &values(own.narrow(1, 2 * d, d)),
            &values(state),
            "own state",
        );
        // Trained (here: random) mix columns change the drafts.
        let (moved, _) = draft(&model, &with_random_mix(&model, mixed));
        assert_ne!(moved, after);
    }
}

#[test]
fn bad_mix_layers_and_state_widths_are_errors() {
    let model = tiny(1);
    let n = model.num_layers();
    for bad in [vec![0], vec![n], vec![2, 1], vec![1, 1]] {
        assert!(
            matches!(
                lookahead(&model).with_mix_layers(&model, &bad),
                Err(ModelError::InvalidArgument(_))
            ),
            "{bad:?}"
        );
    }
    let chain = LayerHead::from_model(&model, HeadKind::Layer, 2, 2, None).unwrap();
    assert!(chain.with_mix_layers(&model, &[1]).is_err());
    let mixed = lookahead(&model).with_mix_layers(&model, &[1]).unwrap();
    assert!(mixed.with_mix_layers(&model, &[2]).is_err(), "mixes once");
    // States of layer N alone for a head that reads two layers.
    let head = lookahead(&model).with_mix_layers(&model, &[2]).unwrap();
    let mut cache = LookaheadHead::new_cache(&head, &model);
    let rows = states(&model, &[n]).narrow(0, 0, 2);
    assert!(matches!(
        head.lookahead(&model, rows, &PROMPT[1..3], &mut cache),
        Err(ModelError::InvalidArgument(_))
    ));
}

fn metadata(model: &Llama) -> HeadMetadata {
    HeadMetadata {
        format_version: FORMAT_VERSION,
        head_kind: "lookahead".into(),
        base_model_sha256: "0".repeat(64),
        base_model_name: "tiny.gguf".into(),
        exit_layer: model.num_layers(),
        hidden_size: model.config().hidden_size,
        vocab_subset: None,
        training: serde_json::json!({}),
        metrics: serde_json::json!({}),
    }
}

#[test]
fn checkpoints_keep_the_mix_layers_and_refuse_bad_ones() {
    let model = tiny(2);
    let n = model.num_layers();
    let dir = tempfile::tempdir().unwrap();
    let head = lookahead(&model).with_mix_layers(&model, &[1, 2]).unwrap();
    let head = with_random_mix(&model, head);
    let prefix = dir.path().join("mixed");
    save_layer_head(&prefix, &head, &metadata(&model), false).unwrap();
    let (loaded, _) = load_layer_head(&prefix, &model, None).unwrap();
    assert_eq!(loaded.feature_layers(), vec![1, 2, n]);
    assert_eq!(draft(&model, &loaded).0, draft(&model, &head).0);
    // A head without mix layers names none (and loads as every checkpoint before them).
    let plain = dir.path().join("plain");
    save_layer_head(&plain, &lookahead(&model), &metadata(&model), false).unwrap();
    let bytes = std::fs::read(plain.with_extension("safetensors")).unwrap();
    assert!(!String::from_utf8_lossy(&bytes).contains("mix_layers"));
    assert_eq!(
        load_layer_head(&plain, &model, None)
            .unwrap()
            .0
            .feature_layers(),
        vec![n]
    );
    // The weights file's header names the layers; a list out of order, out of range or not a
    // list is refused, and so is one that does not fit the fusion's width.
    let weights = prefix.with_extension("safetensors");
    let good = std::fs::read(&weights).unwrap();
    let at = good
        .windows(17)
        .position(|w| w == br#""mix_layers":"1,2"#)
        .expect("the header names the mix layers");
    for bad in ["2,1", "1,9", "1,x", "0,2"] {
        let mut bytes = good.clone();
        bytes[at + 14..at + 17].copy_from_slice(bad.as_bytes());
        std::fs::write(&weights, &bytes).unwrap();
        assert!(
            matches!(
                load_layer_head(&prefix, &model, None),
                Err(ModelError::MalformedHead { .. })
            ),
            "{bad}"
        );
    }
    let mut one = good.clone();
    one[at + 14..at + 17].copy_from_slice(b"1  ");
    std::fs::write(&weights, &one).unwrap();
    assert!(matches!(
        load_layer_head(&prefix, &model, None),
        Err(ModelError::HeadMismatch(_))
    ));
}
