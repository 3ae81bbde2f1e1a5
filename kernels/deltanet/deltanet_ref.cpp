// Reference Gated DeltaNet operators (the ground truth of the tests and the fallback of every
// CPU): causal conv1d, the recurrent gated delta rule, l2norm, gated RMSNorm, the sigmoid gate.
// Dot products and norms sum in double, in increasing index order; the state stays float.
#include <cmath>

#include "../ops.h"

namespace evk {

namespace {
inline float silu1(float x) { return x / (1.f + std::exp(-x)); }
}  // namespace

// Per channel, the state column is the window: y = w . (window ++ x[t]), then the window shifts
// by one (x[t] is read before y[t] is written, so y may be x).
void causal_conv1d_ref(const float* x, int64_t x_stride, int64_t n_tokens, int64_t channels, const float* w,
                       int64_t K, float* state, float* y, int64_t y_stride) {
    for (int64_t c = 0; c < channels; ++c) {
        for (int64_t t = 0; t < n_tokens; ++t) {
            const float xt = x[t * x_stride + c];
            double acc = static_cast<double>(w[(K - 1) * channels + c]) * xt;
            for (int64_t j = 0; j + 1 < K; ++j) acc += static_cast<double>(w[j * channels + c]) * state[j * channels + c];
            for (int64_t j = 0; j + 2 < K; ++j) state[j * channels + c] = state[(j + 1) * channels + c];
            if (K > 1) state[(K - 2) * channels + c] = xt;
            y[t * y_stride + c] = silu1(static_cast<float>(acc));
        }
    }
}

// Token by token, as transformers' torch_recurrent_gated_delta_rule: the decay folds into the
// read (kv = exp(g) S^T k) and the update (S = exp(g) S + k delta^T), the output reads the new S.
void delta_rule_ref(float* S, const float* q, const float* k, int64_t qk_stride, const float* v, int64_t v_stride,
                    const float* g, const float* beta, int64_t gb_stride, int64_t n_tokens, int64_t dk, int64_t dv,
                    float* out, int64_t out_stride) {
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* qt = q + t * qk_stride;
        const float* kt = k + t * qk_stride;
        const float* vt = v + t * v_stride;
        float* ot = out + t * out_stride;
        const float decay = std::exp(g[t * gb_stride]);
        const float b = beta[t * gb_stride];
        for (int64_t j = 0; j < dv; ++j) {
            double kv = 0.0;
            for (int64_t i = 0; i < dk; ++i) kv += static_cast<double>(S[i * dv + j]) * kt[i];
            const float delta = (vt[j] - decay * static_cast<float>(kv)) * b;
            double o = 0.0;
            for (int64_t i = 0; i < dk; ++i) {
                float& s = S[i * dv + j];
                s = decay * s + kt[i] * delta;
                o += static_cast<double>(s) * qt[i];
            }
            ot[j] = static_cast<float>(o);
        }
    }
}

void l2norm_ref(const float* x, float* y, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss + eps));
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv;
}

void rmsnorm_gated_ref(const float* x, const float* w, const float* z, float* y, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i] * silu1(z[i]);
}

void sigmoid_mul_ref(float* x, const float* g, int64_t n) {
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-g[i]));
}

}  // namespace evk
