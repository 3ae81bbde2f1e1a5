// Microbenchmark of the Gated DeltaNet operators at Qwen3.5-0.8B's shapes: one delta-rule head
// (128 x 128 state) over 1 token (decode), 64 and 512 tokens (prefill), every delta_rule variant
// that runs here; causal_conv1d over 6144 channels (q, k, v of 16 heads of 128), K = 4, 1 and 64
// tokens, ref against the best variant. Thread CPU time, medians of --reps samples (each sample
// runs the variants in rotating order). `--once OP VARIANT N` runs one call only, for callgrind:
//   valgrind --tool=callgrind --toggle-collect='evk::delta_rule_*' /tmp/dnbench --once delta_rule avx2 64
// Build from the repository root (the extension's flags, setup.py):
//   g++ -std=c++17 -O3 -fno-math-errno -Inative -Ikernels -DEVK_DEFAULT_OPTABLE='""' kernels/tests/deltanet_bench.cpp
//       $(python -c 'import buildinfo; print(" ".join(buildinfo.sources(kernels_only=True)))') -o /tmp/dnbench
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../ops.h"
#include "bench_clock.h"

using namespace evk;

namespace {

constexpr int64_t kDim = 128, kMaxTokens = 512, kChannels = 6144, kConvK = 4;

struct Inputs {
    std::vector<float> S0, S, q, k, v, g, b, out, x, w, st0, st, y;
    Inputs() {
        std::mt19937 rng(5);
        std::normal_distribution<float> nd(0.f, 1.f);
        auto fill = [&](std::vector<float>& a, size_t n, float scale) {
            a.resize(n);
            for (float& e : a) e = scale * nd(rng);
        };
        fill(S0, kDim * kDim, 0.1f);
        fill(q, kMaxTokens * kDim, 1.f / kDim);  // about unit norm / sqrt(dk), as the block hands it over
        fill(k, kMaxTokens * kDim, 1.f / std::sqrt(static_cast<float>(kDim)));
        fill(v, kMaxTokens * kDim, 1.f);
        g.resize(kMaxTokens);
        b.resize(kMaxTokens);
        for (int64_t t = 0; t < kMaxTokens; ++t) g[t] = -std::exp(nd(rng) - 1.f), b[t] = 1.f / (1.f + std::exp(-nd(rng)));
        out.resize(kMaxTokens * kDim);
        fill(x, 64 * kChannels, 1.f);
        fill(w, kConvK * kChannels, 0.5f);
        fill(st0, (kConvK - 1) * kChannels, 1.f);
        y.resize(64 * kChannels);
    }
    void delta(DeltaRuleFn fn, int64_t n) {
        fn(S.data(), q.data(), k.data(), kDim, v.data(), kDim, g.data(), b.data(), 1, n, kDim, kDim, out.data(), kDim);
    }
    void conv(CausalConv1dFn fn, int64_t n) {
        fn(x.data(), kChannels, n, kChannels, w.data(), kConvK, st.data(), y.data(), kChannels);
    }
};

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    Inputs in;
    in.S = in.S0;
    in.st = in.st0;
    if (argc == 5 && std::strcmp(argv[1], "--once") == 0) {
        const std::string op = argv[2], variant = argv[3];
        const int64_t n = std::min<int64_t>(std::atoi(argv[4]), op == "delta_rule" ? kMaxTokens : 64);
        if (op == "delta_rule" && delta_rule_variant(variant)) in.delta(delta_rule_variant(variant), n);
        else if (op == "causal_conv1d" && causal_conv1d_variant(variant)) in.conv(causal_conv1d_variant(variant), n);
        else return 2;
        std::printf("%s %s n=%lld: out %g\n", op.c_str(), variant.c_str(), static_cast<long long>(n), in.out[0] + in.y[0]);
        return 0;
    }
    const int reps = argc == 3 && std::strcmp(argv[1], "--reps") == 0 ? std::atoi(argv[2]) : 11;
    std::vector<std::string> names;
    for (const VariantInfo& v : list_variants())
        if (v.op == "delta_rule" && v.available) names.push_back(v.name);
    for (int64_t n : {int64_t{1}, int64_t{64}, kMaxTokens}) {
        std::vector<std::vector<double>> t(names.size());
        const int inner = n == 1 ? 200 : 1;
        for (int r = 0; r < reps; ++r)
            for (size_t s = 0; s < names.size(); ++s) {
                const size_t i = (s + r) % names.size();
                in.S = in.S0;
                const double t0 = cpu_seconds();
                for (int j = 0; j < inner; ++j) in.delta(delta_rule_variant(names[i]), n);
                t[i].push_back((cpu_seconds() - t0) / inner);
            }
        for (size_t i = 0; i < names.size(); ++i) {
            const double m = median(t[i]);
            std::printf("delta_rule %-12s 128x128 n=%3lld: %8.2f us/token  %6.2f GFLOP/s (6 dk dv per token)\n", names[i].c_str(),
                        static_cast<long long>(n), m / n * 1e6, 6.0 * kDim * kDim * n / m / 1e9);
        }
    }
    const CausalConv1dFn best = best_ops().causal_conv1d;
    for (int64_t n : {int64_t{1}, int64_t{64}}) {
        std::vector<double> tr, tb;
        for (int r = 0; r < reps; ++r)
            for (int s = 0; s < 2; ++s) {
                const bool ref_first = (r + s) % 2 == 0;
                in.st = in.st0;
                const double t0 = cpu_seconds();
                in.conv(ref_first ? causal_conv1d_ref : best, n);
                (ref_first ? tr : tb).push_back(cpu_seconds() - t0);
            }
        std::printf("causal_conv1d 6144 x K=4 n=%2lld: ref %8.1f us  %s %8.1f us  x%.1f\n", static_cast<long long>(n),
                    median(tr) * 1e6, best_ops().causal_conv1d_variant, median(tb) * 1e6, median(tr) / median(tb));
    }
    return 0;
}
