// The matmul microbenchmarks' weights (matmul_bench.cpp, decode_stream_bench.cpp): the TYPE argument
// checked, and random rows quantized by the format's reference quantizer.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../formats/formats.h"

// The type named `name`, if it is one the reference quantizer writes; else a line on stderr and null.
inline const evk::TypeTraits* bench_type(const char* name, evk::DType* t) {
    if (!evk::type_named(name, t) || !evk::type_traits(*t) || !evk::type_traits(*t)->from_float) {
        std::fprintf(stderr, "unknown or unquantizable type %s\n", name);
        return nullptr;
    }
    return evk::type_traits(*t);
}

// rows x k of normal(0, 1) weights quantized to tt, row after row; only the first `distinct` rows are
// drawn, the rest repeat them (a DRAM-sized weight set up in seconds, streaming like a real one).
inline std::vector<uint8_t> random_rows(const evk::TypeTraits* tt, int64_t rows, int64_t k, int64_t distinct,
                                        std::mt19937& rng, std::normal_distribution<float>& nd) {
    const size_t rb = static_cast<size_t>(k / tt->block_size * tt->block_bytes);
    std::vector<float> wf(static_cast<size_t>(k));
    std::vector<uint8_t> w(rb * static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
        uint8_t* row = w.data() + static_cast<size_t>(r) * rb;
        if (r < distinct) {
            for (float& e : wf) e = nd(rng);
            tt->from_float(wf.data(), row, k);
        } else {
            std::memcpy(row, w.data() + static_cast<size_t>(r % distinct) * rb, rb);
        }
    }
    return w;
}
