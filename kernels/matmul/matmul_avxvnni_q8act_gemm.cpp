// Int8 GEMM on AVX-VNNI (ymm, VEX-encoded vpdpbusd): the robot-class CPU's int8 product for the
// vision tower when a user allows it (vision_int8). Notes, prediction and measurements:
// docs/kernels/vision-int8-gemm.md.
//
// The FP32 GEMM (avx2_gemm) does 8 multiply-adds an instruction; vpdpbusd on ymm does 32 (8 lanes x
// 4 byte products) with nothing expanded to float. Weights: the q8u copy (packed_q8u.h), one group of
// 8 rows per step, its vectors already the interleave vpdpbusd wants (one row's partial dot per
// lane) and already unsigned (+128): the inner loop is a load and N vpdpbusd. Activations: the
// "q8sums" format (q8blocks.h), converted once per product by the caller (q8sums_prep below). The body:
// q8u_gemm_body.inc (also compiled EVEX-encoded as avx512vnni_q8act_gemm_ymm).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "../ops.h"
#include "packed_q8u.h"
#include "q8act_avx2.h"
#include "q8blocks.h"

namespace evk {

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif
namespace q8u_vex {
#define EVK_DPBUSD _mm256_dpbusd_avx_epi32  // VEX-encoded (AVX-VNNI)
#include "q8u_gemm_body.inc"
#undef EVK_DPBUSD
}  // namespace q8u_vex
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

__attribute__((target("avx2,fma,f16c,avxvnni"))) void matmul_avxvnni_q8act_gemm(const MatmulArgs& a) { q8u_vex::gemm(a); }

namespace {

size_t q8sums_row_bytes(int64_t k) { return static_cast<size_t>((k + kQK - 1) / kQK) * sizeof(q8blocks::SumBlock); }

// Tokens [t0, t1) of x as SumBlocks; a last partial block zero-padded, tokens at or past m zeros.
void q8sums_prep(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t0, int64_t t1, void* dst) {
    const int64_t nb = (k + kQK - 1) / kQK;
    for (int64_t t = t0; t < t1; ++t) {
        auto* out = reinterpret_cast<q8blocks::SumBlock*>(static_cast<uint8_t*>(dst) + static_cast<size_t>(t) * q8sums_row_bytes(k));
        if (t >= m) {
            std::memset(static_cast<void*>(out), 0, q8sums_row_bytes(k));
            continue;
        }
        for (int64_t b = 0; b < nb; ++b) {
            const float* src = x + t * x_stride + b * kQK;
            float tail[kQK];
            if ((b + 1) * kQK > k) {
                std::fill(tail, tail + kQK, 0.f);
                std::copy(src, src + (k - b * kQK), tail);
                src = tail;
            }
            q8act::BlockQ8A blk;
            q8act::quantize_act(src, kQK, &blk);
            out[b].d = blk.d;
            out[b].bias = -128 * blk.sum;
            std::memcpy(out[b].qs, blk.qs, kQK);
        }
    }
}

}  // namespace

const ActPrep kActQ8Sums{"q8sums", 1, q8sums_row_bytes, q8sums_prep};

}  // namespace evk
#endif
