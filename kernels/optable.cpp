// Fills the operator table. Today every slot holds its scalar reference; ISA variants
// register here, chosen by detect_cpu_features(), and are tested against the references.
#include <initializer_list>

#include "ops.h"

namespace evk {

void rmsnorm_ref(const float*, const float*, float*, int64_t, float);
void layernorm_ref(const float*, const float*, const float*, float*, int64_t, float);
void rope_ref(float*, int64_t, int64_t, int64_t, float, float, bool);
void silu_mul_ref(float*, const float*, int64_t);
void gelu_tanh_ref(float*, int64_t);
void add_ref(float*, const float*, int64_t);
#if defined(__x86_64__)
void matmul_avx2(const MatmulArgs&);
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
    f.neon = true;
#endif
    return f;
}

namespace {

OpTable make_reference() {
    OpTable t{};
    for (DType d : {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q8_0}) {
        t.matmul[static_cast<uint32_t>(d)] = matmul_ref;
        t.matmul_variant[static_cast<uint32_t>(d)] = "ref";
    }
    t.attention = attention_ref;
    t.attention_variant = "ref";
    t.rmsnorm = rmsnorm_ref;
    t.layernorm = layernorm_ref;
    t.rope = rope_ref;
    t.silu_mul = silu_mul_ref;
    t.gelu_tanh = gelu_tanh_ref;
    t.add = add_ref;
    return t;
}

}  // namespace

const OpTable& reference_ops() {
    static const OpTable t = make_reference();
    return t;
}

const OpTable& best_ops() {
    static const OpTable t = [] {
        OpTable b = make_reference();
        const CpuFeatures f = detect_cpu_features();
#if defined(__x86_64__)
        if (f.avx2 && f.fma && f.f16c) {
            for (DType d : {DType::F32, DType::F16, DType::BF16, DType::Q4_0, DType::Q4_1, DType::Q8_0}) {
                b.matmul[static_cast<uint32_t>(d)] = matmul_avx2;
                b.matmul_variant[static_cast<uint32_t>(d)] = "avx2_f32act";
            }
            b.attention = attention_avx2;
            b.attention_variant = "avx2";
        }
#endif
        (void)f;
        return b;
    }();
    return t;
}

}  // namespace evk
