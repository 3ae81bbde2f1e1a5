// The registry of architectures: which file serves a GGUF's general.architecture (text decoders)
// and clip.projector_type (vision towers + connectors). Adding a family is one file under
// native/models/ and one line in a list below (docs/adding-an-architecture.md).
#pragma once
#include <memory>
#include <stdexcept>
#include <string>

#include "decoder.h"
#include "vision.h"

namespace evn {

// A well-formed file of an architecture this engine does not run (or of the wrong kind: a text
// model given as an mmproj). Not a GGUFError: nothing is wrong with the file.
class UnsupportedModel : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Text decoders: X(general.architecture, the factory's name). Each factory lives in its own file
// (make_llama in llama.cpp) and builds the architecture's blocks, reading its own keys and weights.
#define EVN_DECODER_ARCHS(X) \
    X("llama", make_llama)     \
    X("gemma3", make_gemma3)   \
    X("qwen35", make_qwen35)

// Reads the family's keys and weights; may set cfg's family fields (DecoderConfig).
using DecoderFactory = std::unique_ptr<DecoderArch> (*)(DecoderConfig& cfg, const DecoderLoader& load);

#define EVN_DECLARE_FACTORY(name, factory) std::unique_ptr<DecoderArch> factory(DecoderConfig&, const DecoderLoader&);
EVN_DECODER_ARCHS(EVN_DECLARE_FACTORY)
#undef EVN_DECLARE_FACTORY

// The factory of f's general.architecture; UnsupportedModel naming the supported ones otherwise.
DecoderFactory find_decoder(const GGUFFile& f);

// Vision towers + connectors: X(clip.projector_type, the factory's name), one file each
// (make_idefics3 in idefics3.cpp, make_minicpmv4_6 in minicpmv.cpp, both on the SigLIP tower of siglip.h).
#define EVN_VISION_ARCHS(X)        \
    X("idefics3", make_idefics3) \
    X("minicpmv4_6", make_minicpmv4_6)

// Reads the connector's keys (setting cfg's connector fields), checks the tensors they size, and
// builds the pair.
using VisionFactory = std::unique_ptr<VisionArch> (*)(VisionConfig& cfg, const GGUFFile& f, PackArena& arena);

#define EVN_DECLARE_FACTORY(name, factory) std::unique_ptr<VisionArch> factory(VisionConfig&, const GGUFFile&, PackArena&);
EVN_VISION_ARCHS(EVN_DECLARE_FACTORY)
#undef EVN_DECLARE_FACTORY

// The factory of f's clip.projector_type; UnsupportedModel naming the supported ones otherwise.
VisionFactory find_vision(const GGUFFile& f);

}  // namespace evn
