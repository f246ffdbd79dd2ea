//! Head checkpoints: the trained weights (safetensors, f16 or f32) beside JSON metadata that ties
//! them to one base model (file SHA-256), one exit layer and one vocabulary subset.
//!
//! They live here rather than in the training crate so that inference builds load a trained head
//! without compiling autodiff.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::tensor::{Tensor, TensorData};
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::cpu::PackedCache;
use crate::error::{ModelError, Result};
use crate::heads::mix_layers_fit;
use crate::{
    DecoderLayer, HeadKind, LayerHead, LayerHeadWeights, Llama, MAX_HEAD_LAYERS, VocabSubset,
};

/// Version of the checkpoint layout.
pub const FORMAT_VERSION: u32 = 1;

/// What a head checkpoint is for, and how it was made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadMetadata {
    /// Layout version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// Head kind (`layer` or `adapter`, see [`HeadKind`]).
    pub head_kind: String,
    /// SHA-256 of the base model file the head was trained on.
    pub base_model_sha256: String,
    /// File name of the base model (informative).
    pub base_model_name: String,
    /// Exit layer N.
    pub exit_layer: usize,
    /// Width of the residual stream (checked at load).
    pub hidden_size: usize,
    /// Draft vocabulary subset (token ids), if reduced.
    pub vocab_subset: Option<Vec<u32>>,
    /// The training configuration, as JSON.
    pub training: serde_json::Value,
    /// Evaluation metrics, as JSON.
    pub metrics: serde_json::Value,
}

/// Writes a file so that a reader (or a process started after this one was killed) sees either
/// its old contents or the new ones whole, never a part: the bytes go to a scratch file beside
/// it, are flushed to the disk, and the scratch file is renamed over `path`.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let scratch = path.with_file_name(format!(".{name}.{}.partial", unique_suffix()));
    let written = std::fs::File::create(&scratch).and_then(|mut file| {
        file.write_all(bytes)?;
        file.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&scratch, path)) {
        let _ = std::fs::remove_file(&scratch);
        return Err(ModelError::io(path, e));
    }
    Ok(())
}

/// A suffix for scratch files that no other call, in this process or another, uses: two
/// threads writing the same file must not rename each other's scratch file away.
pub(crate) fn unique_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    format!("{}-{call}", std::process::id())
}

/// SHA-256 of a file, hex-encoded.
pub fn file_sha256(path: &Path) -> Result<String> {
    // A device or a pipe would be read forever.
    let (mut file, _) = crate::file_bytes::open_regular(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| ModelError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// The two files of a checkpoint `PREFIX`: `PREFIX.safetensors` and `PREFIX.json`.
pub fn checkpoint_paths(prefix: &Path) -> (PathBuf, PathBuf) {
    (
        prefix.with_extension("safetensors"),
        prefix.with_extension("json"),
    )
}

/// The name of `field` of a head's `i`-th decoder layer: `layer.FIELD` for the first (the only
/// one of a one-layer head, as every checkpoint before deeper heads has it), `layer1.FIELD`,
/// `layer2.FIELD`, … for [`LayerHeadWeights::deeper`]'s.
fn tensor_name(i: usize, field: &str) -> String {
    match i {
        0 => format!("layer.{field}"),
        i => format!("layer{i}.{field}"),
    }
}

/// Whether a `kind` head's `i`-th layer has its MLP (all but an adapter's attention half).
fn has_mlp(kind: HeadKind, i: usize) -> bool {
    i > 0 || kind != HeadKind::Adapter
}

/// The tensors a head of this kind saves (an adapter has no MLP, only a lookahead head has an
/// input fusion; a deeper head's later layers are whole).
fn tensors_of(w: &LayerHeadWeights) -> Vec<(String, Tensor<2>)> {
    let row = |t: Tensor<1>| t.unsqueeze_dim::<2>(0);
    let mut tensors = vec![("norm".to_string(), row(w.norm.val()))];
    let layers = std::iter::once(&w.layer).chain(&w.deeper).enumerate();
    for (i, l) in layers {
        let name = |field: &str| tensor_name(i, field);
        tensors.push((name("attn_norm"), row(l.attn_norm.val())));
        tensors.push((name("wqkv"), l.wqkv.val()));
        tensors.push((name("wo"), l.wo.val()));
        if has_mlp(w.kind, i) {
            tensors.push((name("mlp_norm"), row(l.mlp_norm.val())));
            tensors.push((name("w_gate_up"), l.w_gate_up.val()));
            tensors.push((name("w_down"), l.w_down.val()));
        }
    }
    if let Some(fuse) = &w.fuse {
        tensors.push(("fuse".to_string(), fuse.val()));
    }
    tensors
}

/// Saves a head's weights (`f16 = true`: half precision, half the size) and metadata.
pub fn save_layer_head(
    prefix: &Path,
    head: &LayerHead,
    metadata: &HeadMetadata,
    f16: bool,
) -> Result<()> {
    let (st_path, json_path) = checkpoint_paths(prefix);
    let malformed = |reason: String| ModelError::MalformedHead {
        path: st_path.clone(),
        reason,
    };
    let mut buffers: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in tensors_of(head.weights()) {
        let shape = t.dims().to_vec();
        let values = t
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| malformed(format!("{e:?}")))?;
        let bytes = if f16 {
            values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect()
        } else {
            values.iter().flat_map(|v| v.to_le_bytes()).collect()
        };
        buffers.push((name, shape, bytes));
    }
    let dtype = if f16 { Dtype::F16 } else { Dtype::F32 };
    let views = buffers
        .iter()
        .map(|(n, s, b)| {
            safetensors::tensor::TensorView::new(dtype, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| malformed(e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    // Each file is replaced whole; the metadata goes last, so a run killed in between leaves
    // new weights that the old metadata's shapes and hash checks still describe or refuse.
    let weights = safetensors::serialize(views, weights_header(head.weights()))
        .map_err(|e| malformed(e.to_string()))?;
    write_atomically(&st_path, &weights)?;
    let json = serde_json::to_string_pretty(metadata).map_err(|e| malformed(e.to_string()))?;
    write_atomically(&json_path, json.as_bytes())
}

/// The weights file's own header entry for what its tensors' shapes do not say: the layers a
/// mixing lookahead head reads besides layer N (`"mix_layers": "10,20"`), beside its fusion,
/// whose width counts them. None for every other head.
fn weights_header(w: &LayerHeadWeights) -> Option<std::collections::HashMap<String, String>> {
    let layers: Vec<String> = w.mix_layers.iter().map(usize::to_string).collect();
    (!layers.is_empty()).then(|| [(MIX_LAYERS.to_string(), layers.join(","))].into())
}

/// The header key of [`weights_header`].
const MIX_LAYERS: &str = "mix_layers";

/// The mix layers a weights file's header names (none when it names none).
fn mix_layers_of(bytes: &[u8]) -> std::result::Result<Vec<usize>, String> {
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
    let Some(list) = header.metadata().as_ref().and_then(|m| m.get(MIX_LAYERS)) else {
        return Ok(Vec::new());
    };
    list.split(',')
        .map(|l| l.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| format!("header `{MIX_LAYERS}` = {list:?}: {e}"))
}

/// Reads a checkpoint's metadata.
pub fn read_metadata(prefix: &Path) -> Result<HeadMetadata> {
    let (_, json_path) = checkpoint_paths(prefix);
    let text = crate::file_bytes::read_to_string(&json_path)?;
    serde_json::from_str(&text).map_err(|e| ModelError::MalformedHead {
        path: json_path,
        reason: e.to_string(),
    })
}

/// Refuses a head trained for another residual width, an exit layer the model does not have, or
/// (when recorded) a model of another depth (checked again when training resumes from a state).
/// Layer L itself passes here: lookahead heads may read it ([`LayerHead::from_weights`] checks
/// the layer against the head's kind).
pub fn ensure_fits(
    model: &Llama,
    hidden_size: usize,
    exit_layer: usize,
    num_layers: Option<usize>,
) -> Result<()> {
    let c = model.config();
    if hidden_size != c.hidden_size
        || num_layers.is_some_and(|n| n != c.num_layers)
        || exit_layer == 0
        || exit_layer > c.num_layers
    {
        let depth = num_layers.map_or(String::new(), |n| format!(" of a {n}-layer model"));
        return Err(ModelError::HeadMismatch(format!(
            "head for hidden size {hidden_size} at layer {exit_layer}{depth}, model has hidden size {} and {} layers",
            c.hidden_size, c.num_layers
        )));
    }
    Ok(())
}

/// Loads a [`LayerHead`] for `model`, refusing a checkpoint made for another base model (by
/// file hash, when `base_sha256` is given), architecture width or layer count.
pub fn load_layer_head(
    prefix: &Path,
    model: &Llama,
    base_sha256: Option<&str>,
) -> Result<(LayerHead, HeadMetadata)> {
    let meta = read_metadata(prefix)?;
    let kind = meta.head_kind.parse::<HeadKind>();
    if meta.format_version != FORMAT_VERSION || kind.is_err() {
        return Err(ModelError::HeadMismatch(format!(
            "checkpoint is a `{}` head of format {}, expected a `layer`, `adapter` or `lookahead` head of format {FORMAT_VERSION}",
            meta.head_kind, meta.format_version
        )));
    }
    if let Some(sha) = base_sha256
        && sha != meta.base_model_sha256
    {
        return Err(ModelError::HeadMismatch(format!(
            "trained on base model {} (sha256 {}), this model's sha256 is {sha}",
            meta.base_model_name, meta.base_model_sha256
        )));
    }
    let c = model.config();
    ensure_fits(model, meta.hidden_size, meta.exit_layer, None)?;
    let (st_path, _) = checkpoint_paths(prefix);
    let bytes = crate::file_bytes::read(&st_path)?;
    let malformed = |reason: String| ModelError::MalformedHead {
        path: st_path.clone(),
        reason,
    };
    let st = SafeTensors::deserialize(&bytes).map_err(|e| malformed(e.to_string()))?;
    let mix_layers = mix_layers_of(&bytes).map_err(malformed)?;
    // A deeper head saves `layer1.*`, `layer2.*`, … after `layer.*`; the first name missing
    // ends it.
    let depth = (1..)
        .take_while(|&i| st.tensor(&tensor_name(i, "wqkv")).is_ok())
        .count()
        + 1;
    let kind = kind?;
    // Checked before the expected shapes are made from them (a hostile list could ask for a
    // fusion of any width).
    let fits = mix_layers_fit(&mix_layers, meta.exit_layer);
    if !mix_layers.is_empty() && (kind != HeadKind::Lookahead || !fits) {
        return Err(malformed(format!(
            "a `{}` head at layer {} mixing layers {mix_layers:?} (only a lookahead head mixes, \
             layers ascending below its own)",
            meta.head_kind, meta.exit_layer
        )));
    }
    if !kind.allows_depth(depth) {
        return Err(malformed(format!(
            "a `{}` head of {depth} layers (at most {MAX_HEAD_LAYERS}; an adapter has one)",
            kind.name()
        )));
    }
    // Any layer has the shapes of the head's (a lookahead head may read the last layer).
    let template = &model.layers()[0];
    let d = c.hidden_size;
    let expected: BTreeMap<String, Vec<usize>> = tensors_of(&LayerHeadWeights {
        layer: template.clone(),
        deeper: vec![template.clone(); depth - 1],
        norm: Param::from_tensor(model.final_norm().clone()),
        fuse: (kind == HeadKind::Lookahead).then(|| {
            let width = (2 + mix_layers.len()) * d;
            Param::from_tensor(Tensor::zeros([d, width], model.device()))
        }),
        kind,
        mix_layers: mix_layers.clone(),
    })
    .into_iter()
    .map(|(n, t)| (n, t.dims().to_vec()))
    .collect();
    let device = model.device();
    let read = |name: &str| -> Result<Tensor<2>> {
        let view = st
            .tensor(name)
            .map_err(|_| malformed(format!("missing tensor `{name}`")))?;
        if view.shape() != expected[name].as_slice() {
            return Err(ModelError::HeadMismatch(format!(
                "tensor `{name}` has shape {:?}, this model needs {:?}",
                view.shape(),
                expected[name]
            )));
        }
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => view
                .data()
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(malformed(format!(
                    "tensor `{name}` has unsupported dtype {other:?}"
                )));
            }
        };
        let shape = [view.shape()[0], view.shape()[1]];
        Ok(Tensor::from_data(TensorData::new(values, shape), device))
    };
    let flat = |t: Tensor<2>| t.reshape([-1]);
    let read_layer = |i: usize| -> Result<DecoderLayer> {
        let name = |field: &str| tensor_name(i, field);
        let mut layer = DecoderLayer {
            attn_norm: Param::from_tensor(flat(read(&name("attn_norm"))?)),
            wqkv: Param::from_tensor(read(&name("wqkv"))?),
            wo: Param::from_tensor(read(&name("wo"))?),
            packed: PackedCache::default(),
            ..template.clone()
        };
        if has_mlp(kind, i) {
            layer.mlp_norm = Param::from_tensor(flat(read(&name("mlp_norm"))?));
            layer.w_gate_up = Param::from_tensor(read(&name("w_gate_up"))?);
            layer.w_down = Param::from_tensor(read(&name("w_down"))?);
        }
        Ok(layer)
    };
    let fuse = match kind {
        HeadKind::Lookahead => Some(Param::from_tensor(read("fuse")?)),
        _ => None,
    };
    let weights = LayerHeadWeights {
        layer: read_layer(0)?,
        deeper: (1..depth).map(read_layer).collect::<Result<_>>()?,
        norm: Param::from_tensor(flat(read("norm")?)),
        fuse,
        kind,
        mix_layers,
    };
    let subset = meta
        .vocab_subset
        .clone()
        .map(|ids| VocabSubset::new(ids, c.vocab_size))
        .transpose()?;
    Ok((
        LayerHead::from_weights(model, meta.exit_layer, weights, subset.as_ref())?,
        meta,
    ))
}

/// [`load_layer_head`] for a head that drafts trees: refuses a chain head (`layer`, `adapter`)
/// with [`ModelError::HeadMismatch`], so that it fails when loaded rather than at its first
/// draft.
pub fn load_lookahead_head(
    prefix: &Path,
    model: &Llama,
    base_sha256: Option<&str>,
) -> Result<(LayerHead, HeadMetadata)> {
    let (head, meta) = load_layer_head(prefix, model, base_sha256)?;
    if head.kind() != HeadKind::Lookahead {
        return Err(ModelError::HeadMismatch(format!(
            "{} is a `{}` head, which drafts chains; trees take a `lookahead` head",
            prefix.display(),
            meta.head_kind
        )));
    }
    Ok((head, meta))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Threads saving the same file at once all succeed, and the file is one of their
    /// contents whole (a scratch name shared between them used to let one rename the other's
    /// scratch file away: `NotFound`).
    #[test]
    fn concurrent_atomic_writes_of_one_file_all_succeed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let contents: Vec<Vec<u8>> = (0..4u8).map(|t| vec![t; 64 << 10]).collect();
        std::thread::scope(|scope| {
            for bytes in &contents {
                let path = &path;
                scope.spawn(move || {
                    for _ in 0..50 {
                        write_atomically(path, bytes).unwrap();
                    }
                });
            }
        });
        let written = std::fs::read(&path).unwrap();
        assert!(contents.contains(&written));
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1, "scratch files left behind");
    }
}
