/* The cpu backend: host memory, f32 activations and weights, OpenMP threads,
 * GEMMs through OpenBLAS. It is the reference every other backend is tested
 * against, so clarity wins over cleverness outside the hot loops. */
#include <omp.h>
#include <stdio.h>
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

/* One ops table per kernel set (cpu_kernels.h); K(op) names the set's
 * kernel for op. */
#define CPU_OPS(K)                                                                                 \
    {                                                                                              \
        .name = "cpu", .destroy = cpu_destroy, .alloc = cpu_alloc, .free = cpu_free,               \
        .weight_dtype = DIT_F32, .upload = cpu_upload, .download = cpu_download, .copy = cpu_copy, \
        .fill = cpu_fill, .linear = K(linear), .activate = K(activate),                            \
        .layer_norm_mod = K(layer_norm_mod), .rms_norm_rope = K(rms_norm_rope),                    \
        .gated_add = K(gated_add), .attention = K(attention),                                      \
        .attention_masked = K(attention_masked), .lse_merge = K(lse_merge),                        \
        .layer_norm = K(layer_norm), .rms_norm = K(rms_norm), .embedding = K(embedding),           \
        .relative_bias = K(relative_bias), .conv2d = K(conv2d), .group_norm = K(group_norm),       \
        .upsample2x = K(upsample2x), .sync = cpu_sync,                                             \
    }

#define K_BUILD(op) dit_cpu_##op
static const dit_backend_ops cpu_ops_build = CPU_OPS(K_BUILD);

/* The x86-64 level the build's own flags give its set: 4, 3, or 0 below
 * x86-64-v3 (the compiler's default, -Dmarch=). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512CD__) &&                      \
    defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_BUILD_LEVEL 4
#elif defined(__AVX2__) && defined(__FMA__) && defined(__BMI__) && defined(__BMI2__) &&            \
    defined(__F16C__) && defined(__LZCNT__) && defined(__MOVBE__)
#define CPU_BUILD_LEVEL 3
#else
#define CPU_BUILD_LEVEL 0
#endif

/* The sets for x86-64-v3 and -v4, built where worker/meson.build builds
 * them: x86-64 with GCC (the same condition). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPU_LEVEL_SETS
#undef DIT_CPU_KERNEL
#define DIT_CPU_KERNEL(op) dit_cpu_##op##_x86_64_v3
#include "backend/cpu/cpu_kernels.h"
#undef DIT_CPU_KERNEL
#define DIT_CPU_KERNEL(op) dit_cpu_##op##_x86_64_v4
#include "backend/cpu/cpu_kernels.h"
#define K_V3(op) dit_cpu_##op##_x86_64_v3
#define K_V4(op) dit_cpu_##op##_x86_64_v4
static const dit_backend_ops cpu_ops_v3 = CPU_OPS(K_V3);
static const dit_backend_ops cpu_ops_v4 = CPU_OPS(K_V4);
#endif

static const struct {
    const char *name;
    int level;
    const dit_backend_ops *ops;
} cpu_sets[] = {
    {"build", CPU_BUILD_LEVEL, &cpu_ops_build},
#ifdef CPU_LEVEL_SETS
    {"x86-64-v3", 3, &cpu_ops_v3},
    {"x86-64-v4", 4, &cpu_ops_v4},
#endif
};
enum { CPU_N_SETS = sizeof cpu_sets / sizeof cpu_sets[0] };

static const char *level_name(int level)
{
    return level >= 4 ? "x86-64-v4" : level >= 3 ? "x86-64-v3" : "below x86-64-v3";
}

int dit_cpu_kernels_build_level(void)
{
    return CPU_BUILD_LEVEL;
}

int dit_cpu_kernels_cpu_level(void)
{
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4"))
        return 4;
    if (__builtin_cpu_supports("x86-64-v3"))
        return 3;
#endif
    return 0;
}

dit_status dit_cpu_kernels_pick(const char *request, int cpu_level, const char **name,
                                dit_diag *diag)
{
    int pick = 0; /* the build's own set unless a level set does better */
    if (!request || !request[0] || strcmp(request, "auto") == 0) {
        for (int i = 1; i < CPU_N_SETS; i++)
            if (cpu_sets[i].level <= cpu_level && cpu_sets[i].level > cpu_sets[pick].level)
                pick = i;
    } else {
        pick = -1;
        for (int i = 0; i < CPU_N_SETS; i++)
            if (strcmp(request, cpu_sets[i].name) == 0)
                pick = i;
        if (pick < 0) {
            char sets[64] = "build";
            for (int i = 1; i < CPU_N_SETS; i++)
                snprintf(sets + strlen(sets), sizeof sets - strlen(sets), ", %s", cpu_sets[i].name);
            return dit_diag_set(
                diag, DIT_ERR_INVALID_ARG,
                "cpu backend: DIT_CPU_KERNELS=%.40s%s: not a kernel set of this build (auto, "
                "%s)",
                request, strlen(request) > 40 ? "..." : "", sets);
        }
        if (cpu_sets[pick].level > cpu_level)
            return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                                "cpu backend: DIT_CPU_KERNELS=%s: this CPU is %s, the set needs %s",
                                cpu_sets[pick].name, level_name(cpu_level),
                                level_name(cpu_sets[pick].level));
    }
    *name = cpu_sets[pick].name;
    return DIT_OK;
}

static const dit_backend_ops *set_ops(const char *name)
{
    for (int i = 0; i < CPU_N_SETS; i++)
        if (strcmp(name, cpu_sets[i].name) == 0)
            return cpu_sets[i].ops;
    return NULL;
}

const char *dit_cpu_backend_kernels(const dit_backend *be)
{
    for (int i = 0; i < CPU_N_SETS; i++)
        if (be && be->ops == cpu_sets[i].ops)
            return cpu_sets[i].name;
    return NULL;
}

void dit_cpu_backend_kernels_describe(const dit_backend *be, char *buf, size_t n)
{
    const char *name = dit_cpu_backend_kernels(be);
    if (!name)
        snprintf(buf, n, "%s", "");
    else if (strcmp(name, "build") == 0)
        snprintf(buf, n, "build (%s)", level_name(CPU_BUILD_LEVEL));
    else
        snprintf(buf, n, "%s", name);
}

void dit_cpu_kernels_describe(char *buf, size_t n)
{
    size_t len = 0;
    len += (size_t)snprintf(buf, n, "build (%s)", level_name(CPU_BUILD_LEVEL));
    for (int i = 1; i < CPU_N_SETS && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, ", %s", cpu_sets[i].name);
}

dit_status dit_cpu_backend_create(int n_threads, dit_backend **out, dit_diag *diag)
{
    if (n_threads < 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "cpu backend: thread count %d < 0",
                            n_threads);
    if (n_threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    const char *kernels = NULL;
    dit_status st = dit_cpu_kernels_pick(getenv("DIT_CPU_KERNELS"), dit_cpu_kernels_cpu_level(),
                                         &kernels, diag);
    if (st != DIT_OK)
        return st;
    dit_cpu_backend *cpu = calloc(1, sizeof *cpu);
    if (!cpu)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "cpu backend: out of memory");
    cpu->base.ops = set_ops(kernels);
    cpu->n_threads = n_threads;
    /* OpenBLAS keeps its thread count process-wide; the backend is the only
     * BLAS user in a process, so it owns that setting. */
    openblas_set_num_threads(n_threads);
    *out = &cpu->base;
    return DIT_OK;
}
