/* The model interface: what generic code (the runtime, the tools, the
 * pipelines through the runtime) knows of a transformer, and the registry
 * that finds a model's class by the `_class_name` of its config.json.
 *
 * A model class is a table of functions and data: how to read its config,
 * what it asks of a parallel layout (dit_parallel_req), its context-
 * parallel plan (parallel/cp_plan.h), how to load it (with this rank's
 * tensor-parallel shard) and run one forward over named tensors, and what
 * the runtime needs besides (weight bytes, CUDA graphs on/off, the
 * cross-rank hooks). Adding a model = its files under models/<name>/ plus
 * one line in registry.c.
 *
 * Forward inputs are named as the diffusers forward's arguments. The
 * runtime passes this rank's share (by the CP plan): non-host inputs as
 * backend f32 tensors, host inputs as host f32 tensors.
 *
 * Owner: classes are static; a dit_model belongs to the thread that loaded
 * it, one forward at a time. */
#ifndef DIT_MODELS_MODEL_H
#define DIT_MODELS_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/arena.h"
#include "backend/backend.h"
#include "core/named_tensors.h"
#include "core/status.h"
#include "core/tensor.h"
#include "parallel/cp_plan.h"
#include "parallel/lora.h"
#include "parallel/mesh.h"
#include "parallel/tp_plan.h"

/* Which tensor-parallel slice of the weights this rank holds. */
typedef struct dit_shard {
    int tp_degree; /* 1 = the whole model */
    int tp_rank;
} dit_shard;

/* Cross-rank operations of a forward pass. A NULL function means "this rank
 * is alone in that group". */
typedef struct dit_model_hooks {
    void *ctx;
    /* Attention of the local queries against the keys and values of the whole
     * context-parallel group. q, k, v, out (B, S_local, H_local, D). */
    dit_status (*attention)(void *ctx, dit_arena *arena, const dit_tensor *out, const dit_tensor *q,
                            const dit_tensor *k, const dit_tensor *v, float scale, dit_diag *diag);
    /* full (B, T n) = the tensor-parallel group's local (B, n) slices side by
     * side, in rank order. */
    dit_status (*tp_all_gather)(void *ctx, dit_arena *arena, const dit_tensor *local,
                                const dit_tensor *full, dit_diag *diag);
    /* In-place sum over the tensor-parallel group. x (B, S, C). */
    dit_status (*tp_all_reduce)(void *ctx, const dit_tensor *x, dit_diag *diag);
    /* Called after every transformer block, counted from 0 in the order they
     * run; a status other than DIT_OK stops the pass. */
    dit_status (*block_done)(void *ctx, int index, dit_diag *diag);
    /* This forward's context-parallel layout (NULL: alone), for a model whose
     * plan has TOKENS rules: it computes tokens [off, off + len) of them. */
    const dit_cp_layout *cp_layout;
} dit_model_hooks;

typedef struct dit_model_class dit_model_class;

/* A loaded model: its class and the class's own object. */
typedef struct dit_model {
    const dit_model_class *cls;
    void *impl;
} dit_model;

/* A short description for logs and tools. */
typedef struct dit_model_summary {
    int num_blocks; /* transformer blocks of all kinds */
    int num_heads, head_dim;
    char blocks[96]; /* e.g. "19 double + 38 single blocks" */
} dit_model_summary;

struct dit_model_class {
    const char *diffusers_class; /* "FluxTransformer2DModel" */
    size_t config_size;          /* bytes of the class's config struct */
    /* Reads dir/config.json into cfg (config_size bytes). */
    dit_status (*config_load)(const char *dir, void *cfg, dit_diag *diag);
    dit_parallel_req (*parallel_req)(const void *cfg);
    dit_model_summary (*summary)(const void *cfg);
    /* The context-parallel plan (parallel/cp_plan.h). */
    const dit_cp_rule *cp_plan;
    int n_cp;
    /* Plans with TOKENS rules (parallel/cp_plan.h), else NULL: the whole
     * length of every sequence (parallel_req's n_seqs) from the inputs'
     * shapes (data may be absent); the shape the output gathers to (the
     * token sequence, split on the GATHER rule's dim); and the host step
     * that makes the final output (`out`, output_shape) from the gathered
     * tokens. */
    dit_status (*seq_lens)(const void *cfg, const dit_named_tensors *in, int64_t *lens,
                           dit_diag *diag);
    dit_status (*gathered_shape)(const void *cfg, const dit_named_tensors *in, dit_tensor *out,
                                 dit_diag *diag);
    dit_status (*cp_finish)(const void *cfg, const dit_named_tensors *in,
                            const dit_tensor *gathered, const dit_tensor *out, dit_diag *diag);
    /* The tensor-parallel plan (parallel/tp_plan.h) the class's load slices
     * by (through dit_tp_add_*), for tools and checks. */
    const dit_tp_rule *tp_plan;
    const int *n_tp;
    /* Loads dir (config.json and the safetensors) keeping this rank's shard
     * (NULL: whole). */
    dit_status (*load)(dit_backend *be, const char *dir, const dit_shard *shard, void **out,
                       dit_diag *diag);
    void (*destroy)(void *m);
    const void *(*config_of)(const void *m);
    /* One forward on this rank's share; `out` a backend f32 tensor of this
     * rank's output shape. Scratch from `arena` (the caller resets it). */
    dit_status (*forward)(void *m, dit_arena *arena, const dit_named_tensors *in,
                          const dit_tensor *out, dit_diag *diag);
    /* The whole output's shape (f32, data NULL) for whole inputs `in`. */
    dit_status (*output_shape)(const void *cfg, const dit_named_tensors *in, dit_tensor *out,
                               dit_diag *diag);
    /* Checks whole host inputs read from a file (`path` for messages): names,
     * shapes against the config. May narrow views in place (diffusers'
     * leniencies, e.g. per-batch ids of which batch 0 is used). */
    dit_status (*check_inputs)(const void *cfg, const char *path, dit_named_tensors *in,
                               dit_diag *diag);
    /* Whole-model floating-point operations of one forward on whole inputs. */
    double (*forward_flops)(const void *cfg, const dit_named_tensors *in);
    size_t (*weight_bytes)(const void *m);
    void (*set_hooks)(void *m, const dit_model_hooks *hooks);
    /* CUDA-graph replay of the forward (backend/graph_cache.h); optional. */
    void (*set_graphs)(void *m, bool on);
    bool (*graph_captured)(const void *m);
    /* The linears LoRA adapters may target (parallel/lora.h): load adapters
     * against them, attach a set before a forward, detach after. NULL: the
     * class takes no adapters. */
    dit_lora_sites *(*lora_sites)(void *m);
};

/* The class whose diffusers name is `diffusers_class`, or NULL. */
const dit_model_class *dit_model_class_find(const char *diffusers_class);

/* The class named by dir/config.json's `_class_name`; DIT_ERR_UNSUPPORTED
 * naming the known classes when there is none. */
dit_status dit_model_class_for_dir(const char *dir, const dit_model_class **out, dit_diag *diag);

/* Reads dir's config with its class; *cfg is malloc'ed (config_size). */
dit_status dit_model_config_load(const char *dir, const dit_model_class **cls, void **cfg,
                                 dit_diag *diag);

/* Finds dir's class and loads it. */
dit_status dit_model_load(dit_backend *be, const char *dir, const dit_shard *shard, dit_model **out,
                          dit_diag *diag);

/* Wraps an object of class `cls` (takes ownership). */
dit_status dit_model_wrap(const dit_model_class *cls, void *impl, dit_model **out, dit_diag *diag);

void dit_model_destroy(dit_model *m);

const void *dit_model_config(const dit_model *m);

/* m's LoRA sites (parallel/lora.h), or NULL when its class takes no
 * adapters. */
dit_lora_sites *dit_model_lora_sites(dit_model *m);

#endif
