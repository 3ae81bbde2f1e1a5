#include "packed_x8.h"

#include <cstring>

namespace evk {

size_t x8_packed_bytes(DType t, int64_t rows, int64_t k) {
    const size_t bb = x8_block_bytes(t);
    if (bb == 0 || rows < 1 || k < kQK || k % kQK != 0) return 0;
    const int64_t groups = (rows + kPackRows - 1) / kPackRows;
    return static_cast<size_t>(groups) * static_cast<size_t>(k / kQK) * bb;
}

void x8_pack(DType t, const void* src, size_t src_row_bytes, int64_t rows, int64_t k, void* dst) {
    const size_t bb = x8_block_bytes(t);
    const int64_t nb = k / kQK, groups = (rows + kPackRows - 1) / kPackRows;
    const size_t in_block = static_cast<size_t>(type_traits(t)->block_bytes);
    const uint8_t* s = static_cast<const uint8_t*>(src);
    uint8_t* out = static_cast<uint8_t*>(dst);
    std::memset(out, 0, x8_packed_bytes(t, rows, k));  // padding rows: zero scales, zero weights
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* o = out + static_cast<size_t>(g * nb + b) * bb;
            for (int64_t r = 0; r < kPackRows && g * kPackRows + r < rows; ++r) {
                const uint8_t* blk = s + static_cast<size_t>(g * kPackRows + r) * src_row_bytes + static_cast<size_t>(b) * in_block;
                std::memcpy(o + 2 * r, blk, 2);  // d (the first field of every format)
                if (t == DType::Q8_0) {
                    const uint8_t* q = blk + 2;
                    for (int j = 0; j < 8; ++j) std::memcpy(o + 16 + 32 * j + 4 * r, q + 4 * j, 4);
                    continue;
                }
                const uint8_t* q = blk + (t == DType::Q4_1 ? 4 : t == DType::Q5_0 ? 6 : 2);
                uint8_t* v = o + (t == DType::Q4_1 ? 32 : t == DType::Q5_0 ? 48 : 16);
                if (t == DType::Q4_1) std::memcpy(o + 16 + 2 * r, blk + 2, 2);  // m
                if (t == DType::Q5_0) std::memcpy(o + 16 + 4 * r, blk + 2, 4);  // qh
                // The file's byte i holds element i (low) and i + 16 (high): vector j, lane r,
                // byte i takes elements 4j + i and 16 + 4j + i, the file's byte 4j + i as it is.
                for (int j = 0; j < 4; ++j) std::memcpy(v + 32 * j + 4 * r, q + 4 * j, 4);
            }
        }
}

void x8_unpack_row(DType t, const void* packed, int64_t k, int64_t row, void* dst) {
    const size_t bb = x8_block_bytes(t), in_block = static_cast<size_t>(type_traits(t)->block_bytes);
    const int64_t nb = k / kQK, g = row / kPackRows, r = row % kPackRows;
    const uint8_t* in = static_cast<const uint8_t*>(packed) + static_cast<size_t>(g * nb) * bb;
    uint8_t* out = static_cast<uint8_t*>(dst);
    for (int64_t b = 0; b < nb; ++b, in += bb, out += in_block) {
        std::memcpy(out, in + 2 * r, 2);
        if (t == DType::Q8_0) {
            for (int j = 0; j < 8; ++j) std::memcpy(out + 2 + 4 * j, in + 16 + 32 * j + 4 * r, 4);
            continue;
        }
        if (t == DType::Q4_1) std::memcpy(out + 2, in + 16 + 2 * r, 2);
        if (t == DType::Q5_0) std::memcpy(out + 2, in + 16 + 4 * r, 4);
        const uint8_t* v = in + (t == DType::Q4_1 ? 32 : t == DType::Q5_0 ? 48 : 16);
        uint8_t* q = out + (t == DType::Q4_1 ? 4 : t == DType::Q5_0 ? 6 : 2);
        for (int j = 0; j < 4; ++j) std::memcpy(q + 4 * j, v + 32 * j + 4 * r, 4);
    }
}

}  // namespace evk
