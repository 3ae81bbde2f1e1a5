// The operator implementation table: a registry of kernel variants and the rules (from
// kernels/optable.tsv, compiled in, or a tuned table loaded at run time) that pick one per
// (operator, format, phase, shape, CPU features). The operators of EVK_OPS (op_list.h: attention
// and the element-wise ones) are chosen by the same rules, once per activated table (best_ops).
#include <initializer_list>
#if defined(__aarch64__)
#include <sys/auxv.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <deque>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "matmul/packed_p16.h"
#include "matmul/packed_q8u.h"
#include "matmul/packed_x8.h"
#include "ops.h"

#ifndef EVK_DEFAULT_OPTABLE
#define EVK_DEFAULT_OPTABLE ""  // no rules: the reference serves every operator
#endif

namespace evk {

#if defined(__aarch64__)
void rmsnorm_neon(const float*, const float*, float*, int64_t, float);
void layernorm_neon(const float*, const float*, const float*, float*, int64_t, float);
void rope_neon(float*, int64_t, int64_t, int64_t, const float*, bool);
void add_neon(float*, const float*, int64_t);
int64_t argmax_neon(const float*, int64_t);
void gelu_mul_neon(float*, const float*, int64_t);
void causal_conv1d_neon(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, float*, int64_t);
void delta_rule_neon(float*, const float*, const float*, int64_t, const float*, int64_t, const float*, const float*,
                     int64_t, int64_t, int64_t, int64_t, float*, int64_t);
void l2norm_neon(const float*, float*, int64_t, float);
void rmsnorm_gated_neon(const float*, const float*, const float*, float*, int64_t, float);
void sigmoid_mul_neon(float*, const float*, int64_t);
void attention_neon(const AttentionArgs&);
void matmul_neon_f32act(const MatmulArgs&);
void matmul_neon_q8act_dot(const MatmulArgs&);
void matmul_neon_q8act_dot_x8(const MatmulArgs&);
void matmul_neon_q8act_i8mm(const MatmulArgs&);
void matmul_neon_q8act_gemm(const MatmulArgs&);
#endif
#if defined(__x86_64__) || defined(__aarch64__)
extern const ActPrep kActQ8Sums;  // the int8 vision GEMMs' activations (q8blocks.h), one definition per ISA
#endif
#if defined(__x86_64__)
void matmul_avx2_f32act(const MatmulArgs&);
void matmul_avx2_gemm(const MatmulArgs&);
void matmul_avx2_q8act(const MatmulArgs&);
void matmul_avx2_q8act_x8(const MatmulArgs&);
void matmul_avxvnni_q8act_x8(const MatmulArgs&);
void matmul_avx512vnni_q8act_x8(const MatmulArgs&);
void matmul_avx512vnni_q8act_x8_ymm(const MatmulArgs&);
void matmul_avx2_q8act_k(const MatmulArgs&);
void matmul_avxvnni_q8act_k(const MatmulArgs&);
void matmul_avx512vnni_q8act_k(const MatmulArgs&);
void matmul_avx512_gemm(const MatmulArgs&);
void matmul_amx_gemm(const MatmulArgs&);
void matmul_avx512vnni_q8act_gemm(const MatmulArgs&);
void matmul_avxvnni_q8act_gemm(const MatmulArgs&);
void matmul_avx512vnni_q8act_gemm_ymm(const MatmulArgs&);
extern const ActPrep kActBf16x2;
extern const ActPrep kActQ8Blocks;
void attention_avx2(const AttentionArgs&);
void attention_avx512(const AttentionArgs&);
void softmax_avx2(float*, int64_t, float);
void gelu_tanh_avx2(float*, int64_t);
void silu_mul_avx2(float*, const float*, int64_t);
void gelu_mul_avx2(float*, const float*, int64_t);
void rmsnorm_avx2(const float*, const float*, float*, int64_t, float);
void layernorm_avx2(const float*, const float*, const float*, float*, int64_t, float);
void rope_avx2(float*, int64_t, int64_t, int64_t, const float*, bool);
void add_avx2(float*, const float*, int64_t);
int64_t argmax_avx2(const float*, int64_t);
void causal_conv1d_avx2(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, float*, int64_t);
void delta_rule_avx2(float*, const float*, const float*, int64_t, const float*, int64_t, const float*, const float*,
                     int64_t, int64_t, int64_t, int64_t, float*, int64_t);
void l2norm_avx2(const float*, float*, int64_t, float);
void rmsnorm_gated_avx2(const float*, const float*, const float*, float*, int64_t, float);
void sigmoid_mul_avx2(float*, const float*, int64_t);
void causal_conv1d_avx512(const float*, int64_t, int64_t, int64_t, const float*, int64_t, float*, float*, int64_t);
void delta_rule_avx512(float*, const float*, const float*, int64_t, const float*, int64_t, const float*, const float*,
                       int64_t, int64_t, int64_t, int64_t, float*, int64_t);
void l2norm_avx512(const float*, float*, int64_t, float);
void rmsnorm_gated_avx512(const float*, const float*, const float*, float*, int64_t, float);
void sigmoid_mul_avx512(float*, const float*, int64_t);
#endif

void delta_rule_ref_chunk64(float*, const float*, const float*, int64_t, const float*, int64_t, const float*,
                            const float*, int64_t, int64_t, int64_t, int64_t, float*, int64_t);

namespace {

#if defined(__x86_64__)
// AMX with BF16 products, usable by this process: CPUID leaf 7 EDX bits 22 (AMX-BF16) and 24
// (AMX-TILE), the OS enabling the tile state in XCR0 (bits 17, 18), and Linux granting this process
// the tile data (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; once per process, threads
// included). Without the grant the first tile instruction would kill the process.
bool amx_bf16_usable() {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 22)) || !(edx & (1u << 24))) return false;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & (1u << 27))) return false;  // OSXSAVE: xgetbv works
    unsigned xcr0_lo = 0, xcr0_hi = 0;
    __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}
#endif

CpuFeatures probe_cpu_features() {
    CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    f.avx512f = __builtin_cpu_supports("avx512f");
    // AVX-VNNI (VEX-encoded vpdpbusd): CPUID leaf 7 sub-leaf 1, EAX bit 4; asked of CPUID directly
    // (clang 14 cannot query it by name); its YMM state is the OS support AVX2 already needs.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    f.avxvnni = f.avx2 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 4)) != 0;
    f.avx512bw = __builtin_cpu_supports("avx512bw");
    f.avx512vl = __builtin_cpu_supports("avx512vl");
    // AVX512-VNNI (EVEX vpdpbusd on zmm): CPUID leaf 7 sub-leaf 0, ECX bit 11.
    f.avx512vnni = f.avx512f && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 11)) != 0;
    f.f16c = f.avx2;  // every AVX2 CPU shipped has F16C; GCC 12 cannot query it by name
    // AVX512-BF16: CPUID leaf 7 sub-leaf 1, EAX bit 5 (its ZMM state is AVX-512's).
    f.avx512bf16 = f.avx512f && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5)) != 0;
#if defined(__x86_64__)
    f.amxbf16 = f.avx512bf16 && amx_bf16_usable();
#endif
#elif defined(__aarch64__)
    f.neon = true;  // Advanced SIMD is mandatory in armv8-a
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    f.dotprod = (hw & (1ul << 20)) != 0;  // HWCAP_ASIMDDP
    f.i8mm = (hw2 & (1ul << 13)) != 0;    // HWCAP2_I8MM
#endif
    return f;
}

}  // namespace

CpuFeatures detect_cpu_features() {
    static const CpuFeatures f = probe_cpu_features();
    return f;
}

const std::vector<std::string>& cpu_feature_names() {
#define EVK_NAME(name) #name,
    static const std::vector<std::string> names = {EVK_CPU_FEATURES(EVK_NAME)};
#undef EVK_NAME
    return names;
}

bool known_cpu_feature(const std::string& name) {
    for (const std::string& n : cpu_feature_names()) if (n == name) return true;
    return false;
}

bool has_cpu_feature(const CpuFeatures& f, const std::string& name) {
#define EVK_HAS(feature) if (name == #feature) return f.feature;
    EVK_CPU_FEATURES(EVK_HAS)
#undef EVK_HAS
    return false;
}

const std::vector<std::string>& table_operators() {
#define EVK_NAME(name, Fn) #name,
    static const std::vector<std::string> names = {EVK_OPS(EVK_NAME)};
#undef EVK_NAME
    return names;
}

namespace {

// One kernel of any operator: its operator's name and its function in that operator's slot.
// Built only by the of:: functions below, whose parameter type is the operator's Fn, so a variant
// cannot sit in the slot of an operator of another signature.
struct Kernel {
    const char* op = nullptr;
    MatmulFn matmul = nullptr;
#define EVK_KERNEL_SLOT(name, Fn) Fn name = nullptr;
    EVK_OPS(EVK_KERNEL_SLOT)
#undef EVK_KERNEL_SLOT
};

// of::softmax(softmax_avx2): the kernel of that operator (one function per operator of EVK_OPS).
namespace of {
inline Kernel matmul(MatmulFn f) {
    Kernel k;
    k.op = "matmul";
    k.matmul = f;
    return k;
}
#define EVK_KERNEL_OF(name, Fn) \
    inline Kernel name(Fn f) {  \
        Kernel k;               \
        k.op = #name;           \
        k.name = f;             \
        return k;               \
    }
EVK_OPS(EVK_KERNEL_OF)
#undef EVK_KERNEL_OF
}  // namespace of

const MatmulPacking kPackX8{"x8", WLayout::kX8, x8_packed_bytes, x8_pack};
const MatmulPacking kPackP16{"p16", WLayout::kP16, p16_packed_bytes, p16_pack};
const MatmulPacking kPackQ8U{"q8u", WLayout::kQ8U, q8u_packed_bytes, q8u_pack};

struct Variant {
    const char* name;
    Kernel fn;
    std::vector<DType> formats;  // matmul only (a vector: an initializer_list would dangle)
    const char* needs;                      // features, as in the table
    const MatmulPacking* packing = nullptr;  // matmul only: the weight layout it reads, if not the file's
    WLayout also_reads = WLayout::kRows;     // matmul only: a packed layout it reads besides the rows
    const MatmulPacking* prefers = nullptr;  // matmul only: a layout it reads faster, not needed (MatmulChoice)
    const ActPrep* act = nullptr;            // matmul only: activations converted once per product (MatmulChoice)
    int64_t panel_rows = 48;                 // matmul only: rows a prefill call works through at a time
    const char* op() const { return fn.op; }
    MatmulChoice choice() const { return {fn.matmul, name, packing, also_reads, prefers, act, panel_rows}; }
};

// A registry entry's name and kernel from (operator, variant): the function is always
// <operator>_<variant>, defined in kernels/<folder>/<folder>_<isa>*.cpp (test_kernels checks the file).
#define EVK_V(op, variant) #variant, of::op(op##_##variant)
// The formats of the K-quant decode kernels (kernels/matmul/kquant_avx2.h), in a brace list.
#define EVK_KQUANT_FORMATS DType::Q5_0, DType::Q5_1, DType::IQ4_NL, DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K

// Every computable format: the variants that read weight rows through dequantize_row run them all.
std::vector<DType> dequantized_formats() {
    return {DType::F32,  DType::F16,  DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1,   DType::Q8_0,
            DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL};
}

const std::vector<Variant>& registry() {
    static const std::vector<Variant> v = {
        {EVK_V(matmul, ref), dequantized_formats(), "-"},
#define EVK_REFERENCE_ENTRY(name, Fn) {EVK_V(name, ref), {}, "-"},
        EVK_OPS(EVK_REFERENCE_ENTRY)
#undef EVK_REFERENCE_ENTRY
        {EVK_V(delta_rule, ref_chunk64), {}, "-"},
#if defined(__aarch64__)
        {EVK_V(rmsnorm, neon), {}, "neon"},
        {EVK_V(layernorm, neon), {}, "neon"},
        {EVK_V(rope, neon), {}, "neon"},
        {EVK_V(add, neon), {}, "neon"},
        {EVK_V(argmax, neon), {}, "neon"},
        {EVK_V(gelu_mul, neon), {}, "neon"},
        {EVK_V(causal_conv1d, neon), {}, "neon"},
        {EVK_V(delta_rule, neon), {}, "neon"},
        {EVK_V(l2norm, neon), {}, "neon"},
        {EVK_V(rmsnorm_gated, neon), {}, "neon"},
        {EVK_V(sigmoid_mul, neon), {}, "neon"},
        {EVK_V(attention, neon), {}, "neon"},
        {EVK_V(matmul, neon_f32act), dequantized_formats(), "neon"},
        {EVK_V(matmul, neon_q8act_dot), {DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::Q5_0, DType::Q5_1, DType::IQ4_NL, DType::Q2_K,
                                         DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K}, "neon,dotprod"},
        {EVK_V(matmul, neon_q8act_dot_x8), {DType::Q4_0, DType::Q4_1, DType::Q8_0}, "neon,dotprod", &kPackX8},
        {EVK_V(matmul, neon_q8act_i8mm), {DType::Q4_0, DType::Q4_1, DType::Q8_0}, "neon,i8mm"},
        {EVK_V(matmul, neon_q8act_gemm), {DType::F32, DType::F16, DType::BF16, DType::Q8_0}, "neon,dotprod", &kPackQ8U,
         WLayout::kRows, nullptr, &kActQ8Sums, 16},
#endif
#if defined(__x86_64__)
        {EVK_V(matmul, avx2_f32act), dequantized_formats(), "avx2,fma,f16c"},
        {EVK_V(matmul, avx2_gemm), dequantized_formats(), "avx2,fma,f16c",
         nullptr, WLayout::kX8},
        {EVK_V(matmul, avx512_gemm), dequantized_formats(), "avx512f,avx512bw,avx512vl,fma,f16c",
         nullptr, WLayout::kX8, &kPackP16},
        {EVK_V(matmul, amx_gemm), dequantized_formats(),
         "amxbf16,avx512bf16,avx512f,avx512bw,avx512vl,fma,f16c", nullptr, WLayout::kX8, &kPackP16, &kActBf16x2, 32},
        {EVK_V(matmul, avx512vnni_q8act_gemm), {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::IQ4_NL, DType::Q2_K,
                                                DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K},
         "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c", nullptr, WLayout::kX8, nullptr, &kActQ8Blocks, 16},
        // Float weights requantized to int8 blocks at load (the q8u copy): only where a user allowed int8
        // products (the table's int8 phase: vision_int8).
        {EVK_V(matmul, avxvnni_q8act_gemm), {DType::F32, DType::F16, DType::BF16, DType::Q8_0}, "avx2,fma,f16c,avxvnni",
         &kPackQ8U, WLayout::kRows, nullptr, &kActQ8Sums, 16},
        {EVK_V(matmul, avx512vnni_q8act_gemm_ymm), {DType::F32, DType::F16, DType::BF16, DType::Q8_0},
         "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c", &kPackQ8U, WLayout::kRows, nullptr, &kActQ8Sums, 16},
        {EVK_V(matmul, avx2_q8act), {DType::Q4_0, DType::Q4_1, DType::Q8_0}, "avx2,fma,f16c"},
        {EVK_V(matmul, avx2_q8act_x8), {DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::Q5_0, DType::Q4_K, DType::Q6_K}, "avx2,fma,f16c", &kPackX8},
        {EVK_V(matmul, avxvnni_q8act_x8), {DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::Q5_0, DType::Q4_K, DType::Q6_K}, "avx2,fma,f16c,avxvnni",
         &kPackX8},
        {EVK_V(matmul, avx512vnni_q8act_x8), {DType::Q4_0, DType::Q4_1, DType::Q8_0},
         "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c", &kPackX8},
        {EVK_V(matmul, avx512vnni_q8act_x8_ymm), {DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::Q5_0, DType::Q4_K, DType::Q6_K},
         "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c", &kPackX8},
        {EVK_V(matmul, avx2_q8act_k), {EVK_KQUANT_FORMATS}, "avx2,fma,f16c"},
        {EVK_V(matmul, avxvnni_q8act_k), {EVK_KQUANT_FORMATS}, "avx2,fma,f16c,avxvnni"},
        {EVK_V(matmul, avx512vnni_q8act_k), {EVK_KQUANT_FORMATS}, "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c"},
        {EVK_V(attention, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(attention, avx512), {}, "avx512f,fma,f16c"},
        {EVK_V(softmax, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(gelu_tanh, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(silu_mul, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(gelu_mul, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(rmsnorm, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(layernorm, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(rope, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(add, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(argmax, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(causal_conv1d, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(delta_rule, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(l2norm, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(rmsnorm_gated, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(sigmoid_mul, avx2), {}, "avx2,fma,f16c"},
        {EVK_V(causal_conv1d, avx512), {}, "avx512f,fma,f16c"},
        {EVK_V(delta_rule, avx512), {}, "avx512f,fma,f16c"},
        {EVK_V(l2norm, avx512), {}, "avx512f,fma,f16c"},
        {EVK_V(rmsnorm_gated, avx512), {}, "avx512f,fma,f16c"},
        {EVK_V(sigmoid_mul, avx512), {}, "avx512f,fma,f16c"},
#endif
    };
    return v;
}
#undef EVK_V
#undef EVK_KQUANT_FORMATS

bool is_table_op(const std::string& op) {
    for (const std::string& n : table_operators()) if (n == op) return true;
    return false;
}

bool known_op(const std::string& op) { return op == "matmul" || is_table_op(op); }

// The names of a comma-separated features column ("-": none).
std::vector<std::string> feature_list(const std::string& list) {
    std::vector<std::string> out;
    if (list == "-" || list.empty()) return out;
    std::stringstream ss(list);
    std::string item;
    while (std::getline(ss, item, ',')) out.push_back(item);
    return out;
}

bool has_features(const CpuFeatures& f, const std::string& list) {
    for (const std::string& item : feature_list(list))
        if (!has_cpu_feature(f, item)) return false;
    return true;
}

struct Rule {
    std::string op, format, phase, shape, features, variant;
};

bool shape_matches(const std::string& shape, int64_t rows, int64_t k) {
    if (shape == "any") return true;
    const bool is_rows = shape.rfind("rows", 0) == 0;
    const std::string rest = shape.substr(is_rows ? 4 : 1);
    const bool ge = rest.rfind(">=", 0) == 0;
    const int64_t n = std::stoll(rest.substr(ge ? 2 : 1));
    const int64_t v = is_rows ? rows : k;
    return ge ? v >= n : v < n;
}

bool valid_shape(const std::string& s) {
    if (s == "any") return true;
    for (const char* p : {"rows>=", "rows<", "k>=", "k<"}) {
        const std::string pre(p);
        // At most 18 digits: the bound fits int64_t (std::stoll in shape_matches never throws).
        if (s.rfind(pre, 0) == 0 && s.size() > pre.size() && s.size() - pre.size() <= 18 &&
            s.find_first_not_of("0123456789", pre.size()) == std::string::npos)
            return true;
    }
    return false;
}

// One rule from its columns; `where` names it in errors ("operator table line 12").
Rule parse_rule(const std::string& text, const std::string& where) {
    std::stringstream ls(text);
    Rule r;
    std::string extra;
    if (!(ls >> r.op >> r.format >> r.phase >> r.shape >> r.features >> r.variant) || (ls >> extra))
        throw std::invalid_argument(where + ": expected 6 columns");
    if (!known_op(r.op)) throw std::invalid_argument(where + ": unknown operator '" + r.op + "'");
    if (r.phase != "*" && r.phase != "decode" && r.phase != "prefill" && r.phase != "int8")
        throw std::invalid_argument(where + ": unknown phase '" + r.phase + "'");
    if (!valid_shape(r.shape)) throw std::invalid_argument(where + ": bad shape class '" + r.shape + "'");
    for (const std::string& feature : feature_list(r.features))
        if (!known_cpu_feature(feature))
            throw std::invalid_argument(where + ": unknown CPU feature '" + feature + "'");
    return r;
}

// The rules of a table: one per line, or several on a line separated by ';' (the compiled-in
// default is one such line). A '#' comments out the rest of its line, ';' included: the comment
// is cut before the line is split into rules, so prose in a copied optable.tsv stays prose.
std::vector<Rule> parse(const std::string& text) {
    std::vector<Rule> rules;
    std::stringstream in(text);
    std::string line;
    int lineno = 0;
    while (std::getline(in, line)) {
        ++lineno;
        const size_t hash = line.find('#');
        if (hash != std::string::npos) line.resize(hash);
        std::stringstream rest(line);
        std::string rule;
        while (std::getline(rest, rule, ';'))
            if (rule.find_first_not_of(" \t\r") != std::string::npos)  // blank: skipped
                rules.push_back(parse_rule(rule, "operator table line " + std::to_string(lineno)));
    }
    return rules;
}

struct Active {
    std::mutex mu;
    std::vector<Rule> rules = parse(EVK_DEFAULT_OPTABLE);
    std::string source = "built-in default (kernels/optable.tsv)";
    uint64_t generation = 0;  // bumped by every load_optable: best_ops() rebuilds after it
};
Active& active() {
    static Active a;
    return a;
}

const Variant* find_variant(const std::string& op, const std::string& name) {
    for (const Variant& v : registry())
        if (op == v.op() && name == v.name) return &v;
    return nullptr;
}

// A variant of op that runs on this CPU, or nullptr.
const Variant* runnable(const std::string& op, const std::string& name) {
    const Variant* v = find_variant(op, name);
    return v && has_features(detect_cpu_features(), v->needs) ? v : nullptr;
}

// The variant the active rules pick for an operator without formats or phases (their columns
// are not consulted); the reference when no rule does.
const Variant& choose_variant(const std::string& op) {
    const CpuFeatures f = detect_cpu_features();  // probed once (detect_cpu_features caches)
    Active& a = active();
    std::lock_guard<std::mutex> lk(a.mu);
    for (const Rule& r : a.rules) {
        if (r.op != op || !has_features(f, r.features)) continue;
        const Variant* v = find_variant(op, r.variant);
        if (v && has_features(f, v->needs)) return *v;
    }
    return *find_variant(op, "ref");
}

bool supports(const Variant& v, DType t) {
    for (DType d : v.formats) if (d == t) return true;
    return false;
}

// The table with the reference variant in every slot.
OpTable make_reference() {
    OpTable t{};
#define EVK_REFERENCE_SLOT(name, Fn) \
    t.name = name##_ref;             \
    t.name##_variant = "ref";
    EVK_OPS(EVK_REFERENCE_SLOT)
#undef EVK_REFERENCE_SLOT
    return t;
}

}  // namespace

MatmulChoice choose_matmul(DType t, Phase phase, int64_t rows, int64_t k, bool int8) {
    const CpuFeatures f = detect_cpu_features();
    const char* phase_name = phase == kDecode ? "decode" : "prefill";
    if (int8 && phase != kPrefill) throw std::invalid_argument("int8 products are chosen for prefill only");
    const TypeTraits* tt = type_traits(t);
    Active& a = active();
    std::lock_guard<std::mutex> lk(a.mu);
    for (const Rule& r : a.rules) {
        if (r.op != "matmul" || (r.format != "*" && (!tt || r.format != tt->name)) ||
            (r.phase != "*" && r.phase != phase_name && !(int8 && r.phase == "int8")) || !shape_matches(r.shape, rows, k) || !has_features(f, r.features))
            continue;
        const Variant* v = find_variant("matmul", r.variant);
        // A variant with a layout of its own serves only the shapes it can lay out (x8: whole blocks).
        if (v && supports(*v, t) && has_features(f, v->needs) && (!v->packing || v->packing->bytes(t, rows, k) != 0))
            return v->choice();
    }
    return {matmul_ref, "ref"};
}

std::string choose(const std::string& op) {
    if (!is_table_op(op)) throw std::invalid_argument("choose: '" + op + "' is not an operator without formats");
    return choose_variant(op).name;
}

void load_optable(const std::string& text, const std::string& source) {
    std::vector<Rule> rules = parse(text);  // throws before anything changes
    Active& a = active();
    std::lock_guard<std::mutex> lk(a.mu);
    a.rules = std::move(rules);
    a.source = source;
    ++a.generation;
}

std::string optable_source() {
    Active& a = active();
    std::lock_guard<std::mutex> lk(a.mu);
    return a.source;
}

std::vector<VariantInfo> list_variants() {
    const CpuFeatures f = detect_cpu_features();
    std::vector<VariantInfo> out;
    for (const Variant& v : registry()) {
        VariantInfo i{v.op(), v.name, {}, has_features(f, v.needs), v.packing ? v.packing->name : ""};
        for (DType d : v.formats) i.formats.push_back(type_traits(d)->name);
        out.push_back(i);
    }
    return out;
}

namespace {
// The function a named, runnable variant of op puts in `slot`, or nullptr.
template <class Fn>
Fn variant_fn(const char* op, const std::string& name, Fn Kernel::*slot) {
    const Variant* v = runnable(op, name);
    return v ? v->fn.*slot : nullptr;
}
}  // namespace

MatmulFn matmul_variant(const std::string& name) { return variant_fn("matmul", name, &Kernel::matmul); }

MatmulChoice matmul_choice(const std::string& name) {
    const Variant* v = runnable("matmul", name);
    return v ? v->choice() : MatmulChoice{nullptr, "", nullptr};
}

#define EVK_VARIANT_LOOKUP(name, Fn) \
    Fn name##_variant(const std::string& variant) { return variant_fn(#name, variant, &Kernel::name); }
EVK_OPS(EVK_VARIANT_LOOKUP)
#undef EVK_VARIANT_LOOKUP

const OpTable& reference_ops() {
    static const OpTable t = make_reference();
    return t;
}

// The table of the rules active now. Each activation of a table gets its own OpTable, built on the
// first call after it and kept for the life of the process (a few hundred bytes each), so a model
// keeps the operators it was loaded with (Compute holds a reference) while a later load in the same
// process gets the new table's (`edgevlm bench --profile robot` after a run on the default table).
const OpTable& best_ops() {
    static std::mutex mu;
    static std::deque<OpTable> built;  // references stay valid as it grows
    static uint64_t built_generation = 0;
    uint64_t generation;
    {
        Active& a = active();
        std::lock_guard<std::mutex> lk(a.mu);
        generation = a.generation;
    }
    std::lock_guard<std::mutex> lk(mu);  // then choose_variant takes active().mu: always this order
    if (built.empty() || built_generation != generation) {
        OpTable b = make_reference();
        // The operator table's pick for op: its function into fn, its name into name.
        auto pick = [](const char* op, auto Kernel::*slot, auto& fn, const char*& name) {
            const Variant& v = choose_variant(op);
            fn = v.fn.*slot;
            name = v.name;
        };
#define EVK_PICK(name, Fn) pick(#name, &Kernel::name, b.name, b.name##_variant);
        EVK_OPS(EVK_PICK)
#undef EVK_PICK
        built.push_back(b);
        built_generation = generation;
    }
    return built.back();
}

}  // namespace evk
