// Arm NEON element-wise operators: the residual add, 4 floats at a time (the reference's one
// rounding per element); baseline armv8-a.
#if defined(__aarch64__)
#include <arm_neon.h>

#include "../ops.h"

namespace evk {

void add_neon(float* a, const float* b, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j += 4) vst1q_f32(a + i + j, vaddq_f32(vld1q_f32(a + i + j), vld1q_f32(b + i + j)));
    for (; i + 4 <= n; i += 4) vst1q_f32(a + i, vaddq_f32(vld1q_f32(a + i), vld1q_f32(b + i)));
    for (; i < n; ++i) a[i] += b[i];
}

}  // namespace evk
#endif
