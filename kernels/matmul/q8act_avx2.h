// int8 block quantization of activations for the AVX2 decode kernels (avx2_q8act and the packed
// x8 variants): blocks of 32 with scale d = max|x| / 127, round to nearest, plus sum(q).
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

#include "../formats/formats.h"

#define EV_AVX2 __attribute__((target("avx2,fma,f16c")))

#include "../elementwise/exp_avx2.h"  // hsum, hmax

namespace evk {
namespace q8act {

struct BlockQ8A {  // activation block
    float d, s;       // scale, and d * sum(qs) (the offset term of Q4_1)
    int32_t sum;      // sum(qs)
    int8_t qs[kQK];
};

EV_AVX2 inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

// Round-to-nearest int8 quantization of k floats (k a multiple of 32).
EV_AVX2 inline void quantize_act(const float* x, int64_t k, BlockQ8A* out) {
    const __m256 sign_mask = _mm256_set1_ps(-0.f);
    for (int64_t b = 0; b < k / kQK; ++b, x += kQK) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) {
            v[j] = _mm256_loadu_ps(x + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[j]));
        }
        const float d = hmax(amax) / 127.f;
        const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
        __m256i q[4];
        for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // Pack 32-bit -> 16 -> 8 bits; the packs interleave 128-bit lanes, the permute undoes it.
        const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
        const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].qs), p);
        const __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), p);
        const int sum = hsum_i32(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
        out[b].d = d;
        out[b].s = d * static_cast<float>(sum);
        out[b].sum = sum;
    }
}

}  // namespace q8act
}  // namespace evk
#endif
