// Arm NEON Gated DeltaNet operators, 4 floats at a time; baseline armv8-a. The delta rule walks
// the state in blocks of 16 columns over all of a call's tokens, as deltanet_avx2.cpp describes
// (two accumulators per vector, even and odd rows); the dv mod 4 last columns, and the other
// operators' tails, run one float at a time with the same fused arithmetic. Every sum's order
// depends on the sizes only: a prompt split into calls gives bit-equal results.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cmath>

#include "../elementwise/exp_neon.h"
#include "../ops.h"

namespace evk {

namespace {

// Columns [j0, j0 + 4 kNV) of the state (rows dv floats apart) over all tokens.
template <int kNV>
void delta_block(float* S, const float* q, const float* k, int64_t qk_stride, const float* v, int64_t v_stride,
                 const float* g, const float* beta, int64_t gb_stride, int64_t n_tokens, int64_t dk, int64_t dv, float* out,
                 int64_t out_stride, int64_t j0) {
    float* Sb = S + j0;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* kt = k + t * qk_stride;
        const float* qt = q + t * qk_stride;
        const float dec = std::exp(g[t * gb_stride]);
        float32x4_t a0[kNV], a1[kNV];
        for (int u = 0; u < kNV; ++u) a0[u] = a1[u] = vdupq_n_f32(0.f);
        int64_t i = 0;
        for (; i + 2 <= dk; i += 2)
            for (int u = 0; u < kNV; ++u) {
                a0[u] = vfmaq_n_f32(a0[u], vld1q_f32(Sb + i * dv + 4 * u), kt[i]);
                a1[u] = vfmaq_n_f32(a1[u], vld1q_f32(Sb + (i + 1) * dv + 4 * u), kt[i + 1]);
            }
        if (i < dk)
            for (int u = 0; u < kNV; ++u) a0[u] = vfmaq_n_f32(a0[u], vld1q_f32(Sb + i * dv + 4 * u), kt[i]);
        float32x4_t delta[kNV];
        const float* vt = v + t * v_stride + j0;
        for (int u = 0; u < kNV; ++u) {
            delta[u] = vmulq_n_f32(vfmsq_n_f32(vld1q_f32(vt + 4 * u), vaddq_f32(a0[u], a1[u]), dec), beta[t * gb_stride]);
            a0[u] = a1[u] = vdupq_n_f32(0.f);
        }
        for (i = 0; i < dk; ++i) {
            float* r = Sb + i * dv;
            float32x4_t* acc = i % 2 ? a1 : a0;
            for (int u = 0; u < kNV; ++u) {
                const float32x4_t s = vfmaq_n_f32(vmulq_n_f32(vld1q_f32(r + 4 * u), dec), delta[u], kt[i]);
                vst1q_f32(r + 4 * u, s);
                acc[u] = vfmaq_n_f32(acc[u], s, qt[i]);
            }
        }
        float* ot = out + t * out_stride + j0;
        for (int u = 0; u < kNV; ++u) vst1q_f32(ot + 4 * u, vaddq_f32(a0[u], a1[u]));
    }
}

// One column j over all tokens, the arithmetic of a lane of delta_block.
void delta_column(float* S, const float* q, const float* k, int64_t qk_stride, const float* v, int64_t v_stride,
                  const float* g, const float* beta, int64_t gb_stride, int64_t n_tokens, int64_t dk, int64_t dv, float* out,
                  int64_t out_stride, int64_t j) {
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* kt = k + t * qk_stride;
        const float* qt = q + t * qk_stride;
        const float dec = std::exp(g[t * gb_stride]);
        float a[2] = {0.f, 0.f};
        for (int64_t i = 0; i < dk; ++i) a[i % 2] = std::fma(S[i * dv + j], kt[i], a[i % 2]);
        const float delta = std::fma(-(a[0] + a[1]), dec, v[t * v_stride + j]) * beta[t * gb_stride];
        a[0] = a[1] = 0.f;
        for (int64_t i = 0; i < dk; ++i) {
            float& s = S[i * dv + j];
            s = std::fma(delta, kt[i], s * dec);
            a[i % 2] = std::fma(s, qt[i], a[i % 2]);
        }
        out[t * out_stride + j] = a[0] + a[1];
    }
}

// Sum of x[i]^2: element i into lane i mod 4 of accumulator (i / 4) mod 4, the tail one at a time
// into a scalar; then the accumulators pairwise, the lanes, the tail.
float sum_squares4(const float* x, int64_t n) {
    float32x4_t acc[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int u = 0; u < 4; ++u) {
            const float32x4_t a = vld1q_f32(x + i + 4 * u);
            acc[u] = vfmaq_f32(acc[u], a, a);
        }
    for (int u = 0; i + 4 <= n; i += 4, ++u) {
        const float32x4_t a = vld1q_f32(x + i);
        acc[u] = vfmaq_f32(acc[u], a, a);
    }
    float tail = 0.f;
    for (; i < n; ++i) tail = std::fma(x[i], x[i], tail);
    return vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]))) + tail;
}

inline float sigmoid1(float z) {
    const float t = std::exp(-std::fabs(z));
    return (z < 0.f ? t : 1.f) / (1.f + t);
}

}  // namespace

void delta_rule_neon(float* S, const float* q, const float* k, int64_t qk_stride, const float* v, int64_t v_stride,
                     const float* g, const float* beta, int64_t gb_stride, int64_t n_tokens, int64_t dk, int64_t dv,
                     float* out, int64_t out_stride) {
    int64_t j0 = 0;
    for (; j0 + 16 <= dv; j0 += 16)
        delta_block<4>(S, q, k, qk_stride, v, v_stride, g, beta, gb_stride, n_tokens, dk, dv, out, out_stride, j0);
    for (; j0 + 4 <= dv; j0 += 4)
        delta_block<1>(S, q, k, qk_stride, v, v_stride, g, beta, gb_stride, n_tokens, dk, dv, out, out_stride, j0);
    for (; j0 < dv; ++j0)
        delta_column(S, q, k, qk_stride, v, v_stride, g, beta, gb_stride, n_tokens, dk, dv, out, out_stride, j0);
}

// Token by token, each token's row across the channels (blocks of 4, then one at a time), the
// state's columns as the window (deltanet_ref.cpp): the rows stream in order.
void causal_conv1d_neon(const float* x, int64_t x_stride, int64_t n_tokens, int64_t channels, const float* w, int64_t K,
                        float* state, float* y, int64_t y_stride) {
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* xt = x + t * x_stride;
        float* yt = y + t * y_stride;
        int64_t c = 0;
        for (; c + 4 <= channels; c += 4) {
            const float32x4_t xv = vld1q_f32(xt + c);
            float32x4_t acc = vmulq_f32(vld1q_f32(w + (K - 1) * channels + c), xv);
            for (int64_t j = 0; j + 1 < K; ++j)
                acc = vfmaq_f32(acc, vld1q_f32(w + j * channels + c), vld1q_f32(state + j * channels + c));
            for (int64_t j = 0; j + 2 < K; ++j) vst1q_f32(state + j * channels + c, vld1q_f32(state + (j + 1) * channels + c));
            if (K > 1) vst1q_f32(state + (K - 2) * channels + c, xv);
            vst1q_f32(yt + c, vmulq_f32(acc, sigmoid4(acc)));
        }
        for (; c < channels; ++c) {
            const float xc = xt[c];
            float acc = w[(K - 1) * channels + c] * xc;
            for (int64_t j = 0; j + 1 < K; ++j) acc = std::fma(w[j * channels + c], state[j * channels + c], acc);
            for (int64_t j = 0; j + 2 < K; ++j) state[j * channels + c] = state[(j + 1) * channels + c];
            if (K > 1) state[(K - 2) * channels + c] = xc;
            yt[c] = acc * sigmoid1(acc);
        }
    }
}

void l2norm_neon(const float* x, float* y, int64_t n, float eps) {
    const float inv = 1.f / std::sqrt(sum_squares4(x, n) + eps);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vmulq_n_f32(vld1q_f32(x + i), inv));
    for (; i < n; ++i) y[i] = x[i] * inv;
}

void rmsnorm_gated_neon(const float* x, const float* w, const float* z, float* y, int64_t n, float eps) {
    const float scale = 1.f / std::sqrt(sum_squares4(x, n) / static_cast<float>(n) + eps);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t zz = vld1q_f32(z + i);
        const float32x4_t xs = vmulq_f32(vmulq_n_f32(vld1q_f32(x + i), scale), vld1q_f32(w + i));
        vst1q_f32(y + i, vmulq_f32(xs, vmulq_f32(zz, sigmoid4(zz))));
    }
    for (; i < n; ++i) y[i] = x[i] * scale * w[i] * (z[i] * sigmoid1(z[i]));
}

void sigmoid_mul_neon(float* x, const float* g, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(x + i, vmulq_f32(vld1q_f32(x + i), sigmoid4(vld1q_f32(g + i))));
    for (; i < n; ++i) x[i] *= sigmoid1(g[i]);
}

}  // namespace evk
#endif
