/* Parallel layout: the (cfg, ring, ulysses, tp) mesh, its validation, and
 * the sub-groups a rank talks to.
 *
 * Meaning as in diffusers' ContextParallelConfig / TensorParallelConfig:
 * ring_degree R and ulysses_degree U split the sequence (context parallel
 * size C = R * U), tp_degree T splits heads and MLP columns. ditserve also
 * combines CP with TP (diffusers refuses) and offers uneven "anything" splits
 * for the unified R x U layout.
 *
 * cfg_degree G (1 or 2, xDiT's CFG parallelism) splits the batch of a
 * forward in two: rank group 0 runs the first half of the batch (the
 * conditional entries of a CFG batch), group 1 the second half (the
 * unconditional ones), each with the whole (ring, ulysses, tp) layout
 * inside it; see runtime/runner.h.
 *
 * Ranks are laid out row-major over (cfg, ring, ulysses, tp):
 *   rank = ((cfg_idx * R + ring_idx) * U + ulysses_idx) * T + tp_idx
 * so tensor-parallel groups are contiguous ranks (the fastest links), Ulysses
 * groups are strided by T and ring groups by U * T, and the two CFG groups
 * are the two halves of the world (cfg group: rank i of each half). The
 * context-parallel rank (the sequence chunk a rank holds) is
 * cp = ring_idx * U + ulysses_idx.
 *
 * Owner: the rank's thread. */
#ifndef DIT_PARALLEL_MESH_H
#define DIT_PARALLEL_MESH_H

#include <stdbool.h>
#include <stdint.h>

#include "comm/comm.h"
#include "core/status.h"

typedef struct dit_parallel_config {
    int world_size;
    int ring_degree;
    int ulysses_degree;
    int tp_degree;
    int cfg_degree;        /* 1, or 2: the batch halves on two rank groups */
    bool ulysses_anything; /* uneven sequence and heads, ulysses only (as diffusers) */
    bool ring_anything;    /* uneven sequence, ring only (as diffusers) */
    bool unified_anything; /* uneven sequence and heads with ring x ulysses (ditserve) */
    bool fp32_merge;       /* convert_to_fp32: merge ring partials in f32 */
} dit_parallel_config;

/* World size 1, every degree 1, f32 merge. */
dit_parallel_config dit_parallel_config_single(void);

/* Rules that depend only on the layout: degrees >= 1, cfg_degree 1 or 2,
 * the product cfg x R x U x T equal to the world size, a parallel layout when world_size > 1, the
 * anything-mode rules. */
dit_status dit_parallel_validate(const dit_parallel_config *pc, dit_diag *diag);

#define DIT_PARALLEL_MAX_WIDTHS 4
#define DIT_PARALLEL_MAX_SEQS 4

/* What a model asks of a parallel layout, from its config alone (a model
 * class's parallel_req): the attention heads that Ulysses and TP split, the
 * feature widths TP splits by columns (FFN widths), and the sequences its
 * context-parallel plan splits, in the order their lengths are passed.
 * Names are string literals, used in messages.
 *
 * Owner: plain value. */
typedef struct dit_parallel_req {
    int num_heads;
    int n_widths;
    int widths[DIT_PARALLEL_MAX_WIDTHS];
    const char *width_names[DIT_PARALLEL_MAX_WIDTHS]; /* "the FFN width" */
    int n_seqs;
    const char *seq_names[DIT_PARALLEL_MAX_SEQS]; /* "image tokens", "text tokens" */
} dit_parallel_req;

/* Rules that depend on the model and the request: heads and every width
 * divisible by T, heads divisible by U (plain Ulysses), and (when seq_lens,
 * req->n_seqs lengths, is not NULL) every split sequence divisible by the CP
 * size (plain modes). A model that splits no sequence refuses a CP size
 * above 1. */
dit_status dit_parallel_validate_model(const dit_parallel_config *pc, const dit_parallel_req *req,
                                       const int64_t *seq_lens, dit_diag *diag);

/* Whether some uneven split is allowed. */
bool dit_parallel_uneven(const dit_parallel_config *pc);

/* torch.tensor_split: part i of n items over k parts; the first n % k parts
 * get one more. */
void dit_partition(int64_t n, int k, int i, int64_t *offset, int64_t *len);

typedef struct dit_mesh dit_mesh;

/* Splits `world` into this rank's tp, ulysses, ring, cp and cfg groups. The mesh
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
/* Rank i of CFG group 0 and rank i of group 1, in that order; NULL when
 * cfg_degree == 1. */
dit_comm *dit_mesh_cfg(const dit_mesh *m);
int dit_mesh_tp_rank(const dit_mesh *m);
int dit_mesh_ulysses_rank(const dit_mesh *m);
int dit_mesh_ring_rank(const dit_mesh *m);
int dit_mesh_cp_rank(const dit_mesh *m);
int dit_mesh_cp_size(const dit_mesh *m);
int dit_mesh_cfg_rank(const dit_mesh *m); /* the CFG group, 0 or 1 */
int dit_mesh_cfg_size(const dit_mesh *m); /* cfg_degree */

#endif
