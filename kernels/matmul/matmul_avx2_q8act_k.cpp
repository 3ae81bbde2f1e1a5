// AVX2 decode kernel for Q5_0, Q5_1, IQ4_NL and the K-quants Q2_K..Q6_K: `avx2_q8act_k`. Weight
// rows are read in place (the file's layout, kquant_avx2.h unpacks them), activations quantized
// once per call to int8 blocks of 32 (q8act_avx2.h); the body is q8act_k_body.inc with kVnni =
// false: maddubs + madd for the integer dots. Notes and numbers: docs/kernels/decode-kquants.md.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "../ops.h"
#include "kquant_avx2.h"
#include "q8act_avx2.h"

namespace evk {

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace k_avx2 {
using namespace kq;
using q8act::BlockQ8A;
using q8act::quantize_act;
constexpr bool kVnni = false;
#define EVK_DPBUSD _mm256_dpbusd_avx_epi32
#include "q8act_k_body.inc"
#undef EVK_DPBUSD
}  // namespace k_avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// a.w: the file's rows; scratch: one token's activation blocks and their scales (q8act_k_body.inc).
__attribute__((target("avx2,fma,f16c"))) void matmul_avx2_q8act_k(const MatmulArgs& a) { k_avx2::dispatch(a); }

}  // namespace evk
#endif
