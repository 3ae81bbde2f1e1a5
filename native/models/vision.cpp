#include "vision.h"

#include <stdexcept>

#include "registry.h"

namespace evn {

namespace {

// The keys every tower + connector pair has; the connector's factory reads its own after these.
VisionConfig read_config(const GGUFFile& f) {
    VisionConfig c;
    const std::string arch = f.get_string("general.architecture");
    if (arch != "clip")
        throw UnsupportedModel("'" + f.path() + "': general.architecture '" + arch + "' is not an mmproj (clip) file");
    c.projector = f.get_string("clip.projector_type");
    find_vision(f);  // an unsupported projector is refused as such, before its keys are read
    if (const GValue* v = f.find("clip.has_vision_encoder"))
        if (v->type != GType::BOOL || v->u == 0) f.fail("clip.has_vision_encoder", "the file has no vision encoder");
    auto pos_int = [&](const std::string& key, uint64_t limit) {
        const uint64_t v = f.get_uint(key);
        if (v == 0 || v > limit) f.fail(key, "value " + std::to_string(v) + " is out of range");
        return static_cast<int64_t>(v);
    };
    c.image_size = pos_int("clip.vision.image_size", 8192);
    c.patch_size = pos_int("clip.vision.patch_size", 1024);
    c.n_embd = pos_int("clip.vision.embedding_length", 1 << 16);
    c.n_ff = pos_int("clip.vision.feed_forward_length", 1 << 18);
    c.n_layer = pos_int("clip.vision.block_count", 1024);
    c.n_head = pos_int("clip.vision.attention.head_count", 1024);
    c.proj_dim = pos_int("clip.vision.projection_dim", 1 << 16);
    c.eps = static_cast<float>(f.get_float("clip.vision.attention.layer_norm_epsilon", 1e-6));
    if (c.image_size % c.patch_size != 0) f.fail("clip.vision.patch_size", "does not divide the image size");
    if (c.n_embd % c.n_head != 0) f.fail("clip.vision.attention.head_count", "does not divide the embedding length");
    if (!(c.eps > 0.f)) f.fail("clip.vision.attention.layer_norm_epsilon", "must be > 0");
    return c;
}

}  // namespace

VisionModel::VisionModel(std::shared_ptr<const GGUFFile> file, int n_threads, bool int8)
    : file_(std::move(file)), cfg_(read_config(*file_)) {
    cfg_.int8 = int8;
    arch_ = find_vision(*file_)(cfg_, *file_, arena_);
    compute_ = std::make_unique<Compute>(n_threads, arch_->max_k());
}

VisionModel::~VisionModel() = default;

int64_t VisionArch::tokens(int64_t gh, int64_t gw) const {
    (void)gh;
    (void)gw;
    throw std::invalid_argument("this projector encodes fixed square tiles only");
}

void VisionArch::encode_grid(Compute&, const float*, int64_t gh, int64_t gw, float*) { (void)tokens(gh, gw); }

}  // namespace evn
