// Arm NEON rotary embedding (both pair layouts), 4 pairs at a time; baseline armv8-a. The last
// pairs (fewer than 4) are gathered into zero-padded vectors and go through the same arithmetic.
#if defined(__aarch64__)
#include <arm_neon.h>

#include "../ops.h"

namespace evk {

namespace {

// The rotation of (a, b) by (c, s) as rope_avx2 writes it: a' = fma(a, c, -(b s)),
// b' = fma(b, c, a s).
inline void rotate(float32x4_t a, float32x4_t b, float32x4_t c, float32x4_t s, float32x4_t* a2, float32x4_t* b2) {
    *a2 = vfmaq_f32(vnegq_f32(vmulq_f32(b, s)), a, c);
    *b2 = vfmaq_f32(vmulq_f32(a, s), b, c);
}

}  // namespace

void rope_neon(float* x, int64_t n_heads, int64_t head_dim, int64_t rope_dims, const float* cs, bool neox) {
    const int64_t half = rope_dims / 2;
    // vld2q splits 4 (cos, sin) pairs into a cos and a sin vector; for the normal layout it splits
    // x's 4 pairs the same way, and vst2q interleaves them back.
    int64_t i = 0;
    for (; i + 4 <= half; i += 4) {
        const float32x4x2_t t = vld2q_f32(cs + 2 * i);
        for (int64_t h = 0; h < n_heads; ++h) {
            float* xh = x + h * head_dim;
            float32x4_t a2, b2;
            if (neox) {
                rotate(vld1q_f32(xh + i), vld1q_f32(xh + i + half), t.val[0], t.val[1], &a2, &b2);
                vst1q_f32(xh + i, a2);
                vst1q_f32(xh + i + half, b2);
            } else {
                const float32x4x2_t p = vld2q_f32(xh + 2 * i);
                float32x4x2_t o;
                rotate(p.val[0], p.val[1], t.val[0], t.val[1], &o.val[0], &o.val[1]);
                vst2q_f32(xh + 2 * i, o);
            }
        }
    }
    if (i == half) return;
    // The last rem < 4 pairs: gathered into zero-padded vectors, the same arithmetic.
    const int64_t rem = half - i;
    float c[4] = {0.f, 0.f, 0.f, 0.f}, s[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t k = 0; k < rem; ++k) c[k] = cs[2 * (i + k)], s[k] = cs[2 * (i + k) + 1];
    const float32x4_t vc = vld1q_f32(c), vs = vld1q_f32(s);
    for (int64_t h = 0; h < n_heads; ++h) {
        float* xh = x + h * head_dim;
        float a[4] = {0.f, 0.f, 0.f, 0.f}, b[4] = {0.f, 0.f, 0.f, 0.f};
        for (int64_t k = 0; k < rem; ++k) {
            a[k] = neox ? xh[i + k] : xh[2 * (i + k)];
            b[k] = neox ? xh[i + k + half] : xh[2 * (i + k) + 1];
        }
        float32x4_t a2, b2;
        rotate(vld1q_f32(a), vld1q_f32(b), vc, vs, &a2, &b2);
        vst1q_f32(a, a2);
        vst1q_f32(b, b2);
        for (int64_t k = 0; k < rem; ++k) {
            (neox ? xh[i + k] : xh[2 * (i + k)]) = a[k];
            (neox ? xh[i + k + half] : xh[2 * (i + k) + 1]) = b[k];
        }
    }
}

}  // namespace evk
#endif
