//! The LLaMA hyper-parameters, read from GGUF metadata or a Hugging Face `config.json`.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// Llama-3 style RoPE frequency scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    /// Overall scale factor.
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled fully.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// Context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
}

/// Hyper-parameters of a LLaMA-family decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Query heads per layer.
    pub num_heads: usize,
    /// Key/value heads per layer (grouped-query attention when smaller than `num_heads`).
    pub num_kv_heads: usize,
    /// Inner width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Optional Llama-3 RoPE scaling.
    #[serde(default)]
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Maximum number of positions (prompt + generation).
    pub context_length: usize,
}

impl LlamaConfig {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Checks internal consistency; every constructor calls this.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::InvalidConfig(m));
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("context_length", self.context_length),
        ] {
            if v == 0 {
                return bad(format!("{name} must be positive"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_heads) {
            return bad(format!(
                "hidden_size {} is not divisible by num_heads {}",
                self.hidden_size, self.num_heads
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even for RoPE",
                self.head_dim()
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return bad(format!("rope_theta {} must be > 1", self.rope_theta));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps {} must be positive",
                self.rms_norm_eps
            ));
        }
        if let Some(s) = &self.rope_scaling
            && !(s.factor >= 1.0
                && s.high_freq_factor > s.low_freq_factor
                && s.low_freq_factor > 0.0)
        {
            return bad(format!("invalid llama3 rope scaling {s:?}"));
        }
        Ok(())
    }

    /// Reads the config from GGUF metadata (`general.architecture` must be `llama`).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(ModelError::UnsupportedArchitecture(arch.to_string()));
        }
        let u = |k: &str| file.get_u64(&format!("llama.{k}")).map(|v| v as usize);
        let num_heads = u("attention.head_count")?;
        let vocab_size = match u("vocab_size") {
            Ok(v) => v,
            Err(_) => file
                .get("tokenizer.ggml.tokens")
                .and_then(|t| t.as_array())
                .map(|t| t.len())
                .ok_or_else(|| ModelError::MissingMetadata("llama.vocab_size".into()))?,
        };
        let config = LlamaConfig {
            hidden_size: u("embedding_length")?,
            num_layers: u("block_count")?,
            num_heads,
            num_kv_heads: u("attention.head_count_kv").unwrap_or(num_heads),
            intermediate_size: u("feed_forward_length")?,
            vocab_size,
            rope_theta: file.get_f64("llama.rope.freq_base").unwrap_or(10_000.0),
            rope_scaling: None,
            rms_norm_eps: file.get_f64("llama.attention.layer_norm_rms_epsilon")?,
            tie_word_embeddings: !file.tensors().contains_key("output.weight"),
            context_length: u("context_length")?,
        };
        config.validate()?;
        Ok(config)
    }

    /// Parses a Hugging Face `config.json` (`model_type` must be `llama`).
    pub fn from_hf_json(json: &str) -> Result<Self> {
        let hf: HfConfig = serde_json::from_str(json)
            .map_err(|e| ModelError::InvalidConfig(format!("config.json: {e}")))?;
        if let Some(t) = &hf.model_type
            && t != "llama"
        {
            return Err(ModelError::UnsupportedArchitecture(t.clone()));
        }
        let rope_scaling = match hf.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let kind = v
                    .get("rope_type")
                    .or_else(|| v.get("type"))
                    .and_then(|t| t.as_str());
                if kind != Some("llama3") {
                    return Err(ModelError::InvalidConfig(format!(
                        "unsupported rope_scaling {v} (supported: llama3)"
                    )));
                }
                Some(
                    serde_json::from_value(v)
                        .map_err(|e| ModelError::InvalidConfig(format!("rope_scaling: {e}")))?,
                )
            }
        };
        let config = LlamaConfig {
            hidden_size: hf.hidden_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            intermediate_size: hf.intermediate_size,
            vocab_size: hf.vocab_size,
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            rope_scaling,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-5),
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            context_length: hf.max_position_embeddings.unwrap_or(2048),
        };
        config.validate()?;
        Ok(config)
    }
}

/// The subset of a Hugging Face LLaMA `config.json` this crate reads.
#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    intermediate_size: usize,
    vocab_size: usize,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    rms_norm_eps: Option<f64>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = r#"{"model_type":"llama","hidden_size":576,"num_hidden_layers":30,
        "num_attention_heads":9,"num_key_value_heads":3,"intermediate_size":1536,"vocab_size":49152,
        "rope_theta":100000,"rms_norm_eps":1e-5,"tie_word_embeddings":true,"max_position_embeddings":8192}"#;

    #[test]
    fn parses_hf_config() {
        let c = LlamaConfig::from_hf_json(SMOL).unwrap();
        assert_eq!(c.head_dim(), 64);
        assert_eq!(c.num_kv_heads, 3);
        assert!(c.tie_word_embeddings);
    }

    #[test]
    fn rejects_bad_configs() {
        let bad_heads = SMOL.replace("\"num_attention_heads\":9", "\"num_attention_heads\":7");
        assert!(matches!(
            LlamaConfig::from_hf_json(&bad_heads),
            Err(ModelError::InvalidConfig(_))
        ));
        let mistral = SMOL.replace("\"llama\"", "\"mistral\"");
        assert!(matches!(
            LlamaConfig::from_hf_json(&mistral),
            Err(ModelError::UnsupportedArchitecture(_))
        ));
        assert!(LlamaConfig::from_hf_json("{not json").is_err());
        let yarn = SMOL.replace(
            "\"rope_theta\"",
            "\"rope_scaling\":{\"rope_type\":\"yarn\"},\"rope_theta\"",
        );
        assert!(LlamaConfig::from_hf_json(&yarn).is_err());
    }
}
