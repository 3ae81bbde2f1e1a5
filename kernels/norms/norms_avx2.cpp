// AVX2 + FMA norms: rmsnorm and layernorm, 8 floats at a time, tails (n mod 8) through masked
// loads and stores with the same arithmetic. Compiled for the baseline ISA; only these functions
// carry the AVX2 target.
//
// Row sums (rmsnorm's sum of squares, layernorm's sum and sum of squared deviations) are added in
// float lanes in one fixed order that depends on n only (never on the thread count, which splits
// rows, not a row): element i goes to partial sum i mod 32 (four 8-lane accumulators; block
// b = i / 8 to accumulator b mod 4), each partial adds its elements in increasing i (squares by
// FMA: the product is not rounded on its own), then (acc0 + acc1) + (acc2 + acc3) and hsum's
// tree over the 8 lanes. The reference adds in double; a float partial of m = ceil(n / 32) terms
// is within (m - 1 + 5) float roundings of the true sum of nonnegative terms, so rmsnorm's scale
// differs from the reference's by about (n / 64 + 8) units of 2^-24 at worst (docs/kernels/
// elementwise-norms.md; the tests hold the variants to that).
#if defined(__x86_64__)
#include <cmath>

#include "../elementwise/exp_avx2.h"  // EV_AVX2, tail_mask, hsum

#include "../ops.h"

namespace evk {

namespace {

enum class RowSum { kPlain, kSquares, kSquaredDeviations };

// One block of 8 into an accumulator: v, v^2 or (v - mean)^2 (v already the deviation for the last).
template <RowSum kWhat>
EV_AVX2 inline __m256 accumulate(__m256 acc, __m256 v) {
    return kWhat == RowSum::kPlain ? _mm256_add_ps(acc, v) : _mm256_fmadd_ps(v, v, acc);
}

// The sum over x[0, n) of x, x^2 or (x - mean)^2 in the order described above.
template <RowSum kWhat>
EV_AVX2 inline float row_sum(const float* x, int64_t n, float mean) {
    const __m256 vm = _mm256_set1_ps(mean);
    const bool dev = kWhat == RowSum::kSquaredDeviations;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; ++j) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * j);
            acc[j] = accumulate<kWhat>(acc[j], dev ? _mm256_sub_ps(v, vm) : v);
        }
    int j = 0;  // the blocks after the last whole 32 continue the rotation: at most 3, then the tail
    for (; i + 8 <= n; i += 8, ++j) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc[j] = accumulate<kWhat>(acc[j], dev ? _mm256_sub_ps(v, vm) : v);
    }
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        const __m256 v = _mm256_maskload_ps(x + i, m);  // lanes past n load 0
        // For the deviations the lanes past n are masked after the subtraction (0 - mean must not count).
        acc[j] = accumulate<kWhat>(acc[j], dev ? _mm256_and_ps(_mm256_sub_ps(v, vm), _mm256_castsi256_ps(m)) : v);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

}  // namespace

// y = x / sqrt(mean(x^2) + eps) * w: the scale as the reference forms it (in double, from the float
// sum), then x * scale * w rounded as the reference rounds it.
EV_AVX2 void rmsnorm_avx2(const float* x, const float* w, float* y, int64_t n, float eps) {
    if (n <= 0) return;
    const double ss = row_sum<RowSum::kSquares>(x, n, 0.f);
    const __m256 s = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps)));
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), s), _mm256_loadu_ps(w + i)));
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(y + i, m, _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(x + i, m), s), _mm256_maskload_ps(w + i, m)));
    }
}

// y = (x - mean) / sqrt(var + eps) * w + b, two passes for the statistics (the mean, then the
// squared deviations from it: no cancellation for rows far from zero mean), one for the output.
EV_AVX2 void layernorm_avx2(const float* x, const float* w, const float* b, float* y, int64_t n, float eps) {
    if (n <= 0) return;
    const float mean = static_cast<float>(static_cast<double>(row_sum<RowSum::kPlain>(x, n, 0.f)) / static_cast<double>(n));
    const double var = static_cast<double>(row_sum<RowSum::kSquaredDeviations>(x, n, mean)) / static_cast<double>(n);
    const __m256 vm = _mm256_set1_ps(mean), inv = _mm256_set1_ps(static_cast<float>(1.0 / std::sqrt(var + eps)));
    int64_t i = 0;
    if (b) {
        for (; i + 8 <= n; i += 8) {
            const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), inv);
            _mm256_storeu_ps(y + i, _mm256_fmadd_ps(d, _mm256_loadu_ps(w + i), _mm256_loadu_ps(b + i)));
        }
        if (i < n) {
            const __m256i m = tail_mask(n - i);
            const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(x + i, m), vm), inv);
            _mm256_maskstore_ps(y + i, m, _mm256_fmadd_ps(d, _mm256_maskload_ps(w + i, m), _mm256_maskload_ps(b + i, m)));
        }
    } else {
        for (; i + 8 <= n; i += 8) {
            const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), inv);
            _mm256_storeu_ps(y + i, _mm256_mul_ps(d, _mm256_loadu_ps(w + i)));
        }
        if (i < n) {
            const __m256i m = tail_mask(n - i);
            const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_maskload_ps(x + i, m), vm), inv);
            _mm256_maskstore_ps(y + i, m, _mm256_mul_ps(d, _mm256_maskload_ps(w + i, m)));
        }
    }
}

}  // namespace evk
#endif
