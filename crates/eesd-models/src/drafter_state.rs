//! Drafter states on disk: what a tree drafter learnt (Token Recycling's matrix, the adaptive
//! tree's rates), tied to the model file whose verifications taught it.
//!
//! Token Recycling keeps its adjacency matrix across prompts; a file lets it outlive the process
//! too, so that a run starts with the candidates earlier runs saw (`generate --drafter-state`).
//! The model file's SHA-256 is recorded because another model's matrix would draft another
//! model's continuations: harmless to the output (verification is lossless) but slow.

use std::path::{Path, PathBuf};

use eesd_core::drafters::DrafterState;
use serde::{Deserialize, Serialize};

use crate::checkpoint::write_atomically;
use crate::error::{ModelError, Result};

/// A drafter's learnt state and what it was learnt with.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedDrafterState {
    /// SHA-256 of the model file whose verifications taught it.
    pub model_sha256: String,
    /// The drafter that saved it (its spec, e.g. `opt@16:auto`; informative).
    pub drafter: String,
    /// The state, restored with [`eesd_core::Drafter::restore`].
    pub state: DrafterState,
}

/// Largest drafter state file read (a full Token Recycling matrix of SmolLM2's vocabulary in
/// JSON is ≈ 10 MB; a file far larger is not one).
const MAX_BYTES: u64 = 256 << 20;

/// The state saved at `path`, or `None` when there is no file there yet. With `model_sha256`,
/// a state another model file taught is refused
/// ([`ModelError::DrafterStateMismatch`]).
pub fn read_drafter_state(
    path: &Path,
    model_sha256: Option<&str>,
) -> Result<Option<SavedDrafterState>> {
    let len = match std::fs::metadata(path) {
        Ok(meta) => meta.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ModelError::io(path, e)),
    };
    let malformed = |reason: String| ModelError::MalformedDrafterState {
        path: path.to_path_buf(),
        reason,
    };
    if len > MAX_BYTES {
        return Err(malformed(format!(
            "{len} bytes, more than a drafter state's {MAX_BYTES}"
        )));
    }
    let bytes = crate::file_bytes::read(path)?;
    let saved: SavedDrafterState =
        serde_json::from_slice(&bytes).map_err(|e| malformed(e.to_string()))?;
    if let Some(sha) = model_sha256
        && saved.model_sha256 != sha
    {
        return Err(ModelError::DrafterStateMismatch {
            path: path.to_path_buf(),
            found: saved.model_sha256,
        });
    }
    Ok(Some(saved))
}

/// Writes `state` to `path` whole or not at all ([`write_atomically`]), creating its folder.
pub fn write_drafter_state(path: &Path, state: &SavedDrafterState) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    }
    let bytes = serde_json::to_vec(state).map_err(|e| ModelError::MalformedDrafterState {
        path: PathBuf::from(path),
        reason: e.to_string(),
    })?;
    write_atomically(path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use eesd_core::Drafter;
    use eesd_core::drafters::TokenRecycling;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("eesd-drafter-state-{}", std::process::id()));
        dir.join(name)
    }

    fn saved(sha: &str) -> SavedDrafterState {
        let mut recycling = TokenRecycling::new(16, 2);
        recycling.observe(3, &[5, 7], &[2.0, 1.0]);
        SavedDrafterState {
            model_sha256: sha.into(),
            drafter: "recycle@8".into(),
            state: DrafterState::Recycling(recycling),
        }
    }

    #[test]
    fn a_state_comes_back_as_written() {
        let path = scratch("round-trip/state.json");
        write_drafter_state(&path, &saved("abc")).unwrap();
        let back = read_drafter_state(&path, Some("abc")).unwrap().unwrap();
        assert_eq!(back.drafter, "recycle@8");
        let DrafterState::Recycling(m) = back.state else {
            panic!("kind changed")
        };
        assert_eq!(m.candidates(3), &[5, 7]);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn missing_files_are_none_and_bad_ones_are_errors() {
        assert!(
            read_drafter_state(&scratch("absent.json"), None)
                .unwrap()
                .is_none()
        );
        let path = scratch("other-model.json");
        write_drafter_state(&path, &saved("abc")).unwrap();
        let err = read_drafter_state(&path, Some("def")).unwrap_err();
        assert!(
            matches!(err, ModelError::DrafterStateMismatch { .. }),
            "{err}"
        );
        for bad in [&b"not json"[..], br#"{"model_sha256":"abc","drafter":"x","state":{"recycling":{"k":0,"vocab":4,"rows":[]}}}"#] {
            std::fs::write(&path, bad).unwrap();
            let err = read_drafter_state(&path, None).unwrap_err();
            assert!(matches!(err, ModelError::MalformedDrafterState { .. }), "{err}");
        }
        std::fs::remove_file(&path).unwrap();
        // A directory is not a state file.
        assert!(read_drafter_state(&std::env::temp_dir(), None).is_err());
    }
}
