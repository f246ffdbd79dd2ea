//! Replays the `train_state` fuzz target's kept inputs (`fuzz/regressions/train_state/`) and its
//! seeds; a kept input once crashed the target and must now be refused with an error.

use std::path::PathBuf;

#[test]
fn every_kept_state_and_seed_is_handled_without_a_panic() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions/train_state");
    let mut kept = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        eprintln!("{}", path.display());
        eesd_train::fuzz::train_state(&std::fs::read(&path).unwrap());
        kept += 1;
    }
    assert!(kept >= 1);
    let seeds = eesd_train::fuzz::seeds().unwrap();
    assert_eq!(seeds.len(), 3);
    for (name, bytes) in seeds {
        eprintln!("seed {name}");
        eesd_train::fuzz::train_state(&bytes);
    }
}

/// A state that names a file outside its directory is refused before anything is read.
#[test]
fn a_state_naming_files_elsewhere_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("run");
    let (_, bytes) = eesd_train::fuzz::seeds().unwrap().remove(0);
    let json = eesd_models::fuzz::split_parts(&bytes, 3)[0].to_vec();
    let text = String::from_utf8(json)
        .unwrap()
        .replace("fuzz.step-000001.head.bpk", "../../etc/passwd");
    std::fs::write(eesd_train::state_path(&prefix), text).unwrap();
    let err = eesd_train::read_state(&prefix).unwrap_err();
    assert!(err.to_string().contains("not a file name"), "{err}");
}

/// Optimizer moments of another shape than the head's parameters (found by the fuzz target:
/// burn loaded them and panicked at the next step) are refused when the run resumes.
#[test]
fn moments_that_do_not_fit_the_head_are_refused_on_resume() {
    let kept = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/regressions/train_state/optimizer-moment-shape-mismatch-aborts");
    let bytes = std::fs::read(kept).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let prefix = eesd_train::fuzz::write_state_files(dir.path(), &bytes).unwrap();
    let model = eesd_train::fuzz::tiny_model().unwrap();
    let err = eesd_train::Distiller::resume(&model, &prefix)
        .err()
        .unwrap();
    let optimizer_file = dir.path().join(eesd_train::fuzz::STATE_FILES[1]);
    assert!(
        matches!(&err, eesd_train::TrainError::Malformed { path, .. } if path == &optimizer_file),
        "{err}"
    );
}
