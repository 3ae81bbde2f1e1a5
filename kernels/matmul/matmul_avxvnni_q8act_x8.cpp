// Packed decode kernel for Q4_0, Q4_1, Q8_0, Q5_0, Q4_K and Q6_K with AVX-VNNI: `avxvnni_q8act_x8`, the body of
// avx2_q8act_x8 (x8_body.inc, described in matmul_avx2_q8act_x8.cpp) compiled with kVnni = true:
// dpbusd (u8 x s8, summed in 32 bits: no saturation); Q8_0 weights are made unsigned by
// w ^ 0x80 = w + 128 and 128 * sum(q) is subtracted per block.
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
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif
namespace x8_vnni {
using q8act::BlockQ8A;
using q8act::quantize_act;
constexpr bool kVnni = true;
#define EVK_DPBUSD _mm256_dpbusd_avx_epi32  // VEX-encoded (AVX-VNNI)
#include "x8_body.inc"
#undef EVK_DPBUSD
}  // namespace x8_vnni
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// a.w is the x8-packed weight; scratch: one token's activation blocks (k / 32 x 44 bytes).
__attribute__((target("avx2,fma,f16c,avxvnni"))) void matmul_avxvnni_q8act_x8(const MatmulArgs& a) { x8_vnni::dispatch(a); }

}  // namespace evk
#endif
