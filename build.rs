//! Lets the examples, benches and tests of a `--features tch` build find LibTorch at run time.
//!
//! torch-sys links LibTorch dynamically and leaves finding it to the loader, so without
//! `LD_LIBRARY_PATH` a tch build's binaries do not start at all, even with `--device flex`
//! ("error while loading shared libraries: libtorch_cpu.so"). Where `LIBTORCH` names the
//! LibTorch the build links (as `scripts/setup-libtorch.sh` says to), its `lib/` is recorded in
//! the binaries' run path; `LD_LIBRARY_PATH` still comes first, for binaries run elsewhere.

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let tch = std::env::var_os("CARGO_FEATURE_TCH").is_some();
    let unix_linker = matches!(
        std::env::var("CARGO_CFG_TARGET_OS").as_deref(),
        Ok("linux" | "macos")
    );
    if let (true, true, Some(dir)) = (tch, unix_linker, std::env::var_os("LIBTORCH")) {
        let lib = Path::new(&dir).join("lib");
        if lib.is_dir() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        }
    }
}
