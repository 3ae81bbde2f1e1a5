// The K-quants: 256-element super-blocks of 16 or 32-element sub-blocks, each sub-block with a small
// integer scale (and, for Q2_K / Q4_K / Q5_K, a min) relative to the super-block's fp16 d (and dmin).
// Layouts are ggml's (ggml-common.h); the element order of each is written out beside its decoder.
//
// Dequantizers compute in float32 in the order the gguf package does (sub-block scale first:
// dl = d * sc, then dl * q - dmin * m), so the output is bit-identical to gguf.quants.dequantize.
// Each product is its own statement: a compiler allowed to contract a*b - c into a fused
// multiply-add within one expression (clang's default) would round once instead of twice.
//
// Quantizers are ours: per sub-block a small search over candidate steps, each refined by least
// squares (fit_affine / fit_symmetric), then the sub-block scales are themselves quantized
// against the super-block's d, and every element is re-quantized with the scale it will be
// decoded with. Not bit-identical to llama.cpp's quantizer; test_formats.py bounds the error.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "formats.h"

namespace evk {

namespace {

// Clamped nearest integer of v in [lo, hi] (lo >= -256; halves round up); a NaN gives lo, never a
// float-to-int overflow. floor(c + 0.5) as the truncation of a positive number: no libm call.
int nearest(float v, int lo, int hi) {
    const float c = std::fmin(std::fmax(v, static_cast<float>(lo)), static_cast<float>(hi));
    return static_cast<int>(c + 256.5f) - 256;
}

// Scale s >= 0 and min m >= 0 with x[i] ~ s * q[i] - m, q[i] in [0, qmax]: the data's range
// [min(x, 0), max(x)] divided into qmax steps, then shrunk a little at a time (clipping the tails
// can pay for a finer step); each candidate's assignment is refit by least squares (the 2x2
// normal equations of s and b = -m, with b held <= 0), reassigned once, and the one of smallest
// squared error kept. m >= 0 because the stored min is unsigned: the range always covers 0.
void fit_affine(const float* x, int n, int qmax, float* scale, float* min) {
    float lo = 0.f, hi = 0.f;
    for (int i = 0; i < n; ++i) {
        lo = std::fmin(lo, x[i]);
        hi = std::fmax(hi, x[i]);
    }
    *scale = 0.f;
    *min = -lo;
    if (!(hi > lo)) return;  // all zero (or NaN): q = 0 decodes to -m
    float best = INFINITY;
    for (int k = 0; k < 12; ++k) {
        float s = (hi - lo) / (static_cast<float>(qmax) + 0.25f * static_cast<float>(k));
        float b = lo;
        for (int it = 0; it < 2; ++it) {
            const float is = 1.f / s;
            double sq = 0, sx = 0, sqq = 0, sqx = 0;
            for (int i = 0; i < n; ++i) {
                const double q = nearest((x[i] - b) * is, 0, qmax);
                sq += q, sx += x[i], sqq += q * q, sqx += q * x[i];
            }
            const double det = n * sqq - sq * sq;
            if (det <= 0) break;
            double ns = (n * sqx - sq * sx) / det;
            double nb = (sx - ns * sq) / n;
            if (nb > 0) {  // the min must stay <= 0: fit s alone with b = 0
                nb = 0;
                ns = sqx / sqq;
            }
            if (!(ns > 0)) break;
            s = static_cast<float>(ns);
            b = static_cast<float>(nb);
        }
        double err = 0;
        const float is = 1.f / s;
        for (int i = 0; i < n; ++i) {
            const float e = s * static_cast<float>(nearest((x[i] - b) * is, 0, qmax)) + b - x[i];
            err += static_cast<double>(e) * e;
        }
        if (err < best) {
            best = static_cast<float>(err);
            *scale = s;
            *min = -b;
        }
    }
}

// Signed scale s with x[i] ~ s * q[i], q[i] in [-qneg, qneg - 1]: the value of largest magnitude
// mapped to -qneg (the side with one more level), the step then varied a few percent either way,
// each candidate refit by least squares (s = sum q x / sum q q) and the one of smallest error kept.
float fit_symmetric(const float* x, int n, int qneg) {
    float amax = 0.f, vmax = 0.f;
    for (int i = 0; i < n; ++i)
        if (std::fabs(x[i]) > amax) {
            amax = std::fabs(x[i]);
            vmax = x[i];
        }
    if (!(amax > 0.f)) return 0.f;
    float best = INFINITY, best_s = vmax / static_cast<float>(-qneg);
    for (int k = -4; k <= 8; ++k) {
        float s = vmax / (static_cast<float>(-qneg) - 0.125f * static_cast<float>(k));
        const float is0 = 1.f / s;
        double sqq = 0, sqx = 0;
        for (int i = 0; i < n; ++i) {
            const double q = nearest(x[i] * is0, -qneg, qneg - 1);
            sqq += q * q, sqx += q * x[i];
        }
        if (sqq > 0) s = static_cast<float>(sqx / sqq);
        if (!(std::fabs(s) > 0.f)) continue;
        double err = 0;
        const float is = 1.f / s;
        for (int i = 0; i < n; ++i) {
            const float e = s * static_cast<float>(nearest(x[i] * is, -qneg, qneg - 1)) - x[i];
            err += static_cast<double>(e) * e;
        }
        if (err < best) {
            best = static_cast<float>(err);
            best_s = s;
        }
    }
    return best_s;
}

// Sub-block scales s[j] >= 0 as integers in [0, qmax] against a super-block scale d (fp16 bits
// written to *d_bits): d = max s / qmax rounded to fp16, each s[j] rounded against that d.
void quantize_scales(const float* s, int n, int qmax, uint16_t* d_bits, int* q) {
    float smax = 0.f;
    for (int j = 0; j < n; ++j) smax = std::fmax(smax, s[j]);
    *d_bits = fp32_to_fp16(smax / static_cast<float>(qmax));
    const float d = fp16_to_fp32(*d_bits);
    for (int j = 0; j < n; ++j) q[j] = d > 0.f ? nearest(s[j] / d, 0, qmax) : 0;
}

// Signed sub-block scales as integers in [-qneg, qneg - 1]: the scale of largest magnitude maps to
// -qneg (its sign taken by d), the others rounded against d.
void quantize_signed_scales(const float* s, int n, int qneg, uint16_t* d_bits, int* q) {
    float amax = 0.f, vmax = 0.f;
    for (int j = 0; j < n; ++j)
        if (std::fabs(s[j]) > amax) {
            amax = std::fabs(s[j]);
            vmax = s[j];
        }
    *d_bits = fp32_to_fp16(vmax / static_cast<float>(-qneg));
    const float d = fp16_to_fp32(*d_bits);
    for (int j = 0; j < n; ++j) q[j] = std::fabs(d) > 0.f ? nearest(s[j] / d, -qneg, qneg - 1) : 0;
}

// Affine super-block (Q2_K, Q4_K, Q5_K): n_sub sub-blocks of `sub` elements, q in [0, qmax],
// scales and mins as integers in [0, smax]. Writes the final q of every element (the scale it is
// decoded with: d * sc - dmin * m), the integer scales and mins, and d / dmin's fp16 bits.
void quantize_affine_superblock(const float* x, int n_sub, int sub, int qmax, int smax, uint8_t* q, int* sc, int* mn,
                                uint16_t* d_bits, uint16_t* dmin_bits) {
    float s[16], m[16];
    for (int j = 0; j < n_sub; ++j) fit_affine(x + j * sub, sub, qmax, &s[j], &m[j]);
    quantize_scales(s, n_sub, smax, d_bits, sc);
    quantize_scales(m, n_sub, smax, dmin_bits, mn);
    const float d = fp16_to_fp32(*d_bits), dmin = fp16_to_fp32(*dmin_bits);
    for (int j = 0; j < n_sub; ++j) {
        const float dl = d * static_cast<float>(sc[j]), ml = dmin * static_cast<float>(mn[j]);
        for (int i = 0; i < sub; ++i)
            q[j * sub + i] = static_cast<uint8_t>(dl > 0.f ? nearest((x[j * sub + i] + ml) / dl, 0, qmax) : 0);
    }
}

// Symmetric super-block (Q3_K, Q6_K): 16 sub-blocks of 16, q in [-qneg, qneg - 1], signed integer
// scales in [-sneg, sneg - 1]. Writes q + qneg (unsigned) for every element.
void quantize_symmetric_superblock(const float* x, int qneg, int sneg, uint8_t* q, int* sc, uint16_t* d_bits) {
    float s[16];
    for (int j = 0; j < 16; ++j) s[j] = fit_symmetric(x + 16 * j, 16, qneg);
    quantize_signed_scales(s, 16, sneg, d_bits, sc);
    const float d = fp16_to_fp32(*d_bits);
    for (int j = 0; j < 16; ++j) {
        const float dl = d * static_cast<float>(sc[j]);
        for (int i = 0; i < 16; ++i) {
            const int v = std::fabs(dl) > 0.f ? nearest(x[16 * j + i] / dl, -qneg, qneg - 1) : 0;
            q[16 * j + i] = static_cast<uint8_t>(v + qneg);
        }
    }
}

// Q4_K / Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins. Bytes 0-3: scales 0-3 in the
// low 6 bits, the top 2 bits of scales 4-7 above them; bytes 4-7 the same for the mins; bytes 8-11:
// the low 4 bits of scale j + 4 and of min j + 4 (low, high nibble).
void scale_min_k4(const uint8_t* p, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = p[j] & 63;
        *m = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 0xf) | ((p[j - 4] >> 6) << 4);
        *m = (p[j + 4] >> 4) | ((p[j] >> 6) << 4);
    }
}

void pack_scale_min_k4(const int* sc, const int* m, uint8_t* p) {
    for (int j = 0; j < 4; ++j) {
        p[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
        p[j + 4] = static_cast<uint8_t>(m[j] | ((m[j + 4] >> 4) << 6));
        p[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xf) | ((m[j + 4] & 0xf) << 4));
    }
}

// Q3_K's 12 bytes of sixteen 6-bit scales stored as scale + 32: scale k's low 4 bits are the low
// nibble of byte k (k < 8) or the high nibble of byte k - 8; its top 2 bits are bits 2 (k / 4) of
// byte 8 + k % 4.
int scale_k3(const uint8_t* p, int k) {
    const int lo = k < 8 ? (p[k] & 0xf) : (p[k - 8] >> 4);
    const int hi = (p[8 + k % 4] >> (2 * (k / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

void pack_scales_k3(const int* sc, uint8_t* p) {
    std::memset(p, 0, 12);
    for (int k = 0; k < 16; ++k) {
        const int v = sc[k] + 32;
        p[k % 8] |= static_cast<uint8_t>((v & 0xf) << (k < 8 ? 0 : 4));
        p[8 + k % 4] |= static_cast<uint8_t>((v >> 4) << (2 * (k / 4)));
    }
}

}  // namespace

// Q2_K: element e = 128 h + 32 t + l (h < 2, t < 4, l < 32) is bits 2t of qs[32 h + l]; its sub-block
// of 16 is e / 16, whose byte scales[e / 16] holds the scale (low nibble) and min (high nibble).
void int_view_row_kquant(DType t, const void* src, int64_t n, uint8_t* q, float* scale, float* offset) {
    const TypeTraits* tt = type_traits(t);
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, q += kQK_K, blk += tt->block_bytes) {
        switch (t) {
        case DType::Q2_K: {
            const float d = fp16_to_fp32(load_u16(blk + offsetof(BlockQ2_K, d)));
            const float dmin = fp16_to_fp32(load_u16(blk + offsetof(BlockQ2_K, dmin)));
            const uint8_t* scales = blk + offsetof(BlockQ2_K, scales);
            const uint8_t* qs = blk + offsetof(BlockQ2_K, qs);
            for (int e = 0; e < kQK_K; ++e) q[e] = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            for (int j = 0; j < 16; ++j) {
                scale[16 * ib + j] = d * static_cast<float>(scales[j] & 0xf);
                offset[16 * ib + j] = dmin * static_cast<float>(scales[j] >> 4);
            }
            break;
        }
        case DType::Q3_K: {
            const float d = fp16_to_fp32(load_u16(blk + offsetof(BlockQ3_K, d)));
            const uint8_t* hmask = blk + offsetof(BlockQ3_K, hmask);
            const uint8_t* qs = blk + offsetof(BlockQ3_K, qs);
            for (int e = 0; e < kQK_K; ++e)  // low - 4 (1 - high) + 4
                q[e] = static_cast<uint8_t>(((qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3) |
                                            (((hmask[e % 32] >> (e / 32)) & 1) << 2));
            for (int j = 0; j < 16; ++j) {
                const float dl = d * static_cast<float>(scale_k3(blk + offsetof(BlockQ3_K, scales), j));
                scale[16 * ib + j] = dl;
                offset[16 * ib + j] = 4.f * dl;
            }
            break;
        }
        case DType::Q4_K: case DType::Q5_K: {
            const bool five = t == DType::Q5_K;
            const float d = fp16_to_fp32(load_u16(blk));
            const float dmin = fp16_to_fp32(load_u16(blk + 2));
            const uint8_t* scales = blk + 4;
            const uint8_t* qh = five ? blk + offsetof(BlockQ5_K, qh) : nullptr;
            const uint8_t* qs = blk + (five ? offsetof(BlockQ5_K, qs) : offsetof(BlockQ4_K, qs));
            for (int j = 0; j < 8; ++j) {
                int sc, m;
                scale_min_k4(scales, j, &sc, &m);
                scale[8 * ib + j] = d * static_cast<float>(sc);
                offset[8 * ib + j] = dmin * static_cast<float>(m);
                for (int l = 0; l < 32; ++l)
                    q[32 * j + l] = static_cast<uint8_t>(((qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xf) |
                                                         (five ? ((qh[l] >> j) & 1) << 4 : 0));
            }
            break;
        }
        case DType::Q6_K: {
            const float d = fp16_to_fp32(load_u16(blk + offsetof(BlockQ6_K, d)));
            const uint8_t* ql = blk + offsetof(BlockQ6_K, ql);
            const uint8_t* qh = blk + offsetof(BlockQ6_K, qh);
            const int8_t* scales = reinterpret_cast<const int8_t*>(blk + offsetof(BlockQ6_K, scales));
            for (int e = 0; e < kQK_K; ++e) {
                const int h = e / 128, r = e % 128;
                q[e] = static_cast<uint8_t>(((ql[64 * h + r % 64] >> (4 * (r / 64))) & 0xf) |
                                            (((qh[32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4));
            }
            for (int j = 0; j < 16; ++j) {
                const float dl = d * static_cast<float>(scales[j]);
                scale[16 * ib + j] = dl;
                offset[16 * ib + j] = 32.f * dl;
            }
            break;
        }
        default:
            std::memset(q, 0, kQK_K);
        }
    }
}

void dequantize_row_q2_k(const void* src, float* dst, int64_t n) {
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, dst += kQK_K, blk += sizeof(BlockQ2_K)) {
        const float d = fp16_to_fp32(load_u16(blk + offsetof(BlockQ2_K, d)));
        const float dmin = fp16_to_fp32(load_u16(blk + offsetof(BlockQ2_K, dmin)));
        const uint8_t* scales = blk + offsetof(BlockQ2_K, scales);
        const uint8_t* qs = blk + offsetof(BlockQ2_K, qs);
        for (int e = 0; e < kQK_K; ++e) {
            const float dl = d * static_cast<float>(scales[e / 16] & 0xf);
            const float ml = dmin * static_cast<float>(scales[e / 16] >> 4);
            const int q = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            const float p = dl * static_cast<float>(q);
            dst[e] = p - ml;
        }
    }
}

void quantize_row_q2_k(const float* x, void* dst, int64_t n) {
    uint8_t* blk = static_cast<uint8_t*>(dst);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, x += kQK_K, blk += sizeof(BlockQ2_K)) {
        uint8_t q[kQK_K];
        int sc[16], mn[16];
        uint16_t d, dmin;
        quantize_affine_superblock(x, 16, 16, 3, 15, q, sc, mn, &d, &dmin);
        uint8_t* scales = blk + offsetof(BlockQ2_K, scales);
        for (int j = 0; j < 16; ++j) scales[j] = static_cast<uint8_t>(sc[j] | (mn[j] << 4));
        uint8_t* qs = blk + offsetof(BlockQ2_K, qs);
        std::memset(qs, 0, kQK_K / 4);
        for (int e = 0; e < kQK_K; ++e) qs[32 * (e / 128) + e % 32] |= static_cast<uint8_t>(q[e] << (2 * ((e % 128) / 32)));
        store_u16(blk + offsetof(BlockQ2_K, d), d);
        store_u16(blk + offsetof(BlockQ2_K, dmin), dmin);
    }
}

// Q3_K: element e = 128 h + 32 t + l has low bits (qs[32 h + l] >> 2t) & 3 and high bit
// (hmask[e % 32] >> e / 32) & 1; a clear high bit means the value is 4 lower: q = low - 4 (1 - high),
// in [-4, 3]. Scale of sub-block e / 16 from scale_k3.
void dequantize_row_q3_k(const void* src, float* dst, int64_t n) {
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, dst += kQK_K, blk += sizeof(BlockQ3_K)) {
        const float d = fp16_to_fp32(load_u16(blk + offsetof(BlockQ3_K, d)));
        const uint8_t* hmask = blk + offsetof(BlockQ3_K, hmask);
        const uint8_t* qs = blk + offsetof(BlockQ3_K, qs);
        const uint8_t* scales = blk + offsetof(BlockQ3_K, scales);
        for (int j = 0; j < 16; ++j) {
            const float dl = d * static_cast<float>(scale_k3(scales, j));
            for (int e = 16 * j; e < 16 * j + 16; ++e) {
                const int low = (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
                const int high = (hmask[e % 32] >> (e / 32)) & 1;
                dst[e] = dl * static_cast<float>(low - 4 * (1 - high));
            }
        }
    }
}

void quantize_row_q3_k(const float* x, void* dst, int64_t n) {
    uint8_t* blk = static_cast<uint8_t*>(dst);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, x += kQK_K, blk += sizeof(BlockQ3_K)) {
        uint8_t q[kQK_K];  // q + 4, in [0, 7]
        int sc[16];
        uint16_t d;
        quantize_symmetric_superblock(x, 4, 32, q, sc, &d);
        uint8_t* hmask = blk + offsetof(BlockQ3_K, hmask);
        uint8_t* qs = blk + offsetof(BlockQ3_K, qs);
        std::memset(hmask, 0, kQK_K / 8);
        std::memset(qs, 0, kQK_K / 4);
        for (int e = 0; e < kQK_K; ++e) {
            qs[32 * (e / 128) + e % 32] |= static_cast<uint8_t>((q[e] & 3) << (2 * ((e % 128) / 32)));
            hmask[e % 32] |= static_cast<uint8_t>((q[e] >> 2) << (e / 32));
        }
        pack_scales_k3(sc, blk + offsetof(BlockQ3_K, scales));
        store_u16(blk + offsetof(BlockQ3_K, d), d);
    }
}

// Q4_K: eight sub-blocks of 32; sub-block j's element l is the low (j even) or high (j odd) nibble
// of qs[32 (j / 2) + l]; x = d * sc_j * q - dmin * m_j.
void dequantize_row_q4_k(const void* src, float* dst, int64_t n) {
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, dst += kQK_K, blk += sizeof(BlockQ4_K)) {
        const float d = fp16_to_fp32(load_u16(blk + offsetof(BlockQ4_K, d)));
        const float dmin = fp16_to_fp32(load_u16(blk + offsetof(BlockQ4_K, dmin)));
        const uint8_t* scales = blk + offsetof(BlockQ4_K, scales);
        const uint8_t* qs = blk + offsetof(BlockQ4_K, qs);
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            scale_min_k4(scales, j, &sc, &m);
            const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
            for (int l = 0; l < 32; ++l) {
                const float p = dl * static_cast<float>((qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xf);
                dst[32 * j + l] = p - ml;
            }
        }
    }
}

void quantize_row_q4_k(const float* x, void* dst, int64_t n) {
    uint8_t* blk = static_cast<uint8_t*>(dst);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, x += kQK_K, blk += sizeof(BlockQ4_K)) {
        uint8_t q[kQK_K];
        int sc[8], mn[8];
        uint16_t d, dmin;
        quantize_affine_superblock(x, 8, 32, 15, 63, q, sc, mn, &d, &dmin);
        pack_scale_min_k4(sc, mn, blk + offsetof(BlockQ4_K, scales));
        uint8_t* qs = blk + offsetof(BlockQ4_K, qs);
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) qs[32 * c + l] = static_cast<uint8_t>(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
        store_u16(blk + offsetof(BlockQ4_K, d), d);
        store_u16(blk + offsetof(BlockQ4_K, dmin), dmin);
    }
}

// Q5_K: Q4_K's nibbles plus a fifth bit, bit j of qh[l] for sub-block j's element l.
void dequantize_row_q5_k(const void* src, float* dst, int64_t n) {
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, dst += kQK_K, blk += sizeof(BlockQ5_K)) {
        const float d = fp16_to_fp32(load_u16(blk + offsetof(BlockQ5_K, d)));
        const float dmin = fp16_to_fp32(load_u16(blk + offsetof(BlockQ5_K, dmin)));
        const uint8_t* scales = blk + offsetof(BlockQ5_K, scales);
        const uint8_t* qh = blk + offsetof(BlockQ5_K, qh);
        const uint8_t* qs = blk + offsetof(BlockQ5_K, qs);
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            scale_min_k4(scales, j, &sc, &m);
            const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
            for (int l = 0; l < 32; ++l) {
                const int q = ((qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xf) | (((qh[l] >> j) & 1) << 4);
                const float p = dl * static_cast<float>(q);
                dst[32 * j + l] = p - ml;
            }
        }
    }
}

void quantize_row_q5_k(const float* x, void* dst, int64_t n) {
    uint8_t* blk = static_cast<uint8_t*>(dst);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, x += kQK_K, blk += sizeof(BlockQ5_K)) {
        uint8_t q[kQK_K];
        int sc[8], mn[8];
        uint16_t d, dmin;
        quantize_affine_superblock(x, 8, 32, 31, 63, q, sc, mn, &d, &dmin);
        pack_scale_min_k4(sc, mn, blk + offsetof(BlockQ5_K, scales));
        uint8_t* qh = blk + offsetof(BlockQ5_K, qh);
        uint8_t* qs = blk + offsetof(BlockQ5_K, qs);
        std::memset(qh, 0, kQK_K / 8);
        for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l)
                qs[32 * c + l] = static_cast<uint8_t>((q[64 * c + l] & 0xf) | ((q[64 * c + 32 + l] & 0xf) << 4));
        for (int j = 0; j < 8; ++j)
            for (int l = 0; l < 32; ++l) qh[l] |= static_cast<uint8_t>((q[32 * j + l] >> 4) << j);
        store_u16(blk + offsetof(BlockQ5_K, d), d);
        store_u16(blk + offsetof(BlockQ5_K, dmin), dmin);
    }
}

// Q6_K: element e = 128 h + r (h < 2, r < 128) has its low 4 bits in ql[64 h + r % 64] (low nibble
// for r < 64, high for r >= 64) and its top 2 bits at bits 2 (r / 32) of qh[32 h + r % 32];
// q = that - 32, in [-32, 31]; x = d * scales[e / 16] * q with int8 sub-block scales.
void dequantize_row_q6_k(const void* src, float* dst, int64_t n) {
    const uint8_t* blk = static_cast<const uint8_t*>(src);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, dst += kQK_K, blk += sizeof(BlockQ6_K)) {
        const float d = fp16_to_fp32(load_u16(blk + offsetof(BlockQ6_K, d)));
        const uint8_t* ql = blk + offsetof(BlockQ6_K, ql);
        const uint8_t* qh = blk + offsetof(BlockQ6_K, qh);
        const int8_t* scales = reinterpret_cast<const int8_t*>(blk + offsetof(BlockQ6_K, scales));
        for (int j = 0; j < 16; ++j) {
            const float dl = d * static_cast<float>(scales[j]);
            for (int e = 16 * j; e < 16 * j + 16; ++e) {
                const int h = e / 128, r = e % 128;
                const int low = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0xf;
                const int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
                dst[e] = dl * static_cast<float>((low | (high << 4)) - 32);
            }
        }
    }
}

void quantize_row_q6_k(const float* x, void* dst, int64_t n) {
    uint8_t* blk = static_cast<uint8_t*>(dst);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, x += kQK_K, blk += sizeof(BlockQ6_K)) {
        uint8_t q[kQK_K];  // q + 32, in [0, 63]
        int sc[16];
        uint16_t d;
        quantize_symmetric_superblock(x, 32, 128, q, sc, &d);
        uint8_t* ql = blk + offsetof(BlockQ6_K, ql);
        uint8_t* qh = blk + offsetof(BlockQ6_K, qh);
        std::memset(ql, 0, kQK_K / 2);
        std::memset(qh, 0, kQK_K / 4);
        for (int e = 0; e < kQK_K; ++e) {
            const int h = e / 128, r = e % 128;
            ql[64 * h + r % 64] |= static_cast<uint8_t>((q[e] & 0xf) << (4 * (r / 64)));
            qh[32 * h + r % 32] |= static_cast<uint8_t>((q[e] >> 4) << (2 * (r / 32)));
        }
        int8_t* scales = reinterpret_cast<int8_t*>(blk + offsetof(BlockQ6_K, scales));
        for (int j = 0; j < 16; ++j) scales[j] = static_cast<int8_t>(sc[j]);
        store_u16(blk + offsetof(BlockQ6_K, d), d);
    }
}

// Q8_K, the activation side of K-quant dot products: a float32 d, q = round(x / d) with the value of
// largest magnitude at +-127, and bsums[j] = the sum of q over elements 16 j .. 16 j + 15.
void quantize_row_q8_k(const float* x, void* dst, int64_t n) {
    uint8_t* blk = static_cast<uint8_t*>(dst);
    for (int64_t ib = 0; ib < n / kQK_K; ++ib, x += kQK_K, blk += sizeof(BlockQ8_K)) {
        float amax = 0.f;
        for (int i = 0; i < kQK_K; ++i) amax = std::fmax(amax, std::fabs(x[i]));
        const float d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        int8_t* qs = reinterpret_cast<int8_t*>(blk + offsetof(BlockQ8_K, qs));
        for (int i = 0; i < kQK_K; ++i) qs[i] = static_cast<int8_t>(nearest(x[i] * id, -127, 127));
        for (int j = 0; j < kQK_K / 16; ++j) {
            int s = 0;
            for (int i = 0; i < 16; ++i) s += qs[16 * j + i];
            const int16_t s16 = static_cast<int16_t>(s);
            std::memcpy(blk + offsetof(BlockQ8_K, bsums) + 2 * j, &s16, 2);
        }
        std::memcpy(blk + offsetof(BlockQ8_K, d), &d, 4);
    }
}

}  // namespace evk
