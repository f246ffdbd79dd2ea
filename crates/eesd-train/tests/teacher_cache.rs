//! The teacher cache on a tiny random LLaMA: a head trained from cached teacher passes is the
//! head trained from fresh ones, bit for bit, and files that do not fit are recomputed.

use eesd_core::Backend;
use eesd_models::testing::{tiny_config, tiny_gguf_bytes};
use eesd_models::{HeadKind, LayerHead, Llama, LoadOptions, LoadedModel};
use eesd_train::{CacheOutcome, DistillConfig, Distiller, Teacher, TeacherCache, TrainError};

fn tiny(seed: u64) -> Llama {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, tiny_gguf_bytes(&tiny_config(), seed)).unwrap();
    let device = Backend::default_compiled().unwrap().device().unwrap();
    LoadedModel::load(&path, &device, &LoadOptions::default())
        .unwrap()
        .model
}

/// Every trained value of the head, as bits.
fn bits(d: Distiller) -> Vec<u32> {
    let head = d.into_head().unwrap();
    let w = head.weights();
    let mut out = Vec::new();
    for m in w.matrices() {
        let v = m.val().into_data().try_into_vec::<f32>().unwrap();
        out.extend(v.iter().map(|x| x.to_bits()));
    }
    let norm = w.norm.val().into_data().try_into_vec::<f32>().unwrap();
    out.extend(norm.iter().map(|x| x.to_bits()));
    out
}

fn distiller(model: &Llama, kind: HeadKind, exit: usize) -> Distiller<'_> {
    let head = LayerHead::from_model(model, kind, exit, 1, None).unwrap();
    let config = DistillConfig {
        learning_rate: 1e-2,
        warmup_steps: 1,
        total_steps: 12,
        ce_weight: 0.5,
        ..Default::default()
    };
    Distiller::new(model, head, config).unwrap()
}

#[test]
fn a_head_trained_from_cached_teachers_is_the_head_trained_from_fresh_ones() {
    let model = tiny(31);
    let layers = model.num_layers();
    // Three blocks, one of two packed sequences; four passes over them.
    let blocks: Vec<Vec<Vec<u32>>> = vec![
        vec![vec![1, 5, 9, 2, 7, 7, 3]],
        vec![vec![4, 4, 8, 1], vec![9, 3, 2, 6, 5]],
        vec![vec![2, 11, 6, 6, 10, 1, 3, 8]],
    ];
    for (kind, exit) in [(HeadKind::Layer, 1), (HeadKind::Lookahead, layers)] {
        let dir = tempfile::tempdir().unwrap();
        let cache = TeacherCache::open(&dir.path().join("teacher"), "tiny 31").unwrap();
        let (mut fresh, mut cached) =
            (distiller(&model, kind, exit), distiller(&model, kind, exit));
        let mut outcomes = Vec::new();
        for step in 0..12 {
            let b = step % blocks.len();
            let batch: Vec<&[u32]> = blocks[b].iter().map(Vec::as_slice).collect();
            let want = fresh
                .train_step_on(&Teacher::new(&model, &batch, &[exit]).unwrap())
                .unwrap();
            // The cache keeps layer 2 too (a run training several heads asks for all).
            let (teacher, outcome) = cache
                .teacher(&model, &format!("block-{b}"), &batch, &[exit, 2])
                .unwrap();
            outcomes.push(outcome);
            let got = cached.train_step_on(&teacher).unwrap();
            assert_eq!(got.to_bits(), want.to_bits(), "{kind:?} step {step}");
        }
        assert_eq!(outcomes[..3], [CacheOutcome::Stored; 3]);
        assert!(outcomes[3..].iter().all(|&o| o == CacheOutcome::Hit));
        assert_eq!(bits(cached), bits(fresh), "{kind:?}");
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
