// Constrained greedy decoding: which tokens may come next. A constraint is consulted once per
// decoded token with the position's logits and picks the greedy token among those it allows (or
// says the answer is complete); it allocates nothing per token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace evn {

class TokenConstraint {
public:
    virtual ~TokenConstraint() = default;
    // Before a request's first token; max_tokens: how many tokens the answer may take at most
    // (the decoder's budget and the context's room; <= 0: unbounded).
    virtual void start(int64_t max_tokens) = 0;
    // The greedy token among the allowed ones (the first of equal maxima, as argmax over masked
    // logits), one of `stop_ids` when ending the answer here is allowed and wins, or -1 when the
    // answer is complete and nothing may follow.
    virtual int32_t choose(const float* logits, int64_t n_vocab, const std::vector<int32_t>& stop_ids) const = 0;
    // The token chosen was taken (never a stop token).
    virtual void advance(int32_t token) = 0;
    // Nothing may follow: the answer is complete (the decoder stops without another step).
    virtual bool complete() const = 0;
};

// The answer is exactly one of a set of token sequences (the encodings of the allowed strings): a
// trie over them. Where one sequence ends and another goes on, ending (a stop token) competes
// with the continuations; where only one ends, the answer is complete.
class ChoiceTrie final : public TokenConstraint {
public:
    // std::invalid_argument for no choices, an empty one, a token outside [0, n_vocab), or more
    // than kMaxNodes trie nodes.
    ChoiceTrie(const std::vector<std::vector<int32_t>>& choices, int64_t n_vocab);

    void start(int64_t) override { node_ = 0; }
    int32_t choose(const float* logits, int64_t n_vocab, const std::vector<int32_t>& stop_ids) const override;
    void advance(int32_t token) override;
    bool complete() const override {
        const std::size_t n = static_cast<std::size_t>(node_);
        return first_[n] == first_[n + 1];
    }

    int64_t n_nodes() const { return static_cast<int64_t>(terminal_.size()); }
    int64_t longest() const { return longest_; }

    static constexpr int64_t kMaxNodes = int64_t{1} << 20;

private:
    // Node i's children: tokens child_token_[first_[i] .. first_[i + 1]) (ascending) leading to
    // nodes child_node_[...]; node 0 is the root.
    std::vector<int64_t> first_;
    std::vector<int32_t> child_token_;
    std::vector<int32_t> child_node_;
    std::vector<uint8_t> terminal_;
    int64_t longest_ = 0;
    int32_t node_ = 0;
};

}  // namespace evn
