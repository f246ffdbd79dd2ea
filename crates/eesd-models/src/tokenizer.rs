//! Tokenizers from `tokenizer.json` or from GGUF metadata, on the `tokenizers` crate.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// GGUF token types (`tokenizer.ggml.token_type`) that are matched whole, never split by BPE:
/// control (3), user-defined (4) and unused (5).
const SPECIAL_TOKEN_TYPES: [u64; 3] = [3, 4, 5];

/// A text tokenizer with the special-token ids a decoder needs.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

/// The pre-tokenizer that llama.cpp uses for a `tokenizer.ggml.pre` value.
fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level = ByteLevel::new(false, true, true);
    Ok(match pre {
        // SmolLM: every digit on its own, then the GPT-2 regex, then bytes.
        "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
        "gpt-2" | "gpt2" => byte_level.into(),
        other => {
            return Err(ModelError::Tokenizer(format!(
                "unsupported tokenizer.ggml.pre `{other}` (supported: smollm, gpt-2); \
                 load a tokenizer.json instead"
            )));
        }
    })
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`. `bos`/`eos` come from the caller (they live in
    /// `config.json` or `tokenizer_config.json`).
    pub fn from_file(path: impl AsRef<Path>, bos: Option<u32>, eos: Option<u32>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = crate::file_bytes::read(path)?;
        Self::from_bytes(&bytes, bos, eos)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// Parses the bytes of a Hugging Face `tokenizer.json` (see [`Tokenizer::from_file`]).
    pub fn from_bytes(bytes: &[u8], bos: Option<u32>, eos: Option<u32>) -> Result<Self> {
        // Parsed as JSON first: tokenizers 0.22 panics (`expect("Helper")`) on a syntax error
        // inside its `decoder` object, and a JSON value cannot have one.
        let json: serde_json::Value = serde_json::from_slice(bytes).map_err(tok_err)?;
        let inner: tokenizers::Tokenizer = serde_json::from_value(json).map_err(tok_err)?;
        Ok(Tokenizer {
            inner,
            bos,
            eos,
            add_bos: false,
        })
    }

    /// Builds the tokenizer described by GGUF metadata (`tokenizer.ggml.model = gpt2`).
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model = file.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(ModelError::Tokenizer(format!(
                "unsupported tokenizer.ggml.model `{model}` (supported: gpt2)"
            )));
        }
        let pre = pre_tokenizer_for(file.get_str("tokenizer.ggml.pre").unwrap_or("gpt-2"))?;
        let strings = |key: &str| -> Result<Vec<String>> {
            let arr = file
                .get(key)
                .ok_or_else(|| ModelError::MissingMetadata(key.into()))?
                .as_array()
                .ok_or(ModelError::MetadataType {
                    key: key.into(),
                    expected: "an array",
                })?;
            arr.iter()
                .map(|v| {
                    v.as_str()
                        .map(String::from)
                        .ok_or(ModelError::MetadataType {
                            key: key.into(),
                            expected: "an array of strings",
                        })
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| ModelError::Tokenizer(format!("malformed merge `{m}`")))
            })
            .collect::<Result<Vec<_>>>()?;
        let types: Vec<u64> = match file
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array())
        {
            Some(arr) => arr.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(ModelError::Tokenizer(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let mut vocab = Vocab::with_capacity(tokens.len());
        for (id, tok) in tokens.iter().enumerate() {
            vocab.entry(tok.clone()).or_insert(id as u32);
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| SPECIAL_TOKEN_TYPES.contains(t))
            .map(|(tok, _)| AddedToken::from(tok.clone(), true))
            .collect();
        inner.add_special_tokens(&specials);
        let id = |key: &str| file.get(key).and_then(|v| v.as_u64()).map(|v| v as u32);
        let add_bos = matches!(
            file.get("tokenizer.ggml.add_bos_token"),
            Some(crate::gguf::GgufValue::Bool(true))
        );
        Ok(Tokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            add_bos,
        })
    }

    /// Encodes text; special tokens written in the text (e.g. `<|im_start|>`) are matched whole.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos
            && let Some(bos) = self.bos
        {
            ids.push(bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text, optionally dropping special tokens.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    /// Number of tokens, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The string of a token id.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Beginning-of-sequence id.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence id.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Incremental detokenizer: turns a growing id sequence into text deltas without splitting
/// multi-byte characters (a token may end inside a UTF-8 sequence).
#[derive(Debug, Default, Clone)]
pub struct TextStream {
    ids: Vec<u32>,
    emitted: usize,
}

impl TextStream {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds tokens and returns the newly completed text, if any.
    pub fn push(&mut self, tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
        self.ids.extend_from_slice(ids);
        let text = tokenizer.decode(&self.ids, true)?;
        if text.ends_with('\u{fffd}') || text.len() < self.emitted {
            return Ok(String::new());
        }
        let delta = text.get(self.emitted..).unwrap_or_default().to_string();
        self.emitted = text.len();
        Ok(delta)
    }
}
