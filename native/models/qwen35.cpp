// Qwen3.5's hybrid decoder (Qwen Team 2026; the text model of MiniCPM-V 4.6): pre-norm layers of two
// kinds, three Gated DeltaNet (linear attention, Yang et al. 2024, "Gated Delta Networks") to every
// gated full-attention layer, each followed by a SwiGLU feed-forward:
//   linear: qkv = conv1d(Wqkv·norm(x)); q, k = l2norm; per value head S = S·exp(g) + k (beta (v - S^T k))^T,
//           o = S^T q; x += Wout · (rmsnorm(o) * silu(Wz·norm(x)))
//   full:   q|gate = Wq·norm(x); x += Wo · (attn(rope(q_norm(q)), rope(k_norm(Wk·norm(x))), Wv·norm(x)) * sigmoid(gate))
//   then    x += W_down · (silu(W_gate·norm2(x)) * W_up·norm2(x))
// The GGUF is llama.cpp's `qwen35` layout (its converter, conversion/qwen.py):
// - every *norm.weight but ssm_norm holds 1 + w (the reference's RMSNorm scales by 1 + w; its gated
//   norm scales by w): used as they are;
// - attn_q holds q and the output gate per head, [q_h (head_dim) | gate_h (head_dim)] for h in heads;
// - ssm_a holds -exp(A_log), so the decay is g = ssm_a * softplus(alpha + ssm_dt.bias);
// - ssm_conv1d is [conv channels][K] (K contiguous): transposed here to the kernel's [K][channels];
// - value heads are in "tiled" order where key heads are fewer: value head j reads key head j % n_k
//   (the converter reorders the reference's grouped heads, j / (n_v / n_k), in attn_qkv's v part,
//   attn_gate, ssm_alpha/beta, ssm_a, ssm_dt, the conv's v channels and ssm_out's columns alike).
// Rope: the reference's multimodal rope (sections of the rotary dims per t/h/w position) is plain
// NEOX rope over rope.dimension_count dims when the three positions are equal, as for text.
// The sequence state of a linear layer (LayerShape::recurrent) is its conv state, (K - 1) x channels
// oldest first, then one dk x dv delta-rule state per value head; the skeleton zeroes, snapshots and
// restores it.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "registry.h"

namespace evn {

namespace {

// softplus as torch computes it (beta 1, threshold 20: linear above).
float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

class Qwen35 final : public DecoderArch {
public:
    Qwen35(DecoderConfig& cfg, const DecoderLoader& load) {
        const GGUFFile& f = load.file();
        const std::string a = cfg.arch + ".";
        read_shapes(cfg, f, a, load.nextn());
        check_tensors(cfg, f);  // every size that an allocation below is computed from, against the file
        const int64_t d = cfg.n_embd, qd = cfg.q_dim(), kvd = cfg.kv_dim(), hd = cfg.head_dim, ff = cfg.n_ff;
        for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
            const std::string p = "blk." + std::to_string(l) + ".";
            Layer& L = layers_[static_cast<size_t>(l)];
            L.attn_norm = load.vector(p + "attn_norm.weight", d);
            L.post_attn_norm = load.vector(p + "post_attention_norm.weight", d);
            if (L.linear) {
                L.w_qkv = load.matrix(p + "attn_qkv.weight", d, conv_dim_);
                L.w_z = load.matrix(p + "attn_gate.weight", d, value_dim_);
                L.w_beta = load.matrix(p + "ssm_beta.weight", d, n_v_);
                L.w_alpha = load.matrix(p + "ssm_alpha.weight", d, n_v_);
                L.w_out = load.matrix(p + "ssm_out.weight", value_dim_, d);
                const std::vector<float> conv = load.vector(p + "ssm_conv1d.weight", conv_k_ * conv_dim_);
                L.conv_w.resize(conv.size());
                for (int64_t c = 0; c < conv_dim_; ++c)
                    for (int64_t j = 0; j < conv_k_; ++j) L.conv_w[j * conv_dim_ + c] = conv[c * conv_k_ + j];
                L.ssm_a = load.vector(p + "ssm_a", n_v_);
                L.ssm_dt = load.vector(p + "ssm_dt.bias", n_v_);
                L.ssm_norm = load.vector(p + "ssm_norm.weight", dv_);
            } else {
                L.wq = load.matrix(p + "attn_q.weight", d, 2 * qd);
                L.wk = load.matrix(p + "attn_k.weight", d, kvd);
                L.wv = load.matrix(p + "attn_v.weight", d, kvd);
                L.wo = load.matrix(p + "attn_output.weight", qd, d);
                L.q_norm = load.vector(p + "attn_q_norm.weight", hd);
                L.k_norm = load.vector(p + "attn_k_norm.weight", hd);
            }
            L.w_gate = load.matrix(p + "ffn_gate.weight", d, ff);
            L.w_up = load.matrix(p + "ffn_up.weight", d, ff);
            L.w_down = load.matrix(p + "ffn_down.weight", ff, d);
        }
        if (has_nextn_) {  // its own tensors, beside its full-attention layer's (blk.<n_layer>.nextn.*)
            const std::string p = "blk." + std::to_string(cfg.n_layer) + ".nextn.";
            nextn_.eh_proj = load.matrix(p + "eh_proj.weight", 2 * d, d);
            nextn_.enorm = load.vector(p + "enorm.weight", d);
            nextn_.hnorm = load.vector(p + "hnorm.weight", d);
            if (f.find_tensor(p + "shared_head_norm.weight")) nextn_.head_norm = load.vector(p + "shared_head_norm.weight", d);
            if (f.find_tensor(p + "embed_tokens.weight")) nextn_.embed = load.matrix(p + "embed_tokens.weight", d, cfg.n_vocab);
            if (f.find_tensor(p + "shared_head_head.weight")) nextn_.head = load.matrix(p + "shared_head_head.weight", d, cfg.n_vocab);
        }
        const int64_t b = load.n_batch();
        auto alloc = [](std::vector<float>& v, int64_t n) { v.assign(static_cast<size_t>(n), 0.f); };
        if (n_linear_ < cfg.n_layer || has_nextn_) alloc(qg_, b * 2 * qd);
        if (n_linear_ > 0) {
            alloc(qkv_, b * conv_dim_);
            alloc(conv_out_, b * conv_dim_);
            alloc(z_, b * value_dim_);
            alloc(core_, b * value_dim_);
            alloc(alpha_, b * n_v_);
            alloc(beta_, b * n_v_);
        }
        kv_dim_ = kvd;
    }

    LayerShape layer_shape(int64_t l) const override {
        return layers_[static_cast<size_t>(l)].linear ? LayerShape{0, state_floats_} : LayerShape{kv_dim_, 0};
    }

    void layer(DecoderContext& c, int64_t l, const Chunk& ch, const LayerCache& cache) const override {
        const Layer& L = layers_[static_cast<size_t>(l)];
        const evk::OpTable& op = c.compute.ops();
        RunState& s = c.s;
        const int64_t n = ch.n, d = c.cfg.n_embd;
        const float eps = c.cfg.rms_eps;
        c.compute.rows(n, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) op.rmsnorm(&s.x[t * d], L.attn_norm.data(), &s.xb[t * d], d, eps);
        });
        if (L.linear) delta_net(c, L, ch, cache);
        else gated_attention(c, L, ch, cache);
        // x += the mixer's output; feed-forward block: x += W_down · (silu(W_gate·norm(x)) * W_up·norm(x))
        residual_swiglu_ffn(c, ch, L.post_attn_norm, L.w_gate, L.w_up, L.w_down);
    }

    const NextNWeights* nextn() const override { return has_nextn_ ? &nextn_ : nullptr; }
    LayerShape nextn_shape() const override { return has_nextn_ ? LayerShape{kv_dim_, 0} : LayerShape{}; }
    // The MTP block's decoder layer: a full-attention layer like the others (block n_layer of the file).
    void nextn_layer(DecoderContext& c, const Chunk& ch, const LayerCache& cache) const override {
        layer(c, static_cast<int64_t>(layers_.size()) - 1, ch, cache);
    }

    std::string variants(const evk::OpTable& op) const override {
        return layer_variants(layers_.back().w_up) + "; causal_conv1d=" + op.causal_conv1d_variant + "; delta_rule=" +
               op.delta_rule_variant + "; l2norm=" + op.l2norm_variant + "; rmsnorm_gated=" + op.rmsnorm_gated_variant +
               "; sigmoid_mul=" + op.sigmoid_mul_variant;
    }

private:
    struct Layer {
        bool linear = false;
        std::vector<float> attn_norm, post_attn_norm;
        Weight w_gate, w_up, w_down;
        // full attention
        Weight wq, wk, wv, wo;  // wq: q and gate, per head
        std::vector<float> q_norm, k_norm;
        // Gated DeltaNet
        Weight w_qkv, w_z, w_beta, w_alpha, w_out;
        std::vector<float> conv_w;  // [K][conv channels]
        std::vector<float> ssm_a, ssm_dt, ssm_norm;
    };

    // The layer pattern and the linear layers' sizes from the file's keys, each bounded; no
    // allocation depends on them until check_tensors has held them against the tensors.
    void read_shapes(DecoderConfig& cfg, const GGUFFile& f, const std::string& a, bool want_nextn) {
        auto key = [&](const std::string& k, uint64_t limit) {
            const uint64_t v = f.get_uint(a + k);
            if (v == 0 || v > limit) f.fail(a + k, "value " + std::to_string(v) + " is out of range");
            return static_cast<int64_t>(v);
        };
        // block_count counts the multi-token-prediction layers the converter keeps after the
        // decoder's own (nextn_predict_layers): this engine runs the decoder's only.
        const int64_t n_all = cfg.n_layer;
        const uint64_t nextn = f.get_uint(a + "nextn_predict_layers", 0);
        if (nextn >= static_cast<uint64_t>(n_all)) f.fail(a + "nextn_predict_layers", "leaves no decoder layers");
        cfg.n_layer = n_all - static_cast<int64_t>(nextn);
        // The first multi-token-prediction block, when asked for (llama.cpp runs one; a second is never read).
        has_nextn_ = want_nextn && nextn >= 1 && f.find_tensor("blk." + std::to_string(cfg.n_layer) + ".nextn.eh_proj.weight");
        layers_.resize(static_cast<size_t>(cfg.n_layer + (has_nextn_ ? 1 : 0)));
        const std::string rkey = a + "attention.recurrent_layers";
        if (const GValue* v = f.find(rkey)) {
            if (v->type != GType::ARRAY || v->elem_type != GType::BOOL || static_cast<int64_t>(v->count()) != n_all)
                f.fail(rkey, "must be one bool per block");
            for (int64_t l = 0; l < cfg.n_layer; ++l) layers_[static_cast<size_t>(l)].linear = v->raw[static_cast<size_t>(l)] != 0;
        } else {
            const uint64_t interval = f.get_uint(a + "full_attention_interval", 4);
            if (interval < 1) f.fail(a + "full_attention_interval", "must be >= 1");
            for (int64_t l = 0; l < cfg.n_layer; ++l)
                layers_[static_cast<size_t>(l)].linear = static_cast<uint64_t>(l + 1) % interval != 0;
        }
        n_linear_ = std::count_if(layers_.begin(), layers_.end(), [](const Layer& L) { return L.linear; });
        if (f.find(a + "attention.value_length") && f.get_uint(a + "attention.value_length") != static_cast<uint64_t>(cfg.head_dim))
            f.fail(a + "attention.value_length", "must equal attention.key_length");
        if (n_linear_ == 0) return;
        conv_k_ = key("ssm.conv_kernel", 32);
        if (conv_k_ < 2) f.fail(a + "ssm.conv_kernel", "must be >= 2");
        dk_ = key("ssm.state_size", 4096);
        n_k_ = key("ssm.group_count", 1024);
        n_v_ = key("ssm.time_step_rank", 1024);
        value_dim_ = key("ssm.inner_size", 1 << 18);
        if (n_v_ % n_k_ != 0) f.fail(a + "ssm.time_step_rank", "value heads must be a multiple of the key heads (group_count)");
        if (value_dim_ % n_v_ != 0) f.fail(a + "ssm.inner_size", "must be a multiple of the value heads (time_step_rank)");
        dv_ = value_dim_ / n_v_;
        key_dim_ = n_k_ * dk_;
        if (key_dim_ > (1 << 18)) f.fail(a + "ssm.group_count", "group_count x state_size is out of range");
        conv_dim_ = 2 * key_dim_ + value_dim_;
        // The delta states (n_v x dk x dv floats) are at most the layer's output projection
        // (value_dim x n_embd elements, in the file) when dk <= n_embd: a file cannot promise more
        // state than it holds weights.
        if (dk_ > cfg.n_embd) f.fail(a + "ssm.state_size", "is larger than embedding_length");
        // ssm_out is a product over value_dim: the compute scratch holds rows of the widest of
        // n_embd, n_ff and q_dim (Compute's max_k).
        if (value_dim_ > std::max({cfg.n_embd, cfg.n_ff, cfg.q_dim()}))
            throw UnsupportedModel("'" + f.path() + "': " + a + "ssm.inner_size " + std::to_string(value_dim_) +
                                   " wider than embedding_length, feed_forward_length and the query width is not supported");
        state_floats_ = (conv_k_ - 1) * conv_dim_ + n_v_ * dk_ * dv_;
    }

    // The tensors whose sizes the run-state and sequence-state buffers are computed from.
    void check_tensors(const DecoderConfig& cfg, const GGUFFile& f) const {
        for (int64_t l = 0; l < static_cast<int64_t>(layers_.size()); ++l) {
            const std::string p = "blk." + std::to_string(l) + ".";
            if (!layers_[static_cast<size_t>(l)].linear) {
                require_elements(f, p + "attn_q.weight", cfg.n_embd * 2 * cfg.q_dim());
                continue;
            }
            const std::string conv = p + "ssm_conv1d.weight";
            const TensorInfo* t = f.find_tensor(conv);
            if (!t) f.fail("tensor '" + conv + "'", "missing");
            if (t->n_dims != 2 || t->ne[0] != conv_k_ || t->ne[1] != conv_dim_)
                f.fail("tensor '" + conv + "'", "must be [" + std::to_string(conv_k_) + ", " + std::to_string(conv_dim_) +
                                                    "] (ssm.conv_kernel, 2 x key dims + inner_size)");
            require_elements(f, p + "attn_qkv.weight", cfg.n_embd * conv_dim_);
            require_elements(f, p + "attn_gate.weight", cfg.n_embd * value_dim_);
            require_elements(f, p + "ssm_out.weight", value_dim_ * cfg.n_embd);
            require_elements(f, p + "ssm_alpha.weight", cfg.n_embd * n_v_);
            require_elements(f, p + "ssm_norm.weight", dv_);
        }
    }

    // x's attention half for a full-attention layer: s.xb2 = Wo · (attn(...) * sigmoid(gate)).
    void gated_attention(DecoderContext& c, const Layer& L, const Chunk& ch, const LayerCache& cache) const {
        const DecoderConfig& cfg = c.cfg;
        const evk::OpTable& op = c.compute.ops();
        RunState& s = c.s;
        const int64_t n = ch.n, d = cfg.n_embd, qd = cfg.q_dim(), kvd = cfg.kv_dim(), hd = cfg.head_dim, rd = cfg.rope_dims;
        const float eps = cfg.rms_eps;
        const Compute::MatmulJob qkv[3] = {{&L.wq, qg_.data(), 2 * qd}, {&L.wk, s.k.data(), kvd}, {&L.wv, s.v.data(), kvd}};
        c.compute.matmul_batch(qkv, 3, s.xb.data(), d, n, ch.phase);
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t h = 0; h < cfg.n_head; ++h)
                op.rmsnorm(&qg_[t * 2 * qd + h * 2 * hd], L.q_norm.data(), &s.q[t * qd + h * hd], hd, eps);
            for (int64_t h = 0; h < cfg.n_head_kv; ++h) {
                float* k = &s.k[t * kvd + h * hd];
                op.rmsnorm(k, L.k_norm.data(), k, hd, eps);
            }
            op.rope(&s.q[t * qd], cfg.n_head, hd, rd, &s.rope_cs[t * rd], true);
            op.rope(&s.k[t * kvd], cfg.n_head_kv, hd, rd, &s.rope_cs[t * rd], true);
        }
        append_kv(c, cache, ch);
        causal_attention(c, cache, ch);
        for (int64_t t = 0; t < n; ++t)
            for (int64_t h = 0; h < cfg.n_head; ++h) op.sigmoid_mul(&s.att[t * qd + h * hd], &qg_[t * 2 * qd + h * 2 * hd + hd], hd);
        c.compute.matmul(L.wo, s.att.data(), n, s.xb2.data(), ch.phase);
    }

    // x's mixing half for a Gated DeltaNet layer: s.xb2 = Wout · gated_norm(delta_rule(conv(Wqkv·xb)), Wz·xb).
    void delta_net(DecoderContext& c, const Layer& L, const Chunk& ch, const LayerCache& cache) const {
        const evk::OpTable& op = c.compute.ops();
        RunState& s = c.s;
        const int64_t n = ch.n, d = c.cfg.n_embd, cd = conv_dim_, vd = value_dim_, nv = n_v_;
        const float eps = c.cfg.rms_eps;
        const Compute::MatmulJob in[4] = {
            {&L.w_qkv, qkv_.data(), cd}, {&L.w_z, z_.data(), vd}, {&L.w_beta, beta_.data(), nv}, {&L.w_alpha, alpha_.data(), nv}};
        c.compute.matmul_batch(in, 4, s.xb.data(), d, n, ch.phase);
        float* conv_state = cache.recurrent;                   // [K - 1][conv channels]
        float* delta_state = conv_state + (conv_k_ - 1) * cd;  // [value head][dk][dv]
        op.causal_conv1d(qkv_.data(), cd, n, cd, L.conv_w.data(), conv_k_, conv_state, conv_out_.data(), cd);
        // q and k of each key head L2-normalised, q scaled by dk^-1/2 (the reference's order: norm, then scale);
        // decay g (log space) and write strength beta of each value head.
        const float q_scale = 1.f / std::sqrt(static_cast<float>(dk_));
        for (int64_t t = 0; t < n; ++t) {
            float* q = &conv_out_[t * cd];
            float* k = q + key_dim_;
            for (int64_t h = 0; h < n_k_; ++h) {
                op.l2norm(q + h * dk_, q + h * dk_, dk_, eps);
                op.l2norm(k + h * dk_, k + h * dk_, dk_, eps);
            }
            for (int64_t i = 0; i < key_dim_; ++i) q[i] *= q_scale;
            for (int64_t h = 0; h < nv; ++h) {
                float& g = alpha_[t * nv + h];
                g = L.ssm_a[h] * softplus(g + L.ssm_dt[h]);
                beta_[t * nv + h] = sigmoid(beta_[t * nv + h]);
            }
        }
        // One value head per work item: its state S (dk x dv, row-major) runs through the chunk's tokens.
        auto head = [&](int64_t h, int) {
            const int64_t kh = h % n_k_;  // tiled value heads (see the top of the file)
            op.delta_rule(delta_state + h * dk_ * dv_, &conv_out_[kh * dk_], &conv_out_[key_dim_ + kh * dk_], cd,
                          &conv_out_[2 * key_dim_ + h * dv_], cd, &alpha_[h], &beta_[h], nv, n, dk_, dv_, &core_[h * dv_], vd);
        };
        c.compute.pool().run(nv, head);
        for (int64_t t = 0; t < n; ++t)
            for (int64_t h = 0; h < nv; ++h) {
                float* o = &core_[t * vd + h * dv_];
                op.rmsnorm_gated(o, L.ssm_norm.data(), &z_[t * vd + h * dv_], o, dv_, eps);
            }
        c.compute.matmul(L.w_out, core_.data(), n, s.xb2.data(), ch.phase);
    }

    std::vector<Layer> layers_;  // the decoder's n_layer, then the MTP block's layer where it is loaded
    bool has_nextn_ = false;
    NextNWeights nextn_;
    int64_t n_linear_ = 0, kv_dim_ = 0;
    int64_t conv_k_ = 0, dk_ = 0, dv_ = 0, n_k_ = 0, n_v_ = 0, key_dim_ = 0, value_dim_ = 0, conv_dim_ = 0;
    int64_t state_floats_ = 0;  // per linear layer: conv state + delta states
    // The chunk's own buffers ([t][...], n_batch tokens), beside the skeleton's RunState.
    mutable std::vector<float> qg_;                   // [t][2 q_dim] q and gate of each head
    mutable std::vector<float> qkv_, conv_out_;       // [t][conv channels] before / after the conv
    mutable std::vector<float> z_, core_;             // [t][inner] gate of the norm; delta-rule output
    mutable std::vector<float> alpha_, beta_;         // [t][value heads] -> decay g, write strength
};

}  // namespace

std::unique_ptr<DecoderArch> make_qwen35(DecoderConfig& cfg, const DecoderLoader& load) {
    return std::make_unique<Qwen35>(cfg, load);
}

}  // namespace evn
