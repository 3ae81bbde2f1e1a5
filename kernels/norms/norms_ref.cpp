// Reference norms: rmsnorm and layernorm (sums in double).
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

}  // namespace evk
