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

// Runs f(r0, r1) over [0, n) in ranges of `per` rows, as one parallel region. The element-wise
// work (bias adds, residuals, layernorm, GELU, copies) is independent per element, so the result
// does not depend on how the rows are split or which thread runs them.
template <class F> void for_rows(ThreadPool& pool, int64_t n, int64_t per, F&& f) {
    per = std::max<int64_t>(1, per);
    auto body = [&](int64_t chunk, int) { f(chunk * per, std::min(n, (chunk + 1) * per)); };
    pool.run((n + per - 1) / per, body);
}

// Rows per chunk for rows of `width` floats: about 16K floats (64 KiB) a chunk, enough chunks
// (64 for 1024 tokens of 768) that a descheduled thread's share is picked up by another.
int64_t rows_per_chunk(int64_t width) { return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(width, 1)); }

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
        release_unused_rows(f, w);
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
    alloc(vt_, d * np);
}

// Bidirectional multi-head attention as matrix products, one head at a time and queries in blocks
// of kQueryBlock: S = Q_h K_h^T with the prefill GEMM (keys as the weight rows), a scaled softmax
// over each row of S, then O_h = S V_h with V^T (vt_, every head's rows contiguous, made by
// encode() in the pass that adds the Q, K, V biases) as the weight rows.
// One query at a time this was ~12% of the FMA peak and 60% of a layer's time.
void ClipVisionModel::attention(int64_t n) {
    const evk::OpTable& op = compute_.ops();
    const int64_t d = cfg_.n_embd, hd = d / cfg_.n_head;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    for (int64_t h = 0; h < cfg_.n_head; ++h) {
        Weight keys = make_weight(evk::DType::F32, &k_[h * hd], n, hd);
        keys.row_bytes = static_cast<size_t>(d) * sizeof(float);  // rows of one head inside k_
        const Weight values_t = make_weight(evk::DType::F32, &vt_[h * hd * n], hd, n);
        for (int64_t q0 = 0; q0 < n; q0 += kQueryBlock) {
            const int64_t qn = std::min(kQueryBlock, n - q0);
            compute_.matmul(keys, &q_[q0 * d + h * hd], d, qn, s_.data(), n, evk::kPrefill);
            auto softmax = [&](int64_t row, int) { op.softmax(&s_[row * n], n, scale); };
            compute_.pool().run(qn, softmax);
            compute_.matmul(values_t, s_.data(), n, qn, &att_[q0 * d + h * hd], d, evk::kPrefill);
        }
    }
}

// Every element-wise step runs over the thread pool in ranges of tokens, fused per token where
// one step feeds the next: the bias of a product, the residual add and the next layernorm in one
// pass; the up projection's bias and GELU in one; the Q, K, V biases and V's transpose in one.
// Each element sees the same operations in the same order as one step at a time on one thread
// would apply them, so the output is the same for any thread count.
void ClipVisionModel::encode(const float* pixels, float* out) {
    const evk::OpTable& op = compute_.ops();
    ThreadPool& pool = compute_.pool();
    const int64_t S = cfg_.image_size, P = cfg_.patch_size, side = cfg_.side(), n = cfg_.n_patches();
    const int64_t d = cfg_.n_embd, ff = cfg_.n_ff, pp = 3 * P * P, s = cfg_.scale_factor, grid = side / s;
    const int64_t per_d = rows_per_chunk(d);

    // Patch embedding is a stride-P convolution: gather each patch as a row in (c, y, x) order,
    // the order of the conv kernel's flattened [c_in][kh][kw], then one matrix product.
    for_rows(pool, n, rows_per_chunk(pp), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t py = t / side, px = t % side;
            float* row = &patches_[t * pp];
            for (int64_t c = 0; c < 3; ++c)
                for (int64_t y = 0; y < P; ++y)
                    std::memcpy(row + (c * P + y) * P, pixels + (c * S + py * P + y) * S + px * P,
                                static_cast<size_t>(P) * sizeof(float));
        }
    });
    compute_.matmul(patch_w_, patches_.data(), n, x_.data(), evk::kPrefill);

    // The layernorm of x that follows a residual, into h; the post LN after the last layer goes
    // straight to the token's place in the pixel shuffle instead. Idefics3's shuffle: output token
    // (I, J) on the side/s grid holds, for a, b in [0, s), patch (I*s + a, J*s + b) at feature
    // offset (a*s + b) * d.
    struct Norm {
        const std::vector<float>*w, *b;
        bool shuffle;
    };
    auto norm = [&](const Norm& nm, int64_t t) {
        float* dst = &h_[t * d];
        if (nm.shuffle) {
            const int64_t py = t / side, px = t % side, I = py / s, a = py % s, J = px / s, b = px % s;
            dst = &shuffled_[((I * grid + J) * s * s + a * s + b) * d];
        }
        op.layernorm(&x_[t * d], nm.w->data(), nm.b->data(), dst, d, cfg_.eps);
    };
    const Norm post{&post_w_, &post_b_, true};
    auto ln1 = [&](size_t l) { return l < layers_.size() ? Norm{&layers_[l].ln1_w, &layers_[l].ln1_b, false} : post; };
    // x += h + bias, token by token (the bias added to h first, as to a biased product's output),
    // then the next layernorm of x.
    auto residual = [&](const std::vector<float>& bias, const Norm& next) {
        for_rows(pool, n, per_d, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
                op.add(&h_[t * d], bias.data(), d);
                op.add(&x_[t * d], &h_[t * d], d);
                norm(next, t);
            }
        });
    };

    // x = patches W + bias, + the position embedding; then the first layernorm.
    const Norm first = ln1(0);
    for_rows(pool, n, per_d, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            op.add(&x_[t * d], patch_b_.data(), d);
            op.add(&x_[t * d], &pos_embd_[t * d], d);
            norm(first, t);
        }
    });

    for (size_t l = 0; l < layers_.size(); ++l) {
        const Layer& L = layers_[l];
        const Compute::MatmulJob qkv[3] = {{&L.wq, q_.data(), d}, {&L.wk, k_.data(), d}, {&L.wv, v_.data(), d}};
        compute_.matmul_batch(qkv, 3, h_.data(), d, n, evk::kPrefill);
        // The biases, and V^T: vt_[c * n + t] = v[t][c] (c = h * hd + j: each head's rows are
        // contiguous). 16 tokens a chunk, so a chunk writes whole 64-byte runs of vt_'s rows.
        for_rows(pool, n, 16, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
                op.add(&q_[t * d], L.bq.data(), d);
                op.add(&k_[t * d], L.bk.data(), d);
                op.add(&v_[t * d], L.bv.data(), d);
            }
            for (int64_t c = 0; c < d; ++c)
                for (int64_t t = t0; t < t1; ++t) vt_[c * n + t] = v_[t * d + c];
        });
        attention(n);
        compute_.matmul(L.wo, att_.data(), n, h_.data(), evk::kPrefill);
        residual(L.bo, Norm{&L.ln2_w, &L.ln2_b, false});

        compute_.matmul(L.w_up, h_.data(), n, ff_.data(), evk::kPrefill);
        for_rows(pool, n, rows_per_chunk(ff), [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) op.add(&ff_[t * ff], L.b_up.data(), ff);
            op.gelu_tanh(&ff_[t0 * ff], (t1 - t0) * ff);
        });
        compute_.matmul(L.w_down, ff_.data(), n, h_.data(), evk::kPrefill);
        residual(L.b_down, ln1(l + 1));
    }
    compute_.matmul(proj_w_, shuffled_.data(), grid * grid, out, evk::kPrefill);
}

std::string ClipVisionModel::variants() const {
    const Weight& w = layers_.empty() ? proj_w_ : layers_[0].wq;
    return std::string("layers (") + evk::type_traits(w.type)->name + "): prefill=" + w.prefill.name + "; patch (" +
           evk::type_traits(patch_w_.type)->name + "): " + patch_w_.prefill.name + "; softmax=" +
           compute_.ops().softmax_variant + "; gelu_tanh=" + compute_.ops().gelu_tanh_variant + "; layernorm=" +
           compute_.ops().layernorm_variant + "; add=" + compute_.ops().add_variant;
}

}  // namespace evn
