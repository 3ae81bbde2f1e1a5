#include "json_schema.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace evn {

namespace {

// Where a frame is inside its value. kStart: nothing of it written yet.
enum Phase : int32_t {
    kStart,
    kObjOpen,   // after '{'
    kObjKey,    // inside a key literal
    kObjAfter,  // after a property's value
    kObjComma,  // after ','
    kArrOpen,   // after '['
    kArrAfter,  // after an item
    kArrComma,  // after ','
    kStrIn,     // inside the quotes
    kStrEsc,    // after a backslash
    kStrUtf8,   // inside a multi-byte character
    kLitMatch,  // inside a literal
    kNumSign,   // after '-'
    kNumZero,   // a leading 0
    kNumInt,    // integer digits
    kNumDot,    // after '.'
    kNumFrac,   // fraction digits
};

constexpr int64_t kHuge = int64_t{1} << 40;  // saturation of byte counts (never overflows below)

int64_t sat(int64_t x) { return std::min(x, kHuge); }

bool is_digit(uint8_t b) { return b >= '0' && b <= '9'; }

std::string byte_hex(unsigned b) {
    const char* hex = "0123456789ABCDEF";
    return std::string("0x") + hex[(b >> 4) & 15] + hex[b & 15];
}

// Ranking of candidates: higher logit first, the lower id on equal logits (argmax's first maximum).
bool better(float la, int32_t a, float lb, int32_t b) { return la > lb || (la == lb && a < b); }

float key_of(float x) { return std::isnan(x) ? -std::numeric_limits<float>::infinity() : x; }

}  // namespace

TokenBytes::TokenBytes(const std::vector<std::string>& pieces) {
    if (static_cast<int64_t>(pieces.size()) > kMaxTokens)
        throw std::invalid_argument("token bytes: more than " + std::to_string(kMaxTokens) + " tokens");
    int64_t total = 0;
    for (const std::string& p : pieces) total += static_cast<int64_t>(p.size());
    if (total > kMaxBytes) throw std::invalid_argument("token bytes: more than " + std::to_string(kMaxBytes) + " bytes");
    data_.reserve(static_cast<size_t>(total));
    offset_.reserve(pieces.size() + 1);
    offset_.push_back(0);
    for (size_t t = 0; t < pieces.size(); ++t) {
        const std::string& p = pieces[t];
        data_.insert(data_.end(), p.begin(), p.end());
        offset_.push_back(static_cast<int64_t>(data_.size()));
        has_bytes_.push_back(p.empty() ? 0 : 1);
        if (p.size() == 1) {
            single_.push_back(static_cast<int32_t>(t));
            has_single_[static_cast<uint8_t>(p[0])] = 1;
        }
    }
}

JsonSchemaConstraint::JsonSchemaConstraint(const std::vector<SchemaNode>& nodes, std::shared_ptr<const TokenBytes> vocab,
                                           const std::vector<int32_t>& fallback)
    : vocab_(std::move(vocab)), heap_(kTopK) {
    if (!vocab_) throw std::invalid_argument("json schema: no token bytes");
    if (static_cast<int64_t>(fallback.size()) > kMaxFallback)
        throw std::invalid_argument("json schema: more than " + std::to_string(kMaxFallback) + " fallback tokens");
    for (const int32_t t : fallback) {
        if (t < 0 || t >= vocab_->size() || vocab_->length(t) == 0)
            throw std::invalid_argument("json schema: fallback token " + std::to_string(t) + " is outside the vocabulary or has no bytes");
        if (vocab_->length(t) > 1) fallback_.push_back(t);
    }
    std::sort(fallback_.begin(), fallback_.end());
    fallback_.erase(std::unique(fallback_.begin(), fallback_.end()), fallback_.end());
    if (nodes.empty()) throw std::invalid_argument("json schema: no nodes");
    const int64_t n_nodes = static_cast<int64_t>(nodes.size());
    if (n_nodes > kMaxNodes) throw std::invalid_argument("json schema: more than " + std::to_string(kMaxNodes) + " nodes");
    nodes_.resize(nodes.size());
    std::array<bool, 256> needed{};  // bytes the fallback may have to write alone
    for (unsigned b = 0x20; b < 0x7f; ++b) needed[b] = true;
    for (int64_t i = 0; i < n_nodes; ++i) {
        const SchemaNode& s = nodes[static_cast<size_t>(i)];
        const std::string at = "json schema: node " + std::to_string(i) + ": ";
        Node& nd = nodes_[static_cast<size_t>(i)];
        nd.kind = s.kind;
        nd.a = s.a;
        nd.b = s.b;
        for (const int32_t c : s.children)
            if (c <= i || c >= n_nodes) throw std::invalid_argument(at + "child " + std::to_string(c) + " is not after it");
        if (static_cast<int64_t>(s.literals.size()) > kMaxLiterals)
            throw std::invalid_argument(at + "more than " + std::to_string(kMaxLiterals) + " literals");
        for (const std::string& l : s.literals) {
            if (l.empty() || static_cast<int64_t>(l.size()) > kMaxLiteralBytes)
                throw std::invalid_argument(at + "a literal is empty or longer than " + std::to_string(kMaxLiteralBytes) + " bytes");
            for (const char c : l) needed[static_cast<uint8_t>(c)] = true;
        }
        const size_t n_lit = s.literals.size(), n_child = s.children.size();
        switch (s.kind) {
        case SchemaNode::kObject:
            if (n_child != n_lit || s.required.size() != n_lit)
                throw std::invalid_argument(at + "an object needs as many keys and required flags as values");
            break;
        case SchemaNode::kArray:
            if (n_child != 1 || n_lit != 0) throw std::invalid_argument(at + "an array has exactly one item node");
            if (s.a < 0 || s.a > s.b || s.b > kMaxItems)
                throw std::invalid_argument(at + "array sizes must satisfy 0 <= min <= max <= " + std::to_string(kMaxItems));
            break;
        case SchemaNode::kString:
            if (n_child || n_lit || s.a < 0 || s.a > kMaxStringChars)
                throw std::invalid_argument(at + "a string takes a length in 0.." + std::to_string(kMaxStringChars));
            break;
        case SchemaNode::kLiterals:
            if (n_child || n_lit == 0) throw std::invalid_argument(at + "literals need at least one text");
            break;
        case SchemaNode::kNumber:
            if (n_child || n_lit || s.a < 1 || s.a > kMaxDigits || s.b < 0 || s.b > kMaxDigits)
                throw std::invalid_argument(at + "a number takes 1.." + std::to_string(kMaxDigits) + " integer and 0.." +
                                            std::to_string(kMaxDigits) + " fraction digits");
            break;
        default:
            throw std::invalid_argument(at + "unknown kind " + std::to_string(s.kind));
        }
        // Literals of one node must be distinct and none a prefix of another: a literal then ends
        // exactly where its last byte is written.
        for (size_t x = 0; x < n_lit; ++x)
            for (size_t y = 0; y < n_lit; ++y)
                if (x != y && s.literals[y].compare(0, s.literals[x].size(), s.literals[x]) == 0)
                    throw std::invalid_argument(at + "literal " + std::to_string(x) + " is a prefix of literal " + std::to_string(y));
        nd.child = s.children;
        nd.lit = s.literals;
        nd.req = s.required;
    }
    // Depth, and each node's shortest value, from the leaves up (children come after parents).
    std::vector<int32_t> depth(nodes_.size(), 1);
    for (int64_t i = n_nodes - 1; i >= 0; --i) {
        Node& nd = nodes_[static_cast<size_t>(i)];
        for (const int32_t c : nd.child) depth[static_cast<size_t>(i)] = std::max(depth[static_cast<size_t>(i)], depth[static_cast<size_t>(c)] + 1);
        if (depth[static_cast<size_t>(i)] > kMaxDepth)
            throw std::invalid_argument("json schema: nested deeper than " + std::to_string(kMaxDepth));
        switch (nd.kind) {
        case SchemaNode::kObject: {
            const int32_t n = static_cast<int32_t>(nd.child.size());
            nd.reach.assign(static_cast<size_t>(n) + 1, n - 1);
            nd.req_count.assign(static_cast<size_t>(n) + 1, 0);
            nd.req_bytes.assign(static_cast<size_t>(n) + 1, 0);
            for (int32_t k = n - 1; k >= 0; --k) {
                const size_t u = static_cast<size_t>(k);
                const bool r = nd.req[u] != 0;
                nd.reach[u] = r ? k : nd.reach[u + 1];
                nd.req_count[u] = nd.req_count[u + 1] + (r ? 1 : 0);
                nd.req_bytes[u] = r ? sat(nd.req_bytes[u + 1] + static_cast<int64_t>(nd.lit[u].size()) +
                                          nodes_[static_cast<size_t>(nd.child[u])].min_len)
                                    : nd.req_bytes[u + 1];
            }
            nd.min_len = sat(1 + object_rest(nd, 0, false));
            break;
        }
        case SchemaNode::kArray: {
            const int64_t item = nodes_[static_cast<size_t>(nd.child[0])].min_len;
            nd.min_len = nd.a == 0 ? 2 : sat(2 + sat(nd.a * item) + nd.a - 1);
            break;
        }
        case SchemaNode::kString: nd.min_len = 2; break;
        case SchemaNode::kLiterals: {
            size_t m = nd.lit[0].size();
            for (const std::string& l : nd.lit) m = std::min(m, l.size());
            nd.min_len = static_cast<int64_t>(m);
            break;
        }
        default: nd.min_len = 1; break;  // kNumber: one digit
        }
    }
    if (nodes_[0].min_len > kMaxAnswerBytes)
        throw std::invalid_argument("json schema: the shortest answer is more than " + std::to_string(kMaxAnswerBytes) + " bytes");
    for (unsigned b = 0; b < 256; ++b)
        if (needed[b] && !vocab_->has_single(static_cast<uint8_t>(b)))
            throw std::invalid_argument("json schema: the vocabulary has no token of the single byte " + byte_hex(b) +
                                        " that an answer may need");
    utf8_ok_ = true;
    for (unsigned b = 0x80; b < 0xc0; ++b) utf8_ok_ = utf8_ok_ && vocab_->has_single(static_cast<uint8_t>(b));
    start(0);
}

void JsonSchemaConstraint::start(int64_t max_tokens) {
    state_.depth = 1;
    state_.f[0] = Frame{};
    budget_ = max_tokens > 0 ? max_tokens : std::numeric_limits<int64_t>::max() / 4;
    steps_ = 0;
    stats_ = Stats{};
}

int64_t JsonSchemaConstraint::object_rest(const Node& nd, int32_t k, bool emitted) const {
    const int32_t rc = nd.req_count[static_cast<size_t>(k)];
    if (rc == 0) return 1;  // '}'
    // The required properties from k on, each after a comma but the first of an empty object.
    return sat(nd.req_bytes[static_cast<size_t>(k)] + (emitted ? rc : rc - 1) + 1);
}

// The lowest literal index in [max(lo, j), hi] that agrees with literal j's first p bytes (any
// literal when p == 0) and has `b` next; -1 when none.
int32_t JsonSchemaConstraint::match(const Node& nd, int32_t lo, int32_t hi, int32_t j, int32_t p, uint8_t b) const {
    const size_t up = static_cast<size_t>(p);
    const std::string* lj = p > 0 ? &nd.lit[static_cast<size_t>(j)] : nullptr;
    for (int32_t k = p > 0 ? std::max(lo, j) : lo; k <= hi; ++k) {
        const std::string& l = nd.lit[static_cast<size_t>(k)];
        if (l.size() > up && static_cast<uint8_t>(l[up]) == b && (up == 0 || std::memcmp(l.data(), lj->data(), up) == 0))
            return k;
    }
    return -1;
}

bool JsonSchemaConstraint::feed(State& s, uint8_t b) const {
    // A loop, not one step: a value that ends without a closing byte (a number) hands the byte to its
    // parent, and an array hands an item's first byte to the item it opens.
    for (;;) {
        if (s.depth == 0) return false;  // the answer is whole: nothing may follow
        Frame& f = s.f[static_cast<size_t>(s.depth - 1)];
        const Node& nd = nodes_[static_cast<size_t>(f.node)];
        auto push = [&](int32_t node) {
            if (s.depth >= kMaxDepth) return false;  // never: the tree's depth was checked
            s.f[static_cast<size_t>(s.depth++)] = Frame{node, kStart, 0, 0, 0, 0, 0};
            return true;
        };
        const int32_t n_lit = static_cast<int32_t>(nd.lit.size());
        switch (f.phase) {
        case kStart:
            switch (nd.kind) {
            case SchemaNode::kObject:
                if (b != '{') return false;
                f.phase = kObjOpen;
                return true;
            case SchemaNode::kArray:
                if (b != '[') return false;
                f.phase = kArrOpen;
                return true;
            case SchemaNode::kString:
                if (b != '"') return false;
                f.phase = kStrIn;
                return true;
            case SchemaNode::kLiterals: {
                const int32_t k = match(nd, 0, n_lit - 1, 0, 0, b);
                if (k < 0) return false;
                f.j = k;
                f.p = 1;
                f.phase = kLitMatch;
                if (nd.lit[static_cast<size_t>(k)].size() == 1) --s.depth;
                return true;
            }
            default:  // kNumber
                if (b == '-') f.phase = kNumSign;
                else if (b == '0') f.phase = kNumZero;
                else if (b >= '1' && b <= '9') f.phase = kNumInt, f.n = 1;
                else return false;
                return true;
            }
        case kObjOpen:
        case kObjComma: {
            if (b == '}' && f.phase == kObjOpen && nd.req_count[static_cast<size_t>(f.n)] == 0) {
                --s.depth;
                return true;
            }
            if (f.n >= n_lit) return false;
            const int32_t k = match(nd, f.n, nd.reach[static_cast<size_t>(f.n)], 0, 0, b);
            if (k < 0) return false;
            f.phase = kObjKey;
            f.j = k;
            f.p = 0;
        }
            [[fallthrough]];  // the key's first byte, matched again below with p = 0 -> 1
        case kObjKey: {
            const int32_t k = f.p == 0 ? f.j : match(nd, f.j, nd.reach[static_cast<size_t>(f.n)], f.j, f.p, b);
            if (k < 0) return false;
            f.j = k;
            if (++f.p == static_cast<int32_t>(nd.lit[static_cast<size_t>(k)].size())) {
                f.n = k + 1;
                f.phase = kObjAfter;
                return push(nd.child[static_cast<size_t>(k)]);
            }
            return true;
        }
        case kObjAfter:
            if (b == ',' && f.n < n_lit) {
                f.phase = kObjComma;
                return true;
            }
            if (b == '}' && nd.req_count[static_cast<size_t>(f.n)] == 0) {
                --s.depth;
                return true;
            }
            return false;
        case kArrOpen:
            if (b == ']' && nd.a == 0) {
                --s.depth;
                return true;
            }
            if (nd.b == 0) return false;
            f.n = 1;
            f.phase = kArrAfter;
            if (!push(nd.child[0])) return false;
            continue;  // the byte opens the first item
        case kArrAfter:
            if (b == ',' && f.n < nd.b) {
                f.phase = kArrComma;
                return true;
            }
            if (b == ']' && f.n >= nd.a) {
                --s.depth;
                return true;
            }
            return false;
        case kArrComma:
            ++f.n;
            f.phase = kArrAfter;
            if (!push(nd.child[0])) return false;
            continue;
        case kStrIn:
            if (b == '"') {
                --s.depth;
                return true;
            }
            if (f.n >= nd.a) return false;  // only the closing quote fits
            if (b == '\\') {
                f.phase = kStrEsc;
                return true;
            }
            if (b >= 0x20 && b < 0x7f) {
                ++f.n;
                return true;
            }
            if (!utf8_ok_) return false;
            // UTF-8 lead bytes with the range of the byte after them (RFC 3629: no overlong forms,
            // no surrogates, nothing above U+10FFFF).
            if (b >= 0xc2 && b <= 0xdf) f.j = 1, f.lo = 0x80, f.hi = 0xbf;
            else if (b == 0xe0) f.j = 2, f.lo = 0xa0, f.hi = 0xbf;
            else if ((b >= 0xe1 && b <= 0xec) || b == 0xee || b == 0xef) f.j = 2, f.lo = 0x80, f.hi = 0xbf;
            else if (b == 0xed) f.j = 2, f.lo = 0x80, f.hi = 0x9f;
            else if (b == 0xf0) f.j = 3, f.lo = 0x90, f.hi = 0xbf;
            else if (b >= 0xf1 && b <= 0xf3) f.j = 3, f.lo = 0x80, f.hi = 0xbf;
            else if (b == 0xf4) f.j = 3, f.lo = 0x80, f.hi = 0x8f;
            else return false;
            ++f.n;
            f.phase = kStrUtf8;
            return true;
        case kStrEsc:
            if (!std::strchr("\"\\/bfnrt", b) || b == 0) return false;
            ++f.n;
            f.phase = kStrIn;
            return true;
        case kStrUtf8:
            if (b < f.lo || b > f.hi) return false;
            f.lo = 0x80;
            f.hi = 0xbf;
            if (--f.j == 0) f.phase = kStrIn;
            return true;
        case kLitMatch: {
            const int32_t k = match(nd, f.j, n_lit - 1, f.j, f.p, b);
            if (k < 0) return false;
            f.j = k;
            if (++f.p == static_cast<int32_t>(nd.lit[static_cast<size_t>(k)].size())) --s.depth;
            return true;
        }
        case kNumSign:
            if (b == '0') f.phase = kNumZero;
            else if (b >= '1' && b <= '9') f.phase = kNumInt, f.n = 1;
            else return false;
            return true;
        case kNumZero:
        case kNumInt:
            if (f.phase == kNumInt && is_digit(b) && f.n < nd.a) {
                ++f.n;
                return true;
            }
            if (b == '.' && nd.b > 0) {
                f.phase = kNumDot;
                return true;
            }
            --s.depth;  // the number ends here: the byte is its parent's
            continue;
        case kNumDot:
            if (!is_digit(b)) return false;
            f.phase = kNumFrac;
            f.j = 1;
            return true;
        case kNumFrac:
            if (is_digit(b) && f.j < nd.b) {
                ++f.j;
                return true;
            }
            --s.depth;
            continue;
        default:
            return false;
        }
    }
}

bool JsonSchemaConstraint::feed_token(State& s, int32_t token) const {
    const int64_t n = vocab_->length(token);
    if (n == 0) return false;
    const uint8_t* p = vocab_->bytes(token);
    for (int64_t i = 0; i < n; ++i)
        if (!feed(s, p[i])) return false;
    return true;
}

// The bytes of the shortest completion of one frame's value, given that the frames above it are done.
int64_t JsonSchemaConstraint::frame_rest(const Frame& f) const {
    const Node& nd = nodes_[static_cast<size_t>(f.node)];
    auto item = [&]() { return nodes_[static_cast<size_t>(nd.child[0])].min_len; };
    // Key k then its value then the rest of the object, for keys from j consistent with p bytes.
    auto best_key = [&](int32_t j, int32_t p) {
        int64_t best = kHuge;
        const size_t up = static_cast<size_t>(p);
        for (int32_t k = j; k <= nd.reach[static_cast<size_t>(f.n)]; ++k) {
            const std::string& l = nd.lit[static_cast<size_t>(k)];
            // Consistent with the p bytes so far (a shorter key is not: keys are prefix-free).
            if (l.size() <= up || (p > 0 && std::memcmp(l.data(), nd.lit[static_cast<size_t>(j)].data(), up) != 0)) continue;
            best = std::min(best, sat(static_cast<int64_t>(l.size()) - p + nodes_[static_cast<size_t>(nd.child[static_cast<size_t>(k)])].min_len +
                                      object_rest(nd, k + 1, true)));
        }
        return best;
    };
    switch (f.phase) {
    case kStart: return nd.min_len;
    case kObjOpen: return object_rest(nd, f.n, false);
    case kObjAfter: return object_rest(nd, f.n, true);
    case kObjComma: return best_key(f.n, 0);
    case kObjKey: return best_key(f.j, f.p);
    case kArrOpen: return nd.a == 0 ? 1 : sat(nd.a * item() + nd.a - 1 + 1);
    case kArrAfter: return sat(std::max<int64_t>(nd.a - f.n, 0) * (item() + 1) + 1);
    case kArrComma: return sat(item() + std::max<int64_t>(nd.a - f.n - 1, 0) * (item() + 1) + 1);
    case kStrIn: return 1;
    case kStrEsc: return 2;
    case kStrUtf8: return f.j + 1;
    case kLitMatch: {
        int64_t best = kHuge;
        const std::string& lj = nd.lit[static_cast<size_t>(f.j)];
        for (size_t k = static_cast<size_t>(f.j); k < nd.lit.size(); ++k)
            if (nd.lit[k].size() > static_cast<size_t>(f.p) && std::memcmp(nd.lit[k].data(), lj.data(), static_cast<size_t>(f.p)) == 0)
                best = std::min(best, static_cast<int64_t>(nd.lit[k].size()) - f.p);
        return best;
    }
    case kNumSign: case kNumDot: return 1;
    default: return 0;  // kNumZero, kNumInt, kNumFrac: the number may end here
    }
}

int64_t JsonSchemaConstraint::rest(const State& s) const {
    int64_t total = 0;
    for (int32_t d = 0; d < s.depth; ++d) total = sat(total + frame_rest(s.f[static_cast<size_t>(d)]));
    return total;
}

bool JsonSchemaConstraint::is_accepting(const State& s) const {
    if (s.depth == 0) return true;
    if (s.depth > 1) return false;
    const int32_t ph = s.f[0].phase;
    return ph == kNumZero || ph == kNumInt || ph == kNumFrac;
}

bool JsonSchemaConstraint::accepting() const { return is_accepting(state_); }

bool JsonSchemaConstraint::complete() const {
    if (state_.depth == 0) return true;
    if (state_.depth > 1) return false;
    const Frame& f = state_.f[0];
    const Node& nd = nodes_[static_cast<size_t>(f.node)];
    switch (f.phase) {
    case kNumZero: return nd.b == 0;
    case kNumInt: return f.n >= nd.a && nd.b == 0;
    case kNumFrac: return f.j >= nd.b;
    default: return false;
    }
}

bool JsonSchemaConstraint::allows(int32_t token) const {
    if (token < 0 || token >= vocab_->size()) return false;
    scratch_.depth = state_.depth;
    std::copy_n(state_.f.begin(), state_.depth, scratch_.f.begin());
    return feed_token(scratch_, token);
}

bool JsonSchemaConstraint::accept(int32_t token, bool stop, int64_t room) const {
    ++stats_.examined;
    if (stop) return is_accepting(state_);
    if (!allows(token)) return false;
    return rest(scratch_) <= room;
}

int32_t JsonSchemaConstraint::choose(const float* logits, int64_t n_vocab, const std::vector<int32_t>& stop_ids) const {
    const int64_t n = std::min(n_vocab, vocab_->size());
    auto is_stop = [&](int32_t t) { return std::find(stop_ids.begin(), stop_ids.end(), t) != stop_ids.end(); };
    // Tokens left after this one: the shortest completion must fit in them.
    const int64_t room = std::max<int64_t>(budget_ - steps_ - 1, 0);
    // The kTopK best candidates (tokens with bytes, and the stop tokens) in one pass: a heap whose top
    // is the worst kept (ranking: `better`).
    auto worse_first = [](const Candidate& x, const Candidate& y) { return better(x.logit, x.id, y.logit, y.id); };
    size_t kept = 0;
    auto offer = [&](int32_t t) {
        const Candidate c{key_of(logits[t]), t};
        if (kept < heap_.size()) {
            heap_[kept++] = c;
            std::push_heap(heap_.begin(), heap_.begin() + static_cast<std::ptrdiff_t>(kept), worse_first);
        } else if (better(c.logit, c.id, heap_[0].logit, heap_[0].id)) {
            std::pop_heap(heap_.begin(), heap_.end(), worse_first);
            heap_.back() = c;
            std::push_heap(heap_.begin(), heap_.end(), worse_first);
        }
    };
    const uint8_t* live = vocab_->has_bytes();
    int64_t t = 0;
    for (; t < n && kept < heap_.size(); ++t)
        if (live[t]) offer(static_cast<int32_t>(t));
    // The heap is full: a later token enters only with a logit above the worst kept one (on a tie
    // the kept one has the lower id; NaN compares false, as its rank -inf never beats anything).
    // Blocks of 16 logits are skipped with one (vectorized) test; the heap changes rarely.
    float worst = heap_[0].logit;
    auto scan = [&](int64_t from, int64_t to) {
        for (int64_t u = from; u < to; ++u)
            if (logits[u] > worst && live[u]) {
                offer(static_cast<int32_t>(u));
                worst = heap_[0].logit;
            }
    };
    constexpr int64_t kBlock = 16;
    for (; t + kBlock <= n; t += kBlock) {
        bool any = false;
        for (int64_t k = 0; k < kBlock; ++k) any |= logits[t + k] > worst;
        if (any) scan(t, t + kBlock);
    }
    scan(t, n);
    for (size_t i = 0; i < stop_ids.size(); ++i) {
        const int32_t s = stop_ids[i];
        // A stop token with bytes is already offered; a repeated one counts once.
        if (s >= 0 && s < n_vocab && (s >= n || vocab_->length(s) == 0) &&
            std::find(stop_ids.begin(), stop_ids.begin() + static_cast<std::ptrdiff_t>(i), s) == stop_ids.begin() + static_cast<std::ptrdiff_t>(i))
            offer(s);
    }
    std::sort_heap(heap_.begin(), heap_.begin() + static_cast<std::ptrdiff_t>(kept), worse_first);  // best first
    ++stats_.chosen;
    for (size_t i = 0; i < kept; ++i)
        if (accept(heap_[i].id, is_stop(heap_[i].id), room)) return heap_[i].id;
    // None of them: the best allowed token of the schema's texts, else the best allowed single-byte
    // token or stop token. One of the latter always fits (the next byte of the shortest completion;
    // the constructor checked each such byte has a token of its own), unless the budget was already
    // too small at the start: then the budget is dropped.
    ++stats_.fallbacks;
    for (const int64_t limit : {room, kHuge}) {
        int32_t best = -1;
        float best_logit = 0.f;
        auto consider = [&](int32_t t, bool stop) {
            const float l = key_of(logits[t]);
            if ((best < 0 || better(l, t, best_logit, best)) && accept(t, stop, limit)) best = t, best_logit = l;
        };
        for (const int32_t t : fallback_)
            if (t < n && !is_stop(t)) consider(t, false);
        if (best >= 0) return best;
        for (const int32_t t : vocab_->single_byte_tokens())
            if (t < n && !is_stop(t)) consider(t, false);
        for (const int32_t s : stop_ids)
            if (s >= 0 && s < n_vocab) consider(s, true);
        if (best >= 0) return best;
    }
    return -1;  // nothing may follow (complete() says so before the decoder asks)
}

void JsonSchemaConstraint::advance(int32_t token) {
    if (!allows(token)) throw std::logic_error("JsonSchemaConstraint::advance: token not allowed here");
    state_.depth = scratch_.depth;
    std::copy_n(scratch_.f.begin(), scratch_.depth, state_.f.begin());
    ++steps_;
}

}  // namespace evn
