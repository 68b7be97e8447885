/* Parallel layout: the (ring, ulysses, tp) mesh, its validation, and the
 * sub-groups a rank talks to.
 *
 * Meaning as in diffusers' ContextParallelConfig / TensorParallelConfig:
 * ring_degree R and ulysses_degree U split the sequence (context parallel
 * size C = R * U), tp_degree T splits heads and MLP columns. ditserve also
 * combines CP with TP (diffusers refuses) and offers uneven "anything" splits
 * for the unified R x U layout.
 *
 * Ranks are laid out row-major over (ring, ulysses, tp):
 *   rank = (ring_idx * U + ulysses_idx) * T + tp_idx
 * so tensor-parallel groups are contiguous ranks (the fastest links), Ulysses
 * groups are strided by T and ring groups by U * T. The context-parallel rank
 * (the sequence chunk a rank holds) is cp = ring_idx * U + ulysses_idx.
 *
 * Owner: the rank's thread. */
#ifndef DIT_PARALLEL_MESH_H
#define DIT_PARALLEL_MESH_H

#include <stdbool.h>
#include <stdint.h>

#include "comm/comm.h"
#include "core/status.h"
#include "models/flux/flux_config.h"

typedef struct dit_parallel_config {
    int world_size;
    int ring_degree;
    int ulysses_degree;
    int tp_degree;
    bool ulysses_anything; /* uneven sequence and heads, ulysses only (as diffusers) */
    bool ring_anything;    /* uneven sequence, ring only (as diffusers) */
    bool unified_anything; /* uneven sequence and heads with ring x ulysses (ditserve) */
    bool fp32_merge;       /* convert_to_fp32: merge ring partials in f32 */
} dit_parallel_config;

/* World size 1, every degree 1, f32 merge. */
dit_parallel_config dit_parallel_config_single(void);

/* Rules that depend only on the layout: degrees >= 1, their product equal
 * to the world size, a parallel layout when world_size > 1, the anything-mode
 * rules. */
dit_status dit_parallel_validate(const dit_parallel_config *pc, dit_diag *diag);

/* Rules that depend on the model and the request: heads and FFN width
 * divisible by T, heads divisible by U (plain Ulysses), token counts
 * divisible by the CP size (plain modes). */
dit_status dit_parallel_validate_model(const dit_parallel_config *pc, const dit_flux_config *mc,
                                       int64_t img_tokens, int64_t txt_tokens, dit_diag *diag);

/* Whether some uneven split is allowed. */
bool dit_parallel_uneven(const dit_parallel_config *pc);

/* torch.tensor_split: part i of n items over k parts; the first n % k parts
 * get one more. */
void dit_partition(int64_t n, int k, int i, int64_t *offset, int64_t *len);

typedef struct dit_mesh dit_mesh;

/* Splits `world` into this rank's tp, ulysses, ring and cp groups. The mesh
 * borrows world; destroy the mesh before the world group. */
dit_status dit_mesh_create(const dit_parallel_config *pc, dit_comm *world, dit_mesh **out,
                           dit_diag *diag);
void dit_mesh_destroy(dit_mesh *m);

const dit_parallel_config *dit_mesh_config(const dit_mesh *m);
dit_comm *dit_mesh_world(const dit_mesh *m);
dit_comm *dit_mesh_tp(const dit_mesh *m);      /* NULL when T == 1 */
dit_comm *dit_mesh_ulysses(const dit_mesh *m); /* NULL when U == 1 */
dit_comm *dit_mesh_ring(const dit_mesh *m);    /* NULL when R == 1 */
dit_comm *dit_mesh_cp(const dit_mesh *m);      /* NULL when C == 1 */
int dit_mesh_tp_rank(const dit_mesh *m);
int dit_mesh_ulysses_rank(const dit_mesh *m);
int dit_mesh_ring_rank(const dit_mesh *m);
int dit_mesh_cp_rank(const dit_mesh *m);
int dit_mesh_cp_size(const dit_mesh *m);

#endif
