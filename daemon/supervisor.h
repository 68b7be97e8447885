/* The worker mesh: spawns one ditworker per local rank (uv_spawn, never fork
 * after grpc_init), talks to them over a private Unix socket, brings the mesh
 * up (hello, setup with the shared-memory segment or the relayed NCCL id,
 * ready), runs one job at a time on all ranks, relays rank 0's progress and
 * result, and rebuilds the whole mesh with backoff when any worker dies,
 * stalls or reports a broken mesh. A job in flight when that happens fails
 * with a message naming the rank; the caller keeps its queue.
 *
 * Multi-node: ranks local_ranks .. world_size-1 are played by workers on
 * other hosts that connect to the join port over TCP (`ditworker --join`)
 * and prove they hold the shared secret (the handshake and the pool are
 * join.h's; the supervisor owns the listener and the sockets). Joined
 * workers wait in a pool; each time the mesh starts, the free remote ranks
 * go to them in arrival order (a worker may ask for a given rank). While
 * ranks are missing the mesh stays STARTING, without a timeout: the startup
 * timeout runs from the moment every rank is present.
 *
 * Owner: the loop thread. Everything holding a libuv handle is freed from
 * its close callback. */
#ifndef DIT_DAEMON_SUPERVISOR_H
#define DIT_DAEMON_SUPERVISOR_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "ditserve_ipc_ipc.pb-c.h"
#include "log.h"
#include "parallel/mesh.h"
#include "serve/join_auth.h"

typedef enum dit_mesh_state {
    DIT_MESH_STARTING,   /* workers spawned, not all ready */
    DIT_MESH_READY,      /* serving jobs */
    DIT_MESH_RESTARTING, /* torn down after a failure, waiting to start again */
    DIT_MESH_STOPPING,
    DIT_MESH_STOPPED,
} dit_mesh_state;

const char *dit_mesh_state_name(dit_mesh_state s);

typedef struct dit_supervisor dit_supervisor;

typedef struct dit_supervisor_config {
    const char *model_dir;
    const char *worker_path;
    const char *backend;
    dit_parallel_config pc;
    int threads;
    double comm_timeout_s;
    double job_timeout_s;
    double startup_timeout_s;
    const dit_log *log;
    /* Multi-node: ranks the daemon starts itself (0 .. local_ranks-1); the
     * rest join over TCP at join_listen ("IP:PORT", port 0: a free one),
     * authenticated with join_secret (kept by the caller for the
     * supervisor's lifetime). local_ranks == world_size: no join port. */
    int local_ranks;
    const char *join_listen;
    const dit_join_secret *join_secret;
    /* LoRA: each worker's cache bound and the adapters every worker loads
     * at setup (kept by the caller for the supervisor's lifetime). */
    int64_t lora_cache_bytes;
    const struct dit_daemon_lora *preload_loras;
    int n_preload_loras;
    const struct dit_daemon_lora *fuse_lora; /* NULL: none */
    float fuse_lora_scale;
    /* Several meshes (ditd --replicas): the name its log lines carry
     * ("mesh" for the only one, "mesh1" ...; NULL: "mesh") and the GPU
     * ordinal of its rank 0 (rank r uses device_base + r). */
    const char *name;
    int device_base;
    int meshes; /* meshes on this host (their workers share the cores); 0: 1 */
    /* Every rank loads the VAE and decodes its share of a job's images
     * (Setup.decode_on_every_rank); false: rank 0 decodes them all. */
    bool decode_on_every_rank;
} dit_supervisor_config;

typedef struct dit_supervisor_events {
    void *ctx;
    void (*state_changed)(void *ctx, dit_mesh_state state);
    /* stage: "denoising" (step `step` done) or "decoding" (the VAE started). */
    void (*job_progress)(void *ctx, uint64_t job_id, int step, int total, double elapsed_ms,
                         const char *stage);
    /* A worker reported its memory (when ready and after every job). */
    void (*worker_memory)(void *ctx, int rank, const Ditserve__Ipc__WorkerMemory *mem);
    /* The job ended. status DIT_OK: `result` is rank 0's JobDone, owned by
     * the callee (free with ditserve__ipc__envelope__free_unpacked on
     * `result_env`). Otherwise `message` explains; result is NULL. */
    void (*job_done)(void *ctx, uint64_t job_id, dit_status status, const char *message,
                     Ditserve__Ipc__Envelope *result_env);
} dit_supervisor_events;

dit_status dit_supervisor_create(uv_loop_t *loop, const dit_supervisor_config *cfg,
                                 const dit_supervisor_events *ev, dit_supervisor **out,
                                 dit_diag *diag);

/* Spawns the mesh. */
void dit_supervisor_start(dit_supervisor *s);

dit_mesh_state dit_supervisor_state(const dit_supervisor *s);

/* Ready and not running a job. */
bool dit_supervisor_idle(const dit_supervisor *s);

/* Sends the job (tmpl, with job_id set) to every rank; the supervisor must
 * be idle. A job that cannot be encoded (over DIT_IPC_MAX_FRAME:
 * DIT_ERR_INVALID_ARG; out of memory) is an error with nothing sent and
 * the mesh as it was; a rank that cannot be written to fails the mesh (the
 * job ends through job_done, and DIT_OK is returned). */
dit_status dit_supervisor_run(dit_supervisor *s, uint64_t job_id, const Ditserve__Ipc__Job *tmpl,
                              dit_diag *diag);

/* Asks the running job to stop at the next step boundary; job_id may name
 * one member of a batched job (ipc Job.batch), which leaves the batch
 * while the others go on. */
void dit_supervisor_cancel(dit_supervisor *s, uint64_t job_id);

/* Tears the mesh down now (a stall the caller noticed, or shutdown) and,
 * unless stopping, builds it again. */
void dit_supervisor_fail(dit_supervisor *s, const char *reason);

/* Asks workers to exit, kills those that do not within `grace_s`, and calls
 * done once every process and handle is gone; then free with destroy. */
void dit_supervisor_stop(dit_supervisor *s, double grace_s, void (*done)(void *ctx), void *ctx);
void dit_supervisor_destroy(dit_supervisor *s);

int64_t dit_supervisor_restarts(const dit_supervisor *s);

/* The bound join port, or -1 without one. */
int dit_supervisor_join_port(const dit_supervisor *s);
/* What rank `rank` runs on, as its worker reported it when ready ("cpu",
 * "cuda:1 NVIDIA H200"); the backend's name before. */
const char *dit_supervisor_device(const dit_supervisor *s, int rank);

#endif
