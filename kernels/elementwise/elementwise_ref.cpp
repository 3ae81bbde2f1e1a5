// Reference element-wise operators: norms, rotary embedding, activations.
#include <cmath>

#include "../ops.h"

namespace evk {

void rmsnorm_ref(const float* x, const float* w, float* y, int64_t n, float eps) {
    double ss = 0.0;  // double: the mean of squares over thousands of elements loses bits in float
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
}

void layernorm_ref(const float* x, const float* w, const float* b, float* y, int64_t n, float eps) {
    double mean = 0.0;
    for (int64_t i = 0; i < n; ++i) mean += x[i];
    mean /= static_cast<double>(n);
    double var = 0.0;
    for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
    var /= static_cast<double>(n);
    const float inv = static_cast<float>(1.0 / std::sqrt(var + eps));
    for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i] - mean) * inv * w[i] + (b ? b[i] : 0.f);
}

void rope_angles(float pos, float theta_base, int64_t rope_dims, float* cs) {
    for (int64_t i = 0; i < rope_dims / 2; ++i) {
        const double theta = static_cast<double>(pos) *
                             std::pow(static_cast<double>(theta_base), -2.0 * static_cast<double>(i) / static_cast<double>(rope_dims));
        cs[2 * i] = static_cast<float>(std::cos(theta));
        cs[2 * i + 1] = static_cast<float>(std::sin(theta));
    }
}

void rope_ref(float* x, int64_t n_heads, int64_t head_dim, int64_t rope_dims, const float* cs, bool neox) {
    const int64_t half = rope_dims / 2;
    for (int64_t i = 0; i < half; ++i) {
        const float c = cs[2 * i], s = cs[2 * i + 1];
        for (int64_t h = 0; h < n_heads; ++h) {
            float* xh = x + h * head_dim;
            const int64_t i0 = neox ? i : 2 * i;
            const int64_t i1 = neox ? i + half : 2 * i + 1;
            const float a = xh[i0], b = xh[i1];
            xh[i0] = a * c - b * s;
            xh[i1] = a * s + b * c;
        }
    }
}

void silu_mul_ref(float* a, const float* b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) a[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
}

void gelu_tanh_ref(float* a, int64_t n) {
    constexpr float kC = 0.7978845608028654f;  // sqrt(2/pi)
    for (int64_t i = 0; i < n; ++i) {
        const float x = a[i];
        a[i] = 0.5f * x * (1.f + std::tanh(kC * (x + 0.044715f * x * x * x)));
    }
}

void softmax_ref(float* x, int64_t n, float scale) {
    float mx = x[0];
    for (int64_t i = 1; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
        x[i] = std::exp(scale * (x[i] - mx));
        sum += x[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

void add_ref(float* a, const float* b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

}  // namespace evk
