// Pieces shared by the x86 attention variants (attention_avx2.cpp, attention_avx512.cpp). They
// carry the AVX2 target: an AVX-512 function may inline them (its target includes AVX2's); the
// operator table calls neither kind on a CPU without AVX2 and FMA.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../ops.h"

namespace evk {

// The scores of 8 keys in one vector: ai holds key i's 8 partial sums; lane i of the result is
// their total. Every lane goes through the same additions (pairs, then pairs of pairs, then the two
// halves), so a key's score does not depend on its place in the group.
__attribute__((target("avx2,fma,f16c"))) inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4,
                                                                 __m256 a5, __m256 a6, __m256 a7) {
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    const __m256 u0 = _mm256_hadd_ps(t0, t1);  // keys 0..3: sums of lanes 0..3 | of lanes 4..7
    const __m256 u1 = _mm256_hadd_ps(t2, t3);  // keys 4..7, likewise
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Software prefetch distances of the half / int8 paths: the rows of 8 keys this many keys ahead in
// the score pass, the value row this many rows ahead in the sum. The conversions keep the core busy
// enough that the hardware prefetchers alone fall behind (docs/kernels/decode-attention.md).
constexpr int64_t kPrefetchKeys = 32, kPrefetchRows = 16;

// Every cache line of [p, p + n) into L1.
__attribute__((target("avx2,fma,f16c"))) inline void prefetch_bytes(const uint8_t* p, size_t n) {
    for (size_t b = 0; b < n; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + b), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + n - 1), _MM_HINT_T0);
}

// A block's scale (Q8_0: its fp16 d; F16: 1).
template <DType KV>
__attribute__((target("avx2,fma,f16c"))) inline float block_scale(const uint8_t* blk) {
    if constexpr (KV == DType::Q8_0) {
        uint16_t h;
        std::memcpy(&h, blk, sizeof h);
        return _cvtsh_ss(h);
    } else {
        return 1.f;
    }
}

}  // namespace evk
#endif
