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

size_t q8sums_row_bytes(int64_t k) { return q8blocks::row_bytes<q8blocks::SumBlock>(k); }

void q8sums_prep(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t0, int64_t t1, void* dst) {
    q8blocks::prep_rows<q8blocks::SumBlock>(x, x_stride, m, k, t0, t1, dst, [](const float* src, q8blocks::SumBlock& out) {
        q8act::BlockQ8A blk;
        q8act::quantize_act(src, kQK, &blk);
        out.d = blk.d;
        out.bias = -128 * blk.sum;
        std::memcpy(out.qs, blk.qs, kQK);
    });
}

}  // namespace

const ActPrep kActQ8Sums{"q8sums", 1, q8sums_row_bytes, q8sums_prep};

}  // namespace evk
#endif
