// Vector exp for the NEON kernels (element-wise operators, the Gated DeltaNet gates), 4 floats at
// a time; baseline armv8-a.
#pragma once
#if defined(__aarch64__)
#include <arm_neon.h>

#include "exp_poly.h"

namespace evk {

// exp(x) = 2^n e^r, n = round(x / ln2), r = x - n ln2 in two parts, e^r = 1 + r + r^2 q(r): the
// reduction and polynomial of exp_avx2.h's exp8 (its comment derives them; constants in
// exp_poly.h), 4 lanes. Inputs are clamped to [kExpMin, kExpMax] (n stays a normal exponent);
// below kExpMin the result is 0.
inline float32x4_t exp4(float32x4_t x) {
    const uint32x4_t under = vcltq_f32(x, vdupq_n_f32(kExpMin));
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(kExpMin)), vdupq_n_f32(kExpMax));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(kLog2e)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(kLn2Hi));
    r = vfmsq_f32(r, n, vdupq_n_f32(kLn2Lo));
    float32x4_t q = vdupq_n_f32(kExpQ[0]);
    for (int i = 1; i < 5; ++i) q = vfmaq_f32(vdupq_n_f32(kExpQ[i]), q, r);
    const float32x4_t er = vaddq_f32(vfmaq_f32(r, q, vmulq_f32(r, r)), vdupq_n_f32(1.f));
    const int32x4_t two_n = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    const float32x4_t y = vmulq_f32(er, vreinterpretq_f32_s32(two_n));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), under));
}

// 1 / (1 + exp(-z)) from exp(-|z|) only (no overflow, no cancellation): t / (1 + t) for z < 0.
inline float32x4_t sigmoid4(float32x4_t z) {
    const float32x4_t t = exp4(vnegq_f32(vabsq_f32(z)));
    const float32x4_t one = vdupq_n_f32(1.f);
    return vdivq_f32(vbslq_f32(vcltq_f32(z, vdupq_n_f32(0.f)), t, one), vaddq_f32(one, t));
}

}  // namespace evk
#endif
