/* Private to the cpu backend: its struct and the op entry points that
 * cpu_backend.c puts into the ops table. */
#ifndef DIT_BACKEND_CPU_INTERNAL_H
#define DIT_BACKEND_CPU_INTERNAL_H

#include "backend/backend.h"

typedef struct dit_cpu_backend {
    dit_backend base; /* must stay first */
    int n_threads;
} dit_cpu_backend;

static inline int dit_cpu_threads(dit_backend *be)
{
    return ((dit_cpu_backend *)be)->n_threads;
}

/* Strided element-wise copy with dtype conversion (any dtype, f8_e4m3
 * included, through f32), up to DIT_MAX_DIMS dims, between two host views of
 * the same shape. Used for upload, download and copy. */
dit_status dit_cpu_copy_strided(const dit_tensor *dst, const dit_tensor *src, int n_threads);

/* The kernels of the ops table under the names of the set this file is
 * compiled for (cpu_kernels.h). */
#define DIT_CPU_CAT_(a, b) a##b
#define DIT_CPU_CAT(a, b) DIT_CPU_CAT_(a, b)
#ifdef DIT_CPU_KERNEL_SUFFIX
#define DIT_CPU_KERNEL(op) DIT_CPU_CAT(dit_cpu_##op, DIT_CPU_KERNEL_SUFFIX)
#else
#define DIT_CPU_KERNEL(op) dit_cpu_##op
#endif
#include "backend/cpu/cpu_kernels.h"

/* Stride-1 convolution, no bias, of the B images of x (B, Ci, H, W) into
 * y (B, Co, H + 2 pad - kh + 1, W + 2 pad - kw + 1) by the direct kernel;
 * DIT_ERR_UNSUPPORTED where it does not apply (a CPU or build without AVX2+FMA,
 * more than 64 outputs, a kernel taller than 7, an input row band beyond
 * its scratch bound) and the caller takes the GEMM. */
dit_status dit_cpu_conv2d_direct(int nt, const float *x, const float *w, float *y, int64_t B,
                                 int64_t Ci, int64_t H, int64_t W, int64_t Co, int64_t kh,
                                 int64_t kw, int64_t pad);
/* The direct kernel's instruction sets: the CPU's best, or one of them (to
 * test each where the CPU has it: every set gives the same bits, each
 * output summed in the same order). */
typedef enum dit_cpu_isa {
    DIT_CPU_ISA_BEST,
    DIT_CPU_ISA_AVX2,   /* with FMA */
    DIT_CPU_ISA_AVX512, /* AVX-512F */
} dit_cpu_isa;
/* dit_cpu_conv2d_direct on that set; DIT_ERR_UNSUPPORTED also where this
 * CPU or build lacks it. */
dit_status dit_cpu_conv2d_direct_isa(dit_cpu_isa isa, int nt, const float *x, const float *w,
                                     float *y, int64_t B, int64_t Ci, int64_t H, int64_t W,
                                     int64_t Co, int64_t kh, int64_t kw, int64_t pad);

#endif
