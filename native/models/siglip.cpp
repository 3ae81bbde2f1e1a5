#include "siglip.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace evn {

namespace {

// Bounds far above any real vision tower (SigLIP at 512 px: 1024 patches, 3072-wide MLP) that
// keep a crafted config from asking for gigabytes of activations.
constexpr int64_t kMaxPatches = 1 << 16;
constexpr int64_t kMaxActivation = int64_t{1} << 27;  // floats in one activation buffer (512 MiB)

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

SiglipTower::SiglipTower(const VisionConfig& cfg, const GGUFFile& f, PackArena& arena, int64_t pos_rows,
                         int64_t max_tokens)
    : cfg_(cfg), pos_rows_(pos_rows > 0 ? pos_rows : cfg.n_patches()),
      max_tokens_(max_tokens > 0 ? max_tokens : cfg.n_patches()) {
    const int64_t d = cfg_.n_embd, ff = cfg_.n_ff, np = max_tokens_, pp = 3 * cfg_.patch_size * cfg_.patch_size;
    // Nothing may be allocated from the config until the file is known to back it: each number is
    // a dimension of a tensor that must be in the file, so here each such tensor must exist with
    // the element count the config implies (load_weight checks the exact shape later).
    require_elements(f, "v.patch_embd.weight", pp * d);
    if (pos_rows_ > kMaxPatches) f.fail("v.position_embd.weight", std::to_string(pos_rows_) + " rows exceed the engine's bound");
    require_elements(f, "v.position_embd.weight", pos_rows_ * d);
    require_elements(f, "v.blk.0.ffn_up.weight", d * ff);  // either way round (see ffn_swapped_)
    require_elements(f, "v.blk.0.ffn_down.weight", d * ff);
    // Activations are n_patches rows of the widest of these: bounded, whatever the file holds.
    const int64_t widest = std::max({d, ff, pp});
    if (np > kMaxPatches || np * widest > kMaxActivation)
        f.fail("clip.vision.image_size", std::to_string(np) + " patches of up to " + std::to_string(widest) +
                                             " floats exceed the engine's activation bound");

    // Every product of the tower is prefill (many patches): its weights have no decode kernel, so
    // the prefill GEMM reads its own packed layout where it has one, and the file's rows of such a
    // weight are released as soon as it is packed (as the text model does for its packed decode
    // weights), so the rows and the copies never all sit in memory at once.
    auto matrix = [&](const std::string& name, int64_t cols, int64_t rows, WeightUse use) {
        Weight w = load_weight(f, name, cols, rows, use, &arena);
        release_unused_rows(f, w);
        return w;
    };
    // The patch embedding stays on float products with vision_int8: its inputs are the pixels, whose
    // int8 rounding would reach every later layer, for 0.3% of a SigLIP-400M tower's flops.
    patch_w_ = matrix("v.patch_embd.weight", pp, d, WeightUse::kPrefillOnly);
    patch_b_ = load_vector(f, "v.patch_embd.bias", d);
    pos_embd_ = load_vector(f, "v.position_embd.weight", pos_rows_ * d);
    post_w_ = load_vector(f, "v.post_ln.weight", d);
    post_b_ = load_vector(f, "v.post_ln.bias", d);

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
        L.wq = matrix(p + "attn_q.weight", d, d, cfg_.weight_use());
        L.wk = matrix(p + "attn_k.weight", d, d, cfg_.weight_use());
        L.wv = matrix(p + "attn_v.weight", d, d, cfg_.weight_use());
        L.wo = matrix(p + "attn_out.weight", d, d, cfg_.weight_use());
        L.bq = load_vector(f, p + "attn_q.bias", d);
        L.bk = load_vector(f, p + "attn_k.bias", d);
        L.bv = load_vector(f, p + "attn_v.bias", d);
        L.bo = load_vector(f, p + "attn_out.bias", d);
        L.w_up = matrix(p + up_name + ".weight", d, ff, cfg_.weight_use());
        L.b_up = load_vector(f, p + up_name + ".bias", ff);
        L.w_down = matrix(p + down_name + ".weight", ff, d, cfg_.weight_use());
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
    alloc(s_, std::min(kQueryBlock, np) * np);
    alloc(vt_, d * np);
}

// The widest row any of its products reads, the compute scratch's width: O_h = S V_h (V^T the weight)
// has rows of as many floats as tokens, which a kernel that expands each weight row into the scratch
// (NEON's F32 one) must have room for.
int64_t SiglipTower::max_k() const {
    return std::max({cfg_.n_embd, cfg_.n_ff, 3 * cfg_.patch_size * cfg_.patch_size, max_tokens_});
}

// Every element-wise step runs over the thread pool in ranges of tokens, fused per token where
// one step feeds the next: the bias of a product, the residual add and the next layernorm in one
// pass; the up projection's bias and GELU in one; the Q, K, V biases and V's transpose in one.
// Each element sees the same operations in the same order as one step at a time on one thread
// would apply them, so the output is the same for any thread count.
void SiglipTower::encode(Compute& c, const float* pixels, float* out) {
    embed(c, pixels, cfg_.side(), cfg_.side(), nullptr);  // x = patches W + b + pos; h = LN1(x)
    layers(c, 0, cfg_.n_layer, out);
}

void SiglipTower::layers(Compute& c, int64_t l0, int64_t l1, float* out) {
    for (int64_t l = l0; l < l1; ++l) {
        const Layer& L = layers_[static_cast<size_t>(l)];
        self_attention(c, L);                                         // h = Wo · MHA(h)
        residual_norm(c, L.bo, Norm{&L.ln2_w, &L.ln2_b}, h_.data());  // x += h + bo; h = LN2(x)
        mlp(c, L);                                                    // h = W_down · gelu(W_up · h + b_up)
        const bool last = l + 1 == cfg_.n_layer;  // x += h + b_down; then the next LN1, or the post LN
        residual_norm(c, L.b_down, entry_norm(l + 1), last ? out : h_.data());
    }
}

SiglipTower::Norm SiglipTower::entry_norm(int64_t l) const {
    if (l >= cfg_.n_layer) return Norm{&post_w_, &post_b_};
    const Layer& L = layers_[static_cast<size_t>(l)];
    return Norm{&L.ln1_w, &L.ln1_b};
}

void SiglipTower::restart(Compute& c, int64_t n, int64_t l, float* out) {
    if (n < 1 || n > max_tokens_) throw std::invalid_argument("a stream of " + std::to_string(n) + " tokens");
    n_ = n;
    norm_stream(c, l, l >= cfg_.n_layer ? out : h_.data());
}

void SiglipTower::norm_stream(Compute& c, int64_t l, float* dst) {
    const evk::OpTable& op = c.ops();
    const int64_t d = cfg_.n_embd;
    const Norm nm = entry_norm(l);
    for_rows(c.pool(), n_, rows_per_chunk(d), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) op.layernorm(&x_[t * d], nm.w->data(), nm.b->data(), dst + t * d, d, cfg_.eps);
    });
}

// Patch embedding is a stride-P convolution: gather each patch as a row in (c, y, x) order, the
// order of the conv kernel's flattened [c_in][kh][kw], then one matrix product; then the bias and
// the position embedding, and the first layernorm into h.
void SiglipTower::embed(Compute& c, const float* pixels, int64_t gh, int64_t gw, const int32_t* pos_ids) {
    const evk::OpTable& op = c.ops();
    const int64_t P = cfg_.patch_size, W = gw * P, H = gh * P, n = gh * gw;
    const int64_t d = cfg_.n_embd, pp = 3 * P * P;
    if (gh < 1 || gw < 1 || n > max_tokens_)
        throw std::invalid_argument("a " + std::to_string(gh) + "x" + std::to_string(gw) +
                                    " patch grid exceeds the tower's " + std::to_string(max_tokens_) + " patches");
    if (pos_ids)
        for (int64_t t = 0; t < n; ++t)
            if (pos_ids[t] < 0 || pos_ids[t] >= pos_rows_) throw std::invalid_argument("position id out of range");
    n_ = n;
    for_rows(c.pool(), n, rows_per_chunk(pp), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t py = t / gw, px = t % gw;
            float* row = &patches_[t * pp];
            for (int64_t ch = 0; ch < 3; ++ch)
                for (int64_t y = 0; y < P; ++y)
                    std::memcpy(row + (ch * P + y) * P, pixels + (ch * H + py * P + y) * W + px * P,
                                static_cast<size_t>(P) * sizeof(float));
        }
    });
    c.matmul(patch_w_, patches_.data(), n, x_.data(), evk::kPrefill);
    const Norm next = entry_norm(0);
    for_rows(c.pool(), n, rows_per_chunk(d), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t pos = pos_ids ? pos_ids[t] : t;
            op.add(&x_[t * d], patch_b_.data(), d);
            op.add(&x_[t * d], &pos_embd_[pos * d], d);
            op.layernorm(&x_[t * d], next.w->data(), next.b->data(), &h_[t * d], d, cfg_.eps);
        }
    });
}

// h = Wo · MHA(h): Q, K, V of h with their biases, attention per head, the output product (its
// bias comes with the residual).
void SiglipTower::self_attention(Compute& c, const Layer& L) {
    const evk::OpTable& op = c.ops();
    const int64_t n = n_, d = cfg_.n_embd;
    const Compute::MatmulJob qkv[3] = {{&L.wq, q_.data(), d}, {&L.wk, k_.data(), d}, {&L.wv, v_.data(), d}};
    c.matmul_batch(qkv, 3, h_.data(), d, n, evk::kPrefill);
    // The biases, and V^T: vt_[ch * n + t] = v[t][ch] (ch = h * hd + j: each head's rows are
    // contiguous). 16 tokens a chunk, so a chunk writes whole 64-byte runs of vt_'s rows.
    for_rows(c.pool(), n, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            op.add(&q_[t * d], L.bq.data(), d);
            op.add(&k_[t * d], L.bk.data(), d);
            op.add(&v_[t * d], L.bv.data(), d);
        }
        for (int64_t ch = 0; ch < d; ++ch)
            for (int64_t t = t0; t < t1; ++t) vt_[ch * n + t] = v_[t * d + ch];
    });
    attention_heads(c);
    c.matmul(L.wo, att_.data(), n, h_.data(), evk::kPrefill);
}

// Bidirectional multi-head attention as matrix products, one head at a time and queries in blocks
// of kQueryBlock: S = Q_h K_h^T with the prefill GEMM (keys as the weight rows), a scaled softmax
// over each row of S, then O_h = S V_h with V^T (every head's rows contiguous) as the weight rows.
// One query at a time this was ~12% of the FMA peak and 60% of a layer's time.
void SiglipTower::attention_heads(Compute& c) {
    const evk::OpTable& op = c.ops();
    const int64_t n = n_, d = cfg_.n_embd, hd = d / cfg_.n_head;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    for (int64_t h = 0; h < cfg_.n_head; ++h) {
        Weight keys = make_weight(evk::DType::F32, &k_[h * hd], n, hd);
        keys.row_bytes = static_cast<size_t>(d) * sizeof(float);  // rows of one head inside k_
        const Weight values_t = make_weight(evk::DType::F32, &vt_[h * hd * n], hd, n);
        for (int64_t q0 = 0; q0 < n; q0 += kQueryBlock) {
            const int64_t qn = std::min(kQueryBlock, n - q0);
            c.matmul(keys, &q_[q0 * d + h * hd], d, qn, s_.data(), n, evk::kPrefill);
            auto softmax = [&](int64_t row, int) { op.softmax(&s_[row * n], n, scale); };
            c.pool().run(qn, softmax);
            c.matmul(values_t, s_.data(), n, qn, &att_[q0 * d + h * hd], d, evk::kPrefill);
        }
    }
}

// h = W_down · gelu_tanh(W_up · h + b_up) (the down product's bias comes with the residual).
void SiglipTower::mlp(Compute& c, const Layer& L) {
    const evk::OpTable& op = c.ops();
    const int64_t n = n_, ff = cfg_.n_ff;
    c.matmul(L.w_up, h_.data(), n, ff_.data(), evk::kPrefill);
    for_rows(c.pool(), n, rows_per_chunk(ff), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) op.add(&ff_[t * ff], L.b_up.data(), ff);
        op.gelu_tanh(&ff_[t0 * ff], (t1 - t0) * ff);
    });
    c.matmul(L.w_down, ff_.data(), n, h_.data(), evk::kPrefill);
}

// x += h + bias, token by token (the bias added to h first, as to a biased product's output),
// then the next layernorm of x into dst (h, or the tower's output after the last layer).
void SiglipTower::residual_norm(Compute& c, const std::vector<float>& bias, const Norm& next, float* dst) {
    const evk::OpTable& op = c.ops();
    const int64_t n = n_, d = cfg_.n_embd;
    for_rows(c.pool(), n, rows_per_chunk(d), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            op.add(&h_[t * d], bias.data(), d);
            op.add(&x_[t * d], &h_[t * d], d);
            op.layernorm(&x_[t * d], next.w->data(), next.b->data(), dst + t * d, d, cfg_.eps);
        }
    });
}

std::string SiglipTower::variants(const evk::OpTable& op) const {
    const Weight& w = layers_.empty() ? patch_w_ : layers_[0].wq;
    return std::string("layers (") + evk::type_traits(w.type)->name + "): prefill=" + w.prefill.name + "; patch (" +
           evk::type_traits(patch_w_.type)->name + "): " + patch_w_.prefill.name + "; softmax=" + op.softmax_variant +
           "; gelu_tanh=" + op.gelu_tanh_variant + "; layernorm=" + op.layernorm_variant + "; add=" + op.add_variant;
}

}  // namespace evn
