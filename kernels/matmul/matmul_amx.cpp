// AMX matrix product for many tokens (prompt prefill, the vision tower): Intel's tile unit, bf16
// products accumulated in fp32. Notes and measurements: docs/kernels/prefill-gemm-amx.md.
//
// Precision: bf16 keeps 8 significant bits, so each float is split in two bf16 numbers,
// v ~ hi + lo (hi: v rounded to bf16; lo: the rest, v - hi, rounded to bf16: |v - hi - lo| <=
// 2^-16 |v|), and a product is w*x ~ w_hi*x_hi + w_lo*x_hi + w_hi*x_lo: three tile products
// instead of one, the w_lo*x_lo term (<= 2^-16 |w x|) dropped. For F16 and BF16 weights hi + lo is
// w exactly. So each term is within 3 * 2^-16 (4.6e-5) of w*x (2 * 2^-16 for F16/BF16 weights),
// and an output within that of sum_k |w x| plus the float sum's rounding (the float kernels'
// bound is 1e-5 of it; measured here: at most ~1e-5 too, the errors being of both signs). The
// activations are never rounded to bf16 alone.
//
// Layout of one call. The caller converts the activations once per product (ActPrep "bf16x2"):
// each token a row of [hi of k elements | lo of k elements], k padded to a multiple of 32, tokens
// to a multiple of 16 (zeros). Those rows are the A tiles as they lie (16 tokens x 32 bf16 of k).
// Weights: a panel of 2 groups of 16 rows and a block of 256 elements of k is expanded to float by
// the AVX-512 GEMM's panel fill (any format and layout: avx512_panel.h), 32 elements of k at a
// time, then split into B tiles in the tile unit's pair layout (tile row kp holds, for each of the
// 16 rows, elements 2kp and 2kp+1 side by side): 8 steps x 2 groups x (hi, lo) = 32 KiB, in L1.
// Four C tiles (2 x 16 tokens x 2 x 16 rows) accumulate in the tile registers over a k block;
// between blocks the partial sums live in y (or, at a partial edge, a 16 x 16 scratch tile).
//
// Every output is the same sequence of tile products over k = 0, 32, 64, ... whatever tile, row
// range, token block or thread computed it: results are bit-identical across thread counts and
// prompt pieces, as with the other GEMMs.
#if defined(__x86_64__)
#include "avx512_panel.h"

#define EV_AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,fma,f16c")))
#define EV_AMX_INLINE __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl,fma,f16c"), always_inline)) inline

namespace evk {

namespace {

using namespace avx512;

constexpr int64_t kStep = 32;                  // elements of k per tile row (32 bf16 = 64 bytes)
constexpr int64_t kKcAmx = 256;                // elements of k per block
constexpr int64_t kStepsPerBlock = kKcAmx / kStep;
constexpr int kGroups = 2;                     // groups of 16 rows per panel
constexpr int64_t kTileBytes = 1024;           // 16 x 64 bytes
constexpr int64_t kStepBytes = kGroups * 2 * kTileBytes;  // a step's B tiles: per group hi, lo
constexpr int64_t kRowPad = 64;                // bytes after each prepared token row: rows 4 KiB apart would share L1 sets

int64_t k_padded(int64_t k) { return (k + kStep - 1) / kStep * kStep; }

size_t bf16x2_row_bytes(int64_t k) { return static_cast<size_t>(4 * k_padded(k) + kRowPad); }

// The first n lanes (n may be <= 0 or > 16).
EV_AMX inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xffff) : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1u);
}

EV_AMX inline __m512i as_words(__m512bh v) {
    __m512i r;
    std::memcpy(&r, &v, sizeof r);
    return r;
}

// (hi, lo) bf16 halves of a and b, packed as 32 words: a's 16 then b's 16. hi is v rounded to
// bf16 (to nearest even), lo = v - hi (exact in float: at most 2^-8 |v|) rounded to bf16.
EV_AMX inline void split(__m512 a, __m512 b, __m512i& hi, __m512i& lo) {
    hi = as_words(_mm512_cvtne2ps_pbh(b, a));
    const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
    const __m512 hb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16));
    lo = as_words(_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha)));
}

EV_AMX void bf16x2_prep(const float* x, int64_t x_stride, int64_t m, int64_t k, int64_t t0, int64_t t1, void* dst) {
    const int64_t kp = k_padded(k);
    const size_t rb = bf16x2_row_bytes(k);
    for (int64_t t = t0; t < t1; ++t) {
        uint8_t* row = static_cast<uint8_t*>(dst) + static_cast<size_t>(t) * rb;
        const float* xr = x + t * x_stride;
        for (int64_t kk = 0; kk < kp; kk += kStep) {
            const __m512 a = t < m ? _mm512_maskz_loadu_ps(first_lanes(k - kk), xr + kk) : _mm512_setzero_ps();
            const __m512 b = t < m ? _mm512_maskz_loadu_ps(first_lanes(k - kk - 16), xr + kk + 16) : _mm512_setzero_ps();
            __m512i hi, lo;
            split(a, b, hi, lo);
            _mm512_storeu_si512(row + 2 * kk, hi);
            _mm512_storeu_si512(row + 2 * (kp + kk), lo);
        }
    }
}

// B tiles of one k block: for each step of 32 elements, the panel (nrows <= 32 rows) is expanded to
// float, then each group's pairs of k become one tile row of (hi) and one of (lo).
EV_AMX void fill_b(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, uint8_t* b) {
    alignas(64) float panel[kStep * 16 * kGroups];
    const int nv = (nrows + 15) / 16, stride = 16 * nv;
    // word i of the split's halves (a's 16, b's 16) to the pair layout: (a0 b0 a1 b1 ...)
    const __m512i inter = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
                                           19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t s = 0; s * kStep < kc; ++s) {
        const int64_t kk0 = k0 + s * kStep, n = kc - s * kStep < kStep ? kc - s * kStep : kStep;
        if (n < kStep) std::memset(panel, 0, sizeof panel);
        fill_panel(a, r0, nrows, kk0, n, panel);
        for (int v = 0; v < nv; ++v) {
            uint8_t* hi_tile = b + s * kStepBytes + v * 2 * kTileBytes;
            for (int kp = 0; kp < 16; ++kp) {
                __m512i hi, lo;
                split(_mm512_load_ps(panel + (2 * kp) * stride + 16 * v), _mm512_load_ps(panel + (2 * kp + 1) * stride + 16 * v), hi, lo);
                _mm512_store_si512(hi_tile + kp * 64, _mm512_permutexvar_epi16(inter, hi));
                _mm512_store_si512(hi_tile + kTileBytes + kp * 64, _mm512_permutexvar_epi16(inter, lo));
            }
        }
    }
}

// The same B tiles for a weight the x8 fill reads (Q4_K, Q6_K, Q5_0 in the x8 copy: x8k_direct),
// made in pair order (avx512_panel_x8k.h): each pair of vectors is split straight into its tile
// rows, with no word permute. The same values and the same split: the same bits as fill_b.
struct PairSink {
    float* buf;  // 16 pairs of 2 x 16 floats
    EV_AVX512 void put_pair(int kp, __m512 a, __m512 b) {
        _mm512_store_ps(buf + 32 * kp, a);
        _mm512_store_ps(buf + 32 * kp + 16, b);
    }
};

template <DType T>
EV_AMX void fill_b_x8k(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, uint8_t* b) {
    alignas(64) float pairs[16 * 32];
    const int nv = (nrows + 15) / 16;
    for (int v = 0; v < nv; ++v) {
        const X8Rows g(r0 + 16 * v, nrows - 16 * v < 16 ? nrows - 16 * v : 16);
        for (int64_t s = 0; s * kStep < kc; ++s) {
            PairSink sink{pairs};
            x8k_block<T, Order::kPairs>(static_cast<const uint8_t*>(a.w), a.k, g.g0, g.g1, (k0 + s * kStep) / kQK, g.live, sink);
            uint8_t* hi_tile = b + s * kStepBytes + v * 2 * kTileBytes;
            for (int kp = 0; kp < 16; ++kp) {
                __m512i hi, lo;
                split(_mm512_load_ps(pairs + 32 * kp), _mm512_load_ps(pairs + 32 * kp + 16), hi, lo);
                _mm512_store_si512(hi_tile + kp * 64, hi);
                _mm512_store_si512(hi_tile + kTileBytes + kp * 64, lo);
            }
        }
    }
}

EV_AMX void fill_b_direct(const MatmulArgs& a, int64_t r0, int nrows, int64_t k0, int64_t kc, uint8_t* b) {
    if (x8k_direct(a, r0, k0, kc)) {
        switch (a.wtype) {
        case DType::Q4_K: return fill_b_x8k<DType::Q4_K>(a, r0, nrows, k0, kc, b);
        case DType::Q6_K: return fill_b_x8k<DType::Q6_K>(a, r0, nrows, k0, kc, b);
        case DType::Q5_0: return fill_b_x8k<DType::Q5_0>(a, r0, nrows, k0, kc, b);
        default: break;
        }
    }
    fill_b(a, r0, nrows, k0, kc, b);
}

// Where C tile (i, j) (tokens 16i.., rows 16j..) accumulates: y itself, or at an edge a scratch
// tile standing for the tn x rn corner of y at `y` (nullptr when p is y).
struct CTiles {
    float* p[2][2];
    int64_t stride[2][2];  // bytes
    float* y[2][2];
    int64_t tn[2][2], rn[2][2];
};

// Tile registers: C(i, j) in 2i + j, A(i) (16 tokens) in 4 + i, B(j) (16 rows) in 6 + j. The
// register numbers are part of the instructions, so these are spelled out, not looped.
template <int NT>
EV_AMX_INLINE void load_a(const uint8_t* a, int64_t xs) {
    _tile_loadd(4, a, xs);
    if constexpr (NT > 1) _tile_loadd(5, a + 16 * xs, xs);
}

// The B tiles of one step, hi or lo (b points at group 0's; group 1's follow its hi and lo).
template <int NG>
EV_AMX_INLINE void load_b(const uint8_t* b) {
    _tile_loadd(6, b, 64);
    if constexpr (NG > 1) _tile_loadd(7, b + 2 * kTileBytes, 64);
}

// C(i, j) += A(i) B(j) for every C tile in use.
template <int NT, int NG>
EV_AMX_INLINE void products() {
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NG > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (NT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (NT > 1 && NG > 1) _tile_dpbf16ps(3, 5, 7);
}

// NT x NG C tiles over nsteps steps of the B block. xa: the first token's hi row at this block's
// k; lo_off: bytes from a hi element to its lo.
template <int NT, int NG>
EV_AMX void tiles(const uint8_t* xa, int64_t xs, int64_t lo_off, const uint8_t* b, int64_t nsteps, const CTiles& c, bool first) {
    if (first) {
        _tile_zero(0);
        if constexpr (NG > 1) _tile_zero(1);
        if constexpr (NT > 1) _tile_zero(2);
        if constexpr (NT > 1 && NG > 1) _tile_zero(3);
    } else {
        _tile_loadd(0, c.p[0][0], c.stride[0][0]);
        if constexpr (NG > 1) _tile_loadd(1, c.p[0][1], c.stride[0][1]);
        if constexpr (NT > 1) _tile_loadd(2, c.p[1][0], c.stride[1][0]);
        if constexpr (NT > 1 && NG > 1) _tile_loadd(3, c.p[1][1], c.stride[1][1]);
    }
    for (int64_t s = 0; s < nsteps; ++s, b += kStepBytes) {
        const int64_t o = s * 2 * kStep;
        load_a<NT>(xa + o, xs);  // x_hi * w_hi
        load_b<NG>(b);
        products<NT, NG>();
        load_b<NG>(b + kTileBytes);  // x_hi * w_lo
        products<NT, NG>();
        load_a<NT>(xa + lo_off + o, xs);  // x_lo * w_hi
        load_b<NG>(b);
        products<NT, NG>();
    }
    _tile_stored(0, c.p[0][0], c.stride[0][0]);
    if constexpr (NG > 1) _tile_stored(1, c.p[0][1], c.stride[0][1]);
    if constexpr (NT > 1) _tile_stored(2, c.p[1][0], c.stride[1][0]);
    if constexpr (NT > 1 && NG > 1) _tile_stored(3, c.p[1][1], c.stride[1][1]);
}

using TilesFn = void (*)(const uint8_t*, int64_t, int64_t, const uint8_t*, int64_t, const CTiles&, bool);
constexpr TilesFn kTilesFns[2][2] = {{tiles<1, 1>, tiles<1, 2>}, {tiles<2, 1>, tiles<2, 2>}};

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

}  // namespace

extern const ActPrep kActBf16x2;  // the operator table's registry (optable.cpp) names it
const ActPrep kActBf16x2{"bf16x2", 16, bf16x2_row_bytes, bf16x2_prep};

EV_AMX void matmul_amx_gemm(const MatmulArgs& a) {
    if (!a.xp) return;  // the runtime always converts the activations first (MatmulChoice::act)
    alignas(64) uint8_t b[kStepsPerBlock * kStepBytes];
    alignas(64) float edge[2][2][16 * 16];
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    _tile_loadconfig(&cfg);
    const int64_t lo_off = 2 * k_padded(a.k);
    const int64_t ys = a.y_stride * static_cast<int64_t>(sizeof(float));
    // Formats the panel fill does not read in slices of 32 (Q5_0, Q5_1, IQ4_NL, the K-quants): the
    // panel's rows expanded to float in scratch first, as avx512_gemm does.
    const bool direct = panel_reads(a);
    const MatmulArgs rows = expanded_rows(a);
    for (int64_t r = a.row0; r < a.row1; r += 16 * kGroups) {
        const int nrows = static_cast<int>(a.row1 - r < 16 * kGroups ? a.row1 - r : 16 * kGroups);
        const int ng = (nrows + 15) / 16;
        if (!direct) expand_rows_avx2(a, r, nrows, a.scratch);
        for (int64_t k0 = 0; k0 < a.k; k0 += kKcAmx) {
            const int64_t kc = a.k - k0 < kKcAmx ? a.k - k0 : kKcAmx;
            if (direct)
                fill_b_direct(a, r, nrows, k0, kc, b);
            else
                fill_b(rows, 0, nrows, k0, kc, b);
            const bool first = k0 == 0;
            for (int64_t t = 0; t < a.m; t += 32) {
                const int nt = a.m - t > 16 ? 2 : 1;
                CTiles c{};
                bool any_edge = false;
                for (int i = 0; i < nt; ++i)
                    for (int j = 0; j < ng; ++j) {
                        const int64_t tn = a.m - (t + 16 * i) < 16 ? a.m - (t + 16 * i) : 16;
                        const int64_t rn = nrows - 16 * j < 16 ? nrows - 16 * j : 16;
                        float* yp = a.y + (t + 16 * i) * a.y_stride + r + 16 * j;
                        if (tn == 16 && rn == 16) {
                            c.p[i][j] = yp;
                            c.stride[i][j] = ys;
                            continue;
                        }
                        any_edge = true;
                        float* e = edge[i][j];
                        std::memset(e, 0, sizeof edge[i][j]);
                        if (!first)
                            for (int64_t tt = 0; tt < tn; ++tt) std::memcpy(e + tt * 16, yp + tt * a.y_stride, static_cast<size_t>(rn) * sizeof(float));
                        c.p[i][j] = e;
                        c.stride[i][j] = 64;
                        c.y[i][j] = yp;
                        c.tn[i][j] = tn;
                        c.rn[i][j] = rn;
                    }
                kTilesFns[nt - 1][ng - 1](a.xp + t * a.xp_stride + 2 * k0, a.xp_stride, lo_off, b, (kc + kStep - 1) / kStep, c, first);
                if (!any_edge) continue;
                for (int i = 0; i < nt; ++i)
                    for (int j = 0; j < ng; ++j)
                        if (c.y[i][j])
                            for (int64_t tt = 0; tt < c.tn[i][j]; ++tt)
                                std::memcpy(c.y[i][j] + tt * a.y_stride, c.p[i][j] + tt * 16, static_cast<size_t>(c.rn[i][j]) * sizeof(float));
            }
        }
    }
    _tile_release();
}

}  // namespace evk
#endif
