// Microbenchmark of the exp-based element-wise variants against the reference, on the vision
// tower's shapes: softmax over 256 rows of 1024 scores (one query block of one head, 1 MiB, as
// the vision tower's self-attention runs it), gelu_tanh over 1024 x 3072 (the MLP activation, 12 MiB),
// silu_mul over 512 x 1536 (a text prefill's FFN gate). Thread CPU time, best of --reps runs, so
// time the thread was descheduled on a shared machine does not count. Build (with the extension's
// code-generation flags, setup.py) and run, from the repository root:
//   g++ -std=c++17 -O3 -fno-math-errno -Inative -Ikernels -DEVK_DEFAULT_OPTABLE='""' kernels/tests/elementwise_bench.cpp
//       $(python -c 'import buildinfo; print(" ".join(buildinfo.sources(kernels_only=True)))') -o /tmp/ewbench
//   /tmp/ewbench --reps 7
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "../ops.h"
#include "bench_clock.h"

using namespace evk;

namespace {

// Best seconds of reps runs of fn over a fresh copy of the inputs (the copy is not timed).
template <class Fn>
double best_of(int reps, const std::vector<float>& input, std::vector<float>& work, Fn fn) {
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
        work = input;
        const double t0 = cpu_seconds();
        fn(work.data());
        const double dt = cpu_seconds() - t0;
        best = dt < best ? dt : best;
    }
    return best;
}

void report(const char* what, int64_t elems, double ref_s, double var_s, const char* variant) {
    std::printf("%-34s ref %8.3f ms (%5.2f ns/elem)   %s %7.3f ms (%5.2f ns/elem)   x%.1f\n", what, ref_s * 1e3,
                ref_s * 1e9 / static_cast<double>(elems), variant, var_s * 1e3, var_s * 1e9 / static_cast<double>(elems),
                ref_s / var_s);
}

}  // namespace

int main(int argc, char** argv) {
    const int reps = argc > 2 && std::string(argv[1]) == "--reps" ? std::atoi(argv[2]) : 7;
    const char* variant = "avx2";
    const SoftmaxFn sm = softmax_variant(variant);
    const GeluFn ge = gelu_tanh_variant(variant);
    const SiluMulFn si = silu_mul_variant(variant);
    if (!sm || !ge || !si) {
        std::printf("variant %s does not run on this CPU\n", variant);
        return 1;
    }
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<float> work;

    {
        const int64_t rows = 256, n = 1024;
        std::vector<float> s(static_cast<size_t>(rows * n));
        for (float& e : s) e = nd(rng) * 4.f;
        auto run = [&](SoftmaxFn f) {
            return best_of(reps, s, work, [&](float* x) {
                for (int64_t r = 0; r < rows; ++r) f(x + r * n, n, 0.125f);
            });
        };
        report("softmax 256 x 1024 (1 MiB)", rows * n, run(softmax_ref), run(sm), variant);
    }
    {
        const int64_t n = 1024 * 3072;
        std::vector<float> a(static_cast<size_t>(n));
        for (float& e : a) e = nd(rng) * 2.f;
        auto run = [&](GeluFn f) { return best_of(reps, a, work, [&](float* x) { f(x, n); }); };
        report("gelu_tanh 1024 x 3072 (12 MiB)", n, run(gelu_tanh_ref), run(ge), variant);
    }
    {
        const int64_t n = 512 * 1536;
        std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
        for (float& e : a) e = nd(rng) * 2.f;
        for (float& e : b) e = nd(rng);
        auto run = [&](SiluMulFn f) { return best_of(reps, a, work, [&](float* x) { f(x, b.data(), n); }); };
        report("silu_mul 512 x 1536 (3 + 3 MiB)", n, run(silu_mul_ref), run(si), variant);
    }
    return 0;
}
