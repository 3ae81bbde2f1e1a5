// AVX2 + FMA Gated DeltaNet operators, 8 floats at a time, tails through masked loads and stores.
// Compiled for the baseline ISA; only these functions carry the AVX2 target.
//
// delta_rule: the columns of a head's state are independent (kv[j], delta[j], S[:, j] and out[j]
// read column j only), so the state is walked in blocks of 32 columns (4 vectors), and all tokens
// of the call run over one block before the next: a block of a 128-row state is 16 KiB, kept in L1
// across the tokens. Per token and block: pass 1 sums kv = S^T k over the rows (two accumulators
// per vector, even and odd rows, for eight FMA chains), pass 2 writes S = exp(g) S + k delta^T and
// sums out = S^T q from the values just written. The order of every sum depends on dk only, so a
// prompt split into calls gives bit-equal results (docs/kernels/deltanet.md).
#if defined(__x86_64__)
#include <cmath>

#include "../elementwise/exp_avx2.h"  // EV_AVX2, sigmoid8, tail_mask, hsum

#include "../ops.h"

namespace evk {

namespace {

// A vector of 8 floats at p, or of the lanes of m only (kMasked; the others read as 0, not touched).
template <bool kMasked>
EV_AVX2 inline __m256 load8(const float* p, __m256i m) {
    return kMasked ? _mm256_maskload_ps(p, m) : _mm256_loadu_ps(p);
}
template <bool kMasked>
EV_AVX2 inline void store8(float* p, __m256i m, __m256 v) {
    if (kMasked)
        _mm256_maskstore_ps(p, m, v);
    else
        _mm256_storeu_ps(p, v);
}

// Columns [j0, j0 + 8 kNV) of the state over all tokens; with kTail the last vector holds the
// lanes of `tail` only.
template <int kNV, bool kTail>
EV_AVX2 void delta_block(float* S, const float* q, const float* k, int64_t qk_stride, const float* v, int64_t v_stride,
                         const float* g, const float* beta, int64_t gb_stride, int64_t n_tokens, int64_t dk, int64_t dv,
                         float* out, int64_t out_stride, int64_t j0, __m256i tail) {
    constexpr int kLast = kNV - 1;
    float* Sb = S + j0;
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* kt = k + t * qk_stride;
        const float* qt = q + t * qk_stride;
        const __m256 dec = _mm256_set1_ps(std::exp(g[t * gb_stride]));
        const __m256 b = _mm256_set1_ps(beta[t * gb_stride]);
        __m256 a0[kNV], a1[kNV];
        for (int u = 0; u < kNV; ++u) a0[u] = a1[u] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 2 <= dk; i += 2) {
            const __m256 k0 = _mm256_set1_ps(kt[i]), k1 = _mm256_set1_ps(kt[i + 1]);
            const float* r0 = Sb + i * dv;
            const float* r1 = r0 + dv;
            for (int u = 0; u < kLast; ++u) {
                a0[u] = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + 8 * u), k0, a0[u]);
                a1[u] = _mm256_fmadd_ps(_mm256_loadu_ps(r1 + 8 * u), k1, a1[u]);
            }
            a0[kLast] = _mm256_fmadd_ps(load8<kTail>(r0 + 8 * kLast, tail), k0, a0[kLast]);
            a1[kLast] = _mm256_fmadd_ps(load8<kTail>(r1 + 8 * kLast, tail), k1, a1[kLast]);
        }
        if (i < dk) {
            const __m256 k0 = _mm256_set1_ps(kt[i]);
            const float* r0 = Sb + i * dv;
            for (int u = 0; u < kLast; ++u) a0[u] = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + 8 * u), k0, a0[u]);
            a0[kLast] = _mm256_fmadd_ps(load8<kTail>(r0 + 8 * kLast, tail), k0, a0[kLast]);
        }
        __m256 delta[kNV];
        const float* vt = v + t * v_stride + j0;
        for (int u = 0; u < kNV; ++u) {
            const __m256 vv = u == kLast ? load8<kTail>(vt + 8 * u, tail) : _mm256_loadu_ps(vt + 8 * u);
            delta[u] = _mm256_mul_ps(_mm256_fnmadd_ps(dec, _mm256_add_ps(a0[u], a1[u]), vv), b);
            a0[u] = a1[u] = _mm256_setzero_ps();  // now the output sums
        }
        i = 0;
        for (; i + 2 <= dk; i += 2) {
            const __m256 k0 = _mm256_set1_ps(kt[i]), k1 = _mm256_set1_ps(kt[i + 1]);
            const __m256 q0 = _mm256_set1_ps(qt[i]), q1 = _mm256_set1_ps(qt[i + 1]);
            float* r0 = Sb + i * dv;
            float* r1 = r0 + dv;
            for (int u = 0; u < kNV; ++u) {
                const bool m = kTail && u == kLast;
                const __m256 s0 = _mm256_fmadd_ps(k0, delta[u], _mm256_mul_ps(dec, m ? load8<kTail>(r0 + 8 * u, tail) : _mm256_loadu_ps(r0 + 8 * u)));
                const __m256 s1 = _mm256_fmadd_ps(k1, delta[u], _mm256_mul_ps(dec, m ? load8<kTail>(r1 + 8 * u, tail) : _mm256_loadu_ps(r1 + 8 * u)));
                if (m) {
                    store8<kTail>(r0 + 8 * u, tail, s0);
                    store8<kTail>(r1 + 8 * u, tail, s1);
                } else {
                    _mm256_storeu_ps(r0 + 8 * u, s0);
                    _mm256_storeu_ps(r1 + 8 * u, s1);
                }
                a0[u] = _mm256_fmadd_ps(q0, s0, a0[u]);
                a1[u] = _mm256_fmadd_ps(q1, s1, a1[u]);
            }
        }
        if (i < dk) {
            const __m256 k0 = _mm256_set1_ps(kt[i]), q0 = _mm256_set1_ps(qt[i]);
            float* r0 = Sb + i * dv;
            for (int u = 0; u < kNV; ++u) {
                const bool m = kTail && u == kLast;
                const __m256 s0 = _mm256_fmadd_ps(k0, delta[u], _mm256_mul_ps(dec, m ? load8<kTail>(r0 + 8 * u, tail) : _mm256_loadu_ps(r0 + 8 * u)));
                if (m)
                    store8<kTail>(r0 + 8 * u, tail, s0);
                else
                    _mm256_storeu_ps(r0 + 8 * u, s0);
                a0[u] = _mm256_fmadd_ps(q0, s0, a0[u]);
            }
        }
        float* ot = out + t * out_stride + j0;
        for (int u = 0; u < kNV; ++u) {
            const __m256 o = _mm256_add_ps(a0[u], a1[u]);
            if (kTail && u == kLast)
                store8<kTail>(ot + 8 * u, tail, o);
            else
                _mm256_storeu_ps(ot + 8 * u, o);
        }
    }
}

// Sum of x[i]^2 over [0, n): element i into accumulator (i / 8) mod 4, then (a0 + a1) + (a2 + a3)
// and hsum's tree (an order that depends on n only).
EV_AVX2 float sum_squares8(const float* x, int64_t n) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int u = 0; u < 4; ++u) {
            const __m256 v = _mm256_loadu_ps(x + i + 8 * u);
            acc[u] = _mm256_fmadd_ps(v, v, acc[u]);
        }
    for (int u = 0; i < n; i += 8, ++u) {
        const __m256 v = n - i >= 8 ? _mm256_loadu_ps(x + i) : _mm256_maskload_ps(x + i, tail_mask(n - i));
        acc[u] = _mm256_fmadd_ps(v, v, acc[u]);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

// Channels [c, c + 8) (the lanes of m only when kTail) of token row xt: y = silu(w . (window ++ x)),
// then the window (the state's column block) shifts by one row.
template <bool kTail>
EV_AVX2 inline void conv_step(const float* xt, int64_t channels, const float* w, int64_t K, float* state, float* yt,
                              int64_t c, __m256i m) {
    const __m256 x = load8<kTail>(xt + c, m);
    __m256 acc = _mm256_mul_ps(load8<kTail>(w + (K - 1) * channels + c, m), x);
    for (int64_t j = 0; j + 1 < K; ++j)
        acc = _mm256_fmadd_ps(load8<kTail>(w + j * channels + c, m), load8<kTail>(state + j * channels + c, m), acc);
    for (int64_t j = 0; j + 2 < K; ++j)
        store8<kTail>(state + j * channels + c, m, load8<kTail>(state + (j + 1) * channels + c, m));
    if (K > 1) store8<kTail>(state + (K - 2) * channels + c, m, x);
    store8<kTail>(yt + c, m, _mm256_mul_ps(acc, sigmoid8(acc)));
}

}  // namespace

EV_AVX2 void delta_rule_avx2(float* S, const float* q, const float* k, int64_t qk_stride, const float* v,
                             int64_t v_stride, const float* g, const float* beta, int64_t gb_stride, int64_t n_tokens,
                             int64_t dk, int64_t dv, float* out, int64_t out_stride) {
    const __m256i all = _mm256_set1_epi32(-1);
    int64_t j0 = 0;
    for (; j0 + 32 <= dv; j0 += 32)
        delta_block<4, false>(S, q, k, qk_stride, v, v_stride, g, beta, gb_stride, n_tokens, dk, dv, out, out_stride, j0, all);
    const int64_t rem = dv - j0;
    if (rem == 0) return;
    const __m256i tail = rem % 8 ? tail_mask(rem % 8) : all;
    const int nv = static_cast<int>((rem + 7) / 8);
#define EVK_DELTA_TAIL(NV)                                                                                                 \
    if (rem % 8)                                                                                                           \
        delta_block<NV, true>(S, q, k, qk_stride, v, v_stride, g, beta, gb_stride, n_tokens, dk, dv, out, out_stride, j0, tail); \
    else                                                                                                                   \
        delta_block<NV, false>(S, q, k, qk_stride, v, v_stride, g, beta, gb_stride, n_tokens, dk, dv, out, out_stride, j0, all);
    switch (nv) {
        case 1: EVK_DELTA_TAIL(1) break;
        case 2: EVK_DELTA_TAIL(2) break;
        case 3: EVK_DELTA_TAIL(3) break;
        default: EVK_DELTA_TAIL(4) break;
    }
#undef EVK_DELTA_TAIL
}

// Token by token, each token's row across the channels: the rows of x, y, w and the state stream
// in order (a channel-major walk would jump x_stride floats per token).
EV_AVX2 void causal_conv1d_avx2(const float* x, int64_t x_stride, int64_t n_tokens, int64_t channels, const float* w,
                                int64_t K, float* state, float* y, int64_t y_stride) {
    const __m256i all = _mm256_set1_epi32(-1), tail = tail_mask(channels % 8);
    for (int64_t t = 0; t < n_tokens; ++t) {
        const float* xt = x + t * x_stride;
        float* yt = y + t * y_stride;
        int64_t c = 0;
        for (; c + 8 <= channels; c += 8) conv_step<false>(xt, channels, w, K, state, yt, c, all);
        if (c < channels) conv_step<true>(xt, channels, w, K, state, yt, c, tail);
    }
}

EV_AVX2 void l2norm_avx2(const float* x, float* y, int64_t n, float eps) {
    const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(sum_squares8(x, n) + eps));
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(y + i, m, _mm256_mul_ps(_mm256_maskload_ps(x + i, m), inv));
    }
}

EV_AVX2 void rmsnorm_gated_avx2(const float* x, const float* w, const float* z, float* y, int64_t n, float eps) {
    const __m256 scale = _mm256_set1_ps(1.f / std::sqrt(sum_squares8(x, n) / static_cast<float>(n) + eps));
    for (int64_t i = 0; i < n; i += 8) {
        const __m256i m = tail_mask(n - i < 8 ? n - i : 8);
        const __m256 zz = _mm256_maskload_ps(z + i, m);
        const __m256 gate = _mm256_mul_ps(zz, sigmoid8(zz));
        const __m256 xs = _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(x + i, m), scale), _mm256_maskload_ps(w + i, m));
        _mm256_maskstore_ps(y + i, m, _mm256_mul_ps(xs, gate));
    }
}

EV_AVX2 void sigmoid_mul_avx2(float* x, const float* g, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), sigmoid8(_mm256_loadu_ps(g + i))));
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(x + i, m, _mm256_mul_ps(_mm256_maskload_ps(x + i, m), sigmoid8(_mm256_maskload_ps(g + i, m))));
    }
}

}  // namespace evk
#endif
