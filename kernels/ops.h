// The operator table: every compute operator the models use, as function pointers.
// Models call through the table only; which variant fills a slot is decided once, at start,
// from the CPU's features (kernels/optable.cpp). Kernels know nothing of models and never
// allocate: any scratch they need is handed to them.
#pragma once
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "formats/formats.h"
#include "op_list.h"

namespace evk {

// How a weight's bytes are laid out: the file's rows, or packed (kernels/matmul/packed_x8.h,
// kernels/matmul/packed_p16.h, kernels/matmul/packed_q8u.h).
enum class WLayout : uint8_t { kRows = 0, kX8 = 1, kP16 = 2, kQ8U = 3 };

// y[t][r] = dot(W row r, x[t]) for rows [row0, row1) and tokens t in [0, m). Every variant gives
// token t the same bits whatever m and the tokens beside it (kernel_check): a verification pass's
// rows are the one-row decode steps (native/models/decoder.h, kMaxPassRows).
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
// A panel's rows expanded to float (avx2_gemm 4, avx512_gemm 48 for the formats its panel fill
// does not read) + 1 for a row unpacked from a packed layout to the file's bytes.
constexpr int64_t kMatmulScratchRows = 49;

// Causal attention of n_q query rows (the query heads that share one kv head: grouped-query
// attention) against the cached keys/values of that kv head. For each g < n_q, with q_g = q + g *
// q_stride and out_g = out + g * q_stride: out_g[d] = sum_j softmax_j(scale * q_g.k_j) v_j for j in
// [0, n_kv); scores holds n_q * n_kv floats. A head's result is bitwise the one of a call with that
// head alone (n_q = 1): the grouping only lets a variant read each key and value row once for all
// n_q heads (1 <= n_q <= kMaxAttentionGroup).
// The cache holds kv_type elements: F32, F16, or Q8_0 (blocks of 32 along the head, ggml's layout);
// for F16 and Q8_0 head_dim is a multiple of 32 and at most kMaxAttentionHeadDim, and the strides
// are multiples of 32 (a row's blocks never straddle two heads).
// Several query tokens at consecutive positions (n_tok > 1, a prefill chunk): token t's heads are
// at q + t * tok_stride (outputs at out + t * tok_stride) and attend keys [lo_t, n_kv + t), lo_t =
// max(0, n_kv + t - window) with a sliding window (window > 0), else 0; scores then holds n_tok *
// n_q * (n_kv + n_tok - 1) floats. Each token's result is bitwise the one of its own call
// (attention_token): a variant with a path for several tokens reuses each key and value row it
// reads for all of them; the others run attention_token's calls one by one.
struct AttentionArgs {
    const float* q;
    const void* k;  // n_kv rows, k_stride elements of kv_type apart
    const void* v;  // n_kv rows, v_stride elements apart
    int64_t k_stride, v_stride;
    int64_t n_kv;
    int64_t head_dim;
    float scale;
    float* out;
    float* scores;
    DType kv_type = DType::F32;
    int64_t n_q = 1;       // query heads sharing this kv head
    int64_t q_stride = 0;  // floats from one query head (and its output) to the next
    int64_t n_tok = 1;      // query tokens at consecutive positions
    int64_t tok_stride = 0;  // floats from one token's query heads (and outputs) to the next
    int64_t window = 0;      // > 0: token t attends at most the last `window` keys up to its own
};
// The first key token t of a call attends (AttentionArgs, n_tok).
constexpr int64_t attention_first_key(const AttentionArgs& a, int64_t t) {
    return a.window > 0 && a.n_kv + t > a.window ? a.n_kv + t - a.window : 0;
}
constexpr int64_t kMaxAttentionHeadDim = 512;
constexpr int64_t kMaxAttentionGroup = 16;
// Whether a cache of type t can hold heads of head_dim values (F32 any; F16 / Q8_0 as above).
constexpr bool kv_type_fits(DType t, int64_t head_dim) {
    return t == DType::F32 || (head_dim % kQK == 0 && head_dim <= kMaxAttentionHeadDim);
}
// Bytes of n elements of a KV cache type (n a multiple of 32 for Q8_0).
constexpr size_t kv_bytes(DType t, int64_t n) {
    return t == DType::Q8_0 ? static_cast<size_t>(n / kQK) * 34 : static_cast<size_t>(n) * (t == DType::F16 ? 2 : 4);
}
// Bytes of one block of 32 cached values: F16 64, Q8_0 34 (an fp16 scale d, then 32 int8).
constexpr size_t kv_block_bytes(DType t) { return kv_bytes(t, kQK); }
using AttentionFn = void (*)(const AttentionArgs&);
// Token t of a call over several tokens as a call of its own (n_tok = 1: its keys from lo_t).
inline AttentionArgs attention_token(const AttentionArgs& a, int64_t t) {
    AttentionArgs one = a;
    const int64_t lo = attention_first_key(a, t);
    one.q = a.q + t * a.tok_stride;
    one.out = a.out + t * a.tok_stride;
    one.k = static_cast<const uint8_t*>(a.k) + kv_bytes(a.kv_type, lo * a.k_stride);
    one.v = static_cast<const uint8_t*>(a.v) + kv_bytes(a.kv_type, lo * a.v_stride);
    one.n_kv = a.n_kv + t - lo;
    one.n_tok = 1, one.tok_stride = 0, one.window = 0;
    return one;
}
// A call over several tokens as one call of `single` per token (variants without a path of their own).
inline void attention_each_token(const AttentionArgs& a, AttentionFn single) {
    for (int64_t t = 0; t < a.n_tok; ++t) single(attention_token(a, t));
}

// Element-wise operators with more than one variant (the exp-based ones).
using SoftmaxFn = void (*)(float* x, int64_t n, float scale);  // x = softmax(scale * x), max-subtracted
using GeluFn = void (*)(float* a, int64_t n);                   // a = gelu_tanh(a)
using SiluMulFn = void (*)(float* a, const float* b, int64_t n);  // a = silu(a) * b
using GeluMulFn = SiluMulFn;                                     // a = gelu_tanh(a) * b (GeGLU)

// Phases of a matrix product: decode (a few tokens: weights streamed once, bandwidth-bound) and
// prefill (many tokens: weights reused across tokens, compute-bound).
enum Phase { kDecode = 0, kPrefill = 1 };
constexpr int64_t kDecodeMaxTokens = 3;  // m <= this uses the decode kernel

// Norms (kernels/norms/), rotary embedding (kernels/rope/) and the residual add
// (kernels/elementwise/). y may be x.
using RmsNormFn = void (*)(const float* x, const float* w, float* y, int64_t n, float eps);
using LayerNormFn = void (*)(const float* x, const float* w, const float* b, float* y, int64_t n, float eps);  // b may be null
// Rotates pairs (2i, 2i+1) ("normal", GGUF llama q/k layout) or (i, i + rope_dims/2) ("neox")
// of each head (heads head_dim apart) by the angles of one position: cs holds (cos, sin) of
// pair i at 2i, 2i+1 (rope_angles). Elements past the rope_dims/2 pairs are left alone.
using RopeFn = void (*)(float* x, int64_t n_heads, int64_t head_dim, int64_t rope_dims, const float* cs, bool neox);
// a += b. The same signature as SiluMulFn: the registry names the operator of every variant.
using AddFn = void (*)(float* a, const float* b, int64_t n);
// The index of the first maximum of x[0, n), a NaN counting as larger than any number (the first
// NaN wins), as numpy.argmax and torch.argmax give it; 0 for n <= 0. Greedy decoding's choice.
using ArgmaxFn = int64_t (*)(const float* x, int64_t n);

// Qwen3.5's Gated DeltaNet (Yang et al. 2024, "Gated Delta Networks"; kernels/deltanet/).
// Depthwise causal conv1d with SiLU over n_tokens rows of `channels` values (x_stride / y_stride
// floats between rows): y[t][c] = silu(sum_j w[j][c] * in[t + j][c]), j < K, over in = state ++ x.
// w is [K][channels], time-major (the file's [channels][K] transposed at load); state is
// [K-1][channels], oldest first, and is left holding the last K-1 inputs of in. n_tokens = 1 is the
// decode step; a prompt split into calls gives the same y as one call. y may be x (same stride):
// each x[t][c] is read before y[t][c] is written.
using CausalConv1dFn = void (*)(const float* x, int64_t x_stride, int64_t n_tokens, int64_t channels, const float* w,
                                int64_t K, float* state, float* y, int64_t y_stride);
// One head of the gated delta rule over n_tokens tokens. S is the head's state, [dk][dv] row-major,
// updated in place. Token t reads q, k at t * qk_stride (dk floats each: L2-normalised, q already
// times dk^-1/2), v at t * v_stride (dv floats), the log-decay g and the write strength beta at
// t * gb_stride, and writes out at t * out_stride (dv floats). Per token:
//   S *= exp(g); kv = S^T k; delta = (v - kv) * beta; S += k delta^T; out = S^T q.
// The recurrent variants do exactly that per token, so a prompt split into calls gives bit-equal
// outputs and state; the chunked ones (`*_chunk64`) do it 64 tokens at a time in matrix form (as
// transformers' torch_chunk_gated_delta_rule) and agree within a rounding bound (the tests).
using DeltaRuleFn = void (*)(float* S, const float* q, const float* k, int64_t qk_stride, const float* v,
                             int64_t v_stride, const float* g, const float* beta, int64_t gb_stride, int64_t n_tokens,
                             int64_t dk, int64_t dv, float* out, int64_t out_stride);
// y = x * rsqrt(sum x^2 + eps) (the FLA library's l2norm: eps inside the root). y may be x.
using L2NormFn = void (*)(const float* x, float* y, int64_t n, float eps);
// y = rmsnorm(x) * w * silu(z) (Qwen3_5RMSNormGated, over one value head). y may be x.
using RmsNormGatedFn = void (*)(const float* x, const float* w, const float* z, float* y, int64_t n, float eps);
// x *= sigmoid(g) (the gated full attention's output gate).
using SigmoidMulFn = void (*)(float* x, const float* g, int64_t n);

// The operators of EVK_OPS (op_list.h), chosen by the active operator table's rules (choose(); one
// OpTable per activated table, and a model keeps the one it was loaded with): for each, its
// function and the name of the variant that fills the slot. Matrix
// products are chosen per weight (format, phase, shape) by choose_matmul().
struct OpTable {
#define EVK_OPTABLE_SLOT(name, Fn) \
    Fn name;                       \
    const char* name##_variant;
    EVK_OPS(EVK_OPTABLE_SLOT)
#undef EVK_OPTABLE_SLOT
};

// CPU features the table is chosen from (EVK_CPU_FEATURES, op_list.h), as its rules name them.
// amxbf16: AMX tiles with BF16 products that the OS lets this process use (Linux asks for the
// tile state with arch_prctl once).
struct CpuFeatures {
#define EVK_CPU_FEATURE_FIELD(name) bool name = false;
    EVK_CPU_FEATURES(EVK_CPU_FEATURE_FIELD)
#undef EVK_CPU_FEATURE_FIELD
};
CpuFeatures detect_cpu_features();
// The names of EVK_CPU_FEATURES, in its order, and whether f has the one named (false for a name
// not in the list: known_cpu_feature tells).
const std::vector<std::string>& cpu_feature_names();
bool known_cpu_feature(const std::string& name);
bool has_cpu_feature(const CpuFeatures& f, const std::string& name);
// The names of EVK_OPS, in its order.
const std::vector<std::string>& table_operators();

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
// The variant the active operator table picks (the first matching rule that runs on this CPU).
// int8: a prefill product whose user allowed int8 activations and requantized weights (vision_int8):
// rules of the table's phase `int8` match it too, where they come first; without int8 they never match.
MatmulChoice choose_matmul(DType t, Phase phase, int64_t rows, int64_t k, bool int8 = false);
// For an operator of EVK_OPS: the name of the variant the active table picks, "ref" when no rule
// does. Throws std::invalid_argument for any other name.
std::string choose(const std::string& op);
// Replaces the active rules (the text of an optable.tsv); throws std::invalid_argument on a bad
// table, leaving the active one unchanged. Models loaded afterwards use the new rules.
void load_optable(const std::string& text, const std::string& source);
std::string optable_source();

struct VariantInfo { std::string op, name; std::vector<std::string> formats; bool available; std::string layout; };
std::vector<VariantInfo> list_variants();
MatmulFn matmul_variant(const std::string& name);     // nullptr if unknown or not runnable here
MatmulChoice matmul_choice(const std::string& name);  // fn nullptr if unknown or not runnable here
// For each operator of EVK_OPS, e.g. SoftmaxFn softmax_variant(name): the named variant's
// function, nullptr if unknown or not runnable here.
#define EVK_VARIANT_LOOKUP(name, Fn) Fn name##_variant(const std::string& variant);
EVK_OPS(EVK_VARIANT_LOOKUP)
#undef EVK_VARIANT_LOOKUP

// The rotation angles of one position for rope: cs[2i], cs[2i + 1] = cos, sin of
// pos * theta_base^(-2i / rope_dims), i < rope_dims / 2 (computed in double: positions reach
// thousands). The same for every layer and head, so a model computes them once per token.
void rope_angles(float pos, float theta_base, int64_t rope_dims, float* cs);

// Scalar reference kernels, exported so tests and faster variants can compare against them:
// matmul_ref, dot_ref, and for each operator of EVK_OPS `name_ref`, of the signature of its Fn
// (e.g. void softmax_ref(float* x, int64_t n, float scale)).
void matmul_ref(const MatmulArgs& a);
float dot_ref(const float* a, const float* b, int64_t n);
#define EVK_REFERENCE_DECL(name, Fn) std::remove_pointer_t<Fn> name##_ref;
EVK_OPS(EVK_REFERENCE_DECL)
#undef EVK_REFERENCE_DECL

}  // namespace evk
