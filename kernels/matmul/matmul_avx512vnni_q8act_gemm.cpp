// Int8 prefill GEMM on AVX-512 VNNI: quantized weights times int8 activations, integer dot
// products per sub-block, as the decode kernels compute one token (and as llama.cpp's prefill does).
// Notes, prediction and measurements: docs/kernels/prefill-q8act-gemm.md.
//
// The float GEMMs (avx512_gemm, avx2_gemm) expand every weight to float and do 16 multiply-adds
// per instruction; vpdpbusd does 64 (16 lanes x 4 byte products) with no expansion to float, so a
// compute-bound prefill has up to 4x the arithmetic rate.
//
// Activations: converted once per product by the caller (ActPrep "q8blocks"): per token, blocks of
// 32 as in the decode kernels (d = max|x| / 127, round to nearest) with d times the sums of the
// quants over the block and over each half (the offsets of 32- and 16-element sub-blocks).
// Weights: per call, a panel of 16 rows is read once into its integer view (formats.h:
// int_view_row: unsigned quants, a scale and an offset per sub-block of 16 or 32), the quants
// interleaved 4 bytes per row so that one 64-byte vector holds 4 consecutive elements of 16 rows
// and one vpdpbusd leaves each row's partial dot in its own lane. Then for tiles of up to 8
// tokens, per sub-block s and token t, each lane r:
//   acc += float(sum_i q_ri x_ti) * (scale_rs * d_t) - offset_rs * (d_t sum_i x_ti)
// The same operations in the same order for a token whatever the tile, the row range or the
// tokens beside it: each token's outputs are the bits a one-token product gives (kernel_check).
#if defined(__x86_64__)
#include "avx512_intrin.h"  // first: GCC 12's AVX-512 intrinsics

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../ops.h"
#include "packed_q8u.h"
#include "packed_x8.h"
#include "q8act_avx2.h"
#include "q8blocks.h"

#define EV_VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

namespace evk {

// The x8 body's helpers (fifth_bits_x8, load_v, load_halves) under this file's target.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif
namespace gemm_x8 {
using q8act::BlockQ8A;
using q8act::quantize_act;
constexpr bool kVnni = true;
#define EVK_DPBUSD _mm256_dpbusd_epi32
#include "x8_body.inc"
#undef EVK_DPBUSD
}  // namespace gemm_x8
// avx512vnni_q8act_gemm_ymm: the AVX-VNNI int8 GEMM on q8u weights (matmul_avxvnni_q8act_gemm.cpp)
// EVEX-encoded, for CPUs with AVX512-VNNI and no AVX-VNNI (Zen 4, Ice Lake).
namespace q8u_evex {
#define EVK_DPBUSD _mm256_dpbusd_epi32
#include "q8u_gemm_body.inc"
#undef EVK_DPBUSD
}  // namespace q8u_evex
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace {

using q8blocks::ActBlock;

constexpr int kLanes = 16;     // weight rows per panel (one zmm lane each)
constexpr int kMaxTile = 8;    // tokens per tile: 8 int32 and 8 float accumulators

size_t q8blocks_row_bytes(int64_t k) { return q8blocks::row_bytes<ActBlock>(k); }

void q8blocks_prep(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t0, int64_t t1, void* dst) {
    q8blocks::prep_rows<ActBlock>(x, x_stride, m, k, t0, t1, dst, [](const float* src, ActBlock& out) {
        q8act::BlockQ8A blk;
        q8act::quantize_act(src, kQK, &blk);
        int lo = 0, hi = 0;
        for (int i = 0; i < kQK / 2; ++i) {
            lo += blk.qs[i];
            hi += blk.qs[i + kQK / 2];
        }
        out.d = blk.d;
        out.ds = blk.s;
        out.ds_half[0] = blk.d * static_cast<float>(lo);
        out.ds_half[1] = blk.d * static_cast<float>(hi);
        std::memcpy(out.qs, blk.qs, kQK);
    });
}

inline int32_t load_i32(const void* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// Tokens x[0..N) (ActBlock rows xs bytes apart) against one panel: quants qp (sub-block s at
// qp + 16 B s, group g of 4 elements at + 64 g), scales / offsets sc / off (16 per sub-block).
// Writes lanes [0, nr) of each token's 16 outputs at y + n * ys.
template <int N, int B>
EV_VNNI512 void tile(const uint8_t* qp, const float* sc, const float* off, int64_t nsub, const uint8_t* xp, int64_t xs,
                     float* y, int64_t ys, int nr) {
    const ActBlock* xb[N];
    for (int n = 0; n < N; ++n) xb[n] = reinterpret_cast<const ActBlock*>(xp + n * xs);
    __m512 acc[N];
    for (int n = 0; n < N; ++n) acc[n] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsub; ++s) {
        const int64_t blk = B == kQK ? s : s / 2;
        const int half = B == kQK ? 0 : static_cast<int>(s % 2);
        __m512i dot[N];
        for (int n = 0; n < N; ++n) dot[n] = _mm512_setzero_si512();
        const uint8_t* q = qp + static_cast<size_t>(s) * kLanes * B;
#pragma GCC unroll 8
        for (int g = 0; g < B / 4; ++g) {
            const __m512i w = _mm512_loadu_si512(q + 64 * g);
#pragma GCC unroll 8
            for (int n = 0; n < N; ++n)
                dot[n] = _mm512_dpbusd_epi32(dot[n], w, _mm512_set1_epi32(load_i32(xb[n][blk].qs + 16 * half + 4 * g)));
        }
        const __m512 scale = _mm512_loadu_ps(sc + kLanes * s), offset = _mm512_loadu_ps(off + kLanes * s);
#pragma GCC unroll 8
        for (int n = 0; n < N; ++n) {
            const ActBlock& a = xb[n][blk];
            acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[n]), _mm512_mul_ps(scale, _mm512_set1_ps(a.d)), acc[n]);
            acc[n] = _mm512_fnmadd_ps(offset, _mm512_set1_ps(B == kQK ? a.ds : a.ds_half[half]), acc[n]);
        }
    }
    const __mmask16 lanes = tail_mask16(nr);
    for (int n = 0; n < N; ++n) _mm512_mask_storeu_ps(y + n * ys, lanes, acc[n]);
}

// Whether the panel of rows [r, r + 16) fills straight from the x8 copy (the 32-element formats,
// the panel starting a group of 8): its vectors are already this panel's interleave, 8 rows each.
bool x8_direct(const MatmulArgs& a, int64_t r) {
    const DType t = a.wtype;
    return a.w_layout == WLayout::kX8 && r % kPackRows == 0 &&
           (t == DType::Q4_0 || t == DType::Q4_1 || t == DType::Q5_0 || t == DType::Q8_0);
}

// The panel of rows [r, r + nr) from the x8 copy: for each half (a group of 8 rows; the second is
// zeros when nr <= 8) and block b, the quants of group g (elements 4g..4g+3) are 32 bytes at
// qp + 64 (8 b + g) + 32 half, the same bytes int_view_row gives (nibbles, fifth bits; Q8_0 + 128).
EV_VNNI512 void fill_from_x8(const MatmulArgs& a, int64_t r, int nr, uint8_t* qp, float* sc, float* off) {
    using namespace gemm_x8;
    const DType t = a.wtype;
    const int64_t nb = a.k / kQK;
    const size_t bb = x8_block_bytes(t);
    const size_t scales = t == DType::Q5_0 ? 48 : t == DType::Q4_1 ? 32 : 16;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int half = 0; half < 2; ++half) {
        const bool present = half == 0 || nr > kPackRows;
        const uint8_t* g = static_cast<const uint8_t*>(a.w) + static_cast<size_t>((r / kPackRows + half) * nb) * bb;
        for (int64_t b = 0; b < nb; ++b, g += bb) {
            uint8_t* q = qp + 64 * 8 * b + 32 * half;
            float* s = sc + kLanes * b + kPackRows * half;
            float* o = off + kLanes * b + kPackRows * half;
            if (!present) {
                for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * j), _mm256_setzero_si256());
                _mm256_storeu_ps(s, _mm256_setzero_ps());
                _mm256_storeu_ps(o, _mm256_setzero_ps());
                continue;
            }
            const __m256 d = load_halves(g);
            _mm256_storeu_ps(s, d);
            if (t == DType::Q8_0) {
                for (int j = 0; j < 8; ++j)
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * j),
                                        _mm256_xor_si256(load_v(g + 16 + 32 * j), _mm256_set1_epi8(static_cast<char>(0x80))));
                _mm256_storeu_ps(o, _mm256_mul_ps(d, _mm256_set1_ps(128.f)));
                continue;
            }
            for (int j = 0; j < 4; ++j) {
                const __m256i v = load_v(g + scales + 32 * j);
                __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (t == DType::Q5_0) {
                    __m256i h_lo, h_hi;
                    fifth_bits_x8(load_v(g + 16), j, &h_lo, &h_hi);
                    lo = _mm256_or_si256(lo, h_lo);
                    hi = _mm256_or_si256(hi, h_hi);
                }
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * j), lo);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * (4 + j)), hi);
            }
            // Q4_1's offset is -m (x = d q + m); Q4_0's 8 d, Q5_0's 16 d: exact products, as int_view_row's.
            _mm256_storeu_ps(o, t == DType::Q4_1 ? _mm256_sub_ps(_mm256_setzero_ps(), load_halves(g + 16))
                                                 : _mm256_mul_ps(d, _mm256_set1_ps(t == DType::Q5_0 ? 16.f : 8.f)));
        }
    }
}

template <int B>
EV_VNNI512 void tiles(const MatmulArgs& a, const uint8_t* qp, const float* sc, const float* off, int64_t r, int nr) {
    const int64_t nsub = a.k / B;
    for (int64_t t = 0; t < a.m; t += kMaxTile) {
        const uint8_t* xp = a.xp + t * a.xp_stride;
        float* y = a.y + t * a.y_stride + r;
        switch (std::min<int64_t>(kMaxTile, a.m - t)) {
        case 1: tile<1, B>(qp, sc, off, nsub, xp, a.xp_stride, y, a.y_stride, nr); break;
        case 2: tile<2, B>(qp, sc, off, nsub, xp, a.xp_stride, y, a.y_stride, nr); break;
        case 3: tile<3, B>(qp, sc, off, nsub, xp, a.xp_stride, y, a.y_stride, nr); break;
        case 4: tile<4, B>(qp, sc, off, nsub, xp, a.xp_stride, y, a.y_stride, nr); break;
        case 5: tile<5, B>(qp, sc, off, nsub, xp, a.xp_stride, y, a.y_stride, nr); break;
        case 6: tile<6, B>(qp, sc, off, nsub, xp, a.xp_stride, y, a.y_stride, nr); break;
        case 7: tile<7, B>(qp, sc, off, nsub, xp, a.xp_stride, y, a.y_stride, nr); break;
        default: tile<8, B>(qp, sc, off, nsub, xp, a.xp_stride, y, a.y_stride, nr); break;
        }
    }
}

}  // namespace

// The operator table's registry (optable.cpp) names it.
const ActPrep kActQ8Blocks{"q8blocks", 1, q8blocks_row_bytes, q8blocks_prep};

// Scratch (kMatmulScratchRows * k floats = 196 k bytes): the panel's quants (16 k bytes), its
// scales and offsets (2 x 16 x k / 16 floats at most: 8 k bytes), one row's view (k bytes and
// 2 x k / 16 floats) and one row unpacked from the x8 layout (under 1.1 k bytes).
EV_VNNI512 void matmul_avx512vnni_q8act_gemm(const MatmulArgs& a) {
    if (!a.xp) return;  // the runtime always converts the activations first (MatmulChoice::act)
    const int B = int_view_block(a.wtype);
    if (B == 0 || a.k % kQK != 0) return;  // the table never routes other formats here
    const int64_t k = a.k, nsub = k / B;
    uint8_t* base = reinterpret_cast<uint8_t*>(a.scratch);
    uint8_t* qp = base;
    float* sc = reinterpret_cast<float*>(qp + kLanes * k);
    float* off = sc + kLanes * nsub;
    uint8_t* rq = reinterpret_cast<uint8_t*>(off + kLanes * nsub);
    float* rsc = reinterpret_cast<float*>(rq + k);
    float* roff = rsc + nsub;
    uint8_t* unpacked = reinterpret_cast<uint8_t*>(roff + nsub);
    for (int64_t r = a.row0; r < a.row1; r += kLanes) {
        const int nr = static_cast<int>(std::min<int64_t>(kLanes, a.row1 - r));
        if (x8_direct(a, r)) {
            fill_from_x8(a, r, nr, qp, sc, off);
            tiles<kQK>(a, qp, sc, off, r, nr);
            continue;
        }
        for (int i = 0; i < kLanes; ++i) {
            if (i < nr) {
                const void* row = static_cast<const uint8_t*>(a.w) + static_cast<size_t>(r + i) * a.w_row_bytes;
                if (a.w_layout == WLayout::kX8) {
                    x8_unpack_row(a.wtype, a.w, k, r + i, unpacked);
                    row = unpacked;
                }
                int_view_row(a.wtype, row, k, rq, rsc, roff);
            } else {
                std::memset(rq, 0, static_cast<size_t>(k));
                std::fill(rsc, rsc + nsub, 0.f);
                std::fill(roff, roff + nsub, 0.f);
            }
            for (int64_t g = 0; g < k / 4; ++g) std::memcpy(qp + 64 * g + 4 * i, rq + 4 * g, 4);
            for (int64_t s = 0; s < nsub; ++s) {
                sc[kLanes * s + i] = rsc[s];
                off[kLanes * s + i] = roff[s];
            }
        }
        if (B == kQK)
            tiles<kQK>(a, qp, sc, off, r, nr);
        else
            tiles<16>(a, qp, sc, off, r, nr);
    }
}

EV_VNNI512 void matmul_avx512vnni_q8act_gemm_ymm(const MatmulArgs& a) { q8u_evex::gemm(a); }

}  // namespace evk
#endif
