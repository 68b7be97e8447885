#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/cli_util.h"

typedef enum opt_kind { OPT_STR, OPT_INT, OPT_SECONDS, OPT_FLAG, OPT_BYTES } opt_kind;

typedef struct opt_def {
    const char *flag;  /* long option name */
    const char *env;   /* DITD_* variable */
    opt_kind kind;
    const char *arg;   /* metavariable in --help */
    const char *help;
    size_t offset;     /* into the parse state */
    long long lo, hi;  /* integer range */
} opt_def;

/* Raw values before interpretation; strings point into argv or environ. */
typedef struct raw {
    const char *model, *model_name, *listen, *backend, *worker, *warmup, *log_level;
    const char *tls_cert, *tls_key, *tls_client_ca, *auth_token_file;
    const char *join_listen, *join_secret_file;
    long long local_ranks;
    long long world, ring, ulysses, tp, max_queue, threads, max_message, conn_age, chunk, max_pixels;
    long long max_unread, max_unread_total;
    long long metrics_port;
    double drain, comm_timeout, job_timeout, startup_timeout;
    long long uany, rany, unany, nofp32, log_json;
} raw;

#define OFF(f) offsetof(raw, f)

static const opt_def defs[] = {
    {"model", "DITD_MODEL", OPT_STR, "DIR", "diffusers FluxPipeline folder to serve (required)",
     OFF(model), 0, 0},
    {"model-name", "DITD_MODEL_NAME", OPT_STR, "NAME",
     "name clients ask for (default: the folder's name)", OFF(model_name), 0, 0},
    {"listen", "DITD_LISTEN", OPT_STR, "HOST:PORT",
     "gRPC address: IPv4:PORT, [IPv6]:PORT, NAME:PORT or :PORT for every interface "
     "(default 0.0.0.0:50051; port 0 picks a free port)", OFF(listen), 0, 0},
    {"backend", "DITD_BACKEND", OPT_STR, "cpu|cuda", "compute backend (default cpu)", OFF(backend), 0, 0},
    {"world-size", "DITD_WORLD_SIZE", OPT_INT, "N",
     "worker processes in the mesh (default R x U x T, else 1)",
     OFF(world), 1, 64},
    {"ring", "DITD_RING", OPT_INT, "R", "ring_degree (context parallelism)", OFF(ring), 1, 64},
    {"ulysses", "DITD_ULYSSES", OPT_INT, "U", "ulysses_degree (context parallelism)", OFF(ulysses), 1, 64},
    {"tp", "DITD_TP", OPT_INT, "T", "tp_degree (tensor parallelism); R x U x T = N", OFF(tp), 1, 64},
    {"ulysses-anything", "DITD_ULYSSES_ANYTHING", OPT_FLAG, NULL,
     "uneven sequence chunks and heads with Ulysses", OFF(uany), 0, 0},
    {"ring-anything", "DITD_RING_ANYTHING", OPT_FLAG, NULL, "uneven sequence chunks with ring",
     OFF(rany), 0, 0},
    {"unified-anything", "DITD_UNIFIED_ANYTHING", OPT_FLAG, NULL,
     "uneven chunks and heads with ring x Ulysses", OFF(unany), 0, 0},
    {"no-fp32-merge", "DITD_NO_FP32_MERGE", OPT_FLAG, NULL,
     "merge ring partials in the activation dtype", OFF(nofp32), 0, 0},
    {"local-ranks", "DITD_LOCAL_RANKS", OPT_INT, "L",
     "ranks started here, 0 .. L-1 (default: all); the rest join over TCP", OFF(local_ranks), 0, 64},
    {"join-listen", "DITD_JOIN_LISTEN", OPT_STR, "IP:PORT",
     "where workers on other hosts join (`ditworker --join`); needs --local-ranks below N",
     OFF(join_listen), 0, 0},
    {"join-secret-file", "DITD_JOIN_SECRET_FILE", OPT_STR, "FILE",
     "shared secret joining workers must prove they hold (at least 16 bytes)",
     OFF(join_secret_file), 0, 0},
    {"max-queue", "DITD_MAX_QUEUE", OPT_INT, "N",
     "requests that may wait; more get RESOURCE_EXHAUSTED (default 16)", OFF(max_queue), 0, 100000},
    {"drain-timeout", "DITD_DRAIN_TIMEOUT", OPT_SECONDS, "SECONDS",
     "on SIGTERM, time for accepted requests to finish (default 30)", OFF(drain), 0, 0},
    {"threads", "DITD_THREADS", OPT_INT, "N", "cpu threads per worker (default cores / N)",
     OFF(threads), 0, 4096},
    {"comm-timeout", "DITD_COMM_TIMEOUT", OPT_SECONDS, "SECONDS",
     "how long a rank waits for its peers (default 60)", OFF(comm_timeout), 0, 0},
    {"job-timeout", "DITD_JOB_TIMEOUT", OPT_SECONDS, "SECONDS",
     "a job with no progress for this long counts as stalled (default 300)", OFF(job_timeout), 0, 0},
    {"startup-timeout", "DITD_STARTUP_TIMEOUT", OPT_SECONDS, "SECONDS",
     "workers must load the model within this (default 600)", OFF(startup_timeout), 0, 0},
    {"worker", "DITD_WORKER", OPT_STR, "PATH",
     "the ditworker binary (default: next to ditd, then the build tree)", OFF(worker), 0, 0},
    {"max-message-bytes", "DITD_MAX_MESSAGE_BYTES", OPT_BYTES, "BYTES",
     "largest request accepted (default 67108864)", OFF(max_message), 1024, (long long)INT_MAX},
    {"max-connection-age", "DITD_MAX_CONNECTION_AGE", OPT_INT, "SECONDS",
     "close client connections after this long, so load balancers rebalance (default: never)",
     OFF(conn_age), 0, 1000000000},
    {"chunk-bytes", "DITD_CHUNK_BYTES", OPT_BYTES, "BYTES",
     "image bytes per ResultChunk message (default 1048576)", OFF(chunk), 1024, 1 << 30},
    {"max-unread-bytes", "DITD_MAX_UNREAD_BYTES", OPT_BYTES, "BYTES",
     "result bytes one connection may leave unread; past them its new calls get "
     "RESOURCE_EXHAUSTED (default 134217728)", OFF(max_unread), 1024, 1ll << 40},
    {"max-unread-total", "DITD_MAX_UNREAD_TOTAL", OPT_BYTES, "BYTES",
     "the same over all connections (default 1073741824)", OFF(max_unread_total), 1024, 1ll << 40},
    {"max-pixels", "DITD_MAX_PIXELS", OPT_INT, "N",
     "largest width x height a request may ask for (default 4194304, 2048x2048)", OFF(max_pixels),
     256, 268435456},
    {"warmup", "DITD_WARMUP", OPT_STR, "WxH:STEPS",
     "run one generation of this shape before serving", OFF(warmup), 0, 0},
    {"tls-cert", "DITD_TLS_CERT", OPT_STR, "FILE",
     "serve TLS with this PEM certificate chain (needs --tls-key)", OFF(tls_cert), 0, 0},
    {"tls-key", "DITD_TLS_KEY", OPT_STR, "FILE", "the PEM private key of --tls-cert", OFF(tls_key), 0, 0},
    {"tls-client-ca", "DITD_TLS_CLIENT_CA", OPT_STR, "FILE",
     "require client certificates signed by these PEM roots (mutual TLS)", OFF(tls_client_ca), 0, 0},
    {"auth-token-file", "DITD_AUTH_TOKEN_FILE", OPT_STR, "FILE",
     "require 'authorization: Bearer TOKEN' (TOKEN read from FILE) on every method but health",
     OFF(auth_token_file), 0, 0},
    {"metrics-port", "DITD_METRICS_PORT", OPT_INT, "PORT",
     "serve Prometheus metrics at http://*:PORT/metrics (0: a free port; default: off)",
     OFF(metrics_port), 0, 65535},
    {"log-level", "DITD_LOG_LEVEL", OPT_STR, "LEVEL", "debug, info, warn or error (default info)",
     OFF(log_level), 0, 0},
    {"log-json", "DITD_LOG_JSON", OPT_FLAG, NULL, "log lines as JSON objects", OFF(log_json), 0, 0},
};

enum { N_DEFS = sizeof defs / sizeof defs[0] };

static void print_help(void)
{
    printf("usage: ditd --model DIR [options]\n"
           "\n"
           "Serves text-to-image generation with a diffusers FluxPipeline over gRPC\n"
           "(ditserve.v1.Generation, grpc.health.v1.Health, server reflection), running the\n"
           "model on a mesh of ditworker processes.\n"
           "\n"
           "Options (each also read from the environment variable shown; flags win):\n");
    for (int i = 0; i < N_DEFS; i++) {
        char left[64];
        snprintf(left, sizeof left, "--%s%s%s", defs[i].flag, defs[i].arg ? " " : "",
                 defs[i].arg ? defs[i].arg : "");
        printf("  %-30s %s\n  %-30s [%s]\n", left, defs[i].help, "", defs[i].env);
    }
    printf("  %-30s %s\n  %-30s %s\n", "--help", "show this help", "--version", "print the version");
    printf("\nSignals: SIGTERM or SIGINT drains (health NOT_SERVING, no new requests,\n"
           "accepted ones finish within --drain-timeout, then exit 0); a second signal\n"
           "exits at once.\n");
}

static int set_value(raw *r, const opt_def *d, const char *val, const char *origin)
{
    char *p = (char *)r + d->offset;
    char *end;
    switch (d->kind) {
    case OPT_STR:
        *(const char **)p = val;
        return 0;
    case OPT_FLAG:
        if (!val || strcmp(val, "1") == 0 || strcmp(val, "true") == 0 || strcmp(val, "yes") == 0) {
            *(long long *)p = 1;
            return 0;
        }
        if (strcmp(val, "0") == 0 || strcmp(val, "false") == 0 || strcmp(val, "no") == 0 ||
            strcmp(val, "") == 0) {
            *(long long *)p = 0;
            return 0;
        }
        fprintf(stderr, "ditd: %s wants 1/0, true/false or yes/no, not '%s'\n", origin, val);
        return 2;
    case OPT_INT:
    case OPT_BYTES: {
        errno = 0;
        long long v = strtoll(val, &end, 10);
        if (errno || *val == '\0' || *end != '\0' || v < d->lo || v > d->hi) {
            fprintf(stderr, "ditd: %s wants an integer from %lld to %lld, not '%s'\n", origin,
                    d->lo, d->hi, val);
            return 2;
        }
        *(long long *)p = v;
        return 0;
    }
    case OPT_SECONDS: {
        errno = 0;
        double v = strtod(val, &end);
        if (errno || *val == '\0' || *end != '\0' || !(v > 0) || v > 1e7) {
            fprintf(stderr, "ditd: %s wants a positive number of seconds, not '%s'\n", origin, val);
            return 2;
        }
        *(double *)p = v;
        return 0;
    }
    }
    return 2;
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
static int check_listen(dit_daemon_config *cfg)
{
    const char *v = cfg->listen;
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
        fprintf(stderr, "ditd: --listen '%s': %s; the form is HOST:PORT, e.g. 0.0.0.0:50051, "
                        "127.0.0.1:0 (a free port), [::]:50051 or :50051 (every interface)\n",
                v, why);
        return 2;
    }
    if (colon == v) {
        snprintf(cfg->listen_buf, sizeof cfg->listen_buf, "0.0.0.0%s", v);
        cfg->listen = cfg->listen_buf;
    }
    return 0;
}

int dit_daemon_config_parse(dit_daemon_config *cfg, int argc, char **argv)
{
    raw r;
    memset(&r, 0, sizeof r);
    r.ring = r.ulysses = r.tp = 1; /* world 0: their product */
    r.max_queue = 16;
    r.max_message = 64ll << 20;
    r.chunk = 1 << 20;
    r.max_pixels = 2048 * 2048;
    r.max_unread = 128ll << 20;
    r.max_unread_total = 1ll << 30;
    r.metrics_port = -1;
    r.local_ranks = -1;
    r.drain = 30;
    r.comm_timeout = 60;
    r.job_timeout = 300;
    r.startup_timeout = 600;
    int rc;
    for (int i = 0; i < N_DEFS; i++) {
        const char *v = getenv(defs[i].env);
        if (v && (rc = set_value(&r, &defs[i], v, defs[i].env)) != 0)
            return rc;
    }
    struct option opts[N_DEFS + 3];
    for (int i = 0; i < N_DEFS; i++)
        opts[i] = (struct option){defs[i].flag, defs[i].kind == OPT_FLAG ? no_argument : required_argument,
                                  NULL, 1000 + i};
    opts[N_DEFS] = (struct option){"help", no_argument, NULL, 'h'};
    opts[N_DEFS + 1] = (struct option){"version", no_argument, NULL, 'V'};
    opts[N_DEFS + 2] = (struct option){NULL, 0, NULL, 0};
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        if (c == 'h') {
            print_help();
            return 1;
        }
        if (c == 'V') {
            printf("ditd %s\n", DIT_VERSION);
            return 1;
        }
        if (c == ':') {
            fprintf(stderr, "ditd: option %s needs a value (see --help)\n", argv[optind - 1]);
            return 2;
        }
        if (c < 1000 || c >= 1000 + N_DEFS) {
            const char *near = dit_suggest_option(argv[optind - 1], opts);
            fprintf(stderr, "ditd: unknown option '%s'%s%s%s (see --help)\n", argv[optind - 1],
                    near ? "; did you mean '--" : "", near ? near : "", near ? "'?" : "");
            return 2;
        }
        char origin[80];
        snprintf(origin, sizeof origin, "--%s", defs[c - 1000].flag);
        if ((rc = set_value(&r, &defs[c - 1000], optarg, origin)) != 0)
            return rc;
    }
    if (optind < argc) {
        fprintf(stderr, "ditd: unexpected argument '%s' (see --help)\n", argv[optind]);
        return 2;
    }
    if (!r.model) {
        fprintf(stderr, "ditd: --model (or DITD_MODEL) is required (see --help)\n");
        return 2;
    }
    memset(cfg, 0, sizeof *cfg);
    cfg->model = r.model;
    cfg->model_name = r.model_name ? r.model_name : basename_of(r.model);
    cfg->listen = r.listen ? r.listen : "0.0.0.0:50051";
    if (check_listen(cfg) != 0)
        return 2;
    cfg->backend_name = r.backend ? r.backend : "cpu";
    if (dit_backend_kind_parse(cfg->backend_name, &cfg->backend) != DIT_OK) {
        fprintf(stderr, "ditd: unknown backend '%s' (cpu or cuda)\n", cfg->backend_name);
        return 2;
    }
    cfg->pc = dit_parallel_config_single();
    cfg->pc.world_size = r.world ? (int)r.world : (int)(r.ring * r.ulysses * r.tp);
    cfg->pc.ring_degree = (int)r.ring;
    cfg->pc.ulysses_degree = (int)r.ulysses;
    cfg->pc.tp_degree = (int)r.tp;
    cfg->pc.ulysses_anything = r.uany != 0;
    cfg->pc.ring_anything = r.rany != 0;
    cfg->pc.unified_anything = r.unany != 0;
    cfg->pc.fp32_merge = r.nofp32 == 0;
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
        fprintf(stderr, "ditd: ranks %d to %d are remote: give --join-listen IP:PORT and "
                        "--join-secret-file FILE\n",
                cfg->local_ranks, cfg->pc.world_size - 1);
        return 2;
    }
    if (cfg->local_ranks == cfg->pc.world_size && (cfg->join_listen || cfg->join_secret_file)) {
        fprintf(stderr, "ditd: --join-listen and --join-secret-file need remote ranks (--local-ranks "
                        "below the world size %d)\n",
                cfg->pc.world_size);
        return 2;
    }
    cfg->max_queue = (int)r.max_queue;
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
    cfg->log.level = DIT_LOG_INFO;
    if (r.log_level && !dit_log_level_parse(r.log_level, &cfg->log.level)) {
        fprintf(stderr, "ditd: log level '%s' is not debug, info, warn or error\n", r.log_level);
        return 2;
    }
    cfg->log.json = r.log_json != 0;
    return 0;
}
