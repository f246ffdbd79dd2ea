//! The training-state parser under untrusted bytes, for the `train_state` fuzz target and its
//! regression tests (see [`eesd_models::fuzz`]).

use std::path::{Path, PathBuf};

use eesd_models::Llama;
use eesd_models::fuzz::split_parts;

use crate::distill::Distiller;

/// File names the seed corpus's states refer to (a state names its own files: those of step 1
/// of a run saved under the prefix `fuzz`).
pub const STATE_FILES: [&str; 2] = ["fuzz.step-000001.head.bpk", "fuzz.step-000001.optim.bpk"];

/// A training state (`PREFIX.state.json`, then the head and optimizer files named by
/// [`STATE_FILES`]) resumed against the tiny test model, and one training step when it loads.
pub fn train_state(data: &[u8]) {
    // The library turns burn's panics on corrupt records into errors (`state::guarded`); the
    // fuzzer's hook would abort on them first, so it gets one that only reports. A panic that
    // nothing catches still aborts the run.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| std::panic::set_hook(Box::new(|info| eprintln!("{info}"))));
    let Some(prefix) =
        eesd_models::fuzz::scratch_dir("state").and_then(|dir| write_state_files(&dir, data).ok())
    else {
        return;
    };
    thread_local! {
        static MODEL: Option<Llama> = tiny_model();
    }
    MODEL.with(|model| {
        if let Some(model) = model
            && let Ok((mut distiller, _)) = Distiller::resume(model, &prefix)
        {
            let _ = distiller.train_step(&[&[1, 2, 3, 4]]);
        }
    });
}

/// Writes the three parts of a `train_state` input into `dir` as the state files they stand
/// for, and returns the state's prefix (`dir/fuzz`).
pub fn write_state_files(dir: &Path, data: &[u8]) -> std::io::Result<PathBuf> {
    let prefix = dir.join("fuzz");
    let files = [
        crate::state::state_path(&prefix),
        dir.join(STATE_FILES[0]),
        dir.join(STATE_FILES[1]),
    ];
    for (path, part) in files.iter().zip(split_parts(data, 3)) {
        std::fs::write(path, part)?;
    }
    Ok(prefix)
}

/// The tiny test model in f32 (training's weights) the target resumes states against.
pub fn tiny_model() -> Option<Llama> {
    let config = eesd_models::testing::tiny_config();
    eesd_models::fuzz::load_gguf_bytes(eesd_models::testing::tiny_gguf_bytes(&config, 7))
}

/// Seed inputs of the `train_state` target: the state of a tiny run after one step, for a whole
/// layer head, an adapter and a lookahead head.
pub fn seeds() -> crate::Result<Vec<(String, Vec<u8>)>> {
    let model = tiny_model()
        .ok_or_else(|| crate::TrainError::InvalidConfig("the tiny model does not load".into()))?;
    let mut out = Vec::new();
    for kind in [
        eesd_models::HeadKind::Layer,
        eesd_models::HeadKind::Adapter,
        eesd_models::HeadKind::Lookahead,
    ] {
        let dir = eesd_models::fuzz::scratch_dir(&format!("seed-state-{}", kind.name()))
            .ok_or_else(|| {
                crate::TrainError::InvalidConfig("no scratch directory for the seeds".into())
            })?;
        let prefix = dir.join("fuzz");
        let subset = eesd_models::VocabSubset::new((0..64).collect(), model.config().vocab_size)?;
        let head = eesd_models::LayerHead::from_model(&model, kind, 1, 1, Some(&subset))?;
        let mut distiller = Distiller::new(&model, head, Default::default())?;
        distiller.train_step(&[&[1, 2, 3, 4]])?;
        distiller.save_state(&prefix, serde_json::json!({"note": "seed"}))?;
        let read = |path: std::path::PathBuf| {
            std::fs::read(&path).map_err(|source| crate::TrainError::Io { path, source })
        };
        let parts = [
            read(crate::state::state_path(&prefix))?,
            read(dir.join(STATE_FILES[0]))?,
            read(dir.join(STATE_FILES[1]))?,
        ];
        let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        out.push((
            kind.name().to_string(),
            eesd_models::fuzz::join_parts(&parts),
        ));
    }
    Ok(out)
}
