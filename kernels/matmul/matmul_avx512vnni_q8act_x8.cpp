// Packed decode kernel for Q4_0, Q4_1 and Q8_0 with AVX-512 VNNI: `avx512vnni_q8act_x8`. The same
// x8 weight layout (packed_x8.h) and int8 activation blocks (q8act_avx2.h) as the AVX2 / AVX-VNNI
// x8 kernels (matmul_avx2_q8act_x8.cpp, matmul_avxvnni_q8act_x8.cpp), and the same sums: one 64-byte vector holds two 32-byte vectors
// of a block, so one zmm vpdpbusd does the work of two ymm ones.
//
// Why: from memory the ymm kernels stream ~20 GB/s on two threads where a plain load loop reads
// 22-24 (docs/kernels/decode-x8-avx512.md). A core keeps only as many misses in flight as its
// out-of-order window holds loads; fewer instructions per byte put more of them in the window.
// Per block of 8 rows x 32 weights (Q4_1: 160 bytes) the ymm VNNI kernel issues ~38 uops, this
// one ~24: the activations' broadcasts, the same for every group of rows, are made once per call.
//
// Lane layout: zmm m of a block (bytes 64m .. 64m + 63 of its quants) holds vectors 2m and 2m + 1;
// dword r of each 256-bit half belongs to row r. Vector j multiplies activation dword j (its 4
// int8 values) for Q8_0, and for Q4 its low nibbles activation dword j, its high nibbles dword
// 4 + j. So the activation vector for "dwords (a, a + 1)" is dword a broadcast over the low half and
// dword a + 1 over the high half, and a block needs four: A[m] = dwords (2m, 2m + 1), m = 0..3.
// After the dots the two halves are added (row r: lane r + lane 8 + r).
//
// Also here: `avx512vnni_q8act_x8_ymm`, the ymm body of the AVX2 / AVX-VNNI x8 kernels
// (x8_body.inc: Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q6_K) compiled with the EVEX-encoded 256-bit vpdpbusd
// of AVX-512 VL + VNNI and 32 vector registers. A CPU with AVX-512 VNNI but no AVX-VNNI (AMD Zen 4,
// Intel Ice Lake / Cascade Lake) otherwise ran Q5_0 / Q4_K / Q6_K on the maddubs path of
// avx2_q8act_x8 (docs/kernels/decode-x8-avx512.md, "Zen 4").
#if defined(__x86_64__)
#include "avx512_intrin.h"  // first: <immintrin.h> without GCC 12's false warnings

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../ops.h"
#include "packed_x8.h"
#include "q8act_avx2.h"

#define EV_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

namespace evk {

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#endif
namespace x8_evex {
using q8act::BlockQ8A;
using q8act::quantize_act;
constexpr bool kVnni = true;
#define EVK_DPBUSD _mm256_dpbusd_epi32  // EVEX-encoded (AVX-512 VL + VNNI)
#include "x8_body.inc"
#undef EVK_DPBUSD
}  // namespace x8_evex
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace {

using q8act::BlockQ8A;

// The four activation vectors of a block (A[m] above), made once per call for every block.
struct ActX8 {
    __m512i a[4];
};

EV_AVX512VNNI inline void broadcast_act(const BlockQ8A* y, int64_t nb, ActX8* out) {
    for (int64_t b = 0; b < nb; ++b) {
        int32_t q[8];
        std::memcpy(q, y[b].qs, sizeof q);
        for (int m = 0; m < 4; ++m)
            out[b].a[m] = _mm512_inserti64x4(_mm512_set1_epi32(q[2 * m]), _mm256_set1_epi32(q[2 * m + 1]), 1);
    }
}

// The 8 rows' integer dots of one block: lane r = sum_i w[r][i] * q[i].
template <DType T>
EV_AVX512VNNI inline __m256i block_dot(const uint8_t* v, const ActX8& x, int32_t qsum) {
    __m512i acc = _mm512_setzero_si512();
    if constexpr (T == DType::Q8_0) {
        // Signed weights made unsigned: w ^ 0x80 = w + 128, and 128 * sum(q) taken off at the end.
        const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
        for (int m = 0; m < 4; ++m)
            acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(v + 64 * m), bias), x.a[m]);
    } else {
        const __m512i m4 = _mm512_set1_epi8(0x0f);
        const __m512i w0 = _mm512_loadu_si512(v), w1 = _mm512_loadu_si512(v + 64);
        __m512i acc2 = _mm512_setzero_si512();  // a second chain: the four dots need not wait on each other
        acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(w0, m4), x.a[0]);
        acc2 = _mm512_dpbusd_epi32(acc2, _mm512_and_si512(w1, m4), x.a[1]);
        acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(_mm512_srli_epi16(w0, 4), m4), x.a[2]);
        acc2 = _mm512_dpbusd_epi32(acc2, _mm512_and_si512(_mm512_srli_epi16(w1, 4), m4), x.a[3]);
        acc = _mm512_add_epi32(acc, acc2);
    }
    __m256i r = _mm256_add_epi32(_mm512_extracti64x4_epi64(acc, 0), _mm512_extracti64x4_epi64(acc, 1));
    if constexpr (T == DType::Q8_0) r = _mm256_sub_epi32(r, _mm256_set1_epi32(128 * qsum));
    return r;
}

EV_AVX512VNNI inline __m256 load_halves(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// A block's lines of the next group into L2, all at once (docs/kernels/decode-x8-avx512.md, "The zmm
// kernel after the prefetch"). The ymm body now spreads them, one line per weight vector
// (x8_body.inc's PrefetchLines); this kernel's CPUs (Zen 4) were not available to measure that here.
EV_AVX512VNNI inline void prefetch_span(const uint8_t* p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
}

// One group of 8 rows against one token's activations: 8 results (the float work as in x8_body.inc);
// pf (or nullptr) is the group to prefetch into L2 meanwhile (prefetch_span, a block per block computed).
template <DType T>
EV_AVX512VNNI inline __m256 group_dot(const uint8_t* g, const BlockQ8A* y, const ActX8* x, int64_t nb,
                                      const uint8_t* pf) {
    constexpr size_t kScales = T == DType::Q4_1 ? 32 : 16;  // bytes of d (and m) before the quants
    const size_t bb = x8_block_bytes(T);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b, g += bb) {
        if (pf) prefetch_span(pf + b * bb, bb);
        const __m256 dot = _mm256_cvtepi32_ps(block_dot<T>(g + kScales, x[b], y[b].sum));
        const __m256 d = load_halves(g);
        if constexpr (T == DType::Q4_0) {
            // w = d (n - 8): d * (dx * sum n q - 8 dx sum q)
            acc = _mm256_fmadd_ps(d, _mm256_fmsub_ps(dot, _mm256_set1_ps(y[b].d), _mm256_set1_ps(8.f * y[b].s)), acc);
        } else {
            acc = _mm256_fmadd_ps(d, _mm256_mul_ps(dot, _mm256_set1_ps(y[b].d)), acc);
            if constexpr (T == DType::Q4_1) acc = _mm256_fmadd_ps(load_halves(g + 16), _mm256_set1_ps(y[b].s), acc);
        }
    }
    return acc;
}

// Groups are taken from kStreams places in the row range in turn (x8_body.inc now chooses by the range's
// size, measured on the Xeon; this kernel keeps four: its CPUs were not available to measure).
constexpr int64_t kStreams = 4;
template <DType T>
EV_AVX512VNNI void run_x8(const MatmulArgs& a, BlockQ8A* yq, ActX8* xa) {
    const int64_t nb = a.k / kQK;
    const size_t group_bytes = static_cast<size_t>(nb) * x8_block_bytes(T);
    const uint8_t* base = static_cast<const uint8_t*>(a.w);
    const int64_t g0 = a.row0 / kPackRows, g1 = (a.row1 + kPackRows - 1) / kPackRows;
    for (int64_t t = 0; t < a.m; ++t) {
        q8act::quantize_act(a.x + t * a.x_stride, a.k, yq);
        broadcast_act(yq, nb, xa);
        float* y = a.y + t * a.y_stride;
        const int64_t per = (g1 - g0 + kStreams - 1) / kStreams;
        for (int64_t i = 0; i < kStreams * per; ++i) {
            const int64_t g = g0 + (i % kStreams) * per + i / kStreams;
            if (g >= g1) continue;
            const int64_t gn = g + 1;  // this stream's next group (read kStreams groups later)
            const uint8_t* pf = gn < g1 && gn < g0 + ((i % kStreams) + 1) * per
                                    ? base + static_cast<size_t>(gn) * group_bytes : nullptr;
            const __m256 acc = group_dot<T>(base + static_cast<size_t>(g) * group_bytes, yq, xa, nb, pf);
            const int64_t r0 = std::max(a.row0, g * kPackRows), r1 = std::min(a.row1, (g + 1) * kPackRows);
            if (r0 == g * kPackRows && r1 == r0 + kPackRows) {
                _mm256_storeu_ps(y + r0, acc);
            } else {
                alignas(32) float tmp[kPackRows];
                _mm256_store_ps(tmp, acc);
                for (int64_t r = r0; r < r1; ++r) y[r] = tmp[r - g * kPackRows];
            }
        }
    }
}

}  // namespace

// a.w is the x8-packed weight. scratch (kMatmulScratchRows * k floats, at least 20 bytes per column):
// the activation blocks (44 bytes per 32 columns), then their broadcasts (256 bytes per 32
// columns) from the next 64-byte boundary: 300 + 63 bytes per 32 columns at most, k >= 32.
EV_AVX512VNNI void matmul_avx512vnni_q8act_x8(const MatmulArgs& a) {
    // Several tokens (a verification pass): the ymm body, which reads each group's weights once for
    // up to 8 tokens, where this loop would stream the weight once per token. The same sums in the
    // same order per token (the float steps above are x8_body.inc's), so a token's bits do not
    // depend on the path (kernel_check's row independence). From memory, SmolLM2-135M Q4_1 at 2
    // threads: 4 rows cost 1.13-1.23x one row this way, 1.77-1.89x token by token
    // (docs/kernels/decode-x8-avx512.md, "Verification passes").
    if (a.m > 1) return x8_evex::dispatch(a);
    const int64_t nb = a.k / kQK;
    BlockQ8A* yq = reinterpret_cast<BlockQ8A*>(a.scratch);
    const uintptr_t after = reinterpret_cast<uintptr_t>(yq + nb);
    ActX8* xa = reinterpret_cast<ActX8*>((after + 63) / 64 * 64);
    switch (a.wtype) {
    case DType::Q4_0: run_x8<DType::Q4_0>(a, yq, xa); break;
    case DType::Q4_1: run_x8<DType::Q4_1>(a, yq, xa); break;
    case DType::Q8_0: run_x8<DType::Q8_0>(a, yq, xa); break;
    default:  // the table never routes other formats here
        for (int64_t t = 0; t < a.m; ++t)
            for (int64_t r = a.row0; r < a.row1; ++r) a.y[t * a.y_stride + r] = NAN;
        break;
    }
}

// a.w is the x8-packed weight; scratch: a pass's activation blocks (x8_body.inc).
EV_AVX512VNNI void matmul_avx512vnni_q8act_x8_ymm(const MatmulArgs& a) { x8_evex::dispatch(a); }

}  // namespace evk
#endif
