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
#   scripts/install_bench_extra.sh --robot      only libllama for the robot profile (x86 robot
#                                               computer: AVX2 + AVX-VNNI + FMA + F16C, no AVX-512,
#                                               no AMX; -DGGML_NATIVE=OFF), built with CMake from
#                                               the llama-cpp-python sdist into ROBOT_LIB (~10-20
#                                               min on 2 cores): `edgevlm bench --profile robot`
#                                               loads it through LLAMA_CPP_LIB_PATH; with
#                                               --with-mtmd also a robot llama-mtmd-cli there
#                                               (~5 more min), which that bench's vision rows run
#   --sdist PATH                                with --robot: the sdist to build (.tar.gz or its
#                                               unpacked folder; default: pip download of the
#                                               installed llama-cpp-python's version)
# Environment: JOBS (parallel compile jobs, default: cores), VPY (default .venv/bin/python),
#   ROBOT_LIB (default: $EDGEVLM_ROBOT_LLAMA_LIB, else ${XDG_CACHE_HOME:-~/.cache}/edgevlm/llama-robot,
#   where `edgevlm bench --profile robot` looks).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${VPY:-.venv/bin/python}
JOBS=${JOBS:-$(nproc)}
ROBOT_LIB=${ROBOT_LIB:-${EDGEVLM_ROBOT_LLAMA_LIB:-${XDG_CACHE_HOME:-$HOME/.cache}/edgevlm/llama-robot}}
with_mtmd=0
force=0
robot=0
sdist=""
while [ $# -gt 0 ]; do
    case "$1" in
        --with-mtmd) with_mtmd=1 ;;
        --force) force=1 ;;
        --robot) robot=1 ;;
        --sdist)
            [ $# -ge 2 ] || { echo "install_bench_extra: --sdist needs a path" >&2; exit 2; }
            sdist=$2; shift ;;
        -h|--help) sed -n '2,28p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install_bench_extra: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ -n "$sdist" ] && [ "$robot" = 0 ]; then
    echo "install_bench_extra: --sdist goes with --robot" >&2; exit 2
fi
if [ -n "$sdist" ] && [ ! -e "$sdist" ]; then
    echo "install_bench_extra: --sdist $sdist not found" >&2; exit 2
fi
if [ ! -x "$VPY" ]; then
    echo "install_bench_extra: $VPY not found: run scripts/setup.sh first" >&2
    exit 1
fi

GPU_OFF="-DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF -DGGML_OPENCL=OFF"
# This CPU's extensions, but never AMX: llama.cpp 0.3.36's AMX matmul segfaults on our test files
# (ggml_backend_amx_mul_mat, llama.cpp issue 20824, closed unfixed; seen here on a Xeon guest with
# amx_int8). Where the CPU has AMX, -march=native would compile it in, so the extensions are named
# one by one from /proc/cpuinfo instead.
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then
    cpu_flag() { grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1" && echo ON || echo OFF; }
    GGML_CPU_ONLY="-DGGML_NATIVE=OFF -DGGML_SSE42=$(cpu_flag sse4_2) -DGGML_AVX=$(cpu_flag avx) \
-DGGML_AVX2=$(cpu_flag avx2) -DGGML_AVX_VNNI=$(cpu_flag avx_vnni) -DGGML_FMA=$(cpu_flag fma) \
-DGGML_F16C=$(cpu_flag f16c) -DGGML_BMI2=$(cpu_flag bmi2) -DGGML_AVX512=$(cpu_flag avx512f) \
-DGGML_AVX512_VBMI=$(cpu_flag avx512vbmi) -DGGML_AVX512_VNNI=$(cpu_flag avx512_vnni) \
-DGGML_AVX512_BF16=$(cpu_flag avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF $GPU_OFF"
else
    GGML_CPU_ONLY="-DGGML_NATIVE=ON $GPU_OFF"
fi
LLAMA_MIN="-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF"

# llama-mtmd-cli from the llama.cpp sources SRC, built in BUILD with the ggml FLAGS, installed in
# DEST. Static: the binary needs none of the shared libraries the Python package ships.
build_mtmd_cli() {
    local src=$1 build=$2 flags=$3 dest=$4
    # shellcheck disable=SC2086  # flags is a list of -D options
    cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        $flags $LLAMA_MIN -DLLAMA_BUILD_TOOLS=ON > "$build.cmake.log" || {
        tail -20 "$build.cmake.log" >&2; exit 1; }
    cmake --build "$build" --target llama-mtmd-cli -j "$JOBS" > "$build.log" || {
        tail -20 "$build.log" >&2; exit 1; }
    mkdir -p "$dest"
    install -m 755 "$build/bin/llama-mtmd-cli" "$dest/llama-mtmd-cli"
}

if [ "$robot" = 1 ]; then
    # The robot profile: what an x86 robot computer (e.g. Alder Lake / Arrow Lake class) has;
    # AVX-512 and AMX explicitly off. Built where the bench runs or cross-built on any x86.
    ROBOT_FLAGS="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON \
-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
-DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
-DGGML_AMX_BF16=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF \
-DGGML_SYCL=OFF -DGGML_OPENCL=OFF"
    need_lib=1
    need_cli=$with_mtmd
    if [ "$force" = 0 ] && [ -f "$ROBOT_LIB/libllama.so" ]; then
        echo "[bench-extra] $ROBOT_LIB/libllama.so exists (--force rebuilds)"
        need_lib=0
    fi
    if [ "$need_cli" = 1 ] && [ "$force" = 0 ] && [ -x "$ROBOT_LIB/llama-mtmd-cli" ]; then
        echo "[bench-extra] $ROBOT_LIB/llama-mtmd-cli exists (--force rebuilds)"
        need_cli=0
    fi
    [ "$need_lib" = 1 ] || [ "$need_cli" = 1 ] || exit 0
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    if [ -z "$sdist" ]; then
        version=$("$VPY" -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || echo 0.3.36)
        "$VPY" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version"
        sdist=$(echo "$work"/llama_cpp_python-*.tar.gz)
    fi
    # A private copy: the given folder may be read-only and is never written.
    mkdir "$work/src"
    if [ -d "$sdist" ]; then
        cp -r "$sdist/vendor/llama.cpp" "$work/src/"
    else
        tar -xzf "$sdist" -C "$work/src" --strip-components=2 --wildcards '*/vendor/llama.cpp'
    fi
    [ -f "$work/src/llama.cpp/CMakeLists.txt" ] || {
        echo "install_bench_extra: $sdist holds no vendor/llama.cpp" >&2; exit 1; }
    if [ "$need_lib" = 1 ]; then
        echo "[bench-extra] building libllama for the robot profile ($JOBS jobs) into $ROBOT_LIB"
        start=$(date +%s)
        # shellcheck disable=SC2086
        cmake -S "$work/src/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
            -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' \
            $ROBOT_FLAGS $LLAMA_MIN -DLLAMA_BUILD_TOOLS=OFF > "$work/cmake.log" || {
            tail -20 "$work/cmake.log" >&2; exit 1; }
        cmake --build "$work/build" --target llama -j "$JOBS" > "$work/build.log" || {
            tail -20 "$work/build.log" >&2; exit 1; }
        mkdir -p "$ROBOT_LIB"
        cp -P "$work"/build/bin/lib*.so* "$ROBOT_LIB/"
        echo "[bench-extra] built $ROBOT_LIB/libllama.so in $(( ($(date +%s) - start) / 60 )) min"
        # Loading runs no AVX-VNNI instruction: the check works on a build machine without it.
        LLAMA_CPP_LIB_PATH="$ROBOT_LIB" "$VPY" -c "import llama_cpp; print('[bench-extra] robot llama.cpp:', llama_cpp.llama_print_system_info().decode().strip())"
    fi
    if [ "$need_cli" = 1 ]; then
        echo "[bench-extra] building llama-mtmd-cli for the robot profile ($JOBS jobs) into $ROBOT_LIB"
        start=$(date +%s)
        build_mtmd_cli "$work/src/llama.cpp" "$work/build-mtmd" "$ROBOT_FLAGS" "$ROBOT_LIB"
        echo "[bench-extra] built $ROBOT_LIB/llama-mtmd-cli in $(( ($(date +%s) - start) / 60 )) min"
    fi
    exit 0
fi

# An earlier install with AMX compiled in (before the rule above) is rebuilt.
if "$VPY" -c "import llama_cpp, sys; sys.exit('AMX_INT8 = 1' not in llama_cpp.llama_print_system_info().decode())" 2>/dev/null; then
    echo "[bench-extra] the installed llama-cpp-python has AMX compiled in: rebuilding without it"
    force=1
fi
if [ "$force" = 1 ] || ! "$VPY" -c "import llama_cpp" 2>/dev/null; then
    echo "[bench-extra] building llama-cpp-python from its sdist ($JOBS jobs; ~3 min on 2 cores of a 2026 Xeon, up to ~25 on slower ones)"
    start=$(date +%s)
    # --no-binary: never a prebuilt wheel (those target a generic CPU, or CUDA).
    reinstall=()
    [ "$force" = 1 ] && reinstall=(--force-reinstall --no-deps)
    CMAKE_ARGS="$GGML_CPU_ONLY $LLAMA_MIN -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
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
        build_mtmd_cli "$src" "$work/build" "$GGML_CPU_ONLY" "$bin_dir"
        echo "[bench-extra] installed $bin_dir/llama-mtmd-cli in $(( ($(date +%s) - start) / 60 )) min"
    fi
fi
