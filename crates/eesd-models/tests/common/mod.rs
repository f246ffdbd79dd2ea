//! Shared helpers of the real-model tests: the model (fetched once into the cache) and the
//! golden reference of `../shared/reference`.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use burn::tensor::Device;
use eesd_models::{LoadOptions, LoadedModel, WeightDType, fetch};

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

impl Golden {
    /// Reference tokens worth comparing: up to the first step whose top-2 margin is tiny (another
    /// engine's rounding may flip the order there).
    pub fn reliable_len(&self) -> usize {
        self.greedy_top2_margins
            .iter()
            .position(|&x| x < 0.02)
            .map_or(self.greedy_ids.len(), |p| p + 1)
    }
}

pub fn workspace_root() -> PathBuf {
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
    eesd_models::testing::test_device().expect("EESD_TEST_BACKEND names a compiled backend")
}

/// The real model, loaded once per test binary.
pub fn model() -> &'static LoadedModel {
    model_in(WeightDType::F32)
}

/// The real model with weights in `dtype`, loaded once per test binary and dtype.
pub fn model_in(dtype: WeightDType) -> &'static LoadedModel {
    static MODELS: [OnceLock<LoadedModel>; WeightDType::ALL.len()] =
        [const { OnceLock::new() }; WeightDType::ALL.len()];
    let slot = WeightDType::ALL
        .iter()
        .position(|&d| d == dtype)
        .expect("a weight dtype");
    MODELS[slot].get_or_init(|| {
        let path = fetch::resolve_model(None).expect("model file");
        let options = LoadOptions {
            context_length: Some(2048),
            dtype,
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

/// A deliberately bad exit head: a random projection onto a random subset of the vocabulary.
/// Lossless decoding must not depend on draft quality, and this also exercises the
/// reduced-vocabulary path.
pub struct RandomHead {
    weight: burn::tensor::Tensor<2>,
    ids: std::sync::Arc<Vec<u32>>,
}

impl RandomHead {
    pub fn new(model: &eesd_models::Llama, subset: usize, seed: u64) -> Self {
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (h, v) = (model.config().hidden_size, model.config().vocab_size);
        let mut ids: Vec<u32> = (0..v as u32).collect();
        for i in 0..subset.min(v) {
            let j = rng.random_range(i..v);
            ids.swap(i, j);
        }
        ids.truncate(subset.min(v));
        let values: Vec<f32> = (0..h * ids.len())
            .map(|_| rng.random::<f32>() - 0.5)
            .collect();
        let weight = burn::tensor::Tensor::from_data(
            burn::tensor::TensorData::new(values, [h, ids.len()]),
            model.device(),
        );
        RandomHead {
            weight,
            ids: std::sync::Arc::new(ids),
        }
    }
}

impl eesd_core::DraftHead<eesd_models::Llama> for RandomHead {
    type Cache = usize;
    fn exit_layer(&self) -> Option<usize> {
        None
    }
    fn new_cache(&self, _: &eesd_models::Llama) -> usize {
        0
    }
    fn draft_logits(
        &self,
        _: &eesd_models::Llama,
        hidden: burn::tensor::Tensor<2>,
        seen: &mut usize,
    ) -> eesd_models::Result<eesd_core::DraftLogits> {
        *seen += hidden.dims()[0];
        Ok(eesd_core::DraftLogits {
            logits: hidden.matmul(self.weight.clone()),
            token_ids: Some(self.ids.clone()),
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

/// Every policy the generator accepts, by spec string.
pub const POLICIES: [&str; 7] = [
    "fixed:1",
    "fixed:4",
    "threshold:0.2",
    "beta-ts",
    "calibrated-ts",
    "cost-ts",
    "beta-ts:0.9",
];

/// One Spec-Bench question (first turn only).
#[derive(serde::Deserialize, Debug, Clone)]
pub struct Question {
    pub question_id: u64,
    pub category: String,
    pub turns: Vec<String>,
}

/// `n` Spec-Bench questions spread over the categories (round-robin, in file order).
pub fn spec_bench(n: usize) -> Vec<Question> {
    let shared = std::env::var_os("EESD_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared"));
    let path = shared.join("data/spec_bench.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let all: Vec<Question> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("question"))
        .collect();
    let mut categories: Vec<String> = Vec::new();
    for q in &all {
        if !categories.contains(&q.category) {
            categories.push(q.category.clone());
        }
    }
    let mut picked = Vec::new();
    for round in 0.. {
        for c in &categories {
            if let Some(q) = all.iter().filter(|q| &q.category == c).nth(round) {
                picked.push(q.clone());
            }
            if picked.len() == n {
                return picked;
            }
        }
    }
    picked
}

/// New tokens per prompt in the real-model identity tests (speculation against AR): 64 by
/// default; `scripts/test.sh` (CI) sets `EESD_IDENTITY_TOKENS=32` to fit its time, and 128 (or
/// more) makes a longer run.
pub fn identity_tokens() -> usize {
    std::env::var("EESD_IDENTITY_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(64)
}

/// Greedy generation of at most `max_new_tokens`, stopping at the real model's end-of-sequence
/// token.
pub fn greedy_config(max_new_tokens: usize) -> eesd_core::GenerationConfig {
    eesd_core::GenerationConfig {
        max_new_tokens,
        stop_tokens: model().tokenizer.eos_token_id().into_iter().collect(),
        ..Default::default()
    }
}

/// Counts (over a vocabulary of `vocab`) of the token at `position` in `runs` generations of
/// `prompt` by `g`, sampled hot (temperature 1.5, top-k 12) with seeds `run · 7919 + salt`;
/// `base` holds the rest of the configuration (mode, exit layer, tree budget).
pub fn sampled_histogram<M, H>(
    g: &mut eesd_core::Generator<'_, M, H>,
    prompt: &[u32],
    base: &eesd_core::GenerationConfig,
    vocab: usize,
    position: usize,
    runs: u64,
    salt: u64,
) -> Vec<usize>
where
    M: eesd_core::LayeredModel,
    H: eesd_core::DraftHead<M>,
{
    let mut counts = vec![0usize; vocab];
    for run in 0..runs {
        let config = eesd_core::GenerationConfig {
            max_new_tokens: position + 1,
            sampling: eesd_core::SamplingParams {
                temperature: 1.5,
                top_k: 12,
                top_p: 1.0,
            },
            seed: run * 7919 + salt,
            ..base.clone()
        };
        let out = g
            .generate(prompt, &config, |_| std::ops::ControlFlow::Continue(()))
            .unwrap();
        counts[out.tokens[position] as usize] += 1;
    }
    counts
}

/// A tiny random LLaMA (see `eesd_models::testing`), loaded through the GGUF path.
pub fn tiny(seed: u64) -> eesd_models::Llama {
    use eesd_models::testing::{tiny_config, tiny_gguf_bytes};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, tiny_gguf_bytes(&tiny_config(), seed)).unwrap();
    LoadedModel::load(&path, &device(), &LoadOptions::default())
        .unwrap()
        .model
}

/// The tiny model with Q4_1/Q8_0 matrices (see `tiny_quantized_gguf_bytes`), loaded with
/// native weights: the quantized kernels run.
pub fn tiny_quantized(seed: u64) -> eesd_models::Llama {
    use eesd_models::testing::{tiny_config, tiny_quantized_gguf_bytes};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-q.gguf");
    std::fs::write(&path, tiny_quantized_gguf_bytes(&tiny_config(), seed)).unwrap();
    let options = LoadOptions {
        dtype: WeightDType::Native,
        ..Default::default()
    };
    LoadedModel::load(&path, &device(), &options).unwrap().model
}

/// p-value of the chi-square test that two samples come from one distribution.
pub fn homogeneity_p(a: &[usize], b: &[usize]) -> f64 {
    use statrs::distribution::{ChiSquared, ContinuousCDF};
    let (na, nb) = (
        a.iter().sum::<usize>() as f64,
        b.iter().sum::<usize>() as f64,
    );
    let (mut stat, mut df) = (0.0, 0);
    for (&x, &y) in a.iter().zip(b) {
        let total = (x + y) as f64;
        if total < 5.0 {
            continue;
        }
        let (ea, eb) = (total * na / (na + nb), total * nb / (na + nb));
        stat += (x as f64 - ea).powi(2) / ea + (y as f64 - eb).powi(2) / eb;
        df += 1;
    }
    1.0 - ChiSquared::new((df - 1).max(1) as f64).unwrap().cdf(stat)
}

/// Asserts that two equally sized samples of token counts come from one distribution:
/// chi-square homogeneity p > 1e-3 and total variation < 0.06.
pub fn assert_same_distribution(a: &[usize], b: &[usize], what: &str) {
    let p = homogeneity_p(a, b);
    let (na, nb) = (
        a.iter().sum::<usize>() as f64,
        b.iter().sum::<usize>() as f64,
    );
    let tv: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 / na - y as f64 / nb).abs())
        .sum::<f64>()
        / 2.0;
    assert!(
        p > 1e-3 && tv < 0.06,
        "{what}: chi-square p = {p}, TV = {tv}"
    );
}

// Not every test binary uses them (as with the module's dead code above).
#[allow(unused_imports)]
pub use eesd_models::testing::{assert_rows_match, on_flex};
