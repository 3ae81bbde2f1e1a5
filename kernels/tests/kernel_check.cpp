// Standalone check of every kernel variant this build registers against the scalar reference,
// on random inputs of awkward sizes. Built natively and with the aarch64 cross compiler (run
// under qemu-aarch64) by test/test_kernels_native.py. Prints "N passed, M failed".
#include <algorithm>
#include <cstddef>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../matmul/matmul_neon.h"
#include "../matmul/packed_x8.h"
#include "../ops.h"

using namespace evk;

namespace {

int passed = 0, failed = 0;

void check(bool ok, const std::string& what) {
    if (ok) {
        ++passed;
    } else {
        ++failed;
        std::printf("FAIL %s\n", what.c_str());
    }
}

std::vector<uint8_t> make_weights(DType t, int64_t rows, int64_t k, std::mt19937& rng) {
    std::normal_distribution<float> nd(0.f, 1.f);
    const size_t rb = row_bytes(t, k);
    std::vector<uint8_t> w(rb * static_cast<size_t>(rows));
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t r = 0; r < rows; ++r) {
        for (float& v : row) v = nd(rng);
        uint8_t* dst = w.data() + static_cast<size_t>(r) * rb;
        type_traits(t)->from_float(row.data(), dst, k);  // every computable format has one
    }
    return w;
}

// Bound on |int8-activation result - float result|: each activation block is rounded by at most
// half a step (amax / 127 / 2), so the error is at most sum_i |w_i| * step_i / 2, plus float slack.
float int8_bound(const float* w, const float* x, int64_t k) {
    float b = 0.f;
    for (int64_t i0 = 0; i0 < k; i0 += kQK) {
        float amax = 0.f;
        for (int j = 0; j < kQK; ++j) amax = std::fmax(amax, std::fabs(x[i0 + j]));
        float wsum = 0.f;
        for (int j = 0; j < kQK; ++j) wsum += std::fabs(w[i0 + j]);
        b += wsum * amax / 127.f * 0.5f;
    }
    return b;
}

// Bound on what requantizing float weights to int8 adds (the q8u layout): each weight moves by at
// most half its block's step amax / 127 (0.6 with float slack), against the activations and their
// own rounding (half their step).
float requant_bound(const float* w, const float* x, int64_t k) {
    float b = 0.f;
    for (int64_t i0 = 0; i0 < k; i0 += kQK) {
        float wmax = 0.f, xmax = 0.f, xsum = 0.f;
        for (int j = 0; j < kQK; ++j) {
            wmax = std::fmax(wmax, std::fabs(w[i0 + j]));
            xmax = std::fmax(xmax, std::fabs(x[i0 + j]));
            xsum += std::fabs(x[i0 + j]);
        }
        b += 0.6f * wmax / 127.f * (xsum + kQK * 0.5f * xmax / 127.f);
    }
    return b;
}

// The formats of 16 and 32-element sub-blocks with fp16 scales (Q5_0, Q5_1, IQ4_NL, the K-quants),
// checked by check_block_formats() rather than the generic matmul loop: where their fp16 fields
// are (every other byte of a block may hold anything), and which of those are mins.
struct BlockFormat {
    DType t;
    std::vector<size_t> scales, mins;  // byte offsets of fp16 fields within a block
};
const std::vector<BlockFormat>& block_formats() {
    static const std::vector<BlockFormat> f = {
        {DType::Q5_0, {offsetof(BlockQ5_0, d)}, {}},
        {DType::Q5_1, {offsetof(BlockQ5_1, d)}, {offsetof(BlockQ5_1, m)}},
        {DType::IQ4_NL, {offsetof(BlockIQ4_NL, d)}, {}},
        {DType::Q2_K, {offsetof(BlockQ2_K, d)}, {offsetof(BlockQ2_K, dmin)}},
        {DType::Q3_K, {offsetof(BlockQ3_K, d)}, {}},
        {DType::Q4_K, {offsetof(BlockQ4_K, d)}, {offsetof(BlockQ4_K, dmin)}},
        {DType::Q5_K, {offsetof(BlockQ5_K, d)}, {offsetof(BlockQ5_K, dmin)}},
        {DType::Q6_K, {offsetof(BlockQ6_K, d)}, {}},
    };
    return f;
}
const BlockFormat* block_format(DType t) {
    for (const BlockFormat& f : block_formats())
        if (f.t == t) return &f;
    return nullptr;
}

// Random bytes with every fp16 field set to a random finite half (subnormals and 65504 included).
std::vector<uint8_t> arbitrary_blocks(const BlockFormat& f, int64_t rows, int64_t k, std::mt19937& rng) {
    const TypeTraits* tt = type_traits(f.t);
    std::vector<uint8_t> w(row_bytes(f.t, k) * static_cast<size_t>(rows));
    for (uint8_t& b : w) b = static_cast<uint8_t>(rng());
    for (size_t blk = 0; blk < w.size(); blk += static_cast<size_t>(tt->block_bytes))
        for (const std::vector<size_t>* fields : {&f.scales, &f.mins})
            for (size_t off : *fields) {
                uint16_t h = static_cast<uint16_t>(rng());
                if ((h & 0x7c00u) == 0x7c00u) h &= 0xbfffu;  // exponent 31 (inf, NaN) -> 15
                std::memcpy(&w[blk + off], &h, 2);
            }
    return w;
}

// m tokens of k activations on the int8 grid: x = c q, c a power of two per token, |q| <= 127 and a
// +-127 in every block of 32, so quantizing x to int8 (per 32 or per 256) is exact and an int8
// kernel must agree with the float reference up to float rounding only.
std::vector<float> int8_grid_activations(int64_t m, int64_t k, std::mt19937& rng) {
    std::uniform_int_distribution<int> q(-127, 127), e(-4, 2), pos(0, kQK - 1);
    std::vector<float> x(static_cast<size_t>(m * k));
    for (int64_t t = 0; t < m; ++t) {
        const float c = std::ldexp(1.f, e(rng));
        for (int64_t i = 0; i < k; ++i) x[t * k + i] = c * static_cast<float>(q(rng));
        for (int64_t b = 0; b < k; b += kQK) x[t * k + b + pos(rng)] = c * ((rng() & 1) ? 127.f : -127.f);
    }
    return x;
}

// Every variant of a block format (any ISA this build has) against matmul_ref, on rows 1, 3, 17, 129
// (split in two ranges) and k of 1 to 18 blocks (32 to 576, or 256 to 2304 for the K-quants),
// weights from the reference quantizer and arbitrary bytes, int8-grid activations. Tolerance: 2e-5 of sum |x| (|s q| + |m|), the magnitudes of both terms of every weight
// (w = s q - m may cancel; the kernels may add the two terms in another order). On Arm also the
// NEON dequantizers element by element, within one rounding of each term.
void check_block_formats(std::mt19937& rng) {
    std::normal_distribution<float> nd(0.f, 1.f);
    for (const BlockFormat& f : block_formats()) {
        const TypeTraits* tt = type_traits(f.t);
        if (!tt || !tt->computable || !tt->from_float) {
            check(false, std::string("format ") + (tt ? tt->name : "?") + " has no reference dequantizer and quantizer");
            continue;
        }
        std::vector<VariantInfo> variants;
        for (const VariantInfo& v : list_variants())
            if (v.op == "matmul" && v.available && v.name != "ref" && std::find(v.formats.begin(), v.formats.end(), tt->name) != v.formats.end())
                variants.push_back(v);
        const std::vector<int64_t> k_set = tt->block_size == kQK_K ? std::vector<int64_t>{256, 512, 2304} : std::vector<int64_t>{32, 96, 160, 576};
        std::vector<int> n_bad(variants.size() + 1, 0), n_cases(variants.size() + 1, 0);
        for (int64_t k : k_set) {
            // Quantized rows come from a pool of 8 per k (the reference quantizers search, slowly
            // under qemu), drawn at random for each row of each shape.
            const size_t rb = row_bytes(f.t, k);
            const int64_t pool_rows = 8;
            std::vector<uint8_t> pool(rb * pool_rows);
            std::vector<float> src(static_cast<size_t>(k));
            for (int64_t r = 0; r < pool_rows; ++r) {
                for (float& e : src) e = nd(rng);
                tt->from_float(src.data(), pool.data() + static_cast<size_t>(r) * rb, k);
            }
            // Tokens per shape: 5 (a GEMM's token tiles and tail), 2, 5, and 1 for the largest.
            for (const auto& [rows, m] : {std::pair<int64_t, int64_t>{1, 5}, {3, 2}, {17, 5}, {129, 1}})
                for (const bool arbitrary : {false, true}) {
                    std::vector<uint8_t> w;
                    if (arbitrary) {
                        w = arbitrary_blocks(f, rows, k, rng);
                    } else {
                        w.resize(rb * static_cast<size_t>(rows));
                        for (int64_t r = 0; r < rows; ++r)
                            std::memcpy(w.data() + static_cast<size_t>(r) * rb, pool.data() + rng() % pool_rows * rb, rb);
                    }
                    const std::vector<float> x = int8_grid_activations(m, k, rng);
                    std::vector<float> y_ref(static_cast<size_t>(m * rows)), scratch(static_cast<size_t>(kMatmulScratchRows * k));
                    MatmulArgs a{w.data(), f.t, rb, k, 0, rows, x.data(), k, y_ref.data(), rows, m, scratch.data()};
                    matmul_ref(a);
                    // Per row: the reference's floats, and each weight's |s q| + |m| (the row dequantized
                    // again with its mins zeroed gives s q).
                    std::vector<float> wf(static_cast<size_t>(rows * k)), term(static_cast<size_t>(rows * k));
                    std::vector<uint8_t> no_min(rb);
                    for (int64_t r = 0; r < rows; ++r) {
                        const uint8_t* row = w.data() + static_cast<size_t>(r) * rb;
                        float* wr = &wf[static_cast<size_t>(r * k)];
                        dequantize_row(f.t, row, wr, k);
                        std::memcpy(no_min.data(), row, rb);
                        for (size_t blk = 0; blk < rb; blk += static_cast<size_t>(tt->block_bytes))
                            for (size_t off : f.mins) std::memset(&no_min[blk + off], 0, 2);
                        dequantize_row(f.t, no_min.data(), scratch.data(), k);
                        for (int64_t i = 0; i < k; ++i) term[r * k + i] = std::fabs(scratch[i]) + std::fabs(wr[i] - scratch[i]);
                    }
                    std::vector<float> mag(static_cast<size_t>(m * rows), 0.f);  // sum |x| (|s q| + |m|) per output
                    for (int64_t t = 0; t < m; ++t)
                        for (int64_t r = 0; r < rows; ++r)
                            for (int64_t i = 0; i < k; ++i) mag[t * rows + r] += std::fabs(x[t * k + i]) * term[r * k + i];
#if defined(__aarch64__)
                    if (const neon::FormatKernels* fk = neon::format_kernels(f.t)) {
                        for (int64_t r = 0; r < rows; ++r) {
                            fk->dequantize(w.data() + static_cast<size_t>(r) * rb, scratch.data(), k);
                            for (int64_t i = 0; i < k; ++i)
                                n_bad.back() += !(std::fabs(scratch[i] - wf[r * k + i]) <= 0x1p-22f * term[r * k + i]);
                        }
                        n_cases.back() += static_cast<int>(rows * k);
                    }
#endif
                    for (size_t vi = 0; vi < variants.size(); ++vi) {
                        const MatmulChoice choice = matmul_choice(variants[vi].name);
                        std::vector<uint8_t> packed, xp;
                        MatmulArgs b = a;
                        std::vector<float> y(static_cast<size_t>(m * rows));
                        b.y = y.data();
                        if (choice.packing) {
                            packed.resize(choice.packing->bytes(f.t, rows, k));
                            choice.packing->pack(f.t, w.data(), rb, rows, k, packed.data());
                            b.w = packed.data();
                            b.w_layout = choice.packing->layout;
                        }
                        if (choice.act) {
                            xp.resize(choice.act->bytes(m, k) + 64);
                            uint8_t* p = xp.data() + (64 - reinterpret_cast<uintptr_t>(xp.data()) % 64) % 64;
                            choice.act->prep(x.data(), k, m, k, 0, choice.act->padded_tokens(m), p);
                            b.xp = p;
                            b.xp_stride = static_cast<int64_t>(choice.act->row_bytes(k));
                        }
                        auto run_split = [&](MatmulArgs c, std::vector<float>& out) {
                            c.y = out.data();
                            c.row1 = rows / 2;  // two row ranges, as the thread pool splits them
                            if (c.row1 > 0) choice.fn(c);
                            c.row0 = rows / 2;
                            c.row1 = rows;
                            choice.fn(c);
                        };
                        run_split(b, y);
                        for (int64_t i = 0; i < m * rows; ++i) {
                            n_bad[vi] += !(std::fabs(y[i] - y_ref[i]) <= 2e-5f * mag[i] + 1e-30f);
                            ++n_cases[vi];
                        }
                        // A row-reading variant that also reads the x8 copy gives the same bits from it
                        // (the prefill GEMMs' panel fill reads Q4_K / Q6_K there directly from a range
                        // starting at a group of 8 rows: the splits at 8 and 64; at 1 the rows first).
                        if (!choice.packing && choice.also_reads == WLayout::kX8 && x8_packed_bytes(f.t, rows, k) > 0) {
                            std::vector<uint8_t> x8(x8_packed_bytes(f.t, rows, k));
                            x8_pack(f.t, w.data(), rb, rows, k, x8.data());
                            MatmulArgs c = b;
                            c.w = x8.data();
                            c.w_layout = WLayout::kX8;
                            std::vector<float> y8(y.size());
                            run_split(c, y8);
                            n_bad[vi] += std::memcmp(y8.data(), y.data(), y.size() * sizeof(float)) != 0;
                            ++n_cases[vi];
                        }
                    }
                }
        }
        for (size_t vi = 0; vi < variants.size(); ++vi)
            check(n_bad[vi] == 0, "matmul/" + variants[vi].name + "/" + tt->name + " (block formats): " + std::to_string(n_bad[vi]) +
                                      " of " + std::to_string(n_cases[vi]) + " outputs off");
        if (n_cases.back() > 0)
            check(n_bad.back() == 0, std::string("neon dequantize/") + tt->name + ": " + std::to_string(n_bad.back()) + " of " +
                                         std::to_string(n_cases.back()) + " values off");
        std::printf("block format %s: %zu variants checked\n", tt->name, variants.size());
    }
}

// The Gated DeltaNet variants (kernels/deltanet/) against the reference, with test_kernels.py's
// bounds: causal_conv1d within 4e-6 of (sum |w||in| + |y|), its state bit for bit, in place the
// same bits; delta_rule within 1e-6 of max |S| (the state) and that times |q_t|_1 (output t), and
// the recurrent variants bit-equal over a prompt split at 37; l2norm, rmsnorm_gated, sigmoid_mul
// within (n/64 + 8) u + 4e-6 of their magnitudes. Eight guard values after each output stay.
void check_deltanet(std::mt19937& rng) {
    std::normal_distribution<float> nd(0.f, 1.f);
    const float guard = 12345.f;
    for (const VariantInfo& v : list_variants()) {
        if (!v.available || v.name == "ref") continue;
        if (v.op == "causal_conv1d") {
            const CausalConv1dFn fn = causal_conv1d_variant(v.name);
            for (int64_t ch : {1, 3, 4, 5, 8, 9, 33, 100})
                for (int64_t K : {1, 2, 4, 5})
                    for (int64_t n : {1, 3, 70}) {
                        const int64_t xs = ch + 3;
                        std::vector<float> x(n * xs), w(K * ch), st0((K - 1) * ch);
                        for (float& e : x) e = nd(rng);
                        for (float& e : w) e = nd(rng);
                        for (float& e : st0) e = nd(rng);
                        std::vector<float> want(n * ch + 8, guard), got(n * ch + 8, guard), sw = st0, sg = st0;
                        causal_conv1d_ref(x.data(), xs, n, ch, w.data(), K, sw.data(), want.data(), ch);
                        fn(x.data(), xs, n, ch, w.data(), K, sg.data(), got.data(), ch);
                        int bad = sw != sg;
                        for (int64_t t = 0; t < n; ++t)
                            for (int64_t c = 0; c < ch; ++c) {
                                double mag = 0;
                                for (int64_t j = 0; j < K; ++j) {
                                    const int64_t r = t + j - (K - 1);  // row of in = state ++ x
                                    mag += std::fabs(w[j * ch + c] * (r < 0 ? st0[(r + K - 1) * ch + c] : x[r * xs + c]));
                                }
                                const double d = std::fabs(static_cast<double>(got[t * ch + c]) - want[t * ch + c]);
                                bad += !(d <= 4e-6 * (mag + std::fabs(want[t * ch + c])));
                            }
                        for (int64_t i = n * ch; i < n * ch + 8; ++i) bad += got[i] != guard;
                        std::vector<float> xi = x, si = st0;
                        fn(xi.data(), xs, n, ch, w.data(), K, si.data(), xi.data(), xs);
                        for (int64_t t = 0; t < n; ++t)
                            bad += std::memcmp(&xi[t * xs], &got[t * ch], ch * sizeof(float)) != 0;
                        check(bad == 0, "causal_conv1d/" + v.name + " ch=" + std::to_string(ch) + " K=" + std::to_string(K) +
                                            " n=" + std::to_string(n) + ": " + std::to_string(bad) + " off");
                    }
        } else if (v.op == "delta_rule") {
            const DeltaRuleFn fn = delta_rule_variant(v.name);
            const bool recurrent = v.name.find("chunk") == std::string::npos;
            const std::pair<int64_t, int64_t> shapes[] = {{128, 128}, {37, 45}, {1, 9}, {64, 7}, {16, 20}};
            for (const auto& [dk, dv] : shapes)
                for (int64_t n : {1, 37, 65, 130}) {
                    const int64_t qs = dk + 2;
                    std::vector<float> q(n * qs), k(n * qs), val(n * dv), g(n), b(n), S0(dk * dv);
                    for (int64_t t = 0; t < n; ++t) {
                        double nq = 0, nk = 0;
                        for (int64_t i = 0; i < qs; ++i) q[t * qs + i] = nd(rng), k[t * qs + i] = nd(rng);
                        for (int64_t i = 0; i < dk; ++i) nq += q[t * qs + i] * q[t * qs + i], nk += k[t * qs + i] * k[t * qs + i];
                        for (int64_t i = 0; i < dk; ++i)
                            q[t * qs + i] /= static_cast<float>(std::sqrt(nq * dk)), k[t * qs + i] /= static_cast<float>(std::sqrt(nk));
                        g[t] = -std::exp(nd(rng) - 1.f);
                        b[t] = 1.f / (1.f + std::exp(-nd(rng)));
                    }
                    for (float& e : val) e = nd(rng);
                    for (float& e : S0) e = 0.1f * nd(rng);
                    // The reference token by token (bit-equal to one call), tracking max |S|.
                    std::vector<float> Sw = S0, want(n * dv), got(n * dv + 8, guard), Sg = S0;
                    float top = 0;
                    for (float e : S0) top = std::fmax(top, std::fabs(e));
                    for (int64_t t = 0; t < n; ++t) {
                        delta_rule_ref(Sw.data(), &q[t * qs], &k[t * qs], qs, &val[t * dv], dv, &g[t], &b[t], 1, 1, dk, dv,
                                       &want[t * dv], dv);
                        for (float e : Sw) top = std::fmax(top, std::fabs(e));
                    }
                    fn(Sg.data(), q.data(), k.data(), qs, val.data(), dv, g.data(), b.data(), 1, n, dk, dv, got.data(), dv);
                    int bad = 0;
                    for (int64_t i = 0; i < dk * dv; ++i) bad += !(std::fabs(Sg[i] - Sw[i]) <= 1e-6 * top);
                    for (int64_t t = 0; t < n; ++t) {
                        double q1 = 0;
                        for (int64_t i = 0; i < dk; ++i) q1 += std::fabs(q[t * qs + i]);
                        for (int64_t j = 0; j < dv; ++j) bad += !(std::fabs(got[t * dv + j] - want[t * dv + j]) <= 1e-6 * top * q1);
                    }
                    for (int64_t i = n * dv; i < n * dv + 8; ++i) bad += got[i] != guard;
                    if (recurrent && n > 37) {  // split at 37: the same bits
                        std::vector<float> Ss = S0, split(n * dv);
                        fn(Ss.data(), q.data(), k.data(), qs, val.data(), dv, g.data(), b.data(), 1, 37, dk, dv, split.data(), dv);
                        fn(Ss.data(), &q[37 * qs], &k[37 * qs], qs, &val[37 * dv], dv, &g[37], &b[37], 1, n - 37, dk, dv,
                           &split[37 * dv], dv);
                        bad += Ss != Sg || std::memcmp(split.data(), got.data(), n * dv * sizeof(float)) != 0;
                    }
                    check(bad == 0, "delta_rule/" + v.name + " dk=" + std::to_string(dk) + " dv=" + std::to_string(dv) +
                                        " n=" + std::to_string(n) + ": " + std::to_string(bad) + " off");
                }
        } else if (v.op == "l2norm" || v.op == "rmsnorm_gated" || v.op == "sigmoid_mul") {
            for (int64_t n : {1, 3, 4, 7, 8, 9, 31, 33, 128, 1000}) {
                std::vector<float> x(n + 8, guard), w(n + 8, guard), z(n + 8, guard), want(n + 8, guard), got(n + 8, guard);
                for (int64_t i = 0; i < n; ++i) x[i] = 3.f * nd(rng), w[i] = nd(rng), z[i] = 4.f * nd(rng);
                double ss = 0;
                for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
                const double tol = (n / 64.0 + 8) * std::ldexp(1.0, -24) + 4e-6;
                std::vector<double> mag(n);
                if (v.op == "l2norm") {
                    l2norm_ref(x.data(), want.data(), n, 1e-6f);
                    l2norm_variant(v.name)(x.data(), got.data(), n, 1e-6f);
                    for (int64_t i = 0; i < n; ++i) mag[i] = std::fabs(x[i]) / std::sqrt(ss + 1e-6);
                } else if (v.op == "rmsnorm_gated") {
                    rmsnorm_gated_ref(x.data(), w.data(), z.data(), want.data(), n, 1e-6f);
                    rmsnorm_gated_variant(v.name)(x.data(), w.data(), z.data(), got.data(), n, 1e-6f);
                    for (int64_t i = 0; i < n; ++i) mag[i] = std::fabs(x[i] * w[i] * z[i]) / std::sqrt(ss / n + 1e-6);
                } else {
                    want = x, got = x;
                    sigmoid_mul_ref(want.data(), z.data(), n);
                    sigmoid_mul_variant(v.name)(got.data(), z.data(), n);
                    for (int64_t i = 0; i < n; ++i) mag[i] = std::fabs(x[i]);
                }
                int bad = 0;
                for (int64_t i = 0; i < n; ++i) bad += !(std::fabs(static_cast<double>(got[i]) - want[i]) <= tol * mag[i]);
                for (int64_t i = n; i < n + 8; ++i) bad += got[i] != guard;
                check(bad == 0, v.op + "/" + v.name + " n=" + std::to_string(n) + ": " + std::to_string(bad) + " off");
            }
        }
    }
}

}  // namespace

int main() {
    std::mt19937 rng(1234);
    std::normal_distribution<float> nd(0.f, 1.f);
    const CpuFeatures f = detect_cpu_features();
    std::printf("cpu:");
    for (const std::string& name : cpu_feature_names()) std::printf(" %s=%d", name.c_str(), has_cpu_feature(f, name) ? 1 : 0);
    std::printf("\n");
    // 113 rows split 56 / 57: a 48-row panel of avx512_gemm plus a partial one; k = 416: two
    // 192-element k blocks of avx512_gemm and a tail block. The formats of block_formats() (the
    // K-quants, which take none of these k) are checked by check_block_formats().
    const int64_t rows_set[] = {1, 3, 17, 64, 113};
    const int64_t k_set[] = {32, 96, 160, 576, 416};
    const int64_t m_set[] = {1, 2, 5, 13};
    for (const VariantInfo& v : list_variants()) {
        if (!v.available) {
            std::printf("skip %s/%s (this CPU lacks it)\n", v.op.c_str(), v.name.c_str());
            continue;
        }
        if (v.op != "matmul") continue;
        const MatmulChoice choice = matmul_choice(v.name);
        const MatmulFn fn = choice.fn;
        const bool int8 = v.name.find("q8act") != std::string::npos;
        for (const std::string& fmt : v.formats) {
            DType t = DType::F32;
            type_named(fmt.c_str(), &t);
            if (block_format(t)) continue;  // check_block_formats()
            int n_cases = 0, n_bad = 0;
            for (int64_t rows : rows_set)
                for (int64_t k : k_set)
                    for (int64_t m : m_set) {
                        if (row_bytes(t, k) == 0) continue;  // k not a whole number of t's blocks
                        const std::vector<uint8_t> w = make_weights(t, rows, k, rng);
                        std::vector<float> x(static_cast<size_t>(m * k));
                        for (float& e : x) e = nd(rng);
                        std::vector<float> y_ref(static_cast<size_t>(m * rows));
                        std::vector<float> scratch(static_cast<size_t>(kMatmulScratchRows * k));
                        MatmulArgs a{w.data(), t, row_bytes(t, k), k, 0, rows, x.data(), k, y_ref.data(), rows, m, scratch.data()};
                        matmul_ref(a);
                        // A variant with an activation format of its own reads x converted once.
                        std::vector<uint8_t> xp;
                        if (choice.act) {
                            xp.resize(choice.act->bytes(m, k) + 64);
                            uint8_t* p = xp.data() + (64 - reinterpret_cast<uintptr_t>(xp.data()) % 64) % 64;
                            choice.act->prep(x.data(), k, m, k, 0, choice.act->padded_tokens(m), p);
                            a.xp = p;
                            a.xp_stride = static_cast<int64_t>(choice.act->row_bytes(k));
                        }
                        // The variant over two row ranges split at `cut`, as the thread pool would,
                        // reading `wdata` in `layout`.
                        auto run_split = [&](const void* wdata, WLayout layout, int64_t cut) {
                            std::vector<float> out(static_cast<size_t>(m * rows));
                            MatmulArgs b = a;
                            b.w = wdata;
                            b.w_layout = layout;
                            b.y = out.data();
                            b.row1 = cut;
                            if (cut > 0) fn(b);
                            b.row0 = cut;
                            b.row1 = rows;
                            fn(b);
                            return out;
                        };
                        // The weights packed into a layout (bytes and pack as in MatmulPacking).
                        auto packed_into = [&](size_t (*bytes)(DType, int64_t, int64_t),
                                               void (*pack)(DType, const void*, size_t, int64_t, int64_t, void*)) {
                            std::vector<uint8_t> out(bytes(t, rows, k));
                            pack(t, w.data(), row_bytes(t, k), rows, k, out.data());
                            return out;
                        };
                        const int64_t split = rows / 2;
                        // A variant with a layout of its own reads the weights packed into it.
                        std::vector<uint8_t> own;
                        if (choice.packing) own = packed_into(choice.packing->bytes, choice.packing->pack);
                        const std::vector<float> y = choice.packing ? run_split(own.data(), choice.packing->layout, split)
                                                                    : run_split(w.data(), WLayout::kRows, split);
                        auto same_bits = [&](const std::vector<float>& other) {
                            return std::memcmp(other.data(), y.data(), y.size() * sizeof(float)) == 0;
                        };
                        // Row independence, promised by every variant: each token's outputs are the
                        // bits a one-token product gives (the decoder's verification passes rely on
                        // it: their rows are what one-row decode steps give, native/models/decoder.h).
                        if (m > 1) {
                            std::vector<float> one(static_cast<size_t>(rows));
                            std::vector<uint8_t> xp1;
                            bool same = true;
                            for (int64_t tok = 0; tok < m && same; ++tok) {
                                MatmulArgs b = a;
                                b.x = x.data() + tok * k;
                                b.m = 1;
                                if (choice.act) {
                                    xp1.assign(choice.act->bytes(1, k) + 64, 0);
                                    uint8_t* p = xp1.data() + (64 - reinterpret_cast<uintptr_t>(xp1.data()) % 64) % 64;
                                    choice.act->prep(b.x, k, 1, k, 0, choice.act->padded_tokens(1), p);
                                    b.xp = p;
                                }
                                b.w = choice.packing ? static_cast<const void*>(own.data()) : w.data();
                                b.w_layout = choice.packing ? choice.packing->layout : WLayout::kRows;
                                b.y = one.data();
                                b.row1 = split;
                                if (split > 0) fn(b);
                                b.row0 = split;
                                b.row1 = rows;
                                fn(b);
                                same = std::memcmp(one.data(), y.data() + tok * rows, one.size() * sizeof(float)) == 0;
                            }
                            check(same, "matmul/" + v.name + "/" + fmt + ": an m-token product's rows differ from one-token products (rows " +
                                            std::to_string(rows) + ", k " + std::to_string(k) + ", m " + std::to_string(m) + ")");
                        }
                        // A row-reading variant that also reads the x8 layout must give the same bits from it.
                        if (choice.also_reads == WLayout::kX8 && x8_packed_bytes(t, rows, k) > 0) {
                            const std::vector<uint8_t> x8 = packed_into(x8_packed_bytes, x8_pack);
                            check(same_bits(run_split(x8.data(), WLayout::kX8, split)),
                                  "matmul/" + v.name + "/" + fmt + " on x8-packed weights differs from the rows");
                        }
                        // A layout the variant prefers (p16) must give the same bits as the rows, for
                        // ranges starting at a multiple of 16 (the runtime's chunks) and anywhere else.
                        if (choice.prefers && choice.prefers->bytes(t, rows, k) > 0) {
                            const std::vector<uint8_t> pk = packed_into(choice.prefers->bytes, choice.prefers->pack);
                            for (const int64_t cut : {split, split / 16 * 16})
                                check(same_bits(run_split(pk.data(), choice.prefers->layout, cut)),
                                      "matmul/" + v.name + "/" + fmt + " on " + choice.prefers->name + "-packed weights differs from the rows (rows " +
                                          std::to_string(rows) + ", k " + std::to_string(k) + ", m " + std::to_string(m) + ", cut " + std::to_string(cut) + ")");
                        }
                        std::vector<float> wrow(static_cast<size_t>(k));
                        for (int64_t tok = 0; tok < m; ++tok)
                            for (int64_t r = 0; r < rows; ++r) {
                                dequantize_row(t, w.data() + static_cast<size_t>(r) * row_bytes(t, k), wrow.data(), k);
                                float mag = 0.f;
                                for (int64_t i = 0; i < k; ++i) mag += std::fabs(wrow[i] * x[tok * k + i]);
                                // 6e-5 for the split-bf16 AMX products (matmul_amx.cpp's bound).
                                float tol = (choice.act ? 6e-5f : 1e-5f) * mag + 1e-6f;
                                if (int8) tol += int8_bound(wrow.data(), &x[tok * k], k) * 1.01f;
                                if (choice.packing && choice.packing->layout == WLayout::kQ8U && t != DType::Q8_0)
                                    tol += requant_bound(wrow.data(), &x[tok * k], k) * 1.01f;
                                const float got = y[tok * rows + r], want = y_ref[tok * rows + r];
                                ++n_cases;
                                if (!(std::fabs(got - want) <= tol)) ++n_bad;
                            }
                    }
            check(n_bad == 0, "matmul/" + v.name + "/" + fmt + ": " + std::to_string(n_bad) + " of " +
                                  std::to_string(n_cases) + " outputs off");
        }
    }
    check_block_formats(rng);
    // Attention variants against the reference.
    for (const VariantInfo& v : list_variants()) {
        if (v.op != "attention" || !v.available) continue;
        const AttentionFn fn = attention_variant(v.name);
        for (int64_t n_kv : {1, 2, 7, 9, 31, 33, 257, 300})
            for (int64_t d : {1, 8, 13, 24, 64, 80, 128, 200}) {
                // Rows further apart than head_dim (as in the KV cache, where a kv head is a slice
                // of a row), and at an odd offset: no alignment.
                const int64_t ks = d + 3, vs = 2 * d + 5;
                std::vector<float> q(d), k(n_kv * ks), val(n_kv * vs), o1(d), o2(d), sc(n_kv);
                for (float& e : q) e = nd(rng);
                for (float& e : k) e = nd(rng);
                for (float& e : val) e = nd(rng);
                AttentionArgs a{q.data(), k.data() + 1, val.data() + 1, ks, vs, n_kv, d, 0.125f, o1.data(), sc.data()};
                attention_ref(a);
                a.out = o2.data();
                fn(a);
                float err = 0.f;
                for (int64_t i = 0; i < d; ++i) err = std::fmax(err, std::fabs(o1[i] - o2[i]));
                check(err < 1e-4f, "attention/" + v.name + " n_kv=" + std::to_string(n_kv) + " d=" + std::to_string(d));
            }
        // Half and int8 caches: rows of blocks, a kv head's slice of a longer row (stride 3 heads),
        // exactly sized buffers so that a read past the last row's blocks is caught by ASan.
        for (DType kt : {DType::F16, DType::Q8_0})
            for (int64_t n_kv : {1, 7, 9, 33, 300})
                for (int64_t d : {32, 64, 96, 160, 256}) {
                    const int64_t st = 3 * d;
                    std::vector<float> q(d), kf(n_kv * st), vf(n_kv * st), o1(d), o2(d), sc(n_kv);
                    for (float& e : q) e = nd(rng);
                    for (float& e : kf) e = nd(rng);
                    for (float& e : vf) e = 3.f * nd(rng);
                    std::vector<uint8_t> kc(kv_bytes(kt, n_kv * st)), vc(kc.size());
                    type_traits(kt)->from_float(kf.data(), kc.data(), n_kv * st);
                    type_traits(kt)->from_float(vf.data(), vc.data(), n_kv * st);
                    const size_t head = kv_bytes(kt, 2 * d);  // the last head of each row
                    AttentionArgs a{q.data(), kc.data() + head, vc.data() + head, st, st, n_kv, d, 0.125f, o1.data(),
                                    sc.data(), kt};
                    attention_ref(a);
                    a.out = o2.data();
                    fn(a);
                    float err = 0.f, mag = 0.f;
                    for (int64_t i = 0; i < d; ++i) err = std::fmax(err, std::fabs(o1[i] - o2[i])), mag = std::fmax(mag, std::fabs(o1[i]));
                    check(err <= 1e-5f * (1.f + mag), "attention/" + v.name + " kv " + type_traits(kt)->name +
                                                          " n_kv=" + std::to_string(n_kv) + " d=" + std::to_string(d));
                }
        // A group of query heads sharing the kv head (n_q > 1, outputs q_stride apart): each head's
        // output bitwise the one of a call with that head alone, for every cache type, group size
        // and a row count that leaves a partial chunk of rows (the variants read V in chunks).
        for (DType kt : {DType::F32, DType::F16, DType::Q8_0})
            for (int64_t g : {int64_t{2}, int64_t{3}, int64_t{4}, int64_t{7}, kMaxAttentionGroup})
                for (int64_t n_kv : {1, 9, 64, 65, 200})
                    for (int64_t d : {32, 64, 96, 160, 256}) {
                        const int64_t st = 2 * d, qs = d + 32;  // query heads further apart than head_dim
                        std::vector<float> q(g * qs), kf(n_kv * st), vf(n_kv * st), og(g * qs, 7.f), o1(d), sc(g * n_kv);
                        for (float& e : q) e = nd(rng);
                        for (float& e : kf) e = nd(rng);
                        for (float& e : vf) e = nd(rng);
                        std::vector<uint8_t> kc(kv_bytes(kt, n_kv * st)), vc(kc.size());
                        type_traits(kt)->from_float(kf.data(), kc.data(), n_kv * st);
                        type_traits(kt)->from_float(vf.data(), vc.data(), n_kv * st);
                        const size_t head = kv_bytes(kt, d);  // the second head of each row
                        AttentionArgs a{q.data(), kc.data() + head, vc.data() + head, st, st, n_kv, d, 0.125f, og.data(),
                                        sc.data(), kt, g, qs};
                        fn(a);
                        bool same = true, gaps = true;
                        for (int64_t h = 0; h < g; ++h) {
                            AttentionArgs one = a;
                            one.q = q.data() + h * qs, one.out = o1.data(), one.n_q = 1, one.q_stride = 0;
                            fn(one);
                            same = same && std::memcmp(o1.data(), og.data() + h * qs, d * sizeof(float)) == 0;
                            for (int64_t i = d; i < qs; ++i) gaps = gaps && og[h * qs + i] == 7.f;
                        }
                        check(same && gaps, "attention/" + v.name + " kv " + type_traits(kt)->name + " group of " +
                                                std::to_string(g) + " n_kv=" + std::to_string(n_kv) + " d=" + std::to_string(d) +
                                                (same ? ": wrote between heads" : ": a head differs from its call alone"));
                    }
        // Several query tokens in one call (n_tok > 1, a prefill chunk; with and without a sliding
        // window): each token's output bitwise the one of its own call (attention_token), the gaps
        // between heads and tokens untouched; every cache type, head sizes on and off the 16-lane
        // path (a multiple of 64), row counts across its passes of 6 (tokens x heads).
        for (DType kt : {DType::F32, DType::F16, DType::Q8_0})
            for (int64_t g : {1, 3, 4})
                for (int64_t n_tok : {2, 5, 8})
                    for (int64_t n_kv : {1, 7, 64, 70})
                        for (int64_t window : {0, 3, 9, 66})
                            for (int64_t d : {32, 64, 256}) {
                                const int64_t st = 2 * d, qs = d + 32, ts = g * qs + 16, keys = n_kv + n_tok - 1;
                                std::vector<float> q(n_tok * ts), kf(keys * st), vf(keys * st), og(n_tok * ts, 7.f), o1(d);
                                std::vector<float> sc(n_tok * g * keys);
                                for (float& e : q) e = nd(rng);
                                for (float& e : kf) e = nd(rng);
                                for (float& e : vf) e = nd(rng);
                                std::vector<uint8_t> kc(kv_bytes(kt, keys * st)), vc(kc.size());
                                type_traits(kt)->from_float(kf.data(), kc.data(), keys * st);
                                type_traits(kt)->from_float(vf.data(), vc.data(), keys * st);
                                const size_t head = kv_bytes(kt, d);
                                AttentionArgs a{q.data(), kc.data() + head, vc.data() + head, st, st, n_kv, d, 0.125f, og.data(),
                                                sc.data(), kt, g, qs, n_tok, ts, window};
                                fn(a);
                                bool same = true, gaps = true;
                                for (int64_t t = 0; t < n_tok; ++t)
                                    for (int64_t h = 0; h < g; ++h) {
                                        AttentionArgs one = attention_token(a, t);
                                        one.q += h * qs, one.out = o1.data(), one.n_q = 1, one.q_stride = 0;
                                        fn(one);
                                        same = same && std::memcmp(o1.data(), og.data() + t * ts + h * qs, d * sizeof(float)) == 0;
                                        for (int64_t i = d; i < qs; ++i) gaps = gaps && og[t * ts + h * qs + i] == 7.f;
                                    }
                                for (int64_t t = 0; t < n_tok; ++t)
                                    for (int64_t i = g * qs; i < ts; ++i) gaps = gaps && og[t * ts + i] == 7.f;
                                check(same && gaps, "attention/" + v.name + " kv " + type_traits(kt)->name + " " + std::to_string(n_tok) +
                                                        " tokens of " + std::to_string(g) + " heads, n_kv=" + std::to_string(n_kv) +
                                                        " window=" + std::to_string(window) + " d=" + std::to_string(d) +
                                                        (same ? ": wrote between rows" : ": a token differs from its call alone"));
                            }
    }
    // Exp-based element-wise variants against the reference, on awkward sizes (SIMD tails) and
    // large magnitudes. Tolerance: relative 2e-6 of the reference, plus 1e-35 for results the
    // variants flush to 0 below exp(-87.3), plus for gelu_tanh 2^-22 |x| (gelu_mul: |x b|): the reference computes
    // 1 + tanh(y) in float, which keeps no digits where tanh(y) is near -1. Softmax rows are
    // compared after dividing each by its sum in double: the reference adds in float, which alone
    // costs it ~2e-6 at n = 4097; the variant's own sum must be 1 within 1e-6. Eight guard values
    // after the n elements must be left alone (the tails use masked loads and stores).
    const int64_t sizes[] = {1, 7, 8, 9, 31, 33, 257, 1000, 4097};
    std::uniform_real_distribution<float> ud(-1.f, 1.f);
    for (const VariantInfo& v : list_variants()) {
        if (!v.available || v.name == "ref" || (v.op != "softmax" && v.op != "gelu_tanh" && v.op != "silu_mul" && v.op != "gelu_mul")) continue;
        for (float spread : {1.f, 8.f, 90.f, 1e4f})
            for (int64_t n : sizes) {
                const float guard = 12345.f;
                std::vector<float> x(n + 8, guard), b(n + 8, guard);
                for (int64_t i = 0; i < n; ++i) x[i] = ud(rng) * spread, b[i] = ud(rng) * 3.f;
                if (v.op == "softmax" && n > 2) x[n / 2] = -1e4f;  // a masking-like score
                std::vector<float> want = x, got = x;
                if (v.op == "softmax") {
                    softmax_ref(want.data(), n, 0.125f);
                    softmax_variant(v.name)(got.data(), n, 0.125f);
                } else if (v.op == "gelu_tanh") {
                    gelu_tanh_ref(want.data(), n);
                    gelu_tanh_variant(v.name)(got.data(), n);
                } else if (v.op == "gelu_mul") {
                    gelu_mul_ref(want.data(), b.data(), n);
                    gelu_mul_variant(v.name)(got.data(), b.data(), n);
                } else {
                    silu_mul_ref(want.data(), b.data(), n);
                    silu_mul_variant(v.name)(got.data(), b.data(), n);
                }
                double sw = 1.0, sg = 1.0;
                if (v.op == "softmax") {
                    sw = sg = 0.0;
                    for (int64_t i = 0; i < n; ++i) sw += want[i], sg += got[i];
                }
                int bad = std::fabs(sg - 1.0) <= 1e-6 ? 0 : 1;
                for (int64_t i = 0; i < n; ++i) {
                    const double w = want[i] / sw, g = got[i] / sg;
                    double tol = 2e-6 * std::fabs(w) + 1e-35;
                    if (v.op == "gelu_tanh") tol += std::ldexp(std::fabs(x[i]), -22);
                    if (v.op == "gelu_mul") tol += std::ldexp(std::fabs(x[i] * b[i]), -22);
                    if (!(std::fabs(g - w) <= tol)) ++bad;
                }
                for (int64_t i = n; i < n + 8; ++i) bad += got[i] != guard;
                check(bad == 0, v.op + "/" + v.name + " n=" + std::to_string(n) + " spread=" + std::to_string(spread) +
                                    ": " + std::to_string(bad) + " off");
            }
    }
    // Norms, rope and add against the reference (docs/kernels/elementwise-norms.md derives the
    // bounds; u = 2^-24). rmsnorm: the variants add squares in float lanes (16 or 32 partial sums,
    // then a tree), the reference in double: |got - want| <= (n/32 + 10) u |want|. layernorm: the
    // mean's error scales with mean|x|, the variance's like rmsnorm's:
    // (n/16 + 8) u inv |w| mean|x| + (n/32 + 12) u |(x - mean) inv w| + 2 u |b|. rope: both round a
    // product fewer times than the reference: 4 u (|a| + |b|)(|c| + |s|) per element, untouched
    // elements bit for bit. add: one rounding, as in the reference: bit for bit. Eight guard values
    // after each output must be left alone.
    const int64_t norm_sizes[] = {1, 7, 8, 9, 31, 33, 63, 64, 65, 576, 577, 768, 1000, 4097};
    const double u = std::ldexp(1.0, -24);
    const float guard = 12345.f;
    // argmax: the reference's index exactly, on sizes across the vector steps, with ties (rounded
    // values), the maximum at either end, signed zeros, NaNs anywhere (the first one wins), all -inf.
    for (const VariantInfo& v : list_variants()) {
        if (!v.available || v.op != "argmax") continue;
        int bad = 0, cases = 0;
        for (int64_t n : norm_sizes)
            for (int kind = 0; kind < 7; ++kind) {
                std::vector<float> x(n);
                for (float& e : x) e = nd(rng);
                if (kind == 1) for (float& e : x) e = std::round(e);
                if (kind == 2) x[n - 1] = 100.f;
                if (kind == 3) x[0] = 100.f;
                if (kind == 4) for (int64_t i = 0; i < n; ++i) x[i] = i % 3 ? -0.f : 0.f;
                if (kind == 5) x[static_cast<size_t>(rng() % n)] = NAN, x[static_cast<size_t>(rng() % n)] = NAN;
                if (kind == 6) std::fill(x.begin(), x.end(), -INFINITY);
                ++cases;
                bad += argmax_variant(v.name)(x.data(), n) != argmax_ref(x.data(), n);
            }
        check(bad == 0, "argmax/" + v.name + ": " + std::to_string(bad) + " of " + std::to_string(cases) + " differ from the reference");
    }
    for (const VariantInfo& v : list_variants()) {
        if (!v.available || v.name == "ref") continue;
        if (v.op == "rmsnorm" || v.op == "layernorm" || v.op == "add") {
            for (float offset : {0.f, 3.f, -40.f})
                for (int64_t n : norm_sizes) {
                    std::vector<float> x(n + 8, guard), w(n + 8, guard), b(n + 8, guard);
                    for (int64_t i = 0; i < n; ++i) x[i] = nd(rng) * 2.f + offset, w[i] = 1.f + 0.3f * nd(rng), b[i] = nd(rng);
                    std::vector<float> want(n + 8, guard), got(n + 8, guard);
                    int bad = 0;
                    if (v.op == "add") {
                        want = x, got = x;
                        add_ref(want.data(), b.data(), n);
                        add_variant(v.name)(got.data(), b.data(), n);
                        bad += std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) != 0;
                    } else if (v.op == "rmsnorm") {
                        rmsnorm_ref(x.data(), w.data(), want.data(), n, 1e-5f);
                        rmsnorm_variant(v.name)(x.data(), w.data(), got.data(), n, 1e-5f);
                        for (int64_t i = 0; i < n; ++i)
                            bad += !(std::fabs(static_cast<double>(got[i]) - want[i]) <= (n / 32.0 + 10) * u * std::fabs(want[i]));
                    } else {
                        double mean = 0, var = 0, mabs = 0;
                        for (int64_t i = 0; i < n; ++i) mean += x[i], mabs += std::fabs(x[i]);
                        mean /= n, mabs /= n;
                        for (int64_t i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
                        const double inv = 1.0 / std::sqrt(var / n + 1e-5);
                        for (const float* bp : {static_cast<const float*>(b.data()), static_cast<const float*>(nullptr)}) {
                            std::fill(want.begin(), want.end(), guard);
                            std::fill(got.begin(), got.end(), guard);
                            layernorm_ref(x.data(), w.data(), bp, want.data(), n, 1e-5f);
                            layernorm_variant(v.name)(x.data(), w.data(), bp, got.data(), n, 1e-5f);
                            for (int64_t i = 0; i < n; ++i) {
                                const double tol = u * ((n / 16.0 + 8) * inv * std::fabs(w[i]) * mabs +
                                                        (n / 32.0 + 12) * std::fabs((x[i] - mean) * inv * w[i]) + 2 * (bp ? std::fabs(bp[i]) : 0.0));
                                bad += !(std::fabs(static_cast<double>(got[i]) - want[i]) <= tol);
                            }
                            for (int64_t i = n; i < n + 8; ++i) bad += got[i] != guard;
                        }
                    }
                    for (int64_t i = n; i < n + 8; ++i) bad += got[i] != guard;
                    check(bad == 0, v.op + "/" + v.name + " n=" + std::to_string(n) + " offset=" + std::to_string(offset) + ": " +
                                        std::to_string(bad) + " off");
                }
        } else if (v.op == "rope") {
            const RopeFn fn = rope_variant(v.name);
            std::uniform_real_distribution<float> angle(-3.2f, 3.2f);
            for (int64_t head_dim : {2, 3, 7, 8, 13, 16, 17, 32, 64, 80, 128})
                for (int64_t rope_dims : {head_dim, head_dim - 1, head_dim / 2, int64_t{2}})
                    for (int64_t n_heads : {1, 3, 9})
                        for (bool neox : {false, true}) {
                            if (rope_dims < 2 || rope_dims > head_dim) continue;
                            std::vector<float> cs(rope_dims + 8, guard);
                            for (int64_t i = 0; i < rope_dims / 2; ++i) {
                                const float t = angle(rng);
                                cs[2 * i] = std::cos(t), cs[2 * i + 1] = std::sin(t);
                            }
                            const int64_t len = n_heads * head_dim;
                            std::vector<float> x(len + 8, guard);
                            for (int64_t i = 0; i < len; ++i) x[i] = nd(rng) * 4.f;
                            std::vector<float> want = x, got = x;
                            rope_ref(want.data(), n_heads, head_dim, rope_dims, cs.data(), neox);
                            fn(got.data(), n_heads, head_dim, rope_dims, cs.data(), neox);
                            const int64_t half = rope_dims / 2;
                            int bad = 0;
                            for (int64_t h = 0; h < n_heads; ++h) {
                                const float* xh = &x[h * head_dim];
                                for (int64_t j = 0; j < head_dim; ++j) {
                                    const int64_t k = h * head_dim + j;
                                    if (j >= 2 * half) {  // not rotated: untouched
                                        bad += got[k] != x[k];
                                        continue;
                                    }
                                    const int64_t pair = neox ? j % half : j / 2;
                                    const float a = xh[neox ? pair : 2 * pair], bb = xh[neox ? pair + half : 2 * pair + 1];
                                    const double tol = 4 * u * (std::fabs(a) + std::fabs(bb)) * (std::fabs(cs[2 * pair]) + std::fabs(cs[2 * pair + 1]));
                                    bad += !(std::fabs(static_cast<double>(got[k]) - want[k]) <= tol);
                                }
                            }
                            for (int64_t i = len; i < len + 8; ++i) bad += got[i] != guard;
                            check(bad == 0, "rope/" + v.name + " head_dim=" + std::to_string(head_dim) + " rope_dims=" +
                                                std::to_string(rope_dims) + " heads=" + std::to_string(n_heads) +
                                                (neox ? " neox" : " normal") + ": " + std::to_string(bad) + " off");
                        }
        }
    }
    check_deltanet(rng);
    std::printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
