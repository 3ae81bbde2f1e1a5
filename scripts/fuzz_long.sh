#!/usr/bin/env bash
# A longer fuzzing campaign than the test suite's fixed-length runs (test/test_fuzz.py), over
#   - the GGUF reader + llama / mmproj model loaders (libFuzzer, ASan + UBSan; native/tests/fuzz_gguf.cpp),
#   - the prefix-cache file reader (atheris; edgevlm_ros/engine/prefix_cache.py),
# both at once (one core each), seeded from test/fuzz_seeds. The corpora persist under build/fuzz/,
# so a second campaign continues where the first stopped.
#
#   scripts/fuzz_long.sh [GGUF_SECONDS [PREFIX_CACHE_SECONDS]]     (defaults 1500 and the same)
#
# The GGUF campaign runs in libFuzzer's fork mode and keeps going after a finding; every finding
# (crash-*, oom-*, timeout-*, under build/fuzz/artifacts-*/) must be fixed and then copied into
# test/fuzz_regressions/<target>/, where the suite replays it. Prints executions, exec/s,
# coverage (libFuzzer's cov: edges and ft: features), corpus size and findings per target.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VPY="$ROOT/.venv/bin/python"
GGUF_SECONDS=${1:-1500}
PC_SECONDS=${2:-$GGUF_SECONDS}
OUT="$ROOT/build/fuzz"
mkdir -p "$OUT/corpus-gguf" "$OUT/corpus-prefix-cache" "$OUT/artifacts-gguf" "$OUT/artifacts-prefix-cache"

EXE=$(PYTHONPATH="$ROOT" "$VPY" test/test_fuzz.py build) || { echo "[fuzz] the harness did not build" >&2; exit 1; }
# The suite's flags (one place: test/test_fuzz.py), so findings here reproduce there.
mapfile -t FLAGS < <(PYTHONPATH="$ROOT" "$VPY" -c "import sys; sys.path.insert(0, 'test'); import test_fuzz; print('\n'.join(test_fuzz.LIBFUZZER_FLAGS))")

echo "[fuzz] $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -m), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo "[fuzz] gguf: ${GGUF_SECONDS}s with $EXE; prefix-cache: ${PC_SECONDS}s with atheris"

# -use_value_profile=1: comparisons guide the search too (magic numbers, sizes, dimension checks).
"$EXE" -fork=1 -ignore_crashes=1 -ignore_ooms=1 -ignore_timeouts=1 -use_value_profile=1 -max_total_time="$GGUF_SECONDS" \
    -dict=test/fuzz_seeds/gguf.dict "${FLAGS[@]}" -artifact_prefix="$OUT/artifacts-gguf/" \
    "$OUT/corpus-gguf" test/fuzz_seeds/gguf >"$OUT/long-gguf.log" 2>&1 &
GGUF_PID=$!
PYTHONPATH="$ROOT" "$VPY" test/test_fuzz.py prefix-cache -max_total_time="$PC_SECONDS" -max_len=4096 -timeout=20 \
    -dict=test/fuzz_seeds/prefix_cache.dict \
    -print_final_stats=1 -artifact_prefix="$OUT/artifacts-prefix-cache/" \
    "$OUT/corpus-prefix-cache" test/fuzz_seeds/prefix_cache >"$OUT/long-prefix-cache.log" 2>&1 &
PC_PID=$!
wait "$GGUF_PID"
wait "$PC_PID"

findings() { find "$1" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' \) | wc -l; }

echo "[fuzz] gguf + models (libFuzzer, fork mode; the last status line):"
# Fork mode status: "#N: cov: C ft: F corp: K exec/s: E oom/timeout/crash: a/b/c time: Ts ..."
grep -E '^#[0-9]+: cov:' "$OUT/long-gguf.log" | tail -1
echo "  corpus files: $(find "$OUT/corpus-gguf" -type f | wc -l), findings kept: $(findings "$OUT/artifacts-gguf")"
# Fork mode's cov: is not the plain edge count: replay corpus + seeds once for the comparable figure
# (the same cov:/ft: the suite's short run prints), out of the instrumented edges.
"$EXE" -runs=0 "${FLAGS[@]}" "$OUT/corpus-gguf" test/fuzz_seeds/gguf 2>&1 \
    | grep -E 'Loaded 1 modules|INITED' | sed -E 's/^INFO: Loaded 1 modules +\(([0-9]+) inline.*/  instrumented edges: \1/; s/^#[0-9]+\s+INITED/  replayed corpus:/'

echo "[fuzz] prefix-cache reader (atheris):"
grep -E '^#[0-9]+\s+(DONE|pulse|NEW|REDUCE)' "$OUT/long-prefix-cache.log" | tail -1
grep -E '^stat::' "$OUT/long-prefix-cache.log"
echo "  corpus files: $(find "$OUT/corpus-prefix-cache" -type f | wc -l), findings kept: $(findings "$OUT/artifacts-prefix-cache")"
grep -hE 'ERROR: |Uncaught Python exception|SUMMARY: ' "$OUT/long-gguf.log" "$OUT/long-prefix-cache.log" | sort | uniq -c | head -20
echo "[fuzz] logs: $OUT/long-gguf.log, $OUT/long-prefix-cache.log"
