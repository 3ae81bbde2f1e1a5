// AVX2 + FMA rotary embedding (both pair layouts), 8 floats at a time, tails through masked loads
// and stores with the same arithmetic. Compiled for the baseline ISA; only these functions carry
// the AVX2 target.
#if defined(__x86_64__)
#include "../elementwise/exp_avx2.h"  // EV_AVX2, tail_mask

#include "../ops.h"

namespace evk {

namespace {

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

}  // namespace evk
#endif
