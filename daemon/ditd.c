/* ditd: the ditserve daemon. Parses the settings, checks the model, starts
 * the worker mesh and the gRPC server on one libuv loop, and drains on
 * SIGTERM/SIGINT. */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <uv.h>

#include "config.h"
#include "core/cli_util.h"
#include "http.h"
#include "log.h"
#include "model_info.h"
#include "parallel/mesh.h"
#include "reflection.h"
#include "serve/request.h"
#include "rpc.h"
#include "server.h"
#include "supervisor.h"

extern const uint8_t dit_descriptor_set[];
extern const size_t dit_descriptor_set_len;

/* Workers get this long to exit after the mesh is told to stop. */
#define STOP_GRACE_S 5.0
/* How often the drain checks whether accepted work is done. */
#define DRAIN_POLL_MS 100

typedef struct daemon_state {
    uv_loop_t loop;
    dit_daemon_config cfg;
    dit_server srv;
    dit_http *http; /* NULL: no --http-listen */
    uv_signal_t sigterm, sigint;
    uv_timer_t drain_timer;
    uint64_t drain_started_ms;
    int signals;
    bool aborted;     /* the drain timeout passed */
    bool rpc_closing; /* the gRPC server is shutting down */
    bool rpc_done;    /* every call ended */
    bool stopping;    /* the mesh was told to stop */
    bool mesh_stopped;
    bool handles_up; /* sigterm, sigint, drain_timer initialised */
    int exit_code;
} daemon_state;

/* The ditworker binary: --worker, else next to ditd (installed), else the
 * build tree's worker folder. */
static dit_status find_worker(const char *given, char *out, size_t cap, dit_diag *diag)
{
    if (given) {
        if (access(given, X_OK) != 0)
            return dit_diag_set(diag, DIT_ERR_NOT_FOUND, "--worker %s is not an executable file",
                                given);
        snprintf(out, cap, "%s", given);
        return DIT_OK;
    }
    char self[PATH_MAX];
    size_t n = sizeof self;
    if (uv_exepath(self, &n) != 0)
        return dit_diag_set(diag, DIT_ERR_NOT_FOUND, "cannot find ditd's own path; pass --worker");
    char *slash = strrchr(self, '/');
    if (slash)
        *slash = '\0';
    const char *suffixes[] = {"/ditworker", "/../worker/ditworker"};
    for (size_t i = 0; i < sizeof suffixes / sizeof *suffixes; i++) {
        const size_t a = strlen(self), b = strlen(suffixes[i]);
        if (a + b + 1 > cap)
            continue;
        memcpy(out, self, a);
        memcpy(out + a, suffixes[i], b + 1);
        if (access(out, X_OK) == 0)
            return DIT_OK;
    }
    return dit_diag_set(diag, DIT_ERR_NOT_FOUND,
                        "no ditworker next to ditd (%s) or in the build tree; pass --worker PATH",
                        self);
}

/* --warmup WxH:STEPS must name a shape this model and mesh can run. */
static dit_status check_warmup(const dit_daemon_config *cfg, const dit_pipeline_info *info,
                               dit_diag *diag)
{
    int w = 0, h = 0, frames = 0, steps = 0;
    if (dit_warmup_spec_parse(cfg->warmup, &w, &h, &frames, &steps) != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "--warmup wants WIDTHxHEIGHT:STEPS (e.g. 256x256:2) or, for video, "
                            "WIDTHxHEIGHTxFRAMES:STEPS (e.g. 832x480x81:1), not '%s'",
                            cfg->warmup);
    Ditserve__V1__GenerateRequest r = DITSERVE__V1__GENERATE_REQUEST__INIT;
    r.prompt = "warm-up";
    r.width = w;
    r.height = h;
    r.num_frames = frames;
    r.num_inference_steps = steps;
    dit_status st = dit_request_validate(&r, info, diag);
    if (st == DIT_OK)
        st = dit_request_validate_mesh(&r, info, &cfg->pc, diag);
    char limit[DIT_DIAG_MAX];
    if (st == DIT_OK && !dit_server_size_ok(cfg, info, &r, limit, sizeof limit))
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s", limit);
    if (st != DIT_OK) /* dit_diag_set keeps the first message: prefix it */
        dit_diag_prefix(diag, "--warmup %s: ", cfg->warmup);
    return st;
}

/* What ListModels and GetServerInfo say about the probed pipeline, in the
 * family-neutral terms of model_info.h: everything comes from the probe
 * (pipelines/probe.h), so another pipeline class needs nothing here. */
static void describe_pipeline(const dit_pipeline_info *info, const dit_daemon_config *cfg,
                              dit_model_info *m)
{
    const dit_transformer_info *t = &info->transformer;
    *m = (dit_model_info){0};
    m->pipeline_class = info->class_name;
    m->transformer_class = t->class_name;
    m->task = info->task && strcmp(info->task, "text-to-video") == 0 ? DIT_TASK_TEXT_TO_VIDEO
                                                                     : DIT_TASK_TEXT_TO_IMAGE;
    m->has_text_encoders = info->has_text_encoders;
    m->default_width = info->default_width;
    m->default_height = info->default_height;
    m->default_steps = info->default_steps;
    m->default_num_frames = info->default_frames;
    m->default_fps = info->default_fps;
    /* One token per size_multiple x size_multiple pixels (VAE factor x patch). */
    m->size_multiple = info->size_multiple;
    m->pixels_per_token = info->size_multiple;
    dit_model_info_set_layout(m, &cfg->pc);
    m->max_pixels = cfg->max_pixels;
    m->max_steps = 1000;
    m->max_sequence_length = info->default_max_sequence_length;
    m->frame_step = info->frame_step; /* 0: images only */
    for (int i = 0; i < info->n_config; i++)
        dit_model_info_add_config(m, info->config[i].key, info->config[i].value);
}

/* The bearer token: the file's first line, at least 16 bytes. */
static dit_status read_token(const char *path, char *out, size_t cap, dit_diag *diag)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return dit_diag_set(diag, DIT_ERR_IO, "cannot read --auth-token-file %s", path);
    const bool got = fgets(out, (int)cap, f) != NULL;
    /* A first line that does not fit is refused, not cut: clients send all
     * of it. */
    bool whole = !got || strchr(out, '\n');
    if (!whole) {
        const int next = fgetc(f);
        whole = next == EOF || next == '\n' || next == '\r';
    }
    fclose(f);
    if (!got)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "--auth-token-file %s is empty", path);
    if (!whole)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "the token in %s is longer than %zu characters", path, cap - 1);
    out[strcspn(out, "\r\n")] = '\0';
    if (strlen(out) < 16)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "the token in %s is shorter than 16 characters", path);
    return DIT_OK;
}

static dit_status read_secret(const char *path, dit_join_secret **out, dit_diag *diag)
{
    *out = malloc(sizeof **out);
    if (!*out)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    dit_status st = dit_join_secret_read(path, *out, diag);
    if (st != DIT_OK) {
        free(*out);
        *out = NULL;
        char msg[512];
        snprintf(msg, sizeof msg, "%s", dit_diag_msg(diag));
        return dit_diag_set(diag, st, "--join-secret-file: %s", msg);
    }
    return DIT_OK;
}

/* Once every call has ended and every worker is gone: close what main
 * owns and let the loop run dry. */
static void maybe_finish(daemon_state *d)
{
    if (!d->mesh_stopped || (d->srv.rpc && !d->rpc_done))
        return;
    DIT_LOG(&d->cfg.log, DIT_LOG_INFO, "main", "workers stopped, calls ended; exiting");
    dit_http_close(d->http);
    uv_handle_t *own[] = {(uv_handle_t *)&d->sigterm, (uv_handle_t *)&d->sigint,
                          (uv_handle_t *)&d->drain_timer};
    for (size_t i = 0; d->handles_up && i < sizeof own / sizeof *own; i++)
        if (!uv_is_closing(own[i]))
            uv_close(own[i], NULL);
    if (d->srv.rpc) {
        dit_rpc_server_destroy(d->srv.rpc);
        d->srv.rpc = NULL;
    }
    dit_server_destroy_meshes(&d->srv);
}

static void on_mesh_stopped(void *ctx)
{
    daemon_state *d = ctx;
    d->mesh_stopped = true;
    maybe_finish(d);
}

static void stop_mesh(daemon_state *d)
{
    if (d->stopping)
        return;
    d->stopping = true;
    uv_timer_stop(&d->drain_timer);
    dit_server_stop_meshes(&d->srv, STOP_GRACE_S, on_mesh_stopped, d);
}

static void on_rpc_done(void *ctx)
{
    daemon_state *d = ctx;
    d->rpc_done = true;
    DIT_LOG(&d->cfg.log, DIT_LOG_INFO, "main", "every call has ended");
    stop_mesh(d);
    maybe_finish(d);
}

/* Closes the gRPC server: GOAWAY to clients, every open stream (health
 * watches, reflection) ended, then on_rpc_done. */
static void close_rpc(daemon_state *d)
{
    if (!d->rpc_closing) {
        d->rpc_closing = true;
        dit_rpc_server_shutdown(d->srv.rpc, on_rpc_done, d);
    }
    dit_rpc_server_cancel_all(d->srv.rpc);
}

static void on_drain_tick(uv_timer_t *t)
{
    daemon_state *d = t->data;
    dit_server *s = &d->srv;
    const double waited_s = (double)(uv_now(&d->loop) - d->drain_started_ms) / 1000.0;
    /* Done when no job waits or runs and every result was taken: results
     * still queued for slow readers get the drain time too, and no more. */
    if (dit_server_pending(s) == 0 && dit_rpc_server_unsent(s->rpc) == 0 &&
        dit_rpc_server_statuses_pending(s->rpc) == 0) {
        close_rpc(d);
        return;
    }
    if (!d->aborted && waited_s >= d->cfg.drain_timeout_s) {
        d->aborted = true;
        DIT_LOG(&d->cfg.log, DIT_LOG_WARN, "main",
                "drain timeout (%.1f s): cancelling %d request(s) still pending and %lld bytes of "
                "results clients have not read",
                d->cfg.drain_timeout_s, dit_server_pending(s),
                (long long)dit_rpc_server_unsent(s->rpc));
        dit_server_abort_pending(s, "the server shut down before the request finished");
        close_rpc(d);
    }
    if (d->aborted && waited_s >= d->cfg.drain_timeout_s + STOP_GRACE_S) {
        /* The running job did not stop at a step boundary: stop the mesh
         * under it. */
        stop_mesh(d);
    }
}

static void on_signal(uv_signal_t *h, int signum)
{
    daemon_state *d = h->data;
    if (++d->signals > 1) {
        DIT_LOG(&d->cfg.log, DIT_LOG_WARN, "main", "second signal (%s): exiting now",
                signum == SIGTERM ? "SIGTERM" : "SIGINT");
        /* Workers notice their socket closing and exit; see ditworker. */
        _exit(1);
    }
    DIT_LOG(&d->cfg.log, DIT_LOG_INFO, "main",
            "%s: draining (%d request(s) pending, up to %.1f s); a second signal exits at once",
            signum == SIGTERM ? "SIGTERM" : "SIGINT", dit_server_pending(&d->srv),
            d->cfg.drain_timeout_s);
    /* New work is refused from here on with UNAVAILABLE and a message
     * (better for clients than a closed port); the gRPC server itself
     * closes once accepted work is done. */
    dit_server_drain(&d->srv);
    d->drain_started_ms = uv_now(&d->loop);
    uv_timer_start(&d->drain_timer, on_drain_tick, 0, DRAIN_POLL_MS);
}

int main(int argc, char **argv)
{
    dit_tune_malloc();
    daemon_state *d = calloc(1, sizeof *d);
    if (!d) {
        fprintf(stderr, "ditd: out of memory\n");
        return 1;
    }
    int rc = dit_daemon_config_parse(&d->cfg, argc, argv);
    if (rc != 0) {
        free(d);
        return rc == 1 ? 0 : 2;
    }
    const dit_log *lg = &d->cfg.log;
    dit_server *s = &d->srv;
    dit_diag diag;
    dit_diag_clear(&diag);
    char worker[PATH_MAX];
    char token[512] = "";
    dit_join_secret *secret = NULL;
    bool grpc_up = false, loop_up = false;
    rc = 1;

    if (dit_pipeline_probe(d->cfg.model, &s->info, &diag) != DIT_OK ||
        dit_parallel_validate_model(&d->cfg.pc, &s->info.parallel, NULL, &diag) != DIT_OK ||
        (d->cfg.warmup && check_warmup(&d->cfg, &s->info, &diag) != DIT_OK) ||
        find_worker(d->cfg.worker_path, worker, sizeof worker, &diag) != DIT_OK ||
        (d->cfg.auth_token_file &&
         read_token(d->cfg.auth_token_file, token, sizeof token, &diag) != DIT_OK) ||
        (d->cfg.join_secret_file &&
         read_secret(d->cfg.join_secret_file, &secret, &diag) != DIT_OK)) {
        fprintf(stderr, "ditd: %s\n", dit_diag_msg(&diag));
        rc = 2;
        goto cleanup;
    }
    /* What ListModels and GetServerInfo report and Generate checks frames
     * against: the probed pipeline's own description. */
    describe_pipeline(&s->info, &d->cfg, &s->model);
    if (!s->info.has_text_encoders)
        DIT_LOG(lg, DIT_LOG_WARN, "main",
                "%s has no text encoders: requests must bring prompt_embeds", d->cfg.model);

    /* A client that vanishes mid-write must not kill the daemon. */
    signal(SIGPIPE, SIG_IGN);
    grpc_init();
    grpc_up = true;
    if (uv_loop_init(&d->loop) != 0) {
        fprintf(stderr, "ditd: cannot create the event loop\n");
        goto cleanup;
    }
    loop_up = true;

    s->loop = &d->loop;
    s->cfg = &d->cfg;
    s->log = lg;
    s->warmed = d->cfg.warmup == NULL;
    const char *services[] = {"ditserve.v1.Generation", "grpc.health.v1.Health",
                              "grpc.reflection.v1.ServerReflection",
                              "grpc.reflection.v1alpha.ServerReflection"};
    if (dit_reflection_create(dit_descriptor_set, dit_descriptor_set_len, services,
                              (int)(sizeof services / sizeof *services), &s->refl,
                              &diag) != DIT_OK) {
        fprintf(stderr, "ditd: %s\n", dit_diag_msg(&diag));
        goto cleanup;
    }

    dit_supervisor_config sc = {
        .model_dir = d->cfg.model,
        .worker_path = worker,
        .backend = d->cfg.backend_name,
        .pc = d->cfg.pc,
        .threads = d->cfg.threads,
        .comm_timeout_s = d->cfg.comm_timeout_s,
        .job_timeout_s = d->cfg.job_timeout_s,
        .startup_timeout_s = d->cfg.startup_timeout_s,
        .log = lg,
        .local_ranks = d->cfg.local_ranks,
        .join_listen = d->cfg.join_listen,
        .join_secret = secret,
        .lora_cache_bytes = d->cfg.lora_cache_bytes,
        .preload_loras = d->cfg.preload_loras,
        .n_preload_loras = d->cfg.n_preload_loras,
        .fuse_lora = d->cfg.fuse_lora.name[0] ? &d->cfg.fuse_lora : NULL,
        .fuse_lora_scale = d->cfg.fuse_lora_scale,
        /* A job's images (a batch's, a request's num_images) are decoded
         * on all the mesh's ranks: the VAE on every one. */
        .decode_on_every_rank = true,
    };
    if (dit_server_create_meshes(s, &sc, &diag) != DIT_OK) {
        fprintf(stderr, "ditd: %s\n", dit_diag_msg(&diag));
        dit_server_stop_meshes(s, 0, on_mesh_stopped, d);
        uv_run(&d->loop, UV_RUN_DEFAULT);
        goto cleanup;
    }

    const dit_rpc_method *methods;
    const int n_methods = dit_server_methods(s, &methods);
    dit_rpc_config rc_cfg = {
        .listen = d->cfg.listen,
        .max_message_bytes = d->cfg.max_message_bytes,
        .max_connection_age_s = d->cfg.max_connection_age_s,
        .tls_cert = d->cfg.tls_cert,
        .tls_key = d->cfg.tls_key,
        .tls_client_ca = d->cfg.tls_client_ca,
        .auth_token = token[0] ? token : NULL,
        .log = lg,
        .refused = dit_server_rpc_refused,
        .refused_ctx = s,
    };
    if (dit_rpc_server_create(&d->loop, &rc_cfg, methods, n_methods, &s->rpc, &s->port, &diag) !=
        DIT_OK) {
        fprintf(stderr, "ditd: %s\n", dit_diag_msg(&diag));
        /* The supervisor holds loop handles: stop it through the loop. */
        dit_server_stop_meshes(s, 0, on_mesh_stopped, d);
        uv_run(&d->loop, UV_RUN_DEFAULT);
        goto cleanup;
    }
    dit_server_start_meshes(s);

    uv_signal_init(&d->loop, &d->sigterm);
    uv_signal_init(&d->loop, &d->sigint);
    uv_timer_init(&d->loop, &d->drain_timer);
    d->sigterm.data = d->sigint.data = d->drain_timer.data = d;
    uv_signal_start(&d->sigterm, on_signal, SIGTERM);
    uv_signal_start(&d->sigint, on_signal, SIGINT);
    d->handles_up = true;

    int metrics_port = -1;
    if (d->cfg.metrics_port >= 0 &&
        dit_metrics_start(d->cfg.metrics_port, 0, d->cfg.model_name, d->cfg.replicas, &s->metrics,
                          &metrics_port, &diag) != DIT_OK) {
        fprintf(stderr, "ditd: %s\n", dit_diag_msg(&diag));
        rc = 2;
        dit_server_drain(s);
        close_rpc(d);
        stop_mesh(d);
        uv_run(&d->loop, UV_RUN_DEFAULT);
        goto cleanup;
    }
    int http_port = -1;
    if (d->cfg.http_listen) {
        dit_http_config hc = {
            .listen = d->cfg.http_listen,
            .model_name = d->cfg.model_name,
            .auth_token = token[0] ? token : NULL,
            .tls_cert = d->cfg.tls_cert,
            .tls_key = d->cfg.tls_key,
            .tls_client_ca = d->cfg.tls_client_ca,
            .cors_origins = d->cfg.http_cors_origins,
            .max_body_bytes = d->cfg.http_max_body_bytes,
            .max_connections = d->cfg.http_max_connections,
            .idle_timeout_s = d->cfg.http_idle_timeout_s,
            .request_timeout_s = d->cfg.http_request_timeout_s,
            .default_width = s->model.default_width,
            .default_height = s->model.default_height,
            .task = dit_task_name(s->model.task),
            .video = s->model.task == DIT_TASK_TEXT_TO_VIDEO,
            .default_num_frames = s->model.default_num_frames,
            .default_fps = s->model.default_fps,
            .frame_step = s->model.frame_step,
            .video_jobs = d->cfg.http_video_jobs,
            .video_bytes = d->cfg.http_video_bytes,
            .video_retention_s = d->cfg.http_video_retention_s,
            .log = lg,
        };
        if (dit_http_create(&d->loop, s, &hc, &d->http, &http_port, &diag) != DIT_OK) {
            fprintf(stderr, "ditd: %s\n", dit_diag_msg(&diag));
            rc = 2;
            dit_server_drain(s);
            close_rpc(d);
            stop_mesh(d);
            uv_run(&d->loop, UV_RUN_DEFAULT);
            goto cleanup;
        }
        s->health_changed = dit_http_set_serving;
        s->meshes_changed = dit_http_set_meshes;
        s->front_held = dit_http_held_bytes;
        s->health_ctx = d->http;
        dit_http_set_serving(d->http, s->serving);
    }
    /* Tests and scripts read the port from this line. */
    const char *colon = strrchr(d->cfg.listen, ':');
    printf("ditd: listening on %.*s:%d\n", colon ? (int)(colon - d->cfg.listen) : 0, d->cfg.listen,
           s->port);
    if (dit_server_join_port(s) >= 0) {
        const char *jc = strrchr(d->cfg.join_listen, ':');
        printf("ditd: workers join on %.*s:%d\n", jc ? (int)(jc - d->cfg.join_listen) : 0,
               d->cfg.join_listen, dit_server_join_port(s));
    }
    if (s->metrics)
        printf("ditd: metrics on http://%.*s:%d/metrics\n",
               colon ? (int)(colon - d->cfg.listen) : 0, d->cfg.listen, metrics_port);
    if (d->http) {
        const char *hc = strrchr(d->cfg.http_listen, ':');
        printf("ditd: http on %s://%.*s:%d\n", d->cfg.tls_cert ? "https" : "http",
               hc ? (int)(hc - d->cfg.http_listen) : 0, d->cfg.http_listen, http_port);
    }
    fflush(stdout);
    DIT_LOG(lg, DIT_LOG_INFO, "main",
            "serving model '%s' from %s on port %d: %d mesh(es) of %d worker(s), %sring %d x "
            "ulysses %d x tp %d, backend %s, queue %d, batches of up to %d, %s%s",
            d->cfg.model_name, d->cfg.model, s->port, d->cfg.replicas, d->cfg.pc.world_size,
            d->cfg.pc.cfg_degree > 1 ? "cfg 2 x " : "", d->cfg.pc.ring_degree,
            d->cfg.pc.ulysses_degree, d->cfg.pc.tp_degree, d->cfg.backend_name, d->cfg.max_queue,
            d->cfg.max_batch,
            d->cfg.tls_cert ? (d->cfg.tls_client_ca ? "mutual TLS" : "TLS") : "plaintext",
            token[0] ? ", bearer token required" : "");

    uv_run(&d->loop, UV_RUN_DEFAULT);
    rc = 0;

cleanup:
    memset(token, 0, sizeof token);
    if (secret) {
        dit_join_secret_wipe(secret);
        free(secret);
    }
    /* Normally both are gone already (maybe_finish); after a failed start
     * they may not be. Their handle closes finish in the last loop run. */
    if (s->rpc)
        dit_rpc_server_destroy(s->rpc);
    dit_server_destroy_meshes(s);
    if (loop_up)
        uv_run(&d->loop, UV_RUN_DEFAULT);
    dit_http_destroy(d->http); /* its connection threads wait for no job now */
    dit_server_free_jobs(s);
    dit_reflection_free(s->refl);
    dit_metrics_stop(s->metrics);
    if (loop_up && uv_loop_close(&d->loop) != 0)
        DIT_LOG(lg, DIT_LOG_WARN, "main", "the event loop still had open handles at exit");
    if (grpc_up)
        grpc_shutdown();
    free(d);
    return rc;
}
