// Counts heap allocations while a real model decodes: the per-token path must allocate nothing.
// malloc and friends are interposed (glibc lets an executable define them) and forward to glibc's
// own implementations; operator new goes through malloc. Usage: alloc_check MODEL.gguf [steps]
// Prints the counts and "N passed, M failed".
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "../gguf.h"
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
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
