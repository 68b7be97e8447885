#include "supervisor.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "comm/shm/comm_shm.h"
#include "ipc_wire.h"

#define SUP_MAX_RANKS DIT_SHM_MAX_RANKS
#define SUP_BACKOFF_MIN_S 1.0
#define SUP_BACKOFF_MAX_S 30.0

typedef struct worker_slot {
    dit_supervisor *s;
    int rank;
    uv_process_t proc;
    bool spawned;   /* the handle is open (closed from the exit callback) */
    bool alive;     /* the process has not exited */
    int pid;
} worker_slot;

typedef struct conn {
    dit_supervisor *s;
    uv_pipe_t pipe;
    dit_ipc_reader reader;
    int rank; /* -1 until hello */
    bool closing;
    struct conn *next;
} conn;

struct dit_supervisor {
    uv_loop_t *loop;
    dit_supervisor_config cfg;
    dit_supervisor_events ev;
    const dit_log *log;
    char sock_dir[64];
    char sock_path[128];
    uv_pipe_t listener;
    worker_slot workers[SUP_MAX_RANKS];
    int N;
    conn *conns;
    conn *by_rank[SUP_MAX_RANKS];
    int open_procs, open_conns;
    dit_shm_segment *seg;
    char shm_name[64];
    dit_mesh_state state;
    int hellos, readies;
    /* The job on the workers. */
    bool job_running;
    uint64_t job_id;
    int job_done_ranks;
    dit_status job_status;
    char job_msg[1024];
    Ditserve__Ipc__Envelope *job_result;
    uv_timer_t startup_timer, watchdog_timer, backoff_timer, kill_timer;
    int timers_open;
    double backoff_s;
    int64_t restarts;
    bool stopping;
    void (*stop_done)(void *ctx);
    void *stop_ctx;
    char device[64];
};

const char *dit_mesh_state_name(dit_mesh_state s)
{
    static const char *const names[] = {"starting", "ready", "restarting", "stopping", "stopped"};
    return (unsigned)s < 5 ? names[s] : "unknown";
}

static void set_state(dit_supervisor *s, dit_mesh_state st)
{
    if (s->state == st)
        return;
    s->state = st;
    DIT_LOG(s->log, DIT_LOG_INFO, "mesh", "state: %s", dit_mesh_state_name(st));
    if (s->ev.state_changed)
        s->ev.state_changed(s->ev.ctx, st);
}

/* ------------------------------------------------------------------------ */
/* Writing to workers                                                        */

typedef struct write_req {
    uv_write_t req;
    uint8_t *frame;
} write_req;

static void on_written(uv_write_t *req, int status)
{
    (void)status; /* a dead peer shows up as an exit or EOF */
    write_req *w = (write_req *)req;
    free(w->frame);
    free(w);
}

static int send_to(conn *c, const Ditserve__Ipc__Envelope *env)
{
    if (!c || c->closing)
        return -1;
    write_req *w = calloc(1, sizeof *w);
    size_t len;
    if (!w || dit_ipc_encode(env, &w->frame, &len) != 0) {
        free(w);
        return -1;
    }
    uv_buf_t buf = uv_buf_init((char *)w->frame, (unsigned)len);
    if (uv_write(&w->req, (uv_stream_t *)&c->pipe, &buf, 1, on_written) != 0) {
        free(w->frame);
        free(w);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Teardown and restart                                                      */

static void spawn_all(dit_supervisor *s);
static void check_torn_down(dit_supervisor *s);

static void on_conn_closed(uv_handle_t *h)
{
    conn *c = h->data;
    dit_supervisor *s = c->s;
    dit_ipc_reader_free(&c->reader);
    free(c);
    s->open_conns--;
    /* The last handle of a torn-down mesh may be a connection. */
    check_torn_down(s);
}

static void close_conn(conn *c)
{
    if (c->closing)
        return;
    c->closing = true;
    dit_supervisor *s = c->s;
    if (c->rank >= 0 && s->by_rank[c->rank] == c)
        s->by_rank[c->rank] = NULL;
    conn **pp = &s->conns;
    while (*pp && *pp != c)
        pp = &(*pp)->next;
    if (*pp)
        *pp = c->next;
    uv_close((uv_handle_t *)&c->pipe, on_conn_closed);
}

static void finish_job(dit_supervisor *s, dit_status st, const char *msg)
{
    if (!s->job_running)
        return;
    s->job_running = false;
    uv_timer_stop(&s->watchdog_timer);
    Ditserve__Ipc__Envelope *res = st == DIT_OK ? s->job_result : NULL;
    if (st != DIT_OK && s->job_result)
        ditserve__ipc__envelope__free_unpacked(s->job_result, NULL);
    s->job_result = NULL;
    const uint64_t id = s->job_id;
    if (s->ev.job_done)
        s->ev.job_done(s->ev.ctx, id, st, msg, res);
    else if (res)
        ditserve__ipc__envelope__free_unpacked(res, NULL);
}

static void on_backoff(uv_timer_t *t)
{
    dit_supervisor *s = t->data;
    if (s->stopping)
        return;
    s->restarts++;
    spawn_all(s);
}

static void check_torn_down(dit_supervisor *s)
{
    if (s->open_procs > 0 || s->open_conns > 0)
        return;
    if (s->state != DIT_MESH_RESTARTING && s->state != DIT_MESH_STOPPING)
        return;
    if (s->seg) {
        dit_shm_segment_destroy(s->seg);
        s->seg = NULL;
    }
    if (s->stopping) {
        set_state(s, DIT_MESH_STOPPED);
        uv_timer_stop(&s->kill_timer);
        if (s->stop_done) {
            void (*done)(void *) = s->stop_done;
            s->stop_done = NULL;
            done(s->stop_ctx);
        }
        return;
    }
    DIT_LOG(s->log, DIT_LOG_INFO, "mesh", "restarting the workers in %.0f s", s->backoff_s);
    uv_timer_start(&s->backoff_timer, on_backoff, (uint64_t)(s->backoff_s * 1000), 0);
    s->backoff_s = s->backoff_s * 2 > SUP_BACKOFF_MAX_S ? SUP_BACKOFF_MAX_S : s->backoff_s * 2;
}

static void kill_all(dit_supervisor *s)
{
    for (int r = 0; r < s->N; r++)
        if (s->workers[r].alive)
            uv_process_kill(&s->workers[r].proc, SIGKILL);
}

void dit_supervisor_fail(dit_supervisor *s, const char *reason)
{
    if (s->state == DIT_MESH_RESTARTING || s->state == DIT_MESH_STOPPED ||
        (s->state == DIT_MESH_STOPPING && !s->job_running))
        return;
    DIT_LOG(s->log, DIT_LOG_ERROR, "mesh", "%s; tearing the mesh down", reason);
    if (s->seg)
        dit_shm_segment_abort(s->seg, -1);
    uv_timer_stop(&s->startup_timer);
    uv_timer_stop(&s->watchdog_timer);
    /* The state changes first, so that whoever hears of the failed job does
     * not hand the next one to this mesh. */
    if (!s->stopping)
        set_state(s, DIT_MESH_RESTARTING);
    finish_job(s, DIT_ERR_PEER, reason);
    kill_all(s);
    while (s->conns)
        close_conn(s->conns);
    check_torn_down(s);
}

/* ------------------------------------------------------------------------ */
/* Messages from workers                                                     */

static void send_setup(dit_supervisor *s)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    if (s->N > 1) {
        dit_shm_config sc = {.world_size = s->N, .timeout_s = s->cfg.comm_timeout_s};
        dit_shm_make_name(&sc);
        if (dit_shm_segment_create(&sc, &s->seg, &diag) != DIT_OK) {
            dit_supervisor_fail(s, dit_diag_msg(&diag));
            return;
        }
        snprintf(s->shm_name, sizeof s->shm_name, "%s", sc.name);
    }
    Ditserve__Ipc__Setup setup = DITSERVE__IPC__SETUP__INIT;
    const dit_parallel_config *pc = &s->cfg.pc;
    setup.world_size = pc->world_size;
    setup.ring_degree = pc->ring_degree;
    setup.ulysses_degree = pc->ulysses_degree;
    setup.tp_degree = pc->tp_degree;
    setup.ulysses_anything = pc->ulysses_anything;
    setup.ring_anything = pc->ring_anything;
    setup.unified_anything = pc->unified_anything;
    setup.fp32_merge = pc->fp32_merge;
    setup.shm_name = s->shm_name;
    setup.model_dir = (char *)s->cfg.model_dir;
    setup.backend = (char *)s->cfg.backend;
    setup.comm_timeout_s = s->cfg.comm_timeout_s;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    setup.threads = s->cfg.threads ? s->cfg.threads : (ncpu > s->N ? (int)(ncpu / s->N) : 1);
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_SETUP;
    env.setup = &setup;
    for (int r = 0; r < s->N; r++) {
        setup.device = r; /* one GPU per rank on the cuda backend */
        send_to(s->by_rank[r], &env);
    }
}

static void handle(conn *c, Ditserve__Ipc__Envelope *env)
{
    dit_supervisor *s = c->s;
    char reason[1200];
    switch (env->msg_case) {
    case DITSERVE__IPC__ENVELOPE__MSG_HELLO: {
        const int r = env->hello->rank;
        if (c->rank >= 0 || r < 0 || r >= s->N || s->by_rank[r]) {
            DIT_LOG(s->log, DIT_LOG_WARN, "mesh", "unexpected hello from rank %d; closing", r);
            close_conn(c);
            break;
        }
        c->rank = r;
        s->by_rank[r] = c;
        if (++s->hellos == s->N)
            send_setup(s);
        break;
    }
    case DITSERVE__IPC__ENVELOPE__MSG_READY:
        if (c->rank == 0 && env->ready->device)
            snprintf(s->device, sizeof s->device, "%s", env->ready->device);
        DIT_LOG(s->log, DIT_LOG_INFO, "mesh", "rank %d ready (%.0f ms to load, %.1f MiB of weights)",
                c->rank, env->ready->load_ms, (double)env->ready->weight_bytes / 1048576.0);
        if (++s->readies == s->N) {
            uv_timer_stop(&s->startup_timer);
            set_state(s, DIT_MESH_READY);
        }
        break;
    case DITSERVE__IPC__ENVELOPE__MSG_PROGRESS:
        if (s->job_running && env->progress->job_id == s->job_id && c->rank == 0) {
            uv_timer_again(&s->watchdog_timer);
            if (s->ev.job_progress)
                s->ev.job_progress(s->ev.ctx, s->job_id, env->progress->step,
                                   env->progress->total_steps, env->progress->elapsed_ms);
        }
        break;
    case DITSERVE__IPC__ENVELOPE__MSG_DONE: {
        const Ditserve__Ipc__JobDone *d = env->done;
        if (!s->job_running || d->job_id != s->job_id) {
            if (d->status != DIT_OK && s->state == DIT_MESH_STARTING) {
                /* A worker could not set up: no point waiting for the rest. */
                snprintf(reason, sizeof reason, "worker rank %d failed to start: %s", c->rank,
                         d->message ? d->message : "");
                dit_supervisor_fail(s, reason);
            }
            break;
        }
        if (d->status != DIT_OK && s->job_status == DIT_OK) {
            s->job_status = (dit_status)d->status;
            snprintf(s->job_msg, sizeof s->job_msg, "%s", d->message ? d->message : "");
        }
        if (c->rank == 0 && d->status == DIT_OK) {
            s->job_result = env;
            env = NULL; /* kept */
        }
        if (++s->job_done_ranks == s->N) {
            if (s->job_status == DIT_OK)
                s->backoff_s = SUP_BACKOFF_MIN_S; /* the mesh works: forget old failures */
            finish_job(s, s->job_status, s->job_msg);
        }
        break;
    }
    default:
        DIT_LOG(s->log, DIT_LOG_WARN, "mesh", "unexpected message %d from rank %d",
                (int)env->msg_case, c->rank);
        break;
    }
    if (env)
        ditserve__ipc__envelope__free_unpacked(env, NULL);
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)h;
    buf->base = malloc(suggested);
    buf->len = buf->base ? suggested : 0;
}

static void on_read(uv_stream_t *stream, ssize_t n, const uv_buf_t *buf)
{
    conn *c = stream->data;
    dit_supervisor *s = c->s;
    if (n > 0 && dit_ipc_reader_feed(&c->reader, buf->base, (size_t)n) != 0)
        n = UV_ENOMEM;
    free(buf->base);
    if (n < 0) {
        const int rank = c->rank;
        close_conn(c);
        if (!s->stopping && rank >= 0) {
            char reason[160];
            snprintf(reason, sizeof reason, "lost the connection to worker rank %d", rank);
            dit_supervisor_fail(s, reason);
        }
        return;
    }
    Ditserve__Ipc__Envelope *env;
    int got;
    while (!c->closing && (got = dit_ipc_reader_next(&c->reader, &env)) == 1)
        handle(c, env);
    if (!c->closing && got < 0) {
        const int rank = c->rank;
        close_conn(c);
        char reason[160];
        snprintf(reason, sizeof reason, "corrupt message stream from worker rank %d", rank);
        dit_supervisor_fail(s, reason);
    }
}

static void on_connection(uv_stream_t *server, int status)
{
    dit_supervisor *s = server->data;
    if (status < 0)
        return;
    conn *c = calloc(1, sizeof *c);
    if (!c)
        return;
    c->s = s;
    c->rank = -1;
    dit_ipc_reader_init(&c->reader);
    uv_pipe_init(s->loop, &c->pipe, 0);
    c->pipe.data = c;
    s->open_conns++;
    c->next = s->conns;
    s->conns = c;
    if (uv_accept(server, (uv_stream_t *)&c->pipe) != 0 ||
        uv_read_start((uv_stream_t *)&c->pipe, alloc_cb, on_read) != 0)
        close_conn(c);
}

/* ------------------------------------------------------------------------ */
/* Processes                                                                 */

static void on_proc_closed(uv_handle_t *h)
{
    worker_slot *w = h->data;
    w->spawned = false;
    w->s->open_procs--;
    check_torn_down(w->s);
}

static void on_exit_cb(uv_process_t *p, int64_t status, int term_signal)
{
    worker_slot *w = p->data;
    dit_supervisor *s = w->s;
    w->alive = false;
    char reason[200];
    if (term_signal)
        snprintf(reason, sizeof reason, "worker rank %d (pid %d) was killed by signal %d (%s)",
                 w->rank, w->pid, term_signal, strsignal(term_signal));
    else
        snprintf(reason, sizeof reason, "worker rank %d (pid %d) exited with status %lld", w->rank,
                 w->pid, (long long)status);
    if (!s->stopping && s->state != DIT_MESH_RESTARTING)
        dit_supervisor_fail(s, reason);
    else
        DIT_LOG(s->log, DIT_LOG_DEBUG, "mesh", "%s", reason);
    uv_close((uv_handle_t *)p, on_proc_closed);
}

static void on_startup_timeout(uv_timer_t *t)
{
    dit_supervisor *s = t->data;
    char reason[160];
    snprintf(reason, sizeof reason, "the workers were not ready within %.0f s (%d of %d ready)",
             s->cfg.startup_timeout_s, s->readies, s->N);
    dit_supervisor_fail(s, reason);
}

static void on_watchdog(uv_timer_t *t)
{
    dit_supervisor *s = t->data;
    char reason[160];
    snprintf(reason, sizeof reason, "job %llu made no progress for %.0f s",
             (unsigned long long)s->job_id, s->cfg.job_timeout_s);
    dit_supervisor_fail(s, reason);
}

static void spawn_all(dit_supervisor *s)
{
    s->hellos = s->readies = 0;
    s->shm_name[0] = '\0';
    set_state(s, DIT_MESH_STARTING);
    uv_timer_start(&s->startup_timer, on_startup_timeout,
                   (uint64_t)(s->cfg.startup_timeout_s * 1000), 0);
    for (int r = 0; r < s->N; r++) {
        worker_slot *w = &s->workers[r];
        char rank[16];
        snprintf(rank, sizeof rank, "%d", r);
        char *args[] = {(char *)s->cfg.worker_path, "--connect", s->sock_path, "--rank", rank, NULL};
        uv_stdio_container_t stdio[3] = {
            {.flags = UV_IGNORE},
            /* ditd's stdout carries its own lines (the listening address);
             * worker output goes to the log stream. */
            {.flags = UV_INHERIT_FD, .data.fd = 2},
            {.flags = UV_INHERIT_FD, .data.fd = 2},
        };
        uv_process_options_t opt = {
            .exit_cb = on_exit_cb,
            /* Its own session: a terminal's Ctrl-C or a signal to ditd's
             * process group reaches ditd alone, which drains and then stops
             * the workers. They still die with ditd (PR_SET_PDEATHSIG). */
            .flags = UV_PROCESS_DETACHED,
            .file = s->cfg.worker_path,
            .args = args,
            .stdio_count = 3,
            .stdio = stdio,
        };
        w->s = s;
        w->rank = r;
        w->proc.data = w;
        int err = uv_spawn(s->loop, &w->proc, &opt);
        if (err != 0) {
            char reason[600];
            snprintf(reason, sizeof reason, "cannot start worker %s: %s", s->cfg.worker_path,
                     uv_strerror(err));
            /* uv_spawn leaves the handle initialised: close it. */
            w->spawned = true;
            s->open_procs++;
            uv_close((uv_handle_t *)&w->proc, on_proc_closed);
            dit_supervisor_fail(s, reason);
            return;
        }
        w->spawned = true;
        w->alive = true;
        w->pid = w->proc.pid;
        s->open_procs++;
    }
    DIT_LOG(s->log, DIT_LOG_INFO, "mesh", "started %d worker(s)", s->N);
}

/* ------------------------------------------------------------------------ */
/* Public                                                                    */

static void free_on_close(uv_handle_t *h)
{
    free(h->data);
}

dit_status dit_supervisor_create(uv_loop_t *loop, const dit_supervisor_config *cfg,
                                 const dit_supervisor_events *ev, dit_supervisor **out,
                                 dit_diag *diag)
{
    dit_supervisor *s = calloc(1, sizeof *s);
    if (!s)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    s->loop = loop;
    s->cfg = *cfg;
    s->ev = *ev;
    s->log = cfg->log;
    s->N = cfg->pc.world_size;
    s->backoff_s = SUP_BACKOFF_MIN_S;
    snprintf(s->device, sizeof s->device, "%s", cfg->backend);
    /* The IPC socket lives in a folder only this user can enter. */
    snprintf(s->sock_dir, sizeof s->sock_dir, "/tmp/ditd-XXXXXX");
    if (!mkdtemp(s->sock_dir)) {
        dit_status st = dit_diag_set(diag, DIT_ERR_IO, "cannot create a socket folder: %s",
                                     strerror(errno));
        free(s);
        return st;
    }
    snprintf(s->sock_path, sizeof s->sock_path, "%s/ipc.sock", s->sock_dir);
    uv_pipe_init(loop, &s->listener, 0);
    s->listener.data = s;
    int err = uv_pipe_bind(&s->listener, s->sock_path);
    if (err == 0)
        err = uv_listen((uv_stream_t *)&s->listener, 128, on_connection);
    if (err != 0) {
        dit_status st = dit_diag_set(diag, DIT_ERR_IO, "cannot listen on %s: %s", s->sock_path,
                                     uv_strerror(err));
        rmdir(s->sock_dir);
        uv_close((uv_handle_t *)&s->listener, free_on_close);
        return st;
    }
    chmod(s->sock_path, 0600);
    uv_timer_t *timers[4] = {&s->startup_timer, &s->watchdog_timer, &s->backoff_timer, &s->kill_timer};
    for (int i = 0; i < 4; i++) {
        uv_timer_init(loop, timers[i]);
        timers[i]->data = s;
    }
    s->state = DIT_MESH_STOPPED;
    *out = s;
    return DIT_OK;
}

void dit_supervisor_start(dit_supervisor *s)
{
    spawn_all(s);
}

dit_mesh_state dit_supervisor_state(const dit_supervisor *s)
{
    return s->state;
}

bool dit_supervisor_idle(const dit_supervisor *s)
{
    return s->state == DIT_MESH_READY && !s->job_running && !s->stopping;
}

dit_status dit_supervisor_run(dit_supervisor *s, uint64_t job_id,
                              Ditserve__V1__GenerateRequest *req, bool warmup, dit_diag *diag)
{
    if (!dit_supervisor_idle(s))
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "the mesh is not idle");
    Ditserve__Ipc__Job job = DITSERVE__IPC__JOB__INIT;
    job.job_id = job_id;
    job.request = req;
    job.warmup = warmup;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_JOB;
    env.job = &job;
    s->job_running = true;
    s->job_id = job_id;
    s->job_done_ranks = 0;
    s->job_status = DIT_OK;
    s->job_msg[0] = '\0';
    for (int r = 0; r < s->N; r++) {
        if (send_to(s->by_rank[r], &env) != 0) {
            char reason[120];
            snprintf(reason, sizeof reason, "cannot send the job to worker rank %d", r);
            dit_supervisor_fail(s, reason);
            return DIT_OK; /* the job ended through job_done */
        }
    }
    uv_timer_start(&s->watchdog_timer, on_watchdog, (uint64_t)(s->cfg.job_timeout_s * 1000),
                   (uint64_t)(s->cfg.job_timeout_s * 1000));
    return DIT_OK;
}

void dit_supervisor_cancel(dit_supervisor *s, uint64_t job_id)
{
    if (!s->job_running || s->job_id != job_id)
        return;
    Ditserve__Ipc__Cancel cancel = DITSERVE__IPC__CANCEL__INIT;
    cancel.job_id = job_id;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_CANCEL;
    env.cancel = &cancel;
    send_to(s->by_rank[0], &env);
}

static void on_kill_timer(uv_timer_t *t)
{
    dit_supervisor *s = t->data;
    int left = 0;
    for (int r = 0; r < s->N; r++)
        left += s->workers[r].alive;
    if (left)
        DIT_LOG(s->log, DIT_LOG_WARN, "mesh", "%d worker(s) did not exit in time; killing them", left);
    kill_all(s);
    while (s->conns)
        close_conn(s->conns);
}

void dit_supervisor_stop(dit_supervisor *s, double grace_s, void (*done)(void *ctx), void *ctx)
{
    s->stopping = true;
    s->stop_done = done;
    s->stop_ctx = ctx;
    uv_timer_stop(&s->backoff_timer);
    uv_timer_stop(&s->startup_timer);
    finish_job(s, DIT_ERR_CANCELLED, "the server is shutting down");
    set_state(s, DIT_MESH_STOPPING);
    Ditserve__Ipc__Shutdown sd = DITSERVE__IPC__SHUTDOWN__INIT;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN;
    env.shutdown = &sd;
    for (conn *c = s->conns; c; c = c->next)
        send_to(c, &env);
    uv_timer_start(&s->kill_timer, on_kill_timer, (uint64_t)(grace_s * 1000), 0);
    /* Connections close as workers exit (EOF); processes close from their
     * exit callbacks. Nothing running: done at once. */
    check_torn_down(s);
}

static void on_timer_closed(uv_handle_t *h)
{
    dit_supervisor *s = h->data;
    if (--s->timers_open == 0) {
        free(s);
    }
}

static void on_listener_closed(uv_handle_t *h)
{
    dit_supervisor *s = h->data;
    unlink(s->sock_path);
    rmdir(s->sock_dir);
    uv_timer_t *timers[4] = {&s->startup_timer, &s->watchdog_timer, &s->backoff_timer, &s->kill_timer};
    s->timers_open = 4;
    for (int i = 0; i < 4; i++)
        uv_close((uv_handle_t *)timers[i], on_timer_closed);
}

void dit_supervisor_destroy(dit_supervisor *s)
{
    if (!s)
        return;
    if (s->job_result)
        ditserve__ipc__envelope__free_unpacked(s->job_result, NULL);
    s->job_result = NULL;
    uv_close((uv_handle_t *)&s->listener, on_listener_closed);
}

int64_t dit_supervisor_restarts(const dit_supervisor *s)
{
    return s->restarts;
}

const char *dit_supervisor_device(const dit_supervisor *s)
{
    return s->device;
}
