//! Resumable training: everything a [`Distiller`] needs to continue exactly where it stopped —
//! the head's f32 weights, the AdamW moments, the step and the configuration.
//!
//! A state `PREFIX` is `PREFIX.state.json` plus two burnpack files named after the step
//! (`PREFIX.step-000300.head.bpk`, `PREFIX.step-000300.optim.bpk`). The JSON is written last
//! and atomically ([`write_atomically`]; the burnpack files are written the same way by burn), so
//! an interrupted save leaves the previous state whole;
//! the previous step's files are removed only after that.

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use eesd_models::checkpoint::{ensure_fits, write_atomically};
use eesd_models::weights::is_plain_file_name;
use eesd_models::{HeadKind, LayerHead, Llama, VocabSubset};
use serde::{Deserialize, Serialize};

use crate::distill::{DistillConfig, Distiller, optimizer};
use crate::error::{Result, TrainError};

/// What `PREFIX.state.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Optimisation steps taken.
    pub step: usize,
    /// The configuration the run continues with.
    pub config: DistillConfig,
    /// Exit layer N.
    pub exit_layer: usize,
    /// Whole layer or adapter.
    pub head_kind: HeadKind,
    /// Decoder layers in the head's block (states saved before deeper heads existed: 1).
    #[serde(default = "one_layer")]
    pub head_layers: usize,
    /// Earlier layers a lookahead head reads beside its own (states saved before mixing heads
    /// existed: none).
    #[serde(default)]
    pub mix_layers: Vec<usize>,
    /// Draft vocabulary subset, if reduced.
    pub vocab_subset: Option<Vec<u32>>,
    /// Width and depth of the model trained against (checked on resume).
    pub hidden_size: usize,
    /// Layers of the model trained against.
    pub num_layers: usize,
    /// Head weights file (beside the JSON).
    pub head_file: String,
    /// Optimizer state file (beside the JSON).
    pub optim_file: String,
    /// Anything the caller wants back on resume (e.g. its evaluation history).
    #[serde(default)]
    pub extra: serde_json::Value,
}

fn one_layer() -> usize {
    1
}

/// `PREFIX.state.json`.
pub fn state_path(prefix: &Path) -> PathBuf {
    prefix.with_extension("state.json")
}

/// Reads `PREFIX.state.json`.
pub fn read_state(prefix: &Path) -> Result<TrainingState> {
    let path = state_path(prefix);
    let text = std::fs::read_to_string(&path).map_err(|e| TrainError::io(&path, e))?;
    let state: TrainingState = serde_json::from_str(&text).map_err(|e| TrainError::Malformed {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    // The state names files beside itself, nothing elsewhere on the machine.
    for file in [&state.head_file, &state.optim_file] {
        if !is_plain_file_name(file) {
            return Err(TrainError::Malformed {
                path,
                reason: format!("`{file}` is not a file name beside the state"),
            });
        }
    }
    Ok(state)
}

/// Reads a burnpack file with `read`, turning a panic inside burn into an error: burn 0.22
/// checks a record's tensor ranks with assertions, so a corrupt or hostile optimizer file would
/// otherwise abort the caller (found by the `train_state` fuzz target).
fn guarded<T, E: std::fmt::Debug>(
    path: &Path,
    read: impl FnOnce() -> std::result::Result<T, E>,
) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)) {
        Ok(result) => result.map_err(|e| record_error(path, e)),
        Err(panic) => {
            let reason = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("burn refused the file");
            Err(record_error(path, reason))
        }
    }
}

fn record_error(path: &Path, e: impl std::fmt::Debug) -> TrainError {
    TrainError::Malformed {
        path: path.to_path_buf(),
        reason: format!("{e:?}"),
    }
}

impl<'m> Distiller<'m> {
    /// Saves the training state under `prefix` (see the module docs), with `extra` stored
    /// alongside for the caller.
    pub fn save_state(&self, prefix: &Path, extra: serde_json::Value) -> Result<()> {
        let dir = prefix.parent().unwrap_or(Path::new(""));
        let stem = prefix
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| TrainError::InvalidConfig(format!("state prefix {prefix:?}")))?;
        let head_file = format!("{stem}.step-{:06}.head.bpk", self.step);
        let optim_file = format!("{stem}.step-{:06}.optim.bpk", self.step);
        let previous = read_state(prefix).ok();
        let head_path = dir.join(&head_file);
        self.weights
            .clone()
            .save_file(&head_path)
            .map_err(|e| record_error(&head_path, e))?;
        let optim_path = dir.join(&optim_file);
        self.optim
            .save(&optim_path)
            .map_err(|e| record_error(&optim_path, e))?;
        let c = self.model.config();
        let state = TrainingState {
            step: self.step,
            config: self.config.clone(),
            exit_layer: self.exit_layer,
            head_kind: self.weights.kind,
            head_layers: self.weights.depth(),
            mix_layers: self.weights.mix_layers.clone(),
            vocab_subset: self.subset.as_ref().map(|s| s.ids().to_vec()),
            hidden_size: c.hidden_size,
            num_layers: c.num_layers,
            head_file,
            optim_file,
            extra,
        };
        let json_path = state_path(prefix);
        let json = serde_json::to_string_pretty(&state).map_err(|e| record_error(&json_path, e))?;
        write_atomically(&json_path, json.as_bytes())?;
        if let Some(old) = previous {
            for file in [old.head_file, old.optim_file] {
                if file != state.head_file && file != state.optim_file {
                    // A leftover file only wastes space; the new state is already complete.
                    let _ = std::fs::remove_file(dir.join(file));
                }
            }
        }
        Ok(())
    }

    /// Continues a run saved by [`Distiller::save_state`] for `model`: same weights, optimizer
    /// moments, step and configuration, so the remaining steps match an uninterrupted run.
    /// A state made for a model of another shape is an error.
    pub fn resume(model: &'m Llama, prefix: &Path) -> Result<(Self, serde_json::Value)> {
        let state = read_state(prefix)?;
        let c = model.config();
        ensure_fits(
            model,
            state.hidden_size,
            state.exit_layer,
            Some(state.num_layers),
        )?;
        let subset = state
            .vocab_subset
            .clone()
            .map(|ids| VocabSubset::new(ids, c.vocab_size))
            .transpose()?;
        let template = LayerHead::from_model(
            model,
            state.head_kind,
            state.exit_layer,
            // Any layer: the saved weights replace it (a lookahead head may read layer L).
            state.exit_layer.min(state.num_layers - 1),
            subset.as_ref(),
        )?
        .deepened(model, state.head_layers.saturating_sub(1))?
        .with_mix_layers(model, &state.mix_layers)?;
        let mut distiller = Distiller::new(model, template, state.config.clone())?;
        let dir = prefix.parent().unwrap_or(Path::new(""));
        let head_path = dir.join(&state.head_file);
        let template = distiller.weights.clone();
        distiller.weights = guarded(&head_path, || template.try_load_file(&head_path))?;
        let optim_path = dir.join(&state.optim_file);
        let fresh = optimizer(&state.config);
        distiller.optim = guarded(&optim_path, || fresh.load(&optim_path))?;
        distiller.step = state.step;
        // burn loads moments of any shape and only fails, with a panic, at the next step
        // (found by the `train_state` fuzz target): try that step now, on copies, with zero
        // gradients, so that a state that does not fit the head is an error here.
        let (mut optim, weights) = (distiller.optim.clone(), distiller.weights.clone());
        let grads = zero_gradients(&weights);
        let lr = distiller.config.learning_rate_at(distiller.step);
        guarded(&optim_path, || {
            optim.step(lr, weights, grads);
            Ok::<(), ()>(())
        })?;
        Ok((distiller, state.extra))
    }
}

/// A zero gradient for every trainable parameter of `module`.
fn zero_gradients<M: Module>(module: &M) -> GradientsParams {
    struct Zeros(GradientsParams);
    impl ModuleVisitor for Zeros {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if param.is_require_grad() {
                self.0.register(param.id, param.val().zeros_like().inner());
            }
        }
    }
    let mut zeros = Zeros(GradientsParams::new());
    module.visit(&mut zeros);
    zeros.0
}
