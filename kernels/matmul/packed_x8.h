// The "x8" weight layout of the packed decode kernels: rows interleaved in groups of 8, so that
// one 32-byte vector holds 4 consecutive elements of each of 8 rows and an integer dot product
// over 4-byte lanes (maddubs + madd, VNNI dpbusd, NEON sdot) leaves one row's sum in each lane:
// no horizontal sums per block, and one float FMA per block serves 8 rows.
//
// Per group of 8 rows (the last group padded with zero rows), per block b of 32 columns:
//   d[8]   uint16  fp16 scales of rows 0..7                      (Q4_0, Q4_1, Q8_0, Q5_0)
//   m[8]   uint16  fp16 offsets                                   (Q4_1 only)
//   Q4_0/Q4_1: 4 vectors of 32 bytes; vector j, byte 4r + i: low nibble = element 4j + i of row
//              r (unsigned, 0..15), high nibble = element 16 + 4j + i.
//   Q8_0:      8 vectors of 32 bytes; vector j, byte 4r + i = element 4j + i of row r (int8).
//   Q5_0:      qh[8] uint32, the file's fifth bits of rows 0..7 (bit i: element i), then the 4
//              nibble vectors of Q4_0.
// The K-quants Q4_K and Q6_K (docs/kernels/decode-kquants-x8.md) take a super-block of 256 columns
// as their block; every byte field of the file's block is interleaved by 4 bytes (vector v, bytes
// 4r..4r+3 = the row's bytes 4v..4v+3) unless named otherwise:
//   Q4_K:      d[8], dmin[8] fp16; the 12 scale bytes as 3 vectors; qs as 32 vectors (vector
//              8c + j: low nibbles = elements 64c + 4j + i, high nibbles = 64c + 32 + 4j + i).
//   Q6_K:      d[8] fp16; the 16 int8 scales as [scale g][row r] bytes (16 x 8); ql as 32
//              vectors, qh as 16.
// A block takes 8 x the bytes of the file's block: the packed copy is the same size as the rows.
// The weight is packed once, at load; the file stays untouched.
#pragma once
#include <cstddef>
#include <cstdint>

#include "../formats/formats.h"

namespace evk {

constexpr int64_t kPackRows = 8;

// Bytes of one block of one group; 0 for a format the layout does not have.
// Inline and constexpr: the kernels ask for it per group of rows, with T a template constant.
constexpr size_t x8_block_bytes(DType t) {
    return t == DType::Q4_0   ? 16 + 128
           : t == DType::Q4_1 ? 32 + 128
           : t == DType::Q8_0 ? 16 + 256
           : t == DType::Q5_0 ? 48 + 128
           : t == DType::Q4_K ? 8 * 144
           : t == DType::Q6_K ? 8 * 210
                              : 0;
}
// Columns of one block: 256 for the K-quants, 32 for the others.
constexpr int64_t x8_block_cols(DType t) { return t == DType::Q4_K || t == DType::Q6_K ? kQK_K : kQK; }
// Bytes of the whole packed weight (rows rounded up to groups), or 0 when t has no x8 layout or
// k is not a whole number of blocks.
size_t x8_packed_bytes(DType t, int64_t rows, int64_t k);
// Packs rows of the file's layout (src_row_bytes apart) into dst (x8_packed_bytes(t, rows, k)).
void x8_pack(DType t, const void* src, size_t src_row_bytes, int64_t rows, int64_t k, void* dst);
// The inverse for one row: writes row `row` of a packed weight back in the file's layout
// (row_bytes(t, k) bytes), so any row-reading kernel can use the packed copy.
void x8_unpack_row(DType t, const void* packed, int64_t k, int64_t row, void* dst);

}  // namespace evk
