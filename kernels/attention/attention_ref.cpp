// Reference attention for one query row: scores, a max-subtracted softmax, weighted sum of values.
#include <cmath>

#include "../ops.h"

namespace evk {

void attention_ref(const AttentionArgs& a) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < a.n_kv; ++j) {
        const float s = a.scale * dot_ref(a.q, a.k + j * a.k_stride, a.head_dim);
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
        const float* v = a.v + j * a.v_stride;
        for (int64_t d = 0; d < a.head_dim; ++d) a.out[d] += p * v[d];
    }
}

}  // namespace evk
