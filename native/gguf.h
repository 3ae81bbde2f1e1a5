// GGUF reader (versions 2 and 3, little-endian). The file is memory-mapped; tensor data is read
// in place. Every count, length, offset, dimension and size read from the file is checked against
// the bytes that remain and against overflow before it is used; a bad file throws GGUFError
// naming the file and the field, and nothing is allocated from an unchecked number.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../kernels/formats/formats.h"
#include "mapped_file.h"

namespace evn {

class GGUFError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

enum class GType : uint32_t {
    U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
    STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};
const char* gtype_name(GType t);

struct GValue {
    GType type = GType::U8;
    GType elem_type = GType::U8;  // arrays only
    uint64_t u = 0;               // unsigned ints and bool
    int64_t i = 0;                // signed ints
    double f = 0.0;               // floats
    std::string s;
    // Arrays are stored compactly, never one GValue per element, so a hostile file cannot turn a
    // few MB of uint8 elements into GBs: numeric and bool elements as their raw little-endian
    // bytes, strings as strings, and only nested arrays as GValues.
    std::vector<uint8_t> raw;
    std::vector<std::string> strs;
    std::vector<GValue> arr;
    size_t count() const;  // elements of an array
};
uint64_t gtype_size(GType t);  // bytes of one numeric or bool element; 0 for strings and arrays

struct TensorInfo {
    std::string name;
    evk::DType type;
    int n_dims = 0;
    int64_t ne[4] = {1, 1, 1, 1};  // ne[0] is the innermost (contiguous) dimension
    uint64_t offset = 0;           // from the start of the file
    uint64_t nbytes = 0;
    const void* data = nullptr;
    int64_t nelements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
};

class GGUFFile {
public:
    explicit GGUFFile(const std::string& path);  // throws GGUFError

    const std::string& path() const { return file_->path(); }
    uint32_t version() const { return version_; }
    uint64_t alignment() const { return alignment_; }
    uint64_t data_offset() const { return data_offset_; }
    size_t file_size() const { return file_->size(); }
    // See MappedFile::release: for tensor data a model has copied into a layout of its own.
    void release(const void* p, size_t n) const { file_->release(p, n); }
    const std::vector<std::pair<std::string, GValue>>& metadata() const { return kv_; }
    const std::vector<TensorInfo>& tensors() const { return tensors_; }

    const GValue* find(const std::string& key) const;
    const TensorInfo* find_tensor(const std::string& name) const;

    // Typed look-ups that throw GGUFError naming the key when it is missing or of the wrong type.
    std::string get_string(const std::string& key) const;
    uint64_t get_uint(const std::string& key) const;
    double get_float(const std::string& key) const;
    uint64_t get_uint(const std::string& key, uint64_t dflt) const;
    double get_float(const std::string& key, double dflt) const;
    [[noreturn]] void fail(const std::string& field, const std::string& what) const;

private:
    std::unique_ptr<MappedFile> file_;
    uint32_t version_ = 0;
    uint64_t alignment_ = 32;
    uint64_t data_offset_ = 0;
    std::vector<std::pair<std::string, GValue>> kv_;
    std::map<std::string, size_t> kv_index_;
    std::vector<TensorInfo> tensors_;
    std::map<std::string, size_t> tensor_index_;
};

}  // namespace evn
