/* FluxTransformer2DModel: weights and the forward pass, on any backend.
 *
 * The forward pass keeps text and image tokens in one activation buffer
 * x (B, St + Si, C), text first, exactly the order diffusers concatenates them
 * for joint attention. Double-stream blocks run their two weight sets on the
 * two row ranges of that buffer, single-stream blocks run on all of it, so
 * there is never a concatenation or split copy.
 *
 * Parallelism enters through two seams: the shard (which slice of the
 * tensor-parallel weights this rank holds) and the comm hooks (attention over
 * the context-parallel group, and the all-reduce after row-split linears).
 * With no hooks the model runs on one rank.
 *
 * Owner: the thread that created it; one forward at a time. */
#ifndef DIT_MODELS_FLUX_FLUX_H
#define DIT_MODELS_FLUX_FLUX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "backend/arena.h"
#include "core/status.h"
#include "core/tensor.h"
#include "models/flux/flux_config.h"
#include "models/model.h"
#include "parallel/lora.h"
#include "parallel/tp_plan.h"

typedef struct dit_flux dit_flux;

/* Which tensor-parallel slice of the weights this rank holds: heads
 * [r H/T, (r+1) H/T) and MLP columns [r F/T, (r+1) F/T). */
typedef dit_shard dit_flux_shard;

/* Cross-rank operations of the forward pass (models/model.h). */
typedef dit_model_hooks dit_flux_hooks;

/* FluxTransformer2DModel's tensor-parallel plan (parallel/tp_plan.h), the
 * table its loader slices by. */
extern const dit_tp_rule dit_flux_tp_plan[];
extern const int dit_flux_tp_plan_len;

/* Loads `dir` (a diffusers transformer folder: config.json and
 * diffusion_pytorch_model.safetensors or its sharded index), keeping only
 * this rank's slices. shard may be NULL for the whole model. Missing,
 * unexpected or mis-shaped tensors are errors naming the tensor and file. */
dit_status dit_flux_load(dit_backend *be, const char *dir, const dit_flux_shard *shard,
                         dit_flux **out, dit_diag *diag);

/* A model with deterministic pseudo-random weights, for benchmarks at sizes
 * no checkpoint is at hand for. */
dit_status dit_flux_create_random(dit_backend *be, const dit_flux_config *cfg,
                                  const dit_flux_shard *shard, uint64_t seed, dit_flux **out,
                                  dit_diag *diag);

void dit_flux_destroy(dit_flux *m);

const dit_flux_config *dit_flux_config_of(const dit_flux *m);

/* Bytes of weights this rank holds on its backend. */
size_t dit_flux_weight_bytes(const dit_flux *m);

void dit_flux_set_hooks(dit_flux *m, const dit_flux_hooks *hooks);

/* The linears LoRA adapters may target, as this rank holds them
 * (parallel/lora.h); attached adapters take the plain f32 path without
 * CUDA graphs. */
dit_lora_sites *dit_flux_lora_sites(dit_flux *m);

/* FLUX's kohya names (dit_lora_kohya_fn). */
int dit_flux_lora_kohya(const char *name, dit_lora_kohya_target *out, int max);

typedef struct dit_flux_inputs {
    /* Backend tensors, f32. Token counts are this rank's. */
    dit_tensor hidden_states;         /* (B, Si, in_channels) */
    dit_tensor encoder_hidden_states; /* (B, St, joint_attention_dim) */
    dit_tensor pooled_projections;    /* (B, pooled_projection_dim) */
    /* Host arrays. */
    const float *timestep; /* (B), as passed to diffusers (x1000 inside) */
    const float *guidance; /* (B); required iff guidance_embeds, else NULL */
    const float *txt_ids;  /* (St, n_axes) */
    const float *img_ids;  /* (Si, n_axes) */
} dit_flux_inputs;

/* One forward pass. sample: backend tensor (B, Si, out_dim), f32.
 * Scratch comes from `arena`, which the caller resets afterwards. */
dit_status dit_flux_forward(dit_flux *m, dit_arena *arena, const dit_flux_inputs *in,
                            const dit_tensor *sample, dit_diag *diag);

/* CUDA-graph replay of the per-step forward (backend/graph_cache.h), for
 * backends with graph ops (cuda; ignored on cpu), keyed by the shapes and
 * the device addresses of inputs, output and arena; replays upload only the
 * step's timestep and RoPE tables first. Graphs stay off while any hook is
 * set. Off by default. */
void dit_flux_set_graphs(dit_flux *m, bool on);

/* Whether a captured graph is held (for tests and benchmarks). */
bool dit_flux_graph_captured(const dit_flux *m);

/* Floating-point operations of one whole-model forward (all ranks
 * together): 2*rows*in*out per linear plus 4*B*S^2*C per attention. */
double dit_flux_forward_flops(const dit_flux_config *cfg, int64_t batch, int64_t txt_tokens,
                              int64_t img_tokens);

#endif
