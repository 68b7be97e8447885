/* One forward pass of a model (models/model.h) on one rank of a mesh (or
 * alone): takes this rank's share of the whole inputs by the model class's
 * context-parallel plan (parallel/cp_plan.h), runs the model with the
 * mesh's attention and tensor-parallel all-reduce as its hooks, and
 * gathers the output. Nothing here knows a particular model. ditrun and
 * ditworker use it, and hand pipelines its dit_denoiser.
 *
 * CFG parallelism (a mesh with cfg_degree 2): when the forward's batch B
 * (dim 0 of the output, and of every input the plan marks `batch`) is
 * even, CFG group g runs entries [g B/2, (g+1) B/2) of the batch on its own
 * (ring, ulysses, tp) layout, and one all-gather between rank i of group 0
 * and rank i of group 1 gives every rank the whole output, as if the whole
 * batch had run. A pipeline's CFG batch stacks [conditional...,
 * unconditional...], so the groups compute one half each. When B is odd
 * (no CFG: batch 1) both groups run the whole batch: the same result, no
 * exchange and no speedup.
 *
 * Owner: the rank's thread. */
#ifndef DIT_RUNTIME_RUNNER_H
#define DIT_RUNTIME_RUNNER_H

#include <stdint.h>

#include "backend/backend.h"
#include "core/named_tensors.h"
#include "models/denoiser.h"
#include "models/model.h"
#include "parallel/mesh.h"

typedef struct dit_runner dit_runner;

/* Called after each transformer block; a non-OK status stops the pass. */
typedef dit_status (*dit_block_fn)(void *ctx, int block, dit_diag *diag);

/* mesh may be NULL (one rank). The runner borrows be, model and mesh. */
dit_status dit_runner_create(dit_backend *be, dit_model *model, dit_mesh *mesh, dit_runner **out,
                             dit_diag *diag);
void dit_runner_destroy(dit_runner *r);

void dit_runner_set_block_callback(dit_runner *r, dit_block_fn fn, void *ctx);

/* Runs the pass. `in`: whole host f32 inputs named as the model's forward
 * arguments; every rank receives the whole output in `out` (host f32, the
 * shape the model class's output_shape gives). */
dit_status dit_runner_forward(dit_runner *r, const dit_named_tensors *in, const dit_tensor *out,
                              dit_diag *diag);

/* The runner as the seam pipelines call (valid while the runner lives). */
dit_denoiser dit_runner_denoiser(dit_runner *r);

typedef struct dit_runner_stats {
    uint64_t attention_bytes_sent; /* context-parallel K/V and head exchanges */
    uint64_t tp_bytes_reduced;     /* bytes entering tensor-parallel all-reduces */
    uint64_t tp_bytes_gathered;    /* AdaLN slices this rank contributed to all-gathers */
    uint64_t gather_bytes;         /* output gather */
    uint64_t cfg_bytes_gathered;   /* this rank's output half in CFG exchanges */
    size_t activation_bytes;       /* arena high-water mark */
} dit_runner_stats;

/* Totals since creation. */
dit_runner_stats dit_runner_get_stats(const dit_runner *r);

#endif
