// AVX2 decode kernels (few tokens): activations are quantized once per call to int8 blocks of
// 32 (scale d, and s = d * sum(q) for the Q4_1 offset term), and each weight block is dotted in
// integer SIMD: maddubs (u8 x s8 -> s16 pairs), madd (-> s32), then one float FMA per block.
// Signed weights (Q4_0 after -8, Q8_0) use the sign trick: |w| x (y with w's sign), since
// maddubs needs one unsigned operand. |w| <= 128 and |y| <= 127 keep the s16 pair sums from
// saturating (2 * 128 * 127 < 32767).
//
// Bytes and flops (SmolLM2-135M Q4_1, one token): 96.6 MB of weights read, 0.27 GFLOP; at
// ~12 GB/s per core the floor is ~8 ms/token on one core: decode is bandwidth-bound if the
// inner loop keeps up with ~0.6 byte/cycle/core, which one maddubs chain per block does.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <cstddef>

#include "../ops.h"
#include "q8act_avx2.h"

namespace evk {

namespace {

using q8act::BlockQ8A;
using q8act::quantize_act;

EV_AVX2 inline __m256i unpack_nibbles(const uint8_t* qs) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);  // high lane: elements 16..31
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

EV_AVX2 inline __m256 dot_signed(__m256i w, __m256i y) {
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

// Weight rows come in place from the mapped file, at any byte alignment (general.alignment may be
// 1): blocks are addressed as bytes and their fp16 fields loaded with load_u16, never through a
// misaligned block struct.
// One block of each weight format against one activation block: the integer dot as 8 float
// lanes, the block's scale, and (Q4_1 only) its offset m, multiplied by sum(x) via y.s.
struct Q4_0F {
    static constexpr int64_t kBytes = sizeof(BlockQ4_0);
    static constexpr bool kHasMin = false;
    EV_AVX2 static __m256 dot(const uint8_t* blk, __m256i yv) {
        const __m256i q = _mm256_sub_epi8(unpack_nibbles(blk + offsetof(BlockQ4_0, qs)), _mm256_set1_epi8(8));
        return dot_signed(q, yv);
    }
    EV_AVX2 static float d(const uint8_t* blk) { return _cvtsh_ss(load_u16(blk + offsetof(BlockQ4_0, d))); }
    static float m(const uint8_t*) { return 0.f; }
};

struct Q4_1F {
    static constexpr int64_t kBytes = sizeof(BlockQ4_1);
    static constexpr bool kHasMin = true;
    EV_AVX2 static __m256 dot(const uint8_t* blk, __m256i yv) {
        // Nibbles are 0..15: maddubs takes them as its unsigned operand directly.
        const __m256i p16 = _mm256_maddubs_epi16(unpack_nibbles(blk + offsetof(BlockQ4_1, qs)), yv);
        return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
    }
    EV_AVX2 static float d(const uint8_t* blk) { return _cvtsh_ss(load_u16(blk + offsetof(BlockQ4_1, d))); }
    EV_AVX2 static float m(const uint8_t* blk) { return _cvtsh_ss(load_u16(blk + offsetof(BlockQ4_1, m))); }
};

struct Q8_0F {
    static constexpr int64_t kBytes = sizeof(BlockQ8_0);
    static constexpr bool kHasMin = false;
    EV_AVX2 static __m256 dot(const uint8_t* blk, __m256i yv) {
        return dot_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + offsetof(BlockQ8_0, qs))), yv);
    }
    EV_AVX2 static float d(const uint8_t* blk) { return _cvtsh_ss(load_u16(blk + offsetof(BlockQ8_0, d))); }
    static float m(const uint8_t*) { return 0.f; }
};

// R rows at once against the same activations: the activation loads are shared and the R
// accumulation chains are independent, so FMA latency overlaps. Each row's arithmetic is the
// same sequence whatever R is, so results do not depend on how rows were grouped.
template <class F, int R>
EV_AVX2 void rows_dot(const uint8_t* const* w, const BlockQ8A* y, int64_t nb, float* out) {
    __m256 acc[R];
    float offs[R];
    for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); offs[r] = 0.f; }
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i yv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].qs));
        for (int r = 0; r < R; ++r) {
            const uint8_t* blk = w[r] + b * F::kBytes;
            acc[r] = _mm256_fmadd_ps(F::dot(blk, yv), _mm256_set1_ps(F::d(blk) * y[b].d), acc[r]);
            if (F::kHasMin) offs[r] += F::m(blk) * y[b].s;
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + offs[r];
}

template <class F>
EV_AVX2 void rows_range(const uint8_t* base, size_t row_bytes, int64_t r0, int64_t r1, const BlockQ8A* y, int64_t nb,
                        float* out) {
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint8_t* w[4] = {base + r * row_bytes, base + (r + 1) * row_bytes, base + (r + 2) * row_bytes,
                               base + (r + 3) * row_bytes};
        rows_dot<F, 4>(w, y, nb, out + r);
    }
    for (; r < r1; ++r) {
        const uint8_t* w[1] = {base + r * row_bytes};
        rows_dot<F, 1>(w, y, nb, out + r);
    }
}

}  // namespace

// scratch: the quantized activations of one token (k / 32 blocks of 40 bytes <= k floats).
EV_AVX2 void matmul_avx2_q8act(const MatmulArgs& a) {
    BlockQ8A* yq = reinterpret_cast<BlockQ8A*>(a.scratch);
    const int64_t nb = a.k / kQK;
    for (int64_t t = 0; t < a.m; ++t) {
        quantize_act(a.x + t * a.x_stride, a.k, yq);
        float* y = a.y + t * a.y_stride;
        const uint8_t* base = static_cast<const uint8_t*>(a.w);
        switch (a.wtype) {
        case DType::Q4_0: rows_range<Q4_0F>(base, a.w_row_bytes, a.row0, a.row1, yq, nb, y); break;
        case DType::Q4_1: rows_range<Q4_1F>(base, a.w_row_bytes, a.row0, a.row1, yq, nb, y); break;
        case DType::Q8_0: rows_range<Q8_0F>(base, a.w_row_bytes, a.row0, a.row1, yq, nb, y); break;
        default:  // the table never routes other formats here
            for (int64_t r = a.row0; r < a.row1; ++r) y[r] = NAN;
            break;
        }
    }
}

}  // namespace evk
#endif
