// The kernel test/tune entry points of edgevlm_ros._engine: CPU features, the operator table
// (rules, variants, choices), one operator by a named variant, reference (de)quantization. Used by
// the tests, `edgevlm tune` and the bench; the models never come through here (bindings.cpp).
#include "bindings_kernels.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <type_traits>

#ifndef EVK_DEFAULT_OPTABLE
#define EVK_DEFAULT_OPTABLE ""
#endif

#include "compute.h"

namespace py = pybind11;
using namespace evn;

namespace {

evk::DType dtype_named(const std::string& name) {
    evk::DType t;
    if (!evk::type_named(name.c_str(), &t)) throw py::value_error("unknown weight format '" + name + "'");
    return t;
}

}  // namespace

evk::DType kv_type_named(const std::string& name) {
    if (name == "f32") return evk::DType::F32;
    if (name == "f16") return evk::DType::F16;
    if (name == "q8_0") return evk::DType::Q8_0;
    throw py::value_error("kv_type must be f32, f16 or q8_0, not '" + name + "'");
}

namespace {

// The formats with kernels, in ggml type id order.
std::vector<evk::DType> computable_types() {
    std::vector<evk::DType> out;
    for (uint32_t id = 0; id < 64; ++id) {
        const evk::TypeTraits* t = evk::type_traits(id);
        if (t && t->computable) out.push_back(static_cast<evk::DType>(id));
    }
    return out;
}

template <class... F>
struct Overloaded : F... {
    using F::operator()...;
};
template <class... F>
Overloaded(F...) -> Overloaded<F...>;

// Runs `run` on the function of the named variant of op ('ref', 'best' = what the operator table
// picked at start, or a variant name). One branch per operator of EVK_OPS (op_list.h) whose Fn
// `run` takes, so a runner written for a signature serves every operator of that signature; any
// other op is "unknown <kind>", listing the ones it serves.
template <class Run>
void run_variant(const char* kind, const std::string& op, const std::string& variant, const Run& run) {
    const evk::OpTable& table = variant == "best" ? evk::best_ops() : evk::reference_ops();
    const bool named = variant != "best" && variant != "ref";
    std::string served;
#define EVK_RUN(name, Fn)                                                                         \
    if constexpr (std::is_invocable_v<const Run&, evk::Fn>) {                                     \
        if (op == #name) {                                                                        \
            const evk::Fn fn = named ? evk::name##_variant(variant) : table.name;                 \
            if (!fn) throw py::value_error(op + " variant '" + variant + "' does not run here");  \
            run(fn);                                                                              \
            return;                                                                               \
        }                                                                                         \
        served += (served.empty() ? "" : ", ") + std::string(#name);                              \
    }
    EVK_OPS(EVK_RUN)
#undef EVK_RUN
    throw py::value_error("unknown " + std::string(kind) + " '" + op + "' (" + served + ")");
}

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

// The Gated DeltaNet operators (kernels/deltanet/) by a named variant ('ref', 'best' or a variant
// name), on copies of their inputs: the state they update comes back beside the output.
void register_deltanet_bindings(py::module_& m) {
    // x (n, width >= channels) rows, w (K, channels), state (K - 1, channels); in_place: y written
    // over a copy of x (same stride), as the decoder may run it. Returns (y (n, channels), state).
    m.def("kernel_causal_conv1d", [](const std::string& variant, FloatArray x, FloatArray w, FloatArray state,
                                     bool in_place) {
        if (w.ndim() != 2 || w.shape(0) < 1 || w.shape(1) < 1) throw py::value_error("w must be (K, channels)");
        const int64_t K = w.shape(0), ch = w.shape(1);
        if (x.ndim() != 2 || x.shape(1) < ch) throw py::value_error("x must be (n, width >= channels)");
        if (state.ndim() != 2 || state.shape(0) != K - 1 || state.shape(1) != ch)
            throw py::value_error("state must be (K - 1, channels)");
        const int64_t n = x.shape(0), xs = x.shape(1);
        py::array_t<float> xbuf({n, xs});
        std::memcpy(xbuf.mutable_data(), x.data(), static_cast<size_t>(x.size()) * sizeof(float));
        py::array_t<float> y({n, ch});
        py::array_t<float> st({K - 1, ch});
        std::memcpy(st.mutable_data(), state.data(), static_cast<size_t>(state.size()) * sizeof(float));
        run_variant("conv operator", "causal_conv1d", variant, [&](evk::CausalConv1dFn fn) {
            float* xb = xbuf.mutable_data();
            float* yp = in_place ? xb : y.mutable_data();
            const float* wp = w.data();
            float* sp = st.mutable_data();
            {
                py::gil_scoped_release nogil;
                fn(xb, xs, n, ch, wp, K, sp, yp, in_place ? xs : ch);
            }
            if (in_place)
                for (int64_t t = 0; t < n; ++t) std::memcpy(y.mutable_data() + t * ch, xb + t * xs, static_cast<size_t>(ch) * sizeof(float));
        });
        return py::make_tuple(y, st);
    }, py::arg("variant"), py::arg("x"), py::arg("w"), py::arg("state"), py::arg("in_place") = false);

    // One head: S (dk, dv); q, k (n, width >= dk) rows (dk defaults to S's), v (n, dv), g, beta (n,).
    // Returns (out (n, dv), S after the n tokens).
    m.def("kernel_delta_rule", [](const std::string& variant, FloatArray S, FloatArray q, FloatArray k, FloatArray v,
                                  FloatArray g, FloatArray beta) {
        if (S.ndim() != 2 || S.shape(0) < 1 || S.shape(1) < 1) throw py::value_error("S must be (dk, dv)");
        const int64_t dk = S.shape(0), dv = S.shape(1);
        if (q.ndim() != 2 || k.ndim() != 2 || q.shape(0) != k.shape(0) || q.shape(1) != k.shape(1) || q.shape(1) < dk)
            throw py::value_error("q and k must be (n, width >= dk), the same shape");
        const int64_t n = q.shape(0), qs = q.shape(1);
        if (v.ndim() != 2 || v.shape(0) != n || v.shape(1) != dv) throw py::value_error("v must be (n, dv)");
        if (g.ndim() != 1 || beta.ndim() != 1 || g.shape(0) != n || beta.shape(0) != n)
            throw py::value_error("g and beta must be (n,)");
        py::array_t<float> out({n, dv});
        py::array_t<float> st({dk, dv});
        std::memcpy(st.mutable_data(), S.data(), static_cast<size_t>(S.size()) * sizeof(float));
        run_variant("delta rule operator", "delta_rule", variant, [&](evk::DeltaRuleFn fn) {
            float* sp = st.mutable_data();
            float* op = out.mutable_data();
            const float *qp = q.data(), *kp = k.data(), *vp = v.data(), *gp = g.data(), *bp = beta.data();
            py::gil_scoped_release nogil;
            fn(sp, qp, kp, qs, vp, dv, gp, bp, 1, n, dk, dv, op, dv);
        });
        return py::make_tuple(out, st);
    }, py::arg("variant"), py::arg("S"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"));

    // l2norm of each row of x (2-D, or 1-D: one row).
    m.def("kernel_l2norm", [](const std::string& variant, FloatArray x, float eps) {
        if (x.ndim() < 1 || x.ndim() > 2 || x.size() < 1) throw py::value_error("x must be a non-empty 1-D or 2-D array");
        const int64_t cols = x.shape(x.ndim() - 1), rows = x.size() / cols;
        py::array_t<float> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
        run_variant("l2norm operator", "l2norm", variant, [&](evk::L2NormFn fn) {
            const float* xp = x.data();
            float* y = out.mutable_data();
            py::gil_scoped_release nogil;
            for (int64_t r = 0; r < rows; ++r) fn(xp + r * cols, y + r * cols, cols, eps);
        });
        return out;
    }, py::arg("variant"), py::arg("x"), py::arg("eps") = 1e-6f);

    // rmsnorm_gated of each row of x (2-D, or 1-D: one row): w as long as a row, z the shape of x.
    m.def("kernel_rmsnorm_gated", [](const std::string& variant, FloatArray x, FloatArray w, FloatArray z, float eps) {
        if (x.ndim() < 1 || x.ndim() > 2 || x.size() < 1) throw py::value_error("x must be a non-empty 1-D or 2-D array");
        const int64_t cols = x.shape(x.ndim() - 1), rows = x.size() / cols;
        if (w.ndim() != 1 || w.shape(0) != cols) throw py::value_error("w must be 1-D, as long as a row of x");
        if (z.size() != x.size()) throw py::value_error("z must have as many elements as x");
        py::array_t<float> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
        run_variant("gated norm operator", "rmsnorm_gated", variant, [&](evk::RmsNormGatedFn fn) {
            const float *xp = x.data(), *wp = w.data(), *zp = z.data();
            float* y = out.mutable_data();
            py::gil_scoped_release nogil;
            for (int64_t r = 0; r < rows; ++r) fn(xp + r * cols, wp, zp + r * cols, y + r * cols, cols, eps);
        });
        return out;
    }, py::arg("variant"), py::arg("x"), py::arg("w"), py::arg("z"), py::arg("eps") = 1e-6f);
}

}  // namespace

void register_kernel_bindings(py::module_& m) {
    m.def("cpu_features", [] {
        const evk::CpuFeatures f = evk::detect_cpu_features();
        py::dict d;  // as the operator table names them (EVK_CPU_FEATURES, op_list.h), in its order
        for (const std::string& name : evk::cpu_feature_names()) d[py::str(name)] = evk::has_cpu_feature(f, name);
        return d;
    });
    m.def("weight_formats", [] {
        std::vector<std::string> names;
        for (evk::DType t : computable_types()) names.push_back(evk::type_traits(t)->name);
        return names;
    }, "The weight formats with kernels (kernels/formats/ traits), in ggml type id order.");
    m.def("row_bytes", [](const std::string& wtype, int64_t n) {
        const size_t rb = evk::row_bytes(dtype_named(wtype), n);
        if (rb == 0) throw py::value_error("n must be a positive multiple of the block size of " + wtype);
        return rb;
    }, py::arg("wtype"), py::arg("n"), "Bytes of one row of n elements of a weight format (its blocks' sizeof).");
    m.def("operators", [] { return evk::table_operators(); },
          "The operators chosen once per process by the operator table (EVK_OPS, kernels/op_list.h), in its "
          "order; matmul, chosen per weight, is not among them.");


    // Kernel-level entry points for tests and `edgevlm tune`: one matmul by a named variant
    // ('ref', 'best' = what the operator table picks for this shape and m, or any variant name).
    // The weight of a kernel-level product: checked, with the named variant ('best': the table's
    // choice) set for both phases and packed into its layout if it has one, reading the file's
    // rows otherwise. prefill_only: a weight like the vision tower's (no decode kernel; the
    // product runs as prefill whatever m), which the variant reads in the layout it prefers.
    struct KernelCase {
        Weight w;
        int64_t m;
        evk::Phase phase;
    };
    auto kernel_case = [](const std::string& variant, const std::string& wtype,
                          const py::array_t<uint8_t, py::array::c_style | py::array::forcecast>& w, int64_t rows,
                          int64_t cols, const py::array_t<float, py::array::c_style | py::array::forcecast>& x, int threads,
                          bool prefill_only) {
        const evk::DType t = dtype_named(wtype);
        const evk::TypeTraits* tt = evk::type_traits(t);
        if (!tt->computable) throw py::value_error("no matmul kernel for " + wtype);
        const size_t rb = evk::row_bytes(t, cols);
        if (rows < 1 || cols < 1 || rb == 0) throw py::value_error("cols must be a positive multiple of the block size");
        if (static_cast<size_t>(w.size()) != rb * static_cast<size_t>(rows)) throw py::value_error("weight bytes do not match rows x cols");
        if (x.ndim() != 2 || x.shape(1) != cols) throw py::value_error("x must have shape (m, cols)");
        if (threads < 1 || threads > 64) throw py::value_error("threads must be in 1..64");
        const WeightUse use = variant != "best" ? WeightUse::kUnset : prefill_only ? WeightUse::kPrefillOnly : WeightUse::kBoth;
        Weight wt = make_weight(t, w.data(), rows, cols, use);
        if (variant != "best") {
            evk::MatmulChoice choice = evk::matmul_choice(variant);
            bool ok = false;
            for (const evk::VariantInfo& v : evk::list_variants())
                if (v.op == "matmul" && v.name == variant)
                    for (const std::string& f : v.formats) ok = ok || f == wtype;
            if (!choice.fn || !ok) throw py::value_error("matmul variant '" + variant + "' does not run " + wtype + " here");
            if (!prefill_only) {
                choice.prefers = nullptr;  // both phases: the rows (or the layout the variant needs)
                set_kernel(wt, evk::kDecode, choice);
            }
            set_kernel(wt, evk::kPrefill, choice);
        }
        return KernelCase{std::move(wt), x.shape(0), prefill_only ? evk::kPrefill : Compute::phase_for(x.shape(0))};
    };
    m.def("kernel_matmul", [kernel_case](const std::string& variant, const std::string& wtype,
                                         py::array_t<uint8_t, py::array::c_style | py::array::forcecast> w, int64_t rows,
                                         int64_t cols, py::array_t<float, py::array::c_style | py::array::forcecast> x,
                                         int threads, bool prefill_only) {
        const KernelCase kc = kernel_case(variant, wtype, w, rows, cols, x, threads, prefill_only);
        py::array_t<float> y({kc.m, rows});
        float* yp = y.mutable_data();
        const float* xp = x.data();
        {
            py::gil_scoped_release nogil;
            Compute c(threads, cols);
            c.matmul(kc.w, xp, cols, kc.m, yp, rows, kc.phase);
        }
        return y;
    }, py::arg("variant"), py::arg("wtype"), py::arg("w"), py::arg("rows"), py::arg("cols"), py::arg("x"), py::arg("threads") = 1,
       py::arg("prefill_only") = false);
    m.def("kernel_matmul_layout", [kernel_case](const std::string& variant, const std::string& wtype,
                                                py::array_t<uint8_t, py::array::c_style | py::array::forcecast> w,
                                                int64_t rows, int64_t cols,
                                                py::array_t<float, py::array::c_style | py::array::forcecast> x,
                                                bool prefill_only) {
        const KernelCase kc = kernel_case(variant, wtype, w, rows, cols, x, 1, prefill_only);
        const evk::MatmulChoice& c = kc.phase == evk::kDecode ? kc.w.decode : kc.w.prefill;
        return std::string(kc.w.reads_packed(c) ? kc.w.packed_as->name : "rows");
    }, py::arg("variant"), py::arg("wtype"), py::arg("w"), py::arg("rows"), py::arg("cols"), py::arg("x"),
       py::arg("prefill_only") = false, "The weight layout kernel_matmul's product reads: 'rows' or a packing's name.");
    m.def("kernel_matmul_seconds", [kernel_case](const std::string& variant, const std::string& wtype,
                                                 py::array_t<uint8_t, py::array::c_style | py::array::forcecast> w,
                                                 int64_t rows, int64_t cols,
                                                 py::array_t<float, py::array::c_style | py::array::forcecast> x,
                                                 int threads, int repeat, bool prefill_only) {
        if (repeat < 1 || repeat > 100000) throw py::value_error("repeat must be in 1..100000");
        const KernelCase kc = kernel_case(variant, wtype, w, rows, cols, x, threads, prefill_only);
        std::vector<float> y(static_cast<size_t>(kc.m * rows));
        const float* xp = x.data();
        double best = 1e30;
        {
            py::gil_scoped_release nogil;
            Compute c(threads, cols);
            c.matmul(kc.w, xp, cols, kc.m, y.data(), rows, kc.phase);  // warm-up
            for (int i = 0; i < repeat; ++i) {
                const auto t0 = std::chrono::steady_clock::now();
                c.matmul(kc.w, xp, cols, kc.m, y.data(), rows, kc.phase);
                best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            }
        }
        return best;
    }, py::arg("variant"), py::arg("wtype"), py::arg("w"), py::arg("rows"), py::arg("cols"), py::arg("x"),
       py::arg("threads") = 1, py::arg("repeat") = 1, py::arg("prefill_only") = false,
       "Best wall seconds of one product over `repeat` (after one warm-up), packing and set-up excluded.");

    m.def("load_optable", [](const std::string& text, const std::string& source) {
        try {
            evk::load_optable(text, source);
        } catch (const std::invalid_argument& e) {
            throw py::value_error(source + ": " + e.what());
        }
    }, py::arg("text"), py::arg("source"), "Replaces the operator table rules; models loaded afterwards use them.");
    m.def("optable_source", &evk::optable_source);
    m.def("builtin_optable", [] { return std::string(EVK_DEFAULT_OPTABLE); }, "The compiled-in rules (kernels/optable.tsv).");
    m.def("list_variants", [] {
        py::list l;
        for (const evk::VariantInfo& v : evk::list_variants()) {
            py::dict d;
            d["op"] = v.op; d["name"] = v.name; d["formats"] = v.formats; d["available"] = v.available;
            d["layout"] = v.layout.empty() ? "rows" : v.layout;  // the weight layout it reads
            l.append(d);
        }
        return l;
    });
    m.def("choose_matmul", [](const std::string& wtype, const std::string& phase, int64_t rows, int64_t k) {
        if (phase != "decode" && phase != "prefill" && phase != "int8")
            throw py::value_error("phase must be decode, prefill or int8");
        return std::string(evk::choose_matmul(dtype_named(wtype), phase == "decode" ? evk::kDecode : evk::kPrefill, rows, k,
                                              phase == "int8").name);
    }, "The variant the active operator table picks (int8: a prefill product with int8 products allowed, vision_int8).");

    m.def("kernel_attention", [](const std::string& table, py::array_t<float, py::array::c_style | py::array::forcecast> q,
                                 py::array_t<float, py::array::c_style | py::array::forcecast> k,
                                 py::array_t<float, py::array::c_style | py::array::forcecast> v, float scale,
                                 const std::string& kv_type) {
        if (q.ndim() < 1 || q.ndim() > 2 || k.ndim() != 2 || v.ndim() != 2 || k.shape(1) != q.shape(q.ndim() - 1) ||
            v.shape(1) != k.shape(1) || k.shape(0) != v.shape(0) || k.shape(0) < 1)
            throw py::value_error("q (d,) or (heads, d), k and v (n, d) with n >= 1");
        const int64_t d = k.shape(1), n = k.shape(0), g = q.ndim() == 2 ? q.shape(0) : 1;
        if (g < 1 || g > evk::kMaxAttentionGroup)
            throw py::value_error("1 to " + std::to_string(evk::kMaxAttentionGroup) + " query heads share a kv head");
        const evk::DType t = kv_type_named(kv_type);
        if (!evk::kv_type_fits(t, d))
            throw py::value_error("a f16 / q8_0 cache needs a head size that is a multiple of 32, at most 512");
        // The keys and values as the cache holds them (the formats' reference conversion).
        std::vector<uint8_t> kc(evk::kv_bytes(t, n * d)), vc(kc.size());
        evk::type_traits(t)->from_float(k.data(), kc.data(), n * d);
        evk::type_traits(t)->from_float(v.data(), vc.data(), n * d);
        py::array_t<float> out(std::vector<py::ssize_t>(q.shape(), q.shape() + q.ndim()));
        std::vector<float> scores(static_cast<size_t>(g * n));
        evk::AttentionArgs a{q.data(), kc.data(), vc.data(), d, d, n, d, scale, out.mutable_data(), scores.data(), t, g, d};
        run_variant("attention operator", "attention", table, [&](evk::AttentionFn fn) { fn(a); });
        return out;
    }, py::arg("variant"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("kv_type") = "f32",
       "Attention of one query row, or of a group of query heads sharing the kv head (q of shape (heads, d)), by a named variant, over keys and values stored as kv_type (f32, f16, q8_0).");

    // One exp-based element-wise operator by a named variant ('ref', 'best' = what the operator
    // table picked at start, or a variant name) on a copy of x: softmax over each row of a 2-D x
    // (or the whole of a 1-D x) with the given scale, gelu_tanh over all of x, silu_mul / gelu_mul with b
    // (the shape of x) as the gate's other factor.
    m.def("kernel_elementwise", [](const std::string& op, const std::string& variant,
                                   py::array_t<float, py::array::c_style | py::array::forcecast> x, py::object b, float scale) {
        if (x.ndim() < 1 || x.ndim() > 2 || x.size() < 1) throw py::value_error("x must be a non-empty 1-D or 2-D array");
        py::array_t<float> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
        float* y = out.mutable_data();
        std::memcpy(y, x.data(), static_cast<size_t>(x.size()) * sizeof(float));
        const int64_t n = x.size();
        run_variant("element-wise operator", op, variant, Overloaded{
            [&](evk::SoftmaxFn fn) {
                if (!b.is_none()) throw py::value_error(op + " takes no b");
                const int64_t cols = x.shape(x.ndim() - 1), rows = n / cols;
                py::gil_scoped_release nogil;
                for (int64_t r = 0; r < rows; ++r) fn(y + r * cols, cols, scale);
            },
            [&](evk::GeluFn fn) {
                if (!b.is_none()) throw py::value_error(op + " takes no b");
                py::gil_scoped_release nogil;
                fn(y, n);
            },
            [&](evk::SiluMulFn fn) {  // silu_mul, gelu_mul and add: a = f(a, b) over n
                if (b.is_none()) throw py::value_error(op + " needs b");
                const auto bb = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(b);
                if (!bb || bb.size() != n) throw py::value_error("b must have as many elements as x");
                const float* bp = bb.data();
                py::gil_scoped_release nogil;
                fn(y, bp, n);
            }});
        return out;
    }, py::arg("op"), py::arg("variant"), py::arg("x"), py::arg("b") = py::none(), py::arg("scale") = 1.f);

    // argmax of x (flattened) by a named variant: the first maximum, the first NaN if any.
    m.def("kernel_argmax", [](const std::string& variant, py::array_t<float, py::array::c_style | py::array::forcecast> x) {
        int64_t at = 0;
        run_variant("argmax operator", "argmax", variant, [&](evk::ArgmaxFn fn) {
            py::gil_scoped_release nogil;
            at = fn(x.data(), x.size());
        });
        return at;
    }, py::arg("variant"), py::arg("x"), "Index of the first maximum of x (NumPy's argmax, NaN included) by a named variant.");

    // rmsnorm or layernorm of each row of x (2-D, or 1-D: one row) by a named variant ('ref', 'best'
    // or a variant name): w (and for layernorm the optional b) as long as a row.
    m.def("kernel_norm", [](const std::string& op, const std::string& variant,
                            py::array_t<float, py::array::c_style | py::array::forcecast> x,
                            py::array_t<float, py::array::c_style | py::array::forcecast> w, py::object b, float eps) {
        if (x.ndim() < 1 || x.ndim() > 2 || x.size() < 1) throw py::value_error("x must be a non-empty 1-D or 2-D array");
        const int64_t cols = x.shape(x.ndim() - 1), rows = x.size() / cols;
        if (w.ndim() != 1 || w.shape(0) != cols) throw py::value_error("w must be 1-D, as long as a row of x");
        py::array_t<float> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
        float* y = out.mutable_data();
        const float* xp = x.data();
        const float* wp = w.data();
        run_variant("norm", op, variant, Overloaded{
            [&](evk::RmsNormFn fn) {
                if (!b.is_none()) throw py::value_error(op + " takes no b");
                py::gil_scoped_release nogil;
                for (int64_t r = 0; r < rows; ++r) fn(xp + r * cols, wp, y + r * cols, cols, eps);
            },
            [&](evk::LayerNormFn fn) {
                py::array_t<float, py::array::c_style | py::array::forcecast> bb;
                const float* bp = nullptr;
                if (!b.is_none()) {
                    bb = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(b);
                    if (!bb || bb.ndim() != 1 || bb.shape(0) != cols) throw py::value_error("b must be 1-D, as long as a row of x");
                    bp = bb.data();
                }
                py::gil_scoped_release nogil;
                for (int64_t r = 0; r < rows; ++r) fn(xp + r * cols, wp, bp, y + r * cols, cols, eps);
            }});
        return out;
    }, py::arg("op"), py::arg("variant"), py::arg("x"), py::arg("w"), py::arg("b") = py::none(), py::arg("eps") = 1e-5f);

    // rope by a named variant on a copy of x: each row of x (2-D, or 1-D: one row) holds n_heads
    // heads head_dim apart (a row may be longer); cs the rope_dims (cos, sin) values of one position.
    m.def("kernel_rope", [](const std::string& variant, py::array_t<float, py::array::c_style | py::array::forcecast> x,
                            int64_t n_heads, int64_t head_dim, int64_t rope_dims,
                            py::array_t<float, py::array::c_style | py::array::forcecast> cs, bool neox) {
        if (x.ndim() < 1 || x.ndim() > 2 || x.size() < 1) throw py::value_error("x must be a non-empty 1-D or 2-D array");
        const int64_t cols = x.shape(x.ndim() - 1), rows = x.size() / cols;
        if (n_heads < 1 || head_dim < 1 || rope_dims < 0 || rope_dims > head_dim || n_heads * head_dim > cols)
            throw py::value_error("need n_heads, head_dim >= 1, rope_dims in [0, head_dim], n_heads * head_dim <= row length");
        if (cs.size() < rope_dims / 2 * 2) throw py::value_error("cs must hold rope_dims / 2 (cos, sin) pairs");
        py::array_t<float> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
        float* y = out.mutable_data();
        std::memcpy(y, x.data(), static_cast<size_t>(x.size()) * sizeof(float));
        const float* c = cs.data();
        run_variant("rope operator", "rope", variant, [&](evk::RopeFn fn) {
            py::gil_scoped_release nogil;
            for (int64_t r = 0; r < rows; ++r) fn(y + r * cols, n_heads, head_dim, rope_dims, c, neox);
        });
        return out;
    }, py::arg("variant"), py::arg("x"), py::arg("n_heads"), py::arg("head_dim"), py::arg("rope_dims"), py::arg("cs"),
       py::arg("neox") = false);

    register_deltanet_bindings(m);

    m.def("rope_angles", [](float pos, float theta_base, int64_t rope_dims) {
        if (rope_dims < 0) throw py::value_error("rope_dims must be >= 0");
        py::array_t<float> cs(rope_dims / 2 * 2);
        evk::rope_angles(pos, theta_base, rope_dims, cs.mutable_data());
        return cs;
    }, py::arg("pos"), py::arg("theta_base"), py::arg("rope_dims"), "(cos, sin) of each rope pair at a position.");

    m.def("choose", [](const std::string& op) {
        try {
            return evk::choose(op);
        } catch (const std::invalid_argument& e) {
            throw py::value_error(e.what());
        }
    }, "The variant the active operator table picks for an operator of operators() (attention, the element-wise ones).");

    m.def("quantize", [](const std::string& wtype, py::array_t<float, py::array::c_style | py::array::forcecast> x) {
        const evk::DType t = dtype_named(wtype);
        const int64_t n = x.size();
        const size_t rb = evk::row_bytes(t, n);
        if (rb == 0) throw py::value_error("size must be a multiple of the block size");
        const evk::FromFloatFn from_float = evk::type_traits(t)->from_float;
        if (!from_float) throw py::value_error("no reference quantizer for " + wtype);
        py::array_t<uint8_t> out(static_cast<py::ssize_t>(rb));
        from_float(x.data(), out.mutable_data(), n);
        return out;
    }, "Reference quantization of a float32 array (a whole number of blocks) to raw GGUF bytes.");

    m.def("dequantize", [](const std::string& wtype, py::array_t<uint8_t, py::array::c_style | py::array::forcecast> raw, int64_t n) {
        const evk::DType t = dtype_named(wtype);
        if (!evk::type_traits(t)->computable) throw py::value_error("format " + wtype + " is not supported");
        const size_t rb = evk::row_bytes(t, n);
        if (rb == 0 || static_cast<size_t>(raw.size()) != rb) throw py::value_error("byte count does not match n");
        py::array_t<float> out(n);
        evk::dequantize_row(t, raw.data(), out.mutable_data(), n);
        return out;
    }, "Reference dequantization of raw GGUF bytes to n float32 values.");

    m.def("kernel_variants", [] {
        py::dict d;
        for (evk::DType t : computable_types()) {
            const std::string name = evk::type_traits(t)->name;
            d[py::str(std::string("matmul/") + name + "/decode")] = evk::choose_matmul(t, evk::kDecode, 1024, 1024).name;
            d[py::str(std::string("matmul/") + name + "/prefill")] = evk::choose_matmul(t, evk::kPrefill, 1024, 1024).name;
        }
        const evk::OpTable& b = evk::best_ops();
#define EVK_CHOSEN(name, Fn) d[#name] = b.name##_variant;
        EVK_OPS(EVK_CHOSEN)
#undef EVK_CHOSEN
        return d;
    });
}
