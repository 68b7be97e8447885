/* The seam between a pipeline and whatever runs its transformer.
 *
 * A pipeline (pipelines/) prepares the transformer's inputs for one step as
 * whole, unsplit host f32 tensors named as the model's forward arguments are
 * named in diffusers, and calls `forward`. Who implements it decides where
 * the model runs: the runtime's runner (runtime/) splits the inputs over a
 * context-parallel mesh by the model class's CP plan, runs every rank and
 * gathers the output; a test may run the model on one rank directly. The
 * pipeline never sees ranks, meshes or the model's C type.
 *
 * Inputs of FluxTransformer2DModel, for example: "hidden_states" (B, Si, C),
 * "encoder_hidden_states" (B, St, J), "pooled_projections" (B, P),
 * "timestep" (B), "guidance" (B) when the model embeds guidance,
 * "img_ids" (Si, 3), "txt_ids" (St, 3); the output is the
 * (B, Si, out_channels) sample.
 *
 * Owner: the implementer; the pipeline only borrows it for a generation. */
#ifndef DIT_MODELS_DENOISER_H
#define DIT_MODELS_DENOISER_H

#include "core/named_tensors.h"
#include "core/status.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dit_denoiser {
    void *ctx;
    /* One forward pass. `in`: host f32 tensors (contiguous), whole batch and
     * sequence. `out`: a host f32 tensor of the output's shape, written in
     * full on success. */
    dit_status (*forward)(void *ctx, const dit_named_tensors *in, const dit_tensor *out,
                          dit_diag *diag);
} dit_denoiser;

#ifdef __cplusplus
}
#endif

#endif
