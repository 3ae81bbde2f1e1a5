#include "packed_q8u.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace evk {

namespace {

bool q8u_source(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::Q8_0; }

// 32 floats to int8: d = max|x| / 127 kept in float (Q8_0's fp16 scale would lose small weights to
// its subnormals), q = round-to-nearest(x / d). Returns d. A file's NaN weights become 0 and an
// infinite one makes d infinite (the block's products NaN, as float ones would be): never a cast
// of NaN to int8 (undefined; found by fuzz_gguf).
float requantize_block(const float* x, int8_t* q) {
    float amax = 0.f;
    for (int i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    for (int i = 0; i < kQK; ++i) {
        const float v = std::nearbyint(x[i] * id);
        q[i] = v == v ? static_cast<int8_t>(std::clamp(v, -127.f, 127.f)) : int8_t{0};
    }
    return d;
}

}  // namespace

size_t q8u_packed_bytes(DType t, int64_t rows, int64_t k) {
    if (!q8u_source(t) || rows <= 0 || k <= 0 || row_bytes(t, k) == 0) return 0;
    return static_cast<size_t>((rows + 7) / 8) * static_cast<size_t>((k + kQK - 1) / kQK) * kQ8uBlockBytes;
}

void q8u_pack(DType t, const void* src, size_t src_row_bytes, int64_t rows, int64_t k, void* dst) {
    const int64_t nb = (k + kQK - 1) / kQK;  // a partial last block is zero-padded
    auto* out = static_cast<uint8_t*>(dst);
    std::memset(out, 0, q8u_packed_bytes(t, rows, k));  // padding rows: d = 0, so they add nothing
    std::vector<float> row(static_cast<size_t>(nb * kQK), 0.f);
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* s = static_cast<const uint8_t*>(src) + static_cast<size_t>(r) * src_row_bytes;
        if (t != DType::Q8_0) dequantize_row(t, s, row.data(), k);
        const int64_t lane = r % 8;
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* g = out + static_cast<size_t>((r / 8) * nb + b) * kQ8uBlockBytes;
            float d;
            int8_t q[kQK];
            if (t == DType::Q8_0) {  // the file's block as it is (its bytes need not be aligned)
                BlockQ8_0 blk;
                std::memcpy(static_cast<void*>(&blk), s + static_cast<size_t>(b) * sizeof blk, sizeof blk);
                d = fp16_to_fp32(blk.d);
                std::memcpy(q, blk.qs, kQK);
            } else {
                d = requantize_block(row.data() + b * kQK, q);
            }
            std::memcpy(g + sizeof(float) * lane, &d, sizeof d);
            for (int j = 0; j < 8; ++j)
                for (int i = 0; i < 4; ++i) g[32 + 32 * j + 4 * lane + i] = static_cast<uint8_t>(q[4 * j + i] + 128);
        }
    }
}

}  // namespace evk
