/* The daemon's state and its gRPC services: the request queue, the job
 * state machine (queued -> running -> done), health, and the glue between
 * gRPC calls and the worker mesh.
 *
 * Owner: the loop thread; main creates and frees it. */
#ifndef DIT_DAEMON_SERVER_H
#define DIT_DAEMON_SERVER_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "config.h"
#include "metrics.h"
#include "model_info.h"
#include "queue.h"
#include "ditserve_v1_generation.pb-c.h"
#include "serve/request.h"
#include "reflection.h"
#include "rpc.h"
#include "supervisor.h"

typedef enum job_kind {
    JOB_GENERATE,
    JOB_WARMUP,         /* the Warmup RPC */
    JOB_LORA_LOAD,      /* LoadLora */
    JOB_LORA_UNLOAD,    /* UnloadLora */
    JOB_STARTUP_WARMUP, /* --warmup, before serving */
} job_kind;

typedef struct job job;
typedef struct job dit_server_job;

/* Where a Generate job that did not come through gRPC reports (the HTTP
 * front end, http.h). Both run on the loop thread. `event` gets every
 * event a gRPC client would get (queued, started, progress, the result's
 * chunks, the result), valid during the call; `finish` comes exactly once,
 * after the result with GRPC_STATUS_OK or with the error, unless the client
 * cancelled the job first (dit_server_cancel). */
typedef struct dit_job_client {
    void (*event)(void *ctx, const Ditserve__V1__GenerateEvent *ev);
    void (*finish)(void *ctx, grpc_status_code code, const char *msg);
    void *ctx;
} dit_job_client;

/* Generate jobs one dit_server_submit may add. */
#define DIT_SERVER_MAX_SUBMIT 16

/* One worker mesh (ditd --replicas runs several) and the batch it runs:
 * the jobs of one ipc Job, member 0 first (members[k] NULL once that
 * member's job ended early: cancelled, its result dropped). */
/* An adapter a mesh's rank 0 reported loaded (its WorkerMemory). */
typedef struct dit_server_lora {
    char *path;
    int64_t bytes;
} dit_server_lora;

typedef struct dit_server_mesh {
    struct dit_server *srv;
    int index;
    char name[16]; /* "mesh" alone, else "mesh0", "mesh1", ... (log subsystem) */
    dit_supervisor *sup;
    job *members[DIT_DAEMON_MAX_BATCH];
    int n_members;   /* 0: idle */
    uint64_t job_id; /* the running ipc job's id (member 0's) */
    bool warmed;     /* its --warmup ran (or none was asked for) */
    double busy_since_ms;
    double busy_ms; /* time it ran jobs, finished ones */
    int64_t jobs_run, requests_run;
    /* Its own LoRA cache, as its rank 0 last reported it: the adapters
     * loaded, and the counters (loads, hits, evictions) for deltas. */
    dit_server_lora *loras_loaded;
    int n_loras_loaded;
    int64_t lora_counts[3];
} dit_server_mesh;

typedef struct dit_server {
    uv_loop_t *loop;
    const dit_daemon_config *cfg;
    const dit_log *log;
    dit_pipeline_info info;
    dit_model_info model; /* what clients are told about the served pipeline */
    dit_rpc_server *rpc;
    int port;
    dit_server_mesh meshes[DIT_DAEMON_MAX_REPLICAS];
    int n_meshes, meshes_stopping;
    void (*meshes_stopped)(void *ctx);
    void *meshes_stopped_ctx;
    uv_timer_t batch_timer; /* --batch-wait-ms: when the waiting head's wait ends */
    bool batch_timer_up;
    dit_reflection *refl;
    dit_metrics *metrics; /* NULL: no metrics endpoint */
    dit_queue queue;      /* waiting jobs, highest priority first, then arrival */
    int n_running;        /* requests running, over every mesh */
    uint64_t next_job_id, next_seq;
    bool draining;
    bool warmed;  /* --warmup done (or none asked for) */
    bool serving; /* what health last reported */
    /* Told whenever health changes (the HTTP front end's /health). */
    void (*health_changed)(void *ctx, bool serving);
    /* Told whenever a mesh's state changes, with every mesh's (same ctx). */
    void (*meshes_changed)(void *ctx, int n, const char *const *states);
    /* Result bytes the front end holds for its unread clients, counted in
     * --max-unread-total with gRPC's (same ctx; NULL: none). */
    int64_t (*front_held)(void *ctx);
    void *health_ctx;
    dit_rpc_call **watchers;
    int n_watchers, cap_watchers;
    /* counters */
    int64_t requests_ok, requests_failed;
    dit_rpc_method methods[11]; /* filled by dit_server_methods */
} dit_server;

/* dit_rpc_config.refused: a Generate call the gRPC layer answered before
 * on_generate (a missing or wrong token, no message) is counted in the
 * metrics and the request log like every refused request. ctx: the
 * server. */
void dit_server_rpc_refused(void *ctx, const char *path, grpc_status_code code, const char *why);

/* The methods ditd serves, in registration order. */
int dit_server_methods(dit_server *s, const dit_rpc_method **out);

/* Creates the --replicas meshes from `base` (each gets its name and GPUs)
 * and the batching timer; the workers start with dit_server_start_meshes.
 * On failure what was made is left for dit_server_stop_meshes. */
dit_status dit_server_create_meshes(dit_server *s, const dit_supervisor_config *base,
                                    dit_diag *diag);
void dit_server_start_meshes(dit_server *s);

/* Stops every mesh (workers asked to exit, killed after grace_s) and the
 * timer; `done` once all are gone. Then dit_server_destroy_meshes. */
void dit_server_stop_meshes(dit_server *s, double grace_s, void (*done)(void *ctx), void *ctx);
void dit_server_destroy_meshes(dit_server *s);

/* Mesh 0's join port (multi-node), or -1. */
int dit_server_join_port(const dit_server *s);

/* The daemon's size limits on a validated request (--max-pixels,
 * --max-video-pixels, a raw result within one worker message), as
 * Generate and Warmup apply them and ditd applies them to --warmup: true,
 * or false with msg (cap bytes) saying which and why. */
bool dit_server_size_ok(const dit_daemon_config *cfg, const dit_pipeline_info *info,
                        const Ditserve__V1__GenerateRequest *r, char *msg, size_t cap);

/* Admits n Generate requests as one (all or none) from another front end:
 * every check and limit a gRPC Generate passes, with room in the queue for
 * all n. On success the jobs own reqs[0..n) and jobs[k] is request k's
 * handle until its client's finish (or dit_server_cancel). On failure the
 * requests stay the caller's, and *code and msg say why. The job may end,
 * its client's finish called, before this returns (a mesh that fails as
 * the job is sent to it reports at once). */
dit_status dit_server_submit(dit_server *s, Ditserve__V1__GenerateRequest **reqs, int n,
                             const dit_job_client *clients, dit_server_job **jobs,
                             grpc_status_code *code, char *msg, size_t cap);

/* The client of a submitted job left: a queued job leaves the queue, a
 * running one stops at its next step. Its client hears nothing more. */
void dit_server_cancel(dit_server *s, dit_server_job *j, const char *reason);

/* Starts draining: health NOT_SERVING, new calls refused. */
void dit_server_drain(dit_server *s);

/* Accepted work left (queued or running). */
int dit_server_pending(const dit_server *s);

/* Fails every queued job and cancels the running one (drain timeout). */
void dit_server_abort_pending(dit_server *s, const char *why);

/* Frees what the server still holds (after the loop ended). */
void dit_server_free_jobs(dit_server *s);

#endif
