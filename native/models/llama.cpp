#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace evn {

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

LlamaConfig read_config(const GGUFFile& f) {
    LlamaConfig c;
    c.arch = f.get_string("general.architecture");
    if (c.arch != "llama")
        f.fail("general.architecture", "'" + c.arch + "' is not a llama-family decoder this engine runs");
    const std::string a = c.arch + ".";
    auto pos_int = [&](const std::string& key, uint64_t limit) {
        const uint64_t v = f.get_uint(key);
        if (v == 0 || v > limit) f.fail(key, "value " + std::to_string(v) + " is out of range");
        return static_cast<int64_t>(v);
    };
    c.n_embd = pos_int(a + "embedding_length", 1 << 16);
    c.n_ff = pos_int(a + "feed_forward_length", 1 << 18);
    c.n_layer = pos_int(a + "block_count", 1024);
    c.n_head = pos_int(a + "attention.head_count", 1024);
    c.n_head_kv = f.find(a + "attention.head_count_kv") ? pos_int(a + "attention.head_count_kv", 1024) : c.n_head;
    c.n_ctx_train = pos_int(a + "context_length", 1 << 24);
    if (c.n_embd % c.n_head != 0) f.fail(a + "attention.head_count", "does not divide embedding_length");
    if (c.n_head % c.n_head_kv != 0) f.fail(a + "attention.head_count_kv", "does not divide head_count");
    c.head_dim = c.n_embd / c.n_head;
    c.rope_dims = f.find(a + "rope.dimension_count") ? pos_int(a + "rope.dimension_count", 1 << 16) : c.head_dim;
    if (c.rope_dims > c.head_dim || c.rope_dims % 2 != 0) f.fail(a + "rope.dimension_count", "must be even and at most the head size");
    c.rms_eps = static_cast<float>(f.get_float(a + "attention.layer_norm_rms_epsilon", 1e-5));
    c.rope_base = static_cast<float>(f.get_float(a + "rope.freq_base", 10000.0));
    if (!(c.rope_base > 1.f)) f.fail(a + "rope.freq_base", "must be > 1");
    if (const GValue* st = f.find(a + "rope.scaling.type")) {
        if (st->type != GType::STRING) f.fail(a + "rope.scaling.type", "must be a string");
        if (st->s == "linear") {
            c.rope_scale = static_cast<float>(f.get_float(a + "rope.scaling.factor", 1.0));
            if (!(c.rope_scale > 0.f)) f.fail(a + "rope.scaling.factor", "must be > 0");
        } else if (st->s != "none") {
            f.fail(a + "rope.scaling.type", "'" + st->s + "' is not supported (none, linear are)");
        }
    }
    const TensorInfo* emb = f.find_tensor("token_embd.weight");
    if (!emb) f.fail("tensor 'token_embd.weight'", "missing");
    c.n_vocab = emb->ne[1];
    c.tied_output = f.find_tensor("output.weight") == nullptr;
    return c;
}

}  // namespace

LlamaModel::LlamaModel(std::shared_ptr<const GGUFFile> file, int n_threads, int64_t n_ctx, int64_t n_batch)
    : file_(std::move(file)), cfg_(read_config(*file_)),
      n_ctx_(n_ctx > 0 ? std::min<int64_t>(n_ctx, cfg_.n_ctx_train) : std::min<int64_t>(cfg_.n_ctx_train, 4096)),
      n_batch_(std::max<int64_t>(1, n_batch)),
      compute_(n_threads, std::max(cfg_.n_embd, cfg_.n_ff)) {
    const GGUFFile& f = *file_;
    const int64_t d = cfg_.n_embd, qd = cfg_.q_dim(), kvd = cfg_.kv_dim(), ff = cfg_.n_ff;
    tok_embd_ = load_weight(f, "token_embd.weight", d, cfg_.n_vocab, WeightUse::kBoth, &arena_);
    output_ = cfg_.tied_output ? tok_embd_ : load_weight(f, "output.weight", d, cfg_.n_vocab, WeightUse::kBoth, &arena_);
    output_norm_ = load_vector(f, "output_norm.weight", d);
    layers_.resize(static_cast<size_t>(cfg_.n_layer));
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
        const std::string p = "blk." + std::to_string(l) + ".";
        Layer& L = layers_[static_cast<size_t>(l)];
        L.attn_norm = load_vector(f, p + "attn_norm.weight", d);
        L.ffn_norm = load_vector(f, p + "ffn_norm.weight", d);
        L.wq = load_weight(f, p + "attn_q.weight", d, qd, WeightUse::kBoth, &arena_);
        L.wk = load_weight(f, p + "attn_k.weight", d, kvd, WeightUse::kBoth, &arena_);
        L.wv = load_weight(f, p + "attn_v.weight", d, kvd, WeightUse::kBoth, &arena_);
        L.wo = load_weight(f, p + "attn_output.weight", qd, d, WeightUse::kBoth, &arena_);
        L.w_gate = load_weight(f, p + "ffn_gate.weight", d, ff, WeightUse::kBoth, &arena_);
        L.w_up = load_weight(f, p + "ffn_up.weight", d, ff, WeightUse::kBoth, &arena_);
        L.w_down = load_weight(f, p + "ffn_down.weight", ff, d, WeightUse::kBoth, &arena_);
    }
    // Weights whose kernels both read a packed copy no longer need their rows in memory (the
    // token embeddings map single rows back in on lookup): ~the model's size less resident.
    release_unused_rows(f, tok_embd_);
    if (!cfg_.tied_output) release_unused_rows(f, output_);
    for (const Layer& L : layers_)
        for (const Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) release_unused_rows(f, *w);
    auto alloc = [](std::vector<float>& v, int64_t n) { v.assign(static_cast<size_t>(n), 0.f); };
    const int64_t b = n_batch_;
    alloc(x_, b * d);
    alloc(xb_, b * std::max(d, qd));
    alloc(xb2_, b * d);
    alloc(q_, b * qd);
    alloc(k_, b * kvd);
    alloc(v_, b * kvd);
    alloc(att_, b * qd);
    alloc(hb_, b * ff);
    alloc(hb2_, b * ff);
    alloc(logits_, cfg_.n_vocab);
    alloc(rope_cs_, b * cfg_.rope_dims);
    alloc(scores_, static_cast<int64_t>(compute_.threads()) * n_ctx_);
    alloc(k_cache_, cfg_.n_layer * n_ctx_ * kvd);
    alloc(v_cache_, cfg_.n_layer * n_ctx_ * kvd);
}

namespace {
void check_ids(const int32_t* ids, int64_t n, int64_t n_vocab) {
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= n_vocab)
            throw std::invalid_argument("token id " + std::to_string(ids[i]) + " is outside the vocabulary [0, " +
                                        std::to_string(n_vocab) + ")");
}
}  // namespace

void LlamaModel::embed(const int32_t* ids, int64_t n, float* out) const {
    check_ids(ids, n, cfg_.n_vocab);
    const int64_t d = cfg_.n_embd;
    for (int64_t i = 0; i < n; ++i)
        evk::dequantize_row(tok_embd_.type, static_cast<const char*>(tok_embd_.data) + static_cast<size_t>(ids[i]) * tok_embd_.row_bytes,
                            out + i * d, d);
}

void LlamaModel::forward_tokens(const int32_t* ids, int64_t n, float* logits, bool all_logits) {
    check_ids(ids, n, cfg_.n_vocab);
    if (n_past_ + n > n_ctx_)
        throw std::length_error("context full: " + std::to_string(n_past_) + " + " + std::to_string(n) + " tokens > n_ctx " +
                                std::to_string(n_ctx_));
    for (int64_t c0 = 0; c0 < n; c0 += n_batch_) {
        const int64_t cn = std::min(n_batch_, n - c0);
        embed(ids + c0, cn, x_.data());
        const bool last_chunk = c0 + cn == n;
        forward_chunk(cn, all_logits ? logits + c0 * cfg_.n_vocab : (last_chunk ? logits : nullptr), all_logits,
                      Compute::phase_for(n));
    }
}

void LlamaModel::forward_embeddings(const float* x, int64_t n, float* logits, bool all_logits) {
    if (n_past_ + n > n_ctx_)
        throw std::length_error("context full: " + std::to_string(n_past_) + " + " + std::to_string(n) + " rows > n_ctx " +
                                std::to_string(n_ctx_));
    const int64_t d = cfg_.n_embd;
    for (int64_t c0 = 0; c0 < n; c0 += n_batch_) {
        const int64_t cn = std::min(n_batch_, n - c0);
        std::memcpy(x_.data(), x + c0 * d, static_cast<size_t>(cn * d) * sizeof(float));
        const bool last_chunk = c0 + cn == n;
        forward_chunk(cn, all_logits ? logits + c0 * cfg_.n_vocab : (last_chunk ? logits : nullptr), all_logits,
                      Compute::phase_for(n));
    }
}

// One chunk of n tokens already embedded in x_, at positions n_past_ .. n_past_ + n - 1.
void LlamaModel::forward_chunk(int64_t n, float* logits, bool all_logits, evk::Phase ph) {
    const evk::OpTable& op = compute_.ops();
    const int64_t d = cfg_.n_embd, qd = cfg_.q_dim(), kvd = cfg_.kv_dim(), ff = cfg_.n_ff, hd = cfg_.head_dim;
    const int64_t pos0 = n_past_, rd = cfg_.rope_dims;
    // The rotation angles of each token's position, once for all layers (a cos, sin and pow per
    // pair per head per layer were ~3% of a decode step).
    for (int64_t t = 0; t < n; ++t)
        evk::rope_angles(static_cast<float>(pos0 + t) / cfg_.rope_scale, cfg_.rope_base, rd, &rope_cs_[t * rd]);
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
        const Layer& L = layers_[static_cast<size_t>(l)];
        // attention block: x += Wo · attn(rope(Wq·norm(x)), rope(Wk·norm(x)), Wv·norm(x))
        for (int64_t t = 0; t < n; ++t) op.rmsnorm(&x_[t * d], L.attn_norm.data(), &xb_[t * d], d, cfg_.rms_eps);
        const Compute::MatmulJob qkv[3] = {{&L.wq, q_.data(), qd}, {&L.wk, k_.data(), kvd}, {&L.wv, v_.data(), kvd}};
        compute_.matmul_batch(qkv, 3, xb_.data(), d, n, ph);
        for (int64_t t = 0; t < n; ++t) {
            op.rope(&q_[t * qd], cfg_.n_head, hd, rd, &rope_cs_[t * rd], false);
            op.rope(&k_[t * kvd], cfg_.n_head_kv, hd, rd, &rope_cs_[t * rd], false);
            std::memcpy(k_at(l, pos0 + t), &k_[t * kvd], static_cast<size_t>(kvd) * sizeof(float));
            std::memcpy(v_at(l, pos0 + t), &v_[t * kvd], static_cast<size_t>(kvd) * sizeof(float));
        }
        attention(l, n, pos0);
        compute_.matmul(L.wo, att_.data(), n, xb2_.data(), ph);
        op.add(x_.data(), xb2_.data(), n * d);
        // feed-forward block: x += W_down · (silu(W_gate·norm(x)) * W_up·norm(x))
        for (int64_t t = 0; t < n; ++t) op.rmsnorm(&x_[t * d], L.ffn_norm.data(), &xb_[t * d], d, cfg_.rms_eps);
        const Compute::MatmulJob gate_up[2] = {{&L.w_gate, hb_.data(), ff}, {&L.w_up, hb2_.data(), ff}};
        compute_.matmul_batch(gate_up, 2, xb_.data(), d, n, ph);
        op.silu_mul(hb_.data(), hb2_.data(), n * ff);
        compute_.matmul(L.w_down, hb_.data(), n, xb2_.data(), ph);
        op.add(x_.data(), xb2_.data(), n * d);
    }
    n_past_ += n;
    if (!logits) return;
    const int64_t first = all_logits ? 0 : n - 1;
    for (int64_t t = first; t < n; ++t) op.rmsnorm(&x_[t * d], output_norm_.data(), &xb_[t * d], d, cfg_.rms_eps);
    compute_.matmul(output_, &xb_[first * d], d, n - first, logits, cfg_.n_vocab, ph);
    // Keep the last position's logits: generate() with an empty prompt continues from them.
    const float* last = logits + (n - 1 - first) * cfg_.n_vocab;
    if (last != logits_.data()) std::memcpy(logits_.data(), last, static_cast<size_t>(cfg_.n_vocab) * sizeof(float));
}

// Causal grouped-query attention for n new queries; work items are (token, head) pairs.
void LlamaModel::attention(int64_t layer, int64_t n, int64_t pos0) {
    const evk::AttentionFn fn = compute_.ops().attention;
    const int64_t hd = cfg_.head_dim, qd = cfg_.q_dim(), kvd = cfg_.kv_dim();
    const int64_t group = cfg_.n_head / cfg_.n_head_kv;
    const float scale = 1.f / std::sqrt(static_cast<float>(hd));
    auto body = [&](int64_t item, int t) {
        {
            const int64_t tok = item / cfg_.n_head, h = item % cfg_.n_head, kvh = h / group;
            evk::AttentionArgs a{};
            a.q = &q_[tok * qd + h * hd];
            a.k = k_at(layer, 0) + kvh * hd;
            a.v = v_at(layer, 0) + kvh * hd;
            a.k_stride = a.v_stride = kvd;
            a.n_kv = pos0 + tok + 1;
            a.head_dim = hd;
            a.scale = scale;
            a.out = &att_[tok * qd + h * hd];
            a.scores = scores_.data() + static_cast<int64_t>(t) * n_ctx_;
            fn(a);
        }
    };
    compute_.pool().run(n * cfg_.n_head, body);
}

void LlamaModel::generate(const int32_t* prompt, int64_t n_prompt, int64_t max_new, const std::vector<int32_t>& stop_ids,
                          double max_ms, GenerateResult& out) {
    const Clock::time_point t0 = Clock::now();
    out.tokens.clear();
    // Never more tokens than the context can still hold: a huge budget must not become a huge
    // reservation (the loop stops with "context_full" first).
    out.tokens.reserve(static_cast<size_t>(std::clamp<int64_t>(max_new, 0, n_ctx_ - n_past_ + 1)));
    out.n_prompt = n_prompt;
    out.stop_reason = "max_tokens";
    if (n_prompt > 0) forward_tokens(prompt, n_prompt, logits_.data(), false);
    out.prefill_ms = ms_since(t0);
    const Clock::time_point t1 = Clock::now();
    for (int64_t i = 0; i < max_new; ++i) {
        // Greedy: the first maximum wins ties, as torch.argmax does.
        const int32_t next = static_cast<int32_t>(std::max_element(logits_.begin(), logits_.end()) - logits_.begin());
        if (std::find(stop_ids.begin(), stop_ids.end(), next) != stop_ids.end()) {
            out.stop_reason = "stop_token";
            break;
        }
        out.tokens.push_back(next);
        if (i + 1 == max_new) break;  // the budget is spent: no need to run the last token
        if (cancelled()) {
            out.stop_reason = "cancelled";
            break;
        }
        if (max_ms > 0 && ms_since(t0) >= max_ms) {
            out.stop_reason = "deadline";
            break;
        }
        if (n_past_ + 1 > n_ctx_) {
            out.stop_reason = "context_full";
            break;
        }
        forward_tokens(&next, 1, logits_.data(), false);
    }
    out.decode_ms = ms_since(t1);
}

KVSnapshot LlamaModel::snapshot() const {
    KVSnapshot s;
    s.n_past = n_past_;
    s.n_layer = cfg_.n_layer;
    s.kv_dim = cfg_.kv_dim();
    const size_t per_layer = static_cast<size_t>(n_past_ * s.kv_dim);
    s.k.resize(per_layer * static_cast<size_t>(cfg_.n_layer));
    s.v.resize(per_layer * static_cast<size_t>(cfg_.n_layer));
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
        std::memcpy(s.k.data() + l * per_layer, k_cache_.data() + l * n_ctx_ * s.kv_dim, per_layer * sizeof(float));
        std::memcpy(s.v.data() + l * per_layer, v_cache_.data() + l * n_ctx_ * s.kv_dim, per_layer * sizeof(float));
    }
    return s;
}

void LlamaModel::restore(const KVSnapshot& s) {
    const size_t per_layer = static_cast<size_t>(s.n_past * s.kv_dim);
    if (s.n_layer != cfg_.n_layer || s.kv_dim != cfg_.kv_dim() || s.n_past < 0 || s.n_past > n_ctx_ ||
        s.k.size() != per_layer * static_cast<size_t>(s.n_layer) || s.v.size() != s.k.size())
        throw std::invalid_argument("KV snapshot does not fit this model (layers, width or context differ)");
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
        std::memcpy(k_cache_.data() + l * n_ctx_ * s.kv_dim, s.k.data() + l * per_layer, per_layer * sizeof(float));
        std::memcpy(v_cache_.data() + l * n_ctx_ * s.kv_dim, s.v.data() + l * per_layer, per_layer * sizeof(float));
    }
    n_past_ = s.n_past;
}

std::string LlamaModel::variants() const {
    const Weight& w = layers_.empty() ? tok_embd_ : layers_[0].wq;
    std::string out = std::string("layers (") + evk::type_traits(w.type)->name + "): decode=" + w.decode.name +
                      " prefill=" + w.prefill.name + "; output (" + evk::type_traits(output_.type)->name +
                      "): decode=" + output_.decode.name + " prefill=" + output_.prefill.name +
                      "; attention=" + compute_.ops().attention_variant +
                      "; silu_mul=" + compute_.ops().silu_mul_variant + "; rmsnorm=" + compute_.ops().rmsnorm_variant +
                      "; rope=" + compute_.ops().rope_variant + "; add=" + compute_.ops().add_variant;
    return out;
}

}  // namespace evn
