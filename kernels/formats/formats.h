// Weight formats as data: ggml's type ids, block layouts, and a traits table (formats.cpp) that
// maps a type to its sizes (sizeof its block struct) and its reference conversions to and from
// float. Block layouts follow ggml-common.h exactly, so GGUF tensors are read in place from the mmap.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace evk {

// ggml type ids as they appear in GGUF tensor infos: every id ggml (llama.cpp b0.3.36's) knows
// (4, 5 and 31-33, 36-38 were retired upstream). Those without a to_float are named and sized so
// a file holding them is refused as "not supported", never as a bad file.
enum class DType : uint32_t {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9,
    Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15,
    IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
    I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28, IQ1_M = 29, BF16 = 30,
    TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39, NVFP4 = 40, Q1_0 = 41, Q2_0 = 42,
};

// Reference conversion of a row of n elements (a whole number of blocks) to float, and back.
using ToFloatFn = void (*)(const void* src, float* dst, int64_t n);
using FromFloatFn = void (*)(const float* src, void* dst, int64_t n);

struct TypeTraits {
    const char* name;
    int64_t block_size;      // elements per block
    int64_t block_bytes;     // bytes per block: sizeof the block struct
    bool computable;         // the engine has kernels for it (to_float and matmul): to_float is set
    ToFloatFn to_float;      // nullptr: not computable
    FromFloatFn from_float;  // nullptr: no reference quantizer
};

// nullptr for an id this build does not know.
const TypeTraits* type_traits(uint32_t ggml_type);
inline const TypeTraits* type_traits(DType t) { return type_traits(static_cast<uint32_t>(t)); }
// The type of a name ("Q4_0"); false for a name this build does not know.
bool type_named(const char* name, DType* t);

constexpr int kQK = 32;     // elements per block of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, IQ4_NL
constexpr int kQK_K = 256;  // elements per super-block of the K-quants

// Scales d, m, s, dmin are fp16 bits (uint16_t). With kernels:
struct BlockQ4_0 { uint16_t d; uint8_t qs[kQK / 2]; };              // x = d * (q - 8)
struct BlockQ4_1 { uint16_t d; uint16_t m; uint8_t qs[kQK / 2]; };  // x = d * q + m
struct BlockQ8_0 { uint16_t d; int8_t qs[kQK]; };                   // x = d * q
// In a 4-bit block, byte j holds element j in its low nibble and element j + 16 in its high one.
// Reference conversions (formats.cpp, kquants.cpp: the element order of each beside its decoder;
// Q8_1 is known to the reader only, Q8_K is quantize-only):
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[kQK / 2]; };
struct BlockQ5_1 { uint16_t d; uint16_t m; uint8_t qh[4]; uint8_t qs[kQK / 2]; };
struct BlockQ8_1 { uint16_t d; uint16_t s; int8_t qs[kQK]; };
struct BlockIQ4_NL { uint16_t d; uint8_t qs[kQK / 2]; };
struct BlockQ2_K { uint8_t scales[kQK_K / 16]; uint8_t qs[kQK_K / 4]; uint16_t d; uint16_t dmin; };
struct BlockQ3_K { uint8_t hmask[kQK_K / 8]; uint8_t qs[kQK_K / 4]; uint8_t scales[12]; uint16_t d; };
struct BlockQ4_K { uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t qs[kQK_K / 2]; };
struct BlockQ5_K { uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t qh[kQK_K / 8]; uint8_t qs[kQK_K / 2]; };
struct BlockQ6_K { uint8_t ql[kQK_K / 2]; uint8_t qh[kQK_K / 4]; int8_t scales[kQK_K / 16]; uint16_t d; };
struct BlockQ8_K { float d; int8_t qs[kQK_K]; int16_t bsums[kQK_K / 16]; };
static_assert(sizeof(BlockQ4_0) == 18, "ggml block_q4_0 layout");
static_assert(sizeof(BlockQ4_1) == 20, "ggml block_q4_1 layout");
static_assert(sizeof(BlockQ8_0) == 34, "ggml block_q8_0 layout");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_1) == 36 && sizeof(BlockIQ4_NL) == 18,
              "ggml 32-element block layouts");
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110 && sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 &&
                  sizeof(BlockQ6_K) == 210 && sizeof(BlockQ8_K) == 292,
              "ggml K-quant block layouts");

// Tensor data is read in place from the mapped file, and a valid GGUF file may align it to as little
// as 1 byte (general.alignment = 1): every 16-bit and 32-bit field of a weight row is loaded
// through these (one plain load after optimization), never through a typed pointer or block struct.
inline uint16_t load_u16(const void* p) {
    uint16_t v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void store_u16(void* p, uint16_t v) { std::memcpy(p, &v, sizeof v); }

// IQ4_NL's 16 levels (x = d * level of a 4-bit index): non-linear, denser near zero.
inline constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);  // round to nearest even
inline float bf16_to_fp32(uint16_t h) {
    union { uint32_t u; float f; } v{static_cast<uint32_t>(h) << 16};
    return v.f;
}

// Bytes of one row of n elements; 0 when n is not a whole number of blocks.
size_t row_bytes(DType t, int64_t n);

// Reference conversion of n elements (a whole number of blocks) to float: type_traits(t)->to_float;
// a zero row for a format that is not computable (callers check TypeTraits::computable first).
void dequantize_row(DType t, const void* src, float* dst, int64_t n);

// Reference quantization (tests and the converter's round trips), the from_float of these formats.
void quantize_row_q8_0(const float* x, void* dst, int64_t n);
void quantize_row_q4_0(const float* x, void* dst, int64_t n);
void quantize_row_q4_1(const float* x, void* dst, int64_t n);
void quantize_row_q5_0(const float* x, void* dst, int64_t n);
void quantize_row_q5_1(const float* x, void* dst, int64_t n);
void quantize_row_iq4_nl(const float* x, void* dst, int64_t n);
// The K-quants (kquants.cpp): 256-element super-blocks; Q8_K is quantize-only (activations).
void quantize_row_q2_k(const float* x, void* dst, int64_t n);
void quantize_row_q3_k(const float* x, void* dst, int64_t n);
void quantize_row_q4_k(const float* x, void* dst, int64_t n);
void quantize_row_q5_k(const float* x, void* dst, int64_t n);
void quantize_row_q6_k(const float* x, void* dst, int64_t n);
void quantize_row_q8_k(const float* x, void* dst, int64_t n);
// The integer view of a row (the int8 prefill GEMM reads it): each element as an unsigned quant
// q (0..255) and, per sub-block of int_view_block(t) elements (16: Q2_K, Q3_K, Q6_K; 32: the
// others), a scale and an offset with x = scale * q - offset, the same product and difference the
// reference dequantizer rounds (Q4_0: scale d, offset 8d; Q8_0 and IQ4_NL: q + 128, offset 128d; the
// K-quants: scale d sc, offset dmin m, or 32 / 4 times the scale for Q6_K / Q3_K's signed quants).
// n a whole number of blocks; scale and offset hold n / int_view_block(t) floats. 0 from
// int_view_block: t has no integer view (the float formats).
int int_view_block(DType t);
void int_view_row(DType t, const void* src, int64_t n, uint8_t* q, float* scale, float* offset);
void int_view_row_kquant(DType t, const void* src, int64_t n, uint8_t* q, float* scale, float* offset);  // kquants.cpp
void dequantize_row_q2_k(const void* src, float* dst, int64_t n);
void dequantize_row_q3_k(const void* src, float* dst, int64_t n);
void dequantize_row_q4_k(const void* src, float* dst, int64_t n);
void dequantize_row_q5_k(const void* src, float* dst, int64_t n);
void dequantize_row_q6_k(const void* src, float* dst, int64_t n);

}  // namespace evk
