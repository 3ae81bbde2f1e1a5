#include "constraint.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

namespace evn {

ChoiceTrie::ChoiceTrie(const std::vector<std::vector<int32_t>>& choices, int64_t n_vocab) {
    if (choices.empty()) throw std::invalid_argument("choices: at least one is needed");
    // Built as maps (once per request set), then flattened into arrays the per-token step reads.
    std::vector<std::map<int32_t, int32_t>> kids(1);
    std::vector<uint8_t> terminal(1, 0);
    for (size_t c = 0; c < choices.size(); ++c) {
        const std::vector<int32_t>& seq = choices[c];
        if (seq.empty()) throw std::invalid_argument("choices: choice " + std::to_string(c) + " has no tokens");
        int32_t node = 0;
        for (const int32_t t : seq) {
            if (t < 0 || t >= n_vocab)
                throw std::invalid_argument("choices: token " + std::to_string(t) + " is outside the vocabulary");
            auto it = kids[static_cast<size_t>(node)].find(t);
            if (it == kids[static_cast<size_t>(node)].end()) {
                if (static_cast<int64_t>(kids.size()) >= kMaxNodes)
                    throw std::invalid_argument("choices: more than " + std::to_string(kMaxNodes) + " trie nodes");
                const int32_t fresh = static_cast<int32_t>(kids.size());
                kids[static_cast<size_t>(node)].emplace(t, fresh);
                kids.emplace_back();
                terminal.push_back(0);
                node = fresh;
            } else {
                node = it->second;
            }
        }
        terminal[static_cast<size_t>(node)] = 1;
        longest_ = std::max<int64_t>(longest_, static_cast<int64_t>(seq.size()));
    }
    first_.reserve(kids.size() + 1);
    for (const auto& k : kids) {
        first_.push_back(static_cast<int64_t>(child_token_.size()));
        for (const auto& [token, next] : k) {  // std::map: ascending token ids
            child_token_.push_back(token);
            child_node_.push_back(next);
        }
    }
    first_.push_back(static_cast<int64_t>(child_token_.size()));
    terminal_ = std::move(terminal);
}

int32_t ChoiceTrie::choose(const float* logits, int64_t n_vocab, const std::vector<int32_t>& stop_ids) const {
    const size_t n = static_cast<size_t>(node_);
    int32_t best = -1;
    float best_logit = 0.f;
    for (int64_t i = first_[n]; i < first_[n + 1]; ++i) {
        const int32_t t = child_token_[static_cast<size_t>(i)];
        if (best < 0 || logits[t] > best_logit) {
            best = t;
            best_logit = logits[t];
        }
    }
    if (!terminal_[n]) return best;  // a trie node that is not an end always has children
    if (best < 0) return -1;         // a leaf: the answer is complete
    // An end with continuations: the best stop token competes (lower ids first on equal logits).
    int32_t stop = -1;
    for (const int32_t s : stop_ids)
        if (s >= 0 && s < n_vocab && (stop < 0 || logits[s] > logits[stop] || (logits[s] == logits[stop] && s < stop)))
            stop = s;
    if (stop >= 0 && (logits[stop] > best_logit || (logits[stop] == best_logit && stop < best))) return stop;
    return best;
}

void ChoiceTrie::advance(int32_t token) {
    const size_t n = static_cast<size_t>(node_);
    const auto b = child_token_.begin() + first_[n], e = child_token_.begin() + first_[n + 1];
    const auto it = std::lower_bound(b, e, token);
    if (it == e || *it != token) throw std::logic_error("ChoiceTrie::advance: token not allowed here");
    node_ = child_node_[static_cast<size_t>(it - child_token_.begin())];
}

}  // namespace evn
