#include "formats.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace evk {

namespace {

float half_bits_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: renormalize
            exp = 127 - 15 + 1;
            while ((man & 0x400u) == 0) { man <<= 1; --exp; }
            man &= 0x3ffu;
            bits = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// 64 KiB table: F16 weights and block scales are converted on every use.
struct HalfTable {
    float v[65536];
    HalfTable() { for (uint32_t i = 0; i < 65536; ++i) v[i] = half_bits_to_float(static_cast<uint16_t>(i)); }
};
const HalfTable& half_table() { static const HalfTable t; return t; }

// Element j (< 32) of a Q5 block: its nibble (low of qs[j], high of qs[j - 16]) and bit j of qh.
int q5_at(const uint8_t* qs, uint32_t qh, int j) {
    const int nib = j < kQK / 2 ? (qs[j] & 0x0f) : (qs[j - kQK / 2] >> 4);
    return nib | static_cast<int>(((qh >> j) & 1u) << 4);
}

// Q5 quantization of one block: q = trunc((x - lo) * id + bias), at most 31 (a NaN gives 0), its
// low nibble into qs, its fifth bit into qh.
void store_q5(const float* x, float id, float bias, float lo, uint8_t* qh_out, uint8_t* qs) {
    uint32_t qh = 0;
    for (int j = 0; j < kQK / 2; ++j) {
        const int q0 = static_cast<int>(std::fmin(std::fmax((x[j] - lo) * id + bias, 0.f), 31.f));
        const int q1 = static_cast<int>(std::fmin(std::fmax((x[j + kQK / 2] - lo) * id + bias, 0.f), 31.f));
        qs[j] = static_cast<uint8_t>((q0 & 0x0f) | ((q1 & 0x0f) << 4));
        qh |= static_cast<uint32_t>(q0 >> 4) << j;
        qh |= static_cast<uint32_t>(q1 >> 4) << (j + kQK / 2);
    }
    std::memcpy(qh_out, &qh, 4);
}

}  // namespace

float fp16_to_fp32(uint16_t h) { return half_table().v[h]; }

uint16_t fp32_to_fp16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past max half
    if (ax < 0x38800000u) {  // subnormal or zero in half
        if (ax < 0x33000000u) return static_cast<uint16_t>(sign);
        const uint32_t e = ax >> 23;
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e;  // value / 2^-24 = mantissa * 2^(e - 126)
        uint32_t r = m >> (shift);
        const uint32_t rem = m & ((1u << shift) - 1);
        const uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) ++r;
        return static_cast<uint16_t>(sign | r);
    }
    uint32_t r = ((ax - 0x38000000u) >> 13);
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
}

size_t row_bytes(DType t, int64_t n) {
    const TypeTraits* tt = type_traits(t);
    if (!tt || n < 0 || n % tt->block_size != 0) return 0;
    return static_cast<size_t>(n / tt->block_size) * static_cast<size_t>(tt->block_bytes);
}

void quantize_row_q8_0(const float* x, void* dst, int64_t n) {
    BlockQ8_0* b = static_cast<BlockQ8_0*>(dst);
    for (int64_t ib = 0; ib < n / kQK; ++ib, x += kQK) {
        float amax = 0.f;
        for (int j = 0; j < kQK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
        const float d = amax / 127.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        b[ib].d = fp32_to_fp16(d);
        for (int j = 0; j < kQK; ++j) b[ib].qs[j] = static_cast<int8_t>(std::lround(x[j] * id));
    }
}

void quantize_row_q4_0(const float* x, void* dst, int64_t n) {
    BlockQ4_0* b = static_cast<BlockQ4_0*>(dst);
    for (int64_t ib = 0; ib < n / kQK; ++ib, x += kQK) {
        float amax = 0.f, max = 0.f;  // the signed value of largest magnitude maps to -8
        for (int j = 0; j < kQK; ++j) {
            if (std::fabs(x[j]) > amax) { amax = std::fabs(x[j]); max = x[j]; }
        }
        const float d = max / -8.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        b[ib].d = fp32_to_fp16(d);
        for (int j = 0; j < kQK / 2; ++j) {
            const int q0 = std::min(15, static_cast<int>(x[j] * id + 8.5f));
            const int q1 = std::min(15, static_cast<int>(x[j + kQK / 2] * id + 8.5f));
            b[ib].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
    }
}

void quantize_row_q4_1(const float* x, void* dst, int64_t n) {
    BlockQ4_1* b = static_cast<BlockQ4_1*>(dst);
    for (int64_t ib = 0; ib < n / kQK; ++ib, x += kQK) {
        float lo = x[0], hi = x[0];
        for (int j = 1; j < kQK; ++j) { lo = std::fmin(lo, x[j]); hi = std::fmax(hi, x[j]); }
        const float d = (hi - lo) / 15.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        b[ib].d = fp32_to_fp16(d);
        b[ib].m = fp32_to_fp16(lo);
        for (int j = 0; j < kQK / 2; ++j) {
            const int q0 = std::min(15, static_cast<int>((x[j] - lo) * id + 0.5f));
            const int q1 = std::min(15, static_cast<int>((x[j + kQK / 2] - lo) * id + 0.5f));
            b[ib].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
    }
}

// Q5_0 / Q5_1: Q4_0 / Q4_1's nibbles plus a fifth bit, bit j of the little-endian 32-bit qh for
// element j. The quantizers are ggml's reference rule (the gguf package's too: bit-identical).
void quantize_row_q5_0(const float* x, void* dst, int64_t n) {
    uint8_t* blk = static_cast<uint8_t*>(dst);
    for (int64_t ib = 0; ib < n / kQK; ++ib, x += kQK, blk += sizeof(BlockQ5_0)) {
        float amax = 0.f, max = 0.f;  // the signed value of largest magnitude maps to -16
        for (int j = 0; j < kQK; ++j)
            if (std::fabs(x[j]) > amax) { amax = std::fabs(x[j]); max = x[j]; }
        const float d = max / -16.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        store_q5(x, id, 16.5f, 0.f, blk + offsetof(BlockQ5_0, qh), blk + offsetof(BlockQ5_0, qs));
        store_u16(blk + offsetof(BlockQ5_0, d), fp32_to_fp16(d));
    }
}

void quantize_row_q5_1(const float* x, void* dst, int64_t n) {
    uint8_t* blk = static_cast<uint8_t*>(dst);
    for (int64_t ib = 0; ib < n / kQK; ++ib, x += kQK, blk += sizeof(BlockQ5_1)) {
        float lo = x[0], hi = x[0];
        for (int j = 1; j < kQK; ++j) { lo = std::fmin(lo, x[j]); hi = std::fmax(hi, x[j]); }
        const float d = (hi - lo) / 31.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        store_q5(x, id, 0.5f, lo, blk + offsetof(BlockQ5_1, qh), blk + offsetof(BlockQ5_1, qs));
        store_u16(blk + offsetof(BlockQ5_1, d), fp32_to_fp16(d));
        store_u16(blk + offsetof(BlockQ5_1, m), fp32_to_fp16(lo));
    }
}

namespace {

// The index of the level nearest v (v / d of an element; a tie goes to the lower level), by
// bisection of the sorted levels. A NaN gives 15.
int nearest_iq4nl(float v) {
    if (v <= kIQ4NLValues[0]) return 0;
    int lo = 0, hi = 15;  // kIQ4NLValues[lo] < v, and v < kIQ4NLValues[hi] unless hi = 15
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (v < kIQ4NLValues[mid]) hi = mid; else lo = mid;
    }
    return v - kIQ4NLValues[lo] <= kIQ4NLValues[hi] - v ? lo : hi;
}

}  // namespace

// Ours: candidate scales around "largest magnitude at level -127" (a few percent either way), each
// refit by least squares over its assignment (d = sum level x / sum level^2), the one of smallest
// squared error kept; the final indices are chosen against the fp16 d the block stores.
void quantize_row_iq4_nl(const float* x, void* dst, int64_t n) {
    uint8_t* blk = static_cast<uint8_t*>(dst);
    for (int64_t ib = 0; ib < n / kQK; ++ib, x += kQK, blk += sizeof(BlockIQ4_NL)) {
        float amax = 0.f, max = 0.f;
        for (int j = 0; j < kQK; ++j)
            if (std::fabs(x[j]) > amax) { amax = std::fabs(x[j]); max = x[j]; }
        float best_d = max / -127.f, best = INFINITY;
        for (int k = -6; k <= 6 && amax > 0.f; ++k) {
            float d = max / -127.f * (1.f + 0.03f * static_cast<float>(k));
            double svx = 0, svv = 0;
            for (int j = 0; j < kQK; ++j) {
                const double v = kIQ4NLValues[nearest_iq4nl(x[j] / d)];
                svx += v * x[j], svv += v * v;
            }
            if (svv > 0 && svx != 0) d = static_cast<float>(svx / svv);
            double err = 0;
            for (int j = 0; j < kQK; ++j) {
                const float e = d * static_cast<float>(kIQ4NLValues[nearest_iq4nl(x[j] / d)]) - x[j];
                err += static_cast<double>(e) * e;
            }
            if (err < best) { best = static_cast<float>(err); best_d = d; }
        }
        const uint16_t dh = fp32_to_fp16(best_d);
        const float d = fp16_to_fp32(dh);
        const float id = d != 0.f ? 1.f / d : 0.f;
        uint8_t* qs = blk + offsetof(BlockIQ4_NL, qs);
        for (int j = 0; j < kQK / 2; ++j)
            qs[j] = static_cast<uint8_t>(nearest_iq4nl(x[j] * id) | (nearest_iq4nl(x[j + kQK / 2] * id) << 4));
        store_u16(blk + offsetof(BlockIQ4_NL, d), dh);
    }
}

namespace {

// Reference conversions of a row to float, one per computable format (its to_float).
void f32_to_float(const void* src, float* dst, int64_t n) { std::memcpy(dst, src, static_cast<size_t>(n) * 4); }

void f16_to_float(const void* src, float* dst, int64_t n) {
    const float* h2f = half_table().v;
    const uint8_t* s = static_cast<const uint8_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = h2f[load_u16(s + 2 * i)];
}

void bf16_to_float(const void* src, float* dst, int64_t n) {
    const uint8_t* s = static_cast<const uint8_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(load_u16(s + 2 * i));
}

void q4_0_to_float(const void* src, float* dst, int64_t n) {
    const float* h2f = half_table().v;
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK; ++ib, dst += kQK, blk += sizeof(BlockQ4_0)) {
        const float d = h2f[load_u16(blk + offsetof(BlockQ4_0, d))];
        const uint8_t* qs = blk + offsetof(BlockQ4_0, qs);
        for (int j = 0; j < kQK / 2; ++j) {
            dst[j] = d * static_cast<float>((qs[j] & 0x0f) - 8);
            dst[j + kQK / 2] = d * static_cast<float>((qs[j] >> 4) - 8);
        }
    }
}

void q4_1_to_float(const void* src, float* dst, int64_t n) {
    const float* h2f = half_table().v;
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK; ++ib, dst += kQK, blk += sizeof(BlockQ4_1)) {
        const float d = h2f[load_u16(blk + offsetof(BlockQ4_1, d))];
        const float m = h2f[load_u16(blk + offsetof(BlockQ4_1, m))];
        const uint8_t* qs = blk + offsetof(BlockQ4_1, qs);
        for (int j = 0; j < kQK / 2; ++j) {
            dst[j] = d * static_cast<float>(qs[j] & 0x0f) + m;
            dst[j + kQK / 2] = d * static_cast<float>(qs[j] >> 4) + m;
        }
    }
}

void q8_0_to_float(const void* src, float* dst, int64_t n) {
    const float* h2f = half_table().v;
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK; ++ib, dst += kQK, blk += sizeof(BlockQ8_0)) {
        const float d = h2f[load_u16(blk + offsetof(BlockQ8_0, d))];
        const int8_t* qs = reinterpret_cast<const int8_t*>(blk + offsetof(BlockQ8_0, qs));
        for (int j = 0; j < kQK; ++j) dst[j] = d * static_cast<float>(qs[j]);
    }
}

// x = d * (q - 16); the gguf package computes the same float32 product.
void q5_0_to_float(const void* src, float* dst, int64_t n) {
    const float* h2f = half_table().v;
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK; ++ib, dst += kQK, blk += sizeof(BlockQ5_0)) {
        const float d = h2f[load_u16(blk + offsetof(BlockQ5_0, d))];
        uint32_t qh;
        std::memcpy(&qh, blk + offsetof(BlockQ5_0, qh), 4);
        const uint8_t* qs = blk + offsetof(BlockQ5_0, qs);
        for (int j = 0; j < kQK; ++j) dst[j] = d * static_cast<float>(q5_at(qs, qh, j) - 16);
    }
}

// x = d * q + m, rounded after the product and after the sum as gguf does (two statements: no
// fused multiply-add, see kquants.cpp).
void q5_1_to_float(const void* src, float* dst, int64_t n) {
    const float* h2f = half_table().v;
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK; ++ib, dst += kQK, blk += sizeof(BlockQ5_1)) {
        const float d = h2f[load_u16(blk + offsetof(BlockQ5_1, d))];
        const float m = h2f[load_u16(blk + offsetof(BlockQ5_1, m))];
        uint32_t qh;
        std::memcpy(&qh, blk + offsetof(BlockQ5_1, qh), 4);
        const uint8_t* qs = blk + offsetof(BlockQ5_1, qs);
        for (int j = 0; j < kQK; ++j) {
            const float p = d * static_cast<float>(q5_at(qs, qh, j));
            dst[j] = p + m;
        }
    }
}

void iq4_nl_to_float(const void* src, float* dst, int64_t n) {
    const float* h2f = half_table().v;
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK; ++ib, dst += kQK, blk += sizeof(BlockIQ4_NL)) {
        const float d = h2f[load_u16(blk + offsetof(BlockIQ4_NL, d))];
        const uint8_t* qs = blk + offsetof(BlockIQ4_NL, qs);
        for (int j = 0; j < kQK / 2; ++j) {
            dst[j] = d * static_cast<float>(kIQ4NLValues[qs[j] & 0x0f]);
            dst[j + kQK / 2] = d * static_cast<float>(kIQ4NLValues[qs[j] >> 4]);
        }
    }
}

// From float (their from_float): F32 as is, F16 rounded to nearest even (fp32_to_fp16), BF16
// likewise (the top 16 bits plus the rounding carry; a NaN stays a NaN, made quiet).
void f32_from_float(const float* x, void* dst, int64_t n) { std::memcpy(dst, x, static_cast<size_t>(n) * 4); }

void f16_from_float(const float* x, void* dst, int64_t n) {
    uint8_t* o = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = fp32_to_fp16(x[i]);
        std::memcpy(o + 2 * i, &h, 2);
    }
}

void bf16_from_float(const float* x, void* dst, int64_t n) {
    uint8_t* o = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, &x[i], 4);
        const uint16_t h = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)
                                                            : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        std::memcpy(o + 2 * i, &h, 2);
    }
}

struct Entry {
    uint32_t id;
    TypeTraits t;
};

// A format of blocks of `per_block` elements laid out as Block: computable with a to_float, known
// only (sizes) without. (Overloads, not `to != nullptr`: the address of a function of another
// file is no constant expression under the sanitizers' builds.)
template <class Block>
constexpr Entry format(DType id, const char* name, int64_t per_block, ToFloatFn to, FromFloatFn from) {
    return {static_cast<uint32_t>(id), {name, per_block, static_cast<int64_t>(sizeof(Block)), true, to, from}};
}
template <class Block>
constexpr Entry format(DType id, const char* name, int64_t per_block, FromFloatFn from = nullptr) {
    return {static_cast<uint32_t>(id), {name, per_block, static_cast<int64_t>(sizeof(Block)), false, nullptr, from}};
}

// A format this build only names and sizes (ggml-common.h's block sizes): never computable.
constexpr Entry sized(DType id, const char* name, int64_t per_block, int64_t bytes) {
    return {static_cast<uint32_t>(id), {name, per_block, bytes, false, nullptr, nullptr}};
}

// The traits table: every ggml type this build knows, its sizes from its block struct (a scalar
// type is a block of one), and its reference conversions where the engine has kernels.
constexpr Entry kTypes[] = {
    format<float>(DType::F32, "F32", 1, f32_to_float, f32_from_float),
    format<uint16_t>(DType::F16, "F16", 1, f16_to_float, f16_from_float),
    format<BlockQ4_0>(DType::Q4_0, "Q4_0", kQK, q4_0_to_float, quantize_row_q4_0),
    format<BlockQ4_1>(DType::Q4_1, "Q4_1", kQK, q4_1_to_float, quantize_row_q4_1),
    format<BlockQ5_0>(DType::Q5_0, "Q5_0", kQK, q5_0_to_float, quantize_row_q5_0),
    format<BlockQ5_1>(DType::Q5_1, "Q5_1", kQK, q5_1_to_float, quantize_row_q5_1),
    format<BlockQ8_0>(DType::Q8_0, "Q8_0", kQK, q8_0_to_float, quantize_row_q8_0),
    format<BlockQ8_1>(DType::Q8_1, "Q8_1", kQK),
    format<BlockQ2_K>(DType::Q2_K, "Q2_K", kQK_K, dequantize_row_q2_k, quantize_row_q2_k),
    format<BlockQ3_K>(DType::Q3_K, "Q3_K", kQK_K, dequantize_row_q3_k, quantize_row_q3_k),
    format<BlockQ4_K>(DType::Q4_K, "Q4_K", kQK_K, dequantize_row_q4_k, quantize_row_q4_k),
    format<BlockQ5_K>(DType::Q5_K, "Q5_K", kQK_K, dequantize_row_q5_k, quantize_row_q5_k),
    format<BlockQ6_K>(DType::Q6_K, "Q6_K", kQK_K, dequantize_row_q6_k, quantize_row_q6_k),
    // The activation side of K-quant dot kernels: a quantizer, never a weight format.
    format<BlockQ8_K>(DType::Q8_K, "Q8_K", kQK_K, quantize_row_q8_k),
    format<BlockIQ4_NL>(DType::IQ4_NL, "IQ4_NL", kQK, iq4_nl_to_float, quantize_row_iq4_nl),
    sized(DType::IQ2_XXS, "IQ2_XXS", kQK_K, 66),
    sized(DType::IQ2_XS, "IQ2_XS", kQK_K, 74),
    sized(DType::IQ3_XXS, "IQ3_XXS", kQK_K, 98),
    sized(DType::IQ1_S, "IQ1_S", kQK_K, 50),
    sized(DType::IQ3_S, "IQ3_S", kQK_K, 110),
    sized(DType::IQ2_S, "IQ2_S", kQK_K, 82),
    sized(DType::IQ4_XS, "IQ4_XS", kQK_K, 136),
    sized(DType::IQ1_M, "IQ1_M", kQK_K, 56),
    sized(DType::TQ1_0, "TQ1_0", kQK_K, 54),
    sized(DType::TQ2_0, "TQ2_0", kQK_K, 66),
    sized(DType::MXFP4, "MXFP4", 32, 17),
    sized(DType::NVFP4, "NVFP4", 64, 36),
    sized(DType::Q1_0, "Q1_0", 128, 18),
    sized(DType::Q2_0, "Q2_0", 64, 18),
    format<int8_t>(DType::I8, "I8", 1),
    format<int16_t>(DType::I16, "I16", 1),
    format<int32_t>(DType::I32, "I32", 1),
    format<int64_t>(DType::I64, "I64", 1),
    format<double>(DType::F64, "F64", 1),
    format<uint16_t>(DType::BF16, "BF16", 1, bf16_to_float, bf16_from_float),
};

// ggml type id -> its entry, or nullptr: one indexed load per lookup (dequantize_row runs per row).
constexpr uint32_t kMaxId = 43;
struct ById {
    const TypeTraits* t[kMaxId] = {};
    constexpr ById() {
        for (const Entry& e : kTypes) t[e.id] = &e.t;
    }
};
constexpr ById kById{};
static_assert(static_cast<uint32_t>(DType::Q2_0) < kMaxId, "kMaxId covers every type id");

}  // namespace

const TypeTraits* type_traits(uint32_t ggml_type) { return ggml_type < kMaxId ? kById.t[ggml_type] : nullptr; }

bool type_named(const char* name, DType* t) {
    for (const Entry& e : kTypes)
        if (std::strcmp(e.t.name, name) == 0) {
            *t = static_cast<DType>(e.id);
            return true;
        }
    return false;
}

int int_view_block(DType t) {
    switch (t) {
    case DType::Q2_K: case DType::Q3_K: case DType::Q6_K: return 16;
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: case DType::Q8_0: case DType::IQ4_NL:
    case DType::Q4_K: case DType::Q5_K: return kQK;
    default: return 0;
    }
}

void int_view_row(DType t, const void* src, int64_t n, uint8_t* q, float* scale, float* offset) {
    if (t == DType::Q2_K || t == DType::Q3_K || t == DType::Q4_K || t == DType::Q5_K || t == DType::Q6_K)
        return int_view_row_kquant(t, src, n, q, scale, offset);
    const float* h2f = half_table().v;
    const TypeTraits* tt = type_traits(t);
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK; ++ib, q += kQK, blk += tt->block_bytes) {
        const float d = h2f[load_u16(blk)];  // every one of these blocks starts with d
        switch (t) {
        case DType::Q4_0: case DType::Q4_1: case DType::IQ4_NL: {
            const uint8_t* qs = blk + (t == DType::Q4_1 ? offsetof(BlockQ4_1, qs) : offsetof(BlockQ4_0, qs));
            for (int j = 0; j < kQK / 2; ++j) {
                q[j] = qs[j] & 0x0f;
                q[j + kQK / 2] = qs[j] >> 4;
            }
            if (t == DType::IQ4_NL)
                for (int j = 0; j < kQK; ++j) q[j] = static_cast<uint8_t>(kIQ4NLValues[q[j]] + 128);
            scale[ib] = d;
            offset[ib] = t == DType::Q4_0 ? 8.f * d : t == DType::IQ4_NL ? 128.f * d : -h2f[load_u16(blk + offsetof(BlockQ4_1, m))];
            break;
        }
        case DType::Q5_0: case DType::Q5_1: {
            const size_t at = t == DType::Q5_0 ? offsetof(BlockQ5_0, qh) : offsetof(BlockQ5_1, qh);
            uint32_t qh;
            std::memcpy(&qh, blk + at, 4);
            for (int j = 0; j < kQK; ++j) q[j] = static_cast<uint8_t>(q5_at(blk + at + 4, qh, j));
            scale[ib] = d;
            offset[ib] = t == DType::Q5_0 ? 16.f * d : -h2f[load_u16(blk + offsetof(BlockQ5_1, m))];
            break;
        }
        case DType::Q8_0: {
            const int8_t* qs = reinterpret_cast<const int8_t*>(blk + offsetof(BlockQ8_0, qs));
            for (int j = 0; j < kQK; ++j) q[j] = static_cast<uint8_t>(qs[j] + 128);
            scale[ib] = d;
            offset[ib] = 128.f * d;
            break;
        }
        default:
            std::memset(q, 0, kQK);
            scale[ib] = offset[ib] = 0.f;
        }
    }
}

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
    const TypeTraits* tt = type_traits(t);
    if (tt && tt->to_float) {
        tt->to_float(src, dst, n);
        return;
    }
    // Callers check TypeTraits::computable first; a zero row is a loud, testable failure.
    std::memset(dst, 0, static_cast<size_t>(n) * 4);
}

}  // namespace evk
