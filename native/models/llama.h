// Llama-family decoder (SmolLM2, the SmolVLM text model): the forward pass reads in the order of
// the paper, one named call on named buffers per step; buffers are allocated once at load, the
// weights are views into the mapped GGUF, and decoding a token allocates nothing.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../compute.h"
#include "../gguf.h"

namespace evn {

struct LlamaConfig {
    std::string arch;
    int64_t n_vocab = 0, n_embd = 0, n_ff = 0, n_layer = 0, n_head = 0, n_head_kv = 0, head_dim = 0;
    int64_t n_ctx_train = 0, rope_dims = 0;
    float rms_eps = 1e-5f, rope_base = 10000.f, rope_scale = 1.f;  // positions are divided by rope_scale
    bool tied_output = false;
    int64_t q_dim() const { return n_head * head_dim; }
    int64_t kv_dim() const { return n_head_kv * head_dim; }
};

// The KV cache of the first n_past positions, detached from the model.
struct KVSnapshot {
    int64_t n_past = 0;
    int64_t n_layer = 0, kv_dim = 0;
    std::vector<float> k, v;  // [layer][pos][kv_dim]
};

struct GenerateResult {
    std::vector<int32_t> tokens;  // generated ids, the stop token excluded
    std::string stop_reason;      // "stop_token", "max_tokens", "deadline", "context_full", "cancelled"
    double prefill_ms = 0, decode_ms = 0;
    int64_t n_prompt = 0;
};

class LlamaModel {
public:
    LlamaModel(std::shared_ptr<const GGUFFile> file, int n_threads, int64_t n_ctx, int64_t n_batch);

    const LlamaConfig& config() const { return cfg_; }
    int64_t n_ctx() const { return n_ctx_; }
    int64_t n_past() const { return n_past_; }
    int threads() const { return compute_.threads(); }
    void reset() { n_past_ = 0; }

    // Runs n tokens (or n embedding rows of n_embd floats) at positions n_past.. and appends them
    // to the KV cache. logits: n_vocab floats for the last position, or n * n_vocab when all.
    void forward_tokens(const int32_t* ids, int64_t n, float* logits, bool all_logits);
    void forward_embeddings(const float* x, int64_t n, float* logits, bool all_logits);

    // Token embeddings (dequantized rows of token_embd) for n ids: n * n_embd floats.
    void embed(const int32_t* ids, int64_t n, float* out) const;

    // Greedy decoding after feeding `prompt`; an empty prompt continues from the logits of the
    // last forward call (e.g. after forward_embeddings of an image prompt). (appended to what the cache holds).
    // max_ms <= 0 means no deadline; it bounds the whole call, prefill included.
    void generate(const int32_t* prompt, int64_t n_prompt, int64_t max_new, const std::vector<int32_t>& stop_ids,
                  double max_ms, GenerateResult& out);

    // Thread-safe, from any thread: a generate() running now or later stops before its next token
    // with "cancelled" (for shutdown: a node stopping mid-answer). Sticky until cancel(false).
    void cancel(bool on = true) { cancel_.store(on, std::memory_order_relaxed); }
    bool cancelled() const { return cancel_.load(std::memory_order_relaxed); }

    KVSnapshot snapshot() const;
    void restore(const KVSnapshot& s);

    const float* last_logits() const { return logits_.data(); }
    std::string variants() const;  // which kernel serves each operator, for the log

private:
    // The phase (decode or prefill kernels) is the whole call's, not the chunk's, so how a long
    // prompt is chunked never changes its numbers.
    void forward_chunk(int64_t n, float* logits, bool all_logits, evk::Phase ph);
    void attention(int64_t layer, int64_t n, int64_t pos0);
    float* k_at(int64_t layer, int64_t pos) { return k_cache_.data() + (layer * n_ctx_ + pos) * cfg_.kv_dim(); }
    float* v_at(int64_t layer, int64_t pos) { return v_cache_.data() + (layer * n_ctx_ + pos) * cfg_.kv_dim(); }

    struct Layer {
        std::vector<float> attn_norm, ffn_norm;
        Weight wq, wk, wv, wo, w_gate, w_up, w_down;
    };

    std::shared_ptr<const GGUFFile> file_;
    LlamaConfig cfg_;
    int64_t n_ctx_, n_batch_;
    Compute compute_;
    PackArena arena_;  // the weights' packed copies
    Weight tok_embd_, output_;
    std::vector<float> output_norm_;
    std::vector<Layer> layers_;

    // Run state, sized for n_batch tokens at once.
    std::vector<float> x_, xb_, xb2_, q_, k_, v_, att_, hb_, hb2_, logits_, scores_;
    std::vector<float> rope_cs_;  // [token of the chunk][rope_dims]: cos, sin per pair
    std::vector<float> k_cache_, v_cache_;
    int64_t n_past_ = 0;
    std::atomic<bool> cancel_{false};
};

}  // namespace evn
