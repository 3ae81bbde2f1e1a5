#include "packed_p16.h"

#include <cstring>

namespace evk {

namespace {
size_t elem_bytes(DType t) {
    switch (t) {
    case DType::F32: return 4;
    case DType::F16:
    case DType::BF16: return 2;
    default: return 0;
    }
}
}  // namespace

size_t p16_packed_bytes(DType t, int64_t rows, int64_t k) {
    const size_t e = elem_bytes(t);
    if (e == 0 || rows < 1 || k < 1) return 0;
    const int64_t groups = (rows + kP16Rows - 1) / kP16Rows;
    return static_cast<size_t>(groups) * static_cast<size_t>(kP16Rows) * static_cast<size_t>(k) * e;
}

void p16_pack(DType t, const void* src, size_t src_row_bytes, int64_t rows, int64_t k, void* dst) {
    const size_t e = elem_bytes(t);
    const int64_t groups = (rows + kP16Rows - 1) / kP16Rows;
    const uint8_t* s = static_cast<const uint8_t*>(src);
    uint8_t* out = static_cast<uint8_t*>(dst);
    std::memset(out, 0, p16_packed_bytes(t, rows, k));  // padding rows: zeros
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t i = 0; i < kP16Rows && g * kP16Rows + i < rows; ++i) {
            const uint8_t* row = s + static_cast<size_t>(g * kP16Rows + i) * src_row_bytes;
            uint8_t* o = out + (static_cast<size_t>(g * k) * kP16Rows + static_cast<size_t>(i)) * e;
            if (e == 2) {
                for (int64_t kk = 0; kk < k; ++kk) std::memcpy(o + static_cast<size_t>(kk * kP16Rows) * 2, row + static_cast<size_t>(kk) * 2, 2);
            } else {
                for (int64_t kk = 0; kk < k; ++kk) std::memcpy(o + static_cast<size_t>(kk * kP16Rows) * 4, row + static_cast<size_t>(kk) * 4, 4);
            }
        }
}

}  // namespace evk
