#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser of user files (cargo-fuzz / libFuzzer, stable Rust).
#
#   bash scripts/fuzz.sh SECONDS [TARGET...]     each target for SECONDS (CI: a short run)
#   FUZZ_RUNS=1000000 bash scripts/fuzz.sh 3600  stop a target at 1M executions or an hour
#   FUZZ_QUICK_BUILD=1 bash scripts/fuzz.sh 10   a cheaper build (CI)
#
# Installs cargo-fuzz if missing, writes the seed corpora (examples/fuzz_seeds.rs) into
# fuzz/corpus/<target>, replays fuzz/regressions/<target> with them, and prints one JSON line per
# target: executions, seconds, coverage (edges and features), corpus size and crashes. A crash
# leaves its input in fuzz/artifacts/<target>/ and fails the script; keep it as a regression in
# fuzz/regressions/<target>/ once fixed (the workspace tests replay that folder).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:?usage: scripts/fuzz.sh SECONDS [TARGET...]}
shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf hf_dir tokenizer_json chat_template head_checkpoint drafter_state train_state)
runs=${FUZZ_RUNS:--1}
# FUZZ_QUICK_BUILD=1 (CI): fuzz/Cargo.toml's dev profile (opt-level 1, no debug info); the
# same profile for build and run, or cargo fuzz run would build again.
profile=-O
[ "${FUZZ_QUICK_BUILD:-0}" = 1 ] && profile=-D

cargo fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --version 0.13.2 --locked
# EESD_FEATURES: the features the caller already built the workspace with (scripts/test.sh), so
# the seed writer reuses that build (`--workspace`: the same feature resolution as the tests'
# build; the root package alone resolves features apart and compiles two crates again).
cargo build --release --workspace --features "${EESD_FEATURES:-train}" --example fuzz_seeds
"${CARGO_TARGET_DIR:-target}"/release/examples/fuzz_seeds fuzz/corpus >/dev/null
(cd fuzz && cargo fuzz build -s none "$profile")

status=0
for target in "${targets[@]}"; do
  log=$(mktemp)
  extra=()
  [ -d "fuzz/regressions/$target" ] && extra+=("regressions/$target")
  set +e
  (cd fuzz && cargo fuzz run -s none "$profile" "$target" "corpus/$target" "${extra[@]}" -- \
    -max_total_time="$seconds" -runs="$runs" -timeout=10 -rss_limit_mb=2048 \
    -malloc_limit_mb=2048 -print_final_stats=1) >"$log" 2>&1
  rc=$?
  set -e
  python3 - "$target" "$rc" "$log" <<'PY'
import json, re, sys
target, rc, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
text = open(path, errors="replace").read()
stat = lambda k: int(m.group(1)) if (m := re.search(rf"stat::{k}:\s+(\d+)", text)) else None
last = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)", text)
cov, ft, corp = (int(x) for x in last[-1]) if last else (None, None, None)
print(json.dumps({
    "target": target, "executions": stat("number_of_executed_units"),
    "seconds": (m := re.search(r"Done \d+ runs in (\d+) second", text)) and int(m.group(1)),
    "edges": cov, "features": ft, "corpus": corp, "peak_rss_mb": stat("peak_rss_mb"),
    "crashed": rc != 0,
}))
PY
  if [ "$rc" != 0 ]; then
    grep -E "panicked|ERROR|SUMMARY|Test unit written" "$log" | head -n 20 >&2
    status=1
  fi
  rm -f "$log"
done
exit $status
