// AVX-512 attention of the query rows of one kv head's group against a half or int8 (F16, Q8_0)
// cache (AttentionArgs, kernels/ops.h; docs/kernels/decode-attention.md, "attention avx512"). The
// AVX2 kernel converts every key and value block once per query head; its conversions, not the
// cache's bytes, bound a half / int8 cache there. Here the 32 zmm registers hold several heads'
// accumulators, so a block is converted once for up to 3 heads' scores and 6 heads' sums, on
// 16-lane vectors. A float cache is memory-bound and takes the AVX2 kernel (16-lane float
// attention was measured no faster, stop 12). Only these functions carry the AVX-512 target; the operator table calls them only on
// CPUs that report avx512f, fma and f16c.
#if defined(__x86_64__)
#include "../matmul/avx512_intrin.h"  // first: <immintrin.h> without GCC 12's false warnings

#include "../ops.h"
#include "attention_x86.h"
#include "../elementwise/exp_avx2.h"

#define EV_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

namespace evk {

void attention_avx2(const AttentionArgs&);

namespace {

// Elements 16c .. 16c + 15 of a block as floats, times the block's scale (Q8_0: d times its int8
// values, the product the format's to_float rounds; F16: the halves converted).
template <DType KV>
EV_AVX512 inline __m512 load16(const uint8_t* blk, int c) {
    if constexpr (KV == DType::F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * c)));
    else
        return _mm512_mul_ps(_mm512_set1_ps(block_scale<KV>(blk)),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * c)))));
}

// The low and high 8 lanes added: a 16-lane partial sum as an 8-lane one.
EV_AVX512 inline __m256 fold16(__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

// Heads of a group per pass: the scores of 8 keys for 3 heads are 24 accumulators, a 64-float slice
// of the weighted sum for 6 heads 24; with the converted key / value vectors and a broadcast they fit
// the 32 zmm registers. A key or value block is converted once per pass, for all its heads.
constexpr int kScoreHeads = 3, kSumHeads = 6;

// scale * q_h.k for the keys [j, j + 8) and the HB heads at q (q_stride apart), into out[h]; keys past
// n_kv repeat the last one. Per block of 32 a key's two 16-lane halves are converted once, then one
// FMA per half into each head's accumulator for that key. A head's scores do not depend on HB or on
// a key's place in the group of 8 (each accumulator sees the same operations).
template <DType KV, int HB>
EV_AVX512 inline void scores8(const AttentionArgs& a, const float* q, int64_t j, __m256* out) {
    static_assert(HB >= 1 && HB <= kScoreHeads, "at most 3 heads a pass");
    const int64_t last = a.n_kv - 1, qs = a.q_stride;
    const size_t st = kv_bytes(KV, a.k_stride);
    const uint8_t* k = static_cast<const uint8_t*>(a.k);
    const uint8_t* r[8];
    for (int i = 0; i < 8; ++i) r[i] = k + static_cast<size_t>(j + i < last ? j + i : last) * st;
    const __m512 z = _mm512_setzero_ps();
    __m512 s00 = z, s01 = z, s02 = z, s03 = z, s04 = z, s05 = z, s06 = z, s07 = z;
    __m512 s10 = z, s11 = z, s12 = z, s13 = z, s14 = z, s15 = z, s16 = z, s17 = z;
    __m512 s20 = z, s21 = z, s22 = z, s23 = z, s24 = z, s25 = z, s26 = z, s27 = z;
    for (int64_t b = 0; b < a.head_dim / kQK; ++b) {
        const size_t off = static_cast<size_t>(b) * kv_block_bytes(KV);
        const float* q0 = q + kQK * b;
#define EV_ATT_KEY(i, x0, x1, x2)                                                                     \
    {                                                                                                 \
        const __m512 k0 = load16<KV>(r[i] + off, 0), k1 = load16<KV>(r[i] + off, 1);                  \
        x0 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 16), k1, _mm512_fmadd_ps(_mm512_loadu_ps(q0), k0, x0)); \
        if constexpr (HB > 1)                                                                         \
            x1 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + qs + 16), k1, _mm512_fmadd_ps(_mm512_loadu_ps(q0 + qs), k0, x1)); \
        if constexpr (HB > 2)                                                                         \
            x2 = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 2 * qs + 16), k1,                               \
                                 _mm512_fmadd_ps(_mm512_loadu_ps(q0 + 2 * qs), k0, x2));              \
    }
        EV_ATT_KEY(0, s00, s10, s20) EV_ATT_KEY(1, s01, s11, s21) EV_ATT_KEY(2, s02, s12, s22)
        EV_ATT_KEY(3, s03, s13, s23) EV_ATT_KEY(4, s04, s14, s24) EV_ATT_KEY(5, s05, s15, s25)
        EV_ATT_KEY(6, s06, s16, s26) EV_ATT_KEY(7, s07, s17, s27)
#undef EV_ATT_KEY
    }
    const __m256 sc = _mm256_set1_ps(a.scale);
    out[0] = _mm256_mul_ps(sc, reduce8(fold16(s00), fold16(s01), fold16(s02), fold16(s03), fold16(s04), fold16(s05),
                                       fold16(s06), fold16(s07)));
    if constexpr (HB > 1)
        out[1] = _mm256_mul_ps(sc, reduce8(fold16(s10), fold16(s11), fold16(s12), fold16(s13), fold16(s14),
                                           fold16(s15), fold16(s16), fold16(s17)));
    if constexpr (HB > 2)
        out[2] = _mm256_mul_ps(sc, reduce8(fold16(s20), fold16(s21), fold16(s22), fold16(s23), fold16(s24),
                                           fold16(s25), fold16(s26), fold16(s27)));
}

// For HB heads (scores e + h n, outputs out + h os): out_h[0, 32 NB) = inv_h * sum_j e_h[j] v_j over
// NB blocks of a value row (v: the rows' first block, st bytes apart), all n rows in one pass: each
// row's blocks converted once (times their scale), then one FMA per 16 values into each head's
// accumulators. A head's sum does not depend on HB.
template <DType KV, int NB, int HB>
EV_AVX512 void weighted_sum(const float* e, int64_t n, const uint8_t* v, size_t st, const float* inv, float* out,
                            int64_t os) {
    static_assert(NB >= 1 && NB <= 2 && HB >= 1 && HB <= kSumHeads, "64 floats of 6 heads a pass");
    constexpr size_t bb = kv_block_bytes(KV);
    const __m512 z = _mm512_setzero_ps();
    __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z, a20 = z, a21 = z, a22 = z, a23 = z;
    __m512 a30 = z, a31 = z, a32 = z, a33 = z, a40 = z, a41 = z, a42 = z, a43 = z, a50 = z, a51 = z, a52 = z, a53 = z;
    for (int64_t j = 0; j < n; ++j) {
        const uint8_t* row = v + static_cast<size_t>(j) * st;
        if (j + kPrefetchRows < n) prefetch_bytes(row + kPrefetchRows * st, NB * bb);
        const __m512 v0 = load16<KV>(row, 0), v1 = load16<KV>(row, 1);
        const __m512 v2 = NB > 1 ? load16<KV>(row + bb, 0) : z, v3 = NB > 1 ? load16<KV>(row + bb, 1) : z;
#define EV_ATT_HEAD(h, x0, x1, x2, x3)                         \
    if constexpr (HB > h) {                                    \
        const __m512 p = _mm512_set1_ps(e[h * n + j]);         \
        x0 = _mm512_fmadd_ps(p, v0, x0);                       \
        x1 = _mm512_fmadd_ps(p, v1, x1);                       \
        if constexpr (NB > 1) {                                \
            x2 = _mm512_fmadd_ps(p, v2, x2);                   \
            x3 = _mm512_fmadd_ps(p, v3, x3);                   \
        }                                                      \
    }
        EV_ATT_HEAD(0, a00, a01, a02, a03) EV_ATT_HEAD(1, a10, a11, a12, a13) EV_ATT_HEAD(2, a20, a21, a22, a23)
        EV_ATT_HEAD(3, a30, a31, a32, a33) EV_ATT_HEAD(4, a40, a41, a42, a43) EV_ATT_HEAD(5, a50, a51, a52, a53)
#undef EV_ATT_HEAD
    }
#define EV_ATT_STORE(h, x0, x1, x2, x3)                                        \
    if constexpr (HB > h) {                                                    \
        const __m512 s = _mm512_set1_ps(inv[h]);                               \
        float* o = out + h * os;                                               \
        _mm512_storeu_ps(o, _mm512_mul_ps(x0, s));                             \
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(x1, s));                        \
        if constexpr (NB > 1) {                                                \
            _mm512_storeu_ps(o + 32, _mm512_mul_ps(x2, s));                    \
            _mm512_storeu_ps(o + 48, _mm512_mul_ps(x3, s));                    \
        }                                                                      \
    }
    EV_ATT_STORE(0, a00, a01, a02, a03) EV_ATT_STORE(1, a10, a11, a12, a13) EV_ATT_STORE(2, a20, a21, a22, a23)
    EV_ATT_STORE(3, a30, a31, a32, a33) EV_ATT_STORE(4, a40, a41, a42, a43) EV_ATT_STORE(5, a50, a51, a52, a53)
#undef EV_ATT_STORE
}

using ScoresFn = void (*)(const AttentionArgs&, const float*, int64_t, __m256*);
using WeightedSumFn = void (*)(const float*, int64_t, const uint8_t*, size_t, const float*, float*, int64_t);

// The group's scores, 8 keys at a time for up to 3 heads at once; each head's exp(s - max) and its
// sum; then the weighted sums in 64-float slices for up to 6 heads at once.
template <DType KV>
EV_AVX512 void attend(const AttentionArgs& a) {
    const int64_t n = a.n_kv, hd = a.head_dim, G = a.n_q;
    constexpr ScoresFn kScores[kScoreHeads] = {scores8<KV, 1>, scores8<KV, 2>, scores8<KV, 3>};
    __m256 vmax[kMaxAttentionGroup];
    for (int64_t g = 0; g < G; ++g) vmax[g] = _mm256_set1_ps(-3.4e38f);
    // 8 keys outer, batches of heads inner: the 8 rows are read from memory once, then from L1.
    __m256 s[kScoreHeads];
    int64_t j = 0;
    const size_t kst = kv_bytes(KV, a.k_stride);
    for (; j + 8 <= n; j += 8) {
        if (j + kPrefetchKeys + 8 <= n)  // the rows of 8 keys kPrefetchKeys ahead
            prefetch_bytes(static_cast<const uint8_t*>(a.k) + static_cast<size_t>(j + kPrefetchKeys) * kst,
                           7 * kst + kv_bytes(KV, hd));
        for (int64_t g0 = 0; g0 < G; g0 += kScoreHeads) {
            const int64_t hb = G - g0 < kScoreHeads ? G - g0 : kScoreHeads;
            kScores[hb - 1](a, a.q + g0 * a.q_stride, j, s);
            for (int64_t h = 0; h < hb; ++h) {
                _mm256_storeu_ps(a.scores + (g0 + h) * n + j, s[h]);
                vmax[g0 + h] = _mm256_max_ps(vmax[g0 + h], s[h]);
            }
        }
    }
    if (j < n)  // lanes past n_kv repeat the last key's score: harmless for the maximum
        for (int64_t g0 = 0; g0 < G; g0 += kScoreHeads) {
            const int64_t hb = G - g0 < kScoreHeads ? G - g0 : kScoreHeads;
            kScores[hb - 1](a, a.q + g0 * a.q_stride, j, s);
            for (int64_t h = 0; h < hb; ++h) {
                _mm256_maskstore_ps(a.scores + (g0 + h) * n + j, tail_mask(n - j), s[h]);
                vmax[g0 + h] = _mm256_max_ps(vmax[g0 + h], s[h]);
            }
        }
    float inv[kMaxAttentionGroup];
    for (int64_t g = 0; g < G; ++g)  // exp(s - mx) in place, 1 / sum
        inv[g] = static_cast<float>(1.0 / exp_sub_scaled_sum(a.scores + g * n, n, hmax(vmax[g]), 1.f));
    constexpr WeightedSumFn kSum[2][kSumHeads] = {
        {weighted_sum<KV, 1, 1>, weighted_sum<KV, 1, 2>, weighted_sum<KV, 1, 3>, weighted_sum<KV, 1, 4>,
         weighted_sum<KV, 1, 5>, weighted_sum<KV, 1, 6>},
        {weighted_sum<KV, 2, 1>, weighted_sum<KV, 2, 2>, weighted_sum<KV, 2, 3>, weighted_sum<KV, 2, 4>,
         weighted_sum<KV, 2, 5>, weighted_sum<KV, 2, 6>}};
    const size_t st = kv_bytes(KV, a.v_stride);
    for (int64_t d0 = 0; d0 < hd; d0 += 64) {
        const int64_t nb = hd - d0 < 64 ? 1 : 2;  // head_dim is a multiple of 32
        const uint8_t* v = static_cast<const uint8_t*>(a.v) + kv_bytes(KV, d0);
        for (int64_t g0 = 0; g0 < G; g0 += kSumHeads) {
            const int64_t hb = G - g0 < kSumHeads ? G - g0 : kSumHeads;
            kSum[nb - 1][hb - 1](a.scores + g0 * n, n, v, st, inv + g0, a.out + g0 * a.q_stride + d0, a.q_stride);
        }
    }
}

// -- A float cache, several query tokens (a prefill chunk; docs/kernels/prefill-attention.md) --
// One token at a time, attention is load-bound: each key row feeds the few heads of one group, and
// the 16 ymm registers of attention avx2 hold one head's 8 scores or 64 sums. Here a call's rows
// (token t, head h: r = t n_q + h) share each key and value row read, 6 rows at a time in the 32
// zmm registers, so the FMAs are no longer waiting on loads. Every row's result is bitwise what
// attention avx2 gives its own call (attention_token): the same FMA chains in the same order.

constexpr int kRowsPass = 6;

// Where a call's row r lies: its query, output, and key range [lo, hi) relative to the call's keys.
struct Row {
    const float* q;
    float* out;
    int64_t lo, hi;
};

inline Row row_of(const AttentionArgs& a, int64_t r) {
    const int64_t t = r / a.n_q, h = r % a.n_q;
    return {a.q + t * a.tok_stride + h * a.q_stride, a.out + t * a.tok_stride + h * a.q_stride,
            attention_first_key(a, t), a.n_kv + t};
}

// Two 8-float pieces as one zmm: lanes 0..7 from lo, 8..15 from hi.
EV_AVX512 inline __m512 pair8(const float* lo, const float* hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(lo))),
                                               _mm256_castps_pd(_mm256_loadu_ps(hi)), 1));
}
EV_AVX512 inline __m256 low8(__m512 x) { return _mm512_castps512_ps256(x); }
EV_AVX512 inline __m256 high8(__m512 x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }

// scale * q_r.k_j for the RB rows at q and the keys [j, j + 8) (keys past `last` repeat it), into
// out[r][0, nv). Keys in pairs per zmm (lanes 0..7 key i, 8..15 key i + 1), each query's 8 floats
// in both halves: every lane runs the chain of attention avx2's scores8 (FMAs over head_dim in
// steps of 8), and its reduce8 gives the same sums.
template <int RB>
EV_AVX512 void scores_rows(const float* const* q, const float* k, int64_t kst, int64_t j, int64_t last, int64_t hd,
                           float scale, float* const* out, int64_t nv) {
    const float* r[8];
    for (int i = 0; i < 8; ++i) r[i] = k + (j + i < last ? j + i : last) * kst;
    const __m512 z = _mm512_setzero_ps();
    __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z, a20 = z, a21 = z, a22 = z, a23 = z;
    __m512 a30 = z, a31 = z, a32 = z, a33 = z, a40 = z, a41 = z, a42 = z, a43 = z, a50 = z, a51 = z, a52 = z, a53 = z;
    for (int64_t d = 0; d < hd; d += 8) {
        const __m512 k01 = pair8(r[0] + d, r[1] + d), k23 = pair8(r[2] + d, r[3] + d);
        const __m512 k45 = pair8(r[4] + d, r[5] + d), k67 = pair8(r[6] + d, r[7] + d);
#define EV_ATT_ROW(h, x0, x1, x2, x3)                                                                        \
    if constexpr (RB > h) {                                                                                  \
        const __m512 qq = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q[h] + d)))); \
        x0 = _mm512_fmadd_ps(qq, k01, x0);                                                                   \
        x1 = _mm512_fmadd_ps(qq, k23, x1);                                                                   \
        x2 = _mm512_fmadd_ps(qq, k45, x2);                                                                   \
        x3 = _mm512_fmadd_ps(qq, k67, x3);                                                                   \
    }
        EV_ATT_ROW(0, a00, a01, a02, a03) EV_ATT_ROW(1, a10, a11, a12, a13) EV_ATT_ROW(2, a20, a21, a22, a23)
        EV_ATT_ROW(3, a30, a31, a32, a33) EV_ATT_ROW(4, a40, a41, a42, a43) EV_ATT_ROW(5, a50, a51, a52, a53)
#undef EV_ATT_ROW
    }
    const __m256 sc = _mm256_set1_ps(scale);
    const __m256i m = tail_mask(nv);
#define EV_ATT_STORE(h, x0, x1, x2, x3)                                                                     \
    if constexpr (RB > h)                                                                                   \
        _mm256_maskstore_ps(out[h], m, _mm256_mul_ps(sc, reduce8(low8(x0), high8(x0), low8(x1), high8(x1), \
                                                                 low8(x2), high8(x2), low8(x3), high8(x3))));
    EV_ATT_STORE(0, a00, a01, a02, a03) EV_ATT_STORE(1, a10, a11, a12, a13) EV_ATT_STORE(2, a20, a21, a22, a23)
    EV_ATT_STORE(3, a30, a31, a32, a33) EV_ATT_STORE(4, a40, a41, a42, a43) EV_ATT_STORE(5, a50, a51, a52, a53)
#undef EV_ATT_STORE
}

// out_r[0, 64) = inv_r * sum_j e_r[j] v_j over the keys [0, n) for the RB rows, keys outside a
// row's range [lo_r, hi_r) masked off (its accumulators untouched, whatever those rows hold): per
// element the chain of attention avx2's weighted_sum (one FMA per key from zero, in key order).
template <int RB>
EV_AVX512 void sum_rows(const float* const* e, const int64_t* lo, const int64_t* hi, const float* v, int64_t vst,
                        int64_t n, const float* inv, float* const* out) {
    const __m512 z = _mm512_setzero_ps();
    __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z, a20 = z, a21 = z, a22 = z, a23 = z;
    __m512 a30 = z, a31 = z, a32 = z, a33 = z, a40 = z, a41 = z, a42 = z, a43 = z, a50 = z, a51 = z, a52 = z, a53 = z;
    // Segments of keys over which the set of rows in range does not change.
    int64_t j = 0;
    while (j < n) {
        int64_t end = n;
        __mmask16 on[kRowsPass];
        for (int h = 0; h < RB; ++h) {
            on[h] = j >= lo[h] && j < hi[h] ? 0xffff : 0;
            if (lo[h] > j && lo[h] < end) end = lo[h];
            if (hi[h] > j && hi[h] < end) end = hi[h];
        }
        for (; j < end; ++j) {
            const float* vj = v + j * vst;
            const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
            const __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
#define EV_ATT_ROW(h, x0, x1, x2, x3)                    \
    if constexpr (RB > h) {                              \
        const __m512 p = _mm512_set1_ps(e[h][j]);        \
        x0 = _mm512_mask3_fmadd_ps(p, v0, x0, on[h]);    \
        x1 = _mm512_mask3_fmadd_ps(p, v1, x1, on[h]);    \
        x2 = _mm512_mask3_fmadd_ps(p, v2, x2, on[h]);    \
        x3 = _mm512_mask3_fmadd_ps(p, v3, x3, on[h]);    \
    }
            EV_ATT_ROW(0, a00, a01, a02, a03) EV_ATT_ROW(1, a10, a11, a12, a13) EV_ATT_ROW(2, a20, a21, a22, a23)
            EV_ATT_ROW(3, a30, a31, a32, a33) EV_ATT_ROW(4, a40, a41, a42, a43) EV_ATT_ROW(5, a50, a51, a52, a53)
#undef EV_ATT_ROW
        }
    }
#define EV_ATT_STORE(h, x0, x1, x2, x3)                   \
    if constexpr (RB > h) {                               \
        const __m512 s = _mm512_set1_ps(inv[h]);          \
        _mm512_storeu_ps(out[h], _mm512_mul_ps(x0, s));   \
        _mm512_storeu_ps(out[h] + 16, _mm512_mul_ps(x1, s)); \
        _mm512_storeu_ps(out[h] + 32, _mm512_mul_ps(x2, s)); \
        _mm512_storeu_ps(out[h] + 48, _mm512_mul_ps(x3, s)); \
    }
    EV_ATT_STORE(0, a00, a01, a02, a03) EV_ATT_STORE(1, a10, a11, a12, a13) EV_ATT_STORE(2, a20, a21, a22, a23)
    EV_ATT_STORE(3, a30, a31, a32, a33) EV_ATT_STORE(4, a40, a41, a42, a43) EV_ATT_STORE(5, a50, a51, a52, a53)
#undef EV_ATT_STORE
}

using ScoresRowsFn = void (*)(const float* const*, const float*, int64_t, int64_t, int64_t, int64_t, float, float* const*,
                              int64_t);
using SumRowsFn = void (*)(const float* const*, const int64_t*, const int64_t*, const float*, int64_t, int64_t,
                           const float*, float* const*);

// Every row's scores over the call's keys [0, n_kv + n_tok - 1) (row r at scores + r * span), 8
// keys outer and passes of 6 rows inner (the 8 key rows then come from L1); per row the maximum of
// its range as attention avx2 takes it (8 lanes, a tail repeating its last score), exp(s - max) and
// 1 / sum over its range; then per 64-float slice of the head the weighted sums, 6 rows a pass.
EV_AVX512 void attend_tokens(const AttentionArgs& a) {
    const int64_t R = a.n_tok * a.n_q, span = a.n_kv + a.n_tok - 1, hd = a.head_dim;
    const float* k = static_cast<const float*>(a.k);
    const float* v = static_cast<const float*>(a.v);
    constexpr ScoresRowsFn kScores[kRowsPass] = {scores_rows<1>, scores_rows<2>, scores_rows<3>,
                                                 scores_rows<4>, scores_rows<5>, scores_rows<6>};
    constexpr SumRowsFn kSums[kRowsPass] = {sum_rows<1>, sum_rows<2>, sum_rows<3>, sum_rows<4>, sum_rows<5>, sum_rows<6>};
    const float* q[kRowsPass];
    float* dst[kRowsPass];
    for (int64_t j = 0; j < span; j += 8)
        for (int64_t r0 = 0; r0 < R; r0 += kRowsPass) {
            const int rb = static_cast<int>(R - r0 < kRowsPass ? R - r0 : kRowsPass);
            for (int h = 0; h < rb; ++h) q[h] = row_of(a, r0 + h).q, dst[h] = a.scores + (r0 + h) * span + j;
            kScores[rb - 1](q, k, a.k_stride, j, span - 1, hd, a.scale, dst, span - j < 8 ? span - j : 8);
        }
    for (int64_t r0 = 0; r0 < R; r0 += kRowsPass) {
        const int rb = static_cast<int>(R - r0 < kRowsPass ? R - r0 : kRowsPass);
        const float* e[kRowsPass];
        int64_t lo[kRowsPass], hi[kRowsPass];
        float inv[kRowsPass];
        for (int h = 0; h < rb; ++h) {
            const Row row = row_of(a, r0 + h);
            float* s = a.scores + (r0 + h) * span;
            lo[h] = row.lo, hi[h] = row.hi, e[h] = s;
            __m256 vmax = _mm256_set1_ps(-3.4e38f);
            int64_t i = row.lo;
            for (; i + 8 <= row.hi; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
            if (i < row.hi)  // attention avx2's tail: lanes past the last key repeat its score
                vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(_mm256_set1_ps(s[row.hi - 1]), _mm256_maskload_ps(s + i, tail_mask(row.hi - i)),
                                                            _mm256_castsi256_ps(tail_mask(row.hi - i))));
            inv[h] = static_cast<float>(1.0 / exp_sub_scaled_sum(s + row.lo, row.hi - row.lo, hmax(vmax), 1.f));
        }
        for (int64_t d0 = 0; d0 < hd; d0 += 64) {
            for (int h = 0; h < rb; ++h) dst[h] = row_of(a, r0 + h).out + d0;
            kSums[rb - 1](e, lo, hi, v + d0, a.v_stride, span, inv, dst);
        }
    }
}

}  // namespace

// Half and int8 caches on 16-lane vectors; a float cache by attention avx2, or for several tokens
// with head_dim a multiple of 64 (a prefill chunk) by attend_tokens; no keys by attention avx2.
EV_AVX512 void attention_avx512(const AttentionArgs& args) {
    const AttentionArgs a = args;  // a local copy: stores to scores cannot alias its fields
    if (a.n_tok > 1) {
        if (a.kv_type == DType::F32 && a.n_kv > 0 && a.head_dim % 64 == 0) return attend_tokens(a);
        return attention_each_token(a, attention_avx512);
    }
    if (a.n_kv > 0 && a.kv_type == DType::F16) return attend<DType::F16>(a);
    if (a.n_kv > 0 && a.kv_type == DType::Q8_0) return attend<DType::Q8_0>(a);
    attention_avx2(a);
}

}  // namespace evk
#endif
