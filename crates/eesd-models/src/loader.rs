//! One call from a path to a ready model: weights, tokenizer and chat template together.

use std::path::{Path, PathBuf};

use burn::tensor::Device;

use crate::chat::ChatTemplate;
use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::llama::{Llama, WeightDType};
use crate::tokenizer::Tokenizer;
use crate::weights::Checkpoint;

/// Options for [`LoadedModel::load`].
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Precision of the weights on the device.
    pub dtype: WeightDType,
    /// Override of the context length (e.g. to bound cache memory); must not exceed the model's.
    pub context_length: Option<usize>,
}

/// A model with its tokenizer and chat template.
#[derive(Debug)]
pub struct LoadedModel {
    /// The network.
    pub model: Llama,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Its chat template, when the checkpoint ships one.
    pub chat_template: Option<ChatTemplate>,
    /// Where it was loaded from.
    pub source: PathBuf,
}

impl LoadedModel {
    /// Loads a `.gguf` file, or a Hugging Face directory (`config.json`, `model.safetensors` or a
    /// sharded index, `tokenizer.json`, optionally `tokenizer_config.json`).
    pub fn load(path: impl AsRef<Path>, device: &Device, options: &LoadOptions) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            Self::load_hf_dir(path, device, options)
        } else {
            Self::load_gguf(path, device, options)
        }
    }

    fn apply(mut config: LlamaConfig, options: &LoadOptions) -> Result<LlamaConfig> {
        if let Some(n) = options.context_length {
            if n == 0 || n > config.context_length {
                return Err(ModelError::InvalidConfig(format!(
                    "context length {n} must be in 1..={}",
                    config.context_length
                )));
            }
            config.context_length = n;
        }
        Ok(config)
    }

    /// Loads a GGUF file: config, tokenizer and chat template all come from its metadata.
    pub fn load_gguf(path: &Path, device: &Device, options: &LoadOptions) -> Result<Self> {
        Self::from_gguf(GgufFile::open(path)?, path, device, options)
    }

    /// Builds the model of a parsed GGUF file (see [`LoadedModel::load_gguf`]); `source` is
    /// recorded as where it came from.
    pub fn from_gguf(
        file: GgufFile,
        source: impl Into<PathBuf>,
        device: &Device,
        options: &LoadOptions,
    ) -> Result<Self> {
        let config = Self::apply(LlamaConfig::from_gguf(&file)?, options)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        if tokenizer.vocab_size() != config.vocab_size {
            return Err(ModelError::VocabMismatch {
                tokenizer: tokenizer.vocab_size(),
                embedding: config.vocab_size,
            });
        }
        let token_str = |id: Option<u32>| id.and_then(|i| tokenizer.token(i)).unwrap_or_default();
        let chat_template = match file.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
            Some(src) => Some(ChatTemplate::new(
                src,
                token_str(tokenizer.bos_token_id()),
                token_str(tokenizer.eos_token_id()),
            )?),
            None => None,
        };
        let model = Llama::from_checkpoint(
            config,
            &Checkpoint::Gguf(Box::new(file)),
            device,
            options.dtype,
        )?;
        Ok(LoadedModel {
            model,
            tokenizer,
            chat_template,
            source: source.into(),
        })
    }

    /// Loads a Hugging Face checkpoint directory.
    pub fn load_hf_dir(dir: &Path, device: &Device, options: &LoadOptions) -> Result<Self> {
        let read = |name: &str| -> Result<String> {
            let p = dir.join(name);
            crate::file_bytes::read_to_string(&p)
        };
        let config_json = read("config.json")?;
        let config = Self::apply(LlamaConfig::from_hf_json(&config_json)?, options)?;
        let ids: serde_json::Value = serde_json::from_str(&config_json)
            .map_err(|e| ModelError::InvalidConfig(format!("config.json: {e}")))?;
        let id = |k: &str| ids.get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
        let tokenizer = Tokenizer::from_file(
            dir.join("tokenizer.json"),
            id("bos_token_id"),
            id("eos_token_id"),
        )?;
        if tokenizer.vocab_size() > config.vocab_size {
            return Err(ModelError::VocabMismatch {
                tokenizer: tokenizer.vocab_size(),
                embedding: config.vocab_size,
            });
        }
        let chat_template = match read("tokenizer_config.json") {
            Ok(text) => {
                let tc: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                    ModelError::InvalidConfig(format!("tokenizer_config.json: {e}"))
                })?;
                let token = |k: &str| {
                    tc.get(k)
                        .and_then(|v| {
                            v.as_str()
                                .or_else(|| v.get("content").and_then(|c| c.as_str()))
                        })
                        .unwrap_or_default()
                        .to_string()
                };
                match tc.get("chat_template").and_then(|v| v.as_str()) {
                    Some(src) => Some(ChatTemplate::new(
                        src,
                        token("bos_token"),
                        token("eos_token"),
                    )?),
                    None => None,
                }
            }
            Err(_) => None,
        };
        let checkpoint = Checkpoint::open_safetensors_dir(dir)?;
        let model = Llama::from_checkpoint(config, &checkpoint, device, options.dtype)?;
        Ok(LoadedModel {
            model,
            tokenizer,
            chat_template,
            source: dir.to_path_buf(),
        })
    }

    /// Turns a user question into prompt ids with the chat template (or the raw text when the
    /// model has no template).
    pub fn chat_prompt(&self, question: &str) -> Result<Vec<u32>> {
        let text = match &self.chat_template {
            Some(t) => t.render(&[crate::chat::ChatMessage::user(question)], true)?,
            None => question.to_string(),
        };
        self.tokenizer.encode(&text)
    }
}
