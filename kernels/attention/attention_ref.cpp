// Reference attention, one query row at a time: scores, a max-subtracted softmax, weighted sum of values.
// Keys and values of a half or int8 cache (F16, Q8_0) are converted a row at a time by the formats'
// reference conversion (to_float), into a row on the stack.
#include <cmath>
#include <cstdint>

#include "../ops.h"

namespace evk {

namespace {

// Row j of a cache of `type` as floats: the row itself for F32, else converted into buf.
const float* kv_row(const void* base, DType type, int64_t stride, int64_t j, int64_t n, float* buf) {
    const uint8_t* row = static_cast<const uint8_t*>(base) + kv_bytes(type, j * stride);
    if (type == DType::F32) return reinterpret_cast<const float*>(row);
    type_traits(type)->to_float(row, buf, n);
    return buf;
}

void attend_one(const AttentionArgs& a) {
    float buf[kMaxAttentionHeadDim];
    float mx = -INFINITY;
    for (int64_t j = 0; j < a.n_kv; ++j) {
        const float s = a.scale * dot_ref(a.q, kv_row(a.k, a.kv_type, a.k_stride, j, a.head_dim, buf), a.head_dim);
        a.scores[j] = s;
        mx = s > mx ? s : mx;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < a.n_kv; ++j) {
        a.scores[j] = std::exp(a.scores[j] - mx);
        sum += a.scores[j];
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < a.head_dim; ++d) a.out[d] = 0.f;
    for (int64_t j = 0; j < a.n_kv; ++j) {
        const float p = a.scores[j] * inv;
        const float* v = kv_row(a.v, a.kv_type, a.v_stride, j, a.head_dim, buf);
        for (int64_t d = 0; d < a.head_dim; ++d) a.out[d] += p * v[d];
    }
}

}  // namespace

// The query heads of a group one after the other, each reading every key and value row; several
// tokens one after the other.
void attention_ref(const AttentionArgs& args) {
    if (args.n_tok > 1) return attention_each_token(args, attention_ref);
    for (int64_t g = 0; g < args.n_q; ++g) {
        AttentionArgs a = args;
        a.q = args.q + g * args.q_stride;
        a.out = args.out + g * args.q_stride;
        a.scores = args.scores + g * args.n_kv;
        attend_one(a);
    }
}

}  // namespace evk
