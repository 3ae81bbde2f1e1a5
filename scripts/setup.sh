#!/usr/bin/env bash
# One-time (and idempotent) setup: .venv, dependencies, test models (fetch_models.sh), native extension.
# A second run reuses what the first installed: pip skips satisfied requirements, the model
# is only fetched when missing, and the extension is rebuilt only when sources changed.
set -euo pipefail
# pip on these machines warns about every package missing from the local mirror: keep the
# log readable by dropping exactly those lines.
quiet_pip() { "$VPY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }
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
    quiet_pip install --quiet --upgrade pip
    # torch first and alone, so nothing later can pull a CUDA build.
    quiet_pip install --quiet "torch==2.13.0"
    quiet_pip install --quiet -r requirements-test.txt
    echo "$want" > "$stamp"
fi

# Native test tools from Debian: the aarch64 cross compiler and qemu-user run the Arm kernels.
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "[setup] installing g++-aarch64-linux-gnu and qemu-user (Debian)"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null
    else
        echo "[setup] warning: g++-aarch64-linux-gnu / qemu-user missing (need root + apt): the Arm kernel tests will fail" >&2
    fi
fi

# Fuzzing (test/test_fuzz.py, scripts/fuzz_long.sh): clang-14 and its runtimes (libFuzzer, ASan,
# UBSan) from Debian build the libFuzzer harness of the GGUF reader and model loaders.
if ! command -v clang++-14 >/dev/null || ! dpkg -s libclang-rt-14-dev >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "[setup] installing clang-14 and libclang-rt-14-dev (Debian)"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-14 libclang-rt-14-dev >/dev/null
    else
        echo "[setup] warning: clang-14 / libclang-rt-14-dev missing (need root + apt): the fuzzing tests will fail" >&2
    fi
fi

"$ROOT/scripts/fetch_models.sh" "$VPY"

# The package in editable mode: console scripts (.venv/bin/edgevlm, edgevlm_node) that run this
# checkout. Done once; later runs only rebuild what changed (below).
if [ ! -x "$VENV/bin/edgevlm" ]; then
    echo "[setup] installing edgevlm_ros (editable) into $VENV"
    quiet_pip install --quiet --no-deps --no-build-isolation -e .
fi

echo "[setup] building the native extension"
"$VPY" setup.py --quiet build_ext --inplace 2>&1 | { grep -v "is ignored" || true; }
test "${PIPESTATUS[0]}" -eq 0
