/* What T5EncoderModel (t5_encoder.c) and UMT5EncoderModel (umt5_encoder.c)
 * share, written once: the config.json reader (T5Config's keys and its
 * feed_forward_proj / dense_act_fn / is_gated_act rules, which UMT5Config
 * repeats), the parameters both load the same way (the tied input
 * embedding, each block's projections and norms, the final norm), the
 * relative-position buckets and the host-side (H, S, n) bias built from a
 * (num_buckets, H) table, the backend ops they need, and the forward pass
 * around the attention call (scratch, embedding, RMS norms, q/k/v/o
 * projections, the feed-forward, the final norm).
 *
 * What differs stays in each encoder: T5 reads block 0's
 * relative_attention_bias and applies it in every block, unmasked; UMT5
 * reads one table per block and masks keys past each entry's length. Each
 * encoder's forward loop calls dit_t5_block_attn_in, its own attention,
 * then dit_t5_block_attn_out_ffn.
 *
 * Internal to the encoders/ folder (the public APIs are t5_encoder.h and
 * umt5_encoder.h). dit_t5_relative_bucket, declared in t5_encoder.h, is
 * defined in t5_common.c. Errors carry the caller's wording: `what` ("t5
 * encoder forward") and the model's name, as the encoders always have.
 *
 * Owner: stateless; the backend functions run on the thread that owns the
 * backend. */
#ifndef DIT_ENCODERS_T5_COMMON_H
#define DIT_ENCODERS_T5_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/arena.h"
#include "backend/backend.h"
#include "core/status.h"
#include "core/tensor.h"
#include "loader/safetensors.h"
#include "loader/weights.h"

/* ------------------------------------------------------------------------ */
/* config.json                                                               */

typedef struct dit_t5_config {
    int64_t vocab, d_model, d_kv, n_heads, n_layers, d_ff, n_buckets, max_distance;
    float eps;
    bool gated;
    dit_act act;   /* dense_act_fn, when the backend has it */
    bool act_relu; /* dense_act_fn "relu": applied on the host (no backend op) */
} dit_t5_config;

/* One config class: the model_type it accepts, how errors name it, and the
 * defaults transformers gives keys that config.json leaves out. */
typedef struct dit_t5_config_kind {
    const char *model_type; /* "t5" */
    const char *model;      /* "T5EncoderModel" */
    const char *holder;     /* "FluxPipeline's text_encoder_2/" */
    int64_t vocab, n_heads, n_layers, d_ff;
    const char *feed_forward_proj;
} dit_t5_config_kind;

/* Reads config.json at `path` into *c. A model_type other than
 * kind->model_type is DIT_ERR_UNSUPPORTED; missing keys take kind's (and
 * T5Config's shared) defaults; errors name the file. */
dit_status dit_t5_config_load(const char *path, const dit_t5_config_kind *kind, dit_t5_config *c,
                              dit_diag *diag);

/* DIT_ERR_UNSUPPORTED naming the first op the encoders' forward needs that
 * `be` lacks, and `model`. fill only when need_fill, copy only when
 * need_copy. */
dit_status dit_t5_check_backend(const dit_backend *be, bool need_fill, bool need_copy,
                                const char *model, dit_diag *diag);

/* ------------------------------------------------------------------------ */
/* Weights                                                                   */

typedef struct dit_t5_block {
    dit_tensor q, k, v;  /* (inner, d_model), no biases */
    dit_tensor o;        /* (d_model, inner) */
    dit_tensor ln0, ln1; /* (d_model) */
    dit_tensor wi0, wi1; /* gated: (d_ff, d_model) each */
    dit_tensor wi;       /* non-gated: (d_ff, d_model) */
    dit_tensor wo;       /* (d_model, d_ff) */
} dit_t5_block;

typedef struct dit_t5_weights {
    void *data; /* one backend allocation holding every tensor below */
    size_t bytes;
    dit_tensor embed;     /* (V, d_model) */
    dit_tensor final_w;   /* (d_model) */
    dit_t5_block *blocks; /* n_layers */
} dit_t5_weights;

/* Loads the input embedding, every block's projections and norms and the
 * final norm from `set` (opened from `dir`) into *w (zeroed by the caller).
 * The embedding is tied: shared.weight, encoder.embed_tokens.weight or both
 * (the same values); the first present is loaded and a second copy only has
 * to have the right shape. *list receives the loaded parameters (for
 * dit_encoder_check_unexpected; free it with dit_weight_list_free), and
 * *dup_embed the name of that second copy, or NULL. The relative attention
 * biases are not loaded: see dit_t5_rel_bias_load. On error *w still needs
 * dit_t5_weights_free. */
dit_status dit_t5_weights_load(dit_backend *be, const dit_st_set *set, const char *dir,
                               const dit_t5_config *c, dit_t5_weights *w, dit_weight_list *list,
                               const char **dup_embed, dit_diag *diag);

/* NULL-safe parts; leaves *w zeroed. */
void dit_t5_weights_free(dit_backend *be, dit_t5_weights *w);

/* The longest relative_attention_bias tensor name dit_t5_rel_bias_load
 * writes, with its terminator. */
#define DIT_T5_REL_BIAS_NAME_CAP 96

/* Block `layer`'s relative_attention_bias, checked to be (n_buckets, H) and
 * converted to f32 at full checkpoint precision into tab (n_buckets * H
 * floats) on the host. name (DIT_T5_REL_BIAS_NAME_CAP bytes) receives the
 * tensor's name, for the caller's list of tensors read outside *list. */
dit_status dit_t5_rel_bias_load(const dit_st_set *set, const char *dir, const dit_t5_config *c,
                                int64_t layer, float *tab, char *name, dit_diag *diag);

/* The relative_attention_bias tables of blocks 0 .. n_tables - 1 as one
 * backend tensor (n_tables * n_buckets, H) f32 in its own allocation
 * (*buf, freed with dit_backend_free): block i's table is rows
 * [i * n_buckets, (i + 1) * n_buckets), which dit_t5_rel_table_of views.
 * The bias each forward needs is built from them on the backend
 * (relative_bias), never on the host. */
dit_status dit_t5_rel_tables_load(dit_backend *be, const dit_st_set *set, const char *dir,
                                  const dit_t5_config *c, int64_t n_tables, dit_tensor *tables,
                                  void **buf, char (*names)[DIT_T5_REL_BIAS_NAME_CAP],
                                  dit_diag *diag);
dit_tensor dit_t5_rel_table_of(const dit_tensor *tables, const dit_t5_config *c, int64_t layer);

/* ------------------------------------------------------------------------ */
/* Forward                                                                   */

/* ids non-NULL, 1 <= B, 1 <= S <= 2^20, and out a (B, S, d_model) f32
 * tensor with dense rows; DIT_ERR_INVALID_ARG prefixed by `what` if not. */
dit_status dit_t5_check_forward_args(const int32_t *ids, int64_t B, int64_t S,
                                     const dit_tensor *out, int64_t d_model, const char *what,
                                     dit_diag *diag);

/* One forward pass's buffers. Arena tensors (B, S, .) f32 unless noted. */
typedef struct dit_t5_scratch {
    dit_arena *arena;
    dit_arena_mark mark; /* released by dit_t5_forward_end */
    int64_t B, S;
    dit_tensor x;              /* (B, S, d_model) residual stream */
    dit_tensor n;              /* (B, S, d_model) RMSNorm output */
    dit_tensor qkv;            /* (B, S, 3 inner): [q | k | v] */
    dit_tensor attn;           /* (B, S, inner): what the encoder's attention writes */
    dit_tensor o;              /* (B, S, d_model): a sub-block's output before the residual add */
    dit_tensor h0;             /* (B, S, d_ff): act(wi_0 x) or act(wi x) */
    dit_tensor h1, prod;       /* gated only: wi_1 x and act(wi_0 x) * wi_1 x */
    dit_tensor bias;           /* (H, S, S) for the encoder's position bias; none without layers */
    dit_tensor q, k, v;        /* (B, S, inner) views of qkv */
    dit_tensor q4, k4, v4, a4; /* (B, S, H, d_kv) views of q, k, v and attn */
    /* Host, with layers only: the bucket of each relative position r in
     * buckets[r + S - 1], r = -(S-1) .. S-1 (relative_bias's argument). */
    int32_t *buckets;
} dit_t5_scratch;

/* Allocates *s from `arena` (and the host buffers), computes the buckets,
 * and writes x = embed[ids] (no scaling). On error everything is released
 * already; on success call dit_t5_forward_end once done. */
dit_status dit_t5_forward_begin(dit_backend *be, dit_arena *arena, const dit_t5_config *c,
                                const dit_t5_weights *w, const int32_t *ids, int64_t B, int64_t S,
                                const char *what, dit_t5_scratch *s, dit_diag *diag);

/* n = RMS0(x); q, k, v = their projections of n. */
dit_status dit_t5_block_attn_in(dit_backend *be, const dit_t5_config *c, const dit_t5_block *b,
                                dit_t5_scratch *s, const char *what, dit_diag *diag);

/* x += o(attn); x += wo(FFN(RMS1(x))), the gated or non-gated FFN. */
dit_status dit_t5_block_attn_out_ffn(dit_backend *be, const dit_t5_config *c, const dit_t5_block *b,
                                     dit_t5_scratch *s, const char *what, dit_diag *diag);

/* out = final_layer_norm(x). */
dit_status dit_t5_final_norm(dit_backend *be, const dit_t5_config *c, const dit_t5_weights *w,
                             dit_t5_scratch *s, const dit_tensor *out, const char *what,
                             dit_diag *diag);

/* Releases what dit_t5_forward_begin took. */
void dit_t5_forward_end(dit_t5_scratch *s);

/* The diag for a failed backend call: "<what>: <call> failed: <status>". */
dit_status dit_t5_op_failed(dit_diag *diag, dit_status st, const char *what, const char *call);

/* st = call; on failure the diag names `what` and the call, then goto
 * cleanup (as DIT_CHECK). Needs `st`, `what` and `diag` in scope. */
#define DIT_T5_OP(call)                                                                            \
    do {                                                                                           \
        st = (call);                                                                               \
        if (st != DIT_OK) {                                                                        \
            st = dit_t5_op_failed(diag, st, what, #call);                                          \
            goto cleanup;                                                                          \
        }                                                                                          \
    } while (0)

#endif
