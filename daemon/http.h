/* The HTTP front end: an OpenAI-compatible images API (with streamed
 * progress as server-sent events), the models list, health, and the
 * playground page, served by libmicrohttpd from inside ditd. Requests go
 * to the same server, queue, limits and logs as gRPC's (dit_server_submit),
 * never to a second process.
 *
 * Threads: libmicrohttpd runs one thread per connection (bounded by
 * max_connections), which reads and checks the request, hands it to the
 * loop through a mutex-protected list and uv_async_send, and then waits on
 * the request's condition variable for what the loop reports (events,
 * the result, the end), watching its socket so that a client that leaves
 * cancels its jobs. Only the loop touches the server and the jobs; each
 * request's shared state is behind its own mutex.
 *
 * Owner: main creates it after the server and closes it on the loop
 * (dit_http_close) before the loop ends; dit_http_destroy, after the loop,
 * stops the connection threads and frees. */
#ifndef DIT_DAEMON_HTTP_H
#define DIT_DAEMON_HTTP_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "core/status.h"
#include "log.h"

struct dit_server;
typedef struct dit_http dit_http;

typedef struct dit_http_config {
    const char *listen;     /* HOST:PORT (":PORT" every interface; port 0 picks one) */
    const char *model_name; /* the served model's id in /v1/models */
    const char *auth_token; /* bearer token for the API; NULL: none */
    /* TLS with this PEM certificate chain and key; NULL: plain HTTP. With
     * tls_client_ca, every request must come with a client certificate
     * signed by those roots (mutual TLS, as on gRPC). */
    const char *tls_cert, *tls_key, *tls_client_ca;
    const char *cors_origins;          /* comma-separated origins, or "*"; NULL: no CORS */
    int64_t max_body_bytes;            /* request bodies past this: 413 */
    int max_connections;               /* open connections at most */
    double idle_timeout_s;             /* a connection silent this long is closed */
    double request_timeout_s;          /* headers and body must arrive within this */
    int default_width, default_height; /* what "size": "auto" means */
    /* The served model: its task's name for /v1/models, and for a video
     * model (/v1/videos) its default frames and rate and the step
     * num_frames - 1 is a multiple of. */
    const char *task;
    bool video;
    int default_num_frames, default_fps, frame_step;
    /* /v1/videos' job store: jobs held at most (any state), finished MP4
     * bytes held at most, and how long a finished job stays. */
    int video_jobs;
    int64_t video_bytes;
    double video_retention_s;
    const dit_log *log;
} dit_http_config;

/* Starts listening. *bound_port gets the port (the chosen one for 0). */
dit_status dit_http_create(uv_loop_t *loop, struct dit_server *srv, const dit_http_config *cfg,
                           dit_http **out, int *bound_port, dit_diag *diag);

/* The server's health hook (dit_server.health_changed): /health answers
 * 200 only while serving. */
void dit_http_set_serving(void *ctx, bool serving);

/* The server's mesh hook (dit_server.meshes_changed): each mesh's state
 * ("ready", "warming_up", "restarting", ...), listed by /health. */
#define DIT_HTTP_MAX_MESHES 16
void dit_http_set_meshes(void *ctx, int n, const char *const *states);

/* Bytes of finished results the front end holds for clients that have not
 * read them yet (dit_server.front_held; any thread). */
int64_t dit_http_held_bytes(void *ctx);

/* Loop thread, when the daemon is done serving: new generations get 503
 * and the loop handle closes (the loop can end). */
void dit_http_close(dit_http *h);

/* After the loop ended: waits a little for responses still being written,
 * stops every connection thread and frees. NULL-safe. */
void dit_http_destroy(dit_http *h);

#endif
