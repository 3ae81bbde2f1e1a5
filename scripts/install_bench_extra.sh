#!/usr/bin/env bash
# Installs the optional bench peer into .venv: llama-cpp-python built from its PyPI sdist for
# this CPU (CMake -DGGML_NATIVE=ON: every instruction-set extension the build machine has), CPU
# only (no CUDA / Metal / Vulkan / HIP), no curl.
#
# Build time: ~12-25 minutes on 2 cores (the sdist compiles all of llama.cpp).
# The result is tied to this CPU: rebuild (--force) on another machine.
#
#   scripts/install_bench_extra.sh              llama-cpp-python (skipped when it imports already)
#   scripts/install_bench_extra.sh --with-mtmd  also llama.cpp's llama-mtmd-cli, built with CMake
#                                               from the same sdist (~10-15 more minutes), copied
#                                               to .venv/bin: `edgevlm bench` then times
#                                               llama.cpp's vision encoder too
#   scripts/install_bench_extra.sh --force      rebuild even if installed
# Environment: JOBS (parallel compile jobs, default: cores), VPY (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${VPY:-.venv/bin/python}
JOBS=${JOBS:-$(nproc)}
with_mtmd=0
force=0
for arg in "$@"; do
    case "$arg" in
        --with-mtmd) with_mtmd=1 ;;
        --force) force=1 ;;
        -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install_bench_extra: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
    esac
done
if [ ! -x "$VPY" ]; then
    echo "install_bench_extra: $VPY not found: run scripts/setup.sh first" >&2
    exit 1
fi

GGML_CPU_ONLY="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF -DGGML_OPENCL=OFF"
LLAMA_MIN="-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF"

if [ "$force" = 1 ] || ! "$VPY" -c "import llama_cpp" 2>/dev/null; then
    echo "[bench-extra] building llama-cpp-python from its sdist ($JOBS jobs; ~12-25 min on 2 cores)"
    start=$(date +%s)
    # --no-binary: never a prebuilt wheel (those target a generic CPU, or CUDA).
    reinstall=()
    [ "$force" = 1 ] && reinstall=(--force-reinstall --no-deps)
    CMAKE_ARGS="$GGML_CPU_ONLY $LLAMA_MIN" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$VPY" -m pip install --no-binary llama-cpp-python --no-cache-dir "${reinstall[@]}" -r requirements-bench.txt
    echo "[bench-extra] llama-cpp-python built in $(( ($(date +%s) - start) / 60 )) min"
else
    echo "[bench-extra] llama-cpp-python is installed ($("$VPY" -c 'import llama_cpp; print(llama_cpp.__version__)'))"
fi
"$VPY" -c "import llama_cpp; print('[bench-extra] llama.cpp:', llama_cpp.llama_print_system_info().decode().strip())"

if [ "$with_mtmd" = 1 ]; then
    bin_dir=$(dirname "$VPY")
    if [ "$force" = 0 ] && [ -x "$bin_dir/llama-mtmd-cli" ]; then
        echo "[bench-extra] $bin_dir/llama-mtmd-cli exists"
    else
        version=$("$VPY" -c 'import llama_cpp; print(llama_cpp.__version__)')
        work=$(mktemp -d)
        trap 'rm -rf "$work"' EXIT
        echo "[bench-extra] building llama-mtmd-cli from the llama-cpp-python $version sdist (~10-15 min on 2 cores)"
        start=$(date +%s)
        "$VPY" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
        tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
        src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
        # Static: the binary needs none of the shared libraries the Python package ships.
        cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
            $GGML_CPU_ONLY $LLAMA_MIN -DLLAMA_BUILD_TOOLS=ON > "$work/cmake.log"
        cmake --build "$work/build" --target llama-mtmd-cli -j "$JOBS" > "$work/build.log" || {
            tail -20 "$work/build.log" >&2; exit 1; }
        install -m 755 "$work/build/bin/llama-mtmd-cli" "$bin_dir/llama-mtmd-cli"
        echo "[bench-extra] installed $bin_dir/llama-mtmd-cli in $(( ($(date +%s) - start) / 60 )) min"
    fi
fi
