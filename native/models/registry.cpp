#include "registry.h"

namespace evn {

namespace {

template <class Factory> struct Entry {
    const char* name;
    Factory make;
};
#define EVN_ENTRY(name, factory) {name, &factory},
constexpr Entry<DecoderFactory> kDecoders[] = {EVN_DECODER_ARCHS(EVN_ENTRY)};
constexpr Entry<VisionFactory> kVisions[] = {EVN_VISION_ARCHS(EVN_ENTRY)};
#undef EVN_ENTRY

// The factory registered under the file's value of `key`; UnsupportedModel naming the registered
// ones otherwise.
template <class Factory, size_t N>
Factory lookup(const Entry<Factory> (&entries)[N], const GGUFFile& f, const std::string& key, const std::string& as) {
    const std::string value = f.get_string(key);
    std::string supported;
    for (const Entry<Factory>& e : entries) {
        if (value == e.name) return e.make;
        supported += (supported.empty() ? "" : ", ") + std::string(e.name);
    }
    throw UnsupportedModel("'" + f.path() + "': " + key + ": '" + value + "' is not supported" + as + " (supported: " +
                           supported + ")");
}

}  // namespace

DecoderFactory find_decoder(const GGUFFile& f) { return lookup(kDecoders, f, "general.architecture", " as a text decoder"); }

VisionFactory find_vision(const GGUFFile& f) { return lookup(kVisions, f, "clip.projector_type", ""); }

}  // namespace evn
