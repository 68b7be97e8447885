/* The cuda backend's entry points, callable from C. Compiled only when the
 * build has CUDA (DIT_HAVE_CUDA); backend.c guards every call. */
#ifndef DIT_BACKEND_CUDA_BACKEND_H
#define DIT_BACKEND_CUDA_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices; 0 when there is no driver or no GPU (the
 * CUDA runtime reports a missing driver as an error, which means "none"). */
int dit_cuda_device_count(void);

/* Like dit_cuda_device_count, and when it is 0 writes why into `why`:
 * cudaGetDeviceCount's error name and message ("cudaErrorNoDevice: no
 * CUDA-capable device is detected", "cudaErrorInsufficientDriver: ...") or
 * that the count was 0. */
int dit_cuda_device_probe(char *why, size_t why_size);

/* NCCL's version as major*10000 + minor*100 + patch, proving NCCL is linked. */
int dit_cuda_nccl_version(void);

/* The cuda backend on `device`: one non-blocking compute stream, cuBLASLt,
 * bf16 weights (weight_dtype), f32 activations. Fails with DIT_ERR_DEVICE
 * when there is no usable GPU and DIT_ERR_UNSUPPORTED below sm_80. */
dit_status dit_cuda_backend_create(int device, dit_backend **out, dit_diag *diag);

/* Whether be is a cuda backend (so the functions below apply). */
bool dit_backend_is_cuda(const dit_backend *be);

/* "cuda:N <the device's name>" (N its ordinal), for reports; NULL for a
 * backend that is not cuda. */
const char *dit_cuda_backend_device_name(const dit_backend *be);

/* The backend's compute stream as a cudaStream_t (void * keeps this header
 * free of CUDA headers), for the NCCL comm group to enqueue on; NULL for
 * another backend. */
void *dit_cuda_backend_stream(dit_backend *be);

typedef struct dit_cuda_memory {
    size_t backend_bytes;      /* device memory the backend holds now */
    size_t backend_peak_bytes; /* its high-water mark since creation */
    size_t device_used_bytes;  /* cudaMemGetInfo: total - free (all users) */
    size_t device_total_bytes;
} dit_cuda_memory;

dit_status dit_cuda_backend_memory(dit_backend *be, dit_cuda_memory *out);

/* Which kernels run the transformer: `legacy`, activations in f32
 * everywhere (every GEMM rounds its input to bf16 in a pass of its own,
 * attention converts f32 K/V tile by tile), or `fast`: Q/K/V written once in
 * bf16 by the RMSNorm + RoPE kernel (V by its GEMM), GEMMs that feed other
 * GEMMs or attention writing bf16 (GELU fused as their epilogue), LayerNorm
 * writing bf16 GEMM inputs (operand_dtype in backend.h). The backend starts
 * with the path named by the environment variable DIT_CUDA_PATH (legacy or
 * fast; unset: fast), read once at creation; set_path switches later
 * (benchmarks and parity tests run both). */
typedef enum dit_cuda_path {
    DIT_CUDA_PATH_LEGACY = 0,
    DIT_CUDA_PATH_FAST,
} dit_cuda_path;

/* "legacy" / "fast"; DIT_ERR_INVALID_ARG otherwise. */
dit_status dit_cuda_path_parse(const char *s, dit_cuda_path *out);
const char *dit_cuda_path_name(dit_cuda_path p);
void dit_cuda_backend_set_path(dit_backend *be, dit_cuda_path p);
dit_cuda_path dit_cuda_backend_path(dit_backend *be);

/* Which tensor-core kernel attention on bf16 q, k, v at head dims 64 and
 * 128 uses (f32 q, k, v always take v1). v1: 64 queries a block, operands
 * staged synchronously, V transposed on the way into shared memory. v2: 128
 * queries a block (32 rows a warp), ldmatrix fragments, cp.async copies
 * overlapping the MMAs; the same arithmetic in the same order, so its
 * output is bit-identical to v1's. cudnn: cuDNN's fused SDPA forward
 * (9.13.1 or newer, loaded at run time from libcudnn.so.9) for calls with
 * bf16 q, k, v and out; its own kernel, so its numbers differ from v1's
 * within the bf16 tolerance. The backend starts with the kernel named by
 * DIT_CUDA_ATTN (v1, v2 or cudnn; unset: v1), read once at creation;
 * set_attn switches later (tests and benchmarks run each). v2 also needs
 * 16-byte aligned rows and falls back to v1 without them; calls cudnn
 * cannot take run on v1 (dit_cuda_stats counts them). */
typedef enum dit_cuda_attn {
    DIT_CUDA_ATTN_V1 = 0,
    DIT_CUDA_ATTN_V2,
    DIT_CUDA_ATTN_CUDNN,
} dit_cuda_attn;

/* "v1" / "v2" / "cudnn"; DIT_ERR_INVALID_ARG otherwise. */
dit_status dit_cuda_attn_parse(const char *s, dit_cuda_attn *out);
const char *dit_cuda_attn_name(dit_cuda_attn k);
void dit_cuda_backend_set_attn(dit_backend *be, dit_cuda_attn k);
dit_cuda_attn dit_cuda_backend_attn(dit_backend *be);

/* Loads cuDNN for DIT_CUDA_ATTN=cudnn now (it is otherwise loaded on first
 * use) and writes "cuDNN 9.x.y", or why it cannot be used, into why.
 * DIT_ERR_UNSUPPORTED when it cannot. */
dit_status dit_cuda_backend_cudnn(dit_backend *be, char *why, size_t n);

/* Whether cuDNN takes the SDPA forward operation the cudnn kernel would
 * build for attention(out, lse, q, k, v) (bf16 (B, S, H, D) tensors; data
 * pointers are not read): loads libcudnn.so.9, makes the tensor and
 * operation descriptors and finalises them, which checks sizes, strides and
 * types against cuDNN's rules without a device. DIT_OK when it does;
 * DIT_ERR_INVALID_ARG with cuDNN's reason when it refuses;
 * DIT_ERR_UNSUPPORTED when the library cannot be loaded or is too old. */
dit_status dit_cudnn_sdpa_check(const dit_tensor *out, const dit_tensor *lse, const dit_tensor *q,
                                const dit_tensor *k, const dit_tensor *v, char *why, size_t n);

/* Whether linear with DIT_ACT_GELU_TANH uses cuBLASLt's fused GELU_BIAS
 * epilogue (default) or its own tanh-GELU kernel after the GEMM. */
void dit_cuda_backend_set_lt_gelu(dit_backend *be, bool on);

/* Device time per kind of op, from CUDA events recorded around every op
 * while profiling is on (benchmarks: one block of the forward at a time).
 * gemm: linear's GEMMs with their bias/activation passes, conv2d;
 * attention: attention, attention_masked, lse_merge; cast: linear's
 * conversion of its activation operand to bf16; elementwise: every other
 * op (norms, RoPE, gated adds, activations, copies). span: from the first
 * op's start to the last op's end, so span minus the sum is time the GPU
 * sat idle between ops (launch overhead, host-bound stretches). */
typedef struct dit_cuda_profile {
    double gemm_ms, attention_ms, elementwise_ms, cast_ms;
    double span_ms;
    int ops;
    bool overflow; /* more ops than the event pool holds: sums are partial */
} dit_cuda_profile;

/* Starts recording (up to max_ops ops between takes). Not while capturing. */
dit_status dit_cuda_backend_profile_start(dit_backend *be, int max_ops);
/* Waits for the recorded ops, sums them into *out and starts a new
 * interval. */
dit_status dit_cuda_backend_profile_take(dit_backend *be, dit_cuda_profile *out);
void dit_cuda_backend_profile_stop(dit_backend *be);

/* Routes every attention call to the f32 CUDA-core kernel, even at head
 * dims 64 and 128 (tests compare the tensor-core kernel against it at
 * sizes the cpu backend is too slow for). */
void dit_cuda_backend_set_attention_f32(dit_backend *be, bool on);

/* The f32 kernel's queries a warp for heads wider than 128 (the VAEs'):
 * 0, the default, takes four where shared memory allows (K and V tiles
 * staged once for 16 queries instead of 4); 1 forces one, the launch of
 * narrower heads. Either gives the same bits; tests and benchmarks time
 * both. */
void dit_cuda_backend_set_generic_qpw(dit_backend *be, int qpw);

/* Host waits on the compute stream (download, sync, frees, staging) while
 * an NCCL group enqueues on it: instead of cudaStreamSynchronize, which
 * never returns when a kernel waits on a dead peer, the backend polls the
 * stream and calls fn(ctx, seconds waited so far, diag) between polls; a
 * non-OK status ends the wait with that status and fn's message (fn is
 * expected to have aborted its communicators). dit_nccl_wait_check is the
 * fn for an NCCL group. NULL fn: plain synchronisation again (set it so
 * before the group is destroyed). */
typedef dit_status (*dit_cuda_wait_check)(void *ctx, double waited_s, dit_diag *diag);
void dit_cuda_backend_set_wait_check(dit_backend *be, dit_cuda_wait_check fn, void *ctx);

/* Counters since creation (or the last reset), for benchmarks and tests.
 * GEMM calls are counted when issued from the host: a call captured into a
 * CUDA graph counts once, at capture, however often the graph replays. */
typedef struct dit_cuda_stats {
    uint64_t gemm_calls;          /* GEMMs issued (linear, conv2d bands) */
    uint64_t gemm_unfused_calls;  /* of which ran on cuBLASLt without the fused
                                     bias/GELU epilogue (no algorithm had it) */
    uint64_t gemm_fallback_calls; /* of which ran on the CUDA-core fallback */
    uint32_t gemm_shapes;         /* distinct GEMM plans made */
    uint32_t gemm_unfused_shapes;
    uint32_t gemm_fallback_shapes;
    uint64_t attn_v1_calls;             /* attention on the 64-query tensor-core kernel */
    uint64_t attn_v2_calls;             /* attention on the pipelined 128-query kernel */
    uint64_t attn_generic_calls;        /* attention and attention_masked on the f32 kernel */
    uint64_t attn_cudnn_calls;          /* attention on cuDNN's SDPA (DIT_CUDA_ATTN=cudnn) */
    uint64_t attn_cudnn_fallback_calls; /* calls cudnn could take that ran on v1 instead */
    uint32_t cudnn_shapes;              /* cuDNN SDPA shapes planned */
    uint32_t cudnn_unsupported_shapes;  /* of which had no plan (they run on v1) */
} dit_cuda_stats;

void dit_cuda_backend_stats(dit_backend *be, dit_cuda_stats *out);
void dit_cuda_backend_reset_stats(dit_backend *be);

/* Forces every GEMM planned from now on into a slower mode, so that tests
 * can check the paths a cuBLASLt heuristic miss takes; clears the plan
 * cache. Not during graph capture. */
typedef enum dit_cuda_gemm_force {
    DIT_CUDA_GEMM_AUTO = 0,    /* cuBLASLt, fused epilogues where it has them */
    DIT_CUDA_GEMM_NO_EPILOGUE, /* cuBLASLt without fused epilogues */
    DIT_CUDA_GEMM_FALLBACK,    /* the CUDA-core fallback kernel only */
} dit_cuda_gemm_force;

dit_status dit_cuda_backend_force_gemm(dit_backend *be, dit_cuda_gemm_force force);

#ifdef __cplusplus
}
#endif

#endif
