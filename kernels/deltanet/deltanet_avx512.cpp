// AVX-512 Gated DeltaNet operators, 16 floats at a time, tails through mask registers: the AVX2
// variants' walks at twice the width (deltanet_avx2.cpp has the reasoning).
//
// delta_rule: the state is walked in blocks of kBlockNV vectors (kBlockNV x 16 columns); all tokens
// of the call run over one block before the next, so a block of a 128-row state stays in L1
// across the tokens. Per token and block: pass 1 sums kv = S^T k over the rows (even and odd rows
// in their own accumulators), pass 2 writes S = exp(g) S + k delta^T and sums out = S^T q from the
// values just written. The order of every sum depends on dk only, so a prompt split into calls
// gives bit-equal results. Block width measured in docs/kernels/deltanet.md ("AVX-512").
#if defined(__x86_64__)
#include "../elementwise/exp_avx512.h"  // first: <immintrin.h> through avx512_intrin.h

#include <cmath>

#include "../ops.h"

namespace evk {

namespace {

constexpr int kBlockNV = 4;  // 64 columns: a 128-row block is 32 KiB

template <bool kMasked>
EV_AVX512 inline __m512 load16(const float* p, __mmask16 m) {
    return kMasked ? _mm512_maskz_loadu_ps(m, p) : _mm512_loadu_ps(p);
}
template <bool kMasked>
EV_AVX512 inline void store16(float* p, __mmask16 m, __m512 v) {
    if (kMasked)
        _mm512_mask_storeu_ps(p, m, v);
    else
        _mm512_storeu_ps(p, v);
}

// Vector u of a block: the last one (`last`) through the tail mask when kTail.
template <bool kTail>
EV_AVX512 inline __m512 ld(bool last, __mmask16 tail, const float* p) {
    return kTail && last ? _mm512_maskz_loadu_ps(tail, p) : _mm512_loadu_ps(p);
}
template <bool kTail>
EV_AVX512 inline void st(bool last, __mmask16 tail, float* p, __m512 x) {
    if (kTail && last)
        _mm512_mask_storeu_ps(p, tail, x);
    else
        _mm512_storeu_ps(p, x);
}

// Columns [j0, j0 + 16 kNV) of the state over all tokens; with kTail the last vector holds the
// lanes of `tail` only.
template <int kNV, bool kTail>
EV_AVX512 void delta_block(float* S, const float* q, const float* k, int64_t qk_stride, const float* v,
                           int64_t v_stride, const float* g, const float* beta, int64_t gb_stride, int64_t n_tokens,
                           int64_t dk, int64_t dv, float* out, int64_t out_stride, int64_t j0, __mmask16 tail) {
    constexpr int kLast = kNV - 1;
    float* Sb = S + j0;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* kt = k + t * qk_stride;
        const float* qt = q + t * qk_stride;
        const __m512 dec = _mm512_set1_ps(std::exp(g[t * gb_stride]));
        const __m512 b = _mm512_set1_ps(beta[t * gb_stride]);
        __m512 a0[kNV], a1[kNV];
        for (int u = 0; u < kNV; ++u) a0[u] = a1[u] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 2 <= dk; i += 2) {
            const __m512 k0 = _mm512_set1_ps(kt[i]), k1 = _mm512_set1_ps(kt[i + 1]);
            const float* r0 = Sb + i * dv;
            const float* r1 = r0 + dv;
            for (int u = 0; u < kNV; ++u) {
                a0[u] = _mm512_fmadd_ps(ld<kTail>(u == kLast, tail, r0 + 16 * u), k0, a0[u]);
                a1[u] = _mm512_fmadd_ps(ld<kTail>(u == kLast, tail, r1 + 16 * u), k1, a1[u]);
            }
        }
        if (i < dk) {
            const __m512 k0 = _mm512_set1_ps(kt[i]);
            const float* r0 = Sb + i * dv;
            for (int u = 0; u < kNV; ++u) a0[u] = _mm512_fmadd_ps(ld<kTail>(u == kLast, tail, r0 + 16 * u), k0, a0[u]);
        }
        __m512 delta[kNV];
        const float* vt = v + t * v_stride + j0;
        for (int u = 0; u < kNV; ++u) {
            delta[u] = _mm512_mul_ps(_mm512_fnmadd_ps(dec, _mm512_add_ps(a0[u], a1[u]), ld<kTail>(u == kLast, tail, vt + 16 * u)), b);
            a0[u] = a1[u] = _mm512_setzero_ps();  // now the output sums
        }
        i = 0;
        for (; i + 2 <= dk; i += 2) {
            const __m512 k0 = _mm512_set1_ps(kt[i]), k1 = _mm512_set1_ps(kt[i + 1]);
            const __m512 q0 = _mm512_set1_ps(qt[i]), q1 = _mm512_set1_ps(qt[i + 1]);
            float* r0 = Sb + i * dv;
            float* r1 = r0 + dv;
            for (int u = 0; u < kNV; ++u) {
                const __m512 s0 = _mm512_fmadd_ps(k0, delta[u], _mm512_mul_ps(dec, ld<kTail>(u == kLast, tail, r0 + 16 * u)));
                const __m512 s1 = _mm512_fmadd_ps(k1, delta[u], _mm512_mul_ps(dec, ld<kTail>(u == kLast, tail, r1 + 16 * u)));
                st<kTail>(u == kLast, tail, r0 + 16 * u, s0);
                st<kTail>(u == kLast, tail, r1 + 16 * u, s1);
                a0[u] = _mm512_fmadd_ps(q0, s0, a0[u]);
                a1[u] = _mm512_fmadd_ps(q1, s1, a1[u]);
            }
        }
        if (i < dk) {
            const __m512 k0 = _mm512_set1_ps(kt[i]), q0 = _mm512_set1_ps(qt[i]);
            float* r0 = Sb + i * dv;
            for (int u = 0; u < kNV; ++u) {
                const __m512 s0 = _mm512_fmadd_ps(k0, delta[u], _mm512_mul_ps(dec, ld<kTail>(u == kLast, tail, r0 + 16 * u)));
                st<kTail>(u == kLast, tail, r0 + 16 * u, s0);
                a0[u] = _mm512_fmadd_ps(q0, s0, a0[u]);
            }
        }
        float* ot = out + t * out_stride + j0;
        for (int u = 0; u < kNV; ++u) st<kTail>(u == kLast, tail, ot + 16 * u, _mm512_add_ps(a0[u], a1[u]));
    }
}

// Sum of x[i]^2 over [0, n): element i into accumulator (i / 16) mod 4, then (a0 + a1) + (a2 + a3)
// and a fixed reduction tree (an order that depends on n only).
EV_AVX512 float sum_squares16(const float* x, int64_t n) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int u = 0; u < 4; ++u) {
            const __m512 v = _mm512_loadu_ps(x + i + 16 * u);
            acc[u] = _mm512_fmadd_ps(v, v, acc[u]);
        }
    for (int u = 0; i < n; i += 16, ++u) {
        const __m512 v = _mm512_maskz_loadu_ps(tail_mask16(n - i), x + i);
        acc[u] = _mm512_fmadd_ps(v, v, acc[u]);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

// Channels [c, c + 16) (the lanes of m only when kTail) of token row xt: y = silu(w . (window ++ x)),
// then the window (the state's column block) shifts by one row.
template <bool kTail>
EV_AVX512 inline void conv_step(const float* xt, int64_t channels, const float* w, int64_t K, float* state, float* yt,
                                int64_t c, __mmask16 m) {
    const __m512 x = load16<kTail>(xt + c, m);
    __m512 acc = _mm512_mul_ps(load16<kTail>(w + (K - 1) * channels + c, m), x);
    for (int64_t j = 0; j + 1 < K; ++j)
        acc = _mm512_fmadd_ps(load16<kTail>(w + j * channels + c, m), load16<kTail>(state + j * channels + c, m), acc);
    for (int64_t j = 0; j + 2 < K; ++j)
        store16<kTail>(state + j * channels + c, m, load16<kTail>(state + (j + 1) * channels + c, m));
    if (K > 1) store16<kTail>(state + (K - 2) * channels + c, m, x);
    store16<kTail>(yt + c, m, _mm512_mul_ps(acc, sigmoid16(acc)));
}

}  // namespace

EV_AVX512 void delta_rule_avx512(float* S, const float* q, const float* k, int64_t qk_stride, const float* v,
                                 int64_t v_stride, const float* g, const float* beta, int64_t gb_stride, int64_t n_tokens,
                                 int64_t dk, int64_t dv, float* out, int64_t out_stride) {
    constexpr int64_t kCols = 16 * kBlockNV;
    const __mmask16 all = 0xffff;
    int64_t j0 = 0;
    for (; j0 + kCols <= dv; j0 += kCols)
        delta_block<kBlockNV, false>(S, q, k, qk_stride, v, v_stride, g, beta, gb_stride, n_tokens, dk, dv, out, out_stride,
                                     j0, all);
    const int64_t rem = dv - j0;
    if (rem == 0) return;
    const __mmask16 tail = rem % 16 ? tail_mask16(rem % 16) : all;
    const int nv = static_cast<int>((rem + 15) / 16);
#define EVK_DELTA_TAIL(NV)                                                                                          \
    if (rem % 16)                                                                                                   \
        delta_block<NV, true>(S, q, k, qk_stride, v, v_stride, g, beta, gb_stride, n_tokens, dk, dv, out, out_stride, \
                              j0, tail);                                                                            \
    else                                                                                                            \
        delta_block<NV, false>(S, q, k, qk_stride, v, v_stride, g, beta, gb_stride, n_tokens, dk, dv, out,          \
                               out_stride, j0, all);
    static_assert(kBlockNV <= 4, "the tail switch covers blocks of up to 4 vectors");
    switch (nv) {
        case 1: EVK_DELTA_TAIL(1) break;
        case 2: EVK_DELTA_TAIL(2) break;
        case 3: EVK_DELTA_TAIL(3) break;
        default: EVK_DELTA_TAIL(4) break;
    }
#undef EVK_DELTA_TAIL
}

EV_AVX512 void causal_conv1d_avx512(const float* x, int64_t x_stride, int64_t n_tokens, int64_t channels,
                                    const float* w, int64_t K, float* state, float* y, int64_t y_stride) {
    const __mmask16 all = 0xffff, tail = tail_mask16(channels % 16);
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* xt = x + t * x_stride;
        float* yt = y + t * y_stride;
        int64_t c = 0;
        for (; c + 16 <= channels; c += 16) conv_step<false>(xt, channels, w, K, state, yt, c, all);
        if (c < channels) conv_step<true>(xt, channels, w, K, state, yt, c, tail);
    }
}

EV_AVX512 void l2norm_avx512(const float* x, float* y, int64_t n, float eps) {
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(sum_squares16(x, n) + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask16(n - i);
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
    }
}

EV_AVX512 void rmsnorm_gated_avx512(const float* x, const float* w, const float* z, float* y, int64_t n, float eps) {
    const __m512 scale = _mm512_set1_ps(1.f / std::sqrt(sum_squares16(x, n) / static_cast<float>(n) + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask16(n - i);
        const __m512 zz = _mm512_maskz_loadu_ps(m, z + i);
        const __m512 gate = _mm512_mul_ps(zz, sigmoid16(zz));
        const __m512 xs = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), scale), _mm512_maskz_loadu_ps(m, w + i));
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(xs, gate));
    }
}

EV_AVX512 void sigmoid_mul_avx512(float* x, const float* g, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask16(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), sigmoid16(_mm512_maskz_loadu_ps(m, g + i))));
    }
}

}  // namespace evk
#endif
