// The decoder skeleton every text architecture shares, read in the order of the paper:
//   embed (token rows, image features at their slots) -> N x block -> final norm -> output head
// plus the sequence state (a KV cache per attention layer, recurrent state per recurrent layer)
// with snapshot/restore, and greedy generation. An architecture is only its block: one file under
// native/models/ that implements DecoderArch, and one line in registry.h (see
// docs/adding-an-architecture.md). Buffers are allocated once at load, the weights are views into
// the mapped GGUF, and decoding a token allocates nothing.
#pragma once
#include <array>
#include <atomic>
#include <mutex>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../compute.h"
#include "../constraint.h"
#include "../gguf.h"

namespace evn {

// The hyperparameters every decoder family has, read from "<general.architecture>.*" keys.
// A family's factory reads its own keys after these and may set the fields marked "family".
struct DecoderConfig {
    std::string arch;
    int64_t n_vocab = 0, n_embd = 0, n_ff = 0, n_layer = 0, n_head = 0, n_head_kv = 0, head_dim = 0;
    int64_t n_ctx_train = 0, rope_dims = 0;
    float rms_eps = 1e-5f, rope_base = 10000.f, rope_scale = 1.f;  // positions are divided by rope_scale
    bool tied_output = false;
    float embd_scale = 1.f;  // family: token rows are multiplied by it (Gemma: sqrt(n_embd)); never image rows
    int64_t q_dim() const { return n_head * head_dim; }
    int64_t kv_dim() const { return n_head_kv * head_dim; }
};

// The KV cache of the first n_past positions, detached from the model: keys and values of every
// layer that has a cache (all of one width, kv_dim), and the recurrent state of every layer that
// carries one (empty for a decoder without recurrent layers).
// Keys and values are floats whatever the cache's type (a half or int8 cache converts them; restoring
// converts back, to the same bits: both conversions are exact on values the cache held).
struct KVSnapshot {
    int64_t n_past = 0;
    int64_t n_layer = 0, kv_dim = 0;  // n_layer: layers with a KV cache
    std::vector<float> k, v;          // [cached layer][pos][kv_dim]
    std::vector<float> recurrent;     // [recurrent layer][its state], in layer order
};

struct GenerateResult {
    std::vector<int32_t> tokens;  // generated ids, the stop token excluded
    std::string stop_reason;      // "stop_token", "max_tokens", "deadline", "context_full", "cancelled", "complete"
    double prefill_ms = 0, decode_ms = 0;
    int64_t n_prompt = 0;
    // Speculation (generate's `lookup`): verification passes run, draft tokens they ran, drafts accepted.
    int64_t spec_passes = 0, spec_drafted = 0, spec_accepted = 0;
};

// Most rows of one verification pass: the token it decodes and up to kMaxDraft drafts, run as a
// decode-phase chunk whatever its size (PromptInput::decode_phase). Every kernel computes each row
// of a chunk as a one-row step computes it (evk::MatmulArgs; attention, norms and RoPE work per
// token), so a verified token is the token plain greedy decoding gives. The decode kernels unpack a
// weight once for up to 8 rows (matmul_avx512vnni_q8act_x8.cpp, x8_body.inc).
constexpr int64_t kMaxPassRows = 8;
constexpr int64_t kMaxDraft = kMaxPassRows - 1;

// The measured time of a decode-phase pass by its rows (ms[rows], a running mean over the decoder's
// generate() calls; 0: not measured yet), which sizes the verification passes (decoder.cpp).
struct PassCosts {
    std::array<double, kMaxPassRows + 1> ms{};
    double draft_ms = 0;  // one step of the multi-token-prediction block (draft_nextn), 0: not measured yet
    void timed(int64_t rows, double ms_taken);
    void draft_timed(double ms_taken);
    double cost(int64_t k) const;  // a pass of 1 + k rows over a one-row step (1 + k/10 unmeasured)
    double draft_cost() const;     // an MTP draft step over a one-row step (1/2 unmeasured)
};

// generate()'s draft sources, in this order: the tokens that followed the longest run (1-5) of
// `tokens`' last ids in `lookup` (earlier answers; its latest occurrence); else n-grams of the
// answer itself and then of the prompt (`prompt`, n_prompt ids): what followed an earlier
// occurrence of its last 3 or 2 ids. Up to -1, a stop id or max_k of them, into out; how many.
int64_t propose_drafts(const std::vector<int32_t>& tokens, const std::vector<int32_t>& lookup, const int32_t* prompt,
                       int64_t n_prompt, const std::vector<int32_t>& stop_ids, int64_t max_k, int32_t* out);

// What one prefill runs: n token ids, where the rows at `slots` (strictly increasing positions in
// [0, n)) take rows of `features` (n_slots x n_embd floats: the image) instead of their token's
// embedding. The ids at the slots are still checked against the vocabulary.
struct PromptInput {
    const int32_t* ids = nullptr;
    int64_t n = 0;
    const float* features = nullptr;
    const int64_t* slots = nullptr;
    int64_t n_slots = 0;
    // Run with the decode kernels whatever n (a verification pass: its rows are one-row steps);
    // otherwise n <= evk::kDecodeMaxTokens does, more rows take the prefill kernels.
    bool decode_phase = false;
};

// What one layer keeps of the sequence, declared by its architecture: a KV cache of kv_dim floats
// per position for K and for V (0: none), and `recurrent` floats of state carried from token to
// token (0: none; Qwen3.5's linear-attention layers).
struct LayerShape {
    int64_t kv_dim = 0, recurrent = 0;
};

// The head-major KV layout (LayerCache): byte offset of kv head h's position p in a layer's K (or
// V) cache of n_ctx positions.
inline size_t kv_head_offset(evk::DType t, int64_t n_ctx, int64_t head_dim, int64_t h, int64_t p) {
    return evk::kv_bytes(t, (h * n_ctx + p) * head_dim);
}

// One layer's part of the sequence state, as its block sees it: kv head h's key of position p at
// k + evk::kv_bytes(kv_type, (h * n_ctx + p) * head_dim) (append_kv and causal_attention read and
// write it). Head-major: one kv head's keys (values) of consecutive positions are contiguous, so
// attention streams them instead of reading a head's slice out of every position's row.
struct LayerCache {
    uint8_t* k = nullptr;
    uint8_t* v = nullptr;
    int64_t kv_dim = 0;  // kv heads x head_dim
    int64_t head_dim = 0, n_ctx = 0;
    // Byte offset of kv head h's position p in k (and in v).
    size_t at(int64_t h, int64_t p) const { return kv_head_offset(kv_type, n_ctx, head_dim, h, p); }
    evk::DType kv_type = evk::DType::F32;
    int64_t first = 0;  // attention reads positions from here on (the MTP block's cache: where it starts)
    float* recurrent = nullptr;
    int64_t recurrent_size = 0;
};

// The named buffers one chunk of tokens runs on (llama2.c's RunState), sized at load for n_batch
// tokens. Row t of each belongs to the chunk's token t.
struct RunState {
    std::vector<float> x;        // [t][n_embd] the residual stream
    std::vector<float> xb;       // [t][max(n_embd, q_dim)] a normed copy of x
    std::vector<float> xb2;      // [t][n_embd] a block's output before the residual add
    std::vector<float> q, k, v;  // [t][q_dim], [t][kv_dim], [t][kv_dim]
    std::vector<float> att;      // [t][q_dim] attention output, head after head
    std::vector<float> hb, hb2;  // [t][n_ff] feed-forward hidden
    std::vector<float> rope_cs;  // [t][rope_dims] cos, sin of each pair at the token's position (rope_base)
    std::vector<float> scores;   // [thread][query heads of a call][n_ctx] attention scores
};

// The chunk a layer runs: n tokens at positions pos0 .. pos0 + n - 1. The phase (decode or prefill
// kernels) is the whole call's, not the chunk's, so how a prompt is chunked never changes its numbers.
struct Chunk {
    int64_t n = 0, pos0 = 0;
    evk::Phase phase = evk::kPrefill;
};

// A multi-token-prediction block ("nextn": DeepSeek-V3, Qwen3.5's MTP), trained to predict the
// token after next. Its input at position p is token p's embedding row and the model's final-normed
// hidden state at p - 1 (zeros where there is none), each RMS-normed by its own weight (enorm,
// hnorm), joined [embedding | hidden] and projected back to the width (eh_proj: 2 n_embd -> n_embd);
// then one block of the family's own with a KV cache of its own; then head_norm. That output is the
// hidden state the next step reads and, through the output head, the step's logits.
struct NextNWeights {
    Weight eh_proj;
    std::vector<float> enorm, hnorm, head_norm;  // head_norm empty: the model's output_norm
    Weight embed, head;                           // data nullptr: the model's token_embd / output
};

// What a block reaches while it runs.
struct DecoderContext {
    const DecoderConfig& cfg;
    Compute& compute;
    RunState& s;
    int64_t n_ctx;
};

// Weights as an architecture loads them at construction: packed into the model's arena, the file's
// rows given back when nothing reads them any more.
class DecoderLoader {
public:
    DecoderLoader(const GGUFFile& f, PackArena& arena, int64_t n_batch, bool nextn = false)
        : f_(f), arena_(arena), n_batch_(n_batch), nextn_(nextn) {}
    const GGUFFile& file() const { return f_; }
    int64_t n_batch() const { return n_batch_; }  // tokens per chunk: for run-state buffers of a family's own
    bool nextn() const { return nextn_; }         // load the multi-token-prediction block where the file has one
    Weight matrix(const std::string& name, int64_t cols, int64_t rows) const;
    std::vector<float> vector(const std::string& name, int64_t n) const { return load_vector(f_, name, n); }

private:
    const GGUFFile& f_;
    PackArena& arena_;
    int64_t n_batch_;
    bool nextn_;
};

// The weights every decoder block of the registry has, under llama.cpp's names (blk.N.attn_norm,
// attn_q / attn_k / attn_v / attn_output, ffn_norm, ffn_gate / ffn_up / ffn_down): pre-norms,
// attention projections and a gated feed-forward. A block with more tensors keeps them beside these.
struct GatedLayerWeights {
    std::vector<float> attn_norm, ffn_norm;
    Weight wq, wk, wv, wo, w_gate, w_up, w_down;
};
GatedLayerWeights load_gated_layer(const DecoderLoader& load, const DecoderConfig& cfg, int64_t layer);

// A decoder architecture: its per-layer weights and what one layer does to the residual stream.
class DecoderArch {
public:
    virtual ~DecoderArch() = default;
    virtual LayerShape layer_shape(int64_t layer) const = 0;
    // Once per chunk, before layer 0 (after the shared rope table of the chunk's positions is made):
    // tables of the family's own (e.g. a second rope base for local layers).
    virtual void begin_chunk(DecoderContext&, const Chunk&) const {}
    // x += block(x) for the chunk's tokens in s.x; appends the layer's keys and values at positions
    // pos0.. of its cache (or advances its recurrent state).
    virtual void layer(DecoderContext& c, int64_t l, const Chunk& ch, const LayerCache& cache) const = 0;
    // Which kernels serve the layers, for the log (op: the operators the decoder runs them with).
    virtual std::string variants(const evk::OpTable& op) const = 0;
    // The multi-token-prediction block, where the family has one, the file holds it and the loader
    // asked for it (DecoderLoader::nextn); nullptr otherwise. Its block runs like layer() on the
    // chunk in s.x (nextn_layer), with a cache of nextn_shape().
    virtual const NextNWeights* nextn() const { return nullptr; }
    virtual LayerShape nextn_shape() const { return {}; }
    virtual void nextn_layer(DecoderContext&, const Chunk&, const LayerCache&) const {}
};

// Shared steps a block is made of.
// Causal attention of the chunk's queries (s.q) over the cache's positions [max(0, p - window + 1), p]
// for the query at position p (window 0: every earlier position), grouped-query heads, into s.att.
// scale 0: 1/sqrt(head_dim).
void causal_attention(DecoderContext& c, const LayerCache& cache, const Chunk& ch, int64_t window = 0,
                      float scale = 0.f);
// The chunk's keys and values (s.k, s.v) into the cache at positions pos0 ...
void append_kv(DecoderContext& c, const LayerCache& cache, const Chunk& ch);
// The second half of a pre-norm SwiGLU block: x += s.xb2 (the mixer's output), then
// x += W_down · (silu(W_gate·norm(x)) * W_up·norm(x)), norm an RMSNorm by `norm` (llama, qwen35).
void residual_swiglu_ffn(DecoderContext& c, const Chunk& ch, const std::vector<float>& norm, const Weight& w_gate,
                         const Weight& w_up, const Weight& w_down);

// "layers (<format>): decode=<kernel> prefill=<kernel>" of a layer's weight, for a block's variants().
std::string layer_variants(const Weight& w);

// Tokens a prompt runs through the layers at a time (the run state is sized for it), unless the
// caller says otherwise. 256 = the most tokens the prefill GEMMs take per call (Compute::matmul_batch's
// token blocks), so a longer chunk saves no more weight preparation: 512-token prompts ran 14-20%
// faster than in chunks of 64 on the AMX table, 4-8% on the AVX2 robot table, an 80-token one
// (a camera frame's prompt) 31% on AMX, for +27 MiB of run state on Qwen3.5-0.8B (+63 MiB at 512).
// Results do not depend on it (docs/kernels/prefill-batch.md).
constexpr int64_t kDefaultBatch = 256;

class Decoder {
public:
    // Picks the architecture from general.architecture (registry.h); UnsupportedModel for one
    // this engine does not run, GGUFError for a file that does not hold what the config says.
    // kv_type: how the KV cache stores keys and values: F32, F16 or Q8_0 (int8 blocks of 32 with an
    // fp16 scale, per head; needs a head size that is a multiple of 32); std::invalid_argument else.
    // mtp: load the file's multi-token-prediction block (NextNWeights) where it has one, run it
    // beside the decoder on every position (its own KV cache) and let generate() draft from it.
    Decoder(std::shared_ptr<const GGUFFile> file, int n_threads, int64_t n_ctx, int64_t n_batch,
            evk::DType kv_type = evk::DType::F32, bool mtp = false);
    ~Decoder();

    const DecoderConfig& config() const { return cfg_; }
    int64_t n_ctx() const { return n_ctx_; }
    evk::DType kv_type() const { return kv_type_; }
    size_t kv_bytes_per_token() const;  // the KV cache's bytes per position, all layers
    int64_t n_past() const { return n_past_; }
    const PassCosts& pass_costs() const { return pass_costs_; }  // speculation's measured pass times
    const std::vector<LayerShape>& layer_shapes() const { return shapes_; }  // what each layer keeps
    int threads() const { return compute_.threads(); }
    void reset();  // an empty sequence: no positions, recurrent states zero
    bool has_mtp() const { return nextn_ != nullptr; }  // a multi-token-prediction block is loaded

    // Drafts from the multi-token-prediction block (has_mtp()): `token` at position n_past() with
    // the final-normed hidden state of position n_past() - 1, then each draft at the next position
    // with the block's own hidden state, greedy; up to k drafts (fewer at the context's end, none
    // past a stop id) into out, their logits (n_vocab each) into logits when given; how many. The
    // block's cache holds the positions the decoder ran (on from the last reset(), or from the
    // position a restore() left); the drafts' rows in it are overwritten when the decoder runs
    // those positions. The sequence state is left as it was.
    int64_t draft_nextn(int32_t token, int64_t k, const std::vector<int32_t>& stop_ids, int32_t* out, float* logits);

    // Runs a prompt at positions n_past.. and appends it to the sequence state. logits: the last
    // position's n_vocab floats, every position's (n * n_vocab) when all_logits, none when nullptr.
    void prefill(const PromptInput& p, float* logits, bool all_logits);

    // One request: prefill `p` on the sequence state as it stands (reset() or restore() sets it),
    // then greedy decoding. Decoding starts from the logits of p's last position, computed by this
    // call's own prefill (so p must hold at least one token): nothing but the sequence state carries
    // over from one call to the next. max_ms <= 0 means no deadline; it bounds the whole call,
    // prefill included.
    // With a constraint, each token is its choice (constraint.h) and stop_reason "complete" means
    // the constrained answer ended where nothing may follow.
    // lookup (speculation, without a constraint; a decoder with recurrent state is rolled back by a
    // copy of that state taken before each pass, and the confirmed rows run again): token ids of
    // earlier answers, -1 between two. After each token, the longest run of the latest tokens (up to
    // 5) found in it proposes the tokens that followed there as drafts; one decode-phase pass runs the
    // token with up to kMaxDraft drafts, and each draft equal to the token greedy decoding then
    // chooses is accepted without a pass of its own; how many drafts a pass runs (0 to kMaxDraft)
    // follows the drafts accepted so far in the call and the measured cost of a pass by its rows.
    // The tokens are those of plain greedy decoding (each row of a decode-phase chunk computes as a
    // one-row step); the sequence state at the end is the one plain decoding leaves.
    void generate(const PromptInput& p, int64_t max_new, const std::vector<int32_t>& stop_ids, double max_ms,
                  GenerateResult& out, TokenConstraint* constraint = nullptr, const std::vector<int32_t>* lookup = nullptr);

    // Thread-safe, from any thread: a generate() running now or later stops before its next token
    // with "cancelled" (for shutdown: a node stopping mid-answer). Sticky until cancel(false).
    void cancel(bool on = true) { cancel_.store(on, std::memory_order_relaxed); }
    bool cancelled() const { return cancel_.load(std::memory_order_relaxed); }

    // Thread-safe, from any thread while generate() runs: the tokens it has produced so far
    // (appended to `dst`), for streaming partial text; nothing between two calls. The writer pays
    // one atomic store per token (no lock, no allocation); readers lock only against the start and
    // end of a call.
    void progress(std::vector<int32_t>& dst) const;

    KVSnapshot snapshot() const;
    void restore(const KVSnapshot& s);  // std::invalid_argument when it does not fit this model

    std::string variants() const;  // which kernel serves each operator, for the log

private:
    void embed(const PromptInput& p, int64_t c0, int64_t cn);  // rows c0 .. c0 + cn of p into s.x
    void forward_chunk(const Chunk& ch, float* logits, bool all_logits);   // the layers, then the MTP block's rows
    void forward_layers(const Chunk& ch, float* logits, bool all_logits);
    LayerCache cache_of(int64_t layer);
    LayerCache nextn_cache();
    // The MTP block over the chunk's rows: inputs e_ (embedded rows) and hidden rows h_prev[t]
    // (row t's previous position), outputs (head-normed) into h_out rows; s.x is overwritten.
    void nextn_rows(const Chunk& ch, const float* h_prev, float* h_out);
    void nextn_room(int64_t pos0, int64_t n);  // pending rows from pos0 on dropped; room for n more
    void nextn_flush();                        // the pending rows through the block

    std::shared_ptr<const GGUFFile> file_;
    DecoderConfig cfg_;
    int64_t n_ctx_, n_batch_;
    Compute compute_;
    PackArena arena_;  // the weights' packed copies
    Weight tok_embd_, output_;
    std::vector<float> output_norm_;
    std::unique_ptr<DecoderArch> arch_;

    RunState s_;
    std::vector<LayerShape> shapes_;           // per layer
    evk::DType kv_type_;
    std::vector<int64_t> kv_at_, rec_at_;      // per layer: byte offset of its cache in kv_ (K; V follows), of its state in rec_
    std::vector<uint8_t> kv_;                  // the sequence state: every layer's K and V caches (kv_type_ elements),
    std::vector<float> rec_;                   // and recurrent states
    std::vector<float> rec_check_;             // generate(): rec_ before a verification pass (speculation)
    std::vector<float> next_logits_;           // generate()'s own: written by its prefill and decode steps, read by it
    PassCosts pass_costs_;                      // generate()'s verification passes: their measured cost
    std::vector<float> spec_logits_;           // generate()'s verification passes: (1 + kMaxDraft) rows of n_vocab
    // The multi-token-prediction block (mtp): its weights (the arch's), its cache (K then V, kv_type_),
    // the first position that cache holds, its pending rows' inputs [n_batch][n_embd] (embedded
    // rows) and the decoder's final-normed hidden rows [1 + n_batch][n_embd] (row 0: the position
    // before the first pending row), the block's joined input [n_batch][2 n_embd], a draft step's
    // hidden state and logits.
    const NextNWeights* nextn_ = nullptr;
    std::vector<uint8_t> nextn_kv_;
    int64_t nextn_first_ = 0;
    std::vector<float> nextn_e_, nextn_h_, nextn_cat_, draft_h_, draft_logits_;
    int64_t nextn_done_ = 0, nextn_pending_ = 0;  // the block's cache holds positions < done; pending rows wait
    int64_t n_past_ = 0;
    std::atomic<bool> cancel_{false};
    // generate()'s output while it runs (progress()): its token buffer, reserved up front so that
    // it never moves, and how many entries are written (release-stored after each).
    mutable std::mutex progress_mu_;
    const int32_t* progress_data_ = nullptr;  // guarded by progress_mu_
    std::atomic<int64_t> progress_n_{0};
};

}  // namespace evn
