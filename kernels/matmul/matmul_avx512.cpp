// AVX-512 matrix product for many tokens (prompt prefill, the vision tower): weight rows are the
// vector lanes. Notes and measurements: docs/kernels/prefill-gemm-avx512.md.
//
// For each panel of up to 48 weight rows and each block of up to kKc (192) elements of k, the rows are
// expanded to float and transposed (16 x 16 in registers) into an L1 panel laid out k-major:
// panel[kk][0..48) holds element k0 + kk of the 48 rows. A register tile of 3 x 16 rows times 8
// tokens (24 zmm accumulators) then streams the panel: per element of k, 3 panel loads and 8
// broadcast activations feed 24 FMAs. Partial sums live in y between k blocks.
//
// Every output y[t][r] is one sequential chain of fused multiply-adds over k = 0, 1, ..., k-1,
// whatever tile, row range, token count or thread computed it: results do not depend on how the
// runtime splits the work (bit-identical across thread counts and prompt pieces).
//
// Compiled for the baseline ISA; only these functions carry the AVX-512 target, and the operator
// table calls them only on CPUs that report AVX-512 F/BW/VL. No allocation: the panel is on the
// stack (36 KiB); the MatmulArgs scratch is not needed. The panel fill lives in avx512_panel.h
// (the AMX GEMM, matmul_amx.cpp, fills its panels with it too).
#if defined(__x86_64__)
#include "avx512_panel.h"

namespace evk {

namespace {

using namespace avx512;  // the panel fill (avx512_panel.h)

constexpr int kVecs = 3;               // row vectors per panel (16 rows each)
constexpr int kPanelRows = 16 * kVecs;  // 48
constexpr int kTok = 8;                // tokens per register tile
#ifndef EVK_AVX512_KC
#define EVK_AVX512_KC 192
#endif
constexpr int64_t kKc = EVK_AVX512_KC;           // elements of k per panel block: 48 x 192 floats = 36 KiB

// NT tokens x NV row vectors over one k block. y (token 0, panel row 0) holds the partial sums of
// the earlier k blocks unless first; last_mask selects the valid rows of the last row vector.
template <int NV, int NT>
EV_AVX512 void tile(const float* panel, int64_t kc, const float* x, int64_t x_stride, float* y, int64_t y_stride,
                    bool first, __mmask16 last_mask) {
    __m512 acc[NT][NV];
    for (int t = 0; t < NT; ++t)
        for (int v = 0; v < NV; ++v) {
            const __mmask16 m = v == NV - 1 ? last_mask : static_cast<__mmask16>(0xffff);
            acc[t][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m, y + t * y_stride + 16 * v);
        }
    const float* xs[NT];
    for (int t = 0; t < NT; ++t) xs[t] = x + t * x_stride;
    for (int64_t kk = 0; kk < kc; ++kk) {
        __m512 w[NV];
        for (int v = 0; v < NV; ++v) w[v] = _mm512_load_ps(panel + kk * (16 * NV) + 16 * v);
        for (int t = 0; t < NT; ++t) {
            const __m512 b = _mm512_set1_ps(xs[t][kk]);
            for (int v = 0; v < NV; ++v) acc[t][v] = _mm512_fmadd_ps(w[v], b, acc[t][v]);
        }
    }
    for (int t = 0; t < NT; ++t)
        for (int v = 0; v < NV; ++v) {
            const __mmask16 m = v == NV - 1 ? last_mask : static_cast<__mmask16>(0xffff);
            _mm512_mask_storeu_ps(y + t * y_stride + 16 * v, m, acc[t][v]);
        }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool, __mmask16);

template <int NV>
constexpr TileFn tiles_for[kTok] = {tile<NV, 1>, tile<NV, 2>, tile<NV, 3>, tile<NV, 4>,
                                    tile<NV, 5>, tile<NV, 6>, tile<NV, 7>, tile<NV, 8>};
constexpr const TileFn* kTiles[kVecs] = {tiles_for<1>, tiles_for<2>, tiles_for<3>};

}  // namespace

EV_AVX512 void matmul_avx512_gemm(const MatmulArgs& a) {
    static_assert(kMatmulScratchRows >= kPanelRows + 1, "scratch holds a panel's float rows and one unpacked row");
    alignas(64) float panel[kPanelRows * kKc];
    const bool direct = panel_reads(a);  // else: float rows in scratch first
    const MatmulArgs rows = expanded_rows(a);  // the float rows of the current panel, for the other formats
    for (int64_t r = a.row0, nrows = 0; r < a.row1; r += nrows) {
        // Panels of 48 rows, but 49..64 rows left go as 32 + the rest: two 2-vector tiles instead
        // of a 3-vector and a 1-vector one (the 1-vector tile is the slowest per row).
        const int64_t left = a.row1 - r;
        nrows = left > kPanelRows + 16 ? kPanelRows : left > kPanelRows ? 32 : left;
        const int nv = static_cast<int>((nrows + 15) / 16);
        const __mmask16 last_mask = tail_mask16(nrows - 16 * (nv - 1));
        const TileFn* tiles = kTiles[nv - 1];
        if (!direct) expand_rows_avx2(a, r, nrows, a.scratch);
        for (int64_t k0 = 0; k0 < a.k; k0 += kKc) {
            const int64_t kc = a.k - k0 < kKc ? a.k - k0 : kKc;
            if (direct)
                fill_panel(a, r, static_cast<int>(nrows), k0, kc, panel);
            else
                fill_panel(rows, 0, static_cast<int>(nrows), k0, kc, panel);
            // p16: the next block's weights (the next k block of these groups, or the first of the
            // next panel's) are prefetched into L2 a slice per tile while the tiles run, so the
            // next fill finds them there.
            const uint8_t* pf[kVecs] = {};
            int64_t pf_bytes = 0, pf_done = 0;
            if (a.w_layout == WLayout::kP16 && r % kP16Rows == 0) {
                const int64_t es = a.wtype == DType::F32 ? 4 : 2;
                int64_t nr = r, nk = k0 + kKc;
                if (nk >= a.k) nr = r + nrows, nk = 0;
                if (nr < a.row1) {
                    const int64_t nkc = a.k - nk < kKc ? a.k - nk : kKc, nnv = (a.row1 - nr < kPanelRows ? a.row1 - nr + 15 : kPanelRows) / 16;
                    pf_bytes = nkc * kP16Rows * es;
                    for (int64_t v = 0; v < nnv; ++v)
                        pf[v] = static_cast<const uint8_t*>(a.w) + ((nr / kP16Rows + v) * a.k + nk) * kP16Rows * es;
                }
            }
            const int64_t n_tiles = (a.m + kTok - 1) / kTok;
            for (int64_t t = 0, ti = 1; t < a.m; t += kTok, ++ti) {
                if (pf_bytes) {
                    const int64_t upto = pf_bytes * ti / n_tiles;
                    for (; pf_done < upto; pf_done += 64)
                        for (int v = 0; v < kVecs; ++v)
                            if (pf[v]) _mm_prefetch(reinterpret_cast<const char*>(pf[v] + pf_done), _MM_HINT_T1);
                }
                const int nt = static_cast<int>(a.m - t < kTok ? a.m - t : kTok);
                tiles[nt - 1](panel, kc, a.x + t * a.x_stride + k0, a.x_stride, a.y + t * a.y_stride + r, a.y_stride,
                              k0 == 0, last_mask);
            }
        }
    }
}

}  // namespace evk
#endif
