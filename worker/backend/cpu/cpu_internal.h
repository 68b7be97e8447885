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

dit_status dit_cpu_linear(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                          const dit_tensor *w, const dit_tensor *bias, dit_act act, float beta);
dit_status dit_cpu_activate(dit_backend *be, const dit_tensor *y, const dit_tensor *x, dit_act act);
dit_status dit_cpu_layer_norm_mod(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                  const dit_tensor *shift, const dit_tensor *scale, float eps);
dit_status dit_cpu_rms_norm_rope(dit_backend *be, const dit_tensor *x, const dit_tensor *weight,
                                 float eps, const dit_tensor *cos, const dit_tensor *sin);
dit_status dit_cpu_gated_add(dit_backend *be, const dit_tensor *res, const dit_tensor *x,
                             const dit_tensor *gate);
dit_status dit_cpu_attention(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                             const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                             float scale);
dit_status dit_cpu_attention_masked(dit_backend *be, const dit_tensor *out, const dit_tensor *q,
                                    const dit_tensor *k, const dit_tensor *v, float scale,
                                    const dit_tensor *bias, bool causal);
dit_status dit_cpu_layer_norm(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                              const dit_tensor *weight, const dit_tensor *bias, float eps);
dit_status dit_cpu_rms_norm(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                            const dit_tensor *weight, float eps);
dit_status dit_cpu_relative_bias(dit_backend *be, const dit_tensor *y, const dit_tensor *table,
                                 const int32_t *buckets);
dit_status dit_cpu_embedding(dit_backend *be, const dit_tensor *y, const dit_tensor *table,
                             const int32_t *ids, int64_t n);
dit_status dit_cpu_conv2d(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                          const dit_tensor *w, const dit_tensor *bias, int stride, int pad);
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
dit_status dit_cpu_group_norm(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                              const dit_tensor *weight, const dit_tensor *bias, int groups,
                              float eps, dit_act act);
dit_status dit_cpu_upsample2x(dit_backend *be, const dit_tensor *y, const dit_tensor *x);
dit_status dit_cpu_lse_merge(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                             const dit_tensor *out_b, const dit_tensor *lse_b);

#endif
