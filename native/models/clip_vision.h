// SigLIP vision tower + idefics3 connector (SmolVLM), read from an mmproj GGUF in llama.cpp's
// layout (clip.* keys, v.* and mm.* tensors). One tile of pixels in, image-token embeddings in
// the decoder's width out:
//   patch conv -> + position embedding -> N x [LN, bidirectional MHA, LN, GELU-tanh MLP]
//   -> post LN -> pixel shuffle (scale s) -> linear projection.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "../compute.h"
#include "../gguf.h"

namespace evn {

struct ClipVisionConfig {
    std::string projector;
    int64_t image_size = 0, patch_size = 0, n_embd = 0, n_ff = 0, n_layer = 0, n_head = 0;
    int64_t proj_dim = 0, scale_factor = 1;
    float eps = 1e-6f;
    int64_t side() const { return image_size / patch_size; }           // patches per side
    int64_t n_patches() const { return side() * side(); }
    int64_t n_out() const { return n_patches() / (scale_factor * scale_factor); }  // tokens per tile
};

class ClipVisionModel {
public:
    ClipVisionModel(std::shared_ptr<const GGUFFile> file, int n_threads);
    const ClipVisionConfig& config() const { return cfg_; }
    int threads() const { return compute_.threads(); }
    bool ffn_swapped() const { return ffn_swapped_; }
    std::string variants() const;

    // pixels: one tile, channel-major [3][image_size][image_size], already normalized.
    // out: n_out() rows of proj_dim floats.
    void encode(const float* pixels, float* out);

private:
    struct Layer {
        std::vector<float> ln1_w, ln1_b, ln2_w, ln2_b, bq, bk, bv, bo, b_up, b_down;
        Weight wq, wk, wv, wo, w_up, w_down;
    };
    void attention(int64_t n);

    std::shared_ptr<const GGUFFile> file_;
    ClipVisionConfig cfg_;
    Compute compute_;
    PackArena arena_;  // the weights' packed copies (huge pages)
    Weight patch_w_, proj_w_;
    std::vector<float> patch_b_, pos_embd_, post_w_, post_b_;
    std::vector<Layer> layers_;
    bool ffn_swapped_ = false;

    static constexpr int64_t kQueryBlock = 256;  // rows of the score matrix held at once
    std::vector<float> patches_, x_, h_, q_, k_, v_, att_, ff_, shuffled_, s_;
    std::vector<float> vt_;  // V transposed: n_embd rows of n_patches (head h: rows [h*hd, (h+1)*hd))
};

}  // namespace evn
