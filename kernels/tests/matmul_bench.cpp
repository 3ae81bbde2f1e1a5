// Microbenchmark of one decode product (m = 1) on a packed x8 weight: a weight of ROWS x K in TYPE,
// either cache-resident (one weight, reused) or streamed from DRAM (enough copies to fill
// 512 MiB, read in turn), one thread. Thread CPU time, best of --reps; GB/s of weight bytes.
// `--once` runs one product only, for callgrind:
//   valgrind --tool=callgrind --toggle-collect='*run_x8*' /tmp/mmbench Q6_K 64 2048 --once
// Build from the repository root (the extension's flags, setup.py):
//   g++ -std=c++17 -O3 -fno-math-errno -Inative -Ikernels -DEVK_DEFAULT_OPTABLE='""' kernels/tests/matmul_bench.cpp
//       $(python -c 'import buildinfo; print(" ".join(buildinfo.sources(kernels_only=True)))') -o /tmp/mmbench
//   /tmp/mmbench TYPE ROWS K [VARIANT] [--once]      (VARIANT: avx2_q8act_x8 by default)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../formats/formats.h"
#include "../matmul/packed_x8.h"
#include "../ops.h"
#include "bench_clock.h"
#include "bench_weight.h"

using namespace evk;

int main(int argc, char** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: %s TYPE ROWS K [VARIANT] [--once]\n", argv[0]);
        return 2;
    }
    DType t{};
    const TypeTraits* tt = bench_type(argv[1], &t);
    if (!tt) return 2;
    const int64_t rows = std::atoll(argv[2]), k = std::atoll(argv[3]);
    std::string variant = "avx2_q8act_x8";
    bool once = false;
    for (int i = 4; i < argc; ++i) {
        if (std::strcmp(argv[i], "--once") == 0) once = true;
        else variant = argv[i];
    }
    if (rows < 8 || rows % 8 || k < tt->block_size || k % tt->block_size || x8_packed_bytes(t, rows, k) == 0) {
        std::fprintf(stderr, "%s has no x8 layout at %lld x %lld\n", argv[1], static_cast<long long>(rows),
                     static_cast<long long>(k));
        return 2;
    }
    const MatmulFn fn = matmul_variant(variant);
    if (!fn) {
        std::fprintf(stderr, "variant %s unknown or not runnable here\n", variant.c_str());
        return 2;
    }
    const size_t rb = static_cast<size_t>(k / tt->block_size * tt->block_bytes);
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    const std::vector<uint8_t> w = random_rows(tt, rows, k, rows, rng, nd);
    std::vector<float> x(static_cast<size_t>(k)), y(static_cast<size_t>(rows));
    for (float& e : x) e = nd(rng);
    const size_t pb = x8_packed_bytes(t, rows, k);
    const size_t copies = once ? 1 : std::max<size_t>(1, (size_t{512} << 20) / pb);
    std::vector<uint8_t> packed(pb * copies);
    for (size_t c = 0; c < copies; ++c) x8_pack(t, w.data(), rb, rows, k, packed.data() + c * pb);
    std::vector<float> scratch(static_cast<size_t>(kMatmulScratchRows * k));
    MatmulArgs a{packed.data(), t, rb, k, 0, rows, x.data(), k, y.data(), rows, 1, scratch.data()};
    a.w_layout = WLayout::kX8;
    if (once) {
        fn(a);
        std::printf("%s %s %lld x %lld: y[0] = %g\n", variant.c_str(), argv[1], static_cast<long long>(rows),
                    static_cast<long long>(k), static_cast<double>(y[0]));
        return 0;
    }
    const int reps = 5;
    for (int mode = 0; mode < 2; ++mode) {  // 0: the first copy again and again; 1: every copy in turn
        double best = 1e30;
        for (int rep = 0; rep < reps; ++rep) {
            const double t0 = cpu_seconds();
            for (size_t c = 0; c < copies; ++c) {
                a.w = packed.data() + (mode == 0 ? 0 : c * pb);
                fn(a);
            }
            best = std::min(best, (cpu_seconds() - t0) / static_cast<double>(copies));
        }
        std::printf("%-18s %-5s %6lld x %5lld %-14s %9.1f us  %6.2f GB/s\n", variant.c_str(), argv[1],
                    static_cast<long long>(rows), static_cast<long long>(k), mode == 0 ? "cache-resident" : "streamed",
                    best * 1e6, static_cast<double>(pb) / best / 1e9);
    }
    return 0;
}
