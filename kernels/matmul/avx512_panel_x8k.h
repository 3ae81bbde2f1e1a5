// The prefill panel fill for Q4_K and Q6_K weights in the x8 copy (packed_x8.h), straight from it:
// 16 rows (two groups of 8) x one sub-block of 32 elements at a time into the k-major float panel
// of avx512_panel.h. Before, a panel's rows went x8 -> the file's row (x8_unpack_row) -> float row
// (dequant_row) -> transposed panel: three passes over every weight per call. Notes:
// docs/kernels/prefill-panel-x8k.md.
//
// Each 32-byte vector of the x8 copy holds 4 consecutive elements of each of 8 rows (bytes 4r..4r+3:
// row r). Two groups' vectors side by side are 16 rows x 4 elements; a byte shuffle within each
// 128-bit lane and a dword permute make them 4 elements x 16 rows, one 16-byte lane per element:
// each widens to one panel row of 16 floats. A value is computed with the same operations, in the
// same order, as dequant_row (kquant_avx2.h) computes it from the file's row: x = fma(q, d * sc,
// -dmin * mn) for Q4_K, x = q * (d * sc) for Q6_K, so the panel's floats are the rows' bit for bit.
// Lanes past the panel's rows are 0 (their scales are masked to 0).
//
// Included by avx512_panel.h only (it carries the AVX-512 target; see there).
#pragma once
#if defined(__x86_64__)
#include "avx512_intrin.h"

#include <cstddef>
#include <cstring>

#include "../ops.h"
#include "packed_x8.h"

#define EV_AVX512_X8K __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

namespace evk {
namespace avx512 {

// Byte offsets of the fields in one x8 group block (packed_x8.h).
constexpr size_t kX8Q4K_Dmin = 16, kX8Q4K_Scales = 32, kX8Q4K_Qs = 128;
constexpr size_t kX8Q6K_Scales = 16, kX8Q6K_Ql = 144, kX8Q6K_Qh = 1168;

// The x8 fill applies: Q4_K or Q6_K in the x8 copy, rows from a group boundary, whole sub-blocks.
constexpr bool x8k_type(DType t) { return t == DType::Q4_K || t == DType::Q6_K; }
inline bool x8k_direct(const MatmulArgs& a, int64_t r0, int64_t k0, int64_t kc) {
    return x8k_type(a.wtype) && a.w_layout == WLayout::kX8 && r0 % kPackRows == 0 && k0 % kQK == 0 && kc % kQK == 0;
}

// 32 bytes at off of both group blocks side by side: rows 0..7 in the low half, 8..15 in the high.
EV_AVX512_X8K inline __m512i load_pair(const uint8_t* b0, const uint8_t* b1, size_t off) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + off))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + off)), 1);
}

// 8 fp16 values at off of both blocks as 16 floats.
EV_AVX512_X8K inline __m512 halves_pair(const uint8_t* b0, const uint8_t* b1, size_t off) {
    const __m128i h0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + off));
    const __m128i h1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + off));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1));
}

// 16 rows x 4 elements (row r at bytes 4r..4r+3) -> 4 elements x 16 rows (element i at bytes
// 16i..16i+15, row r at byte 16i + r).
EV_AVX512_X8K inline __m512i rows_to_elements(__m512i v) {
    const __m512i in_lane = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_epi32(lanes, _mm512_shuffle_epi8(v, in_lane));
}

// Element i (0..3) of a rows_to_elements result as 16 floats; kSigned: the bytes are int8.
template <bool kSigned>
EV_AVX512_X8K inline __m512 element_floats(__m512i e, int i) {
    __m128i b;
    switch (i) {  // the lane index is an immediate
    case 0: b = _mm512_extracti32x4_epi32(e, 0); break;
    case 1: b = _mm512_extracti32x4_epi32(e, 1); break;
    case 2: b = _mm512_extracti32x4_epi32(e, 2); break;
    default: b = _mm512_extracti32x4_epi32(e, 3); break;
    }
    return _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

// -v, exactly (the sign bit flipped, as the scalar negation does: -0 for +0).
EV_AVX512_X8K inline __m512 neg(__m512 v) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}

// Byte j of each dword of v, as 16 int32.
EV_AVX512_X8K inline __m512i dword_byte(__m512i v, int j) {
    return _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(8 * j)), _mm512_set1_epi32(0xff));
}

// Sub-block j (0..7) of one Q4_K super-block for 16 rows: b0, b1 the two groups' blocks; dst the
// panel row of the sub-block's first element (stride floats apart); lanes not in `live` are 0.
EV_AVX512_X8K inline void x8k_sub_q4k(const uint8_t* b0, const uint8_t* b1, int j, __mmask16 live, float* dst, int stride) {
    const __m512 d = halves_pair(b0, b1, 0), dmin = halves_pair(b0, b1, kX8Q4K_Dmin);
    // The 12 scale bytes of each row as 3 dwords w0, w1, w2 (k4_scales in kquant_avx2.h).
    const __m512i w0 = load_pair(b0, b1, kX8Q4K_Scales), w1 = load_pair(b0, b1, kX8Q4K_Scales + 32);
    __m512i sc, mn;
    if (j < 4) {
        sc = _mm512_and_si512(dword_byte(w0, j), _mm512_set1_epi32(0x3f));
        mn = _mm512_and_si512(dword_byte(w1, j), _mm512_set1_epi32(0x3f));
    } else {
        const __m512i w2 = load_pair(b0, b1, kX8Q4K_Scales + 64);
        const __m512i top = _mm512_set1_epi32(0x30);
        sc = _mm512_or_si512(_mm512_and_si512(dword_byte(w2, j - 4), _mm512_set1_epi32(0x0f)),
                             _mm512_and_si512(_mm512_srli_epi32(dword_byte(w0, j - 4), 2), top));
        mn = _mm512_or_si512(_mm512_srli_epi32(dword_byte(w2, j - 4), 4), _mm512_and_si512(_mm512_srli_epi32(dword_byte(w1, j - 4), 2), top));
    }
    // As k4_scales: scf = float(sc) * d, mnf = float(mn) * -dmin.
    const __m512 scf = _mm512_maskz_mul_ps(live, _mm512_cvtepi32_ps(sc), d);
    const __m512 mnf = _mm512_maskz_mul_ps(live, _mm512_cvtepi32_ps(mn), neg(dmin));
    // Sub-block j: the nibbles of vectors 8 (j / 2) .. + 7, low for even j, high for odd.
    const size_t q0 = kX8Q4K_Qs + 32 * 8 * static_cast<size_t>(j / 2);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int v = 0; v < 8; ++v) {
        __m512i q = load_pair(b0, b1, q0 + 32 * static_cast<size_t>(v));
        q = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(q, 4) : q, low4);
        const __m512i e = rows_to_elements(q);
        for (int i = 0; i < 4; ++i)
            _mm512_store_ps(dst + (4 * v + i) * stride, _mm512_fmadd_ps(element_floats<false>(e, i), scf, mnf));
    }
}

// Sub-block j (0..7) of one Q6_K super-block for 16 rows, as x8k_sub_q4k. Element 128 h + 32 jj + l
// (j = 4 h + jj): low 4 bits in ql byte 64 h + 32 (jj % 2) + l (high nibble for jj >= 2), top 2
// bits at bit 2 jj of qh byte 32 h + l; q - 32 times d * sc[(32 j + l) / 16].
EV_AVX512_X8K inline void x8k_sub_q6k(const uint8_t* b0, const uint8_t* b1, int j, __mmask16 live, float* dst, int stride) {
    const __m512 d = halves_pair(b0, b1, 0);
    __m512 s[2];
    for (int half = 0; half < 2; ++half) {  // the 16-element scale groups 2j and 2j + 1: 8 bytes per group block
        const size_t off = kX8Q6K_Scales + 8 * static_cast<size_t>(2 * j + half);
        int64_t lo, hi;
        std::memcpy(&lo, b0 + off, 8);
        std::memcpy(&hi, b1 + off, 8);
        const __m512 scale = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set_epi64x(hi, lo)));
        s[half] = _mm512_maskz_mul_ps(live, d, scale);  // as dequant_row: d * float(sc)
    }
    const int h = j / 4, jj = j % 4;
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
    for (int v = 0; v < 8; ++v) {
        const __m512i l = load_pair(b0, b1, kX8Q6K_Ql + 32 * static_cast<size_t>(16 * h + 8 * (jj % 2) + v));
        const __m512i lo = _mm512_and_si512(jj >= 2 ? _mm512_srli_epi16(l, 4) : l, low4);
        const __m512i qh = load_pair(b0, b1, kX8Q6K_Qh + 32 * static_cast<size_t>(8 * h + v));
        const __m512i hs = jj == 0 ? _mm512_slli_epi16(qh, 4) : jj == 1 ? _mm512_slli_epi16(qh, 2) : jj == 2 ? qh : _mm512_srli_epi16(qh, 2);
        const __m512i q = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_and_si512(hs, top2)), bias);
        const __m512i e = rows_to_elements(q);
        const __m512 sv = s[v >= 4];  // elements 4v .. 4v + 3: scale group 2j + (4v >= 16)
        for (int i = 0; i < 4; ++i) _mm512_store_ps(dst + (4 * v + i) * stride, _mm512_mul_ps(element_floats<true>(e, i), sv));
    }
}

// pack_panel_t's contract for x8k_direct(a, r0, k0, kc): rows [r0, r0 + nrows) x elements
// [k0, k0 + kc) into panel[kk * stride + row], stride = 16 * ceil(nrows / 16), rows past nrows 0.
template <DType T>
EV_AVX512_X8K void pack_panel_x8k(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, float* panel) {
    static_assert(x8k_type(T), "Q4_K and Q6_K only");
    const uint8_t* base = static_cast<const uint8_t*>(a.w);
    const int64_t nb = a.k / kQK_K;
    const size_t bb = x8_block_bytes(T);
    const int nv = (nrows + 15) / 16;
    const int stride = 16 * nv;
    for (int v = 0; v < nv; ++v) {
        const int n = nrows - 16 * v < 16 ? nrows - 16 * v : 16;
        const int64_t g0 = (r0 + 16 * v) / kPackRows;
        const int64_t g1 = n > kPackRows ? g0 + 1 : g0;  // rows 8..15 absent: read group 0 again, masked
        const __mmask16 live = tail_mask16(n);
        for (int64_t s = k0 / kQK; s < (k0 + kc) / kQK; ++s) {
            const int64_t b = s / (kQK_K / kQK);
            const int j = static_cast<int>(s % (kQK_K / kQK));
            const uint8_t* b0 = base + static_cast<size_t>(g0 * nb + b) * bb;
            const uint8_t* b1 = base + static_cast<size_t>(g1 * nb + b) * bb;
            float* dst = panel + (s * kQK - k0) * stride + 16 * v;
            if constexpr (T == DType::Q4_K)
                x8k_sub_q4k(b0, b1, j, live, dst, stride);
            else
                x8k_sub_q6k(b0, b1, j, live, dst, stride);
        }
    }
}

}  // namespace avx512
}  // namespace evk
#endif
