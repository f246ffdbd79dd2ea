//! Small random LLaMA models written to disk on the fly, for tests of this workspace and of
//! downstream crates (no download needed): GGUF with a byte-level BPE tokenizer, or a Hugging
//! Face directory with the same weights.

use std::path::Path;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use burn::tensor::Tensor;

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::gguf::{GgufValue, GgufWriter};
use crate::weights::{HostTensor, WeightName, permute_rope_rows};

/// Special tokens of the tiny tokenizer, after the 256 byte tokens.
pub const TINY_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A 4-layer LLaMA with GQA, small enough for fast tests.
pub fn tiny_config() -> LlamaConfig {
    LlamaConfig {
        hidden_size: 64,
        num_layers: 4,
        num_heads: 4,
        num_kv_heads: 2,
        intermediate_size: 128,
        vocab_size: 256 + TINY_SPECIALS.len(),
        rope_theta: 10_000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: true,
        context_length: 128,
    }
}

/// Random weights in Hugging Face layout, by [`WeightName`].
pub fn random_weights(config: &LlamaConfig, seed: u64) -> Vec<(WeightName, HostTensor)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (h, d, f) = (
        config.hidden_size,
        config.head_dim(),
        config.intermediate_size,
    );
    let mut t = |shape: Vec<usize>, scale: f32, offset: f32| {
        let n = shape.iter().product();
        let values = (0..n)
            .map(|_| offset + scale * (rng.random::<f32>() * 2.0 - 1.0))
            .collect();
        HostTensor { values, shape }
    };
    let mut out = vec![(
        WeightName::Embedding,
        t(vec![config.vocab_size, h], 1.0, 0.0),
    )];
    let w = 1.0 / (h as f32).sqrt();
    for i in 0..config.num_layers {
        out.push((WeightName::AttnNorm(i), t(vec![h], 0.1, 1.0)));
        out.push((WeightName::Q(i), t(vec![config.num_heads * d, h], w, 0.0)));
        out.push((
            WeightName::K(i),
            t(vec![config.num_kv_heads * d, h], w, 0.0),
        ));
        out.push((
            WeightName::V(i),
            t(vec![config.num_kv_heads * d, h], w, 0.0),
        ));
        out.push((WeightName::O(i), t(vec![h, config.num_heads * d], w, 0.0)));
        out.push((WeightName::MlpNorm(i), t(vec![h], 0.1, 1.0)));
        out.push((WeightName::Gate(i), t(vec![f, h], w, 0.0)));
        out.push((WeightName::Up(i), t(vec![f, h], w, 0.0)));
        out.push((
            WeightName::Down(i),
            t(vec![h, f], 1.0 / (f as f32).sqrt(), 0.0),
        ));
    }
    out.push((WeightName::FinalNorm, t(vec![h], 0.1, 1.0)));
    if !config.tie_word_embeddings {
        out.push((WeightName::LmHead, t(vec![config.vocab_size, h], w, 0.0)));
    }
    out
}

/// GGUF metadata of a LLaMA config plus the tiny byte-level tokenizer.
pub fn gguf_metadata(w: &mut GgufWriter, config: &LlamaConfig) {
    let u = |v: usize| GgufValue::U64(v as u64);
    w.metadata("general.architecture", GgufValue::String("llama".into()))
        .metadata("llama.block_count", u(config.num_layers))
        .metadata("llama.context_length", u(config.context_length))
        .metadata("llama.embedding_length", u(config.hidden_size))
        .metadata("llama.feed_forward_length", u(config.intermediate_size))
        .metadata("llama.attention.head_count", u(config.num_heads))
        .metadata("llama.attention.head_count_kv", u(config.num_kv_heads))
        .metadata("llama.rope.freq_base", GgufValue::F64(config.rope_theta))
        .metadata(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F64(config.rms_norm_eps),
        )
        .metadata("llama.vocab_size", u(config.vocab_size));
    // Byte-level alphabet: the 256 byte tokens, then the specials; no merges.
    let mut tokens: Vec<GgufValue> = byte_level_alphabet()
        .into_iter()
        .map(GgufValue::String)
        .collect();
    let mut types = vec![GgufValue::I64(1); tokens.len()];
    for s in TINY_SPECIALS {
        tokens.push(GgufValue::String(s.into()));
        types.push(GgufValue::I64(3));
    }
    w.metadata("tokenizer.ggml.model", GgufValue::String("gpt2".into()))
        .metadata("tokenizer.ggml.pre", GgufValue::String("smollm".into()))
        .metadata("tokenizer.ggml.tokens", GgufValue::Array(tokens))
        .metadata("tokenizer.ggml.token_type", GgufValue::Array(types))
        .metadata("tokenizer.ggml.merges", GgufValue::Array(Vec::new()))
        .metadata("tokenizer.ggml.bos_token_id", u(257))
        .metadata("tokenizer.ggml.eos_token_id", u(258));
}

/// The 256 characters GPT-2's byte-level BPE uses for the bytes 0..=255.
pub fn byte_level_alphabet() -> Vec<String> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    let mut by_byte = vec![String::new(); 256];
    for (b, c) in printable.iter().zip(chars) {
        by_byte[*b as usize] = char::from_u32(c).map(String::from).unwrap_or_default();
    }
    by_byte
}

/// `t` with q/k rows permuted to GGUF's interleaved-RoPE order, as llama.cpp's converter does.
pub(crate) fn gguf_row_order(name: WeightName, t: HostTensor, config: &LlamaConfig) -> HostTensor {
    match name {
        WeightName::Q(_) => permute_rope_rows(&t, config.num_heads),
        WeightName::K(_) => permute_rope_rows(&t, config.num_kv_heads),
        _ => t,
    }
}

/// The tiny model as GGUF bytes (f32 tensors, q/k permuted like llama.cpp does).
pub fn tiny_gguf_bytes(config: &LlamaConfig, seed: u64) -> Vec<u8> {
    let mut w = GgufWriter::new();
    gguf_metadata(&mut w, config);
    for (name, t) in random_weights(config, seed) {
        let t = gguf_row_order(name, t, config);
        w.tensor_f32(name.gguf(), &t.shape, &t.values);
    }
    w.to_bytes()
}

/// The tiny model as GGUF bytes with quantized matrices, as GGUF files usually are: the
/// embedding in Q8_0, the layers' projections in Q4_1 (norm gains stay f32). Loaded with
/// [`crate::WeightDType::Native`], it runs the quantized kernels.
pub fn tiny_quantized_gguf_bytes(config: &LlamaConfig, seed: u64) -> Vec<u8> {
    use crate::quant::{GgmlType, quantize_q4_1, quantize_q8_0};
    let mut w = GgufWriter::new();
    gguf_metadata(&mut w, config);
    for (name, t) in random_weights(config, seed) {
        let t = gguf_row_order(name, t, config);
        match (name, t.shape.len()) {
            (_, 1) => w.tensor_f32(name.gguf(), &t.shape, &t.values),
            (WeightName::Embedding, _) => w.tensor(
                name.gguf(),
                &t.shape,
                GgmlType::Q8_0,
                quantize_q8_0(&t.values),
            ),
            _ => w.tensor(
                name.gguf(),
                &t.shape,
                GgmlType::Q4_1,
                quantize_q4_1(&t.values),
            ),
        };
    }
    w.to_bytes()
}

/// Writes the tiny model as a GGUF file.
pub fn write_tiny_gguf(path: &Path, config: &LlamaConfig, seed: u64) -> Result<()> {
    std::fs::write(path, tiny_gguf_bytes(config, seed)).map_err(|e| ModelError::io(path, e))
}

/// Writes the same tiny model as a Hugging Face directory (`config.json`, `model.safetensors`,
/// `tokenizer.json`).
pub fn write_tiny_hf_dir(dir: &Path, config: &LlamaConfig, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let weights = random_weights(config, seed);
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = weights
        .iter()
        .map(|(n, t)| {
            (
                n.hf(),
                t.values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                t.shape.clone(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, b, s)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .map_err(|e| ModelError::Malformed(e.to_string()))?;
            Ok((n.clone(), view))
        })
        .collect::<Result<_>>()?;
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path)
        .map_err(|e| ModelError::Malformed(e.to_string()))?;
    let cfg = serde_json::json!({
        "model_type": "llama", "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
        "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.context_length, "bos_token_id": 257, "eos_token_id": 258,
    });
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| ModelError::io(p, e))
    };
    write("config.json", cfg.to_string())?;
    // The tokenizer: same vocabulary as the GGUF one, serialised by the tokenizers crate itself.
    let mut gguf = GgufWriter::new();
    gguf_metadata(&mut gguf, config);
    let file = crate::gguf::GgufFile::from_bytes(gguf.to_bytes())?;
    let tokenizer = crate::tokenizer::Tokenizer::from_gguf(&file)?;
    let json = tokenizer
        .inner()
        .to_string(false)
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    write("tokenizer.json", json)
}

/// A tensor's values as f32 on the host (in tests, where a failure to read them is a bug).
pub fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 tensor data")
}

/// The environment variable naming the backend tests run on (`flex`, `tch`, `tch-cuda`,
/// `vulkan`, ...); unset, the build's default backend.
pub const TEST_BACKEND_ENV: &str = "EESD_TEST_BACKEND";

/// The device tests run on: `$EESD_TEST_BACKEND`, else the first backend compiled in
/// ([`eesd_core::Backend::default_compiled`]). One switch for every test suite of the
/// workspace, so that a CI run on LibTorch exercises the same tests as one on flex.
pub fn test_device() -> Result<burn::tensor::Device> {
    let invalid = |e: eesd_core::CoreError| ModelError::InvalidArgument(e.to_string());
    let backend = match std::env::var(TEST_BACKEND_ENV) {
        Ok(name) => name.parse::<eesd_core::Backend>().map_err(invalid)?,
        Err(_) => eesd_core::Backend::default_compiled().ok_or_else(|| {
            ModelError::InvalidArgument("this build has no backend compiled in".into())
        })?,
    };
    backend.device().map_err(invalid)
}

/// Whether tests run on flex, the one backend with the CPU's own kernels (native quantized
/// weights, Q8_0 drafts, blocks bit-identical to their rows by design).
pub fn on_flex() -> bool {
    match std::env::var(TEST_BACKEND_ENV) {
        Ok(name) => name == "flex",
        Err(_) => eesd_core::Backend::default_compiled() == Some(eesd_core::Backend::Flex),
    }
}

/// Asserts that two runs of values are the same: bit for bit on flex, else within 1e-4 of the
/// largest magnitude (LibTorch's and the GPUs' products choose their kernels, and so their
/// summation order, by shape: a block or a shared pass differs from its parts in the last bits).
pub fn assert_rows_match(a: &[f32], b: &[f32], what: &str) {
    if on_flex() {
        assert_eq!(a, b, "{what}");
        return;
    }
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = a.iter().chain(b).fold(1f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff <= 1e-4 * scale,
        "{what}: rows differ by {diff} (scale {scale})"
    );
}

/// Asserts that two scalars (a step's loss) are the same: the same value, bit for bit, on
/// flex; else within `rel` of `want`'s magnitude.
pub fn assert_scalar_match(got: f64, want: f64, rel: f64, what: &str) {
    match on_flex() {
        true => assert!(
            got == want && got.to_bits() == want.to_bits(),
            "{what}: {got} vs {want}"
        ),
        false => assert!(
            (got - want).abs() <= rel * want.abs(),
            "{what}: {got} vs {want} (relative {rel})"
        ),
    }
}
