// Microbenchmark of rmsnorm, layernorm, rope and add, reference against a variant (avx2 by
// default), at the models' sizes: SmolLM2-135M's rmsnorm rows of 576 (one decode token; a 64-token
// prefill chunk), its rope on 9 query heads and 3 kv heads of 64, the residual add of one token
// and of a 64-token chunk, and the SmolVLM vision tower's layernorm and residual add over 1024
// tokens of 768. Also two fusions the models could use, each against the unfused calls of the same
// variant: add_rmsnorm (llama: x += b over the chunk, then rmsnorm of every row) and add_layernorm
// (the vision residual: x += h, then layernorm of the row), written here only, to decide whether a
// fused operator is worth adding.
//
// Thread CPU time (time descheduled on a shared machine does not count); every sample runs ref and
// the variant back to back in alternating order, and the report gives medians (and the best) of
// --reps samples. Build (with the extension's code-generation flags, setup.py) and run, from the
// repository root:
//   g++ -std=c++17 -O3 -fno-math-errno -Inative -Ikernels -DEVK_DEFAULT_OPTABLE='""' kernels/tests/norms_bench.cpp
//       $(python -c 'import buildinfo; print(" ".join(buildinfo.sources(kernels_only=True)))') -o /tmp/normbench
//   /tmp/normbench --reps 31
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "../ops.h"
#include "bench_clock.h"
#if defined(__x86_64__)
#include "../elementwise/exp_avx2.h"
#endif

using namespace evk;

namespace {

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Per sample: reset() (not timed), then a() and b() timed, their order alternating.
void ab(const char* what, int reps, int inner, const char* name_a, const char* name_b, const std::function<void()>& reset,
        const std::function<void()>& a, const std::function<void()>& b, double bytes, double flops) {
    std::vector<double> ta, tb;
    for (int r = 0; r < reps; ++r)
        for (int k = 0; k < 2; ++k) {
            const bool first_a = (r + k) % 2 == 0;
            reset();
            const double t0 = cpu_seconds();
            for (int i = 0; i < inner; ++i) (first_a ? a : b)();
            (first_a ? ta : tb).push_back((cpu_seconds() - t0) / inner);
        }
    const double ma = median(ta), mb = median(tb);
    std::printf("%-44s %s %9.2f us (best %8.2f)   %s %9.2f us (best %8.2f)   x%.2f   %s: %.1f GB/s %.2f GFLOP/s\n", what, name_a,
                ma * 1e6, *std::min_element(ta.begin(), ta.end()) * 1e6, name_b, mb * 1e6,
                *std::min_element(tb.begin(), tb.end()) * 1e6, ma / mb, name_b, bytes / mb / 1e9, flops / mb / 1e9);
}

#if defined(__x86_64__)
// x += b, then y = rmsnorm(x) * w, in one pass for the add and the sum of squares (float lanes, 4
// accumulators as rmsnorm_avx2) and one for the output: one read of x fewer than add + rmsnorm.
EV_AVX2 void add_rmsnorm_fused(float* x, const float* b, const float* w, float* y, int64_t n, float eps) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; ++j) {
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + i + 8 * j), _mm256_loadu_ps(b + i + 8 * j));
            _mm256_storeu_ps(x + i + 8 * j, v);
            acc[j] = _mm256_fmadd_ps(v, v, acc[j]);
        }
    int j = 0;
    for (; i + 8 <= n; i += 8, ++j) {
        const __m256 v = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(b + i));
        _mm256_storeu_ps(x + i, v);
        acc[j] = _mm256_fmadd_ps(v, v, acc[j]);
    }
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        const __m256 v = _mm256_add_ps(_mm256_maskload_ps(x + i, m), _mm256_maskload_ps(b + i, m));
        _mm256_maskstore_ps(x + i, m, v);
        acc[j] = _mm256_fmadd_ps(v, v, acc[j]);
    }
    const double ss = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    const __m256 s = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps)));
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), _mm256_loadu_ps(w + i)));
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(y + i, m, _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(x + i, m), s), _mm256_maskload_ps(w + i, m)));
    }
}

// x += h, then layernorm: the add and the mean's sum in one pass. n a multiple of 16 (768 here).
EV_AVX2 void add_layernorm_fused(float* x, const float* h, const float* w, const float* b, float* y, int64_t n, float eps) {
    if (n % 16 != 0) std::abort();
    __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 v0 = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(h + i));
        const __m256 v1 = _mm256_add_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(h + i + 8));
        _mm256_storeu_ps(x + i, v0);
        _mm256_storeu_ps(x + i + 8, v1);
        acc = _mm256_add_ps(acc, v0);
        acc1 = _mm256_add_ps(acc1, v1);
    }
    const float mean = static_cast<float>(hsum(_mm256_add_ps(acc, acc1)) / static_cast<double>(n));
    const __m256 vm = _mm256_set1_ps(mean);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
        const __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(x + i), vm), d1 = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vm);
        s0 = _mm256_fmadd_ps(d0, d0, s0);
        s1 = _mm256_fmadd_ps(d1, d1, s1);
    }
    const __m256 inv = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(hsum(_mm256_add_ps(s0, s1)) / static_cast<double>(n) + eps)));
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), inv);
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(d, _mm256_loadu_ps(w + i), _mm256_loadu_ps(b + i)));
    }
}
#endif

}  // namespace

int main(int argc, char** argv) {
    const int reps = argc > 2 && std::string(argv[1]) == "--reps" ? std::atoi(argv[2]) : 31;
    const std::string variant = argc > 4 && std::string(argv[3]) == "--variant" ? argv[4] : "avx2";
    const RmsNormFn rn = rmsnorm_variant(variant);
    const LayerNormFn ln = layernorm_variant(variant);
    const RopeFn ro = rope_variant(variant);
    const AddFn ad = add_variant(variant);
    if (!rn || !ln || !ro || !ad) {
        std::printf("variant %s does not run on this CPU\n", variant.c_str());
        return 1;
    }
    const char* v = variant.c_str();
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto randv = [&](size_t n, float mul, float add) {
        std::vector<float> out(n);
        for (float& e : out) e = nd(rng) * mul + add;
        return out;
    };
    auto nothing = [] {};

    // rmsnorm, SmolLM2: rows of 576; 1 token (decode) and a 64-token chunk. Bytes: x read twice
    // (the sum, the output; the second from L1), w read, y written.
    for (int64_t rows : {int64_t{1}, int64_t{64}}) {
        const int64_t d = 576;
        const std::vector<float> x = randv(rows * d, 2.f, 0.5f), w = randv(d, 0.2f, 1.f);
        std::vector<float> y(rows * d);
        auto run = [&](RmsNormFn f) {
            return [&, f] { for (int64_t t = 0; t < rows; ++t) f(&x[t * d], w.data(), &y[t * d], d, 1e-5f); };
        };
        const std::string what = "rmsnorm " + std::to_string(rows) + " x 576";
        ab(what.c_str(), reps, rows == 1 ? 2000 : 50, "ref", v, nothing, run(rmsnorm_ref), run(rn), rows * d * 16.0, rows * d * 4.0);
    }
    // rope, SmolLM2 q (9 heads) and k (3 heads) of 64, normal layout, one token; 64 tokens.
    for (int64_t heads : {int64_t{9}, int64_t{3}})
        for (bool neox : {false, true}) {
            const int64_t hd = 64, tokens = 64;
            std::vector<float> x = randv(tokens * heads * hd, 1.f, 0.f), cs(hd);
            rope_angles(77.f, 10000.f, hd, cs.data());
            auto run = [&](RopeFn f) {
                return [&, f] { for (int64_t t = 0; t < tokens; ++t) f(&x[t * heads * hd], heads, hd, hd, cs.data(), neox); };
            };
            const std::string what = "rope " + std::to_string(heads) + " x 64 " + (neox ? "neox" : "normal") + " (x64 tokens)";
            ab(what.c_str(), reps, 50, "ref", v, nothing, run(rope_ref), run(ro), tokens * heads * hd * 8.0, tokens * heads * hd * 3.0);
        }
    // add: one token of 576, a 64-token chunk of 576, the vision residual 1024 x 768 (3 MiB each).
    for (int64_t n : {int64_t{576}, int64_t{64 * 576}, int64_t{1024 * 768}}) {
        std::vector<float> a = randv(n, 1.f, 0.f);
        const std::vector<float> b = randv(n, 1e-3f, 0.f);
        auto run = [&](AddFn f) { return [&, f] { f(a.data(), b.data(), n); }; };
        const std::string what = "add " + std::to_string(n);
        ab(what.c_str(), reps, n < 100000 ? 500 : 5, "ref", v, nothing, run(add_ref), run(ad), n * 12.0, n * 1.0);
    }
    // layernorm, vision tower: 1024 tokens x 768 (x 3 MiB read, y 3 MiB written), with the bias.
    {
        const int64_t d = 768, tokens = 1024;
        const std::vector<float> x = randv(tokens * d, 2.f, 0.3f), w = randv(d, 0.2f, 1.f), b = randv(d, 0.1f, 0.f);
        std::vector<float> y(tokens * d);
        auto run = [&](LayerNormFn f) {
            return [&, f] { for (int64_t t = 0; t < tokens; ++t) f(&x[t * d], w.data(), b.data(), &y[t * d], d, 1e-6f); };
        };
        ab("layernorm 1024 x 768", reps, 3, "ref", v, nothing, run(layernorm_ref), run(ln), tokens * d * 8.0, tokens * d * 8.0);
    }
#if defined(__x86_64__)
    if (variant == "avx2") {
        // llama: add over the chunk then rmsnorm row by row (as forward_chunk) against the fusion.
        for (int64_t rows : {int64_t{1}, int64_t{64}}) {
            const int64_t d = 576;
            std::vector<float> x = randv(rows * d, 1.f, 0.f);
            const std::vector<float> b = randv(rows * d, 1e-3f, 0.f), w = randv(d, 0.2f, 1.f);
            std::vector<float> y(rows * d);
            auto unfused = [&] {
                ad(x.data(), b.data(), rows * d);
                for (int64_t t = 0; t < rows; ++t) rn(&x[t * d], w.data(), &y[t * d], d, 1e-5f);
            };
            auto fused = [&] { for (int64_t t = 0; t < rows; ++t) add_rmsnorm_fused(&x[t * d], &b[t * d], w.data(), &y[t * d], d, 1e-5f); };
            const std::string what = "add+rmsnorm " + std::to_string(rows) + " x 576";
            ab(what.c_str(), reps, rows == 1 ? 2000 : 50, "unfused", "fused", nothing, unfused, fused, rows * d * 20.0, rows * d * 5.0);
        }
        // vision residual: x += h, layernorm(x) row by row (as the SigLIP tower's residual_norm) against the fusion.
        {
            const int64_t d = 768, tokens = 1024;
            std::vector<float> x = randv(tokens * d, 1.f, 0.f);
            const std::vector<float> h = randv(tokens * d, 1e-3f, 0.f), w = randv(d, 0.2f, 1.f), b = randv(d, 0.1f, 0.f);
            std::vector<float> y(tokens * d);
            auto unfused = [&] {
                for (int64_t t = 0; t < tokens; ++t) {
                    ad(&x[t * d], &h[t * d], d);
                    ln(&x[t * d], w.data(), b.data(), &y[t * d], d, 1e-6f);
                }
            };
            auto fused = [&] {
                for (int64_t t = 0; t < tokens; ++t) add_layernorm_fused(&x[t * d], &h[t * d], w.data(), b.data(), &y[t * d], d, 1e-6f);
            };
            ab("add+layernorm 1024 x 768", reps, 3, "unfused", "fused", nothing, unfused, fused, tokens * d * 20.0, tokens * d * 9.0);
        }
    }
#endif
    return 0;
}
