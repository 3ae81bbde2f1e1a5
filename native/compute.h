// The runtime's compute context: the thread pool, the operator table, and per-thread scratch.
// Models describe their layers with Weight views and call these helpers; the helpers split work
// across threads and reach kernels only through the operator table.
#pragma once
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "../kernels/ops.h"
#include "gguf.h"
#include "thread_pool.h"

namespace evn {

// A 2-D weight viewed in place in the mapped file: `rows` rows of `cols` elements.
// The kernels that serve it are chosen once, at load, from the operator table.
// A kernel that reads a layout of its own (MatmulChoice::packing) gets `packed`, made once when the
// kernel is set; copies of a Weight share it (the tied output head and the token embeddings). A
// kernel of the other phase that can read that layout too (MatmulChoice::also_reads) uses it as
// well; then nothing reads the rows in the file any more (rows_unused()). A layout a kernel only
// prefers (MatmulChoice::prefers) is made when no phase with a kernel would read the rows instead:
// a weight used for one phase only (WeightUse::kPrefillOnly: the vision tower), never a second copy.
struct Weight {
    evk::DType type = evk::DType::F32;
    const void* data = nullptr;
    int64_t rows = 0, cols = 0;
    size_t row_bytes = 0;
    evk::MatmulChoice decode{nullptr, ""}, prefill{nullptr, ""};  // fn nullptr: no kernel for that phase
    std::shared_ptr<const uint8_t> packed;
    const evk::MatmulPacking* packed_as = nullptr;  // the layout of `packed` (nullptr with no copy)

    // Whether a kernel of choice c reads layout l (packed: its own, or one it also reads or prefers).
    static bool reads_layout(const evk::MatmulChoice& c, evk::WLayout l) {
        if (l == evk::WLayout::kRows) return false;
        return c.packing ? c.packing->layout == l : c.also_reads == l || (c.prefers && c.prefers->layout == l);
    }
    evk::WLayout packed_layout() const { return packed_as ? packed_as->layout : evk::WLayout::kRows; }
    bool reads_packed(const evk::MatmulChoice& c) const { return packed && reads_layout(c, packed_layout()); }
    // Every phase with a kernel reads the packed copy: the file's rows are needed for nothing but
    // embedding lookups.
    bool rows_unused() const {
        return packed && (decode.fn || prefill.fn) && (!decode.fn || reads_packed(decode)) &&
               (!prefill.fn || reads_packed(prefill));
    }
};

// Where a model's packed weight copies live: 64-byte aligned pieces of 2 MiB-aligned chunks advised
// as huge pages. The decode kernels stream ~100 MB per token; on 4 KiB pages that is a TLB miss
// every 64 cache lines (measured here from memory: 9.2 -> 11.2 GB/s on one core, 19.9 -> 22 on
// two). A chunk lives as long as any weight packed into it (or the arena).
class PackArena {
public:
    std::shared_ptr<uint8_t> take(size_t n);

private:
    std::shared_ptr<uint8_t> chunk_;
    size_t used_ = 0, size_ = 0, next_chunk_ = size_t{2} << 20;
};

// Which phases a weight serves: both (the text model), prefill only (the vision tower: no decode
// kernel, so the prefill kernel's preferred layout costs no second copy), prefill only with int8
// products allowed (the vision tower with vision_int8: the table's int8 rules match too), or none
// yet (the caller sets the kernels with set_kernel: tests and tuning).
enum class WeightUse { kBoth, kPrefillOnly, kPrefillInt8, kUnset };

// A Weight view of raw memory, with its kernels chosen from the operator table; a packed copy,
// if a kernel needs (or prefers) one, comes from `arena` (its own allocation without one).
Weight make_weight(evk::DType type, const void* data, int64_t rows, int64_t cols, WeightUse use = WeightUse::kBoth,
                   PackArena* arena = nullptr);
// Sets the kernel of one phase (e.g. a named variant, for tests and tuning), packing the weight
// into the kernel's layout if it has one (or prefers one, under the rule above). Drops a packed
// copy nothing needs any more. std::invalid_argument when the layout differs from the one the
// other phase already packed, or the shape has no such layout.
void set_kernel(Weight& w, evk::Phase phase, const evk::MatmulChoice& choice, PackArena* arena = nullptr);

// Gives the file's pages of w's rows back to the OS when every phase with a kernel reads the packed
// copy (Weight::rows_unused()): the rows and the copies never all sit in memory at once.
void release_unused_rows(const GGUFFile& f, const Weight& w);

// Looks up a 2-D tensor of the expected shape (cols = ne[0]) and a type with kernels.
Weight load_weight(const GGUFFile& f, const std::string& name, int64_t cols, int64_t rows,
                   WeightUse use = WeightUse::kBoth, PackArena* arena = nullptr);
// GGUFError unless the tensor exists with exactly n elements: for a number from the config that
// sizes an allocation, checked against the file before anything is allocated from it.
void require_elements(const GGUFFile& f, const std::string& name, int64_t n);
// Looks up a tensor of exactly n elements and converts it to owned floats (norms, biases).
std::vector<float> load_vector(const GGUFFile& f, const std::string& name, int64_t n);

class Compute {
public:
    Compute(int n_threads, int64_t max_k);
    int threads() const { return pool_.size(); }
    const evk::OpTable& ops() const { return *ops_; }
    ThreadPool& pool() { return pool_; }

    // y[t] = W x[t] for t in [0, m); x rows are x_stride floats apart, y rows y_stride.
    // The phase picks the kernel: a forward pass over many tokens is prefill for every one of its
    // layers' products, so a token's numbers never depend on how a prompt was split into calls.
    // The output head over the prompt's last token alone is a decode product (one token: the
    // first decode step's, as Decoder::forward_chunk runs it), whatever the chunk.
    void matmul(const Weight& w, const float* x, int64_t x_stride, int64_t m, float* y, int64_t y_stride,
                evk::Phase phase);
    void matmul(const Weight& w, const float* x, int64_t m, float* y, evk::Phase phase) {
        matmul(w, x, w.cols, m, y, w.rows, phase);
    }
    // A weight with no kernel for the phase (a prefill-only weight asked to decode) throws
    // std::invalid_argument.
    // Several products of the same input in one parallel region (one hand-over to the workers
    // instead of one per product): Q, K and V, or gate and up. Each output is computed exactly as
    // matmul() computes it. All weights must have x's width as their cols.
    struct MatmulJob {
        const Weight* w;
        float* y;
        int64_t y_stride;  // floats between tokens of y (usually w->rows)
    };
    static constexpr int kMaxJobs = 4;
    void matmul_batch(const MatmulJob* jobs, int n_jobs, const float* x, int64_t x_stride, int64_t m, evk::Phase phase);

    static evk::Phase phase_for(int64_t n_tokens) { return n_tokens <= evk::kDecodeMaxTokens ? evk::kDecode : evk::kPrefill; }

    // fn(t0, t1) over the token rows [0, n): for the element-wise work of a chunk (norms, rope,
    // gates, residual adds), whose rows do not depend on each other. A prefill chunk of at least
    // kRowsParallel tokens is cut into pieces the threads share; fewer tokens (decode) run on the
    // caller, which a hand-over would cost more than the work. The pieces do not change a bit.
    static constexpr int64_t kRowsParallel = 32;
    template <class F>
    void rows(int64_t n, F&& fn) {
        if (n < kRowsParallel || pool_.size() == 1) return fn(int64_t{0}, n);
        const int64_t pieces = std::min<int64_t>(n / 8, 4 * pool_.size()), per = (n + pieces - 1) / pieces;
        auto body = [&](int64_t i, int) { fn(i * per, std::min(n, (i + 1) * per)); };
        pool_.run((n + per - 1) / per, body);
    }

    // Scratch of kMatmulScratchRows * max_k floats reserved for thread t.
    float* scratch(int t) {
        return scratch_.data() + static_cast<size_t>(t) * static_cast<size_t>(evk::kMatmulScratchRows * max_k_);
    }

private:
    ThreadPool pool_;
    const evk::OpTable* ops_;
    int64_t max_k_;
    std::vector<float> scratch_;
    std::vector<uint8_t> xp_buf_;  // activations converted for a kernel with MatmulChoice::act
    int decode_chunks_;            // row chunks per thread in decode (EDGEVLM_DECODE_CHUNKS, default 1)
    size_t decode_chunk_bytes_;    // and at most this many weight bytes each (EDGEVLM_DECODE_CHUNK_KB; 0, the default: no bound)
};

}  // namespace evn
