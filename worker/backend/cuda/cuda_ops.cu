/* cuda backend: the row-wise f32 ops (activations, LayerNorm with
 * modulation, LayerNorm, RMSNorm, fused RMSNorm + RoPE, gated residuals,
 * embedding) and the VAE's image ops (conv2d as im2col + cuBLASLt,
 * GroupNorm with optional SiLU, nearest 2x upsampling). Each mirrors its
 * reference in backend/cpu; reductions run in f32 (GroupNorm in f64, as the
 * cpu backend does). */
#include <cmath>

#include "backend/cuda/cuda_internal.cuh"

static bool is_f32_rows(const dit_tensor *t)
{
    return t && t->dtype == DIT_F32 && t->ndim >= 1 && dit_tensor_rows_dense(t);
}

/* (B, C) modulation vector with dense rows. */
static bool is_batch_vec(const dit_tensor *t, int64_t B, int64_t C)
{
    return t->dtype == DIT_F32 && t->ndim == 2 && t->ne[0] == B && t->ne[1] == C &&
           dit_tensor_rows_dense(t);
}

/* Sum over the block (blockDim.x a multiple of 32, <= 1024). Every thread
 * gets the result. `red` holds 32 floats. */
__device__ float block_sum(float v, float *red)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    __syncthreads(); /* red may still be read from a previous call */
    if (lane == 0)
        red[wid] = v;
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    v = lane < nw ? red[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* f32 results stored as f32 or rounded to bf16. */
__device__ __forceinline__ void st_out(float *p, float v)
{
    *p = v;
}
__device__ __forceinline__ void st_out(__nv_bfloat16 *p, float v)
{
    *p = __float2bfloat16_rn(v);
}

/* ------------------------------------------------------------------------ */
/* Activations                                                               */

__global__ void k_activate(cuda_view y, const cuda_view x, int act)
{
    const int64_t cols = x.ne[3];
    const int64_t n = cuda_view_rows(x) * cols;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r, c;
        cuda_divmod(i, cols, r, c);
        const float v = *(const float *)cuda_view_at(x, r, c);
        *(float *)cuda_view_at(y, r, c) = cuda_act(v, act);
    }
}

extern "C" dit_status dit_cuda_activate(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                        dit_act act)
{
    dit_cuda_backend *cb = cuda_of(be);
    if (!is_f32_rows(x) || !is_f32_rows(y) || !dit_tensor_same_shape(x, y) || !cuda_view_ok(x) ||
        !cuda_view_ok(y))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, "activate", "x, y: same shape, f32 rows");
    const int64_t n = dit_tensor_numel(x);
    if (n == 0 || (act == DIT_ACT_NONE && x->data == y->data && dit_tensor_is_contiguous(x)))
        return DIT_OK;
    DIT_CUDA_LAUNCH(k_activate, cuda_blocks(n, 256), 256, 0, cb->stream, cuda_view_of(y),
                    cuda_view_of(x), (int)act);
    CUDA_LAUNCHED(cb, "activate");
    return DIT_OK;
}

/* ------------------------------------------------------------------------ */
/* Norms                                                                     */

/* y = (x - mean) rstd [* w or * (1 + scale)] [+ b or + shift]. One block
 * per row. mod: shift/scale are per-batch rows (b = row / S); otherwise
 * w/b are (C) affine parameters. y is f32, or bf16 for a GEMM's input. */
template <typename TO>
__global__ void k_layer_norm(cuda_view y, const cuda_view x, int64_t S, const float *p1,
                             int64_t p1_stride, const float *p2, int64_t p2_stride, float eps,
                             bool mod)
{
    __shared__ float red[32];
    const int64_t r = blockIdx.x, C = x.ne[3];
    const float *xr = (const float *)cuda_view_at(x, r, 0);
    TO *yr = (TO *)cuda_view_row(y, r);
    float s = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        s += xr[c];
    const float mean = block_sum(s, red) / (float)C;
    float q = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        const float d = xr[c] - mean;
        q += d * d;
    }
    const float rstd = 1.0f / sqrtf(block_sum(q, red) / (float)C + eps);
    const int64_t b = r / S;
    const float *sh = mod ? (p1 ? p1 + b * p1_stride : NULL) : p2;
    const float *sc = mod ? (p2 ? p2 + b * p2_stride : NULL) : p1;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float v = (xr[c] - mean) * rstd;
        if (mod) {
            if (sc)
                v *= 1.0f + sc[c];
            if (sh)
                v += sh[c];
        } else {
            if (sc)
                v *= sc[c];
            if (sh)
                v += sh[c];
        }
        st_out(yr + c, v);
    }
}

static int row_threads(int64_t C)
{
    return C >= 1024 ? 512 : (C >= 256 ? 256 : (C >= 64 ? 64 : 32));
}

extern "C" dit_status dit_cuda_layer_norm_mod(dit_backend *be, const dit_tensor *y,
                                              const dit_tensor *x, const dit_tensor *shift,
                                              const dit_tensor *scale, float eps)
{
    dit_cuda_backend *cb = cuda_of(be);
    const char *op = "layer_norm_mod";
    const bool y_ok = y && y->ndim == 3 && dit_tensor_rows_dense(y) &&
                      (y->dtype == DIT_F32 || y->dtype == DIT_BF16);
    if (!is_f32_rows(x) || !y_ok || x->ndim != 3 || !dit_tensor_same_shape(x, y))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op,
                            "x must be (B, S, C) f32, y the same shape f32 or bf16");
    const int64_t B = x->ne[0], S = x->ne[1], C = x->ne[2];
    if ((shift && !is_batch_vec(shift, B, C)) || (scale && !is_batch_vec(scale, B, C)))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "shift, scale must be (B, C) f32");
    if (B * S == 0)
        return DIT_OK;
    const float *shp = shift ? (const float *)shift->data : NULL;
    const float *scp = scale ? (const float *)scale->data : NULL;
    const int64_t shl = shift ? shift->nb[0] / 4 : 0, scl = scale ? scale->nb[0] / 4 : 0;
    if (y->dtype == DIT_BF16)
        DIT_CUDA_LAUNCH(k_layer_norm<__nv_bfloat16>, (unsigned)(B * S), row_threads(C), 0,
                        cb->stream, cuda_view_of(y), cuda_view_of(x), S, shp, shl, scp, scl, eps,
                        true);
    else
        DIT_CUDA_LAUNCH(k_layer_norm<float>, (unsigned)(B * S), row_threads(C), 0, cb->stream,
                        cuda_view_of(y), cuda_view_of(x), S, shp, shl, scp, scl, eps, true);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

extern "C" dit_status dit_cuda_layer_norm(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                          const dit_tensor *weight, const dit_tensor *bias,
                                          float eps)
{
    dit_cuda_backend *cb = cuda_of(be);
    const char *op = "layer_norm";
    if (!is_f32_rows(x) || !is_f32_rows(y) || x->ndim != 3 || !dit_tensor_same_shape(x, y))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "x, y must be (B, S, C) f32");
    const int64_t C = x->ne[2];
    if ((weight && (weight->ndim != 1 || weight->ne[0] != C || weight->dtype != DIT_F32)) ||
        (bias && (bias->ndim != 1 || bias->ne[0] != C || bias->dtype != DIT_F32)))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "weight, bias must be (C) f32");
    const int64_t rows = x->ne[0] * x->ne[1];
    if (rows == 0)
        return DIT_OK;
    DIT_CUDA_LAUNCH(k_layer_norm<float>, (unsigned)rows, row_threads(C), 0, cb->stream,
                    cuda_view_of(y), cuda_view_of(x), 1,
                    weight ? (const float *)weight->data : NULL, 0,
                    bias ? (const float *)bias->data : NULL, 0, eps, false);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

__global__ void k_rms_norm(cuda_view y, const cuda_view x, const float *w, float eps)
{
    __shared__ float red[32];
    const int64_t r = blockIdx.x, C = x.ne[3];
    const float *xr = (const float *)cuda_view_at(x, r, 0);
    float *yr = (float *)cuda_view_at(y, r, 0);
    float q = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        q += xr[c] * xr[c];
    const float rinv = 1.0f / sqrtf(block_sum(q, red) / (float)C + eps);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        yr[c] = w[c] * (xr[c] * rinv);
}

extern "C" dit_status dit_cuda_rms_norm(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                        const dit_tensor *weight, float eps)
{
    dit_cuda_backend *cb = cuda_of(be);
    const char *op = "rms_norm";
    if (!is_f32_rows(x) || !is_f32_rows(y) || x->ndim != 3 || !dit_tensor_same_shape(x, y))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "x, y must be (B, S, C) f32");
    const int64_t C = x->ne[2];
    if (!weight || weight->ndim != 1 || weight->ne[0] != C || weight->dtype != DIT_F32)
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "weight must be (C) f32");
    const int64_t rows = x->ne[0] * x->ne[1];
    if (rows == 0)
        return DIT_OK;
    DIT_CUDA_LAUNCH(k_rms_norm, (unsigned)rows, row_threads(C), 0, cb->stream, cuda_view_of(y),
                    cuda_view_of(x), (const float *)weight->data, eps);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

/* One warp per (b, s, h) row of D: RMSNorm over D, then RoPE on the
 * interleaved pairs, from x (f32) into y (TO; may be x itself: every lane
 * has read the whole row for the norm before any lane writes). Rows per
 * block: 4 warps. */
template <typename TO>
__global__ void k_rms_norm_rope(cuda_view y, const cuda_view x, int64_t S, int64_t H,
                                const float *w, float eps, const float *cosp, int64_t cos_ld,
                                const float *sinp, int64_t sin_ld, int64_t rows)
{
    const int64_t r = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows)
        return;
    const int lane = threadIdx.x & 31;
    const int64_t D = x.ne[3];
    const float *xr = (const float *)cuda_view_row(x, r);
    TO *yr = (TO *)cuda_view_row(y, r);
    float q = 0.0f;
    for (int64_t d = lane; d < D; d += 32)
        q += xr[d] * xr[d];
    for (int o = 16; o > 0; o >>= 1)
        q += __shfl_xor_sync(0xffffffffu, q, o);
    const float rinv = 1.0f / sqrtf(q / (float)D + eps);
    const int64_t s = (r / H) % S;
    if (cosp) {
        const float *cr = cosp + s * cos_ld, *sr = sinp + s * sin_ld;
        for (int64_t p = lane; 2 * p + 1 < D; p += 32) {
            const int64_t d = 2 * p;
            float a = xr[d] * rinv, b = xr[d + 1] * rinv;
            if (w) {
                a *= w[d];
                b *= w[d + 1];
            }
            st_out(yr + d, a * cr[d] - b * sr[d]);
            st_out(yr + d + 1, b * cr[d + 1] + a * sr[d + 1]);
        }
    } else {
        for (int64_t d = lane; d < D; d += 32)
            st_out(yr + d, w ? xr[d] * rinv * w[d] : xr[d] * rinv);
    }
}

static dit_status rms_norm_rope_core(dit_cuda_backend *cb, const char *op, const dit_tensor *y,
                                     const dit_tensor *x, const dit_tensor *weight, float eps,
                                     const dit_tensor *cos, const dit_tensor *sin)
{
    if (!is_f32_rows(x) || x->ndim != 4)
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "x must be (B, S, H, D) f32");
    if (!dit_tensor_same_shape(x, y) || !dit_tensor_rows_dense(y) ||
        (y->dtype != DIT_F32 && y->dtype != DIT_BF16))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "y must be x's shape, f32 or bf16");
    const int64_t B = x->ne[0], S = x->ne[1], H = x->ne[2], D = x->ne[3];
    if (weight && (weight->dtype != DIT_F32 || weight->ndim != 1 || weight->ne[0] != D))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "weight must be (D) f32");
    if ((cos == NULL) != (sin == NULL))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "cos and sin go together");
    if (cos &&
        (!is_f32_rows(cos) || !is_f32_rows(sin) || cos->ndim != 2 || sin->ndim != 2 ||
         cos->ne[0] != S || cos->ne[1] != D || !dit_tensor_same_shape(cos, sin) || D % 2 != 0))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "cos, sin must be (S, D) f32, D even");
    const int64_t rows = B * S * H;
    if (rows == 0)
        return DIT_OK;
    const int warps = 4;
    const unsigned blocks = (unsigned)((rows + warps - 1) / warps);
    const float *wp = weight ? (const float *)weight->data : NULL;
    const float *cp = cos ? (const float *)cos->data : NULL,
                *sp = sin ? (const float *)sin->data : NULL;
    const int64_t cld = cos ? cos->nb[0] / 4 : 0, sld = sin ? sin->nb[0] / 4 : 0;
    if (y->dtype == DIT_BF16)
        DIT_CUDA_LAUNCH(k_rms_norm_rope<__nv_bfloat16>, blocks, 32 * warps, 0, cb->stream,
                        cuda_view_of(y), cuda_view_of(x), S, H, wp, eps, cp, cld, sp, sld, rows);
    else
        DIT_CUDA_LAUNCH(k_rms_norm_rope<float>, blocks, 32 * warps, 0, cb->stream, cuda_view_of(y),
                        cuda_view_of(x), S, H, wp, eps, cp, cld, sp, sld, rows);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

extern "C" dit_status dit_cuda_rms_norm_rope(dit_backend *be, const dit_tensor *x,
                                             const dit_tensor *weight, float eps,
                                             const dit_tensor *cos, const dit_tensor *sin)
{
    return rms_norm_rope_core(cuda_of(be), "rms_norm_rope", x, x, weight, eps, cos, sin);
}

extern "C" dit_status dit_cuda_rms_norm_rope_to(dit_backend *be, const dit_tensor *y,
                                                const dit_tensor *x, const dit_tensor *weight,
                                                float eps, const dit_tensor *cos,
                                                const dit_tensor *sin)
{
    return rms_norm_rope_core(cuda_of(be), "rms_norm_rope_to", y, x, weight, eps, cos, sin);
}

/* ------------------------------------------------------------------------ */
/* Residuals and embedding                                                   */

__global__ void k_gated_add(cuda_view res, const cuda_view x, int64_t S, const float *gate,
                            int64_t gate_ld)
{
    const int64_t C = res.ne[3];
    const int64_t n = cuda_view_rows(res) * C;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r, c;
        cuda_divmod(i, C, r, c);
        float *rp = (float *)cuda_view_at(res, r, c);
        const float xv = *(const float *)cuda_view_at(x, r, c);
        *rp += gate ? gate[(r / S) * gate_ld + c] * xv : xv;
    }
}

extern "C" dit_status dit_cuda_gated_add(dit_backend *be, const dit_tensor *res,
                                         const dit_tensor *x, const dit_tensor *gate)
{
    dit_cuda_backend *cb = cuda_of(be);
    const char *op = "gated_add";
    if (!is_f32_rows(res) || !is_f32_rows(x) || res->ndim != 3 || !dit_tensor_same_shape(res, x))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "res, x must be (B, S, C) f32");
    const int64_t B = res->ne[0], S = res->ne[1], C = res->ne[2];
    if (gate && !is_batch_vec(gate, B, C))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "gate must be (B, C) f32");
    const int64_t n = B * S * C;
    if (n == 0)
        return DIT_OK;
    DIT_CUDA_LAUNCH(k_gated_add, cuda_blocks(n, 256), 256, 0, cb->stream, cuda_view_of(res),
                    cuda_view_of(x), S, gate ? (const float *)gate->data : NULL,
                    gate ? gate->nb[0] / 4 : 0);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

__global__ void k_embedding(cuda_view y, const char *table, int tdt, int64_t C, const int32_t *ids,
                            int64_t n)
{
    const size_t te = tdt == DIT_F32 ? 4 : 2;
    const int64_t total = n * C;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r, c;
        cuda_divmod(i, C, r, c);
        const float v = cuda_load(table + ((int64_t)ids[r] * C + c) * (int64_t)te, tdt);
        *(float *)cuda_view_at(y, r, c) = v;
    }
}

/* n host int32 values (the ids of a gather) must lie in [0, limit); `what`
 * names them in the error. */
static dit_status check_ids(dit_cuda_backend *cb, const int32_t *ids, int64_t n, int64_t limit,
                            const char *what, const char *op)
{
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= limit)
            return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "%s %d at %lld outside [0, %lld)",
                                what, (int)ids[i], (long long)i, (long long)limit);
    return DIT_OK;
}

/* check_ids, then the ids copied into the MISC scratch for the kernel that
 * follows on the stream. Not during graph capture: the copy reads host
 * memory at enqueue time. */
static dit_status upload_ids(dit_cuda_backend *cb, const int32_t *ids, int64_t n, int64_t limit,
                             const char *what, const int32_t **out, const char *op)
{
    DIT_CHECK_RET(check_ids(cb, ids, n, limit, what, op));
    if (cb->capturing)
        return dit_cuda_bad(cb, DIT_ERR_UNSUPPORTED, op, "host %ss during graph capture", what);
    void *d = NULL;
    DIT_CHECK_RET(dit_cuda_scratch(cb, CUDA_SCRATCH_MISC, (size_t)n * sizeof(int32_t), &d, op));
    /* Pageable source: staged before the call returns, so `ids` may go. */
    CUDA_TRY(
        cb, op,
        cudaMemcpyAsync(d, ids, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice, cb->stream));
    *out = (const int32_t *)d;
    return DIT_OK;
}

extern "C" dit_status dit_cuda_embedding(dit_backend *be, const dit_tensor *y,
                                         const dit_tensor *table, const int32_t *ids, int64_t n)
{
    dit_cuda_backend *cb = cuda_of(be);
    const char *op = "embedding";
    if (!is_f32_rows(y) || y->ndim != 2 || table->ndim != 2 || y->ne[0] != n ||
        y->ne[1] != table->ne[1] || !dit_tensor_is_contiguous(table) ||
        (table->dtype != DIT_F32 && table->dtype != DIT_BF16 && table->dtype != DIT_F16))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "y (n, C) f32, table (V, C)");
    const int64_t V = table->ne[0], C = table->ne[1];
    if (n == 0 || C == 0)
        return check_ids(cb, ids, n, V, "id", op);
    const int32_t *dids = NULL;
    dit_status st = upload_ids(cb, ids, n, V, "id", &dids, op);
    if (st != DIT_OK)
        return st;
    DIT_CUDA_LAUNCH(k_embedding, cuda_blocks(n * C, 256), 256, 0, cb->stream, cuda_view_of(y),
                    (const char *)table->data, (int)table->dtype, C, dids, n);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

/* y (H, Sq, Skv) contiguous: y[h][i][j] = table[b[j - i + Sq - 1] * H + h]. */
__global__ void k_relative_bias(float *y, const float *table, const int32_t *b, int64_t H,
                                int64_t Sq, int64_t Skv)
{
    const int64_t total = H * Sq * Skv;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < total;
         e += (int64_t)gridDim.x * blockDim.x) {
        int64_t hi, j;
        cuda_divmod(e, Skv, hi, j);
        int64_t h, i;
        cuda_divmod(hi, Sq, h, i);
        y[e] = table[(int64_t)b[j - i + Sq - 1] * H + h];
    }
}

extern "C" dit_status dit_cuda_relative_bias(dit_backend *be, const dit_tensor *y,
                                             const dit_tensor *table, const int32_t *buckets)
{
    dit_cuda_backend *cb = cuda_of(be);
    const char *op = "relative_bias";
    if (!y || !table || !buckets || y->dtype != DIT_F32 || y->ndim != 3 ||
        !dit_tensor_is_contiguous(y) || table->dtype != DIT_F32 || table->ndim != 2 ||
        !dit_tensor_is_contiguous(table) || table->ne[1] != y->ne[0])
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op,
                            "y (H, Sq, Skv) f32 contiguous, table (n_buckets, H) f32 contiguous");
    const int64_t H = y->ne[0], Sq = y->ne[1], Skv = y->ne[2], nb = table->ne[0];
    if (H == 0 || Sq == 0 || Skv == 0)
        return DIT_OK;
    const int32_t *db = NULL;
    dit_status st = upload_ids(cb, buckets, Sq + Skv - 1, nb, "bucket", &db, op);
    if (st != DIT_OK)
        return st;
    DIT_CUDA_LAUNCH(k_relative_bias, cuda_blocks(H * Sq * Skv, 256), 256, 0, cb->stream,
                    (float *)y->data, (const float *)table->data, db, H, Sq, Skv);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

/* ------------------------------------------------------------------------ */
/* VAE image ops (NCHW, contiguous)                                          */

static bool is_nchw(const dit_tensor *t)
{
    return t && t->dtype == DIT_F32 && t->ndim == 4 && dit_tensor_is_contiguous(t);
}

/* colT (P_band, K) bf16 for output rows [r0, r0 + nr): element (p, kk) with
 * p = oy * Wo + ox (oy relative to r0) and kk = (c, i, j). */
__global__ void k_im2col(__nv_bfloat16 *col, const float *x, int64_t Ci, int64_t H, int64_t W,
                         int64_t kh, int64_t kw, int64_t Wo, int64_t r0, int64_t nr, int stride,
                         int pad)
{
    const int64_t K = Ci * kh * kw;
    const int64_t total = nr * Wo * K;
    for (int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t kk = idx % K, p = idx / K;
        const int64_t oy = r0 + p / Wo, ox = p % Wo;
        const int64_t c = kk / (kh * kw), i = (kk / kw) % kh, j = kk % kw;
        const int64_t iy = oy * stride - pad + i, ix = ox * stride - pad + j;
        float v = 0.0f;
        if (iy >= 0 && iy < H && ix >= 0 && ix < W)
            v = x[(c * H + iy) * W + ix];
        col[idx] = __float2bfloat16_rn(v);
    }
}

/* y (B, Co, P) += bias[co]. */
__global__ void k_conv_bias(float *y, const float *bias, int64_t Co, int64_t P, int64_t total)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] += bias[(i / P) % Co];
}

/* Column-budget per band, in bf16 elements (128 MiB). */
static const int64_t CONV_COL_ELEMS = 64ll << 20;

extern "C" dit_status dit_cuda_conv2d(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                      const dit_tensor *w, const dit_tensor *bias, int stride,
                                      int pad)
{
    dit_cuda_backend *cb = cuda_of(be);
    const char *op = "conv2d";
    if (!is_nchw(x) || !is_nchw(y) || !w || w->ndim != 4 || !dit_tensor_is_contiguous(w) ||
        (w->dtype != DIT_F32 && w->dtype != DIT_BF16) || stride < 1 || pad < 0)
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op,
                            "x, y NCHW f32 contiguous, w (Co, Ci, kh, kw) bf16/f32");
    const int64_t B = x->ne[0], Ci = x->ne[1], H = x->ne[2], W = x->ne[3];
    const int64_t Co = w->ne[0], kh = w->ne[2], kw = w->ne[3];
    const int64_t Ho = (H + 2 * pad - kh) / stride + 1, Wo = (W + 2 * pad - kw) / stride + 1;
    if (w->ne[1] != Ci || y->ne[0] != B || y->ne[1] != Co || y->ne[2] != Ho || y->ne[3] != Wo)
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "shape mismatch");
    if (bias && (bias->dtype != DIT_F32 || bias->ndim != 1 || bias->ne[0] != Co))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "bias must be (Co) f32");
    const int64_t K = Ci * kh * kw, P = Ho * Wo;
    if (B * Co * P == 0)
        return DIT_OK;
    /* w as a dense bf16 (Co, K) matrix. */
    dit_tensor w2 = dit_tensor_2d(w->data, w->dtype, Co, K);
    const __nv_bfloat16 *wb = NULL;
    dit_status st = dit_cuda_as_bf16(cb, &w2, CUDA_SCRATCH_W, &wb, op);
    if (st != DIT_OK)
        return st;
    int64_t band = CONV_COL_ELEMS / (K * Wo > 0 ? K * Wo : 1);
    band = band < 1 ? 1 : (band > Ho ? Ho : band);
    void *colp = NULL;
    st = dit_cuda_scratch(cb, CUDA_SCRATCH_COL, (size_t)(band * Wo * K) * 2 + 16, &colp, op);
    if (st != DIT_OK)
        return st;
    __nv_bfloat16 *col = (__nv_bfloat16 *)colp;
    for (int64_t b = 0; b < B; b++) {
        const float *xb = (const float *)x->data + b * Ci * H * W;
        float *yb = (float *)y->data + b * Co * P;
        for (int64_t r0 = 0; r0 < Ho; r0 += band) {
            const int64_t nr = Ho - r0 < band ? Ho - r0 : band;
            const int64_t np = nr * Wo;
            DIT_CUDA_LAUNCH(k_im2col, cuda_blocks(np * K, 256), 256, 0, cb->stream, col, xb, Ci, H,
                            W, kh, kw, Wo, r0, nr, stride, pad);
            CUDA_LAUNCHED(cb, op);
            /* y[:, band] row-major (Co, P) is column-major (P x Co) with
             * ld P: D (np x Co) = colT^T... i.e. op(A) = colT (np x K)
             * stored column-major as (K x np), op(B) = w^T (K x Co). */
            st = dit_cuda_gemm(cb, true, false, np, Co, K, col, K, wb, K, yb + r0 * Wo, P, NULL,
                               DIT_ACT_NONE, 0.0f, op);
            if (st != DIT_OK)
                return st;
        }
    }
    if (bias) {
        const int64_t total = B * Co * P;
        DIT_CUDA_LAUNCH(k_conv_bias, cuda_blocks(total, 256), 256, 0, cb->stream, (float *)y->data,
                        (const float *)bias->data, Co, P, total);
        CUDA_LAUNCHED(cb, op);
    }
    return DIT_OK;
}

/* Partial sums (f64) of one (b, g) group, split over gridDim.y blocks. */
__global__ void k_group_stats(const float *x, int64_t n_per_group, double *stats)
{
    __shared__ double red[2][32];
    const int64_t g = blockIdx.x;
    const float *xg = x + g * n_per_group;
    double s = 0.0, q = 0.0;
    for (int64_t i = blockIdx.y * (int64_t)blockDim.x + threadIdx.x; i < n_per_group;
         i += (int64_t)gridDim.y * blockDim.x) {
        const double v = xg[i];
        s += v;
        q += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
        q += __shfl_xor_sync(0xffffffffu, q, o);
    }
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) {
        red[0][wid] = s;
        red[1][wid] = q;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double ts = 0.0, tq = 0.0;
        for (int i = 0; i < (int)(blockDim.x >> 5); i++) {
            ts += red[0][i];
            tq += red[1][i];
        }
        atomicAdd(&stats[2 * g], ts);
        atomicAdd(&stats[2 * g + 1], tq);
    }
}

__global__ void k_group_apply(float *y, const float *x, const double *stats, const float *w,
                              const float *bias, int64_t C, int64_t cg, int64_t HW, int64_t groups,
                              float eps, bool silu, int64_t total)
{
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t c = (i / HW) % C, b = i / (HW * C);
        const int64_t g = b * groups + c / cg;
        const double n = (double)(cg * HW);
        const double mean = stats[2 * g] / n;
        double var = stats[2 * g + 1] / n - mean * mean;
        var = var < 0.0 ? 0.0 : var;
        const float rstd = (float)(1.0 / sqrt(var + (double)eps));
        const float a = rstd * w[c];
        const float off = bias[c] - (float)mean * a;
        float v = x[i] * a + off;
        if (silu)
            v = v / (1.0f + expf(-v));
        y[i] = v;
    }
}

extern "C" dit_status dit_cuda_group_norm(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                          const dit_tensor *weight, const dit_tensor *bias,
                                          int groups, float eps, dit_act act)
{
    dit_cuda_backend *cb = cuda_of(be);
    const char *op = "group_norm";
    if (!is_nchw(x) || !is_nchw(y) || !dit_tensor_same_shape(x, y) || groups < 1)
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "x, y NCHW f32 contiguous");
    const int64_t B = x->ne[0], C = x->ne[1], HW = x->ne[2] * x->ne[3];
    if (C % groups != 0 || !weight || !bias || weight->ne[0] != C || bias->ne[0] != C ||
        weight->dtype != DIT_F32 || bias->dtype != DIT_F32 ||
        (act != DIT_ACT_NONE && act != DIT_ACT_SILU))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "groups, weight, bias or act");
    const int64_t cg = C / groups, total = B * C * HW;
    if (total == 0)
        return DIT_OK;
    void *sp = NULL;
    dit_status st =
        dit_cuda_scratch(cb, CUDA_SCRATCH_MISC, (size_t)(2 * B * groups) * sizeof(double), &sp, op);
    if (st != DIT_OK)
        return st;
    double *stats = (double *)sp;
    CUDA_TRY(cb, op,
             cudaMemsetAsync(stats, 0, (size_t)(2 * B * groups) * sizeof(double), cb->stream));
    const int64_t per = cg * HW;
    int64_t split = per / (256 * 64);
    split = split < 1 ? 1 : (split > 64 ? 64 : split);
    DIT_CUDA_LAUNCH(k_group_stats, dim3((unsigned)(B * groups), (unsigned)split), 256, 0,
                    cb->stream, (const float *)x->data, per, stats);
    CUDA_LAUNCHED(cb, op);
    DIT_CUDA_LAUNCH(k_group_apply, cuda_blocks(total, 256), 256, 0, cb->stream, (float *)y->data,
                    (const float *)x->data, stats, (const float *)weight->data,
                    (const float *)bias->data, C, cg, HW, groups, eps, act == DIT_ACT_SILU, total);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

__global__ void k_upsample2x(float *y, const float *x, int64_t H, int64_t W, int64_t total)
{
    /* total = planes * 2H * 2W output elements. */
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t ox = i % (2 * W), t = i / (2 * W);
        const int64_t oy = t % (2 * H), plane = t / (2 * H);
        y[i] = x[(plane * H + oy / 2) * W + ox / 2];
    }
}

extern "C" dit_status dit_cuda_upsample2x(dit_backend *be, const dit_tensor *y, const dit_tensor *x)
{
    dit_cuda_backend *cb = cuda_of(be);
    if (!is_nchw(x) || !is_nchw(y))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, "upsample2x", "x, y NCHW f32 contiguous");
    const int64_t B = x->ne[0], C = x->ne[1], H = x->ne[2], W = x->ne[3];
    if (y->ne[0] != B || y->ne[1] != C || y->ne[2] != 2 * H || y->ne[3] != 2 * W)
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, "upsample2x", "y must be (B, C, 2H, 2W)");
    const int64_t total = B * C * 4 * H * W;
    if (total == 0)
        return DIT_OK;
    DIT_CUDA_LAUNCH(k_upsample2x, cuda_blocks(total, 256), 256, 0, cb->stream, (float *)y->data,
                    (const float *)x->data, H, W, total);
    CUDA_LAUNCHED(cb, "upsample2x");
    return DIT_OK;
}
