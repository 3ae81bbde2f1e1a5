// libFuzzer harness for the GGUF reader and the two model loaders (text decoder, vision tower
// mmproj: idefics3 and minicpmv4_6). Built by test/test_fuzz.py and scripts/fuzz_long.sh with clang
// -fsanitize=fuzzer,address,undefined from the same sources as the extension (buildinfo.py),
// except native/mapped_file.cpp, which this file replaces (see below).
//
// One input is one file. It is written to a memfd and opened by path (/proc/self/fd/N), as the
// engine opens model files, then:
//   1. GGUFFile must load it or refuse it with GGUFError; nothing else may escape;
//   2. every tensor's first and last byte and every metadata value is touched;
//   3. Decoder (n_ctx 8, its multi-token-prediction block loaded where the file has one: two drafts
//      from it) and VisionModel are constructed from whatever loaded; each must
//      succeed or refuse with GGUFError (a bad file) or UnsupportedModel (an architecture the
//      registry does not hold); their shape and key checks are fuzzed too;
//   4. a model that was built runs once (one token, or one image tile: for a family whose
//      slices have grids of their own, minicpmv4_6, a slice of another grid), so the kernels
//      meet whatever shapes and weight bytes the checks let through; a decoder's sequence state
//      (KV cache and, for a hybrid decoder such as qwen35, its recurrent state) is then snapshotted,
//      reset and restored before the second token, as a prefix cache does.
// A crash, a sanitizer report, an escaping exception or an allocation over -malloc_limit_mb is a
// finding: libFuzzer writes the input to crash-*/oom-* and test/fuzz_regressions keeps it.
//
// Over-reads: a mapping rounds the file up to a whole page, and bytes past the end of the file
// up to that page boundary read as zeros without any fault, where ASan cannot see them either.
// The MappedFile below therefore reads the file into a heap block of exactly its size, so
// reading even one byte past the end is an ASan report. The block is page-aligned like a mapping,
// so tensor data keeps the alignment it has in the engine.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../gguf.h"
#include "../mapped_file.h"
#include "../models/registry.h"

namespace evn {

MappedFile::MappedFile(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error("cannot open '" + path + "': " + std::strerror(errno));
    struct stat st{};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        ::close(fd);
        throw std::runtime_error("'" + path + "' is not a regular file");
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
        void* p = nullptr;
        if (::posix_memalign(&p, 4096, size_) != 0) {
            ::close(fd);
            throw std::runtime_error("out of memory");
        }
        size_t got = 0;
        while (got < size_) {
            const ssize_t r = ::pread(fd, static_cast<char*>(p) + got, size_ - got, static_cast<off_t>(got));
            if (r <= 0) {
                std::free(p);
                ::close(fd);
                throw std::runtime_error("cannot read '" + path + "'");
            }
            got += static_cast<size_t>(r);
        }
        data_ = static_cast<const uint8_t*>(p);
    }
    ::close(fd);
}

MappedFile::~MappedFile() { std::free(const_cast<uint8_t*>(data_)); }
// A heap copy has no pages to drop (madvise on it would zero the data): keep everything.
void MappedFile::release(const void*, size_t) const {}

}  // namespace evn

namespace {

int g_fd = -1;
std::string g_path;

void write_input(const uint8_t* data, size_t size) {
    if (::ftruncate(g_fd, 0) != 0 || ::pwrite(g_fd, data, size, 0) != static_cast<ssize_t>(size)) {
        std::perror("fuzz_gguf: memfd write");
        std::abort();
    }
}

// Sums bytes so the compiler keeps every read.
volatile uint64_t g_sink = 0;

void touch(const evn::GValue& v, int depth = 0) {
    uint64_t s = v.u + static_cast<uint64_t>(v.i) + v.s.size() + static_cast<uint64_t>(v.f == v.f);
    if (!v.s.empty()) s += static_cast<unsigned char>(v.s.back());
    if (depth < 2)
        for (const evn::GValue& e : v.arr) touch(e, depth + 1);
    g_sink = g_sink + s;
}

void touch(const evn::GGUFFile& f) {
    for (const auto& kv : f.metadata()) touch(kv.second);
    for (const evn::TensorInfo& t : f.tensors()) {
        const auto* p = static_cast<const uint8_t*>(t.data);
        if (t.nbytes) g_sink = g_sink + p[0] + p[t.nbytes - 1];
    }
}

void try_llama(const std::shared_ptr<const evn::GGUFFile>& f) {
    std::unique_ptr<evn::Decoder> m;
    try {
        m = std::make_unique<evn::Decoder>(f, 1, 8, 4, evk::DType::F32, /*mtp=*/true);
    } catch (const evn::GGUFError&) {
        return;  // refused: what a bad file must get
    } catch (const evn::UnsupportedModel&) {
        return;  // refused: an architecture this engine does not run
    }
    std::vector<float> logits(static_cast<size_t>(m->config().n_vocab));
    // The last row of the embedding table, then (context allowing) a second position.
    const int32_t last = static_cast<int32_t>(m->config().n_vocab - 1), first = 0;
    m->prefill(evn::PromptInput{&last, 1}, logits.data(), false);
    const evn::KVSnapshot s = m->snapshot();
    m->reset();
    m->restore(s);
    if (m->n_ctx() >= 2) m->prefill(evn::PromptInput{&first, 1}, logits.data(), false);
    if (m->has_mtp() && m->n_past() < m->n_ctx()) {  // a file's multi-token-prediction block: two drafts
        int32_t drafts[2];
        m->draft_nextn(last, 2, {}, drafts, nullptr);
    }
    g_sink = g_sink + (logits[0] == logits[0]);
}

void try_clip(const std::shared_ptr<const evn::GGUFFile>& f) {
    std::unique_ptr<evn::VisionModel> m;
    try {
        // Every other file (by its tensor count: the same input takes the same path when replayed)
        // with int8 products allowed: the q8u copies are made from whatever shapes loaded.
        m = std::make_unique<evn::VisionModel>(f, 1, f->tensors().size() % 2 == 1);
    } catch (const evn::GGUFError&) {
        return;
    } catch (const evn::UnsupportedModel&) {
        return;
    }
    const evn::VisionConfig& c = m->config();
    // A model too big to encode quickly is still constructed (and so checked), not run.
    const int64_t d = c.n_embd;
    auto cheap = [&](int64_t np) {
        return np * (2 * np * d + d * (3 * c.patch_size * c.patch_size + 4 * d + 2 * c.n_ff)) * c.n_layer <= 50'000'000;
    };
    // A family whose slices have grids of their own (minicpmv4_6) encodes one slice that is not the
    // square tile, so its position rows come from the bucket table at a grid of their own:
    // scale_factor rows of twice the tile's columns. That is at most twice the tile's patches (the
    // bound on a slice; exactly it when the tile is scale_factor patches a side, as in the seeds),
    // so the grid is valid for every mmproj that loaded: a refusal escapes and is a finding. (Its
    // square tile takes the same code at other numbers: not run too, it would cost a third more.)
    bool slice = true;
    int64_t gh = c.scale_factor, gw = 2 * c.side(), n_tokens = 0;
    try {
        n_tokens = m->tokens(gh, gw);
    } catch (const std::invalid_argument&) {  // fixed square tiles only (idefics3): one tile
        slice = false;
        gh = gw = c.side();
        n_tokens = c.n_out();
    }
    if (!cheap(gh * gw)) return;
    std::vector<float> pixels(static_cast<size_t>(3 * gh * gw * c.patch_size * c.patch_size), 0.25f);
    std::vector<float> out(static_cast<size_t>(n_tokens * c.proj_dim));
    if (slice)
        m->encode_grid(pixels.data(), gh, gw, out.data());
    else
        m->encode(pixels.data(), out.data());
    g_sink = g_sink + (out[0] == out[0]);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    g_fd = ::memfd_create("fuzz_gguf", 0);
    if (g_fd < 0) {
        std::perror("fuzz_gguf: memfd_create");
        std::abort();
    }
    g_path = "/proc/self/fd/" + std::to_string(g_fd);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    write_input(data, size);
    std::shared_ptr<const evn::GGUFFile> f;
    try {
        f = std::make_shared<const evn::GGUFFile>(g_path);
    } catch (const evn::GGUFError&) {
        return 0;
    }
    touch(*f);
    try_llama(f);
    try_clip(f);
    return 0;
}
