/* Helpers shared by the GPU suites: the skip rule (exit 77 when there is no
 * device, which meson reports as SKIP), and "same data on both backends"
 * tensors for op-by-op parity against the cpu reference.
 *
 * Check runs with CK_NOFORK in these suites: a CUDA context does not survive
 * fork(), and main() touches the driver before any test runs. */
#ifndef DIT_TESTS_GPU_UTIL_H
#define DIT_TESTS_GPU_UTIL_H

#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "../test_util.h"

#define GPU_SKIP 77

/* Whether DIT_GPU_REQUIRED=1 is set: a machine that is meant to have a GPU
 * (tests/gpu/run.sh) must not pass by skipping. */
static inline bool gpu_required(void)
{
    const char *v = getenv("DIT_GPU_REQUIRED");
    return v && strcmp(v, "1") == 0;
}

/* Exits 77 with a message when this machine has no usable CUDA device, or
 * 1 when DIT_GPU_REQUIRED=1 says it must have one. Either way the CUDA
 * runtime's own error (name and message) is printed: "no device" and "the
 * driver failed to initialise" look the same to a skip otherwise. */
static inline void gpu_require_device(const char *suite)
{
    char why[256];
    int n = dit_cuda_device_probe(why, sizeof why);
    if (n > 0)
        return;
    if (gpu_required()) {
        printf("%s: FAIL: DIT_GPU_REQUIRED=1 but no CUDA device can be used: %s\n", suite, why);
        fflush(stdout);
        exit(1);
    }
    printf("%s: SKIP: no CUDA device can be used here (%s); set DIT_GPU_REQUIRED=1 to make this "
           "a failure\n",
           suite, why);
    fflush(stdout);
    exit(GPU_SKIP);
}

/* A tensor with the same contents on the cpu backend (f32) and the cuda
 * backend (dtype `gdt`: f32 for activations, bf16 for weights). */
typedef struct gpu_pair {
    dit_tensor c, g;
    void *cbuf, *gbuf;
} gpu_pair;

/* Rounds host values to bf16 so that a bf16 copy on the device is exact:
 * parity then measures the kernels, not the storage format. */
static inline void gpu_round_bf16(float *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = dit_bf16_to_f32(dit_f32_to_bf16(p[i]));
}

static inline gpu_pair gpu_pair_make(dit_backend *cpu, dit_backend *gpu, dit_dtype gdt, int ndim,
                                     const int64_t *shape, const float *host)
{
    gpu_pair p;
    memset(&p, 0, sizeof p);
    p.c = dit_tensor_make(NULL, DIT_F32, ndim, shape);
    p.g = dit_tensor_make(NULL, gdt, ndim, shape);
    size_t cb = dit_tensor_nbytes(&p.c), gb = dit_tensor_nbytes(&p.g);
    ck_assert_int_eq(dit_backend_alloc(cpu, cb ? cb : 4, &p.cbuf), DIT_OK);
    ck_assert_int_eq(dit_backend_alloc(gpu, gb ? gb : 4, &p.gbuf), DIT_OK);
    p.c.data = p.cbuf;
    p.g.data = p.gbuf;
    if (host) {
        dit_tensor h = dit_tensor_make((void *)host, DIT_F32, ndim, shape);
        ck_assert_int_eq(cpu->ops->upload(cpu, &p.c, &h), DIT_OK);
        dit_status st = gpu->ops->upload(gpu, &p.g, &h);
        ck_assert_msg(st == DIT_OK, "upload: %s", gpu->ops->last_error(gpu));
    }
    return p;
}

static inline void gpu_pair_free(dit_backend *cpu, dit_backend *gpu, gpu_pair *p)
{
    dit_backend_free(cpu, p->cbuf);
    dit_backend_free(gpu, p->gbuf);
    memset(p, 0, sizeof *p);
}

/* Host f32 copy of a backend view (caller frees). */
static inline float *gpu_fetch(dit_backend *be, const dit_tensor *t)
{
    size_t n = (size_t)dit_tensor_numel(t);
    float *h = malloc((n ? n : 1) * sizeof *h);
    ck_assert_ptr_nonnull(h);
    int64_t shape[DIT_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++)
        shape[i] = t->ne[i];
    dit_tensor ht = dit_tensor_make(h, DIT_F32, t->ndim, shape);
    dit_status st = be->ops->download(be, &ht, t);
    ck_assert_msg(st == DIT_OK, "download on %s failed: %s", be->ops->name,
                  be->ops->last_error ? be->ops->last_error(be) : "");
    return h;
}

/* Downloads a view from both backends and compares (atol + rtol |cpu|). */
static inline size_t gpu_compare_views(const char *what, dit_backend *cpu, const dit_tensor *ct,
                                       dit_backend *gpu, const dit_tensor *gt, double atol,
                                       double rtol)
{
    size_t n = (size_t)dit_tensor_numel(ct);
    float *want = gpu_fetch(cpu, ct), *got = gpu_fetch(gpu, gt);
    double *wd = malloc((n ? n : 1) * sizeof *wd);
    ck_assert_ptr_nonnull(wd);
    for (size_t i = 0; i < n; i++)
        wd[i] = want[i];
    size_t bad = test_compare(what, got, wd, n, atol, rtol);
    free(want);
    free(got);
    free(wd);
    return bad;
}

static inline float *gpu_rand(test_rng *r, size_t n, float lo, float hi, bool bf16)
{
    float *p = malloc((n ? n : 1) * sizeof *p);
    ck_assert_ptr_nonnull(p);
    test_fill(r, p, n, lo, hi);
    if (bf16)
        gpu_round_bf16(p, n);
    return p;
}

/* Runs `call` (a dit_status expression) and fails the test with the
 * backend's message when it is not DIT_OK. */
#define GPU_OK(be, call)                                                                           \
    do {                                                                                           \
        dit_status st_ = (call);                                                                   \
        ck_assert_msg(st_ == DIT_OK, "%s on %s: %s: %s", #call, (be)->ops->name,                   \
                      dit_status_str(st_),                                                         \
                      (be)->ops->last_error ? (be)->ops->last_error(be) : "");                     \
    } while (0)

#endif
