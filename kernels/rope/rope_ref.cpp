// Reference rotary embedding and the angles of a position.
#include <cmath>

#include "../ops.h"

namespace evk {

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

}  // namespace evk
