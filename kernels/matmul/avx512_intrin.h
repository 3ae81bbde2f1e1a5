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
#endif
