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

// The fields of each format: the one description pack and unpack both follow.
template <DType T> struct Layout;
template <> struct Layout<DType::Q4_0> { static constexpr Field f[] = {{0, 0, 2, 2}, {2, 16, 16, 4}}; };
template <> struct Layout<DType::Q4_1> { static constexpr Field f[] = {{0, 0, 2, 2}, {2, 16, 2, 2}, {4, 32, 16, 4}}; };
template <> struct Layout<DType::Q8_0> { static constexpr Field f[] = {{0, 0, 2, 2}, {2, 16, 32, 4}}; };
template <> struct Layout<DType::Q5_0> { static constexpr Field f[] = {{0, 0, 2, 2}, {2, 16, 4, 4}, {6, 48, 16, 4}}; };
template <> struct Layout<DType::Q4_K> {
    static constexpr Field f[] = {{0, 0, 2, 2}, {2, 16, 2, 2}, {4, 32, 12, 4}, {16, 128, 128, 4}};
};
template <> struct Layout<DType::Q6_K> {
    static constexpr Field f[] = {{208, 0, 2, 2}, {192, 16, 16, 1}, {0, 144, 128, 4}, {128, 1168, 64, 4}};
};

// Field I of T for row r, from the file's block to the group's packed block (kToPacked) or back.
// Everything but r is a constant: each copy compiles to one move (the head's ~6 M blocks at load,
// and a row unpacked per prefill product).
template <DType T, bool kToPacked, size_t I = 0>
inline void move_row(const uint8_t* from, uint8_t* to, size_t r) {
    constexpr Field f = Layout<T>::f[I];
    for (size_t v = 0; v < f.bytes / f.lane; ++v) {
        const size_t p = f.packed + 8 * f.lane * v + f.lane * r, b = f.file + f.lane * v;
        std::memcpy(to + (kToPacked ? p : b), from + (kToPacked ? b : p), f.lane);
    }
    if constexpr (I + 1 < sizeof(Layout<T>::f) / sizeof(Field)) move_row<T, kToPacked, I + 1>(from, to, r);
}

template <DType T>
void pack(const uint8_t* s, size_t src_row_bytes, int64_t rows, int64_t nb, uint8_t* out) {
    constexpr size_t bb = x8_block_bytes(T), in_block = bb / kPackRows;  // a group block is 8 file blocks
    const int64_t groups = (rows + kPackRows - 1) / kPackRows;
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t b = 0; b < nb; ++b)
            for (int64_t r = 0; r < kPackRows && g * kPackRows + r < rows; ++r)
                move_row<T, true>(s + static_cast<size_t>(g * kPackRows + r) * src_row_bytes + static_cast<size_t>(b) * in_block,
                                  out + static_cast<size_t>(g * nb + b) * bb, static_cast<size_t>(r));
}

template <DType T>
void unpack_row(const uint8_t* in, int64_t nb, int64_t r, uint8_t* out) {
    constexpr size_t bb = x8_block_bytes(T), in_block = bb / kPackRows;  // a group block is 8 file blocks
    for (int64_t b = 0; b < nb; ++b, in += bb, out += in_block) move_row<T, false>(in, out, static_cast<size_t>(r));
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
    const int64_t nb = k / x8_block_cols(t);
    const uint8_t* s = static_cast<const uint8_t*>(src);
    uint8_t* out = static_cast<uint8_t*>(dst);
    std::memset(out, 0, x8_packed_bytes(t, rows, k));  // padding rows: zero scales, zero weights
    switch (t) {
    case DType::Q4_0: pack<DType::Q4_0>(s, src_row_bytes, rows, nb, out); break;
    case DType::Q4_1: pack<DType::Q4_1>(s, src_row_bytes, rows, nb, out); break;
    case DType::Q8_0: pack<DType::Q8_0>(s, src_row_bytes, rows, nb, out); break;
    case DType::Q5_0: pack<DType::Q5_0>(s, src_row_bytes, rows, nb, out); break;
    case DType::Q4_K: pack<DType::Q4_K>(s, src_row_bytes, rows, nb, out); break;
    case DType::Q6_K: pack<DType::Q6_K>(s, src_row_bytes, rows, nb, out); break;
    default: break;  // x8_packed_bytes is 0: nothing to pack
    }
}

void x8_unpack_row(DType t, const void* packed, int64_t k, int64_t row, void* dst) {
    const int64_t nb = k / x8_block_cols(t), g = row / kPackRows, r = row % kPackRows;
    const uint8_t* in = static_cast<const uint8_t*>(packed) + static_cast<size_t>(g * nb) * x8_block_bytes(t);
    uint8_t* out = static_cast<uint8_t*>(dst);
    switch (t) {
    case DType::Q4_0: unpack_row<DType::Q4_0>(in, nb, r, out); break;
    case DType::Q4_1: unpack_row<DType::Q4_1>(in, nb, r, out); break;
    case DType::Q8_0: unpack_row<DType::Q8_0>(in, nb, r, out); break;
    case DType::Q5_0: unpack_row<DType::Q5_0>(in, nb, r, out); break;
    case DType::Q4_K: unpack_row<DType::Q4_K>(in, nb, r, out); break;
    case DType::Q6_K: unpack_row<DType::Q6_K>(in, nb, r, out); break;
    default: break;
    }
}

}  // namespace evk
