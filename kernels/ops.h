// The operator table: every compute operator the models use, as function pointers.
// Models call through the table only; which variant fills a slot is decided once, at start,
// from the CPU's features (kernels/optable.cpp). Kernels know nothing of models and never
// allocate: any scratch they need is handed to them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "formats/formats.h"

namespace evk {

// How a weight's bytes are laid out: the file's rows, or packed (kernels/matmul/packed_x8.h,
// kernels/matmul/packed_p16.h).
enum class WLayout : uint8_t { kRows = 0, kX8 = 1, kP16 = 2 };

// y[t][r] = dot(W row r, x[t]) for rows [row0, row1) and tokens t in [0, m).
// W rows are k elements of wtype, w_row_bytes apart (w_layout kRows), or the whole weight packed
// in w_layout. scratch holds at least kMatmulScratchRows * k floats, private to the calling thread.
// A variant with an activation format of its own (MatmulChoice::act) reads x converted once per
// product by the caller: xp is token 0 of this call, xp_stride bytes between tokens; x stays set.
struct MatmulArgs {
    const void* w;
    DType wtype;
    size_t w_row_bytes;
    int64_t k;
    int64_t row0, row1;
    const float* x;
    int64_t x_stride;  // floats between tokens of x
    float* y;
    int64_t y_stride;  // floats between tokens of y
    int64_t m;
    float* scratch;
    WLayout w_layout = WLayout::kRows;
    const uint8_t* xp = nullptr;
    int64_t xp_stride = 0;
};
using MatmulFn = void (*)(const MatmulArgs&);
// 4 rows of a panel + 1 for a row unpacked from a packed layout to the file's bytes.
constexpr int64_t kMatmulScratchRows = 5;

// Causal attention of one query row against cached keys/values of one kv head.
// out[d] = sum_j softmax_j(scale * q.k_j) v_j for j in [0, n_kv); scores holds n_kv floats.
struct AttentionArgs {
    const float* q;
    const float* k;  // n_kv rows, k_stride floats apart
    const float* v;  // n_kv rows, v_stride floats apart
    int64_t k_stride, v_stride;
    int64_t n_kv;
    int64_t head_dim;
    float scale;
    float* out;
    float* scores;
};
using AttentionFn = void (*)(const AttentionArgs&);

// Element-wise operators with more than one variant (the exp-based ones).
using SoftmaxFn = void (*)(float* x, int64_t n, float scale);  // x = softmax(scale * x), max-subtracted
using GeluFn = void (*)(float* a, int64_t n);                   // a = gelu_tanh(a)
using SiluMulFn = void (*)(float* a, const float* b, int64_t n);  // a = silu(a) * b

// Phases of a matrix product: decode (a few tokens: weights streamed once, bandwidth-bound) and
// prefill (many tokens: weights reused across tokens, compute-bound).
enum Phase { kDecode = 0, kPrefill = 1 };
constexpr int64_t kDecodeMaxTokens = 3;  // m <= this uses the decode kernel

// Norms, rotary embedding and the residual add (kernels/elementwise/norms_*.cpp). y may be x.
using RmsNormFn = void (*)(const float* x, const float* w, float* y, int64_t n, float eps);
using LayerNormFn = void (*)(const float* x, const float* w, const float* b, float* y, int64_t n, float eps);  // b may be null
using RopeFn = void (*)(float* x, int64_t n_heads, int64_t head_dim, int64_t rope_dims, const float* cs, bool neox);
// a += b. The same signature as SiluMulFn: the registry tells the two apart by name (optable.cpp).
using AddFn = void (*)(float* a, const float* b, int64_t n);

// Element-wise operators and attention, chosen once per process. Matrix products are chosen per
// weight (format, phase, shape) by choose_matmul(). Attention and every element-wise operator
// (softmax, gelu_tanh, silu_mul, rmsnorm, layernorm, rope, add) are chosen by the operator
// table's rules (choose()).
struct OpTable {
    AttentionFn attention;
    const char* attention_variant;
    SoftmaxFn softmax;
    const char* softmax_variant;
    GeluFn gelu_tanh;
    const char* gelu_tanh_variant;
    SiluMulFn silu_mul;
    const char* silu_mul_variant;
    RmsNormFn rmsnorm;
    const char* rmsnorm_variant;
    LayerNormFn layernorm;
    const char* layernorm_variant;
    // Rotates pairs (2i, 2i+1) ("normal", GGUF llama q/k layout) or (i, i + rope_dims/2) ("neox")
    // of each head (heads head_dim apart) by the angles of one position: cs holds (cos, sin) of
    // pair i at 2i, 2i+1 (rope_angles). Elements past the rope_dims/2 pairs are left alone.
    RopeFn rope;
    const char* rope_variant;
    AddFn add;  // a += b
    const char* add_variant;
};

// CPU features the table is chosen from.
struct CpuFeatures {
    bool avx2 = false, fma = false, f16c = false, avx512f = false, avx512bw = false, avx512vl = false;
    bool avxvnni = false, avx512vnni = false;
    // AVX512-BF16, and AMX tiles with BF16 products that the OS lets this process use (Linux asks
    // for the tile state with arch_prctl once).
    bool avx512bf16 = false, amx_bf16 = false;
    bool neon = false, dotprod = false, i8mm = false;
};
CpuFeatures detect_cpu_features();

// The reference table (scalar, the ground truth) and the best table for this CPU.
const OpTable& reference_ops();
const OpTable& best_ops();

// A matmul variant may read its weights in a layout of its own, made once at load (the file stays
// untouched): bytes(type, rows, k) of packed data written by pack(); the kernel then receives the
// packed buffer as MatmulArgs::w (w_row_bytes is the file's row size, for reference) and must
// accept any [row0, row1). nullptr packing: the kernel reads the file's rows in place.
struct MatmulPacking {
    const char* name;  // e.g. "x8", for logs
    WLayout layout;
    size_t (*bytes)(DType t, int64_t rows, int64_t k);
    void (*pack)(DType t, const void* src, size_t src_row_bytes, int64_t rows, int64_t k, void* dst);
};

// Activations converted once per product, for a variant whose arithmetic does not read floats (the
// AMX GEMM's bf16 pairs): prep writes tokens [t0, t1) of x (m tokens, x_stride floats apart, k
// each; tokens at or past m are written as zeros) into dst, row_bytes(k) per token. The caller pads
// the tokens to a multiple of `pad_tokens` (bytes() is the size for m tokens, padding included) and
// runs prep over token ranges in parallel.
struct ActPrep {
    const char* name;
    int64_t pad_tokens;
    size_t (*row_bytes)(int64_t k);
    void (*prep)(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t0, int64_t t1, void* dst);
    int64_t padded_tokens(int64_t m) const { return (m + pad_tokens - 1) / pad_tokens * pad_tokens; }
    size_t bytes(int64_t m, int64_t k) const { return static_cast<size_t>(padded_tokens(m)) * row_bytes(k); }
};

// also_reads: a variant that reads the file's rows but, given MatmulArgs::w_layout, also that
// packed layout (the prefill GEMM dequantizing x8 rows): a weight packed for decode then serves
// prefill from the same copy, and its rows in the file need not stay in memory.
// prefers: a layout the variant reads faster than the rows but does not need (the prefill GEMM's
// p16 panels). A weight is packed into it only when that makes no second copy: the other phase
// has no kernel (a prefill-only weight, the vision tower) or reads that layout too (evn::set_kernel).
struct MatmulChoice {
    MatmulFn fn;
    const char* name;
    const MatmulPacking* packing = nullptr;
    WLayout also_reads = WLayout::kRows;
    const MatmulPacking* prefers = nullptr;
    const ActPrep* act = nullptr;  // nullptr: the kernel reads x as floats
    int64_t panel_rows = 48;       // prefill: rows a call works through at a time (the runtime's chunks are multiples)
};
struct AttentionChoice { AttentionFn fn; const char* name; };
// The variant the active operator table picks (the first matching rule that runs on this CPU).
MatmulChoice choose_matmul(DType t, Phase phase, int64_t rows, int64_t k);
AttentionChoice choose_attention();
// For an operator without formats or phases ("attention", "softmax", "gelu_tanh", "silu_mul",
// "rmsnorm", "layernorm", "rope", "add"):
// the name of the variant the active table picks, "ref" when no rule does.
std::string choose(const std::string& op);
// Replaces the active rules (the text of an optable.tsv); throws std::invalid_argument on a bad
// table, leaving the active one unchanged. Models loaded afterwards use the new rules.
void load_optable(const std::string& text, const std::string& source);
std::string optable_source();

struct VariantInfo { std::string op, name; std::vector<std::string> formats; bool available; std::string layout; };
std::vector<VariantInfo> list_variants();
MatmulFn matmul_variant(const std::string& name);     // nullptr if unknown or not runnable here
MatmulChoice matmul_choice(const std::string& name);  // fn nullptr if unknown or not runnable here
AttentionFn attention_variant(const std::string& name);
SoftmaxFn softmax_variant(const std::string& name);
GeluFn gelu_tanh_variant(const std::string& name);
SiluMulFn silu_mul_variant(const std::string& name);
RmsNormFn rmsnorm_variant(const std::string& name);
LayerNormFn layernorm_variant(const std::string& name);
RopeFn rope_variant(const std::string& name);
AddFn add_variant(const std::string& name);

// The rotation angles of one position for rope: cs[2i], cs[2i + 1] = cos, sin of
// pos * theta_base^(-2i / rope_dims), i < rope_dims / 2 (computed in double: positions reach
// thousands). The same for every layer and head, so a model computes them once per token.
void rope_angles(float pos, float theta_base, int64_t rope_dims, float* cs);

// Scalar reference kernels, exported so tests and faster variants can compare against them.
void matmul_ref(const MatmulArgs& a);
void attention_ref(const AttentionArgs& a);
float dot_ref(const float* a, const float* b, int64_t n);
void softmax_ref(float* x, int64_t n, float scale);
void gelu_tanh_ref(float* a, int64_t n);
void silu_mul_ref(float* a, const float* b, int64_t n);
void rmsnorm_ref(const float* x, const float* w, float* y, int64_t n, float eps);
void layernorm_ref(const float* x, const float* w, const float* b, float* y, int64_t n, float eps);
void rope_ref(float* x, int64_t n_heads, int64_t head_dim, int64_t rope_dims, const float* cs, bool neox);
void add_ref(float* a, const float* b, int64_t n);

}  // namespace evk
