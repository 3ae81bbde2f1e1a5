// Packed decode kernels for Q4_0, Q4_1, Q8_0, Q5_0, Q4_K and Q6_K on x86 (Q5_0: docs/kernels/decode-kquants.md; Q4_K, Q6_K:
// decode-kquants-x8.md): weights in the x8 layout (packed_x8.h),
// activations quantized once per call to int8 blocks (q8act_avx2.h). Per group of 8 rows and
// block of 32 columns, the integer dot leaves row r's sum in 32-bit lane r, so one conversion and
// one or two FMAs finish the block for all 8 rows (avx2_q8act needs them per row, plus a
// horizontal sum per row at the end).
//   avx2_q8act_x8:    maddubs (u8 x s8 -> s16 pairs); for the 4-bit formats the eight s16
//                     products of a block are summed in 16 bits (|each| <= 2 * 15 * 127, eight of
//                     them <= 30480 < 32767) before one madd; Q8_0 uses the sign trick and a madd
//                     per vector (one product can reach 2 * 128 * 127 = 32512).
//   avxvnni_q8act_x8: dpbusd (u8 x s8, summed in 32 bits: no saturation); Q8_0 weights are made
//                     unsigned by w ^ 0x80 = w + 128 and 128 * sum(q) is subtracted per block.
// Bytes and flops per decoded token are those of avx2_q8act (docs/kernels/decode-int8.md); the
// point is fewer instructions per weight: ~47 (AVX2) / ~31 (VNNI) uops per 256 Q4 weights against
// ~136 for avx2_q8act (docs/kernels/decode-x8.md). This file holds avx2_q8act_x8; the same body
// (x8_body.inc) with kVnni = true is avxvnni_q8act_x8 in matmul_avxvnni_q8act_x8.cpp.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../ops.h"
#include "packed_x8.h"
#include "q8act_avx2.h"

namespace evk {

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace x8_avx2 {
using q8act::BlockQ8A;
using q8act::quantize_act;
constexpr bool kVnni = false;
#define EVK_DPBUSD _mm256_dpbusd_avx_epi32  // never instantiated: kVnni is false
#include "x8_body.inc"
#undef EVK_DPBUSD
}  // namespace x8_avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// a.w is the x8-packed weight; scratch: one token's activation blocks (k / 32 x 44 bytes).
EV_AVX2 void matmul_avx2_q8act_x8(const MatmulArgs& a) { x8_avx2::dispatch(a); }

}  // namespace evk
#endif
