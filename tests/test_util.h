/* Helpers shared by the Check suites: deterministic random data and a
 * tolerance comparison that prints the first mismatches. */
#ifndef DIT_TESTS_TEST_UTIL_H
#define DIT_TESTS_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct test_rng {
    uint64_t s;
} test_rng;

static inline uint64_t test_rng_next(test_rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi). */
static inline float test_rng_uniform(test_rng *r, float lo, float hi)
{
    double u = (double)(test_rng_next(r) >> 11) * 0x1.0p-53;
    return (float)(lo + (hi - lo) * u);
}

static inline void test_fill(test_rng *r, float *p, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        p[i] = test_rng_uniform(r, lo, hi);
}

/* Counts elements with |got - want| > atol + rtol * |want| and prints the
 * first few; NaN anywhere counts as a mismatch. */
static inline size_t test_compare(const char *what, const float *got, const double *want, size_t n,
                                  double atol, double rtol)
{
    size_t bad = 0;
    double max_abs = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)got[i] == want[i] ? 0.0 : fabs((double)got[i] - want[i]);
        if (!(d <= atol + rtol * fabs(want[i]))) {
            if (bad < 5)
                fprintf(stderr, "%s: [%zu] got %.9g want %.9g (diff %.3g)\n", what, i,
                        (double)got[i], want[i], d);
            bad++;
        }
        if (d > max_abs)
            max_abs = d;
    }
    if (bad)
        fprintf(stderr, "%s: %zu of %zu mismatched, max abs diff %.3g\n", what, bad, n, max_abs);
    return bad;
}

#endif
