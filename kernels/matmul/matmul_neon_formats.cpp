// NEON row kernels for Q5_0, Q5_1, IQ4_NL and the K-quants Q2_K..Q6_K (layouts: formats.h, ggml's):
// one decoder per format turns a block into groups of 32 int8 values with a float scale s and min m
// per half-group of 16 (w = s * q - m), and two consumers share every decoder: the dequantization of
// a row to float (matmul_neon_f32act, the prefill path) and the dot product of a row with int8
// activations (matmul_neon_q8act_dot: sdot, one activation block of 32 per group).
//
// The float products are the reference's: s = d * sc (sub-block scale first), then s * q - m, so
// dequantized rows match kernels/formats within the rounding of a fused multiply-add the compiler
// may form. In the dot product the sub-block scale multiplies the integer sum of 16 or 32 products,
// exact in int32 (|q| <= 127, |x| <= 127); mins are applied through the sums of the activations.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstddef>
#include <cstring>

#include "matmul_neon.h"

namespace evk {
namespace neon {

namespace {

// 32 decoded values of one group: elements 0..15 and 16..31.
struct Q32 {
    int8x16_t lo, hi;
};

inline int8x16_t s8(uint8x16_t v) { return vreinterpretq_s8_u8(v); }
inline uint8x16_t low_nibbles(uint8x16_t v) { return vandq_u8(v, vdupq_n_u8(0x0f)); }
inline uint8x16_t nibbles(uint8x16_t v, bool high) { return high ? vshrq_n_u8(v, 4) : low_nibbles(v); }
// v >> n per byte, n known only at run time (a group index).
inline uint8x16_t shr(uint8x16_t v, int n) { return vshlq_u8(v, vdupq_n_s8(static_cast<int8_t>(-n))); }
// 0x10 in byte i where bit `bit` of qh[i] is set (Q5_K's fifth bits of one sub-block).
inline uint8x16_t fifth_bit(uint8x16_t qh, int bit) {
    return vandq_u8(vtstq_u8(qh, vdupq_n_u8(static_cast<uint8_t>(1u << bit))), vdupq_n_u8(0x10));
}

// Q5_0 / Q5_1: 16 nibble bytes (element i low, i + 16 high) and a 32-bit qh whose bit i is element
// i's fifth bit: qh's bytes 0, 1 cover elements 0..15, bytes 2, 3 elements 16..31.
inline Q32 five_bit_block(const uint8_t* qh, const uint8_t* qs) {
    static const uint8_t kLaneBit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t bit = vld1q_u8(kLaneBit), sixteen = vdupq_n_u8(0x10);
    auto fifth = [&](int byte) {
        const uint8x16_t v = vcombine_u8(vdup_n_u8(qh[byte]), vdup_n_u8(qh[byte + 1]));
        return vandq_u8(vtstq_u8(v, bit), sixteen);
    };
    const uint8x16_t raw = vld1q_u8(qs);
    return {s8(vorrq_u8(low_nibbles(raw), fifth(0))), s8(vorrq_u8(vshrq_n_u8(raw, 4), fifth(2)))};
}

// The little-endian 32-bit word at p.
inline uint32_t word(const uint8_t* p) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    return w;
}

// Each format: kGroups groups of 32 per block of kBytes; scales() writes s[h], m[h] for the
// 2 kGroups half-groups (m untouched when the format has none: the caller zeroes it); group()
// the int8 values of group g. kSplit: the two halves of a group have their own scales.
struct FmtQ5_0 {
    static constexpr int kGroups = 1;
    static constexpr bool kSplit = false, kMins = false;
    static constexpr size_t kBytes = sizeof(BlockQ5_0);
    static void scales(const uint8_t* b, float* s, float*) { s[0] = s[1] = fp16_to_fp32(load_u16(b)); }
    static Q32 group(const uint8_t* b, int) {  // x = d (q - 16)
        const Q32 q = five_bit_block(b + offsetof(BlockQ5_0, qh), b + offsetof(BlockQ5_0, qs));
        return {vsubq_s8(q.lo, vdupq_n_s8(16)), vsubq_s8(q.hi, vdupq_n_s8(16))};
    }
};

struct FmtQ5_1 {  // x = d q + m: the min enters as -m
    static constexpr int kGroups = 1;
    static constexpr bool kSplit = false, kMins = true;
    static constexpr size_t kBytes = sizeof(BlockQ5_1);
    static void scales(const uint8_t* b, float* s, float* m) {
        s[0] = s[1] = fp16_to_fp32(load_u16(b));
        m[0] = m[1] = -fp16_to_fp32(load_u16(b + offsetof(BlockQ5_1, m)));
    }
    static Q32 group(const uint8_t* b, int) { return five_bit_block(b + offsetof(BlockQ5_1, qh), b + offsetof(BlockQ5_1, qs)); }
};

struct FmtIQ4_NL {  // x = d * kIQ4NLValues[nibble] (formats.h), one table lookup per 16 bytes
    static constexpr int kGroups = 1;
    static constexpr bool kSplit = false, kMins = false;
    static constexpr size_t kBytes = sizeof(BlockIQ4_NL);
    static void scales(const uint8_t* b, float* s, float*) { s[0] = s[1] = fp16_to_fp32(load_u16(b)); }
    static Q32 group(const uint8_t* b, int) {
        const int8x16_t levels = vld1q_s8(kIQ4NLValues);
        const uint8x16_t raw = vld1q_u8(b + offsetof(BlockIQ4_NL, qs));
        return {vqtbl1q_s8(levels, low_nibbles(raw)), vqtbl1q_s8(levels, vshrq_n_u8(raw, 4))};
    }
};

// Q4_K / Q5_K: d, dmin at bytes 0, 2, then 12 bytes of eight 6-bit scales and mins. As 32-bit
// words w0..w2: scales 0..3 = w0 & 0x3f.., mins 0..3 = w1 & 0x3f..; scales 4..7 take their low 4 bits
// from w2's low nibbles and their top 2 from w0's top bits, mins 4..7 from w2's high nibbles and w1.
inline void k4_scales(const uint8_t* b, float* s, float* m) {
    static_assert(offsetof(BlockQ4_K, scales) == 4 && offsetof(BlockQ5_K, scales) == 4, "Q4_K / Q5_K share a header");
    const float d = fp16_to_fp32(load_u16(b)), dmin = fp16_to_fp32(load_u16(b + 2));
    const uint32_t w0 = word(b + 4), w1 = word(b + 8), w2 = word(b + 12);
    const uint32_t words[4] = {w0 & 0x3f3f3f3fu, ((w2 >> 0) & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u),
                               w1 & 0x3f3f3f3fu, ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u)};
    uint8_t v[16];  // scales 0..7, then mins 0..7
    std::memcpy(v, words, 16);
    for (int j = 0; j < 8; ++j) {
        s[2 * j] = s[2 * j + 1] = d * static_cast<float>(v[j]);
        m[2 * j] = m[2 * j + 1] = dmin * static_cast<float>(v[8 + j]);
    }
}

struct FmtQ4_K {  // sub-block j: the low (j even) or high (j odd) nibbles of qs[32 (j / 2) ..]
    static constexpr int kGroups = 8;
    static constexpr bool kSplit = false, kMins = true;
    static constexpr size_t kBytes = sizeof(BlockQ4_K);
    static void scales(const uint8_t* b, float* s, float* m) { k4_scales(b, s, m); }
    static Q32 group(const uint8_t* b, int g) {
        const uint8_t* q = b + offsetof(BlockQ4_K, qs) + 32 * (g / 2);
        return {s8(nibbles(vld1q_u8(q), g % 2)), s8(nibbles(vld1q_u8(q + 16), g % 2))};
    }
};

struct FmtQ5_K {  // Q4_K's nibbles, fifth bit of sub-block j's element l at bit j of qh[l]
    static constexpr int kGroups = 8;
    static constexpr bool kSplit = false, kMins = true;
    static constexpr size_t kBytes = sizeof(BlockQ5_K);
    static void scales(const uint8_t* b, float* s, float* m) { k4_scales(b, s, m); }
    static Q32 group(const uint8_t* b, int g) {
        const uint8_t* q = b + offsetof(BlockQ5_K, qs) + 32 * (g / 2);
        const uint8_t* qh = b + offsetof(BlockQ5_K, qh);
        return {s8(vorrq_u8(nibbles(vld1q_u8(q), g % 2), fifth_bit(vld1q_u8(qh), g))),
                s8(vorrq_u8(nibbles(vld1q_u8(q + 16), g % 2), fifth_bit(vld1q_u8(qh + 16), g)))};
    }
};

// Group g = 4 h + t (h < 2, t < 4) of Q6_K: low 4 bits from ql[64 h + 32 (t % 2) ..] (low nibbles for
// t < 2, high for t >= 2), top 2 bits at bits 2t of qh[32 h ..]; q = that - 32. int8 scale per 16.
struct FmtQ6_K {
    static constexpr int kGroups = 8;
    static constexpr bool kSplit = true, kMins = false;
    static constexpr size_t kBytes = sizeof(BlockQ6_K);
    static void scales(const uint8_t* b, float* s, float*) {
        const float d = fp16_to_fp32(load_u16(b + offsetof(BlockQ6_K, d)));
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + offsetof(BlockQ6_K, scales));
        for (int j = 0; j < 16; ++j) s[j] = d * static_cast<float>(sc[j]);
    }
    static Q32 group(const uint8_t* b, int g) {
        const int h = g / 4, t = g % 4;
        const uint8_t* ql = b + offsetof(BlockQ6_K, ql) + 64 * h + 32 * (t % 2);
        const uint8_t* qh = b + offsetof(BlockQ6_K, qh) + 32 * h;
        auto half = [&](int i) {
            const uint8x16_t top = vshlq_n_u8(vandq_u8(shr(vld1q_u8(qh + i), 2 * t), vdupq_n_u8(3)), 4);
            return vsubq_s8(s8(vorrq_u8(nibbles(vld1q_u8(ql + i), t >= 2), top)), vdupq_n_s8(32));
        };
        return {half(0), half(16)};
    }
};

// Group g = 4 h + t of Q3_K: low 2 bits at bits 2t of qs[32 h ..], high bit at bit g of hmask[..];
// a clear high bit means 4 lower: q = low - 4 (1 - high). Sixteen 6-bit scales stored + 32, as
// words w0..w2: scale k's low 4 bits are nibble k / 8 of byte k % 8 (w0, w1), its top 2 bits are
// bits 2 (k / 4) of byte 8 + k % 4 (w2).
struct FmtQ3_K {
    static constexpr int kGroups = 8;
    static constexpr bool kSplit = true, kMins = false;
    static constexpr size_t kBytes = sizeof(BlockQ3_K);
    static void scales(const uint8_t* b, float* s, float*) {
        const float d = fp16_to_fp32(load_u16(b + offsetof(BlockQ3_K, d)));
        const uint8_t* p = b + offsetof(BlockQ3_K, scales);
        const uint32_t w0 = word(p), w1 = word(p + 4), w2 = word(p + 8);
        const uint32_t words[4] = {(w0 & 0x0f0f0f0fu) | ((w2 << 4) & 0x30303030u), (w1 & 0x0f0f0f0fu) | ((w2 << 2) & 0x30303030u),
                                   ((w0 >> 4) & 0x0f0f0f0fu) | (w2 & 0x30303030u),
                                   ((w1 >> 4) & 0x0f0f0f0fu) | ((w2 >> 2) & 0x30303030u)};
        uint8_t v[16];
        std::memcpy(v, words, 16);
        for (int j = 0; j < 16; ++j) s[j] = d * static_cast<float>(static_cast<int>(v[j]) - 32);
    }
    static Q32 group(const uint8_t* b, int g) {
        const int h = g / 4, t = g % 4;
        const uint8_t* qs = b + offsetof(BlockQ3_K, qs) + 32 * h;
        const uint8_t* hm = b + offsetof(BlockQ3_K, hmask);
        auto half = [&](int i) {
            const uint8x16_t low = vandq_u8(shr(vld1q_u8(qs + i), 2 * t), vdupq_n_u8(3));
            const uint8x16_t high = vtstq_u8(vld1q_u8(hm + i), vdupq_n_u8(static_cast<uint8_t>(1u << g)));
            return vsubq_s8(s8(low), s8(vbicq_u8(vdupq_n_u8(4), high)));
        };
        return {half(0), half(16)};
    }
};

// Group g = 4 h + t of Q2_K: bits 2t of qs[32 h ..]; byte j of scales: sub-block j's scale (low
// nibble) and min (high nibble).
struct FmtQ2_K {
    static constexpr int kGroups = 8;
    static constexpr bool kSplit = true, kMins = true;
    static constexpr size_t kBytes = sizeof(BlockQ2_K);
    static void scales(const uint8_t* b, float* s, float* m) {
        const float d = fp16_to_fp32(load_u16(b + offsetof(BlockQ2_K, d)));
        const float dmin = fp16_to_fp32(load_u16(b + offsetof(BlockQ2_K, dmin)));
        const uint8_t* sc = b + offsetof(BlockQ2_K, scales);
        for (int j = 0; j < 16; ++j) {
            s[j] = d * static_cast<float>(sc[j] & 0xf);
            m[j] = dmin * static_cast<float>(sc[j] >> 4);
        }
    }
    static Q32 group(const uint8_t* b, int g) {
        const uint8_t* qs = b + offsetof(BlockQ2_K, qs) + 32 * (g / 4);
        const int t = g % 4;
        return {s8(vandq_u8(shr(vld1q_u8(qs), 2 * t), vdupq_n_u8(3))), s8(vandq_u8(shr(vld1q_u8(qs + 16), 2 * t), vdupq_n_u8(3)))};
    }
};

// 16 values of q as floats: s * q - m.
inline void store_half(float* dst, int8x16_t q, float s, float m) {
    const int16x8_t a = vmovl_s8(vget_low_s8(q)), b = vmovl_high_s8(q);
    const int32x4_t v[4] = {vmovl_s16(vget_low_s16(a)), vmovl_high_s16(a), vmovl_s16(vget_low_s16(b)), vmovl_high_s16(b)};
    for (int i = 0; i < 4; ++i) vst1q_f32(dst + 4 * i, vsubq_f32(vmulq_n_f32(vcvtq_f32_s32(v[i]), s), vdupq_n_f32(m)));
}

template <class F>
void dequantize(const uint8_t* row, float* dst, int64_t n) {
    float s[16], m[16] = {};
    for (int64_t b = 0; b < n / (kQK * F::kGroups); ++b, row += F::kBytes) {
        F::scales(row, s, m);
        for (int g = 0; g < F::kGroups; ++g, dst += kQK) {
            const Q32 q = F::group(row, g);
            store_half(dst, q.lo, s[2 * g], m[2 * g]);
            store_half(dst + 16, q.hi, s[2 * g + 1], m[2 * g + 1]);
        }
    }
}

// One row against nb activation blocks of 32 (group i of the row meets block i).
template <class F>
__attribute__((target("arch=armv8.2-a+dotprod"))) float dot(const uint8_t* row, const BlockQ8A* y, int64_t nb) {
    float acc = 0.f, offs = 0.f;
    float s[16], m[16] = {};
    const int32x4_t zero = vdupq_n_s32(0);
    for (int64_t b = 0; b < nb / F::kGroups; ++b, row += F::kBytes) {
        F::scales(row, s, m);
        for (int g = 0; g < F::kGroups; ++g, ++y) {
            const Q32 q = F::group(row, g);
            const int8x16_t y0 = vld1q_s8(y->qs), y1 = vld1q_s8(y->qs + 16);
            if constexpr (F::kSplit) {
                const float p0 = static_cast<float>(vaddvq_s32(vdotq_s32(zero, q.lo, y0)));
                const float p1 = static_cast<float>(vaddvq_s32(vdotq_s32(zero, q.hi, y1)));
                acc += y->d * (s[2 * g] * p0 + s[2 * g + 1] * p1);
                if constexpr (F::kMins)
                    offs += y->d * (m[2 * g] * static_cast<float>(vaddlvq_s8(y0)) + m[2 * g + 1] * static_cast<float>(vaddlvq_s8(y1)));
            } else {
                const int32x4_t p = vdotq_s32(vdotq_s32(zero, q.lo, y0), q.hi, y1);
                acc += y->d * s[2 * g] * static_cast<float>(vaddvq_s32(p));
                if constexpr (F::kMins) offs += m[2 * g] * y->s;
            }
        }
    }
    return acc - offs;
}

template <class F>
constexpr FormatKernels kernels_of() {
    return {dequantize<F>, dot<F>};
}

struct Entry {
    DType t;
    FormatKernels k;
};
const Entry kFormats[] = {
    {DType::Q5_0, kernels_of<FmtQ5_0>()}, {DType::Q5_1, kernels_of<FmtQ5_1>()}, {DType::IQ4_NL, kernels_of<FmtIQ4_NL>()},
    {DType::Q2_K, kernels_of<FmtQ2_K>()}, {DType::Q3_K, kernels_of<FmtQ3_K>()}, {DType::Q4_K, kernels_of<FmtQ4_K>()},
    {DType::Q5_K, kernels_of<FmtQ5_K>()}, {DType::Q6_K, kernels_of<FmtQ6_K>()},
};

}  // namespace

const FormatKernels* format_kernels(DType t) {
    for (const Entry& e : kFormats)
        if (e.t == t) return &e.k;
    return nullptr;
}

}  // namespace neon
}  // namespace evk
#endif
