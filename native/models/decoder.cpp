#include "decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "registry.h"

namespace evn {

namespace {

using Clock = std::chrono::steady_clock;

// Query rows (tokens x query heads) of one prefill attention call: the AVX-512 kernel works
// through them 6 at a time, each key and value row read once for all (causal_attention).
constexpr int64_t kAttentionRows = 24;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// The architecture is looked up first: an unsupported one is refused as such, before any of its
// keys is read (a missing key would read as a bad file).
DecoderConfig read_config(const GGUFFile& f) {
    find_decoder(f);
    DecoderConfig c;
    c.arch = f.get_string("general.architecture");
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
    if (c.n_head % c.n_head_kv != 0) f.fail(a + "attention.head_count_kv", "does not divide head_count");
    // The head size: attention.key_length where the file gives it (Gemma 3: 256 for a width of
    // 640), else the width split evenly over the heads.
    if (f.find(a + "attention.key_length")) {
        c.head_dim = pos_int(a + "attention.key_length", 1 << 12);
        if (c.q_dim() > (1 << 18)) f.fail(a + "attention.key_length", "head_count x key_length is out of range");
    } else {
        if (c.n_embd % c.n_head != 0) f.fail(a + "attention.head_count", "does not divide embedding_length");
        c.head_dim = c.n_embd / c.n_head;
    }
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

void check_ids(const int32_t* ids, int64_t n, int64_t n_vocab) {
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= n_vocab)
            throw std::invalid_argument("token id " + std::to_string(ids[i]) + " is outside the vocabulary [0, " +
                                        std::to_string(n_vocab) + ")");
}

}  // namespace

GatedLayerWeights load_gated_layer(const DecoderLoader& load, const DecoderConfig& cfg, int64_t layer) {
    const int64_t d = cfg.n_embd, qd = cfg.q_dim(), kvd = cfg.kv_dim(), ff = cfg.n_ff;
    const std::string p = "blk." + std::to_string(layer) + ".";
    GatedLayerWeights L;
    L.attn_norm = load.vector(p + "attn_norm.weight", d);
    L.ffn_norm = load.vector(p + "ffn_norm.weight", d);
    L.wq = load.matrix(p + "attn_q.weight", d, qd);
    L.wk = load.matrix(p + "attn_k.weight", d, kvd);
    L.wv = load.matrix(p + "attn_v.weight", d, kvd);
    L.wo = load.matrix(p + "attn_output.weight", qd, d);
    L.w_gate = load.matrix(p + "ffn_gate.weight", d, ff);
    L.w_up = load.matrix(p + "ffn_up.weight", d, ff);
    L.w_down = load.matrix(p + "ffn_down.weight", ff, d);
    return L;
}

Weight DecoderLoader::matrix(const std::string& name, int64_t cols, int64_t rows) const {
    Weight w = load_weight(f_, name, cols, rows, WeightUse::kBoth, &arena_);
    // A weight whose kernels both read a packed copy no longer needs its rows in memory (the token
    // embeddings map single rows back in on lookup): ~the model's size less resident.
    release_unused_rows(f_, w);
    return w;
}

Decoder::Decoder(std::shared_ptr<const GGUFFile> file, int n_threads, int64_t n_ctx, int64_t n_batch, evk::DType kv_type,
                 bool mtp)
    : file_(std::move(file)), cfg_(read_config(*file_)),
      n_ctx_(n_ctx > 0 ? std::min<int64_t>(n_ctx, cfg_.n_ctx_train) : std::min<int64_t>(cfg_.n_ctx_train, 4096)),
      n_batch_(std::max<int64_t>(1, n_batch)),
      // the MTP block's input projection reads rows of 2 n_embd
      compute_(n_threads, std::max({cfg_.n_embd, cfg_.n_ff, cfg_.q_dim(), mtp ? 2 * cfg_.n_embd : 0})), kv_type_(kv_type) {
    if (kv_type != evk::DType::F32 && kv_type != evk::DType::F16 && kv_type != evk::DType::Q8_0)
        throw std::invalid_argument("kv_type must be f32, f16 or q8_0");
    if (!evk::kv_type_fits(kv_type, cfg_.head_dim))
        throw std::invalid_argument(std::string("kv_type ") + (kv_type == evk::DType::F16 ? "f16" : "q8_0") +
                                    " is not supported for a head size of " +
                                    std::to_string(cfg_.head_dim) + " (it needs a multiple of 32, at most " +
                                    std::to_string(evk::kMaxAttentionHeadDim) + "): use f32");
    const GGUFFile& f = *file_;
    const DecoderFactory make = find_decoder(f);
    const DecoderLoader load(f, arena_, n_batch_, mtp);
    const int64_t d = cfg_.n_embd;
    tok_embd_ = load.matrix("token_embd.weight", d, cfg_.n_vocab);
    output_ = cfg_.tied_output ? tok_embd_ : load.matrix("output.weight", d, cfg_.n_vocab);
    output_norm_ = load.vector("output_norm.weight", d);
    arch_ = make(cfg_, load);

    auto alloc = [](std::vector<float>& v, int64_t n) { v.assign(static_cast<size_t>(n), 0.f); };
    const int64_t b = n_batch_, qd = cfg_.q_dim(), kvd = cfg_.kv_dim();
    alloc(s_.x, b * d);
    alloc(s_.xb, b * std::max(d, qd));
    alloc(s_.xb2, b * d);
    alloc(s_.q, b * qd);
    alloc(s_.k, b * kvd);
    alloc(s_.v, b * kvd);
    alloc(s_.att, b * qd);
    alloc(s_.hb, b * cfg_.n_ff);
    alloc(s_.hb2, b * cfg_.n_ff);
    alloc(s_.rope_cs, b * cfg_.rope_dims);
    // Per thread: the scores of the query rows of one causal_attention call (tokens x query heads:
    // at most kAttentionRows, or one group's heads, at most kMaxAttentionGroup) over the context.
    alloc(s_.scores, static_cast<int64_t>(compute_.threads()) *
                         std::max(kAttentionRows, std::min(cfg_.n_head / cfg_.n_head_kv, evk::kMaxAttentionGroup)) * n_ctx_);
    alloc(next_logits_, cfg_.n_vocab);
    alloc(spec_logits_, (1 + kMaxDraft) * cfg_.n_vocab);
    int64_t kv_bytes = 0, rec_floats = 0;
    for (int64_t l = 0; l < cfg_.n_layer; ++l) {
        const LayerShape sh = arch_->layer_shape(l);
        shapes_.push_back(sh);
        kv_at_.push_back(kv_bytes);
        rec_at_.push_back(rec_floats);
        kv_bytes += 2 * static_cast<int64_t>(evk::kv_bytes(kv_type_, n_ctx_ * sh.kv_dim));
        rec_floats += sh.recurrent;
    }
    kv_.assign(static_cast<size_t>(kv_bytes), 0);
    alloc(rec_, rec_floats);
    alloc(rec_check_, rec_floats);  // generate()'s copy of the recurrent state before a verification pass
    nextn_ = arch_->nextn();
    if (nextn_) {
        nextn_kv_.assign(2 * evk::kv_bytes(kv_type_, n_ctx_ * arch_->nextn_shape().kv_dim), 0);
        alloc(nextn_e_, b * d);
        alloc(nextn_h_, (b + 1) * d);
        alloc(nextn_cat_, b * 2 * d);
        alloc(draft_h_, d);
        alloc(draft_logits_, cfg_.n_vocab);
    }
}

Decoder::~Decoder() = default;

void Decoder::reset() {
    n_past_ = 0;
    std::fill(rec_.begin(), rec_.end(), 0.f);
    nextn_first_ = nextn_done_ = nextn_pending_ = 0;
    std::fill(nextn_h_.begin(), nextn_h_.end(), 0.f);  // no position before the first
}

// The block's pending rows are positions nextn_done_ .. nextn_done_ + nextn_pending_ - 1 that the
// decoder ran; before a chunk at pos0 the rows from pos0 on are dropped (the decoder runs them
// again: a verification pass's unconfirmed rows), and the rest run first when n more would not fit.
void Decoder::nextn_room(int64_t pos0, int64_t n) {
    if (pos0 < nextn_done_) {  // only a rollback below a flush could ask this; the block restarts there
        nextn_done_ = nextn_first_ = pos0;
        nextn_pending_ = 0;
        std::fill_n(nextn_h_.begin(), cfg_.n_embd, 0.f);
        return;
    }
    nextn_pending_ = std::min(nextn_pending_, pos0 - nextn_done_);
    if (nextn_pending_ + n > n_batch_) nextn_flush();
}

// The pending rows through the block, as one chunk (its cache then holds every position before
// nextn_done_).
void Decoder::nextn_flush() {
    const int64_t n = nextn_pending_, d = cfg_.n_embd, rd = cfg_.rope_dims;
    if (n == 0) return;
    const Chunk ch{n, nextn_done_, Compute::phase_for(n)};
    for (int64_t t = 0; t < n; ++t)
        evk::rope_angles(static_cast<float>(ch.pos0 + t) / cfg_.rope_scale, cfg_.rope_base, rd, &s_.rope_cs[t * rd]);
    DecoderContext ctx{cfg_, compute_, s_, n_ctx_};
    arch_->begin_chunk(ctx, ch);
    nextn_rows(ch, nextn_h_.data(), nullptr);
    std::copy_n(nextn_h_.begin() + n * d, d, nextn_h_.begin());  // the position before the next row
    nextn_done_ += n;
    nextn_pending_ = 0;
}

LayerCache Decoder::nextn_cache() {
    LayerCache c;
    c.kv_dim = arch_->nextn_shape().kv_dim;
    c.kv_type = kv_type_;
    c.k = nextn_kv_.data();
    c.v = c.k + evk::kv_bytes(kv_type_, n_ctx_ * c.kv_dim);
    c.head_dim = cfg_.head_dim;
    c.n_ctx = n_ctx_;
    c.first = nextn_first_;
    return c;
}

LayerCache Decoder::cache_of(int64_t layer) {
    const size_t l = static_cast<size_t>(layer);
    LayerCache c;
    c.kv_dim = shapes_[l].kv_dim;
    c.kv_type = kv_type_;
    if (c.kv_dim) {
        c.k = kv_.data() + kv_at_[l];
        c.v = c.k + evk::kv_bytes(kv_type_, n_ctx_ * c.kv_dim);
        c.head_dim = cfg_.head_dim;
        c.n_ctx = n_ctx_;
    }
    c.recurrent_size = shapes_[l].recurrent;
    if (c.recurrent_size) c.recurrent = rec_.data() + rec_at_[l];
    return c;
}

void Decoder::prefill(const PromptInput& p, float* logits, bool all_logits) {
    check_ids(p.ids, p.n, cfg_.n_vocab);
    for (int64_t i = 0; i < p.n_slots; ++i)
        if (p.slots[i] < (i ? p.slots[i - 1] + 1 : 0) || p.slots[i] >= p.n)
            throw std::invalid_argument("image slots must be increasing positions inside the prompt");
    if (p.n_slots > 0 && !p.features) throw std::invalid_argument("image slots without features");
    if (n_past_ + p.n > n_ctx_)
        throw std::length_error("context full: " + std::to_string(n_past_) + " + " + std::to_string(p.n) + " tokens > n_ctx " +
                                std::to_string(n_ctx_));
    const evk::Phase ph = p.decode_phase ? evk::kDecode : Compute::phase_for(p.n);
    for (int64_t c0 = 0; c0 < p.n; c0 += n_batch_) {
        const int64_t cn = std::min(n_batch_, p.n - c0);
        embed(p, c0, cn);
        const bool last_chunk = c0 + cn == p.n;
        float* out = !logits ? nullptr : all_logits ? logits + c0 * cfg_.n_vocab : last_chunk ? logits : nullptr;
        forward_chunk(Chunk{cn, n_past_, ph}, out, all_logits);
    }
}

// Rows c0 .. c0 + cn of the prompt into s.x: the token's embedding row (times embd_scale), or the
// image feature row where the position is a slot.
void Decoder::embed(const PromptInput& p, int64_t c0, int64_t cn) {
    const int64_t d = cfg_.n_embd;
    if (nextn_) nextn_room(n_past_, cn);  // first: running pending rows overwrites s.x
    for (int64_t i = 0; i < cn; ++i)
        evk::dequantize_row(tok_embd_.type,
                            static_cast<const char*>(tok_embd_.data) + static_cast<size_t>(p.ids[c0 + i]) * tok_embd_.row_bytes,
                            &s_.x[i * d], d);
    if (cfg_.embd_scale != 1.f)
        for (int64_t i = 0; i < cn * d; ++i) s_.x[i] *= cfg_.embd_scale;
    const int64_t* first = std::lower_bound(p.slots, p.slots + p.n_slots, c0);
    for (const int64_t* sl = first; sl != p.slots + p.n_slots && *sl < c0 + cn; ++sl)
        std::memcpy(&s_.x[(*sl - c0) * d], p.features + (sl - p.slots) * d, static_cast<size_t>(d) * sizeof(float));
    if (!nextn_) return;
    // The MTP block's input rows, after its pending ones: the same, unless it has token embeddings of its own.
    float* rows = nextn_e_.data() + nextn_pending_ * d;
    std::copy_n(s_.x.begin(), cn * d, rows);
    if (!nextn_->embed.data) return;
    for (int64_t i = 0; i < cn; ++i)
        if (!std::binary_search(p.slots, p.slots + p.n_slots, c0 + i)) {
            const Weight& e = nextn_->embed;
            evk::dequantize_row(e.type, static_cast<const char*>(e.data) + static_cast<size_t>(p.ids[c0 + i]) * e.row_bytes,
                                rows + i * d, d);
            for (int64_t j = 0; j < d; ++j) rows[i * d + j] *= cfg_.embd_scale;
        }
}

void Decoder::nextn_rows(const Chunk& ch, const float* h_prev, float* h_out) {
    const evk::OpTable& op = compute_.ops();
    const int64_t n = ch.n, d = cfg_.n_embd;
    const float eps = cfg_.rms_eps;
    compute_.rows(n, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            op.rmsnorm(&nextn_e_[t * d], nextn_->enorm.data(), &nextn_cat_[t * 2 * d], d, eps);
            op.rmsnorm(&h_prev[t * d], nextn_->hnorm.data(), &nextn_cat_[t * 2 * d + d], d, eps);
        }
    });
    compute_.matmul(nextn_->eh_proj, nextn_cat_.data(), n, s_.x.data(), ch.phase);
    DecoderContext ctx{cfg_, compute_, s_, n_ctx_};
    arch_->nextn_layer(ctx, ch, nextn_cache());
    if (!h_out) return;
    const std::vector<float>& norm = nextn_->head_norm.empty() ? output_norm_ : nextn_->head_norm;
    for (int64_t t = 0; t < n; ++t) op.rmsnorm(&s_.x[t * d], norm.data(), &h_out[t * d], d, eps);
}

int64_t Decoder::draft_nextn(int32_t token, int64_t k, const std::vector<int32_t>& stop_ids, int32_t* out, float* logits) {
    if (!nextn_) throw std::invalid_argument("no multi-token-prediction block is loaded (a file with one, mtp on)");
    check_ids(&token, 1, cfg_.n_vocab);
    const int64_t d = cfg_.n_embd, V = cfg_.n_vocab, rd = cfg_.rope_dims;
    k = std::min(k, n_ctx_ - n_past_);
    nextn_room(n_past_, 0);
    nextn_flush();  // the block's cache now holds every position before n_past, row 0 the hidden state of n_past - 1
    const Weight& e = nextn_->embed.data ? nextn_->embed : tok_embd_;
    const Weight& head = nextn_->head.data ? nextn_->head : output_;
    std::copy_n(nextn_h_.begin(), d, draft_h_.begin());
    DecoderContext ctx{cfg_, compute_, s_, n_ctx_};
    int64_t j = 0;
    for (; j < k; ++j) {
        const int64_t pos = n_past_ + j;
        evk::dequantize_row(e.type, static_cast<const char*>(e.data) + static_cast<size_t>(token) * e.row_bytes,
                            nextn_e_.data(), d);
        if (cfg_.embd_scale != 1.f)
            for (int64_t i = 0; i < d; ++i) nextn_e_[i] *= cfg_.embd_scale;
        evk::rope_angles(static_cast<float>(pos) / cfg_.rope_scale, cfg_.rope_base, rd, s_.rope_cs.data());
        const Chunk ch{1, pos, evk::kDecode};
        arch_->begin_chunk(ctx, ch);
        nextn_rows(ch, draft_h_.data(), draft_h_.data());
        compute_.matmul(head, draft_h_.data(), d, 1, draft_logits_.data(), V, evk::kDecode);
        if (logits) std::copy_n(draft_logits_.begin(), V, logits + j * V);
        token = static_cast<int32_t>(compute_.ops().argmax(draft_logits_.data(), V));
        if (std::find(stop_ids.begin(), stop_ids.end(), token) != stop_ids.end()) break;
        out[j] = token;
    }
    return j;
}

// One chunk of tokens already embedded in s.x, through every layer, then (when logits is given)
// the final norm and the output head.
void Decoder::forward_layers(const Chunk& ch, float* logits, bool all_logits) {
    const evk::OpTable& op = compute_.ops();
    const int64_t n = ch.n, d = cfg_.n_embd, rd = cfg_.rope_dims;
    DecoderContext ctx{cfg_, compute_, s_, n_ctx_};
    // The rotation angles of each token's position, once for all layers (a cos, sin and pow per
    // pair per head per layer were ~3% of a decode step).
    for (int64_t t = 0; t < n; ++t)
        evk::rope_angles(static_cast<float>(ch.pos0 + t) / cfg_.rope_scale, cfg_.rope_base, rd, &s_.rope_cs[t * rd]);
    arch_->begin_chunk(ctx, ch);
    for (int64_t l = 0; l < cfg_.n_layer; ++l) arch_->layer(ctx, l, ch, cache_of(l));
    n_past_ += n;
    if (!logits) return;
    const int64_t first = all_logits ? 0 : n - 1;
    for (int64_t t = first; t < n; ++t) op.rmsnorm(&s_.x[t * d], output_norm_.data(), &s_.xb[t * d], d, cfg_.rms_eps);
    // The last token's logits alone: one token through the head, bandwidth-bound, the decode
    // kernel's job (a prefill GEMM expanded Gemma 3's whole 178 MB head to float panels for one
    // token: ~20 of 45 ms after a prefix cache; docs/kernels/prefill-head.md). Every position's
    // logits (scoring a prompt) stay a prefill product like the layers'.
    compute_.matmul(output_, &s_.xb[first * d], d, n - first, logits, cfg_.n_vocab, all_logits ? ch.phase : evk::kDecode);
}

void Decoder::forward_chunk(const Chunk& ch, float* logits, bool all_logits) {
    forward_layers(ch, logits, all_logits);
    if (!nextn_) return;
    // The MTP block runs the chunk's positions too (its cache must hold what a draft attends to):
    // row t pairs the token at pos0 + t with the decoder's final-normed hidden state at pos0 + t - 1.
    // They wait as pending rows (embed() put their inputs there) and run as one chunk before the
    // next draft (draft_nextn) or when the rows fill n_batch: one weight read for many positions
    // instead of a one-row step beside every decoded token.
    const evk::OpTable& op = compute_.ops();
    const int64_t n = ch.n, d = cfg_.n_embd;
    float* h = nextn_h_.data() + (1 + nextn_pending_) * d;
    compute_.rows(n, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) op.rmsnorm(&s_.x[t * d], output_norm_.data(), h + t * d, d, cfg_.rms_eps);
    });
    nextn_pending_ += n;
}

void append_kv(DecoderContext& c, const LayerCache& cache, const Chunk& ch) {
    const int64_t kvd = cache.kv_dim, hd = cache.head_dim;
    // F32: a copy; F16: round to nearest even; Q8_0: the reference quantizer (blocks of 32 within a
    // head: the same blocks as over the whole row).
    const evk::FromFloatFn convert = evk::type_traits(cache.kv_type)->from_float;
    for (int64_t t = 0; t < ch.n; ++t)
        for (int64_t h = 0; h < kvd / hd; ++h) {
            convert(&c.s.k[t * kvd + h * hd], cache.k + cache.at(h, ch.pos0 + t), hd);
            convert(&c.s.v[t * kvd + h * hd], cache.v + cache.at(h, ch.pos0 + t), hd);
        }
}

// How many parts the query heads of a kv head's group are split into for causal_attention: as few
// as possible (each part reads the kv head's keys and values once), but enough that there are as
// many work items as threads, no part exceeds kMaxAttentionGroup heads, and, where there are few
// items, their count is a multiple of the threads: SmolLM2's decode, 3 kv heads of 3 query heads on
// 2 threads, splits each group in 2 (6 items) rather than leave a thread idle for a third of the
// attention (docs/kernels/decode-attention.md: at 1k positions 7.65 -> 6.40 ms a token for f32).
static int64_t attention_parts(int64_t group, int64_t n_tokens, int64_t n_kv_heads, int64_t threads) {
    const int64_t items = n_tokens * n_kv_heads;
    int64_t parts = std::max<int64_t>((group + evk::kMaxAttentionGroup - 1) / evk::kMaxAttentionGroup,
                                      (threads + items - 1) / items);
    if (items < 4 * threads)
        while (parts < group && items * parts % threads != 0) ++parts;
    return std::min(parts, group);
}

// Tokens of one attention call: as many as keep the call's query rows within kAttentionRows,
// while the calls still number 4 per thread (the later tokens of a chunk cost more: causal).
static int64_t attention_tokens(int64_t rows_per_token, int64_t n_tokens, int64_t items_per_token, int64_t threads) {
    int64_t tile = std::max<int64_t>(1, std::min(n_tokens, kAttentionRows / rows_per_token));
    while (tile > 1 && (n_tokens + tile - 1) / tile * items_per_token < 4 * threads) tile = (tile + 1) / 2;
    return tile;
}

// Grouped-query attention for the chunk's queries; work items are (tokens, kv head, part of its
// group): one attention call per item, its query heads (AttentionArgs::n_q) and in prefill
// several consecutive tokens (n_tok) sharing each key and value row read. A head's result does not
// depend on the grouping, a token's not on the tokens beside it (the kernels' contract).
void causal_attention(DecoderContext& c, const LayerCache& cache, const Chunk& ch, int64_t window, float scale) {
    const DecoderConfig& cfg = c.cfg;
    const evk::AttentionFn fn = c.compute.ops().attention;
    const int64_t hd = cfg.head_dim, qd = cfg.q_dim();
    const int64_t n_kvh = cfg.n_head_kv, group = cfg.n_head / n_kvh;
    const int64_t parts = attention_parts(group, ch.n, n_kvh, c.compute.threads());
    const int64_t per_tile = n_kvh * parts;
    const int64_t tile = attention_tokens((group + parts - 1) / parts, ch.n, per_tile, c.compute.threads());
    const int64_t scores_per_thread = static_cast<int64_t>(c.s.scores.size()) / c.compute.threads();
    if (scale == 0.f) scale = 1.f / std::sqrt(static_cast<float>(hd));
    auto body = [&](int64_t item, int t) {
        const int64_t tok = item / per_tile * tile, kvh = item % per_tile / parts, part = item % parts;
        const int64_t h0 = kvh * group + part * group / parts, h1 = kvh * group + (part + 1) * group / parts;
        const int64_t end = ch.pos0 + tok + 1, begin = std::max<int64_t>(cache.first, window > 0 ? end - window : 0);
        evk::AttentionArgs a{};
        a.q = &c.s.q[tok * qd + h0 * hd];
        a.k = cache.k + cache.at(kvh, begin);
        a.v = cache.v + cache.at(kvh, begin);
        a.k_stride = a.v_stride = hd;
        a.kv_type = cache.kv_type;
        a.n_kv = end - begin;
        a.head_dim = hd;
        a.scale = scale;
        a.out = &c.s.att[tok * qd + h0 * hd];
        a.n_q = h1 - h0;
        a.q_stride = hd;
        a.scores = c.s.scores.data() + static_cast<int64_t>(t) * scores_per_thread;
        a.n_tok = std::min(tile, ch.n - tok);
        a.tok_stride = qd;
        a.window = window;
        fn(a);
    };
    c.compute.pool().run((ch.n + tile - 1) / tile * per_tile, body);
}

namespace {

// The tokens that follow the latest occurrence of `tail` (len ids) in seq[0, end), up to -1, a stop
// id or max_k of them (the following ids may run on past `end`, up to n), into out; how many.
int64_t follow(const int32_t* tail, int64_t len, const int32_t* seq, int64_t end, int64_t n,
               const std::vector<int32_t>& stop_ids, int64_t max_k, int32_t* out) {
    for (int64_t at = end - len; at >= 0; --at) {  // latest occurrence first; a token must follow it
        if (at + len >= n || !std::equal(tail, tail + len, seq + at)) continue;
        int64_t k = 0;
        for (int64_t j = at + len; j < n && k < max_k; ++j) {
            const int32_t t = seq[j];
            if (t < 0 || std::find(stop_ids.begin(), stop_ids.end(), t) != stop_ids.end()) break;
            out[k++] = t;
        }
        if (k > 0) return k;
    }
    return 0;
}

// How many drafts generate()'s next verification pass runs: the k (0..kMaxDraft) that maximises
// the tokens a pass is expected to give per unit of time, (1 + p + ... + p^k) / cost(k), where p is
// the chance that a draft is accepted given the one before it was (counts of this call's passes,
// decayed, with a prior of 1/2) and cost(k) the measured time of a (1 + k)-row pass over a one-row
// step's (PassCosts). So where extra rows cost little (the x86 decode kernels read the weights once
// for up to 8 rows) long drafts run as soon as they tend to be right, and where each row costs
// nearly a step (kernels that stream the weights per token) drafts run only when nearly all are
// accepted. When no k pays, a 1-draft pass still runs every `probe`th token, to notice when drafts
// start to fit again. Drafts that cost a step of their own (the MTP block's: draft_nextn) add that
// cost, `per_draft` one-row steps each, and with `backoff` each probe that fails doubles the wait
// for the next (up to 8 x probe; an accepted draft resets it). Only the speed depends on this
// choice: the tokens are greedy's whatever it is.
class DraftPolicy {
public:
    explicit DraftPolicy(const PassCosts& costs, int64_t probe = 8, bool backoff = false)
        : costs_(costs), base_(probe), probe_(probe), backoff_(backoff) {}
    int64_t want(int64_t since_pass, double per_draft = 0) const {
        const double p = (accepted_ + 1.0) / (examined_ + 2.0);
        int64_t best = 0;
        double best_gain = 1.0, expect = 1.0, pk = 1.0;
        for (int64_t k = 1; k <= kMaxDraft; ++k) {
            pk *= p;
            expect += pk;
            const double gain = expect / (costs_.cost(k) + static_cast<double>(k) * per_draft);
            if (gain > best_gain * 1.02) {  // a clear gain, not noise in the measured costs
                best = k;
                best_gain = gain;
            }
        }
        return best > 0 ? best : since_pass >= probe_ ? 1 : 0;
    }
    // A pass of 1 + n_draft rows ended with next_draft of its drafts accepted.
    void pass(int64_t n_draft, int64_t next_draft) {
        if (backoff_) probe_ = next_draft > 0 ? base_ : std::min(2 * probe_, 8 * base_);
        accepted_ = 0.7 * accepted_ + static_cast<double>(next_draft);
        examined_ = 0.7 * examined_ + static_cast<double>(next_draft + (next_draft < n_draft ? 1 : 0));
    }

private:
    const PassCosts& costs_;
    int64_t base_, probe_;
    bool backoff_;
    double accepted_ = 0, examined_ = 0;
};

}  // namespace

// A running mean that one slow pass (the OS took a core away) cannot throw: a sample counts for at
// most 1.5x the current estimate (or, for a row count not measured yet, the prior 1 + (rows-1)/10
// one-row steps). Without the bound, one 5x outlier on a row count that runs rarely kept the
// policy off it for the rest of a bench run.
void PassCosts::timed(int64_t rows, double t) {
    double& m = ms[static_cast<size_t>(rows)];
    const double ref = m > 0 ? m : ms[1] > 0 ? ms[1] * (1.0 + 0.1 * static_cast<double>(rows - 1)) : 0.0;
    if (ref > 0) t = std::min(t, 1.5 * ref);
    m = m > 0 ? 0.8 * m + 0.2 * t : t;
}

void PassCosts::draft_timed(double t) {
    if (draft_ms > 0) t = std::min(t, 1.5 * draft_ms);
    draft_ms = draft_ms > 0 ? 0.8 * draft_ms + 0.2 * t : t;
}

double PassCosts::draft_cost() const { return ms[1] > 0 && draft_ms > 0 ? draft_ms / ms[1] : 0.5; }

double PassCosts::cost(int64_t k) const {
    const double one = ms[1], many = ms[static_cast<size_t>(1 + k)];
    return one > 0 && many > 0 ? std::max(1.0, many / one) : 1.0 + 0.1 * static_cast<double>(k);
}

int64_t propose_drafts(const std::vector<int32_t>& tokens, const std::vector<int32_t>& lookup, const int32_t* prompt,
                       int64_t n_prompt, const std::vector<int32_t>& stop_ids, int64_t max_k, int32_t* out) {
    if (max_k <= 0 || tokens.empty()) return 0;
    const int64_t n = static_cast<int64_t>(lookup.size()), nt = static_cast<int64_t>(tokens.size());
    // The longest tail (up to 5 ids) that occurs there: a longer match picks the right one of several
    // places a short tail occurs (the demo VLM's drift stream, simulated on its captions: 1.5-2% fewer
    // pass costs than with tails of at most 3).
    for (int64_t len = std::min<int64_t>(5, nt); len >= 1; --len)
        if (const int64_t k = follow(tokens.data() + nt - len, len, lookup.data(), n, n, stop_ids, max_k, out)) return k;
    // n-grams of the answer so far (an earlier occurrence: it ends before the tail starts), then of
    // the prompt; a single id is too weak a match there.
    for (int64_t len = std::min<int64_t>(3, nt); len >= 2; --len) {
        const int32_t* tail = tokens.data() + nt - len;
        if (const int64_t k = follow(tail, len, tokens.data(), nt - 1, nt, stop_ids, max_k, out)) return k;
        if (prompt && n_prompt > 0)
            if (const int64_t k = follow(tail, len, prompt, n_prompt, n_prompt, stop_ids, max_k, out)) return k;
    }
    return 0;
}

void Decoder::generate(const PromptInput& p, int64_t max_new, const std::vector<int32_t>& stop_ids, double max_ms,
                       GenerateResult& out, TokenConstraint* constraint, const std::vector<int32_t>* lookup) {
    if (p.n < 1) throw std::invalid_argument("generate needs a prompt: the first token comes from its last position");
    if (lookup)
        for (const int32_t t : *lookup)
            if (t < -1 || t >= cfg_.n_vocab)
                throw std::invalid_argument("lookup ids must be token ids (0.." + std::to_string(cfg_.n_vocab - 1) +
                                            ") or -1 between answers, got " + std::to_string(t));
    out.spec_passes = out.spec_drafted = out.spec_accepted = 0;
    const Clock::time_point t0 = Clock::now();
    out.tokens.clear();
    // Never more tokens than the context can still hold: a huge budget must not become a huge
    // reservation (the loop stops with "context_full" first).
    out.tokens.reserve(static_cast<size_t>(std::clamp<int64_t>(max_new, 0, n_ctx_ - n_past_ + 1)));
    // progress() readers see this buffer until the call ends (it never grows past the reservation).
    struct Publish {
        Decoder& d;
        Publish(Decoder& dec, const int32_t* data) : d(dec) {
            std::lock_guard<std::mutex> lock(d.progress_mu_);
            d.progress_n_.store(0, std::memory_order_relaxed);
            d.progress_data_ = data;
        }
        ~Publish() {
            std::lock_guard<std::mutex> lock(d.progress_mu_);
            d.progress_data_ = nullptr;
            d.progress_n_.store(0, std::memory_order_relaxed);
        }
        Publish(const Publish&) = delete;
        Publish& operator=(const Publish&) = delete;
    } publish(*this, out.tokens.data());
    const size_t capacity = out.tokens.capacity();
    out.n_prompt = p.n;
    out.stop_reason = "max_tokens";
    prefill(p, next_logits_.data(), false);
    out.prefill_ms = ms_since(t0);
    const Clock::time_point t1 = Clock::now();
    // The most tokens this call can produce: the budget, and the context's room (the first token
    // comes from the prefill's logits, each later one needs a position).
    if (constraint) constraint->start(std::min<int64_t>(max_new, n_ctx_ - n_past_ + 1));
    const int64_t V = cfg_.n_vocab;
    // drafts_from given (even empty: n-grams of the prompt and the answer are drafts too)
    const bool speculate = lookup && !constraint;
    const int64_t base = n_past_;  // generated token j sits at position base + j
    int64_t n_fed = 0;             // generated tokens whose keys and values are in the cache, confirmed
    // The drafts the last verification pass ran after the token it decoded, not yet confirmed:
    // draft[j] sits at position base + n_fed + (j - next_draft) and its logits are row 1 + j.
    std::array<int32_t, kMaxDraft> draft{};
    int64_t n_draft = 0, next_draft = 0, since_pass = 0;
    // A decoder with recurrent state (Qwen3.5) cannot forget a rejected draft by length: its state
    // has advanced through every row of the pass. So the state is copied before each pass and, when
    // fewer rows are confirmed than ran, put back and advanced through the confirmed rows alone
    // (a decode-phase chunk of 1 to kMaxDraft rows, whose rows compute as one-row steps do).
    const bool recurrent = !rec_.empty();
    std::array<int32_t, 1 + kMaxDraft> pass_rows{};
    int64_t pass_pos0 = 0;
    auto settle_pass = [&] {  // the last pass's unconfirmed rows out of the recurrent state
        if (!recurrent || n_draft == 0 || next_draft == n_draft) return;
        std::copy(rec_check_.begin(), rec_check_.end(), rec_.begin());
        n_past_ = pass_pos0;
        prefill(PromptInput{pass_rows.data(), 1 + next_draft, nullptr, nullptr, 0, true}, nullptr, false);
    };
    // Drafts from the MTP block (draft_nextn) where the lookup proposes none: their own policy (their
    // acceptance is the block's, not the lookup's), probing every 16th token when none pays, less
    // often while its probes fail (a probe costs a draft step and a 2-row pass: ~0.5 one-row steps).
    const bool nextn_drafts = nextn_ && !constraint;
    DraftPolicy policy(pass_costs_), nextn_policy(pass_costs_, 16, true);
    bool pass_from_nextn = false;
    int64_t since_nextn = 0;
    const float* logits = next_logits_.data();
    for (int64_t i = 0; i < max_new; ++i) {
        // Greedy: the first maximum wins ties, as torch.argmax does (among the allowed tokens).
        const int32_t next = constraint
            ? constraint->choose(logits, V, stop_ids)
            : static_cast<int32_t>(compute_.ops().argmax(logits, V));
        if (next < 0) {
            out.stop_reason = "complete";
            break;
        }
        if (std::find(stop_ids.begin(), stop_ids.end(), next) != stop_ids.end()) {
            out.stop_reason = "stop_token";
            break;
        }
        if (out.tokens.size() == capacity) {  // cannot happen (the loop stops at context_full first)
            out.stop_reason = "context_full";
            break;
        }
        out.tokens.push_back(next);
        progress_n_.store(static_cast<int64_t>(out.tokens.size()), std::memory_order_release);
        if (constraint) {
            constraint->advance(next);
            if (constraint->complete()) {
                out.stop_reason = "complete";
                break;
            }
        }
        if (i + 1 == max_new) break;  // the budget is spent: no need to run the last token
        if (cancelled()) {
            out.stop_reason = "cancelled";
            break;
        }
        if (max_ms > 0 && ms_since(t0) >= max_ms) {
            out.stop_reason = "deadline";
            break;
        }
        if (next_draft < n_draft && draft[static_cast<size_t>(next_draft)] == next) {
            // The token is the draft the last pass ran at its position: its logits are ready.
            logits = spec_logits_.data() + (1 + next_draft) * V;
            ++next_draft;
            ++n_fed;
            ++out.spec_accepted;
            continue;
        }
        if (n_draft > 0) (pass_from_nextn ? nextn_policy : policy).pass(n_draft, next_draft);  // a pass whose drafts end here
        settle_pass();
        n_draft = next_draft = 0;
        n_past_ = base + n_fed;  // the cache forgets the drafts that were not confirmed
        if (n_past_ + 1 > n_ctx_) {
            out.stop_reason = "context_full";
            break;
        }
        int64_t k = 0;
        if (speculate) {
            k = propose_drafts(out.tokens, *lookup, p.ids, p.n, stop_ids,
                               std::min({policy.want(since_pass), max_new - i - 2, n_ctx_ - n_past_ - 1}), draft.data());
        }
        since_pass = k > 0 ? 0 : since_pass + 1;
        pass_from_nextn = false;
        if (k == 0 && nextn_drafts) {
            const int64_t want = std::min({nextn_policy.want(since_nextn, pass_costs_.draft_cost()), max_new - i - 2,
                                           n_ctx_ - n_past_ - 1});
            if (want > 0) {
                const Clock::time_point td = Clock::now();  // the block's waiting rows, then its steps
                k = draft_nextn(next, want, stop_ids, draft.data(), nullptr);
                pass_costs_.draft_timed(ms_since(td) / static_cast<double>(std::min(want, k + 1)));
                pass_from_nextn = k > 0;
            }
            since_nextn = want > 0 ? 0 : since_nextn + 1;
        }
        const Clock::time_point tp = Clock::now();
        if (k == 0) {
            prefill(PromptInput{&next, 1}, next_logits_.data(), false);
            logits = next_logits_.data();
            if (speculate || nextn_drafts) pass_costs_.timed(1, ms_since(tp));
        } else {
            pass_rows[0] = next;
            std::copy(draft.begin(), draft.begin() + k, pass_rows.begin() + 1);
            if (recurrent) {
                std::copy(rec_.begin(), rec_.end(), rec_check_.begin());
                pass_pos0 = n_past_;
            }
            prefill(PromptInput{pass_rows.data(), 1 + k, nullptr, nullptr, 0, true}, spec_logits_.data(), true);
            pass_costs_.timed(1 + k, ms_since(tp));
            logits = spec_logits_.data();
            n_draft = k;
            ++out.spec_passes;
            out.spec_drafted += k;
        }
        ++n_fed;
    }
    settle_pass();           // a pass the loop left with rows it did not confirm
    n_past_ = base + n_fed;  // as plain decoding leaves it: drafts not confirmed are forgotten
    out.decode_ms = ms_since(t1);
}

void Decoder::progress(std::vector<int32_t>& dst) const {
    std::lock_guard<std::mutex> lock(progress_mu_);
    if (!progress_data_) return;
    const int64_t n = progress_n_.load(std::memory_order_acquire);
    dst.insert(dst.end(), progress_data_, progress_data_ + n);
}

KVSnapshot Decoder::snapshot() const {
    KVSnapshot s;
    s.n_past = n_past_;
    for (const LayerShape& sh : shapes_)
        if (sh.kv_dim) {
            ++s.n_layer;
            s.kv_dim = sh.kv_dim;
        }
    const size_t per_layer = static_cast<size_t>(n_past_ * s.kv_dim);
    s.k.resize(per_layer * static_cast<size_t>(s.n_layer));
    s.v.resize(s.k.size());
    s.recurrent = rec_;
    // The cache is head-major (LayerCache); a snapshot is position-major, [pos][kv_dim] per layer.
    const evk::ToFloatFn convert = evk::type_traits(kv_type_)->to_float;
    const int64_t hd = cfg_.head_dim, n_kvh = s.kv_dim / (hd ? hd : 1);
    std::vector<float> head(static_cast<size_t>(n_past_ * hd));
    size_t i = 0;
    for (size_t l = 0; l < shapes_.size(); ++l) {
        if (!shapes_[l].kv_dim) continue;
        const uint8_t* k = kv_.data() + kv_at_[l];
        const uint8_t* v = k + evk::kv_bytes(kv_type_, n_ctx_ * s.kv_dim);
        for (int64_t h = 0; h < n_kvh && n_past_ > 0; ++h)
            for (int side = 0; side < 2; ++side) {
                convert((side ? v : k) + kv_head_offset(kv_type_, n_ctx_, hd, h, 0), head.data(), n_past_ * hd);
                float* dst = (side ? s.v : s.k).data() + i * per_layer + h * hd;
                for (int64_t p = 0; p < n_past_; ++p)
                    std::copy_n(head.data() + p * hd, hd, dst + p * s.kv_dim);
            }
        ++i;
    }
    return s;
}

size_t Decoder::kv_bytes_per_token() const {
    size_t n = 0;
    for (const LayerShape& sh : shapes_) n += 2 * evk::kv_bytes(kv_type_, sh.kv_dim);
    return n;
}

void Decoder::restore(const KVSnapshot& s) {
    int64_t cached = 0;
    bool uniform = true;
    for (const LayerShape& sh : shapes_)
        if (sh.kv_dim) {
            ++cached;
            uniform = uniform && sh.kv_dim == s.kv_dim;
        }
    const size_t per_layer = static_cast<size_t>(s.n_past * s.kv_dim);
    if (s.n_layer != cached || !uniform || s.n_past < 0 || s.n_past > n_ctx_ ||
        s.k.size() != per_layer * static_cast<size_t>(s.n_layer) || s.v.size() != s.k.size() ||
        s.recurrent.size() != rec_.size())
        throw std::invalid_argument("KV snapshot does not fit this model (layers, width or context differ)");
    const evk::FromFloatFn convert = evk::type_traits(kv_type_)->from_float;
    const int64_t hd = cfg_.head_dim, n_kvh = s.kv_dim / (hd ? hd : 1);
    std::vector<float> head(static_cast<size_t>(s.n_past * hd));
    size_t i = 0;
    for (size_t l = 0; l < shapes_.size(); ++l) {
        if (!shapes_[l].kv_dim) continue;
        const LayerCache c = cache_of(static_cast<int64_t>(l));
        for (int64_t h = 0; h < n_kvh && s.n_past > 0; ++h)
            for (int side = 0; side < 2; ++side) {
                const float* src = (side ? s.v : s.k).data() + i * per_layer + h * hd;
                for (int64_t p = 0; p < s.n_past; ++p) std::copy_n(src + p * s.kv_dim, hd, head.data() + p * hd);
                convert(head.data(), (side ? c.v : c.k) + c.at(h, 0), s.n_past * hd);
            }
        ++i;
    }
    std::copy(s.recurrent.begin(), s.recurrent.end(), rec_.begin());
    n_past_ = s.n_past;
    // A snapshot has no MTP cache: the block attends from here on, its first hidden input zeros.
    nextn_first_ = nextn_done_ = n_past_;
    nextn_pending_ = 0;
    std::fill(nextn_h_.begin(), nextn_h_.end(), 0.f);
}

void residual_swiglu_ffn(DecoderContext& c, const Chunk& ch, const std::vector<float>& norm, const Weight& w_gate,
                         const Weight& w_up, const Weight& w_down) {
    const evk::OpTable& op = c.compute.ops();
    RunState& s = c.s;
    const int64_t n = ch.n, d = c.cfg.n_embd, ff = c.cfg.n_ff;
    const float eps = c.cfg.rms_eps;
    // x += the mixer's output, then the feed-forward block's input norm(x), a row at a time
    c.compute.rows(n, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            op.add(&s.x[t * d], &s.xb2[t * d], d);
            op.rmsnorm(&s.x[t * d], norm.data(), &s.xb[t * d], d, eps);
        }
    });
    const Compute::MatmulJob gate_up[2] = {{&w_gate, s.hb.data(), ff}, {&w_up, s.hb2.data(), ff}};
    c.compute.matmul_batch(gate_up, 2, s.xb.data(), d, n, ch.phase);
    c.compute.rows(n, [&](int64_t t0, int64_t t1) { op.silu_mul(&s.hb[t0 * ff], &s.hb2[t0 * ff], (t1 - t0) * ff); });
    c.compute.matmul(w_down, s.hb.data(), n, s.xb2.data(), ch.phase);
    c.compute.rows(n, [&](int64_t t0, int64_t t1) { op.add(&s.x[t0 * d], &s.xb2[t0 * d], (t1 - t0) * d); });
}

std::string layer_variants(const Weight& w) {
    return std::string("layers (") + evk::type_traits(w.type)->name + "): decode=" + w.decode.name + " prefill=" + w.prefill.name;
}

std::string Decoder::variants() const {
    const evk::OpTable& op = compute_.ops();
    return arch_->variants(op) + "; output (" + evk::type_traits(output_.type)->name + "): decode=" + output_.decode.name +
           " prefill=" + output_.prefill.name + "; attention=" + op.attention_variant + "; silu_mul=" +
           op.silu_mul_variant + "; rmsnorm=" + op.rmsnorm_variant + "; rope=" + op.rope_variant + "; add=" +
           op.add_variant;
}

}  // namespace evn
