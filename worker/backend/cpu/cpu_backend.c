/* The cpu backend: host memory, f32 activations and weights, OpenMP threads,
 * GEMMs through OpenBLAS. It is the reference every other backend is tested
 * against, so clarity wins over cleverness outside the hot loops. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cblas.h>

#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_backend.h"

/* OpenBLAS extension, declared in its cblas.h but not in every BLAS's. */
void openblas_set_num_threads(int num_threads);

#define DIT_CPU_ALIGN 64

static void cpu_destroy(dit_backend *be)
{
    free(be);
}

static dit_status cpu_alloc(dit_backend *be, size_t bytes, void **out)
{
    (void)be;
    size_t rounded = (bytes + DIT_CPU_ALIGN - 1) / DIT_CPU_ALIGN * DIT_CPU_ALIGN;
    if (rounded == 0)
        rounded = DIT_CPU_ALIGN;
    void *p = aligned_alloc(DIT_CPU_ALIGN, rounded);
    if (!p)
        return DIT_ERR_NOMEM;
    *out = p;
    return DIT_OK;
}

static void cpu_free(dit_backend *be, void *ptr)
{
    (void)be;
    free(ptr);
}

/* One row of the innermost dim: convert n elements with strides. */
static void copy_row(char *dst, int64_t dst_stride, dit_dtype dt, const char *src,
                     int64_t src_stride, dit_dtype stype, int64_t n)
{
    size_t de = dit_dtype_size(dt), se = dit_dtype_size(stype);
    if (dst_stride == (int64_t)de && src_stride == (int64_t)se) {
        if (dt == stype) {
            memcpy(dst, src, (size_t)n * de);
        } else if (dt == DIT_F32) {
            dit_convert_to_f32((float *)dst, src, stype, (size_t)n);
        } else if (stype == DIT_F32) {
            dit_convert_from_f32(dst, dt, (const float *)src, (size_t)n);
        } else {
            for (int64_t i = 0; i < n; i++) {
                float f;
                dit_convert_to_f32(&f, src + i * se, stype, 1);
                dit_convert_from_f32(dst + i * de, dt, &f, 1);
            }
        }
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        float f;
        dit_convert_to_f32(&f, src + i * src_stride, stype, 1);
        dit_convert_from_f32(dst + i * dst_stride, dt, &f, 1);
    }
}

dit_status dit_cpu_copy_strided(const dit_tensor *dst, const dit_tensor *src, int n_threads)
{
    if (!dit_tensor_same_shape(dst, src) || dst->ndim < 1 || dst->ndim > DIT_MAX_DIMS ||
        (unsigned)dst->dtype >= DIT_DTYPE_COUNT || (unsigned)src->dtype >= DIT_DTYPE_COUNT)
        return DIT_ERR_INVALID_ARG;
    const int last = dst->ndim - 1;
    const int64_t rows = dit_tensor_nrows(dst), cols = dst->ne[last];
    int64_t row_bytes = cols * (int64_t)dit_dtype_size(dst->dtype);
    int nt = row_bytes * rows > (1 << 20) ? n_threads : 1;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        char *d = (char *)dst->data + dit_tensor_row_offset(dst, r);
        const char *s = (const char *)src->data + dit_tensor_row_offset(src, r);
        copy_row(d, dst->nb[last], dst->dtype, s, src->nb[last], src->dtype, cols);
    }
    return DIT_OK;
}

static dit_status cpu_upload(dit_backend *be, const dit_tensor *dst, const dit_tensor *src)
{
    return dit_cpu_copy_strided(dst, src, dit_cpu_threads(be));
}

static dit_status cpu_download(dit_backend *be, const dit_tensor *dst, const dit_tensor *src)
{
    return dit_cpu_copy_strided(dst, src, dit_cpu_threads(be));
}

static dit_status cpu_copy(dit_backend *be, const dit_tensor *dst, const dit_tensor *src)
{
    return dit_cpu_copy_strided(dst, src, dit_cpu_threads(be));
}

static dit_status cpu_fill(dit_backend *be, const dit_tensor *dst, float value)
{
    (void)be;
    if (dst->dtype != DIT_F32 || dst->ndim < 1 || dst->ndim > DIT_MAX_DIMS)
        return DIT_ERR_INVALID_ARG;
    const int last = dst->ndim - 1;
    const int64_t rows = dit_tensor_nrows(dst), cols = dst->ne[last], cs = dst->nb[last];
    for (int64_t r = 0; r < rows; r++) {
        char *row = (char *)dst->data + dit_tensor_row_offset(dst, r);
        for (int64_t c = 0; c < cols; c++)
            *(float *)(row + c * cs) = value;
    }
    return DIT_OK;
}

static dit_status cpu_sync(dit_backend *be)
{
    (void)be;
    return DIT_OK;
}

static const dit_backend_ops cpu_ops = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .weight_dtype = DIT_F32,
    .upload = cpu_upload,
    .download = cpu_download,
    .copy = cpu_copy,
    .fill = cpu_fill,
    .linear = dit_cpu_linear,
    .activate = dit_cpu_activate,
    .layer_norm_mod = dit_cpu_layer_norm_mod,
    .rms_norm_rope = dit_cpu_rms_norm_rope,
    .gated_add = dit_cpu_gated_add,
    .attention = dit_cpu_attention,
    .attention_masked = dit_cpu_attention_masked,
    .lse_merge = dit_cpu_lse_merge,
    .layer_norm = dit_cpu_layer_norm,
    .rms_norm = dit_cpu_rms_norm,
    .embedding = dit_cpu_embedding,
    .relative_bias = dit_cpu_relative_bias,
    .conv2d = dit_cpu_conv2d,
    .group_norm = dit_cpu_group_norm,
    .upsample2x = dit_cpu_upsample2x,
    .sync = cpu_sync,
};

dit_status dit_cpu_backend_create(int n_threads, dit_backend **out, dit_diag *diag)
{
    if (n_threads < 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "cpu backend: thread count %d < 0",
                            n_threads);
    if (n_threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    dit_cpu_backend *cpu = calloc(1, sizeof *cpu);
    if (!cpu)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "cpu backend: out of memory");
    cpu->base.ops = &cpu_ops;
    cpu->n_threads = n_threads;
    /* OpenBLAS keeps its thread count process-wide; the backend is the only
     * BLAS user in a process, so it owns that setting. */
    openblas_set_num_threads(n_threads);
    *out = &cpu->base;
    return DIT_OK;
}
