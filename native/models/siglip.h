// SigLIP vision tower (Zhai et al. 2023; a ViT, Dosovitskiy et al. 2021), in the order of the paper:
//   x = conv_patch(pixels) + b + pos
//   per layer:  x += Wo · MHA(LN1(x)) + bo        (bidirectional, biased Q, K, V)
//               x += W_down · gelu_tanh(W_up · LN2(x) + b_up) + b_down
//   out = post_LN(x)
// For the connectors that build on it (idefics3.cpp: fixed square tiles; minicpmv.cpp: a slice's own
// grid, position rows picked from a bucket table, and a merger between two runs of layers).
#pragma once
#include <vector>

#include "vision.h"

namespace evn {

class SiglipTower {
public:
    // Checks every tensor the config implies before allocating anything sized from it.
    // pos_rows: rows of v.position_embd (0: one per patch of the square tile); max_tokens: the most
    // patches one call may embed (0: the square tile's).
    SiglipTower(const VisionConfig& cfg, const GGUFFile& f, PackArena& arena, int64_t pos_rows = 0,
                int64_t max_tokens = 0);
    int64_t max_k() const;
    int64_t max_tokens() const { return max_tokens_; }
    // out: n_patches rows of n_embd, in patch order (row-major over the patch grid).
    void encode(Compute& c, const float* pixels, float* out);

    // The same tower as blocks, for a connector that works between its layers. The residual stream
    // x (stream(), tokens() rows of n_embd) enters layer l with h = LN1_l(x) beside it.
    // embed: pixels [3][gh*P][gw*P]; x = patches W + b + pos[pos_ids[t]] (pos_ids: gh*gw rows of
    // the position table, each < pos_rows); then h = LN1_0(x).
    void embed(Compute& c, const float* pixels, int64_t gh, int64_t gw, const int32_t* pos_ids);
    // Layers [l0, l1) over the stream; when l1 is the last layer, out = post_LN(x) (tokens() rows).
    void layers(Compute& c, int64_t l0, int64_t l1, float* out);
    // After a block rewrote the stream to n tokens: h = LN1_l(x), or out = post_LN(x) when l is n_layer.
    void restart(Compute& c, int64_t n, int64_t l, float* out);
    float* stream() { return x_.data(); }
    int64_t tokens() const { return n_; }
    bool ffn_swapped() const { return ffn_swapped_; }
    std::string variants(const evk::OpTable& op) const;

private:
    struct Layer {
        std::vector<float> ln1_w, ln1_b, ln2_w, ln2_b, bq, bk, bv, bo, b_up, b_down;
        Weight wq, wk, wv, wo, w_up, w_down;
    };
    struct Norm {
        const std::vector<float>*w, *b;
    };
    Norm entry_norm(int64_t l) const;  // LN1 of layer l, or the post LN for l == n_layer
    void norm_stream(Compute& c, int64_t l, float* out);
    void self_attention(Compute& c, const Layer& L);
    void attention_heads(Compute& c);
    void mlp(Compute& c, const Layer& L);
    void residual_norm(Compute& c, const std::vector<float>& bias, const Norm& next, float* dst);

    const VisionConfig cfg_;
    Weight patch_w_;
    std::vector<float> patch_b_, pos_embd_, post_w_, post_b_;
    std::vector<Layer> layers_;
    bool ffn_swapped_ = false;
    int64_t pos_rows_ = 0, max_tokens_ = 0;
    int64_t n_ = 0;  // tokens in the stream now

    static constexpr int64_t kQueryBlock = 256;  // rows of the score matrix held at once
    // Run state for one tile: patches_ [patch][3*P*P], x_ the residual stream, h_ a normed copy or a
    // block's output, q_ k_ v_ att_ [patch][n_embd], ff_ [patch][n_ff], s_ scores of a query block.
    std::vector<float> patches_, x_, h_, q_, k_, v_, att_, ff_, s_;
    std::vector<float> vt_;  // V transposed: n_embd rows of n_patches (head h: rows [h*hd, (h+1)*hd))
};

}  // namespace evn
