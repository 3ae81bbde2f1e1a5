// Int8 GEMM on Arm with FEAT_DotProd (sdot by lane): the vision tower's int8 products where a user
// allows them (vision_int8), as avxvnni_q8act_gemm on x86 (q8u_gemm_body.inc; notes:
// docs/kernels/vision-int8-gemm.md). The same q8u weights (packed_q8u.h: 8 rows interleaved by 4
// bytes, stored + 128, float scales) and q8sums activations (q8blocks.h); sdot multiplies signed
// bytes, so each weight vector is flipped back (XOR 0x80) once for all the tile's tokens and the
// activations' -128 sum (SumBlock::bias) is not needed: the int32 sums are the signed dot products.
// Per block and token, rows 0..3 and 4..7: 8 sdot each, then one float FMA.
// Each token's float steps are the same in the same order whatever the tile or the row range, and
// its integer sums are exact: a token's outputs do not depend on the tokens beside it.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "../ops.h"
#include "matmul_neon.h"
#include "packed_q8u.h"
#include "q8blocks.h"

namespace evk {

namespace {

using q8blocks::SumBlock;

size_t q8sums_row_bytes(int64_t k) { return q8blocks::row_bytes<SumBlock>(k); }

// neon::quantize_act's rounding, as the x86 prep's.
void q8sums_prep(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t0, int64_t t1, void* dst) {
    q8blocks::prep_rows<SumBlock>(x, x_stride, m, k, t0, t1, dst, [](const float* src, SumBlock& out) {
        neon::BlockQ8A blk;
        neon::quantize_act(src, kQK, &blk);
        int32_t sum = 0;
        for (int i = 0; i < kQK; ++i) sum += blk.qs[i];
        out.d = blk.d;
        out.bias = -128 * sum;
        std::memcpy(out.qs, blk.qs, kQK);
    });
}

constexpr int64_t kTokenBlock = 64;  // tokens whose activations stay in cache while the row range is swept
constexpr int kTile = 4;             // tokens per tile: 2 activation, 2 int and 2 float vectors each

// Tokens x[0..N) (SumBlock rows xs bytes apart) against one group of 8 rows (nb blocks at g);
// writes lanes [lo, hi) of each token's 8 outputs at y + n * ys.
template <int N>
__attribute__((target("arch=armv8.2-a+dotprod"))) void tile(const uint8_t* g, int64_t nb, const uint8_t* xp, int64_t xs,
                                                            float* y, int64_t ys, int lo, int hi) {
    const SumBlock* xb[N];
    for (int n = 0; n < N; ++n) xb[n] = reinterpret_cast<const SumBlock*>(xp + n * xs);
    const uint8x16_t flip = vdupq_n_u8(0x80);
    float32x4_t acc0[N], acc1[N];
    for (int n = 0; n < N; ++n) acc0[n] = acc1[n] = vdupq_n_f32(0.f);
    for (int64_t b = 0; b < nb; ++b, g += kQ8uBlockBytes) {
        int8x16_t x0[N], x1[N];
        int32x4_t p0[N], p1[N];  // rows 0..3, rows 4..7
        for (int n = 0; n < N; ++n) {
            x0[n] = vld1q_s8(xb[n][b].qs);
            x1[n] = vld1q_s8(xb[n][b].qs + 16);
            p0[n] = p1[n] = vdupq_n_s32(0);
        }
        for (int j = 0; j < 8; ++j) {
            const int8x16_t w0 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(g + 32 + 32 * j), flip));
            const int8x16_t w1 = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(g + 48 + 32 * j), flip));
            for (int n = 0; n < N; ++n) {
                neon::dot_lane_pair(p0[n], p1[n], w0, w1, j < 4 ? x0[n] : x1[n], j % 4);
            }
        }
        float d[8];
        std::memcpy(d, g, sizeof d);
        const float32x4_t d0 = vld1q_f32(d), d1 = vld1q_f32(d + 4);
        for (int n = 0; n < N; ++n) {
            acc0[n] = vfmaq_f32(acc0[n], vcvtq_f32_s32(p0[n]), vmulq_n_f32(d0, xb[n][b].d));
            acc1[n] = vfmaq_f32(acc1[n], vcvtq_f32_s32(p1[n]), vmulq_n_f32(d1, xb[n][b].d));
        }
    }
    for (int n = 0; n < N; ++n) {
        float out[8];
        vst1q_f32(out, acc0[n]);
        vst1q_f32(out + 4, acc1[n]);
        std::copy(out + lo, out + hi, y + n * ys + lo);
    }
}

}  // namespace

const ActPrep kActQ8Sums{"q8sums", 1, q8sums_row_bytes, q8sums_prep};

// a.w is the q8u copy, a.xp the q8sums activations; rows [row0, row1) may start and end anywhere.
__attribute__((target("arch=armv8.2-a+dotprod"))) void matmul_neon_q8act_gemm(const MatmulArgs& a) {
    if (!a.xp || a.w_layout != WLayout::kQ8U) return;  // the registry never routes others here
    const int64_t nb = (a.k + kQK - 1) / kQK;
    const size_t group_bytes = static_cast<size_t>(nb) * kQ8uBlockBytes;
    for (int64_t t0 = 0; t0 < a.m; t0 += kTokenBlock) {
        const int64_t t1 = std::min(a.m, t0 + kTokenBlock);
        for (int64_t grp = a.row0 / 8; grp * 8 < a.row1; ++grp) {
            const int lo = static_cast<int>(std::max<int64_t>(a.row0 - grp * 8, 0));
            const int hi = static_cast<int>(std::min<int64_t>(a.row1 - grp * 8, 8));
            const uint8_t* g = static_cast<const uint8_t*>(a.w) + static_cast<size_t>(grp) * group_bytes;
            for (int64_t t = t0; t < t1; t += kTile) {
                const uint8_t* xp = a.xp + t * a.xp_stride;
                float* y = a.y + t * a.y_stride + grp * 8;
                switch (std::min<int64_t>(kTile, t1 - t)) {
                case 1: tile<1>(g, nb, xp, a.xp_stride, y, a.y_stride, lo, hi); break;
                case 2: tile<2>(g, nb, xp, a.xp_stride, y, a.y_stride, lo, hi); break;
                case 3: tile<3>(g, nb, xp, a.xp_stride, y, a.y_stride, lo, hi); break;
                default: tile<4>(g, nb, xp, a.xp_stride, y, a.y_stride, lo, hi); break;
                }
            }
        }
    }
}

}  // namespace evk
#endif
