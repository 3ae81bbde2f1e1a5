// MiniCPM-V 4.6's vision side (openbmb; transformers' models/minicpmv4_6), on a SigLIP so400m tower
// run at each slice's own patch grid (gh x gw, both even):
//   x = conv_patch(pixels) + b + pos[bucket(i, j)]      (a B x B table, row i*B/gh, column j*B/gw)
//   layers 0 .. insert_layer_id                          (gh*gw tokens)
//   WindowMerger (16x only): attention inside each 2x2 window, then each window's four tokens
//     concatenated -> LN -> W_up -> gelu_tanh -> W_down, plus their mean: gh*gw/4 tokens
//   the remaining layers on those tokens, post LN
//   DownsampleMLP: 2x2 neighbours concatenated -> LN -> W_up -> gelu (erf) -> W_down (decoder width)
// 16x: 64 tokens per 448 px slice; 4x (no window merger): 256. Read from llama.cpp's mmproj layout
// (clip.projector_type minicpmv4_6; the merger's layer in clip.vision.wa_layer_indexes; the mode
// in clip.vision.projector.scale_factor: 4 for 16x, 2 for 4x).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "registry.h"
#include "siglip.h"

namespace evn {

namespace {

// f(i, thread) for i in [0, n) over the pool (one chunk per row or window: each is independent).
template <class F> void each(ThreadPool& pool, int64_t n, F&& f) { pool.run(n, f); }

Weight matrix(const GGUFFile& f, PackArena& arena, const VisionConfig& cfg, const std::string& name, int64_t cols,
              int64_t rows) {
    Weight w = load_weight(f, name, cols, rows, cfg.weight_use(), &arena);
    release_unused_rows(f, w);
    return w;
}

// llama.cpp's layout makes these biases optional: absent is zero.
std::vector<float> bias_or_zero(const GGUFFile& f, const std::string& name, int64_t n) {
    if (f.find_tensor(name)) return load_vector(f, name, n);
    return std::vector<float>(static_cast<size_t>(n), 0.f);
}

// dst row 4*w + 2*a + b = src token (2*wy + a, 2*wx + b) of the gh x gw grid, w = wy * gw/2 + wx: each
// 2x2 window's tokens contiguous (so m = gh*gw/4 rows of 4*d are the windows concatenated), windows
// row-major over the half grid (the order transformers' window index and merger reshape both give).
void gather_windows(ThreadPool& pool, const float* src, int64_t gh, int64_t gw, int64_t d, float* dst) {
    const int64_t hw = gw / 2, m = (gh / 2) * hw;
    each(pool, m, [&](int64_t w, int) {
        const int64_t wy = w / hw, wx = w % hw;
        for (int64_t r = 0; r < 4; ++r) {
            const int64_t t = (2 * wy + r / 2) * gw + 2 * wx + r % 2;
            std::memcpy(dst + (4 * w + r) * d, src + t * d, static_cast<size_t>(d) * sizeof(float));
        }
    });
}

void layernorm_rows(Compute& c, const float* x, const std::vector<float>& w, const std::vector<float>& b, float* dst,
                    int64_t rows, int64_t width, float eps) {
    const evk::OpTable& op = c.ops();
    each(c.pool(), rows, [&](int64_t r, int) { op.layernorm(x + r * width, w.data(), b.data(), dst + r * width, width, eps); });
}

// y += bias on every row, over the pool.
void add_bias(Compute& c, float* y, const std::vector<float>& bias, int64_t rows) {
    const evk::OpTable& op = c.ops();
    const int64_t width = static_cast<int64_t>(bias.size());
    each(c.pool(), rows, [&](int64_t r, int) { op.add(y + r * width, bias.data(), width); });
}

// The window-attention merger after layer insert_layer_id: n tokens in, n/4 out (16x mode only).
class WindowMerger {
public:
    WindowMerger(const VisionConfig& cfg, const GGUFFile& f, PackArena& arena, int64_t max_tokens)
        : d_(cfg.n_embd), n_head_(cfg.n_head), eps_(cfg.eps) {
        const std::string p = "v.vit_merger.";
        const TensorInfo* up = f.find_tensor(p + "ds_ffn_up.weight");
        if (!up || up->n_dims != 2 || up->ne[0] != 4 * d_ || up->ne[1] < 1 || up->ne[1] > (1 << 18))
            f.fail(p + "ds_ffn_up.weight", "missing, or not a (4 * embedding length) x (1 .. 262144) matrix");
        wi_ = up->ne[1];
        if ((max_tokens / 4) * wi_ > (int64_t{1} << 27)) f.fail(p + "ds_ffn_up.weight", "activations exceed the engine's bound");
        ln1_w_ = load_vector(f, p + "ln1.weight", d_);
        ln1_b_ = load_vector(f, p + "ln1.bias", d_);
        wq_ = matrix(f, arena, cfg, p + "attn_q.weight", d_, d_);
        wk_ = matrix(f, arena, cfg, p + "attn_k.weight", d_, d_);
        wv_ = matrix(f, arena, cfg, p + "attn_v.weight", d_, d_);
        wo_ = matrix(f, arena, cfg, p + "attn_out.weight", d_, d_);
        bq_ = bias_or_zero(f, p + "attn_q.bias", d_);
        bk_ = bias_or_zero(f, p + "attn_k.bias", d_);
        bv_ = bias_or_zero(f, p + "attn_v.bias", d_);
        bo_ = bias_or_zero(f, p + "attn_out.bias", d_);
        ds_ln_w_ = load_vector(f, p + "ds_ln.weight", 4 * d_);
        ds_ln_b_ = load_vector(f, p + "ds_ln.bias", 4 * d_);
        w_up_ = matrix(f, arena, cfg, p + "ds_ffn_up.weight", 4 * d_, wi_);
        b_up_ = bias_or_zero(f, p + "ds_ffn_up.bias", wi_);
        w_down_ = matrix(f, arena, cfg, p + "ds_ffn_down.weight", wi_, d_);
        b_down_ = bias_or_zero(f, p + "ds_ffn_down.bias", d_);
        for (std::vector<float>* v : {&xw_, &h_, &q_, &k_, &v_, &att_}) v->assign(static_cast<size_t>(max_tokens * d_), 0.f);
        mean_.assign(static_cast<size_t>(max_tokens / 4 * d_), 0.f);
        u_.assign(static_cast<size_t>(max_tokens / 4 * wi_), 0.f);
    }

    int64_t max_k() const { return std::max(4 * d_, wi_); }

    // x: the gh x gw grid's tokens in row-major order; afterwards its first gh*gw/4 rows hold the
    // merged tokens, row-major over the half grid.
    void merge(Compute& c, float* x, int64_t gh, int64_t gw) {
        const evk::OpTable& op = c.ops();
        const int64_t n = gh * gw, m = n / 4, d = d_;
        gather_windows(c.pool(), x, gh, gw, d, xw_.data());  // the residual, window-major
        layernorm_rows(c, xw_.data(), ln1_w_, ln1_b_, h_.data(), n, d, eps_);
        const Compute::MatmulJob qkv[3] = {{&wq_, q_.data(), d}, {&wk_, k_.data(), d}, {&wv_, v_.data(), d}};
        c.matmul_batch(qkv, 3, h_.data(), d, n, evk::kPrefill);
        add_bias(c, q_.data(), bq_, n);
        add_bias(c, k_.data(), bk_, n);
        add_bias(c, v_.data(), bv_, n);
        window_attention(c, m);
        c.matmul(wo_, att_.data(), n, h_.data(), evk::kPrefill);
        // xw += attention + bo; each window's mean; the window's four tokens (one row of 4d) normed.
        each(c.pool(), m, [&](int64_t w, int) {
            float* rows = &xw_[4 * w * d];
            float* mean = &mean_[w * d];
            std::fill(mean, mean + d, 0.f);
            for (int64_t r = 0; r < 4; ++r) {
                op.add(&h_[(4 * w + r) * d], bo_.data(), d);
                op.add(rows + r * d, &h_[(4 * w + r) * d], d);
                for (int64_t i = 0; i < d; ++i) mean[i] += rows[r * d + i];
            }
            for (int64_t i = 0; i < d; ++i) mean[i] *= 0.25f;
            op.layernorm(rows, ds_ln_w_.data(), ds_ln_b_.data(), &h_[4 * w * d], 4 * d, eps_);
        });
        c.matmul(w_up_, h_.data(), m, u_.data(), evk::kPrefill);
        each(c.pool(), m, [&](int64_t w, int) {
            op.add(&u_[w * wi_], b_up_.data(), wi_);
            op.gelu_tanh(&u_[w * wi_], wi_);
        });
        c.matmul(w_down_, u_.data(), m, x, evk::kPrefill);
        each(c.pool(), m, [&](int64_t w, int) {
            op.add(x + w * d, b_down_.data(), d);
            op.add(x + w * d, &mean_[w * d], d);
        });
    }

private:
    // att = softmax(q k^T / sqrt(hd)) v per head inside each window of four tokens.
    void window_attention(Compute& c, int64_t m) {
        const evk::OpTable& op = c.ops();
        const int64_t d = d_, hd = d / n_head_;
        const float scale = 1.f / std::sqrt(static_cast<float>(hd));
        each(c.pool(), m, [&](int64_t w, int) {
            for (int64_t h = 0; h < n_head_; ++h)
                for (int64_t i = 0; i < 4; ++i) {
                    const float* q = &q_[(4 * w + i) * d + h * hd];
                    float s[4];
                    for (int64_t j = 0; j < 4; ++j) {
                        const float* k = &k_[(4 * w + j) * d + h * hd];
                        float dot = 0.f;
                        for (int64_t e = 0; e < hd; ++e) dot += q[e] * k[e];
                        s[j] = dot;
                    }
                    op.softmax(s, 4, scale);
                    float* o = &att_[(4 * w + i) * d + h * hd];
                    std::fill(o, o + hd, 0.f);
                    for (int64_t j = 0; j < 4; ++j) {
                        const float* v = &v_[(4 * w + j) * d + h * hd];
                        for (int64_t e = 0; e < hd; ++e) o[e] += s[j] * v[e];
                    }
                }
        });
    }

    const int64_t d_, n_head_;
    const float eps_;
    int64_t wi_ = 0;
    std::vector<float> ln1_w_, ln1_b_, bq_, bk_, bv_, bo_, ds_ln_w_, ds_ln_b_, b_up_, b_down_;
    Weight wq_, wk_, wv_, wo_, w_up_, w_down_;
    // xw_ the residual in window order; h_ a normed copy, then the attention's output, then the
    // windows' normed rows of 4d; q_ k_ v_ att_ per token; mean_ and u_ per window.
    std::vector<float> xw_, h_, q_, k_, v_, att_, mean_, u_;
};

// The final DownsampleMLP: 2x2 neighbours of the gh x gw grid -> one token of the decoder's width.
class DownsampleMLP {
public:
    DownsampleMLP(const VisionConfig& cfg, const GGUFFile& f, PackArena& arena, int64_t max_tokens)
        : d4_(4 * cfg.n_embd), proj_(cfg.proj_dim), eps_(cfg.eps) {
        norm_w_ = load_vector(f, "mm.input_norm.weight", d4_);
        norm_b_ = bias_or_zero(f, "mm.input_norm.bias", d4_);
        w_up_ = matrix(f, arena, cfg, "mm.up.weight", d4_, d4_);
        b_up_ = bias_or_zero(f, "mm.up.bias", d4_);
        w_down_ = matrix(f, arena, cfg, "mm.down.weight", d4_, proj_);
        b_down_ = bias_or_zero(f, "mm.down.bias", proj_);
        cat_.assign(static_cast<size_t>(max_tokens * cfg.n_embd), 0.f);
        u_.assign(cat_.size(), 0.f);
    }

    int64_t max_k() const { return d4_; }

    void run(Compute& c, const float* x, int64_t gh, int64_t gw, float* out) {
        const int64_t m = (gh / 2) * (gw / 2), d = d4_ / 4;
        gather_windows(c.pool(), x, gh, gw, d, cat_.data());
        layernorm_rows(c, cat_.data(), norm_w_, norm_b_, cat_.data(), m, d4_, eps_);
        c.matmul(w_up_, cat_.data(), m, u_.data(), evk::kPrefill);
        const evk::OpTable& op = c.ops();
        each(c.pool(), m, [&](int64_t r, int) {
            float* u = &u_[r * d4_];
            op.add(u, b_up_.data(), d4_);
            for (int64_t i = 0; i < d4_; ++i) u[i] = 0.5f * u[i] * (1.f + std::erf(u[i] * 0.70710678118654752f));
        });
        c.matmul(w_down_, u_.data(), m, out, evk::kPrefill);
        add_bias(c, out, b_down_, m);
    }

private:
    const int64_t d4_, proj_;
    const float eps_;
    std::vector<float> norm_w_, norm_b_, b_up_, b_down_;
    Weight w_up_, w_down_;
    std::vector<float> cat_, u_;  // m rows of 4d: the neighbours concatenated (normed in place); W_up's output
};

class MiniCPMV46 final : public VisionArch {
public:
    MiniCPMV46(const VisionConfig& cfg, const GGUFFile& f, PackArena& arena, int64_t buckets, int64_t insert_layer)
        : cfg_(cfg), buckets_(buckets), insert_(insert_layer), tower_(cfg, f, arena, buckets * buckets, max_tokens(cfg)),
          mlp_(cfg, f, arena, max_tokens(cfg)) {
        if (merges_in_tower()) merger_ = std::make_unique<WindowMerger>(cfg, f, arena, max_tokens(cfg));
        hidden_.assign(static_cast<size_t>(max_tokens(cfg) * cfg.n_embd), 0.f);
        pos_ids_.assign(static_cast<size_t>(max_tokens(cfg)), 0);
    }

    int64_t max_k() const override {
        return std::max({tower_.max_k(), mlp_.max_k(), merger_ ? merger_->max_k() : int64_t{0}});
    }

    void encode(Compute& c, const float* pixels, float* out) override { encode_grid(c, pixels, cfg_.side(), cfg_.side(), out); }

    int64_t tokens(int64_t gh, int64_t gw) const override { return gh * gw / (cfg_.scale_factor * cfg_.scale_factor); }

    void encode_grid(Compute& c, const float* pixels, int64_t gh, int64_t gw, float* out) override {
        const int64_t s = cfg_.scale_factor;
        if (gh < s || gw < s || gh % s != 0 || gw % s != 0 || gh * gw > tower_.max_tokens())
            throw std::invalid_argument("a " + std::to_string(gh) + "x" + std::to_string(gw) + " patch grid is not a slice of this " +
                                        "mmproj (sides multiples of " + std::to_string(s) + ", at most " +
                                        std::to_string(tower_.max_tokens()) + " patches)");
        // The nearest bucket of the B x B table for row i of gh: floor(i * B / gh), as transformers'
        // bucketize of i / gh against the boundaries k / B.
        for (int64_t i = 0; i < gh; ++i)
            for (int64_t j = 0; j < gw; ++j)
                pos_ids_[static_cast<size_t>(i * gw + j)] = static_cast<int32_t>((i * buckets_ / gh) * buckets_ + j * buckets_ / gw);
        tower_.embed(c, pixels, gh, gw, pos_ids_.data());
        if (merger_) {
            tower_.layers(c, 0, insert_ + 1, hidden_.data());
            merger_->merge(c, tower_.stream(), gh, gw);
            gh /= 2;
            gw /= 2;
            tower_.restart(c, gh * gw, insert_ + 1, hidden_.data());
            tower_.layers(c, insert_ + 1, cfg_.n_layer, hidden_.data());
        } else {
            tower_.layers(c, 0, cfg_.n_layer, hidden_.data());
        }
        mlp_.run(c, hidden_.data(), gh, gw, out);
    }

    std::string variants(const evk::OpTable& op) const override { return tower_.variants(op); }
    bool ffn_swapped() const override { return tower_.ffn_swapped(); }

private:
    // Slices keep about scale_resolution^2 pixels (clip.vision.image_size): twice that bounds any of them.
    static int64_t max_tokens(const VisionConfig& cfg) { return 2 * cfg.n_patches(); }
    bool merges_in_tower() const { return cfg_.scale_factor == 4; }

    const VisionConfig cfg_;
    const int64_t buckets_, insert_;
    SiglipTower tower_;
    DownsampleMLP mlp_;
    std::unique_ptr<WindowMerger> merger_;
    std::vector<float> hidden_;    // the tower's output (post LN), row-major over its last grid
    std::vector<int32_t> pos_ids_;  // each patch's row of the position table
};

}  // namespace

std::unique_ptr<VisionArch> make_minicpmv4_6(VisionConfig& cfg, const GGUFFile& f, PackArena& arena) {
    const uint64_t s = f.get_uint("clip.vision.projector.scale_factor", 4);
    if (s != 2 && s != 4) f.fail("clip.vision.projector.scale_factor", "must be 2 (4x) or 4 (16x), not " + std::to_string(s));
    cfg.scale_factor = static_cast<int64_t>(s);
    if (cfg.side() % cfg.scale_factor != 0) f.fail("clip.vision.projector.scale_factor", "does not divide the patch grid");
    // The position table is a B x B bucket grid (70 x 70 for 980 px at patch 14).
    const TensorInfo* pos = f.find_tensor("v.position_embd.weight");
    if (!pos || pos->n_dims != 2 || pos->ne[0] != cfg.n_embd)
        f.fail("v.position_embd.weight", "missing, or its rows are not the embedding length");
    const int64_t rows = pos->ne[1], buckets = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(rows))));
    if (rows < 1 || buckets * buckets != rows || buckets > 4096)
        f.fail("v.position_embd.weight", std::to_string(rows) + " rows are not a square bucket grid");
    int64_t insert = -1;
    if (s == 4) {
        const GValue* v = f.find("clip.vision.wa_layer_indexes");
        if (!v || v->type != GType::ARRAY || v->count() != 1 || (v->elem_type != GType::I32 && v->elem_type != GType::U32) ||
            v->raw.size() != 4)
            f.fail("clip.vision.wa_layer_indexes", "16x mode needs one int32: the layer the window merger follows");
        int32_t id = 0;
        std::memcpy(&id, v->raw.data(), 4);
        if (id < 0 || id >= cfg.n_layer) f.fail("clip.vision.wa_layer_indexes", "layer " + std::to_string(id) + " is out of range");
        insert = id;
    }
    // The widths that size the connector's buffers come from the config: the file must back them.
    require_elements(f, "mm.up.weight", 16 * cfg.n_embd * cfg.n_embd);
    require_elements(f, "mm.down.weight", 4 * cfg.n_embd * cfg.proj_dim);
    return std::make_unique<MiniCPMV46>(cfg, f, arena, buckets, insert);
}

}  // namespace evn
