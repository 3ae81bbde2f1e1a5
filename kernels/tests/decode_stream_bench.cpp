// Decode products (m = 1) on an x8-packed weight as the engine runs them, on several threads, each
// thread half (a share) of the rows, wall time, best of 5 calls. By default the weight comes from
// DRAM: a 600 MiB buffer is read between calls. `--cached` instead runs 200 calls back to back on the
// same weight (a weight that fits the caches: the kernel's compute rate). The weight sits on 2 MiB
// pages (MADV_HUGEPAGE, 64-byte aligned), as the engine's PackArena places it.
// docs/kernels/decode-x8-spread-prefetch.md: the measurements of the spread prefetch.
// Build from the repository root (the extension's flags, setup.py):
//   g++ -std=c++17 -O3 -fno-math-errno -pthread -Inative -Ikernels -DEVK_DEFAULT_OPTABLE='""'
//       kernels/tests/decode_stream_bench.cpp
//       $(python -c 'import buildinfo; print(" ".join(buildinfo.sources(kernels_only=True)))') -o /tmp/dsbench
//   /tmp/dsbench TYPE ROWS K [--threads N] [--cached] VARIANT...     (e.g. Q6_K 248320 1024 avxvnni_q8act_x8)
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../formats/formats.h"
#include "../matmul/packed_x8.h"
#include "../ops.h"
#include "bench_weight.h"

using namespace evk;

namespace {

struct Freed {
    void operator()(uint8_t* p) const { std::free(p); }
};

std::unique_ptr<uint8_t, Freed> huge_buffer(size_t bytes) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(kHuge, size));
    if (!p) return nullptr;
    ::madvise(p, size, MADV_HUGEPAGE);  // advice only
    return std::unique_ptr<uint8_t, Freed>(p);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 5) {
        std::fprintf(stderr, "usage: %s TYPE ROWS K [--threads N] [--cached] VARIANT...\n", argv[0]);
        return 2;
    }
    DType t{};
    const TypeTraits* tt = bench_type(argv[1], &t);
    if (!tt) return 2;
    const int64_t rows = std::atoll(argv[2]), k = std::atoll(argv[3]);
    int threads = 2;
    bool cached = false;
    std::vector<std::string> variants;
    for (int i = 4; i < argc; ++i) {
        if (std::strcmp(argv[i], "--cached") == 0) cached = true;
        else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) threads = std::atoi(argv[++i]);
        else variants.emplace_back(argv[i]);
    }
    if (threads < 1 || threads > 64 || rows < 8 * threads || rows % 8 || k < tt->block_size || k % tt->block_size ||
        x8_packed_bytes(t, rows, k) == 0 || variants.empty()) {
        std::fprintf(stderr, "bad arguments (rows a multiple of 8, k of the block, 1-64 threads, a variant)\n");
        return 2;
    }
    const size_t rb = static_cast<size_t>(k / tt->block_size * tt->block_bytes);
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    const std::vector<uint8_t> w = random_rows(tt, rows, k, 256, rng, nd);  // 256 distinct rows, repeated
    std::vector<float> x(static_cast<size_t>(k)), y(static_cast<size_t>(rows));
    for (float& e : x) e = nd(rng);
    const size_t pb = x8_packed_bytes(t, rows, k);
    auto packed = huge_buffer(pb);
    if (!packed) return 1;
    x8_pack(t, w.data(), rb, rows, k, packed.get());
    std::vector<uint8_t> flush(cached ? 0 : size_t{600} << 20, 1);
    std::vector<std::vector<float>> scratch(static_cast<size_t>(threads),
                                            std::vector<float>(static_cast<size_t>(kMatmulScratchRows * k)));
    const int calls = cached ? 200 : 1;
    for (const std::string& v : variants) {
        const MatmulFn fn = matmul_variant(v);
        if (!fn) {
            std::fprintf(stderr, "variant %s unknown or not runnable here\n", v.c_str());
            return 2;
        }
        double best = 1e30;
        for (int rep = 0; rep < 5; ++rep) {
            volatile uint8_t sink = 0;
            for (size_t i = 0; i < flush.size(); i += 64) sink = static_cast<uint8_t>(sink + flush[i]);
            const auto t0 = std::chrono::steady_clock::now();
            std::vector<std::thread> pool;
            for (int th = 0; th < threads; ++th)
                pool.emplace_back([&, th] {
                    const int64_t share = rows / 8 / threads * 8;
                    const int64_t r0 = th * share, r1 = th == threads - 1 ? rows : r0 + share;
                    MatmulArgs a{packed.get(), t, rb, k, r0, r1, x.data(), k, y.data(), rows, 1,
                                 scratch[static_cast<size_t>(th)].data()};
                    a.w_layout = WLayout::kX8;
                    for (int c = 0; c < calls; ++c) fn(a);
                });
            for (std::thread& th : pool) th.join();
            best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls);
        }
        std::printf("%-26s %s %lld x %lld, %d threads, %s: %8.3f ms %6.1f GB/s\n", v.c_str(), argv[1],
                    static_cast<long long>(rows), static_cast<long long>(k), threads, cached ? "cached" : "from DRAM",
                    best * 1e3, static_cast<double>(pb) / best / 1e9);
    }
    return 0;
}
