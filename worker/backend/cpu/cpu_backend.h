/* The cpu backend constructor; everything else goes through the ops table. */
#ifndef DIT_BACKEND_CPU_BACKEND_H
#define DIT_BACKEND_CPU_BACKEND_H

#include <stdbool.h>
#include <stddef.h>

#include "backend/backend.h"

/* n_threads: OpenMP/OpenBLAS threads this backend uses; 0 = online cores.
 * The kernel set (below) is the environment's DIT_CPU_KERNELS or, unset,
 * the automatic choice; a set the build lacks or the CPU cannot run fails
 * here. */
dit_status dit_cpu_backend_create(int n_threads, dit_backend **out, dit_diag *diag);

/* The backend's own kernels (everything but the GEMMs, which are
 * OpenBLAS's) come in sets: "build", compiled with the build's flags (its
 * -march), and on x86-64 with GCC also "x86-64-v3" (AVX2, FMA) and
 * "x86-64-v4" (AVX-512 F/BW/CD/DQ/VL). A set gives its own bits: sums that
 * vectorise run in another order at another vector width (results agree
 * within the tolerances the tests hold every set to).
 *
 * dit_cpu_kernels_pick: request NULL, "" or "auto": "build" unless a level
 * set above the build's own level is one the CPU runs, then the highest
 * such (a -march=native build keeps its own set; a portable build, -Dmarch=,
 * gets the CPU's vector width); or the set named, if this build has it and
 * cpu_level (dit_cpu_kernels_cpu_level's scale) reaches it. *name is a
 * static string. */
dit_status dit_cpu_kernels_pick(const char *request, int cpu_level, const char **name,
                                dit_diag *diag);
/* This CPU's x86-64 level: 4, 3, or 0 (below x86-64-v3, or not x86-64). */
int dit_cpu_kernels_cpu_level(void);
/* The level the build's own flags give the "build" set, on the same scale. */
int dit_cpu_kernels_build_level(void);
/* The set a cpu backend runs; NULL for any other backend. */
const char *dit_cpu_backend_kernels(const dit_backend *be);
/* The same for a log line: "x86-64-v4", or "build (x86-64-v4)" with the
 * build set's level; "" for any other backend. */
void dit_cpu_backend_kernels_describe(const dit_backend *be, char *buf, size_t n);
/* The sets built, "build (x86-64-v4), x86-64-v3, x86-64-v4": the build's
 * own with the level its flags give it, then the level sets. */
void dit_cpu_kernels_describe(char *buf, size_t n);

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
