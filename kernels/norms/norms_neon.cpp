// Arm NEON norms (rmsnorm, layernorm), 4 floats at a time; baseline armv8-a. A tail of n mod 4 elements is copied into a zero-padded block of 4
// on the stack and goes through the same vector arithmetic (no scalar path to drift from it).
//
// Row sums in float lanes, in one fixed order that depends on n only: element i goes to partial
// sum i mod 16 (four 4-lane accumulators; block b = i / 4 to accumulator b mod 4), each partial in
// increasing i (squares by FMA), then (acc0 + acc1) + (acc2 + acc3) and the pairwise vaddvq over
// the 4 lanes. The tolerances against the scalar reference: docs/kernels/elementwise-norms.md.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cmath>
#include <cstring>

#include "../ops.h"

namespace evk {

namespace {

// The first rem (< 4) floats of p, zero-padded to a vector.
inline float32x4_t load_tail(const float* p, int64_t rem) {
    float t[4] = {0.f, 0.f, 0.f, 0.f};
    std::memcpy(t, p, static_cast<size_t>(rem) * sizeof(float));
    return vld1q_f32(t);
}

inline void store_tail(float* p, float32x4_t v, int64_t rem) {
    float t[4];
    vst1q_f32(t, v);
    std::memcpy(p, t, static_cast<size_t>(rem) * sizeof(float));
}

constexpr uint32_t kLaneIndex[4] = {0, 1, 2, 3};

enum class RowSum { kPlain, kSquares, kSquaredDeviations };

template <RowSum kWhat>
inline float32x4_t accumulate(float32x4_t acc, float32x4_t v) {
    return kWhat == RowSum::kPlain ? vaddq_f32(acc, v) : vfmaq_f32(acc, v, v);
}

template <RowSum kWhat>
float row_sum(const float* x, int64_t n, float mean) {
    const float32x4_t vm = vdupq_n_f32(mean);
    const bool dev = kWhat == RowSum::kSquaredDeviations;
    float32x4_t acc[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 4; ++j) {
            const float32x4_t v = vld1q_f32(x + i + 4 * j);
            acc[j] = accumulate<kWhat>(acc[j], dev ? vsubq_f32(v, vm) : v);
        }
    int j = 0;
    for (; i + 4 <= n; i += 4, ++j) {
        const float32x4_t v = vld1q_f32(x + i);
        acc[j] = accumulate<kWhat>(acc[j], dev ? vsubq_f32(v, vm) : v);
    }
    if (i < n) {
        // Lanes past n: 0 for the plain and squared sums; for the deviations, masked after the
        // subtraction (0 - mean must not count).
        float32x4_t v = load_tail(x + i, n - i);
        if (dev) {
            const uint32x4_t live = vcltq_u32(vld1q_u32(kLaneIndex), vdupq_n_u32(static_cast<uint32_t>(n - i)));
            v = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(vsubq_f32(v, vm)), live));
        }
        acc[j] = accumulate<kWhat>(acc[j], v);
    }
    return vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
}

}  // namespace

void rmsnorm_neon(const float* x, const float* w, float* y, int64_t n, float eps) {
    if (n <= 0) return;
    const double ss = row_sum<RowSum::kSquares>(x, n, 0.f);
    const float32x4_t s = vdupq_n_f32(static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps)));
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vmulq_f32(vmulq_f32(vld1q_f32(x + i), s), vld1q_f32(w + i)));
    if (i < n) store_tail(y + i, vmulq_f32(vmulq_f32(load_tail(x + i, n - i), s), load_tail(w + i, n - i)), n - i);
}

void layernorm_neon(const float* x, const float* w, const float* b, float* y, int64_t n, float eps) {
    if (n <= 0) return;
    const float mean = static_cast<float>(static_cast<double>(row_sum<RowSum::kPlain>(x, n, 0.f)) / static_cast<double>(n));
    const double var = static_cast<double>(row_sum<RowSum::kSquaredDeviations>(x, n, mean)) / static_cast<double>(n);
    const float32x4_t vm = vdupq_n_f32(mean), inv = vdupq_n_f32(static_cast<float>(1.0 / std::sqrt(var + eps)));
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float32x4_t d = vmulq_f32(vsubq_f32(vld1q_f32(x + i), vm), inv);
        vst1q_f32(y + i, b ? vfmaq_f32(vld1q_f32(b + i), d, vld1q_f32(w + i)) : vmulq_f32(d, vld1q_f32(w + i)));
    }
    if (i < n) {
        const int64_t rem = n - i;
        const float32x4_t d = vmulq_f32(vsubq_f32(load_tail(x + i, rem), vm), inv);
        store_tail(y + i, b ? vfmaq_f32(load_tail(b + i, rem), d, load_tail(w + i, rem)) : vmulq_f32(d, load_tail(w + i, rem)), rem);
    }
}

}  // namespace evk
#endif
