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

typedef struct dit_server {
    uv_loop_t *loop;
    const dit_daemon_config *cfg;
    const dit_log *log;
    dit_pipeline_info info;
    dit_model_info model; /* what clients are told about the served pipeline */
    dit_rpc_server *rpc;
    int port;
    dit_supervisor *sup;
    dit_reflection *refl;
    dit_metrics *metrics; /* NULL: no metrics endpoint */
    dit_queue queue;      /* waiting jobs, highest priority first, then arrival */
    job *running;
    uint64_t next_job_id, next_seq;
    bool draining;
    bool warmed;  /* --warmup done (or none asked for) */
    bool serving; /* what health last reported */
    /* Told whenever health changes (the HTTP front end's /health). */
    void (*health_changed)(void *ctx, bool serving);
    void *health_ctx;
    dit_rpc_call **watchers;
    int n_watchers, cap_watchers;
    /* counters */
    int64_t requests_ok, requests_failed;
    /* The LoRA adapters rank 0 last reported loaded (its WorkerMemory). */
    struct dit_server_lora {
        char *path;
        int64_t bytes;
    } * loras_loaded;
    int n_loras_loaded;
    /* Rank 0's last LoRA counters (loads, hits, evictions), for deltas. */
    int64_t lora_counts[3];
    dit_rpc_method methods[11]; /* filled by dit_server_methods */
} dit_server;

/* The methods ditd serves, in registration order. */
int dit_server_methods(dit_server *s, const dit_rpc_method **out);

/* Supervisor events go here. */
dit_supervisor_events dit_server_mesh_events(dit_server *s);

/* Admits n Generate requests as one (all or none) from another front end:
 * every check and limit a gRPC Generate passes, with room in the queue for
 * all n. On success the jobs own reqs[0..n) and jobs[k] is request k's
 * handle until its client's finish (or dit_server_cancel). On failure the
 * requests stay the caller's, and *code and msg say why. */
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
