/* Collective communication over a group of ranks: a struct of function
 * pointers with two implementations, `shm` (CPU processes on one host,
 * POSIX shared memory) and `nccl` (GPUs).
 *
 * Rules shared by every backend:
 *  - Buffers are in the memory of the backend the group serves: host memory
 *    for shm, device memory for nccl. Sizes are in bytes unless a dtype is
 *    given. Ranks are indices within the group, 0 .. size-1.
 *  - Every op is collective over the whole group: all members call it, in
 *    the same order, with matching sizes. sendrecv is collective too: every
 *    member sends to one peer and receives from one peer in the same call
 *    (ring rotation is the use).
 *  - A rank whose peer died, stalled past the group's timeout, or aborted
 *    gets DIT_ERR_PEER or DIT_ERR_TIMEOUT (with a message naming the peer),
 *    never a hang. After such an error the group is unusable; destroy it.
 *  - Packed layouts: "v" ops take per-rank byte counts and lay the blocks
 *    end to end in rank order, without gaps.
 *  - Completion: shm ops have finished when they return. nccl ops are
 *    enqueued on the stream the group was created with (the compute
 *    stream), so they are ordered with the kernels around them; barrier
 *    waits for the stream and is where a broken peer is noticed.
 *
 * Owner: the thread that created the group; not thread-safe. */
#ifndef DIT_COMM_COMM_H
#define DIT_COMM_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dit_comm dit_comm;

/* An exchange started by sendrecv_start and finished by sendrecv_wait. */
typedef struct dit_comm_request {
    int active;
    const void *send;
    size_t send_bytes;
    int dst;
    void *recv;
    size_t recv_bytes;
    int src;
    uint64_t seq; /* backend bookkeeping */
} dit_comm_request;

typedef struct dit_comm_ops {
    const char *name;
    void (*destroy)(dit_comm *c);

    /* In-place sum of `count` elements of `dtype` (f32 on shm; f32/bf16/f16
     * on nccl). Every rank gets the same bits. */
    dit_status (*all_reduce_sum)(dit_comm *c, void *buf, size_t count, dit_dtype dtype,
                                 dit_diag *diag);

    /* recv = concat over ranks of each rank's `bytes` from send (even). */
    dit_status (*all_gather)(dit_comm *c, const void *send, size_t bytes, void *recv,
                             dit_diag *diag);

    /* recv = concat over ranks r of counts[r] bytes (uneven); this rank
     * sends counts[rank] bytes from send. */
    dit_status (*all_gather_v)(dit_comm *c, const void *send, void *recv, const size_t *counts,
                               dit_diag *diag);

    /* send holds size blocks of `bytes`, block j for rank j; recv receives
     * size blocks, block i from rank i. */
    dit_status (*all_to_all)(dit_comm *c, const void *send, size_t bytes, void *recv,
                             dit_diag *diag);

    /* Uneven: send_counts[j] bytes to rank j, recv_counts[i] bytes from
     * rank i, both packed in rank order. */
    dit_status (*all_to_all_v)(dit_comm *c, const void *send, const size_t *send_counts, void *recv,
                               const size_t *recv_counts, dit_diag *diag);

    /* Starts sending send_bytes to rank dst while receiving recv_bytes from
     * rank src; the buffers must stay untouched until sendrecv_wait. At most
     * one exchange is open per group. */
    dit_status (*sendrecv_start)(dit_comm *c, const void *send, size_t send_bytes, int dst,
                                 void *recv, size_t recv_bytes, int src, dit_comm_request *req,
                                 dit_diag *diag);
    dit_status (*sendrecv_wait)(dit_comm *c, dit_comm_request *req, dit_diag *diag);

    /* bytes from root's buf to every rank's buf. */
    dit_status (*broadcast)(dit_comm *c, void *buf, size_t bytes, int root, dit_diag *diag);

    dit_status (*barrier)(dit_comm *c, dit_diag *diag);

    /* Collective over this group: ranks with the same color form a new group,
     * ordered by (key, rank). color < 0 takes part but joins no group
     * (*out = NULL). */
    dit_status (*split)(dit_comm *c, int color, int key, dit_comm **out, dit_diag *diag);

    /* Marks the group broken so that every member's pending and future ops
     * fail fast (used when this rank fails, or its supervisor says so). */
    void (*abort)(dit_comm *c);
} dit_comm_ops;

/* Every backend's group struct starts with this header. */
struct dit_comm {
    const dit_comm_ops *ops;
    int rank;
    int size;
};

static inline int dit_comm_rank(const dit_comm *c)
{
    return c->rank;
}

static inline int dit_comm_size(const dit_comm *c)
{
    return c->size;
}

/* Blocking exchange: sendrecv_start then sendrecv_wait. */
dit_status dit_comm_sendrecv(dit_comm *c, const void *send, size_t send_bytes, int dst, void *recv,
                             size_t recv_bytes, int src, dit_diag *diag);

/* NULL-safe. Sub-groups must be destroyed before the group they came from. */
void dit_comm_destroy(dit_comm *c);

#ifdef __cplusplus
}
#endif

#endif
