// The operator implementation table: a registry of kernel variants and the rules (from
// kernels/optable.tsv, compiled in, or a tuned table loaded at run time) that pick one per
// (operator, format, phase, shape, CPU features). Element-wise operators have a single variant
// today and are filled directly.
#include <initializer_list>
#if defined(__aarch64__)
#include <sys/auxv.h>
#endif
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "ops.h"

#ifndef EVK_DEFAULT_OPTABLE
#define EVK_DEFAULT_OPTABLE "matmul * * any - ref;attention * * any - ref"
#endif

namespace evk {

void rmsnorm_ref(const float*, const float*, float*, int64_t, float);
void layernorm_ref(const float*, const float*, const float*, float*, int64_t, float);
void rope_ref(float*, int64_t, int64_t, int64_t, float, float, bool);
void silu_mul_ref(float*, const float*, int64_t);
void gelu_tanh_ref(float*, int64_t);
void add_ref(float*, const float*, int64_t);
void softmax_ref(float*, int64_t, float);
#if defined(__aarch64__)
void matmul_neon_f32act(const MatmulArgs&);
void matmul_neon_q8act_dot(const MatmulArgs&);
#endif
#if defined(__x86_64__)
void matmul_avx2(const MatmulArgs&);
void matmul_avx2_gemm(const MatmulArgs&);
void matmul_avx2_q8act(const MatmulArgs&);
void attention_avx2(const AttentionArgs&);
#endif

CpuFeatures detect_cpu_features() {
    CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    f.avx2 = __builtin_cpu_supports("avx2");
    f.fma = __builtin_cpu_supports("fma");
    f.avx512f = __builtin_cpu_supports("avx512f");
    f.f16c = f.avx2;  // every AVX2 CPU shipped has F16C; GCC 12 cannot query it by name
#elif defined(__aarch64__)
    f.neon = true;  // Advanced SIMD is mandatory in armv8-a
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    f.dotprod = (hw & (1ul << 20)) != 0;  // HWCAP_ASIMDDP
    f.i8mm = (hw2 & (1ul << 13)) != 0;    // HWCAP2_I8MM
#endif
    return f;
}

namespace {

struct Variant {
    const char* op;
    const char* name;
    MatmulFn matmul;
    AttentionFn attention;
    std::vector<DType> formats;  // matmul only (a vector: an initializer_list would dangle)
    const char* needs;                      // features, as in the table
};

const std::vector<Variant>& registry() {
    static const std::vector<Variant> v = {
        {"matmul", "ref", matmul_ref, nullptr, {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q8_0}, "-"},
        {"attention", "ref", nullptr, attention_ref, {}, "-"},
#if defined(__aarch64__)
        {"matmul", "neon_f32act", matmul_neon_f32act, nullptr, {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q8_0}, "neon"},
        {"matmul", "neon_q8act_dot", matmul_neon_q8act_dot, nullptr, {DType::Q4_0, DType::Q4_1, DType::Q8_0}, "neon,dotprod"},
#endif
#if defined(__x86_64__)
        {"matmul", "avx2_f32act", matmul_avx2, nullptr, {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q8_0}, "avx2,fma,f16c"},
        {"matmul", "avx2_gemm", matmul_avx2_gemm, nullptr, {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q8_0}, "avx2,fma,f16c"},
        {"matmul", "avx2_q8act", matmul_avx2_q8act, nullptr, {DType::Q4_0, DType::Q4_1, DType::Q8_0}, "avx2,fma,f16c"},
        {"attention", "avx2", nullptr, attention_avx2, {}, "avx2,fma,f16c"},
#endif
    };
    return v;
}

bool has_features(const CpuFeatures& f, const std::string& list) {
    if (list == "-" || list.empty()) return true;
    std::stringstream ss(list);
    std::string item;
    while (std::getline(ss, item, ',')) {
        const bool ok = item == "avx2" ? f.avx2 : item == "fma" ? f.fma : item == "f16c" ? f.f16c
                      : item == "avx512f" ? f.avx512f : item == "neon" ? f.neon : item == "dotprod" ? f.dotprod
                      : item == "i8mm" ? f.i8mm : false;
        if (!ok) return false;
    }
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
        if (s.rfind(pre, 0) == 0 && s.size() > pre.size() &&
            s.find_first_not_of("0123456789", pre.size()) == std::string::npos)
            return true;
    }
    return false;
}

std::vector<Rule> parse(const std::string& text) {
    std::vector<Rule> rules;
    std::string line;
    int lineno = 0;
    std::string norm = text;
    for (char& c : norm) if (c == ';') c = '\n';
    std::stringstream in(norm);
    while (std::getline(in, line)) {
        ++lineno;
        const size_t hash = line.find('#');
        if (hash != std::string::npos) line.resize(hash);
        std::stringstream ls(line);
        Rule r;
        if (!(ls >> r.op)) continue;  // blank or comment
        std::string extra;
        if (!(ls >> r.format >> r.phase >> r.shape >> r.features >> r.variant) || (ls >> extra))
            throw std::invalid_argument("operator table line " + std::to_string(lineno) + ": expected 6 columns");
        if (r.op != "matmul" && r.op != "attention")
            throw std::invalid_argument("operator table line " + std::to_string(lineno) + ": unknown operator '" + r.op + "'");
        if (r.phase != "*" && r.phase != "decode" && r.phase != "prefill")
            throw std::invalid_argument("operator table line " + std::to_string(lineno) + ": unknown phase '" + r.phase + "'");
        if (!valid_shape(r.shape))
            throw std::invalid_argument("operator table line " + std::to_string(lineno) + ": bad shape class '" + r.shape + "'");
        rules.push_back(r);
    }
    return rules;
}

struct Active {
    std::mutex mu;
    std::vector<Rule> rules = parse(EVK_DEFAULT_OPTABLE);
    std::string source = "built-in default (kernels/optable.tsv)";
};
Active& active() {
    static Active a;
    return a;
}

const Variant* find_variant(const std::string& op, const std::string& name) {
    for (const Variant& v : registry())
        if (op == v.op && name == v.name) return &v;
    return nullptr;
}

bool supports(const Variant& v, DType t) {
    for (DType d : v.formats) if (d == t) return true;
    return false;
}

OpTable make_elementwise() {
    OpTable t{};
    t.rmsnorm = rmsnorm_ref;
    t.layernorm = layernorm_ref;
    t.rope = rope_ref;
    t.silu_mul = silu_mul_ref;
    t.gelu_tanh = gelu_tanh_ref;
    t.add = add_ref;
    t.softmax = softmax_ref;
    return t;
}

}  // namespace

MatmulChoice choose_matmul(DType t, Phase phase, int64_t rows, int64_t k) {
    static const CpuFeatures f = detect_cpu_features();
    const char* phase_name = phase == kDecode ? "decode" : "prefill";
    const TypeTraits* tt = type_traits(t);
    Active& a = active();
    std::lock_guard<std::mutex> lk(a.mu);
    for (const Rule& r : a.rules) {
        if (r.op != "matmul" || (r.format != "*" && (!tt || r.format != tt->name)) ||
            (r.phase != "*" && r.phase != phase_name) || !shape_matches(r.shape, rows, k) || !has_features(f, r.features))
            continue;
        const Variant* v = find_variant("matmul", r.variant);
        if (v && supports(*v, t) && has_features(f, v->needs)) return {v->matmul, v->name};
    }
    return {matmul_ref, "ref"};
}

AttentionChoice choose_attention() {
    static const CpuFeatures f = detect_cpu_features();
    Active& a = active();
    std::lock_guard<std::mutex> lk(a.mu);
    for (const Rule& r : a.rules) {
        if (r.op != "attention" || !has_features(f, r.features)) continue;
        const Variant* v = find_variant("attention", r.variant);
        if (v && has_features(f, v->needs)) return {v->attention, v->name};
    }
    return {attention_ref, "ref"};
}

void load_optable(const std::string& text, const std::string& source) {
    std::vector<Rule> rules = parse(text);  // throws before anything changes
    Active& a = active();
    std::lock_guard<std::mutex> lk(a.mu);
    a.rules = std::move(rules);
    a.source = source;
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
        VariantInfo i{v.op, v.name, {}, has_features(f, v.needs)};
        for (DType d : v.formats) i.formats.push_back(type_traits(d)->name);
        out.push_back(i);
    }
    return out;
}

MatmulFn matmul_variant(const std::string& name) {
    const Variant* v = find_variant("matmul", name);
    return v && has_features(detect_cpu_features(), v->needs) ? v->matmul : nullptr;
}

AttentionFn attention_variant(const std::string& name) {
    const Variant* v = find_variant("attention", name);
    return v && has_features(detect_cpu_features(), v->needs) ? v->attention : nullptr;
}

const OpTable& reference_ops() {
    static const OpTable t = [] {
        OpTable r = make_elementwise();
        r.attention = attention_ref;
        r.attention_variant = "ref";
        return r;
    }();
    return t;
}

const OpTable& best_ops() {
    static const OpTable t = [] {
        OpTable b = make_elementwise();
        const AttentionChoice c = choose_attention();
        b.attention = c.fn;
        b.attention_variant = c.name;
        return b;
    }();
    return t;
}

}  // namespace evk
