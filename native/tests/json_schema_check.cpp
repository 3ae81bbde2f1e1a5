// Hostile and random use of the JSON-schema constraint, for ASan + UBSan: random valid schema trees
// decoded under random logits (NaN, infinities, ties) and random budgets must only ever choose
// tokens the state allows and end in a whole answer when the budget runs out; random malformed
// trees must be refused with std::invalid_argument, never crash. Usage: json_schema_check [schemas]
// Prints "N passed, M failed".
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <stdexcept>

#include "../json_schema.h"

using evn::JsonSchemaConstraint;
using evn::SchemaNode;

namespace {

std::mt19937 rng(7);
int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// A vocabulary of every single byte, JSON-looking pieces, random byte strings and empty tokens.
std::vector<std::string> vocabulary() {
    std::vector<std::string> v;
    for (int b = 0; b < 256; ++b) v.push_back(std::string(1, static_cast<char>(b)));
    const char* pieces[] = {"{\"", "\":", "\",\"", "\"}", "},{", "[\"", "\"]", "true", "false", "tr", "ue",
                            "\"v1\"", "\"k0\":", "\"k1\":{", "12", "0.", ".5", "-3", "\\n", "\\u", "\xc3\xa9",
                            "\xe2\x82", "\xac", "\xf0\x9f\x98\x80", "\xed\xa0\x80", "ab cd", "\"v", "k2", ",", "]]"};
    for (const char* p : pieces) v.push_back(p);
    for (int i = 0; i < 60; ++i) {
        std::string s;
        for (int k = uniform(1, 6); k > 0; --k) s.push_back(static_cast<char>(uniform(0, 255)));
        v.push_back(s);
    }
    for (int i = 0; i < 6; ++i) v.push_back("");  // control tokens
    return v;
}

// A random valid subtree appended to `nodes`; returns its index.
int32_t random_node(std::vector<SchemaNode>& nodes, int depth) {
    const int32_t at = static_cast<int32_t>(nodes.size());
    nodes.emplace_back();
    const int kind = depth >= 5 ? uniform(2, 4) : uniform(0, 4);
    SchemaNode n;
    n.kind = kind;
    switch (kind) {
    case SchemaNode::kObject:
        for (int k = uniform(0, 4); k > 0; --k) {
            n.literals.push_back("\"k" + std::to_string(n.literals.size()) + (uniform(0, 1) ? "x" : "") + "\":");
            n.required.push_back(static_cast<uint8_t>(uniform(0, 1)));
            n.children.push_back(random_node(nodes, depth + 1));
        }
        break;
    case SchemaNode::kArray:
        n.a = uniform(0, 2);
        n.b = n.a + uniform(0, 2);
        n.children.push_back(random_node(nodes, depth + 1));
        break;
    case SchemaNode::kString: n.a = uniform(0, 5); break;
    case SchemaNode::kLiterals:
        if (uniform(0, 1)) n.literals = {"true", "false"};
        else
            for (int k = uniform(1, 4); k > 0; --k) n.literals.push_back("\"v" + std::to_string(n.literals.size()) + "\"");
        break;
    default:
        n.a = uniform(1, 3);
        n.b = uniform(0, 2);
        break;
    }
    nodes[static_cast<size_t>(at)] = n;
    return at;
}

float random_logit() {
    switch (uniform(0, 40)) {
    case 0: return std::numeric_limits<float>::quiet_NaN();
    case 1: return std::numeric_limits<float>::infinity();
    case 2: return -std::numeric_limits<float>::infinity();
    case 3: return 1.f;  // ties
    default: return std::normal_distribution<float>(0.f, 3.f)(rng);
    }
}

}  // namespace

int main(int argc, char** argv) {
    const int n_schemas = argc > 1 ? std::atoi(argv[1]) : 300;
    int passed = 0, failed = 0;
    auto vocab = std::make_shared<evn::TokenBytes>(vocabulary());
    const int64_t n_vocab = vocab->size() + 2;  // a head wider than the vocabulary
    const std::vector<int32_t> stops = {static_cast<int32_t>(vocab->size() - 1), static_cast<int32_t>(n_vocab - 1)};
    std::vector<float> logits(static_cast<size_t>(n_vocab));
    for (int s = 0; s < n_schemas; ++s) {
        std::vector<SchemaNode> nodes;
        random_node(nodes, 1);
        std::vector<int32_t> fallback;  // multi-byte pieces the fallback tries first
        for (int k = uniform(0, 20); k > 0; --k) fallback.push_back(uniform(256, static_cast<int>(vocab->size()) - 7));
        JsonSchemaConstraint c(nodes, vocab, fallback);
        bool ok = true;
        for (int run = 0; run < 3 && ok; ++run) {
            const int64_t budget = run == 0 ? 0 : c.min_answer_bytes() + uniform(0, 20);
            c.start(budget);
            int64_t steps = 0;
            for (; steps < (budget ? budget : 200); ++steps) {
                for (float& l : logits) l = random_logit();
                const int32_t t = c.choose(logits.data(), n_vocab, stops);
                if (t < 0) {
                    ok = ok && c.complete();
                    break;
                }
                if (t == stops[0] || t == stops[1]) {
                    ok = ok && c.accepting();
                    break;
                }
                if (!c.allows(t)) {
                    ok = false;
                    break;
                }
                c.advance(t);
                if (c.complete()) break;
                ok = ok && (!budget || c.min_completion_bytes() <= budget - steps - 1);
            }
            // Cut by the budget: still a whole answer.
            if (budget && steps == budget) ok = ok && c.accepting();
        }
        (ok ? passed : failed)++;
    }
    // Malformed trees: refused with invalid_argument, or (rarely valid) usable.
    int refused = 0;
    for (int s = 0; s < 3000; ++s) {
        std::vector<SchemaNode> nodes(static_cast<size_t>(uniform(0, 5)));
        for (SchemaNode& n : nodes) {
            n.kind = uniform(-1, 5);
            n.a = uniform(0, 3) ? uniform(-2, 5) : std::numeric_limits<int32_t>::max();
            n.b = uniform(0, 3) ? uniform(-2, 5) : -std::numeric_limits<int32_t>::max();
            for (int k = uniform(0, 3); k > 0; --k) n.children.push_back(uniform(-1, 6));
            for (int k = uniform(0, 3); k > 0; --k) n.literals.push_back(std::string(static_cast<size_t>(uniform(0, 3)), "\"a:"[uniform(0, 2)]));
            for (int k = uniform(0, 3); k > 0; --k) n.required.push_back(static_cast<uint8_t>(uniform(0, 1)));
        }
        std::vector<int32_t> fallback;
        for (int k = uniform(0, 2); k > 0; --k) fallback.push_back(uniform(-3, static_cast<int>(vocab->size()) + 3));
        try {
            JsonSchemaConstraint c(nodes, vocab, fallback);
            c.start(uniform(0, 30));
            for (int i = 0; i < 30 && !c.complete(); ++i) {
                for (float& l : logits) l = random_logit();
                const int32_t t = c.choose(logits.data(), n_vocab, stops);
                if (t < 0 || t == stops[0] || t == stops[1]) break;
                c.advance(t);
            }
        } catch (const std::invalid_argument&) {
            ++refused;
        }
    }
    std::printf("malformed trees: %d of 3000 refused\n", refused);
    (refused > 0 ? passed : failed)++;
    // A long key before a shorter one: the shortest completion inside the long key must not compare
    // bytes past the short key's end (found by review: memcmp over the matched length).
    {
        std::vector<SchemaNode> nodes(3);
        nodes[0].kind = SchemaNode::kObject;
        nodes[0].children = {1, 2};
        nodes[0].literals = {"\"" + std::string(40, 'a') + "\":", "\"" + std::string(20, 'b') + "\":"};
        nodes[0].required = {0, 1};
        nodes[1].kind = nodes[2].kind = SchemaNode::kNumber;
        nodes[1].a = nodes[2].a = 2;
        JsonSchemaConstraint c(nodes, vocab);
        c.start(0);
        bool ok = true;
        for (int i = 0; i < 35; ++i) {
            c.advance(i == 0 ? '{' : i == 1 ? '"' : 'a');
            // In key 0 (43 bytes) after i bytes: its rest, a digit, ',', key 1 (23), a digit, '}'.
            if (i >= 2) ok = ok && c.min_completion_bytes() == 43 - i + 1 + 1 + 23 + 1 + 1;
        }
        (ok ? passed : failed)++;
    }
    // Hostile calls: a short logits array, a token outside the vocabulary.
    {
        std::vector<SchemaNode> nodes(1);
        nodes[0].kind = SchemaNode::kNumber;
        nodes[0].a = 3;
        JsonSchemaConstraint c(nodes, vocab);
        c.start(5);
        bool ok = c.choose(logits.data(), 0, stops) == -1 && !c.allows(-1) && !c.allows(1 << 30);
        try {
            c.advance(static_cast<int32_t>(n_vocab + 5));
            ok = false;
        } catch (const std::logic_error&) {
        }
        (ok ? passed : failed)++;
    }
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
