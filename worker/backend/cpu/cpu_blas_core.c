/* OpenBLAS chooses its kernels for the CPU when it loads, from the CPU's
 * family and model. A CPU newer than the OpenBLAS release gets its generic
 * fallback: Debian bookworm's 0.3.21 does not know Emerald Rapids (family 6,
 * model 207), runs SSE3 "Prescott" kernels there, and the mid-size FLUX
 * forward takes 8.4 s instead of 1.8 s (README, "OpenBLAS and new CPUs").
 * OPENBLAS_CORETYPE, read when the library loads, overrides the choice, so
 * a program that finds itself on such kernels sets it and executes itself
 * again. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <cblas.h>

#include "backend/cpu/cpu_backend.h"

/* OpenBLAS's kernel sets for x86 CPUs without AVX2 and FMA: the ones its
 * fallback picks, and the older cores. */
static const char *const pre_avx2_cores[] = {
    "Prescott", "Core2",        "Penryn",  "Dunnington", "Nehalem",    "Sandybridge",
    "Atom",     "Barcelona",    "Bobcat",  "Bulldozer",  "Piledriver", "Steamroller",
    "Opteron",  "Opteron_SSE3", "Katmai",  "Coppermine", "Northwood",  "Banias",
    "Athlon",   "Nano",         "Unknown",
};

const char *dit_cpu_blas_core_advice(const char *corename, bool avx2_fma, bool avx512)
{
    if (!corename || !avx2_fma)
        return NULL;
    bool generic = false;
    for (size_t i = 0; i < sizeof pre_avx2_cores / sizeof pre_avx2_cores[0]; i++)
        generic |= strcasecmp(corename, pre_avx2_cores[i]) == 0;
    if (!generic)
        return NULL;
    return avx512 ? "SkylakeX" : "Haswell";
}

/* Set for the program executed again: OpenBLAS's own choice, which
 * dit_cpu_blas_describe reports. */
#define FALLBACK_ENV "DIT_OPENBLAS_OWN_CHOICE"

void dit_cpu_blas_core_fix(char **argv, bool announce)
{
#if defined(__x86_64__) || defined(__i386__)
    const char *set = getenv("OPENBLAS_CORETYPE");
    if (set && set[0])
        return;
    __builtin_cpu_init();
    const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512cd");
    const char *core = openblas_get_corename();
    const char *want = dit_cpu_blas_core_advice(core, avx2_fma, avx512);
    if (!want)
        return;
    const char *prog = argv && argv[0] ? argv[0] : "ditserve";
    if (announce) {
        fprintf(stderr,
                "%s: OpenBLAS chose its %s kernels, but this CPU has %s; running again with "
                "OPENBLAS_CORETYPE=%s (set OPENBLAS_CORETYPE to choose yourself)\n",
                prog, core, avx512 ? "AVX-512" : "AVX2 and FMA", want);
        fflush(stderr);
    }
    if (setenv("OPENBLAS_CORETYPE", want, 1) != 0 || setenv(FALLBACK_ENV, core, 1) != 0)
        return;
    execv("/proc/self/exe", argv);
    /* Still here: no /proc, or the exec failed. Run on as we are. */
    fprintf(stderr, "%s: could not run again (%s); OpenBLAS stays on its %s kernels\n", prog,
            strerror(errno), core);
    unsetenv("OPENBLAS_CORETYPE");
    unsetenv(FALLBACK_ENV);
#else
    (void)argv;
    (void)announce;
#endif
}

void dit_cpu_blas_describe(char *buf, size_t n)
{
    const char *core = openblas_get_corename();
    const char *own = getenv(FALLBACK_ENV);
    const char *set = getenv("OPENBLAS_CORETYPE");
    if (own && own[0] && set && set[0])
        snprintf(buf, n, "OpenBLAS %s kernels (OPENBLAS_CORETYPE set: its own choice was %s)",
                 core ? core : "?", own);
    else
        snprintf(buf, n, "OpenBLAS %s kernels", core ? core : "?");
}
