// The gated delta rule 64 tokens at a time in matrix form (the WY representation of a chunk's
// product of Householder-like updates, as transformers' torch_chunk_gated_delta_rule and the FLA
// library's chunk kernel): the same result as the recurrence up to rounding, but not bit-equal
// when a prompt is split into calls at another place than a chunk boundary. Scalar, sums in double.
//
// Within a chunk of c <= 64 tokens, with G_t = g_0 + ... + g_t (cumulative log-decay from the
// chunk's start), D_ij = exp(G_i - G_j) for j <= i, and the state S entering the chunk:
//   T = (I + strict_lower(beta_i k_i.k_j D_ij))^-1            (forward substitution, c x c)
//   U = T (beta v),  W = T (beta exp(G) k)                     (c x dv, c x dk)
//   V' = U - W S                                               (the chunk's corrected values)
//   out = exp(G) q S + lower(q_i.k_j D_ij) V'
//   S <- exp(G_last) S + (exp(G_last - G) k)^T V'
// Scratch lives on the stack (about 160 KiB at dk = dv = 256); heads wider than kMaxDim run the
// recurrence instead.
#include <cmath>

#include "../ops.h"

namespace evk {

namespace {
constexpr int64_t kChunk = 64;
constexpr int64_t kMaxDim = 256;

double dot(const float* a, const float* b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
    return s;
}
}  // namespace

void delta_rule_ref_chunk64(float* S, const float* q, const float* k, int64_t qk_stride, const float* v,
                            int64_t v_stride, const float* g, const float* beta, int64_t gb_stride, int64_t n_tokens,
                            int64_t dk, int64_t dv, float* out, int64_t out_stride) {
    if (dk > kMaxDim || dv > kMaxDim) {
        delta_rule_ref(S, q, k, qk_stride, v, v_stride, g, beta, gb_stride, n_tokens, dk, dv, out, out_stride);
        return;
    }
    float T[kChunk][kChunk], U[kChunk][kMaxDim], W[kChunk][kMaxDim];
    double G[kChunk];
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kChunk) {
        const int64_t c = n_tokens - t0 < kChunk ? n_tokens - t0 : kChunk;
        const float* qc = q + t0 * qk_stride;
        const float* kc = k + t0 * qk_stride;
        double acc = 0.0;
        for (int64_t i = 0; i < c; ++i) G[i] = acc += g[(t0 + i) * gb_stride];
        // T by forward substitution: row i = e_i - sum_{j<i} A_ij row j, A_ij = beta_i k_i.k_j D_ij.
        for (int64_t i = 0; i < c; ++i) {
            const double bi = beta[(t0 + i) * gb_stride];
            for (int64_t j = 0; j < c; ++j) T[i][j] = 0.f;
            T[i][i] = 1.f;
            for (int64_t j = 0; j < i; ++j) {
                const double a = bi * dot(kc + i * qk_stride, kc + j * qk_stride, dk) * std::exp(G[i] - G[j]);
                for (int64_t l = 0; l <= j; ++l) T[i][l] = static_cast<float>(T[i][l] - a * T[j][l]);
            }
        }
        // U = T (beta v) - (T (beta exp(G) k)) S: the chunk's values corrected for what S predicts.
        for (int64_t i = 0; i < c; ++i) {
            for (int64_t x = 0; x < dk; ++x) {
                double w = 0.0;
                for (int64_t j = 0; j <= i; ++j)
                    w += static_cast<double>(T[i][j]) * beta[(t0 + j) * gb_stride] * std::exp(G[j]) * kc[j * qk_stride + x];
                W[i][x] = static_cast<float>(w);
            }
            for (int64_t y = 0; y < dv; ++y) {
                double u = 0.0;
                for (int64_t j = 0; j <= i; ++j)
                    u += static_cast<double>(T[i][j]) * beta[(t0 + j) * gb_stride] * v[(t0 + j) * v_stride + y];
                for (int64_t x = 0; x < dk; ++x) u -= static_cast<double>(W[i][x]) * S[x * dv + y];
                U[i][y] = static_cast<float>(u);
            }
        }
        for (int64_t i = 0; i < c; ++i) {
            float* o = out + (t0 + i) * out_stride;
            const double ei = std::exp(G[i]);
            for (int64_t y = 0; y < dv; ++y) {
                double s = 0.0;
                for (int64_t x = 0; x < dk; ++x) s += static_cast<double>(qc[i * qk_stride + x]) * S[x * dv + y];
                o[y] = static_cast<float>(s * ei);
            }
            for (int64_t j = 0; j <= i; ++j) {
                const double p = dot(qc + i * qk_stride, kc + j * qk_stride, dk) * std::exp(G[i] - G[j]);
                for (int64_t y = 0; y < dv; ++y) o[y] = static_cast<float>(o[y] + p * U[j][y]);
            }
        }
        const double last = G[c - 1];
        for (int64_t x = 0; x < dk; ++x)
            for (int64_t y = 0; y < dv; ++y) {
                double s = std::exp(last) * S[x * dv + y];
                for (int64_t j = 0; j < c; ++j) s += std::exp(last - G[j]) * kc[j * qk_stride + x] * U[j][y];
                S[x * dv + y] = static_cast<float>(s);
            }
    }
}

}  // namespace evk
