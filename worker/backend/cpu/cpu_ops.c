/* cpu backend: GEMM (OpenBLAS) with fused bias/activation epilogue, and the
 * row-wise ops (norms, modulation, RoPE, gated residuals, activations). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cblas.h>

#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_math.h"

/* Rows of a view whose innermost dim is dense: row r is the r-th combination
 * of the outer indices, in row-major order. */
static inline float *row_ptr(const dit_tensor *t, int64_t r)
{
    char *p = t->data;
    for (int d = t->ndim - 2; d >= 0; d--) {
        int64_t i = r % t->ne[d];
        r /= t->ne[d];
        p += i * t->nb[d];
    }
    return (float *)p;
}

static inline int64_t n_rows(const dit_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim - 1; d++)
        n *= t->ne[d];
    return n;
}

static bool is_f32_rows(const dit_tensor *t)
{
    return t && t->dtype == DIT_F32 && t->ndim >= 1 && dit_tensor_rows_dense(t);
}

/* Rows per thread chunk such that tiny tensors stay on one thread. */
static int threads_for(dit_backend *be, int64_t elems)
{
    return elems < 16384 ? 1 : dit_cpu_threads(be);
}

static void act_row(float *y, const float *x, int64_t n, dit_act act)
{
    switch (act) {
    case DIT_ACT_GELU_TANH:
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            y[i] = dit_gelu_tanhf(x[i]);
        break;
    case DIT_ACT_SILU:
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            y[i] = dit_siluf(x[i]);
        break;
    case DIT_ACT_GELU_ERF:
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            y[i] = dit_gelu_erff(x[i]);
        break;
    case DIT_ACT_QUICK_GELU:
#pragma omp simd
        for (int64_t i = 0; i < n; i++)
            y[i] = dit_quick_geluf(x[i]);
        break;
    case DIT_ACT_NONE:
        if (y != x)
            for (int64_t i = 0; i < n; i++)
                y[i] = x[i];
        break;
    }
}

dit_status DIT_CPU_KERNEL(linear)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                  const dit_tensor *w, const dit_tensor *bias, dit_act act,
                                  float beta)
{
    if (!is_f32_rows(x) || !is_f32_rows(y) || !w || w->dtype != DIT_F32 || w->ndim != 2 ||
        !dit_tensor_is_contiguous(w))
        return DIT_ERR_INVALID_ARG;
    if (x->ndim != y->ndim || (x->ndim != 2 && x->ndim != 3))
        return DIT_ERR_INVALID_ARG;
    if (beta != 0.0f && act != DIT_ACT_NONE)
        return DIT_ERR_INVALID_ARG;
    const int nd = x->ndim;
    const int64_t K = x->ne[nd - 1], M = x->ne[nd - 2], N = w->ne[0];
    const int64_t B = nd == 3 ? x->ne[0] : 1;
    if (w->ne[1] != K || y->ne[nd - 1] != N || y->ne[nd - 2] != M || (nd == 3 && y->ne[0] != B))
        return DIT_ERR_INVALID_ARG;
    if (bias && (bias->dtype != DIT_F32 || bias->ndim != 1 || bias->ne[0] != N ||
                 !dit_tensor_is_contiguous(bias)))
        return DIT_ERR_INVALID_ARG;
    if (M == 0 || N == 0 || B == 0)
        return DIT_OK;

    const int64_t lda = x->nb[nd - 2] / 4, ldy = y->nb[nd - 2] / 4;
    const float *wp = w->data;
    /* Batches laid end to end fold into a single, larger GEMM. */
    bool fold = B == 1 || (x->nb[0] == M * x->nb[1] && y->nb[0] == M * y->nb[1]);
    if (K == 0) {
        /* Empty reduction: x w^T is zero. */
        for (int64_t r = 0; r < B * M; r++) {
            float *yr = row_ptr(y, r);
            for (int64_t n = 0; n < N; n++)
                yr[n] = beta * yr[n];
        }
    } else if (fold) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)(B * M), (int)N, (int)K, 1.0f,
                    (const float *)x->data, (int)lda, wp, (int)K, beta, (float *)y->data, (int)ldy);
    } else {
        for (int64_t b = 0; b < B; b++)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)N, (int)K, 1.0f,
                        (const float *)((const char *)x->data + b * x->nb[0]), (int)lda, wp, (int)K,
                        beta, (float *)((char *)y->data + b * y->nb[0]), (int)ldy);
    }
    if (!bias && act == DIT_ACT_NONE)
        return DIT_OK;

    const float *bp = bias ? bias->data : NULL;
    const int64_t rows = B * M;
#pragma omp parallel for num_threads(threads_for(be, rows *N)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *yr = row_ptr(y, r);
        if (bp) {
#pragma omp simd
            for (int64_t n = 0; n < N; n++)
                yr[n] += bp[n];
        }
        act_row(yr, yr, N, act);
    }
    return DIT_OK;
}

dit_status DIT_CPU_KERNEL(activate)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                    dit_act act)
{
    if (!is_f32_rows(x) || !is_f32_rows(y) || !dit_tensor_same_shape(x, y))
        return DIT_ERR_INVALID_ARG;
    const int64_t rows = n_rows(x), n = x->ne[x->ndim - 1];
#pragma omp parallel for num_threads(threads_for(be, rows *n)) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        act_row(row_ptr(y, r), row_ptr(x, r), n, act);
    return DIT_OK;
}

/* (B, C) view check for the per-batch modulation vectors. */
static bool is_batch_vec(const dit_tensor *t, int64_t B, int64_t C)
{
    return t->dtype == DIT_F32 && t->ndim == 2 && t->ne[0] == B && t->ne[1] == C &&
           dit_tensor_rows_dense(t);
}

dit_status DIT_CPU_KERNEL(layer_norm_mod)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                          const dit_tensor *shift, const dit_tensor *scale,
                                          float eps)
{
    if (!is_f32_rows(x) || !is_f32_rows(y) || x->ndim != 3 || !dit_tensor_same_shape(x, y))
        return DIT_ERR_INVALID_ARG;
    const int64_t B = x->ne[0], S = x->ne[1], C = x->ne[2];
    if ((shift && !is_batch_vec(shift, B, C)) || (scale && !is_batch_vec(scale, B, C)))
        return DIT_ERR_INVALID_ARG;
#pragma omp parallel for num_threads(threads_for(be, B *S *C)) schedule(static)
    for (int64_t r = 0; r < B * S; r++) {
        const int64_t b = r / S;
        const float *xr = row_ptr(x, r);
        float *yr = row_ptr(y, r);
        /* Two passes: the mean, then the variance of the centred values,
         * which stays accurate when |mean| >> std. */
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < C; c++)
            sum += xr[c];
        const float mean = sum / (float)C;
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t c = 0; c < C; c++) {
            float d = xr[c] - mean;
            sq += d * d;
        }
        const float rstd = 1.0f / sqrtf(sq / (float)C + eps);
        const float *sh =
            shift ? (const float *)((const char *)shift->data + b * shift->nb[0]) : NULL;
        const float *sc =
            scale ? (const float *)((const char *)scale->data + b * scale->nb[0]) : NULL;
        if (sh && sc) {
#pragma omp simd
            for (int64_t c = 0; c < C; c++)
                yr[c] = (xr[c] - mean) * rstd * (1.0f + sc[c]) + sh[c];
        } else {
            for (int64_t c = 0; c < C; c++) {
                float v = (xr[c] - mean) * rstd;
                if (sc)
                    v *= 1.0f + sc[c];
                if (sh)
                    v += sh[c];
                yr[c] = v;
            }
        }
    }
    return DIT_OK;
}

dit_status DIT_CPU_KERNEL(rms_norm_rope)(dit_backend *be, const dit_tensor *x,
                                         const dit_tensor *weight, float eps, const dit_tensor *cos,
                                         const dit_tensor *sin)
{
    if (!is_f32_rows(x) || x->ndim != 4)
        return DIT_ERR_INVALID_ARG;
    const int64_t B = x->ne[0], S = x->ne[1], H = x->ne[2], D = x->ne[3];
    if (weight && (weight->dtype != DIT_F32 || weight->ndim != 1 || weight->ne[0] != D))
        return DIT_ERR_INVALID_ARG;
    if ((cos == NULL) != (sin == NULL))
        return DIT_ERR_INVALID_ARG;
    if (cos &&
        (!is_f32_rows(cos) || !is_f32_rows(sin) || cos->ndim != 2 || sin->ndim != 2 ||
         cos->ne[0] != S || cos->ne[1] != D || !dit_tensor_same_shape(cos, sin) || D % 2 != 0))
        return DIT_ERR_INVALID_ARG;
    const float *wp = weight ? weight->data : NULL;
#pragma omp parallel for num_threads(threads_for(be, B *S *H *D)) schedule(static)
    for (int64_t r = 0; r < B * S * H; r++) {
        float *xr = row_ptr(x, r);
        const int64_t s = (r / H) % S;
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t d = 0; d < D; d++)
            sq += xr[d] * xr[d];
        const float rinv = 1.0f / sqrtf(sq / (float)D + eps);
        if (wp) {
#pragma omp simd
            for (int64_t d = 0; d < D; d++)
                xr[d] = xr[d] * rinv * wp[d];
        } else {
#pragma omp simd
            for (int64_t d = 0; d < D; d++)
                xr[d] = xr[d] * rinv;
        }
        if (cos) {
            const float *cr = (const float *)((const char *)cos->data + s * cos->nb[0]);
            const float *sr = (const float *)((const char *)sin->data + s * sin->nb[0]);
            for (int64_t d = 0; d < D; d += 2) {
                const float a = xr[d], b = xr[d + 1];
                xr[d] = a * cr[d] - b * sr[d];
                xr[d + 1] = b * cr[d + 1] + a * sr[d + 1];
            }
        }
    }
    return DIT_OK;
}

dit_status DIT_CPU_KERNEL(gated_add)(dit_backend *be, const dit_tensor *res, const dit_tensor *x,
                                     const dit_tensor *gate)
{
    if (!is_f32_rows(res) || !is_f32_rows(x) || res->ndim != 3 || !dit_tensor_same_shape(res, x))
        return DIT_ERR_INVALID_ARG;
    const int64_t B = res->ne[0], S = res->ne[1], C = res->ne[2];
    if (gate && !is_batch_vec(gate, B, C))
        return DIT_ERR_INVALID_ARG;
#pragma omp parallel for num_threads(threads_for(be, B *S *C)) schedule(static)
    for (int64_t r = 0; r < B * S; r++) {
        float *rr = row_ptr(res, r);
        const float *xr = row_ptr(x, r);
        if (gate) {
            const float *g = (const float *)((const char *)gate->data + (r / S) * gate->nb[0]);
#pragma omp simd
            for (int64_t c = 0; c < C; c++)
                rr[c] += g[c] * xr[c];
        } else {
#pragma omp simd
            for (int64_t c = 0; c < C; c++)
                rr[c] += xr[c];
        }
    }
    return DIT_OK;
}

dit_status DIT_CPU_KERNEL(layer_norm)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                      const dit_tensor *weight, const dit_tensor *bias, float eps)
{
    if (!is_f32_rows(x) || !is_f32_rows(y) || x->ndim != 3 || !dit_tensor_same_shape(x, y))
        return DIT_ERR_INVALID_ARG;
    const int64_t C = x->ne[2];
    if ((weight && (weight->ndim != 1 || weight->ne[0] != C || weight->dtype != DIT_F32)) ||
        (bias && (bias->ndim != 1 || bias->ne[0] != C || bias->dtype != DIT_F32)))
        return DIT_ERR_INVALID_ARG;
    const float *w = weight ? weight->data : NULL, *b = bias ? bias->data : NULL;
    const int64_t rows = n_rows(x);
#pragma omp parallel for num_threads(threads_for(be, rows *C)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = row_ptr(x, r);
        float *yr = row_ptr(y, r);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < C; c++)
            sum += xr[c];
        const float mean = sum / (float)C;
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t c = 0; c < C; c++)
            sq += (xr[c] - mean) * (xr[c] - mean);
        const float rstd = 1.0f / sqrtf(sq / (float)C + eps);
        for (int64_t c = 0; c < C; c++) {
            float v = (xr[c] - mean) * rstd;
            if (w)
                v *= w[c];
            if (b)
                v += b[c];
            yr[c] = v;
        }
    }
    return DIT_OK;
}

dit_status DIT_CPU_KERNEL(rms_norm)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                    const dit_tensor *weight, float eps)
{
    if (!is_f32_rows(x) || !is_f32_rows(y) || x->ndim != 3 || !dit_tensor_same_shape(x, y))
        return DIT_ERR_INVALID_ARG;
    const int64_t C = x->ne[2];
    if (!weight || weight->ndim != 1 || weight->ne[0] != C || weight->dtype != DIT_F32)
        return DIT_ERR_INVALID_ARG;
    const float *w = weight->data;
    const int64_t rows = n_rows(x);
#pragma omp parallel for num_threads(threads_for(be, rows *C)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = row_ptr(x, r);
        float *yr = row_ptr(y, r);
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t c = 0; c < C; c++)
            sq += xr[c] * xr[c];
        const float rinv = 1.0f / sqrtf(sq / (float)C + eps);
#pragma omp simd
        for (int64_t c = 0; c < C; c++)
            yr[c] = w[c] * (xr[c] * rinv);
    }
    return DIT_OK;
}

dit_status DIT_CPU_KERNEL(relative_bias)(dit_backend *be, const dit_tensor *y,
                                         const dit_tensor *table, const int32_t *buckets)
{
    if (!y || !table || !buckets || y->dtype != DIT_F32 || y->ndim != 3 ||
        !dit_tensor_is_contiguous(y) || table->dtype != DIT_F32 || table->ndim != 2 ||
        !dit_tensor_is_contiguous(table) || table->ne[1] != y->ne[0])
        return DIT_ERR_INVALID_ARG;
    const int64_t H = y->ne[0], Sq = y->ne[1], Skv = y->ne[2], nb = table->ne[0];
    if (H == 0 || Sq == 0 || Skv == 0)
        return DIT_OK;
    for (int64_t r = 0; r < Sq + Skv - 1; r++)
        if (buckets[r] < 0 || buckets[r] >= nb)
            return DIT_ERR_INVALID_ARG;
    const float *tab = table->data;
#pragma omp parallel for num_threads(dit_cpu_threads(be)) schedule(static)
    for (int64_t hi = 0; hi < H * Sq; hi++) {
        const int64_t h = hi / Sq, i = hi % Sq;
        float *row = (float *)y->data + hi * Skv;
        const int32_t *b = buckets + (Sq - 1 - i); /* b[j]: the bucket of j - i */
        for (int64_t j = 0; j < Skv; j++)
            row[j] = tab[(int64_t)b[j] * H + h];
    }
    return DIT_OK;
}

dit_status DIT_CPU_KERNEL(embedding)(dit_backend *be, const dit_tensor *y, const dit_tensor *table,
                                     const int32_t *ids, int64_t n)
{
    (void)be;
    if (!is_f32_rows(y) || y->ndim != 2 || table->ndim != 2 || table->dtype != DIT_F32 ||
        y->ne[0] != n || y->ne[1] != table->ne[1] || !dit_tensor_is_contiguous(table))
        return DIT_ERR_INVALID_ARG;
    const int64_t V = table->ne[0], C = table->ne[1];
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= V)
            return DIT_ERR_INVALID_ARG;
        memcpy(row_ptr(y, i), (const float *)table->data + (int64_t)ids[i] * C,
               (size_t)C * sizeof(float));
    }
    return DIT_OK;
}
