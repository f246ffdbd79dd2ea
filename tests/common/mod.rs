//! Helpers shared by the integration tests that run example binaries.

use std::path::{Path, PathBuf};

/// The `train_exit_head` example binary `cargo test` built beside the running test
/// (`target/<profile>/examples/`).
pub fn train_exit_head() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let path = profile_dir.join("examples").join("train_exit_head");
    assert!(
        path.exists(),
        "{} is built by `cargo test --features train`",
        path.display()
    );
    path
}
