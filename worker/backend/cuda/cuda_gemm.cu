/* cuda backend: linear through cuBLASLt (bf16 x bf16 -> f32, compute 32F),
 * with bias / GELU epilogues, beta accumulation, and a plan cache so each
 * GEMM shape queries the heuristic once (the "fixed GEMM algorithm choices"
 * of warm-up, and a requirement for graph capture, which must not allocate).
 *
 * Layout: the backend's tensors are row-major, cuBLASLt is column-major. A
 * row-major (R, C) matrix is a column-major (C x R) one with the same
 * leading dimension, so y (M, N) = x (M, K) w (N, K)^T is computed as the
 * column-major y^T (N x M) = w (stored K x N, transposed) * x^T (K x M). */
#include <cstdlib>
#include <cstring>

#include "backend/cuda/cuda_internal.cuh"

/* ------------------------------------------------------------------------ */
/* Small kernels                                                             */

/* dst (rows, K) dense bf16 <- src rows (f32, f16 or bf16; dense rows). One
 * block per row. */
__global__ void k_rows_to_bf16(__nv_bfloat16 *dst, const cuda_view src, int64_t K)
{
    const int64_t r = blockIdx.x;
    const char *s = cuda_view_at(src, r, 0);
    __nv_bfloat16 *d = dst + r * K;
    if (src.dtype == DIT_F32) {
        const float *sf = (const float *)s;
        if (((uintptr_t)sf & 7) == 0 && (K & 1) == 0) {
            for (int64_t c = 2 * threadIdx.x; c < K; c += 2 * blockDim.x) {
                const float2 v = *(const float2 *)(sf + c);
                *(__nv_bfloat162 *)(d + c) = __floats2bfloat162_rn(v.x, v.y);
            }
        } else {
            for (int64_t c = threadIdx.x; c < K; c += blockDim.x)
                d[c] = __float2bfloat16_rn(sf[c]);
        }
    } else {
        for (int64_t c = threadIdx.x; c < K; c += blockDim.x)
            d[c] = __float2bfloat16_rn(cuda_load(s + c * src.nb[3], src.dtype));
    }
}

__device__ __forceinline__ float ld_d(const float *p)
{
    return *p;
}
__device__ __forceinline__ float ld_d(const __nv_bfloat16 *p)
{
    return __bfloat162float(*p);
}
__device__ __forceinline__ void st_d(float *p, float v)
{
    *p = v;
}
__device__ __forceinline__ void st_d(__nv_bfloat16 *p, float v)
{
    *p = __float2bfloat16_rn(v);
}

/* y = act(y + bias) over rows of N elements (f32 or bf16) with row stride
 * ldy. */
template <typename TD>
__global__ void k_bias_act(TD *y, int64_t rows, int64_t N, int64_t ldy, const float *bias, int act)
{
    const int64_t n = rows * N;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r, c;
        cuda_divmod(i, N, r, c);
        TD *p = y + r * ldy + c;
        float v = ld_d(p);
        if (bias)
            v += bias[c];
        st_d(p, cuda_act(v, act));
    }
}

template <typename TD>
__global__ void k_scale_rows(TD *y, int64_t rows, int64_t N, int64_t ldy, float beta)
{
    const int64_t n = rows * N;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r, c;
        cuda_divmod(i, N, r, c);
        TD *p = y + r * ldy + c;
        st_d(p, beta == 0.0f ? 0.0f : beta * ld_d(p));
    }
}

/* y (rows x N, ldy) = x (rows x N, dense) rounded to bf16 once. */
__global__ void k_round_rows_bf16(const float *x, int64_t rows, int64_t N, __nv_bfloat16 *y,
                                  int64_t ldy)
{
    const int64_t n = rows * N;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r, c;
        cuda_divmod(i, N, r, c);
        y[r * ldy + c] = __float2bfloat16_rn(x[i]);
    }
}

/* Fallback GEMM for shapes no cuBLASLt algorithm takes (column-major, like
 * cuBLASLt): D = op(A) op(B) + beta D + bias[row]. 16 x 16 tiles. */
enum { FB_T = 16 };

template <typename TD>
__global__ void k_gemm_fallback(bool transa, bool transb, int64_t m, int64_t n, int64_t k,
                                const __nv_bfloat16 *A, int64_t lda, const __nv_bfloat16 *B,
                                int64_t ldb, TD *D, int64_t ldc, const float *bias, float beta)
{
    __shared__ float As[FB_T][FB_T + 1];
    __shared__ float Bs[FB_T][FB_T + 1];
    /* Columns of D (n: tokens or pixels, possibly millions) on grid x,
     * whose limit is 2^31 - 1 blocks; rows (m: features) on grid y. */
    const int64_t i = blockIdx.y * (int64_t)FB_T + threadIdx.x; /* row of D */
    const int64_t j = blockIdx.x * (int64_t)FB_T + threadIdx.y; /* column of D */
    float acc = 0.0f;
    for (int64_t l0 = 0; l0 < k; l0 += FB_T) {
        /* As[x][y] = op(A)(row0 + x, l0 + y); Bs[x][y] = op(B)(l0 + x, col0 + y) */
        {
            const int64_t r = blockIdx.y * (int64_t)FB_T + threadIdx.x, l = l0 + threadIdx.y;
            float v = 0.0f;
            if (r < m && l < k)
                v = __bfloat162float(transa ? A[l + r * lda] : A[r + l * lda]);
            As[threadIdx.x][threadIdx.y] = v;
        }
        {
            const int64_t l = l0 + threadIdx.x, c = blockIdx.x * (int64_t)FB_T + threadIdx.y;
            float v = 0.0f;
            if (l < k && c < n)
                v = __bfloat162float(transb ? B[c + l * ldb] : B[l + c * ldb]);
            Bs[threadIdx.x][threadIdx.y] = v;
        }
        __syncthreads();
        for (int t = 0; t < FB_T; t++)
            acc += As[threadIdx.x][t] * Bs[t][threadIdx.y];
        __syncthreads();
    }
    if (i < m && j < n) {
        TD *p = D + i + j * ldc;
        float v = acc + (beta != 0.0f ? beta * ld_d(p) : 0.0f);
        if (bias)
            v += bias[i];
        st_d(p, v);
    }
}

/* Both element types of a GEMM output. */
static dit_status bias_act_t(dit_cuda_backend *cb, void *y, dit_dtype dt, int64_t rows, int64_t N,
                             int64_t ldy, const float *bias, dit_act act, const char *op)
{
    if (rows * N == 0 || (!bias && act == DIT_ACT_NONE))
        return DIT_OK;
    if (dt == DIT_BF16)
        DIT_CUDA_LAUNCH(k_bias_act<__nv_bfloat16>, cuda_blocks(rows * N, 256), 256, 0, cb->stream,
                        (__nv_bfloat16 *)y, rows, N, ldy, bias, (int)act);
    else
        DIT_CUDA_LAUNCH(k_bias_act<float>, cuda_blocks(rows * N, 256), 256, 0, cb->stream,
                        (float *)y, rows, N, ldy, bias, (int)act);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

dit_status dit_cuda_bias_act(dit_cuda_backend *cb, float *y, int64_t rows, int64_t N, int64_t ldy,
                             const float *bias, dit_act act, const char *op)
{
    return bias_act_t(cb, y, DIT_F32, rows, N, ldy, bias, act, op);
}

/* ------------------------------------------------------------------------ */
/* Plan cache and the cuBLASLt call                                          */

void dit_cuda_gemm_cache_clear(dit_cuda_backend *cb)
{
    for (size_t i = 0; i < cb->n_gemms; i++) {
        cuda_gemm_entry *e = &cb->gemms[i];
        if (e->op)
            cublasLtMatmulDescDestroy(e->op);
        if (e->a)
            cublasLtMatrixLayoutDestroy(e->a);
        if (e->b)
            cublasLtMatrixLayoutDestroy(e->b);
        if (e->c)
            cublasLtMatrixLayoutDestroy(e->c);
    }
    free(cb->gemms);
    cb->gemms = NULL;
    cb->n_gemms = cb->cap_gemms = 0;
}

static int ptr_align(const void *p)
{
    const uintptr_t v = (uintptr_t)p;
    if ((v & 15) == 0)
        return 16;
    if ((v & 7) == 0)
        return 8;
    if ((v & 3) == 0)
        return 4;
    return 2;
}

static bool key_eq(const cuda_gemm_entry *e, const cuda_gemm_entry *k)
{
    return e->transa == k->transa && e->transb == k->transb && e->m == k->m && e->n == k->n &&
           e->k == k->k && e->lda == k->lda && e->ldb == k->ldb && e->ldc == k->ldc &&
           e->epilogue == k->epilogue && e->align == k->align && e->has_beta == k->has_beta &&
           e->bias_align == k->bias_align && e->d_bf16 == k->d_bf16;
}

/* Asks the heuristic for e's descriptors as they are now; true when it
 * offers an algorithm (stored in e->algo). */
static dit_status gemm_query(dit_cuda_backend *cb, cuda_gemm_entry *e, bool *found_out,
                             const char *op)
{
    *found_out = false;
    cublasLtMatmulPreference_t pref = NULL;
    LT_TRY(cb, op, cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = cb->lt_ws_bytes;
    const uint32_t al = (uint32_t)e->align;
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                 &al, sizeof al);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                 &al, sizeof al);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                 &al, sizeof al);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                 &al, sizeof al);
    if (s != CUBLAS_STATUS_SUCCESS) {
        cublasLtMatmulPreferenceDestroy(pref);
        return dit_cuda_fail_lt(cb, s, op, "cublasLtMatmulPreferenceSetAttribute");
    }
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    int found = 0;
    s = cublasLtMatmulAlgoGetHeuristic(cb->lt, e->op, e->a, e->b, e->c, e->c, pref, 1, &res,
                                       &found);
    cublasLtMatmulPreferenceDestroy(pref);
    /* No algorithm (NOT_SUPPORTED or zero results) is not an error: the
     * caller tries the next mode. */
    if (s == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS) {
        e->algo = res.algo;
        *found_out = true;
    }
    return DIT_OK;
}

static const char *mode_words(int mode)
{
    return mode == CUDA_GEMM_PLAIN ? "cuBLASLt without its fused epilogue (bias/activation in "
                                     "a separate pass)"
                                   : "the CUDA-core fallback kernel (much slower)";
}

/* Once per shape: a GEMM that runs slower than it should says so, because
 * nothing else would show it. Forced modes (tests) are deliberate. */
static void gemm_warn(dit_cuda_backend *cb, const cuda_gemm_entry *e, const char *op,
                      const char *why)
{
    if (cb->gemm_force != DIT_CUDA_GEMM_AUTO)
        return;
    fprintf(stderr,
            "cuda backend: warning: %s: GEMM m %lld n %lld k %lld (lda %lld ldb %lld ldc %lld, "
            "epilogue %d, alignment %d, beta %d) %s; it runs on %s from now on\n",
            op, (long long)e->m, (long long)e->n, (long long)e->k, (long long)e->lda,
            (long long)e->ldb, (long long)e->ldc, e->epilogue, e->align, (int)e->has_beta, why,
            mode_words(e->mode));
}

/* Moves e to the next slower mode that has an algorithm: FUSED -> PLAIN
 * (the same descriptor with the default epilogue) -> FALLBACK. */
static dit_status gemm_demote(dit_cuda_backend *cb, cuda_gemm_entry *e, const char *op)
{
    if (e->mode == CUDA_GEMM_FUSED && e->epilogue != CUBLASLT_EPILOGUE_DEFAULT &&
        cb->gemm_force != DIT_CUDA_GEMM_FALLBACK) {
        const cublasLtEpilogue_t plain = CUBLASLT_EPILOGUE_DEFAULT;
        LT_TRY(cb, op,
               cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &plain,
                                              sizeof plain));
        bool found = false;
        dit_status st = gemm_query(cb, e, &found, op);
        if (st != DIT_OK)
            return st;
        if (found) {
            e->mode = CUDA_GEMM_PLAIN;
            return DIT_OK;
        }
    }
    e->mode = CUDA_GEMM_FALLBACK;
    return DIT_OK;
}

/* Builds descriptors and asks the heuristic once for this key, stepping
 * down a mode when it has nothing. */
static dit_status gemm_plan(dit_cuda_backend *cb, cuda_gemm_entry *e, const float *bias,
                            const char *op)
{
    const cublasOperation_t ta = e->transa ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = e->transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasLtEpilogue_t epi = cb->gemm_force == DIT_CUDA_GEMM_AUTO
                                       ? (cublasLtEpilogue_t)e->epilogue
                                       : CUBLASLT_EPILOGUE_DEFAULT;
    const cudaDataType_t bias_type = CUDA_R_32F;
    LT_TRY(cb, op, cublasLtMatmulDescCreate(&e->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_TRY(cb, op,
           cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_TRY(cb, op,
           cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    LT_TRY(cb, op,
           cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (epi & CUBLASLT_EPILOGUE_BIAS)
        LT_TRY(cb, op,
               cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                              &bias_type, sizeof bias_type));
    /* Stored shapes: A is (k x m) when transposed, B (n x k) when transposed. */
    LT_TRY(cb, op,
           cublasLtMatrixLayoutCreate(&e->a, CUDA_R_16BF, e->transa ? e->k : e->m,
                                      e->transa ? e->m : e->k, e->lda));
    LT_TRY(cb, op,
           cublasLtMatrixLayoutCreate(&e->b, CUDA_R_16BF, e->transb ? e->n : e->k,
                                      e->transb ? e->k : e->n, e->ldb));
    LT_TRY(cb, op,
           cublasLtMatrixLayoutCreate(&e->c, e->d_bf16 ? CUDA_R_16BF : CUDA_R_32F, e->m, e->n,
                                      e->ldc));

    /* The heuristic reads the bias pointer's alignment (cublasLt.h), so it
     * sees the real one; bias_align in the key keeps it valid for reuse. */
    if (bias && (epi & CUBLASLT_EPILOGUE_BIAS))
        LT_TRY(cb, op,
               cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                              sizeof bias));
    e->mode = epi == (cublasLtEpilogue_t)e->epilogue ? CUDA_GEMM_FUSED : CUDA_GEMM_PLAIN;
    if (cb->gemm_force == DIT_CUDA_GEMM_FALLBACK) {
        e->mode = CUDA_GEMM_FALLBACK;
    } else {
        bool found = false;
        dit_status st = gemm_query(cb, e, &found, op);
        if (st != DIT_OK)
            return st;
        if (!found) {
            st = gemm_demote(cb, e, op);
            if (st != DIT_OK)
                return st;
            gemm_warn(cb, e, op, "has no cuBLASLt algorithm");
        }
    }
    cb->stats.gemm_shapes++;
    if (e->mode == CUDA_GEMM_PLAIN && e->epilogue != CUBLASLT_EPILOGUE_DEFAULT)
        cb->stats.gemm_unfused_shapes++;
    if (e->mode == CUDA_GEMM_FALLBACK)
        cb->stats.gemm_fallback_shapes++;
    return DIT_OK;
}

static dit_status gemm_lookup(dit_cuda_backend *cb, const cuda_gemm_entry *key, const float *bias,
                              cuda_gemm_entry **out, const char *op)
{
    for (size_t i = 0; i < cb->n_gemms; i++) {
        if (key_eq(&cb->gemms[i], key)) {
            *out = &cb->gemms[i];
            return DIT_OK;
        }
    }
    if (cb->n_gemms == cb->cap_gemms) {
        size_t cap = cb->cap_gemms ? cb->cap_gemms * 2 : 32;
        cuda_gemm_entry *n = (cuda_gemm_entry *)realloc(cb->gemms, cap * sizeof *n);
        if (!n)
            return dit_cuda_bad(cb, DIT_ERR_NOMEM, op, "gemm plan cache: out of memory");
        cb->gemms = n;
        cb->cap_gemms = cap;
    }
    cuda_gemm_entry *e = &cb->gemms[cb->n_gemms];
    *e = *key;
    e->op = NULL;
    e->a = e->b = e->c = NULL;
    e->mode = CUDA_GEMM_FALLBACK;
    dit_status st = gemm_plan(cb, e, bias, op);
    if (st != DIT_OK) {
        if (e->op)
            cublasLtMatmulDescDestroy(e->op);
        if (e->a)
            cublasLtMatrixLayoutDestroy(e->a);
        if (e->b)
            cublasLtMatrixLayoutDestroy(e->b);
        if (e->c)
            cublasLtMatrixLayoutDestroy(e->c);
        return st;
    }
    cb->n_gemms++;
    *out = e;
    return DIT_OK;
}

dit_status dit_cuda_gemm(dit_cuda_backend *cb, bool transa, bool transb, int64_t m, int64_t n,
                         int64_t k, const __nv_bfloat16 *A, int64_t lda, const __nv_bfloat16 *B,
                         int64_t ldb, float *D, int64_t ldc, const float *bias, dit_act act,
                         float beta, const char *op)
{
    return dit_cuda_gemm_t(cb, transa, transb, m, n, k, A, lda, B, ldb, D, DIT_F32, ldc, bias, act,
                           beta, op);
}

dit_status dit_cuda_gemm_t(dit_cuda_backend *cb, bool transa, bool transb, int64_t m, int64_t n,
                           int64_t k, const __nv_bfloat16 *A, int64_t lda, const __nv_bfloat16 *B,
                           int64_t ldb, void *D, dit_dtype dt, int64_t ldc, const float *bias,
                           dit_act act, float beta, const char *op)
{
    if (m == 0 || n == 0)
        return DIT_OK;
    const bool d_bf16 = dt == DIT_BF16;
    if (k == 0) {
        if (d_bf16)
            DIT_CUDA_LAUNCH(k_scale_rows<__nv_bfloat16>, cuda_blocks(m * n, 256), 256, 0,
                            cb->stream, (__nv_bfloat16 *)D, n, m, ldc, beta);
        else
            DIT_CUDA_LAUNCH(k_scale_rows<float>, cuda_blocks(m * n, 256), 256, 0, cb->stream,
                            (float *)D, n, m, ldc, beta);
        CUDA_LAUNCHED(cb, op);
        /* D is column-major m x n: its "rows" for bias_act are the n columns. */
        return bias_act_t(cb, D, dt, n, m, ldc, bias, act, op);
    }
    if (d_bf16 && (bias || act != DIT_ACT_NONE)) {
        /* A bf16 output with a bias or an activation. cuBLASLt takes the bias
         * only in D's type (cublasLt.h, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE),
         * so an f32 bias with a bf16 D has no algorithm at all; and a bias or
         * GELU applied after a bf16 store rounds twice. So the GEMM writes f32
         * with its epilogue fused exactly as on the f32 path, and one pass
         * rounds the result into D: a single rounding, the f32 path's numbers
         * rounded once. (A bf16 y never has beta: the backend refuses it.) */
        void *tmp = NULL;
        dit_status st =
            dit_cuda_scratch(cb, CUDA_SCRATCH_OUT, (size_t)(m * n) * sizeof(float), &tmp, op);
        if (st == DIT_OK)
            st = dit_cuda_gemm_t(cb, transa, transb, m, n, k, A, lda, B, ldb, tmp, DIT_F32, m, bias,
                                 act, 0.0f, op);
        if (st != DIT_OK)
            return st;
        /* D is column-major m x n: n "rows" of m elements, ldc apart. */
        DIT_CUDA_LAUNCH(k_round_rows_bf16, cuda_blocks(m * n, 256), 256, 0, cb->stream,
                        (const float *)tmp, n, m, (__nv_bfloat16 *)D, ldc);
        CUDA_LAUNCHED(cb, op);
        return DIT_OK;
    }
    const bool fuse_gelu = act == DIT_ACT_GELU_TANH && cb->lt_gelu;
    cuda_gemm_entry key;
    memset(&key, 0, sizeof key);
    key.transa = transa;
    key.transb = transb;
    key.m = m;
    key.n = n;
    key.k = k;
    key.lda = lda;
    key.ldb = ldb;
    key.ldc = ldc;
    key.epilogue = bias ? (fuse_gelu ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_BIAS)
                        : (fuse_gelu ? CUBLASLT_EPILOGUE_GELU : CUBLASLT_EPILOGUE_DEFAULT);
    int al = ptr_align(A);
    al = ptr_align(B) < al ? ptr_align(B) : al;
    al = ptr_align(D) < al ? ptr_align(D) : al;
    key.align = al;
    key.has_beta = beta != 0.0f;
    key.bias_align = bias ? ptr_align(bias) : 0;
    key.d_bf16 = d_bf16;
    cuda_gemm_entry *e = NULL;
    dit_status st = gemm_lookup(cb, &key, bias, &e, op);
    if (st != DIT_OK)
        return st;
    cb->stats.gemm_calls++;
    while (e->mode != CUDA_GEMM_FALLBACK) {
        if (bias && e->mode == CUDA_GEMM_FUSED)
            LT_TRY(cb, op,
                   cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                  sizeof bias));
        const float alpha = 1.0f;
        const cublasStatus_t ms =
            cublasLtMatmul(cb->lt, e->op, &alpha, A, e->a, B, e->b, &beta, D, e->c, D, e->c,
                           &e->algo, cb->lt_ws, cb->lt_ws_bytes, cb->stream);
        if (ms == CUBLAS_STATUS_SUCCESS)
            break;
        /* An algorithm the heuristic offered but the run refuses: nothing
         * was enqueued, so the next mode may run it now. */
        if (ms != CUBLAS_STATUS_NOT_SUPPORTED && ms != CUBLAS_STATUS_INVALID_VALUE)
            return dit_cuda_fail_lt(cb, ms, op, "cublasLtMatmul");
        const int was = e->mode;
        st = gemm_demote(cb, e, op);
        if (st != DIT_OK)
            return st;
        if (was == CUDA_GEMM_FUSED && e->mode == CUDA_GEMM_PLAIN &&
            e->epilogue != CUBLASLT_EPILOGUE_DEFAULT)
            cb->stats.gemm_unfused_shapes++;
        if (e->mode == CUDA_GEMM_FALLBACK)
            cb->stats.gemm_fallback_shapes++;
        gemm_warn(cb, e, op, "was refused by cublasLtMatmul");
    }
    /* What the GEMM itself did not apply runs as one pass over D. */
    const float *post_bias = NULL;
    dit_act post = act;
    if (e->mode == CUDA_GEMM_FUSED) {
        if (fuse_gelu)
            post = DIT_ACT_NONE;
    } else if (e->mode == CUDA_GEMM_PLAIN) {
        post_bias = bias;
        if (e->epilogue != CUBLASLT_EPILOGUE_DEFAULT)
            cb->stats.gemm_unfused_calls++;
    } else {
        dim3 grid((unsigned)((n + FB_T - 1) / FB_T), (unsigned)((m + FB_T - 1) / FB_T));
        if (d_bf16)
            DIT_CUDA_LAUNCH(k_gemm_fallback<__nv_bfloat16>, grid, dim3(FB_T, FB_T), 0, cb->stream,
                            transa, transb, m, n, k, A, lda, B, ldb, (__nv_bfloat16 *)D, ldc, bias,
                            beta);
        else
            DIT_CUDA_LAUNCH(k_gemm_fallback<float>, grid, dim3(FB_T, FB_T), 0, cb->stream, transa,
                            transb, m, n, k, A, lda, B, ldb, (float *)D, ldc, bias, beta);
        CUDA_LAUNCHED(cb, op);
        cb->stats.gemm_fallback_calls++;
    }
    return bias_act_t(cb, D, dt, n, m, ldc, post_bias, post, op);
}

extern "C" dit_status dit_cuda_backend_force_gemm(dit_backend *be, dit_cuda_gemm_force force)
{
    if (!dit_backend_is_cuda(be))
        return DIT_ERR_INVALID_ARG;
    dit_cuda_backend *cb = cuda_of(be);
    if (cb->capturing)
        return dit_cuda_bad(cb, DIT_ERR_UNSUPPORTED, "force_gemm", "during graph capture");
    cb->gemm_force = (int)force;
    dit_cuda_gemm_cache_clear(cb);
    return DIT_OK;
}

extern "C" void dit_cuda_backend_stats(dit_backend *be, dit_cuda_stats *out)
{
    memset(out, 0, sizeof *out);
    if (dit_backend_is_cuda(be))
        *out = cuda_of(be)->stats;
}

extern "C" void dit_cuda_backend_reset_stats(dit_backend *be)
{
    if (dit_backend_is_cuda(be))
        memset(&cuda_of(be)->stats, 0, sizeof cuda_of(be)->stats);
}

/* ------------------------------------------------------------------------ */
/* Operands                                                                  */

dit_status dit_cuda_as_bf16(dit_cuda_backend *cb, const dit_tensor *t, int slot,
                            const __nv_bfloat16 **out, const char *op)
{
    if (t->dtype == DIT_BF16 && dit_tensor_is_contiguous(t)) {
        *out = (const __nv_bfloat16 *)t->data;
        return DIT_OK;
    }
    if (!dit_tensor_rows_dense(t) || !cuda_view_ok(t))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "operand rows must be dense");
    const cuda_view v = cuda_view_of(t);
    const int64_t rows = cuda_view_rows(v), cols = v.ne[3];
    void *p = NULL;
    dit_status st = dit_cuda_scratch(cb, slot, (size_t)(rows * cols) * 2 + 16, &p, op);
    if (st != DIT_OK)
        return st;
    if (rows * cols > 0) {
        DIT_CUDA_LAUNCH(k_rows_to_bf16, (unsigned)rows, 256, 0, cb->stream, (__nv_bfloat16 *)p, v,
                        cols);
        CUDA_LAUNCHED(cb, op);
    }
    *out = (const __nv_bfloat16 *)p;
    return DIT_OK;
}

/* f32 or bf16 with dense rows. */
static bool is_act_rows(const dit_tensor *t)
{
    return t && (t->dtype == DIT_F32 || t->dtype == DIT_BF16) && t->ndim >= 1 &&
           dit_tensor_rows_dense(t);
}

extern "C" dit_status dit_cuda_linear(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                      const dit_tensor *w, const dit_tensor *bias, dit_act act,
                                      float beta)
{
    dit_cuda_backend *cb = cuda_of(be);
    const char *op = "linear";
    if (!is_act_rows(x) || !is_act_rows(y) || !w || w->ndim != 2 ||
        (w->dtype != DIT_BF16 && w->dtype != DIT_F32) || !dit_tensor_is_contiguous(w))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op,
                            "x, y must be f32 or bf16 with dense rows and w a contiguous 2-D "
                            "bf16/f32");
    if (x->ndim != y->ndim || (x->ndim != 2 && x->ndim != 3))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "x and y must both be 2-D or 3-D");
    if (beta != 0.0f && act != DIT_ACT_NONE)
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "beta != 0 needs act NONE");
    if (beta != 0.0f && y->dtype != DIT_F32)
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "beta != 0 needs an f32 y");
    const int nd = x->ndim;
    const int64_t K = x->ne[nd - 1], M = x->ne[nd - 2], N = w->ne[0];
    const int64_t B = nd == 3 ? x->ne[0] : 1;
    if (w->ne[1] != K || y->ne[nd - 1] != N || y->ne[nd - 2] != M || (nd == 3 && y->ne[0] != B))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op,
                            "shapes: x (.., %lld, %lld), w (%lld, %lld), y (.., %lld, %lld)",
                            (long long)M, (long long)K, (long long)w->ne[0], (long long)w->ne[1],
                            (long long)y->ne[nd - 2], (long long)y->ne[nd - 1]);
    if (bias && (bias->dtype != DIT_F32 || bias->ndim != 1 || bias->ne[0] != N ||
                 !dit_tensor_is_contiguous(bias)))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "bias must be f32 (N) contiguous");
    if (M == 0 || N == 0 || B == 0)
        return DIT_OK;
    const float *bp = bias ? (const float *)bias->data : NULL;
    const int64_t ye = y->dtype == DIT_F32 ? 4 : 2;
    if (y->nb[nd - 2] % ye != 0 || (nd == 3 && y->nb[0] % ye != 0))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "y's strides are not whole elements");
    const int64_t ldy = y->nb[nd - 2] / ye;

    /* x as the GEMM's bf16 B operand: (B, M) columns of K with leading
     * dimension ldx and batch stride xbs, in elements. A bf16 x (the fast
     * path) is used where it lies; an f32 one is rounded into a dense
     * scratch copy first (the pass the fast path saves). */
    const __nv_bfloat16 *xb = NULL, *wb = NULL;
    int64_t ldx = K, xbs = M * K;
    bool x_even = true; /* the B M columns evenly spaced: one GEMM can take all */
    dit_status st = DIT_OK;
    if (K > 0) {
        if (x->dtype == DIT_BF16 && x->nb[nd - 2] % 2 == 0 && (nd == 2 || x->nb[0] % 2 == 0) &&
            x->nb[nd - 2] / 2 >= K) {
            xb = (const __nv_bfloat16 *)x->data;
            ldx = x->nb[nd - 2] / 2;
            xbs = nd == 3 ? x->nb[0] / 2 : 0;
            x_even = B == 1 || xbs == M * ldx;
        } else {
            const cuda_view xv = cuda_view_of(x);
            void *p = NULL;
            st = dit_cuda_scratch(cb, CUDA_SCRATCH_X, (size_t)(B * M * K) * 2 + 16, &p, op);
            if (st != DIT_OK)
                return st;
            const int slot = dit_cuda_prof_begin(cb, CUDA_PROF_CAST);
            DIT_CUDA_LAUNCH(k_rows_to_bf16, (unsigned)(B * M), 256, 0, cb->stream,
                            (__nv_bfloat16 *)p, xv, K);
            dit_cuda_prof_end(cb, slot);
            CUDA_LAUNCHED(cb, op);
            xb = (const __nv_bfloat16 *)p;
        }
        const int slot = w->dtype == DIT_BF16 ? -1 : dit_cuda_prof_begin(cb, CUDA_PROF_CAST);
        st = dit_cuda_as_bf16(cb, w, CUDA_SCRATCH_W, &wb, op);
        dit_cuda_prof_end(cb, slot);
        if (st != DIT_OK)
            return st;
    }
    const bool fold = B == 1 || (y->nb[0] == M * y->nb[1] && x_even);
    const int slot = dit_cuda_prof_begin(cb, CUDA_PROF_GEMM);
    if (fold) {
        st = dit_cuda_gemm_t(cb, true, false, N, B * M, K, wb, K, xb, ldx, y->data, y->dtype, ldy,
                             bp, act, beta, op);
    } else {
        for (int64_t b = 0; b < B && st == DIT_OK; b++)
            st = dit_cuda_gemm_t(cb, true, false, N, M, K, wb, K, xb ? xb + b * xbs : NULL, ldx,
                                 (char *)y->data + b * y->nb[0], y->dtype, ldy, bp, act, beta, op);
    }
    dit_cuda_prof_end(cb, slot);
    return st;
}
