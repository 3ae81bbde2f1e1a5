// Shared by the Arm NEON matmul files: the int8 activation blocks of the q8act kernels
// (matmul_neon.cpp) and the kernels of the formats decoded in matmul_neon_formats.cpp (Q5_0,
// Q5_1, IQ4_NL, Q2_K..Q6_K), which matmul_neon_f32act and matmul_neon_q8act_dot call per row.
#pragma once
#if defined(__aarch64__)
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

}  // namespace neon
}  // namespace evk
#endif
