// The vision skeleton: one tile of pixels in, image-token embeddings in the decoder's width out,
//   vision tower (patches -> hidden states) -> connector (hidden states -> decoder tokens)
// read from an mmproj GGUF in llama.cpp's layout (clip.* keys, v.* and mm.* tensors). The pair is
// picked by clip.projector_type from the registry (registry.h): SigLIP + idefics3, SigLIP + minicpmv4_6; a family
// is one file (its connector, reusing a tower such as siglip.h) and one registration line.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "../compute.h"
#include "../gguf.h"

namespace evn {

struct VisionConfig {
    std::string projector;                                                   // clip.projector_type
    int64_t image_size = 0, patch_size = 0, n_embd = 0, n_ff = 0, n_layer = 0, n_head = 0;  // the tower
    float eps = 1e-6f;
    int64_t proj_dim = 0;      // the decoder's width, which the connector projects to
    int64_t scale_factor = 1;  // the connector's spatial merge per side (1: none)
    bool int8 = false;         // the user allowed int8 products (vision_int8): the table's int8 rules serve the weights
    int64_t side() const { return image_size / patch_size; }  // patches per side
    int64_t n_patches() const { return side() * side(); }
    int64_t n_out() const { return n_patches() / (scale_factor * scale_factor); }  // tokens per tile
    // How the tower's and connector's matrices are used: prefill only, int8 products where allowed.
    WeightUse weight_use() const { return int8 ? WeightUse::kPrefillInt8 : WeightUse::kPrefillOnly; }
};

// A tower + connector pair: its weights, its activations, one tile's encoding.
class VisionArch {
public:
    virtual ~VisionArch() = default;
    // The widest input row any of its products reads (the compute scratch is sized from it).
    virtual int64_t max_k() const = 0;
    // pixels: one tile, channel-major [3][image_size][image_size], normalized; out: n_out rows of proj_dim.
    virtual void encode(Compute& c, const float* pixels, float* out) = 0;
    virtual std::string variants(const evk::OpTable& op) const = 0;  // op: the operators encode() runs with
    virtual bool ffn_swapped() const { return false; }  // the mmproj names fc1 ffn_down (some published files)
    // A tile of gh x gw patches (pixels [3][gh*P][gw*P]): tokens(gh, gw) rows of proj_dim, for a family
    // whose tiles have grids of their own (std::invalid_argument for a grid it cannot take, and from a
    // family of fixed square tiles, which encode() serves).
    virtual int64_t tokens(int64_t gh, int64_t gw) const;
    virtual void encode_grid(Compute& c, const float* pixels, int64_t gh, int64_t gw, float* out);
};

class VisionModel {
public:
    // UnsupportedModel for a file that is not an mmproj or has a projector the registry lacks,
    // GGUFError for one that does not hold what its config says.
    // int8: the user allows int8 products for the matrices (vision_int8; the operator table's int8
    // rules pick the kernels, and a CPU without one keeps the float kernels).
    VisionModel(std::shared_ptr<const GGUFFile> file, int n_threads, bool int8 = false);
    ~VisionModel();
    const VisionConfig& config() const { return cfg_; }
    int threads() const { return compute_->threads(); }
    bool ffn_swapped() const { return arch_->ffn_swapped(); }
    std::string variants() const { return arch_->variants(compute_->ops()); }
    void encode(const float* pixels, float* out) { arch_->encode(*compute_, pixels, out); }
    int64_t tokens(int64_t gh, int64_t gw) const { return arch_->tokens(gh, gw); }
    void encode_grid(const float* pixels, int64_t gh, int64_t gw, float* out) {
        arch_->encode_grid(*compute_, pixels, gh, gw, out);
    }

private:
    std::shared_ptr<const GGUFFile> file_;
    VisionConfig cfg_;
    PackArena arena_;  // the weights' packed copies (huge pages)
    std::unique_ptr<VisionArch> arch_;
    std::unique_ptr<Compute> compute_;  // made after the weights: its scratch is sized from them
};

}  // namespace evn
