/* Private to the cuda backend: its struct, the error plumbing that turns
 * CUDA / cuBLAS codes into dit_status (the one place per library, see
 * design.md §9), the strided-view descriptors the kernels take, and the op
 * entry points that cuda_backend.cu puts into the ops table.
 *
 * Owner: the thread that created the backend (like every backend). */
#ifndef DIT_BACKEND_CUDA_INTERNAL_CUH
#define DIT_BACKEND_CUDA_INTERNAL_CUH

#include <cassert>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"

/* One cached GEMM configuration: the descriptors and the algorithm the
 * heuristic picked for a shape, so that later calls (and graph capture)
 * never query again. */
struct cuda_gemm_entry {
    /* key */
    int transa, transb;
    int64_t m, n, k, lda, ldb, ldc;
    int epilogue;
    int align;      /* smallest pointer alignment (bytes, <= 16) of A, B, C, D */
    int bias_align; /* the bias pointer's, 0 without one */
    bool has_beta;
    bool d_bf16; /* D (and C) bf16 instead of f32 */
    /* value */
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    int mode; /* cuda_gemm_mode: how this shape runs */
};

/* How a GEMM shape runs. The heuristic may have no algorithm for a fused
 * epilogue (bias, GELU) at some shape or alignment while it has one for the
 * plain product; then the product runs on cuBLASLt and bias and activation
 * in a separate pass, which costs one memory pass instead of a 10-100x
 * slower GEMM. Only a shape cuBLASLt refuses outright runs on the 16 x 16
 * CUDA-core fallback kernel. */
enum cuda_gemm_mode {
    CUDA_GEMM_FUSED = 0, /* cuBLASLt with the epilogue asked for */
    CUDA_GEMM_PLAIN,     /* cuBLASLt without epilogue; bias and act after */
    CUDA_GEMM_FALLBACK,  /* k_gemm_fallback; act after */
};

enum {
    CUDA_SCRATCH_X = 0,
    CUDA_SCRATCH_W,
    CUDA_SCRATCH_COL,
    CUDA_SCRATCH_MISC,
    CUDA_SCRATCH_OUT,   /* f32 GEMM results rounded into a bf16 output */
    CUDA_SCRATCH_CUDNN, /* cuDNN's attention workspace */
    CUDA_SCRATCH_N
};

/* Op categories of the profiler (dit_cuda_backend_profile_*). */
enum { CUDA_PROF_GEMM = 0, CUDA_PROF_ATTN, CUDA_PROF_ELEM, CUDA_PROF_CAST, CUDA_PROF_N };

/* Timing events around every op while profiling: pair i is ev[2i] (before
 * the op's first kernel) and ev[2i + 1] (after its last), category cat[i]. */
struct cuda_prof {
    bool on;
    cudaEvent_t *ev;
    unsigned char *cat;
    int cap, n;
    bool overflow;
};

struct cuda_alloc_rec {
    void *p;
    size_t bytes;
};

/* cuDNN, loaded on first use (cuda_cudnn.cu). */
struct cuda_cudnn;

typedef struct dit_cuda_backend {
    dit_backend base; /* must stay first */
    int device;
    char device_name[112]; /* "cuda:N <the device's name>" */
    int sm_count;
    size_t gen_smem_max; /* dynamic shared memory a block may have (the generic attention
                            kernel's limit) */
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *lt_ws;
    size_t lt_ws_bytes;
    /* Scratch buffers, grown (never while capturing a graph) and reused. */
    void *scratch[CUDA_SCRATCH_N];
    size_t scratch_bytes[CUDA_SCRATCH_N];
    /* Upload / download staging: pinned host and device, same size. */
    void *pinned;
    void *stage;
    size_t stage_bytes;
    /* GEMM plan cache. */
    cuda_gemm_entry *gemms;
    size_t n_gemms, cap_gemms;
    /* Allocation book-keeping for the memory high-water mark. */
    cuda_alloc_rec *allocs;
    size_t n_allocs, cap_allocs;
    size_t bytes_in_use, bytes_peak;
    bool capturing;
    /* Captured graphs alive, and device buffers they may still point at
     * (scratch that grew, memory freed during a capture): freed once no
     * graph is left. */
    int live_graphs;
    void **retired;
    size_t n_retired, cap_retired;
    bool lt_gelu;    /* use cuBLASLt's GELU_BIAS epilogue for DIT_ACT_GELU_TANH */
    int gemm_force;  /* dit_cuda_gemm_force: tests force the slower modes */
    bool attn_f32;   /* tests: every attention on the f32 kernel */
    int gen_qpw;     /* tests: 1 forces one query a warp on the f32 kernel; 0 auto */
    int path;        /* dit_cuda_path */
    int attn;        /* dit_cuda_attn */
    cuda_cudnn *dnn; /* NULL until DIT_CUDA_ATTN=cudnn first needs it */
    cuda_prof prof;
    dit_cuda_wait_check wait_fn; /* set while a comm group enqueues on stream */
    void *wait_ctx;
    dit_cuda_stats stats;
    char err[512];
} dit_cuda_backend;

static inline dit_cuda_backend *cuda_of(dit_backend *be)
{
    return (dit_cuda_backend *)be;
}

/* Records "op: what: CUDA message" in be->err and maps the code. */
dit_status dit_cuda_fail(dit_cuda_backend *cb, cudaError_t e, const char *op, const char *what);
dit_status dit_cuda_fail_lt(dit_cuda_backend *cb, cublasStatus_t s, const char *op,
                            const char *what);
/* Records an argument error for op and returns DIT_ERR_INVALID_ARG (or st). */
dit_status dit_cuda_bad(dit_cuda_backend *cb, dit_status st, const char *op, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Waits on the host for everything issued on cb->stream: a plain
 * cudaStreamSynchronize, or, while a comm group enqueues on the stream
 * (dit_cuda_backend_set_wait_check), a poll that the group can cut short
 * when a peer is dead or the wait passes its timeout. */
dit_status dit_cuda_stream_wait(dit_cuda_backend *cb, const char *op);

/* Attention on cuDNN's SDPA forward (cuda_cudnn.cu). eligible: the call's
 * tensors are what it takes (bf16 q, k, v and out with 16-byte aligned
 * rows, a 16-byte aligned lse). attention: *ran false (and DIT_OK) when the call must run on v1
 * instead: cuDNN missing or too old, no plan for the shape, or a shape
 * first met during graph capture; counted in the stats. open: loads cuDNN
 * now, writing its version or why it cannot be used into why. */
bool dit_cuda_cudnn_eligible(const dit_tensor *out, const dit_tensor *lse, const dit_tensor *q,
                             const dit_tensor *k, const dit_tensor *v);
dit_status dit_cuda_cudnn_attention(dit_cuda_backend *cb, const char *op, const dit_tensor *out,
                                    const dit_tensor *lse, const dit_tensor *q, const dit_tensor *k,
                                    const dit_tensor *v, float scale, bool *ran);
dit_status dit_cuda_cudnn_open(dit_cuda_backend *cb, char *why, size_t n);
void dit_cuda_cudnn_destroy(dit_cuda_backend *cb);

/* Profiler marks around an op (no-ops unless profiling, and never while
 * capturing a graph): begin returns a slot for end, or -1. */
int dit_cuda_prof_begin(dit_cuda_backend *cb, int cat);
void dit_cuda_prof_end(dit_cuda_backend *cb, int slot);

/* Returns the status of a dit_status expression when it is not DIT_OK. */
#define DIT_CHECK_RET(call)                                                                        \
    do {                                                                                           \
        const dit_status s_ = (call);                                                              \
        if (s_ != DIT_OK)                                                                          \
            return s_;                                                                             \
    } while (0)

/* Launches kernel k (a name, or a pointer to one) with grid, block,
 * dynamic shared memory and stream: the <<< >>> launch under nvcc. The
 * host build of these sources on the SIMT emulator (tests/gpu/emu) defines
 * it first, as a call into the emulated runtime. */
#ifndef DIT_CUDA_LAUNCH
#define DIT_CUDA_LAUNCH(k, grid, block, smem, stream, ...)                                         \
    k<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#endif

/* Checks the launch of the kernel just issued. */
#define CUDA_LAUNCHED(cb, op)                                                                      \
    do {                                                                                           \
        cudaError_t e_ = cudaGetLastError();                                                       \
        if (e_ != cudaSuccess)                                                                     \
            return dit_cuda_fail((cb), e_, (op), "kernel launch");                                 \
    } while (0)

#define CUDA_TRY(cb, op, call)                                                                     \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return dit_cuda_fail((cb), e_, (op), #call);                                           \
    } while (0)

#define LT_TRY(cb, op, call)                                                                       \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
            return dit_cuda_fail_lt((cb), s_, (op), #call);                                        \
    } while (0)

/* A scratch buffer of at least `bytes`; growing waits for the stream and is
 * refused while a graph is being captured (warm up eagerly first). */
dit_status dit_cuda_scratch(dit_cuda_backend *cb, int slot, size_t bytes, void **out,
                            const char *op);

/* ---- strided views for kernels ---------------------------------------- */

/* A view padded to 4 dims with leading size-1 dims (a 5-D tensor folded
 * to 4 first, see cuda_fold_dims); strides in bytes.
 *
 * Row r (the flattened index over dims 0..2) starts at
 *  - p + r * rs when rs >= 0: the rows are evenly spaced (contiguous
 *    tensors and column slices of them, dit_tensor_row_stride), so no
 *    division is needed;
 *  - p + (r / ne[2]) * nb[1] + (r % ne[2]) * nb[2] when ts >= 0: dims 0
 *    and 1 are evenly spaced (the (B, S, H, D) head views of a fused
 *    (B, S, 3 H D) projection), one division;
 *  - otherwise through all three dims, two divisions. */
struct cuda_view {
    char *p;
    int64_t ne[4];
    int64_t nb[4];
    int64_t rs; /* uniform row stride in bytes, or -1 */
    int64_t ts; /* nb[1] when dims 0 and 1 flatten evenly, or -1 */
    int dtype;  /* dit_dtype */
};

/* Fills rs and ts from ne and nb (after any change to them). */
static inline void cuda_view_strides(cuda_view &v)
{
    /* dit_tensor_row_stride on the padded 4-D view. */
    dit_tensor t;
    memset(&t, 0, sizeof t);
    t.ndim = 4;
    for (int i = 0; i < 4; i++) {
        t.ne[i] = v.ne[i];
        t.nb[i] = v.nb[i];
    }
    t.dtype = (dit_dtype)v.dtype;
    v.rs = dit_tensor_row_stride(&t);
    v.ts = (v.ne[0] == 1 || v.nb[0] == v.ne[1] * v.nb[1]) ? v.nb[1] : -1;
}

/* A tensor of more than 4 dims as an equivalent one of 4 (the same
 * elements, in the same row-major order, at the same addresses) by merging
 * adjacent outer dims that are evenly spaced: a contiguous (B, C, F, H, W)
 * becomes (B*C, F, H, W). The innermost dim is never merged, so the columns
 * the kernels see are the tensor's own. False when no pair of outer dims
 * merges (a 5-D view narrowed in three of its outer dims): the ops refuse
 * such views with a status instead of padding past 4 dims. */
static inline bool cuda_fold_dims(const dit_tensor *t, dit_tensor *out)
{
    *out = *t;
    while (out->ndim > 4) {
        int i = 0;
        for (; i + 1 < out->ndim - 1; i++)
            if (out->ne[i] == 1 || out->ne[i + 1] == 1 ||
                out->nb[i] == out->ne[i + 1] * out->nb[i + 1])
                break;
        if (i + 1 >= out->ndim - 1)
            return false;
        /* A size-1 dim's stride is arbitrary: keep the other's. */
        const int64_t nb = out->ne[i + 1] == 1 ? out->nb[i] : out->nb[i + 1];
        out->ne[i] *= out->ne[i + 1];
        out->nb[i] = nb;
        for (int j = i + 1; j + 1 < out->ndim; j++) {
            out->ne[j] = out->ne[j + 1];
            out->nb[j] = out->nb[j + 1];
        }
        out->ndim--;
    }
    return true;
}

/* True when cuda_view_of can describe t: up to 4 dims, or 5 that fold. */
static inline bool cuda_view_ok(const dit_tensor *t)
{
    dit_tensor f;
    return t->ndim >= 0 && t->ndim <= DIT_MAX_DIMS && cuda_fold_dims(t, &f);
}

/* Callers check cuda_view_ok first (every op does, or takes a fixed rank
 * of at most 4). */
static inline cuda_view cuda_view_of(const dit_tensor *tensor)
{
    dit_tensor folded;
    const bool folds = cuda_fold_dims(tensor, &folded);
    assert(folds);
    (void)folds;
    const dit_tensor *t = &folded;
    cuda_view v;
    v.p = (char *)t->data;
    v.dtype = (int)t->dtype;
    const int off = 4 - t->ndim;
    for (int i = 0; i < 4; i++) {
        v.ne[i] = 1;
        v.nb[i] = 0;
    }
    for (int i = 0; i < t->ndim; i++) {
        v.ne[off + i] = t->ne[i];
        v.nb[off + i] = t->nb[i];
    }
    cuda_view_strides(v);
    return v;
}

__host__ __device__ static inline int64_t cuda_view_rows(const cuda_view &v)
{
    return v.ne[0] * v.ne[1] * v.ne[2];
}

/* q = a / b, r = a % b for non-negative a, b > 0, in 32 bits when both fit
 * (a 64-bit division is a long software sequence on the GPU; element
 * indices of all but the largest tensors fit in 32 bits). */
__device__ __forceinline__ void cuda_divmod(int64_t a, int64_t b, int64_t &q, int64_t &r)
{
    if (((uint64_t)a | (uint64_t)b) <= 0xffffffffull) {
        const uint32_t a32 = (uint32_t)a, b32 = (uint32_t)b;
        const uint32_t q32 = a32 / b32;
        q = q32;
        r = a32 - q32 * b32;
    } else {
        q = a / b;
        r = a - q * b;
    }
}

/* Pointer to the start of row r (flattened outer index). */
__device__ __forceinline__ char *cuda_view_row(const cuda_view &v, int64_t r)
{
    if (v.rs >= 0)
        return v.p + r * v.rs;
    int64_t t, i2;
    cuda_divmod(r, v.ne[2], t, i2);
    if (v.ts >= 0)
        return v.p + t * v.ts + i2 * v.nb[2];
    int64_t i0, i1;
    cuda_divmod(t, v.ne[1], i0, i1);
    return v.p + i0 * v.nb[0] + i1 * v.nb[1] + i2 * v.nb[2];
}

/* Pointer to (row r = flattened outer index, column c). */
__device__ __forceinline__ char *cuda_view_at(const cuda_view &v, int64_t r, int64_t c)
{
    return cuda_view_row(v, r) + c * v.nb[3];
}

/* f32, bf16 and f16 only: f8_e4m3 tensors never reach a kernel (uploads
 * convert them on the host; every op's dtype check refuses them). */
__device__ __forceinline__ float cuda_load(const char *p, int dt)
{
    if (dt == DIT_F32)
        return *(const float *)p;
    if (dt == DIT_BF16)
        return __bfloat162float(*(const __nv_bfloat16 *)p);
    return __half2float(*(const __half *)p);
}

__device__ __forceinline__ void cuda_store(char *p, int dt, float v)
{
    if (dt == DIT_F32)
        *(float *)p = v;
    else if (dt == DIT_BF16)
        *(__nv_bfloat16 *)p = __float2bfloat16_rn(v);
    else
        *(__half *)p = __float2half_rn(v);
}

static inline unsigned cuda_blocks(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    if (b > 1048576)
        b = 1048576; /* kernels loop grid-stride beyond this */
    return (unsigned)b;
}

/* Converts rows [row0, row0 + nrows) of `dst` (any dtype, strided) from the
 * dense row-major buffer `src` of dtype st (nrows x dst.ne[3]). */
dit_status dit_cuda_rows_from_dense(dit_cuda_backend *cb, const cuda_view &dst, int64_t row0,
                                    int64_t nrows, const void *src, dit_dtype st, const char *op);

/* A dense bf16 (rows, cols) copy of a 2-D-or-more tensor t with dense rows,
 * in scratch slot `slot`; t itself when it already is dense bf16. */
dit_status dit_cuda_as_bf16(dit_cuda_backend *cb, const dit_tensor *t, int slot,
                            const __nv_bfloat16 **out, const char *op);

/* D (col-major m x n, ldc, f32) = alpha op(A) op(B) + beta C(=D) [+ bias
 * (m)] [GELU], A and B bf16 column-major as cuBLASLt sees them. act is
 * applied by cuBLASLt (GELU_BIAS) or by a follow-up kernel. */
dit_status dit_cuda_gemm(dit_cuda_backend *cb, bool transa, bool transb, int64_t m, int64_t n,
                         int64_t k, const __nv_bfloat16 *A, int64_t lda, const __nv_bfloat16 *B,
                         int64_t ldb, float *D, int64_t ldc, const float *bias, dit_act act,
                         float beta, const char *op);

/* The same with D of dtype dt: f32, or bf16 (the fast path's GEMMs whose
 * output only feeds another GEMM or attention), rounded once after bias and
 * activation when cuBLASLt fuses them; beta reads D's old values in dt. */
dit_status dit_cuda_gemm_t(dit_cuda_backend *cb, bool transa, bool transb, int64_t m, int64_t n,
                           int64_t k, const __nv_bfloat16 *A, int64_t lda, const __nv_bfloat16 *B,
                           int64_t ldb, void *D, dit_dtype dt, int64_t ldc, const float *bias,
                           dit_act act, float beta, const char *op);

void dit_cuda_gemm_cache_clear(dit_cuda_backend *cb);

/* Sets the dynamic shared memory limits of the attention kernels (once, at
 * create, so nothing of the kind happens during graph capture). */
dit_status dit_cuda_attention_init(dit_cuda_backend *cb);

/* ---- ops --------------------------------------------------------------- */

extern "C" {
dit_status dit_cuda_linear(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                           const dit_tensor *w, const dit_tensor *bias, dit_act act, float beta);
dit_status dit_cuda_activate(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                             dit_act act);
dit_status dit_cuda_layer_norm_mod(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                   const dit_tensor *shift, const dit_tensor *scale, float eps);
dit_status dit_cuda_layer_norm(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                               const dit_tensor *weight, const dit_tensor *bias, float eps);
dit_status dit_cuda_rms_norm(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                             const dit_tensor *weight, float eps);
dit_status dit_cuda_relative_bias(dit_backend *be, const dit_tensor *y, const dit_tensor *table,
                                  const int32_t *buckets);
dit_status dit_cuda_embedding(dit_backend *be, const dit_tensor *y, const dit_tensor *table,
                              const int32_t *ids, int64_t n);
dit_status dit_cuda_conv2d(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                           const dit_tensor *w, const dit_tensor *bias, int stride, int pad);
dit_status dit_cuda_group_norm(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                               const dit_tensor *weight, const dit_tensor *bias, int groups,
                               float eps, dit_act act);
dit_status dit_cuda_upsample2x(dit_backend *be, const dit_tensor *y, const dit_tensor *x);
dit_status dit_cuda_rms_norm_rope(dit_backend *be, const dit_tensor *x, const dit_tensor *weight,
                                  float eps, const dit_tensor *cos, const dit_tensor *sin);
dit_status dit_cuda_rms_norm_rope_to(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                     const dit_tensor *weight, float eps, const dit_tensor *cos,
                                     const dit_tensor *sin);
dit_status dit_cuda_gated_add(dit_backend *be, const dit_tensor *res, const dit_tensor *x,
                              const dit_tensor *gate);
dit_status dit_cuda_attention(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                              const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                              float scale);
dit_status dit_cuda_attention_masked(dit_backend *be, const dit_tensor *out, const dit_tensor *q,
                                     const dit_tensor *k, const dit_tensor *v, float scale,
                                     const dit_tensor *bias, bool causal);
dit_status dit_cuda_lse_merge(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                              const dit_tensor *out_b, const dit_tensor *lse_b);
}

/* Applies act (and bias) in place on rows of y (M rows of N, row stride ldy
 * floats): y = act(y + bias). */
dit_status dit_cuda_bias_act(dit_cuda_backend *cb, float *y, int64_t rows, int64_t N, int64_t ldy,
                             const float *bias, dit_act act, const char *op);

__device__ __forceinline__ float cuda_act(float x, int act)
{
    switch (act) {
    case DIT_ACT_GELU_TANH: {
        const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.0f + tanhf(inner));
    }
    case DIT_ACT_SILU:
        return x / (1.0f + expf(-x));
    case DIT_ACT_GELU_ERF:
        return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    case DIT_ACT_QUICK_GELU:
        return x / (1.0f + expf(-1.702f * x));
    default:
        return x;
    }
}

#endif
