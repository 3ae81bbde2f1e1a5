// Reference matrix product for every computable weight format: each weight row is
// dequantized once into scratch, then dotted with every token of x. Plain loops, no ISA code.
#include <cstdint>

#include "../ops.h"

namespace evk {

float dot_ref(const float* a, const float* b, int64_t n) {
    // Eight independent partial sums: a fixed summation order the compiler can still vectorize.
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

void matmul_ref(const MatmulArgs& a) {
    const char* base = static_cast<const char*>(a.w);
    for (int64_t r = a.row0; r < a.row1; ++r) {
        const void* row = base + static_cast<size_t>(r) * a.w_row_bytes;
        const float* wr;
        if (a.wtype == DType::F32 && reinterpret_cast<uintptr_t>(row) % alignof(float) == 0) {
            wr = static_cast<const float*>(row);  // in place; a misaligned row is copied to scratch below
        } else {
            dequantize_row(a.wtype, row, a.scratch, a.k);
            wr = a.scratch;
        }
        for (int64_t t = 0; t < a.m; ++t) a.y[t * a.y_stride + r] = dot_ref(wr, a.x + t * a.x_stride, a.k);
    }
}

}  // namespace evk
