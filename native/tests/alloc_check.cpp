// Counts heap allocations while a real model decodes: the per-token path must allocate nothing.
// malloc and friends are interposed (glibc lets an executable define them) and forward to glibc's
// own implementations; operator new goes through malloc. Usage: alloc_check MODEL.gguf [steps]
// Prints the counts and "N passed, M failed".
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "../gguf.h"
#include "../json_schema.h"
#include "../models/decoder.h"

extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
void __libc_free(void*);
}

static volatile bool g_counting = false;
static volatile long g_allocs = 0;

extern "C" {
void* malloc(size_t n) {
    if (g_counting) __atomic_add_fetch(&g_allocs, 1, __ATOMIC_RELAXED);
    return __libc_malloc(n);
}
void* calloc(size_t a, size_t b) {
    if (g_counting) __atomic_add_fetch(&g_allocs, 1, __ATOMIC_RELAXED);
    return __libc_calloc(a, b);
}
void* realloc(void* p, size_t n) {
    if (g_counting) __atomic_add_fetch(&g_allocs, 1, __ATOMIC_RELAXED);
    return __libc_realloc(p, n);
}
void* aligned_alloc(size_t al, size_t n) {
    if (g_counting) __atomic_add_fetch(&g_allocs, 1, __ATOMIC_RELAXED);
    return __libc_memalign(al, n);
}
int posix_memalign(void** out, size_t al, size_t n) {
    if (g_counting) __atomic_add_fetch(&g_allocs, 1, __ATOMIC_RELAXED);
    *out = __libc_memalign(al, n);
    return *out ? 0 : 12;
}
void free(void* p) { __libc_free(p); }
}

// The bytes of a byte-level BPE vocabulary's tokens (GPT-2's alphabet: printable Latin-1 bytes stand
// for themselves, the others are shifted to U+0100 on), control tokens empty: what the Python
// tokenizer hands the schema constraint.
static std::vector<std::string> bpe_token_bytes(const evn::GGUFFile& f) {
    int table[512];
    for (int& c : table) c = -1;
    int shifted = 0;
    for (int b = 0; b < 256; ++b) {
        const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        table[printable ? b : 256 + shifted++] = b;
    }
    const evn::GValue* tokens = f.find("tokenizer.ggml.tokens");
    const evn::GValue* types = f.find("tokenizer.ggml.token_type");
    std::vector<std::string> out;
    if (!tokens) return out;
    for (size_t t = 0; t < tokens->strs.size(); ++t) {
        int32_t type = 1;
        if (types && (t + 1) * 4 <= types->raw.size()) std::memcpy(&type, types->raw.data() + t * 4, 4);
        const std::string& text = tokens->strs[t];
        std::string bytes;
        for (size_t i = 0; i < text.size();) {  // UTF-8 code points of at most two bytes map to a byte
            const unsigned char c = static_cast<unsigned char>(text[i]);
            int cp = -1;
            if (c < 0x80) cp = c, i += 1;
            else if ((c & 0xE0) == 0xC0 && i + 1 < text.size()) cp = ((c & 0x1F) << 6) | (text[i + 1] & 0x3F), i += 2;
            if (cp < 0 || cp >= 512 || table[cp] < 0) {
                bytes = text;
                break;
            }
            bytes.push_back(static_cast<char>(table[cp]));
        }
        out.push_back(type == 3 ? std::string() : bytes);
    }
    return out;
}

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: alloc_check MODEL.gguf [steps] [threads]\n");
        return 2;
    }
    const int steps = argc > 2 ? std::atoi(argv[2]) : 100;
    const int threads = argc > 3 ? std::atoi(argv[3]) : 2;
    int passed = 0, failed = 0;
    auto file = std::make_shared<evn::GGUFFile>(argv[1]);
    evn::Decoder model(file, threads, 512, 64);
    std::vector<float> logits(static_cast<size_t>(model.config().n_vocab));
    const int32_t prompt[] = {1, 504, 30, 2};
    model.prefill(evn::PromptInput{prompt, 4}, logits.data(), false);
    int32_t tok = 42;
    const evn::PromptInput one{&tok, 1};
    model.prefill(one, logits.data(), false);  // warm-up decode step

    g_counting = true;
    for (int i = 0; i < steps; ++i) model.prefill(one, logits.data(), false);
    g_counting = false;
    const long decode_allocs = g_allocs;
    std::printf("decode: %d steps, %ld heap allocations\n", steps, decode_allocs);
    (decode_allocs == 0 ? passed : failed)++;

    // generate() reserves its output once, before the loop: one allocation, whatever the length.
    evn::GenerateResult r;
    r.tokens.reserve(8);
    std::vector<int32_t> stops = {2};
    model.reset();
    g_allocs = 0;
    g_counting = true;
    model.generate(evn::PromptInput{prompt, 4}, steps, stops, 0.0, r);
    g_counting = false;
    std::printf("generate: %zu tokens, %ld heap allocations\n", r.tokens.size(), static_cast<long>(g_allocs));
    (g_allocs <= 2 ? passed : failed)++;

    // Constrained to one long choice: the trie is built before, each token's choice allocates nothing.
    std::vector<int32_t> longest;
    for (int i = 0; i < steps; ++i) longest.push_back(3 + i % 50);
    evn::ChoiceTrie choices({longest}, model.config().n_vocab);
    model.reset();
    g_allocs = 0;
    g_counting = true;
    model.generate(evn::PromptInput{prompt, 4}, steps, stops, 0.0, r, &choices);
    g_counting = false;
    std::printf("generate with choices: %zu tokens (%s), %ld heap allocations\n", r.tokens.size(),
                r.stop_reason.c_str(), static_cast<long>(g_allocs));
    (g_allocs <= 2 && r.tokens == longest ? passed : failed)++;

    // Constrained to a JSON schema: an object with a boolean, an enum, an integer and an array of
    // strings (compiled as engine/constraints.py compiles it); stack, scratch state and candidate
    // heap are sized at construction, so the whole answer allocates nothing per token.
    auto vocab = std::make_shared<evn::TokenBytes>(bpe_token_bytes(*file));
    std::vector<evn::SchemaNode> nodes(6);
    nodes[0].kind = evn::SchemaNode::kObject;
    nodes[0].children = {1, 2, 3, 4};
    nodes[0].literals = {"\"ok\":", "\"colour\":", "\"count\":", "\"tags\":"};
    nodes[0].required = {1, 1, 1, 1};
    nodes[1].kind = evn::SchemaNode::kLiterals;
    nodes[1].literals = {"true", "false"};
    nodes[2].kind = evn::SchemaNode::kLiterals;
    nodes[2].literals = {"\"red\"", "\"green\"", "\"blue\""};
    nodes[3].kind = evn::SchemaNode::kNumber;
    nodes[3].a = 12;
    nodes[4].kind = evn::SchemaNode::kArray;
    nodes[4].children = {5};
    nodes[4].a = 1;
    nodes[4].b = 8;
    nodes[5].kind = evn::SchemaNode::kString;
    nodes[5].a = 64;
    evn::JsonSchemaConstraint schema(nodes, vocab);
    model.reset();
    g_allocs = 0;
    g_counting = true;
    model.generate(evn::PromptInput{prompt, 4}, steps, stops, 0.0, r, &schema);
    g_counting = false;
    const evn::JsonSchemaConstraint::Stats st = schema.stats();
    std::printf("generate with a json schema: %zu tokens (%s), %ld heap allocations, %.1f candidates per token, "
                "%lld fallbacks\n", r.tokens.size(), r.stop_reason.c_str(), static_cast<long>(g_allocs),
                st.chosen ? static_cast<double>(st.examined) / static_cast<double>(st.chosen) : 0.0,
                static_cast<long long>(st.fallbacks));
    (g_allocs <= 2 && !r.tokens.empty() && (schema.complete() || r.stop_reason == "max_tokens") ? passed : failed)++;
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
