// The "q8blocks" activation format of the int8 prefill GEMMs (avx512vnni_q8act_gemm,
// avxvnni_q8act_gemm): per token, blocks of 32 quantized as the decode kernels do (d = max|x| / 127,
// round to nearest), with d times the sums over the block and over its halves (the offsets of 32-
// and 16-element sub-blocks); a last partial block (k not a multiple of 32) zero-padded. Converted
// once per product by the caller (ActPrep kActQ8Blocks,
// defined with the AVX-512 GEMM in matmul_avx512vnni_q8act_gemm.cpp).
#pragma once
#include <cstdint>

#include "../ops.h"

namespace evk {
namespace q8blocks {

struct ActBlock {
    float d;           // scale
    float ds;          // d * sum of the 32 quants
    float ds_half[2];  // d * sum of quants 0..15 and of 16..31
    int8_t qs[kQK];
};
static_assert(sizeof(ActBlock) == 48, "3 cache-line quarters per block");

}  // namespace q8blocks

extern const ActPrep kActQ8Blocks;

}  // namespace evk
