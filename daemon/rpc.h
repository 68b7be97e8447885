/* The gRPC server (gRPC C core), bridged to the libuv loop.
 *
 * One thread blocks in grpc_completion_queue_next and hands each completed
 * operation ({tag, ok}) to the loop through a mutex-protected list and
 * uv_async_send; the loop runs every handler and starts every batch. So all
 * call state belongs to the loop thread, as does everything the handlers
 * touch.
 *
 * Each registered method keeps several calls requested at all times; unknown
 * methods answer UNIMPLEMENTED at once. Every call sends initial metadata
 * with its first message or its status, has its RECV_CLOSE_ON_SERVER
 * pending from the start (that is how client cancellation and deadlines
 * arrive), sends one message batch at a time from a queue, and is freed only
 * when its status went out (or it was cancelled) and every batch completed.
 *
 * Owner: the loop thread (except the completion-queue thread's queue). */
#ifndef DIT_DAEMON_RPC_H
#define DIT_DAEMON_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>
#include <uv.h>

#include "core/status.h"
#include "log.h"

typedef struct dit_rpc_server dit_rpc_server;
typedef struct dit_rpc_call dit_rpc_call;

typedef enum dit_rpc_kind {
    DIT_RPC_UNARY,         /* one request, one response */
    DIT_RPC_SERVER_STREAM, /* one request, many responses */
    DIT_RPC_BIDI_STREAM,   /* many requests, many responses */
} dit_rpc_kind;

/* Streams (calls) one HTTP/2 connection may have open at once. */
#define DIT_RPC_MAX_STREAMS 256

typedef struct dit_rpc_method {
    const char *path; /* "/package.Service/Method" */
    dit_rpc_kind kind;
    bool public_auth; /* false: needs the bearer token when one is configured */
    /* A new call. For unary and server-streaming methods `req` holds the
     * request message (NULL with len 0 when the client sent none); for bidi
     * methods it is NULL and messages arrive through on_message. */
    void (*on_call)(void *ctx, dit_rpc_call *call, const uint8_t *req, size_t len);
    /* Bidi only: the next message, or NULL when the client half-closed. */
    void (*on_message)(void *ctx, dit_rpc_call *call, const uint8_t *msg, size_t len);
    /* The client cancelled, the deadline passed, or the server cancelled all
     * calls, before the handler finished the call. The handler must call
     * dit_rpc_call_finish (any status) to let the call go. */
    void (*on_cancel)(void *ctx, dit_rpc_call *call);
    void *ctx;
    /* The largest request message this method takes, in bytes (0: the
     * server's --max-message-bytes). Larger ones are refused with
     * RESOURCE_EXHAUSTED before they are read: a small request that
     * protobuf-c would unpack into many unknown fields costs dozens of
     * times its size. */
    int64_t max_request_bytes;
} dit_rpc_method;

typedef struct dit_rpc_config {
    const char *listen;
    int64_t max_message_bytes;
    int64_t max_connection_age_s;
    /* TLS: PEM files; cert and key turn TLS on, ca additionally requires and
     * verifies client certificates. NULL: plaintext. */
    const char *tls_cert, *tls_key, *tls_client_ca;
    /* Bearer token required on methods without public_auth; NULL: none. */
    const char *auth_token;
    const dit_log *log;
    /* Optional, loop thread: a call answered here before its method's
     * handler saw it (a missing or wrong token, no or an unreadable request
     * message), so that the server counts and logs it like the refusals its
     * handlers make. */
    void (*refused)(void *ctx, const char *path, grpc_status_code code, const char *why);
    void *refused_ctx;
} dit_rpc_config;

dit_status dit_rpc_server_create(uv_loop_t *loop, const dit_rpc_config *cfg,
                                 const dit_rpc_method *methods, int n_methods, dit_rpc_server **out,
                                 int *bound_port, dit_diag *diag);

/* Stops accepting calls; `done` runs on the loop once every call has ended
 * (dit_rpc_server_cancel_all hurries that along). */
void dit_rpc_server_shutdown(dit_rpc_server *s, void (*done)(void *ctx), void *ctx);
void dit_rpc_server_cancel_all(dit_rpc_server *s);

/* After shutdown's `done`: stops the completion-queue thread and frees. */
void dit_rpc_server_destroy(dit_rpc_server *s);

/* Per call, loop thread only. Messages are copied. */
void dit_rpc_call_send(dit_rpc_call *c, const uint8_t *msg, size_t len);
/* The same for a protobuf message, packed straight into the buffer gRPC
 * sends (one copy of a result chunk instead of two). */
void dit_rpc_call_send_message(dit_rpc_call *c, const ProtobufCMessage *msg);
/* One message made of `head` (copied) and then `len` bytes at `data`, which
 * are not copied: gRPC sends them from where they lie and, once done with
 * them, calls release(ctx), on whichever thread drops them (the loop's or
 * one of gRPC's). release runs exactly once, also when nothing is sent (a
 * call already over). */
void dit_rpc_call_send_parts(dit_rpc_call *c, const uint8_t *head, size_t head_len,
                             const uint8_t *data, size_t len, void (*release)(void *), void *ctx);
/* Ends the call with a status after the queued messages. At most once. */
void dit_rpc_call_finish(dit_rpc_call *c, grpc_status_code code, const char *details);
/* Bidi: ask for the next message (on_message fires when it arrives). */
void dit_rpc_call_read(dit_rpc_call *c);

/* The status the call was finished with (OK before that), and its details
 * (valid while the handler runs). */
grpc_status_code dit_rpc_call_code(const dit_rpc_call *c, const char **details);

void dit_rpc_call_set_user(dit_rpc_call *c, void *user);
void *dit_rpc_call_user(const dit_rpc_call *c);

/* Milliseconds until the client's deadline (a large number when none). */
double dit_rpc_call_deadline_ms(const dit_rpc_call *c);
bool dit_rpc_call_cancelled(const dit_rpc_call *c);
/* The client's address as gRPC reports it (freed with the call). */
const char *dit_rpc_call_peer(dit_rpc_call *c);

/* Bytes of messages queued on this call's connection (every call of it)
 * that the client has not taken yet: a client that stops reading leaves
 * them here, held back by HTTP/2 flow control. */
int64_t dit_rpc_call_conn_unsent(dit_rpc_call *c);
/* The same over every connection. */
int64_t dit_rpc_server_unsent(const dit_rpc_server *s);
/* Calls finished whose status has not gone out yet (a drain waits for
 * them before it closes the server). */
int64_t dit_rpc_server_statuses_pending(const dit_rpc_server *s);

/* gRPC's canonical status name ("INVALID_ARGUMENT"). */
const char *dit_rpc_status_name(grpc_status_code code);

#endif
