#include "http.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <gnutls/gnutls.h>
#include <microhttpd.h>

#include "core/utf8.h"
#include "openai.h"
#include "serve/request.h"
#include "server.h"

extern const char dit_playground_html[];
extern const size_t dit_playground_html_len;

/* Images one request may ask for (openai.h). */
#define HTTP_MAX_N DIT_OPENAI_MAX_N
/* How often a waiting connection thread looks at its socket. */
#define HTTP_POLL_MS 200
/* A stream silent this long gets an SSE comment, so proxies keep it. */
#define HTTP_KEEPALIVE_MS 15000
/* The playground and error bodies are small; SSE writes go out in blocks. */
#define HTTP_SSE_BLOCK 65536

/* ------------------------------------------------------------------------ */
/* Requests shared by a connection thread and the loop                      */

typedef struct gen gen;

typedef enum gen_phase {
    GEN_NEW,      /* handed to the loop, not admitted yet */
    GEN_ACCEPTED, /* in the queue or running */
    GEN_DONE,     /* the job (all n images) finished, failed or was cancelled (or refused) */
} gen_phase;

/* One images request: one job of num_images = n. `job` is the loop's; the
 * rest is under mu once the job is submitted. */
struct gen {
    dit_http *h;
    uv_mutex_t mu;
    uv_cond_t cv;
    int refs; /* the connection's and, while its job lives, the loop's */
    bool stream;
    int n;                              /* images, the request's num_images */
    Ditserve__V1__GenerateRequest *req; /* the connection's until admitted */
    dit_server_job *job;                /* loop thread only; NULL once finished */
    int64_t created;
    /* Under mu. */
    gen_phase phase;
    bool finished;    /* the job ended (or was cancelled) */
    bool have_result; /* a Result whose image sizes match the chunks */
    bool bad_chunks;  /* a chunk out of order or of an image that does not exist */
    uint8_t *data;    /* the n PNGs one after another, as their chunks arrive */
    size_t len, cap;
    int cur;                    /* the image whose chunks arrive now */
    size_t got[HTTP_MAX_N];     /* bytes of each image so far */
    size_t img_off[HTTP_MAX_N]; /* where each image starts in data */
    uint64_t seed;
    int width, height;
    Ditserve__V1__Timings timings;
    bool failed;
    grpc_status_code code;
    char msg[DIT_DIAG_MAX];
    char *sse; /* SSE bytes the client has not been sent yet */
    size_t sse_len, sse_off, sse_cap;
    bool gone;                   /* the client left */
    struct MHD_Connection *conn; /* the connection thread's, for the SSE reader */
    int64_t held;                /* its part of dit_http.held (mu) */
};

typedef struct vjob vjob;

/* "video_" and 32 hex digits from getrandom: the id alone fetches the MP4. */
#define VIDEO_ID_LEN 38
/* Ids of jobs deleted or expired that a list's `after` still finds: a
 * client that deletes while it pages on (the openai client's
 * auto-pagination) names one it has just deleted. */
#define VIDEO_GONE_MAX 1024

/* A job that left the store, and its place in the store's order. */
typedef struct vgone {
    char id[VIDEO_ID_LEN + 1];
    uint64_t seq;
} vgone;

typedef enum op_kind {
    OP_SUBMIT,  /* an images request's job */
    OP_CANCEL,  /* their client left */
    OP_VSUBMIT, /* a /v1/videos job */
    OP_VCANCEL, /* it was deleted */
} op_kind;

/* A connection libmicrohttpd holds (see on_accept). */
typedef struct conn_slot {
    struct conn_slot *prev, *next;
    int fd;
    /* Under cmu: a request's headers are in (until it completes), and
     * since when the connection has waited for one (accepted, or its last
     * request completed). */
    bool busy;
    uint64_t since_ms;
} conn_slot;

/* The connection's slot, NULL when it has none. */
static conn_slot *slot_of(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

typedef struct op {
    struct op *next;
    op_kind kind;
    gen *g;  /* OP_SUBMIT, OP_CANCEL */
    vjob *v; /* OP_VSUBMIT, OP_VCANCEL */
} op;

struct dit_http {
    uv_loop_t *loop;
    struct dit_server *srv; /* loop thread only */
    dit_http_config cfg;
    char *token, *cors;                /* copies */
    char *cert_pem, *key_pem, *ca_pem; /* ca_pem: client certificates required */
    struct MHD_Daemon *mhd;
    bool tls;
    int64_t started;
    _Atomic int64_t held;  /* result bytes waiting for their clients (gen.held) */
    uint64_t keepalive_ms; /* an event stream's comment when quiet this long */
    uv_async_t async;
    uv_mutex_t mu; /* ops, closed, active */
    op *ops_head, *ops_tail;
    bool closed;
    int active; /* requests whose connection has not completed */
    atomic_bool serving;
    atomic_bool stopping;
    /* Each mesh's state (ditd --replicas) for /health, under mu. */
    char mesh_states[DIT_HTTP_MAX_MESHES][24];
    int n_meshes;
    /* /v1/videos' store. Lock order: a request's mu is never held with it. */
    uv_mutex_t vmu;
    uv_cond_t vcv;               /* admission decided */
    vjob *vhead, *vtail;         /* oldest first */
    int vcount;                  /* in the list */
    int vreserved;               /* created, admission not decided yet */
    int64_t vbytes;              /* MP4 bytes held, finished or arriving */
    uint64_t vseq;               /* the last vjob.seq given */
    vgone vgone[VIDEO_GONE_MAX]; /* a ring: the last jobs to leave the store */
    int vgone_next;              /* where the next one goes */
    /* The connections libmicrohttpd holds, accepted and not yet reaped,
     * for on_accept. nconns counts them all, the list those whose socket is
     * known. Under cmu. */
    uv_mutex_t cmu;
    conn_slot *conns;
    int nconns;
};

/* The bytes a request holds for its client change (mu held, or the last
 * reference). */
static void gen_hold(gen *g, int64_t delta)
{
    g->held += delta;
    atomic_fetch_add(&g->h->held, delta);
}

static void gen_unref(gen *g)
{
    uv_mutex_lock(&g->mu);
    const int left = --g->refs;
    uv_mutex_unlock(&g->mu);
    if (left > 0)
        return;
    if (g->req)
        ditserve__v1__generate_request__free_unpacked(g->req, NULL);
    gen_hold(g, -g->held);
    free(g->data);
    free(g->sse);
    uv_cond_destroy(&g->cv);
    uv_mutex_destroy(&g->mu);
    free(g);
}

/* Appends to the SSE buffer (mu held). False when out of memory. */
static bool sse_append(gen *g, const char *s, size_t n)
{
    if (g->sse_off > 0 && g->sse_off == g->sse_len)
        g->sse_off = g->sse_len = 0;
    if (g->sse_len + n > g->sse_cap) {
        size_t cap = g->sse_cap ? g->sse_cap : 4096;
        while (cap < g->sse_len + n)
            cap *= 2;
        char *p = realloc(g->sse, cap);
        if (!p)
            return false;
        gen_hold(g, (int64_t)cap - (int64_t)g->sse_cap);
        g->sse = p;
        g->sse_cap = cap;
    }
    memcpy(g->sse + g->sse_len, s, n);
    g->sse_len += n;
    return true;
}

/* One SSE event: `event: TYPE` and the object (which holds "type" too, as
 * OpenAI's client reads it from there). Frees obj. mu held. */
static void sse_event(gen *g, const char *type, cJSON *obj)
{
    cJSON_AddStringToObject(obj, "type", type);
    char *text = cJSON_PrintUnformatted(obj);
    cJSON_Delete(obj);
    if (!text)
        return;
    char head[96];
    const int hn = snprintf(head, sizeof head, "event: %s\ndata: ", type);
    sse_append(g, head, (size_t)hn);
    sse_append(g, text, strlen(text));
    sse_append(g, "\n\n", 2);
    free(text);
}

/* ------------------------------------------------------------------------ */
/* JSON pieces                                                               */

static const char b64_alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static char *base64(const uint8_t *p, size_t n)
{
    char *out = malloc((n + 2) / 3 * 4 + 1);
    if (!out)
        return NULL;
    size_t o = 0, i = 0;
    for (; i + 2 < n; i += 3) {
        const uint32_t v = (uint32_t)p[i] << 16 | (uint32_t)p[i + 1] << 8 | p[i + 2];
        out[o++] = b64_alphabet[v >> 18];
        out[o++] = b64_alphabet[(v >> 12) & 63];
        out[o++] = b64_alphabet[(v >> 6) & 63];
        out[o++] = b64_alphabet[v & 63];
    }
    if (i < n) {
        const uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0);
        out[o++] = b64_alphabet[v >> 18];
        out[o++] = b64_alphabet[(v >> 12) & 63];
        out[o++] = i + 1 < n ? b64_alphabet[(v >> 6) & 63] : '=';
        out[o++] = '=';
    }
    out[o] = '\0';
    return out;
}

/* An integer written out in full: cJSON prints numbers with 15 significant
 * digits when they compare equal within its tolerance, which turns a seed
 * such as 6259364193470371 into 6.25936419347037e+15. */
static void add_u64(cJSON *o, const char *name, uint64_t v)
{
    char buf[24];
    snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
    cJSON_AddRawToObject(o, name, buf);
}

static cJSON *timings_json(const Ditserve__V1__Timings *t)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "queue_ms", t->queue_ms);
    cJSON_AddNumberToObject(o, "tokenize_ms", t->tokenize_ms);
    cJSON_AddNumberToObject(o, "text_encode_ms", t->text_encode_ms);
    cJSON_AddNumberToObject(o, "denoise_ms", t->denoise_ms);
    cJSON_AddNumberToObject(o, "step_ms_min", t->step_ms_min);
    cJSON_AddNumberToObject(o, "step_ms_max", t->step_ms_max);
    cJSON_AddNumberToObject(o, "vae_ms", t->vae_ms);
    cJSON_AddNumberToObject(o, "encode_ms", t->encode_ms);
    cJSON_AddNumberToObject(o, "total_ms", t->total_ms);
    return o;
}

/* The HTTP status of a gRPC one. */
static unsigned http_status_of(grpc_status_code code)
{
    switch (code) {
    case GRPC_STATUS_OK:
        return MHD_HTTP_OK;
    case GRPC_STATUS_INVALID_ARGUMENT:
    case GRPC_STATUS_FAILED_PRECONDITION:
    case GRPC_STATUS_OUT_OF_RANGE:
        return MHD_HTTP_BAD_REQUEST;
    case GRPC_STATUS_UNAUTHENTICATED:
        return MHD_HTTP_UNAUTHORIZED;
    case GRPC_STATUS_PERMISSION_DENIED:
        return MHD_HTTP_FORBIDDEN;
    case GRPC_STATUS_NOT_FOUND:
        return MHD_HTTP_NOT_FOUND;
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
        return MHD_HTTP_TOO_MANY_REQUESTS;
    case GRPC_STATUS_UNAVAILABLE:
        return MHD_HTTP_SERVICE_UNAVAILABLE;
    case GRPC_STATUS_UNIMPLEMENTED:
        return MHD_HTTP_NOT_IMPLEMENTED;
    case GRPC_STATUS_DEADLINE_EXCEEDED:
        return MHD_HTTP_GATEWAY_TIMEOUT;
    case GRPC_STATUS_CANCELLED:
        return 499; /* the client closed the request (nginx's code) */
    default:
        return MHD_HTTP_INTERNAL_SERVER_ERROR;
    }
}

/* OpenAI's error "type" for an HTTP status, and our "code". */
static const char *error_type_of(unsigned status)
{
    if (status == MHD_HTTP_UNAUTHORIZED)
        return "authentication_error";
    if (status == MHD_HTTP_TOO_MANY_REQUESTS)
        return "rate_limit_error";
    if (status == MHD_HTTP_NOT_FOUND)
        return "not_found_error";
    if (status == MHD_HTTP_FORBIDDEN)
        return "permission_error";
    return status >= 500 ? "server_error" : "invalid_request_error";
}

/* {"error": {"message", "type", "param", "code"}}; param may be NULL. */
static cJSON *error_json(unsigned status, const char *param, const char *code, const char *msg)
{
    cJSON *o = cJSON_CreateObject(), *e = cJSON_AddObjectToObject(o, "error");
    cJSON_AddStringToObject(e, "message", msg);
    cJSON_AddStringToObject(e, "type", error_type_of(status));
    if (param)
        cJSON_AddStringToObject(e, "param", param);
    else
        cJSON_AddNullToObject(e, "param");
    cJSON_AddStringToObject(e, "code", code);
    return o;
}

static const char *grpc_code_name(grpc_status_code code)
{
    switch (code) {
    case GRPC_STATUS_INVALID_ARGUMENT:
        return "invalid_value";
    case GRPC_STATUS_NOT_FOUND:
        return "model_not_found";
    case GRPC_STATUS_RESOURCE_EXHAUSTED:
        return "queue_full";
    case GRPC_STATUS_UNAVAILABLE:
        return "unavailable";
    case GRPC_STATUS_CANCELLED:
        return "cancelled";
    case GRPC_STATUS_FAILED_PRECONDITION:
        return "failed_precondition";
    case GRPC_STATUS_DEADLINE_EXCEEDED:
        return "deadline_exceeded";
    default:
        return "internal_error";
    }
}

/* ------------------------------------------------------------------------ */
/* Loop thread: the jobs' client                                             */

/* Appends one chunk of image `index` at `offset` within it (mu held). The
 * images stream in order, each from offset 0; anything else marks the
 * result broken rather than reordering it. */
static void take_chunk(gen *g, const Ditserve__V1__ResultChunk *c)
{
    if (g->bad_chunks)
        return;
    const int index = c->image_index;
    if (index == g->cur + 1 && index < g->n && g->got[g->cur] > 0)
        g->cur = index; /* the next image begins */
    if (index != g->cur || c->offset < 0 || (uint64_t)c->offset != g->got[g->cur]) {
        g->bad_chunks = true;
        return;
    }
    const size_t n = c->data.len;
    if (g->len + n > g->cap) {
        size_t cap = g->cap ? g->cap : 65536;
        while (cap < g->len + n)
            cap *= 2;
        uint8_t *p = realloc(g->data, cap);
        if (!p) {
            g->bad_chunks = true; /* the result check reports the short images */
            return;
        }
        gen_hold(g, (int64_t)cap - (int64_t)g->cap);
        g->data = p;
        g->cap = cap;
    }
    memcpy(g->data + g->len, c->data.data, n);
    g->len += n;
    g->got[g->cur] += n;
}

/* Checks the Result against the chunks and splits data into the n images
 * by Result.image_bytes (one image: total_bytes alone will do). mu held. */
static bool split_images(gen *g, const Ditserve__V1__Result *r)
{
    if (g->bad_chunks || r->total_bytes < 0 || (uint64_t)r->total_bytes != g->len)
        return false;
    if (r->n_image_bytes == 0 && g->n == 1) {
        g->img_off[0] = 0;
        return g->len > 0;
    }
    if (r->n_image_bytes != (size_t)g->n || g->cur != g->n - 1)
        return false;
    size_t off = 0;
    for (int k = 0; k < g->n; k++) {
        if (r->image_bytes[k] <= 0 || (uint64_t)r->image_bytes[k] != g->got[k])
            return false;
        g->img_off[k] = off;
        off += g->got[k];
    }
    return off == g->len;
}

static void on_job_event(void *ctx, const Ditserve__V1__GenerateEvent *ev)
{
    gen *g = ctx;
    uv_mutex_lock(&g->mu);
    cJSON *o = NULL;
    /* The queue, start and progress events are the request's, all n images
     * at once (one batch); only a completed image names its index. */
    switch (ev->event_case) {
    case DITSERVE__V1__GENERATE_EVENT__EVENT_QUEUED:
        if (g->stream) {
            o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "num_images", g->n);
            cJSON_AddNumberToObject(o, "position", ev->queued->position);
            cJSON_AddNumberToObject(o, "queue_depth", ev->queued->queue_depth);
            sse_event(g, "ditserve.queued", o);
        }
        break;
    case DITSERVE__V1__GENERATE_EVENT__EVENT_STARTED:
        if (g->stream) {
            o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "num_images", g->n);
            cJSON_AddNumberToObject(o, "queue_ms", ev->started->queue_ms);
            sse_event(g, "ditserve.started", o);
        }
        break;
    case DITSERVE__V1__GENERATE_EVENT__EVENT_PROGRESS:
        if (g->stream) {
            o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "num_images", g->n);
            cJSON_AddNumberToObject(o, "step", ev->progress->step);
            cJSON_AddNumberToObject(o, "total_steps", ev->progress->total_steps);
            cJSON_AddNumberToObject(o, "elapsed_ms", ev->progress->elapsed_ms);
            cJSON_AddStringToObject(o, "stage", ev->progress->stage ? ev->progress->stage : "");
            sse_event(g, "ditserve.progress", o);
        }
        break;
    case DITSERVE__V1__GENERATE_EVENT__EVENT_CHUNK:
        take_chunk(g, ev->chunk);
        break;
    case DITSERVE__V1__GENERATE_EVENT__EVENT_RESULT: {
        const Ditserve__V1__Result *r = ev->result;
        g->seed = r->seed;
        g->width = r->width;
        g->height = r->height;
        if (r->timings)
            g->timings = *r->timings;
        g->have_result = split_images(g, r);
        if (!g->stream || !g->have_result)
            break;
        char size[40];
        snprintf(size, sizeof size, "%dx%d", g->width, g->height);
        for (int k = 0; k < g->n; k++) {
            char *b64 = base64(g->data + g->img_off[k], g->got[k]);
            o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "b64_json", b64 ? b64 : "");
            free(b64);
            add_u64(o, "created_at", (uint64_t)g->created);
            cJSON_AddStringToObject(o, "size", size);
            cJSON_AddStringToObject(o, "output_format", "png");
            cJSON_AddStringToObject(o, "quality", "auto");
            cJSON_AddStringToObject(o, "background", "opaque");
            cJSON *u = cJSON_AddObjectToObject(o, "usage");
            cJSON_AddNumberToObject(u, "input_tokens", 0);
            cJSON_AddNumberToObject(u, "output_tokens", 0);
            cJSON_AddNumberToObject(u, "total_tokens", 0);
            cJSON *d = cJSON_AddObjectToObject(u, "input_tokens_details");
            cJSON_AddNumberToObject(d, "image_tokens", 0);
            cJSON_AddNumberToObject(d, "text_tokens", 0);
            cJSON_AddNumberToObject(o, "index", k);
            add_u64(o, "seed", g->seed);
            cJSON_AddItemToObject(o, "timings", timings_json(&g->timings));
            sse_event(g, "image_generation.completed", o);
        }
        free(g->data); /* sent; the stream needs it no more */
        gen_hold(g, -(int64_t)g->cap);
        g->data = NULL;
        g->len = g->cap = 0;
        break;
    }
    default:
        break;
    }
    uv_mutex_unlock(&g->mu);
    uv_cond_broadcast(&g->cv);
}

/* Marks the request finished (mu held); false when it already was. */
static bool finish_gen(gen *g, grpc_status_code code, const char *msg)
{
    if (g->finished)
        return false;
    g->finished = true;
    g->phase = GEN_DONE;
    if (code == GRPC_STATUS_OK && !g->have_result) {
        code = GRPC_STATUS_INTERNAL;
        msg = g->n > 1 ? "the images did not arrive whole" : "the image did not arrive whole";
    }
    if (code != GRPC_STATUS_OK && !g->failed) {
        g->failed = true;
        g->code = code;
        dit_openai_copy_text(g->msg, sizeof g->msg, msg && *msg ? msg : "failed");
        if (g->stream) {
            const unsigned st = http_status_of(code);
            cJSON *o = error_json(st, NULL, grpc_code_name(code), g->msg);
            sse_event(g, "error", o);
        }
    }
    return true;
}

static void on_job_finish(void *ctx, grpc_status_code code, const char *msg)
{
    gen *g = ctx;
    g->job = NULL;
    uv_mutex_lock(&g->mu);
    const bool now = finish_gen(g, code, msg);
    uv_mutex_unlock(&g->mu);
    uv_cond_broadcast(&g->cv);
    if (now)
        gen_unref(g); /* the loop's */
}

/* Cancels the job if it is still queued or running (loop thread); drops
 * the loop's reference when that finishes the request. */
static void cancel_gen(gen *g, const char *why)
{
    if (!g->job)
        return;
    dit_server_job *j = g->job;
    g->job = NULL;
    dit_server_cancel(g->h->srv, j, why);
    uv_mutex_lock(&g->mu);
    const bool now = finish_gen(g, GRPC_STATUS_CANCELLED, why);
    uv_mutex_unlock(&g->mu);
    uv_cond_broadcast(&g->cv);
    if (now)
        gen_unref(g);
}

static void submit(dit_http *h, gen *g)
{
    dit_job_client client = {on_job_event, on_job_finish, g};
    dit_server_job *job = NULL;
    grpc_status_code code = GRPC_STATUS_OK;
    char msg[DIT_DIAG_MAX];
    /* The job can end inside dit_server_submit (a mesh that fails as the
     * job is sent to it reports at once, and the job is freed with its
     * request): this call holds a reference of its own, and the request
     * leaves g first (an admitted job owns it). */
    uv_mutex_lock(&g->mu);
    g->refs++;
    Ditserve__V1__GenerateRequest *req = g->req;
    g->req = NULL;
    uv_mutex_unlock(&g->mu);
    if (dit_server_submit(h->srv, &req, 1, &client, &job, &code, msg, sizeof msg) != DIT_OK) {
        uv_mutex_lock(&g->mu);
        g->req = req; /* still ours */
        g->failed = true;
        g->code = code;
        dit_openai_copy_text(g->msg, sizeof g->msg, msg);
        g->phase = GEN_DONE;
        uv_mutex_unlock(&g->mu);
        uv_cond_broadcast(&g->cv);
        gen_unref(g); /* the loop's: no job will report */
        gen_unref(g); /* this call's */
        return;
    }
    uv_mutex_lock(&g->mu);
    if (!g->finished) {
        g->job = job;
        if (g->phase == GEN_NEW)
            g->phase = GEN_ACCEPTED;
    }
    uv_mutex_unlock(&g->mu);
    uv_cond_broadcast(&g->cv);
    gen_unref(g); /* this call's */
}

/* ------------------------------------------------------------------------ */
/* /v1/videos: asynchronous jobs kept in a store                             */

/* Fields a form body (multipart or urlencoded) may carry. */
#define FORM_MAX_FIELDS 32
/* What a polling client is told to wait between status requests. */
#define VIDEO_POLL_AFTER_MS "500"

typedef enum vstate { V_QUEUED, V_RUNNING, V_COMPLETED, V_FAILED } vstate;

/* One /v1/videos job. Everything but `job` (the loop's) is under h->vmu.
 * It lives while it is referenced: by the store (from admission until it
 * is deleted or expires), by the loop (until its job finishes or is
 * cancelled), by the connection creating it (until admission is decided)
 * and by a cancel op in flight. */
typedef struct vjob {
    struct vjob *next; /* the store's list, oldest first */
    dit_http *h;
    dit_server_job *job;                /* loop thread only; NULL once finished */
    Ditserve__V1__GenerateRequest *req; /* the creator's until admitted */
    int refs;
    bool in_store;
    uint64_t seq;          /* its place in the store's order (1, 2, ...), given as it enters */
    bool decided, refused; /* admission */
    bool ended_in_submit;  /* admitted, and its job ended inside dit_server_submit */
    vstate state;
    char id[VIDEO_ID_LEN + 1];
    char *model, *prompt;
    int width, height, num_frames, fps;
    uint64_t seed;
    int progress;                                 /* 0-100 */
    int64_t created_at, completed_at, expires_at; /* unix seconds; 0: not yet */
    /* When it is forgotten, on CLOCK_MONOTONIC (ms): expires_at as it was
     * when the job ended, so that a step of the wall clock neither sweeps
     * the store nor keeps a job in it. */
    uint64_t expires_ms;
    grpc_status_code code;
    /* The error's code when it is not the gRPC status's (the store's own
     * refusal), else NULL. */
    const char *ecode;
    char msg[DIT_DIAG_MAX];
    uint8_t *data; /* the MP4 as its chunks arrive; cap = len once completed */
    size_t len, cap;
    bool whole;
    const char *too_big; /* why its clip did not fit the store (finish fails it), or NULL */
    size_t counted;      /* bytes of it in h->vbytes: len, while it holds data */
    Ditserve__V1__Timings timings;
} vjob;

static const char *vstate_name(vstate s)
{
    switch (s) {
    case V_QUEUED:
        return "queued";
    case V_RUNNING:
        return "in_progress";
    case V_COMPLETED:
        return "completed";
    case V_FAILED:
        return "failed";
    }
    return "failed";
}

static int64_t wall_s(void)
{
    return (int64_t)time(NULL);
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Drops one reference (vmu held); the last frees the job. */
static void vdrop_locked(dit_http *h, vjob *v)
{
    if (--v->refs > 0)
        return;
    h->vbytes -= (int64_t)v->counted;
    if (v->req)
        ditserve__v1__generate_request__free_unpacked(v->req, NULL);
    free(v->data);
    free(v->model);
    free(v->prompt);
    free(v);
}

static void vunref(dit_http *h, vjob *v)
{
    uv_mutex_lock(&h->vmu);
    vdrop_locked(h, v);
    uv_mutex_unlock(&h->vmu);
}

/* A clip's response is gone (libmicrohttpd's thread). */
static void video_sent(void *cls)
{
    vjob *v = cls;
    vunref(v->h, v);
}

/* Takes a job out of the store's count (vmu held; the caller unlinks it
 * and drops the store's reference), keeping its id and place for `after`. */
static void vleave_locked(dit_http *h, vjob *v)
{
    vgone *g = &h->vgone[h->vgone_next];
    h->vgone_next = (h->vgone_next + 1) % VIDEO_GONE_MAX;
    memcpy(g->id, v->id, sizeof g->id);
    g->seq = v->seq;
    v->in_store = false;
    h->vcount--;
}

/* Forgets finished jobs past their retention (vmu held; now: mono_ms()). */
static void vexpire_locked(dit_http *h, uint64_t now)
{
    vjob **pp = &h->vhead;
    h->vtail = NULL;
    while (*pp) {
        vjob *v = *pp;
        if ((v->state == V_COMPLETED || v->state == V_FAILED) && v->expires_ms <= now) {
            *pp = v->next;
            vleave_locked(h, v);
            vdrop_locked(h, v);
            continue;
        }
        h->vtail = v;
        pp = &v->next;
    }
}

/* Marks a job ended (vmu held). */
static void vend_locked(dit_http *h, vjob *v, vstate state, grpc_status_code code, const char *msg)
{
    v->state = state;
    v->code = code;
    dit_openai_copy_text(v->msg, sizeof v->msg, msg && *msg ? msg : "failed");
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    v->completed_at = (int64_t)wall.tv_sec;
    /* Whole seconds, rounded up: a retention under one second keeps it one. */
    v->expires_at = v->completed_at + (int64_t)ceil(h->cfg.video_retention_s);
    const int64_t left_ms = (v->expires_at - v->completed_at) * 1000 - wall.tv_nsec / 1000000;
    v->expires_ms = mono_ms() + (uint64_t)(left_ms > 0 ? left_ms : 0);
    if (state == V_COMPLETED) {
        v->progress = 100;
        return;
    }
    free(v->data); /* a failed job keeps no bytes */
    v->data = NULL;
    v->len = v->cap = 0;
    h->vbytes -= (int64_t)v->counted;
    v->counted = 0;
}

/* Loop thread: what a video's job reports. */
static void on_video_event(void *ctx, const Ditserve__V1__GenerateEvent *ev)
{
    vjob *v = ctx;
    dit_http *h = v->h;
    uv_mutex_lock(&h->vmu);
    switch (ev->event_case) {
    case DITSERVE__V1__GENERATE_EVENT__EVENT_STARTED:
        v->state = V_RUNNING;
        break;
    case DITSERVE__V1__GENERATE_EVENT__EVENT_PROGRESS: {
        /* Denoising steps make 0-99; 100 is for the finished MP4. */
        const int total = ev->progress->total_steps;
        if (total > 0) {
            const int p = (int)((int64_t)ev->progress->step * 100 / total);
            v->progress = p < 0 ? 0 : p > 99 ? 99 : p;
        }
        v->state = V_RUNNING;
        break;
    }
    case DITSERVE__V1__GENERATE_EVENT__EVENT_CHUNK: {
        const size_t n = ev->chunk->data.len;
        if (v->too_big)
            break;
        /* Bytes in flight count against what is left of the store, as the
         * finished ones do: the store's bound holds for the memory used. */
        if (h->vbytes + (int64_t)n > h->cfg.video_bytes)
            vexpire_locked(h, mono_ms());
        if (h->vbytes + (int64_t)n > h->cfg.video_bytes) {
            /* The finish refuses it; what arrived so far goes now. */
            v->too_big = (int64_t)(v->len + n) > h->cfg.video_bytes
                             ? "the video is larger than the store holds (--http-video-bytes)"
                             : "the videos held (finished or arriving) fill the store "
                               "(--http-video-bytes); delete some or wait for them to expire";
            free(v->data);
            v->data = NULL;
            v->len = v->cap = 0;
            h->vbytes -= (int64_t)v->counted;
            v->counted = 0;
            break;
        }
        if (v->len + n > v->cap) {
            size_t cap = v->cap ? v->cap : 65536;
            while (cap < v->len + n)
                cap *= 2;
            uint8_t *p = realloc(v->data, cap);
            if (!p)
                break; /* the result check below notices the short video */
            v->data = p;
            v->cap = cap;
        }
        memcpy(v->data + v->len, ev->chunk->data.data, n);
        v->len += n;
        v->counted += n;
        h->vbytes += (int64_t)n;
        break;
    }
    case DITSERVE__V1__GENERATE_EVENT__EVENT_RESULT: {
        const Ditserve__V1__Result *r = ev->result;
        v->seed = r->seed;
        v->width = r->width;
        v->height = r->height;
        if (r->num_frames > 0)
            v->num_frames = r->num_frames;
        if (r->fps > 0)
            v->fps = r->fps;
        if (r->timings)
            v->timings = *r->timings;
        v->whole = !v->too_big && (int64_t)v->len == r->total_bytes;
        break;
    }
    default:
        break;
    }
    uv_mutex_unlock(&h->vmu);
}

static void on_video_finish(void *ctx, grpc_status_code code, const char *msg)
{
    vjob *v = ctx;
    dit_http *h = v->h;
    v->job = NULL;
    uv_mutex_lock(&h->vmu);
    if (code == GRPC_STATUS_OK && v->too_big) {
        code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        v->ecode = "video_store_full";
        msg = v->too_big;
    } else if (code == GRPC_STATUS_OK && !v->whole) {
        code = GRPC_STATUS_INTERNAL;
        msg = "the video did not arrive whole";
    }
    if (code == GRPC_STATUS_OK) {
        vexpire_locked(h, mono_ms());
        /* Its bytes are counted already (as they arrived). The buffer
         * shrinks to them: the store counts len, and doubling left up to
         * twice that allocated (the old one stays if realloc fails). */
        if (v->cap > v->len && v->len > 0) {
            uint8_t *p = realloc(v->data, v->len);
            if (p) {
                v->data = p;
                v->cap = v->len;
            }
        }
        vend_locked(h, v, V_COMPLETED, code, "");
    } else {
        vend_locked(h, v, V_FAILED, code, msg);
    }
    vdrop_locked(h, v); /* the loop's */
    uv_mutex_unlock(&h->vmu);
    uv_cond_broadcast(&h->vcv);
}

/* Loop thread: admission, all or nothing. */
static void video_submit(dit_http *h, vjob *v)
{
    dit_job_client client = {on_video_event, on_video_finish, v};
    dit_server_job *job = NULL;
    grpc_status_code code = GRPC_STATUS_OK;
    char msg[DIT_DIAG_MAX];
    /* The job can end inside dit_server_submit (see submit): the creator's
     * reference keeps v until `decided`, and v->job is set only for a job
     * that lives on. The request leaves v first (an admitted job owns it). */
    Ditserve__V1__GenerateRequest *req = v->req;
    v->req = NULL;
    const bool ok =
        dit_server_submit(h->srv, &req, 1, &client, &job, &code, msg, sizeof msg) == DIT_OK;
    uv_mutex_lock(&h->vmu);
    v->decided = true;
    if (ok) {
        if (v->state != V_COMPLETED && v->state != V_FAILED)
            v->job = job;
        else
            v->ended_in_submit = true;
    } else {
        v->req = req; /* still ours */
        v->refused = true;
        v->code = code;
        dit_openai_copy_text(v->msg, sizeof v->msg, msg);
        vdrop_locked(h, v); /* the loop's: no job will report */
    }
    uv_mutex_unlock(&h->vmu);
    uv_cond_broadcast(&h->vcv);
}

/* Loop thread: a deleted job stops (queued: leaves the queue; running: at
 * its next step). Drops the op's reference. */
static void video_cancel(dit_http *h, vjob *v)
{
    if (v->job) {
        dit_server_job *j = v->job;
        v->job = NULL;
        dit_server_cancel(h->srv, j, "its /v1/videos job was deleted");
        vunref(h, v); /* the loop's: its client hears nothing more */
    }
    vunref(h, v);
}

static void on_async(uv_async_t *a)
{
    dit_http *h = a->data;
    uv_mutex_lock(&h->mu);
    op *list = h->ops_head;
    h->ops_head = h->ops_tail = NULL;
    uv_mutex_unlock(&h->mu);
    while (list) {
        op *o = list;
        list = o->next;
        switch (o->kind) {
        case OP_SUBMIT:
            submit(h, o->g);
            break;
        case OP_CANCEL:
            cancel_gen(o->g, "the HTTP client disconnected");
            gen_unref(o->g);
            break;
        case OP_VSUBMIT:
            video_submit(h, o->v);
            break;
        case OP_VCANCEL:
            video_cancel(h, o->v);
            break;
        }
        free(o);
    }
}

/* Hands an op to the loop. False once the front end is closed. A video
 * op's reference is the caller's to take (and to drop on false). */
static bool push_op(dit_http *h, op_kind kind, gen *g, vjob *v)
{
    op *o = calloc(1, sizeof *o);
    if (!o)
        return false;
    o->kind = kind;
    o->g = g;
    o->v = v;
    if (kind == OP_CANCEL) { /* the op's own reference: the job may end first */
        uv_mutex_lock(&g->mu);
        g->refs++;
        uv_mutex_unlock(&g->mu);
    }
    uv_mutex_lock(&h->mu);
    const bool open = !h->closed;
    if (open) {
        if (h->ops_tail)
            h->ops_tail->next = o;
        else
            h->ops_head = o;
        h->ops_tail = o;
        uv_async_send(&h->async);
    }
    uv_mutex_unlock(&h->mu);
    if (!open) {
        if (kind == OP_CANCEL)
            gen_unref(g);
        free(o);
    }
    return open;
}

/* ------------------------------------------------------------------------ */
/* Connection threads: parsing and checking                                  */

typedef struct req_ctx {
    bool is_gen;   /* POST /v1/images/generations */
    bool is_video; /* POST /v1/videos */
    bool form;     /* its body is a form (multipart/form-data or urlencoded) */
    bool answered;
    char *body;
    size_t len, cap;
    bool too_big;
    uint64_t t0_ms;
    gen *g;
} req_ctx;

/* What the served model fills in for fields a request leaves out. */
static dit_openai_defaults defaults_of(const dit_http *h)
{
    return (dit_openai_defaults){.model_name = h->cfg.model_name,
                                 .width = h->cfg.default_width,
                                 .height = h->cfg.default_height,
                                 .num_frames = h->cfg.default_num_frames,
                                 .fps = h->cfg.default_fps,
                                 .frame_step = h->cfg.frame_step};
}

/* What a request without a seed gets. */
static uint64_t random_seed(void)
{
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r)
        r = mono_ms() * 0x9e3779b97f4a7c15ull;
    return r;
}

/* ------------------------------------------------------------------------ */
/* Connection threads: answering                                             */

/* The request's Origin when CORS allows it, else NULL. */
static const char *allowed_origin(dit_http *h, struct MHD_Connection *conn)
{
    const char *origin = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Origin");
    if (!origin || !h->cors)
        return NULL;
    if (strcmp(h->cors, "*") == 0)
        return "*";
    const size_t n = strlen(origin);
    for (const char *p = h->cors; *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        /* "a, b": the blanks around an entry are not part of it. */
        while (len && (*p == ' ' || *p == '\t')) {
            p++;
            len--;
        }
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t'))
            len--;
        if (len == n && memcmp(p, origin, n) == 0)
            return origin;
        if (!end)
            break;
        p = end + 1;
    }
    return NULL;
}

static enum MHD_Result queue(dit_http *h, struct MHD_Connection *conn, unsigned status,
                             struct MHD_Response *resp, const char *type)
{
    if (!resp)
        return MHD_NO;
    if (type)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    const char *origin = allowed_origin(h, conn);
    if (origin) {
        MHD_add_response_header(resp, "Access-Control-Allow-Origin", origin);
        /* A script on that origin reads only CORS-safelisted headers and
         * those named here: the poll hint of /v1/videos/{id}. */
        MHD_add_response_header(resp, "Access-Control-Expose-Headers", "openai-poll-after-ms");
    }
    /* With a list of origins the answer depends on the request's Origin
     * whether or not it matched: without Vary a browser's cache may hand
     * the copy it got with no Origin (a <video src>) to a fetch from an
     * allowed origin, which then fails its CORS check. */
    if (h->cors && (origin || strcmp(h->cors, "*") != 0))
        MHD_add_response_header(resp, "Vary", "Origin");
    MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff");
    enum MHD_Result r = MHD_queue_response(conn, status, resp);
    MHD_destroy_response(resp);
    return r;
}

static enum MHD_Result send_json(dit_http *h, struct MHD_Connection *conn, unsigned status,
                                 cJSON *obj)
{
    char *text = obj ? cJSON_PrintUnformatted(obj) : NULL;
    cJSON_Delete(obj);
    if (!text)
        return MHD_NO;
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!resp)
        free(text);
    return queue(h, conn, status, resp, "application/json");
}

static enum MHD_Result send_error(dit_http *h, struct MHD_Connection *conn,
                                  const dit_openai_error *b)
{
    DIT_LOG(h->cfg.log, DIT_LOG_DEBUG, "http", "refused with %u (%s)", b->status, b->code);
    cJSON *o = error_json(b->status, b->param, b->code, b->msg);
    if (b->status == MHD_HTTP_UNAUTHORIZED) {
        char *text = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        if (!text)
            return MHD_NO;
        struct MHD_Response *resp =
            MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
        if (!resp) {
            free(text);
            return MHD_NO;
        }
        MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
        return queue(h, conn, b->status, resp, "application/json");
    }
    return send_json(h, conn, b->status, o);
}

static enum MHD_Result send_simple_error(dit_http *h, struct MHD_Connection *conn, unsigned status,
                                         const char *code, const char *msg)
{
    dit_openai_error b;
    dit_openai_fail(&b, status, NULL, code, "%s", msg);
    return send_error(h, conn, &b);
}

/* Constant-time comparison of the bearer token. */
static bool authorized(dit_http *h, struct MHD_Connection *conn)
{
    if (!h->token)
        return true;
    const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (!v || strncasecmp(v, "Bearer ", 7) != 0)
        return false;
    v += 7;
    const size_t a = strlen(v), b = strlen(h->token);
    /* As long whatever was sent: the time tells nothing of the token's
     * length either. */
    unsigned char diff = a != b;
    for (size_t i = 0; i < b; i++)
        diff |= (unsigned char)((i < a ? v[i] : 0) ^ h->token[i]);
    return diff == 0;
}

/* The client has closed its end (or the socket failed). */
static bool client_gone(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return false;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

/* One short wait for news (mu held); false when the client left or the
 * daemon stops. The connection's completion then cancels the job. */
static bool wait_news(gen *g, struct MHD_Connection *conn)
{
    uv_cond_timedwait(&g->cv, &g->mu, (uint64_t)HTTP_POLL_MS * 1000000);
    if (atomic_load(&g->h->stopping))
        return false;
    if (client_gone(conn)) {
        g->gone = true;
        return false;
    }
    return true;
}

/* Waits (mu held) until `until` phase or later; false when the client
 * left or the daemon stops. */
static bool wait_phase(gen *g, struct MHD_Connection *conn, gen_phase until)
{
    while (g->phase < until)
        if (!wait_news(g, conn))
            return g->phase >= until;
    return true;
}

static enum MHD_Result send_result(dit_http *h, struct MHD_Connection *conn, gen *g)
{
    /* mu held; the job finished without failure, its n images whole. */
    cJSON *o = cJSON_CreateObject();
    add_u64(o, "created", (uint64_t)g->created);
    cJSON *data = cJSON_AddArrayToObject(o, "data");
    char size[40];
    snprintf(size, sizeof size, "%dx%d", g->width, g->height);
    for (int k = 0; k < g->n; k++) {
        char *b64 = base64(g->data + g->img_off[k], g->got[k]);
        if (!b64) {
            cJSON_Delete(o);
            return send_simple_error(h, conn, 500, "internal_error", "out of memory");
        }
        cJSON *item = cJSON_CreateObject();
        cJSON_AddStringToObject(item, "b64_json", b64);
        free(b64);
        add_u64(item, "seed", g->seed);
        cJSON_AddItemToObject(item, "timings", timings_json(&g->timings));
        cJSON_AddItemToArray(data, item);
    }
    add_u64(o, "seed", g->seed);
    cJSON_AddStringToObject(o, "size", size);
    cJSON_AddStringToObject(o, "output_format", "png");
    cJSON_AddItemToObject(o, "timings", timings_json(&g->timings));
    /* The PNGs live on as the response's base64 until it is sent. */
    gen_hold(g, (int64_t)(g->len / 3 + 1) * 4 - (int64_t)g->cap);
    free(g->data);
    g->data = NULL;
    g->len = g->cap = 0;
    return send_json(h, conn, MHD_HTTP_OK, o);
}

static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    gen *g = cls;
    uv_mutex_lock(&g->mu);
    uint64_t quiet_since = mono_ms();
    ssize_t out = 0;
    for (;;) {
        if (g->sse_off < g->sse_len) {
            const size_t n = g->sse_len - g->sse_off < max ? g->sse_len - g->sse_off : max;
            memcpy(buf, g->sse + g->sse_off, n);
            g->sse_off += n;
            out = (ssize_t)n;
            break;
        }
        if (g->phase == GEN_DONE) {
            out = MHD_CONTENT_READER_END_OF_STREAM;
            break;
        }
        if (mono_ms() - quiet_since >= g->h->keepalive_ms) {
            static const char ka[] = ": keep-alive\n\n";
            const size_t n = sizeof ka - 1 < max ? sizeof ka - 1 : max;
            memcpy(buf, ka, n);
            out = (ssize_t)n;
            break;
        }
        if (!wait_news(g, g->conn) && g->sse_off == g->sse_len && g->phase != GEN_DONE) {
            out = MHD_CONTENT_READER_END_WITH_ERROR;
            break;
        }
    }
    uv_mutex_unlock(&g->mu);
    return out;
}

static enum MHD_Result answer_generation(dit_http *h, struct MHD_Connection *conn, req_ctx *rc)
{
    dit_openai_error b;
    gen *g = calloc(1, sizeof *g);
    if (!g)
        return send_simple_error(h, conn, 500, "internal_error", "out of memory");
    uv_mutex_init(&g->mu);
    uv_cond_init(&g->cv);
    g->h = h;
    g->refs = 1;
    g->created = (int64_t)time(NULL);
    rc->g = g;
    g->conn = conn;
    const dit_openai_defaults d = defaults_of(h);
    dit_openai_images im;
    if (!dit_openai_parse_images(&d, rc->body, rc->len, random_seed(), &im, &b))
        return send_error(h, conn, &b);
    g->req = im.req;
    g->n = im.n;
    g->stream = im.stream;
    g->refs = 2; /* the loop's, until its job ends */
    if (!push_op(h, OP_SUBMIT, g, NULL)) {
        g->refs = 1;
        return send_simple_error(h, conn, 503, "unavailable",
                                 "the server is shutting down; send the request to another "
                                 "replica");
    }
    uv_mutex_lock(&g->mu);
    if (!wait_phase(g, conn, g->stream ? GEN_ACCEPTED : GEN_DONE)) {
        uv_mutex_unlock(&g->mu);
        return MHD_NO; /* nobody to answer */
    }
    enum MHD_Result r;
    /* A failure before the answer starts is a plain error, also for a stream:
     * a job that fails inside dit_server_submit has queued its events (and
     * the error) before any of them could reach the client. */
    if (g->failed && (!g->stream || !g->have_result)) {
        const unsigned st = http_status_of(g->code);
        dit_openai_fail(&b, st, NULL, grpc_code_name(g->code), "%s", g->msg);
        uv_mutex_unlock(&g->mu);
        return send_error(h, conn, &b);
    }
    if (!g->stream) {
        r = send_result(h, conn, g);
        uv_mutex_unlock(&g->mu);
        return r;
    }
    uv_mutex_unlock(&g->mu);
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, HTTP_SSE_BLOCK, sse_reader, g, NULL);
    if (resp) {
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    }
    return queue(h, conn, MHD_HTTP_OK, resp, "text/event-stream");
}

static enum MHD_Result answer_static(dit_http *h, struct MHD_Connection *conn, const char *url)
{
    if (strcmp(url, "/health") == 0) {
        const bool serving = atomic_load(&h->serving);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", serving ? "SERVING" : "NOT_SERVING");
        cJSON *meshes = cJSON_AddArrayToObject(o, "meshes");
        uv_mutex_lock(&h->mu);
        for (int i = 0; meshes && i < h->n_meshes; i++) {
            cJSON *m = cJSON_CreateObject();
            cJSON_AddNumberToObject(m, "mesh", i);
            cJSON_AddStringToObject(m, "state", h->mesh_states[i]);
            cJSON_AddItemToArray(meshes, m);
        }
        uv_mutex_unlock(&h->mu);
        return send_json(h, conn, serving ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE, o);
    }
    if (strcmp(url, "/") == 0 || strcmp(url, "/index.html") == 0) {
        struct MHD_Response *resp = MHD_create_response_from_buffer(
            dit_playground_html_len, (void *)dit_playground_html, MHD_RESPMEM_PERSISTENT);
        if (resp) {
            MHD_add_response_header(
                resp, "Content-Security-Policy",
                "default-src 'self'; img-src 'self' data:; media-src 'self' blob:; "
                "style-src 'self' 'unsafe-inline'; "
                "script-src 'self' 'unsafe-inline'");
            MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        }
        return queue(h, conn, MHD_HTTP_OK, resp, "text/html; charset=utf-8");
    }
    if (strcmp(url, "/v1/models") == 0) {
        if (!authorized(h, conn))
            return send_simple_error(h, conn, 401, "invalid_api_key",
                                     "missing or wrong bearer token (Authorization: Bearer ...)");
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "object", "list");
        cJSON *data = cJSON_AddArrayToObject(o, "data");
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "id", h->cfg.model_name);
        cJSON_AddStringToObject(m, "object", "model");
        add_u64(m, "created", (uint64_t)h->started);
        cJSON_AddStringToObject(m, "owned_by", "ditserve");
        /* ditserve's: what the model makes, and what a request defaults to. */
        char size[40];
        snprintf(size, sizeof size, "%dx%d", h->cfg.default_width, h->cfg.default_height);
        cJSON_AddStringToObject(m, "task", h->cfg.task ? h->cfg.task : "text-to-image");
        cJSON_AddStringToObject(m, "default_size", size);
        if (h->cfg.video) {
            cJSON_AddNumberToObject(m, "default_num_frames", h->cfg.default_num_frames);
            cJSON_AddNumberToObject(m, "default_fps", h->cfg.default_fps);
            cJSON_AddNumberToObject(m, "frame_step", h->cfg.frame_step);
        }
        cJSON_AddItemToArray(data, m);
        return send_json(h, conn, MHD_HTTP_OK, o);
    }
    return send_simple_error(h, conn, 404, "not_found", "no such endpoint");
}

/* ------------------------------------------------------------------------ */
/* /v1/videos: connection threads                                            */

/* A form body's fields, each a string, as a JSON object (the shape
 * parse_video reads). multipart/form-data is what OpenAI's client sends
 * for videos.create. */
typedef struct form {
    cJSON *obj;
    cJSON *last; /* the field whose value is arriving */
    size_t last_len;
    dit_openai_error *b;
    bool failed;
    int n;
} form;

static enum MHD_Result form_field(void *cls, enum MHD_ValueKind kind, const char *key,
                                  const char *filename, const char *content_type,
                                  const char *transfer_encoding, const char *data, uint64_t off,
                                  size_t size)
{
    (void)kind;
    (void)content_type;
    (void)transfer_encoding;
    form *f = cls;
    if (f->failed)
        return MHD_NO;
    if (!key || !*key) {
        f->failed = !dit_openai_fail(f->b, 400, NULL, "invalid_form", "a form field has no name");
        return MHD_NO;
    }
    if (filename) {
        if (strcmp(key, "input_reference") == 0)
            dit_openai_fail(f->b, 400, "input_reference", "unsupported_parameter",
                            "input_reference is not served: the model makes video from text alone");
        else
            dit_openai_fail(f->b, 400, NULL, "unknown_parameter", "unknown file field '%s'",
                            dit_openai_echo_name(key));
        f->failed = true;
        return MHD_NO;
    }
    if (off == 0) {
        if (cJSON_GetObjectItemCaseSensitive(f->obj, key)) {
            f->failed = !dit_openai_fail(f->b, 400, NULL, "duplicate_parameter",
                                         "'%s' is given twice", dit_openai_echo_name(key));
            return MHD_NO;
        }
        if (++f->n > FORM_MAX_FIELDS) {
            f->failed = !dit_openai_fail(f->b, 400, NULL, "invalid_form",
                                         "more than %d form fields", FORM_MAX_FIELDS);
            return MHD_NO;
        }
        f->last = cJSON_AddStringToObject(f->obj, key, "");
        f->last_len = 0;
        if (!f->last) {
            f->failed = !dit_openai_fail(f->b, 500, NULL, "internal_error", "out of memory");
            return MHD_NO;
        }
    }
    if (!f->last || off != f->last_len || strcmp(f->last->string, key) != 0) {
        f->failed = !dit_openai_fail(f->b, 400, NULL, "invalid_form", "the form body is malformed");
        return MHD_NO;
    }
    if (size == 0)
        return MHD_YES;
    if (memchr(data, 0, size)) {
        f->failed =
            !dit_openai_fail(f->b, 400, NULL, "invalid_form", "a form value holds a NUL byte");
        return MHD_NO;
    }
    char *p = realloc(f->last->valuestring, f->last_len + size + 1);
    if (!p) {
        f->failed = !dit_openai_fail(f->b, 500, NULL, "internal_error", "out of memory");
        return MHD_NO;
    }
    memcpy(p + f->last_len, data, size);
    f->last_len += size;
    p[f->last_len] = '\0';
    f->last->valuestring = p;
    return MHD_YES;
}

/* The form body as a JSON object of strings; NULL with b filled. Values
 * must be UTF-8 without NUL bytes. */
static cJSON *parse_form(struct MHD_Connection *conn, const char *body, size_t len,
                         dit_openai_error *b)
{
    form f = {.obj = cJSON_CreateObject(), .b = b};
    if (!f.obj) {
        dit_openai_fail(b, 500, NULL, "internal_error", "out of memory");
        return NULL;
    }
    struct MHD_PostProcessor *pp = MHD_create_post_processor(conn, 4096, form_field, &f);
    if (!pp) {
        dit_openai_fail(b, 400, NULL, "invalid_form",
                        "the form body cannot be read (no boundary?)");
        cJSON_Delete(f.obj);
        return NULL;
    }
    const enum MHD_Result r = len ? MHD_post_process(pp, body, len) : MHD_YES;
    const enum MHD_Result end = MHD_destroy_post_processor(pp);
    if (!f.failed && (r != MHD_YES || end != MHD_YES))
        f.failed = !dit_openai_fail(b, 400, NULL, "invalid_form", "the form body is malformed");
    for (const cJSON *v = f.obj->child; v && !f.failed; v = v->next)
        if (!dit_utf8_valid(v->valuestring, strlen(v->valuestring)))
            f.failed = !dit_openai_fail(b, 400, NULL, "invalid_form", "a form value is not UTF-8");
    if (f.failed) {
        cJSON_Delete(f.obj);
        return NULL;
    }
    return f.obj;
}

/* OpenAI's Video object, with ditserve's num_frames, fps, seed and
 * timings (vmu held). */
static cJSON *video_json(const vjob *v)
{
    cJSON *o = cJSON_CreateObject();
    char buf[64];
    cJSON_AddStringToObject(o, "id", v->id);
    cJSON_AddStringToObject(o, "object", "video");
    add_u64(o, "created_at", (uint64_t)v->created_at);
    cJSON_AddStringToObject(o, "status", vstate_name(v->state));
    cJSON_AddStringToObject(o, "model", v->model);
    cJSON_AddNumberToObject(o, "progress", v->progress);
    cJSON_AddStringToObject(o, "prompt", v->prompt);
    snprintf(buf, sizeof buf, "%g", v->fps > 0 ? (double)v->num_frames / v->fps : 0.0);
    cJSON_AddStringToObject(o, "seconds", buf);
    snprintf(buf, sizeof buf, "%dx%d", v->width, v->height);
    cJSON_AddStringToObject(o, "size", buf);
    if (v->state == V_FAILED) {
        cJSON *e = cJSON_AddObjectToObject(o, "error");
        cJSON_AddStringToObject(e, "code", v->ecode ? v->ecode : grpc_code_name(v->code));
        cJSON_AddStringToObject(e, "message", v->msg);
    } else {
        cJSON_AddNullToObject(o, "error");
    }
    if (v->completed_at)
        add_u64(o, "completed_at", (uint64_t)v->completed_at);
    else
        cJSON_AddNullToObject(o, "completed_at");
    if (v->expires_at)
        add_u64(o, "expires_at", (uint64_t)v->expires_at);
    else
        cJSON_AddNullToObject(o, "expires_at");
    cJSON_AddNullToObject(o, "remixed_from_video_id");
    cJSON_AddNumberToObject(o, "num_frames", v->num_frames);
    cJSON_AddNumberToObject(o, "fps", v->fps);
    add_u64(o, "seed", v->seed);
    if (v->state == V_COMPLETED)
        cJSON_AddItemToObject(o, "timings", timings_json(&v->timings));
    return o;
}

/* The stored job with this id (vmu held), or NULL. Ids are compared in
 * time independent of where they differ. */
static vjob *vfind_locked(dit_http *h, const char *id, size_t n)
{
    if (n != VIDEO_ID_LEN)
        return NULL;
    for (vjob *v = h->vhead; v; v = v->next) {
        unsigned char diff = 0;
        for (size_t i = 0; i < VIDEO_ID_LEN; i++)
            diff |= (unsigned char)(v->id[i] ^ id[i]);
        if (!diff)
            return v;
    }
    return NULL;
}

static enum MHD_Result send_video(dit_http *h, struct MHD_Connection *conn, unsigned status,
                                  cJSON *o, bool poll_hint)
{
    char *text = o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    if (!text)
        return MHD_NO;
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(text), text, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(text);
        return MHD_NO;
    }
    if (poll_hint) /* read by OpenAI's client's poll() */
        MHD_add_response_header(resp, "openai-poll-after-ms", VIDEO_POLL_AFTER_MS);
    return queue(h, conn, status, resp, "application/json");
}

static enum MHD_Result answer_video_create(dit_http *h, struct MHD_Connection *conn, req_ctx *rc)
{
    dit_openai_error b = {0};
    if (!h->cfg.video)
        return send_simple_error(
            h, conn, 400, "model_makes_images",
            "the served model makes images, not video: use /v1/images/generations");
    vjob *v = calloc(1, sizeof *v);
    if (!v)
        return send_simple_error(h, conn, 500, "internal_error", "out of memory");
    v->h = h;
    v->refs = 2; /* this connection's until admission is decided, and the loop's */
    v->created_at = wall_s();
    const dit_openai_defaults d = defaults_of(h);
    dit_openai_video vd;
    bool parsed;
    if (rc->form) {
        cJSON *root = parse_form(conn, rc->body, rc->len, &b);
        parsed = root && dit_openai_parse_video(&d, root, true, random_seed(), &vd, &b);
        cJSON_Delete(root);
    } else {
        parsed = dit_openai_parse_video_json(&d, rc->body, rc->len, random_seed(), &vd, &b);
    }
    if (parsed) { /* the job takes what was read */
        v->req = vd.req;
        v->model = vd.model;
        v->prompt = vd.prompt;
        v->width = vd.width;
        v->height = vd.height;
        v->num_frames = vd.num_frames;
        v->fps = vd.fps;
        v->seed = vd.seed;
    }
    uint8_t rnd[16];
    if (parsed && getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd)
        dit_openai_fail(&b, 500, NULL, "internal_error", "no random bytes for the video's id");
    if (!parsed || b.status) {
        v->refs = 1;
        vunref(h, v);
        return send_error(h, conn, &b);
    }
    memcpy(v->id, "video_", 6);
    for (int i = 0; i < 16; i++)
        snprintf(v->id + 6 + 2 * i, 3, "%02x", rnd[i]);
    uv_mutex_lock(&h->vmu);
    vexpire_locked(h, mono_ms());
    if (h->vcount + h->vreserved >= h->cfg.video_jobs)
        dit_openai_fail(
            &b, 429, NULL, "video_store_full",
            "%d video jobs are held (--http-video-jobs); delete finished ones or wait for "
            "them to expire",
            h->vcount + h->vreserved);
    else if (h->vbytes >= h->cfg.video_bytes)
        dit_openai_fail(&b, 429, NULL, "video_store_full",
                        "the videos held (finished or arriving) fill the store "
                        "(--http-video-bytes); delete some or wait for them to expire");
    else
        h->vreserved++;
    uv_mutex_unlock(&h->vmu);
    if (b.status) {
        v->refs = 1;
        vunref(h, v);
        return send_error(h, conn, &b);
    }
    if (!push_op(h, OP_VSUBMIT, NULL, v)) {
        uv_mutex_lock(&h->vmu);
        h->vreserved--;
        v->refs = 1;
        vdrop_locked(h, v);
        uv_mutex_unlock(&h->vmu);
        return send_simple_error(h, conn, 503, "unavailable",
                                 "the server is shutting down; send the request to another "
                                 "replica");
    }
    uv_mutex_lock(&h->vmu);
    while (!v->decided && !atomic_load(&h->stopping))
        uv_cond_timedwait(&h->vcv, &h->vmu, (uint64_t)HTTP_POLL_MS * 1000000);
    h->vreserved--;
    enum MHD_Result r;
    if (!v->decided) { /* stopping: nobody to answer */
        vdrop_locked(h, v);
        uv_mutex_unlock(&h->vmu);
        return MHD_NO;
    }
    /* Refused, or admitted and failed inside dit_server_submit (a mesh
     * that fails as the job is sent to it reports at once): an error
     * answer, as for images, and nothing stored. */
    if (v->refused || (v->ended_in_submit && v->state == V_FAILED)) {
        dit_openai_fail(&b, http_status_of(v->code), NULL,
                        v->ecode ? v->ecode : grpc_code_name(v->code), "%s", v->msg);
        vdrop_locked(h, v);
        uv_mutex_unlock(&h->vmu);
        return send_error(h, conn, &b);
    }
    /* This connection's reference becomes the store's. */
    v->in_store = true;
    v->seq = ++h->vseq;
    if (h->vtail)
        h->vtail->next = v;
    else
        h->vhead = v;
    h->vtail = v;
    h->vcount++;
    cJSON *o = video_json(v);
    /* Logged before the store's reference may go (a DELETE, an expiry). */
    DIT_LOG(h->cfg.log, DIT_LOG_DEBUG, "http", "video job %.14s... created", v->id);
    uv_mutex_unlock(&h->vmu);
    r = send_video(h, conn, MHD_HTTP_OK, o, true);
    return r;
}

/* A query argument (NULL: absent). */
static const char *query_arg(struct MHD_Connection *conn, const char *name)
{
    return MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, name);
}

/* A page of GET /v1/videos takes no more items once their JSON passes
 * this (it always takes one), and says has_more: an item echoes a prompt
 * of up to 64 KiB, which JSON's escapes make up to six times longer, so a
 * page of 100 could be about 40 MiB per request. */
#define VIDEO_LIST_PAGE_BYTES ((size_t)4 << 20)

/* Text that grows; failed once an allocation failed. */
typedef struct textbuf {
    char *p;
    size_t len, cap;
    bool failed;
} textbuf;

static void text_add(textbuf *t, const char *s, size_t n)
{
    if (t->failed)
        return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 4096;
        while (cap < t->len + n + 1)
            cap *= 2;
        char *p = realloc(t->p, cap);
        if (!p) {
            t->failed = true;
            return;
        }
        t->p = p;
        t->cap = cap;
    }
    memcpy(t->p + t->len, s, n);
    t->len += n;
    t->p[t->len] = '\0';
}

static enum MHD_Result answer_video_list(dit_http *h, struct MHD_Connection *conn)
{
    const char *limit_s = query_arg(conn, "limit"), *order = query_arg(conn, "order"),
               *after = query_arg(conn, "after");
    long limit = 20;
    if (limit_s) {
        char *end;
        limit = strtol(limit_s, &end, 10);
        if (!*limit_s || *end || limit < 1 || limit > 100)
            return send_simple_error(h, conn, 400, "invalid_value",
                                     "'limit' must be an integer from 1 to 100");
    }
    if (order && strcmp(order, "asc") != 0 && strcmp(order, "desc") != 0)
        return send_simple_error(h, conn, 400, "invalid_value",
                                 "'order' must be \"asc\" or \"desc\"");
    const bool desc = !order || strcmp(order, "desc") == 0;
    uv_mutex_lock(&h->vmu);
    vexpire_locked(h, mono_ms());
    const int n = h->vcount;
    vjob **all = n ? malloc((size_t)n * sizeof *all) : NULL;
    if (n && !all) {
        uv_mutex_unlock(&h->vmu);
        return send_simple_error(h, conn, 500, "internal_error", "out of memory");
    }
    int k = 0;
    for (vjob *v = h->vhead; v && k < n; v = v->next)
        all[k++] = v;
    /* `after` is a place in the store's order: that of a job held, or of
     * one deleted or expired lately (the list goes on past it). */
    int start = 0;
    if (after) {
        uint64_t seq = 0;
        for (int i = 0; i < k && !seq; i++)
            if (strcmp(all[i]->id, after) == 0)
                seq = all[i]->seq;
        for (int i = 0; i < VIDEO_GONE_MAX && !seq; i++)
            if (h->vgone[i].seq && strcmp(h->vgone[i].id, after) == 0)
                seq = h->vgone[i].seq;
        if (!seq) {
            uv_mutex_unlock(&h->vmu);
            free(all);
            return send_simple_error(h, conn, 404, "video_not_found",
                                     "'after' names no video held here");
        }
        /* The list is in seq order: skip those at or before the place. */
        for (int i = 0; i < k; i++)
            if (desc ? all[i]->seq >= seq : all[i]->seq <= seq)
                start++;
    }
    /* The page is written as text item by item, so that its size is
     * known as it grows (the ids are ASCII, fit to quote as they are). */
    textbuf t = {0};
    static const char head[] = "{\"object\":\"list\",\"data\":[";
    text_add(&t, head, sizeof head - 1);
    char first[VIDEO_ID_LEN + 3] = "null", last[VIDEO_ID_LEN + 3] = "null";
    size_t items = 0; /* bytes of the items' JSON */
    int i = start;
    for (; i < k && i - start < limit && items <= VIDEO_LIST_PAGE_BYTES; i++) {
        const vjob *v = all[desc ? k - 1 - i : i];
        cJSON *item = video_json(v);
        char *text = item ? cJSON_PrintUnformatted(item) : NULL;
        cJSON_Delete(item);
        if (!text) {
            t.failed = true;
            break;
        }
        const size_t len = strlen(text);
        if (i > start)
            text_add(&t, ",", 1);
        text_add(&t, text, len);
        free(text);
        items += len;
        if (i == start)
            snprintf(first, sizeof first, "\"%s\"", v->id);
        snprintf(last, sizeof last, "\"%s\"", v->id);
    }
    char tail[2 * sizeof first + 64];
    snprintf(tail, sizeof tail, "],\"first_id\":%s,\"last_id\":%s,\"has_more\":%s}", first, last,
             i < k ? "true" : "false");
    text_add(&t, tail, strlen(tail));
    uv_mutex_unlock(&h->vmu);
    free(all);
    if (t.failed) {
        free(t.p);
        return send_simple_error(h, conn, 500, "internal_error", "out of memory");
    }
    struct MHD_Response *resp = MHD_create_response_from_buffer(t.len, t.p, MHD_RESPMEM_MUST_FREE);
    if (!resp)
        free(t.p);
    return queue(h, conn, MHD_HTTP_OK, resp, "application/json");
}

/* GET and DELETE under /v1/videos (POST, which has a body, is
 * answer_video_create). */
static enum MHD_Result answer_videos(dit_http *h, struct MHD_Connection *conn, const char *url,
                                     const char *method)
{
    const bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
    const bool del = strcmp(method, "DELETE") == 0;
    if (!authorized(h, conn))
        return send_simple_error(h, conn, 401, "invalid_api_key",
                                 "missing or wrong bearer token (Authorization: Bearer ...)");
    const char *rest = url + strlen("/v1/videos");
    if (!*rest) {
        if (!get)
            return send_simple_error(h, conn, 405, "method_not_allowed",
                                     "/v1/videos takes GET (the list) or POST (a new video)");
        return answer_video_list(h, conn);
    }
    const char *id = rest + 1; /* after the '/' */
    const char *slash = strchr(id, '/');
    const size_t id_len = slash ? (size_t)(slash - id) : strlen(id);
    const char *tail = slash ? slash : "";
    const bool content = strcmp(tail, "/content") == 0;
    if (*tail && !content)
        return send_simple_error(h, conn, 404, "not_found", "no such endpoint");
    if (!(get || (del && !content)))
        return send_simple_error(h, conn, 405, "method_not_allowed",
                                 content ? "/v1/videos/{id}/content takes GET"
                                         : "/v1/videos/{id} takes GET or DELETE");
    if (content) {
        const char *variant = query_arg(conn, "variant");
        if (variant && strcmp(variant, "video") != 0) {
            if (strcmp(variant, "thumbnail") == 0 || strcmp(variant, "spritesheet") == 0)
                return send_simple_error(h, conn, 404, "variant_not_available",
                                         "only variant \"video\" (the MP4) is served");
            return send_simple_error(h, conn, 400, "invalid_value",
                                     "'variant' must be \"video\", \"thumbnail\" or "
                                     "\"spritesheet\"");
        }
    }
    uv_mutex_lock(&h->vmu);
    vexpire_locked(h, mono_ms());
    vjob *v = vfind_locked(h, id, id_len);
    if (!v) {
        uv_mutex_unlock(&h->vmu);
        return send_simple_error(h, conn, 404, "video_not_found",
                                 "no video with this id (finished videos expire)");
    }
    if (del) {
        /* Forgotten now; a job still queued or running is cancelled on the
         * loop, which holds a reference for the op. */
        for (vjob **pp = &h->vhead; *pp; pp = &(*pp)->next)
            if (*pp == v) {
                *pp = v->next;
                break;
            }
        h->vtail = NULL;
        for (vjob *p = h->vhead; p; p = p->next)
            h->vtail = p;
        vleave_locked(h, v);
        const bool live = v->state == V_QUEUED || v->state == V_RUNNING;
        if (live)
            v->refs++; /* the cancel op's */
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "id", v->id);
        cJSON_AddStringToObject(o, "object", "video.deleted");
        cJSON_AddBoolToObject(o, "deleted", true);
        vdrop_locked(h, v); /* the store's */
        uv_mutex_unlock(&h->vmu);
        if (live && !push_op(h, OP_VCANCEL, NULL, v))
            vunref(h, v); /* closed: the drain ends the job */
        return send_json(h, conn, MHD_HTTP_OK, o);
    }
    if (!content) {
        const bool busy = v->state == V_QUEUED || v->state == V_RUNNING;
        cJSON *o = video_json(v);
        uv_mutex_unlock(&h->vmu);
        return send_video(h, conn, MHD_HTTP_OK, o, busy);
    }
    if (v->state != V_COMPLETED) {
        dit_openai_error b;
        if (v->state == V_FAILED)
            dit_openai_fail(&b, 409, NULL, "video_failed", "the video failed: %s", v->msg);
        else
            dit_openai_fail(&b, 409, NULL, "video_not_ready", "the video is %s (progress %d%%)",
                            vstate_name(v->state), v->progress);
        uv_mutex_unlock(&h->vmu);
        return send_error(h, conn, &b);
    }
    /* No copy: a completed clip does not change, and the response holds a
     * reference, so that a delete or expiry while it is written frees it
     * after (and the lock is not held for a copy of up to
     * --http-video-bytes per request). */
    v->refs++;
    struct MHD_Response *resp =
        MHD_create_response_from_buffer_with_free_callback_cls(v->len, v->data, video_sent, v);
    if (!resp)
        v->refs--;
    uv_mutex_unlock(&h->vmu);
    if (resp)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "private, max-age=3600");
    return queue(h, conn, MHD_HTTP_OK, resp, "video/mp4");
}

/* With --tls-client-ca: the connection presented a certificate that
 * verifies against those roots (gnutls checks chain, dates and usage). */
static bool client_verified(dit_http *h, struct MHD_Connection *conn)
{
    if (!h->ca_pem)
        return true;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_GNUTLS_SESSION);
    if (!ci || !ci->tls_session)
        return false;
    gnutls_session_t session = (gnutls_session_t)ci->tls_session;
    unsigned n_certs = 0;
    if (!gnutls_certificate_get_peers(session, &n_certs) || n_certs == 0)
        return false;
    unsigned status = 0;
    return gnutls_certificate_verify_peers2(session, &status) == GNUTLS_E_SUCCESS && status == 0;
}

static bool json_content_type(struct MHD_Connection *conn)
{
    const char *ct = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Type");
    if (!ct)
        return false;
    const size_t n = strlen("application/json");
    return strncasecmp(ct, "application/json", n) == 0 && (ct[n] == '\0' || ct[n] == ';');
}

static bool form_content_type(struct MHD_Connection *conn)
{
    const char *ct = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Type");
    return ct && (strncasecmp(ct, MHD_HTTP_POST_ENCODING_MULTIPART_FORMDATA,
                              strlen(MHD_HTTP_POST_ENCODING_MULTIPART_FORMDATA)) == 0 ||
                  strncasecmp(ct, MHD_HTTP_POST_ENCODING_FORM_URLENCODED,
                              strlen(MHD_HTTP_POST_ENCODING_FORM_URLENCODED)) == 0);
}

/* What a request says of its body's length. */
typedef struct framing {
    int content_lengths, transfer_encodings;
    bool chunked; /* the (only) Transfer-Encoding is "chunked" */
} framing;

static enum MHD_Result count_framing(void *cls, enum MHD_ValueKind kind, const char *key,
                                     const char *value)
{
    (void)kind;
    framing *f = cls;
    if (strcasecmp(key, "Content-Length") == 0)
        f->content_lengths++;
    else if (strcasecmp(key, "Transfer-Encoding") == 0) {
        f->transfer_encodings++;
        f->chunked = value && strcasecmp(value, "chunked") == 0;
    }
    return MHD_YES;
}

/* A body whose length two readers could read two ways (several
 * Content-Length headers, Transfer-Encoding beside Content-Length, an
 * encoding other than chunked) is refused: a proxy in front that reads it
 * the other way would take the rest for another request. */
static bool ambiguous_framing(struct MHD_Connection *conn)
{
    framing f = {0};
    MHD_get_connection_values(conn, MHD_HEADER_KIND, count_framing, &f);
    return f.content_lengths > 1 || f.transfer_encodings > 1 ||
           (f.transfer_encodings && (f.content_lengths || !f.chunked));
}

/* A POST or DELETE from a page of another origin that --http-cors-origins
 * does not list. A form posts across sites without a preflight (and
 * without a token the server cannot tell it from its user's); same-origin
 * pages (the playground) send an Origin of the Host they talk to. */
static bool cross_site_write(dit_http *h, struct MHD_Connection *conn, const char *method)
{
    if (strcmp(method, "POST") != 0 && strcmp(method, "DELETE") != 0)
        return false;
    const char *origin = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Origin");
    if (!origin || allowed_origin(h, conn))
        return false;
    const char *host = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Host");
    const char *auth = strstr(origin, "://");
    return !host || !auth || strcasecmp(auth + 3, host) != 0;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **con_cls)
{
    (void)version;
    dit_http *h = cls;
    req_ctx *rc = *con_cls;
    if (!rc) {
        rc = calloc(1, sizeof *rc);
        if (!rc)
            return MHD_NO;
        *con_cls = rc;
        rc->t0_ms = mono_ms();
        uv_mutex_lock(&h->mu);
        h->active++;
        uv_mutex_unlock(&h->mu);
        conn_slot *slot = slot_of(conn);
        if (slot) {
            uv_mutex_lock(&h->cmu);
            slot->busy = true;
            uv_mutex_unlock(&h->cmu);
        }
        if (!client_verified(h, conn)) {
            rc->answered = true;
            return send_simple_error(h, conn, 403, "client_certificate_required",
                                     "this server requires a client certificate signed by its "
                                     "--tls-client-ca");
        }
        if (strcmp(method, "OPTIONS") == 0) {
            /* CORS preflight: allowed origins get the methods and headers. */
            rc->answered = true;
            struct MHD_Response *resp = MHD_create_response_from_buffer(0, "", 0);
            if (resp && allowed_origin(h, conn)) {
                MHD_add_response_header(resp, "Access-Control-Allow-Methods",
                                        "GET, POST, DELETE, OPTIONS");
                MHD_add_response_header(resp, "Access-Control-Allow-Headers",
                                        "authorization, content-type");
                MHD_add_response_header(resp, "Access-Control-Max-Age", "600");
            }
            return queue(h, conn, MHD_HTTP_NO_CONTENT, resp, NULL);
        }
        if (ambiguous_framing(conn)) {
            rc->answered = true;
            return send_simple_error(h, conn, 400, "invalid_framing",
                                     "the body's length is given more than one way (several "
                                     "Content-Length headers, or Transfer-Encoding beside one, or "
                                     "an encoding other than chunked)");
        }
        if (cross_site_write(h, conn, method)) {
            rc->answered = true;
            return send_simple_error(h, conn, 403, "cross_origin_refused",
                                     "a page of another origin may not POST or DELETE here; the "
                                     "server lists the pages it allows in --http-cors-origins");
        }
        rc->is_gen = strcmp(url, "/v1/images/generations") == 0;
        rc->is_video = strcmp(url, "/v1/videos") == 0 && strcmp(method, "POST") == 0;
        if (!rc->is_gen && !rc->is_video) {
            rc->answered = true;
            if (strncmp(url, "/v1/videos", 10) == 0 && (url[10] == '\0' || url[10] == '/'))
                return answer_videos(h, conn, url, method);
            if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
                const bool known = strcmp(url, "/v1/models") == 0 || strcmp(url, "/health") == 0 ||
                                   strcmp(url, "/") == 0 || strcmp(url, "/index.html") == 0;
                return send_simple_error(h, conn, known ? 405 : 404,
                                         known ? "method_not_allowed" : "not_found",
                                         known ? "this endpoint takes GET" : "no such endpoint");
            }
            return answer_static(h, conn, url);
        }
        if (strcmp(method, "POST") != 0) {
            rc->answered = true;
            return send_simple_error(h, conn, 405, "method_not_allowed",
                                     "/v1/images/generations takes POST");
        }
        /* Answered before the body is read: the client need not send it. */
        dit_openai_error b = {0};
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
        if (!authorized(h, conn))
            dit_openai_fail(&b, 401, NULL, "invalid_api_key",
                            "missing or wrong bearer token (Authorization: Bearer ...)");
        else if (cl && strtoll(cl, NULL, 10) > h->cfg.max_body_bytes)
            dit_openai_fail(&b, 413, NULL, "body_too_large", "the body is larger than %lld bytes",
                            (long long)h->cfg.max_body_bytes);
        else if (rc->is_video && (rc->form = form_content_type(conn)))
            ; /* OpenAI's client sends videos.create as multipart/form-data */
        else if (!json_content_type(conn))
            dit_openai_fail(&b, 400, NULL, "invalid_content_type",
                            rc->is_video
                                ? "the body must be JSON (Content-Type: application/json) or a "
                                  "form (multipart/form-data)"
                                : "the body must be JSON (Content-Type: application/json)");
        if (b.status) {
            rc->answered = true;
            return send_error(h, conn, &b);
        }
        return MHD_YES;
    }
    if (rc->answered) {
        *upload_size = 0; /* the rest of a refused body is dropped */
        return MHD_YES;
    }
    const bool late = mono_ms() - rc->t0_ms > (uint64_t)(h->cfg.request_timeout_s * 1000);
    if (*upload_size) {
        const size_t n = *upload_size;
        *upload_size = 0;
        /* libmicrohttpd answers only once the body is in: a body too large
         * is read and dropped until then, within the request timeout. */
        if (late)
            return MHD_NO;
        if (rc->too_big || rc->len + n > (size_t)h->cfg.max_body_bytes) {
            rc->too_big = true;
            return MHD_YES;
        }
        /* One byte more for a NUL after the body: the JSON parser must not
         * find the buffer's end by reading past it. */
        if (rc->len + n + 1 > rc->cap) {
            size_t cap = rc->cap ? rc->cap : 4096;
            while (cap < rc->len + n + 1)
                cap *= 2;
            char *p = realloc(rc->body, cap);
            if (!p)
                return MHD_NO;
            rc->body = p;
            rc->cap = cap;
        }
        memcpy(rc->body + rc->len, upload, n);
        rc->len += n;
        rc->body[rc->len] = '\0';
        return MHD_YES;
    }
    if (rc->too_big) {
        rc->answered = true;
        dit_openai_error b;
        dit_openai_fail(&b, 413, NULL, "body_too_large", "the body is larger than %lld bytes",
                        (long long)h->cfg.max_body_bytes);
        return send_error(h, conn, &b);
    }
    if (late) {
        rc->answered = true;
        return send_simple_error(h, conn, 408, "request_timeout",
                                 "the body did not arrive in time");
    }
    rc->answered = true;
    return rc->is_video ? answer_video_create(h, conn, rc) : answer_generation(h, conn, rc);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode why)
{
    (void)why;
    dit_http *h = cls;
    req_ctx *rc = *con_cls;
    if (!rc)
        return;
    gen *g = rc->g;
    if (g) {
        uv_mutex_lock(&g->mu);
        const bool cancel = g->refs > 1 && g->phase != GEN_DONE;
        g->gone = true;
        uv_mutex_unlock(&g->mu);
        if (cancel)
            push_op(h, OP_CANCEL, g, NULL);
        gen_unref(g);
    }
    free(rc->body);
    free(rc);
    *con_cls = NULL;
    uv_mutex_lock(&h->mu);
    h->active--;
    uv_mutex_unlock(&h->mu);
    conn_slot *slot = slot_of(conn);
    if (slot) {
        uv_mutex_lock(&h->cmu);
        slot->busy = false;
        slot->since_ms = mono_ms();
        uv_mutex_unlock(&h->cmu);
    }
}

/* ------------------------------------------------------------------------ */
/* Connection limit                                                          */

/* --http-max-connections counts a connection until the server shuts it down,
 * not until libmicrohttpd reaps it. libmicrohttpd shuts a connection's
 * sending side the moment it closes it (the client reads its end), but only
 * counts it out later, once its polling thread has joined the connection's
 * thread, and that polling thread accepts a waiting client before it reaps.
 * With its limit alone, a client that connects as soon as it has read the end
 * of an idle connection would be refused, the closed one still counted.
 * libmicrohttpd's own limit is therefore twice ours, the room for connections
 * shut down and not reaped yet, and on_accept applies ours from the sockets'
 * TCP state. */

/* Whether the server has not shut this connection down yet. Once it has (or
 * the connection died), the socket leaves ESTABLISHED and CLOSE_WAIT; with
 * TLS that comes a moment after the close_notify, when the thread ends. */
static bool conn_open(int fd)
{
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0)
        return true; /* cannot tell: it counts */
    return ti.tcpi_state == TCP_ESTABLISHED || ti.tcpi_state == TCP_CLOSE_WAIT;
}

/* libmicrohttpd's polling thread, for each connection it accepts below its
 * own limit. The sockets are looked at only when the count is at the limit,
 * and only until enough of them are found shut down. At the limit, a
 * connection that has not sent a request's headers within
 * --http-request-timeout (trickling them in, a byte at a time, is never
 * idle) is shut down to make room: libmicrohttpd's timeout is for silence
 * alone. */
static enum MHD_Result on_accept(void *cls, const struct sockaddr *addr, socklen_t addrlen)
{
    (void)addr;
    (void)addrlen;
    dit_http *h = cls;
    const uint64_t limit_ms = (uint64_t)(h->cfg.request_timeout_s * 1000);
    uv_mutex_lock(&h->cmu);
    const uint64_t now = mono_ms();                    /* after the lock: no since_ms is later */
    int over = h->nconns - h->cfg.max_connections + 1; /* to find shut down */
    for (conn_slot *c = h->conns; c && over > 0; c = c->next)
        if (!conn_open(c->fd))
            over--;
    for (conn_slot *c = h->conns; c && over > 0; c = c->next)
        if (!c->busy && c->since_ms < now && now - c->since_ms > limit_ms && conn_open(c->fd)) {
            shutdown(c->fd, SHUT_RDWR); /* its thread sees the end and closes it */
            over--;
        }
    uv_mutex_unlock(&h->cmu);
    return over > 0 ? MHD_NO : MHD_YES;
}

/* A connection accepted (its slot in *socket_context) or reaped. One whose
 * slot could not be made is counted all the same, as open. */
static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_context,
                          enum MHD_ConnectionNotificationCode code)
{
    dit_http *h = cls;
    conn_slot *c = *socket_context;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (ci && (c = calloc(1, sizeof *c))) {
            c->fd = ci->connect_fd;
            c->since_ms = mono_ms();
        }
        uv_mutex_lock(&h->cmu);
        h->nconns++;
        if (c) {
            c->next = h->conns;
            if (h->conns)
                h->conns->prev = c;
            h->conns = c;
        }
        uv_mutex_unlock(&h->cmu);
        *socket_context = c;
        return;
    }
    uv_mutex_lock(&h->cmu);
    h->nconns--;
    if (c) {
        if (c->prev)
            c->prev->next = c->next;
        else
            h->conns = c->next;
        if (c->next)
            c->next->prev = c->prev;
    }
    uv_mutex_unlock(&h->cmu);
    free(c);
    *socket_context = NULL;
}

/* ------------------------------------------------------------------------ */
/* Life                                                                      */

static char *read_file(const char *path, dit_diag *diag)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        dit_diag_set(diag, DIT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0, n;
    char tmp[4096];
    while ((n = fread(tmp, 1, sizeof tmp, f)) > 0) {
        if (len + n + 1 > cap) {
            cap = (len + n + 1) * 2;
            char *p = realloc(buf, cap);
            if (!p || cap > (1u << 20)) {
                free(p ? p : buf);
                fclose(f);
                dit_diag_set(diag, DIT_ERR_IO, "%s is not a PEM file of a sensible size", path);
                return NULL;
            }
            buf = p;
        }
        memcpy(buf + len, tmp, n);
        len += n;
    }
    fclose(f);
    if (!buf) {
        dit_diag_set(diag, DIT_ERR_IO, "%s is empty", path);
        return NULL;
    }
    buf[len] = '\0';
    return buf;
}

/* HOST:PORT, [IPv6]:PORT or :PORT into an address. */
static dit_status resolve(const char *listen, struct sockaddr_storage *ss, socklen_t *sl, int *port,
                          dit_diag *diag)
{
    const char *colon = strrchr(listen, ':');
    char host[256];
    if (!colon || colon - listen >= (long)sizeof host)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "--http-listen wants HOST:PORT (or :PORT), not '%s'", listen);
    char *end;
    const long p = strtol(colon + 1, &end, 10);
    if (!colon[1] || *end || p < 0 || p > 65535)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "--http-listen '%s': bad port", listen);
    size_t hl = (size_t)(colon - listen);
    const char *hs = listen;
    if (hl >= 2 && hs[0] == '[' && hs[hl - 1] == ']') {
        hs++;
        hl -= 2;
    }
    memcpy(host, hs, hl);
    host[hl] = '\0';
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    char ps[8];
    snprintf(ps, sizeof ps, "%ld", p);
    if (getaddrinfo(hl ? host : NULL, ps, &hints, &res) != 0 || !res)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "--http-listen '%s': cannot resolve '%s'",
                            listen, host);
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *sl = res->ai_addrlen;
    freeaddrinfo(res);
    *port = (int)p;
    return DIT_OK;
}

static void free_http(dit_http *h)
{
    free(h->token);
    free(h->cors);
    free(h->cert_pem);
    free(h->key_pem);
    free(h->ca_pem);
    while (h->vhead) { /* every job has ended or was freed with the server's */
        vjob *v = h->vhead;
        h->vhead = v->next;
        v->refs = 1;
        vdrop_locked(h, v);
    }
    while (h->conns) { /* none: libmicrohttpd reaps every connection when it stops */
        conn_slot *c = h->conns;
        h->conns = c->next;
        free(c);
    }
    uv_cond_destroy(&h->vcv);
    uv_mutex_destroy(&h->vmu);
    uv_mutex_destroy(&h->cmu);
    uv_mutex_destroy(&h->mu);
    free(h);
}

static void free_after_close(uv_handle_t *handle)
{
    free_http(handle->data);
}

dit_status dit_http_create(uv_loop_t *loop, struct dit_server *srv, const dit_http_config *cfg,
                           dit_http **out, int *bound_port, dit_diag *diag)
{
    dit_status st = DIT_OK;
    struct sockaddr_storage ss;
    socklen_t sl = 0;
    int port = 0;
    dit_http *h = calloc(1, sizeof *h);
    if (!h)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    h->loop = loop;
    h->srv = srv;
    h->cfg = *cfg;
    h->started = (int64_t)time(NULL);
    uv_mutex_init(&h->mu);
    uv_mutex_init(&h->vmu);
    uv_mutex_init(&h->cmu);
    uv_cond_init(&h->vcv);
    atomic_init(&h->serving, false);
    atomic_init(&h->stopping, false);
    if ((st = resolve(cfg->listen, &ss, &sl, &port, diag)) != DIT_OK)
        goto fail;
    if ((cfg->auth_token && !(h->token = strdup(cfg->auth_token))) ||
        (cfg->cors_origins && *cfg->cors_origins && !(h->cors = strdup(cfg->cors_origins)))) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto fail;
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
                     MHD_USE_POLL | MHD_USE_ITC;
    if (ss.ss_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    if (cfg->tls_cert) {
        if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
            st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                              "this libmicrohttpd was built without TLS: --http-listen cannot "
                              "serve HTTPS");
            goto fail;
        }
        if (!(h->cert_pem = read_file(cfg->tls_cert, diag)) ||
            !(h->key_pem = read_file(cfg->tls_key, diag)) ||
            (cfg->tls_client_ca && !(h->ca_pem = read_file(cfg->tls_client_ca, diag)))) {
            st = DIT_ERR_IO;
            goto fail;
        }
        flags |= MHD_USE_TLS;
        h->tls = true;
    }
    if (uv_async_init(loop, &h->async, on_async) != 0) {
        st = dit_diag_set(diag, DIT_ERR_IO, "cannot create the HTTP loop handle");
        goto fail;
    }
    h->async.data = h;
    struct MHD_OptionItem tls_opts[] = {
        {h->tls ? MHD_OPTION_HTTPS_MEM_CERT : MHD_OPTION_END, 0, h->cert_pem},
        {MHD_OPTION_HTTPS_MEM_KEY, 0, h->key_pem},
        /* The trusted roots also make libmicrohttpd ask for a client
         * certificate; client_verified checks it. */
        {h->ca_pem ? MHD_OPTION_HTTPS_MEM_TRUST : MHD_OPTION_END, 0, h->ca_pem},
        {MHD_OPTION_END, 0, NULL},
    };
    /* Whole seconds, rounded up (0 would be no timeout at all); an event
     * stream speaks at least twice within it. */
    const unsigned idle_s =
        (unsigned)ceil(cfg->idle_timeout_s) > 0 ? (unsigned)ceil(cfg->idle_timeout_s) : 1;
    h->keepalive_ms =
        (uint64_t)idle_s * 500 < HTTP_KEEPALIVE_MS ? (uint64_t)idle_s * 500 : HTTP_KEEPALIVE_MS;
    h->mhd = MHD_start_daemon(
        flags, (uint16_t)port, on_accept, h, on_request, h, MHD_OPTION_SOCK_ADDR,
        (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_LIMIT, 2u * (unsigned)cfg->max_connections,
        MHD_OPTION_NOTIFY_CONNECTION, on_connection, h, MHD_OPTION_CONNECTION_TIMEOUT, idle_s,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_THREAD_STACK_SIZE,
        (size_t)512 * 1024, MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)64 * 1024, MHD_OPTION_ARRAY,
        tls_opts, MHD_OPTION_END);
    if (!h->mhd) {
        /* The handle closes on the loop, which frees the rest after it. */
        uv_close((uv_handle_t *)&h->async, free_after_close);
        *out = NULL;
        return dit_diag_set(diag, DIT_ERR_IO, "cannot serve HTTP on %s (in use?)", cfg->listen);
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_BIND_PORT);
    *bound_port = info ? info->port : port;
    *out = h;
    return DIT_OK;
fail:
    free_http(h);
    *out = NULL;
    return st;
}

int64_t dit_http_held_bytes(void *ctx)
{
    const dit_http *h = ctx;
    return atomic_load(&h->held);
}

void dit_http_set_serving(void *ctx, bool serving)
{
    dit_http *h = ctx;
    if (h)
        atomic_store(&h->serving, serving);
}

void dit_http_set_meshes(void *ctx, int n, const char *const *states)
{
    dit_http *h = ctx;
    if (!h)
        return;
    uv_mutex_lock(&h->mu);
    h->n_meshes = n < DIT_HTTP_MAX_MESHES ? n : DIT_HTTP_MAX_MESHES;
    for (int i = 0; i < h->n_meshes; i++)
        snprintf(h->mesh_states[i], sizeof h->mesh_states[i], "%s", states[i]);
    uv_mutex_unlock(&h->mu);
}

void dit_http_close(dit_http *h)
{
    if (!h)
        return;
    uv_mutex_lock(&h->mu);
    const bool was = h->closed;
    h->closed = true;
    uv_mutex_unlock(&h->mu);
    atomic_store(&h->serving, false);
    if (!was) {
        on_async(&h->async); /* ops that arrived before the close */
        uv_close((uv_handle_t *)&h->async, NULL);
    }
}

void dit_http_destroy(dit_http *h)
{
    if (!h)
        return;
    if (h->mhd) {
        /* Responses being written get a moment to finish; then every
         * connection thread is told to stop and joined. */
        const MHD_socket lfd = MHD_quiesce_daemon(h->mhd);
        if (lfd != MHD_INVALID_SOCKET)
            close(lfd);
        for (int i = 0; i < 50; i++) {
            uv_mutex_lock(&h->mu);
            const int active = h->active;
            uv_mutex_unlock(&h->mu);
            if (!active)
                break;
            struct timespec ts = {0, 40 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        atomic_store(&h->stopping, true);
        MHD_stop_daemon(h->mhd);
    }
    op *o = h->ops_head;
    while (o) {
        op *next = o->next;
        if (o->g)
            gen_unref(o->g);
        if (o->v && o->kind == OP_VSUBMIT) {
            uv_mutex_lock(&h->vmu); /* no job: its creator is told it was refused */
            o->v->decided = o->v->refused = true;
            o->v->code = GRPC_STATUS_UNAVAILABLE;
            snprintf(o->v->msg, sizeof o->v->msg, "the server is shutting down");
            vdrop_locked(h, o->v);
            uv_mutex_unlock(&h->vmu);
        } else if (o->v) {
            vunref(h, o->v);
        }
        free(o);
        o = next;
    }
    free_http(h);
}
