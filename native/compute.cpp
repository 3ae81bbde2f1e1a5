#include "compute.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "models/registry.h"

namespace evn {

namespace {

// A tensor of a format this engine does not run: the file is well formed, so UnsupportedModel in
// one line naming the tensor and the format, not a GGUFError.
void require_computable(const GGUFFile& f, const std::string& name, evk::DType type) {
    const evk::TypeTraits* tt = evk::type_traits(type);
    if (!tt->computable)
        throw UnsupportedModel("'" + f.path() + "': tensor '" + name + "': weight format " + tt->name + " is not supported");
}

}  // namespace

Weight load_weight(const GGUFFile& f, const std::string& name, int64_t cols, int64_t rows, WeightUse use,
                   PackArena* arena) {
    const TensorInfo* t = f.find_tensor(name);
    if (!t) f.fail("tensor '" + name + "'", "missing");
    // The outermost dimension is the rows; the inner ones (one for a matrix, three for a conv
    // kernel [kw, kh, c_in]) flatten, contiguous, into a row of cols elements.
    const int64_t outer = t->ne[t->n_dims - 1];
    const int64_t inner = t->n_dims == 1 ? 1 : t->nelements() / outer;
    if (t->n_dims < 2 || outer != rows || inner != cols || (t->n_dims == 2 && t->ne[0] != cols)) {
        std::string shape;
        for (int d = 0; d < t->n_dims; ++d) shape += (d ? ", " : "") + std::to_string(t->ne[d]);
        f.fail("tensor '" + name + "'", "shape [" + shape + "] does not match the expected [" + std::to_string(cols) + ", " +
                                            std::to_string(rows) + "]");
    }
    require_computable(f, name, t->type);
    return make_weight(t->type, t->data, rows, cols, use, arena);
}

Weight make_weight(evk::DType type, const void* data, int64_t rows, int64_t cols, WeightUse use, PackArena* arena) {
    Weight w;
    w.type = type;
    w.data = data;
    w.rows = rows;
    w.cols = cols;
    w.row_bytes = evk::row_bytes(type, cols);
    if (use == WeightUse::kBoth) set_kernel(w, evk::kDecode, evk::choose_matmul(type, evk::kDecode, rows, cols), arena);
    if (use != WeightUse::kUnset)
        set_kernel(w, evk::kPrefill, evk::choose_matmul(type, evk::kPrefill, rows, cols, use == WeightUse::kPrefillInt8), arena);
    return w;
}

std::shared_ptr<uint8_t> PackArena::take(size_t n) {
    n = (n + 63) / 64 * 64;
    if (!chunk_ || size_ - used_ < n) {
        // Chunks of 2 MiB, doubling up to 32 MiB (a small model, as the fuzz harness builds by the
        // thousand, maps 2 MiB, not 32): only the pages written are resident (a huge page is
        // faulted whole, so a chunk's unused tail costs at most 2 MiB).
        constexpr size_t kHuge = size_t{2} << 20, kMaxChunk = size_t{32} << 20;
        const size_t size = std::max(next_chunk_, (n + kHuge - 1) / kHuge * kHuge);
        next_chunk_ = std::min(kMaxChunk, 2 * next_chunk_);
        void* mem = std::aligned_alloc(kHuge, size);
        if (!mem) throw std::bad_alloc();
        ::madvise(mem, size, MADV_HUGEPAGE);  // advice only: without THP the pages are 4 KiB
        chunk_.reset(static_cast<uint8_t*>(mem), std::free);
        used_ = 0;
        size_ = size;
    }
    std::shared_ptr<uint8_t> piece(chunk_, chunk_.get() + used_);  // shares the chunk's ownership
    used_ += n;
    return piece;
}

void set_kernel(Weight& w, evk::Phase phase, const evk::MatmulChoice& choice, PackArena* arena) {
    const evk::MatmulChoice& other = phase == evk::kDecode ? w.prefill : w.decode;
    const evk::MatmulPacking* want = choice.packing;
    // A preferred layout only where it is the one copy: the other phase has no kernel, or reads it too.
    if (!want && choice.prefers && !other.packing && choice.prefers->bytes(w.type, w.rows, w.cols) != 0 &&
        (!other.fn || Weight::reads_layout(other, choice.prefers->layout)))
        want = choice.prefers;
    if (want && (!w.packed || w.packed_layout() != want->layout)) {
        const evk::MatmulPacking& p = *want;
        if (w.packed && other.packing)
            throw std::invalid_argument(std::string("weight already packed as '") + w.packed_as->name + "', not '" + p.name + "'");
        const size_t n = p.bytes(w.type, w.rows, w.cols);
        if (n == 0) throw std::invalid_argument(std::string("no '") + p.name + "' layout for this weight");
        std::shared_ptr<uint8_t> buf;
        if (arena) {
            buf = arena->take(n);
        } else {  // 64-byte aligned: a group's vectors never straddle a cache line more than they must
            void* mem = std::aligned_alloc(64, (n + 63) / 64 * 64);
            if (!mem) throw std::bad_alloc();
            buf.reset(static_cast<uint8_t*>(mem), std::free);
        }
        p.pack(w.type, w.data, w.row_bytes, w.rows, w.cols, buf.get());
        w.packed = std::move(buf);
        w.packed_as = &p;
    }
    (phase == evk::kDecode ? w.decode : w.prefill) = choice;
    // Keep the copy while a kernel needs it, or while every phase with a kernel reads it (then the
    // rows may go); otherwise it would be a second copy next to the rows something still reads.
    if (w.packed && !w.decode.packing && !w.prefill.packing && !w.rows_unused()) {
        w.packed.reset();
        w.packed_as = nullptr;
    }
}

void release_unused_rows(const GGUFFile& f, const Weight& w) {
    if (w.rows_unused()) f.release(w.data, static_cast<size_t>(w.rows) * w.row_bytes);
}

std::vector<float> load_vector(const GGUFFile& f, const std::string& name, int64_t n) {
    const TensorInfo* t = f.find_tensor(name);
    if (!t) f.fail("tensor '" + name + "'", "missing");
    if (t->nelements() != n)
        f.fail("tensor '" + name + "'", std::to_string(t->nelements()) + " elements, expected " + std::to_string(n));
    require_computable(f, name, t->type);
    std::vector<float> v(static_cast<size_t>(n));
    evk::dequantize_row(t->type, t->data, v.data(), n);
    return v;
}

void require_elements(const GGUFFile& f, const std::string& name, int64_t n) {
    const TensorInfo* t = f.find_tensor(name);
    if (!t) f.fail("tensor '" + name + "'", "missing");
    if (t->nelements() != n) {
        std::string shape;
        for (int d = 0; d < t->n_dims; ++d) shape += (d ? ", " : "") + std::to_string(t->ne[d]);
        f.fail("tensor '" + name + "'", "shape [" + shape + "] holds " + std::to_string(t->nelements()) +
                                            " elements, the config needs " + std::to_string(n));
    }
}

namespace {
int decode_chunks_from_env() {
    const char* v = std::getenv("EDGEVLM_DECODE_CHUNKS");
    const int n = v ? std::atoi(v) : 1;
    return n < 1 ? 1 : n > 64 ? 64 : n;
}
size_t decode_chunk_bytes_from_env() {
    const char* v = std::getenv("EDGEVLM_DECODE_CHUNK_KB");
    const long kb = v ? std::atol(v) : 0;  // 0: no bound
    return kb <= 0 ? 0 : static_cast<size_t>(std::clamp<long>(kb, 16, long{1} << 30)) << 10;
}
}  // namespace

Compute::Compute(int n_threads, int64_t max_k)
    : pool_(n_threads), ops_(&evk::best_ops()), max_k_(max_k),
      scratch_(static_cast<size_t>(pool_.size()) * static_cast<size_t>(evk::kMatmulScratchRows * max_k)),
      decode_chunks_(decode_chunks_from_env()), decode_chunk_bytes_(decode_chunk_bytes_from_env()) {}

void Compute::matmul(const Weight& w, const float* x, int64_t x_stride, int64_t m, float* y, int64_t y_stride,
                     evk::Phase phase) {
    const MatmulJob job{&w, y, y_stride};
    matmul_batch(&job, 1, x, x_stride, m, phase);
}

void Compute::matmul_batch(const MatmulJob* jobs, int n_jobs, const float* x, int64_t x_stride, int64_t m,
                           evk::Phase phase) {
    if (n_jobs < 1 || n_jobs > kMaxJobs) throw std::invalid_argument("matmul_batch: 1 to 4 products");
    // Tokens in blocks, so the activations a chunk streams stay in L2: 64, or in prefill as many
    // (up to 256) as fit 1 MiB of floats, while the chunks still outnumber the threads twice. Each
    // block re-reads the whole weight, so for k = 768 four times fewer passes over the weights.
    constexpr int64_t kTokenBlock = 64;
    struct Plan {
        evk::MatmulFn fn;
        const void* data;
        evk::WLayout layout;
        bool converted;  // reads the activations in act's format
        int64_t rows_per_chunk, row_chunks, first_chunk, tok;
    };
    const evk::ActPrep* act = nullptr;
    Plan plans[kMaxJobs];
    int64_t n_chunks = 0;
    for (int i = 0; i < n_jobs; ++i) {
        const Weight& w = *jobs[i].w;
        const evk::MatmulChoice& c = phase == evk::kDecode ? w.decode : w.prefill;
        if (!c.fn) throw std::invalid_argument(std::string("matmul: the weight has no ") +
                                               (phase == evk::kDecode ? "decode" : "prefill") + " kernel");
        const bool packed = w.reads_packed(c);
        Plan& p = plans[i];
        p.fn = c.fn;
        p.data = packed ? static_cast<const void*>(w.packed.get()) : w.data;
        p.layout = packed ? w.packed_layout() : evk::WLayout::kRows;
        p.converted = c.act != nullptr;
        if (c.act && act && c.act != act) throw std::invalid_argument("matmul_batch: two activation formats in one batch");
        if (c.act) act = c.act;
        // Chunks of rows, multiples of 16 (packed groups of 8 or 16 are never split).
        // Decode: decode_chunks_ per thread (1 unless EDGEVLM_DECODE_CHUNKS says otherwise). Each
        // call streams its rows from memory and pays a stream start (the prefetchers ramp up anew,
        // the activations are quantized again): with 8 chunks per thread a 576-row product ran as
        // 48-row calls of 17 KB, and decode took 6.3-7.2 ms per token against 5.1-5.8 with one
        // chunk per thread (SmolLM2-135M, 2 threads, alternated runs). More chunks let the other
        // threads take over the share of a thread the OS deschedules, on a machine shared with
        // other work.
        // Prefill: enough chunks that a descheduled thread's share is picked up by another, in
        // multiples of the GEMM's panel (48 rows, 32 for AMX), or the whole weight when it has
        // fewer than two panels (attention's V^T, 64 rows): a 16-row call runs the GEMM's slowest
        // tile, and the token blocks give the threads work enough.
        // EDGEVLM_DECODE_CHUNK_KB=N also bounds a decode chunk to N KiB of weight, claimed in turn: a
        // thread that streams slower, or that the OS deschedules, then holds back only the chunk it is
        // in, not half of a 178 MB output head. Off by default: 2, 8 and 32 MiB bounds on Gemma 3
        // 270M's head were not faster than one chunk per thread under load (docs/kernels/decode-dispatch.md).
        if (phase == evk::kDecode) {
            p.rows_per_chunk = std::max<int64_t>(16, (w.rows + 16 * decode_chunks_ * pool_.size() - 1) /
                                                         (16 * decode_chunks_ * pool_.size()) * 16);
            if (decode_chunk_bytes_ > 0) {
                const int64_t by_bytes = static_cast<int64_t>(decode_chunk_bytes_ / std::max<size_t>(w.row_bytes, 1)) / 16 * 16;
                p.rows_per_chunk = std::max<int64_t>(16, std::min(p.rows_per_chunk, by_bytes));
            }
        } else {  // whole panels (128 would run 48 + 48 + a 32-row tile)
            const int64_t panel = std::max<int64_t>(16, c.panel_rows);
            p.rows_per_chunk = std::max<int64_t>(16, (w.rows / (8 * pool_.size()) + 15) / 16 * 16);
            p.rows_per_chunk = w.rows < 2 * panel ? (w.rows + 15) / 16 * 16 : (p.rows_per_chunk + panel - 1) / panel * panel;
        }
        p.row_chunks = (w.rows + p.rows_per_chunk - 1) / p.rows_per_chunk;
        p.tok = kTokenBlock;
        if (phase == evk::kPrefill) {
            p.tok = std::clamp<int64_t>((int64_t{1} << 18) / std::max<int64_t>(w.cols, 1) / kTokenBlock * kTokenBlock, kTokenBlock, 4 * kTokenBlock);
            while (p.tok > kTokenBlock && p.row_chunks * ((m + p.tok - 1) / p.tok) < 2 * pool_.size()) p.tok /= 2;
        }
        p.first_chunk = n_chunks;
        n_chunks += p.row_chunks * ((m + p.tok - 1) / p.tok);
    }
    // A kernel with an activation format of its own reads x converted once, here, by all threads;
    // the token blocks are multiples of 16, the conversion's padding.
    const uint8_t* xp = nullptr;
    size_t xp_row = 0;
    if (act) {
        const int64_t k = jobs[0].w->cols;
        xp_row = act->row_bytes(k);
        const size_t need = act->bytes(m, k) + 64;
        if (xp_buf_.size() < need) xp_buf_.resize(need);  // grows in prefill only: decode kernels convert nothing
        uint8_t* dst = xp_buf_.data() + (64 - reinterpret_cast<uintptr_t>(xp_buf_.data()) % 64) % 64;
        const int64_t pad = act->pad_tokens, groups = act->padded_tokens(m) / pad;
        auto convert = [&](int64_t g, int) { act->prep(x, x_stride, m, k, g * pad, (g + 1) * pad, dst); };
        pool_.run(groups, convert);
        xp = dst;
    }
    auto body = [&](int64_t chunk, int t) {
        int i = n_jobs - 1;
        while (chunk < plans[i].first_chunk) --i;
        const Plan& p = plans[i];
        const Weight& w = *jobs[i].w;
        const int64_t local = chunk - p.first_chunk, rc = local % p.row_chunks, tb = local / p.row_chunks;
        evk::MatmulArgs a{};
        a.w = p.data;
        a.wtype = w.type;
        a.w_row_bytes = w.row_bytes;
        a.k = w.cols;
        a.row0 = rc * p.rows_per_chunk;
        a.row1 = std::min(w.rows, a.row0 + p.rows_per_chunk);
        a.x = x + tb * p.tok * x_stride;
        a.x_stride = x_stride;
        a.y = jobs[i].y + tb * p.tok * jobs[i].y_stride;
        a.y_stride = jobs[i].y_stride;
        a.m = std::min(p.tok, m - tb * p.tok);
        a.scratch = scratch(t);
        a.w_layout = p.layout;
        if (p.converted) {
            a.xp = xp + static_cast<size_t>(tb * p.tok) * xp_row;
            a.xp_stride = static_cast<int64_t>(xp_row);
        }
        p.fn(a);
    };
    pool_.run(n_chunks, body);
}

}  // namespace evn
