// The "q8u" weight layout of the int8 GEMM for float weights (avxvnni_q8act_gemm): the weight
// requantized to int8 at load (blocks of 32, d = max|w| / 127 in float, q = round(w / d): Q8_0 without
// its fp16 scale; a Q8_0 file's blocks as they are), laid out for vpdpbusd (u8 x s8) on 8 rows:
// per group of 8 rows (the last padded with zero rows), per block b of 32 columns, 288 bytes:
//   d[8]   float   the rows' scales (float: no conversion per block in the kernel)
//   q      8 vectors of 32 bytes; vector j, byte 4r + i = element 4j + i of row r, plus 128
//          (unsigned: the kernel subtracts 128 d times the activations' sum per block)
// Made once, at load, for a weight a user allowed int8 products for (the vision tower with
// vision_int8): the file stays untouched.
#pragma once
#include <cstddef>
#include <cstdint>

#include "../formats/formats.h"

namespace evk {

constexpr size_t kQ8uBlockBytes = 8 * sizeof(float) + 8 * 32;

// Bytes of the packed weight, or 0 when t is not F32, F16, BF16 or Q8_0 (or k is not a whole number
// of Q8_0's blocks). A float weight's last partial block of columns (k not a multiple of 32:
// SigLIP's 4304-wide down projection, 588-wide patch embedding) is zero-padded to 32.
size_t q8u_packed_bytes(DType t, int64_t rows, int64_t k);
void q8u_pack(DType t, const void* src, size_t src_row_bytes, int64_t rows, int64_t k, void* dst);

}  // namespace evk
