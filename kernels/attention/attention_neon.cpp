// NEON attention of the query rows of one kv head's group against its cached keys and values
// (AttentionArgs, kernels/ops.h), on a float, half or int8 (Q8_0) cache; baseline armv8-a.
//
// Why: an Arm robot ran `attention ref`, a scalar dot and axpy per key with a row converted on the
// stack for the compressed caches. Per token that is head_dim x n_kv x 2 multiply-adds per query
// head: SmolLM2-135M at 1k positions, 30 layers x 9 heads x 1024 x 128 = 35 M scalar FMAs, more
// than streaming its 96 MB of weights costs a Cortex-A76-class core. Here 4 lanes per FMA and the
// half / int8 values converted once per row for all the query heads of a group (vcvt_f32_f16;
// int8 widened twice, times the block's scale). Correctness against the reference under qemu-aarch64 (kernel_check);
// speed not measured (no Arm machine here).
//
// The steps are the reference's: every score, their maximum, exp(score - max) (exp4, the NEON
// element-wise operators' exp), their sum, then sum_j e_j v_j scaled by 1 / sum.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cmath>
#include <cstring>

#include "../elementwise/exp_neon.h"
#include "../ops.h"

namespace evk {

namespace {

// q . k over n floats: 4 accumulators of 4 lanes, then 4 lanes, then the scalar tail.
inline float dot_f32(const float* q, const float* k, int64_t n) {
    float32x4_t s0 = vdupq_n_f32(0.f), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = vfmaq_f32(s0, vld1q_f32(q + i), vld1q_f32(k + i));
        s1 = vfmaq_f32(s1, vld1q_f32(q + i + 4), vld1q_f32(k + i + 4));
        s2 = vfmaq_f32(s2, vld1q_f32(q + i + 8), vld1q_f32(k + i + 8));
        s3 = vfmaq_f32(s3, vld1q_f32(q + i + 12), vld1q_f32(k + i + 12));
    }
    for (; i + 4 <= n; i += 4) s0 = vfmaq_f32(s0, vld1q_f32(q + i), vld1q_f32(k + i));
    float s = vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
    for (; i < n; ++i) s += q[i] * k[i];
    return s;
}

// out[0, n) += p * v[0, n).
inline void axpy_f32(float p, const float* v, float* out, int64_t n) {
    const float32x4_t pv = vdupq_n_f32(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        vst1q_f32(out + i, vfmaq_f32(vld1q_f32(out + i), pv, vld1q_f32(v + i)));
        vst1q_f32(out + i + 4, vfmaq_f32(vld1q_f32(out + i + 4), pv, vld1q_f32(v + i + 4)));
    }
    for (; i + 4 <= n; i += 4) vst1q_f32(out + i, vfmaq_f32(vld1q_f32(out + i), pv, vld1q_f32(v + i)));
    for (; i < n; ++i) out[i] += p * v[i];
}

// -- Half and int8 caches: rows of blocks of 32 (head_dim a multiple of 32) --

// Elements 8c .. 8c + 7 of a block as two float vectors (Q8_0: its int8 values, without the scale).
template <DType KV>
inline void load8(const uint8_t* blk, int c, float32x4_t* lo, float32x4_t* hi) {
    if constexpr (KV == DType::F16) {
        const float16x8_t h = vreinterpretq_f16_u8(vld1q_u8(blk + 16 * c));
        *lo = vcvt_f32_f16(vget_low_f16(h));
        *hi = vcvt_high_f32_f16(h);
    } else {
        const int16x8_t w = vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(blk + 2 + 8 * c)));
        *lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w)));
        *hi = vcvtq_f32_s32(vmovl_high_s16(w));
    }
}

// A block's scale (Q8_0: its fp16 d; F16: 1).
template <DType KV>
inline float block_scale(const uint8_t* blk) {
    if constexpr (KV == DType::Q8_0) {
        uint16_t h;
        std::memcpy(&h, blk, sizeof h);
        return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
    } else {
        return 1.f;
    }
}

// dst[0, n) = a row of blocks as floats (Q8_0: d times its int8 values, the product the format's
// to_float rounds). Converted once per row for all the heads of a group.
template <DType KV>
inline void convert_row(const uint8_t* row, int64_t n, float* dst) {
    for (int64_t b = 0; b < n / kQK; ++b, row += kv_block_bytes(KV), dst += kQK) {
        const float d = block_scale<KV>(row);
        for (int c = 0; c < 4; ++c) {
            float32x4_t lo, hi;
            load8<KV>(row, c, &lo, &hi);
            if constexpr (KV == DType::Q8_0) lo = vmulq_n_f32(lo, d), hi = vmulq_n_f32(hi, d);
            vst1q_f32(dst + 8 * c, lo);
            vst1q_f32(dst + 8 * c + 4, hi);
        }
    }
}

// scores[j] = exp(scores[j] - max) and their sum.
inline float exp_scores(float* s, int64_t n, float mx) {
    const float32x4_t m = vdupq_n_f32(mx);
    float32x4_t acc = vdupq_n_f32(0.f);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float32x4_t e = exp4(vsubq_f32(vld1q_f32(s + j), m));
        vst1q_f32(s + j, e);
        acc = vaddq_f32(acc, e);
    }
    float sum = vaddvq_f32(acc);
    for (; j < n; ++j) {
        float tail[4] = {s[j] - mx, 0.f, 0.f, 0.f};
        vst1q_f32(tail, exp4(vld1q_f32(tail)));
        s[j] = tail[0];
        sum += tail[0];
    }
    return sum;
}

// Each query head of the group in the reference's steps; a key or value row is read once for all
// heads (the heads inner) and, for a half / int8 cache, converted to floats once for all of them.
// A head's additions are the same, in the same order, as when it is alone.
template <DType KV>
void attend(const AttentionArgs& a) {
    const int64_t n = a.n_kv, G = a.n_q, hd = a.head_dim;
    const uint8_t* k = static_cast<const uint8_t*>(a.k);
    const uint8_t* v = static_cast<const uint8_t*>(a.v);
    const size_t ks = kv_bytes(KV, a.k_stride), vs = kv_bytes(KV, a.v_stride);
    float buf[KV == DType::F32 ? 1 : kMaxAttentionHeadDim];
    // Row j as floats: the row itself for F32, else converted into buf.
    auto row_f32 = [&](const uint8_t* row) -> const float* {
        if constexpr (KV == DType::F32) {
            return reinterpret_cast<const float*>(row);
        } else {
            convert_row<KV>(row, hd, buf);
            return buf;
        }
    };
    float mx[kMaxAttentionGroup];
    for (int64_t g = 0; g < G; ++g) mx[g] = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
        const float* row = row_f32(k + static_cast<size_t>(j) * ks);
        for (int64_t g = 0; g < G; ++g) {
            const float s = a.scale * dot_f32(a.q + g * a.q_stride, row, hd);
            a.scores[g * n + j] = s;
            mx[g] = s > mx[g] ? s : mx[g];
        }
    }
    float inv[kMaxAttentionGroup];
    for (int64_t g = 0; g < G; ++g) {
        inv[g] = 1.f / exp_scores(a.scores + g * n, n, mx[g]);
        for (int64_t d = 0; d < hd; ++d) a.out[g * a.q_stride + d] = 0.f;
    }
    for (int64_t j = 0; j < n; ++j) {
        const float* row = row_f32(v + static_cast<size_t>(j) * vs);
        for (int64_t g = 0; g < G; ++g) axpy_f32(a.scores[g * n + j], row, a.out + g * a.q_stride, hd);
    }
    for (int64_t g = 0; g < G; ++g) {
        float* out = a.out + g * a.q_stride;
        const float32x4_t iv = vdupq_n_f32(inv[g]);
        int64_t d = 0;
        for (; d + 4 <= hd; d += 4) vst1q_f32(out + d, vmulq_f32(vld1q_f32(out + d), iv));
        for (; d < hd; ++d) out[d] *= inv[g];
    }
}

}  // namespace

void attention_neon(const AttentionArgs& a) {
    if (a.n_tok > 1) return attention_each_token(a, attention_neon);
    if (a.n_kv <= 0) {  // no keys: zeros, as the reference writes
        for (int64_t g = 0; g < a.n_q; ++g)
            for (int64_t d = 0; d < a.head_dim; ++d) a.out[g * a.q_stride + d] = 0.f;
        return;
    }
    switch (a.kv_type) {
    case DType::F16: attend<DType::F16>(a); break;
    case DType::Q8_0: attend<DType::Q8_0>(a); break;
    default: attend<DType::F32>(a); break;
    }
}

}  // namespace evk
#endif
