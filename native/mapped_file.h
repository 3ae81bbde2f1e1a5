// A read-only memory map of a whole file, unmapped when the object dies.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace evn {

class MappedFile {
public:
    explicit MappedFile(const std::string& path);  // throws std::runtime_error
    ~MappedFile();
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;

    const uint8_t* data() const { return data_; }
    size_t size() const { return size_; }
    const std::string& path() const { return path_; }
    // Drops the whole pages inside [p, p + n) from this process's memory (they stay in the page
    // cache, and a later read maps them again): for data copied elsewhere at load. Ranges outside
    // the mapping are ignored.
    void release(const void* p, size_t n) const;

private:
    std::string path_;
    const uint8_t* data_ = nullptr;
    size_t size_ = 0;
};

}  // namespace evn
