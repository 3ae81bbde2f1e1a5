// Llama-family block (SmolLM2, the SmolVLM text model): pre-norm attention and a SwiGLU
// feed-forward, each added to the residual stream (Touvron et al. 2023, "LLaMA"):
//   x += Wo · attn(rope(Wq·rmsnorm(x)), rope(Wk·rmsnorm(x)), Wv·rmsnorm(x))
//   x += W_down · (silu(W_gate·rmsnorm(x)) * W_up·rmsnorm(x))
// The skeleton (decoder.h) does the embedding, the final norm, the head and the sequence state.
#include <string>
#include <vector>

#include "registry.h"

namespace evn {

namespace {

class Llama final : public DecoderArch {
public:
    Llama(const DecoderConfig& cfg, const DecoderLoader& load) {
        layers_.reserve(static_cast<size_t>(cfg.n_layer));
        for (int64_t l = 0; l < cfg.n_layer; ++l) layers_.push_back(load_gated_layer(load, cfg, l));
        kv_dim_ = cfg.kv_dim();
    }

    LayerShape layer_shape(int64_t) const override { return LayerShape{kv_dim_, 0}; }

    void layer(DecoderContext& c, int64_t l, const Chunk& ch, const LayerCache& cache) const override {
        const DecoderConfig& cfg = c.cfg;
        const evk::OpTable& op = c.compute.ops();
        RunState& s = c.s;
        const GatedLayerWeights& L = layers_[static_cast<size_t>(l)];
        const int64_t n = ch.n, d = cfg.n_embd, qd = cfg.q_dim(), kvd = cfg.kv_dim();
        const int64_t hd = cfg.head_dim, rd = cfg.rope_dims;
        // attention block: x += Wo · attn(rope(Wq·norm(x)), rope(Wk·norm(x)), Wv·norm(x))
        Compute& cc = c.compute;
        cc.rows(n, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) op.rmsnorm(&s.x[t * d], L.attn_norm.data(), &s.xb[t * d], d, cfg.rms_eps);
        });
        const Compute::MatmulJob qkv[3] = {{&L.wq, s.q.data(), qd}, {&L.wk, s.k.data(), kvd}, {&L.wv, s.v.data(), kvd}};
        cc.matmul_batch(qkv, 3, s.xb.data(), d, n, ch.phase);
        cc.rows(n, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
                op.rope(&s.q[t * qd], cfg.n_head, hd, rd, &s.rope_cs[t * rd], false);
                op.rope(&s.k[t * kvd], cfg.n_head_kv, hd, rd, &s.rope_cs[t * rd], false);
            }
        });
        append_kv(c, cache, ch);
        causal_attention(c, cache, ch);
        c.compute.matmul(L.wo, s.att.data(), n, s.xb2.data(), ch.phase);
        // x += attn; feed-forward block: x += W_down · (silu(W_gate·norm(x)) * W_up·norm(x))
        residual_swiglu_ffn(c, ch, L.ffn_norm, L.w_gate, L.w_up, L.w_down);
    }

    std::string variants(const evk::OpTable&) const override { return layer_variants(layers_[0].wq); }

private:
    std::vector<GatedLayerWeights> layers_;
    int64_t kv_dim_ = 0;
};

}  // namespace

std::unique_ptr<DecoderArch> make_llama(DecoderConfig& cfg, const DecoderLoader& load) {
    return std::make_unique<Llama>(cfg, load);
}

}  // namespace evn
