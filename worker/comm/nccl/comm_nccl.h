/* The NCCL comm backend: one rank per GPU, ranks in one or more processes
 * (usually one process per GPU), possibly on several hosts.
 *
 * Setup: rank 0 calls dit_nccl_unique_id and relays the bytes to every other
 * rank by some host channel (the daemon's supervisor, a file, a socket); then
 * every rank calls dit_nccl_comm_create with the same id and world size. The
 * process that made the id runs NCCL's bootstrap root for it, so it must stay
 * alive until every rank has finished creating its group.
 *
 * Buffers passed to the ops are device memory on cfg->device. Ops are
 * enqueued on the compute stream given at creation and return once enqueued
 * (barrier excepted, see comm.h); a peer that dies or stalls is noticed by
 * the next op's enqueue check, by barrier, or by a host wait on the compute
 * stream that polls dit_nccl_wait_check (the cuda backend's downloads and
 * syncs do once it is installed there), within cfg->timeout_s; the group
 * and every group split from it are then aborted, so that kernels stuck on
 * the dead peer exit, and report DIT_ERR_PEER or DIT_ERR_TIMEOUT.
 *
 * This header is plain C and needs neither CUDA nor NCCL headers: the
 * stream is passed as a void pointer.
 *
 * Owner: the thread that created the group (not thread-safe, as comm.h says).
 * create makes cfg->device the calling thread's current CUDA device. */
#ifndef DIT_COMM_NCCL_COMM_NCCL_H
#define DIT_COMM_NCCL_COMM_NCCL_H

#include "comm/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Size of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES). */
#define DIT_NCCL_ID_BYTES 128

/* Makes a new group id. Called once, by rank 0, per group created with
 * dit_nccl_comm_create; needs no GPU. */
dit_status dit_nccl_unique_id(unsigned char out[DIT_NCCL_ID_BYTES], dit_diag *diag);

typedef struct dit_nccl_config {
    int rank;                            /* 0 .. world_size-1 */
    int world_size;                      /* >= 1 */
    int device;                          /* CUDA device ordinal this rank uses */
    unsigned char id[DIT_NCCL_ID_BYTES]; /* from rank 0's dit_nccl_unique_id */
    void *stream;                        /* cudaStream_t of the compute backend; NULL: the group
                                            creates (and owns) a stream of its own */
    double timeout_s; /* longest wait for peers before DIT_ERR_TIMEOUT; 0 = 60 s */
} dit_nccl_config;

/* Joins the group described by cfg (collective over all world_size ranks;
 * waits up to the timeout for the others). Errors: DIT_ERR_INVALID_ARG for a
 * bad config, DIT_ERR_DEVICE when the device cannot be used (no GPU, no
 * driver), DIT_ERR_PEER / DIT_ERR_TIMEOUT when the other ranks fail or do not
 * turn up. */
dit_status dit_nccl_comm_create(const dit_nccl_config *cfg, dit_comm **out, dit_diag *diag);

/* One look at the health of `comm` (a dit_comm * from dit_nccl_comm_create,
 * passed as void * so that it fits the cuda backend's wait hook,
 * dit_cuda_backend_set_wait_check) and of every group split from it, for a
 * host that has been waiting `waited_s` seconds on the compute stream:
 * DIT_OK to keep waiting; DIT_ERR_PEER when NCCL reports an asynchronous
 * error on any of them (a peer died, a link dropped) or one is already
 * broken; DIT_ERR_TIMEOUT once waited_s passes the group's timeout. On an
 * error every group of the family is aborted (ncclCommAbort), which makes
 * their kernels exit so that the stream drains; destroy them. */
dit_status dit_nccl_wait_check(void *comm, double waited_s, dit_diag *diag);

#ifdef __cplusplus
}
#endif

#endif
