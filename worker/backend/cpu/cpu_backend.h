/* The cpu backend constructor; everything else goes through the ops table. */
#ifndef DIT_BACKEND_CPU_BACKEND_H
#define DIT_BACKEND_CPU_BACKEND_H

#include <stdbool.h>
#include <stddef.h>

#include "backend/backend.h"

/* n_threads: OpenMP/OpenBLAS threads this backend uses; 0 = online cores. */
dit_status dit_cpu_backend_create(int n_threads, dit_backend **out, dit_diag *diag);

/* OpenBLAS on a CPU newer than itself falls back to generic pre-AVX2
 * kernels (4-5x slower GEMMs). When it has done so on a CPU with AVX2 and
 * FMA, and OPENBLAS_CORETYPE is not set, sets OPENBLAS_CORETYPE (SkylakeX
 * with AVX-512 F/BW/DQ/VL/CD, else Haswell), says so on stderr when
 * `announce` (ditworker, whose stderr is ditd's log, reports it in its Ready
 * message instead) and executes the program again (/proc/self/exe, the
 * same argv), so that OpenBLAS loads with it; returns when nothing is to be
 * done or the exec failed. Call it first in main, before any file or thread
 * is opened. */
void dit_cpu_blas_core_fix(char **argv, bool announce);

/* "OpenBLAS SkylakeX kernels", with "(OPENBLAS_CORETYPE set: its own
 * choice was Prescott)" after dit_cpu_blas_core_fix chose them. */
void dit_cpu_blas_describe(char *buf, size_t n);

/* The decision alone: the OPENBLAS_CORETYPE to set for OpenBLAS's chosen
 * core `corename` on a CPU with (or without) AVX2 + FMA and AVX-512, or
 * NULL to leave it. */
const char *dit_cpu_blas_core_advice(const char *corename, bool avx2_fma, bool avx512);

#endif
