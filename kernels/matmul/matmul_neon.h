// Shared by the Arm NEON matmul files: the int8 activation blocks of the q8act kernels
// (matmul_neon.cpp) and the kernels of the formats decoded in matmul_neon_formats.cpp (Q5_0,
// Q5_1, IQ4_NL, Q2_K..Q6_K), which matmul_neon_f32act and matmul_neon_q8act_dot call per row.
#pragma once
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstdint>

#include "../formats/formats.h"

namespace evk {
namespace neon {

// One block of 32 activations as int8: x ~ d * qs, s = d * sum(qs) (for the formats with a min).
struct BlockQ8A {
    float d, s;
    int8_t qs[kQK];
};

// k / 32 blocks of x (k a multiple of 32): d = amax / 127, qs rounded to nearest even.
void quantize_act(const float* x, int64_t k, BlockQ8A* out);

// A format's NEON row kernels: dequantize n elements of a row to float (n a whole number of blocks),
// and one row's dot product with k / 32 activation blocks (needs FEAT_DotProd: called only by the
// dotprod variant).
struct FormatKernels {
    void (*dequantize)(const uint8_t* row, float* dst, int64_t n);
    float (*dot)(const uint8_t* row, const BlockQ8A* y, int64_t n_act_blocks);
};
// nullptr for a format these kernels do not decode (F32, F16, BF16, Q4_0, Q4_1, Q8_0: matmul_neon.cpp's own).
const FormatKernels* format_kernels(DType t);

// The x8 interleave's step (packed_x8.h, packed_q8u.h): p0 += sdot(a, y's 4-byte group `lane`) and
// p1 += sdot(b, the same group), a holding rows 0..3 and b rows 4..7, so each 32-bit lane keeps one
// row's sum. lane is 0..3; the switch makes it the immediate sdot by lane needs.
__attribute__((target("arch=armv8.2-a+dotprod"))) inline void dot_lane_pair(int32x4_t& p0, int32x4_t& p1, int8x16_t a,
                                                                            int8x16_t b, int8x16_t y, int lane) {
    switch (lane) {
    case 0: p0 = vdotq_laneq_s32(p0, a, y, 0); p1 = vdotq_laneq_s32(p1, b, y, 0); break;
    case 1: p0 = vdotq_laneq_s32(p0, a, y, 1); p1 = vdotq_laneq_s32(p1, b, y, 1); break;
    case 2: p0 = vdotq_laneq_s32(p0, a, y, 2); p1 = vdotq_laneq_s32(p1, b, y, 2); break;
    default: p0 = vdotq_laneq_s32(p0, a, y, 3); p1 = vdotq_laneq_s32(p1, b, y, 3); break;
    }
}

}  // namespace neon
}  // namespace evk
#endif
