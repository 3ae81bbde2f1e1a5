#include "clip_vision.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace evn {

namespace {

constexpr WeightUse kPrefill = WeightUse::kPrefillOnly;

// Bounds far above any real vision tower (SigLIP at 512 px: 1024 patches, 3072-wide MLP) that
// keep a crafted config from asking for gigabytes of activations.
constexpr int64_t kMaxPatches = 1 << 16;
constexpr int64_t kMaxActivation = int64_t{1} << 27;  // floats in one activation buffer (512 MiB)

void require_elements(const GGUFFile& f, const std::string& name, int64_t n) {
    const TensorInfo* t = f.find_tensor(name);
    if (!t) f.fail("tensor '" + name + "'", "missing");
    if (t->nelements() != n) {
        std::string shape;
        for (int d = 0; d < t->n_dims; ++d) shape += (d ? ", " : "") + std::to_string(t->ne[d]);
        f.fail("tensor '" + name + "'", "shape [" + shape + "] holds " + std::to_string(t->nelements()) +
                                            " elements, the config needs " + std::to_string(n));
    }
}

ClipVisionConfig read_config(const GGUFFile& f) {
    ClipVisionConfig c;
    const std::string arch = f.get_string("general.architecture");
    if (arch != "clip") f.fail("general.architecture", "'" + arch + "' is not an mmproj (clip) file");
    c.projector = f.get_string("clip.projector_type");
    if (c.projector != "idefics3")
        f.fail("clip.projector_type", "'" + c.projector + "' is not supported (idefics3 is)");
    if (const GValue* v = f.find("clip.has_vision_encoder"))
        if (v->type != GType::BOOL || v->u == 0) f.fail("clip.has_vision_encoder", "the file has no vision encoder");
    auto pos_int = [&](const std::string& key, uint64_t limit) {
        const uint64_t v = f.get_uint(key);
        if (v == 0 || v > limit) f.fail(key, "value " + std::to_string(v) + " is out of range");
        return static_cast<int64_t>(v);
    };
    c.image_size = pos_int("clip.vision.image_size", 8192);
    c.patch_size = pos_int("clip.vision.patch_size", 1024);
    c.n_embd = pos_int("clip.vision.embedding_length", 1 << 16);
    c.n_ff = pos_int("clip.vision.feed_forward_length", 1 << 18);
    c.n_layer = pos_int("clip.vision.block_count", 1024);
    c.n_head = pos_int("clip.vision.attention.head_count", 1024);
    c.proj_dim = pos_int("clip.vision.projection_dim", 1 << 16);
    c.scale_factor = pos_int("clip.vision.projector.scale_factor", 64);
    c.eps = static_cast<float>(f.get_float("clip.vision.attention.layer_norm_epsilon", 1e-6));
    if (c.image_size % c.patch_size != 0) f.fail("clip.vision.patch_size", "does not divide the image size");
    if (c.side() % c.scale_factor != 0) f.fail("clip.vision.projector.scale_factor", "does not divide the patch grid");
    if (c.n_embd % c.n_head != 0) f.fail("clip.vision.attention.head_count", "does not divide the embedding length");
    if (!(c.eps > 0.f)) f.fail("clip.vision.attention.layer_norm_epsilon", "must be > 0");
    // Nothing may be allocated from these numbers until the file is known to back them: the
    // compute scratch (sized from the width, the feed-forward size, the patch and the shuffled
    // width) is allocated right after this returns, before any weight is loaded. Each of those
    // numbers is a dimension of a tensor that must be in the file, so here each such tensor must
    // exist with the element count the config implies (load_weight checks the exact shape later).
    const int64_t d = c.n_embd, s2 = c.scale_factor * c.scale_factor;
    require_elements(f, "v.patch_embd.weight", 3 * c.patch_size * c.patch_size * d);
    require_elements(f, "v.position_embd.weight", c.n_patches() * d);
    require_elements(f, "mm.model.fc.weight", d * s2 * c.proj_dim);
    require_elements(f, "v.blk.0.ffn_up.weight", d * c.n_ff);  // either way round (see ffn_swapped_)
    require_elements(f, "v.blk.0.ffn_down.weight", d * c.n_ff);
    // Activations are n_patches rows of the widest of these: bounded, whatever the file holds.
    const int64_t widest = std::max({d, c.n_ff, 3 * c.patch_size * c.patch_size});
    if (c.n_patches() > kMaxPatches || c.n_patches() * widest > kMaxActivation)
        f.fail("clip.vision.image_size", std::to_string(c.n_patches()) + " patches of up to " + std::to_string(widest) +
                                             " floats exceed the engine's activation bound");
    return c;
}

bool has_shape(const TensorInfo* t, int64_t ne0, int64_t ne1) { return t && t->ne[0] == ne0 && t->ne[1] == ne1; }

}  // namespace

ClipVisionModel::ClipVisionModel(std::shared_ptr<const GGUFFile> file, int n_threads)
    : file_(std::move(file)), cfg_(read_config(*file_)),
      compute_(n_threads, std::max({cfg_.n_embd, cfg_.n_ff, 3 * cfg_.patch_size * cfg_.patch_size,
                                    cfg_.n_embd * cfg_.scale_factor * cfg_.scale_factor})) {
    const GGUFFile& f = *file_;
    const int64_t d = cfg_.n_embd, ff = cfg_.n_ff, np = cfg_.n_patches(), pp = 3 * cfg_.patch_size * cfg_.patch_size;
    // Every product of the tower is prefill (many patches): its weights have no decode kernel, so
    // the prefill GEMM reads its own packed layout where it has one, and the file's rows of such a
    // weight are released as soon as it is packed (as the text model does for its packed decode
    // weights), so the rows and the copies never all sit in memory at once.
    auto release = [&](Weight w) {
        if (w.rows_unused()) f.release(w.data, static_cast<size_t>(w.rows) * w.row_bytes);
        return w;
    };
    patch_w_ = release(load_weight(f, "v.patch_embd.weight", pp, d, kPrefill, &arena_));
    patch_b_ = load_vector(f, "v.patch_embd.bias", d);
    pos_embd_ = load_vector(f, "v.position_embd.weight", np * d);
    post_w_ = load_vector(f, "v.post_ln.weight", d);
    post_b_ = load_vector(f, "v.post_ln.bias", d);
    proj_w_ = release(load_weight(f, "mm.model.fc.weight", d * cfg_.scale_factor * cfg_.scale_factor, cfg_.proj_dim, kPrefill, &arena_));

    // Some published mmproj files name fc1 ffn_down and fc2 ffn_up. The shapes tell which is
    // which: the up projection maps width -> ff (ne0 = width, ne1 = ff).
    if (d != ff) {
        const TensorInfo* up = f.find_tensor("v.blk.0.ffn_up.weight");
        const TensorInfo* down = f.find_tensor("v.blk.0.ffn_down.weight");
        ffn_swapped_ = has_shape(up, ff, d) && has_shape(down, d, ff);
    }
    const std::string up_name = ffn_swapped_ ? "ffn_down" : "ffn_up";
    const std::string down_name = ffn_swapped_ ? "ffn_up" : "ffn_down";
    layers_.resize(static_cast<size_t>(cfg_.n_layer));
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
        const std::string p = "v.blk." + std::to_string(l) + ".";
        Layer& L = layers_[static_cast<size_t>(l)];
        L.ln1_w = load_vector(f, p + "ln1.weight", d);
        L.ln1_b = load_vector(f, p + "ln1.bias", d);
        L.ln2_w = load_vector(f, p + "ln2.weight", d);
        L.ln2_b = load_vector(f, p + "ln2.bias", d);
        L.wq = release(load_weight(f, p + "attn_q.weight", d, d, kPrefill, &arena_));
        L.wk = release(load_weight(f, p + "attn_k.weight", d, d, kPrefill, &arena_));
        L.wv = release(load_weight(f, p + "attn_v.weight", d, d, kPrefill, &arena_));
        L.wo = release(load_weight(f, p + "attn_out.weight", d, d, kPrefill, &arena_));
        L.bq = load_vector(f, p + "attn_q.bias", d);
        L.bk = load_vector(f, p + "attn_k.bias", d);
        L.bv = load_vector(f, p + "attn_v.bias", d);
        L.bo = load_vector(f, p + "attn_out.bias", d);
        L.w_up = release(load_weight(f, p + up_name + ".weight", d, ff, kPrefill, &arena_));
        L.b_up = load_vector(f, p + up_name + ".bias", ff);
        L.w_down = release(load_weight(f, p + down_name + ".weight", ff, d, kPrefill, &arena_));
        L.b_down = load_vector(f, p + down_name + ".bias", d);
    }
    auto alloc = [](std::vector<float>& v, int64_t n) { v.assign(static_cast<size_t>(n), 0.f); };
    alloc(patches_, np * pp);
    alloc(x_, np * d);
    alloc(h_, np * d);
    alloc(q_, np * d);
    alloc(k_, np * d);
    alloc(v_, np * d);
    alloc(att_, np * d);
    alloc(ff_, np * ff);
    alloc(shuffled_, np * d);
    alloc(s_, std::min(kQueryBlock, np) * np);
    alloc(vt_, np * (d / cfg_.n_head));
}

void ClipVisionModel::linear(const Weight& w, const std::vector<float>& bias, const float* x, int64_t n, float* y) {
    compute_.matmul(w, x, n, y, evk::kPrefill);
    if (!bias.empty())
        for (int64_t t = 0; t < n; ++t) compute_.ops().add(y + t * w.rows, bias.data(), w.rows);
}

// Bidirectional multi-head attention as matrix products, one head at a time and queries in blocks
// of kQueryBlock: S = Q_h K_h^T with the prefill GEMM (keys as the weight rows), a scaled softmax
// over each row of S, then O_h = S V_h (V_h transposed once per head so its rows are contiguous).
// One query at a time this was ~12% of the FMA peak and 60% of a layer's time.
void ClipVisionModel::attention(int64_t n) {
    const evk::OpTable& op = compute_.ops();
    const int64_t d = cfg_.n_embd, hd = d / cfg_.n_head;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    for (int64_t h = 0; h < cfg_.n_head; ++h) {
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < hd; ++j) vt_[j * n + i] = v_[i * d + h * hd + j];
        Weight keys = make_weight(evk::DType::F32, &k_[h * hd], n, hd);
        keys.row_bytes = static_cast<size_t>(d) * sizeof(float);  // rows of one head inside k_
        const Weight values_t = make_weight(evk::DType::F32, vt_.data(), hd, n);
        for (int64_t q0 = 0; q0 < n; q0 += kQueryBlock) {
            const int64_t qn = std::min(kQueryBlock, n - q0);
            compute_.matmul(keys, &q_[q0 * d + h * hd], d, qn, s_.data(), n, evk::kPrefill);
            auto softmax = [&](int64_t row, int) { op.softmax(&s_[row * n], n, scale); };
            compute_.pool().run(qn, softmax);
            compute_.matmul(values_t, s_.data(), n, qn, &att_[q0 * d + h * hd], d, evk::kPrefill);
        }
    }
}

void ClipVisionModel::encode(const float* pixels, float* out) {
    const evk::OpTable& op = compute_.ops();
    const int64_t S = cfg_.image_size, P = cfg_.patch_size, side = cfg_.side(), n = cfg_.n_patches();
    const int64_t d = cfg_.n_embd, ff = cfg_.n_ff, pp = 3 * P * P;

    // Patch embedding is a stride-P convolution: gather each patch as a row in (c, y, x) order,
    // the order of the conv kernel's flattened [c_in][kh][kw], then one matrix product.
    for (int64_t py = 0; py < side; ++py)
        for (int64_t px = 0; px < side; ++px) {
            float* row = &patches_[(py * side + px) * pp];
            for (int64_t c = 0; c < 3; ++c)
                for (int64_t y = 0; y < P; ++y)
                    std::memcpy(row + (c * P + y) * P, pixels + (c * S + py * P + y) * S + px * P,
                                static_cast<size_t>(P) * sizeof(float));
        }
    linear(patch_w_, patch_b_, patches_.data(), n, x_.data());
    op.add(x_.data(), pos_embd_.data(), n * d);

    for (const Layer& L : layers_) {
        for (int64_t t = 0; t < n; ++t) op.layernorm(&x_[t * d], L.ln1_w.data(), L.ln1_b.data(), &h_[t * d], d, cfg_.eps);
        linear(L.wq, L.bq, h_.data(), n, q_.data());
        linear(L.wk, L.bk, h_.data(), n, k_.data());
        linear(L.wv, L.bv, h_.data(), n, v_.data());
        attention(n);
        linear(L.wo, L.bo, att_.data(), n, h_.data());
        op.add(x_.data(), h_.data(), n * d);
        for (int64_t t = 0; t < n; ++t) op.layernorm(&x_[t * d], L.ln2_w.data(), L.ln2_b.data(), &h_[t * d], d, cfg_.eps);
        linear(L.w_up, L.b_up, h_.data(), n, ff_.data());
        op.gelu_tanh(ff_.data(), n * ff);
        linear(L.w_down, L.b_down, ff_.data(), n, h_.data());
        op.add(x_.data(), h_.data(), n * d);
    }
    for (int64_t t = 0; t < n; ++t) op.layernorm(&x_[t * d], post_w_.data(), post_b_.data(), &h_[t * d], d, cfg_.eps);

    // Pixel shuffle as Idefics3 does it: output token (I, J) on the side/s grid holds, for
    // a, b in [0, s), patch (I*s + a, J*s + b) at feature offset (a*s + b) * d.
    const int64_t s = cfg_.scale_factor, grid = side / s;
    for (int64_t I = 0; I < grid; ++I)
        for (int64_t J = 0; J < grid; ++J)
            for (int64_t a = 0; a < s; ++a)
                for (int64_t b = 0; b < s; ++b)
                    std::memcpy(&shuffled_[((I * grid + J) * s * s + a * s + b) * d], &h_[((I * s + a) * side + J * s + b) * d],
                                static_cast<size_t>(d) * sizeof(float));
    compute_.matmul(proj_w_, shuffled_.data(), grid * grid, out, evk::kPrefill);
}

std::string ClipVisionModel::variants() const {
    const Weight& w = layers_.empty() ? proj_w_ : layers_[0].wq;
    return std::string("layers (") + evk::type_traits(w.type)->name + "): prefill=" + w.prefill.name + "; patch (" +
           evk::type_traits(patch_w_.type)->name + "): " + patch_w_.prefill.name + "; softmax=" +
           compute_.ops().softmax_variant + "; gelu_tanh=" + compute_.ops().gelu_tanh_variant;
}

}  // namespace evn
