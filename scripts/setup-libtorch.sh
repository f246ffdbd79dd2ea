#!/usr/bin/env bash
# Installs a CPU LibTorch 2.9.0 (what burn-tch 0.22.1 links against) without a network route to
# pytorch.org: the PyPI torch wheel is unpacked for its CPU library and headers only.
#
#   scripts/setup-libtorch.sh [DIR]      (default DIR: third_party/libtorch)
#
# Then build and run with:
#   export LIBTORCH=DIR LIBTORCH_CXX11_ABI=1 LD_LIBRARY_PATH=DIR/lib
#   cargo build --release --features tch
set -euo pipefail
DIR="$(realpath -m "${1:-third_party/libtorch}")"
if [ -f "$DIR/lib/libtorch.so" ] && [ -f "$DIR/lib/libtorch_cpu.so" ] && [ -d "$DIR/include/torch" ]; then
  echo "libtorch already at $DIR"
  exit 0
fi
PY="${PYTHON:-python3}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$DIR/lib"
echo "downloading torch==2.9.0 wheel (~900 MB) ..."
"$PY" -m pip download --no-deps --quiet torch==2.9.0 --only-binary=:all: -d "$WORK/torch"
"$PY" -m pip download --no-deps --quiet nvidia-cuda-runtime-cu12==12.8.90 nvidia-cuda-cupti-cu12==12.8.90 -d "$WORK/cuda"
"$PY" - "$WORK" "$DIR" <<'PYEOF'
import glob, os, shutil, sys, zipfile
work, out = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(work, "torch", "torch-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        keep_lib = name.startswith("torch/lib/") and (base in ("libtorch_cpu.so", "libc10.so") or base.startswith("libgomp"))
        keep_inc = name.startswith("torch/include/") and not name.endswith("/")
        if keep_lib or keep_inc:
            target = os.path.join(out, name[len("torch/"):])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(name) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
for wheel in glob.glob(os.path.join(work, "cuda", "*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            base = os.path.basename(name)
            if base.startswith(("libcudart.so.12", "libcupti.so.12")):
                with z.open(name) as src, open(os.path.join(out, "lib", base), "wb") as dst:
                    shutil.copyfileobj(src, dst)
PYEOF
# libtorch_cpu.so needs these exact sonames.
( cd "$DIR/lib" && for f in libgomp*.so*; do if [ "$f" != libgomp.so.1 ] && [ ! -e libgomp.so.1 ]; then ln -s "$f" libgomp.so.1; fi; done )
# A stub libtorch.so so that `-ltorch` resolves to the CPU library only (no libtorch_cuda.so).
echo "" > "$WORK/empty.c"
gcc -shared -fPIC "$WORK/empty.c" -o "$DIR/lib/libtorch.so" -L"$DIR/lib" -Wl,--no-as-needed -ltorch_cpu -lc10 -Wl,-rpath,'$ORIGIN'
echo "libtorch ready at $DIR"
