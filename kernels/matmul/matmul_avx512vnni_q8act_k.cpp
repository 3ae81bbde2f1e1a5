// AVX512-VNNI decode kernel for Q5_0, Q5_1, IQ4_NL and Q2_K..Q6_K: `avx512vnni_q8act_k`, the body
// of avx2_q8act_k (q8act_k_body.inc) with kVnni = true and the EVEX vpdpbusd on ymm (AVX512-VL),
// for CPUs with AVX512-VNNI but no AVX-VNNI (Ice Lake, Cascade Lake, Zen 4). Untested on hardware
// here (the CI machine has AVX2 only); every line but the dot instruction is the AVX2 kernel's.
#if defined(__x86_64__)
#include "avx512_intrin.h"  // first: <immintrin.h> without GCC 12's false warnings

#include <cmath>
#include <cstring>

#include "../ops.h"
#include "kquant_avx2.h"
#include "q8act_avx2.h"

namespace evk {

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif
namespace k_avx512vnni {
using namespace kq;
using q8act::BlockQ8A;
using q8act::quantize_act;
constexpr bool kVnni = true;
#define EVK_DPBUSD _mm256_dpbusd_epi32
#include "q8act_k_body.inc"
#undef EVK_DPBUSD
}  // namespace k_avx512vnni
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// a.w: the file's rows; scratch: one token's activation blocks and their scales (q8act_k_body.inc).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) void matmul_avx512vnni_q8act_k(const MatmulArgs& a) { k_avx512vnni::dispatch(a); }

}  // namespace evk
#endif
