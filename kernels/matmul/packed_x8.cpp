#include "packed_x8.h"

#include <cstring>

namespace evk {

namespace {

// One field of the file's block and where the x8 layout puts it: element v of `lane` bytes
// (v < bytes / lane) of row r goes to packed + 8 * lane * v + lane * r (packed_x8.h's layouts:
// lane 2 for the fp16 fields, 1 for Q6_K's scales, 4 for the quants).
struct Field {
    uint16_t file, packed, bytes, lane;
};

struct Fields {
    const Field* f;
    int n;
};

constexpr Field kQ4_0[] = {{0, 0, 2, 2}, {2, 16, 16, 4}};
constexpr Field kQ4_1[] = {{0, 0, 2, 2}, {2, 16, 2, 2}, {4, 32, 16, 4}};
constexpr Field kQ8_0[] = {{0, 0, 2, 2}, {2, 16, 32, 4}};
constexpr Field kQ5_0[] = {{0, 0, 2, 2}, {2, 16, 4, 4}, {6, 48, 16, 4}};
constexpr Field kQ4_K[] = {{0, 0, 2, 2}, {2, 16, 2, 2}, {4, 32, 12, 4}, {16, 128, 128, 4}};
constexpr Field kQ6_K[] = {{208, 0, 2, 2}, {192, 16, 16, 1}, {0, 144, 128, 4}, {128, 1168, 64, 4}};

Fields fields(DType t) {
    switch (t) {
    case DType::Q4_0: return {kQ4_0, 2};
    case DType::Q4_1: return {kQ4_1, 3};
    case DType::Q8_0: return {kQ8_0, 2};
    case DType::Q5_0: return {kQ5_0, 3};
    case DType::Q4_K: return {kQ4_K, 4};
    case DType::Q6_K: return {kQ6_K, 4};
    default: return {nullptr, 0};
    }
}

// memcpy of a constant size per field width, so each copy is one move (the head's ~6 M blocks).
inline void copy_lane(uint8_t* to, const uint8_t* from, int lane) {
    if (lane == 4) std::memcpy(to, from, 4);
    else if (lane == 2) std::memcpy(to, from, 2);
    else *to = *from;
}

// Row r of one block, from the file's block to the group's packed block (to_packed) or back.
void move_row(Fields fs, const uint8_t* from, uint8_t* to, int64_t r, bool to_packed) {
    for (int i = 0; i < fs.n; ++i) {
        const Field& f = fs.f[i];
        for (int v = 0; v < f.bytes / f.lane; ++v) {
            const size_t p = f.packed + 8 * f.lane * v + f.lane * static_cast<size_t>(r), b = f.file + f.lane * v;
            copy_lane(to + (to_packed ? p : b), from + (to_packed ? b : p), f.lane);
        }
    }
}

}  // namespace

size_t x8_packed_bytes(DType t, int64_t rows, int64_t k) {
    const size_t bb = x8_block_bytes(t);
    const int64_t bc = x8_block_cols(t);
    if (bb == 0 || rows < 1 || k < bc || k % bc != 0) return 0;
    const int64_t groups = (rows + kPackRows - 1) / kPackRows;
    return static_cast<size_t>(groups) * static_cast<size_t>(k / bc) * bb;
}

void x8_pack(DType t, const void* src, size_t src_row_bytes, int64_t rows, int64_t k, void* dst) {
    const size_t bb = x8_block_bytes(t);
    const int64_t nb = k / x8_block_cols(t), groups = (rows + kPackRows - 1) / kPackRows;
    const size_t in_block = static_cast<size_t>(type_traits(t)->block_bytes);
    const Fields fs = fields(t);
    const uint8_t* s = static_cast<const uint8_t*>(src);
    uint8_t* out = static_cast<uint8_t*>(dst);
    std::memset(out, 0, x8_packed_bytes(t, rows, k));  // padding rows: zero scales, zero weights
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t b = 0; b < nb; ++b)
            for (int64_t r = 0; r < kPackRows && g * kPackRows + r < rows; ++r)
                move_row(fs, s + static_cast<size_t>(g * kPackRows + r) * src_row_bytes + static_cast<size_t>(b) * in_block,
                         out + static_cast<size_t>(g * nb + b) * bb, r, true);
}

void x8_unpack_row(DType t, const void* packed, int64_t k, int64_t row, void* dst) {
    const size_t bb = x8_block_bytes(t), in_block = static_cast<size_t>(type_traits(t)->block_bytes);
    const int64_t nb = k / x8_block_cols(t), g = row / kPackRows, r = row % kPackRows;
    const Fields fs = fields(t);
    const uint8_t* in = static_cast<const uint8_t*>(packed) + static_cast<size_t>(g * nb) * bb;
    uint8_t* out = static_cast<uint8_t*>(dst);
    for (int64_t b = 0; b < nb; ++b, in += bb, out += in_block) move_row(fs, in, out, r, false);
}

}  // namespace evk
