// AVX2 + FMA + F16C matrix product with float activations (the same arithmetic as the reference,
// summed in a different order). Each weight row is expanded to floats in L1-resident scratch with
// SIMD, then dotted with every token. Compiled for the baseline ISA; only these functions carry
// the AVX2 target, and the operator table calls them only on CPUs that report AVX2 and FMA.
#if defined(__x86_64__)
#include <immintrin.h>

#include "../ops.h"
#include "kquant_avx2.h"
#include "packed_x8.h"

#define EV_AVX2 __attribute__((target("avx2,fma,f16c")))

#include "../elementwise/exp_avx2.h"

namespace evk {

namespace {

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

}  // namespace

// A row of any format to float, vectorized where the format has a fast path.
EV_AVX2 void dequantize_row_avx2(DType t, const void* src, float* dst, int64_t n) {
    switch (t) {
    case DType::F16: {
        const uint8_t* s = static_cast<const uint8_t*>(src);  // 2 bytes per element, any alignment
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * i))));
        for (; i < n; ++i) dst[i] = half_to_float(load_u16(s + 2 * i));
        return;
    }
    case DType::BF16: {
        const uint8_t* s = static_cast<const uint8_t*>(src);  // 2 bytes per element, any alignment
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 2 * i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        for (; i < n; ++i) dst[i] = bf16_to_fp32(load_u16(s + 2 * i));
        return;
    }
    case DType::Q4_0: {
        const uint8_t* blk = static_cast<const uint8_t*>(src);
        for (int64_t ib = 0; ib < n / kQK; ++ib, blk += sizeof(BlockQ4_0)) {
            const __m256 d = _mm256_set1_ps(half_to_float(load_u16(blk + offsetof(BlockQ4_0, d))));
            nibbles_to_floats(blk + offsetof(BlockQ4_0, qs), d, _mm256_mul_ps(d, _mm256_set1_ps(-8.f)), dst + ib * kQK);
        }
        return;
    }
    case DType::Q4_1: {
        const uint8_t* blk = static_cast<const uint8_t*>(src);
        for (int64_t ib = 0; ib < n / kQK; ++ib, blk += sizeof(BlockQ4_1))
            nibbles_to_floats(blk + offsetof(BlockQ4_1, qs), _mm256_set1_ps(half_to_float(load_u16(blk + offsetof(BlockQ4_1, d)))),
                              _mm256_set1_ps(half_to_float(load_u16(blk + offsetof(BlockQ4_1, m)))), dst + ib * kQK);
        return;
    }
    case DType::Q8_0: {
        const uint8_t* blk = static_cast<const uint8_t*>(src);
        for (int64_t ib = 0; ib < n / kQK; ++ib, blk += sizeof(BlockQ8_0)) {
            const __m256 d = _mm256_set1_ps(half_to_float(load_u16(blk + offsetof(BlockQ8_0, d))));
            const uint8_t* qs = blk + offsetof(BlockQ8_0, qs);
            for (int p = 0; p < 4; ++p) {
                const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * p));
                _mm256_storeu_ps(dst + ib * kQK + 8 * p, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
            }
        }
        return;
    }
    case DType::Q5_0: return kq::dequant_row<kq::Q5_0F>(static_cast<const uint8_t*>(src), dst, n);
    case DType::Q5_1: return kq::dequant_row<kq::Q5_1F>(static_cast<const uint8_t*>(src), dst, n);
    case DType::IQ4_NL: return kq::dequant_row<kq::IQ4_NLF>(static_cast<const uint8_t*>(src), dst, n);
    case DType::Q2_K: return kq::dequant_row<kq::Q2_KF>(static_cast<const uint8_t*>(src), dst, n);
    case DType::Q3_K: return kq::dequant_row<kq::Q3_KF>(static_cast<const uint8_t*>(src), dst, n);
    case DType::Q4_K: return kq::dequant_row<kq::Q4_KF>(static_cast<const uint8_t*>(src), dst, n);
    case DType::Q5_K: return kq::dequant_row<kq::Q5_KF>(static_cast<const uint8_t*>(src), dst, n);
    case DType::Q6_K: return kq::dequant_row<kq::Q6_KF>(static_cast<const uint8_t*>(src), dst, n);
    default:
        dequantize_row(t, src, dst, n);
        return;
    }
}

// Rows [r, r + n) of a's weight (the file's rows or the decode kernels' x8 copy, unpacked to the
// file's bytes first in dst + n * a.k) as n float rows of a.k in dst: the GEMMs' panels of the
// formats they do not expand themselves (avx2_gemm: all; avx512_gemm: matmul_avx512.cpp).
EV_AVX2 void expand_rows_avx2(const MatmulArgs& a, int64_t r, int64_t n, float* dst) {
    void* unpacked = dst + n * a.k;
    for (int64_t i = 0; i < n; ++i) {
        const void* row = static_cast<const uint8_t*>(a.w) + static_cast<size_t>(r + i) * a.w_row_bytes;
        if (a.w_layout == WLayout::kX8) {
            x8_unpack_row(a.wtype, a.w, a.k, r + i, unpacked);
            row = unpacked;
        }
        dequantize_row_avx2(a.wtype, row, dst + i * a.k, a.k);
    }
}

EV_AVX2 void matmul_avx2_f32act(const MatmulArgs& a) {
    const char* base = static_cast<const char*>(a.w);
    for (int64_t r = a.row0; r < a.row1; ++r) {
        const void* row = base + static_cast<size_t>(r) * a.w_row_bytes;
        const float* wr;
        if (a.wtype == DType::F32 && reinterpret_cast<uintptr_t>(row) % alignof(float) == 0) {
            wr = static_cast<const float*>(row);  // in place; a misaligned row is copied to scratch below
        } else {
            dequantize_row_avx2(a.wtype, row, a.scratch, a.k);
            wr = a.scratch;
        }
        for (int64_t t = 0; t < a.m; ++t) a.y[t * a.y_stride + r] = dot_avx2(wr, a.x + t * a.x_stride, a.k);
    }
}

// Register-tiled product for many tokens (prefill, vision): 4 weight rows are expanded to float
// in scratch, then each group of 3 tokens is dotted with all 4 rows at once: 12 accumulators,
// 4 + 3 loads per 12 FMAs, so the loop is bound by the FMA units, not by loads.
// Per weight panel the 64-token activation block (<= 64 x 3072 floats) is re-read from L2.
EV_AVX2 static void tile_4x3(const float* w, int64_t k, const float* x, int64_t x_stride, float* y, int64_t y_stride,
                             int64_t r) {
    const float* w0 = w;
    const float* w1 = w + k;
    const float* w2 = w + 2 * k;
    const float* w3 = w + 3 * k;
    const float* x0 = x;
    const float* x1 = x + x_stride;
    const float* x2 = x + 2 * x_stride;
    __m256 acc[4][3];
    for (auto& row : acc)
        for (auto& v : row) v = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
        const __m256 a0 = _mm256_loadu_ps(w0 + i), a1 = _mm256_loadu_ps(w1 + i);
        const __m256 a2 = _mm256_loadu_ps(w2 + i), a3 = _mm256_loadu_ps(w3 + i);
        __m256 b = _mm256_loadu_ps(x0 + i);
        acc[0][0] = _mm256_fmadd_ps(a0, b, acc[0][0]);
        acc[1][0] = _mm256_fmadd_ps(a1, b, acc[1][0]);
        acc[2][0] = _mm256_fmadd_ps(a2, b, acc[2][0]);
        acc[3][0] = _mm256_fmadd_ps(a3, b, acc[3][0]);
        b = _mm256_loadu_ps(x1 + i);
        acc[0][1] = _mm256_fmadd_ps(a0, b, acc[0][1]);
        acc[1][1] = _mm256_fmadd_ps(a1, b, acc[1][1]);
        acc[2][1] = _mm256_fmadd_ps(a2, b, acc[2][1]);
        acc[3][1] = _mm256_fmadd_ps(a3, b, acc[3][1]);
        b = _mm256_loadu_ps(x2 + i);
        acc[0][2] = _mm256_fmadd_ps(a0, b, acc[0][2]);
        acc[1][2] = _mm256_fmadd_ps(a1, b, acc[1][2]);
        acc[2][2] = _mm256_fmadd_ps(a2, b, acc[2][2]);
        acc[3][2] = _mm256_fmadd_ps(a3, b, acc[3][2]);
    }
    const float* ws[4] = {w0, w1, w2, w3};
    const float* xs[3] = {x0, x1, x2};
    for (int rr = 0; rr < 4; ++rr)
        for (int tt = 0; tt < 3; ++tt) {
            float s = hsum(acc[rr][tt]);
            for (int64_t j = i; j < k; ++j) s += ws[rr][j] * xs[tt][j];
            y[tt * y_stride + r + rr] = s;
        }
}

// The same summation order as one accumulator of tile_4x3, so a token's result does not depend
// on which group of 3 it fell in: prefilling a prompt in pieces (a restored prefix, then the
// rest) gives bit-identical logits to prefilling it whole.
EV_AVX2 static float dot_like_tile(const float* w, const float* x, int64_t k) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc);
    float s = hsum(acc);
    for (; i < k; ++i) s += w[i] * x[i];
    return s;
}

EV_AVX2 void matmul_avx2_gemm(const MatmulArgs& a) {
    const char* base = static_cast<const char*>(a.w);
    for (int64_t r = a.row0; r < a.row1; r += 4) {
        const int64_t nr = a.row1 - r < 4 ? a.row1 - r : 4;
        const float* panel;
        // In place only when the rows are float-aligned (general.alignment may be 1); else copied.
        if (a.wtype == DType::F32 && a.w_row_bytes == static_cast<size_t>(a.k) * 4 &&
            reinterpret_cast<uintptr_t>(base) % alignof(float) == 0) {
            panel = reinterpret_cast<const float*>(base + static_cast<size_t>(r) * a.w_row_bytes);
        } else {
            expand_rows_avx2(a, r, nr, a.scratch);
            panel = a.scratch;
        }
        int64_t t = 0;
        if (nr == 4)
            for (; t + 3 <= a.m; t += 3)
                tile_4x3(panel, a.k, a.x + t * a.x_stride, a.x_stride, a.y + t * a.y_stride, a.y_stride, r);
        for (; t < a.m; ++t)  // leftover tokens, or a panel of fewer than 4 rows
            for (int64_t i = 0; i < nr; ++i)
                a.y[t * a.y_stride + r + i] = dot_like_tile(panel + i * a.k, a.x + t * a.x_stride, a.k);
    }
}

}  // namespace evk
#endif
