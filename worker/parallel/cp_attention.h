/* Context-parallel attention: Ulysses, ring, and both (unified), each with
 * even or uneven ("anything") splits, on any backend and comm.
 *
 * Ulysses (group of U ranks, rank u): an all-to-all trades the sequence split
 * for a head split, so rank u holds heads [u*Hc, min(H, (u+1)*Hc)) with
 * Hc = ceil(H/U) for the whole sequence of its group (ranks' chunks in rank
 * order); after attention the inverse all-to-all brings (B, S_local, H, D)
 * back. Uneven chunks and head counts are just uneven block sizes.
 *
 * Ring (group of R ranks, rank r): every rank keeps its queries and passes
 * key/value chunks around the ring; at step s it attends to the chunk of rank
 * (r - s) mod R while the next chunk is already on its way, and merges the
 * partial results by their log-sum-exp in f32. Chunks travel padded to the
 * longest chunk and are sliced back, so padding never enters the softmax.
 * Memory: two chunks.
 *
 * Unified: Ulysses inside each ulysses group, then ring attention across the
 * ring group on (B, S_group, H_local, D), then the inverse all-to-all.
 *
 * Owner: the rank's thread. */
#ifndef DIT_PARALLEL_CP_ATTENTION_H
#define DIT_PARALLEL_CP_ATTENTION_H

#include <stdint.h>

#include "backend/backend.h"
#include "backend/arena.h"
#include "parallel/mesh.h"

typedef struct dit_cp_attention dit_cp_attention;

dit_status dit_cp_attention_create(dit_backend *be, const dit_mesh *mesh, dit_cp_attention **out,
                                   dit_diag *diag);
void dit_cp_attention_destroy(dit_cp_attention *a);

/* Sequence length held by every context-parallel rank (indexed by cp rank),
 * set once per forward pass. */
dit_status dit_cp_attention_set_lengths(dit_cp_attention *a, const int64_t *lengths, int n,
                                        dit_diag *diag);

/* out = attention over the whole context-parallel sequence for the local
 * queries. q, k, v, out (B, S_local, H, D); scratch from `arena`. */
dit_status dit_cp_attention_run(dit_cp_attention *a, dit_arena *arena, const dit_tensor *out,
                                const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                                float scale, dit_diag *diag);

/* Bytes this rank sent through the comm since creation (for benchmarks). */
uint64_t dit_cp_attention_bytes_sent(const dit_cp_attention *a);

#endif
