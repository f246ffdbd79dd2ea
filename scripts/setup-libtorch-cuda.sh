#!/usr/bin/env bash
# Unpacks the CUDA LibTorch inside a PyPI torch wheel (libraries and headers only) to build eesd
# for `--device tch-cuda`, on any x86-64 Linux machine, GPU or not. The binaries then run where
# the same PyTorch version is installed, its `torch/lib` on LD_LIBRARY_PATH (that installation
# brings the CUDA libraries). Default 2.11.0 (CUDA 13.0), the version this was run with on an
# NVIDIA H200; burn-tch 0.22 is written for 2.9, so the build skips tch's version check.
#
#   scripts/setup-libtorch-cuda.sh [DIR] [VERSION]   (default DIR: third_party/libtorch-cuda)
#
# Then build with:
#   export LIBTORCH=DIR LIBTORCH_CXX11_ABI=1 LIBTORCH_BYPASS_VERSION_CHECK=1
#   # only where the CUDA libraries themselves are absent (a machine without PyTorch):
#   export RUSTFLAGS="-C link-arg=-Wl,--allow-shlib-undefined"
#   cargo build --release --no-default-features --features tch --example generate
# and run on the GPU machine with:
#   export LD_LIBRARY_PATH=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib
#   target/release/examples/generate --device tch-cuda --prompt "Hi"
set -euo pipefail
DIR="$(realpath -m "${1:-third_party/libtorch-cuda}")"
VERSION="${2:-2.11.0}"
if [ -f "$DIR/lib/libtorch_cuda.so" ] && [ -d "$DIR/include/torch" ]; then
  echo "CUDA libtorch already at $DIR"
  exit 0
fi
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
echo "downloading the torch==$VERSION wheel (≈ 500-900 MB) ..."
"$PY" -m pip download --no-deps --quiet "torch==$VERSION" --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --python-version 3.12 -d "$WORK"
"$PY" - "$WORK" "$DIR" <<'PYEOF'
import glob, os, shutil, sys, zipfile
work, out = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(work, "torch-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    if "torch/lib/libtorch_cuda.so" not in z.namelist():
        sys.exit(f"{os.path.basename(wheel)} holds no libtorch_cuda.so (a CPU-only build?)")
    for name in z.namelist():
        if name.endswith("/") or not name.startswith(("torch/lib/", "torch/include/")):
            continue
        target = os.path.join(out, name[len("torch/"):])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(name) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
PYEOF
echo "CUDA libtorch $VERSION ready at $DIR"
