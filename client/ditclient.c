/* ditclient: calls on the gRPC C core.
 *
 * Every call, unary or streaming, takes the same path:
 *   start:  one batch sends initial metadata, the request and the half-close
 *           and receives the initial metadata; a second batch waits for the
 *           status, so the status is collected however the call ends.
 *   recv:   one RECV_MESSAGE batch at a time (the core allows only one in
 *           flight); a NULL message means the server finished the stream.
 *   finish: wait for both batches, read the status, tear down.
 * Waiting plucks the call's own completion queue with a 100 ms deadline so
 * that the caller's cancel flag is noticed between events. */
#include "ditclient.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "grpc_health_v1_health.pb-c.h"

#ifndef DIT_VERSION
#define DIT_VERSION "dev"
#endif

#define DEFAULT_TARGET "127.0.0.1:50051"
#define POLL_MS 100

struct dit_client {
    grpc_channel *channel;
    char *target;
    char *authorization; /* "Bearer <token>", or NULL */
    double timeout_s;
};

static const char *const code_names[DIT_RPC_CODE_COUNT] = {
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

const char *dit_rpc_code_name(int code)
{
    if (code < 0 || code >= DIT_RPC_CODE_COUNT)
        return "UNKNOWN";
    return code_names[code];
}

const char *dit_health_name(dit_health h)
{
    switch (h) {
    case DIT_HEALTH_SERVING:
        return "SERVING";
    case DIT_HEALTH_NOT_SERVING:
        return "NOT_SERVING";
    case DIT_HEALTH_SERVICE_UNKNOWN:
        return "SERVICE_UNKNOWN";
    case DIT_HEALTH_UNKNOWN:
    default:
        return "UNKNOWN";
    }
}

__attribute__((format(printf, 3, 4))) static dit_rpc_code
set_status(dit_rpc_status *st, dit_rpc_code code, const char *fmt, ...)
{
    if (st) {
        st->code = code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(st->details, sizeof st->details, fmt, ap);
        va_end(ap);
    }
    return code;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Reads a whole PEM file, NUL-terminated, as the credential API wants it.
 * The core accepts any text here and fails only when it connects, as an
 * unhelpful "empty address list"; checking for the PEM marker now lets the
 * error name the file. */
static char *read_pem(const char *path, const char *what, const char *marker, dit_rpc_status *st)
{
    char *buf = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        set_status(st, DIT_RPC_INVALID_ARGUMENT, "cannot read %s %s: %s", what, path,
                   strerror(errno));
        return NULL;
    }
    if (fseek(f, 0, SEEK_END) != 0)
        goto fail;
    long n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0)
        goto fail;
    buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n)
        goto fail;
    buf[n] = '\0';
    fclose(f);
    if (!strstr(buf, marker)) {
        free(buf);
        set_status(st, DIT_RPC_INVALID_ARGUMENT, "%s %s holds no PEM '%s' block", what, path,
                   marker);
        return NULL;
    }
    return buf;
fail:
    set_status(st, DIT_RPC_INVALID_ARGUMENT, "cannot read %s %s: %s", what, path,
               errno ? strerror(errno) : "short read");
    free(buf);
    fclose(f);
    return NULL;
}

dit_rpc_code dit_client_open(const dit_client_opts *opts, dit_client **out, dit_rpc_status *st)
{
    static const dit_client_opts defaults = {0};
    const dit_client_opts *o = opts ? opts : &defaults;
    dit_rpc_code code = DIT_RPC_OK;
    char *ca = NULL, *cert = NULL, *key = NULL;
    grpc_channel_credentials *creds = NULL;
    dit_client *c = NULL;
    bool grpc_up = false;
    set_status(st, DIT_RPC_OK, "%s", "");
    *out = NULL;

    const char *target = o->target ? o->target : DEFAULT_TARGET;
    if (target[0] == '\0')
        return set_status(st, DIT_RPC_INVALID_ARGUMENT, "%s", "the target is empty");
    if (!o->cert_file != !o->key_file)
        return set_status(st, DIT_RPC_INVALID_ARGUMENT, "%s",
                          "a client certificate needs its key, and a key its certificate");
    if (!(o->timeout_s >= 0))
        return set_status(st, DIT_RPC_INVALID_ARGUMENT, "%s", "the timeout is negative");
    if (o->token && (o->token[0] == '\0' || strpbrk(o->token, "\r\n")))
        return set_status(st, DIT_RPC_INVALID_ARGUMENT, "%s",
                          "the token is empty or holds a line break");

    const bool tls = o->tls || o->ca_file || o->cert_file;
    if (o->ca_file && !(ca = read_pem(o->ca_file, "CA file", "-----BEGIN CERTIFICATE-----", st))) {
        code = st ? st->code : DIT_RPC_INVALID_ARGUMENT;
        goto cleanup;
    }
    if (o->cert_file) {
        if (!(cert = read_pem(o->cert_file, "certificate", "-----BEGIN CERTIFICATE-----", st)) ||
            !(key = read_pem(o->key_file, "key", "PRIVATE KEY-----", st))) {
            code = DIT_RPC_INVALID_ARGUMENT;
            goto cleanup;
        }
    }

    char with_port[1024];
    if (!dit_client_target_with_port(target, with_port, sizeof with_port))
        return set_status(st, DIT_RPC_INVALID_ARGUMENT, "%s", "the target is too long");
    c = calloc(1, sizeof *c);
    if (!c || !(c->target = strdup(with_port))) {
        code = set_status(st, DIT_RPC_INTERNAL, "%s", "client: out of memory");
        goto cleanup;
    }
    c->timeout_s = o->timeout_s;
    if (o->token) {
        size_t n = strlen(o->token) + sizeof "Bearer ";
        if (!(c->authorization = malloc(n))) {
            code = set_status(st, DIT_RPC_INTERNAL, "%s", "client: out of memory");
            goto cleanup;
        }
        snprintf(c->authorization, n, "Bearer %s", o->token);
    }

    /* grpc_init is reference counted; each client holds one reference so
     * that clients may be opened and closed independently. */
    grpc_init();
    grpc_up = true;
    if (tls) {
        grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
        creds = grpc_ssl_credentials_create(ca, cert ? &pair : NULL, NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    if (!creds) {
        code = set_status(st, DIT_RPC_INVALID_ARGUMENT, "%s",
                          "cannot create the channel credentials (bad PEM data?)");
        goto cleanup;
    }

    /* The API keeps ResultChunks within gRPC's default 4 MiB message limit;
     * a larger ceiling only keeps the client working against a server set
     * up with larger chunks. */
    grpc_arg args[] = {
        {.type = GRPC_ARG_STRING,
         .key = (char *)GRPC_ARG_PRIMARY_USER_AGENT_STRING,
         .value.string = (char *)"ditclient/" DIT_VERSION},
        {.type = GRPC_ARG_INTEGER,
         .key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
         .value.integer = 64 << 20},
    };
    grpc_channel_args chargs = {.num_args = sizeof args / sizeof args[0], .args = args};
    c->channel = grpc_channel_create(c->target, creds, &chargs);
    if (!c->channel) {
        code = set_status(st, DIT_RPC_INVALID_ARGUMENT, "cannot create a channel to %s", target);
        goto cleanup;
    }
    *out = c;
    c = NULL;

cleanup:
    if (creds)
        grpc_channel_credentials_release(creds);
    free(ca);
    free(cert);
    if (key) {
        /* The private key should not linger in freed heap memory. */
        memset(key, 0, strlen(key));
        free(key);
    }
    if (c) {
        free(c->authorization);
        free(c->target);
        free(c);
        if (grpc_up)
            grpc_shutdown();
    }
    return code;
}

void dit_client_close(dit_client *c)
{
    if (!c)
        return;
    grpc_channel_destroy(c->channel);
    free(c->authorization);
    free(c->target);
    free(c);
    grpc_shutdown();
}

bool dit_client_target_with_port(const char *target, char *out, size_t cap)
{
    static const char *const verbatim[] = {"unix:", "unix-abstract:", "vsock:", "ipv4:", "ipv6:"};
    const char *host = target;
    for (size_t i = 0; i < sizeof verbatim / sizeof verbatim[0]; i++)
        if (strncmp(target, verbatim[i], strlen(verbatim[i])) == 0)
            goto copy;
    if (strncmp(target, "dns:", 4) == 0) {
        /* dns:host, dns:///host or dns://authority/host */
        host = target + 4;
        if (strncmp(host, "//", 2) == 0) {
            const char *slash = strchr(host + 2, '/');
            if (!slash)
                goto copy;
            host = slash + 1;
        }
    } else if (strstr(target, "://")) {
        goto copy; /* some other scheme: its resolver's rules apply */
    }
    const size_t prefix = (size_t)(host - target);
    int n;
    if (host[0] == '[') {
        const char *close = strchr(host, ']');
        if (!close || close[1] != '\0')
            goto copy; /* "[addr]:port", or not an address we understand */
        n = snprintf(out, cap, "%s:%d", target, DIT_CLIENT_DEFAULT_PORT);
    } else {
        const char *colon = strchr(host, ':');
        if (colon && strchr(colon + 1, ':')) /* a bare IPv6 address: bracket it */
            n = snprintf(out, cap, "%.*s[%s]:%d", (int)prefix, target, host,
                         DIT_CLIENT_DEFAULT_PORT);
        else if (!colon && host[0])
            n = snprintf(out, cap, "%s:%d", target, DIT_CLIENT_DEFAULT_PORT);
        else
            goto copy;
    }
    return n >= 0 && (size_t)n < cap;
copy:
    n = snprintf(out, cap, "%s", target);
    return n >= 0 && (size_t)n < cap;
}

const char *dit_client_target(const dit_client *c)
{
    return c->target;
}

/* ------------------------------------------------------------------------ */
/* One call */

typedef struct rpc {
    dit_client *client;
    grpc_completion_queue *cq;
    grpc_call *call;
    const atomic_int *cancel;
    bool cancelled; /* grpc_call_cancel_with_status already issued */
    bool started;   /* the two start batches are in flight */
    bool stream_done;
    double t0_ms;

    grpc_metadata auth_md;
    grpc_metadata_array initial_md, trailing_md;
    grpc_byte_buffer *send_buf;
    grpc_byte_buffer *recv_buf;
    grpc_status_code status;
    grpc_slice details;
    const char *error_string;

    /* A failure found by the client; it overrides the server's status. */
    dit_rpc_code local_code;
    char local_msg[DIT_RPC_DETAILS_MAX];

    /* Distinct addresses serve as completion-queue tags. */
    char tag_start, tag_status, tag_recv;
} rpc;

__attribute__((format(printf, 3, 4))) static void rpc_fail(rpc *r, dit_rpc_code code,
                                                           const char *fmt, ...)
{
    if (r->local_code != DIT_RPC_OK)
        return; /* the first failure is the cause */
    r->local_code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->local_msg, sizeof r->local_msg, fmt, ap);
    va_end(ap);
}

static void rpc_cancel(rpc *r, const char *why)
{
    if (r->call && !r->cancelled) {
        r->cancelled = true;
        grpc_call_cancel_with_status(r->call, GRPC_STATUS_CANCELLED, why, NULL);
    }
}

/* Plucks `tag`, polling the cancel flag meanwhile. Returns the op's success.
 * The deadline needs no handling here: when it passes, the core fails the
 * pending ops and they complete like any other. */
static bool rpc_wait(rpc *r, void *tag)
{
    for (;;) {
        if (r->cancel && atomic_load(r->cancel))
            rpc_cancel(r, "client: cancelled by the caller");
        gpr_timespec until =
            gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(POLL_MS, GPR_TIMESPAN));
        grpc_event ev = grpc_completion_queue_pluck(r->cq, tag, until, NULL);
        if (ev.type == GRPC_OP_COMPLETE)
            return ev.success != 0;
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            return false; /* not reached: the queue is shut down only at the end */
    }
}

static grpc_byte_buffer *pack_message(const ProtobufCMessage *msg)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

static ProtobufCMessage *unpack_message(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *d)
{
    grpc_byte_buffer_reader reader;
    if (!grpc_byte_buffer_reader_init(&reader, bb))
        return NULL;
    grpc_slice s = grpc_byte_buffer_reader_readall(&reader);
    grpc_byte_buffer_reader_destroy(&reader);
    ProtobufCMessage *m =
        protobuf_c_message_unpack(d, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    return m;
}

static gpr_timespec call_deadline(const dit_client *c, const dit_call_opts *co)
{
    double t = co && co->timeout_s != 0 ? co->timeout_s : c->timeout_s;
    if (!(t > 0))
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_micros((int64_t)(t * 1e6), GPR_TIMESPAN));
}

/* Creates the call and starts the send batch and the status batch. Failures
 * are recorded in r and surface from rpc_finish. */
static void rpc_start(rpc *r, dit_client *c, const char *method, bool with_auth,
                      const ProtobufCMessage *req, const dit_call_opts *co)
{
    memset(r, 0, sizeof *r);
    r->client = c;
    r->cancel = co ? co->cancel : NULL;
    r->t0_ms = now_ms();
    grpc_metadata_array_init(&r->initial_md);
    grpc_metadata_array_init(&r->trailing_md);
    r->details = grpc_empty_slice();

    r->cq = grpc_completion_queue_create_for_pluck(NULL);
    if (!r->cq) {
        rpc_fail(r, DIT_RPC_INTERNAL, "%s", "client: cannot create a completion queue");
        return;
    }
    r->call = grpc_channel_create_call(c->channel, NULL, GRPC_PROPAGATE_DEFAULTS, r->cq,
                                       grpc_slice_from_static_string(method), NULL,
                                       call_deadline(c, co), NULL);
    if (!r->call) {
        rpc_fail(r, DIT_RPC_INTERNAL, "client: cannot create the call %s", method);
        return;
    }
    r->send_buf = pack_message(req);

    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (with_auth && c->authorization) {
        r->auth_md.key = grpc_slice_from_static_string("authorization");
        r->auth_md.value = grpc_slice_from_static_string(c->authorization);
        ops[0].data.send_initial_metadata.count = 1;
        ops[0].data.send_initial_metadata.metadata = &r->auth_md;
    }
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = r->send_buf;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &r->initial_md;
    grpc_call_error e = grpc_call_start_batch(r->call, ops, 4, &r->tag_start, NULL);
    if (e != GRPC_CALL_OK) {
        rpc_fail(r, DIT_RPC_INTERNAL, "client: cannot start %s (call error %d)", method, (int)e);
        return;
    }

    grpc_op st_op;
    memset(&st_op, 0, sizeof st_op);
    st_op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    st_op.data.recv_status_on_client.trailing_metadata = &r->trailing_md;
    st_op.data.recv_status_on_client.status = &r->status;
    st_op.data.recv_status_on_client.status_details = &r->details;
    st_op.data.recv_status_on_client.error_string = &r->error_string;
    e = grpc_call_start_batch(r->call, &st_op, 1, &r->tag_status, NULL);
    if (e != GRPC_CALL_OK) {
        /* The first batch is in flight: cancel so that it completes. */
        rpc_fail(r, DIT_RPC_INTERNAL, "client: cannot start %s (call error %d)", method, (int)e);
        rpc_cancel(r, "client: start failed");
        (void)rpc_wait(r, &r->tag_start);
        return;
    }
    r->started = true;
}

/* The next message of the response stream, or NULL at its end (or when the
 * call failed; rpc_finish tells which). The caller destroys the buffer. */
static grpc_byte_buffer *rpc_recv(rpc *r)
{
    if (!r->started || r->stream_done)
        return NULL;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &r->recv_buf;
    r->recv_buf = NULL;
    grpc_call_error e = grpc_call_start_batch(r->call, &op, 1, &r->tag_recv, NULL);
    if (e != GRPC_CALL_OK) {
        rpc_fail(r, DIT_RPC_INTERNAL, "client: cannot receive (call error %d)", (int)e);
        rpc_cancel(r, "client: receive failed");
        r->stream_done = true;
        return NULL;
    }
    bool ok = rpc_wait(r, &r->tag_recv);
    grpc_byte_buffer *bb = r->recv_buf;
    r->recv_buf = NULL;
    if (!ok || !bb) {
        if (bb)
            grpc_byte_buffer_destroy(bb);
        r->stream_done = true;
        return NULL;
    }
    return bb;
}

/* Waits for the call to end, fills st, and frees everything but r itself.
 * Returns the final code. */
static dit_rpc_code rpc_finish(rpc *r, dit_rpc_status *st)
{
    if (r->started) {
        /* A local failure mid-stream leaves the server talking: cancel so
         * that the status batch completes now. */
        if (r->local_code != DIT_RPC_OK || !r->stream_done)
            rpc_cancel(r, "client: call abandoned");
        (void)rpc_wait(r, &r->tag_start);
        (void)rpc_wait(r, &r->tag_status);
    }
    dit_rpc_code code;
    if (r->local_code != DIT_RPC_OK) {
        code = set_status(st, r->local_code, "%s", r->local_msg);
    } else if (!r->started) {
        code = set_status(st, DIT_RPC_INTERNAL, "%s", "client: the call did not start");
    } else {
        code = (dit_rpc_code)r->status;
        if (code < 0 || code >= DIT_RPC_CODE_COUNT)
            code = DIT_RPC_UNKNOWN;
        size_t n = GRPC_SLICE_LENGTH(r->details);
        if (n == 0 && code != DIT_RPC_OK && r->error_string)
            set_status(st, code, "%s", r->error_string);
        else
            set_status(st, code, "%.*s",
                       (int)(n < DIT_RPC_DETAILS_MAX ? n : DIT_RPC_DETAILS_MAX - 1),
                       (const char *)GRPC_SLICE_START_PTR(r->details));
    }

    if (r->call)
        grpc_call_unref(r->call);
    if (r->cq) {
        grpc_completion_queue_shutdown(r->cq);
        /* Every batch has been plucked, so the shutdown completes at once. */
        while (grpc_completion_queue_pluck(r->cq, NULL, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL)
                   .type != GRPC_QUEUE_SHUTDOWN) {
        }
        grpc_completion_queue_destroy(r->cq);
    }
    if (r->send_buf)
        grpc_byte_buffer_destroy(r->send_buf);
    grpc_metadata_array_destroy(&r->initial_md);
    grpc_metadata_array_destroy(&r->trailing_md);
    grpc_slice_unref(r->details);
    if (r->error_string)
        gpr_free((void *)r->error_string);
    return code;
}

/* A unary call: one request, one response message of type `d`. */
static dit_rpc_code unary(dit_client *c, const char *method, bool with_auth,
                          const ProtobufCMessage *req, const ProtobufCMessageDescriptor *d,
                          const dit_call_opts *co, ProtobufCMessage **out, dit_rpc_status *st)
{
    rpc r;
    *out = NULL;
    rpc_start(&r, c, method, with_auth, req, co);
    ProtobufCMessage *resp = NULL;
    grpc_byte_buffer *bb = rpc_recv(&r);
    if (bb) {
        resp = unpack_message(bb, d);
        grpc_byte_buffer_destroy(bb);
        if (!resp)
            rpc_fail(&r, DIT_RPC_INTERNAL, "client: cannot decode the %s response", d->name);
        /* Drain: a unary response ends after one message. */
        grpc_byte_buffer *extra = rpc_recv(&r);
        if (extra) {
            grpc_byte_buffer_destroy(extra);
            rpc_fail(&r, DIT_RPC_INTERNAL, "client: %s sent more than one response", method);
        }
    }
    dit_rpc_code code = rpc_finish(&r, st);
    if (code == DIT_RPC_OK && !resp)
        code = set_status(st, DIT_RPC_INTERNAL, "client: %s ended OK without a response", method);
    if (code != DIT_RPC_OK) {
        if (resp)
            protobuf_c_message_free_unpacked(resp, NULL);
        return code;
    }
    *out = resp;
    return DIT_RPC_OK;
}

dit_rpc_code dit_client_health(dit_client *c, const char *service, const dit_call_opts *co,
                               dit_health *out, dit_rpc_status *st)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    if (service)
        req.service = (char *)service;
    ProtobufCMessage *resp;
    /* No token: health is for probes (load balancers, Kubernetes) that hold
     * none, and the daemon answers it without authentication. */
    dit_rpc_code code = unary(c, "/grpc.health.v1.Health/Check", false, &req.base,
                              &grpc__health__v1__health_check_response__descriptor, co, &resp, st);
    if (code != DIT_RPC_OK)
        return code;
    const Grpc__Health__V1__HealthCheckResponse *h = (void *)resp;
    *out = h->status >= 0 && h->status <= 3 ? (dit_health)h->status : DIT_HEALTH_UNKNOWN;
    protobuf_c_message_free_unpacked(resp, NULL);
    return DIT_RPC_OK;
}

dit_rpc_code dit_client_server_info(dit_client *c, const dit_call_opts *co,
                                    Ditserve__V1__ServerInfo **out, dit_rpc_status *st)
{
    Ditserve__V1__GetServerInfoRequest req = DITSERVE__V1__GET_SERVER_INFO_REQUEST__INIT;
    return unary(c, "/ditserve.v1.Generation/GetServerInfo", true, &req.base,
                 &ditserve__v1__server_info__descriptor, co, (ProtobufCMessage **)out, st);
}

dit_rpc_code dit_client_list_models(dit_client *c, const dit_call_opts *co,
                                    Ditserve__V1__ListModelsResponse **out, dit_rpc_status *st)
{
    Ditserve__V1__ListModelsRequest req = DITSERVE__V1__LIST_MODELS_REQUEST__INIT;
    return unary(c, "/ditserve.v1.Generation/ListModels", true, &req.base,
                 &ditserve__v1__list_models_response__descriptor, co, (ProtobufCMessage **)out, st);
}

dit_rpc_code dit_client_list_loras(dit_client *c, const dit_call_opts *co,
                                   Ditserve__V1__ListLorasResponse **out, dit_rpc_status *st)
{
    Ditserve__V1__ListLorasRequest req = DITSERVE__V1__LIST_LORAS_REQUEST__INIT;
    return unary(c, "/ditserve.v1.Generation/ListLoras", true, &req.base,
                 &ditserve__v1__list_loras_response__descriptor, co, (ProtobufCMessage **)out, st);
}

dit_rpc_code dit_client_lora_op(dit_client *c, bool load, const char *name, const dit_call_opts *co,
                                char *text, size_t cap, dit_rpc_status *st)
{
    ProtobufCMessage *resp = NULL;
    dit_rpc_code code;
    text[0] = '\0';
    if (load) {
        Ditserve__V1__LoadLoraRequest req = DITSERVE__V1__LOAD_LORA_REQUEST__INIT;
        req.name = (char *)name;
        code = unary(c, "/ditserve.v1.Generation/LoadLora", true, &req.base,
                     &ditserve__v1__load_lora_response__descriptor, co, &resp, st);
        const Ditserve__V1__LoadLoraResponse *r = (const void *)resp;
        if (r && r->lora)
            snprintf(text, cap, "loaded %s (%lld bytes) in %.1f ms", name,
                     (long long)r->lora->bytes, r->elapsed_ms);
    } else {
        Ditserve__V1__UnloadLoraRequest req = DITSERVE__V1__UNLOAD_LORA_REQUEST__INIT;
        req.name = (char *)name;
        code = unary(c, "/ditserve.v1.Generation/UnloadLora", true, &req.base,
                     &ditserve__v1__unload_lora_response__descriptor, co, &resp, st);
        const Ditserve__V1__UnloadLoraResponse *r = (const void *)resp;
        if (r)
            snprintf(text, cap, "%s %s", r->was_loaded ? "unloaded" : "was not loaded:", name);
    }
    if (resp)
        protobuf_c_message_free_unpacked(resp, NULL);
    return code;
}

dit_rpc_code dit_client_warmup(dit_client *c, const char *model, int width, int height, int frames,
                               int steps, const dit_call_opts *co,
                               Ditserve__V1__WarmupResponse **out, dit_rpc_status *st)
{
    Ditserve__V1__WarmupRequest req = DITSERVE__V1__WARMUP_REQUEST__INIT;
    if (model)
        req.model = (char *)model;
    req.width = width;
    req.height = height;
    req.num_frames = frames;
    req.num_inference_steps = steps;
    Ditserve__V1__WarmupResponse *resp = NULL;
    dit_rpc_code code =
        unary(c, "/ditserve.v1.Generation/Warmup", true, &req.base,
              &ditserve__v1__warmup_response__descriptor, co, (ProtobufCMessage **)&resp, st);
    if (out)
        *out = resp;
    else if (resp)
        ditserve__v1__warmup_response__free_unpacked(resp, NULL);
    return code;
}

/* ------------------------------------------------------------------------ */
/* Generate */

void dit_gen_output_free(dit_gen_output *o)
{
    if (!o)
        return;
    free(o->request_id);
    if (o->result)
        ditserve__v1__result__free_unpacked(o->result, NULL);
    free(o->data);
    memset(o, 0, sizeof *o);
}

typedef struct assembly {
    uint8_t *data;
    size_t size, cap;
    int image;          /* the image_index being received */
    size_t image_start; /* where its bytes begin in data */
} assembly;

/* Result.image_bytes, when it splits the result, must be sizes that add up
 * to the bytes received: a caller writes each image from its offset. */
static bool image_sizes_ok(rpc *r, const Ditserve__V1__Result *res, size_t received)
{
    uint64_t sum = 0;
    for (size_t m = 0; m < res->n_image_bytes; m++) {
        if (res->image_bytes[m] < 0 || (uint64_t)res->image_bytes[m] > received) {
            rpc_fail(r, DIT_RPC_DATA_LOSS, "client: the Result's image %zu has %lld bytes", m,
                     (long long)res->image_bytes[m]);
            return false;
        }
        sum += (uint64_t)res->image_bytes[m]; /* each at most received: no overflow */
    }
    if (res->n_image_bytes > 0 && sum != received) {
        rpc_fail(r, DIT_RPC_DATA_LOSS,
                 "client: the Result's %zu images come to %llu bytes, %zu "
                 "arrived",
                 res->n_image_bytes, (unsigned long long)sum, received);
        return false;
    }
    return true;
}

/* Appends one chunk. Chunks must arrive in order and without gaps, image
 * after image (offsets within each image): the daemon sends them that way,
 * and anything else means lost bytes. The images' bytes are kept one after
 * another; Result.image_bytes splits them. */
static bool assemble(rpc *r, assembly *a, Ditserve__V1__ResultChunk *ch)
{
    if (ch->image_index == a->image + 1 && ch->offset == 0) {
        a->image++;
        a->image_start = a->size;
    }
    if (ch->image_index != a->image) {
        rpc_fail(r, DIT_RPC_DATA_LOSS, "client: result chunk of image %d, expected image %d",
                 (int)ch->image_index, a->image);
        return false;
    }
    if (ch->offset < 0 || (uint64_t)ch->offset != a->size - a->image_start) {
        rpc_fail(r, DIT_RPC_DATA_LOSS, "client: result chunk at offset %lld, expected %zu",
                 (long long)ch->offset, a->size - a->image_start);
        return false;
    }
    size_t n = ch->data.len;
    if (n > DIT_CLIENT_MAX_RESULT_BYTES - a->size) {
        rpc_fail(r, DIT_RPC_DATA_LOSS, "client: result larger than %zu bytes",
                 DIT_CLIENT_MAX_RESULT_BYTES);
        return false;
    }
    if (!a->data && n) {
        /* The first chunk's bytes become the assembly as they are (an image
         * of one chunk is never copied): protobuf-c allocated them on their
         * own, with malloc, and frees them with the event unless taken. */
        a->data = ch->data.data;
        a->size = a->cap = n;
        ch->data.data = NULL;
        ch->data.len = 0;
        return true;
    }
    if (a->size + n > a->cap) {
        size_t cap = a->cap ? a->cap : 1 << 16;
        while (cap < a->size + n)
            cap *= 2;
        uint8_t *p = realloc(a->data, cap);
        if (!p) {
            rpc_fail(r, DIT_RPC_INTERNAL, "client: out of memory for a %zu-byte result", cap);
            return false;
        }
        a->data = p;
        a->cap = cap;
    }
    if (n)
        memcpy(a->data + a->size, ch->data.data, n);
    a->size += n;
    return true;
}

dit_rpc_code dit_client_generate(dit_client *c, const Ditserve__V1__GenerateRequest *req,
                                 const dit_gen_callbacks *cb, const dit_call_opts *co,
                                 dit_gen_output *out, dit_rpc_status *st)
{
    static const dit_gen_callbacks no_callbacks = {0};
    if (!cb)
        cb = &no_callbacks;
    dit_gen_output res;
    memset(&res, 0, sizeof res);
    assembly asm_buf = {0};
    rpc r;
    rpc_start(&r, c, "/ditserve.v1.Generation/Generate", true, &req->base, co);

    grpc_byte_buffer *bb;
    while ((bb = rpc_recv(&r))) {
        Ditserve__V1__GenerateEvent *ev =
            (void *)unpack_message(bb, &ditserve__v1__generate_event__descriptor);
        grpc_byte_buffer_destroy(bb);
        if (!ev) {
            rpc_fail(&r, DIT_RPC_INTERNAL, "%s", "client: cannot decode a GenerateEvent");
            break;
        }
        if (!res.request_id && ev->request_id && ev->request_id[0])
            res.request_id = strdup(ev->request_id);
        const char *rid = res.request_id ? res.request_id : "";
        int stop = 0;
        switch (ev->event_case) {
        case DITSERVE__V1__GENERATE_EVENT__EVENT_QUEUED:
            if (cb->queued)
                stop = cb->queued(cb->user, rid, ev->queued->position, ev->queued->queue_depth);
            break;
        case DITSERVE__V1__GENERATE_EVENT__EVENT_STARTED:
            if (cb->started)
                stop = cb->started(cb->user, rid, ev->started->queue_ms);
            break;
        case DITSERVE__V1__GENERATE_EVENT__EVENT_PROGRESS: {
            const char *stage = ev->progress->stage;
            if (stage && stage[0] && strcmp(stage, "denoising") != 0) {
                if (cb->stage)
                    stop = cb->stage(cb->user, rid, stage, ev->progress->elapsed_ms);
            } else if (cb->progress) {
                stop = cb->progress(cb->user, rid, ev->progress->step, ev->progress->total_steps,
                                    ev->progress->elapsed_ms);
            }
            break;
        }
        case DITSERVE__V1__GENERATE_EVENT__EVENT_CHUNK:
            if (!assemble(&r, &asm_buf, ev->chunk))
                break;
            if (cb->chunk)
                stop = cb->chunk(cb->user, rid, asm_buf.size);
            break;
        case DITSERVE__V1__GENERATE_EVENT__EVENT_RESULT:
            if (res.result) {
                rpc_fail(&r, DIT_RPC_INTERNAL, "%s", "client: a second Result event");
                break;
            }
            /* Detach the Result from the event: protobuf-c allocates every
             * sub-message separately, so it can be freed on its own. */
            res.result = ev->result;
            ev->event_case = DITSERVE__V1__GENERATE_EVENT__EVENT__NOT_SET;
            ev->result = NULL;
            if (res.result->total_bytes < 0 || (uint64_t)res.result->total_bytes != asm_buf.size) {
                rpc_fail(&r, DIT_RPC_DATA_LOSS, "client: Result announces %lld bytes, %zu arrived",
                         (long long)res.result->total_bytes, asm_buf.size);
                break;
            }
            if (!image_sizes_ok(&r, res.result, asm_buf.size))
                break;
            if (cb->result)
                stop = cb->result(cb->user, rid, res.result, asm_buf.data, asm_buf.size);
            break;
        case DITSERVE__V1__GENERATE_EVENT__EVENT__NOT_SET:
        default:
            /* An event type newer than this client: skip it. */
            break;
        }
        ditserve__v1__generate_event__free_unpacked(ev, NULL);
        if (r.local_code != DIT_RPC_OK)
            break;
        if (stop)
            rpc_cancel(&r, "client: cancelled by the caller");
    }

    dit_rpc_code code = rpc_finish(&r, st);
    res.latency_ms = now_ms() - r.t0_ms;
    if (code == DIT_RPC_OK && !res.result)
        code =
            set_status(st, DIT_RPC_DATA_LOSS, "%s", "client: the stream ended OK without a Result");
    res.data = asm_buf.data;
    res.size = asm_buf.size;
    if (out)
        *out = res;
    else
        dit_gen_output_free(&res);
    return code;
}
