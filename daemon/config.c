#include "config.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/options.h"
#include "serve/request.h"

/* Raw values before interpretation; strings point into the table, argv or
 * environ. */
typedef struct raw {
    const char *model, *model_name, *listen, *backend, *worker, *warmup, *log_level;
    const char *tls_cert, *tls_key, *tls_client_ca, *auth_token_file;
    const char *join_listen, *join_secret_file;
    long long local_ranks;
    long long world, ring, ulysses, tp, max_queue, threads, max_message, conn_age, chunk,
        max_pixels, max_video_pixels;
    long long max_unread, max_unread_total;
    long long metrics_port;
    long long max_batch, batch_wait_ms, replicas;
    const char *http_listen, *http_cors;
    long long http_max_body, http_max_conns, http_video_jobs, http_video_bytes;
    double http_idle, http_request_timeout, http_video_retention;
    double drain, comm_timeout, job_timeout, startup_timeout;
    bool uany, rany, unany, nofp32, cfgpar, log_json;
    const char *lora_dir, *lora_fuse;
    long long lora_cache;
    int n_loras;
    dit_daemon_lora loras[DIT_DAEMON_MAX_PRELOAD_LORAS];
    /* DITD_LORA is set: its value is set_lora's first call, and the first
     * --lora flag after it replaces it (the flag wins, as for every
     * setting) instead of adding to it. */
    bool lora_env;
    int lora_calls;
} raw;

/* --lora-fuse NAME[:SCALE]: the adapter by the name --lora gives it, or
 * DIR/NAME.safetensors under --lora-dir. 0, or -1 with a message printed. */
static int resolve_fuse(const char *val, const raw *r, dit_daemon_config *cfg)
{
    char name[sizeof cfg->fuse_lora.name];
    float scale = 1.0f;
    const char *colon = strrchr(val, ':');
    const size_t n = colon ? (size_t)(colon - val) : strlen(val);
    if (n >= sizeof name) {
        fprintf(stderr, "ditd: --lora-fuse: the name is at most %zu bytes\n", sizeof name - 1);
        return -1;
    }
    memcpy(name, val, n);
    name[n] = '\0';
    if (colon) {
        char *end;
        const double v = strtod(colon + 1, &end);
        if (colon[1] == '\0' || *end != '\0' || !isfinite(v) || v < -100 || v > 100) {
            fprintf(stderr, "ditd: --lora-fuse %s: the scale must be a number from -100 to 100\n",
                    val);
            return -1;
        }
        scale = (float)v;
    }
    if (!dit_request_lora_name_ok(name)) {
        fprintf(stderr,
                "ditd: --lora-fuse %s: the name is not 1 to 128 bytes of [A-Za-z0-9._-] "
                "without '..'\n",
                val);
        return -1;
    }
    snprintf(cfg->fuse_lora.name, sizeof cfg->fuse_lora.name, "%s", name);
    cfg->fuse_lora_scale = scale;
    for (int i = 0; i < r->n_loras; i++)
        if (strcmp(r->loras[i].name, name) == 0) {
            snprintf(cfg->fuse_lora.path, sizeof cfg->fuse_lora.path, "%s", r->loras[i].path);
            return 0;
        }
    if (r->lora_dir) {
        snprintf(cfg->fuse_lora.path, sizeof cfg->fuse_lora.path, "%s/%s.safetensors", r->lora_dir,
                 name);
        if (access(cfg->fuse_lora.path, R_OK) == 0)
            return 0;
    }
    fprintf(stderr,
            "ditd: --lora-fuse %s: no adapter of that name (give it with --lora NAME=PATH or put "
            "NAME.safetensors in --lora-dir)\n",
            val);
    return -1;
}

/* --lora NAME=PATH[,NAME=PATH...], repeatable. */
static int set_lora(void *target, const char *val, char *err, size_t cap)
{
    raw *r = target;
    if (r->lora_env && r->lora_calls++ == 1)
        r->n_loras = 0; /* the first flag: DITD_LORA's adapters go */
    const char *p = val;
    for (;;) {
        const char *end = strchr(p, ',');
        const size_t n = end ? (size_t)(end - p) : strlen(p);
        const char *eq = memchr(p, '=', n);
        if (!eq || eq == p || eq + 1 == p + n) {
            snprintf(err, cap, "wants NAME=PATH[,NAME=PATH...]");
            return -1;
        }
        const size_t nn = (size_t)(eq - p), pn = n - nn - 1;
        if (r->n_loras >= DIT_DAEMON_MAX_PRELOAD_LORAS) {
            snprintf(err, cap, "takes at most %d adapters", DIT_DAEMON_MAX_PRELOAD_LORAS);
            return -1;
        }
        dit_daemon_lora *l = &r->loras[r->n_loras];
        if (nn >= sizeof l->name || pn >= sizeof l->path) {
            snprintf(err, cap, "a name is at most %zu bytes and a path %zu", sizeof l->name - 1,
                     sizeof l->path - 1);
            return -1;
        }
        memcpy(l->name, p, nn);
        l->name[nn] = '\0';
        memcpy(l->path, eq + 1, pn);
        l->path[pn] = '\0';
        if (!dit_request_lora_name_ok(l->name)) {
            snprintf(err, cap,
                     "the name '%.40s' is not 1 to 128 bytes of [A-Za-z0-9._-] without '..'",
                     l->name);
            return -1;
        }
        for (int i = 0; i < r->n_loras; i++)
            if (strcmp(r->loras[i].name, l->name) == 0) {
                snprintf(err, cap, "names '%s' twice", l->name);
                return -1;
            }
        r->n_loras++;
        if (!end)
            return 0;
        p = end + 1;
    }
}

#define OFF(f) offsetof(raw, f)
#define STR(name, def, arg, help, env, f)                                                          \
    {                                                                                              \
        name, 0, DIT_OPT_STRING, def, arg, help, env, OFF(f), 0, 0, NULL, false                    \
    }
#define INT(name, def, arg, help, env, f, lo, hi)                                                  \
    {                                                                                              \
        name, 0, DIT_OPT_INT, def, arg, help, env, OFF(f), lo, hi, NULL, false                     \
    }
#define BYTES(name, def, help, env, f, lo, hi)                                                     \
    {                                                                                              \
        name, 0, DIT_OPT_BYTES, def, "BYTES", help, env, OFF(f), lo, hi, NULL, false               \
    }
#define SECS(name, def, help, env, f)                                                              \
    {                                                                                              \
        name, 0, DIT_OPT_SECONDS, def, "SECONDS", help, env, OFF(f), 0, 0, NULL, false             \
    }
#define FLAG(name, help, env, f)                                                                   \
    {                                                                                              \
        name, 0, DIT_OPT_FLAG, NULL, NULL, help, env, OFF(f), 0, 0, NULL, false                    \
    }

static const dit_option defs[] = {
    STR("model", NULL, "DIR", "diffusers pipeline folder to serve (required)", "DITD_MODEL", model),
    STR("model-name", NULL, "NAME", "name clients ask for (default: the folder's name)",
        "DITD_MODEL_NAME", model_name),
    STR("listen", "0.0.0.0:50051", "HOST:PORT",
        "gRPC address: IPv4:PORT, [IPv6]:PORT, NAME:PORT or :PORT for every interface "
        "(port 0 picks a free port)",
        "DITD_LISTEN", listen),
    STR("backend", "cpu", "cpu|cuda", "compute backend", "DITD_BACKEND", backend),
    INT("world-size", NULL, "N", "worker processes in the mesh (default [2 x] R x U x T)",
        "DITD_WORLD_SIZE", world, 1, 64),
    INT("ring", "1", "R", "ring_degree (context parallelism)", "DITD_RING", ring, 1, 64),
    INT("ulysses", "1", "U", "ulysses_degree (context parallelism)", "DITD_ULYSSES", ulysses, 1,
        64),
    INT("tp", "1", "T", "tp_degree (tensor parallelism); R x U x T = N", "DITD_TP", tp, 1, 64),
    FLAG("ulysses-anything", "uneven sequence chunks and heads with Ulysses",
         "DITD_ULYSSES_ANYTHING", uany),
    FLAG("ring-anything", "uneven sequence chunks with ring", "DITD_RING_ANYTHING", rany),
    FLAG("unified-anything", "uneven chunks and heads with ring x Ulysses", "DITD_UNIFIED_ANYTHING",
         unany),
    FLAG("cfg-parallel",
         "cfg_degree 2: the conditional and unconditional halves of CFG requests on two groups "
         "of R x U x T workers (N = 2 x R x U x T); no gain without CFG",
         "DITD_CFG_PARALLEL", cfgpar),
    FLAG("no-fp32-merge", "merge ring partials in the activation dtype", "DITD_NO_FP32_MERGE",
         nofp32),
    INT("local-ranks", "-1", "L", "ranks started here, 0 .. L-1 (-1: all); the rest join over TCP",
        "DITD_LOCAL_RANKS", local_ranks, -1, 64),
    STR("join-listen", NULL, "IP:PORT",
        "where workers on other hosts join (`ditworker --join`); needs --local-ranks below N",
        "DITD_JOIN_LISTEN", join_listen),
    STR("join-secret-file", NULL, "FILE",
        "shared secret joining workers must prove they hold (at least 16 bytes)",
        "DITD_JOIN_SECRET_FILE", join_secret_file),
    INT("max-queue", "16", "N", "requests that may wait; more get RESOURCE_EXHAUSTED",
        "DITD_MAX_QUEUE", max_queue, 1, 100000),
    INT("max-batch", "1", "N",
        "run up to N queued requests of the same shape (size, frames, steps, CFG, adapters) as "
        "one batched generation, their decodes spread over the mesh's ranks (above 1 every "
        "rank loads the VAE); 1: one request at a time",
        "DITD_MAX_BATCH", max_batch, 1, DIT_DAEMON_MAX_BATCH),
    INT("batch-wait-ms", "0", "MS",
        "hold an idle mesh up to MS milliseconds after the oldest waiting request arrived, for "
        "more requests to batch with it (never past a request's deadline)",
        "DITD_BATCH_WAIT_MS", batch_wait_ms, 0, 10000),
    INT("replicas", "1", "M",
        "meshes to run (M x N workers, GPUs m*N .. m*N+N-1 for mesh m), all taking requests "
        "from one queue",
        "DITD_REPLICAS", replicas, 1, DIT_DAEMON_MAX_REPLICAS),
    SECS("drain-timeout", "30", "on SIGTERM, time for accepted requests to finish",
         "DITD_DRAIN_TIMEOUT", drain),
    INT("threads", "0", "N", "cpu threads per worker (0: cores / (N x replicas))", "DITD_THREADS",
        threads, 0, 4096),
    SECS("comm-timeout", "60", "how long a rank waits for its peers", "DITD_COMM_TIMEOUT",
         comm_timeout),
    SECS("job-timeout", "300", "a job with no progress for this long counts as stalled",
         "DITD_JOB_TIMEOUT", job_timeout),
    SECS("startup-timeout", "600", "workers must load the model within this",
         "DITD_STARTUP_TIMEOUT", startup_timeout),
    STR("worker", NULL, "PATH", "the ditworker binary (default: next to ditd, then the build tree)",
        "DITD_WORKER", worker),
    BYTES("max-message-bytes", "67108864", "largest request accepted (at most 256 MiB)",
          "DITD_MAX_MESSAGE_BYTES", max_message, 1024, 268435456),
    INT("max-connection-age", "0", "SECONDS",
        "close client connections after this long, so load balancers rebalance (0: never)",
        "DITD_MAX_CONNECTION_AGE", conn_age, 0, 1000000000),
    BYTES("chunk-bytes", "1048576", "image bytes per ResultChunk message", "DITD_CHUNK_BYTES",
          chunk, 1024, 1 << 30),
    BYTES("max-unread-bytes", "134217728",
          "result bytes one connection may leave unread; past them its new calls get "
          "RESOURCE_EXHAUSTED",
          "DITD_MAX_UNREAD_BYTES", max_unread, 1024, (double)(1ll << 40)),
    BYTES("max-unread-total", "1073741824", "the same over all connections",
          "DITD_MAX_UNREAD_TOTAL", max_unread_total, 1024, (double)(1ll << 40)),
    INT("max-pixels", "4194304", "N", "largest width x height a request may ask for (2048x2048)",
        "DITD_MAX_PIXELS", max_pixels, 256, 268435456),
    INT("max-video-pixels", "74649600", "N",
        "largest width x height x frames a video request may ask for (81 frames of 1280x720)",
        "DITD_MAX_VIDEO_PIXELS", max_video_pixels, 256, 68719476736.0),
    STR("lora-dir", NULL, "DIR",
        "LoRA adapters requests may name: NAME stands for DIR/NAME.safetensors", "DITD_LORA_DIR",
        lora_dir),
    {"lora", 0, DIT_OPT_CUSTOM, NULL, "NAME=PATH",
     "an adapter requests may name, loaded at start and kept (repeatable, or comma-separated)",
     "DITD_LORA", 0, 0, 0, set_lora, false},
    STR("lora-fuse", NULL, "NAME[:SCALE]",
        "merge this adapter (from --lora or --lora-dir) into the weights at start, scale 1 "
        "unless given: full speed, and requests cannot detach it",
        "DITD_LORA_FUSE", lora_fuse),
    BYTES("lora-cache-bytes", "2147483648",
          "memory each worker may keep loaded adapters in (least recently used evicted first)",
          "DITD_LORA_CACHE_BYTES", lora_cache, 0, (double)(1ll << 50)),
    STR("warmup", NULL, "WxH[xF]:STEPS",
        "run one generation of this shape (F: video frames) before serving", "DITD_WARMUP", warmup),
    STR("tls-cert", NULL, "FILE", "serve TLS with this PEM certificate chain (needs --tls-key)",
        "DITD_TLS_CERT", tls_cert),
    STR("tls-key", NULL, "FILE", "the PEM private key of --tls-cert", "DITD_TLS_KEY", tls_key),
    STR("tls-client-ca", NULL, "FILE",
        "require client certificates signed by these PEM roots (mutual TLS)", "DITD_TLS_CLIENT_CA",
        tls_client_ca),
    STR("auth-token-file", NULL, "FILE",
        "require 'authorization: Bearer TOKEN' (TOKEN read from FILE) on every method but health",
        "DITD_AUTH_TOKEN_FILE", auth_token_file),
    INT("metrics-port", "-1", "PORT",
        "serve Prometheus metrics at http://*:PORT/metrics (0: a free port; -1: off)",
        "DITD_METRICS_PORT", metrics_port, -1, 65535),
    STR("http-listen", NULL, "HOST:PORT",
        "also serve the OpenAI-compatible HTTP API, /health and the playground page here "
        "(port 0 picks a free port; same TLS and token flags as gRPC)",
        "DITD_HTTP_LISTEN", http_listen),
    STR("http-cors-origins", NULL, "ORIGINS",
        "browser origins allowed to call the HTTP API, comma-separated, or * (default: none)",
        "DITD_HTTP_CORS_ORIGINS", http_cors),
    BYTES("http-max-body-bytes", "1048576", "largest HTTP request body; larger ones get 413",
          "DITD_HTTP_MAX_BODY_BYTES", http_max_body, 1024, 67108864),
    INT("http-max-connections", "256", "N", "open HTTP connections at most (a thread each)",
        "DITD_HTTP_MAX_CONNECTIONS", http_max_conns, 1, 100000),
    SECS("http-idle-timeout", "30", "an HTTP connection silent this long is closed",
         "DITD_HTTP_IDLE_TIMEOUT", http_idle),
    SECS("http-request-timeout", "30", "an HTTP request's body must arrive within this",
         "DITD_HTTP_REQUEST_TIMEOUT", http_request_timeout),
    INT("http-video-jobs", "64", "N",
        "/v1/videos jobs held at most (queued, running and finished); more get 429",
        "DITD_HTTP_VIDEO_JOBS", http_video_jobs, 1, 10000),
    BYTES("http-video-bytes", "1073741824",
          "finished /v1/videos MP4s held at most, in all; past it new jobs get 429",
          "DITD_HTTP_VIDEO_BYTES", http_video_bytes, 1048576, 1099511627776LL),
    SECS("http-video-retention", "3600",
         "a finished /v1/videos job and its MP4 are forgotten this long after it ends",
         "DITD_HTTP_VIDEO_RETENTION", http_video_retention),
    STR("log-level", "info", "LEVEL", "debug, info, warn or error", "DITD_LOG_LEVEL", log_level),
    FLAG("log-json", "log lines as JSON objects", "DITD_LOG_JSON", log_json),
};

static const dit_options table = {
    .prog = "ditd",
    .usage = "usage: ditd --model DIR [options]\n"
             "\n"
             "Serves generation with a diffusers pipeline (FluxPipeline, WanPipeline) over gRPC\n"
             "(ditserve.v1.Generation, grpc.health.v1.Health, server reflection), running the\n"
             "model on a mesh of ditworker processes.\n",
    .epilog = "Signals: SIGTERM or SIGINT drains (health NOT_SERVING, no new requests,\n"
              "accepted ones finish within --drain-timeout, then exit 0); a second signal\n"
              "exits at once.\n",
    .version = DIT_VERSION,
    .opts = defs,
    .n_opts = sizeof defs / sizeof defs[0],
};

int dit_warmup_spec_parse(const char *text, int *width, int *height, int *frames, int *steps)
{
    int w = 0, h = 0, f = 0, s = 0, used = 0;
    if (sscanf(text, "%dx%dx%d:%d%n", &w, &h, &f, &s, &used) == 4 && text[used] == '\0' && f > 0) {
        /* WxHxF:STEPS */
    } else if (f = 0, used = 0,
               sscanf(text, "%dx%d:%d%n", &w, &h, &s, &used) == 3 && text[used] == '\0') {
        /* WxH:STEPS */
    } else {
        return -1;
    }
    if (w <= 0 || h <= 0 || s <= 0)
        return -1;
    *width = w;
    *height = h;
    *frames = f;
    *steps = s;
    return 0;
}

static const char *basename_of(const char *path)
{
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/')
        n--;
    const char *s = path + n;
    while (s > path && s[-1] != '/')
        s--;
    return s;
}

/* --listen must be HOST:PORT with a port from 0 to 65535 before anything
 * starts: gRPC itself would take "127.0.0.1:99999" as port 34463 and
 * report other mistakes only once the workers run. ":PORT" means every
 * interface and is rewritten to 0.0.0.0:PORT. */
static int check_listen(const char *flag, const char **listen, char *buf, size_t cap)
{
    const char *v = *listen;
    const char *colon = strrchr(v, ':');
    const char *why = NULL;
    if (!colon) {
        why = "it has no ':PORT'";
    } else if (v[0] == '[' ? colon == v || colon[-1] != ']' || colon - v < 3 ||
                                 memchr(v + 1, ']', (size_t)(colon - v - 2)) != NULL
                           : memchr(v, ':', (size_t)(colon - v)) != NULL) {
        why = "an IPv6 address goes in brackets, [::1]:PORT";
    } else if (colon[1] == '\0' || strspn(colon + 1, "0123456789") != strlen(colon + 1) ||
               strlen(colon + 1) > 5 || atoi(colon + 1) > 65535) {
        why = "the port is not a number from 0 to 65535";
    } else if (memchr(v, ' ', (size_t)(colon - v)) || memchr(v, '/', (size_t)(colon - v))) {
        why = "the host is not an address or a name";
    }
    if (why) {
        fprintf(stderr,
                "ditd: --%s '%s': %s; the form is HOST:PORT, e.g. 0.0.0.0:50051, "
                "127.0.0.1:0 (a free port), [::]:50051 or :50051 (every interface)\n",
                flag, v, why);
        return 2;
    }
    if (colon == v) {
        snprintf(buf, cap, "0.0.0.0%s", v);
        *listen = buf;
    }
    return 0;
}

int dit_daemon_config_parse(dit_daemon_config *cfg, int argc, char **argv)
{
    raw r;
    memset(&r, 0, sizeof r);
    const char *lora_env = getenv("DITD_LORA");
    r.lora_env = lora_env && lora_env[0];
    const int rc = dit_options_parse(&table, &r, argc, argv, NULL);
    if (rc != 0)
        return rc;
    if (!r.model) {
        fprintf(stderr, "ditd: --model (or DITD_MODEL) is required (see --help)\n");
        return 2;
    }
    memset(cfg, 0, sizeof *cfg);
    cfg->model = r.model;
    cfg->model_name = r.model_name ? r.model_name : basename_of(r.model);
    cfg->listen = r.listen;
    if (check_listen("listen", &cfg->listen, cfg->listen_buf, sizeof cfg->listen_buf) != 0)
        return 2;
    cfg->http_listen = r.http_listen;
    if (cfg->http_listen && check_listen("http-listen", &cfg->http_listen, cfg->http_listen_buf,
                                         sizeof cfg->http_listen_buf) != 0)
        return 2;
    cfg->http_cors_origins = r.http_cors;
    cfg->http_max_body_bytes = r.http_max_body;
    cfg->http_max_connections = (int)r.http_max_conns;
    cfg->http_idle_timeout_s = r.http_idle;
    cfg->http_request_timeout_s = r.http_request_timeout;
    cfg->http_video_jobs = (int)r.http_video_jobs;
    cfg->http_video_bytes = r.http_video_bytes;
    cfg->http_video_retention_s = r.http_video_retention;
    cfg->backend_name = r.backend;
    if (dit_backend_kind_parse(cfg->backend_name, &cfg->backend) != DIT_OK) {
        fprintf(stderr, "ditd: unknown backend '%s' (cpu or cuda)\n", cfg->backend_name);
        return 2;
    }
    cfg->pc = dit_parallel_config_single();
    cfg->pc.cfg_degree = r.cfgpar ? 2 : 1;
    cfg->pc.world_size =
        r.world ? (int)r.world : (int)(cfg->pc.cfg_degree * r.ring * r.ulysses * r.tp);
    cfg->pc.ring_degree = (int)r.ring;
    cfg->pc.ulysses_degree = (int)r.ulysses;
    cfg->pc.tp_degree = (int)r.tp;
    cfg->pc.ulysses_anything = r.uany;
    cfg->pc.ring_anything = r.rany;
    cfg->pc.unified_anything = r.unany;
    cfg->pc.fp32_merge = !r.nofp32;
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_parallel_validate(&cfg->pc, &diag) != DIT_OK) {
        fprintf(stderr, "ditd: %s\n", dit_diag_msg(&diag));
        return 2;
    }
    cfg->local_ranks = r.local_ranks < 0 ? cfg->pc.world_size : (int)r.local_ranks;
    cfg->join_listen = r.join_listen;
    cfg->join_secret_file = r.join_secret_file;
    if (cfg->local_ranks > cfg->pc.world_size) {
        fprintf(stderr, "ditd: --local-ranks %d is more than the world size %d\n", cfg->local_ranks,
                cfg->pc.world_size);
        return 2;
    }
    if (cfg->local_ranks < cfg->pc.world_size && (!cfg->join_listen || !cfg->join_secret_file)) {
        fprintf(stderr,
                "ditd: ranks %d to %d are remote: give --join-listen IP:PORT and "
                "--join-secret-file FILE\n",
                cfg->local_ranks, cfg->pc.world_size - 1);
        return 2;
    }
    if (cfg->local_ranks == cfg->pc.world_size && (cfg->join_listen || cfg->join_secret_file)) {
        fprintf(stderr,
                "ditd: --join-listen and --join-secret-file need remote ranks (--local-ranks "
                "below the world size %d)\n",
                cfg->pc.world_size);
        return 2;
    }
    cfg->max_queue = (int)r.max_queue;
    cfg->max_batch = (int)r.max_batch;
    cfg->batch_wait_ms = (int)r.batch_wait_ms;
    cfg->replicas = (int)r.replicas;
    if (cfg->replicas > 1 && cfg->local_ranks < cfg->pc.world_size) {
        fprintf(stderr,
                "ditd: --replicas %d needs every rank local: meshes with ranks that join "
                "over TCP run one ditd each\n",
                cfg->replicas);
        return 2;
    }
    cfg->drain_timeout_s = r.drain;
    cfg->threads = (int)r.threads;
    cfg->comm_timeout_s = r.comm_timeout;
    cfg->worker_path = r.worker;
    cfg->job_timeout_s = r.job_timeout;
    cfg->startup_timeout_s = r.startup_timeout;
    cfg->max_message_bytes = r.max_message;
    cfg->max_connection_age_s = r.conn_age;
    cfg->chunk_bytes = r.chunk;
    cfg->max_unread_bytes = r.max_unread;
    cfg->max_unread_total = r.max_unread_total;
    cfg->warmup = r.warmup;
    cfg->max_pixels = r.max_pixels;
    cfg->max_video_pixels = r.max_video_pixels;
    cfg->tls_cert = r.tls_cert;
    cfg->tls_key = r.tls_key;
    cfg->tls_client_ca = r.tls_client_ca;
    cfg->auth_token_file = r.auth_token_file;
    cfg->metrics_port = (int)r.metrics_port;
    if (!cfg->tls_cert != !cfg->tls_key) {
        fprintf(stderr, "ditd: --tls-cert and --tls-key go together\n");
        return 2;
    }
    if (cfg->tls_client_ca && !cfg->tls_cert) {
        fprintf(stderr, "ditd: --tls-client-ca needs --tls-cert and --tls-key\n");
        return 2;
    }
    if (!dit_log_level_parse(r.log_level, &cfg->log.level)) {
        fprintf(stderr, "ditd: log level '%s' is not debug, info, warn or error\n", r.log_level);
        return 2;
    }
    cfg->log.json = r.log_json;
    cfg->lora_dir = r.lora_dir;
    cfg->lora_cache_bytes = r.lora_cache;
    if (cfg->lora_dir) {
        struct stat sb;
        if (stat(cfg->lora_dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
            fprintf(stderr, "ditd: --lora-dir %s is not a directory\n", cfg->lora_dir);
            return 2;
        }
    }
    if (r.lora_fuse && resolve_fuse(r.lora_fuse, &r, cfg) != 0)
        return 2;
    cfg->n_preload_loras = r.n_loras;
    for (int i = 0; i < r.n_loras; i++) {
        cfg->preload_loras[i] = r.loras[i];
        if (access(r.loras[i].path, R_OK) != 0) {
            fprintf(stderr, "ditd: --lora %s=%s: the file cannot be read\n", r.loras[i].name,
                    r.loras[i].path);
            return 2;
        }
    }
    return 0;
}
