// Reference element-wise operators: activations, softmax, the residual add.
#include <cmath>

#include "../ops.h"

namespace evk {

void silu_mul_ref(float* a, const float* b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) a[i] = a[i] / (1.f + std::exp(-a[i])) * b[i];
}

namespace {
// GELU in its tanh form (Hendrycks & Gimpel 2016): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline float gelu_tanh1(float x) {
    constexpr float kC = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * x * (1.f + std::tanh(kC * (x + 0.044715f * x * x * x)));
}
}  // namespace

void gelu_tanh_ref(float* a, int64_t n) {
    for (int64_t i = 0; i < n; ++i) a[i] = gelu_tanh1(a[i]);
}

// GeGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer"; Gemma's feed-forward).
void gelu_mul_ref(float* a, const float* b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) a[i] = gelu_tanh1(a[i]) * b[i];
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

int64_t argmax_ref(const float* x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (x[i] != x[i]) return i;  // the first NaN
        if (x[i] > x[best]) best = i;
    }
    return best;
}

}  // namespace evk
