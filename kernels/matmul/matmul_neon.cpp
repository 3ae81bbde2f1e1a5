// Arm NEON kernels. matmul_neon_f32act: weight rows expanded to float (the NEON decoders of
// matmul_neon_formats.cpp for Q5_0, Q5_1, IQ4_NL and the K-quants, the reference dequantizer for the
// rest), then 4-accumulator FMA dots (any M); matmul_neon_q8act_dot reads the former formats through
// the same decoders. matmul_neon_q8act: decode with int8 activations, the
// integer dot product of FEAT_DotProd (sdot: four int8 products summed into each int32 lane),
// one float FMA per block, as the AVX2 maddubs kernel does on x86; matmul_neon_q8act_dot_x8, the
// same on weights packed 8 rows interleaved (packed_x8.h); matmul_neon_q8act_i8mm, two rows by two
// tokens per smmla (FEAT_I8MM). Built for baseline armv8-a;
// the dotprod function carries its own target and is picked only when HWCAP reports it.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "../ops.h"
#include "matmul_neon.h"
#include "packed_x8.h"

namespace evk {

namespace {

inline float dot_neon(const float* a, const float* b, int64_t n) {
    float32x4_t s0 = vdupq_n_f32(0.f), s1 = vdupq_n_f32(0.f), s2 = vdupq_n_f32(0.f), s3 = vdupq_n_f32(0.f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
        s1 = vfmaq_f32(s1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
        s2 = vfmaq_f32(s2, vld1q_f32(a + i + 8), vld1q_f32(b + i + 8));
        s3 = vfmaq_f32(s3, vld1q_f32(a + i + 12), vld1q_f32(b + i + 12));
    }
    for (; i + 4 <= n; i += 4) s0 = vfmaq_f32(s0, vld1q_f32(a + i), vld1q_f32(b + i));
    float s = vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

using neon::BlockQ8A;

}  // namespace

void neon::quantize_act(const float* x, int64_t k, BlockQ8A* out) {
    for (int64_t b = 0; b < k / kQK; ++b, x += kQK) {
        float32x4_t v[8];
        float32x4_t amax = vdupq_n_f32(0.f);
        for (int j = 0; j < 8; ++j) {
            v[j] = vld1q_f32(x + 4 * j);
            amax = vmaxq_f32(amax, vabsq_f32(v[j]));
        }
        const float d = vmaxvq_f32(amax) / 127.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < 8; ++j) {
            // vcvtnq: round to nearest, ties to even, like the x86 kernel's _mm256_round_ps.
            const int32x4_t q = vcvtnq_s32_f32(vmulq_n_f32(v[j], id));
            sum += vaddvq_s32(q);
            const int16x4_t q16 = vqmovn_s32(q);
            const int8x8_t q8 = vqmovn_s16(vcombine_s16(q16, q16));
            int8_t tmp[8];
            vst1_s8(tmp, q8);
            std::memcpy(out[b].qs + 4 * j, tmp, 4);
        }
        out[b].d = d;
        out[b].s = d * static_cast<float>(sum);
    }
}

namespace {

using neon::quantize_act;

__attribute__((target("arch=armv8.2-a+dotprod"))) float row_dot(DType t, const uint8_t* row, const BlockQ8A* y,
                                                                  int64_t nb) {
    float acc = 0.f, offs = 0.f;
    const uint8x16_t low = vdupq_n_u8(0x0f);
    for (int64_t b = 0; b < nb; ++b) {
        const int8x16_t y0 = vld1q_s8(y[b].qs), y1 = vld1q_s8(y[b].qs + 16);
        int32x4_t p = vdupq_n_s32(0);
        float dw, mw = 0.f;
        if (t == DType::Q8_0) {
            const uint8_t* blk = row + static_cast<size_t>(b) * sizeof(BlockQ8_0);
            dw = fp16_to_fp32(load_u16(blk));
            p = vdotq_s32(p, vld1q_s8(reinterpret_cast<const int8_t*>(blk + 2)), y0);
            p = vdotq_s32(p, vld1q_s8(reinterpret_cast<const int8_t*>(blk + 18)), y1);
        } else {
            const bool q41 = t == DType::Q4_1;
            const size_t bs = q41 ? sizeof(BlockQ4_1) : sizeof(BlockQ4_0);
            const uint8_t* blk = row + static_cast<size_t>(b) * bs;
            dw = fp16_to_fp32(load_u16(blk));
            if (q41) mw = fp16_to_fp32(load_u16(blk + 2));
            const uint8x16_t raw = vld1q_u8(blk + (q41 ? 4 : 2));
            int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, low));  // elements 0..15
            int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));   // elements 16..31
            if (!q41) {
                lo = vsubq_s8(lo, vdupq_n_s8(8));
                hi = vsubq_s8(hi, vdupq_n_s8(8));
            }
            p = vdotq_s32(p, lo, y0);
            p = vdotq_s32(p, hi, y1);
        }
        acc += dw * y[b].d * static_cast<float>(vaddvq_s32(p));
        offs += mw * y[b].s;
    }
    return acc + offs;
}

// One group of 8 rows in the x8 layout (packed_x8.h) against N tokens: in each 32-byte vector,
// bytes 0..15 are rows 0..3 and bytes 16..31 rows 4..7, 4 elements per row; the activations'
// matching 4-byte group is one 32-bit lane of qs[0..15] or qs[16..31], so sdot by lane leaves
// each row's sum in its own lane and one float FMA per block serves 4 rows. Each weight vector is
// loaded (and unpacked) once for the N tokens (a verification pass reads the weights once); each
// token's float steps are the same in the same order whatever N, and its integer sums are exact,
// so a token's 8 results do not depend on the tokens beside it.
template <int N>
__attribute__((target("arch=armv8.2-a+dotprod"))) void x8_group(DType t, const uint8_t* g, const BlockQ8A* const* y,
                                                                int64_t nb, float* const* out) {
    const size_t bb = x8_block_bytes(t), scales = t == DType::Q4_1 ? 32 : 16;
    const uint8x16_t low = vdupq_n_u8(0x0f);
    float32x4_t acc0[N], acc1[N];
    for (int n = 0; n < N; ++n) acc0[n] = acc1[n] = vdupq_n_f32(0.f);
    for (int64_t b = 0; b < nb; ++b, g += bb) {
        const uint8_t* v = g + scales;
        int8x16_t y0[N], y1[N];
        int32x4_t p0[N], p1[N];  // rows 0..3, rows 4..7
        for (int n = 0; n < N; ++n) {
            y0[n] = vld1q_s8(y[n][b].qs);
            y1[n] = vld1q_s8(y[n][b].qs + 16);
            p0[n] = p1[n] = vdupq_n_s32(0);
        }
        if (t == DType::Q8_0) {
            for (int j = 0; j < 8; ++j) {
                const int8x16_t w0 = vld1q_s8(reinterpret_cast<const int8_t*>(v + 32 * j));
                const int8x16_t w1 = vld1q_s8(reinterpret_cast<const int8_t*>(v + 32 * j + 16));
                for (int n = 0; n < N; ++n) neon::dot_lane_pair(p0[n], p1[n], w0, w1, j < 4 ? y0[n] : y1[n], j % 4);
            }
        } else {
            // Nibbles 0..15 are valid signed bytes: sdot takes them as they are.
            for (int j = 0; j < 4; ++j) {
                const uint8x16_t r0 = vld1q_u8(v + 32 * j), r1 = vld1q_u8(v + 32 * j + 16);
                const int8x16_t lo0 = vreinterpretq_s8_u8(vandq_u8(r0, low)), lo1 = vreinterpretq_s8_u8(vandq_u8(r1, low));
                const int8x16_t hi0 = vreinterpretq_s8_u8(vshrq_n_u8(r0, 4)), hi1 = vreinterpretq_s8_u8(vshrq_n_u8(r1, 4));
                for (int n = 0; n < N; ++n) {
                    neon::dot_lane_pair(p0[n], p1[n], lo0, lo1, y0[n], j);
                    neon::dot_lane_pair(p0[n], p1[n], hi0, hi1, y1[n], j);
                }
            }
        }
        const float32x4_t d0 = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(g))));
        const float32x4_t d1 = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(g + 8))));
        for (int n = 0; n < N; ++n) {
            const BlockQ8A& yb = y[n][b];
            float32x4_t f0 = vmulq_n_f32(vcvtq_f32_s32(p0[n]), yb.d), f1 = vmulq_n_f32(vcvtq_f32_s32(p1[n]), yb.d);
            if (t == DType::Q4_0) {  // w = d (n - 8): d * (dx * sum n q - 8 dx sum q)
                f0 = vsubq_f32(f0, vdupq_n_f32(8.f * yb.s));
                f1 = vsubq_f32(f1, vdupq_n_f32(8.f * yb.s));
            }
            acc0[n] = vfmaq_f32(acc0[n], d0, f0);
            acc1[n] = vfmaq_f32(acc1[n], d1, f1);
            if (t == DType::Q4_1) {
                acc0[n] = vfmaq_n_f32(acc0[n], vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(g + 16)))), yb.s);
                acc1[n] = vfmaq_n_f32(acc1[n], vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(g + 24)))), yb.s);
            }
        }
    }
    for (int n = 0; n < N; ++n) {
        vst1q_f32(out[n], acc0[n]);
        vst1q_f32(out[n] + 4, acc1[n]);
    }
}

}  // namespace

void matmul_neon_f32act(const MatmulArgs& a) {
    const uint8_t* base = static_cast<const uint8_t*>(a.w);
    const neon::FormatKernels* fk = neon::format_kernels(a.wtype);  // nullptr: the reference dequantizer
    for (int64_t r = a.row0; r < a.row1; ++r) {
        const uint8_t* row = base + static_cast<size_t>(r) * a.w_row_bytes;
        if (fk)
            fk->dequantize(row, a.scratch, a.k);
        else
            dequantize_row(a.wtype, row, a.scratch, a.k);
        for (int64_t t = 0; t < a.m; ++t) a.y[t * a.y_stride + r] = dot_neon(a.scratch, a.x + t * a.x_stride, a.k);
    }
}

void matmul_neon_q8act_dot(const MatmulArgs& a) {
    BlockQ8A* yq = reinterpret_cast<BlockQ8A*>(a.scratch);
    const int64_t nb = a.k / kQK;
    const uint8_t* base = static_cast<const uint8_t*>(a.w);
    const neon::FormatKernels* fk = neon::format_kernels(a.wtype);  // nullptr: Q4_0, Q4_1, Q8_0 (row_dot)
    for (int64_t t = 0; t < a.m; ++t) {
        quantize_act(a.x + t * a.x_stride, a.k, yq);
        for (int64_t r = a.row0; r < a.row1; ++r) {
            const uint8_t* row = base + static_cast<size_t>(r) * a.w_row_bytes;
            a.y[t * a.y_stride + r] = fk ? fk->dot(row, yq, nb) : row_dot(a.wtype, row, yq, nb);
        }
    }
}

// i8mm (FEAT_I8MM): smmla multiplies a 2 x 8 int8 matrix by an 8 x 2 one into a 2 x 2 int32 tile,
// 32 products per instruction against sdot's 16. Two weight rows (8 consecutive elements of each,
// from the file's rows) against two tokens' activations: per block of 32, 4 smmla per row pair
// and token pair, then one float FMA for the 2 x 2 scales d_row * d_token. With an odd token
// count the last token is paired with itself (half the products wasted), so it pays off from
// m = 2 on (several tokens at once); one token is the sdot kernels' job.
namespace {

struct RowPair {  // the file's rows r and r + 1 (r + 1 may repeat r at an odd end)
    const uint8_t* r0;
    const uint8_t* r1;
};

// Unpacked int8 weights of one block of one row: 32 values in two registers.
inline void block_q8(DType t, const uint8_t* blk, int8x16_t& lo, int8x16_t& hi) {
    if (t == DType::Q8_0) {
        lo = vld1q_s8(reinterpret_cast<const int8_t*>(blk + 2));
        hi = vld1q_s8(reinterpret_cast<const int8_t*>(blk + 18));
        return;
    }
    const uint8x16_t raw = vld1q_u8(blk + (t == DType::Q4_1 ? 4 : 2));
    lo = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0f)));  // elements 0..15
    hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));                // elements 16..31
    if (t == DType::Q4_0) {
        lo = vsubq_s8(lo, vdupq_n_s8(8));
        hi = vsubq_s8(hi, vdupq_n_s8(8));
    }
}

// out[0..3] = (row0, tok0), (row0, tok1), (row1, tok0), (row1, tok1).
__attribute__((target("arch=armv8.2-a+i8mm"))) void pair_dot(DType t, RowPair w, const BlockQ8A* y0, const BlockQ8A* y1,
                                                           int64_t nb, float* out) {
    const size_t bs = static_cast<size_t>(type_traits(t)->block_bytes);
    float32x4_t acc = vdupq_n_f32(0.f);
    float offs[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* b0 = w.r0 + static_cast<size_t>(b) * bs;
        const uint8_t* b1 = w.r1 + static_cast<size_t>(b) * bs;
        int8x16_t w0[2], w1[2];
        block_q8(t, b0, w0[0], w0[1]);
        block_q8(t, b1, w1[0], w1[1]);
        const int8x16_t x0[2] = {vld1q_s8(y0[b].qs), vld1q_s8(y0[b].qs + 16)};
        const int8x16_t x1[2] = {vld1q_s8(y1[b].qs), vld1q_s8(y1[b].qs + 16)};
        int32x4_t p = vdupq_n_s32(0);
        for (int h = 0; h < 2; ++h) {
            // 8-element pieces: (row0 | row1) x (tok0 | tok1), for elements 16h + 0..7 and 16h + 8..15.
            p = vmmlaq_s32(p, vcombine_s8(vget_low_s8(w0[h]), vget_low_s8(w1[h])),
                           vcombine_s8(vget_low_s8(x0[h]), vget_low_s8(x1[h])));
            p = vmmlaq_s32(p, vcombine_s8(vget_high_s8(w0[h]), vget_high_s8(w1[h])),
                           vcombine_s8(vget_high_s8(x0[h]), vget_high_s8(x1[h])));
        }
        const float d0 = fp16_to_fp32(load_u16(b0)), d1 = fp16_to_fp32(load_u16(b1));
        const float scale[4] = {d0 * y0[b].d, d0 * y1[b].d, d1 * y0[b].d, d1 * y1[b].d};
        acc = vfmaq_f32(acc, vcvtq_f32_s32(p), vld1q_f32(scale));
        if (t == DType::Q4_1) {
            const float m0 = fp16_to_fp32(load_u16(b0 + 2)), m1 = fp16_to_fp32(load_u16(b1 + 2));
            offs[0] += m0 * y0[b].s;
            offs[1] += m0 * y1[b].s;
            offs[2] += m1 * y0[b].s;
            offs[3] += m1 * y1[b].s;
        }
    }
    vst1q_f32(out, vaddq_f32(acc, vld1q_f32(offs)));
}

}  // namespace

// Rows in pairs, tokens in pairs; scratch holds the activation blocks of up to two tokens.
__attribute__((target("arch=armv8.2-a+i8mm"))) void matmul_neon_q8act_i8mm(const MatmulArgs& a) {
    const int64_t nb = a.k / kQK;
    BlockQ8A* yq0 = reinterpret_cast<BlockQ8A*>(a.scratch);
    BlockQ8A* yq1 = yq0 + nb;  // 2 x (k / 32) blocks of 40 bytes fit in the scratch's 5 x k floats
    const uint8_t* base = static_cast<const uint8_t*>(a.w);
    for (int64_t t = 0; t < a.m; t += 2) {
        const bool two = t + 1 < a.m;
        quantize_act(a.x + t * a.x_stride, a.k, yq0);
        if (two) quantize_act(a.x + (t + 1) * a.x_stride, a.k, yq1);
        const BlockQ8A* y1 = two ? yq1 : yq0;
        for (int64_t r = a.row0; r < a.row1; r += 2) {
            const bool pair = r + 1 < a.row1;
            const RowPair w{base + static_cast<size_t>(r) * a.w_row_bytes,
                            base + static_cast<size_t>(pair ? r + 1 : r) * a.w_row_bytes};
            float out[4];
            pair_dot(a.wtype, w, yq0, y1, nb, out);
            a.y[t * a.y_stride + r] = out[0];
            if (two) a.y[(t + 1) * a.y_stride + r] = out[1];
            if (pair) {
                a.y[t * a.y_stride + r + 1] = out[2];
                if (two) a.y[(t + 1) * a.y_stride + r + 1] = out[3];
            }
        }
    }
}

namespace {

// Tokens t0 .. t0 + N - 1 (their blocks at yq + n * nb) against the groups of the row range.
template <int N>
__attribute__((target("arch=armv8.2-a+dotprod"))) void x8_tokens(const MatmulArgs& a, const BlockQ8A* yq, int64_t t0) {
    const int64_t nb = a.k / kQK;
    const size_t group_bytes = static_cast<size_t>(nb) * x8_block_bytes(a.wtype);
    const uint8_t* base = static_cast<const uint8_t*>(a.w);
    const int64_t g0 = a.row0 / kPackRows, g1 = (a.row1 + kPackRows - 1) / kPackRows;
    const BlockQ8A* ys[N];
    float out[N][kPackRows];
    float* outs[N];
    for (int n = 0; n < N; ++n) {
        ys[n] = yq + n * nb;
        outs[n] = out[n];
    }
    for (int64_t g = g0; g < g1; ++g) {
        x8_group<N>(a.wtype, base + static_cast<size_t>(g) * group_bytes, ys, nb, outs);
        const int64_t r0 = std::max(a.row0, g * kPackRows), r1 = std::min(a.row1, (g + 1) * kPackRows);
        for (int n = 0; n < N; ++n)
            for (int64_t r = r0; r < r1; ++r) a.y[(t0 + n) * a.y_stride + r] = out[n][r - g * kPackRows];
    }
}

}  // namespace

// a.w is the x8-packed weight (packed_x8.h). Tokens in passes of up to 4 (what the 32 vector
// registers hold: per token two activation vectors, two int and two float accumulators).
__attribute__((target("arch=armv8.2-a+dotprod"))) void matmul_neon_q8act_dot_x8(const MatmulArgs& a) {
    constexpr int kPass = 4;
    static_assert(kPass * sizeof(BlockQ8A) <= kMatmulScratchRows * kQK * sizeof(float), "the scratch holds a pass's blocks");
    BlockQ8A* yq = reinterpret_cast<BlockQ8A*>(a.scratch);
    const int64_t nb = a.k / kQK;
    for (int64_t t = 0; t < a.m;) {
        const int n = static_cast<int>(std::min<int64_t>(kPass, a.m - t));
        for (int i = 0; i < n; ++i) quantize_act(a.x + (t + i) * a.x_stride, a.k, yq + i * nb);
        switch (n) {
        case 1: x8_tokens<1>(a, yq, t); break;
        case 2: x8_tokens<2>(a, yq, t); break;
        case 3: x8_tokens<3>(a, yq, t); break;
        default: x8_tokens<4>(a, yq, t); break;
        }
        t += n;
    }
}

}  // namespace evk
#endif
