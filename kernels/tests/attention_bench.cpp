// Microbenchmark of decode attention, variant against variant (avx2 against avx512 by default), at
// one decode token's work: `layers` separate caches (so that K and V come from L3 / memory as in
// decode, not from L1), kv heads of a group of query heads each, every cache type. Default shape:
// SmolLM2-135M (30 layers, 3 kv heads, 3 query heads each, head_dim 64, the cache row 3 heads wide);
// --hd 256 --kvh 1 --group 4 --layers 18 is Gemma 3 270M. Reports the median thread-CPU time of a
// token's attention, the two variants alternated sample by sample, and the bytes the cache holds.
// --tokens N (prefill): the attention of an N-token prompt from position 0 over a float cache, in
// calls of --tile tokens (AttentionArgs::n_tok) against calls of one token, the same variant (--a);
// reports the median thread-CPU time of the prompt's attention and its GFLOP/s (4 hd flops a
// query-key pair: the scores and the weighted sum).
// Build with the extension's flags and run, from the repository root:
//   g++ -std=c++17 -O3 -fno-math-errno -pthread -Inative -Ikernels -DEVK_DEFAULT_OPTABLE='""' kernels/tests/attention_bench.cpp
//       $(python -c 'import buildinfo; print(" ".join(buildinfo.sources(kernels_only=True)))') -o /tmp/attbench
//   /tmp/attbench --ctx 4096 --reps 15
#include <algorithm>
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

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// The attention of a `tokens`-token prompt (causal, from position 0; queries and cache head-major
// per layer), in calls of `tile` tokens against calls of one, alternated sample by sample.
int prefill(AttentionFn fn, const std::string& name, int64_t tokens, int64_t tile, int64_t hd, int64_t kvh,
            int64_t group, int64_t layers, int reps, std::mt19937& rng) {
    std::normal_distribution<float> nd;
    const int64_t qd = kvh * group * hd;
    std::vector<float> q(tokens * qd), out(tokens * qd), scores(std::max<int64_t>(tile, 1) * group * (tokens + tile));
    std::vector<float> kc(layers * kvh * tokens * hd), vc(kc.size());
    for (float& e : q) e = nd(rng);
    for (float& e : kc) e = nd(rng);
    for (float& e : vc) e = nd(rng);
    auto prompt = [&](int64_t n_tok) {
        for (int64_t l = 0; l < layers; ++l)
            for (int64_t h = 0; h < kvh; ++h) {
                const float* k = kc.data() + (l * kvh + h) * tokens * hd;
                const float* v = vc.data() + (l * kvh + h) * tokens * hd;
                for (int64_t t = 0; t < tokens; t += n_tok) {
                    AttentionArgs a{q.data() + t * qd + h * group * hd, k, v, hd, hd, t + 1, hd, 0.125f,
                                    out.data() + t * qd + h * group * hd, scores.data(), DType::F32, group, hd};
                    a.n_tok = std::min(n_tok, tokens - t), a.tok_stride = qd;
                    fn(a);
                }
            }
    };
    std::vector<double> t1, tn;
    for (int r = 0; r < reps; ++r)
        for (int k = 0; k < 2; ++k) {
            const bool one_first = (r + k) % 2 == 0;
            const double t0 = cpu_seconds();
            prompt(one_first ? 1 : tile);
            (one_first ? t1 : tn).push_back(cpu_seconds() - t0);
        }
    const double flops = 4.0 * hd * layers * kvh * group * (tokens * (tokens + 1) / 2);
    const double m1 = median(t1), mn = median(tn);
    std::printf("%s, prompt of %lld tokens, %lld layers x %lld kv heads x %lld query heads, head_dim %lld, median of %d:\n"
                "  1 token a call: %8.2f ms (%5.1f GFLOP/s)   %lld tokens a call: %8.2f ms (%5.1f GFLOP/s)   x%.2f\n",
                name.c_str(), static_cast<long long>(tokens), static_cast<long long>(layers), static_cast<long long>(kvh),
                static_cast<long long>(group), static_cast<long long>(hd), reps, m1 * 1e3, flops / m1 / 1e9,
                static_cast<long long>(tile), mn * 1e3, flops / mn / 1e9, m1 / mn);
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    int64_t ctx = 1024, hd = 64, kvh = 3, group = 3, layers = 30, tokens = 0, tile = 6;
    int reps = 11;
    std::string va = "avx2", vb = "avx512";
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string k = argv[i];
        const long long x = std::atoll(argv[i + 1]);
        if (k == "--ctx") ctx = x;
        else if (k == "--hd") hd = x;
        else if (k == "--kvh") kvh = x;
        else if (k == "--group") group = x;
        else if (k == "--layers") layers = x;
        else if (k == "--reps") reps = static_cast<int>(x);
        else if (k == "--tokens") tokens = x;
        else if (k == "--tile") tile = x;
        else if (k == "--a") va = argv[i + 1];
        else if (k == "--b") vb = argv[i + 1];
        else {
            std::fprintf(stderr, "unknown option %s\n", k.c_str());
            return 2;
        }
    }
    const AttentionFn fa = attention_variant(va), fb = attention_variant(vb);
    if (!fa || !fb) {
        std::fprintf(stderr, "no variant %s or %s on this build\n", va.c_str(), vb.c_str());
        return 2;
    }
    std::mt19937 rng(7);
    std::normal_distribution<float> nd;
    if (tokens > 0) return prefill(fa, va, tokens, tile, hd, kvh, group, layers, reps, rng);
    const int64_t row = kvh * hd;  // one position's keys of a layer (head-major here: a head's rows contiguous)
    std::vector<float> q(group * hd), out(group * hd), scores(group * ctx);
    for (float& e : q) e = nd(rng);
    std::printf("ctx %lld, %lld layers x %lld kv heads x %lld query heads, head_dim %lld; %s vs %s, median of %d\n",
                static_cast<long long>(ctx), static_cast<long long>(layers), static_cast<long long>(kvh),
                static_cast<long long>(group), static_cast<long long>(hd), va.c_str(), vb.c_str(), reps);
    for (DType t : {DType::F32, DType::F16, DType::Q8_0}) {
        const size_t per_layer = kv_bytes(t, ctx * row);
        std::vector<uint8_t> kc(layers * per_layer), vc(layers * per_layer);
        std::vector<float> f(ctx * row);
        for (int64_t l = 0; l < layers; ++l) {
            for (float& e : f) e = nd(rng);
            type_traits(t)->from_float(f.data(), kc.data() + l * per_layer, ctx * row);
            for (float& e : f) e = nd(rng);
            type_traits(t)->from_float(f.data(), vc.data() + l * per_layer, ctx * row);
        }
        auto token = [&](AttentionFn fn) {
            for (int64_t l = 0; l < layers; ++l)
                for (int64_t h = 0; h < kvh; ++h) {
                    const size_t off = l * per_layer + kv_bytes(t, h * ctx * hd);
                    AttentionArgs a{q.data(), kc.data() + off, vc.data() + off, hd, hd, ctx, hd, 0.125f, out.data(),
                                    scores.data(), t, group, hd};
                    fn(a);
                }
        };
        std::vector<double> ta, tb;
        for (int r = 0; r < reps; ++r)
            for (int k = 0; k < 2; ++k) {
                const bool a_first = (r + k) % 2 == 0;
                const double t0 = cpu_seconds();
                token(a_first ? fa : fb);
                (a_first ? ta : tb).push_back(cpu_seconds() - t0);
            }
        const double ma = median(ta), mb = median(tb);
        const double bytes = 2.0 * layers * per_layer;
        std::printf("%-5s cache %7.1f MB: %s %8.3f ms (%5.1f GB/s)  %s %8.3f ms (%5.1f GB/s)  %s/%s x%.2f\n",
                    type_traits(t)->name, bytes / 1e6, va.c_str(), ma * 1e3, bytes / ma / 1e9, vb.c_str(), mb * 1e3,
                    bytes / mb / 1e9, va.c_str(), vb.c_str(), ma / mb);
    }
    return 0;
}
