// AVX2 + FMA attention of the query rows of one kv head's group against its cached keys and values
// (AttentionArgs, kernels/ops.h), on a float, half or int8 (Q8_0) cache; docs/kernels/decode-attention.md. Compiled for the baseline ISA;
// only these functions carry the AVX2 target, and the operator table calls them only on CPUs that
// report AVX2 and FMA.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>

#include "../ops.h"

#define EV_AVX2 __attribute__((target("avx2,fma,f16c")))

#include "../elementwise/exp_avx2.h"
#include "attention_x86.h"

namespace evk {

namespace {

// scale * q.k for the keys [j, j + 8): one accumulator per key (8 independent FMA chains, q loaded
// once per 8 keys), the tail of head_dim % 8 by masked loads (nothing read past a row). Keys past
// n_kv repeat the last one; the caller stores only the valid lanes.
EV_AVX2 inline __m256 scores8(const AttentionArgs& a, const float* qp, int64_t j, __m256i dmask) {
    const int64_t last = a.n_kv - 1, st = a.k_stride;
    const float* k = static_cast<const float*>(a.k);
    const float* r0 = k + (j < last ? j : last) * st;
    const float* r1 = k + (j + 1 < last ? j + 1 : last) * st;
    const float* r2 = k + (j + 2 < last ? j + 2 : last) * st;
    const float* r3 = k + (j + 3 < last ? j + 3 : last) * st;
    const float* r4 = k + (j + 4 < last ? j + 4 : last) * st;
    const float* r5 = k + (j + 5 < last ? j + 5 : last) * st;
    const float* r6 = k + (j + 6 < last ? j + 6 : last) * st;
    const float* r7 = k + (j + 7 < last ? j + 7 : last) * st;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    int64_t d = 0;
    for (; d + 8 <= a.head_dim; d += 8) {
        const __m256 q = _mm256_loadu_ps(qp + d);
        s0 = _mm256_fmadd_ps(q, _mm256_loadu_ps(r0 + d), s0);
        s1 = _mm256_fmadd_ps(q, _mm256_loadu_ps(r1 + d), s1);
        s2 = _mm256_fmadd_ps(q, _mm256_loadu_ps(r2 + d), s2);
        s3 = _mm256_fmadd_ps(q, _mm256_loadu_ps(r3 + d), s3);
        s4 = _mm256_fmadd_ps(q, _mm256_loadu_ps(r4 + d), s4);
        s5 = _mm256_fmadd_ps(q, _mm256_loadu_ps(r5 + d), s5);
        s6 = _mm256_fmadd_ps(q, _mm256_loadu_ps(r6 + d), s6);
        s7 = _mm256_fmadd_ps(q, _mm256_loadu_ps(r7 + d), s7);
    }
    if (d < a.head_dim) {
        const __m256 q = _mm256_maskload_ps(qp + d, dmask);
        s0 = _mm256_fmadd_ps(q, _mm256_maskload_ps(r0 + d, dmask), s0);
        s1 = _mm256_fmadd_ps(q, _mm256_maskload_ps(r1 + d, dmask), s1);
        s2 = _mm256_fmadd_ps(q, _mm256_maskload_ps(r2 + d, dmask), s2);
        s3 = _mm256_fmadd_ps(q, _mm256_maskload_ps(r3 + d, dmask), s3);
        s4 = _mm256_fmadd_ps(q, _mm256_maskload_ps(r4 + d, dmask), s4);
        s5 = _mm256_fmadd_ps(q, _mm256_maskload_ps(r5 + d, dmask), s5);
        s6 = _mm256_fmadd_ps(q, _mm256_maskload_ps(r6 + d, dmask), s6);
        s7 = _mm256_fmadd_ps(q, _mm256_maskload_ps(r7 + d, dmask), s7);
    }
    return _mm256_mul_ps(_mm256_set1_ps(a.scale), reduce8(s0, s1, s2, s3, s4, s5, s6, s7));
}

// Chunk c (8 floats) of a block of NC chunks; the last one masked by dmask when Tail.
template <int NC, bool Tail>
EV_AVX2 inline __m256 load_chunk(const float* p, int c, __m256i dmask) {
    return Tail && c == NC - 1 ? _mm256_maskload_ps(p + 8 * c, dmask) : _mm256_loadu_ps(p + 8 * c);
}

template <int NC, bool Tail>
EV_AVX2 inline void store_chunk(float* p, int c, __m256 x, __m256i dmask) {
    if (c >= NC) return;
    if (Tail && c == NC - 1)
        _mm256_maskstore_ps(p + 8 * c, dmask, x);
    else
        _mm256_storeu_ps(p + 8 * c, x);
}

// A weighted sum's accumulators between two chunks of rows (a head of a group waits while the
// others use the chunk): stored and reloaded exactly, so chunking does not change a single addition.
struct SumState {
    alignas(32) float v[12][8];
};

// out[0, 8 NC) (the last chunk masked when Tail) = inv * sum_j e[j] v_j, j-outer: NC independent
// accumulators hold this block of the output row in registers, each V row is read once (a second
// set of accumulators, for even / odd j, when NC <= 4, so that there are enough independent FMA
// chains). Rows [j0, j1) of the sum: from zero when first, else from st; into st unless last, when
// the sum is scaled and stored to out (j0 even, so the pairs are those of one call over all rows).
// The accumulators are named variables, not an array: GCC keeps an array of vectors in memory and
// stores every accumulator on every step.
template <int NC, bool Tail>
EV_AVX2 void weighted_sum(const float* e, const float* v, int64_t stride, int64_t j0, int64_t j1, int64_t rem,
                          bool first, bool last, float inv, SumState* st, float* out) {
    static_assert(NC >= 1 && NC <= 8, "blocks of at most 64 floats");
    const __m256i dmask = tail_mask(rem);  // the last chunk's lanes when Tail (rem = head_dim % 8)
    constexpr bool kTwoSets = NC <= 4;
    const __m256 z = _mm256_setzero_ps();
    __m256 a0 = z, a1 = z, a2 = z, a3 = z, a4 = z, a5 = z, a6 = z, a7 = z, b0 = z, b1 = z, b2 = z, b3 = z;
#define EV_ATT_LOAD(acc, i, used) \
    if (used) acc = _mm256_load_ps(st->v[i]);
    if (!first) {
        EV_ATT_LOAD(a0, 0, true) EV_ATT_LOAD(a1, 1, NC > 1) EV_ATT_LOAD(a2, 2, NC > 2) EV_ATT_LOAD(a3, 3, NC > 3)
        EV_ATT_LOAD(a4, 4, NC > 4) EV_ATT_LOAD(a5, 5, NC > 5) EV_ATT_LOAD(a6, 6, NC > 6) EV_ATT_LOAD(a7, 7, NC > 7)
        EV_ATT_LOAD(b0, 8, kTwoSets) EV_ATT_LOAD(b1, 9, kTwoSets && NC > 1) EV_ATT_LOAD(b2, 10, kTwoSets && NC > 2)
        EV_ATT_LOAD(b3, 11, kTwoSets && NC > 3)
    }
#undef EV_ATT_LOAD
#define EV_ATT_FMA(acc, c, p, row) \
    if (c < NC) acc = _mm256_fmadd_ps(p, load_chunk<NC, Tail>(row, c, dmask), acc);
    int64_t j = j0;
    if (kTwoSets)
        for (; j + 2 <= j1; j += 2) {
            const __m256 p0 = _mm256_broadcast_ss(e + j), p1 = _mm256_broadcast_ss(e + j + 1);
            const float* v0 = v + j * stride;
            const float* v1 = v0 + stride;
            EV_ATT_FMA(a0, 0, p0, v0) EV_ATT_FMA(a1, 1, p0, v0) EV_ATT_FMA(a2, 2, p0, v0) EV_ATT_FMA(a3, 3, p0, v0)
            EV_ATT_FMA(b0, 0, p1, v1) EV_ATT_FMA(b1, 1, p1, v1) EV_ATT_FMA(b2, 2, p1, v1) EV_ATT_FMA(b3, 3, p1, v1)
        }
    for (; j < j1; ++j) {
        const __m256 p = _mm256_broadcast_ss(e + j);
        const float* vj = v + j * stride;
        EV_ATT_FMA(a0, 0, p, vj) EV_ATT_FMA(a1, 1, p, vj) EV_ATT_FMA(a2, 2, p, vj) EV_ATT_FMA(a3, 3, p, vj)
        EV_ATT_FMA(a4, 4, p, vj) EV_ATT_FMA(a5, 5, p, vj) EV_ATT_FMA(a6, 6, p, vj) EV_ATT_FMA(a7, 7, p, vj)
    }
#undef EV_ATT_FMA
    if (!last) {
#define EV_ATT_SAVE(acc, i, used) \
    if (used) _mm256_store_ps(st->v[i], acc);
        EV_ATT_SAVE(a0, 0, true) EV_ATT_SAVE(a1, 1, NC > 1) EV_ATT_SAVE(a2, 2, NC > 2) EV_ATT_SAVE(a3, 3, NC > 3)
        EV_ATT_SAVE(a4, 4, NC > 4) EV_ATT_SAVE(a5, 5, NC > 5) EV_ATT_SAVE(a6, 6, NC > 6) EV_ATT_SAVE(a7, 7, NC > 7)
        EV_ATT_SAVE(b0, 8, kTwoSets) EV_ATT_SAVE(b1, 9, kTwoSets && NC > 1) EV_ATT_SAVE(b2, 10, kTwoSets && NC > 2)
        EV_ATT_SAVE(b3, 11, kTwoSets && NC > 3)
#undef EV_ATT_SAVE
        return;
    }
    if (kTwoSets) {
        a0 = _mm256_add_ps(a0, b0);
        a1 = _mm256_add_ps(a1, b1);
        a2 = _mm256_add_ps(a2, b2);
        a3 = _mm256_add_ps(a3, b3);
    }
    const __m256 vinv = _mm256_set1_ps(inv);
    store_chunk<NC, Tail>(out, 0, _mm256_mul_ps(a0, vinv), dmask);
    store_chunk<NC, Tail>(out, 1, _mm256_mul_ps(a1, vinv), dmask);
    store_chunk<NC, Tail>(out, 2, _mm256_mul_ps(a2, vinv), dmask);
    store_chunk<NC, Tail>(out, 3, _mm256_mul_ps(a3, vinv), dmask);
    store_chunk<NC, Tail>(out, 4, _mm256_mul_ps(a4, vinv), dmask);
    store_chunk<NC, Tail>(out, 5, _mm256_mul_ps(a5, vinv), dmask);
    store_chunk<NC, Tail>(out, 6, _mm256_mul_ps(a6, vinv), dmask);
    store_chunk<NC, Tail>(out, 7, _mm256_mul_ps(a7, vinv), dmask);
}

using WeightedSumFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, int64_t, bool, bool, float,
                               SumState*, float*);
// Indexed by [chunks - 1][head_dim % 8 != 0].
constexpr WeightedSumFn kWeightedSum[8][2] = {
    {weighted_sum<1, false>, weighted_sum<1, true>}, {weighted_sum<2, false>, weighted_sum<2, true>},
    {weighted_sum<3, false>, weighted_sum<3, true>}, {weighted_sum<4, false>, weighted_sum<4, true>},
    {weighted_sum<5, false>, weighted_sum<5, true>}, {weighted_sum<6, false>, weighted_sum<6, true>},
    {weighted_sum<7, false>, weighted_sum<7, true>}, {weighted_sum<8, false>, weighted_sum<8, true>},
};

// -- Half and int8 caches (F16, Q8_0): rows of blocks of 32 elements, head_dim a multiple of 32 --
// Converted once into float buffers in L1 for all the heads of a group (8 key rows; a chunk of
// value rows' 64-float slice), which the float kernels above then read: a block costs one
// conversion however many heads share it (the AVX-512 kernel holds the heads' accumulators in its
// 32 registers instead; 16 ymm registers do not hold them).

// Elements 8c .. 8c + 7 of a block as floats, times the block's scale d (Q8_0: d times its int8
// values, the product the format's to_float rounds; F16: the halves converted).
template <DType KV>
EV_AVX2 inline __m256 load_block8(const uint8_t* blk, int c, __m256 d) {
    if constexpr (KV == DType::F16)
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * c)));
    else
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * c)))));
}

// dst[0, 32 nb) = the nb blocks at src as floats.
template <DType KV>
EV_AVX2 inline void convert_blocks(const uint8_t* src, int64_t nb, float* dst) {
    for (int64_t b = 0; b < nb; ++b, src += kv_block_bytes(KV), dst += kQK) {
        const __m256 d = _mm256_set1_ps(block_scale<KV>(src));
        _mm256_store_ps(dst, load_block8<KV>(src, 0, d));
        _mm256_store_ps(dst + 8, load_block8<KV>(src, 1, d));
        _mm256_store_ps(dst + 16, load_block8<KV>(src, 2, d));
        _mm256_store_ps(dst + 24, load_block8<KV>(src, 3, d));
    }
}

// Rows of V per chunk when a group shares them: 64 rows of a 64-float slice are 16 KiB (F32), so
// the chunk a head has just read is still in L1 for the next head of the group.
constexpr int64_t kGroupRows = 64;

// Every head of the group: scores 8 keys at a time, head-inner (the 8 key rows read from memory
// once, then from L1 for the other heads); each head's exp(s - max) and its sum; then the weighted
// sums, in chunks of kGroupRows value rows, head-inner (a single head: one chunk of all rows).
EV_AVX2 void attend(const AttentionArgs& a) {
    const int64_t n = a.n_kv, hd = a.head_dim, G = a.n_q;
    const __m256i dmask = tail_mask(hd % 8);
    __m256 vmax[kMaxAttentionGroup];
    for (int64_t g = 0; g < G; ++g) vmax[g] = _mm256_set1_ps(-3.4e38f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int64_t g = 0; g < G; ++g) {
            const __m256 s = scores8(a, a.q + g * a.q_stride, j, dmask);
            _mm256_storeu_ps(a.scores + g * n + j, s);
            vmax[g] = _mm256_max_ps(vmax[g], s);
        }
    if (j < n)  // lanes past n_kv repeat the last key's score: harmless for the maximum
        for (int64_t g = 0; g < G; ++g) {
            const __m256 s = scores8(a, a.q + g * a.q_stride, j, dmask);
            _mm256_maskstore_ps(a.scores + g * n + j, tail_mask(n - j), s);
            vmax[g] = _mm256_max_ps(vmax[g], s);
        }
    float inv[kMaxAttentionGroup];
    for (int64_t g = 0; g < G; ++g)  // exp(s - mx) in place, 1 / sum
        inv[g] = static_cast<float>(1.0 / exp_sub_scaled_sum(a.scores + g * n, n, hmax(vmax[g]), 1.f));
    SumState state[kMaxAttentionGroup];
    const int64_t chunk = G == 1 ? n : kGroupRows;
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {
        const int64_t w = hd - d0 < 64 ? hd - d0 : 64;
        for (int64_t c0 = 0; c0 < n; c0 += chunk) {
            const int64_t c1 = n - c0 < chunk ? n : c0 + chunk;
            for (int64_t g = 0; g < G; ++g) {
                const float* e = a.scores + g * n;
                float* out = a.out + g * a.q_stride + d0;
                kWeightedSum[(w + 7) / 8 - 1][w % 8 != 0](e, static_cast<const float*>(a.v) + d0, a.v_stride, c0, c1,
                                                          hd % 8, c0 == 0, c1 == n, inv[g], &state[g], out);
            }
        }
    }
}

// A half / int8 cache: per 8 keys, their rows converted into a float buffer, then every head's
// scores by the float kernel on it; per chunk of kGroupRows value rows and 64-float slice, the slice
// converted, then every head's weighted sum by the float kernel on it. A head's result does not
// depend on the group: the same conversions and float steps either way.
template <DType KV>
EV_AVX2 void attend_blocks(const AttentionArgs& a) {
    const int64_t n = a.n_kv, hd = a.head_dim, G = a.n_q, nb = hd / kQK;
    const size_t kst = kv_bytes(KV, a.k_stride), vst = kv_bytes(KV, a.v_stride), row = kv_bytes(KV, hd);
    const uint8_t* k = static_cast<const uint8_t*>(a.k);
    alignas(32) float kbuf[8 * kMaxAttentionHeadDim];
    AttentionArgs kb = a;  // the float view of the buffered 8 rows
    kb.k = kbuf, kb.k_stride = hd, kb.kv_type = DType::F32;
    const __m256i all = tail_mask(8);
    __m256 vmax[kMaxAttentionGroup];
    for (int64_t g = 0; g < G; ++g) vmax[g] = _mm256_set1_ps(-3.4e38f);
    for (int64_t j = 0; j < n; j += 8) {
        const int64_t m = n - j < 8 ? n - j : 8;  // rows past n_kv repeat the last one (scores8)
        if (j + kPrefetchKeys + 8 <= n) prefetch_bytes(k + static_cast<size_t>(j + kPrefetchKeys) * kst, 7 * kst + row);
        for (int64_t i = 0; i < m; ++i) convert_blocks<KV>(k + static_cast<size_t>(j + i) * kst, nb, kbuf + i * hd);
        kb.n_kv = m;
        for (int64_t g = 0; g < G; ++g) {
            const __m256 s = scores8(kb, a.q + g * a.q_stride, 0, all);
            _mm256_maskstore_ps(a.scores + g * n + j, tail_mask(m), s);
            vmax[g] = _mm256_max_ps(vmax[g], s);  // lanes past n_kv repeat the last key's score
        }
    }
    float inv[kMaxAttentionGroup];
    for (int64_t g = 0; g < G; ++g)  // exp(s - mx) in place, 1 / sum
        inv[g] = static_cast<float>(1.0 / exp_sub_scaled_sum(a.scores + g * n, n, hmax(vmax[g]), 1.f));
    alignas(32) float vbuf[kGroupRows * 64];
    SumState state[kMaxAttentionGroup];
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {
        const int64_t w = hd - d0 < 64 ? hd - d0 : 64;  // 32 or 64
        const uint8_t* v = static_cast<const uint8_t*>(a.v) + kv_bytes(KV, d0);
        for (int64_t c0 = 0; c0 < n; c0 += kGroupRows) {
            const int64_t c1 = n - c0 < kGroupRows ? n : c0 + kGroupRows;
            for (int64_t j = c0; j < c1; ++j) {
                const uint8_t* r = v + static_cast<size_t>(j) * vst;
                if (j + kPrefetchRows < n) prefetch_bytes(r + kPrefetchRows * vst, kv_bytes(KV, w));
                convert_blocks<KV>(r, w / kQK, vbuf + (j - c0) * w);
            }
            for (int64_t g = 0; g < G; ++g)
                kWeightedSum[w / 8 - 1][0](a.scores + g * n + c0, vbuf, w, 0, c1 - c0, 0, c0 == 0, c1 == n, inv[g],
                                           &state[g], a.out + g * a.q_stride + d0);
        }
    }
}

}  // namespace

// Scores 8 keys at a time (scores8), exp(s - max) and its sum by the shared vector exp
// (exp_sub_scaled_sum), then the weighted sum of values j-outer in blocks of up to 64 output floats
// held in registers (one pass over V for head_dim <= 64, ceil(head_dim / 64) passes otherwise).
// The 1 / sum normalization is applied once per output element, at the end. The query heads of a
// group share every key and value row read (attend).
EV_AVX2 void attention_avx2(const AttentionArgs& args) {
    if (args.n_tok > 1) return attention_each_token(args, attention_avx2);  // 16 ymm registers: one token at a time
    const AttentionArgs a = args;  // a local copy: stores to scores cannot alias its fields
    if (a.n_kv <= 0) {  // no keys: zeros, as the reference writes
        for (int64_t g = 0; g < a.n_q; ++g)
            for (int64_t d = 0; d < a.head_dim; ++d) a.out[g * a.q_stride + d] = 0.f;
        return;
    }
    if (a.kv_type == DType::F16) return attend_blocks<DType::F16>(a);
    if (a.kv_type == DType::Q8_0) return attend_blocks<DType::Q8_0>(a);
    attend(a);
}

}  // namespace evk
#endif
