// AVX-512 matrix product for many tokens (prompt prefill, the vision tower): weight rows are the
// vector lanes. Notes and measurements: docs/kernels/prefill-gemm-avx512.md.
//
// For each panel of up to 48 weight rows and each block of up to kKc (192) elements of k, the rows are
// expanded to float and transposed (16 x 16 in registers) into an L1 panel laid out k-major:
// panel[kk][0..48) holds element k0 + kk of the 48 rows. A register tile of 3 x 16 rows times 8
// tokens (24 zmm accumulators) then streams the panel: per element of k, 3 panel loads and 8
// broadcast activations feed 24 FMAs. Partial sums live in y between k blocks.
//
// Every output y[t][r] is one sequential chain of fused multiply-adds over k = 0, 1, ..., k-1,
// whatever tile, row range, token count or thread computed it: results do not depend on how the
// runtime splits the work (bit-identical across thread counts and prompt pieces).
//
// Compiled for the baseline ISA; only these functions carry the AVX-512 target, and the operator
// table calls them only on CPUs that report AVX-512 F/BW/VL. No allocation: the panel is on the
// stack (36 KiB); the MatmulArgs scratch is not needed.
#if defined(__x86_64__)
// GCC 12's AVX-512 intrinsics initialise their unused operand as `__m512 __Y = __Y;`, which
// -W(maybe-)uninitialized reports wherever they are inlined (GCC bug 105593, fixed in GCC 13).
// (clang has neither the bug nor the -Wmaybe-uninitialized group: GCC only.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif

#include <cstddef>
#include <cstring>

#include "../ops.h"
#include "packed_p16.h"
#include "packed_x8.h"

#define EV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

namespace evk {

namespace {

constexpr int kVecs = 3;               // row vectors per panel (16 rows each)
constexpr int kPanelRows = 16 * kVecs;  // 48
constexpr int kTok = 8;                // tokens per register tile
#ifndef EVK_AVX512_KC
#define EVK_AVX512_KC 192
#endif
constexpr int64_t kKc = EVK_AVX512_KC;           // elements of k per panel block: 48 x 192 floats = 36 KiB

EV_AVX512 inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

EV_AVX512 inline __mmask16 tail_mask(int64_t n) {  // the first min(n, 16) lanes
    return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

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
    const __mmask16 m = tail_mask(k - e);
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

EV_AVX512 void pack_panel(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, float* panel) {
    switch (a.wtype) {
    case DType::F32: return pack_panel_t<DType::F32>(a, r0, nrows, k0, kc, panel);
    case DType::F16: return pack_panel_t<DType::F16>(a, r0, nrows, k0, kc, panel);
    case DType::BF16: return pack_panel_t<DType::BF16>(a, r0, nrows, k0, kc, panel);
    case DType::Q4_0: return pack_panel_t<DType::Q4_0>(a, r0, nrows, k0, kc, panel);
    case DType::Q4_1: return pack_panel_t<DType::Q4_1>(a, r0, nrows, k0, kc, panel);
    case DType::Q8_0: return pack_panel_t<DType::Q8_0>(a, r0, nrows, k0, kc, panel);
    default: return;  // not registered for other formats
    }
}

// NT tokens x NV row vectors over one k block. y (token 0, panel row 0) holds the partial sums of
// the earlier k blocks unless first; last_mask selects the valid rows of the last row vector.
template <int NV, int NT>
EV_AVX512 void tile(const float* panel, int64_t kc, const float* x, int64_t x_stride, float* y, int64_t y_stride,
                    bool first, __mmask16 last_mask) {
    __m512 acc[NT][NV];
    for (int t = 0; t < NT; ++t)
        for (int v = 0; v < NV; ++v) {
            const __mmask16 m = v == NV - 1 ? last_mask : static_cast<__mmask16>(0xffff);
            acc[t][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, y + t * y_stride + 16 * v);
        }
    const float* xs[NT];
    for (int t = 0; t < NT; ++t) xs[t] = x + t * x_stride;
    for (int64_t kk = 0; kk < kc; ++kk) {
        __m512 w[NV];
        for (int v = 0; v < NV; ++v) w[v] = _mm512_load_ps(panel + kk * (16 * NV) + 16 * v);
        for (int t = 0; t < NT; ++t) {
            const __m512 b = _mm512_set1_ps(xs[t][kk]);
            for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_fmadd_ps(w[v], b, acc[t][v]);
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int v = 0; v < NV; ++v) {
            const __mmask16 m = v == NV - 1 ? last_mask : static_cast<__mmask16>(0xffff);
            _mm512_mask_storeu_ps(y + t * y_stride + 16 * v, m, acc[t][v]);
        }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool, __mmask16);

template <int NV>
constexpr TileFn tiles_for[kTok] = {tile<NV, 1>, tile<NV, 2>, tile<NV, 3>, tile<NV, 4>,
                                    tile<NV, 5>, tile<NV, 6>, tile<NV, 7>, tile<NV, 8>};
constexpr const TileFn* kTiles[kVecs] = {tiles_for<1>, tiles_for<2>, tiles_for<3>};

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

EV_AVX512 void fill_panel(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, float* panel) {
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

}  // namespace

EV_AVX512 void matmul_avx512_gemm(const MatmulArgs& a) {
    alignas(64) float panel[kPanelRows * kKc];
    for (int64_t r = a.row0, nrows = 0; r < a.row1; r += nrows) {
        // Panels of 48 rows, but 49..64 rows left go as 32 + the rest: two 2-vector tiles instead
        // of a 3-vector and a 1-vector one (the 1-vector tile is the slowest per row).
        const int64_t left = a.row1 - r;
        nrows = left > kPanelRows + 16 ? kPanelRows : left > kPanelRows ? 32 : left;
        const int nv = static_cast<int>((nrows + 15) / 16);
        const __mmask16 last_mask = tail_mask(nrows - 16 * (nv - 1));
        const TileFn* tiles = kTiles[nv - 1];
        for (int64_t k0 = 0; k0 < a.k; k0 += kKc) {
            const int64_t kc = a.k - k0 < kKc ? a.k - k0 : kKc;
            fill_panel(a, r, static_cast<int>(nrows), k0, kc, panel);
            // p16: the next block's weights (the next k block of these groups, or the first of the
            // next panel's) are prefetched into L2 a slice per tile while the tiles run, so the
            // next fill finds them there.
            const uint8_t* pf[kVecs] = {};
            int64_t pf_bytes = 0, pf_done = 0;
            if (a.w_layout == WLayout::kP16 && r % kP16Rows == 0) {
                const int64_t es = a.wtype == DType::F32 ? 4 : 2;
                int64_t nr = r, nk = k0 + kKc;
                if (nk >= a.k) nr = r + nrows, nk = 0;
                if (nr < a.row1) {
                    const int64_t nkc = a.k - nk < kKc ? a.k - nk : kKc, nnv = (a.row1 - nr < kPanelRows ? a.row1 - nr + 15 : kPanelRows) / 16;
                    pf_bytes = nkc * kP16Rows * es;
                    for (int64_t v = 0; v < nnv; ++v)
                        pf[v] = static_cast<const uint8_t*>(a.w) + ((nr / kP16Rows + v) * a.k + nk) * kP16Rows * es;
                }
            }
            const int64_t n_tiles = (a.m + kTok - 1) / kTok;
            for (int64_t t = 0, ti = 1; t < a.m; t += kTok, ++ti) {
                if (pf_bytes) {
                    const int64_t upto = pf_bytes * ti / n_tiles;
                    for (; pf_done < upto; pf_done += 64)
                        for (int v = 0; v < kVecs; ++v)
                            if (pf[v]) _mm_prefetch(reinterpret_cast<const char*>(pf[v] + pf_done), _MM_HINT_T1);
                }
                const int nt = static_cast<int>(a.m - t < kTok ? a.m - t : kTok);
                tiles[nt - 1](panel, kc, a.x + t * a.x_stride + k0, a.x_stride, a.y + t * a.y_stride + r, a.y_stride,
                              k0 == 0, last_mask);
            }
        }
    }
}

}  // namespace evk
#endif
