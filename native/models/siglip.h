// SigLIP vision tower (Zhai et al. 2023; a ViT, Dosovitskiy et al. 2021), in the order of the paper:
//   x = conv_patch(pixels) + b + pos
//   per layer:  x += Wo · MHA(LN1(x)) + bo        (bidirectional, biased Q, K, V)
//               x += W_down · gelu_tanh(W_up · LN2(x) + b_up) + b_down
//   out = post_LN(x)
// For the connectors that build on it (idefics3.cpp; MiniCPM-V's merger next).
#pragma once
#include <vector>

#include "vision.h"

namespace evn {

class SiglipTower {
public:
    // Checks every tensor the config implies before allocating anything sized from it.
    SiglipTower(const VisionConfig& cfg, const GGUFFile& f, PackArena& arena);
    int64_t max_k() const;
    // out: n_patches rows of n_embd, in patch order (row-major over the patch grid).
    void encode(Compute& c, const float* pixels, float* out);
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
    void embed_patches(Compute& c, const float* pixels, const Norm& next);
    void self_attention(Compute& c, const Layer& L);
    void attention_heads(Compute& c);
    void mlp(Compute& c, const Layer& L);
    void residual_norm(Compute& c, const std::vector<float>& bias, const Norm& next, float* dst);

    const VisionConfig cfg_;
    Weight patch_w_;
    std::vector<float> patch_b_, pos_embd_, post_w_, post_b_;
    std::vector<Layer> layers_;
    bool ffn_swapped_ = false;

    static constexpr int64_t kQueryBlock = 256;  // rows of the score matrix held at once
    // Run state for one tile: patches_ [patch][3*P*P], x_ the residual stream, h_ a normed copy or a
    // block's output, q_ k_ v_ att_ [patch][n_embd], ff_ [patch][n_ff], s_ scores of a query block.
    std::vector<float> patches_, x_, h_, q_, k_, v_, att_, ff_, s_;
    std::vector<float> vt_;  // V transposed: n_embd rows of n_patches (head h: rows [h*hd, (h+1)*hd))
};

}  // namespace evn
