//! Shared helpers of the real-model tests: the model (fetched once into the cache) and the
//! golden reference of `../shared/reference`.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use burn::tensor::Device;
use eesd_models::{LoadOptions, LoadedModel, fetch};

/// One golden entry.
#[derive(serde::Deserialize, Debug)]
pub struct Golden {
    pub text: String,
    pub prompt_ids: Vec<u32>,
    pub last_logits_top5: Vec<(u32, f32)>,
    pub greedy_ids: Vec<u32>,
    pub greedy_top2_margins: Vec<f32>,
    pub greedy_text: String,
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The golden entries; `EESD_SHARED` overrides the location of the shared folder.
pub fn golden() -> Vec<Golden> {
    let shared = std::env::var_os("EESD_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared"));
    let path = shared.join("reference/smollm2-135m-instruct-q4_1.golden.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden json")
}

/// The device the tests run on: `$EESD_TEST_BACKEND` (flex, tch, ...) or the default build's.
pub fn device() -> Device {
    match std::env::var("EESD_TEST_BACKEND") {
        Ok(name) => name
            .parse::<eesd_core::Backend>()
            .and_then(|b| b.device())
            .expect("EESD_TEST_BACKEND"),
        Err(_) => eesd_core::Backend::default_compiled()
            .expect("a compiled backend")
            .device()
            .unwrap(),
    }
}

/// The real model, loaded once per test binary.
pub fn model() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = fetch::resolve_model(None).expect("model file");
        let options = LoadOptions {
            context_length: Some(2048),
            ..Default::default()
        };
        LoadedModel::load(&path, &device(), &options).expect("load model")
    })
}

/// Row `i` of a `[t, vocab]` logits tensor as a Vec.
pub fn row(logits: &burn::tensor::Tensor<2>, i: usize) -> Vec<f32> {
    logits
        .clone()
        .narrow(0, i, 1)
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 data")
}

pub fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv { (i, x) } else { (bi, bv) }
        })
        .0 as u32
}

/// The `k` largest (id, logit) pairs, descending.
pub fn top_k(v: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
    idx.into_iter().take(k).map(|i| (i as u32, v[i])).collect()
}
