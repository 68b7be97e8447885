#include "rpc.h"

#include <stdio.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

/* Calls kept requested per method, so bursts of clients are accepted
 * without waiting for the loop. */
#define RPC_REQUESTS_PER_METHOD 16

typedef struct rpc_tag {
    void (*fn)(struct rpc_tag *t, bool ok);
} rpc_tag;

#define CONTAINER(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

typedef struct rpc_event {
    rpc_tag *tag;
    bool ok;
} rpc_event;

typedef struct out_msg {
    struct out_msg *next;
    grpc_byte_buffer *buf;
    size_t len;
} out_msg;

/* Bytes queued on one client connection's calls that the client has not
 * taken yet (a message counts until gRPC completes its send, which waits on
 * HTTP/2 flow control). Calls of a connection share one entry, found by the
 * peer address; it lives while a call refers to it. */
typedef struct conn_acct {
    struct conn_acct *next;
    char *peer;
    int64_t bytes;
    int refs;
} conn_acct;

/* A call's state belongs to the loop thread, except its send side, which
 * the completion-queue thread also touches: when a send completes it starts
 * the next queued batch itself (the result after its chunk, the status after
 * the last message) instead of waiting for the loop to pick the completion
 * up, one thread hand-off less per message. The send side is the fields
 * under `smu`; the loop still accounts and frees the sent messages when the
 * completion reaches it, and frees the call only once none is on its way. */
struct dit_rpc_call {
    dit_rpc_server *srv;
    int method;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    rpc_tag new_tag, close_tag, send_tag, recv_tag;
    int cancelled_flag;
    bool started, close_done, recv_busy;
    bool finish_requested, dead, cancel_notified;
    int depth; /* completion handlers on the stack: no freeing under them */
    /* The send side (see above), under smu. */
    uv_mutex_t smu;
    out_msg *head, *tail; /* queued, head first; the head is in flight while sending_msg */
    out_msg *sent;        /* sent, for the loop to account and free */
    bool send_busy, md_sent, sending_status, status_done, send_stopped;
    bool sending_msg;         /* the batch in flight carries the head message */
    int send_events;          /* send completions on their way to the loop */
    grpc_call_error send_err; /* a batch the completion-queue thread could not start */
    grpc_byte_buffer *recv_buf;
    grpc_status_code code;
    grpc_slice details;
    bool has_details;
    char *details_text; /* the same, for the request log */
    void *user;
    char *peer;
    conn_acct *acct;     /* set with the first message queued */
    bool acct_tried;     /* looked for once: a call counts all its bytes there or none */
    int64_t unsent;      /* bytes of this call's queued messages */
    bool status_counted; /* in the server's statuses_pending (loop thread) */
};

typedef struct generic_call {
    dit_rpc_server *srv;
    rpc_tag new_tag, done_tag;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
    int cancelled;
    grpc_slice status_details;
} generic_call;

struct dit_rpc_server {
    uv_loop_t *loop;
    grpc_server *server;
    grpc_completion_queue *cq;
    uv_thread_t thread;
    bool thread_started;
    uv_async_t async;
    uv_mutex_t mu;
    rpc_event *events;
    size_t n_events, cap_events;
    const dit_rpc_method *methods;
    int n_methods;
    void **handles;
    rpc_tag shutdown_tag;
    bool shutting_down, grpc_shutdown_done;
    void (*done)(void *ctx);
    void *done_ctx;
    int live;
    char *auth_header; /* "Bearer <token>" */
    const dit_log *log;
    void (*refused)(void *ctx, const char *path, grpc_status_code code, const char *why);
    void *refused_ctx;
    conn_acct *accts;
    int64_t unsent;           /* over every call */
    int64_t statuses_pending; /* calls finished whose status has not gone out yet */
};

static const char *const status_names[] = {
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

const char *dit_rpc_status_name(grpc_status_code code)
{
    if ((unsigned)code < sizeof status_names / sizeof *status_names)
        return status_names[code];
    return "UNKNOWN";
}

/* ------------------------------------------------------------------------ */
/* Completion-queue thread -> loop                                           */

static void on_send(rpc_tag *t, bool ok);
static void send_done(dit_rpc_call *c, bool ok);

static void cq_thread(void *arg)
{
    dit_rpc_server *s = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        rpc_tag *tag = ev.tag;
        if (tag->fn == on_send)
            send_done(CONTAINER(tag, dit_rpc_call, send_tag), ev.success != 0);
        uv_mutex_lock(&s->mu);
        if (s->n_events == s->cap_events) {
            size_t cap = s->cap_events ? s->cap_events * 2 : 64;
            rpc_event *ne = realloc(s->events, cap * sizeof *ne);
            if (!ne) {
                /* Without memory the event cannot be kept; the call it belongs
                 * to would hang, so stop loudly instead. */
                fprintf(stderr, "ditd: out of memory in the gRPC event bridge\n");
                abort();
            }
            s->events = ne;
            s->cap_events = cap;
        }
        s->events[s->n_events++] = (rpc_event){ev.tag, ev.success != 0};
        uv_mutex_unlock(&s->mu);
        uv_async_send(&s->async);
    }
}

static void on_async(uv_async_t *h)
{
    dit_rpc_server *s = h->data;
    for (;;) {
        uv_mutex_lock(&s->mu);
        rpc_event *batch = s->events;
        size_t n = s->n_events;
        s->events = NULL;
        s->n_events = s->cap_events = 0;
        uv_mutex_unlock(&s->mu);
        if (n == 0) {
            free(batch);
            return;
        }
        for (size_t i = 0; i < n; i++)
            batch[i].tag->fn(batch[i].tag, batch[i].ok);
        free(batch);
    }
}

/* ------------------------------------------------------------------------ */
/* Calls                                                                     */

static void request_call(dit_rpc_server *s, int method);
static void pump(dit_rpc_call *c);

static void check_shutdown_done(dit_rpc_server *s)
{
    if (s->shutting_down && s->grpc_shutdown_done && s->live == 0 && s->done) {
        void (*done)(void *) = s->done;
        s->done = NULL;
        done(s->done_ctx);
    }
}

/* Adds delta (negative: sent) to the call's, its connection's and the
 * server's count of bytes not yet taken by the client. */
static void account(dit_rpc_call *c, int64_t delta)
{
    c->unsent += delta;
    c->srv->unsent += delta;
    if (c->acct)
        c->acct->bytes += delta;
}

static conn_acct *acct_get(dit_rpc_server *s, const char *peer)
{
    for (conn_acct *a = s->accts; a; a = a->next)
        if (strcmp(a->peer, peer) == 0) {
            a->refs++;
            return a;
        }
    conn_acct *a = calloc(1, sizeof *a);
    if (!a || !(a->peer = strdup(peer))) {
        free(a);
        return NULL;
    }
    a->refs = 1;
    a->next = s->accts;
    s->accts = a;
    return a;
}

static void acct_put(dit_rpc_server *s, conn_acct *a)
{
    if (!a || --a->refs > 0)
        return;
    for (conn_acct **pp = &s->accts; *pp; pp = &(*pp)->next)
        if (*pp == a) {
            *pp = a->next;
            break;
        }
    free(a->peer);
    free(a);
}

static void call_free(dit_rpc_call *c)
{
    account(c, -c->unsent);
    if (c->status_counted)
        c->srv->statuses_pending--;
    acct_put(c->srv, c->acct);
    for (out_msg **list = &c->head; list; list = list == &c->head ? &c->sent : NULL)
        while (*list) {
            out_msg *m = *list;
            *list = m->next;
            grpc_byte_buffer_destroy(m->buf);
            free(m);
        }
    if (c->payload)
        grpc_byte_buffer_destroy(c->payload);
    if (c->recv_buf)
        grpc_byte_buffer_destroy(c->recv_buf);
    if (c->has_details)
        grpc_slice_unref(c->details);
    free(c->details_text);
    grpc_metadata_array_destroy(&c->md);
    if (c->call)
        grpc_call_unref(c->call);
    if (c->peer)
        gpr_free(c->peer);
    uv_mutex_destroy(&c->smu);
    free(c);
}

/* Nothing more goes out on the call (loop thread). */
static void mark_dead(dit_rpc_call *c)
{
    c->dead = true;
    uv_mutex_lock(&c->smu);
    c->send_stopped = true;
    uv_mutex_unlock(&c->smu);
}

static void maybe_free(dit_rpc_call *c)
{
    if (c->depth > 0 || !c->close_done || c->recv_busy || !c->finish_requested)
        return;
    uv_mutex_lock(&c->smu);
    const bool sending = c->send_busy || c->send_events > 0, status_done = c->status_done;
    uv_mutex_unlock(&c->smu);
    if (sending || (!status_done && !c->dead))
        return;
    dit_rpc_server *s = c->srv;
    call_free(c);
    s->live--;
    check_shutdown_done(s);
}

/* Every completion handler brackets its work with enter/leave, so that a
 * call the application finishes from inside it (a handler calling
 * dit_rpc_call_finish) is freed only once the handler is done with it. */
static void enter(dit_rpc_call *c)
{
    c->depth++;
}

static void leave(dit_rpc_call *c)
{
    c->depth--;
    maybe_free(c);
}

static void notify_cancel(dit_rpc_call *c)
{
    if (c->cancel_notified || c->finish_requested)
        return;
    c->cancel_notified = true;
    const dit_rpc_method *m = &c->srv->methods[c->method];
    if (m->on_cancel)
        m->on_cancel(m->ctx, c);
    else
        dit_rpc_call_finish(c, GRPC_STATUS_CANCELLED, "cancelled");
}

static void on_close(rpc_tag *t, bool ok)
{
    (void)ok;
    dit_rpc_call *c = CONTAINER(t, dit_rpc_call, close_tag);
    enter(c);
    c->close_done = true;
    if (c->cancelled_flag) {
        mark_dead(c);
        notify_cancel(c);
    }
    leave(c);
}

/* Starts the next send batch if none is in flight: the queued head
 * message, with the status when it is the last and the call is finished
 * (one completion less at the end of every call), or the status alone.
 * Either thread, smu held. */
static void pump_locked(dit_rpc_call *c)
{
    if (c->send_busy || c->send_stopped)
        return;
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!c->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[n].data.send_initial_metadata.count = 0;
        n++;
    }
    if (c->head) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->head->buf;
        n++;
        c->sending_msg = true;
    }
    if ((!c->head || !c->head->next) && c->finish_requested && !c->status_done) {
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.trailing_metadata_count = 0;
        ops[n].data.send_status_from_server.status = c->code;
        ops[n].data.send_status_from_server.status_details = c->has_details ? &c->details : NULL;
        n++;
        c->sending_status = true;
    } else if (!c->head) {
        return;
    }
    c->md_sent = true;
    c->send_busy = true;
    grpc_call_error err = grpc_call_start_batch(c->call, ops, n, &c->send_tag, NULL);
    if (err != GRPC_CALL_OK) {
        c->send_busy = false;
        c->sending_status = false;
        c->sending_msg = false;
        c->send_stopped = true;
        c->send_err = err;
    }
}

/* Loop thread: pump_locked, and what a failed start means for the call. */
static void pump(dit_rpc_call *c)
{
    uv_mutex_lock(&c->smu);
    pump_locked(c);
    const grpc_call_error err = c->send_err;
    c->send_err = GRPC_CALL_OK;
    uv_mutex_unlock(&c->smu);
    if (err != GRPC_CALL_OK) {
        c->dead = true;
        DIT_LOG(c->srv->log, DIT_LOG_WARN, "grpc", "start_batch failed (%d); dropping the call",
                (int)err);
        /* Ends it for the client too: its close notification then comes,
         * and the call (with its unsent bytes) is freed, instead of being
         * held until the client goes. */
        grpc_call_cancel(c->call, NULL);
    }
}

/* Completion-queue thread, a send batch done: the message it carried
 * joins the sent list, and the next batch starts at once. Counts the
 * completion as on its way to the loop (on_send), which keeps the call. */
static void send_done(dit_rpc_call *c, bool ok)
{
    uv_mutex_lock(&c->smu);
    c->send_busy = false;
    if (c->sending_msg && c->head) {
        out_msg *m = c->head;
        c->head = m->next;
        if (!c->head)
            c->tail = NULL;
        m->next = c->sent;
        c->sent = m;
    }
    c->sending_msg = false;
    if (c->sending_status) {
        c->sending_status = false;
        c->status_done = true;
    }
    if (!ok)
        c->send_stopped = true; /* the client went away */
    else
        pump_locked(c);
    c->send_events++;
    uv_mutex_unlock(&c->smu);
}

/* Loop thread, after send_done: accounts and frees what was sent. */
static void on_send(rpc_tag *t, bool ok)
{
    dit_rpc_call *c = CONTAINER(t, dit_rpc_call, send_tag);
    enter(c);
    uv_mutex_lock(&c->smu);
    out_msg *sent = c->sent;
    c->sent = NULL;
    c->send_events--;
    const bool status_out = c->status_done || c->send_stopped;
    uv_mutex_unlock(&c->smu);
    if (status_out && c->status_counted) {
        c->status_counted = false;
        c->srv->statuses_pending--;
    }
    while (sent) {
        out_msg *m = sent;
        sent = m->next;
        account(c, -(int64_t)m->len);
        grpc_byte_buffer_destroy(m->buf);
        free(m);
    }
    if (!ok) {
        /* The client went away: nothing more can be sent. */
        c->dead = true;
        notify_cancel(c);
    }
    pump(c);
    leave(c);
}

/* Queues the n slices (len bytes in all) as the call's next message; takes
 * the caller's references. */
static void queue_slices(dit_rpc_call *c, grpc_slice *slices, size_t n, size_t len)
{
    out_msg *m = calloc(1, sizeof *m);
    if (m)
        m->buf = grpc_raw_byte_buffer_create(slices, n);
    for (size_t i = 0; i < n; i++)
        grpc_slice_unref(slices[i]);
    if (!m) {
        /* A stream missing a message must not end OK: the call ends, and
         * its handler hears of it as of a client's cancel, when the close
         * comes back (not from here: the caller may hold what that frees). */
        mark_dead(c);
        grpc_call_cancel_with_status(c->call, GRPC_STATUS_RESOURCE_EXHAUSTED,
                                     "out of memory for a message", NULL);
        return;
    }
    m->len = len;
    if (!c->acct_tried) {
        c->acct_tried = true;
        c->acct = acct_get(c->srv, dit_rpc_call_peer(c));
    }
    account(c, (int64_t)len);
    uv_mutex_lock(&c->smu);
    if (c->tail)
        c->tail->next = m;
    else
        c->head = m;
    c->tail = m;
    uv_mutex_unlock(&c->smu);
    pump(c);
}

void dit_rpc_call_send(dit_rpc_call *c, const uint8_t *msg, size_t len)
{
    if (c->dead || c->finish_requested)
        return;
    grpc_slice slice = grpc_slice_from_copied_buffer((const char *)msg, len);
    queue_slices(c, &slice, 1, len);
}

void dit_rpc_call_send_message(dit_rpc_call *c, const ProtobufCMessage *msg)
{
    if (c->dead || c->finish_requested)
        return;
    const size_t len = protobuf_c_message_get_packed_size(msg);
    grpc_slice slice = grpc_slice_malloc(len);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(slice));
    queue_slices(c, &slice, 1, len);
}

void dit_rpc_call_send_parts(dit_rpc_call *c, const uint8_t *head, size_t head_len,
                             const uint8_t *data, size_t len, void (*release)(void *), void *ctx)
{
    /* The data slice owns the one release: dropping it, sent or not,
     * releases. */
    grpc_slice parts[2] = {grpc_slice_from_copied_buffer((const char *)head, head_len),
                           grpc_slice_new_with_user_data((void *)data, len, release, ctx)};
    if (c->dead || c->finish_requested) {
        grpc_slice_unref(parts[0]);
        grpc_slice_unref(parts[1]);
        return;
    }
    queue_slices(c, parts, 2, head_len + len);
}

void dit_rpc_call_finish(dit_rpc_call *c, grpc_status_code code, const char *details)
{
    if (c->finish_requested)
        return;
    uv_mutex_lock(&c->smu);
    c->finish_requested = true;
    if (!c->dead) {
        c->status_counted = true;
        c->srv->statuses_pending++;
    }
    c->code = code;
    if (details && *details) {
        c->details = grpc_slice_from_copied_string(details);
        c->has_details = true;
        c->details_text = strdup(details);
    }
    uv_mutex_unlock(&c->smu);
    pump(c);
    maybe_free(c);
}

/* Whether a request message of len bytes is over the method's own bound;
 * sets *why when it is. */
static bool over_method_bound(const dit_rpc_method *m, size_t len, char *why, size_t cap)
{
    if (m->max_request_bytes <= 0 || (int64_t)len <= m->max_request_bytes)
        return false;
    snprintf(why, cap, "the request message is %zu bytes; %s takes at most %lld", len, m->path,
             (long long)m->max_request_bytes);
    return true;
}

static void on_recv(rpc_tag *t, bool ok)
{
    dit_rpc_call *c = CONTAINER(t, dit_rpc_call, recv_tag);
    enter(c);
    c->recv_busy = false;
    grpc_byte_buffer *buf = c->recv_buf;
    c->recv_buf = NULL;
    const dit_rpc_method *m = &c->srv->methods[c->method];
    char why[256];
    if (ok && buf && !c->finish_requested &&
        over_method_bound(m, grpc_byte_buffer_length(buf), why, sizeof why)) {
        dit_rpc_call_finish(c, GRPC_STATUS_RESOURCE_EXHAUSTED, why);
    } else if (ok && buf && !c->finish_requested) {
        grpc_byte_buffer_reader r;
        grpc_byte_buffer_reader_init(&r, buf);
        grpc_slice sl = grpc_byte_buffer_reader_readall(&r);
        grpc_byte_buffer_reader_destroy(&r);
        m->on_message(m->ctx, c, GRPC_SLICE_START_PTR(sl), GRPC_SLICE_LENGTH(sl));
        grpc_slice_unref(sl);
    } else if (!c->finish_requested) {
        m->on_message(m->ctx, c, NULL, 0);
    }
    if (buf)
        grpc_byte_buffer_destroy(buf);
    leave(c);
}

void dit_rpc_call_read(dit_rpc_call *c)
{
    if (c->recv_busy || c->dead || c->finish_requested)
        return;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_buf;
    c->recv_busy = true;
    if (grpc_call_start_batch(c->call, &op, 1, &c->recv_tag, NULL) != GRPC_CALL_OK) {
        c->recv_busy = false;
        mark_dead(c);
    }
}

grpc_status_code dit_rpc_call_code(const dit_rpc_call *c, const char **details)
{
    if (details)
        *details = c->details_text ? c->details_text : "";
    return c->finish_requested ? c->code : GRPC_STATUS_OK;
}

void dit_rpc_call_set_user(dit_rpc_call *c, void *user)
{
    c->user = user;
}

void *dit_rpc_call_user(const dit_rpc_call *c)
{
    return c->user;
}

double dit_rpc_call_deadline_ms(const dit_rpc_call *c)
{
    gpr_timespec now = gpr_now(GPR_CLOCK_MONOTONIC);
    gpr_timespec dl = gpr_convert_clock_type(c->deadline, GPR_CLOCK_MONOTONIC);
    if (gpr_time_cmp(dl, gpr_inf_future(GPR_CLOCK_MONOTONIC)) == 0)
        return 1e18;
    gpr_timespec d = gpr_time_sub(dl, now);
    return (double)d.tv_sec * 1e3 + (double)d.tv_nsec / 1e6;
}

bool dit_rpc_call_cancelled(const dit_rpc_call *c)
{
    return c->dead;
}

int64_t dit_rpc_call_conn_unsent(dit_rpc_call *c)
{
    const char *peer = dit_rpc_call_peer(c);
    for (const conn_acct *a = c->srv->accts; a; a = a->next)
        if (strcmp(a->peer, peer) == 0)
            return a->bytes;
    return 0;
}

int64_t dit_rpc_server_unsent(const dit_rpc_server *s)
{
    return s ? s->unsent : 0;
}

int64_t dit_rpc_server_statuses_pending(const dit_rpc_server *s)
{
    return s ? s->statuses_pending : 0;
}

const char *dit_rpc_call_peer(dit_rpc_call *c)
{
    if (!c->peer)
        c->peer = grpc_call_get_peer(c->call);
    return c->peer ? c->peer : "?";
}

/* Equal without an early exit, so that the time taken tells nothing about
 * how much of a guessed token was right. */
static bool same_secret(const uint8_t *a, size_t na, const char *b)
{
    const size_t nb = strlen(b);
    size_t diff = na ^ nb; /* all its bits: a length 2^32 longer differs too */
    for (size_t i = 0; i < nb; i++)
        diff |= (size_t)(uint8_t)(b[i] ^ (i < na ? a[i] : 0));
    return diff == 0;
}

/* Whether the call's metadata carries the configured bearer token. */
static bool authorized(const dit_rpc_call *c)
{
    const char *want = c->srv->auth_header;
    if (!want || c->srv->methods[c->method].public_auth)
        return true;
    for (size_t i = 0; i < c->md.count; i++) {
        const grpc_metadata *m = &c->md.metadata[i];
        if (grpc_slice_str_cmp(m->key, "authorization") == 0 &&
            same_secret(GRPC_SLICE_START_PTR(m->value), GRPC_SLICE_LENGTH(m->value), want))
            return true;
    }
    return false;
}

static void dispatch_new_call(dit_rpc_call *c);

static void on_new_call(rpc_tag *t, bool ok)
{
    dit_rpc_call *c = CONTAINER(t, dit_rpc_call, new_tag);
    dit_rpc_server *s = c->srv;
    if (!ok) {
        /* Shutting down: the requested call will never come. */
        call_free(c);
        return;
    }
    s->live++;
    c->started = true;
    if (!s->shutting_down)
        request_call(s, c->method);
    enter(c);
    dispatch_new_call(c);
    leave(c);
}

/* Checks the token, reads the request and hands the call to its handler. */
static void dispatch_new_call(dit_rpc_call *c)
{
    dit_rpc_server *s = c->srv;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->cancelled_flag;
    if (grpc_call_start_batch(c->call, &op, 1, &c->close_tag, NULL) != GRPC_CALL_OK) {
        c->close_done = true;
        mark_dead(c);
    }
    const dit_rpc_method *m = &s->methods[c->method];
    grpc_status_code code = GRPC_STATUS_OK;
    const char *why = NULL;
    char bound[256];
    grpc_byte_buffer_reader r;
    if (!authorized(c)) {
        code = GRPC_STATUS_UNAUTHENTICATED;
        why = "missing or wrong bearer token (metadata 'authorization: Bearer ...')";
    } else if (m->kind == DIT_RPC_BIDI_STREAM) {
        m->on_call(m->ctx, c, NULL, 0);
        return;
    } else if (!c->payload) {
        code = GRPC_STATUS_INVALID_ARGUMENT;
        why = "the request message is missing";
    } else if (over_method_bound(m, grpc_byte_buffer_length(c->payload), bound, sizeof bound)) {
        code = GRPC_STATUS_RESOURCE_EXHAUSTED;
        why = bound;
    } else if (!grpc_byte_buffer_reader_init(&r, c->payload)) {
        code = GRPC_STATUS_INVALID_ARGUMENT;
        why = "cannot read the request message";
    }
    if (why) {
        if (s->refused) /* before the client hears, which may then look */
            s->refused(s->refused_ctx, m->path, code, why);
        dit_rpc_call_finish(c, code, why);
        return;
    }
    grpc_slice sl = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    m->on_call(m->ctx, c, GRPC_SLICE_START_PTR(sl), GRPC_SLICE_LENGTH(sl));
    grpc_slice_unref(sl);
}

static void request_call(dit_rpc_server *s, int method)
{
    dit_rpc_call *c = calloc(1, sizeof *c);
    if (!c)
        return;
    uv_mutex_init(&c->smu);
    c->srv = s;
    c->method = method;
    c->new_tag.fn = on_new_call;
    c->close_tag.fn = on_close;
    c->send_tag.fn = on_send;
    c->recv_tag.fn = on_recv;
    grpc_metadata_array_init(&c->md);
    const bool bidi = s->methods[method].kind == DIT_RPC_BIDI_STREAM;
    grpc_call_error err = grpc_server_request_registered_call(
        s->server, s->handles[method], &c->call, &c->deadline, &c->md, bidi ? NULL : &c->payload,
        s->cq, s->cq, &c->new_tag);
    if (err != GRPC_CALL_OK) {
        DIT_LOG(s->log, DIT_LOG_ERROR, "grpc", "cannot request calls for %s (%d)",
                s->methods[method].path, (int)err);
        call_free(c);
    }
}

/* ------------------------------------------------------------------------ */
/* Unknown methods                                                           */

static void request_generic(dit_rpc_server *s);

static void on_generic_done(rpc_tag *t, bool ok)
{
    (void)ok;
    generic_call *g = CONTAINER(t, generic_call, done_tag);
    grpc_slice_unref(g->status_details);
    grpc_call_details_destroy(&g->details);
    grpc_metadata_array_destroy(&g->md);
    grpc_call_unref(g->call);
    dit_rpc_server *s = g->srv;
    free(g);
    s->live--;
    check_shutdown_done(s);
}

static void on_generic_new(rpc_tag *t, bool ok)
{
    generic_call *g = CONTAINER(t, generic_call, new_tag);
    dit_rpc_server *s = g->srv;
    if (!ok) {
        grpc_call_details_destroy(&g->details);
        grpc_metadata_array_destroy(&g->md);
        free(g);
        return;
    }
    s->live++;
    if (!s->shutting_down)
        request_generic(s);
    char msg[512];
    snprintf(msg, sizeof msg, "method %.*s is not implemented by this server",
             (int)GRPC_SLICE_LENGTH(g->details.method),
             (const char *)GRPC_SLICE_START_PTR(g->details.method));
    g->status_details = grpc_slice_from_copied_string(msg);
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[1].data.send_status_from_server.status = GRPC_STATUS_UNIMPLEMENTED;
    ops[1].data.send_status_from_server.status_details = &g->status_details;
    ops[2].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[2].data.recv_close_on_server.cancelled = &g->cancelled;
    if (grpc_call_start_batch(g->call, ops, 3, &g->done_tag, NULL) != GRPC_CALL_OK)
        on_generic_done(&g->done_tag, false);
}

static void request_generic(dit_rpc_server *s)
{
    generic_call *g = calloc(1, sizeof *g);
    if (!g)
        return;
    g->srv = s;
    g->new_tag.fn = on_generic_new;
    g->done_tag.fn = on_generic_done;
    grpc_call_details_init(&g->details);
    grpc_metadata_array_init(&g->md);
    if (grpc_server_request_call(s->server, &g->call, &g->details, &g->md, s->cq, s->cq,
                                 &g->new_tag) != GRPC_CALL_OK) {
        grpc_call_details_destroy(&g->details);
        grpc_metadata_array_destroy(&g->md);
        free(g);
    }
}

/* ------------------------------------------------------------------------ */
/* Server                                                                    */

static char *read_file(const char *path, dit_diag *diag)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        dit_diag_set(diag, DIT_ERR_IO, "cannot read %s", path);
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *buf = n >= 0 && n < (1 << 24) ? malloc((size_t)n + 1) : NULL;
    if (buf && fread(buf, 1, (size_t)n, f) == (size_t)n) {
        buf[n] = '\0';
    } else {
        free(buf);
        buf = NULL;
        dit_diag_set(diag, DIT_ERR_IO, "cannot read %s", path);
    }
    fclose(f);
    return buf;
}

static void on_grpc_shutdown(rpc_tag *t, bool ok)
{
    (void)ok;
    dit_rpc_server *s = CONTAINER(t, dit_rpc_server, shutdown_tag);
    s->grpc_shutdown_done = true;
    check_shutdown_done(s);
}

static void on_async_closed(uv_handle_t *h);

dit_status dit_rpc_server_create(uv_loop_t *loop, const dit_rpc_config *cfg,
                                 const dit_rpc_method *methods, int n_methods, dit_rpc_server **out,
                                 int *bound_port, dit_diag *diag)
{
    dit_status st = DIT_OK;
    char *cert = NULL, *key = NULL, *ca = NULL;
    grpc_server_credentials *creds = NULL;
    bool async_up = false;
    dit_rpc_server *s = calloc(1, sizeof *s);
    if (!s)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    s->loop = loop;
    s->methods = methods;
    s->n_methods = n_methods;
    s->log = cfg->log;
    s->refused = cfg->refused;
    s->refused_ctx = cfg->refused_ctx;
    s->shutdown_tag.fn = on_grpc_shutdown;
    uv_mutex_init(&s->mu);
    s->handles = calloc((size_t)n_methods, sizeof *s->handles);
    if (!s->handles) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    if (cfg->auth_token) {
        size_t n = strlen(cfg->auth_token) + 8;
        s->auth_header = malloc(n);
        if (!s->auth_header) { /* never serve open for want of memory */
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
            goto cleanup;
        }
        snprintf(s->auth_header, n, "Bearer %s", cfg->auth_token);
    }
    grpc_arg args[6];
    int nargs = 0;
    /* Streams one connection may have open at once (HTTP/2's default is
     * no limit): a client cannot hold calls without bound on one
     * connection; more wait in the client until one ends. */
    args[nargs++] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                               .key = GRPC_ARG_MAX_CONCURRENT_STREAMS,
                               .value.integer = DIT_RPC_MAX_STREAMS};
    /* gRPC sets SO_REUSEPORT by default, which lets a second ditd bind the
     * port this one holds and take half its clients: bind exclusively. */
    args[nargs++] =
        (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ALLOW_REUSEPORT, .value.integer = 0};
    args[nargs++] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                               .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                               .value.integer = (int)cfg->max_message_bytes};
    args[nargs++] = (grpc_arg){
        .type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, .value.integer = -1};
    if (cfg->max_connection_age_s > 0)
        args[nargs++] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                                   .key = GRPC_ARG_MAX_CONNECTION_AGE_MS,
                                   .value.integer = cfg->max_connection_age_s * 1000 < INT_MAX
                                                        ? (int)(cfg->max_connection_age_s * 1000)
                                                        : INT_MAX}; /* ms: 24.8 days at most */
    grpc_channel_args chargs = {.num_args = (size_t)nargs, .args = args};
    s->server = grpc_server_create(&chargs, NULL);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(s->server, s->cq, NULL);
    for (int i = 0; i < n_methods; i++) {
        s->handles[i] = grpc_server_register_method(s->server, methods[i].path, NULL,
                                                    methods[i].kind == DIT_RPC_BIDI_STREAM
                                                        ? GRPC_SRM_PAYLOAD_NONE
                                                        : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER,
                                                    0);
        if (!s->handles[i]) {
            st = dit_diag_set(diag, DIT_ERR_INTERNAL, "cannot register %s", methods[i].path);
            goto cleanup;
        }
    }
    if (cfg->tls_cert || cfg->tls_key) {
        if (!cfg->tls_cert || !cfg->tls_key) {
            st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "TLS needs both a certificate and a key");
            goto cleanup;
        }
        if (!(cert = read_file(cfg->tls_cert, diag)) || !(key = read_file(cfg->tls_key, diag)) ||
            (cfg->tls_client_ca && !(ca = read_file(cfg->tls_client_ca, diag)))) {
            st = DIT_ERR_IO;
            goto cleanup;
        }
        grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
        creds = grpc_ssl_server_credentials_create_ex(
            ca, &pair, 1,
            ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
               : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
            NULL);
    } else {
        creds = grpc_insecure_server_credentials_create();
    }
    if (!creds) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "cannot build the server credentials");
        goto cleanup;
    }
    int port = grpc_server_add_http2_port(s->server, cfg->listen, creds);
    if (port == 0) {
        st = dit_diag_set(diag, DIT_ERR_IO,
                          "cannot listen on %s: the address is in use (another ditd?) or not "
                          "an address of this host",
                          cfg->listen);
        goto cleanup;
    }
    *bound_port = port;
    if (uv_async_init(loop, &s->async, on_async) != 0) {
        st = dit_diag_set(diag, DIT_ERR_INTERNAL, "uv_async_init failed");
        goto cleanup;
    }
    s->async.data = s;
    async_up = true;
    grpc_server_start(s->server);
    if (uv_thread_create(&s->thread, cq_thread, s) != 0) {
        st = dit_diag_set(diag, DIT_ERR_INTERNAL, "cannot start the completion-queue thread");
        goto cleanup;
    }
    s->thread_started = true;
    for (int i = 0; i < n_methods; i++)
        for (int k = 0; k < RPC_REQUESTS_PER_METHOD; k++)
            request_call(s, i);
    for (int k = 0; k < 4; k++)
        request_generic(s);
    *out = s;
    s = NULL;
cleanup:
    if (creds)
        grpc_server_credentials_release(creds);
    free(cert);
    if (key) {
        memset(key, 0, strlen(key));
        free(key);
    }
    free(ca);
    if (s) {
        /* Creation failed before any call: tear down directly. */
        if (s->server) {
            grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
            grpc_server_cancel_all_calls(s->server);
            grpc_completion_queue_shutdown(s->cq);
            while (
                grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
                GRPC_QUEUE_SHUTDOWN) {
            }
            grpc_server_destroy(s->server);
            grpc_completion_queue_destroy(s->cq);
        }
        if (async_up) {
            /* The loop holds the handle: s goes in its close callback. */
            uv_close((uv_handle_t *)&s->async, on_async_closed);
        } else {
            free(s->handles);
            free(s->auth_header);
            uv_mutex_destroy(&s->mu);
            free(s);
        }
    }
    return st;
}

void dit_rpc_server_shutdown(dit_rpc_server *s, void (*done)(void *ctx), void *ctx)
{
    if (s->shutting_down)
        return;
    s->shutting_down = true;
    s->done = done;
    s->done_ctx = ctx;
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->shutdown_tag);
}

void dit_rpc_server_cancel_all(dit_rpc_server *s)
{
    grpc_server_cancel_all_calls(s->server);
}

static void on_async_closed(uv_handle_t *h)
{
    dit_rpc_server *s = h->data;
    free(s->events);
    free(s->handles);
    free(s->auth_header);
    uv_mutex_destroy(&s->mu);
    free(s);
}

void dit_rpc_server_destroy(dit_rpc_server *s)
{
    if (!s)
        return;
    grpc_server_destroy(s->server);
    grpc_completion_queue_shutdown(s->cq);
    if (s->thread_started)
        uv_thread_join(&s->thread);
    grpc_completion_queue_destroy(s->cq);
    /* Requested-but-unused calls completed with ok=false; run them. */
    on_async(&s->async);
    uv_close((uv_handle_t *)&s->async, on_async_closed);
}
