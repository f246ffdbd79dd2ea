//! Loading tiny models written on the fly: GGUF and Hugging Face formats agree, caches are
//! consistent, and every kind of bad input is a typed error, never a panic.

use burn::tensor::Tensor;
use eesd_models::gguf::{GgufValue, GgufWriter};
use eesd_models::testing::{self, tiny_config, tiny_gguf_bytes};
use eesd_models::{GgmlType, GgufFile, LoadOptions, LoadedModel, ModelError, WeightName};

mod common;

use common::device;

fn load_bytes(bytes: Vec<u8>) -> Result<LoadedModel, ModelError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, bytes).unwrap();
    LoadedModel::load(&path, &device(), &LoadOptions::default())
}

fn to_vec(t: Tensor<2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

const TOKENS: [u32; 9] = [72, 101, 108, 108, 111, 44, 32, 119, 111];

#[test]
fn gguf_and_safetensors_give_the_same_logits() {
    let config = tiny_config();
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    testing::write_tiny_gguf(&gguf, &config, 7).unwrap();
    let hf = dir.path().join("hf");
    testing::write_tiny_hf_dir(&hf, &config, 7).unwrap();
    let a = LoadedModel::load(&gguf, &device(), &LoadOptions::default()).unwrap();
    let b = LoadedModel::load(&hf, &device(), &LoadOptions::default()).unwrap();
    assert_eq!(a.model.config(), b.model.config());
    let la = to_vec(a.model.forward(&TOKENS, &mut a.model.new_cache()).unwrap());
    let lb = to_vec(b.model.forward(&TOKENS, &mut b.model.new_cache()).unwrap());
    assert!(max_diff(&la, &lb) < 1e-4, "max diff {}", max_diff(&la, &lb));
    // Same tokenizer either way.
    let text = "Hello, 2024 world!";
    assert_eq!(
        a.tokenizer.encode(text).unwrap(),
        b.tokenizer.encode(text).unwrap()
    );
    assert_eq!(
        a.tokenizer
            .decode(&a.tokenizer.encode(text).unwrap(), false)
            .unwrap(),
        text
    );
}

#[test]
fn sharded_safetensors_load() {
    let config = tiny_config();
    let dir = tempfile::tempdir().unwrap();
    testing::write_tiny_hf_dir(dir.path(), &config, 3).unwrap();
    let single = LoadedModel::load(dir.path(), &device(), &LoadOptions::default()).unwrap();
    // Split the single file into two shards plus an index.
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names: Vec<String> = st.names().into_iter().map(String::from).collect();
    let mut weight_map = serde_json::Map::new();
    for (shard, chunk) in names.chunks(names.len() / 2 + 1).enumerate() {
        let file = format!("model-{shard:05}.safetensors");
        let views: Vec<_> = chunk
            .iter()
            .map(|n| (n.clone(), st.tensor(n).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.path().join(&file)).unwrap();
        chunk.iter().for_each(|n| {
            weight_map.insert(n.clone(), file.clone().into());
        });
    }
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let sharded = LoadedModel::load(dir.path(), &device(), &LoadOptions::default()).unwrap();
    let la = to_vec(
        single
            .model
            .forward(&TOKENS, &mut single.model.new_cache())
            .unwrap(),
    );
    let lb = to_vec(
        sharded
            .model
            .forward(&TOKENS, &mut sharded.model.new_cache())
            .unwrap(),
    );
    assert_eq!(la, lb);
}

#[test]
fn block_token_by_token_and_truncation_agree() {
    let m = load_bytes(tiny_gguf_bytes(&tiny_config(), 11))
        .unwrap()
        .model;
    let vocab = m.config().vocab_size;
    let block = to_vec(m.forward(&TOKENS, &mut m.new_cache()).unwrap());

    let mut cache = m.new_cache();
    let mut stepwise = Vec::new();
    for t in TOKENS {
        stepwise.extend(to_vec(m.forward(&[t], &mut cache).unwrap()));
    }
    assert!(max_diff(&block, &stepwise) < 1e-4);

    // Feed garbage after 5 tokens, roll it back, then feed the true rest.
    let mut cache = m.new_cache();
    let mut rolled = to_vec(m.forward(&TOKENS[..5], &mut cache).unwrap());
    m.forward(&[1, 2, 3], &mut cache).unwrap();
    cache.truncate(5);
    rolled.extend(to_vec(m.forward(&TOKENS[5..], &mut cache).unwrap()));
    assert!(max_diff(&block, &rolled) < 1e-4);

    // Early-exit seam: layers [0, 2) then [2, 4) equal [0, 4).
    let mut cache = m.new_cache();
    let h = m.embed(&TOKENS).unwrap();
    let h = m.forward_layers(h, 0..2, &mut cache).unwrap();
    let h = m.forward_layers(h, 2..4, &mut cache).unwrap();
    assert!(max_diff(&block, &to_vec(m.logits(h))) < 1e-5);
    assert_eq!(block.len(), TOKENS.len() * vocab);
}

#[test]
fn cache_grows_past_its_initial_capacity() {
    let mut config = tiny_config();
    config.context_length = 600;
    let m = load_bytes(tiny_gguf_bytes(&config, 5)).unwrap().model;
    let tokens: Vec<u32> = (0..300).map(|i| (i * 7 % 256) as u32).collect();
    let block = to_vec(m.forward(&tokens, &mut m.new_cache()).unwrap());
    let mut cache = m.new_cache();
    let mut parts = to_vec(m.forward(&tokens[..250], &mut cache).unwrap());
    parts.extend(to_vec(m.forward(&tokens[250..], &mut cache).unwrap()));
    assert!(max_diff(&block, &parts) < 1e-4);
}

#[test]
fn context_overflow_and_bad_tokens_are_errors() {
    let m = load_bytes(tiny_gguf_bytes(&tiny_config(), 1))
        .unwrap()
        .model;
    let long = vec![65u32; m.config().context_length + 1];
    assert!(matches!(
        m.forward(&long, &mut m.new_cache()),
        Err(ModelError::ContextOverflow { .. })
    ));
    let mut cache = m.new_cache();
    m.forward(&vec![65u32; 100], &mut cache).unwrap();
    assert!(matches!(
        m.forward(&[65; 29], &mut cache),
        Err(ModelError::ContextOverflow { .. })
    ));
    assert!(matches!(
        m.forward(&[9999], &mut m.new_cache()),
        Err(ModelError::TokenOutOfRange { .. })
    ));
    assert!(matches!(
        m.forward(&[], &mut m.new_cache()),
        Err(ModelError::InvalidArgument(_))
    ));
    let h = m.embed(&[1]).unwrap();
    assert!(
        m.forward_layers(h.clone(), 2..9, &mut m.new_cache())
            .is_err()
    );
    // Layers holding different lengths cannot run as one range.
    let mut cache = m.new_cache();
    m.forward_layers(h.clone(), 0..2, &mut cache).unwrap();
    assert!(matches!(
        m.forward_layers(h, 0..4, &mut cache),
        Err(ModelError::InvalidArgument(_))
    ));
}

#[test]
fn truncated_files_are_errors_at_every_cut() {
    let bytes = tiny_gguf_bytes(&tiny_config(), 2);
    for cut in [0, 3, 4, 8, 20, 100, 5_000, bytes.len() / 2, bytes.len() - 1] {
        let err = GgufFile::from_bytes(bytes[..cut].to_vec()).unwrap_err();
        assert!(
            matches!(
                err,
                ModelError::Truncated { .. } | ModelError::BadMagic { .. }
            ),
            "cut at {cut}: {err}"
        );
    }
}

#[test]
fn bad_magic_and_version_are_errors() {
    let mut bytes = tiny_gguf_bytes(&tiny_config(), 2);
    bytes[..4].copy_from_slice(b"GGML");
    assert!(matches!(
        GgufFile::from_bytes(bytes.clone()),
        Err(ModelError::BadMagic { .. })
    ));
    bytes[..4].copy_from_slice(b"GGUF");
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(bytes),
        Err(ModelError::UnsupportedVersion(1))
    ));
    assert!(matches!(
        LoadedModel::load(
            "/nonexistent/model.gguf",
            &device(),
            &LoadOptions::default()
        ),
        Err(ModelError::Io { .. })
    ));
}

/// A tiny GGUF with one weight replaced (or dropped) and optional metadata overrides.
fn tiny_with(
    replace: WeightName,
    tensor: Option<(&[usize], GgmlType, Vec<u8>)>,
    meta: &[(&str, GgufValue)],
) -> Vec<u8> {
    let config = tiny_config();
    let mut w = GgufWriter::new();
    testing::gguf_metadata(&mut w, &config);
    for (k, v) in meta {
        w.metadata(*k, v.clone());
    }
    for (name, t) in testing::random_weights(&config, 4) {
        if name == replace {
            if let Some((shape, kind, bytes)) = &tensor {
                w.tensor(name.gguf(), shape, *kind, bytes.clone());
            }
        } else {
            w.tensor_f32(name.gguf(), &t.shape, &t.values);
        }
    }
    w.to_bytes()
}

#[test]
fn unknown_tensor_types_are_errors() {
    // Q2_K is a real ggml type this crate does not dequantize.
    let bytes = tiny_with(
        WeightName::Up(1),
        Some((&[128, 64], GgmlType::Other(10), vec![0; 8192])),
        &[],
    );
    let err = load_bytes(bytes).unwrap_err();
    assert!(
        matches!(err, ModelError::UnsupportedTensorType { .. }),
        "{err}"
    );
    // An id no ggml version defines fails at parse time.
    let mut w = GgufWriter::new();
    w.tensor("x", &[4], GgmlType::Other(99), vec![0; 16]);
    assert!(matches!(
        GgufFile::from_bytes(w.to_bytes()),
        Err(ModelError::UnsupportedTensorType { .. })
    ));
}

#[test]
fn missing_tensor_and_shape_mismatch_are_errors() {
    let err = load_bytes(tiny_with(WeightName::Down(2), None, &[])).unwrap_err();
    assert!(
        matches!(err, ModelError::MissingTensor(ref n) if n == "blk.2.ffn_down.weight"),
        "{err}"
    );
    let bytes = (0..64 * 100).flat_map(|_| 0f32.to_le_bytes()).collect();
    let err = load_bytes(tiny_with(
        WeightName::Gate(0),
        Some((&[100, 64], GgmlType::F32, bytes)),
        &[],
    ))
    .unwrap_err();
    assert!(matches!(err, ModelError::ShapeMismatch { .. }), "{err}");
}

#[test]
fn wrong_architecture_vocab_and_tokenizer_are_errors() {
    let arch = [("general.architecture", GgufValue::String("gpt2".into()))];
    let err = load_bytes(tiny_with(WeightName::LmHead, None, &arch)).unwrap_err();
    assert!(
        matches!(err, ModelError::UnsupportedArchitecture(_)),
        "{err}"
    );

    let bytes = (0..300 * 64).flat_map(|_| 0f32.to_le_bytes()).collect();
    let err = load_bytes(tiny_with(
        WeightName::Embedding,
        Some((&[300, 64], GgmlType::F32, bytes)),
        &[],
    ))
    .unwrap_err();
    assert!(matches!(err, ModelError::VocabMismatch { .. }), "{err}");

    let pre = [("tokenizer.ggml.pre", GgufValue::String("qwen2".into()))];
    let err = load_bytes(tiny_with(WeightName::LmHead, None, &pre)).unwrap_err();
    assert!(
        matches!(err, ModelError::Tokenizer(ref m) if m.contains("qwen2")),
        "{err}"
    );

    let heads = [("llama.attention.head_count", GgufValue::U64(3))];
    let err = load_bytes(tiny_with(WeightName::LmHead, None, &heads)).unwrap_err();
    assert!(matches!(err, ModelError::InvalidConfig(_)), "{err}");
}

#[test]
fn corrupt_hf_directories_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    testing::write_tiny_hf_dir(dir.path(), &tiny_config(), 1).unwrap();
    let st = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let err = LoadedModel::load(dir.path(), &device(), &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, ModelError::Malformed(_)), "{err}");
    std::fs::write(dir.path().join("config.json"), "{\"model_type\": \"llama\"").unwrap();
    let err = LoadedModel::load(dir.path(), &device(), &LoadOptions::default()).unwrap_err();
    assert!(matches!(err, ModelError::InvalidConfig(_)), "{err}");
}

/// `Llama::logits_of` gives the model's logits for a subset of the vocabulary: on flex the same
/// bits as those columns of `Llama::logits` (each output its own chain of products), with
/// native and with dense weights; ids outside the vocabulary are refused.
#[test]
fn logits_of_some_rows_are_those_columns_of_the_logits() {
    let flex = !matches!(std::env::var("EESD_TEST_BACKEND").as_deref(), Ok(b) if b != "flex");
    for model in [common::tiny(11), common::tiny_quantized(11)] {
        let vocab = model.config().vocab_size;
        let hidden = model.embed(&[1, 5, 9, 2, 7]).unwrap();
        let full = testing::values(model.logits(hidden.clone()));
        let ids: Vec<u32> = vec![3, 0, (vocab - 1) as u32, 17, 3];
        let rows = model.lm_head_rows(&ids).unwrap();
        assert_eq!(rows.len(), ids.len());
        let some = testing::values(model.logits_of(hidden, &rows));
        assert_eq!(some.len(), 5 * ids.len());
        for t in 0..5 {
            for (j, &id) in ids.iter().enumerate() {
                let (got, want) = (some[t * ids.len() + j], full[t * vocab + id as usize]);
                if flex {
                    assert_eq!(got.to_bits(), want.to_bits(), "position {t}, token {id}");
                } else {
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{got} vs {want}"
                    );
                }
            }
        }
        assert!(matches!(
            model.lm_head_rows(&[vocab as u32]),
            Err(ModelError::InvalidArgument(_))
        ));
    }
}
