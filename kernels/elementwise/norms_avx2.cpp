// AVX2 + FMA norms, rotary embedding and the residual add: rmsnorm, layernorm, rope (both pair
// layouts) and add, 8 floats at a time, tails (n mod 8) through masked loads and stores with the
// same arithmetic. Compiled for the baseline ISA; only these functions carry the AVX2 target.
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

#include "exp_avx2.h"  // EV_AVX2, tail_mask, hsum

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

// Eight neox pairs (p0[k], p1[k]) rotated by (c[k], s[k]); kMasked: only the first lanes of m.
template <bool kMasked>
EV_AVX2 inline void rotate_halves(float* p0, float* p1, __m256 c, __m256 s, __m256i m) {
    const __m256 a = kMasked ? _mm256_maskload_ps(p0, m) : _mm256_loadu_ps(p0);
    const __m256 b = kMasked ? _mm256_maskload_ps(p1, m) : _mm256_loadu_ps(p1);
    const __m256 a2 = _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)), b2 = _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s));
    if (kMasked) {
        _mm256_maskstore_ps(p0, m, a2);
        _mm256_maskstore_ps(p1, m, b2);
    } else {
        _mm256_storeu_ps(p0, a2);
        _mm256_storeu_ps(p1, b2);
    }
}

// Four interleaved pairs (a b a b ..) rotated by cs's (c s c s ..): with C = (c c), S = (s s) per
// pair and the pairs swapped, fmaddsub gives a c - b s in even lanes and b c + a s in odd ones.
EV_AVX2 inline __m256 rotate_pairs(__m256 xv, __m256 v) {
    const __m256 sw = _mm256_permute_ps(xv, 0xB1);  // b0 a0 b1 a1 ..
    return _mm256_fmaddsub_ps(xv, _mm256_moveldup_ps(v), _mm256_mul_ps(sw, _mm256_movehdup_ps(v)));
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

// Rotation of a pair (a, b) by (c, s), written with explicit FMAs so that no compiler contracts it
// differently: a' = fma(a, c, -(b s)), b' = fma(b, c, a s) (one rounding fewer than the reference's
// a c - b s, a s + b c; the NEON variant uses the same form, so the two give the same bits).
EV_AVX2 void rope_avx2(float* x, int64_t n_heads, int64_t head_dim, int64_t rope_dims, const float* cs, bool neox) {
    const int64_t half = rope_dims / 2;
    if (neox) {
        // Pair i is (i, i + half): eight pairs are two plain vectors; cos and sin de-interleaved
        // once per eight pairs and used for every head.
        for (int64_t i = 0; i < half; i += 8) {
            const int64_t rem = half - i < 8 ? half - i : 8;
            const __m256i m = tail_mask(rem);
            const __m256 v0 = _mm256_maskload_ps(cs + 2 * i, tail_mask(2 * rem));         // c0 s0 .. c3 s3
            const __m256 v1 = _mm256_maskload_ps(cs + 2 * i + 8, tail_mask(2 * rem - 8));  // c4 s4 .. c7 s7
            // The shuffles give c0 c1 c4 c5 | c2 c3 c6 c7 (s alike); the 64-bit permute orders them.
            const __m256 c = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(v0, v1, 0x88)), 0xD8));
            const __m256 s = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(v0, v1, 0xDD)), 0xD8));
            for (int64_t h = 0; h < n_heads; ++h) {
                float* p0 = x + h * head_dim + i;
                if (rem == 8)
                    rotate_halves<false>(p0, p0 + half, c, s, m);
                else
                    rotate_halves<true>(p0, p0 + half, c, s, m);
            }
        }
        return;
    }
    // Pair i is (2i, 2i + 1), laid out as cs is.
    const int64_t len = 2 * half;
    for (int64_t h = 0; h < n_heads; ++h) {
        float* xh = x + h * head_dim;
        int64_t i = 0;
        for (; i + 8 <= len; i += 8) _mm256_storeu_ps(xh + i, rotate_pairs(_mm256_loadu_ps(xh + i), _mm256_loadu_ps(cs + i)));
        if (i < len) {
            const __m256i m = tail_mask(len - i);
            _mm256_maskstore_ps(xh + i, m, rotate_pairs(_mm256_maskload_ps(xh + i, m), _mm256_maskload_ps(cs + i, m)));
        }
    }
}

// a += b: the reference's one rounding per element, 32 floats a step.
EV_AVX2 void add_avx2(float* a, const float* b, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 32; j += 8)
            _mm256_storeu_ps(a + i + j, _mm256_add_ps(_mm256_loadu_ps(a + i + j), _mm256_loadu_ps(b + i + j)));
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(a + i, m, _mm256_add_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m)));
    }
}

}  // namespace evk
#endif
