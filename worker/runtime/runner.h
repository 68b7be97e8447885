/* One forward pass of the Flux transformer on one rank of a mesh (or alone):
 * takes this rank's share of the inputs (the context-parallel plan: image
 * and text tokens and their position ids split on the sequence), runs the
 * model with the mesh's attention and all-reduce, and gathers the output.
 * ditrun uses it directly; the daemon's workers will too.
 *
 * Owner: the rank's thread. */
#ifndef DIT_RUNTIME_RUNNER_H
#define DIT_RUNTIME_RUNNER_H

#include <stdint.h>

#include "backend/backend.h"
#include "models/flux/flux.h"
#include "parallel/mesh.h"

/* Host inputs of one forward pass, whole (every rank holds all of them),
 * shaped as diffusers' FluxTransformer2DModel.forward takes them. */
typedef struct dit_forward_inputs {
    int64_t batch, img_tokens, txt_tokens;
    const float *hidden_states;         /* (B, Si, in_channels) */
    const float *encoder_hidden_states; /* (B, St, joint_attention_dim) */
    const float *pooled_projections;    /* (B, pooled_projection_dim) */
    const float *timestep;              /* (B) */
    const float *guidance;              /* (B), or NULL without guidance embeds */
    const float *img_ids;               /* (Si, n_axes) */
    const float *txt_ids;               /* (St, n_axes) */
} dit_forward_inputs;

typedef struct dit_runner dit_runner;

/* Called after each transformer block; a non-OK status stops the pass. */
typedef dit_status (*dit_block_fn)(void *ctx, int block, dit_diag *diag);

/* mesh may be NULL (one rank). The runner borrows be, model and mesh. */
dit_status dit_runner_create(dit_backend *be, dit_flux *model, dit_mesh *mesh, dit_runner **out,
                             dit_diag *diag);
void dit_runner_destroy(dit_runner *r);

void dit_runner_set_block_callback(dit_runner *r, dit_block_fn fn, void *ctx);

/* Runs the pass; every rank receives the whole output in `sample` (host,
 * (B, Si, out_dim) f32). */
dit_status dit_runner_forward(dit_runner *r, const dit_forward_inputs *in, float *sample,
                              dit_diag *diag);

typedef struct dit_runner_stats {
    uint64_t attention_bytes_sent; /* context-parallel K/V and head exchanges */
    uint64_t tp_bytes_reduced;     /* bytes entering tensor-parallel all-reduces */
    uint64_t tp_bytes_gathered;    /* AdaLN slices this rank contributed to all-gathers */
    uint64_t gather_bytes;         /* output gather */
    size_t activation_bytes;       /* arena high-water mark */
} dit_runner_stats;

/* Totals since creation. */
dit_runner_stats dit_runner_get_stats(const dit_runner *r);

#endif
