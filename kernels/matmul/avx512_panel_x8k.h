// The prefill panel fill for Q4_K, Q6_K and Q5_0 weights in the x8 copy (packed_x8.h), straight
// from it: 16 rows (two groups of 8) x one (sub-)block of 32 elements at a time into the k-major
// float panel of avx512_panel.h. Before, a panel's rows went x8 -> the file's row (x8_unpack_row) -> float row
// (dequant_row) -> transposed panel: three passes over every weight per call. Notes:
// docs/kernels/prefill-panel-x8k.md.
//
// Each 32-byte vector of the x8 copy holds 4 consecutive elements of each of 8 rows (bytes 4r..4r+3:
// row r). Two groups' vectors side by side are 16 rows x 4 elements; a byte shuffle within each
// 128-bit lane and a dword permute make them 4 elements x 16 rows, one 16-byte lane per element:
// each widens to one panel row of 16 floats. A value is computed with the same operations, in the
// same order, as dequant_row (kquant_avx2.h) computes it from the file's row: x = fma(q, d * sc,
// -dmin * mn) for Q4_K, x = q * (d * sc) for Q6_K, x = fma(q, d, d * -16) for Q5_0, so the panel's floats are the rows' bit for bit.
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
constexpr size_t kX8Q5_0_Qh = 16, kX8Q5_0_Qs = 48;

// The x8 fill applies: one of these formats in the x8 copy, rows from a group boundary, whole
// blocks of 32.
constexpr bool x8k_type(DType t) { return t == DType::Q4_K || t == DType::Q6_K || t == DType::Q5_0; }
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

// Where a block's values go, and so in which order they are made:
//   kElements: one vector per element of k, lane r = row r (the float panel, k-major);
//   kPairs:    one vector pair per two elements 2p, 2p + 1 of k: lanes 2r + e hold element 2p + e of
//              row r for rows 0..7 (first) and 8..15 (second), so that one vcvtne2ps2bf16 of the pair
//              is a row of the AMX B tile's pair layout (matmul_amx.cpp), with no word permute.
enum class Order { kElements, kPairs };

// 16 rows x 4 elements (row r at bytes 4r..4r+3) -> four 16-byte lanes. kElements: lane i is
// element i of rows 0..15. kPairs: lane 2p + h is elements 2p, 2p + 1 of rows 8h..8h+7, interleaved.
template <Order O>
EV_AVX512_X8K inline __m512i rows_to(__m512i v) {
    if constexpr (O == Order::kElements) {
        const __m512i in_lane = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
        const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        return _mm512_permutexvar_epi32(lanes, _mm512_shuffle_epi8(v, in_lane));
    } else {
        // In each 128-bit lane (rows 4L..4L+3): dwords (e0, e1 of rows 4L, 4L+1), (of 4L+2, 4L+3),
        // then the same for e2, e3; the dword permute gathers them by pair and half.
        const __m512i in_lane = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
        const __m512i lanes = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        return _mm512_permutexvar_epi32(lanes, _mm512_shuffle_epi8(v, in_lane));
    }
}

// Lane i (0..3) of a rows_to result: its 16 bytes.
EV_AVX512_X8K inline __m128i lane_bytes(__m512i e, int i) {
    switch (i) {  // the lane index is an immediate
    case 0: return _mm512_extracti32x4_epi32(e, 0);
    case 1: return _mm512_extracti32x4_epi32(e, 1);
    case 2: return _mm512_extracti32x4_epi32(e, 2);
    default: return _mm512_extracti32x4_epi32(e, 3);
    }
}

// The same as 16 int32; kSigned: the bytes are int8.
template <bool kSigned>
EV_AVX512_X8K inline __m512i lane_ints(__m512i e, int i) {
    const __m128i b = lane_bytes(e, i);
    return kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}

// A per-row vector (lane r = row r) in the order of lane i of rows_to<O>: for kPairs, rows
// 8 (i % 2) .. + 7 each twice.
template <Order O>
EV_AVX512_X8K inline __m512 per_lane(__m512 rows, int i) {
    if constexpr (O == Order::kElements) {
        (void)i;
        return rows;
    } else {
        const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        return _mm512_permutexvar_ps(i % 2 ? _mm512_add_epi32(first, _mm512_set1_epi32(8)) : first, rows);
    }
}
template <Order O>
EV_AVX512_X8K inline __m512i per_lane(__m512i rows, int i) {
    return _mm512_castps_si512(per_lane<O>(_mm512_castsi512_ps(rows), i));
}

// -v, exactly (the sign bit flipped, as the scalar negation does: -0 for +0).
EV_AVX512_X8K inline __m512 neg(__m512 v) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
}

// Byte j of each dword of v, as 16 int32.
EV_AVX512_X8K inline __m512i dword_byte(__m512i v, int j) {
    return _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(8 * j)), _mm512_set1_epi32(0xff));
}

// Hands the 4 vectors of lanes 0..3 (elements e0 .. e0 + 3 of the block) to the sink: kElements
// put(element, v) each; kPairs put_pair(element / 2, first, second) twice.
template <Order O, class Sink>
EV_AVX512_X8K inline void emit(Sink& sink, int e0, const __m512 x[4]) {
    if constexpr (O == Order::kElements) {
        for (int i = 0; i < 4; ++i) sink.put(e0 + i, x[i]);
    } else {
        sink.put_pair(e0 / 2, x[0], x[1]);
        sink.put_pair(e0 / 2 + 1, x[2], x[3]);
    }
}

// Sub-block j (0..7) of one Q4_K super-block for 16 rows: b0, b1 the two groups' blocks; lanes not
// in `live` are 0. The 32 values go to the sink in order O.
template <Order O, class Sink>
EV_AVX512_X8K inline void x8k_sub_q4k(const uint8_t* b0, const uint8_t* b1, int j, __mmask16 live, Sink& sink) {
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
    const __m512 s[2] = {per_lane<O>(scf, 0), per_lane<O>(scf, 1)}, m[2] = {per_lane<O>(mnf, 0), per_lane<O>(mnf, 1)};
    // Sub-block j: the nibbles of vectors 8 (j / 2) .. + 7, low for even j, high for odd.
    const size_t q0 = kX8Q4K_Qs + 32 * 8 * static_cast<size_t>(j / 2);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int v = 0; v < 8; ++v) {
        __m512i q = load_pair(b0, b1, q0 + 32 * static_cast<size_t>(v));
        q = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(q, 4) : q, low4);
        const __m512i e = rows_to<O>(q);
        __m512 x[4];
        for (int i = 0; i < 4; ++i) x[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lane_ints<false>(e, i)), s[i % 2], m[i % 2]);
        emit<O>(sink, 4 * v, x);
    }
}

// Sub-block j (0..7) of one Q6_K super-block for 16 rows, as x8k_sub_q4k. Element 128 h + 32 jj + l
// (j = 4 h + jj): low 4 bits in ql byte 64 h + 32 (jj % 2) + l (high nibble for jj >= 2), top 2
// bits at bit 2 jj of qh byte 32 h + l; q - 32 times d * sc[(32 j + l) / 16].
template <Order O, class Sink>
EV_AVX512_X8K inline void x8k_sub_q6k(const uint8_t* b0, const uint8_t* b1, int j, __mmask16 live, Sink& sink) {
    const __m512 d = halves_pair(b0, b1, 0);
    __m512 s[2][2];  // [scale group 2j + g][lane parity]
    for (int g = 0; g < 2; ++g) {  // the 16-element scale groups 2j and 2j + 1: 8 bytes per group block
        const size_t off = kX8Q6K_Scales + 8 * static_cast<size_t>(2 * j + g);
        int64_t lo, hi;
        std::memcpy(&lo, b0 + off, 8);
        std::memcpy(&hi, b1 + off, 8);
        const __m512 scale = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set_epi64x(hi, lo)));
        const __m512 sv = _mm512_maskz_mul_ps(live, d, scale);  // as dequant_row: d * float(sc)
        s[g][0] = per_lane<O>(sv, 0);
        s[g][1] = per_lane<O>(sv, 1);
    }
    const int h = j / 4, jj = j % 4;
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
    for (int v = 0; v < 8; ++v) {
        const __m512i l = load_pair(b0, b1, kX8Q6K_Ql + 32 * static_cast<size_t>(16 * h + 8 * (jj % 2) + v));
        const __m512i lo = _mm512_and_si512(jj >= 2 ? _mm512_srli_epi16(l, 4) : l, low4);
        const __m512i qh = load_pair(b0, b1, kX8Q6K_Qh + 32 * static_cast<size_t>(8 * h + v));
        const __m512i hs = jj == 0 ? _mm512_slli_epi16(qh, 4) : jj == 1 ? _mm512_slli_epi16(qh, 2) : jj == 2 ? qh : _mm512_srli_epi16(qh, 2);
        const __m512i q = _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_and_si512(hs, top2)), bias);
        const __m512i e = rows_to<O>(q);
        const int g = v >= 4;  // elements 4v .. 4v + 3: scale group 2j + (4v >= 16)
        __m512 x[4];
        for (int i = 0; i < 4; ++i) x[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(lane_ints<true>(e, i)), s[g][i % 2]);
        emit<O>(sink, 4 * v, x);
    }
}

// Block b0 / b1 of Q5_0 (32 elements) for 16 rows, as x8k_sub_q4k. Element 4 j + i (+ 16 in the
// high nibbles) of row r: the nibble of vector j's byte 4 r + i, fifth bit at that bit of the row's
// qh word; x = fma(q, d, d * -16) as Q5_0F (kquant_avx2.h).
template <Order O, class Sink>
EV_AVX512_X8K inline void x8k_block_q5_0(const uint8_t* b0, const uint8_t* b1, __mmask16 live, Sink& sink) {
    const __m512 d = _mm512_maskz_mov_ps(live, halves_pair(b0, b1, 0));
    const __m512 mnf = _mm512_mul_ps(d, _mm512_set1_ps(-16.f));
    const __m512 dl[2] = {per_lane<O>(d, 0), per_lane<O>(d, 1)}, ml[2] = {per_lane<O>(mnf, 0), per_lane<O>(mnf, 1)};
    const __m512i qh_rows = load_pair(b0, b1, kX8Q5_0_Qh);  // row r's fifth bits: dword r
    const __m512i qh[2] = {per_lane<O>(qh_rows, 0), per_lane<O>(qh_rows, 1)};
    // Lane i's element offset from the first of its 4: kElements i; kPairs 2 (i / 2) + the lane's parity.
    const __m512i odd = O == Order::kPairs ? _mm512_setr_epi32(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1) : _mm512_setzero_si512();
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi32(0x10);
    for (int half = 0; half < 2; ++half)
        for (int j = 0; j < 4; ++j) {
            __m512i q = load_pair(b0, b1, kX8Q5_0_Qs + 32 * static_cast<size_t>(j));
            q = _mm512_and_si512(half ? _mm512_srli_epi16(q, 4) : q, low4);
            const __m512i e = rows_to<O>(q);
            __m512 x[4];
            for (int i = 0; i < 4; ++i) {
                // Element el of each lane: bit el of qh to bit 4 (a left shift by 4 - el, or right by el - 4).
                const int el0 = 16 * half + 4 * j + (O == Order::kElements ? i : 2 * (i / 2));
                const __m512i el = _mm512_add_epi32(_mm512_set1_epi32(el0), odd);
                // (el0 <= 3: every lane's el <= 4, kPairs' el0 being even.)
                const __m512i fifth = el0 <= 3 ? _mm512_sllv_epi32(qh[i % 2], _mm512_sub_epi32(_mm512_set1_epi32(4), el))
                                               : _mm512_srlv_epi32(qh[i % 2], _mm512_sub_epi32(el, _mm512_set1_epi32(4)));
                const __m512i qi = _mm512_ternarylogic_epi32(lane_ints<false>(e, i), fifth, bit4, 0xf8);  // a | (b & c)
                x[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qi), dl[i % 2], ml[i % 2]);
            }
            emit<O>(sink, 16 * half + 4 * j, x);
        }
}

// One block of 32 (a K-quant's sub-block s % 8 of super-block s / 8, or Q5_0's block s) of 16 rows
// from groups g0, g1 of a weight in the x8 copy, to the sink in order O.
template <DType T, Order O, class Sink>
EV_AVX512_X8K inline void x8k_block(const uint8_t* base, int64_t k, int64_t g0, int64_t g1, int64_t s, __mmask16 live, Sink& sink) {
    static_assert(x8k_type(T), "Q4_K, Q6_K and Q5_0 only");
    constexpr int64_t subs = x8_block_cols(T) / kQK;
    constexpr size_t bb = x8_block_bytes(T);
    const int64_t nb = k / x8_block_cols(T), b = s / subs;
    const uint8_t* b0 = base + static_cast<size_t>(g0 * nb + b) * bb;
    const uint8_t* b1 = base + static_cast<size_t>(g1 * nb + b) * bb;
    if constexpr (T == DType::Q4_K)
        x8k_sub_q4k<O>(b0, b1, static_cast<int>(s % subs), live, sink);
    else if constexpr (T == DType::Q6_K)
        x8k_sub_q6k<O>(b0, b1, static_cast<int>(s % subs), live, sink);
    else
        x8k_block_q5_0<O>(b0, b1, live, sink);
}

// The two groups of 8 rows that rows [r, r + n) (r a multiple of 8, n <= 16) lie in, and their lanes.
struct X8Rows {
    int64_t g0, g1;
    __mmask16 live;
    X8Rows(int64_t r, int n)
        : g0(r / kPackRows), g1(n > kPackRows ? r / kPackRows + 1 : r / kPackRows),  // rows 8..15 absent: group 0 again, masked
          live(tail_mask16(n)) {}
};

struct PanelSink {
    float* dst;  // the block's first element of this row group
    int stride;
    EV_AVX512_X8K void put(int e, __m512 v) { _mm512_store_ps(dst + e * stride, v); }
};

// pack_panel_t's contract for x8k_direct(a, r0, k0, kc): rows [r0, r0 + nrows) x elements
// [k0, k0 + kc) into panel[kk * stride + row], stride = 16 * ceil(nrows / 16), rows past nrows 0.
template <DType T>
EV_AVX512_X8K void pack_panel_x8k(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, float* panel) {
    const uint8_t* base = static_cast<const uint8_t*>(a.w);
    const int nv = (nrows + 15) / 16;
    const int stride = 16 * nv;
    for (int v = 0; v < nv; ++v) {
        const X8Rows g(r0 + 16 * v, nrows - 16 * v < 16 ? nrows - 16 * v : 16);
        for (int64_t s = k0 / kQK; s < (k0 + kc) / kQK; ++s) {  // blocks of 32
            PanelSink sink{panel + (s * kQK - k0) * stride + 16 * v, stride};
            x8k_block<T, Order::kElements>(base, a.k, g.g0, g.g1, s, g.live, sink);
        }
    }
}

}  // namespace avx512
}  // namespace evk
#endif
