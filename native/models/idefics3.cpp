// Idefics3 connector (SmolVLM; Laurençon et al. 2024) on a SigLIP tower: the tower's hidden states,
// pixel-shuffled by s (each s x s block of neighbouring patches becomes one token of s*s*d
// features), then one linear projection to the decoder's width. 64 tokens per 512 px tile (s = 4).
#include <algorithm>
#include <cstring>

#include "registry.h"
#include "siglip.h"

namespace evn {

namespace {

class Idefics3 final : public VisionArch {
public:
    Idefics3(const VisionConfig& cfg, const GGUFFile& f, PackArena& arena)
        : cfg_(cfg), tower_(cfg, f, arena),
          proj_(load_weight(f, "mm.model.fc.weight", shuffled_width(), cfg.proj_dim, cfg.weight_use(), &arena)) {
        release_unused_rows(f, proj_);
        hidden_.assign(static_cast<size_t>(cfg.n_patches() * cfg.n_embd), 0.f);
        shuffled_.assign(hidden_.size(), 0.f);
    }

    int64_t max_k() const override { return std::max(tower_.max_k(), shuffled_width()); }

    void encode(Compute& c, const float* pixels, float* out) override {
        tower_.encode(c, pixels, hidden_.data());
        pixel_shuffle();
        c.matmul(proj_, shuffled_.data(), cfg_.n_out(), out, evk::kPrefill);
    }

    std::string variants(const evk::OpTable& op) const override { return tower_.variants(op); }
    bool ffn_swapped() const override { return tower_.ffn_swapped(); }

private:
    int64_t shuffled_width() const { return cfg_.n_embd * cfg_.scale_factor * cfg_.scale_factor; }

    // Output token (I, J) on the side/s grid holds, for a, b in [0, s), patch (I*s + a, J*s + b) at
    // feature offset (a*s + b) * d.
    void pixel_shuffle() {
        const int64_t side = cfg_.side(), s = cfg_.scale_factor, grid = side / s, d = cfg_.n_embd;
        for (int64_t t = 0; t < cfg_.n_patches(); ++t) {
            const int64_t py = t / side, px = t % side, I = py / s, a = py % s, J = px / s, b = px % s;
            std::memcpy(&shuffled_[((I * grid + J) * s * s + a * s + b) * d], &hidden_[t * d],
                        static_cast<size_t>(d) * sizeof(float));
        }
    }

    const VisionConfig cfg_;
    SiglipTower tower_;
    Weight proj_;
    std::vector<float> hidden_, shuffled_;  // the tower's output in patch order; in token order
};

}  // namespace

std::unique_ptr<VisionArch> make_idefics3(VisionConfig& cfg, const GGUFFile& f, PackArena& arena) {
    const uint64_t s = f.get_uint("clip.vision.projector.scale_factor");
    if (s == 0 || s > 64) f.fail("clip.vision.projector.scale_factor", "value " + std::to_string(s) + " is out of range");
    cfg.scale_factor = static_cast<int64_t>(s);
    if (cfg.side() % cfg.scale_factor != 0) f.fail("clip.vision.projector.scale_factor", "does not divide the patch grid");
    // The projection's input width comes from the config: the file must back it before the
    // compute scratch is sized from it.
    require_elements(f, "mm.model.fc.weight", cfg.n_embd * cfg.scale_factor * cfg.scale_factor * cfg.proj_dim);
    return std::make_unique<Idefics3>(cfg, f, arena);
}

}  // namespace evn
