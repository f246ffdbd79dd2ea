//! The teacher cache on a tiny random LLaMA: a head trained from cached teacher passes is the
//! head trained from fresh ones, bit for bit on flex (full or draft vocabulary, dense or native
//! weights, files with or without the greedy tokens), and files that do not fit are recomputed.

use std::collections::HashMap;

use eesd_models::testing::{
    assert_rows_match, assert_scalar_match, tiny_config, tiny_gguf_bytes, tiny_quantized_gguf_bytes,
};
use eesd_models::{HeadKind, LayerHead, Llama, LoadOptions, LoadedModel, VocabSubset, WeightDType};
use eesd_train::{CacheOutcome, DistillConfig, Distiller, Teacher, TeacherCache, TrainError};
use safetensors::SafeTensors;

fn tiny(seed: u64) -> Llama {
    load(tiny_gguf_bytes(&tiny_config(), seed), WeightDType::F32)
}

/// The tiny model with Q4_1/Q8_0 matrices, kept in their blocks.
fn tiny_native(seed: u64) -> Llama {
    load(
        tiny_quantized_gguf_bytes(&tiny_config(), seed),
        WeightDType::Native,
    )
}

fn load(bytes: Vec<u8>, dtype: WeightDType) -> Llama {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, bytes).unwrap();
    let device = eesd_models::testing::test_device().unwrap();
    let options = LoadOptions {
        dtype,
        ..Default::default()
    };
    LoadedModel::load(&path, &device, &options).unwrap().model
}

/// The trained head's weights, in order.
fn weights(d: Distiller) -> Vec<f32> {
    let head = d.into_head().unwrap();
    let w = head.weights();
    let mut out = Vec::new();
    for m in w.matrices() {
        out.extend(m.val().into_data().try_into_vec::<f32>().unwrap());
    }
    out.extend(w.norm.val().into_data().try_into_vec::<f32>().unwrap());
    out
}

fn distiller<'m>(
    model: &'m Llama,
    kind: HeadKind,
    exit: usize,
    subset: Option<&VocabSubset>,
) -> Distiller<'m> {
    let head = LayerHead::from_model(model, kind, exit, 1, subset).unwrap();
    let config = DistillConfig {
        learning_rate: 1e-2,
        warmup_steps: 1,
        total_steps: 12,
        ce_weight: 0.5,
        ..Default::default()
    };
    Distiller::new(model, head, config).unwrap()
}

/// Rewrites every file in `dir` without its `argmax` tensor, as the cache wrote them before
/// it kept the greedy tokens.
fn drop_greedy_tokens(dir: &std::path::Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta: HashMap<String, String> = meta.metadata().clone().unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let kept: Vec<_> = st
            .tensors()
            .into_iter()
            .filter(|(name, _)| name != "argmax")
            .collect();
        assert!(
            kept.len() < st.len(),
            "{} has its greedy tokens",
            path.display()
        );
        std::fs::write(&path, safetensors::serialize(kept, Some(meta)).unwrap()).unwrap();
    }
}

#[test]
fn a_head_trained_from_cached_teachers_is_the_head_trained_from_fresh_ones() {
    for (model, subset) in [
        (tiny(31), None),
        (tiny(31), Some(vec![3, 0, 7, 9, 20, 1])),
        (tiny_native(31), Some(vec![5, 2, 11, 8, 1, 30])),
    ] {
        let subset = subset.map(|ids| VocabSubset::new(ids, model.config().vocab_size).unwrap());
        trains_alike(&model, subset.as_ref());
    }
}

fn trains_alike(model: &Llama, subset: Option<&VocabSubset>) {
    let layers = model.num_layers();
    // Three blocks, one of two packed sequences; four passes over them.
    let blocks: Vec<Vec<Vec<u32>>> = vec![
        vec![vec![1, 5, 9, 2, 7, 7, 3]],
        vec![vec![4, 4, 8, 1], vec![9, 3, 2, 6, 5]],
        vec![vec![2, 11, 6, 6, 10, 1, 3, 8]],
    ];
    for (kind, exit) in [(HeadKind::Layer, 1), (HeadKind::Lookahead, layers)] {
        let dir = tempfile::tempdir().unwrap();
        let files = dir.path().join("teacher");
        let cache = TeacherCache::open(&files, "tiny 31").unwrap();
        let (mut fresh, mut cached) = (
            distiller(model, kind, exit, subset),
            distiller(model, kind, exit, subset),
        );
        let mut outcomes = Vec::new();
        for step in 0..12 {
            if step == 6 {
                drop_greedy_tokens(&files);
            }
            let b = step % blocks.len();
            let batch: Vec<&[u32]> = blocks[b].iter().map(Vec::as_slice).collect();
            let want = fresh
                .train_step_on(&Teacher::new(model, &batch, &[exit]).unwrap())
                .unwrap();
            // The cache keeps layer 2 too (a run training several heads asks for all).
            let (teacher, outcome) = cache
                .teacher(model, &format!("block-{b}"), &batch, &[exit, 2])
                .unwrap();
            outcomes.push(outcome);
            let got = cached.train_step_on(&teacher).unwrap();
            // LibTorch does not repeat a pass bit for bit, and the small differences grow over
            // the steps.
            assert_scalar_match(got, want, 1e-3, &format!("{kind:?} step {step}"));
        }
        assert_eq!(outcomes[..3], [CacheOutcome::Stored; 3]);
        assert!(outcomes[3..].iter().all(|&o| o == CacheOutcome::Hit));
        assert_rows_match(&weights(cached), &weights(fresh), &format!("{kind:?}"));
    }
}

#[test]
fn files_that_do_not_fit_are_computed_again() {
    let model = tiny(32);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("teacher");
    let cache = TeacherCache::open(&path, "tiny 32").unwrap();
    let a: &[&[u32]] = &[&[1, 2, 3, 4, 5]];
    let b: &[&[u32]] = &[&[1, 2, 3, 4, 6]];
    let outcome = |cache: &TeacherCache, seqs: &[&[u32]], layers: &[usize]| {
        cache.teacher(&model, "k", seqs, layers).unwrap().1
    };
    assert_eq!(outcome(&cache, a, &[1]), CacheOutcome::Stored);
    assert_eq!(outcome(&cache, a, &[1]), CacheOutcome::Hit);
    // Other tokens under the same key, a layer the file lacks, another teacher.
    assert_eq!(outcome(&cache, b, &[1]), CacheOutcome::Stored);
    assert_eq!(outcome(&cache, b, &[1, 2]), CacheOutcome::Stored);
    assert_eq!(outcome(&cache, b, &[2]), CacheOutcome::Hit);
    let other = TeacherCache::open(&path, "another model").unwrap();
    assert_eq!(outcome(&other, b, &[2]), CacheOutcome::Stored);
    assert_eq!(outcome(&cache, b, &[2]), CacheOutcome::Stored);
    // A torn or garbled file.
    let file = path.join("k.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    assert_eq!(outcome(&cache, b, &[2]), CacheOutcome::Stored);
    std::fs::write(&file, b"not a safetensors file").unwrap();
    assert_eq!(outcome(&cache, b, &[2]), CacheOutcome::Stored);
    assert_eq!(outcome(&cache, b, &[2]), CacheOutcome::Hit);
    // Keys are plain file names.
    for key in ["", "../k", "a/b", "k.x"] {
        let err = cache.teacher(&model, key, a, &[1]).err();
        assert!(matches!(err, Some(TrainError::InvalidConfig(_))), "{key}");
    }
    // No scratch file is left behind.
    let names: Vec<String> = std::fs::read_dir(&path)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["k.safetensors"]);
}
