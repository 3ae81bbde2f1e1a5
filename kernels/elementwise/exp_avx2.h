// Vector exp for the AVX2 + FMA kernels (element-wise operators and attention), 8 floats at a time.
// Only functions that carry the AVX2 target include this; the operator table calls them only on
// CPUs that report AVX2 and FMA.
//
// exp(x) = 2^n e^r with n = round(x / ln2) and r = x - n ln2 (|r| <= ln2 / 2, ln2 in two parts so
// r is exact to ~1e-12); e^r = 1 + r + r^2 q(r), q of degree 4 fitted to the relative error on
// |r| <= ln2 / 2 (3e-9 in exact arithmetic, ~1.2 ulp evaluated in float32); 2^n is written into
// the exponent bits. Inputs are clamped to [kExpMin, kExpMax], so every input, inf included,
// gives a finite result: n stays in [-126, 127], a normal exponent. Below kExpMin (where the true
// value is under 1.3e-38) the result is 0 instead of a subnormal.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#include "exp_poly.h"

#ifndef EV_AVX2
#define EV_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace evk {


EV_AVX2 inline __m256 exp8(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    __m256 q = _mm256_set1_ps(kExpQ[0]);
    for (int i = 1; i < 5; ++i) q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kExpQ[i]));
    const __m256 er = _mm256_add_ps(_mm256_fmadd_ps(q, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(er, _mm256_castsi256_ps(two_n)));
}

// 1 / (1 + exp(-z)), from exp(-|z|) only (no overflow, no cancellation): t / (1 + t) for z < 0.
EV_AVX2 inline __m256 sigmoid8(__m256 z) {
    const __m256 t = exp8(_mm256_or_ps(z, _mm256_set1_ps(-0.f)));  // exp(-|z|)
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 num = _mm256_blendv_ps(one, t, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ));
    return _mm256_div_ps(num, _mm256_add_ps(one, t));
}

// Lanes [0, rem) set, for masked loads and stores of a tail of rem < 8 elements.
EV_AVX2 inline __m256i tail_mask(int64_t rem) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rem)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Horizontal sum and maximum of 8 floats (the AVX2 kernels' one copy of each).
EV_AVX2 inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

EV_AVX2 inline float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

EV_AVX2 inline double hsum_pd(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}

// x[i] = exp(scale * (x[i] - mx)) for i in [0, n) (the argument rounded as the scalar reference
// rounds it: a subtraction, then a product); returns the sum of the results, added in double.
EV_AVX2 inline double exp_sub_scaled_sum(float* x, int64_t n, float mx, float scale) {
    const __m256 vmx = _mm256_set1_ps(mx), vs = _mm256_set1_ps(scale);
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd(), s2 = _mm256_setzero_pd(), s3 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {  // two blocks of 8 per step: four independent sums
        const __m256 e0 = exp8(_mm256_mul_ps(vs, _mm256_sub_ps(_mm256_loadu_ps(x + i), vmx)));
        const __m256 e1 = exp8(_mm256_mul_ps(vs, _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vmx)));
        _mm256_storeu_ps(x + i, e0);
        _mm256_storeu_ps(x + i + 8, e1);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e0)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e0, 1)));
        s2 = _mm256_add_pd(s2, _mm256_cvtps_pd(_mm256_castps256_ps128(e1)));
        s3 = _mm256_add_pd(s3, _mm256_cvtps_pd(_mm256_extractf128_ps(e1, 1)));
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_mul_ps(vs, _mm256_sub_ps(_mm256_loadu_ps(x + i), vmx)));
        _mm256_storeu_ps(x + i, e);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(m),
                                       exp8(_mm256_mul_ps(vs, _mm256_sub_ps(_mm256_maskload_ps(x + i, m), vmx))));
        _mm256_maskstore_ps(x + i, m, e);
        s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    return hsum_pd(_mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)));
}

}  // namespace evk
#endif
