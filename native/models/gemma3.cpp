// Gemma 3 block (Gemma Team 2025, "Gemma 3 Technical Report"; the text model of the Gemma 3 VLMs):
// pre- and post-norms around attention and the feed-forward, per-head RMSNorm of q and k, a GeGLU
// (tanh) feed-forward, and local sliding-window layers between global ones, each with its own rope base:
//   x += post_attn_norm(Wo · attn(rope(q_norm(Wq·norm(x))), rope(k_norm(Wk·norm(x))), Wv·norm(x)))
//   x += post_ffw_norm(W_down · (gelu(W_gate·norm(x)) * W_up·norm(x)))
// The reference's RMSNorm scales by (1 + w); llama.cpp's converter writes w + 1 into the GGUF
// (every *norm.weight), so the file's weights are used as they are, like any RMSNorm's.
// The skeleton (decoder.h) does the embedding (x sqrt(n_embd), set here), the final norm, the tied
// head and the sequence state.
#include <cmath>
#include <string>
#include <vector>

#include "registry.h"

namespace evn {

namespace {

// Which layers attend locally, as llama.cpp reads it: the key attention.sliding_window_pattern,
// either one bool per layer or a period n (layer l local unless l % n == n - 1; 0: every layer);
// without the key, Gemma 3's period 6 (five local layers, then a global one).
std::vector<bool> local_layers(const GGUFFile& f, const std::string& a, int64_t n_layer) {
    std::vector<bool> local(static_cast<size_t>(n_layer));
    const std::string key = a + "attention.sliding_window_pattern";
    const GValue* v = f.find(key);
    if (v && v->type == GType::ARRAY) {
        if (v->elem_type != GType::BOOL || static_cast<int64_t>(v->count()) != n_layer)
            f.fail(key, "must be one bool per layer");
        for (int64_t l = 0; l < n_layer; ++l) local[static_cast<size_t>(l)] = v->raw[static_cast<size_t>(l)] != 0;
        return local;
    }
    const uint64_t period = v ? f.get_uint(key) : 6;  // any period is well-defined (one longer than the model: all local)
    for (int64_t l = 0; l < n_layer; ++l)
        local[static_cast<size_t>(l)] = period == 0 || static_cast<uint64_t>(l) % period < period - 1;
    return local;
}

class Gemma3 final : public DecoderArch {
public:
    Gemma3(DecoderConfig& cfg, const DecoderLoader& load) {
        const GGUFFile& f = load.file();
        const std::string a = cfg.arch + ".";
        const int64_t d = cfg.n_embd, kvd = cfg.kv_dim(), hd = cfg.head_dim;
        if (f.get_float(a + "final_logit_softcapping", 0.0) != 0.0)
            throw UnsupportedModel("'" + f.path() + "': " + a + "final_logit_softcapping is not supported");
        cfg.embd_scale = std::sqrt(static_cast<float>(d));
        // The window: positions [p - window + 1, p] for a query at p (llama.cpp's and the
        // reference's mask). Without the key every layer is global.
        window_ = static_cast<int64_t>(f.get_uint(a + "attention.sliding_window", 0));
        if (window_ > cfg.n_ctx_train) window_ = 0;  // a window wider than the context masks nothing
        local_ = window_ > 0 ? local_layers(f, a, cfg.n_layer) : std::vector<bool>(static_cast<size_t>(cfg.n_layer));
        local_base_ = static_cast<float>(f.get_float(a + "rope.freq_base_swa", 10000.0));
        if (!(local_base_ > 1.f)) f.fail(a + "rope.freq_base_swa", "must be > 1");
        // The query scale: attention.scale where the file gives it, else the reference's
        // query_pre_attn_scalar^-1/2, which the converter does not write: the head size for every
        // Gemma 3 but the 27B (62 layers), whose scalar is n_embd / n_head (llama.cpp's rule).
        const double scale = f.get_float(a + "attention.scale", 0.0);
        scale_ = scale > 0.0 ? static_cast<float>(scale)
                             : 1.f / std::sqrt(static_cast<float>(cfg.n_layer == 62 ? d / cfg.n_head : hd));
        layers_.resize(static_cast<size_t>(cfg.n_layer));
        for (int64_t l = 0; l < cfg.n_layer; ++l) {
            const std::string p = "blk." + std::to_string(l) + ".";
            Layer& L = layers_[static_cast<size_t>(l)];
            static_cast<GatedLayerWeights&>(L) = load_gated_layer(load, cfg, l);
            L.q_norm = load.vector(p + "attn_q_norm.weight", hd);
            L.k_norm = load.vector(p + "attn_k_norm.weight", hd);
            L.post_attn_norm = load.vector(p + "post_attention_norm.weight", d);
            L.post_ffw_norm = load.vector(p + "post_ffw_norm.weight", d);
        }
        kv_dim_ = kvd;
        rope_local_.assign(static_cast<size_t>(load.n_batch() * cfg.rope_dims), 0.f);
    }

    LayerShape layer_shape(int64_t) const override { return LayerShape{kv_dim_, 0}; }

    // The local layers' rotation angles (their own base, positions not rescaled: llama.cpp's
    // rope_freq_scale_train_swa is 1); the shared s.rope_cs holds the global layers' base.
    void begin_chunk(DecoderContext& c, const Chunk& ch) const override {
        const int64_t rd = c.cfg.rope_dims;
        if (window_ == 0) return;
        for (int64_t t = 0; t < ch.n; ++t)
            evk::rope_angles(static_cast<float>(ch.pos0 + t), local_base_, rd, &rope_local_[t * rd]);
    }

    void layer(DecoderContext& c, int64_t l, const Chunk& ch, const LayerCache& cache) const override {
        const DecoderConfig& cfg = c.cfg;
        const evk::OpTable& op = c.compute.ops();
        RunState& s = c.s;
        const Layer& L = layers_[static_cast<size_t>(l)];
        const bool local = local_[static_cast<size_t>(l)];
        const float* cs = local ? rope_local_.data() : s.rope_cs.data();
        const int64_t n = ch.n, d = cfg.n_embd, qd = cfg.q_dim(), kvd = cfg.kv_dim(), ff = cfg.n_ff;
        const int64_t hd = cfg.head_dim, rd = cfg.rope_dims;
        const float eps = cfg.rms_eps;
        // attention block: x += post_attn_norm(Wo · attn(rope(q_norm(q)), rope(k_norm(k)), v))
        Compute& cc = c.compute;
        cc.rows(n, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) op.rmsnorm(&s.x[t * d], L.attn_norm.data(), &s.xb[t * d], d, eps);
        });
        const Compute::MatmulJob qkv[3] = {{&L.wq, s.q.data(), qd}, {&L.wk, s.k.data(), kvd}, {&L.wv, s.v.data(), kvd}};
        c.compute.matmul_batch(qkv, 3, s.xb.data(), d, n, ch.phase);
        cc.rows(n, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
                for (int64_t h = 0; h < cfg.n_head; ++h) {
                    float* q = &s.q[t * qd + h * hd];
                    op.rmsnorm(q, L.q_norm.data(), q, hd, eps);
                }
                for (int64_t h = 0; h < cfg.n_head_kv; ++h) {
                    float* k = &s.k[t * kvd + h * hd];
                    op.rmsnorm(k, L.k_norm.data(), k, hd, eps);
                }
                op.rope(&s.q[t * qd], cfg.n_head, hd, rd, &cs[t * rd], true);
                op.rope(&s.k[t * kvd], cfg.n_head_kv, hd, rd, &cs[t * rd], true);
            }
        });
        append_kv(c, cache, ch);
        causal_attention(c, cache, ch, local ? window_ : 0, scale_);
        c.compute.matmul(L.wo, s.att.data(), n, s.xb2.data(), ch.phase);
        // x += post_attn_norm(attn), then the feed-forward block's input norm(x), a row at a time
        cc.rows(n, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
                op.rmsnorm(&s.xb2[t * d], L.post_attn_norm.data(), &s.xb2[t * d], d, eps);
                op.add(&s.x[t * d], &s.xb2[t * d], d);
                op.rmsnorm(&s.x[t * d], L.ffn_norm.data(), &s.xb[t * d], d, eps);
            }
        });
        // feed-forward block: x += post_ffw_norm(W_down · (gelu(W_gate·norm(x)) * W_up·norm(x)))
        const Compute::MatmulJob gate_up[2] = {{&L.w_gate, s.hb.data(), ff}, {&L.w_up, s.hb2.data(), ff}};
        c.compute.matmul_batch(gate_up, 2, s.xb.data(), d, n, ch.phase);
        cc.rows(n, [&](int64_t t0, int64_t t1) { op.gelu_mul(&s.hb[t0 * ff], &s.hb2[t0 * ff], (t1 - t0) * ff); });
        c.compute.matmul(L.w_down, s.hb.data(), n, s.xb2.data(), ch.phase);
        cc.rows(n, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
                op.rmsnorm(&s.xb2[t * d], L.post_ffw_norm.data(), &s.xb2[t * d], d, eps);
                op.add(&s.x[t * d], &s.xb2[t * d], d);
            }
        });
    }

    std::string variants(const evk::OpTable& op) const override {
        return layer_variants(layers_[0].wq) + "; gelu_mul=" + op.gelu_mul_variant;
    }

private:
    struct Layer : GatedLayerWeights {
        std::vector<float> q_norm, k_norm, post_attn_norm, post_ffw_norm;
    };
    std::vector<Layer> layers_;
    std::vector<bool> local_;  // per layer: sliding-window attention with the local rope base
    int64_t kv_dim_ = 0, window_ = 0;
    float local_base_ = 10000.f, scale_ = 0.f;
    mutable std::vector<float> rope_local_;  // [t][rope_dims] the chunk's local angles (begin_chunk)
};

}  // namespace

std::unique_ptr<DecoderArch> make_gemma3(DecoderConfig& cfg, const DecoderLoader& load) {
    return std::make_unique<Gemma3>(cfg, load);
}

}  // namespace evn
