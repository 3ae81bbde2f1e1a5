#include "formats.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace evk {

namespace {

struct Entry { uint32_t id; TypeTraits t; };

// Sizes from ggml's block structs; only the types with kernels are computable.
constexpr Entry kTypes[] = {
    {0, {"F32", 1, 4, true}},        {1, {"F16", 1, 2, true}},
    {2, {"Q4_0", 32, 18, true}},     {3, {"Q4_1", 32, 20, true}},
    {6, {"Q5_0", 32, 22, false}},    {7, {"Q5_1", 32, 24, false}},
    {8, {"Q8_0", 32, 34, true}},     {9, {"Q8_1", 32, 36, false}},
    {10, {"Q2_K", 256, 84, false}},  {11, {"Q3_K", 256, 110, false}},
    {12, {"Q4_K", 256, 144, false}}, {13, {"Q5_K", 256, 176, false}},
    {14, {"Q6_K", 256, 210, false}}, {15, {"Q8_K", 256, 292, false}},
    {20, {"IQ4_NL", 32, 18, false}}, {24, {"I8", 1, 1, false}},
    {25, {"I16", 1, 2, false}},      {26, {"I32", 1, 4, false}},
    {27, {"I64", 1, 8, false}},      {28, {"F64", 1, 8, false}},
    {30, {"BF16", 1, 2, true}},
};

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

}  // namespace

const TypeTraits* type_traits(uint32_t ggml_type) {
    for (const Entry& e : kTypes) if (e.id == ggml_type) return &e.t;
    return nullptr;
}

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

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
    const float* h2f = half_table().v;
    switch (t) {
    case DType::F32:
        std::memcpy(dst, src, static_cast<size_t>(n) * 4);
        return;
    case DType::F16: {
        const uint8_t* s = static_cast<const uint8_t*>(src);
        for (int64_t i = 0; i < n; ++i) dst[i] = h2f[load_u16(s + 2 * i)];
        return;
    }
    case DType::BF16: {
        const uint8_t* s = static_cast<const uint8_t*>(src);
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(load_u16(s + 2 * i));
        return;
    }
    case DType::Q4_0: {
        const uint8_t* blk = static_cast<const uint8_t*>(src);
        for (int64_t ib = 0; ib < n / kQK; ++ib, dst += kQK, blk += sizeof(BlockQ4_0)) {
            const float d = h2f[load_u16(blk + offsetof(BlockQ4_0, d))];
            const uint8_t* qs = blk + offsetof(BlockQ4_0, qs);
            for (int j = 0; j < kQK / 2; ++j) {
                dst[j] = d * static_cast<float>((qs[j] & 0x0f) - 8);
                dst[j + kQK / 2] = d * static_cast<float>((qs[j] >> 4) - 8);
            }
        }
        return;
    }
    case DType::Q4_1: {
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
        return;
    }
    case DType::Q8_0: {
        const uint8_t* blk = static_cast<const uint8_t*>(src);
        for (int64_t ib = 0; ib < n / kQK; ++ib, dst += kQK, blk += sizeof(BlockQ8_0)) {
            const float d = h2f[load_u16(blk + offsetof(BlockQ8_0, d))];
            const int8_t* qs = reinterpret_cast<const int8_t*>(blk + offsetof(BlockQ8_0, qs));
            for (int j = 0; j < kQK; ++j) dst[j] = d * static_cast<float>(qs[j]);
        }
        return;
    }
    default:
        // Callers check TypeTraits::computable first; a zero row is a loud, testable failure.
        std::memset(dst, 0, static_cast<size_t>(n) * 4);
        return;
    }
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

}  // namespace evk
