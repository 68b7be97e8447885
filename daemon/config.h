/* ditd's settings: every command-line flag also has a DITD_* environment
 * variable (flags win), both read through one table so that --help, the
 * flags and the environment always agree.
 *
 * Owner: main; read-only once parsed. */
#ifndef DIT_DAEMON_CONFIG_H
#define DIT_DAEMON_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "serve/host.h"
#include "log.h"
#include "parallel/mesh.h"

/* --lora NAME=PATH: an adapter loaded at start and never evicted. */
#define DIT_DAEMON_MAX_PRELOAD_LORAS 16
typedef struct dit_daemon_lora {
    char name[129];
    char path[4096];
} dit_daemon_lora;

/* Bounds of --max-batch and --replicas. */
#define DIT_DAEMON_MAX_BATCH 16
#define DIT_DAEMON_MAX_REPLICAS 16

typedef struct dit_daemon_config {
    const char *model;      /* pipeline folder */
    const char *model_name; /* name clients use; default: the folder's name */
    const char
        *listen; /* HOST:PORT (checked; ":PORT" made 0.0.0.0:PORT); port 0 picks a free one */
    const char *backend_name;
    dit_backend_kind backend;
    dit_parallel_config pc;
    int max_queue;                /* requests waiting (not running) */
    int max_batch;                /* requests one batched generation may hold */
    int batch_wait_ms;            /* how long an idle mesh waits to fill a batch */
    int replicas;                 /* meshes, each of pc.world_size workers */
    double drain_timeout_s;       /* on SIGTERM: time for accepted work to finish */
    int threads;                  /* per worker; 0: cores / world size */
    double comm_timeout_s;        /* how long a rank waits for its peers */
    const char *worker_path;      /* the ditworker binary */
    double job_timeout_s;         /* a job with no progress for this long is a stall */
    double startup_timeout_s;     /* workers must be ready within this */
    int64_t max_message_bytes;    /* largest request accepted */
    int64_t max_connection_age_s; /* 0: connections live forever */
    int64_t chunk_bytes;          /* result bytes per ResultChunk message */
    /* Result bytes queued for clients that have not read them yet, per
     * connection and in all; past them new calls are refused. */
    int64_t max_unread_bytes, max_unread_total;
    const char *warmup;       /* WIDTHxHEIGHT:STEPS run before serving, or NULL */
    int64_t max_pixels;       /* largest width x height accepted */
    int64_t max_video_pixels; /* largest width x height x frames accepted */
    const char *tls_cert, *tls_key, *tls_client_ca; /* PEM files; NULL: plaintext */
    const char *auth_token_file;                    /* bearer token for every method but health */
    int metrics_port;        /* Prometheus HTTP port; -1: off, 0: a free one */
    int local_ranks;         /* ranks ditd starts (0 .. local_ranks-1); the rest join */
    const char *join_listen; /* IP:PORT for joining workers, or NULL */
    const char *join_secret_file;
    /* The HTTP front end (http.h); NULL: off. Checked as listen is. */
    const char *http_listen;
    const char *http_cors_origins; /* comma-separated, or "*"; NULL: none */
    int64_t http_max_body_bytes;
    int http_max_connections;
    double http_idle_timeout_s, http_request_timeout_s;
    /* /v1/videos: jobs held, their MP4 bytes in all, how long finished ones stay. */
    int http_video_jobs;
    int64_t http_video_bytes;
    double http_video_retention_s;
    /* LoRA adapters requests may name: DIR/NAME.safetensors under lora_dir
     * (NULL: none) and the preloaded ones; the workers keep loaded ones
     * within lora_cache_bytes each. */
    const char *lora_dir;
    int64_t lora_cache_bytes;
    int n_preload_loras;
    dit_daemon_lora preload_loras[DIT_DAEMON_MAX_PRELOAD_LORAS];
    /* --lora-fuse NAME[:SCALE]: merged into the weights at start (name
     * empty: none); path resolved from --lora or --lora-dir. */
    dit_daemon_lora fuse_lora;
    float fuse_lora_scale;
    dit_log log;
    char listen_buf[300];      /* storage for listen when it was rewritten */
    char http_listen_buf[300]; /* the same for http_listen */
} dit_daemon_config;

/* The shape of --warmup: WxH:STEPS, or WxHxF:STEPS with F video frames
 * (0 when not given: the model's default). 0, or -1 when the text is not
 * in either form with positive numbers. */
int dit_warmup_spec_parse(const char *text, int *width, int *height, int *frames, int *steps);

/* Fills cfg from the environment and argv. Returns 0 to run, 1 when --help
 * or --version was printed, 2 on bad usage (message printed). */
int dit_daemon_config_parse(dit_daemon_config *cfg, int argc, char **argv);

#endif
