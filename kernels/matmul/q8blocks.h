// The activation formats of the int8 prefill GEMMs, converted once per product by the caller: per
// token, blocks of 32 quantized as the decode kernels do (d = max|x| / 127, round to nearest).
// "q8blocks" (avx512vnni_q8act_gemm; ActPrep kActQ8Blocks, defined with it in
// matmul_avx512vnni_q8act_gemm.cpp): with d times the sums over the block and over its halves (the
// offsets of 32- and 16-element sub-blocks). "q8sums" (below).
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

// The "q8sums" format of the int8 GEMM on q8u weights (q8u_gemm_body.inc): the same quantization,
// with -128 times the block's integer sum, the start of the int32 accumulator that cancels the
// weights' + 128 exactly (their dot products come out as the signed sums, no float correction); a
// last partial block (k not a multiple of 32: SigLIP's 4304-wide down projection) zero-padded, as
// the q8u weights are.
struct SumBlock {
    float d;       // scale
    int32_t bias;  // -128 * sum of the 32 quants
    int8_t qs[kQK];
};
static_assert(sizeof(SumBlock) == 40, "8 bytes of header, the quants");

}  // namespace q8blocks

extern const ActPrep kActQ8Blocks;
extern const ActPrep kActQ8Sums;  // defined with the AVX-VNNI GEMM (matmul_avxvnni_q8act_gemm.cpp)

}  // namespace evk
