// Weight formats as data: ggml's type ids, block layouts and sizes, and reference conversions.
// Block layouts follow ggml-common.h exactly, so GGUF tensors are read in place from the mmap.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace evk {

// ggml type ids as they appear in GGUF tensor infos (ids 4 and 5 were retired upstream).
enum class DType : uint32_t {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
    Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, IQ4_NL = 20,
    I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, BF16 = 30,
};

struct TypeTraits {
    const char* name;
    int64_t block_size;    // elements per block
    int64_t block_bytes;   // bytes per block
    bool computable;       // the engine has kernels for it (dequantize_row and matmul)
};

// nullptr for an id this build does not know.
const TypeTraits* type_traits(uint32_t ggml_type);
inline const TypeTraits* type_traits(DType t) { return type_traits(static_cast<uint32_t>(t)); }

constexpr int kQK = 32;  // elements per block of Q4_0, Q4_1, Q8_0

struct BlockQ4_0 { uint16_t d; uint8_t qs[kQK / 2]; };              // x = d * (q - 8)
struct BlockQ4_1 { uint16_t d; uint16_t m; uint8_t qs[kQK / 2]; };  // x = d * q + m
struct BlockQ8_0 { uint16_t d; int8_t qs[kQK]; };                   // x = d * q
static_assert(sizeof(BlockQ4_0) == 18, "ggml block_q4_0 layout");
static_assert(sizeof(BlockQ4_1) == 20, "ggml block_q4_1 layout");
static_assert(sizeof(BlockQ8_0) == 34, "ggml block_q8_0 layout");
// In a 4-bit block, byte j holds element j in its low nibble and element j + 16 in its high one.

// Tensor data is read in place from the mapped file, and a valid GGUF file may align it to as little
// as 1 byte (general.alignment = 1): every 16-bit and 32-bit field of a weight row is loaded
// through these (one plain load after optimization), never through a typed pointer or block struct.
inline uint16_t load_u16(const void* p) {
    uint16_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);  // round to nearest even
inline float bf16_to_fp32(uint16_t h) {
    union { uint32_t u; float f; } v{static_cast<uint32_t>(h) << 16};
    return v.f;
}

// Bytes of one row of n elements; 0 when n is not a whole number of blocks.
size_t row_bytes(DType t, int64_t n);

// Reference conversion of n elements (a whole number of blocks) to float.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);

// Reference quantization (tests and the converter's round trips).
void quantize_row_q8_0(const float* x, void* dst, int64_t n);
void quantize_row_q4_0(const float* x, void* dst, int64_t n);
void quantize_row_q4_1(const float* x, void* dst, int64_t n);

}  // namespace evk
