// The one list of the operator table's operators and the one list of the CPU features its rules
// name. Everything that enumerates either is generated from these X-macros: the OpTable struct and
// CpuFeatures (ops.h), the reference declarations and the variant lookups, best_ops, the table
// parser's known names (optable.cpp), and the Python bindings that report, choose and run them
// (native/bindings_kernels.cpp; Python asks the extension: _engine.operators(), cpu_features()).
// Adding an operator or a feature is one line here (docs/kernels/README.md shows the diff).
#pragma once

// X(name, Fn): an operator without weight formats or phases, chosen once per process by the table's
// rules. It gets the slot `Fn name; const char* name_variant;` of OpTable, the reference
// `name_ref` (a function of Fn's signature, the ground truth), the lookup `name_variant(variant)`,
// and the name `name` in kernels/optable.tsv and in Python. Its variants are registered in
// optable.cpp as `<name>_<variant>` functions (kernels/<folder>/<folder>_<isa>.cpp).
// matmul is not here: it is chosen per weight (format, phase, shape) by choose_matmul().
#define EVK_OPS(X)              \
    X(attention, AttentionFn)   \
    X(softmax, SoftmaxFn)       \
    X(gelu_tanh, GeluFn)        \
    X(silu_mul, SiluMulFn)      \
    X(gelu_mul, GeluMulFn)      \
    X(rmsnorm, RmsNormFn)       \
    X(layernorm, LayerNormFn)   \
    X(rope, RopeFn)             \
    X(add, AddFn)               \
    X(argmax, ArgmaxFn)         \
    X(causal_conv1d, CausalConv1dFn) \
    X(delta_rule, DeltaRuleFn)  \
    X(l2norm, L2NormFn)         \
    X(rmsnorm_gated, RmsNormGatedFn) \
    X(sigmoid_mul, SigmoidMulFn)

// X(name): a CPU feature, named as the table's features column names it; a field `bool name` of
// CpuFeatures, set by probe_cpu_features() (optable.cpp: the detection is code, one line per
// feature there) and reported by _engine.cpu_features().
#define EVK_CPU_FEATURES(X) \
    X(avx2)                 \
    X(fma)                  \
    X(f16c)                 \
    X(avx512f)              \
    X(avx512bw)             \
    X(avx512vl)             \
    X(avxvnni)              \
    X(avx512vnni)           \
    X(avx512bf16)           \
    X(amxbf16)              \
    X(neon)                 \
    X(dotprod)              \
    X(i8mm)
