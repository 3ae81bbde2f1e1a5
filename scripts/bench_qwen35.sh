#!/usr/bin/env bash
# The README's Qwen3.5-0.8B bench (issue 15), reproducible on any machine:
#   1. the 24-layer random checkpoint at Qwen3.5-0.8B's widths with the real Qwen3.5 tokenizer
#      (test/qwen35_fixtures.py, seeded: the same weights everywhere), converted to F16 by
#      llama.cpp's own convert_hf_to_gguf.py (sdist 0.3.36);
#   2. that F16 file quantized by ours (`edgevlm quantize`) to Q4_K_M and Q8_0;
#   3. `edgevlm bench` on each, against llama.cpp on the same file, 2 threads, text only.
#
#   scripts/bench_qwen35.sh [TYPE ...]      (default: q8_0 q4_k_m; extra bench flags in BENCH_ARGS)
#
# Needs the bench extras (scripts/install_bench_extra.sh: llama-cpp-python). The files are kept in
# build/bench-models/ (the checkpoint and its F16 file in build/test-fixtures: ~5 GB in all); a second run reuses
# them. The checkpoint and F16 conversion take a few minutes, our Q4_K_M quantizer ~11 on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VPY="$ROOT/.venv/bin/python"
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
OUT="$ROOT/build/bench-models"
mkdir -p "$OUT"
TYPES=("$@")
[ ${#TYPES[@]} -gt 0 ] || TYPES=(q8_0 q4_k_m)

f16() {  # the 24-layer checkpoint's F16 file by llama.cpp's converter (built once, in the fixture cache)
    PYTHONPATH="$ROOT:$ROOT/test" "$VPY" -c \
        "import qwen35_fixtures as F; print(F.cached_qwen35_llama_cpp_gguf(layers=24, outtype='f16'))"
}
for t in "${TYPES[@]}"; do
    f="$OUT/qwen35-0.8b-random-$t.gguf"
    if [ ! -f "$f" ]; then
        echo "[bench-qwen35] edgevlm quantize -> $t"
        F16=${F16:-$(f16)}
        PYTHONPATH="$ROOT" "$VPY" -m edgevlm_ros.cli quantize "$F16" "${f%.gguf}.part.gguf" --type "$t"
        mv "${f%.gguf}.part.gguf" "$f"
    fi
    echo "[bench-qwen35] $(date -u '+%Y-%m-%d %H:%M UTC') bench $t"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    PYTHONPATH="$ROOT" "$VPY" -m edgevlm_ros.cli bench --model "$f" --no-vision --no-rss \
        --json "$OUT/bench-qwen35-$t.json" ${BENCH_ARGS:-}
done
