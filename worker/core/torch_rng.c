#include "core/torch_rng.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

/* Built with -fno-math-errno (worker/meson.build): see box_muller16. */

void dit_mt19937_seed(dit_mt19937 *g, uint64_t seed)
{
    g->state[0] = (uint32_t)(seed & 0xffffffffu);
    for (int i = 1; i < 624; i++)
        g->state[i] = 1812433253u * (g->state[i - 1] ^ (g->state[i - 1] >> 30)) + (uint32_t)i;
    g->index = 624;
}

/* The recurrence in three runs, so that no index needs a modulo: words
 * 0..226 read ahead 397 (old values), 227..622 read back 227 (words this
 * twist already rewrote, as the one-loop form with (i + 397) % 624 does),
 * and the last wraps to word 0. */
static uint32_t twist_word(uint32_t hi, uint32_t lo, uint32_t far)
{
    const uint32_t y = (hi & 0x80000000u) | (lo & 0x7fffffffu);
    return far ^ (y >> 1) ^ ((0u - (y & 1u)) & 0x9908b0dfu);
}

static void twist(dit_mt19937 *g)
{
    uint32_t *s = g->state;
    for (int i = 0; i < 227; i++)
        s[i] = twist_word(s[i], s[i + 1], s[i + 397]);
    for (int i = 227; i < 623; i++)
        s[i] = twist_word(s[i], s[i + 1], s[i - 227]);
    s[623] = twist_word(s[623], s[0], s[396]);
    g->index = 0;
}

static uint32_t temper(uint32_t y)
{
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

uint32_t dit_mt19937_next(dit_mt19937 *g)
{
    if (g->index >= 624)
        twist(g);
    return temper(g->state[g->index++]);
}

/* One uniform in [0, 1): 24 random bits, exact in f32 (the scaling by
 * 2^-24 is exact, so it equals torch's division in double). */
static float uniform24_of(uint32_t r)
{
    return (float)(int32_t)(r & 0xffffffu) * 0x1p-24f;
}

static float uniform24(dit_mt19937 *g)
{
    return uniform24_of(dit_mt19937_next(g));
}

/* n uniforms, one per output, a twist's worth at a time. */
static void fill_uniform24(dit_mt19937 *g, float *out, size_t n)
{
    while (n > 0) {
        if (g->index >= 624)
            twist(g);
        const size_t k = (size_t)(624 - g->index) < n ? (size_t)(624 - g->index) : n;
        const uint32_t *s = g->state + g->index;
        for (size_t i = 0; i < k; i++)
            out[i] = uniform24_of(temper(s[i]));
        g->index += (int)k;
        out += k;
        n -= k;
    }
}

/* torch turns uniforms into normals with Cephes-style f32 polynomials
 * (ATen's avx_mathfun log and sincos, not libm), built with the compiler's
 * default FMA contraction. The functions below evaluate the same
 * polynomials with the same operation order and the same fused
 * multiply-adds, so the results are bit-identical to torch.randn on x86
 * machines with AVX2, which is where diffusers runs on the CPU (checked on
 * 205,600 values over 40 seeds and 4 sizes: no bit differs). The constants
 * are Cephes' published coefficients. Every other operation must stay
 * unfused, which ISO C mode (-std=c11: -ffp-contract=off) guarantees. */
static float cephes_logf(float x)
{
    /* Split x = m * 2^e with m in [0.5, 1). */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    float e = (float)((int32_t)(bits >> 23) - 0x7f) + 1.0f;
    bits = (bits & ~0x7f800000u) | 0x3f000000u;
    float m;
    memcpy(&m, &bits, sizeof m);
    /* if m < sqrt(1/2): e -= 1, m = 2m - 1; else m = m - 1 */
    const bool low = m < 0.707106781186547524f;
    float tmp = low ? m : 0.0f;
    e = low ? e - 1.0f : e;
    m = (m - 1.0f) + tmp;
    const float z = m * m;
    float y = 7.0376836292E-2f;
    y = fmaf(y, m, -1.1514610310E-1f);
    y = fmaf(y, m, 1.1676998740E-1f);
    y = fmaf(y, m, -1.2420140846E-1f);
    y = fmaf(y, m, 1.4249322787E-1f);
    y = fmaf(y, m, -1.6668057665E-1f);
    y = fmaf(y, m, 2.0000714765E-1f);
    y = fmaf(y, m, -2.4999993993E-1f);
    y = fmaf(y, m, 3.3333331174E-1f);
    y = y * m;
    y = fmaf(y, z, e * -2.12194440e-4f);
    y = fmaf(-z, 0.5f, y);
    return fmaf(e, 0.693359375f, m + y);
}

static void cephes_sincosf(float x, float *s, float *c)
{
    uint32_t sign_sin = x < 0 ? 0x80000000u : 0u;
    x = x < 0 ? -x : x;
    int32_t j = (int32_t)(x * 1.27323954473516f); /* 4 / pi, truncated */
    j = (j + 1) & ~1;
    const float y = (float)j;
    const uint32_t swap_sin = (uint32_t)(j & 4) << 29;
    const bool poly = (j & 2) == 0;
    const uint32_t sign_cos = (uint32_t)(~(j - 2) & 4) << 29;
    sign_sin ^= swap_sin;
    /* Extended-precision reduction x - y * pi/4 in three parts. */
    x = fmaf(y, -0.78515625f, x);
    x = fmaf(y, -2.4187564849853515625e-4f, x);
    x = fmaf(y, -3.77489497744594108e-8f, x);
    const float z = x * x;
    float yc = fmaf(2.443315711809948E-005f, z, -1.388731625493765E-003f);
    yc = fmaf(yc, z, 4.166664568298827E-002f);
    yc = yc * z;
    yc = fmaf(yc, z, -(z * 0.5f));
    yc = yc + 1.0f;
    float ys = fmaf(-1.9515295891E-4f, z, 8.3321608736E-3f);
    ys = fmaf(ys, z, -1.6666654611E-1f);
    ys = ys * z;
    ys = fmaf(ys, x, x);
    float sv = poly ? ys : yc, cv = poly ? yc : ys;
    uint32_t b;
    memcpy(&b, &sv, sizeof b);
    b ^= sign_sin;
    memcpy(s, &b, sizeof b);
    memcpy(&b, &cv, sizeof b);
    b ^= sign_cos;
    memcpy(c, &b, sizeof b);
}

/* Box-Muller on 16 uniforms: (u1 = 1 - d[j], u2 = d[j + 8]) -> d[j], d[j+8].
 * The eight lanes are independent and the code above has no branch, so
 * the compiler runs them as one vector of each operation (sqrtf's argument,
 * -2 log(u) for u in (0, 1], is never negative, so errno, which the build
 * leaves out, could not be set anyway): every lane sees the same IEEE
 * operations as the scalar form, and the same bits come out. */
static void box_muller16(float *d)
{
    const float two_pi = (float)(2.0 * 3.14159265358979323846);
    for (int j = 0; j < 8; j++) {
        const float u1 = 1.0f - d[j];
        const float u2 = d[j + 8];
        const float radius = sqrtf(-2.0f * cephes_logf(u1));
        float s, c;
        cephes_sincosf(two_pi * u2, &s, &c);
        d[j] = radius * c;
        d[j + 8] = radius * s;
    }
}

void dit_torch_randn(dit_mt19937 *g, float *out, size_t n)
{
    if (n < 16) {
        float tmp[16];
        for (int i = 0; i < 16; i++)
            tmp[i] = uniform24(g);
        box_muller16(tmp);
        memcpy(out, tmp, n * sizeof *out);
        return;
    }
    fill_uniform24(g, out, n);
    for (size_t i = 0; i + 16 <= n; i += 16)
        box_muller16(out + i);
    if (n % 16 != 0) {
        float *tail = out + n - 16;
        for (int i = 0; i < 16; i++)
            tail[i] = uniform24(g);
        box_muller16(tail);
    }
}
