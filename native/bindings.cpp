// The model API of edgevlm_ros._engine: the GGUF reader and the models. The kernel test/tune
// entry points live in bindings_kernels.cpp. Compute runs with the GIL released so a ROS executor
// keeps spinning while a frame is described.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bindings_kernels.h"
#include "gguf.h"
#include "models/clip_vision.h"
#include "models/llama.h"

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

}  // namespace

PYBIND11_MODULE(_engine, m) {
    m.doc() = "edgevlm native engine: GGUF reader, kernels and model graphs";
    py::register_exception<GGUFError>(m, "GGUFError", PyExc_ValueError);

    register_kernel_bindings(m);

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
        .def_property_readonly("nbytes", [](const KVSnapshot& s) { return (s.k.size() + s.v.size()) * sizeof(float); })
        .def("arrays", [](const KVSnapshot& s) {
            auto copy = [&](const std::vector<float>& src) {
                py::array_t<float> a({s.n_layer, s.n_past, s.kv_dim});
                std::memcpy(a.mutable_data(), src.data(), src.size() * sizeof(float));
                return a;
            };
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

    py::class_<LlamaModel>(m, "LlamaModel")
        .def(py::init([](std::shared_ptr<GGUFFile> f, int threads, int64_t n_ctx, int64_t n_batch) {
                 if (threads < 1 || threads > 256) throw py::value_error("threads must be in 1..256");
                 if (n_ctx < 0) throw py::value_error("n_ctx must be >= 0 (0 = default)");
                 if (n_batch < 1 || n_batch > 4096) throw py::value_error("n_batch must be in 1..4096");
                 py::gil_scoped_release nogil;
                 return std::make_unique<LlamaModel>(std::move(f), threads, n_ctx, n_batch);
             }),
             py::arg("file"), py::arg("threads") = 1, py::arg("n_ctx") = 0, py::arg("n_batch") = 64)
        .def_property_readonly("config", [](const LlamaModel& mdl) {
            const LlamaConfig& c = mdl.config();
            py::dict d;
            d["arch"] = c.arch; d["n_vocab"] = c.n_vocab; d["n_embd"] = c.n_embd; d["n_ff"] = c.n_ff;
            d["n_layer"] = c.n_layer; d["n_head"] = c.n_head; d["n_head_kv"] = c.n_head_kv; d["head_dim"] = c.head_dim;
            d["n_ctx_train"] = c.n_ctx_train; d["rope_dims"] = c.rope_dims; d["rms_eps"] = c.rms_eps;
            d["rope_base"] = c.rope_base; d["rope_scale"] = c.rope_scale; d["tied_output"] = c.tied_output;
            return d;
        })
        .def_property_readonly("n_ctx", &LlamaModel::n_ctx)
        .def_property_readonly("n_past", &LlamaModel::n_past)
        .def_property_readonly("threads", &LlamaModel::threads)
        .def("variants", &LlamaModel::variants, "Which kernel variant serves each operator.")
        .def("reset", &LlamaModel::reset)
        .def("forward", [](LlamaModel& mdl, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids, bool all_logits) {
            ids = as_ids(ids);
            const int64_t n = ids.shape(0);
            if (n == 0) throw py::value_error("no tokens to run");
            const int64_t V = mdl.config().n_vocab;
            py::array_t<float> out = all_logits ? py::array_t<float>(std::vector<py::ssize_t>{n, V}) : py::array_t<float>(std::vector<py::ssize_t>{V});
            float* dst = out.mutable_data();
            const int32_t* src = ids.data();
            {
                py::gil_scoped_release nogil;
                mdl.forward_tokens(src, n, dst, all_logits);
            }
            return out;
        }, py::arg("ids"), py::arg("all_logits") = false,
           "Appends tokens to the cache; returns the last position's logits, or every position's.")
        .def("forward_embeddings", [](LlamaModel& mdl, py::array_t<float, py::array::c_style | py::array::forcecast> x, bool all_logits) {
            if (x.ndim() != 2 || x.shape(1) != mdl.config().n_embd)
                throw py::value_error("embeddings must have shape (n, " + std::to_string(mdl.config().n_embd) + ")");
            const int64_t n = x.shape(0), V = mdl.config().n_vocab;
            if (n == 0) throw py::value_error("no embeddings to run");
            py::array_t<float> out = all_logits ? py::array_t<float>(std::vector<py::ssize_t>{n, V}) : py::array_t<float>(std::vector<py::ssize_t>{V});
            float* dst = out.mutable_data();
            const float* src = x.data();
            {
                py::gil_scoped_release nogil;
                mdl.forward_embeddings(src, n, dst, all_logits);
            }
            return out;
        }, py::arg("x"), py::arg("all_logits") = false)
        .def("generate", [](LlamaModel& mdl, py::array_t<int32_t, py::array::c_style | py::array::forcecast> prompt, int64_t max_new,
                            std::vector<int32_t> stop_ids, double max_ms) {
            prompt = as_ids(prompt);
            if (max_new < 0) throw py::value_error("max_new_tokens must be >= 0");
            if (prompt.shape(0) == 0 && mdl.n_past() == 0) throw py::value_error("empty prompt on an empty cache");
            GenerateResult r;
            const int32_t* src = prompt.data();
            const int64_t n = prompt.shape(0);
            {
                py::gil_scoped_release nogil;
                mdl.generate(src, n, max_new, stop_ids, max_ms, r);
            }
            py::dict d;
            d["tokens"] = r.tokens;
            d["stop_reason"] = r.stop_reason;
            d["prefill_ms"] = r.prefill_ms;
            d["decode_ms"] = r.decode_ms;
            d["n_prompt"] = r.n_prompt;
            return d;
        }, py::arg("prompt"), py::arg("max_new_tokens"), py::arg("stop_ids"), py::arg("max_ms") = 0.0,
           "Greedy decoding after appending prompt to the cache; the stop token is not returned.")
        .def("cancel", [](LlamaModel& mdl, bool on) { mdl.cancel(on); }, py::arg("on") = true,
             py::call_guard<py::gil_scoped_release>(),
             "From any thread: generate() stops before its next token with stop_reason 'cancelled' "
             "(sticky until cancel(False)).")
        .def("embed", [](const LlamaModel& mdl, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids) {
            ids = as_ids(ids);
            const int64_t n = ids.shape(0), d = mdl.config().n_embd;
            py::array_t<float> out({n, d});
            mdl.embed(ids.data(), n, out.mutable_data());
            return out;
        }, py::arg("ids"), "Token embedding rows, shape (n, n_embd).")
        .def("snapshot", [](const LlamaModel& mdl) { return std::make_shared<KVSnapshot>(mdl.snapshot()); })
        .def("restore", [](LlamaModel& mdl, const KVSnapshot& s) { mdl.restore(s); });

    py::class_<ClipVisionModel>(m, "ClipVisionModel")
        .def(py::init([](std::shared_ptr<GGUFFile> f, int threads) {
                 if (threads < 1 || threads > 256) throw py::value_error("threads must be in 1..256");
                 py::gil_scoped_release nogil;
                 return std::make_unique<ClipVisionModel>(std::move(f), threads);
             }),
             py::arg("file"), py::arg("threads") = 1)
        .def_property_readonly("config", [](const ClipVisionModel& mdl) {
            const ClipVisionConfig& c = mdl.config();
            py::dict d;
            d["projector"] = c.projector; d["image_size"] = c.image_size; d["patch_size"] = c.patch_size;
            d["n_embd"] = c.n_embd; d["n_ff"] = c.n_ff; d["n_layer"] = c.n_layer; d["n_head"] = c.n_head;
            d["proj_dim"] = c.proj_dim; d["scale_factor"] = c.scale_factor; d["eps"] = c.eps;
            d["tokens_per_tile"] = c.n_out(); d["ffn_swapped"] = mdl.ffn_swapped();
            return d;
        })
        .def("variants", &ClipVisionModel::variants, "Which kernel variant serves each operator.")
        .def("encode", [](ClipVisionModel& mdl, py::array_t<float, py::array::c_style | py::array::forcecast> pixels) {
            const ClipVisionConfig& c = mdl.config();
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
}
