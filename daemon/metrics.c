#include "metrics.h"

#include <microhttpd.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <uv.h>

#include "core/utf8.h"

#define N_STATUS 17
#define N_BUCKETS 14
#define N_RANKS 64
#define N_MESHES 16
/* ditserve_batch_size's buckets: requests in one batched generation. */
#define N_BATCH_BUCKETS 8
static const int batch_bounds[N_BATCH_BUCKETS] = {1, 2, 3, 4, 6, 8, 12, 16};

static const char *const status_names[N_STATUS] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

/* Seconds: from a 1 ms step on a GPU to minutes of queueing. */
static const double bounds[N_BUCKETS] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                         0.25,  0.5,    1,     2.5,  5,     10,   60};

/* Open HTTP connections at most; past METRICS_SOFT_CONNS a new connection
 * closes the oldest one that has not sent a request (else the oldest), so
 * idle or slow clients, however many, cannot keep a scraper out. The hard
 * limit leaves room for connections arriving while evicted ones close. */
#define METRICS_MAX_CONNS 256
#define METRICS_SOFT_CONNS 224
/* An HTTP connection with nothing to say is closed after this long. */
#define METRICS_IDLE_TIMEOUT_S 5

/* One open HTTP connection, oldest first. Owner: libmicrohttpd's thread
 * (every callback runs on it). */
typedef struct http_conn {
    struct http_conn *prev, *next;
    int fd;
    bool served;  /* it sent a request */
    bool evicted; /* shut down; closes on the next poll */
} http_conn;

typedef struct histogram {
    uint64_t counts[N_BUCKETS + 1]; /* the last one is +Inf */
    uint64_t n;
    double sum;
} histogram;

struct dit_metrics {
    uv_mutex_t mu;
    struct MHD_Daemon *httpd;
    char model[512]; /* the label value, escaped (label_value) */
    uint64_t requests[N_STATUS];
    histogram queue, latency, step;
    int queued, running;
    /* Per mesh (ditd --replicas); n_meshes: the highest index seen + 1. */
    int n_meshes;
    char mesh_state[N_MESHES][32];
    int64_t restarts[N_MESHES];
    double busy_s[N_MESHES];
    /* Requests per batched generation: counts per bucket (+Inf last). */
    uint64_t batch_counts[N_BATCH_BUCKETS + 1], batch_n, batch_sum;
    /* Per mesh and rank, as the workers last reported; seen once reported. */
    bool seen[N_MESHES][N_RANKS];
    int64_t rss[N_MESHES][N_RANKS], gpu_used[N_MESHES][N_RANKS], gpu_total[N_MESHES][N_RANKS],
        gpu_peak[N_MESHES][N_RANKS];
    int64_t lora_loads, lora_hits, lora_evictions, lora_cached, lora_cached_bytes;
    /* libmicrohttpd's thread only. */
    http_conn *oldest, *newest;
    int n_conns;
};

static void observe(histogram *h, double v)
{
    int b = 0;
    while (b < N_BUCKETS && v > bounds[b])
        b++;
    h->counts[b]++;
    h->n++;
    h->sum += v;
}

void dit_metrics_request(dit_metrics *m, const char *status, double queue_s, double total_s)
{
    if (!m)
        return;
    uv_mutex_lock(&m->mu);
    for (int i = 0; i < N_STATUS; i++)
        if (strcmp(status, status_names[i]) == 0)
            m->requests[i]++;
    if (queue_s >= 0)
        observe(&m->queue, queue_s);
    if (total_s >= 0)
        observe(&m->latency, total_s);
    uv_mutex_unlock(&m->mu);
}

void dit_metrics_step(dit_metrics *m, double step_s)
{
    if (!m)
        return;
    uv_mutex_lock(&m->mu);
    observe(&m->step, step_s);
    uv_mutex_unlock(&m->mu);
}

void dit_metrics_gauges(dit_metrics *m, int queued, int running)
{
    if (!m)
        return;
    uv_mutex_lock(&m->mu);
    m->queued = queued;
    m->running = running;
    uv_mutex_unlock(&m->mu);
}

void dit_metrics_mesh(dit_metrics *m, int mesh, const char *state, int64_t restarts)
{
    if (!m || mesh < 0 || mesh >= N_MESHES)
        return;
    uv_mutex_lock(&m->mu);
    snprintf(m->mesh_state[mesh], sizeof m->mesh_state[mesh], "%s", state);
    m->restarts[mesh] = restarts;
    m->n_meshes = mesh + 1 > m->n_meshes ? mesh + 1 : m->n_meshes;
    uv_mutex_unlock(&m->mu);
}

void dit_metrics_mesh_busy(dit_metrics *m, int mesh, double seconds)
{
    if (!m || mesh < 0 || mesh >= N_MESHES || !(seconds >= 0))
        return;
    uv_mutex_lock(&m->mu);
    m->busy_s[mesh] += seconds;
    m->n_meshes = mesh + 1 > m->n_meshes ? mesh + 1 : m->n_meshes;
    uv_mutex_unlock(&m->mu);
}

void dit_metrics_batch(dit_metrics *m, int requests)
{
    if (!m || requests < 1)
        return;
    uv_mutex_lock(&m->mu);
    int b = 0;
    while (b < N_BATCH_BUCKETS && requests > batch_bounds[b])
        b++;
    m->batch_counts[b]++;
    m->batch_n++;
    m->batch_sum += (uint64_t)requests;
    uv_mutex_unlock(&m->mu);
}

void dit_metrics_worker_memory(dit_metrics *m, int mesh, int rank, int64_t rss, int64_t gpu_used,
                               int64_t gpu_total, int64_t gpu_peak)
{
    if (!m || rank < 0 || rank >= N_RANKS || mesh < 0 || mesh >= N_MESHES)
        return;
    uv_mutex_lock(&m->mu);
    m->seen[mesh][rank] = true;
    m->rss[mesh][rank] = rss;
    m->gpu_used[mesh][rank] = gpu_used;
    m->gpu_total[mesh][rank] = gpu_total;
    m->gpu_peak[mesh][rank] = gpu_peak;
    uv_mutex_unlock(&m->mu);
}

void dit_metrics_lora(dit_metrics *m, int64_t loads, int64_t hits, int64_t evictions,
                      int64_t cached, int64_t cached_bytes)
{
    if (!m)
        return;
    uv_mutex_lock(&m->mu);
    m->lora_loads += loads > 0 ? loads : 0;
    m->lora_hits += hits > 0 ? hits : 0;
    m->lora_evictions += evictions > 0 ? evictions : 0;
    m->lora_cached = cached;
    m->lora_cached_bytes = cached_bytes;
    uv_mutex_unlock(&m->mu);
}

typedef struct text {
    char *buf;
    size_t len, cap;
    int failed;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...)
{
    if (t->failed)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(t->buf + t->len, t->cap - t->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->failed = 1;
            return;
        }
        if ((size_t)n < t->cap - t->len) {
            t->len += (size_t)n;
            return;
        }
        size_t cap = (t->cap + (size_t)n) * 2;
        char *nb = realloc(t->buf, cap);
        if (!nb) {
            t->failed = 1;
            return;
        }
        t->buf = nb;
        t->cap = cap;
    }
}

static void put_histogram(text *t, const char *name, const char *help, const histogram *h,
                          const char *model)
{
    put(t, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int b = 0; b < N_BUCKETS; b++) {
        cum += h->counts[b];
        put(t, "%s_bucket{model=\"%s\",le=\"%g\"} %llu\n", name, model, bounds[b],
            (unsigned long long)cum);
    }
    put(t, "%s_bucket{model=\"%s\",le=\"+Inf\"} %llu\n", name, model, (unsigned long long)h->n);
    put(t, "%s_sum{model=\"%s\"} %.6f\n%s_count{model=\"%s\"} %llu\n", name, model, h->sum, name,
        model, (unsigned long long)h->n);
}

static void put_per_rank(text *t, dit_metrics *m, const char *name, const char *help,
                         int64_t (*v)[N_RANKS], bool gpu_only)
{
    bool any = false;
    for (int i = 0; i < N_MESHES; i++)
        for (int r = 0; r < N_RANKS; r++)
            any |= m->seen[i][r] && (!gpu_only || m->gpu_total[i][r] > 0);
    if (!any)
        return;
    put(t, "# HELP %s %s\n# TYPE %s gauge\n", name, help, name);
    for (int i = 0; i < N_MESHES; i++)
        for (int r = 0; r < N_RANKS; r++)
            if (m->seen[i][r] && (!gpu_only || m->gpu_total[i][r] > 0))
                put(t, "%s{model=\"%s\",mesh=\"%d\",rank=\"%d\"} %lld\n", name, m->model, i, r,
                    (long long)v[i][r]);
}

char *dit_metrics_render(dit_metrics *m)
{
    text t = {.buf = malloc(4096), .cap = 4096};
    if (!t.buf)
        return NULL;
    t.buf[0] = '\0';
    uv_mutex_lock(&m->mu);
    const char *md = m->model;
    put(&t, "# HELP ditserve_requests_total Generate requests by final gRPC status.\n"
            "# TYPE ditserve_requests_total counter\n");
    for (int i = 0; i < N_STATUS; i++)
        put(&t, "ditserve_requests_total{model=\"%s\",status=\"%s\"} %llu\n", md, status_names[i],
            (unsigned long long)m->requests[i]);
    put(&t,
        "# HELP ditserve_queued_requests Requests waiting in the queue.\n"
        "# TYPE ditserve_queued_requests gauge\nditserve_queued_requests{model=\"%s\"} %d\n",
        md, m->queued);
    put(&t,
        "# HELP ditserve_running_requests Requests running on the mesh.\n"
        "# TYPE ditserve_running_requests gauge\nditserve_running_requests{model=\"%s\"} %d\n",
        md, m->running);
    put_histogram(&t, "ditserve_queue_seconds", "Time requests waited in the queue.", &m->queue,
                  md);
    put_histogram(&t, "ditserve_request_seconds", "Time from arrival to the last result byte.",
                  &m->latency, md);
    put_histogram(&t, "ditserve_step_seconds", "Time of one denoising step.", &m->step, md);
    const int nm = m->n_meshes > 0 ? m->n_meshes : 1;
    put(&t, "# HELP ditserve_worker_restarts_total Times each worker mesh was rebuilt.\n"
            "# TYPE ditserve_worker_restarts_total counter\n");
    for (int i = 0; i < nm; i++)
        put(&t, "ditserve_worker_restarts_total{model=\"%s\",mesh=\"%d\"} %lld\n", md, i,
            (long long)m->restarts[i]);
    static const char *const states[] = {"starting", "ready", "restarting", "stopping", "stopped"};
    put(&t, "# HELP ditserve_mesh_state Each worker mesh's state (1 for the current one).\n"
            "# TYPE ditserve_mesh_state gauge\n");
    for (int i = 0; i < nm; i++)
        for (size_t k = 0; k < sizeof states / sizeof *states; k++)
            put(&t, "ditserve_mesh_state{model=\"%s\",mesh=\"%d\",state=\"%s\"} %d\n", md, i,
                states[k], strcmp(states[k], m->mesh_state[i]) == 0);
    put(&t, "# HELP ditserve_mesh_busy_seconds_total Time each mesh spent running generations.\n"
            "# TYPE ditserve_mesh_busy_seconds_total counter\n");
    for (int i = 0; i < nm; i++)
        put(&t, "ditserve_mesh_busy_seconds_total{model=\"%s\",mesh=\"%d\"} %.6f\n", md, i,
            m->busy_s[i]);
    put(&t, "# HELP ditserve_batch_size Requests in each batched generation (ditd --max-batch).\n"
            "# TYPE ditserve_batch_size histogram\n");
    uint64_t cum = 0;
    for (int b = 0; b < N_BATCH_BUCKETS; b++) {
        cum += m->batch_counts[b];
        put(&t, "ditserve_batch_size_bucket{model=\"%s\",le=\"%d\"} %llu\n", md, batch_bounds[b],
            (unsigned long long)cum);
    }
    put(&t, "ditserve_batch_size_bucket{model=\"%s\",le=\"+Inf\"} %llu\n", md,
        (unsigned long long)m->batch_n);
    put(&t,
        "ditserve_batch_size_sum{model=\"%s\"} %llu\nditserve_batch_size_count{model=\"%s\"} "
        "%llu\n",
        md, (unsigned long long)m->batch_sum, md, (unsigned long long)m->batch_n);
    put(&t,
        "# HELP ditserve_lora_loads_total LoRA adapter files the meshes loaded.\n"
        "# TYPE ditserve_lora_loads_total counter\nditserve_lora_loads_total{model=\"%s\"} %lld\n"
        "# HELP ditserve_lora_cache_hits_total Adapter uses served by the workers' caches.\n"
        "# TYPE ditserve_lora_cache_hits_total counter\n"
        "ditserve_lora_cache_hits_total{model=\"%s\"} %lld\n"
        "# HELP ditserve_lora_evictions_total Adapters dropped to stay within the cache bound.\n"
        "# TYPE ditserve_lora_evictions_total counter\n"
        "ditserve_lora_evictions_total{model=\"%s\"} %lld\n"
        "# HELP ditserve_lora_cached_adapters Adapters loaded, over every mesh's cache.\n"
        "# TYPE ditserve_lora_cached_adapters gauge\n"
        "ditserve_lora_cached_adapters{model=\"%s\"} %lld\n"
        "# HELP ditserve_lora_cached_bytes Memory a rank holds for loaded adapters, over every "
        "mesh's cache.\n"
        "# TYPE ditserve_lora_cached_bytes gauge\nditserve_lora_cached_bytes{model=\"%s\"} %lld\n",
        md, (long long)m->lora_loads, md, (long long)m->lora_hits, md, (long long)m->lora_evictions,
        md, (long long)m->lora_cached, md, (long long)m->lora_cached_bytes);
    put_per_rank(&t, m, "ditserve_worker_resident_bytes",
                 "Resident memory of each rank's worker process.", m->rss, false);
    put_per_rank(&t, m, "ditserve_gpu_memory_used_bytes",
                 "GPU memory in use on each rank's device (every process on it).", m->gpu_used,
                 true);
    put_per_rank(&t, m, "ditserve_gpu_memory_total_bytes", "GPU memory of each rank's device.",
                 m->gpu_total, true);
    put_per_rank(&t, m, "ditserve_gpu_memory_peak_bytes",
                 "High-water mark of the memory each rank's backend allocated.", m->gpu_peak, true);
    uv_mutex_unlock(&m->mu);
    if (t.failed) {
        free(t.buf);
        return NULL;
    }
    return t.buf;
}

static enum MHD_Result on_http(void *cls, struct MHD_Connection *conn, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **con_cls)
{
    (void)version;
    (void)upload;
    (void)upload_size;
    (void)con_cls;
    dit_metrics *m = cls;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    if (ci && ci->socket_context)
        ((http_conn *)ci->socket_context)->served = true;
    unsigned code = MHD_HTTP_OK;
    char *body = NULL;
    const char *type = "text/plain; version=0.0.4; charset=utf-8";
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
        code = MHD_HTTP_METHOD_NOT_ALLOWED;
        body = strdup("only GET /metrics is served here\n");
    } else if (strcmp(url, "/metrics") != 0) {
        code = MHD_HTTP_NOT_FOUND;
        body = strdup("not found: metrics are at /metrics\n");
    } else if (!(body = dit_metrics_render(m))) {
        code = MHD_HTTP_INTERNAL_SERVER_ERROR;
    }
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(body ? strlen(body) : 0, body ? body : (char *)"",
                                        body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, "Content-Type", type);
    enum MHD_Result r = MHD_queue_response(conn, code, resp);
    MHD_destroy_response(resp);
    return r;
}

static void on_conn_event(void *cls, struct MHD_Connection *conn, void **ctx,
                          enum MHD_ConnectionNotificationCode what)
{
    dit_metrics *m = cls;
    if (what == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        http_conn *hc = ci ? calloc(1, sizeof *hc) : NULL;
        if (!hc)
            return; /* not tracked: never evicted, still timed out */
        hc->fd = ci->connect_fd;
        hc->prev = m->newest;
        if (m->newest)
            m->newest->next = hc;
        else
            m->oldest = hc;
        m->newest = hc;
        m->n_conns++;
        *ctx = hc;
    } else if (what == MHD_CONNECTION_NOTIFY_CLOSED && *ctx) {
        http_conn *hc = *ctx;
        if (hc->prev)
            hc->prev->next = hc->next;
        else
            m->oldest = hc->next;
        if (hc->next)
            hc->next->prev = hc->prev;
        else
            m->newest = hc->prev;
        m->n_conns--;
        free(hc);
        *ctx = NULL;
    }
}

/* Runs before each accept: at the soft limit, makes room by shutting down
 * the oldest connection that never sent a request (a scraper's keep-alive
 * connection goes only when every other one is serving too). */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t len)
{
    (void)addr;
    (void)len;
    dit_metrics *m = cls;
    int live = 0;
    for (http_conn *hc = m->oldest; hc; hc = hc->next)
        live += !hc->evicted;
    if (live < METRICS_SOFT_CONNS)
        return MHD_YES;
    http_conn *victim = NULL;
    for (http_conn *hc = m->oldest; hc && !victim; hc = hc->next)
        if (!hc->evicted && !hc->served)
            victim = hc;
    for (http_conn *hc = m->oldest; hc && !victim; hc = hc->next)
        if (!hc->evicted)
            victim = hc;
    if (victim) {
        shutdown(victim->fd, SHUT_RDWR);
        victim->evicted = true;
    }
    return MHD_YES;
}

/* `s` as a Prometheus label value in out (cap bytes, NUL included): \, "
 * and a newline escaped, bytes that are not UTF-8 as '?', cut before a
 * character or an escape that would not fit whole (the text format refuses
 * the whole scrape over one bad value). */
static void label_value(const char *s, char *out, size_t cap)
{
    size_t o = 0, n = strlen(s);
    for (size_t i = 0; i < n;) {
        size_t len = dit_utf8_len(s + i, n - i);
        const char *src = s + i;
        char esc[2];
        size_t w = len;
        if (len == 0) { /* not UTF-8 */
            src = "?";
            w = len = 1;
        } else if (s[i] == '\\' || s[i] == '"' || s[i] == '\n') {
            esc[0] = '\\';
            esc[1] = s[i] == '\n' ? 'n' : s[i];
            src = esc;
            w = 2;
        }
        if (o + w + 1 > cap)
            break;
        memcpy(out + o, src, w);
        o += w;
        i += len;
    }
    out[o] = '\0';
}

dit_status dit_metrics_start(int port, int loopback_only, const char *model, int n_meshes,
                             dit_metrics **out, int *bound_port, dit_diag *diag)
{
    dit_metrics *m = calloc(1, sizeof *m);
    if (!m)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    uv_mutex_init(&m->mu);
    label_value(model ? model : "", m->model, sizeof m->model);
    m->n_meshes = n_meshes < 1 ? 1 : n_meshes > N_MESHES ? N_MESHES : n_meshes;
    for (int i = 0; i < N_MESHES; i++)
        snprintf(m->mesh_state[i], sizeof m->mesh_state[i], "starting");
    /* Every address: IPv6 and IPv4 on one socket, so that a ditd serving
     * gRPC on IPv6 (an IPv6-only cluster) is scraped there too; IPv4 alone
     * where the host has no IPv6. epoll (poll where there is none): select()
     * would fail on descriptors past FD_SETSIZE, which a busy ditd reaches. */
    if (!loopback_only) {
        struct sockaddr_in6 addr6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port)};
        addr6.sin6_addr = in6addr_any;
        m->httpd = MHD_start_daemon(MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_DUAL_STACK,
                                    (uint16_t)port, on_accept, m, on_http, m, MHD_OPTION_SOCK_ADDR,
                                    (struct sockaddr *)&addr6, MHD_OPTION_CONNECTION_LIMIT,
                                    (unsigned)METRICS_MAX_CONNS, MHD_OPTION_CONNECTION_TIMEOUT,
                                    (unsigned)METRICS_IDLE_TIMEOUT_S, MHD_OPTION_NOTIFY_CONNECTION,
                                    on_conn_event, m, MHD_OPTION_END);
    }
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(loopback_only ? INADDR_LOOPBACK : INADDR_ANY);
    if (!m->httpd)
        m->httpd = MHD_start_daemon(MHD_USE_AUTO_INTERNAL_THREAD, (uint16_t)port, on_accept, m,
                                    on_http, m, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
                                    MHD_OPTION_CONNECTION_LIMIT, (unsigned)METRICS_MAX_CONNS,
                                    MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)METRICS_IDLE_TIMEOUT_S,
                                    MHD_OPTION_NOTIFY_CONNECTION, on_conn_event, m, MHD_OPTION_END);
    if (!m->httpd) {
        uv_mutex_destroy(&m->mu);
        free(m);
        return dit_diag_set(diag, DIT_ERR_IO, "cannot serve metrics on port %d (in use?)", port);
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(m->httpd, MHD_DAEMON_INFO_BIND_PORT);
    *bound_port = info ? info->port : port;
    *out = m;
    return DIT_OK;
}

void dit_metrics_stop(dit_metrics *m)
{
    if (!m)
        return;
    MHD_stop_daemon(m->httpd);
    uv_mutex_destroy(&m->mu);
    free(m);
}
