// The "p16" weight layout of the AVX-512 prefill GEMM (matmul_avx512.cpp): the weight transposed
// once, at load, into the k-major panels its register tile reads, so that a call no longer expands
// and transposes 16 x 16 blocks of rows per panel (~17% of the vision encode).
//
// Rows in groups of 16 (the last group padded with zero rows); group g holds, for kk = 0 .. k-1,
// the 16 elements kk of rows 16g .. 16g+15, contiguous: element (row r, column kk) is at index
// ((r / 16) * k + kk) * 16 + r % 16. Elements keep the file's type for F32, F16 and BF16 (the
// packed copy is the size of the rows, plus the padding): the GEMM converts a k block of 3 groups
// to float into its L1 panel, with no transpose. Quantized formats have no p16 layout.
#pragma once
#include <cstddef>
#include <cstdint>

#include "../formats/formats.h"

namespace evk {

constexpr int64_t kP16Rows = 16;

// Bytes of the packed weight, or 0 when t has no p16 layout.
size_t p16_packed_bytes(DType t, int64_t rows, int64_t k);
// Packs rows of the file's layout (src_row_bytes apart) into dst (p16_packed_bytes(t, rows, k)).
void p16_pack(DType t, const void* src, size_t src_row_bytes, int64_t rows, int64_t k, void* dst);

}  // namespace evk
