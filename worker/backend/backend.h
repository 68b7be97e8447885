/* The compute backend interface: a struct of function pointers that every
 * device implements (cpu is the readable reference, cuda the fast one).
 *
 * Conventions for every op:
 *  - Tensors live in the backend's memory (dit_backend_alloc). Shapes are
 *    outermost first; the comment on each op gives the shapes it accepts.
 *  - Inputs and outputs may be strided views as long as their innermost dim
 *    is dense (unit stride); an op that needs more says so.
 *  - Activations are f32 on the cpu backend. Weights are whatever the backend
 *    chose at upload (cpu: f32, cuda: bf16).
 *  - Ops may run asynchronously; dit_backend_download and dit_backend_sync
 *    wait for everything issued before them.
 *
 * Owner: the thread that created the backend. Backends are not thread-safe. */
#ifndef DIT_BACKEND_BACKEND_H
#define DIT_BACKEND_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dit_backend dit_backend;

/* A captured sequence of backend ops that can be replayed (a CUDA graph). */
typedef struct dit_backend_graph dit_backend_graph;

typedef enum dit_act {
    DIT_ACT_NONE = 0,
    DIT_ACT_GELU_TANH,  /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
    DIT_ACT_SILU,       /* x * sigmoid(x) */
    DIT_ACT_GELU_ERF,   /* 0.5 x (1 + erf(x / sqrt(2))) */
    DIT_ACT_QUICK_GELU, /* x * sigmoid(1.702 x), CLIP's activation */
} dit_act;

typedef struct dit_backend_ops {
    const char *name;
    void (*destroy)(dit_backend *be);

    dit_status (*alloc)(dit_backend *be, size_t bytes, void **out);
    void (*free)(dit_backend *be, void *ptr);

    /* Dtype the backend stores weights in after upload. */
    dit_dtype weight_dtype;

    /* dst (backend) <- src (host view, any dtype, any strides, same shape).
     * An f8_e4m3 source is converted on the way (exactly: every E4M3 value
     * is a bf16, f16 and f32 value); no backend computes in f8_e4m3. */
    dit_status (*upload)(dit_backend *be, const dit_tensor *dst, const dit_tensor *host_src);
    /* dst (host, contiguous, any dtype) <- src (backend view). Waits. */
    dit_status (*download)(dit_backend *be, const dit_tensor *host_dst, const dit_tensor *src);
    /* dst <- src, both backend views of the same shape (up to DIT_MAX_DIMS
     * dims). */
    dit_status (*copy)(dit_backend *be, const dit_tensor *dst, const dit_tensor *src);
    /* Every element of dst <- value. */
    dit_status (*fill)(dit_backend *be, const dit_tensor *dst, float value);

    /* y = act(x w^T + bias) + beta * y.
     * x (B, M, K), w (N, K) contiguous, bias (N) or NULL, y (B, M, N).
     * x may also be 2-D (M, K) with y (M, N). beta != 0 requires
     * act == DIT_ACT_NONE. */
    dit_status (*linear)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                         const dit_tensor *w, const dit_tensor *bias, dit_act act, float beta);

    /* y = act(x), same shape, any rank <= 4. y may alias x. */
    dit_status (*activate)(dit_backend *be, const dit_tensor *y, const dit_tensor *x, dit_act act);

    /* y = LayerNorm(x) * (1 + scale) + shift, no affine parameters.
     * x, y (B, S, C) (y may alias x); shift, scale (B, C) or NULL. */
    dit_status (*layer_norm_mod)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                 const dit_tensor *shift, const dit_tensor *scale, float eps);

    /* y = LayerNorm(x) * weight + bias over the last dim. x, y (B, S, C)
     * (may alias); weight, bias (C) or NULL. */
    dit_status (*layer_norm)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                             const dit_tensor *weight, const dit_tensor *bias, float eps);

    /* y = x / sqrt(mean(x^2) + eps) * weight over the last dim, in f32 (T5's
     * LayerNorm). x, y (B, S, C) (may alias); weight (C). */
    dit_status (*rms_norm)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                           const dit_tensor *weight, float eps);

    /* y[i] = table[ids[i]] for host ids (n of them). y (n, C), table (V, C).
     * Ids outside [0, V) are errors. */
    dit_status (*embedding)(dit_backend *be, const dit_tensor *y, const dit_tensor *table,
                            const int32_t *ids, int64_t n);

    /* 2-D convolution, NCHW: x (B, Cin, H, W), w (Cout, Cin, kh, kw), bias
     * (Cout) or NULL, y (B, Cout, Ho, Wo) with Ho = (H + 2 pad - kh) / stride
     * + 1 (likewise Wo). Zero padding. */
    dit_status (*conv2d)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                         const dit_tensor *w, const dit_tensor *bias, int stride, int pad);

    /* GroupNorm over NCHW x (B, C, H, W) with `groups` groups, affine weight
     * and bias (C), then act (NONE or SILU). y may alias x. */
    dit_status (*group_norm)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                             const dit_tensor *weight, const dit_tensor *bias, int groups,
                             float eps, dit_act act);

    /* Nearest-neighbour 2x upsampling, NCHW: y (B, C, 2H, 2W), x (B, C, H, W). */
    dit_status (*upsample2x)(dit_backend *be, const dit_tensor *y, const dit_tensor *x);

    /* In place on x (B, S, H, D): RMSNorm over D with weight (D), then, when
     * cos and sin (S, D) are given, rotary embedding on interleaved pairs
     * (x[2i], x[2i+1]) in f32. */
    dit_status (*rms_norm_rope)(dit_backend *be, const dit_tensor *x, const dit_tensor *weight,
                                float eps, const dit_tensor *cos, const dit_tensor *sin);

    /* res += gate * x, gate (B, C) broadcast over S, or NULL for a plain add.
     * res, x (B, S, C). */
    dit_status (*gated_add)(dit_backend *be, const dit_tensor *res, const dit_tensor *x,
                            const dit_tensor *gate);

    /* Softmax attention without mask:
     *   out = softmax(scale * q k^T) v, lse = log(sum exp(scale * q k^T)).
     * q (B, Sq, H, D), k and v (B, Skv, H, D), out (B, Sq, H, D),
     * lse (B, H, Sq) contiguous f32 or NULL. Never materialises Sq x Skv. */
    dit_status (*attention)(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                            const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                            float scale);

    /* Attention with an additive bias and/or a causal mask, for the text
     * encoders: scores = scale * q k^T + bias, with bias (H, Sq, Skv) f32
     * (shared by the batch) or NULL; causal masks key j > query i. Same
     * shapes as attention; no log-sum-exp. */
    dit_status (*attention_masked)(dit_backend *be, const dit_tensor *out, const dit_tensor *q,
                                   const dit_tensor *k, const dit_tensor *v, float scale,
                                   const dit_tensor *bias, bool causal);

    /* Merges a partial attention result into a running one, in f32:
     *   lse' = log(e^lse + e^lse_b),
     *   out' = (e^lse out + e^lse_b out_b) / (e^lse + e^lse_b).
     * out, out_b (B, S, H, D); lse, lse_b (B, H, S) f32. Updates out, lse. */
    dit_status (*lse_merge)(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                            const dit_tensor *out_b, const dit_tensor *lse_b);

    /* Waits for all issued work. */
    dit_status (*sync)(dit_backend *be);

    /* ---- Optional: NULL where a backend has no use for them (cpu). ---- */

    /* Graph capture. Between graph_begin and graph_end the backend records
     * the ops issued instead of (or as well as) running them; graph_launch
     * replays them on the same memory. Captured ops must not grow backend
     * scratch, upload, download or sync (do an eager pass of the same shape
     * first). graph_end always ends the capture; on failure *out is NULL. */
    dit_status (*graph_begin)(dit_backend *be);
    dit_status (*graph_end)(dit_backend *be, dit_backend_graph **out);
    dit_status (*graph_launch)(dit_backend *be, dit_backend_graph *g);
    void (*graph_destroy)(dit_backend *be, dit_backend_graph *g);

    /* Device-side pseudo-random init matching the host generator of
     * dit_flux_create_random: with gamma = 0x9e3779b97f4a7c15 and
     * mix() splitmix64's output function, element (r, c) of dst (N) or
     * (N, K) becomes (float)((2u - 1) a) with
     * u = (mix(base + (row0 + r) 0x2545f4914f6cdd1d + (col0 + c + 1) gamma)
     * >> 11) 2^-53, stored in dst's dtype. */
    dit_status (*init_uniform)(dit_backend *be, const dit_tensor *dst, uint64_t base, int64_t row0,
                               int64_t col0, float a);

    /* The message of the last failed op ("linear: cublasLtMatmul: ..."), or
     * "" when there is none. */
    const char *(*last_error)(dit_backend *be);

    /* ---- Optional: a faster layout of activations (cuda's fast path). ---- */

    /* The dtype the backend wants for activations whose only consumers are
     * GEMMs (linear's x) and attention (q, k, v, out): DIT_BF16 on cuda
     * with DIT_CUDA_PATH=fast, where linear then also takes bf16 x and
     * writes bf16 y (beta 0), attention takes bf16 q, k, v and writes bf16
     * out, and layer_norm_mod writes bf16 y; DIT_F32 otherwise. NULL means
     * DIT_F32. A model asks at the start of every forward. */
    dit_dtype (*operand_dtype)(dit_backend *be);

    /* rms_norm_rope out of place: y (B, S, H, D), of dtype f32 or
     * operand_dtype, gets RMSNorm + RoPE of x (B, S, H, D) f32, which is not
     * changed. Same weight, cos, sin rules. */
    dit_status (*rms_norm_rope_to)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                   const dit_tensor *weight, float eps, const dit_tensor *cos,
                                   const dit_tensor *sin);

    /* ---- Text encoders. ---- */

    /* T5's relative position bias, built where attention reads it:
     * y[h][i][j] = table[buckets[j - i + Sq - 1]][h] for y (H, Sq, Skv) f32
     * contiguous and table (n_buckets, H) f32 contiguous, both backend
     * tensors. buckets (host) holds Sq + Skv - 1 ids, the bucket of the
     * relative position r = j - i at r + Sq - 1; an id outside
     * [0, n_buckets) is an error. Not during graph capture. */
    dit_status (*relative_bias)(dit_backend *be, const dit_tensor *y, const dit_tensor *table,
                                const int32_t *buckets);
} dit_backend_ops;

/* Every backend struct starts with this header. */
struct dit_backend {
    const dit_backend_ops *ops;
};

typedef enum dit_backend_kind {
    DIT_BACKEND_CPU = 0,
    DIT_BACKEND_CUDA,
} dit_backend_kind;

typedef struct dit_backend_config {
    dit_backend_kind kind;
    int n_threads; /* cpu: worker threads, 0 = all cores */
    int device;    /* cuda: device ordinal */
} dit_backend_config;

dit_status dit_backend_create(const dit_backend_config *cfg, dit_backend **out, dit_diag *diag);
void dit_backend_destroy(dit_backend *be);

/* Parses "cpu" / "cuda". */
dit_status dit_backend_kind_parse(const char *s, dit_backend_kind *out);

/* Whether this build has the backend compiled in. */
bool dit_backend_available(dit_backend_kind kind);

/* Thin dispatchers, so callers read `dit_backend_linear(be, ...)`. */
static inline dit_status dit_backend_alloc(dit_backend *be, size_t bytes, void **out)
{
    return be->ops->alloc(be, bytes, out);
}
static inline void dit_backend_free(dit_backend *be, void *p)
{
    if (p)
        be->ops->free(be, p);
}

#ifdef __cplusplus
}
#endif

#endif
