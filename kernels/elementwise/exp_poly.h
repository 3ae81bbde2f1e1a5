// The constants of the vector exp, one set for every width: exp8 (exp_avx2.h, whose comment derives
// them), exp16 (exp_avx512.h) and exp4 (exp_neon.h) run the same reduction and polynomial, so the
// ISAs round alike lane for lane.
#pragma once

namespace evk {

constexpr float kExpMin = -87.3f;  // exp(-87.3) = 1.26e-38, just above FLT_MIN
constexpr float kExpMax = 88.0f;   // exp(88) = 1.65e38, n = 127
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;       // ln2, high 16 bits
constexpr float kLn2Lo = 1.42860682030941723e-6f;  // ln2, the rest
// q(r) of e^r = 1 + r + r^2 q(r), highest degree first (Horner).
constexpr float kExpQ[5] = {1.381461275741458e-3f, 8.368710055947304e-3f, 4.166838899254799e-2f,
                            1.666652113199234e-1f, 4.999999403953552e-1f};

}  // namespace evk
