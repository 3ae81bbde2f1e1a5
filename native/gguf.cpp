#include "gguf.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace evn {

namespace {

constexpr int kMaxArrayDepth = 4;      // arrays of arrays nest at most this deep
constexpr uint64_t kMaxStringLen = 1ull << 30;
constexpr uint64_t kMaxNameLen = 65535;

// Bytes each element type needs at least; used to bound counts before anything is allocated.
uint64_t min_size(GType t) {
    switch (t) {
    case GType::U8: case GType::I8: case GType::BOOL: return 1;
    case GType::U16: case GType::I16: return 2;
    case GType::U32: case GType::I32: case GType::F32: return 4;
    case GType::U64: case GType::I64: case GType::F64: case GType::STRING: return 8;
    case GType::ARRAY: return 12;
    }
    return 0;
}

bool valid_gtype(uint32_t t) { return t <= 12; }

// Strict UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF), as Python decodes it:
// keys and tensor names become Python str, so a name that is not UTF-8 is refused at load time.
bool valid_utf8(const std::string& s) {
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    const size_t n = s.size();
    size_t i = 0;
    while (i < n) {
        const unsigned c = p[i];
        if (c < 0x80) { ++i; continue; }
        size_t len;
        unsigned lo = 0x80, hi = 0xbf;  // allowed range of the first continuation byte
        if (c >= 0xc2 && c <= 0xdf) len = 2;
        else if (c >= 0xe0 && c <= 0xef) { len = 3; if (c == 0xe0) lo = 0xa0; if (c == 0xed) hi = 0x9f; }
        else if (c >= 0xf0 && c <= 0xf4) { len = 4; if (c == 0xf0) lo = 0x90; if (c == 0xf4) hi = 0x8f; }
        else return false;
        if (n - i < len) return false;
        if (p[i + 1] < lo || p[i + 1] > hi) return false;
        for (size_t k = 2; k < len; ++k)
            if ((p[i + k] & 0xc0) != 0x80) return false;
        i += len;
    }
    return true;
}

// A cursor over the mapped bytes: every read checks the bytes that remain first.
class Cursor {
public:
    Cursor(const GGUFFile& f, const uint8_t* p, size_t n) : f_(f), p_(p), n_(n) {}
    size_t pos() const { return pos_; }
    size_t remaining() const { return n_ - pos_; }

    template <class T> T read(const std::string& field) {
        need(sizeof(T), field);
        T v;
        std::memcpy(&v, p_ + pos_, sizeof(T));
        pos_ += sizeof(T);
        return v;
    }
    std::string read_string(const std::string& field, uint64_t max_len) {
        const uint64_t len = read<uint64_t>(field + " (string length)");
        if (len > max_len) f_.fail(field, "string length " + std::to_string(len) + " is absurd");
        need(len, field + " (string of " + std::to_string(len) + " bytes)");
        std::string s(reinterpret_cast<const char*>(p_ + pos_), static_cast<size_t>(len));
        pos_ += static_cast<size_t>(len);
        return s;
    }
    void read_bytes(void* dst, uint64_t n, const std::string& field) {
        need(n, field);
        if (n) std::memcpy(dst, p_ + pos_, static_cast<size_t>(n));
        pos_ += static_cast<size_t>(n);
    }
    void need(uint64_t bytes, const std::string& field) const {
        if (bytes > remaining())
            f_.fail(field, "needs " + std::to_string(bytes) + " bytes at offset " + std::to_string(pos_) +
                               " but the file has " + std::to_string(remaining()) + " left (truncated?)");
    }

private:
    const GGUFFile& f_;
    const uint8_t* p_;
    size_t n_;
    size_t pos_ = 0;
};

void read_value(Cursor& c, const GGUFFile& f, GType type, const std::string& key, int depth, GValue& out) {
    out.type = type;
    switch (type) {
    case GType::U8: out.u = c.read<uint8_t>(key); break;
    case GType::I8: out.i = c.read<int8_t>(key); break;
    case GType::U16: out.u = c.read<uint16_t>(key); break;
    case GType::I16: out.i = c.read<int16_t>(key); break;
    case GType::U32: out.u = c.read<uint32_t>(key); break;
    case GType::I32: out.i = c.read<int32_t>(key); break;
    case GType::U64: out.u = c.read<uint64_t>(key); break;
    case GType::I64: out.i = c.read<int64_t>(key); break;
    case GType::F32: out.f = c.read<float>(key); break;
    case GType::F64: out.f = c.read<double>(key); break;
    case GType::BOOL: {
        const uint8_t b = c.read<uint8_t>(key);
        if (b > 1) f.fail(key, "bool value " + std::to_string(b) + " is neither 0 nor 1");
        out.u = b;
        break;
    }
    case GType::STRING: out.s = c.read_string(key, kMaxStringLen); break;
    case GType::ARRAY: {
        if (depth >= kMaxArrayDepth) f.fail(key, "arrays nested deeper than " + std::to_string(kMaxArrayDepth));
        const uint32_t et = c.read<uint32_t>(key + " (array element type)");
        if (!valid_gtype(et)) f.fail(key, "unknown array element type " + std::to_string(et));
        const uint64_t count = c.read<uint64_t>(key + " (array count)");
        // Each element needs at least min_size bytes: a count the file cannot hold is refused
        // here, before the vector is sized.
        if (count > c.remaining() / min_size(static_cast<GType>(et)))
            f.fail(key, "array count " + std::to_string(count) + " exceeds what the file can hold");
        out.elem_type = static_cast<GType>(et);
        if (out.elem_type == GType::STRING) {
            out.strs.reserve(static_cast<size_t>(count));
            for (uint64_t k = 0; k < count; ++k) out.strs.push_back(c.read_string(key, kMaxStringLen));
        } else if (out.elem_type == GType::ARRAY) {
            out.arr.resize(static_cast<size_t>(count));
            for (uint64_t k = 0; k < count; ++k) read_value(c, f, out.elem_type, key, depth + 1, out.arr[k]);
        } else {
            const uint64_t bytes = count * gtype_size(out.elem_type);  // count <= remaining: no overflow
            out.raw.resize(static_cast<size_t>(bytes));
            c.read_bytes(out.raw.data(), bytes, key + " (array data)");
            if (out.elem_type == GType::BOOL)
                for (uint8_t b : out.raw)
                    if (b > 1) f.fail(key, "bool value " + std::to_string(b) + " is neither 0 nor 1");
        }
        break;
    }
    }
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t& out) { return __builtin_mul_overflow(a, b, &out); }

}  // namespace

uint64_t gtype_size(GType t) {
    switch (t) {
    case GType::U8: case GType::I8: case GType::BOOL: return 1;
    case GType::U16: case GType::I16: return 2;
    case GType::U32: case GType::I32: case GType::F32: return 4;
    case GType::U64: case GType::I64: case GType::F64: return 8;
    default: return 0;
    }
}

size_t GValue::count() const {
    if (type != GType::ARRAY) return 0;
    if (elem_type == GType::STRING) return strs.size();
    if (elem_type == GType::ARRAY) return arr.size();
    return raw.size() / gtype_size(elem_type);
}

const char* gtype_name(GType t) {
    static const char* names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                  "bool", "string", "array", "uint64", "int64", "float64"};
    const auto i = static_cast<uint32_t>(t);
    return i < 13 ? names[i] : "unknown";
}

void GGUFFile::fail(const std::string& field, const std::string& what) const {
    throw GGUFError("bad GGUF file '" + path() + "': " + field + ": " + what);
}

GGUFFile::GGUFFile(const std::string& path) {
    // open() on a FIFO blocks until a writer appears: refuse anything that is not a regular file
    // before opening it (MappedFile checks again after open, on the descriptor).
    struct stat st{};
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
        throw GGUFError("'" + path + "' is not a regular file");
    try {
        file_ = std::make_unique<MappedFile>(path);
    } catch (const std::runtime_error& e) {
        throw GGUFError(e.what());
    }
    Cursor c(*this, file_->data(), file_->size());
    if (file_->size() < 4 || std::memcmp(file_->data(), "GGUF", 4) != 0) fail("magic", "not a GGUF file (expected 'GGUF')");
    c.read<uint32_t>("magic");
    version_ = c.read<uint32_t>("version");
    if (version_ != 2 && version_ != 3) {
        const uint32_t swapped = __builtin_bswap32(version_);
        fail("version", "version " + std::to_string(version_) + " is not supported (2 and 3 are)" +
                            (swapped == 2 || swapped == 3 ? "; this looks like a big-endian file, only little-endian is" : ""));
    }
    const uint64_t n_tensors = c.read<uint64_t>("tensor_count");
    const uint64_t n_kv = c.read<uint64_t>("metadata_kv_count");
    // A key/value pair needs at least 12 bytes (key length + type); a tensor info at least 24.
    if (n_kv > c.remaining() / 12) fail("metadata_kv_count", std::to_string(n_kv) + " exceeds what the file can hold");
    if (n_tensors > c.remaining() / 24) fail("tensor_count", std::to_string(n_tensors) + " exceeds what the file can hold");

    kv_.reserve(static_cast<size_t>(std::min<uint64_t>(n_kv, 4096)));  // a count is a claim, not a size
    for (uint64_t k = 0; k < n_kv; ++k) {
        std::string key = c.read_string("metadata key #" + std::to_string(k), kMaxNameLen);
        if (!valid_utf8(key)) fail("metadata key #" + std::to_string(k), "not valid UTF-8");
        if (kv_index_.count(key)) fail(key, "duplicate metadata key");
        const uint32_t t = c.read<uint32_t>(key + " (type)");
        if (!valid_gtype(t)) fail(key, "unknown value type " + std::to_string(t));
        GValue v;
        read_value(c, *this, static_cast<GType>(t), key, 0, v);
        kv_index_[key] = kv_.size();
        kv_.emplace_back(std::move(key), std::move(v));
    }

    if (const GValue* a = find("general.alignment")) {
        if (a->type != GType::U32) fail("general.alignment", "must be uint32");
        if (a->u == 0 || (a->u & (a->u - 1)) != 0) fail("general.alignment", std::to_string(a->u) + " is not a power of two");
        alignment_ = a->u;
    }

    tensors_.reserve(static_cast<size_t>(std::min<uint64_t>(n_tensors, 4096)));
    for (uint64_t k = 0; k < n_tensors; ++k) {
        TensorInfo ti;
        ti.name = c.read_string("tensor #" + std::to_string(k) + " name", kMaxNameLen);
        if (!valid_utf8(ti.name)) fail("tensor #" + std::to_string(k) + " name", "not valid UTF-8");
        const std::string field = "tensor '" + ti.name + "'";
        if (tensor_index_.count(ti.name)) fail(field, "duplicate tensor name");
        const uint32_t nd = c.read<uint32_t>(field + " n_dims");
        if (nd < 1 || nd > 4) fail(field, "n_dims " + std::to_string(nd) + " is not in 1..4");
        ti.n_dims = static_cast<int>(nd);
        uint64_t nel = 1;
        for (uint32_t d = 0; d < nd; ++d) {
            const uint64_t ne = c.read<uint64_t>(field + " dim " + std::to_string(d));
            if (ne == 0 || ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
                fail(field, "dimension " + std::to_string(d) + " = " + std::to_string(ne) + " is invalid");
            if (mul_overflows(nel, ne, nel) || nel > (1ull << 50))
                fail(field, "element count overflows (dimensions too large)");
            ti.ne[d] = static_cast<int64_t>(ne);
        }
        const uint32_t ty = c.read<uint32_t>(field + " type");
        const evk::TypeTraits* tt = evk::type_traits(ty);
        if (!tt) fail(field, "unknown tensor type " + std::to_string(ty));
        ti.type = static_cast<evk::DType>(ty);
        if (ti.ne[0] % tt->block_size != 0)
            fail(field, "row length " + std::to_string(ti.ne[0]) + " is not a multiple of the " + tt->name +
                            " block size " + std::to_string(tt->block_size));
        if (mul_overflows(nel / static_cast<uint64_t>(tt->block_size), static_cast<uint64_t>(tt->block_bytes), ti.nbytes))
            fail(field, "byte size overflows");
        ti.offset = c.read<uint64_t>(field + " offset");
        if (ti.offset % alignment_ != 0) fail(field, "offset " + std::to_string(ti.offset) + " is not aligned to " + std::to_string(alignment_));
        tensor_index_[ti.name] = tensors_.size();
        tensors_.push_back(std::move(ti));
    }

    // The data section starts at the next multiple of the alignment after the tensor infos.
    const uint64_t pos = c.pos();
    data_offset_ = (pos + alignment_ - 1) / alignment_ * alignment_;
    if (data_offset_ > file_->size() && !tensors_.empty()) fail("data section", "starts past the end of the file");
    for (TensorInfo& ti : tensors_) {
        uint64_t start, end;
        if (__builtin_add_overflow(data_offset_, ti.offset, &start) || __builtin_add_overflow(start, ti.nbytes, &end) ||
            end > file_->size())
            fail("tensor '" + ti.name + "'", "data [" + std::to_string(ti.offset) + ", +" + std::to_string(ti.nbytes) +
                                                 ") runs past the end of the file (" + std::to_string(file_->size()) + " bytes)");
        ti.offset = start;
        ti.data = file_->data() + start;
    }
}

const GValue* GGUFFile::find(const std::string& key) const {
    auto it = kv_index_.find(key);
    return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

const TensorInfo* GGUFFile::find_tensor(const std::string& name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::string GGUFFile::get_string(const std::string& key) const {
    const GValue* v = find(key);
    if (!v) fail(key, "missing");
    if (v->type != GType::STRING) fail(key, std::string("expected a string, found ") + gtype_name(v->type));
    return v->s;
}

uint64_t GGUFFile::get_uint(const std::string& key) const {
    const GValue* v = find(key);
    if (!v) fail(key, "missing");
    switch (v->type) {
    case GType::U8: case GType::U16: case GType::U32: case GType::U64: return v->u;
    case GType::I8: case GType::I16: case GType::I32: case GType::I64:
        if (v->i < 0) fail(key, "negative value " + std::to_string(v->i));
        return static_cast<uint64_t>(v->i);
    default: fail(key, std::string("expected an integer, found ") + gtype_name(v->type));
    }
}

uint64_t GGUFFile::get_uint(const std::string& key, uint64_t dflt) const { return find(key) ? get_uint(key) : dflt; }

double GGUFFile::get_float(const std::string& key) const {
    const GValue* v = find(key);
    if (!v) fail(key, "missing");
    if (v->type == GType::F32 || v->type == GType::F64) return v->f;
    return static_cast<double>(get_uint(key));
}

double GGUFFile::get_float(const std::string& key, double dflt) const { return find(key) ? get_float(key) : dflt; }

}  // namespace evn
