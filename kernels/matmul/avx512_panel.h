// The panel fill shared by the AVX-512 and AMX prefill GEMMs (matmul_avx512.cpp, matmul_amx.cpp):
// weight rows of any format (the file's rows, the x8 copy, the p16 copy) expanded to float into a
// k-major panel, panel[kk * 16 * nv + row], for up to 3 groups of 16 rows and one block of k.
// Included by those two files only; every function carries the AVX-512 target and is inline, so
// each includes its own copy and the baseline-ISA parts of the engine never see it.
#pragma once
#if defined(__x86_64__)
#include "avx512_intrin.h"

#include <cstddef>
#include <cstring>

#include "../ops.h"
#include "avx512_panel_x8k.h"
#include "packed_p16.h"
#include "packed_x8.h"

#define EV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

namespace evk {

// Rows [r, r + n) of a's weight as n float rows of a.k in dst (matmul_avx2.cpp).
void expand_rows_avx2(const MatmulArgs& a, int64_t r, int64_t n, float* dst);

namespace avx512 {

EV_AVX512 inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }


// Elements e..e+15 of one quantized block, from its 16 quant bytes (Q8_0: the half holding them;
// Q4: the whole block, element i in byte i % 16's low nibble, i + 16 in its high one), its scale d
// and (Q4_1) offset mn. load16 and load16_x8 both expand through this, so the file's rows and the
// packed copy give the same floats, bit for bit.
template <DType T>
EV_AVX512 inline __m512 expand16(__m128i raw, float d, float mn, int64_t e) {
    if constexpr (T == DType::Q8_0) {
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), _mm512_set1_ps(d));
    } else {
        const __m128i q = (e & 16) ? _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f))
                                   : _mm_and_si128(raw, _mm_set1_epi8(0x0f));
        const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
        if constexpr (T == DType::Q4_0) return _mm512_mul_ps(_mm512_sub_ps(qf, _mm512_set1_ps(8.f)), _mm512_set1_ps(d));
        return _mm512_fmadd_ps(qf, _mm512_set1_ps(d), _mm512_set1_ps(mn));
    }
}

// 16 elements [e, e + 16) of one weight row as floats; lanes at or past k are 0. For the block
// formats e is a multiple of 16 and k of 32 (a whole block's half is always present).
template <DType T>
EV_AVX512 inline __m512 load16(const uint8_t* row, int64_t e, int64_t k) {
    const __mmask16 m = tail_mask16(k - e);
    switch (T) {
    case DType::F32:
        return _mm512_maskz_loadu_ps(m, row + 4 * e);
    case DType::F16:
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, row + 2 * e));
    case DType::BF16: {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + 2 * e));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
    case DType::Q4_0:
    case DType::Q4_1:
    case DType::Q8_0: {
        constexpr size_t kBlock = T == DType::Q8_0 ? sizeof(BlockQ8_0) : T == DType::Q4_1 ? sizeof(BlockQ4_1) : sizeof(BlockQ4_0);
        const uint8_t* blk = row + (e / kQK) * kBlock;
        // Q8_0: this half's 16 quants; Q4: the block's 16 quant bytes (d, then m for Q4_1, first).
        const size_t qs = T == DType::Q8_0 ? 2 + (e & 16) : T == DType::Q4_1 ? 4 : 2;
        const float mn = T == DType::Q4_1 ? half_to_float(load_u16(blk + 2)) : 0.f;
        return expand16<T>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qs)), half_to_float(load_u16(blk)),
                           mn, e);
    }
    default:
        return _mm512_setzero_ps();  // not registered for other formats
    }
}

// The same 16 elements of row `row` of a weight packed in the x8 layout (packed_x8.h): the block's
// 16 quant bytes (Q8_0: of this half) are 4 dwords, one per 32-byte vector, put back in the file's
// order, then expanded by expand16 as load16's are.
template <DType T>
EV_AVX512 inline __m512 load16_x8(const uint8_t* packed, int64_t row, int64_t e, int64_t k) {
    const int64_t nb = k / kQK, r = row % kPackRows, b = e / kQK;
    const uint8_t* blk = packed + static_cast<size_t>((row / kPackRows) * nb + b) * x8_block_bytes(T);
    const float d = half_to_float(load_u16(blk + 2 * r));
    auto dword = [&](size_t off) {
        int32_t v;
        std::memcpy(&v, blk + off, 4);
        return v;
    };
    // The 4 dwords of this row in 4 consecutive 32-byte vectors: Q8_0 vectors 0..3 or 4..7 (the
    // half), Q4 vectors 0..3 after the scales.
    const size_t v0 = (T == DType::Q8_0 ? 16 + 32 * ((e & 16) / 4) : T == DType::Q4_1 ? 32 : 16) + 4 * r;
    const __m128i raw = _mm_setr_epi32(dword(v0), dword(v0 + 32), dword(v0 + 64), dword(v0 + 96));
    const float mn = T == DType::Q4_1 ? half_to_float(load_u16(blk + 16 + 2 * r)) : 0.f;
    return expand16<T>(raw, d, mn, e);
}

// In place: r[j] (16 floats each) becomes column j of the 16 x 16 matrix whose rows were r[0..16).
EV_AVX512 inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: (a0 b0 a1 b1), (a2 b2 a3 b3)
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    __m512 u[16];
    for (int i = 0; i < 16; i += 4) {  // u[i + j], lane L: element 4L + j of rows i..i+3
        const __m512d t0 = _mm512_castps_pd(t[i]), t1 = _mm512_castps_pd(t[i + 1]);
        const __m512d t2 = _mm512_castps_pd(t[i + 2]), t3 = _mm512_castps_pd(t[i + 3]);
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    for (int j = 0; j < 4; ++j) {  // a 4 x 4 transpose of 128-bit lanes
        const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
        const __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xee);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
        const __m512 v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xee);
        r[j] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        r[j + 4] = _mm512_shuffle_f32x4(v0, v2, 0xdd);
        r[j + 8] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        r[j + 12] = _mm512_shuffle_f32x4(v1, v3, 0xdd);
    }
}

// Expands rows [r0, r0 + nrows) x elements [k0, k0 + kc) into panel[kk * stride + row], stride =
// 16 * ceil(nrows / 16); rows past nrows are 0. Elements past kc (up to the next 16) are written
// too (0 past k) but never read.
template <DType T>
EV_AVX512 void pack_panel_t(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, float* panel) {
    const uint8_t* base = static_cast<const uint8_t*>(a.w);
    const int nv = (nrows + 15) / 16;
    const int stride = 16 * nv;
    for (int v = 0; v < nv; ++v) {
        const uint8_t* row0 = base + static_cast<size_t>(r0 + 16 * v) * a.w_row_bytes;
        const size_t rb = a.w_row_bytes;
        const int n = nrows - 16 * v < 16 ? nrows - 16 * v : 16;
        for (int64_t kk = 0; kk < kc; kk += 16) {
            __m512 c[16];
            if constexpr (T == DType::Q4_0 || T == DType::Q4_1 || T == DType::Q8_0) {
                if (a.w_layout == WLayout::kX8) {  // the decode kernels' packed copy
                    for (int i = 0; i < 16; ++i)
                        c[i] = i < n ? load16_x8<T>(base, r0 + 16 * v + i, k0 + kk, a.k) : _mm512_setzero_ps();
                    transpose16(c);
                    float* dst = panel + kk * stride + 16 * v;
                    for (int j = 0; j < 16; ++j) _mm512_store_ps(dst + j * stride, c[j]);
                    continue;
                }
            }
            if (n == 16) {
                for (int i = 0; i < 16; ++i) c[i] = load16<T>(row0 + i * rb, k0 + kk, a.k);
            } else {
                for (int i = 0; i < 16; ++i) c[i] = i < n ? load16<T>(row0 + i * rb, k0 + kk, a.k) : _mm512_setzero_ps();
            }
            transpose16(c);
            float* dst = panel + kk * stride + 16 * v;
            for (int j = 0; j < 16; ++j) _mm512_store_ps(dst + j * stride, c[j]);
        }
    }
}

// The formats pack_panel expands as they lie in any layout; the others (K-quants, Q5_0, Q5_1,
// IQ4_NL) the caller expands to float rows first (matmul_avx512.cpp), except Q4_K, Q6_K and Q5_0
// in the x8 copy from a group boundary (avx512_panel_x8k.h): see panel_reads.
constexpr bool pack_panel_reads(DType t) {
    return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::Q4_0 || t == DType::Q4_1 ||
           t == DType::Q8_0;
}

// Whether the panel fill reads a's weight as it lies for every panel of the call: panels start
// at a.row0 plus multiples of 16 rows and k blocks at multiples of 32, so x8k_direct holding for
// the whole call holds for each of them.
inline bool panel_reads(const MatmulArgs& a) {
    return pack_panel_reads(a.wtype) || x8k_direct(a, a.row0, 0, a.k);
}

// The others: a panel's rows as float rows in a.scratch (expand_rows_avx2, matmul_avx2.cpp, rows
// [r, r + n) to scratch rows 0 .. n - 1), read through the weight this returns.
inline MatmulArgs expanded_rows(const MatmulArgs& a) {
    MatmulArgs rows = a;
    rows.w = a.scratch;
    rows.wtype = DType::F32;
    rows.w_row_bytes = static_cast<size_t>(a.k) * sizeof(float);
    rows.w_layout = WLayout::kRows;
    return rows;
}

EV_AVX512 inline void pack_panel(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, float* panel) {
    switch (a.wtype) {
    case DType::F32: return pack_panel_t<DType::F32>(a, r0, nrows, k0, kc, panel);
    case DType::F16: return pack_panel_t<DType::F16>(a, r0, nrows, k0, kc, panel);
    case DType::BF16: return pack_panel_t<DType::BF16>(a, r0, nrows, k0, kc, panel);
    case DType::Q4_0: return pack_panel_t<DType::Q4_0>(a, r0, nrows, k0, kc, panel);
    case DType::Q4_1: return pack_panel_t<DType::Q4_1>(a, r0, nrows, k0, kc, panel);
    case DType::Q8_0: return pack_panel_t<DType::Q8_0>(a, r0, nrows, k0, kc, panel);
    case DType::Q4_K:
        if (x8k_direct(a, r0, k0, kc)) pack_panel_x8k<DType::Q4_K>(a, r0, nrows, k0, kc, panel);
        return;
    case DType::Q6_K:
        if (x8k_direct(a, r0, k0, kc)) pack_panel_x8k<DType::Q6_K>(a, r0, nrows, k0, kc, panel);
        return;
    case DType::Q5_0:
        if (x8k_direct(a, r0, k0, kc)) pack_panel_x8k<DType::Q5_0>(a, r0, nrows, k0, kc, panel);
        return;
    default: return;  // !panel_reads(a)
    }
}

// The same panel from a weight packed in the p16 layout (packed_p16.h), already k-major: for rows
// starting at a multiple of 16, each of the nv groups' k block is converted to float as it lies
// (one 16-lane load and store per element of k, no transpose); otherwise element by element (a
// caller's odd row range, never the runtime's 16-row chunks). The values are the rows' values, bit
// for bit. Lanes past nrows hold the next rows or the zero padding: computed, never stored.
template <DType T>
EV_AVX512 inline __m512 load16_p16(const uint8_t* p) {
    if constexpr (T == DType::F32) return _mm512_loadu_ps(p);
    if constexpr (T == DType::F16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

template <DType T>
EV_AVX512 void fill_panel_p16_t(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, float* panel) {
    constexpr size_t es = T == DType::F32 ? 4 : 2;
    const uint8_t* base = static_cast<const uint8_t*>(a.w);
    const int nv = (nrows + 15) / 16;
    const int stride = 16 * nv;
    if (r0 % kP16Rows == 0) {
        for (int v = 0; v < nv; ++v) {
            const uint8_t* g = base + (static_cast<size_t>((r0 / kP16Rows + v) * a.k + k0) * kP16Rows) * es;
            float* dst = panel + 16 * v;
            for (int64_t kk = 0; kk < kc; ++kk) _mm512_store_ps(dst + kk * stride, load16_p16<T>(g + static_cast<size_t>(kk) * kP16Rows * es));
        }
        return;
    }
    for (int64_t kk = 0; kk < kc; ++kk)
        for (int i = 0; i < stride; ++i) {
            float f = 0.f;
            if (i < nrows) {
                const int64_t r = r0 + i;
                const uint8_t* e = base + (static_cast<size_t>((r / kP16Rows) * a.k + k0 + kk) * kP16Rows + static_cast<size_t>(r % kP16Rows)) * es;
                if constexpr (T == DType::F32) {
                    std::memcpy(&f, e, 4);
                } else {
                    const uint16_t h = load_u16(e);
                    if constexpr (T == DType::F16) {
                        f = half_to_float(h);
                    } else {
                        const uint32_t u = static_cast<uint32_t>(h) << 16;
                        std::memcpy(&f, &u, 4);
                    }
                }
            }
            panel[kk * stride + i] = f;
        }
}

EV_AVX512 inline void fill_panel(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, float* panel) {
    if (a.w_layout == WLayout::kP16) {
        switch (a.wtype) {
        case DType::F32: return fill_panel_p16_t<DType::F32>(a, r0, nrows, k0, kc, panel);
        case DType::F16: return fill_panel_p16_t<DType::F16>(a, r0, nrows, k0, kc, panel);
        case DType::BF16: return fill_panel_p16_t<DType::BF16>(a, r0, nrows, k0, kc, panel);
        default: return;  // no p16 layout for other formats
        }
    }
    pack_panel(a, r0, nrows, k0, kc, panel);
}

}  // namespace avx512
}  // namespace evk
#endif
