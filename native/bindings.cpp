// The model API of edgevlm_ros._engine: the GGUF reader and the models. The kernel test/tune
// entry points live in bindings_kernels.cpp. Compute runs with the GIL released so a ROS executor
// keeps spinning while a frame is described.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cctype>
#include <cstring>
#include <optional>

#include "bindings_kernels.h"
#include "gguf.h"
#include "json_schema.h"
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

}  // namespace

PYBIND11_MODULE(_engine, m) {
    m.doc() = "edgevlm native engine: GGUF reader, kernels and model graphs";
    py::register_exception<GGUFError>(m, "GGUFError", PyExc_ValueError);
    py::register_exception<UnsupportedModel>(m, "UnsupportedModelError", PyExc_ValueError);

    register_kernel_bindings(m);
    m.attr("DEFAULT_BATCH") = kDefaultBatch;  // Decoder's n_batch unless given (decoder.h)

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
        .def_property_readonly("n_recurrent", [](const KVSnapshot& s) { return s.recurrent.size(); })
        .def("arrays", [](const KVSnapshot& s) {
            py::array_t<float> k({s.n_layer, s.n_past, s.kv_dim}), v({s.n_layer, s.n_past, s.kv_dim});
            py::array_t<float> rec(static_cast<py::ssize_t>(s.recurrent.size()));
            auto copy = [](py::array_t<float>& dst, const std::vector<float>& src) {
                if (!src.empty()) std::memcpy(dst.mutable_data(), src.data(), src.size() * sizeof(float));  // never memcpy(nullptr)
            };
            copy(k, s.k);
            copy(v, s.v);
            copy(rec, s.recurrent);
            return py::make_tuple(k, v, rec);
        }, "Copies of the cached keys and values, each (n_layer, n_past, kv_dim) float32, and of the recurrent "
           "state (n_recurrent floats, layer after layer in the blocks' own layout; empty without recurrent layers).")
        .def_static("from_arrays", [](py::array_t<float, py::array::c_style | py::array::forcecast> k,
                                      py::array_t<float, py::array::c_style | py::array::forcecast> v,
                                      std::optional<py::array_t<float, py::array::c_style | py::array::forcecast>> rec) {
            if (k.ndim() != 3 || v.ndim() != 3 || k.shape(0) != v.shape(0) || k.shape(1) != v.shape(1) || k.shape(2) != v.shape(2))
                throw py::value_error("k and v must both have shape (n_layer, n_past, kv_dim)");
            if (rec && rec->ndim() != 1) throw py::value_error("recurrent must be one-dimensional");
            auto s = std::make_shared<KVSnapshot>();
            s->n_layer = k.shape(0);
            s->n_past = k.shape(1);
            s->kv_dim = k.shape(2);
            s->k.assign(k.data(), k.data() + k.size());
            s->v.assign(v.data(), v.data() + v.size());
            if (rec) s->recurrent.assign(rec->data(), rec->data() + rec->size());
            return s;
        }, py::arg("k"), py::arg("v"), py::arg("recurrent") = py::none(),
           "A snapshot from arrays (a prefix-cache file); restore() checks it fits the model.");

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

    // Constraints on what generate() may produce (constraint.h).
    py::class_<TokenConstraint, std::shared_ptr<TokenConstraint>>(m, "TokenConstraint");

    // Exactly one of these token sequences.
    py::class_<ChoiceTrie, TokenConstraint, std::shared_ptr<ChoiceTrie>>(m, "Choices")
        .def(py::init([](const std::vector<std::vector<int32_t>>& choices, int64_t n_vocab) {
                 try {
                     return std::make_shared<ChoiceTrie>(choices, n_vocab);
                 } catch (const std::invalid_argument& e) {
                     throw py::value_error(e.what());
                 }
             }),
             py::arg("choices"), py::arg("n_vocab"))
        .def_property_readonly("n_nodes", &ChoiceTrie::n_nodes)
        .def_property_readonly("longest", &ChoiceTrie::longest, "tokens of the longest choice");

    // The bytes every token decodes to (b"" for a token never chosen): once per vocabulary.
    py::class_<TokenBytes, std::shared_ptr<TokenBytes>>(m, "TokenBytes")
        .def(py::init([](const std::vector<py::bytes>& pieces) {
                 std::vector<std::string> v;
                 v.reserve(pieces.size());
                 for (const py::bytes& b : pieces) v.emplace_back(b);
                 return std::make_shared<TokenBytes>(v);
             }),
             py::arg("pieces"))
        .def("__len__", &TokenBytes::size)
        .def_property_readonly("single_byte_tokens", &TokenBytes::single_byte_tokens);

    // An answer that parses as JSON and validates against a schema compiled by engine/constraints.py:
    // nodes (kind, a, b, children, literals, required), node 0 the root (json_schema.h).
    using NodeTuple = std::tuple<int32_t, int64_t, int64_t, std::vector<int32_t>, std::vector<py::bytes>, std::vector<bool>>;
    py::class_<JsonSchemaConstraint, TokenConstraint, std::shared_ptr<JsonSchemaConstraint>>(m, "JsonSchema")
        .def(py::init([](const std::vector<NodeTuple>& nodes, std::shared_ptr<const TokenBytes> vocab,
                         const std::vector<int32_t>& fallback) {
                 std::vector<SchemaNode> v(nodes.size());
                 for (size_t i = 0; i < nodes.size(); ++i) {
                     const auto& [kind, a, b, children, literals, required] = nodes[i];
                     v[i].kind = kind;
                     v[i].a = a;
                     v[i].b = b;
                     v[i].children = children;
                     for (const py::bytes& l : literals) v[i].literals.emplace_back(l);
                     v[i].required.assign(required.begin(), required.end());
                 }
                 return std::make_shared<JsonSchemaConstraint>(v, std::move(vocab), fallback);
             }),
             py::arg("nodes"), py::arg("vocab"), py::arg("fallback") = std::vector<int32_t>{})
        .def_property_readonly("fallback_tokens", &JsonSchemaConstraint::fallback_tokens)
        .def_property_readonly("min_tokens", &JsonSchemaConstraint::min_answer_bytes,
                               "the fewest tokens that always suffice for an answer (bytes of the shortest one)")
        .def_property_readonly("min_completion", &JsonSchemaConstraint::min_completion_bytes)
        .def_property_readonly("utf8_strings", &JsonSchemaConstraint::utf8_strings)
        .def_property_readonly("complete", &JsonSchemaConstraint::complete)
        .def_property_readonly("accepting", &JsonSchemaConstraint::accepting)
        .def_property_readonly("stats", [](const JsonSchemaConstraint& c) {
            const JsonSchemaConstraint::Stats s = c.stats();
            py::dict d;
            d["chosen"] = s.chosen;
            d["examined"] = s.examined;
            d["fallbacks"] = s.fallbacks;
            return d;
        }, "of the last request: tokens chosen, candidates examined, single-byte fallbacks")
        .def_property_readonly_static("top_k", [](py::object) { return JsonSchemaConstraint::kTopK; })
        .def("start", &JsonSchemaConstraint::start, py::arg("max_tokens") = 0)
        .def("allows", &JsonSchemaConstraint::allows, py::arg("token"))
        .def("choose", [](const JsonSchemaConstraint& c, py::array_t<float, py::array::c_style | py::array::forcecast> logits,
                          const std::vector<int32_t>& stop_ids) {
            if (logits.ndim() != 1) throw py::value_error("logits must be 1-D");
            return c.choose(logits.data(), logits.shape(0), stop_ids);
        }, py::arg("logits"), py::arg("stop_ids"), "the token generate() would choose after these logits")
        .def("advance", [](JsonSchemaConstraint& c, int32_t token) {
            try {
                c.advance(token);
            } catch (const std::logic_error& e) {
                throw py::value_error(e.what());
            }
        }, py::arg("token"));

    py::class_<Decoder>(m, "Decoder")
        .def(py::init([](std::shared_ptr<GGUFFile> f, int threads, int64_t n_ctx, int64_t n_batch, const std::string& kv_type,
                         bool mtp) {
                 if (threads < 1 || threads > 256) throw py::value_error("threads must be in 1..256");
                 if (n_ctx < 0) throw py::value_error("n_ctx must be >= 0 (0 = default)");
                 if (n_batch < 1 || n_batch > 4096) throw py::value_error("n_batch must be in 1..4096");
                 const evk::DType kt = kv_type_named(kv_type);
                 py::gil_scoped_release nogil;
                 return std::make_unique<Decoder>(std::move(f), threads, n_ctx, n_batch, kt, mtp);  // invalid_argument: ValueError
             }),
             py::arg("file"), py::arg("threads") = 1, py::arg("n_ctx") = 0, py::arg("n_batch") = kDefaultBatch, py::arg("kv_type") = "f32",
             py::arg("mtp") = false,
             "mtp: load the file's multi-token-prediction block where it has one (has_mtp), run it beside the decoder "
             "and let generate() draft from it.")
        .def_property_readonly("has_mtp", &Decoder::has_mtp, "A multi-token-prediction block is loaded (mtp=True and the file has one).")
        .def("draft_mtp", [](Decoder& mdl, int32_t token, int64_t k) {
            if (k < 1 || k > 64) throw py::value_error("k must be in 1..64");
            const int64_t V = mdl.config().n_vocab;
            std::vector<int32_t> drafts(static_cast<size_t>(k));
            py::array_t<float> logits(std::vector<py::ssize_t>{k, V});
            int64_t n = 0;
            {
                py::gil_scoped_release nogil;
                n = mdl.draft_nextn(token, k, {}, drafts.data(), logits.mutable_data());
            }
            drafts.resize(static_cast<size_t>(n));
            return py::make_tuple(drafts, logits[py::slice(0, n, 1)]);
        }, py::arg("token"), py::arg("k"),
           "Drafts from the multi-token-prediction block: `token` at position n_past with the decoder's hidden state of "
           "the position before, then k - 1 more, greedy (fewer at the context's end). Returns (drafts, their logits "
           "(len(drafts), n_vocab)); the sequence state is left as it was.")
        .def_property_readonly("kv_type", [](const Decoder& mdl) {
            std::string n = evk::type_traits(mdl.kv_type())->name;
            for (char& ch : n) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
            return n;
        }, "How the KV cache stores keys and values: 'f32', 'f16' or 'q8_0'.")
        .def_property_readonly("kv_bytes_per_token", &Decoder::kv_bytes_per_token,
                               "Bytes the KV cache takes per position (keys and values of every layer with a cache).")
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
        .def_property_readonly("state_shape", [](const Decoder& mdl) {
            // What restore() accepts (a prefix-cache file is checked against it before it is read).
            int64_t kv_layers = 0, kv_dim = 0, recurrent = 0;
            for (const LayerShape& sh : mdl.layer_shapes()) {
                kv_layers += sh.kv_dim != 0;
                kv_dim = sh.kv_dim ? sh.kv_dim : kv_dim;
                recurrent += sh.recurrent;
            }
            py::dict d;
            d["n_layer"] = kv_layers; d["kv_dim"] = kv_dim; d["n_ctx"] = mdl.n_ctx(); d["recurrent"] = recurrent;
            return d;
        }, "The sequence state restore() accepts: layers with a KV cache (n_layer) and their width (kv_dim), the "
           "context (n_ctx), the floats of recurrent state (recurrent).")
        .def_property_readonly("n_past", &Decoder::n_past)
        .def_property_readonly("pass_ms", [](const Decoder& mdl) {
            const PassCosts& c = mdl.pass_costs();
            return std::vector<double>(c.ms.begin() + 1, c.ms.end());
        }, "Speculation's running mean time (ms) of a decode-phase pass of 1, 2, ... kMaxPassRows rows as "
           "generate() measured them (0: not measured yet); they size the verification passes.")
        .def_property_readonly("threads", &Decoder::threads)
        .def("variants", &Decoder::variants, "Which kernel variant serves each operator.")
        .def("reset", &Decoder::reset)
        .def("forward", [](Decoder& mdl, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids,
                           bool all_logits, py::object features, py::object slots, bool decode_phase) {
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
            PromptInput in = p.input();
            in.decode_phase = decode_phase;
            {
                py::gil_scoped_release nogil;
                mdl.prefill(in, dst, all_logits);
            }
            return out;
        }, py::arg("ids"), py::arg("all_logits") = false, py::arg("features") = py::none(), py::arg("slots") = py::none(),
           py::arg("decode_phase") = false,
           "Appends tokens to the sequence (the rows at `slots` take the rows of `features`, shape (len(slots), "
           "n_embd): an image); returns the last position's logits, or every position's. decode_phase: the "
           "decode kernels run every row (as a verification pass does), whatever the number of tokens.")
        .def("generate", [](Decoder& mdl, py::object prompt, int64_t max_new, std::vector<int32_t> stop_ids, double max_ms,
                            std::shared_ptr<TokenConstraint> constraint, std::optional<std::vector<int32_t>> lookup) {
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
                mdl.generate(p.input(), max_new, stop_ids, max_ms > 0 ? std::max(max_ms - start_ms, 1e-6) : 0.0, r,
                             constraint.get(), lookup ? &*lookup : nullptr);
                r.prefill_ms += start_ms;
            }
            py::dict d;
            d["tokens"] = r.tokens;
            d["stop_reason"] = r.stop_reason;
            d["prefill_ms"] = r.prefill_ms;
            d["decode_ms"] = r.decode_ms;
            d["n_prompt"] = r.n_prompt;
            d["spec_passes"] = r.spec_passes;
            d["spec_drafted"] = r.spec_drafted;
            d["spec_accepted"] = r.spec_accepted;
            return d;
        }, py::arg("prompt"), py::arg("max_new_tokens"), py::arg("stop_ids"), py::arg("max_ms") = 0.0,
           py::arg("constraint") = nullptr, py::arg("lookup") = py::none(),
           "Greedy decoding after prefilling prompt: a Prompt (restored prefix or empty sequence first, image "
           "features at their slots) or token ids (appended to the sequence as it stands). The stop token is not "
           "returned; prefill_ms includes restoring the prefix. With a `constraint` (Choices: the answer is one of "
           "them; JsonSchema: the answer is JSON valid against it), stop_reason 'complete' where nothing may follow. "
           "lookup (speculation, token ids of earlier answers, -1 between two): drafts from it are verified in "
           "decode-phase passes; the tokens are plain greedy's (spec_passes, spec_drafted, spec_accepted count it).")
        .def("cancel", [](Decoder& mdl, bool on) { mdl.cancel(on); }, py::arg("on") = true,
             py::call_guard<py::gil_scoped_release>(),
             "From any thread: generate() stops before its next token with stop_reason 'cancelled' "
             "(sticky until cancel(False)).")
        .def("progress", [](const Decoder& mdl) {
            std::vector<int32_t> t;
            {
                py::gil_scoped_release nogil;  // the lock may wait for generate() starting or ending
                mdl.progress(t);
            }
            return t;
        }, "From any thread while generate() runs: the tokens generated so far (empty between calls).")
        .def("snapshot", [](const Decoder& mdl) { return std::make_shared<KVSnapshot>(mdl.snapshot()); })
        .def("restore", [](Decoder& mdl, const KVSnapshot& s) { mdl.restore(s); });

    py::class_<VisionModel>(m, "VisionModel")
        .def(py::init([](std::shared_ptr<GGUFFile> f, int threads, bool int8) {
                 if (threads < 1 || threads > 256) throw py::value_error("threads must be in 1..256");
                 py::gil_scoped_release nogil;
                 return std::make_unique<VisionModel>(std::move(f), threads, int8);
             }),
             py::arg("file"), py::arg("threads") = 1, py::arg("int8") = false,
             "int8: allow int8 products for the tower's matrices (vision_int8), where the operator table has an int8 rule.")
        .def_property_readonly("config", [](const VisionModel& mdl) {
            const VisionConfig& c = mdl.config();
            py::dict d;
            d["projector"] = c.projector; d["image_size"] = c.image_size; d["patch_size"] = c.patch_size;
            d["n_embd"] = c.n_embd; d["n_ff"] = c.n_ff; d["n_layer"] = c.n_layer; d["n_head"] = c.n_head;
            d["proj_dim"] = c.proj_dim; d["scale_factor"] = c.scale_factor; d["eps"] = c.eps;
            d["tokens_per_tile"] = c.n_out(); d["ffn_swapped"] = mdl.ffn_swapped(); d["int8"] = c.int8;
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
        }, py::arg("pixels"), "Image-token embeddings for every tile, in order: (n_tiles * tokens_per_tile, proj_dim).")
        .def("encode_slice", [](VisionModel& mdl, py::array_t<float, py::array::c_style | py::array::forcecast> pixels) {
            const VisionConfig& c = mdl.config();
            const int64_t P = c.patch_size;
            if (pixels.ndim() != 3 || pixels.shape(0) != 3 || pixels.shape(1) % P != 0 || pixels.shape(2) % P != 0)
                throw py::value_error("pixels must have shape (3, H, W), H and W multiples of " + std::to_string(P));
            const int64_t gh = pixels.shape(1) / P, gw = pixels.shape(2) / P;
            py::array_t<float> out({mdl.tokens(gh, gw), c.proj_dim});
            float* dst = out.mutable_data();
            const float* src = pixels.data();
            {
                py::gil_scoped_release nogil;
                mdl.encode_grid(src, gh, gw, dst);
            }
            return out;
        }, py::arg("pixels"), "Image-token embeddings of one slice at its own size (MiniCPM-V): (tokens, proj_dim).");
}
