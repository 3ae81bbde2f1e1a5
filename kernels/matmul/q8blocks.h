// The activation formats of the int8 prefill GEMMs, converted once per product by the caller: per
// token, blocks of 32 quantized as the decode kernels do (d = max|x| / 127, round to nearest).
// "q8blocks" (avx512vnni_q8act_gemm; ActPrep kActQ8Blocks, defined with it in
// matmul_avx512vnni_q8act_gemm.cpp): with d times the sums over the block and over its halves (the
// offsets of 32- and 16-element sub-blocks). "q8sums" (below).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

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

// Bytes of one token's row of Blocks: one per 32 values, a last partial block counted whole.
template <class Block>
size_t row_bytes(int64_t k) {
    return static_cast<size_t>((k + kQK - 1) / kQK) * sizeof(Block);
}

// The loop of every ActPrep of these formats: tokens [t0, t1) of x (m tokens, x_stride floats
// apart, k each) into rows of row_bytes<Block>(k) at dst, fill(src, block) making each Block from 32
// floats (a last partial block zero-padded first); tokens at or past m are zeros.
template <class Block, class Fill>
void prep_rows(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t0, int64_t t1, void* dst, Fill&& fill) {
    const int64_t nb = (k + kQK - 1) / kQK;
    for (int64_t t = t0; t < t1; ++t) {
        auto* out = reinterpret_cast<Block*>(static_cast<uint8_t*>(dst) + static_cast<size_t>(t) * row_bytes<Block>(k));
        if (t >= m) {
            std::memset(static_cast<void*>(out), 0, row_bytes<Block>(k));
            continue;
        }
        for (int64_t b = 0; b < nb; ++b) {
            const float* src = x + t * x_stride + b * kQK;
            float tail[kQK];
            if ((b + 1) * kQK > k) {
                std::fill(tail, tail + kQK, 0.f);
                std::copy(src, src + (k - b * kQK), tail);
                src = tail;
            }
            fill(src, out[b]);
        }
    }
}

}  // namespace q8blocks

extern const ActPrep kActQ8Blocks;
extern const ActPrep kActQ8Sums;  // defined with the AVX-VNNI GEMM (matmul_avxvnni_q8act_gemm.cpp)

}  // namespace evk
