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

// The first maximum (argmax_ref's): the largest value over 4 independent vector chains (a NaN
// noted on the way sends the search to the first NaN instead), then the first index holding it.
int64_t argmax_neon(const float* x, int64_t n) {
    if (n <= 0) return 0;
    float32x4_t m0 = vdupq_n_f32(x[0]), m1 = m0, m2 = m0, m3 = m0;
    uint32x4_t ok = vdupq_n_u32(0xffffffffu);  // lanes that saw no NaN
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const float32x4_t a = vld1q_f32(x + i), b = vld1q_f32(x + i + 4), c = vld1q_f32(x + i + 8), d = vld1q_f32(x + i + 12);
        m0 = vmaxnmq_f32(m0, a), m1 = vmaxnmq_f32(m1, b), m2 = vmaxnmq_f32(m2, c), m3 = vmaxnmq_f32(m3, d);
        ok = vandq_u32(ok, vandq_u32(vandq_u32(vceqq_f32(a, a), vceqq_f32(b, b)), vandq_u32(vceqq_f32(c, c), vceqq_f32(d, d))));
    }
    float mx = vmaxnmvq_f32(vmaxnmq_f32(vmaxnmq_f32(m0, m1), vmaxnmq_f32(m2, m3)));
    bool any_nan = vminvq_u32(ok) == 0 || x[0] != x[0];
    for (; i < n; ++i) {
        any_nan = any_nan || x[i] != x[i];
        mx = x[i] > mx ? x[i] : mx;
    }
    if (any_nan) return argmax_ref(x, n);  // the first NaN
    const float32x4_t vm = vdupq_n_f32(mx);
    for (i = 0; i + 16 <= n; i += 16) {
        const uint32x4_t h = vorrq_u32(vorrq_u32(vceqq_f32(vld1q_f32(x + i), vm), vceqq_f32(vld1q_f32(x + i + 4), vm)),
                                       vorrq_u32(vceqq_f32(vld1q_f32(x + i + 8), vm), vceqq_f32(vld1q_f32(x + i + 12), vm)));
        if (vmaxvq_u32(h) != 0) break;  // the first hit is among these 16
    }
    for (; i < n; ++i)
        if (x[i] == mx) return i;
    return 0;  // not reached: mx is one of the elements
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
