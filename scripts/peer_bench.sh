#!/usr/bin/env bash
# Peer benchmark (not part of CI): llama.cpp's `llama-bench` and eesd on the same GGUF file, on
# the same machine, in one run.
#
#   bash scripts/peer_bench.sh            # builds llama-bench once (≈ 10 min on 2 cores), then measures
#
# llama.cpp comes from the sources vendored in the `llama-cpp-python` source package on PyPI
# (the only route to its code from machines that reach package registries alone). Prints one
# JSON object per line: llama.cpp tg128 and pp512, eesd AR decoding and 512-token prefill per dtype (`ar_decode`),
# and the machine (`lscpu` model name). Environment: EESD_MODEL (default: the cached model),
# THREADS (default 2), LLAMA_CPP_PYTHON (default 0.3.36), PEER_DIR (default target/peer).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
threads=${THREADS:-2}
version=${LLAMA_CPP_PYTHON:-0.3.36}
work=${PEER_DIR:-$root/target/peer}
mkdir -p "$work"

bench="$work/llama.cpp-$version/build/bin/llama-bench"
if [[ ! -x "$bench" ]]; then
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install -q scikit-build-core cmake
    "$work/venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python --no-build-isolation \
        "llama-cpp-python==$version" -d "$work"
    tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
    rm -rf "$work/llama.cpp-$version"
    mv "$work/llama_cpp_python-$version/vendor/llama.cpp" "$work/llama.cpp-$version"
    (
        cd "$work/llama.cpp-$version"
        "$work/venv/bin/cmake" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_SERVER=OFF >/dev/null
        "$work/venv/bin/cmake" --build build --target llama-bench -j "$(nproc)" >/dev/null
    )
fi

cargo build --release --example fetch_model --bench ar_decode -q 2>/dev/null ||
    cargo build --release --example fetch_model --bench ar_decode
model=${EESD_MODEL:-$(target/release/examples/fetch_model)}

echo "{\"machine\": \"$(lscpu | sed -n 's/^Model name: *//p' | head -1)\", \"threads\": $threads, \"model\": \"$(basename "$model")\"}"
# Each test on its own, with llama.cpp's repacked weights (its AMX / VNNI layouts) and, where
# that run dies (its AMX kernels raised SIGILL on a 2-core Intel Xeon VM: worker threads
# without the tile permission), again with `--repack 0`; the JSON says which ran.
for test in "-p 0 -n 128" "-p 512 -n 0"; do
    ran=0
    for repack in 1 0; do
        # shellcheck disable=SC2086 # $test is two flags
        if out=$("$bench" -m "$model" -t "$threads" $test --repack "$repack" -o jsonl 2>/dev/null); then
            REPACK=$repack python3 -c '
import json, os, sys
for line in sys.stdin:
    r = json.loads(line)
    test = "pp%d" % r["n_prompt"] if r["n_prompt"] else "tg%d" % r["n_gen"]
    print(json.dumps({"engine": "llama.cpp", "build": r.get("build_commit"), "test": test,
                      "repack": os.environ["REPACK"] == "1",
                      "tokens_per_second": round(r["avg_ts"], 1), "stddev": round(r["stddev_ts"], 1)}))
' <<<"$out"
            ran=1
            break
        fi
    done
    if [[ $ran == 0 ]]; then
        echo "llama-bench $test failed with and without --repack" >&2
    fi
done
EESD_THREADS=$threads cargo bench --bench ar_decode -q -- --dtypes native,f32,f16 \
    --max-new-tokens 128 --json
