//! The frozen model's passes over the training blocks, kept on disk between passes over the data.
//!
//! Training goes over the same answers several times, and every step begins with a full forward
//! pass of the frozen model over its block: most of a step's time on a CPU. A [`TeacherCache`]
//! keeps, per block, the hidden states the heads read (after each exit layer below the last, and
//! after the last layer, from which the logits follow) and the full model's greedy tokens, so
//! that later passes only compute the logits of the heads' draft vocabularies. A [`Teacher`]
//! read back equals the one the forward pass gives, bit for bit, so a run with a cache trains
//! exactly the head a run without one trains.
//!
//! One safetensors file per block (`KEY.safetensors`: the block's token ids, its states in f32
//! as `layer.N`, the greedy tokens as `argmax` (a file written before they were kept has them
//! computed again on reading), and in the metadata the sequence lengths and the teacher's
//! identity, e.g. the model file's SHA-256 and weight format). A file that is missing, unreadable, for other
//! tokens, another teacher or fewer layers is computed again and replaced; files are written
//! with [`eesd_models::write_atomically`], so a killed run leaves whole files or none (and at most
//! a `.partial` scratch file, never read). Size: `4 · hidden · (exit layers below the last + 1)`
//! bytes per position (SmolLM2-135M, one lookahead head reading the last layer: 2.3 KB per
//! position, ≈ 4 GB for 1.7M positions).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Tensor, TensorData};
use eesd_models::Llama;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::distill::Teacher;
use crate::error::{Result, TrainError};

/// A directory of the frozen model's states per training block (see the module docs).
#[derive(Debug, Clone)]
pub struct TeacherCache {
    dir: PathBuf,
    identity: String,
}

/// Where a [`Teacher`] from [`TeacherCache::teacher`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Read from its file.
    Hit,
    /// Computed by the model and stored (no file yet, or one that did not fit).
    Stored,
}

impl TeacherCache {
    /// The cache in `dir` (created if absent) for the teacher named `identity`: entries made
    /// by another teacher (another model file, weight format or backend) are not used.
    pub fn open(dir: &Path, identity: impl Into<String>) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
        Ok(TeacherCache {
            dir: dir.to_path_buf(),
            identity: identity.into(),
        })
    }

    /// The teacher of block `key` (a file name: letters, digits, `-` and `_`) over `sequences`
    /// with the states after `exit_layers`: read from its file when that holds these sequences
    /// and layers from this teacher, else computed by [`Teacher::new`] and stored.
    pub fn teacher(
        &self,
        model: &Llama,
        key: &str,
        sequences: &[&[u32]],
        exit_layers: &[usize],
    ) -> Result<(Teacher, CacheOutcome)> {
        if key.is_empty()
            || !key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(TrainError::InvalidConfig(format!(
                "teacher cache key `{key}`: use letters, digits, `-` and `_`"
            )));
        }
        let (tokens, lengths) = Teacher::block(model, sequences, exit_layers)?;
        let path = self.dir.join(format!("{key}.safetensors"));
        let layers = model.num_layers();
        let mut wanted: Vec<usize> = exit_layers
            .iter()
            .copied()
            .filter(|&n| n < layers)
            .collect();
        wanted.sort_unstable();
        wanted.dedup();
        // A file that does not fit is no error: it is recomputed and replaced (a path that is
        // not a regular file, e.g. a pipe, is not read: it would block).
        if let Ok(bytes) = eesd_models::file_bytes::read(&path)
            && let Some((hidden, argmax)) = self.parse(&bytes, model, &tokens, &lengths, &wanted)
        {
            let teacher = Teacher::from_states(model, tokens, lengths, hidden, argmax)?;
            return Ok((teacher, CacheOutcome::Hit));
        }
        let teacher = Teacher::run(model, tokens, lengths, exit_layers)?;
        self.store(&path, &teacher)?;
        Ok((teacher, CacheOutcome::Stored))
    }

    /// The states of a stored block, by layer (`wanted`, below the last, then the last layer's),
    /// and its greedy tokens where stored, if `bytes` are one for this teacher, `tokens`,
    /// `lengths` and (at least) those layers.
    #[allow(clippy::type_complexity)]
    fn parse(
        &self,
        bytes: &[u8],
        model: &Llama,
        tokens: &[u32],
        lengths: &[usize],
        wanted: &[usize],
    ) -> Option<(Vec<(usize, Tensor<2>)>, Option<Vec<u32>>)> {
        let (_, meta) = SafeTensors::read_metadata(bytes).ok()?;
        let meta = meta.metadata().as_ref()?;
        let stored_lengths: Vec<usize> = serde_json::from_str(meta.get("lengths")?).ok()?;
        if meta.get("identity") != Some(&self.identity) || stored_lengths != lengths {
            return None;
        }
        let st = SafeTensors::deserialize(bytes).ok()?;
        let ids = |name: &str| -> Option<Vec<u32>> {
            let view = st.tensor(name).ok()?;
            (view.dtype() == Dtype::U32 && view.shape() == [tokens.len()]).then(|| {
                view.data()
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect()
            })
        };
        if ids("tokens")? != tokens {
            return None;
        }
        let vocab = model.config().vocab_size;
        let argmax = ids("argmax").filter(|a| a.iter().all(|&t| (t as usize) < vocab));
        let shape = [tokens.len(), model.config().hidden_size];
        let read = |name: &str| -> Option<Tensor<2>> {
            let view = st.tensor(name).ok()?;
            if view.dtype() != Dtype::F32 || view.shape() != shape {
                return None;
            }
            let values: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            Some(Tensor::from_data(
                TensorData::new(values, shape),
                model.device(),
            ))
        };
        let states = wanted
            .iter()
            .copied()
            .chain([model.num_layers()])
            .map(|n| Some((n, read(&format!("layer.{n}"))?)))
            .collect::<Option<Vec<_>>>()?;
        Some((states, argmax))
    }

    /// Writes `teacher`'s block to `path`, atomically.
    fn store(&self, path: &Path, teacher: &Teacher) -> Result<()> {
        let f32_bytes = |t: &Tensor<2>| -> Result<Vec<u8>> {
            let values = t
                .clone()
                .into_data()
                .convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| TrainError::TensorData(format!("{e:?}")))?;
            Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect())
        };
        let ids = |name: &str, ids: &[u32]| {
            let bytes = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
            (name.to_string(), vec![ids.len()], Dtype::U32, bytes)
        };
        let mut data: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = vec![
            ids("tokens", teacher.tokens()),
            ids("argmax", teacher.argmax()),
        ];
        for (n, t) in teacher.states() {
            data.push((
                format!("layer.{n}"),
                t.dims().to_vec(),
                Dtype::F32,
                f32_bytes(t)?,
            ));
        }
        let views = data
            .iter()
            .map(|(name, shape, dtype, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes).map(|v| (name.clone(), v))
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| TrainError::TensorData(e.to_string()))?;
        let lengths = serde_json::to_string(teacher.lengths())
            .map_err(|e| TrainError::TensorData(e.to_string()))?;
        let meta = HashMap::from([
            ("identity".to_string(), self.identity.clone()),
            ("lengths".to_string(), lengths),
        ]);
        let bytes = safetensors::serialize(views, Some(meta))
            .map_err(|e| TrainError::TensorData(e.to_string()))?;
        Ok(eesd_models::write_atomically(path, &bytes)?)
    }
}
