/* WanTransformer3DModel (Wan 2.1 text-to-video): weights and the forward
 * pass, on any backend.
 *
 * The forward patchifies the latent video (B, C, F, H, W) on the host into
 * tokens (B, S, C pt ph pw) in (frame, row, column) order, runs the blocks
 * on the residual stream x (B, S, inner) and unpatchifies proj_out's
 * output back to (B, out_channels, F, H, W), as diffusers does.
 *
 * Parallelism enters through the shard and the hooks (models/model.h); with
 * no hooks the model runs on one rank.
 *
 * Owner: the thread that created it; one forward at a time. */
#ifndef DIT_MODELS_WAN_WAN_H
#define DIT_MODELS_WAN_WAN_H

#include <stddef.h>
#include <stdint.h>

#include "backend/arena.h"
#include "backend/backend.h"
#include "core/status.h"
#include "core/tensor.h"
#include "models/model.h"
#include "models/wan/wan_config.h"
#include "parallel/lora.h"
#include "parallel/tp_plan.h"

typedef struct dit_wan dit_wan;

/* The tensor-parallel plan the loader slices by (parallel/tp_plan.h). */
extern const dit_tp_rule dit_wan_tp_plan[];
extern const int dit_wan_tp_plan_len;

/* Loads `dir` (config.json and diffusion_pytorch_model.safetensors or its
 * sharded index), keeping this rank's slices (shard NULL: whole). Missing,
 * unexpected or mis-shaped tensors are errors naming the tensor and file. */
dit_status dit_wan_load(dit_backend *be, const char *dir, const dit_shard *shard, dit_wan **out,
                        dit_diag *diag);
void dit_wan_destroy(dit_wan *m);
const dit_wan_config *dit_wan_config_of(const dit_wan *m);
size_t dit_wan_weight_bytes(const dit_wan *m);
void dit_wan_set_hooks(dit_wan *m, const dit_model_hooks *hooks);
/* The linears LoRA adapters may target (parallel/lora.h). */
dit_lora_sites *dit_wan_lora_sites(dit_wan *m);

typedef struct dit_wan_inputs {
    /* Host, f32, contiguous: the latent video (B, in_channels, F, H, W)
     * with F, H, W divisible by the patch, and the timesteps (B) as
     * WanPipeline passes them (integers in [0, 1000), not scaled). */
    const dit_tensor *hidden_states;
    const float *timestep;
    /* Backend, f32: the text (B, L, text_dim). */
    dit_tensor encoder_hidden_states;
} dit_wan_inputs;

/* One forward pass. sample: backend tensor (B, out_channels, F, H, W), f32;
 * or (B, tokens, out_dim): proj_out's tokens before unpatchify, all of them
 * or, with the hooks' cp_layout, this rank's chunk of the video tokens.
 * Scratch from `arena`, which the caller resets afterwards. */
dit_status dit_wan_forward(dit_wan *m, dit_arena *arena, const dit_wan_inputs *in,
                           const dit_tensor *sample, dit_diag *diag);

/* Unpatchify on the host: tok (B, F H W / patch, out_dim) to out (B,
 * out_channels, NF, NH, NW). */
void dit_wan_unpatchify(const dit_wan_config *cfg, const float *tok, int64_t batch, int64_t nf,
                        int64_t nh, int64_t nw, float *out);

/* Floating-point operations of one whole forward: 2 rows in out per linear
 * plus 4 B Sq Skv inner per attention. */
double dit_wan_forward_flops(const dit_wan_config *cfg, int64_t batch, int64_t tokens,
                             int64_t text_tokens);

#endif
