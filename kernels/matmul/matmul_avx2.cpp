// AVX2 + FMA + F16C matrix product with float activations (the same arithmetic as the reference,
// summed in a different order). Each weight row is expanded to floats in L1-resident scratch with
// SIMD, then dotted with every token. Compiled for the baseline ISA; only these functions carry
// the AVX2 target, and the operator table calls them only on CPUs that report AVX2 and FMA.
#if defined(__x86_64__)
#include <immintrin.h>

#include "../ops.h"

#define EV_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace evk {

namespace {

EV_AVX2 inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

EV_AVX2 float dot_avx2(const float* a, const float* b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

EV_AVX2 inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// 16 bytes of packed nibbles -> 32 floats: low nibbles are elements 0..15, high ones 16..31.
EV_AVX2 inline void nibbles_to_floats(const uint8_t* qs, __m256 d, __m256 bias, float* out) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int p = 0; p < 4; ++p) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]));
        _mm256_storeu_ps(out + 8 * p, _mm256_fmadd_ps(q, d, bias));
    }
}

EV_AVX2 void dequantize_row_avx2(DType t, const void* src, float* dst, int64_t n) {
    switch (t) {
    case DType::F16: {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
        for (; i < n; ++i) dst[i] = half_to_float(s[i]);
        return;
    }
    case DType::BF16: {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        for (; i < n; ++i) dst[i] = bf16_to_fp32(s[i]);
        return;
    }
    case DType::Q4_0: {
        const BlockQ4_0* b = static_cast<const BlockQ4_0*>(src);
        for (int64_t ib = 0; ib < n / kQK; ++ib) {
            const __m256 d = _mm256_set1_ps(half_to_float(b[ib].d));
            nibbles_to_floats(b[ib].qs, d, _mm256_mul_ps(d, _mm256_set1_ps(-8.f)), dst + ib * kQK);
        }
        return;
    }
    case DType::Q4_1: {
        const BlockQ4_1* b = static_cast<const BlockQ4_1*>(src);
        for (int64_t ib = 0; ib < n / kQK; ++ib)
            nibbles_to_floats(b[ib].qs, _mm256_set1_ps(half_to_float(b[ib].d)), _mm256_set1_ps(half_to_float(b[ib].m)),
                              dst + ib * kQK);
        return;
    }
    case DType::Q8_0: {
        const BlockQ8_0* b = static_cast<const BlockQ8_0*>(src);
        for (int64_t ib = 0; ib < n / kQK; ++ib) {
            const __m256 d = _mm256_set1_ps(half_to_float(b[ib].d));
            for (int p = 0; p < 4; ++p) {
                const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b[ib].qs + 8 * p));
                _mm256_storeu_ps(dst + ib * kQK + 8 * p, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
            }
        }
        return;
    }
    default:
        dequantize_row(t, src, dst, n);
        return;
    }
}

}  // namespace

EV_AVX2 void matmul_avx2(const MatmulArgs& a) {
    const char* base = static_cast<const char*>(a.w);
    for (int64_t r = a.row0; r < a.row1; ++r) {
        const void* row = base + static_cast<size_t>(r) * a.w_row_bytes;
        const float* wr;
        if (a.wtype == DType::F32) {
            wr = static_cast<const float*>(row);
        } else {
            dequantize_row_avx2(a.wtype, row, a.scratch, a.k);
            wr = a.scratch;
        }
        for (int64_t t = 0; t < a.m; ++t) a.y[t * a.y_stride + r] = dot_avx2(wr, a.x + t * a.x_stride, a.k);
    }
}

EV_AVX2 void attention_avx2(const AttentionArgs& a) {
    float mx = -3.4e38f;
    for (int64_t j = 0; j < a.n_kv; ++j) {
        const float s = a.scale * dot_avx2(a.q, a.k + j * a.k_stride, a.head_dim);
        a.scores[j] = s;
        mx = s > mx ? s : mx;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < a.n_kv; ++j) {
        a.scores[j] = __builtin_expf(a.scores[j] - mx);
        sum += a.scores[j];
    }
    const float inv = 1.f / sum;
    int64_t d = 0;
    for (; d + 8 <= a.head_dim; d += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < a.n_kv; ++j)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(a.scores[j] * inv), _mm256_loadu_ps(a.v + j * a.v_stride + d), acc);
        _mm256_storeu_ps(a.out + d, acc);
    }
    for (; d < a.head_dim; ++d) {
        float acc = 0.f;
        for (int64_t j = 0; j < a.n_kv; ++j) acc += a.scores[j] * inv * a.v[j * a.v_stride + d];
        a.out[d] = acc;
    }
}

}  // namespace evk
#endif
