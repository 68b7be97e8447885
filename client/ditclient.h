/* ditclient: a small C client for ditd's public gRPC API (ditserve.v1.Generation
 * and grpc.health.v1.Health), on the gRPC C core.
 *
 * Requests and responses are the protobuf-c messages generated from
 * proto/ditserve/v1/generation.proto, so every field the API has is reachable
 * without a parallel set of C structs. Responses returned to the caller are
 * unpacked with protobuf-c's default allocator; free them with the matching
 * `ditserve__v1__*__free_unpacked(msg, NULL)`.
 *
 * Errors are gRPC status codes (dit_rpc_code, numerically equal to
 * grpc_status_code) with the server's details. Failures found by the client
 * itself use the same space so that callers handle one kind of error: an
 * undecodable message is INTERNAL, a broken result stream (a gap between
 * chunks, a size that disagrees with Result.total_bytes) is DATA_LOSS, a
 * cancellation from the caller is CANCELLED; their details start "client: ".
 *
 * Threads: a dit_client is safe to use from several threads at once, one call
 * per thread at a time; calls share the channel (one HTTP/2 connection) and
 * each call runs on a completion queue of its own. A single shared pluck
 * queue would cap concurrent callers at GRPC_MAX_COMPLETION_QUEUE_PLUCKERS
 * (6), and a `next` queue would need a dispatcher thread; a queue per call
 * costs one small allocation next to a multi-second generation. Callbacks run
 * on the thread that made the call.
 *
 * Owner: whoever opened the client closes it, after every call on it has
 * returned. */
#ifndef DIT_CLIENT_DITCLIENT_H
#define DIT_CLIENT_DITCLIENT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ditserve_v1_generation.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* gRPC status codes, by the numbers every gRPC implementation uses. */
typedef enum dit_rpc_code {
    DIT_RPC_OK = 0,
    DIT_RPC_CANCELLED = 1,
    DIT_RPC_UNKNOWN = 2,
    DIT_RPC_INVALID_ARGUMENT = 3,
    DIT_RPC_DEADLINE_EXCEEDED = 4,
    DIT_RPC_NOT_FOUND = 5,
    DIT_RPC_ALREADY_EXISTS = 6,
    DIT_RPC_PERMISSION_DENIED = 7,
    DIT_RPC_RESOURCE_EXHAUSTED = 8,
    DIT_RPC_FAILED_PRECONDITION = 9,
    DIT_RPC_ABORTED = 10,
    DIT_RPC_OUT_OF_RANGE = 11,
    DIT_RPC_UNIMPLEMENTED = 12,
    DIT_RPC_INTERNAL = 13,
    DIT_RPC_UNAVAILABLE = 14,
    DIT_RPC_DATA_LOSS = 15,
    DIT_RPC_UNAUTHENTICATED = 16,
    DIT_RPC_CODE_COUNT
} dit_rpc_code;

/* "OK", "CANCELLED", ..., "UNAUTHENTICATED"; "UNKNOWN" for a number outside
 * the table (a server may send one). Never NULL. */
const char *dit_rpc_code_name(int code);

#define DIT_RPC_DETAILS_MAX 512

/* The outcome of a call: the final status and its details (the server's
 * message, or the client's when it failed locally), truncated to fit. */
typedef struct dit_rpc_status {
    dit_rpc_code code;
    char details[DIT_RPC_DETAILS_MAX];
} dit_rpc_status;

typedef struct dit_client dit_client;

typedef struct dit_client_opts {
    const char *target;    /* "host:port" or any gRPC target URI; NULL: 127.0.0.1:50051;
                            * a host without a port gets ditd's 50051 (see below) */
    bool tls;              /* TLS with the system roots; implied by ca_file or cert_file */
    const char *ca_file;   /* PEM roots to verify the server with */
    const char *cert_file; /* PEM client certificate chain for mTLS; needs key_file */
    const char *key_file;  /* PEM private key of cert_file */
    const char *token;     /* sent as "authorization: Bearer <token>" except to Health */
    double timeout_s;      /* deadline of every call that does not set its own; 0: none */
} dit_client_opts;

/* ditd's port, which a target without one gets (gRPC itself would dial 443). */
#define DIT_CLIENT_DEFAULT_PORT 50051

/* Writes `target` with DIT_CLIENT_DEFAULT_PORT added when it names a host
 * and no port: "localhost" -> "localhost:50051", "::1" and "[::1]" ->
 * "[::1]:50051", "dns:///host" -> "dns:///host:50051". Targets with a
 * port, and unix:, unix-abstract:, vsock:, ipv4: and ipv6: URIs, are
 * copied as they are. Returns false when out (cap bytes) is too small. */
bool dit_client_target_with_port(const char *target, char *out, size_t cap);

/* Sets up the channel; it connects lazily, on the first call, so a wrong
 * target shows up as UNAVAILABLE there. Fails (INVALID_ARGUMENT, with the
 * reason in st) only on unusable options or unreadable PEM files. */
dit_rpc_code dit_client_open(const dit_client_opts *opts, dit_client **out, dit_rpc_status *st);
void dit_client_close(dit_client *c);
const char *dit_client_target(const dit_client *c);

/* Per-call options; a NULL pointer means all defaults. */
#define DIT_TIMEOUT_NONE (-1.0)
typedef struct dit_call_opts {
    /* Seconds until the call's deadline; 0: the client's timeout_s;
     * DIT_TIMEOUT_NONE: no deadline even when the client has one. */
    double timeout_s;
    /* When not NULL and it becomes nonzero, the call is cancelled and ends
     * with CANCELLED. It is polled every 100 ms and between events, so it
     * may be set from another thread or from a signal handler (an atomic
     * store is async-signal-safe where the type is lock-free, as int is). */
    const atomic_int *cancel;
} dit_call_opts;

/* grpc.health.v1 serving states. */
typedef enum dit_health {
    DIT_HEALTH_UNKNOWN = 0,
    DIT_HEALTH_SERVING = 1,
    DIT_HEALTH_NOT_SERVING = 2,
    DIT_HEALTH_SERVICE_UNKNOWN = 3,
} dit_health;

/* "UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN". */
const char *dit_health_name(dit_health h);

/* Health.Check for `service` ("" or NULL: the server as a whole). *out is set
 * only when the call succeeds. */
dit_rpc_code dit_client_health(dit_client *c, const char *service, const dit_call_opts *co,
                               dit_health *out, dit_rpc_status *st);

/* GetServerInfo; *out is the caller's (ditserve__v1__server_info__free_unpacked). */
dit_rpc_code dit_client_server_info(dit_client *c, const dit_call_opts *co,
                                    Ditserve__V1__ServerInfo **out, dit_rpc_status *st);

/* ListModels; *out is the caller's (ditserve__v1__list_models_response__free_unpacked). */
dit_rpc_code dit_client_list_models(dit_client *c, const dit_call_opts *co,
                                    Ditserve__V1__ListModelsResponse **out, dit_rpc_status *st);

/* ListLoras; *out is the caller's (ditserve__v1__list_loras_response__free_unpacked). */
dit_rpc_code dit_client_list_loras(dit_client *c, const dit_call_opts *co,
                                   Ditserve__V1__ListLorasResponse **out, dit_rpc_status *st);

/* LoadLora (load true) or UnloadLora of adapter `name`; *text (cap bytes)
 * says what the daemon answered. */
dit_rpc_code dit_client_lora_op(dit_client *c, bool load, const char *name, const dit_call_opts *co,
                                char *text, size_t cap, dit_rpc_status *st);

/* Warmup with the given shape (0s: the server's defaults; frames for video
 * models; model NULL or "": the only model). *out (may be NULL to discard)
 * is the caller's (ditserve__v1__warmup_response__free_unpacked). */
dit_rpc_code dit_client_warmup(dit_client *c, const char *model, int width, int height, int frames,
                               int steps, const dit_call_opts *co,
                               Ditserve__V1__WarmupResponse **out, dit_rpc_status *st);

/* Generate's events as they arrive. Every member may be NULL. A callback that
 * returns nonzero cancels the call (it then ends with CANCELLED). The request
 * id is the one the server echoed (it makes one up when the request had
 * none). */
typedef struct dit_gen_callbacks {
    void *user;
    int (*queued)(void *user, const char *request_id, int position, int queue_depth);
    int (*started)(void *user, const char *request_id, double queue_ms);
    int (*progress)(void *user, const char *request_id, int step, int total_steps,
                    double elapsed_ms);
    /* After each ResultChunk was placed: bytes assembled so far. */
    int (*chunk)(void *user, const char *request_id, size_t received);
    /* The final Result, with the assembled bytes (valid during the call). */
    int (*result)(void *user, const char *request_id, const Ditserve__V1__Result *result,
                  const uint8_t *data, size_t size);
    /* A Progress event that marks a stage other than denoising (today
     * "decoding": the VAE started after the last step). `progress` above
     * sees only the denoising steps. */
    int (*stage)(void *user, const char *request_id, const char *stage, double elapsed_ms);
} dit_gen_callbacks;

/* What a Generate call produced. Members stay NULL / 0 for parts that never
 * arrived, so a failed call may still report the request id or a Result
 * (when the status failed after it). Free with dit_gen_output_free. */
typedef struct dit_gen_output {
    char *request_id;             /* NULL when no event arrived */
    Ditserve__V1__Result *result; /* the Result event, or NULL */
    uint8_t *data;                /* the ResultChunks assembled: PNG bytes or the raw tensor */
    size_t size;
    double latency_ms; /* call start to final status, on the client's monotonic clock */
} dit_gen_output;

void dit_gen_output_free(dit_gen_output *o);

/* The most result bytes the client assembles before failing with DATA_LOSS;
 * a 4096 x 4096 f32 raw tensor is 192 MiB. */
#define DIT_CLIENT_MAX_RESULT_BYTES ((size_t)1 << 30)

/* Generate: sends `req` and handles the stream one message at a time,
 * calling `cb` (may be NULL) per event and assembling the chunks. Returns OK
 * only when the server ended the stream with OK after a Result whose
 * total_bytes equals the bytes received. `out` may be NULL to discard. */
dit_rpc_code dit_client_generate(dit_client *c, const Ditserve__V1__GenerateRequest *req,
                                 const dit_gen_callbacks *cb, const dit_call_opts *co,
                                 dit_gen_output *out, dit_rpc_status *st);

#ifdef __cplusplus
}
#endif

#endif
