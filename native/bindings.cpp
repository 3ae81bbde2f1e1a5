// The one pybind11 file: exposes the GGUF reader and the models to Python as edgevlm_ros._engine.
// Compute runs with the GIL released so a ROS executor keeps spinning while a frame is described.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#ifndef EVK_DEFAULT_OPTABLE
#define EVK_DEFAULT_OPTABLE ""
#endif

#include "gguf.h"
#include "models/registry.h"

namespace py = pybind11;
using namespace evn;

namespace {

py::object to_python(const GValue& v) {
    switch (v.type) {
    case GType::U8: case GType::U16: case GType::U32: case GType::U64: return py::int_(v.u);
    case GType::I8: case GType::I16: case GType::I32: case GType::I64: return py::int_(v.i);
    case GType::F32: case GType::F64: return py::float_(v.f);
    case GType::BOOL: return py::bool_(v.u != 0);
    case GType::STRING: {
        // Invalid UTF-8 in a file must not raise here: keep the bytes as surrogate escapes.
        PyObject* s = PyUnicode_DecodeUTF8(v.s.data(), static_cast<Py_ssize_t>(v.s.size()), "surrogateescape");
        if (!s) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(s);
    }
    case GType::ARRAY: {
        const size_t n = v.count();
        py::list l(n);
        if (v.elem_type == GType::ARRAY) {
            for (size_t i = 0; i < n; ++i) l[i] = to_python(v.arr[i]);
        } else if (v.elem_type == GType::STRING) {
            for (size_t i = 0; i < n; ++i) {
                GValue e;
                e.type = GType::STRING;
                e.s = v.strs[i];
                l[i] = to_python(e);
            }
        } else {
            const size_t w = static_cast<size_t>(gtype_size(v.elem_type));
            for (size_t i = 0; i < n; ++i) {
                const uint8_t* p = v.raw.data() + i * w;
                GValue e;
                e.type = v.elem_type;
                uint64_t bits = 0;
                std::memcpy(&bits, p, w);
                switch (v.elem_type) {
                case GType::I8: e.i = static_cast<int8_t>(bits); break;
                case GType::I16: e.i = static_cast<int16_t>(bits); break;
                case GType::I32: e.i = static_cast<int32_t>(bits); break;
                case GType::I64: e.i = static_cast<int64_t>(bits); break;
                case GType::F32: { float x; std::memcpy(&x, p, 4); e.f = x; break; }
                case GType::F64: { double x; std::memcpy(&x, p, 8); e.f = x; break; }
                default: e.u = bits; break;  // unsigned ints and bool
                }
                l[i] = to_python(e);
            }
        }
        return std::move(l);
    }
    }
    return py::none();
}

py::dict tensor_dict(const TensorInfo& t) {
    py::dict d;
    d["name"] = t.name;
    d["type"] = evk::type_traits(t.type)->name;
    py::list shape;
    for (int i = 0; i < t.n_dims; ++i) shape.append(t.ne[i]);
    d["shape"] = shape;  // ggml order: ne[0] (contiguous) first
    d["offset"] = t.offset;
    d["nbytes"] = t.nbytes;
    return d;
}

py::array_t<float> dequantize_tensor(const GGUFFile& f, const std::string& name) {
    const TensorInfo* t = f.find_tensor(name);
    if (!t) throw py::key_error("no tensor '" + name + "' in '" + f.path() + "'");
    if (!evk::type_traits(t->type)->computable)
        throw py::value_error(std::string("format ") + evk::type_traits(t->type)->name + " of '" + name + "' is not supported");
    std::vector<py::ssize_t> shape;
    for (int i = t->n_dims - 1; i >= 0; --i) shape.push_back(t->ne[i]);  // numpy order
    py::array_t<float> out(shape);
    float* dst = out.mutable_data();
    const int64_t rows = t->nelements() / t->ne[0];
    const size_t rb = evk::row_bytes(t->type, t->ne[0]);
    for (int64_t r = 0; r < rows; ++r)
        evk::dequantize_row(t->type, static_cast<const char*>(t->data) + static_cast<size_t>(r) * rb, dst + r * t->ne[0], t->ne[0]);
    return out;
}

py::array_t<int32_t> as_ids(const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& a) {
    if (a.ndim() != 1) throw py::value_error("token ids must be a 1-D array");
    return a;
}

// A request's prompt as Python hands it over, owned (Decoder.generate's GIL-free part reads it).
struct Prompt {
    std::vector<int32_t> ids;
    std::vector<float> features;  // n_slots rows of n_embd
    std::vector<int64_t> slots;
    int64_t feature_width = 0;
    std::shared_ptr<const KVSnapshot> prefix;
    PromptInput input() const {
        return PromptInput{ids.data(), static_cast<int64_t>(ids.size()), features.data(), slots.data(),
                           static_cast<int64_t>(slots.size())};
    }
};

void set_image(Prompt& p, const py::object& features, const py::object& slots) {
    if (features.is_none() != slots.is_none()) throw py::value_error("features and slots go together");
    if (features.is_none()) return;
    const auto f = features.cast<py::array_t<float, py::array::c_style | py::array::forcecast>>();
    const auto s = slots.cast<py::array_t<int64_t, py::array::c_style | py::array::forcecast>>();
    if (f.ndim() != 2 || s.ndim() != 1 || f.shape(0) != s.shape(0))
        throw py::value_error("features must have shape (n, width) for n slots, got " + std::to_string(f.shape(0)) +
                              " rows for " + std::to_string(s.size()) + " slots");
    p.features.assign(f.data(), f.data() + f.size());
    p.slots.assign(s.data(), s.data() + s.size());
    p.feature_width = f.shape(1);
}

void check_image(const Decoder& mdl, const Prompt& p) {
    if (!p.slots.empty() && p.feature_width != mdl.config().n_embd)
        throw py::value_error("image features are " + std::to_string(p.feature_width) + " wide, the decoder " +
                              std::to_string(mdl.config().n_embd));
}

evk::DType dtype_named(const std::string& name) {
    for (uint32_t id = 0; id < 64; ++id) {
        const evk::TypeTraits* t = evk::type_traits(id);
        if (t && name == t->name) return static_cast<evk::DType>(id);
    }
    throw py::value_error("unknown weight format '" + name + "'");
}

}  // namespace

PYBIND11_MODULE(_engine, m) {
    m.doc() = "edgevlm native engine: GGUF reader, kernels and model graphs";
    py::register_exception<GGUFError>(m, "GGUFError", PyExc_ValueError);
    py::register_exception<UnsupportedModel>(m, "UnsupportedModelError", PyExc_ValueError);

    m.def("cpu_features", [] {
        const evk::CpuFeatures f = evk::detect_cpu_features();
        py::dict d;
        d["avx2"] = f.avx2; d["fma"] = f.fma; d["f16c"] = f.f16c; d["avx512f"] = f.avx512f;
        d["avx512bw"] = f.avx512bw; d["avx512vl"] = f.avx512vl; d["avxvnni"] = f.avxvnni; d["avx512vnni"] = f.avx512vnni;
        d["avx512bf16"] = f.avx512bf16; d["amxbf16"] = f.amx_bf16;  // as the operator table names them
        d["neon"] = f.neon; d["dotprod"] = f.dotprod; d["i8mm"] = f.i8mm;
        return d;
    });


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
        if (phase != "decode" && phase != "prefill") throw py::value_error("phase must be decode or prefill");
        return std::string(evk::choose_matmul(dtype_named(wtype), phase == "decode" ? evk::kDecode : evk::kPrefill, rows, k).name);
    }, "The variant the active operator table picks.");

    m.def("kernel_attention", [](const std::string& table, py::array_t<float, py::array::c_style | py::array::forcecast> q,
                                 py::array_t<float, py::array::c_style | py::array::forcecast> k,
                                 py::array_t<float, py::array::c_style | py::array::forcecast> v, float scale) {
        if (q.ndim() != 1 || k.ndim() != 2 || v.ndim() != 2 || k.shape(1) != q.shape(0) || v.shape(1) != q.shape(0) ||
            k.shape(0) != v.shape(0) || k.shape(0) < 1)
            throw py::value_error("q (d,), k and v (n, d) with n >= 1");
        const int64_t d = q.shape(0), n = k.shape(0);
        py::array_t<float> out(d);
        std::vector<float> scores(static_cast<size_t>(n));
        evk::AttentionArgs a{q.data(), k.data(), v.data(), d, d, n, d, scale, out.mutable_data(), scores.data()};
        const evk::AttentionFn fn = table == "ref" ? evk::reference_ops().attention
                                  : table == "best" ? evk::best_ops().attention : evk::attention_variant(table);
        if (!fn) throw py::value_error("attention variant '" + table + "' does not run here");
        fn(a);
        return out;
    });

    // One exp-based element-wise operator by a named variant ('ref', 'best' = what the operator
    // table picked at start, or a variant name) on a copy of x: softmax over each row of a 2-D x
    // (or the whole of a 1-D x) with the given scale, gelu_tanh over all of x, silu_mul with b
    // (the shape of x) as the gate's other factor.
    m.def("kernel_elementwise", [](const std::string& op, const std::string& variant,
                                   py::array_t<float, py::array::c_style | py::array::forcecast> x, py::object b, float scale) {
        if (x.ndim() < 1 || x.ndim() > 2 || x.size() < 1) throw py::value_error("x must be a non-empty 1-D or 2-D array");
        const evk::OpTable& table = variant == "best" ? evk::best_ops() : evk::reference_ops();
        const bool named = variant != "best" && variant != "ref";
        py::array_t<float> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
        float* y = out.mutable_data();
        std::memcpy(y, x.data(), static_cast<size_t>(x.size()) * sizeof(float));
        const int64_t n = x.size();
        if (op == "softmax") {
            const evk::SoftmaxFn fn = named ? evk::softmax_variant(variant) : table.softmax;
            if (!fn) throw py::value_error("softmax variant '" + variant + "' does not run here");
            if (!b.is_none()) throw py::value_error("softmax takes no b");
            const int64_t cols = x.shape(x.ndim() - 1), rows = n / cols;
            py::gil_scoped_release nogil;
            for (int64_t r = 0; r < rows; ++r) fn(y + r * cols, cols, scale);
        } else if (op == "gelu_tanh") {
            const evk::GeluFn fn = named ? evk::gelu_tanh_variant(variant) : table.gelu_tanh;
            if (!fn) throw py::value_error("gelu_tanh variant '" + variant + "' does not run here");
            if (!b.is_none()) throw py::value_error("gelu_tanh takes no b");
            py::gil_scoped_release nogil;
            fn(y, n);
        } else if (op == "silu_mul" || op == "add") {  // the same signature: a = f(a, b) over n
            const evk::SiluMulFn fn = op == "add" ? (named ? evk::add_variant(variant) : table.add)
                                                  : (named ? evk::silu_mul_variant(variant) : table.silu_mul);
            if (!fn) throw py::value_error(op + " variant '" + variant + "' does not run here");
            if (b.is_none()) throw py::value_error(op + " needs b");
            const auto bb = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(b);
            if (!bb || bb.size() != n) throw py::value_error("b must have as many elements as x");
            const float* bp = bb.data();
            py::gil_scoped_release nogil;
            fn(y, bp, n);
        } else {
            throw py::value_error("unknown element-wise operator '" + op + "' (softmax, gelu_tanh, silu_mul, add)");
        }
        return out;
    }, py::arg("op"), py::arg("variant"), py::arg("x"), py::arg("b") = py::none(), py::arg("scale") = 1.f);

    // rmsnorm or layernorm of each row of x (2-D, or 1-D: one row) by a named variant ('ref', 'best'
    // or a variant name): w (and for layernorm the optional b) as long as a row.
    m.def("kernel_norm", [](const std::string& op, const std::string& variant,
                            py::array_t<float, py::array::c_style | py::array::forcecast> x,
                            py::array_t<float, py::array::c_style | py::array::forcecast> w, py::object b, float eps) {
        if (x.ndim() < 1 || x.ndim() > 2 || x.size() < 1) throw py::value_error("x must be a non-empty 1-D or 2-D array");
        const int64_t cols = x.shape(x.ndim() - 1), rows = x.size() / cols;
        if (w.ndim() != 1 || w.shape(0) != cols) throw py::value_error("w must be 1-D, as long as a row of x");
        const evk::OpTable& table = variant == "best" ? evk::best_ops() : evk::reference_ops();
        const bool named = variant != "best" && variant != "ref";
        py::array_t<float> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
        float* y = out.mutable_data();
        const float* xp = x.data();
        const float* wp = w.data();
        if (op == "rmsnorm") {
            const evk::RmsNormFn fn = named ? evk::rmsnorm_variant(variant) : table.rmsnorm;
            if (!fn) throw py::value_error("rmsnorm variant '" + variant + "' does not run here");
            if (!b.is_none()) throw py::value_error("rmsnorm takes no b");
            py::gil_scoped_release nogil;
            for (int64_t r = 0; r < rows; ++r) fn(xp + r * cols, wp, y + r * cols, cols, eps);
        } else if (op == "layernorm") {
            const evk::LayerNormFn fn = named ? evk::layernorm_variant(variant) : table.layernorm;
            if (!fn) throw py::value_error("layernorm variant '" + variant + "' does not run here");
            py::array_t<float, py::array::c_style | py::array::forcecast> bb;
            const float* bp = nullptr;
            if (!b.is_none()) {
                bb = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(b);
                if (!bb || bb.ndim() != 1 || bb.shape(0) != cols) throw py::value_error("b must be 1-D, as long as a row of x");
                bp = bb.data();
            }
            py::gil_scoped_release nogil;
            for (int64_t r = 0; r < rows; ++r) fn(xp + r * cols, wp, bp, y + r * cols, cols, eps);
        } else {
            throw py::value_error("unknown norm '" + op + "' (rmsnorm, layernorm)");
        }
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
        const evk::RopeFn fn = variant == "best" ? evk::best_ops().rope : variant == "ref" ? evk::reference_ops().rope
                                                                                           : evk::rope_variant(variant);
        if (!fn) throw py::value_error("rope variant '" + variant + "' does not run here");
        py::array_t<float> out(std::vector<py::ssize_t>(x.shape(), x.shape() + x.ndim()));
        float* y = out.mutable_data();
        std::memcpy(y, x.data(), static_cast<size_t>(x.size()) * sizeof(float));
        const float* c = cs.data();
        py::gil_scoped_release nogil;
        for (int64_t r = 0; r < rows; ++r) fn(y + r * cols, n_heads, head_dim, rope_dims, c, neox);
        return out;
    }, py::arg("variant"), py::arg("x"), py::arg("n_heads"), py::arg("head_dim"), py::arg("rope_dims"), py::arg("cs"),
       py::arg("neox") = false);

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
    }, "The variant the active operator table picks for attention or an element-wise operator (softmax, gelu_tanh, "
       "silu_mul, rmsnorm, layernorm, rope, add).");

    m.def("quantize", [](const std::string& wtype, py::array_t<float, py::array::c_style | py::array::forcecast> x) {
        const evk::DType t = dtype_named(wtype);
        const int64_t n = x.size();
        const size_t rb = evk::row_bytes(t, n);
        if (rb == 0) throw py::value_error("size must be a multiple of the block size");
        py::array_t<uint8_t> out(static_cast<py::ssize_t>(rb));
        switch (t) {
        case evk::DType::Q8_0: evk::quantize_row_q8_0(x.data(), out.mutable_data(), n); break;
        case evk::DType::Q4_0: evk::quantize_row_q4_0(x.data(), out.mutable_data(), n); break;
        case evk::DType::Q4_1: evk::quantize_row_q4_1(x.data(), out.mutable_data(), n); break;
        case evk::DType::F16: {
            uint16_t* o = reinterpret_cast<uint16_t*>(out.mutable_data());
            for (int64_t i = 0; i < n; ++i) o[i] = evk::fp32_to_fp16(x.data()[i]);
            break;
        }
        case evk::DType::F32: std::memcpy(out.mutable_data(), x.data(), rb); break;
        default: throw py::value_error("no reference quantizer for " + wtype);
        }
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
        for (const char* name : {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}) {
            const evk::DType t = dtype_named(name);
            d[py::str(std::string("matmul/") + name + "/decode")] = evk::choose_matmul(t, evk::kDecode, 1024, 1024).name;
            d[py::str(std::string("matmul/") + name + "/prefill")] = evk::choose_matmul(t, evk::kPrefill, 1024, 1024).name;
        }
        const evk::OpTable& b = evk::best_ops();
        d["attention"] = b.attention_variant;
        d["softmax"] = b.softmax_variant;
        d["gelu_tanh"] = b.gelu_tanh_variant;
        d["silu_mul"] = b.silu_mul_variant;
        d["rmsnorm"] = b.rmsnorm_variant;
        d["layernorm"] = b.layernorm_variant;
        d["rope"] = b.rope_variant;
        d["add"] = b.add_variant;
        return d;
    });

    py::class_<GGUFFile, std::shared_ptr<GGUFFile>>(m, "GGUFFile")
        .def(py::init([](const std::string& path) {
                 py::gil_scoped_release nogil;
                 return std::make_shared<GGUFFile>(path);
             }),
             py::arg("path"))
        .def_property_readonly("path", &GGUFFile::path)
        .def_property_readonly("version", &GGUFFile::version)
        .def_property_readonly("alignment", &GGUFFile::alignment)
        .def_property_readonly("data_offset", &GGUFFile::data_offset)
        .def_property_readonly("file_size", &GGUFFile::file_size)
        .def("metadata", [](const GGUFFile& f) {
            py::dict d;
            for (const auto& kv : f.metadata()) d[py::str(kv.first)] = to_python(kv.second);
            return d;
        }, "All key/value pairs as plain Python values (arrays as lists).")
        .def("tensors", [](const GGUFFile& f) {
            py::list l;
            for (const TensorInfo& t : f.tensors()) l.append(tensor_dict(t));
            return l;
        })
        .def("dequantize", &dequantize_tensor, py::arg("name"), "A tensor converted to float32, numpy dimension order.");

    py::class_<KVSnapshot, std::shared_ptr<KVSnapshot>>(m, "KVSnapshot")
        .def_readonly("n_past", &KVSnapshot::n_past)
        .def_readonly("n_layer", &KVSnapshot::n_layer)
        .def_readonly("kv_dim", &KVSnapshot::kv_dim)
        .def_property_readonly("nbytes", [](const KVSnapshot& s) { return (s.k.size() + s.v.size() + s.recurrent.size()) * sizeof(float); })
        .def("arrays", [](const KVSnapshot& s) {
            auto copy = [&](const std::vector<float>& src) {
                py::array_t<float> a({s.n_layer, s.n_past, s.kv_dim});
                std::memcpy(a.mutable_data(), src.data(), src.size() * sizeof(float));
                return a;
            };
            // Prefix-cache files (format 1) hold K and V only: a state they cannot hold is refused, not cut.
            if (!s.recurrent.empty()) throw py::value_error("the snapshot holds recurrent state, which arrays() does not carry");
            return py::make_tuple(copy(s.k), copy(s.v));
        }, "Copies of the cached keys and values, each (n_layer, n_past, kv_dim) float32.")
        .def_static("from_arrays", [](py::array_t<float, py::array::c_style | py::array::forcecast> k,
                                      py::array_t<float, py::array::c_style | py::array::forcecast> v) {
            if (k.ndim() != 3 || v.ndim() != 3 || k.shape(0) != v.shape(0) || k.shape(1) != v.shape(1) || k.shape(2) != v.shape(2))
                throw py::value_error("k and v must both have shape (n_layer, n_past, kv_dim)");
            auto s = std::make_shared<KVSnapshot>();
            s->n_layer = k.shape(0);
            s->n_past = k.shape(1);
            s->kv_dim = k.shape(2);
            s->k.assign(k.data(), k.data() + k.size());
            s->v.assign(v.data(), v.data() + v.size());
            return s;
        }, py::arg("k"), py::arg("v"), "A snapshot from arrays (a prefix-cache file); restore() checks it fits the model.");

    // What one request prefills (Decoder.generate): the suffix ids, the image features and the
    // positions they take, and the fixed-prefix state it starts from (None: an empty sequence).
    py::class_<Prompt>(m, "Prompt")
        .def(py::init([](py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids, py::object features,
                         py::object slots, std::shared_ptr<const KVSnapshot> prefix) {
                 Prompt p;
                 ids = as_ids(ids);
                 p.ids.assign(ids.data(), ids.data() + ids.shape(0));
                 set_image(p, features, slots);
                 p.prefix = std::move(prefix);
                 return p;
             }),
             py::arg("ids"), py::arg("features") = py::none(), py::arg("slots") = py::none(), py::arg("prefix") = py::none())
        .def_property_readonly("n_tokens", [](const Prompt& p) { return p.ids.size(); })
        .def_property_readonly("n_slots", [](const Prompt& p) { return p.slots.size(); });

    py::class_<Decoder>(m, "Decoder")
        .def(py::init([](std::shared_ptr<GGUFFile> f, int threads, int64_t n_ctx, int64_t n_batch) {
                 if (threads < 1 || threads > 256) throw py::value_error("threads must be in 1..256");
                 if (n_ctx < 0) throw py::value_error("n_ctx must be >= 0 (0 = default)");
                 if (n_batch < 1 || n_batch > 4096) throw py::value_error("n_batch must be in 1..4096");
                 py::gil_scoped_release nogil;
                 return std::make_unique<Decoder>(std::move(f), threads, n_ctx, n_batch);
             }),
             py::arg("file"), py::arg("threads") = 1, py::arg("n_ctx") = 0, py::arg("n_batch") = 64)
        .def_property_readonly("config", [](const Decoder& mdl) {
            const DecoderConfig& c = mdl.config();
            py::dict d;
            d["arch"] = c.arch; d["n_vocab"] = c.n_vocab; d["n_embd"] = c.n_embd; d["n_ff"] = c.n_ff;
            d["n_layer"] = c.n_layer; d["n_head"] = c.n_head; d["n_head_kv"] = c.n_head_kv; d["head_dim"] = c.head_dim;
            d["n_ctx_train"] = c.n_ctx_train; d["rope_dims"] = c.rope_dims; d["rms_eps"] = c.rms_eps;
            d["rope_base"] = c.rope_base; d["rope_scale"] = c.rope_scale; d["tied_output"] = c.tied_output;
            return d;
        })
        .def_property_readonly("n_ctx", &Decoder::n_ctx)
        .def_property_readonly("n_past", &Decoder::n_past)
        .def_property_readonly("threads", &Decoder::threads)
        .def("variants", &Decoder::variants, "Which kernel variant serves each operator.")
        .def("reset", &Decoder::reset)
        .def("forward", [](Decoder& mdl, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids,
                           bool all_logits, py::object features, py::object slots) {
            Prompt p;
            ids = as_ids(ids);
            p.ids.assign(ids.data(), ids.data() + ids.shape(0));
            set_image(p, features, slots);
            const int64_t n = ids.shape(0);
            if (n == 0) throw py::value_error("no tokens to run");
            check_image(mdl, p);
            const int64_t V = mdl.config().n_vocab;
            py::array_t<float> out = all_logits ? py::array_t<float>(std::vector<py::ssize_t>{n, V}) : py::array_t<float>(std::vector<py::ssize_t>{V});
            float* dst = out.mutable_data();
            {
                py::gil_scoped_release nogil;
                mdl.prefill(p.input(), dst, all_logits);
            }
            return out;
        }, py::arg("ids"), py::arg("all_logits") = false, py::arg("features") = py::none(), py::arg("slots") = py::none(),
           "Appends tokens to the sequence (the rows at `slots` take the rows of `features`, shape (len(slots), "
           "n_embd): an image); returns the last position's logits, or every position's.")
        .def("generate", [](Decoder& mdl, py::object prompt, int64_t max_new, std::vector<int32_t> stop_ids, double max_ms) {
            if (max_new < 0) throw py::value_error("max_new_tokens must be >= 0");
            // A Prompt starts from its prefix (or an empty sequence); bare ids go on the sequence as it stands.
            Prompt bare;
            const bool request = py::isinstance<Prompt>(prompt);
            if (!request) {
                py::array_t<int32_t> ids = as_ids(prompt.cast<py::array_t<int32_t, py::array::c_style | py::array::forcecast>>());
                bare.ids.assign(ids.data(), ids.data() + ids.shape(0));
            }
            const Prompt& p = request ? prompt.cast<const Prompt&>() : bare;
            if (p.ids.empty()) throw py::value_error("empty prompt: the first token comes from the prompt's last position");
            check_image(mdl, p);
            GenerateResult r;
            {
                py::gil_scoped_release nogil;
                const auto t0 = std::chrono::steady_clock::now();
                if (request && p.prefix) mdl.restore(*p.prefix);
                else if (request) mdl.reset();
                const double start_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
                mdl.generate(p.input(), max_new, stop_ids, max_ms > 0 ? std::max(max_ms - start_ms, 1e-6) : 0.0, r);
                r.prefill_ms += start_ms;
            }
            py::dict d;
            d["tokens"] = r.tokens;
            d["stop_reason"] = r.stop_reason;
            d["prefill_ms"] = r.prefill_ms;
            d["decode_ms"] = r.decode_ms;
            d["n_prompt"] = r.n_prompt;
            return d;
        }, py::arg("prompt"), py::arg("max_new_tokens"), py::arg("stop_ids"), py::arg("max_ms") = 0.0,
           "Greedy decoding after prefilling prompt: a Prompt (restored prefix or empty sequence first, image "
           "features at their slots) or token ids (appended to the sequence as it stands). The stop token is not "
           "returned; prefill_ms includes restoring the prefix.")
        .def("cancel", [](Decoder& mdl, bool on) { mdl.cancel(on); }, py::arg("on") = true,
             py::call_guard<py::gil_scoped_release>(),
             "From any thread: generate() stops before its next token with stop_reason 'cancelled' "
             "(sticky until cancel(False)).")
        .def("snapshot", [](const Decoder& mdl) { return std::make_shared<KVSnapshot>(mdl.snapshot()); })
        .def("restore", [](Decoder& mdl, const KVSnapshot& s) { mdl.restore(s); });
    m.attr("LlamaModel") = m.attr("Decoder");  // the name of the days when llama was the only architecture

    py::class_<VisionModel>(m, "VisionModel")
        .def(py::init([](std::shared_ptr<GGUFFile> f, int threads) {
                 if (threads < 1 || threads > 256) throw py::value_error("threads must be in 1..256");
                 py::gil_scoped_release nogil;
                 return std::make_unique<VisionModel>(std::move(f), threads);
             }),
             py::arg("file"), py::arg("threads") = 1)
        .def_property_readonly("config", [](const VisionModel& mdl) {
            const VisionConfig& c = mdl.config();
            py::dict d;
            d["projector"] = c.projector; d["image_size"] = c.image_size; d["patch_size"] = c.patch_size;
            d["n_embd"] = c.n_embd; d["n_ff"] = c.n_ff; d["n_layer"] = c.n_layer; d["n_head"] = c.n_head;
            d["proj_dim"] = c.proj_dim; d["scale_factor"] = c.scale_factor; d["eps"] = c.eps;
            d["tokens_per_tile"] = c.n_out(); d["ffn_swapped"] = mdl.ffn_swapped();
            return d;
        })
        .def("variants", &VisionModel::variants, "Which kernel variant serves each operator.")
        .def("encode", [](VisionModel& mdl, py::array_t<float, py::array::c_style | py::array::forcecast> pixels) {
            const VisionConfig& c = mdl.config();
            if (pixels.ndim() != 4 || pixels.shape(1) != 3 || pixels.shape(2) != c.image_size || pixels.shape(3) != c.image_size)
                throw py::value_error("pixels must have shape (n_tiles, 3, " + std::to_string(c.image_size) + ", " +
                                      std::to_string(c.image_size) + ")");
            const int64_t tiles = pixels.shape(0), per = c.n_out();
            if (tiles < 1) throw py::value_error("no tiles to encode");
            py::array_t<float> out({tiles * per, c.proj_dim});
            float* dst = out.mutable_data();
            const float* src = pixels.data();
            {
                py::gil_scoped_release nogil;
                for (int64_t t = 0; t < tiles; ++t)
                    mdl.encode(src + t * 3 * c.image_size * c.image_size, dst + t * per * c.proj_dim);
            }
            return out;
        }, py::arg("pixels"), "Image-token embeddings for every tile, in order: (n_tiles * tokens_per_tile, proj_dim).");
    m.attr("ClipVisionModel") = m.attr("VisionModel");  // the name of the days of one vision tower
}
