// Arm NEON element-wise operators: the residual add, 4 floats at a time (the reference's one
// rounding per element), and the GELU gate on a vector exp; baseline armv8-a.
#if defined(__aarch64__)
#include <arm_neon.h>

#include "../ops.h"
#include "exp_neon.h"

namespace evk {

namespace {

// 0.5 x (1 + tanh(y)) = x sigmoid(2y), y = sqrt(2/pi) (x + 0.044715 x^3); the sigmoid from
// exp(-|z|) only (t / (1 + t) for z < 0): no overflow, no cancellation.
inline float32x4_t gelu4(float32x4_t x) {
    const float32x4_t inner = vfmaq_f32(x, vmulq_f32(vdupq_n_f32(0.044715f), vmulq_f32(x, x)), x);
    const float32x4_t z = vmulq_f32(vdupq_n_f32(2.f * 0.7978845608028654f), inner);
    const float32x4_t t = exp4(vnegq_f32(vabsq_f32(z)));
    const float32x4_t one = vdupq_n_f32(1.f);
    const float32x4_t num = vbslq_f32(vcltq_f32(z, vdupq_n_f32(0.f)), t, one);
    return vmulq_f32(x, vdivq_f32(num, vaddq_f32(one, t)));
}

}  // namespace

void add_neon(float* a, const float* b, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j += 4) vst1q_f32(a + i + j, vaddq_f32(vld1q_f32(a + i + j), vld1q_f32(b + i + j)));
    for (; i + 4 <= n; i += 4) vst1q_f32(a + i, vaddq_f32(vld1q_f32(a + i), vld1q_f32(b + i)));
    for (; i < n; ++i) a[i] += b[i];
}

// a = gelu_tanh(a) * b (GeGLU); the tail (n % 4) through a 4-float copy with the same arithmetic.
void gelu_mul_neon(float* a, const float* b, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(a + i, vmulq_f32(gelu4(vld1q_f32(a + i)), vld1q_f32(b + i)));
    if (i < n) {
        float ta[4] = {0.f, 0.f, 0.f, 0.f}, tb[4] = {0.f, 0.f, 0.f, 0.f};
        for (int64_t j = 0; j < n - i; ++j) ta[j] = a[i + j], tb[j] = b[i + j];
        vst1q_f32(ta, vmulq_f32(gelu4(vld1q_f32(ta)), vld1q_f32(tb)));
        for (int64_t j = 0; j < n - i; ++j) a[i + j] = ta[j];
    }
}

}  // namespace evk
#endif
