/* The shared-memory comm backend: ranks are processes on one host that map
 * one POSIX shared-memory segment. Each rank owns staging slots in it; a
 * collective is "write my part, barrier, read what I need, barrier", with the
 * barrier a futex-based counter per group. Messages larger than a slot go
 * through it in chunks. Waiting ranks sleep in the kernel, check that their
 * peers are alive and give up after the configured timeout, so a dead or
 * stalled peer produces an error rather than a hang.
 *
 * Lifecycle: a launcher (ditrun, the daemon's supervisor) creates the
 * segment, starts the ranks, each rank joins it and gets the world group,
 * the launcher unlinks it at the end and may abort it when a rank dies.
 *
 * Owner: the segment handle belongs to the launcher's thread; a dit_comm
 * from dit_shm_comm_join belongs to the joining rank's thread. */
#ifndef DIT_COMM_SHM_COMM_SHM_H
#define DIT_COMM_SHM_COMM_SHM_H

#include <stddef.h>

#include "comm/comm.h"

#define DIT_SHM_MAX_RANKS 64
#define DIT_SHM_DEFAULT_SLOT_BYTES ((size_t)8 << 20)

typedef struct dit_shm_config {
    char name[64];     /* POSIX shm name, "/dit-..." */
    int world_size;    /* 1 .. DIT_SHM_MAX_RANKS */
    size_t slot_bytes; /* staging bytes per rank per slot; 0 = default */
    double timeout_s;  /* longest wait for peers before DIT_ERR_TIMEOUT; 0 = 60 s */
} dit_shm_config;

typedef struct dit_shm_segment dit_shm_segment;

/* Fills cfg->name with a name unique to this process and moment,
 * "/dit-PID-HEX", so that dit_shm_reclaim_stale can tell whose it is. */
void dit_shm_make_name(dit_shm_config *cfg);

/* Creates and initialises the segment (fails if the name exists). */
dit_status dit_shm_segment_create(const dit_shm_config *cfg, dit_shm_segment **out, dit_diag *diag);

/* Marks the mesh broken because `failed_rank` (or -1: unknown) failed; every
 * rank's pending and later ops then fail fast. */
void dit_shm_segment_abort(dit_shm_segment *seg, int failed_rank);

/* The first rank recorded as failed (by itself, a peer that saw it die, or
 * the launcher), or -1. */
int dit_shm_segment_failed_rank(const dit_shm_segment *seg);

/* Unmaps and unlinks. NULL-safe. */
void dit_shm_segment_destroy(dit_shm_segment *seg);

/* Removes the segment's name once every rank has mapped it: the memory
 * stays until the last mapping goes, and nothing is left in /dev/shm if the
 * creator is killed. NULL-safe. */
void dit_shm_segment_unlink(dit_shm_segment *seg);

/* Unlinks segments named by dit_shm_make_name ("/dit-PID-...") whose
 * creating process is gone and which belong to this user: what a killed
 * daemon left. Returns how many were removed. */
int dit_shm_reclaim_stale(void);

/* Joins an existing segment as `rank` and returns the world group. Waits
 * (up to the timeout) for every rank to join. */
dit_status dit_shm_comm_join(const dit_shm_config *cfg, int rank, dit_comm **out, dit_diag *diag);

#endif
