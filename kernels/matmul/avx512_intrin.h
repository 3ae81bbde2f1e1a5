// <immintrin.h> for the files with AVX-512 code (include it first, before any other header that
// includes <immintrin.h>). GCC 12's AVX-512 intrinsics initialise their unused operand as
// `__m512 __Y = __Y;`, which -W(maybe-)uninitialized reports wherever they are inlined (GCC bug
// 105593, fixed in GCC 13). clang has neither the bug nor the -Wmaybe-uninitialized group.
#pragma once
#if defined(__x86_64__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif

#include <cstdint>

namespace evk {
// The first min(n, 16) lanes (n >= 0): masked loads and stores of a tail of 16-float vectors.
inline __mmask16 tail_mask16(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}
}  // namespace evk
#endif
