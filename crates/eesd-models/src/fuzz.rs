//! Entry points that feed untrusted bytes through every parser of a user's model files, the way
//! loading a downloaded file would: the coverage-guided fuzz targets in `fuzz/` call them, and
//! the regression tests replay every input those campaigns kept (`fuzz/regressions/`).
//!
//! Each function returns normally whatever the bytes are: a parser may answer with a
//! [`ModelError`](crate::ModelError), never panic, hang or allocate beyond what the input's
//! size justifies. Inputs that carry several files are split at [`PART_SEPARATOR`].

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use burn::tensor::Device;

use crate::chat::{ChatMessage, ChatTemplate};
use crate::checkpoint::load_layer_head;
use crate::gguf::GgufFile;
use crate::llama::{Llama, WeightDType};
use crate::loader::{LoadOptions, LoadedModel};
use crate::tokenizer::{TextStream, Tokenizer};

/// Separates the files of a multi-file input (a Hugging Face directory, a head checkpoint).
pub const PART_SEPARATOR: &[u8] = b"\n--8<--\n";

/// Texts every tokenizer and template is exercised with: ASCII, digits, multi-byte UTF-8,
/// special-token look-alikes and an empty string.
const TEXTS: [&str; 4] = [
    "Hello, world! 12345",
    "naïve café — 東京 🚀",
    "<|im_start|>user\n<|im_end|>",
    "",
];

/// Splits a multi-file input into `n` parts (missing parts are empty).
pub fn split_parts(data: &[u8], n: usize) -> Vec<&[u8]> {
    let mut parts = Vec::with_capacity(n);
    let mut rest = data;
    while parts.len() + 1 < n {
        match rest
            .windows(PART_SEPARATOR.len())
            .position(|w| w == PART_SEPARATOR)
        {
            Some(i) => {
                parts.push(&rest[..i]);
                rest = &rest[i + PART_SEPARATOR.len()..];
            }
            None => break,
        }
    }
    parts.push(rest);
    parts.resize(n, &[]);
    parts
}

/// Joins files into one multi-file input (the inverse of [`split_parts`]), for seed corpora.
pub fn join_parts(parts: &[&[u8]]) -> Vec<u8> {
    parts.join(PART_SEPARATOR)
}

/// A GGUF file: header, metadata, tensor directory and data bounds, dequantization of every
/// tensor, the config, the tokenizer and chat template from metadata, and the whole model
/// (native blocks and f32) with one forward pass when it loads.
pub fn gguf(data: &[u8]) {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    for info in file.tensors().values() {
        let _ = file.tensor_f32(&info.name);
    }
    if let Ok(tokenizer) = Tokenizer::from_gguf(&file) {
        exercise_tokenizer(&tokenizer);
    }
    if let Some(source) = file.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
        chat_template(source.as_bytes());
    }
    for dtype in [WeightDType::Native, WeightDType::F32] {
        let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
            return;
        };
        let options = LoadOptions {
            dtype,
            ..Default::default()
        };
        if let Ok(loaded) = LoadedModel::from_gguf(file, "fuzz.gguf", &device(), &options) {
            exercise_model(&loaded);
        }
    }
}

/// A Hugging Face directory: `config.json`, `model.safetensors`, `tokenizer.json`,
/// `tokenizer_config.json` and (when not empty) `model.safetensors.index.json`, in that order.
pub fn hf_dir(data: &[u8]) {
    let parts = split_parts(data, 5);
    let Some(dir) = scratch_dir("hf") else {
        return;
    };
    let names = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
    ];
    for (name, part) in names.iter().zip(&parts) {
        let path = dir.join(name);
        let written = match (part.is_empty(), *name) {
            (true, "model.safetensors.index.json" | "tokenizer_config.json") => {
                remove_if_present(&path)
            }
            _ => std::fs::write(&path, part).is_ok(),
        };
        if !written {
            return;
        }
    }
    for dtype in [WeightDType::Native, WeightDType::F16] {
        let options = LoadOptions {
            dtype,
            ..Default::default()
        };
        if let Ok(loaded) = LoadedModel::load_hf_dir(&dir, &device(), &options) {
            exercise_model(&loaded);
        }
    }
}

/// A Hugging Face `tokenizer.json`, then encoding and decoding.
pub fn tokenizer_json(data: &[u8]) {
    if let Ok(tokenizer) = Tokenizer::from_bytes(data, Some(0), Some(1)) {
        exercise_tokenizer(&tokenizer);
    }
}

/// A chat template as a model file carries it, rendered for a short conversation.
pub fn chat_template(data: &[u8]) {
    let Ok(source) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(template) = ChatTemplate::new(source, "<s>", "</s>") {
        let messages = [
            ChatMessage::system("Be brief."),
            ChatMessage::user(TEXTS[1]),
            ChatMessage::assistant(TEXTS[0]),
            ChatMessage::user(TEXTS[2]),
        ];
        let _ = template.render(&messages, true);
        let _ = template.render(&[], false);
    }
}

/// A head checkpoint (`PREFIX.json` metadata, then `PREFIX.safetensors`) loaded for the tiny
/// test model.
pub fn head_checkpoint(data: &[u8]) {
    let parts = split_parts(data, 2);
    let Some(dir) = scratch_dir("head") else {
        return;
    };
    let prefix = dir.join("head");
    let (st_path, json_path) = crate::checkpoint::checkpoint_paths(&prefix);
    if std::fs::write(&json_path, parts[0]).is_err() || std::fs::write(&st_path, parts[1]).is_err()
    {
        return;
    }
    thread_local! {
        static MODEL: Option<Llama> = tiny_model();
    }
    MODEL.with(|model| {
        if let Some(model) = model
            && let Ok((head, _)) = load_layer_head(&prefix, model, None)
        {
            let mut cache = model.new_cache();
            let _ = model.forward(&[1, 2], &mut cache);
            // A loaded head drafts: every layer it claims runs, on states of its exit layer.
            let n = eesd_core::DraftHead::exit_layer(&head).unwrap_or(1);
            let mut states = model.new_cache();
            let hidden = model
                .embed(&[1, 2])
                .and_then(|h| model.forward_layers(h, 0..n, &mut states));
            if let Ok(hidden) = hidden {
                let _ = match head.kind() {
                    crate::HeadKind::Lookahead => {
                        let mut c = eesd_core::LookaheadHead::new_cache(&head, model);
                        eesd_core::LookaheadHead::lookahead(&head, model, hidden, &[2, 3], &mut c)
                            .map(drop)
                    }
                    _ => {
                        let mut c = eesd_core::DraftHead::new_cache(&head, model);
                        eesd_core::DraftHead::draft_logits(&head, model, hidden, &mut c).map(drop)
                    }
                };
            }
        }
    });
}

/// The tiny test model (native blocks), for targets that need a model to load against.
fn tiny_model() -> Option<Llama> {
    let config = crate::testing::tiny_config();
    load_gguf_bytes(crate::testing::tiny_quantized_gguf_bytes(&config, 7))
}

/// A model from GGUF bytes made by [`crate::testing`], on the targets' device; `None` if they
/// do not load.
pub fn load_gguf_bytes(bytes: Vec<u8>) -> Option<Llama> {
    let file = GgufFile::from_bytes(bytes).ok()?;
    LoadedModel::from_gguf(file, "tiny.gguf", &device(), &LoadOptions::default())
        .ok()
        .map(|loaded| loaded.model)
}

/// The tests' device (flex unless `EESD_TEST_BACKEND` names another), never burn's
/// `Device::default()`, which is a GPU runtime whenever one is compiled in. A bad
/// `EESD_TEST_BACKEND` is the harness's setting, not a fuzzed input: it stops the run.
fn device() -> Device {
    crate::testing::test_device().expect("EESD_TEST_BACKEND names a compiled backend")
}

/// Vocabulary of the drafters a fuzzed drafter state is restored into.
const DRAFT_VOCAB: usize = 64;

/// Drafters that keep a state, as `DrafterSpec`s (a matrix, the adaptive tree's rates, and the
/// parts of a fusion and of a Thompson Sampling choice).
const STATEFUL_DRAFTERS: [&str; 4] = ["recycle@8", "opt@8", "fused@8:4", "ts:opt@8|recycle@4"];

/// Each of [`STATEFUL_DRAFTERS`], fresh, for a vocabulary of [`DRAFT_VOCAB`], with its spec.
fn stateful_drafters() -> impl Iterator<Item = (&'static str, Box<dyn eesd_core::Drafter + Send>)> {
    STATEFUL_DRAFTERS.into_iter().filter_map(|name| {
        let spec = name.parse::<eesd_core::drafters::DrafterSpec>().ok()?;
        Some((name, spec.build(DRAFT_VOCAB)))
    })
}

/// A drafter state file (`generate --drafter-state`), restored into each kind of drafter that
/// keeps one, which then drafts, observes the target and hands its state back.
pub fn drafter_state(data: &[u8]) {
    let Some(dir) = scratch_dir("drafter-state") else {
        return;
    };
    let path = dir.join("state.json");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let Ok(Some(saved)) = crate::read_drafter_state(&path, None) else {
        return;
    };
    for (_, mut drafter) in stateful_drafters() {
        if drafter.restore(saved.state.clone()).is_err() {
            continue;
        }
        let context = [1, 2, 3, 1, 2, (DRAFT_VOCAB - 1) as u32];
        let tree = drafter.propose(&context, 8);
        assert!(
            tree.tokens().iter().all(|&t| (t as usize) < DRAFT_VOCAB),
            "a restored drafter proposed a token outside its vocabulary"
        );
        drafter.observe(2, &[3, 4], &[1.0, 0.5]);
        let _ = drafter.state();
    }
}

/// A directory of this thread for the files of a multi-file input, reused between its inputs
/// and removed with its files when the thread ends (for the main thread: when the process
/// exits normally). Per thread, not per process: tests run in threads of one process, and two
/// of them writing the same files at once would read each other's half-renamed files.
pub fn scratch_dir(kind: &str) -> Option<PathBuf> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static THREADS: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static THREAD: usize = THREADS.fetch_add(1, Ordering::Relaxed);
        static MADE: RefCell<ScratchDirs> = const { RefCell::new(ScratchDirs(Vec::new())) };
    }
    let thread = THREAD.with(|t| *t);
    let dir =
        std::env::temp_dir().join(format!("eesd-fuzz-{}-{thread}-{kind}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    MADE.with_borrow_mut(|made| {
        if !made.0.contains(&dir) {
            made.0.push(dir.clone());
        }
    });
    Some(dir)
}

/// The scratch directories one thread made; dropped (with the thread) it removes them.
struct ScratchDirs(Vec<PathBuf>);

impl Drop for ScratchDirs {
    fn drop(&mut self) {
        for dir in &self.0 {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn remove_if_present(path: &Path) -> bool {
    match std::fs::remove_file(path) {
        Ok(()) => true,
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

fn exercise_tokenizer(tokenizer: &Tokenizer) {
    for text in TEXTS {
        if let Ok(ids) = tokenizer.encode(text) {
            let _ = tokenizer.decode(&ids, false);
            let mut stream = TextStream::new();
            let _ = stream.push(tokenizer, &ids);
        }
    }
    let vocab = tokenizer.vocab_size() as u32;
    let _ = tokenizer.decode(&[0, vocab.saturating_sub(1), vocab, u32::MAX], true);
    let _ = tokenizer.token(vocab);
}

fn exercise_model(loaded: &LoadedModel) {
    let _ = loaded.chat_prompt(TEXTS[0]);
    let model = &loaded.model;
    let vocab = model.config().vocab_size as u32;
    let mut cache = model.new_cache();
    let _ = model.forward(&[0, vocab - 1], &mut cache);
    let _ = model.forward(&[vocab], &mut cache);
}

/// The fuzz targets of this crate, by name (the train-state target lives in `eesd-train`).
pub const TARGETS: [&str; 6] = [
    "gguf",
    "hf_dir",
    "tokenizer_json",
    "chat_template",
    "head_checkpoint",
    "drafter_state",
];

/// Runs the target called `name` on `data`; `false` when there is no such target here.
pub fn run(name: &str, data: &[u8]) -> bool {
    match name {
        "gguf" => gguf(data),
        "hf_dir" => hf_dir(data),
        "tokenizer_json" => tokenizer_json(data),
        "chat_template" => chat_template(data),
        "head_checkpoint" => head_checkpoint(data),
        "drafter_state" => drafter_state(data),
        _ => return false,
    }
    true
}

/// SmolLM2's chat template, as its GGUF file carries it.
pub const SMOLLM_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// A model small enough for fast fuzzing that still exercises every part of loading (GQA, two
/// layers, rows of 32 for the block formats).
pub fn micro_config() -> crate::LlamaConfig {
    crate::LlamaConfig {
        hidden_size: 32,
        num_layers: 2,
        num_heads: 2,
        num_kv_heads: 1,
        intermediate_size: 64,
        context_length: 32,
        ..crate::testing::tiny_config()
    }
}

/// Seed inputs of a target, named: small generated files of every kind the target reads, and,
/// given `real_gguf` (the bytes of a real model file), its metadata (tokenizer, chat template)
/// on micro tensors.
pub fn seeds(target: &str, real_gguf: Option<&[u8]>) -> crate::Result<Vec<(String, Vec<u8>)>> {
    use crate::gguf::{GgufValue, GgufWriter};
    use crate::quant::{GgmlType, quantize_q4_1, quantize_q8_0};
    use crate::testing::{gguf_metadata, random_weights};

    let config = micro_config();
    // One GGUF per tensor encoding, with the chat template in its metadata.
    let gguf_with = |kind: GgmlType, metadata: Option<&GgufFile>| -> Vec<u8> {
        let mut w = GgufWriter::new();
        match metadata {
            Some(file) => {
                for (k, v) in file.metadata() {
                    let v = match k.as_str() {
                        "llama.block_count" => GgufValue::U64(config.num_layers as u64),
                        "llama.embedding_length" => GgufValue::U64(config.hidden_size as u64),
                        _ => v.clone(),
                    };
                    w.metadata(k.clone(), v);
                }
            }
            None => {
                gguf_metadata(&mut w, &config);
                w.metadata(
                    "tokenizer.chat_template",
                    GgufValue::String(SMOLLM_TEMPLATE.into()),
                );
            }
        }
        for (name, t) in random_weights(&config, 1) {
            let t = crate::testing::gguf_row_order(name, t, &config);
            let bytes = match (kind, t.shape.len()) {
                (_, 1) | (GgmlType::F32, _) => {
                    w.tensor_f32(name.gguf(), &t.shape, &t.values);
                    continue;
                }
                (GgmlType::F16, _) => t
                    .values
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect(),
                (GgmlType::Q8_0, _) => quantize_q8_0(&t.values),
                _ => quantize_q4_1(&t.values),
            };
            w.tensor(name.gguf(), &t.shape, kind, bytes);
        }
        w.to_bytes()
    };
    let hf_files = || -> crate::Result<Vec<Vec<u8>>> {
        let dir = scratch_dir("seed-hf").ok_or_else(|| {
            crate::ModelError::InvalidArgument("no temporary directory for seeds".into())
        })?;
        crate::testing::write_tiny_hf_dir(&dir, &config, 1)?;
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read(&path).map_err(|e| crate::ModelError::io(path, e))
        };
        let tokenizer_config = serde_json::json!({
            "chat_template": SMOLLM_TEMPLATE, "bos_token": "<|im_start|>",
            "eos_token": {"content": "<|im_end|>"},
        });
        Ok(vec![
            read("config.json")?,
            read("model.safetensors")?,
            read("tokenizer.json")?,
            tokenizer_config.to_string().into_bytes(),
        ])
    };
    let real = real_gguf
        .map(|bytes| GgufFile::from_bytes(bytes.to_vec()))
        .transpose()?;
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    match target {
        "gguf" => {
            for (name, kind) in [
                ("micro-f32", GgmlType::F32),
                ("micro-f16", GgmlType::F16),
                ("micro-q8_0", GgmlType::Q8_0),
                ("micro-q4_1", GgmlType::Q4_1),
            ] {
                out.push((name.into(), gguf_with(kind, None)));
            }
            if let Some(file) = &real {
                out.push((
                    "real-metadata-q4_1".into(),
                    gguf_with(GgmlType::Q4_1, Some(file)),
                ));
            }
        }
        "hf_dir" => {
            let files = hf_files()?;
            let parts: Vec<&[u8]> = files.iter().map(Vec::as_slice).collect();
            out.push(("micro".into(), join_parts(&parts)));
            let index = serde_json::json!({"weight_map": {"model.embed_tokens.weight": "model.safetensors"}});
            let index = index.to_string().into_bytes();
            let mut sharded = parts.clone();
            sharded.push(&index);
            out.push(("micro-sharded".into(), join_parts(&sharded)));
        }
        "tokenizer_json" => out.push(("micro".into(), hf_files()?.swap_remove(2))),
        "chat_template" => {
            out.push(("smollm".into(), SMOLLM_TEMPLATE.as_bytes().to_vec()));
            out.push((
                "raise".into(),
                b"{% if messages|length == 0 %}{{ raise_exception('empty') }}{% endif %}{{ messages[0].content|upper }}".to_vec(),
            ));
            if let Some(t) = real
                .as_ref()
                .and_then(|f| f.get("tokenizer.chat_template"))
                .and_then(|v| v.as_str())
            {
                out.push(("real".into(), t.as_bytes().to_vec()));
            }
        }
        "head_checkpoint" => {
            let model = tiny_model().ok_or_else(|| {
                crate::ModelError::InvalidArgument("the tiny model does not load".into())
            })?;
            let dir = scratch_dir("seed-head").ok_or_else(|| {
                crate::ModelError::InvalidArgument("no temporary directory for seeds".into())
            })?;
            // One-layer heads of each kind, and two-layer ones (`layer1.*` tensors).
            for (kind, extra) in [
                (crate::HeadKind::Layer, 0),
                (crate::HeadKind::Adapter, 0),
                (crate::HeadKind::Lookahead, 0),
                (crate::HeadKind::Layer, 1),
                (crate::HeadKind::Lookahead, 1),
            ] {
                let subset = crate::VocabSubset::new((0..64).collect(), model.config().vocab_size)?;
                let head = crate::LayerHead::from_model(&model, kind, 1, 1, Some(&subset))?
                    .deepened(&model, extra)?;
                let name = match extra {
                    0 => kind.name().to_string(),
                    _ => format!("{}-{}-layers", kind.name(), 1 + extra),
                };
                let metadata = crate::HeadMetadata {
                    format_version: crate::checkpoint::FORMAT_VERSION,
                    head_kind: kind.name().into(),
                    base_model_sha256: String::new(),
                    base_model_name: "tiny.gguf".into(),
                    exit_layer: 1,
                    hidden_size: model.config().hidden_size,
                    vocab_subset: Some(subset.ids().to_vec()),
                    training: serde_json::Value::Null,
                    metrics: serde_json::Value::Null,
                };
                let prefix = dir.join(&name);
                crate::save_layer_head(&prefix, &head, &metadata, kind == crate::HeadKind::Layer)?;
                let (st, json) = crate::checkpoint::checkpoint_paths(&prefix);
                let read = |p: &Path| std::fs::read(p).map_err(|e| crate::ModelError::io(p, e));
                out.push((name, join_parts(&[&read(&json)?, &read(&st)?])));
            }
        }
        "drafter_state" => {
            // Each kind of state, learnt from a few observations, as `generate` saves it.
            for (name, mut drafter) in stateful_drafters() {
                for t in 0..12u32 {
                    drafter.observe(t, &[t + 1, t + 2, 7], &[3.0, 2.0, 1.0]);
                }
                if let Some(state) = drafter.state() {
                    let saved = crate::SavedDrafterState {
                        model_sha256: "0".repeat(64),
                        drafter: name.into(),
                        state,
                    };
                    let bytes = serde_json::to_vec(&saved).map_err(|e| {
                        crate::ModelError::InvalidArgument(format!("drafter state seed: {e}"))
                    })?;
                    out.push((name.replace(['@', ':', '|'], "-"), bytes));
                }
            }
        }
        _ => {}
    }
    Ok(out)
}
