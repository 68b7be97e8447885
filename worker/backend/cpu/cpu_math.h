/* Scalar math written so that GCC vectorises it inside `omp simd` loops
 * without -ffast-math: no errno, no calls into libm. Accuracy is a couple of
 * ulp over the ranges the model uses, checked by tests/test_cpu_ops.c. */
#ifndef DIT_BACKEND_CPU_MATH_H
#define DIT_BACKEND_CPU_MATH_H

#include <stdint.h>

/* e^x for f32. Range reduction x = n ln2 + r with |r| <= ln2/2, a degree-6
 * polynomial for e^r, and 2^n built in the exponent bits. Returns 0 below
 * -87.34 (where e^x underflows to subnormals) and +inf above 88.72. */
static inline float dit_expf(float x)
{
    const float hi = 88.7228f, lo = -87.3365f;
    /* Written so that NaN clamps to lo: converting NaN to an integer below
     * would be undefined (the result is made NaN again at the end). */
    float xc = x > hi ? hi : (x >= lo ? x : lo);
    /* Round to nearest by adding and subtracting 1.5 * 2^23 (exact for the
     * |n| <= 128 here); unlike roundevenf this vectorises. */
    const float shifter = 12582912.0f;
    float n = (xc * 1.44269504088896341f + shifter) - shifter;
    float r = xc - n * 0.693145751953125f; /* ln2 high part, exact product */
    r = r - n * 1.428606765330187045e-06f; /* ln2 low part */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* 2^n from the exponent bits; n = 128 (x near the top of the range)
     * would be the infinity pattern, so it is built as 2^127 * 2. */
    int32_t ni = (int32_t)n;
    float extra = ni > 127 ? 2.0f : 1.0f;
    ni = ni > 127 ? 127 : ni;
    /* A union pun (well defined in C) rather than memcpy: GCC keeps it in
     * registers and so still vectorises the loops that call this. */
    union {
        int32_t i;
        float f;
    } scale = {.i = (ni + 127) << 23};
    float y = p * scale.f * extra;
    y = x < lo ? 0.0f : y;
    y = x > hi ? __builtin_inff() : y;
    y = x != x ? x : y;
    return y;
}

/* tanh via e^{2x}: tanh(x) = 1 - 2 / (e^{2x} + 1), with the odd-symmetric
 * small-argument branch replaced by a short series where the subtraction
 * would cancel. */
static inline float dit_tanhf(float x)
{
    float ax = x < 0 ? -x : x;
    float e = dit_expf(2.0f * ax);
    float t = 1.0f - 2.0f / (e + 1.0f);
    float x2 = x * x;
    /* x - x^3/3 + 2x^5/15 - 17x^7/315 is accurate to ~1 ulp for |x| < 0.0625 */
    float s = ax * (1.0f + x2 * (-0.333333333f + x2 * (0.133333333f + x2 * -0.053968254f)));
    t = ax < 0.0625f ? s : t;
    return x < 0 ? -t : t;
}

static inline float dit_gelu_tanhf(float x)
{
    const float k_beta = 0.7978845608028654f; /* sqrt(2/pi) */
    const float k_kappa = 0.044715f;
    float inner = k_beta * (x + k_kappa * x * x * x);
    return 0.5f * x * (1.0f + dit_tanhf(inner));
}

/* erf by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7), odd. */
static inline float dit_erff(float x)
{
    float ax = x < 0 ? -x : x;
    float t = 1.0f / (1.0f + 0.3275911f * ax);
    float poly =
        t * (0.254829592f +
             t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    float y = 1.0f - poly * dit_expf(-ax * ax);
    return x < 0 ? -y : y;
}

static inline float dit_gelu_erff(float x)
{
    return 0.5f * x * (1.0f + dit_erff(x * 0.70710678118654752f));
}

static inline float dit_quick_geluf(float x)
{
    return x / (1.0f + dit_expf(-1.702f * x));
}

static inline float dit_siluf(float x)
{
    return x / (1.0f + dit_expf(-x));
}

#endif
