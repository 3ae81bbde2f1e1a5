// AVX2 unpacking of the formats with 5-bit, non-linear and super-block quants: Q5_0, Q5_1, IQ4_NL
// (blocks of 32) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks of 256, ggml's layouts: formats.h).
// Shared by the int8-activation decode kernels (q8act_k_body.inc) and the prefill GEMM's row
// expansion (dequantize_row_avx2 in matmul_avx2.cpp), so both read a block the same way.
//
// Every format is seen as groups of 8 sub-blocks of 32 weights: a K-quant super-block, or 8
// consecutive blocks of a 32-format (the last group of a row may hold fewer: n < 8). Per group,
// prep() decodes the scales once; quants(j) gives sub-block j as 32 int8 values, element i in
// byte i. A weight is
//   kUnsigned32 (Q4_K, Q5_K, Q5_0, Q5_1): x = scf[j] * q + mnf[j],          q unsigned (0..31)
//   kSigned32   (IQ4_NL):                 x = scf[j] * q,                   q signed (-127..113)
//   kSigned16   (Q3_K, Q6_K):             x = d * sc[i / 16] * q,           q signed (-32..31)
//   kMin16      (Q2_K):                   x = d * sc[i / 16] * q - dmin * mn[i / 16], q 0..3
// with scf, mnf the 8 lanes of two float vectors and sc, mn the group's 16 small integer scales.
// Any bytes are valid input: every value read is masked to its field's width.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "../formats/formats.h"

#ifndef EV_AVX2
#define EV_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace evk {
namespace kq {

enum class Kind { kUnsigned32, kSigned32, kSigned16, kMin16 };

inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

EV_AVX2 inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes of nibbles -> 32 values 0..15: low nibbles are elements 0..15, high ones 16..31.
EV_AVX2 inline __m256i nibble_pairs(const uint8_t* qs) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
}

// Byte i = 0x10 where bit i of the 32-bit word at p is set (the fifth bit of a Q5 quant).
EV_AVX2 inline __m256i fifth_bits(const uint8_t* p) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(load_u32(p))),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// The fp16 scale at byte offset `off` of each of n blocks `stride` bytes apart, as floats (lanes
// past n are 0).
EV_AVX2 inline __m256 gather_halves(const uint8_t* g, int64_t stride, size_t off, int n) {
    alignas(16) uint16_t h[8] = {};
    for (int j = 0; j < n; ++j) h[j] = load_u16(g + j * stride + off);
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// The scales of one group, decoded once.
struct Prep {
    __m256 scf, mnf;  // kUnsigned32 / kSigned32: per sub-block; kSigned16 / kMin16: d and -dmin in every lane
    __m128i sc, mn;   // kSigned16 / kMin16: the 16 int8 scales (and Q2_K's mins) of the group
    __m256i hi;       // Q5_K's fifth bits, Q3_K's high-bit mask
};

// ---- the 32-element formats: a group is n <= 8 blocks ----

struct Q5_0F {
    static constexpr Kind kKind = Kind::kUnsigned32;
    static constexpr DType kType = DType::Q5_0;
    static constexpr int64_t kBlockBytes = sizeof(BlockQ5_0);
    static constexpr int kSubsPerBlock = 1;
    EV_AVX2 static void prep(const uint8_t* g, int n, Prep& p) {  // x = d (q - 16)
        p.scf = gather_halves(g, kBlockBytes, offsetof(BlockQ5_0, d), n);
        p.mnf = _mm256_mul_ps(p.scf, _mm256_set1_ps(-16.f));
    }
    EV_AVX2 static __m256i quants(const uint8_t* g, const Prep&, int j) {
        const uint8_t* b = g + j * kBlockBytes;
        return _mm256_or_si256(nibble_pairs(b + offsetof(BlockQ5_0, qs)), fifth_bits(b + offsetof(BlockQ5_0, qh)));
    }
};

struct Q5_1F {
    static constexpr Kind kKind = Kind::kUnsigned32;
    static constexpr DType kType = DType::Q5_1;
    static constexpr int64_t kBlockBytes = sizeof(BlockQ5_1);
    static constexpr int kSubsPerBlock = 1;
    EV_AVX2 static void prep(const uint8_t* g, int n, Prep& p) {  // x = d q + m
        p.scf = gather_halves(g, kBlockBytes, offsetof(BlockQ5_1, d), n);
        p.mnf = gather_halves(g, kBlockBytes, offsetof(BlockQ5_1, m), n);
    }
    EV_AVX2 static __m256i quants(const uint8_t* g, const Prep&, int j) {
        const uint8_t* b = g + j * kBlockBytes;
        return _mm256_or_si256(nibble_pairs(b + offsetof(BlockQ5_1, qs)), fifth_bits(b + offsetof(BlockQ5_1, qh)));
    }
};

struct IQ4_NLF {
    static constexpr Kind kKind = Kind::kSigned32;
    static constexpr DType kType = DType::IQ4_NL;
    static constexpr int64_t kBlockBytes = sizeof(BlockIQ4_NL);
    static constexpr int kSubsPerBlock = 1;
    EV_AVX2 static void prep(const uint8_t* g, int n, Prep& p) { p.scf = gather_halves(g, kBlockBytes, offsetof(BlockIQ4_NL, d), n); }
    EV_AVX2 static __m256i quants(const uint8_t* g, const Prep&, int j) {
        // The format's 16 levels (ggml's kvalues_iq4nl), looked up by nibble in both lanes.
        const __m256i levels = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,  //
                                                -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
        return _mm256_shuffle_epi8(levels, nibble_pairs(g + j * kBlockBytes + offsetof(BlockIQ4_NL, qs)));
    }
};

// ---- the K-quants: a group is one super-block of 256 ----

// Q4_K / Q5_K's 12 scale bytes -> 8 6-bit scales and 8 6-bit mins. Bytes 0..3 hold scales 0..3 in
// their low 6 bits and the top 2 bits of scales 4..7; bytes 4..7 the same for the mins; bytes
// 8..11 the low 4 bits of scale 4 + i (low nibble) and min 4 + i (high nibble).
EV_AVX2 inline void k4_scales(const uint8_t* s, float d, float dmin, Prep& p) {
    const uint32_t w0 = load_u32(s), w1 = load_u32(s + 4), w2 = load_u32(s + 8);
    const uint32_t sc_lo = w0 & 0x3f3f3f3fu, mn_lo = w1 & 0x3f3f3f3fu;
    const uint32_t sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
    const uint32_t mn_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
    const __m128i sc = _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), 0, 0);
    const __m128i mn = _mm_setr_epi32(static_cast<int>(mn_lo), static_cast<int>(mn_hi), 0, 0);
    p.scf = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)), _mm256_set1_ps(d));
    p.mnf = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)), _mm256_set1_ps(-dmin));
}

// Sub-block j of 128 bytes of nibbles: bytes 32 (j / 2) .. +31, low nibbles for even j, high for odd.
EV_AVX2 inline __m256i k4_nibbles(const uint8_t* qs, int j) {
    const __m256i v = load32(qs + 32 * (j / 2));
    return _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
}

struct Q4_KF {
    static constexpr Kind kKind = Kind::kUnsigned32;
    static constexpr DType kType = DType::Q4_K;
    static constexpr int64_t kBlockBytes = sizeof(BlockQ4_K);
    static constexpr int kSubsPerBlock = 8;
    EV_AVX2 static void prep(const uint8_t* b, int, Prep& p) {
        k4_scales(b + offsetof(BlockQ4_K, scales), _cvtsh_ss(load_u16(b + offsetof(BlockQ4_K, d))),
                  _cvtsh_ss(load_u16(b + offsetof(BlockQ4_K, dmin))), p);
    }
    EV_AVX2 static __m256i quants(const uint8_t* b, const Prep&, int j) { return k4_nibbles(b + offsetof(BlockQ4_K, qs), j); }
};

struct Q5_KF {
    static constexpr Kind kKind = Kind::kUnsigned32;
    static constexpr DType kType = DType::Q5_K;
    static constexpr int64_t kBlockBytes = sizeof(BlockQ5_K);
    static constexpr int kSubsPerBlock = 8;
    EV_AVX2 static void prep(const uint8_t* b, int, Prep& p) {
        k4_scales(b + offsetof(BlockQ5_K, scales), _cvtsh_ss(load_u16(b + offsetof(BlockQ5_K, d))),
                  _cvtsh_ss(load_u16(b + offsetof(BlockQ5_K, dmin))), p);
        p.hi = load32(b + offsetof(BlockQ5_K, qh));  // element 32 j + l: bit j of byte l
    }
    EV_AVX2 static __m256i quants(const uint8_t* b, const Prep& p, int j) {
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
        const __m256i h = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(p.hi, bit), bit), _mm256_set1_epi8(0x10));
        return _mm256_or_si256(k4_nibbles(b + offsetof(BlockQ5_K, qs), j), h);
    }
};

struct Q6_KF {
    static constexpr Kind kKind = Kind::kSigned16;
    static constexpr DType kType = DType::Q6_K;
    static constexpr int64_t kBlockBytes = sizeof(BlockQ6_K);
    static constexpr int kSubsPerBlock = 8;
    EV_AVX2 static void prep(const uint8_t* b, int, Prep& p) {
        p.scf = _mm256_set1_ps(_cvtsh_ss(load_u16(b + offsetof(BlockQ6_K, d))));
        p.sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + offsetof(BlockQ6_K, scales)));
    }
    // Element 128 h + 32 jj + l (j = 4 h + jj): low 4 bits in ql[64 h + 32 (jj % 2) + l] (high
    // nibble for jj >= 2), high 2 bits at bit 2 jj of qh[32 h + l]; q - 32.
    EV_AVX2 static __m256i quants(const uint8_t* b, const Prep&, int j) {
        const int h = j / 4, jj = j % 4;
        const __m256i l = load32(b + offsetof(BlockQ6_K, ql) + 64 * h + 32 * (jj % 2));
        const __m256i lo = _mm256_and_si256(jj >= 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(0x0f));
        const __m256i qh = load32(b + offsetof(BlockQ6_K, qh) + 32 * h);
        // bits 2 jj, 2 jj + 1 of each byte to bits 4, 5 (16-bit shifts: the mask drops what crosses bytes)
        const __m256i hs = jj == 0 ? _mm256_slli_epi16(qh, 4) : jj == 1 ? _mm256_slli_epi16(qh, 2) : jj == 2 ? qh : _mm256_srli_epi16(qh, 2);
        const __m256i hi = _mm256_and_si256(hs, _mm256_set1_epi8(0x30));
        return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
    }
};

struct Q3_KF {
    static constexpr Kind kKind = Kind::kSigned16;
    static constexpr DType kType = DType::Q3_K;
    static constexpr int64_t kBlockBytes = sizeof(BlockQ3_K);
    static constexpr int kSubsPerBlock = 8;
    // 16 6-bit scales, minus 32: the low 4 bits of scale i in byte i % 8 (low nibble for i < 8,
    // high for i >= 8), the top 2 bits at bit 2 (i / 4) of byte 8 + i % 4.
    EV_AVX2 static void prep(const uint8_t* b, int, Prep& p) {
        const uint8_t* s = b + offsetof(BlockQ3_K, scales);
        const uint32_t w0 = load_u32(s), w1 = load_u32(s + 4), w2 = load_u32(s + 8);
        const uint32_t m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
        const __m128i u = _mm_setr_epi32(static_cast<int>((w0 & m4) | ((w2 & m2) << 4)),
                                         static_cast<int>((w1 & m4) | (((w2 >> 2) & m2) << 4)),
                                         static_cast<int>(((w0 >> 4) & m4) | (((w2 >> 4) & m2) << 4)),
                                         static_cast<int>(((w1 >> 4) & m4) | (((w2 >> 6) & m2) << 4)));
        p.sc = _mm_sub_epi8(u, _mm_set1_epi8(32));
        p.scf = _mm256_set1_ps(_cvtsh_ss(load_u16(b + offsetof(BlockQ3_K, d))));
        p.hi = load32(b + offsetof(BlockQ3_K, hmask));
    }
    // Element 128 h + 32 jj + l (j = 4 h + jj): 2 bits at bit 2 jj of qs[32 h + l], minus 4 unless
    // bit j of hmask[l] is set.
    EV_AVX2 static __m256i quants(const uint8_t* b, const Prep& p, int j) {
        const __m256i v = load32(b + offsetof(BlockQ3_K, qs) + 32 * (j / 4));
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (j % 4)), _mm256_set1_epi8(3));
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
        const __m256i unset = _mm256_cmpeq_epi8(_mm256_and_si256(p.hi, bit), _mm256_setzero_si256());
        return _mm256_sub_epi8(lo, _mm256_and_si256(unset, _mm256_set1_epi8(4)));
    }
};

struct Q2_KF {
    static constexpr Kind kKind = Kind::kMin16;
    static constexpr DType kType = DType::Q2_K;
    static constexpr int64_t kBlockBytes = sizeof(BlockQ2_K);
    static constexpr int kSubsPerBlock = 8;
    EV_AVX2 static void prep(const uint8_t* b, int, Prep& p) {  // byte i: scale (low nibble), min (high) of elements 16 i..
        const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + offsetof(BlockQ2_K, scales)));
        p.sc = _mm_and_si128(s, _mm_set1_epi8(0x0f));
        p.mn = _mm_and_si128(_mm_srli_epi16(s, 4), _mm_set1_epi8(0x0f));
        p.scf = _mm256_set1_ps(_cvtsh_ss(load_u16(b + offsetof(BlockQ2_K, d))));
        p.mnf = _mm256_set1_ps(-_cvtsh_ss(load_u16(b + offsetof(BlockQ2_K, dmin))));
    }
    // Element 128 h + 32 jj + l (j = 4 h + jj): 2 bits at bit 2 jj of qs[32 h + l].
    EV_AVX2 static __m256i quants(const uint8_t* b, const Prep&, int j) {
        const __m256i v = load32(b + offsetof(BlockQ2_K, qs) + 32 * (j / 4));
        return _mm256_and_si256(_mm256_srli_epi16(v, 2 * (j % 4)), _mm256_set1_epi8(3));
    }
};

// Bytes of one group of F (8 sub-blocks), and the sub-blocks of a row of k elements.
template <class F>
constexpr int64_t group_bytes() {
    return F::kBlockBytes * (8 / F::kSubsPerBlock);
}

// 8 floats from 8 int8 values (signed, or unsigned for the kUnsigned32 / kMin16 kinds).
template <class F>
EV_AVX2 inline __m256 widen8(__m128i q8) {
    constexpr bool kU = F::kKind == Kind::kUnsigned32 || F::kKind == Kind::kMin16;
    return _mm256_cvtepi32_ps(kU ? _mm256_cvtepu8_epi32(q8) : _mm256_cvtepi8_epi32(q8));
}

// A row of n elements of format F (n a whole number of blocks) to floats.
template <class F>
EV_AVX2 void dequant_row(const uint8_t* src, float* dst, int64_t n) {
    const int64_t subs = n / 32;
    for (int64_t s0 = 0; s0 < subs; s0 += 8) {
        const int ns = subs - s0 < 8 ? static_cast<int>(subs - s0) : 8;
        const uint8_t* g = src + (s0 / 8) * group_bytes<F>();
        Prep p{};
        F::prep(g, ns, p);
        alignas(32) float scf[8], mnf[8];
        alignas(16) int8_t sc[16], mn[16];
        _mm256_store_ps(scf, p.scf);
        _mm256_store_ps(mnf, p.mnf);
        _mm_store_si128(reinterpret_cast<__m128i*>(sc), p.sc);
        _mm_store_si128(reinterpret_cast<__m128i*>(mn), p.mn);
        for (int j = 0; j < ns; ++j) {
            const __m256i q = F::quants(g, p, j);
            const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
            float* out = dst + (s0 + j) * 32;
            for (int c = 0; c < 4; ++c) {
                const __m128i part = c % 2 ? _mm_srli_si128(halves[c / 2], 8) : halves[c / 2];
                const __m256 qf = widen8<F>(part);
                __m256 x;
                if constexpr (F::kKind == Kind::kUnsigned32) {
                    x = _mm256_fmadd_ps(qf, _mm256_set1_ps(scf[j]), _mm256_set1_ps(mnf[j]));
                } else if constexpr (F::kKind == Kind::kSigned32) {
                    x = _mm256_mul_ps(qf, _mm256_set1_ps(scf[j]));
                } else {
                    const int i16 = 2 * j + c / 2;  // the 16-element scale group
                    x = _mm256_mul_ps(qf, _mm256_set1_ps(scf[0] * static_cast<float>(sc[i16])));
                    if constexpr (F::kKind == Kind::kMin16)
                        x = _mm256_add_ps(x, _mm256_set1_ps(mnf[0] * static_cast<float>(mn[i16])));
                }
                _mm256_storeu_ps(out + 8 * c, x);
            }
        }
    }
}

}  // namespace kq
}  // namespace evk
#endif
