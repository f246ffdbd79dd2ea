//! Checkpoint formats behind one interface: named f32 tensors in Hugging Face layout.
//!
//! Tensors are addressed by [`WeightName`]; each format maps it to its own naming. GGUF q/k
//! projections are un-permuted from the interleaved-RoPE layout so that both formats give the
//! same model (see [`crate::rope`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use crate::cpu::QuantFormat;
use crate::error::{ModelError, Result};
use crate::file_bytes::{self, FileBytes};
use crate::gguf::GgufFile;
use crate::quant::GgmlType;

/// A weight of the LLaMA architecture, format-independent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightName {
    /// Token embedding `[vocab, hidden]`.
    Embedding,
    /// Final RMSNorm gain `[hidden]`.
    FinalNorm,
    /// Untied LM head `[vocab, hidden]`.
    LmHead,
    /// Pre-attention RMSNorm gain of a layer.
    AttnNorm(usize),
    /// Query projection `[heads·head_dim, hidden]`.
    Q(usize),
    /// Key projection `[kv_heads·head_dim, hidden]`.
    K(usize),
    /// Value projection `[kv_heads·head_dim, hidden]`.
    V(usize),
    /// Attention output projection `[hidden, heads·head_dim]`.
    O(usize),
    /// Pre-MLP RMSNorm gain of a layer.
    MlpNorm(usize),
    /// SwiGLU gate projection `[ffn, hidden]`.
    Gate(usize),
    /// SwiGLU up projection `[ffn, hidden]`.
    Up(usize),
    /// SwiGLU down projection `[hidden, ffn]`.
    Down(usize),
}

impl WeightName {
    /// The tensor name in GGUF files.
    pub fn gguf(self) -> String {
        match self {
            Self::Embedding => "token_embd.weight".into(),
            Self::FinalNorm => "output_norm.weight".into(),
            Self::LmHead => "output.weight".into(),
            Self::AttnNorm(i) => format!("blk.{i}.attn_norm.weight"),
            Self::Q(i) => format!("blk.{i}.attn_q.weight"),
            Self::K(i) => format!("blk.{i}.attn_k.weight"),
            Self::V(i) => format!("blk.{i}.attn_v.weight"),
            Self::O(i) => format!("blk.{i}.attn_output.weight"),
            Self::MlpNorm(i) => format!("blk.{i}.ffn_norm.weight"),
            Self::Gate(i) => format!("blk.{i}.ffn_gate.weight"),
            Self::Up(i) => format!("blk.{i}.ffn_up.weight"),
            Self::Down(i) => format!("blk.{i}.ffn_down.weight"),
        }
    }

    /// The tensor name in Hugging Face safetensors checkpoints.
    pub fn hf(self) -> String {
        match self {
            Self::Embedding => "model.embed_tokens.weight".into(),
            Self::FinalNorm => "model.norm.weight".into(),
            Self::LmHead => "lm_head.weight".into(),
            Self::AttnNorm(i) => format!("model.layers.{i}.input_layernorm.weight"),
            Self::Q(i) => format!("model.layers.{i}.self_attn.q_proj.weight"),
            Self::K(i) => format!("model.layers.{i}.self_attn.k_proj.weight"),
            Self::V(i) => format!("model.layers.{i}.self_attn.v_proj.weight"),
            Self::O(i) => format!("model.layers.{i}.self_attn.o_proj.weight"),
            Self::MlpNorm(i) => format!("model.layers.{i}.post_attention_layernorm.weight"),
            Self::Gate(i) => format!("model.layers.{i}.mlp.gate_proj.weight"),
            Self::Up(i) => format!("model.layers.{i}.mlp.up_proj.weight"),
            Self::Down(i) => format!("model.layers.{i}.mlp.down_proj.weight"),
        }
    }
}

/// A dense f32 tensor in row-major order.
#[derive(Debug, Clone)]
pub struct HostTensor {
    /// Values, row-major.
    pub values: Vec<f32>,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
}

impl HostTensor {
    /// Checks the shape against what the config implies.
    pub fn expect_shape(self, name: WeightName, expected: &[usize]) -> Result<Self> {
        if self.shape != expected {
            return Err(ModelError::ShapeMismatch {
                name: name.hf(),
                expected: expected.to_vec(),
                found: self.shape,
            });
        }
        Ok(self)
    }
}

/// Un-permutes the rows of a GGUF q/k projection from interleaved-pair RoPE order to rotate-half
/// order: within each head, GGUF row `2i + s` holds HF row `s·(d/2) + i`.
pub fn unpermute_rope_rows(t: &HostTensor, heads: usize) -> HostTensor {
    permute_rows(t, heads, false)
}

/// Permutes q/k rows from Hugging Face (rotate-half) order to GGUF (interleaved) order, as
/// llama.cpp's converter does; the inverse of [`unpermute_rope_rows`].
pub fn permute_rope_rows(t: &HostTensor, heads: usize) -> HostTensor {
    permute_rows(t, heads, true)
}

fn permute_rows(t: &HostTensor, heads: usize, to_gguf: bool) -> HostTensor {
    HostTensor {
        values: permute_row_chunks(&t.values, t.shape[0], heads, to_gguf),
        shape: t.shape.clone(),
    }
}

/// The rows of `data` (`rows` equal chunks: f32 values, or a quantized row's bytes) moved
/// between GGUF's interleaved and Hugging Face's rotate-half q/k order (see
/// [`unpermute_rope_rows`]).
fn permute_row_chunks<T: Copy + Default>(
    data: &[T],
    rows: usize,
    heads: usize,
    to_gguf: bool,
) -> Vec<T> {
    let cols = data.len() / rows.max(1);
    let dim = rows / heads;
    let half = dim / 2;
    let mut out = vec![T::default(); data.len()];
    for h in 0..heads {
        for s in 0..2 {
            for i in 0..half {
                let (gguf, hf) = (h * dim + 2 * i + s, h * dim + s * half + i);
                let (src, dst) = if to_gguf { (hf, gguf) } else { (gguf, hf) };
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Whether `name` is one plain file name (no directory part, not `.` or `..`), as files that
/// an index or a state names beside itself must be.
pub fn is_plain_file_name(name: &str) -> bool {
    let mut parts = Path::new(name).components();
    matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(_)), None)
    ) && !name.contains(['/', '\\'])
}

/// A weight matrix as stored in a GGUF file, in a block format the quantized kernel reads.
#[derive(Debug, Clone)]
pub struct QuantizedTensor {
    /// Block format.
    pub format: QuantFormat,
    /// The blocks, row-major (q/k rows already in Hugging Face order).
    pub bytes: Vec<u8>,
    /// `[rows, row length]`.
    pub shape: [usize; 2],
}

/// A source of named weights.
pub enum Checkpoint {
    /// A GGUF file (q/k rows in interleaved-RoPE order).
    Gguf(Box<GgufFile>),
    /// Hugging Face safetensors files, with the file each tensor lives in.
    SafeTensors {
        /// File contents (mapped), by path.
        files: BTreeMap<PathBuf, FileBytes>,
        /// Tensor name → file.
        index: BTreeMap<String, PathBuf>,
    },
}

impl Checkpoint {
    /// Opens the safetensors weights of a Hugging Face model directory, sharded or not.
    pub fn open_safetensors_dir(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if index_path.exists() {
            let text = file_bytes::read_to_string(&index_path)?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::Malformed(format!("{}: {e}", index_path.display())))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| {
                    ModelError::Malformed(format!("{}: no weight_map", index_path.display()))
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(String::from))
                .collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec!["model.safetensors".into()]
        };
        let mut files = BTreeMap::new();
        let mut index = BTreeMap::new();
        for name in shard_names {
            // An index names files beside it, nothing elsewhere on the machine.
            if !is_plain_file_name(&name) {
                return Err(ModelError::Malformed(format!(
                    "{}: shard `{name}` is not a file name in the model directory",
                    index_path.display()
                )));
            }
            let path = dir.join(&name);
            let bytes = FileBytes::map(&path)?;
            let st = SafeTensors::deserialize(&bytes)
                .map_err(|e| ModelError::Malformed(format!("{}: {e}", path.display())))?;
            for tensor in st.names() {
                index.insert(tensor.to_string(), path.clone());
            }
            files.insert(path, bytes);
        }
        Ok(Checkpoint::SafeTensors { files, index })
    }

    /// Whether the checkpoint holds a weight.
    pub fn contains(&self, name: WeightName) -> bool {
        match self {
            Checkpoint::Gguf(f) => f.tensors().contains_key(&name.gguf()),
            Checkpoint::SafeTensors { index, .. } => index.contains_key(&name.hf()),
        }
    }

    /// How a weight is stored: its GGML type in a GGUF file; F32, F16 or BF16 in safetensors.
    pub fn stored_type(&self, name: WeightName) -> Result<GgmlType> {
        match self {
            Checkpoint::Gguf(f) => f
                .tensors()
                .get(&name.gguf())
                .map(|info| info.kind)
                .ok_or_else(|| ModelError::MissingTensor(name.gguf())),
            Checkpoint::SafeTensors { .. } => {
                let info = self.safetensors_info(name)?;
                Ok(match info.dtype {
                    Dtype::F16 => GgmlType::F16,
                    Dtype::BF16 => GgmlType::Bf16,
                    _ => GgmlType::F32,
                })
            }
        }
    }

    /// The header entry (dtype, shape) of a weight in a safetensors checkpoint.
    fn safetensors_info(&self, name: WeightName) -> Result<safetensors::tensor::TensorInfo> {
        let key = name.hf();
        let Checkpoint::SafeTensors { files, index } = self else {
            return Err(ModelError::MissingTensor(key));
        };
        let path = index
            .get(&key)
            .ok_or_else(|| ModelError::MissingTensor(key.clone()))?;
        let (_, meta) = SafeTensors::read_metadata(&files[path])
            .map_err(|e| ModelError::Malformed(format!("{}: {e}", path.display())))?;
        meta.info(&key)
            .cloned()
            .ok_or(ModelError::MissingTensor(key))
    }

    /// The shape of a weight (Hugging Face order, outermost first), without reading its values.
    pub fn read_shape(&self, name: WeightName) -> Result<Vec<usize>> {
        match self {
            Checkpoint::Gguf(f) => f
                .tensors()
                .get(&name.gguf())
                .map(|info| info.shape())
                .ok_or_else(|| ModelError::MissingTensor(name.gguf())),
            Checkpoint::SafeTensors { .. } => Ok(self.safetensors_info(name)?.shape),
        }
    }

    /// Reads a 2-D weight in its quantized block format, or `None` when it is not stored in one
    /// the quantized kernel reads (floats, safetensors). `heads` as in [`Checkpoint::read`].
    pub fn read_quantized(
        &self,
        name: WeightName,
        heads: usize,
    ) -> Result<Option<QuantizedTensor>> {
        let Checkpoint::Gguf(f) = self else {
            return Ok(None);
        };
        let info = f
            .tensors()
            .get(&name.gguf())
            .ok_or_else(|| ModelError::MissingTensor(name.gguf()))?;
        let shape = info.shape();
        let (Some(format), &[rows, cols]) = (QuantFormat::from_ggml(info.kind), shape.as_slice())
        else {
            return Ok(None);
        };
        let bytes = f.tensor_bytes(info)?;
        let bytes = match name {
            WeightName::Q(_) | WeightName::K(_) if heads > 0 && rows.is_multiple_of(2 * heads) => {
                permute_row_chunks(bytes, rows, heads, false)
            }
            _ => bytes.to_vec(),
        };
        Ok(Some(QuantizedTensor {
            format,
            bytes,
            shape: [rows, cols],
        }))
    }

    /// Reads a weight as f32 in Hugging Face layout. `heads` is the head count of a q/k projection
    /// (needed to undo the GGUF RoPE permutation) and ignored otherwise.
    pub fn read(&self, name: WeightName, heads: usize) -> Result<HostTensor> {
        match self {
            Checkpoint::Gguf(f) => {
                let (values, shape) = f.tensor_f32(&name.gguf())?;
                let t = HostTensor { values, shape };
                Ok(match name {
                    WeightName::Q(_) | WeightName::K(_)
                        if t.shape.len() == 2
                            && heads > 0
                            && t.shape[0].is_multiple_of(2 * heads) =>
                    {
                        unpermute_rope_rows(&t, heads)
                    }
                    _ => t,
                })
            }
            Checkpoint::SafeTensors { files, index } => {
                let key = name.hf();
                let path = index
                    .get(&key)
                    .ok_or_else(|| ModelError::MissingTensor(key.clone()))?;
                let st = SafeTensors::deserialize(&files[path])
                    .map_err(|e| ModelError::Malformed(format!("{}: {e}", path.display())))?;
                let view = st
                    .tensor(&key)
                    .map_err(|_| ModelError::MissingTensor(key.clone()))?;
                let data = view.data();
                let values: Vec<f32> = match view.dtype() {
                    Dtype::F32 => data
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect(),
                    Dtype::F16 => data
                        .chunks_exact(2)
                        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                    Dtype::BF16 => data
                        .chunks_exact(2)
                        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect(),
                    other => {
                        return Err(ModelError::UnsupportedTensorType {
                            name: key,
                            kind: format!("{other:?}"),
                        });
                    }
                };
                Ok(HostTensor {
                    values,
                    shape: view.shape().to_vec(),
                })
            }
        }
    }
}
