// AVX2 + FMA element-wise operators: softmax, GELU (tanh form), the SiLU and GELU gates built on the vector
// exp (exp_avx2.h), and the residual add, 8 floats at a time, the tail (n % 8) through masked loads and stores with
// the same arithmetic. Compiled for the baseline ISA; only these functions carry the AVX2 target.
#if defined(__x86_64__)
#include "exp_avx2.h"

#include "../ops.h"

namespace evk {

// Same operator as softmax_ref: x = softmax(scale * x), max-subtracted; the sum in double.
EV_AVX2 void softmax_avx2(float* x, int64_t n, float scale) {
    if (n <= 0) return;
    __m256 vmax = _mm256_set1_ps(x[0]), m1 = vmax, m2 = vmax, m3 = vmax;  // four independent chains
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
        m2 = _mm256_max_ps(m2, _mm256_loadu_ps(x + i + 16));
        m3 = _mm256_max_ps(m3, _mm256_loadu_ps(x + i + 24));
    }
    vmax = _mm256_max_ps(_mm256_max_ps(vmax, m1), _mm256_max_ps(m2, m3));
    for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
    float mx = hmax(vmax);
    for (; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
    const double sum = exp_sub_scaled_sum(x, n, mx, scale);  // >= 1: the maximum gives exp(0)
    const __m256 inv = _mm256_set1_ps(static_cast<float>(1.0 / sum));
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(x + i, m, _mm256_mul_ps(_mm256_maskload_ps(x + i, m), inv));
    }
}

namespace {

// 0.5 x (1 + tanh(y)) with y = sqrt(2/pi) (x + 0.044715 x^3) is exactly x sigmoid(2y): no tanh,
// and no cancellation where tanh(y) is near -1 (the scalar form loses all digits there).
EV_AVX2 inline __m256 gelu8(__m256 x) {
    const __m256 x2 = _mm256_mul_ps(x, x);
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x2), x, x);  // x + 0.044715 x^3
    return _mm256_mul_ps(x, sigmoid8(_mm256_mul_ps(_mm256_set1_ps(2.f * 0.7978845608028654f), inner)));
}

}  // namespace

EV_AVX2 void gelu_tanh_avx2(float* a, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, gelu8(_mm256_loadu_ps(a + i)));
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(a + i, m, gelu8(_mm256_maskload_ps(a + i, m)));
    }
}

// a = silu(a) * b = a sigmoid(a) b.
EV_AVX2 void silu_mul_avx2(float* a, const float* b, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(a + i);
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid8(x)), _mm256_loadu_ps(b + i)));
    }
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        const __m256 x = _mm256_maskload_ps(a + i, m);
        _mm256_maskstore_ps(a + i, m, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid8(x)), _mm256_maskload_ps(b + i, m)));
    }
}

// a = gelu_tanh(a) * b (GeGLU), gelu as in gelu_tanh_avx2.
EV_AVX2 void gelu_mul_avx2(float* a, const float* b, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, _mm256_mul_ps(gelu8(_mm256_loadu_ps(a + i)), _mm256_loadu_ps(b + i)));
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(a + i, m, _mm256_mul_ps(gelu8(_mm256_maskload_ps(a + i, m)), _mm256_maskload_ps(b + i, m)));
    }
}

// The first maximum (argmax_ref's): the largest value over 4 independent vector chains (a NaN
// noted on the way sends the search to the first NaN instead), then the first index holding it,
// 32 floats a step. Two reads of x, no serial chain through every element.
EV_AVX2 int64_t argmax_avx2(const float* x, int64_t n) {
    if (n <= 0) return 0;
    __m256 m0 = _mm256_set1_ps(x[0]), m1 = m0, m2 = m0, m3 = m0;
    __m256 nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        m0 = _mm256_max_ps(m0, a), m1 = _mm256_max_ps(m1, b), m2 = _mm256_max_ps(m2, c), m3 = _mm256_max_ps(m3, d);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q), _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i);
        m0 = _mm256_max_ps(m0, a);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    float mx = hmax(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    bool any_nan = _mm256_movemask_ps(nan) != 0 || x[0] != x[0];
    for (; i < n; ++i) {
        any_nan = any_nan || x[i] != x[i];
        mx = x[i] > mx ? x[i] : mx;
    }
    if (any_nan) return argmax_ref(x, n);  // the first NaN
    const __m256 vm = _mm256_set1_ps(mx);
    for (i = 0; i + 32 <= n; i += 32) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ)) |
                        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), vm, _CMP_EQ_OQ)) << 8 |
                        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), vm, _CMP_EQ_OQ)) << 16 |
                        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), vm, _CMP_EQ_OQ)) << 24;
        if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
    }
    for (; i < n; ++i)
        if (x[i] == mx) return i;
    return 0;  // not reached: mx is one of the elements
}

// a += b: the reference's one rounding per element, 32 floats a step.
EV_AVX2 void add_avx2(float* a, const float* b, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 32; j += 8)
            _mm256_storeu_ps(a + i + j, _mm256_add_ps(_mm256_loadu_ps(a + i + j), _mm256_loadu_ps(b + i + j)));
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    if (i < n) {
        const __m256i m = tail_mask(n - i);
        _mm256_maskstore_ps(a + i, m, _mm256_add_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m)));
    }
}

}  // namespace evk
#endif
