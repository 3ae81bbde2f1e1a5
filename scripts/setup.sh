#!/usr/bin/env bash
# One-time (and idempotent) setup: .venv, dependencies, test model, native extension.
# A second run reuses what the first installed: pip skips satisfied requirements, the model
# is only fetched when missing, and the extension is rebuilt only when sources changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV="$ROOT/.venv"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

stamp="$VENV/.requirements.sha"
want=$(sha256sum requirements-test.txt | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[setup] installing requirements (torch is pinned to the CPU wheel)"
    "$VPY" -m pip install --quiet --upgrade pip
    # torch first and alone, so nothing later can pull a CUDA build.
    "$VPY" -m pip install --quiet "torch==2.13.0"
    "$VPY" -m pip install --quiet -r requirements-test.txt
    echo "$want" > "$stamp"
fi

"$ROOT/scripts/fetch_models.sh" "$VPY"

echo "[setup] building the native extension"
"$VPY" setup.py --quiet build_ext --inplace
