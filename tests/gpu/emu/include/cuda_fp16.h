/* IEEE half for the host build on the SIMT emulator: storage and the two
 * conversions the cuda backend uses, rounding to nearest even as the
 * hardware's cvt.rn.f16.f32 does. */
#ifndef DIT_EMU_CUDA_FP16_H
#define DIT_EMU_CUDA_FP16_H

#include <cstdint>
#include <cstring>

struct __half {
    uint16_t bits;
};

static inline float __half2float(__half h)
{
    const uint32_t s = (uint32_t)(h.bits >> 15) << 31, e = (h.bits >> 10) & 31u,
                   m = h.bits & 0x3ffu;
    uint32_t u;
    if (e == 31) {
        u = s | 0x7f800000u | (m << 13);
    } else if (e != 0) {
        u = s | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0) {
        u = s;
    } else {
        /* Subnormal: m * 2^-24 is exact in f32. */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= s;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __half __float2half_rn(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t s = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return __half{(uint16_t)(s | 0x7e00u)};
    if (a >= 0x477ff000u) /* rounds to 65520 or more: infinity */
        return __half{(uint16_t)(s | 0x7c00u)};
    if (a < 0x38800000u) {
        /* Below the smallest normal (2^-14): a multiple of 2^-24, rounded
         * to nearest even by the f32 addition of a large constant. */
        float x;
        memcpy(&x, &a, 4);
        const float big = 0.5f; /* ulp(0.5) in f32 is 2^-24 */
        float r = x + big;
        uint32_t ru;
        memcpy(&ru, &r, 4);
        return __half{(uint16_t)(s | (uint16_t)(ru - 0x3f000000u))};
    }
    const uint32_t odd = (a >> 13) & 1u;
    const uint32_t r = a + 0xfffu + odd;
    return __half{(uint16_t)(s | (uint16_t)((r - 0x38000000u) >> 13))};
}

#endif
