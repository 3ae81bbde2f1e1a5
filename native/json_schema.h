// A JSON-schema constraint: the answer parses as JSON and validates against a schema, written in
// one canonical form (no whitespace, keys in schema order, optional keys may be left out, numbers
// with bounded digit counts, strings of printable characters with short escapes). The schema comes
// compiled (edgevlm_ros/engine/constraints.py) into a tree of nodes; the state is a stack of frames,
// one per open value, fed byte by byte. Everything is sized at construction: choosing a token
// copies the stack into a preallocated scratch state and allocates nothing.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "constraint.h"

namespace evn {

// The bytes each token decodes to, once per vocabulary (shared by every schema of a model). A token
// without bytes (control and image tokens) is never chosen, except as a stop token.
class TokenBytes {
public:
    // std::invalid_argument for more than kMaxTokens tokens or kMaxBytes bytes in all.
    explicit TokenBytes(const std::vector<std::string>& pieces);

    int64_t size() const { return static_cast<int64_t>(offset_.size()) - 1; }
    const uint8_t* bytes(int32_t t) const { return data_.data() + offset_[static_cast<size_t>(t)]; }
    int64_t length(int32_t t) const {
        return offset_[static_cast<size_t>(t) + 1] - offset_[static_cast<size_t>(t)];
    }
    // 1 for a token with bytes, 0 without: the candidate scan reads this beside the logits.
    const uint8_t* has_bytes() const { return has_bytes_.data(); }
    // Tokens that are exactly one byte, ascending ids (SentencePiece may have two for a byte).
    const std::vector<int32_t>& single_byte_tokens() const { return single_; }
    bool has_single(uint8_t b) const { return has_single_[b] != 0; }

    static constexpr int64_t kMaxTokens = int64_t{1} << 22;
    static constexpr int64_t kMaxBytes = int64_t{1} << 28;

private:
    std::vector<uint8_t> data_;
    std::vector<int64_t> offset_;  // token t: data_[offset_[t] .. offset_[t + 1])
    std::vector<uint8_t> has_bytes_;
    std::vector<int32_t> single_;
    std::array<uint8_t, 256> has_single_{};
};

// One node of a compiled schema, as the Python side sends it. Children have higher indices than
// their parent (so the tree has no cycle); node 0 is the root.
//   kObject:   children[k] the value of property k, literals[k] its key as written with quotes and
//              colon ("name":), required[k]
//   kArray:    children = {item}; a = minItems, b = maxItems
//   kString:   a = the most characters (a multi-byte UTF-8 character and an escape count one)
//   kLiterals: literals = the allowed texts (an enum's JSON strings, or true / false), prefix-free
//   kNumber:   a = the most integer digits, b = the most fraction digits (0: an integer)
struct SchemaNode {
    enum Kind : int32_t { kObject = 0, kArray = 1, kString = 2, kLiterals = 3, kNumber = 4 };
    int32_t kind = kObject;
    int64_t a = 0, b = 0;
    std::vector<int32_t> children;
    std::vector<std::string> literals;
    std::vector<uint8_t> required;
};

class JsonSchemaConstraint final : public TokenConstraint {
public:
    // std::invalid_argument (one line) for a malformed tree, a size beyond the limits below, or a
    // vocabulary without the single-byte tokens the answers may need (the fallback's guarantee).
    // fallback: tokens the fallback tries before the single-byte ones (the schema's keys and enum
    // texts as the tokenizer splits them), so forced text is written in words, not byte by byte.
    JsonSchemaConstraint(const std::vector<SchemaNode>& nodes, std::shared_ptr<const TokenBytes> vocab,
                         const std::vector<int32_t>& fallback = {});

    // max_tokens: how many tokens the answer may take (<= 0: no bound). Each chosen token leaves
    // enough tokens to close every open value with single-byte tokens, so an answer cut by the
    // budget is still complete JSON.
    void start(int64_t max_tokens) override;
    int32_t choose(const float* logits, int64_t n_vocab, const std::vector<int32_t>& stop_ids) const override;
    void advance(int32_t token) override;  // std::logic_error for a token the state does not allow
    bool complete() const override;

    // The answer so far is a whole value (a stop token may end it here).
    bool accepting() const;
    // Bytes of the shortest answer (so the fewest tokens that always suffice), and of the shortest
    // completion of the answer so far.
    int64_t min_answer_bytes() const { return nodes_[0].min_len; }
    int64_t min_completion_bytes() const { return rest(state_); }
    // Whether the token's bytes may follow the answer so far (no budget).
    bool allows(int32_t token) const;
    // Multi-byte UTF-8 characters in free strings: only when the vocabulary has every continuation byte alone.
    bool utf8_strings() const { return utf8_ok_; }

    // Of the last request (since start()): tokens chosen, candidates examined for them, and how many
    // were chosen by the single-byte fallback.
    struct Stats {
        int64_t chosen = 0, examined = 0, fallbacks = 0;
    };
    Stats stats() const { return stats_; }
    const std::vector<int32_t>& fallback_tokens() const { return fallback_; }

    // choose() examines at most kTopK candidates in logit order, then falls back to the best allowed
    // token of the schema's texts, else the best allowed single-byte token or stop token: at most
    // kTopK + 2 x (fallback + single-byte + stop tokens) feeds per token.
    static constexpr int kTopK = 64;
    static constexpr int64_t kMaxFallback = 4096;  // tokens beside the single-byte ones
    static constexpr int kMaxDepth = 16;
    static constexpr int64_t kMaxNodes = 4096, kMaxLiterals = 4096, kMaxLiteralBytes = 4096;
    static constexpr int64_t kMaxItems = 4096, kMaxStringChars = 1 << 16, kMaxDigits = 18;
    static constexpr int64_t kMaxAnswerBytes = int64_t{1} << 20;  // the shortest answer's bytes

private:
    struct Node {
        int32_t kind = 0;
        int64_t a = 0, b = 0;
        std::vector<int32_t> child;
        std::vector<std::string> lit;
        std::vector<uint8_t> req;
        // kObject, n + 1 entries, for properties k ..: the last one reachable from k (the first
        // required one, else the last), and the required ones' count and bytes (key + shortest value).
        std::vector<int32_t> reach, req_count;
        std::vector<int64_t> req_bytes;
        int64_t min_len = 0;  // bytes of the node's shortest value
    };
    // One open value. Fields by kind: n = next property (object), items so far (array), characters
    // (string), integer digits (number); j = the lowest literal / key consistent with the bytes so
    // far, UTF-8 continuation bytes pending (string), fraction digits (number); p = bytes of literal
    // j matched; lo, hi = the range of the next continuation byte (string).
    struct Frame {
        int32_t node = 0, phase = 0, n = 0, j = 0, p = 0;
        uint8_t lo = 0, hi = 0;
    };
    struct State {
        int32_t depth = 0;
        std::array<Frame, kMaxDepth> f{};
    };
    struct Candidate {
        float logit;
        int32_t id;
    };

    bool feed(State& s, uint8_t byte) const;
    bool feed_token(State& s, int32_t token) const;
    int64_t rest(const State& s) const;
    int64_t frame_rest(const Frame& f) const;
    int64_t object_rest(const Node& nd, int32_t k, bool emitted) const;
    int32_t match(const Node& nd, int32_t lo, int32_t hi, int32_t j, int32_t p, uint8_t b) const;
    bool is_accepting(const State& s) const;
    // Whether `token` may be chosen now: a stop token where the answer is whole, else its bytes fit
    // and leave room (remaining tokens after it) for the shortest completion.
    bool accept(int32_t token, bool stop, int64_t room) const;

    std::vector<Node> nodes_;
    std::shared_ptr<const TokenBytes> vocab_;
    bool utf8_ok_ = false;
    State state_;
    int64_t budget_ = 0, steps_ = 0;
    // choose()'s preallocated work space.
    mutable State scratch_;
    mutable std::vector<Candidate> heap_;
    mutable Stats stats_;
    std::vector<int32_t> fallback_;  // the given tokens of more than one byte, ascending, once each
};

}  // namespace evn
