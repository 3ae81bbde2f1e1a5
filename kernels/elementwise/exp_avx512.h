// Vector exp and sigmoid for the AVX-512 kernels, 16 floats at a time: exp_avx2.h's method with
// exp_poly.h's constants (the same clamp to [kExpMin, kExpMax], 0 below kExpMin). Only functions that carry the AVX-512 target include this;
// the operator table calls them only on CPUs that report avx512f, fma and f16c.
#pragma once
#if defined(__x86_64__)
#include "../matmul/avx512_intrin.h"  // <immintrin.h> without GCC 12's false warnings; tail_mask16

#include <cstdint>

#include "exp_poly.h"

#ifndef EV_AVX512
#define EV_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#endif

namespace evk {

EV_AVX512 inline __m512 exp16(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
    __m512 q = _mm512_set1_ps(kExpQ[0]);
    for (int i = 1; i < 5; ++i) q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kExpQ[i]));
    const __m512 er = _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    const __m512i two_n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), er, _mm512_castsi512_ps(two_n));
}

// 1 / (1 + exp(-z)), from exp(-|z|) only, as sigmoid8.
EV_AVX512 inline __m512 sigmoid16(__m512 z) {
    const __m512 t = exp16(_mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(z), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));  // exp(-|z|)
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ), one, t);
    return _mm512_div_ps(num, _mm512_add_ps(one, t));
}

}  // namespace evk
#endif
