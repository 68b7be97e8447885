#include "supervisor.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <stdarg.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/file_id.h"
#include "serve/host.h"
#include "config.h"
#include "ipc_wire.h"
#include "join.h"
#include "results.h"

#define SUP_MAX_RANKS DIT_SHM_MAX_RANKS
#define SUP_BACKOFF_MIN_S 1.0
#define SUP_BACKOFF_MAX_S 30.0
/* How often the pool of joined workers is looked at (and stale handshakes
 * dropped), and how often a mesh missing ranks says so. */
#define SUP_JOIN_TICK_MS 500
#define SUP_JOIN_REMIND_S 30.0
/* After a rank's own failure of a job, how long the other ranks have to
 * report before the mesh is torn down (--comm-timeout when that is
 * shorter). Ranks that fail alike (memory for the same activations, a
 * cancel) report within milliseconds of each other; one left behind in a
 * collective would wait out --comm-timeout and the mesh would restart
 * anyway. */
#define SUP_STRAGGLER_GRACE_S 2.0

/* Where the mesh is. Each phase maps to one public dit_mesh_state (the
 * STARTING, READY and RESTARTING ones have steps callers need not see);
 * `stopping` and `destroyed` stay apart, as requests that outlive the
 * phases they are made in. */
typedef enum sup_phase {
    PH_STOPPED,   /* STOPPED: before the start, after the stop */
    PH_GATHERING, /* STARTING: spawned, waiting for every rank's hello (or join) */
    PH_MESH_ID,   /* STARTING: the setup went to rank 0, waiting for its NCCL id */
    PH_LOADING,   /* STARTING: the setup went to every rank, waiting for each ready */
    PH_READY,     /* READY: idle */
    PH_RUNNING,   /* READY: a job is on the workers */
    PH_TEARDOWN,  /* RESTARTING: waiting for the processes and connections to close */
    PH_BACKOFF,   /* RESTARTING: torn down, waiting to start again */
    PH_STOPPING,  /* STOPPING: waiting for the processes and connections to close */
} sup_phase;

typedef struct worker_slot {
    dit_supervisor *s;
    int rank;
    uv_process_t proc;
    bool spawned; /* the handle is open (closed from the exit callback) */
    bool alive;   /* the process has not exited */
    int pid;
} worker_slot;

typedef struct conn {
    dit_supervisor *s;
    union {
        uv_handle_t handle;
        uv_stream_t stream;
        uv_pipe_t pipe; /* a worker this daemon started */
        uv_tcp_t tcp;   /* a worker that joined over TCP */
    } h;
    dit_ipc_reader reader;
    int rank; /* -1 until hello (or, joined, until a rank is assigned) */
    bool closing;
    bool tcp; /* a worker that joins over TCP: read by the join handshake until it has joined */
    /* Part of the mesh: a spawned worker's connection, or a joined one
     * with a rank. Teardowns wait for these alone (open_conns); the pool
     * and handshakes in progress are counted in open_joiners. */
    bool counted;
    dit_joiner jp; /* TCP only: the handshake's state (join.h) */
    struct conn *next;
} conn;

#define CONN_OF_JOINER(p) ((conn *)(void *)((char *)(p)-offsetof(conn, jp)))

/* A listener's spare handle. libuv stops a listener whose callback leaves
 * the connection waiting unaccepted, for good, and keeps its fd; one that
 * gets no conn (no memory) is accepted into the spare and closed at once.
 * While the spare closes (a second such connection in the same loop turn)
 * the next one waits, and the spare's close callback takes it. */
typedef struct sup_spare {
    union {
        uv_handle_t handle;
        uv_stream_t stream;
        uv_pipe_t pipe;
        uv_tcp_t tcp;
    } h;
    struct dit_supervisor *s;
    uv_stream_t *server;
    uv_connection_cb retry; /* the listener's callback */
    bool closing;           /* in use until its close callback */
    bool waiting;           /* a connection waits in server for it */
} sup_spare;

struct dit_supervisor {
    uv_loop_t *loop;
    dit_supervisor_config cfg;
    dit_supervisor_events ev;
    const dit_log *log;
    const char *name; /* log subsystem */
    char sock_dir[64];
    /* sock_dir/owner.lock, flock'ed for the supervisor's life: another ditd
     * removes the folder only when it can take the lock (reclaim_sock_dirs),
     * whatever pid namespace each runs in. */
    int lock_fd;
    char sock_path[128];
    uv_pipe_t listener;
    worker_slot workers[SUP_MAX_RANKS];
    int N, L; /* world size, ranks started here */
    uv_tcp_t join_listener;
    sup_spare spare, join_spare; /* the listeners' (sup_spare) */
    uv_timer_t join_timer;
    bool join_open;
    int join_port;
    double join_reminded_s;
    dit_joiners *joiners; /* with remote ranks: the handshake and the pool */
    unsigned char nccl_id[256];
    size_t nccl_id_len;
    int handles_open; /* closed in destroy; free when 0 */
    conn *conns;
    conn *by_rank[SUP_MAX_RANKS];
    int open_procs, open_conns, open_joiners;
    bool destroyed; /* destroy was called: free once handles_open is 0 */
    dit_shm_segment *seg;
    char shm_name[64];
    sup_phase phase;
    int hellos, readies;
    bool rank_ready[SUP_MAX_RANKS], rank_done[SUP_MAX_RANKS]; /* counted once each */
    /* The job on the workers (PH_RUNNING). */
    uint64_t job_id;
    int job_done_ranks;
    dit_status job_status;
    char job_msg[1024];
    int job_err_rank;     /* the rank whose report set job_status */
    bool job_peer_failed; /* that report only followed another rank's failure */
    bool job_ends_mesh;   /* a rank said it leaves after the job (JobDone.worker_exits) */
    /* Each rank's JobDone while it succeeded: rank 0's is the result, and a
     * batch's members decoded on other ranks take their entries from
     * theirs (merge_batch). */
    Ditserve__Ipc__Envelope *job_results[SUP_MAX_RANKS];
    double rank_done_ms[SUP_MAX_RANKS]; /* when each rank's JobDone came (uv_hrtime, ms) */
    bool job_collective;                /* the ranks run the job together (not a LoRA load) */
    uv_timer_t startup_timer, watchdog_timer, backoff_timer, kill_timer, straggler_timer;
    double backoff_s;
    int64_t restarts;
    bool stopping;
    void (*stop_done)(void *ctx);
    void *stop_ctx;
    char device[SUP_MAX_RANKS][112]; /* each rank's, as its ready said (printable ASCII) */
};

const char *dit_mesh_state_name(dit_mesh_state s)
{
    static const char *const names[] = {"starting", "ready", "restarting", "stopping", "stopped"};
    return (unsigned)s < 5 ? names[s] : "unknown";
}

static dit_mesh_state public_state(sup_phase ph)
{
    switch (ph) {
    case PH_GATHERING:
    case PH_MESH_ID:
    case PH_LOADING:
        return DIT_MESH_STARTING;
    case PH_READY:
    case PH_RUNNING:
        return DIT_MESH_READY;
    case PH_TEARDOWN:
    case PH_BACKOFF:
        return DIT_MESH_RESTARTING;
    case PH_STOPPING:
        return DIT_MESH_STOPPING;
    case PH_STOPPED:
        break;
    }
    return DIT_MESH_STOPPED;
}

/* Moves to ph; callers hear of it only when the public state changes. A
 * stopping mesh only goes on stopping: a worker that says hello or ready
 * after the stop began (it was still starting) must not bring the mesh back
 * to loading or ready, where the stop would never complete. */
static void set_phase(dit_supervisor *s, sup_phase ph)
{
    if (s->stopping && ph != PH_STOPPING && ph != PH_STOPPED && s->phase != PH_RUNNING)
        return;
    const dit_mesh_state before = public_state(s->phase), after = public_state(ph);
    s->phase = ph;
    if (before == after)
        return;
    DIT_LOG(s->log, DIT_LOG_INFO, s->name, "state: %s", dit_mesh_state_name(after));
    if (s->ev.state_changed)
        s->ev.state_changed(s->ev.ctx, after);
}

/* ------------------------------------------------------------------------ */
/* Writing to workers                                                        */

/* An encoded frame, freed after its last write: a job goes to every rank
 * as the same bytes, encoded once. */
typedef struct frame_buf {
    int refs;
    uint8_t *bytes;
    size_t len;
} frame_buf;

typedef struct write_req {
    uv_write_t req;
    frame_buf *f;
} write_req;

static void frame_unref(frame_buf *f)
{
    if (--f->refs > 0)
        return;
    free(f->bytes);
    free(f);
}

/* NULL when env is over DIT_IPC_MAX_FRAME or memory ran out. */
static frame_buf *frame_encode(const Ditserve__Ipc__Envelope *env)
{
    frame_buf *f = calloc(1, sizeof *f);
    if (!f)
        return NULL;
    if (dit_ipc_encode(env, &f->bytes, &f->len) != 0) {
        free(f);
        return NULL;
    }
    f->refs = 1; /* the caller's */
    return f;
}

static void on_written(uv_write_t *req, int status)
{
    (void)status; /* a dead peer shows up as an exit or EOF */
    write_req *w = (write_req *)req;
    frame_unref(w->f);
    free(w);
}

static int write_frame(conn *c, frame_buf *f)
{
    if (!c || c->closing)
        return -1;
    write_req *w = calloc(1, sizeof *w);
    if (!w)
        return -1;
    w->f = f;
    f->refs++;
    uv_buf_t buf = uv_buf_init((char *)f->bytes, (unsigned)f->len);
    if (uv_write(&w->req, &c->h.stream, &buf, 1, on_written) != 0) {
        frame_unref(f);
        free(w);
        return -1;
    }
    return 0;
}

static int send_to(conn *c, const Ditserve__Ipc__Envelope *env)
{
    if (!c || c->closing)
        return -1;
    frame_buf *f = frame_encode(env);
    if (!f)
        return -1;
    const int rc = write_frame(c, f);
    frame_unref(f);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Teardown and restart                                                      */

static void spawn_all(dit_supervisor *s);
static void check_torn_down(dit_supervisor *s);

static void maybe_free(dit_supervisor *s)
{
    if (s->destroyed && s->handles_open == 0 && s->open_conns == 0 && s->open_joiners == 0 &&
        s->open_procs == 0 && !s->spare.closing && !s->join_spare.closing) {
        dit_joiners_destroy(s->joiners);
        free(s);
    }
}

static void on_conn_closed(uv_handle_t *h)
{
    conn *c = h->data;
    dit_supervisor *s = c->s;
    dit_ipc_reader_free(&c->reader);
    if (c->counted)
        s->open_conns--;
    else
        s->open_joiners--;
    free(c);
    /* The last handle of a torn-down mesh may be a connection. */
    check_torn_down(s);
    maybe_free(s);
}

/* Takes the connection out of the mesh (it is read no more). */
static void detach_conn(conn *c)
{
    c->closing = true;
    dit_supervisor *s = c->s;
    if (c->rank >= 0 && s->by_rank[c->rank] == c)
        s->by_rank[c->rank] = NULL;
    if (c->tcp && s->joiners)
        dit_joiners_remove(s->joiners, &c->jp);
    conn **pp = &s->conns;
    while (*pp && *pp != c)
        pp = &(*pp)->next;
    if (*pp)
        *pp = c->next;
    uv_read_stop(&c->h.stream);
}

static void close_conn(conn *c)
{
    if (c->closing)
        return;
    detach_conn(c);
    uv_close(&c->h.handle, on_conn_closed);
}

static void on_flushed(uv_shutdown_t *req, int status)
{
    (void)status;
    conn *c = req->data;
    free(req);
    uv_close(&c->h.handle, on_conn_closed);
}

/* Closes after what was written has gone out (a refusal's reason). */
static void close_conn_flushed(conn *c)
{
    if (c->closing)
        return;
    detach_conn(c);
    uv_shutdown_t *req = malloc(sizeof *req);
    if (req) {
        req->data = c;
        if (uv_shutdown(req, &c->h.stream, on_flushed) == 0)
            return;
        free(req);
    }
    uv_close(&c->h.handle, on_conn_closed);
}

static void drop_job_results(dit_supervisor *s)
{
    for (int r = 0; r < SUP_MAX_RANKS; r++)
        if (s->job_results[r]) {
            ditserve__ipc__envelope__free_unpacked(s->job_results[r], NULL);
            s->job_results[r] = NULL;
        }
}

/* A job whose JobDone lists its members: each member's result put
 * together from the ranks that hold its images (results.h). */
static bool merge_batch(dit_supervisor *s, char *why, size_t cap)
{
    Ditserve__Ipc__JobDone *done[SUP_MAX_RANKS] = {NULL};
    const int n = s->N < SUP_MAX_RANKS ? s->N : SUP_MAX_RANKS;
    for (int r = 0; r < n; r++)
        done[r] = s->job_results[r] ? s->job_results[r]->done : NULL;
    return dit_results_merge(done, n, s->rank_done_ms, why, cap);
}

/* Reports the job that was on the workers as ended; the caller has moved the
 * phase on from PH_RUNNING first (so that whoever hears of it sees where
 * the mesh now is). */
static void finish_job(dit_supervisor *s, dit_status st, const char *msg)
{
    uv_timer_stop(&s->watchdog_timer);
    uv_timer_stop(&s->straggler_timer);
    char why[160];
    Ditserve__Ipc__Envelope *res = st == DIT_OK ? s->job_results[0] : NULL;
    if (res && res->done && res->done->n_batch > 0 && !merge_batch(s, why, sizeof why)) {
        DIT_LOG(s->log, DIT_LOG_ERROR, s->name, "%s", why);
        st = DIT_ERR_INTERNAL;
        msg = why;
        res = NULL;
    }
    if (res)
        s->job_results[0] = NULL; /* handed on */
    drop_job_results(s);
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
    if (s->open_procs > 0 || s->open_conns > 0 || s->destroyed)
        return;
    if (s->phase != PH_TEARDOWN && s->phase != PH_STOPPING)
        return;
    if (s->seg) {
        dit_shm_segment_destroy(s->seg);
        s->seg = NULL;
    }
    if (s->stopping) {
        set_phase(s, PH_STOPPED);
        uv_timer_stop(&s->kill_timer);
        if (s->stop_done) {
            void (*done)(void *) = s->stop_done;
            s->stop_done = NULL;
            done(s->stop_ctx);
        }
        return;
    }
    set_phase(s, PH_BACKOFF);
    DIT_LOG(s->log, DIT_LOG_INFO, s->name, "restarting the workers in %.0f s", s->backoff_s);
    uv_timer_start(&s->backoff_timer, on_backoff, (uint64_t)(s->backoff_s * 1000), 0);
    s->backoff_s = s->backoff_s * 2 > SUP_BACKOFF_MAX_S ? SUP_BACKOFF_MAX_S : s->backoff_s * 2;
}

static void kill_all(dit_supervisor *s)
{
    for (int r = 0; r < s->L; r++)
        if (s->workers[r].alive)
            uv_process_kill(&s->workers[r].proc, SIGKILL);
}

void dit_supervisor_fail(dit_supervisor *s, const char *reason)
{
    const dit_mesh_state st = public_state(s->phase);
    /* No job runs while the mesh stops (the stop ended it). */
    if (st == DIT_MESH_RESTARTING || st == DIT_MESH_STOPPED || st == DIT_MESH_STOPPING)
        return;
    DIT_LOG(s->log, DIT_LOG_ERROR, s->name, "%s; tearing the mesh down", reason);
    if (s->seg)
        dit_shm_segment_abort(s->seg, -1);
    uv_timer_stop(&s->startup_timer);
    uv_timer_stop(&s->watchdog_timer);
    uv_timer_stop(&s->straggler_timer);
    /* The state changes first, so that whoever hears of the failed job does
     * not hand the next one to this mesh. */
    const bool job = s->phase == PH_RUNNING;
    if (!s->stopping)
        set_phase(s, PH_TEARDOWN);
    if (job && s->job_done_ranks == s->N) {
        /* Every rank reported before the mesh went (some leave after a
         * failure that ends it, JobDone.worker_exits): the job ends as they
         * said. */
        finish_job(s, s->job_status, s->job_msg);
    } else if (job && s->job_status != DIT_OK && s->job_msg[0]) {
        /* A rank reported why the job failed before the mesh broke (a
         * peer that stalled or died, from its side): that is the cause; the
         * lost connection that follows (the reporting rank exits) is not. */
        char full[sizeof s->job_msg + 256];
        snprintf(full, sizeof full, "worker rank %d: %s (then %s)", s->job_err_rank, s->job_msg,
                 reason);
        finish_job(s, DIT_ERR_PEER, full);
    } else if (job) {
        finish_job(s, DIT_ERR_PEER, reason);
    }
    kill_all(s);
    /* The mesh's connections go; joined workers waiting for a rank stay for
     * the next mesh. */
    conn *next;
    for (conn *c = s->conns; c; c = next) {
        next = c->next;
        if (c->counted)
            close_conn(c);
    }
    check_torn_down(s);
}

/* ------------------------------------------------------------------------ */
/* Messages from workers                                                     */

static bool use_nccl(const dit_supervisor *s)
{
    return s->N > 1 && strcmp(s->cfg.backend, "cuda") == 0;
}

static void on_startup_timeout(uv_timer_t *t);
static void on_straggler_timeout(uv_timer_t *t);

static double straggler_grace_s(const dit_supervisor *s)
{
    const double c = s->cfg.comm_timeout_s;
    return c > 0 && c < SUP_STRAGGLER_GRACE_S ? c : SUP_STRAGGLER_GRACE_S;
}

/* Sends the setup to ranks [from, to). */
static void send_setup_range(dit_supervisor *s, int from, int to)
{
    Ditserve__Ipc__Setup setup = DITSERVE__IPC__SETUP__INIT;
    const dit_parallel_config *pc = &s->cfg.pc;
    setup.world_size = pc->world_size;
    setup.ring_degree = pc->ring_degree;
    setup.ulysses_degree = pc->ulysses_degree;
    setup.tp_degree = pc->tp_degree;
    setup.cfg_degree = pc->cfg_degree;
    setup.ulysses_anything = pc->ulysses_anything;
    setup.ring_anything = pc->ring_anything;
    setup.unified_anything = pc->unified_anything;
    setup.fp32_merge = pc->fp32_merge;
    setup.shm_name = s->shm_name;
    setup.nccl_id.data = s->nccl_id;
    setup.nccl_id.len = s->nccl_id_len;
    setup.model_dir = (char *)s->cfg.model_dir;
    setup.backend = (char *)s->cfg.backend;
    setup.comm_timeout_s = s->cfg.comm_timeout_s;
    setup.lora_cache_bytes = s->cfg.lora_cache_bytes;
    setup.decode_on_every_rank = s->cfg.decode_on_every_rank;
    Ditserve__Ipc__JobLora pl[DIT_DAEMON_MAX_PRELOAD_LORAS], *plp[DIT_DAEMON_MAX_PRELOAD_LORAS];
    for (int i = 0; i < s->cfg.n_preload_loras && i < DIT_DAEMON_MAX_PRELOAD_LORAS; i++) {
        ditserve__ipc__job_lora__init(&pl[i]);
        pl[i].name = (char *)s->cfg.preload_loras[i].name;
        pl[i].path = (char *)s->cfg.preload_loras[i].path;
        dit_file_id id; /* every rank preloads the same version */
        if (dit_file_id_of(pl[i].path, &id)) {
            pl[i].file_dev = id.dev;
            pl[i].file_ino = id.ino;
            pl[i].file_size = id.size;
            pl[i].file_mtime_ns = id.mtime_ns;
        }
        plp[i] = &pl[i];
        setup.n_preload_loras++;
    }
    setup.preload_loras = plp;
    Ditserve__Ipc__JobLora fuse = DITSERVE__IPC__JOB_LORA__INIT;
    if (s->cfg.fuse_lora) {
        fuse.name = (char *)s->cfg.fuse_lora->name;
        fuse.path = (char *)s->cfg.fuse_lora->path;
        fuse.scale = s->cfg.fuse_lora_scale;
        setup.fuse_lora = &fuse;
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    /* Every local worker of every mesh on this host shares its cores. */
    const int here = (s->L > 0 ? s->L : 1) * (s->cfg.meshes > 1 ? s->cfg.meshes : 1);
    const int local_threads =
        s->cfg.threads ? s->cfg.threads : (ncpu > here ? (int)(ncpu / here) : 1);
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_SETUP;
    env.setup = &setup;
    for (int r = from; r < to; r++) {
        setup.rank = r;
        /* One GPU per local rank; joined workers pick their own, and their
         * own thread count (0: all their cores) unless --threads is set. */
        setup.device = r < s->L ? s->cfg.device_base + r : -1;
        setup.threads = r < s->L ? local_threads : s->cfg.threads;
        send_to(s->by_rank[r], &env);
    }
}

static void send_setup(dit_supervisor *s)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    if (s->L < s->N) {
        /* Every rank is here: from now on, loading has a deadline. */
        uv_timer_start(&s->startup_timer, on_startup_timeout,
                       (uint64_t)(s->cfg.startup_timeout_s * 1000), 0);
        DIT_LOG(s->log, DIT_LOG_INFO, s->name, "all %d ranks present (%d joined); setting up", s->N,
                s->N - s->L);
    }
    if (use_nccl(s)) {
        /* Rank 0 makes the NCCL id (and runs its bootstrap root); the others
         * get it once rank 0 has sent it (MeshId). */
        s->nccl_id_len = 0;
        set_phase(s, PH_MESH_ID);
        send_setup_range(s, 0, 1);
        return;
    }
    if (s->N > 1) {
        dit_shm_config sc = {.world_size = s->N, .timeout_s = s->cfg.comm_timeout_s};
        dit_shm_make_name(&sc);
        if (dit_shm_segment_create(&sc, &s->seg, &diag) != DIT_OK) {
            dit_supervisor_fail(s, dit_diag_msg(&diag));
            return;
        }
        snprintf(s->shm_name, sizeof s->shm_name, "%s", sc.name);
    }
    set_phase(s, PH_LOADING);
    send_setup_range(s, 0, s->N);
}

/* Closes a connection that broke the protocol; one that plays a rank takes
 * the mesh down with it. */
static void drop_conn(conn *c, const char *why)
{
    dit_supervisor *s = c->s;
    const int rank = c->rank;
    DIT_LOG(s->log, DIT_LOG_WARN, s->name, "%s from %s%d; closing it", why,
            rank >= 0 ? "rank " : "a worker without a rank, pid ", rank >= 0 ? rank : c->jp.pid);
    close_conn(c);
    if (rank >= 0 && !s->stopping) {
        char reason[200];
        snprintf(reason, sizeof reason, "worker rank %d broke the protocol (%s)", rank, why);
        dit_supervisor_fail(s, reason);
    }
}

static void handle(conn *c, Ditserve__Ipc__Envelope *env)
{
    dit_supervisor *s = c->s;
    char reason[1200];
    /* Without a rank a worker may only say hello (a spawned one); a joined
     * worker in the pool has nothing to say until it gets its setup. */
    if (c->rank < 0 && (c->tcp || env->msg_case != DITSERVE__IPC__ENVELOPE__MSG_HELLO)) {
        snprintf(reason, sizeof reason, "unexpected message %d", (int)env->msg_case);
        drop_conn(c, reason);
        ditserve__ipc__envelope__free_unpacked(env, NULL);
        return;
    }
    switch (env->msg_case) {
    case DITSERVE__IPC__ENVELOPE__MSG_HELLO: {
        const int r = env->hello->rank;
        if (c->rank >= 0 || c->tcp || r < 0 || r >= s->L || s->by_rank[r]) {
            snprintf(reason, sizeof reason, "an unexpected hello (rank %d)", r);
            drop_conn(c, reason);
            break;
        }
        c->rank = r;
        s->by_rank[r] = c;
        if (s->stopping) {
            /* Started before the stop and connected after it: it missed
             * the Shutdown the others got, and has nothing to load. */
            Ditserve__Ipc__Shutdown sd = DITSERVE__IPC__SHUTDOWN__INIT;
            Ditserve__Ipc__Envelope out = DITSERVE__IPC__ENVELOPE__INIT;
            out.msg_case = DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN;
            out.shutdown = &sd;
            send_to(c, &out);
            break;
        }
        if (++s->hellos == s->N)
            send_setup(s);
        break;
    }
    case DITSERVE__IPC__ENVELOPE__MSG_MESH_ID: {
        const ProtobufCBinaryData *id = &env->mesh_id->nccl_id;
        if (c->rank != 0 || s->phase != PH_MESH_ID || id->len == 0 || id->len > sizeof s->nccl_id) {
            DIT_LOG(s->log, DIT_LOG_WARN, s->name, "unexpected mesh id from rank %d; ignored",
                    c->rank);
            break;
        }
        memcpy(s->nccl_id, id->data, id->len);
        s->nccl_id_len = id->len;
        set_phase(s, PH_LOADING);
        send_setup_range(s, 1, s->N);
        break;
    }
    case DITSERVE__IPC__ENVELOPE__MSG_READY:
        if (env->ready->memory && s->ev.worker_memory)
            s->ev.worker_memory(s->ev.ctx, c->rank, env->ready->memory);
        if (c->rank >= 0 && c->rank < s->N && env->ready->device) {
            /* A remote worker's words: printable ASCII only, bounded. */
            char *d = s->device[c->rank];
            size_t n = 0;
            for (const char *p = env->ready->device; *p && n + 1 < sizeof s->device[0]; p++)
                d[n++] = *p >= 0x20 && *p < 0x7f ? *p : '?';
            d[n] = '\0';
        }
        DIT_LOG(s->log, DIT_LOG_INFO, s->name,
                "rank %d ready (%.0f ms to load, %.1f MiB of weights%s%.*s)", c->rank,
                env->ready->load_ms, (double)env->ready->weight_bytes / 1048576.0,
                env->ready->blas && env->ready->blas[0] ? "; " : "", 160,
                env->ready->blas ? env->ready->blas : "");
        if (s->rank_ready[c->rank]) {
            drop_conn(c, "a second ready");
            break;
        }
        s->rank_ready[c->rank] = true;
        if (++s->readies == s->N) {
            uv_timer_stop(&s->startup_timer);
            /* Every rank has mapped the segment (they join it before they
             * load): its name can go, so a killed ditd leaves nothing in
             * /dev/shm. */
            dit_shm_segment_unlink(s->seg);
            set_phase(s, PH_READY);
        }
        break;
    case DITSERVE__IPC__ENVELOPE__MSG_PROGRESS:
        if (s->phase == PH_RUNNING && env->progress->job_id == s->job_id && c->rank == 0) {
            uv_timer_again(&s->watchdog_timer);
            if (s->ev.job_progress)
                s->ev.job_progress(s->ev.ctx, s->job_id, env->progress->step,
                                   env->progress->total_steps, env->progress->elapsed_ms,
                                   env->progress->stage && env->progress->stage[0]
                                       ? env->progress->stage
                                       : "denoising");
        }
        break;
    case DITSERVE__IPC__ENVELOPE__MSG_DONE: {
        const Ditserve__Ipc__JobDone *d = env->done;
        if (d->memory && s->ev.worker_memory && c->rank >= 0)
            s->ev.worker_memory(s->ev.ctx, c->rank, d->memory);
        if (s->phase != PH_RUNNING || d->job_id != s->job_id) {
            if (d->status != DIT_OK && public_state(s->phase) == DIT_MESH_STARTING) {
                /* A worker could not set up: no point waiting for the rest. */
                snprintf(reason, sizeof reason, "worker rank %d failed to start: %s", c->rank,
                         d->message ? d->message : "");
                dit_supervisor_fail(s, reason);
            }
            break;
        }
        if (s->rank_done[c->rank]) {
            drop_conn(c, "a second result for one job");
            break;
        }
        s->rank_done[c->rank] = true;
        s->rank_done_ms[c->rank] = (double)uv_hrtime() / 1e6;
        /* The first failure stands, but a rank's own failure replaces one
         * that only followed another rank's. */
        if (d->status != DIT_OK &&
            (s->job_status == DIT_OK || (s->job_peer_failed && !d->peer_failed))) {
            s->job_status = (dit_status)d->status;
            s->job_err_rank = c->rank;
            s->job_peer_failed = d->peer_failed;
            snprintf(s->job_msg, sizeof s->job_msg, "%s", d->message ? d->message : "");
        }
        if (d->status == DIT_OK && (c->rank == 0 || d->n_batch > 0) && c->rank < SUP_MAX_RANKS &&
            !s->job_results[c->rank]) {
            s->job_results[c->rank] = env;
            env = NULL; /* kept */
        }
        if (d->worker_exits)
            s->job_ends_mesh = true;
        if (++s->job_done_ranks == s->N) {
            if (s->job_status == DIT_OK)
                s->backoff_s = SUP_BACKOFF_MIN_S; /* the mesh works: forget old failures */
            if (s->job_ends_mesh) {
                /* Every rank reported, but some leave now: the mesh is
                 * rebuilt before the job's end is told, so that the queue
                 * does not hand the next job to workers on their way out
                 * (it would fail as soon as their sockets close). */
                snprintf(reason, sizeof reason,
                         "worker rank %d leaves after the job's failure (the mesh cannot go on)",
                         s->job_err_rank);
                dit_supervisor_fail(s, reason);
                break;
            }
            set_phase(s, PH_READY);
            finish_job(s, s->job_status, s->job_msg);
        } else if (d->status != DIT_OK && !d->peer_failed && s->job_collective &&
                   !uv_is_active((uv_handle_t *)&s->straggler_timer)) {
            /* A rank failed on its own while others still run: unless they
             * follow it at once, they wait for it inside a collective. */
            uv_timer_start(&s->straggler_timer, on_straggler_timeout,
                           (uint64_t)(straggler_grace_s(s) * 1000), 0);
        }
        break;
    }
    default:
        DIT_LOG(s->log, DIT_LOG_WARN, s->name, "unexpected message %d from rank %d",
                (int)env->msg_case, c->rank);
        break;
    }
    if (env)
        ditserve__ipc__envelope__free_unpacked(env, NULL);
}

/* Reads land in the connection's reader, sized for the whole frame being
 * received: a result of several hundred KB arrives in one or two reads and
 * is not copied again before it is unpacked. A joiner not yet authenticated
 * gets room for one byte past what it may send before it has. */
static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    conn *c = h->data;
    size_t min = suggested, max = DIT_IPC_MAX_FRAME;
    if (c->tcp && !dit_joiners_joined(&c->jp)) {
        min = c->reader.len <= DIT_JOINERS_PREAUTH_BYTES
                  ? DIT_JOINERS_PREAUTH_BYTES + 1 - c->reader.len
                  : 1;
        max = min;
    }
    uint8_t *room;
    size_t n;
    if (dit_ipc_reader_room(&c->reader, min, max, &room, &n) != 0) {
        buf->base = NULL;
        buf->len = 0;
        return;
    }
    buf->base = (char *)room;
    /* The room may be the buffer's whole free end: a peer that has not
     * joined gets no more than it is allowed. */
    buf->len = n > max ? max : n;
}

/* ------------------------------------------------------------------------ */
/* Workers joining over TCP                                                  */

static double now_s(const dit_supervisor *s)
{
    return (double)uv_now(s->loop) / 1e3;
}

/* The join handshake's transport: frames and closes go through the
 * connection that embeds the joiner. */
static int join_send(void *ctx, dit_joiner *p, const Ditserve__Ipc__Envelope *env)
{
    (void)ctx;
    return send_to(CONN_OF_JOINER(p), env);
}

static void join_close(void *ctx, dit_joiner *p, bool flush)
{
    (void)ctx;
    conn *c = CONN_OF_JOINER(p);
    if (flush)
        close_conn_flushed(c);
    else
        close_conn(c);
}

/* Gives the free remote ranks of a starting mesh to the joined workers that
 * wait: first those that asked for that rank, then the others, oldest
 * first. */
static void assign_remote(dit_supervisor *s)
{
    if (public_state(s->phase) != DIT_MESH_STARTING || s->stopping || !s->joiners)
        return;
    for (int pass = 0; pass < 2; pass++) {
        for (int r = s->L; r < s->N; r++) {
            if (s->by_rank[r])
                continue;
            dit_joiner *p = dit_joiners_take(s->joiners, r, pass == 1);
            if (!p)
                continue;
            conn *best = CONN_OF_JOINER(p);
            best->rank = r;
            s->by_rank[r] = best;
            best->counted = true;
            s->open_joiners--;
            s->open_conns++;
            DIT_LOG(s->log, DIT_LOG_INFO, "join", "rank %d: the worker at %s (pid %d)", r, p->addr,
                    p->pid);
            if (++s->hellos == s->N)
                send_setup(s);
            if (public_state(s->phase) != DIT_MESH_STARTING)
                return; /* the setup failed */
        }
    }
}

static void on_join_tick(uv_timer_t *t)
{
    dit_supervisor *s = t->data;
    const double now = now_s(s);
    dit_joiners_expire(s->joiners, now);
    assign_remote(s);
    if (public_state(s->phase) == DIT_MESH_STARTING && s->hellos < s->N &&
        now - s->join_reminded_s >= SUP_JOIN_REMIND_S) {
        s->join_reminded_s = now;
        char missing[256] = "";
        size_t len = 0;
        for (int r = s->L; r < s->N && len + 8 < sizeof missing; r++)
            if (!s->by_rank[r])
                len += (size_t)snprintf(missing + len, sizeof missing - len, "%s%d",
                                        len ? ", " : "", r);
        DIT_LOG(s->log, DIT_LOG_INFO, "join",
                "waiting for workers to join on port %d for rank(s) %s", s->join_port, missing);
    }
}

/* ------------------------------------------------------------------------ */
/* Reading from workers                                                      */

static void on_read(uv_stream_t *stream, ssize_t n, const uv_buf_t *buf)
{
    conn *c = stream->data;
    dit_supervisor *s = c->s;
    const bool preauth = c->tcp && !dit_joiners_joined(&c->jp);
    (void)buf; /* it points into c->reader (alloc_cb) */
    if (n > 0)
        dit_ipc_reader_commit(&c->reader, (size_t)n);
    if (n > 0 && preauth && c->reader.len > DIT_JOINERS_PREAUTH_BYTES) {
        dit_joiners_refuse(s->joiners, &c->jp, true, "join request too large");
        return;
    }
    if (n < 0) {
        const int rank = c->rank;
        close_conn(c);
        if (!s->stopping && rank >= 0 && c->tcp && s->phase == PH_GATHERING) {
            /* A joined worker that leaves before the mesh's setup went out
             * (a pod restarting while another rank is awaited) frees its
             * rank for the next joiner; the rest of the mesh waits on. */
            s->hellos--;
            DIT_LOG(s->log, DIT_LOG_WARN, "join",
                    "the worker for rank %d (at %s) left before the mesh started; waiting for "
                    "another",
                    rank, c->jp.addr);
            assign_remote(s);
        } else if (!s->stopping && rank >= 0) {
            char reason[200];
            if (c->tcp)
                snprintf(reason, sizeof reason, "lost the connection to worker rank %d (at %s)",
                         rank, c->jp.addr);
            else
                snprintf(reason, sizeof reason, "lost the connection to worker rank %d", rank);
            dit_supervisor_fail(s, reason);
        } else if (c->tcp && rank < 0) {
            DIT_LOG(s->log, DIT_LOG_DEBUG, "join", "the waiting worker at %s left", c->jp.addr);
        }
        return;
    }
    Ditserve__Ipc__Envelope *env;
    int got;
    while (!c->closing && (got = dit_ipc_reader_next(&c->reader, &env)) == 1) {
        if (!c->tcp || dit_joiners_joined(&c->jp))
            handle(c, env);
        else if (dit_joiners_handle(s->joiners, &c->jp, env))
            assign_remote(s);
    }
    if (!c->closing && got < 0) {
        const int rank = c->rank;
        close_conn(c);
        if (rank >= 0) {
            char reason[160];
            snprintf(reason, sizeof reason, "corrupt message stream from worker rank %d", rank);
            dit_supervisor_fail(s, reason);
        } else {
            DIT_LOG(s->log, DIT_LOG_WARN, "join", "corrupt message stream from %s; closed",
                    c->jp.addr);
        }
    }
}

/* A remote host that vanishes without closing is noticed within about a
 * minute, not the kernel's hours (keepalive) or its 15 minutes of
 * retransmissions (with data in flight): serve/join_auth.h. */
static void join_socket_options(conn *c, const char *addr)
{
    uv_os_fd_t fd;
    if (uv_fileno(&c->h.handle, &fd) != 0 || dit_join_socket_options(fd) != 0)
        DIT_LOG(c->s->log, DIT_LOG_WARN, "join",
                "cannot set the TCP keepalive and timeout of the connection from %s", addr);
}

static conn *new_conn(dit_supervisor *s, bool tcp)
{
    conn *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->s = s;
    c->rank = -1;
    /* A spawned worker needs no handshake: the Unix socket's folder is
     * this user's alone. */
    c->tcp = tcp;
    dit_ipc_reader_init(&c->reader);
    if (tcp)
        uv_tcp_init(s->loop, &c->h.tcp);
    else
        uv_pipe_init(s->loop, &c->h.pipe, 0);
    c->h.handle.data = c;
    c->counted = !tcp;
    if (c->counted)
        s->open_conns++;
    else
        s->open_joiners++;
    c->next = s->conns;
    s->conns = c;
    return c;
}

static void on_spare_closed(uv_handle_t *h)
{
    sup_spare *sp = h->data;
    dit_supervisor *s = sp->s;
    sp->closing = false;
    const bool waiting = sp->waiting;
    sp->waiting = false;
    if (waiting && !s->destroyed && !uv_is_closing((uv_handle_t *)sp->server))
        sp->retry(sp->server, 0);
    maybe_free(s);
}

/* The connection waiting on server gets no conn (no memory): it is closed
 * through the listener's spare, which needs no memory of its own, so that
 * the listener goes on. Allocation failure cannot be caused in a test. */
static void drop_connection(dit_supervisor *s, uv_stream_t *server, sup_spare *sp,
                            uv_connection_cb cb)
{
    if (sp->closing) {
        sp->waiting = true; /* the listener pauses until the spare is free */
        return;
    }
    sp->s = s;
    sp->server = server;
    sp->retry = cb;
    if (server->type == UV_TCP)
        uv_tcp_init(s->loop, &sp->h.tcp);
    else
        uv_pipe_init(s->loop, &sp->h.pipe, 0);
    sp->h.handle.data = sp;
    sp->closing = true;
    (void)uv_accept(server, &sp->h.stream);
    uv_close(&sp->h.handle, on_spare_closed);
    DIT_LOG(s->log, DIT_LOG_WARN, s->name, "no memory for a new connection: closed it");
}

static void on_connection(uv_stream_t *server, int status)
{
    dit_supervisor *s = server->data;
    if (status < 0)
        return;
    conn *c = new_conn(s, false);
    if (!c) {
        drop_connection(s, server, &s->spare, on_connection);
        return;
    }
    if (uv_accept(server, &c->h.stream) != 0 || uv_read_start(&c->h.stream, alloc_cb, on_read) != 0)
        close_conn(c);
}

static void on_join_connection(uv_stream_t *server, int status)
{
    dit_supervisor *s = server->data;
    if (status < 0)
        return;
    conn *c = new_conn(s, true);
    if (!c) {
        drop_connection(s, server, &s->join_spare, on_join_connection);
        return;
    }
    char addr[80] = "an unknown address";
    if (uv_accept(server, &c->h.stream) != 0) {
        close_conn(c);
        return;
    }
    struct sockaddr_storage sa;
    int salen = sizeof sa;
    if (uv_tcp_getpeername(&c->h.tcp, (struct sockaddr *)&sa, &salen) == 0) {
        char ip[64] = "?";
        int port = 0;
        if (sa.ss_family == AF_INET6) {
            const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&sa;
            uv_ip6_name(a, ip, sizeof ip);
            port = ntohs(a->sin6_port);
            snprintf(addr, sizeof addr, "[%s]:%d", ip, port);
        } else {
            const struct sockaddr_in *a = (const struct sockaddr_in *)&sa;
            uv_ip4_name(a, ip, sizeof ip);
            port = ntohs(a->sin_port);
            snprintf(addr, sizeof addr, "%s:%d", ip, port);
        }
    }
    join_socket_options(c, addr);
    if (uv_read_start(&c->h.stream, alloc_cb, on_read) != 0) {
        close_conn(c);
        return;
    }
    /* The oldest handshake goes past the limit; then the challenge. */
    dit_joiners_accept(s->joiners, &c->jp, addr, now_s(s), s->stopping);
}

/* ------------------------------------------------------------------------ */
/* Processes                                                                 */

static void on_proc_closed(uv_handle_t *h)
{
    worker_slot *w = h->data;
    w->spawned = false;
    w->s->open_procs--;
    check_torn_down(w->s);
    maybe_free(w->s);
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
    if (!s->stopping && !s->destroyed && public_state(s->phase) != DIT_MESH_RESTARTING)
        dit_supervisor_fail(s, reason);
    else
        DIT_LOG(s->log, DIT_LOG_DEBUG, s->name, "%s", reason);
    uv_close((uv_handle_t *)p, on_proc_closed);
}

static void on_startup_timeout(uv_timer_t *t)
{
    dit_supervisor *s = t->data;
    bool locals = true;
    for (int r = 0; r < s->L; r++)
        locals &= s->by_rank[r] != NULL;
    if (s->phase == PH_GATHERING && locals && s->L < s->N) {
        /* Only joiners are missing: waiting for them has no deadline. */
        uv_timer_start(&s->startup_timer, on_startup_timeout,
                       (uint64_t)(s->cfg.startup_timeout_s * 1000), 0);
        return;
    }
    char reason[160];
    snprintf(reason, sizeof reason, "the workers were not ready within %.0f s (%d of %d ready)",
             s->cfg.startup_timeout_s, s->readies, s->N);
    dit_supervisor_fail(s, reason);
}

static void on_straggler_timeout(uv_timer_t *t)
{
    dit_supervisor *s = t->data;
    if (s->phase != PH_RUNNING)
        return;
    char waiting[96] = "";
    size_t len = 0;
    int count = 0;
    for (int r = 0; r < s->N && len + 12 < sizeof waiting; r++)
        if (!s->rank_done[r]) {
            len +=
                (size_t)snprintf(waiting + len, sizeof waiting - len, "%s%d", len ? ", " : "", r);
            count++;
        }
    char reason[200];
    snprintf(reason, sizeof reason,
             "rank%s %s still waited for rank %d in the forward %.1f s after it failed",
             count > 1 ? "s" : "", waiting, s->job_err_rank, straggler_grace_s(s));
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
    memset(s->rank_ready, 0, sizeof s->rank_ready);
    s->shm_name[0] = '\0';
    s->nccl_id_len = 0;
    s->join_reminded_s = now_s(s);
    set_phase(s, PH_GATHERING);
    /* The local workers must say hello in time; with remote ranks, the
     * deadline for loading starts again once every rank is present. */
    uv_timer_start(&s->startup_timer, on_startup_timeout,
                   (uint64_t)(s->cfg.startup_timeout_s * 1000), 0);
    for (int r = 0; r < s->L; r++) {
        worker_slot *w = &s->workers[r];
        char rank[16], parent[24];
        snprintf(rank, sizeof rank, "%d", r);
        /* Our pid: a worker checks its parent against it, which holds
         * where ditd is pid 1 (a container's entrypoint) too. */
        snprintf(parent, sizeof parent, "%ld", (long)getpid());
        char *args[] = {(char *)s->cfg.worker_path,
                        "--connect",
                        s->sock_path,
                        "--rank",
                        rank,
                        "--parent-pid",
                        parent,
                        NULL};
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
    /* The pids, rank by rank: an operator (or a test) can tell which
     * process plays which rank of which mesh. */
    char pids[SUP_MAX_RANKS * 12] = "";
    size_t len = 0;
    for (int r = 0; r < s->L && len < sizeof pids; r++)
        len += (size_t)snprintf(pids + len, sizeof pids - len, "%s%d", r ? " " : "",
                                (int)s->workers[r].pid);
    if (s->L < s->N)
        DIT_LOG(s->log, DIT_LOG_INFO, s->name,
                "started %d local worker(s) (pids %s); ranks %d to %d join on port %d", s->L, pids,
                s->L, s->N - 1, s->join_port);
    else
        DIT_LOG(s->log, DIT_LOG_INFO, s->name, "started %d worker(s) (pids %s)", s->N, pids);
    assign_remote(s);
}

/* ------------------------------------------------------------------------ */
/* Public                                                                    */

static void free_on_close(uv_handle_t *h)
{
    free(h->data);
}

static dit_status open_join_port(dit_supervisor *s, dit_diag *diag)
{
    char host[256];
    int port;
    dit_status st = dit_join_split_address(s->cfg.join_listen, host, sizeof host, &port, diag);
    if (st != DIT_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", dit_diag_msg(diag));
        return dit_diag_set(diag, st, "--join-listen: %s", msg);
    }
    struct sockaddr_storage sa;
    memset(&sa, 0, sizeof sa);
    if (uv_ip4_addr(host, port, (struct sockaddr_in *)&sa) != 0 &&
        uv_ip6_addr(host, port, (struct sockaddr_in6 *)&sa) != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "--join-listen: '%s' is not an IPv4 or IPv6 address", host);
    uv_tcp_init(s->loop, &s->join_listener);
    s->join_listener.data = s;
    s->join_open = true;
    int err = uv_tcp_bind(&s->join_listener, (const struct sockaddr *)&sa, 0);
    if (err == 0)
        err = uv_listen((uv_stream_t *)&s->join_listener, 64, on_join_connection);
    if (err != 0)
        return dit_diag_set(diag, DIT_ERR_IO, "cannot listen for workers on %s: %s",
                            s->cfg.join_listen, uv_strerror(err));
    struct sockaddr_storage bound;
    int blen = sizeof bound;
    if (uv_tcp_getsockname(&s->join_listener, (struct sockaddr *)&bound, &blen) == 0)
        s->join_port =
            ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                              : ((struct sockaddr_in *)&bound)->sin_port);
    uv_timer_start(&s->join_timer, on_join_tick, SUP_JOIN_TICK_MS, SUP_JOIN_TICK_MS);
    return DIT_OK;
}

/* Removes /tmp/ditd-PID-* socket folders of this user whose ditd is gone:
 * the socket inside, then the folder (rmdir refuses one holding more). */
/* A socket folder's lock file, flock'ed by its live owner. */
#define SOCK_LOCK_NAME "owner.lock"

static int reclaim_sock_dirs(void)
{
    DIR *dir = opendir("/tmp");
    if (!dir)
        return 0;
    int removed = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        if (strncmp(e->d_name, "ditd-", 5) != 0)
            continue;
        char *end;
        const long pid = strtol(e->d_name + 5, &end, 10);
        if (end == e->d_name + 5 || *end != '-' || pid <= 0 || pid > INT_MAX)
            continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue;
        struct stat sb;
        if (fstatat(dirfd(dir), e->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(sb.st_mode) ||
            sb.st_uid != geteuid())
            continue;
        /* No such pid here; but a ditd in another pid namespace (a
         * container sharing /tmp) has a pid that means nothing here: its
         * lock says it lives. A folder without a lock file is a moment old
         * (its owner is about to make one) or an older ditd's: left alone
         * for a minute. */
        char path[400];
        snprintf(path, sizeof path, "/tmp/%s/" SOCK_LOCK_NAME, e->d_name);
        const int fd = open(path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
        if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0) {
            close(fd);
            continue;
        }
        if (fd < 0 && (errno != ENOENT || time(NULL) - sb.st_mtime < 60))
            continue;
        if (fd >= 0)
            unlink(path);
        snprintf(path, sizeof path, "/tmp/%s/ipc.sock", e->d_name);
        unlink(path);
        snprintf(path, sizeof path, "/tmp/%s", e->d_name);
        if (rmdir(path) == 0)
            removed++;
        if (fd >= 0)
            close(fd);
    }
    closedir(dir);
    return removed;
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
    s->name = cfg->name ? cfg->name : "mesh";
    s->N = cfg->pc.world_size;
    s->L = cfg->local_ranks;
    s->join_port = -1;
    s->backoff_s = SUP_BACKOFF_MIN_S;
    if (s->L < 0 || s->L > s->N || (s->L < s->N && (!cfg->join_listen || !cfg->join_secret))) {
        free(s);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "ranks %d to %d are remote: they need a join address and secret",
                            cfg->local_ranks, cfg->pc.world_size - 1);
    }
    for (int r = 0; r < SUP_MAX_RANKS; r++)
        snprintf(s->device[r], sizeof s->device[r], "%s", cfg->backend);
    /* What a ditd killed with SIGKILL left behind (its workers died with
     * it): socket folders and shm segments named with its pid. */
    const int stale = reclaim_sock_dirs() + dit_shm_reclaim_stale();
    if (stale > 0)
        DIT_LOG(cfg->log, DIT_LOG_INFO, s->name,
                "removed %d socket folder(s) and shm segment(s) of ditd processes that are gone",
                stale);
    /* The IPC socket lives in a folder only this user can enter, named with
     * ditd's pid so that the next ditd can remove it if this one is killed. */
    snprintf(s->sock_dir, sizeof s->sock_dir, "/tmp/ditd-%d-XXXXXX", (int)getpid());
    if (!mkdtemp(s->sock_dir)) {
        dit_status st =
            dit_diag_set(diag, DIT_ERR_IO, "cannot create a socket folder: %s", strerror(errno));
        free(s);
        return st;
    }
    char lock_path[sizeof s->sock_dir + sizeof SOCK_LOCK_NAME + 1];
    snprintf(lock_path, sizeof lock_path, "%s/" SOCK_LOCK_NAME, s->sock_dir);
    s->lock_fd = open(lock_path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (s->lock_fd < 0 || flock(s->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        dit_status st = dit_diag_set(diag, DIT_ERR_IO, "cannot lock the socket folder %s: %s",
                                     s->sock_dir, strerror(errno));
        if (s->lock_fd >= 0)
            close(s->lock_fd);
        unlink(lock_path);
        rmdir(s->sock_dir);
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
        unlink(lock_path);
        close(s->lock_fd);
        rmdir(s->sock_dir);
        uv_close((uv_handle_t *)&s->listener, free_on_close);
        return st;
    }
    chmod(s->sock_path, 0600);
    uv_timer_t *timers[6] = {&s->startup_timer, &s->watchdog_timer, &s->backoff_timer,
                             &s->kill_timer,    &s->join_timer,     &s->straggler_timer};
    for (int i = 0; i < 6; i++) {
        uv_timer_init(loop, timers[i]);
        timers[i]->data = s;
    }
    s->phase = PH_STOPPED;
    if (s->L < s->N) {
        const dit_joiners_config jc = {.secret = cfg->join_secret,
                                       .backend = cfg->backend,
                                       .world_size = s->N,
                                       .local_ranks = s->L,
                                       .log = cfg->log};
        const dit_joiners_io io = {.ctx = s, .send = join_send, .close = join_close};
        dit_status st = dit_joiners_create(&jc, &io, &s->joiners, diag);
        if (st == DIT_OK)
            st = open_join_port(s, diag);
        if (st != DIT_OK) {
            /* Everything is a loop handle now: let destroy free it. */
            dit_supervisor_destroy(s);
            return st;
        }
    }
    *out = s;
    return DIT_OK;
}

void dit_supervisor_start(dit_supervisor *s)
{
    spawn_all(s);
}

dit_mesh_state dit_supervisor_state(const dit_supervisor *s)
{
    return public_state(s->phase);
}

bool dit_supervisor_idle(const dit_supervisor *s)
{
    return s->phase == PH_READY && !s->stopping;
}

dit_status dit_supervisor_run(dit_supervisor *s, uint64_t job_id, const Ditserve__Ipc__Job *tmpl,
                              dit_diag *diag)
{
    if (!dit_supervisor_idle(s))
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "the mesh is not idle");
    Ditserve__Ipc__Job job = *tmpl;
    job.job_id = job_id;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_JOB;
    env.job = &job;
    /* A job that cannot be encoded is its own failure, not the mesh's. */
    frame_buf *f = frame_encode(&env);
    if (!f) {
        const size_t n = ditserve__ipc__envelope__get_packed_size(&env);
        if (n > DIT_IPC_MAX_FRAME)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "the job's requests come to %zu bytes, more than the %zu one "
                                "worker message holds",
                                n, (size_t)DIT_IPC_MAX_FRAME);
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for the job's message (%zu bytes)",
                            n);
    }
    set_phase(s, PH_RUNNING);
    drop_job_results(s); /* none are left from the last job; defence */
    s->job_id = job_id;
    s->job_done_ranks = 0;
    memset(s->rank_done, 0, sizeof s->rank_done);
    s->job_status = DIT_OK;
    s->job_peer_failed = false;
    s->job_ends_mesh = false;
    s->job_collective = !tmpl->lora_only;
    s->job_msg[0] = '\0';
    for (int r = 0; r < s->N; r++) {
        if (write_frame(s->by_rank[r], f) != 0) {
            frame_unref(f);
            char reason[120];
            snprintf(reason, sizeof reason, "cannot send the job to worker rank %d", r);
            dit_supervisor_fail(s, reason);
            return DIT_OK; /* the job ended through job_done */
        }
    }
    frame_unref(f);
    uv_timer_start(&s->watchdog_timer, on_watchdog, (uint64_t)(s->cfg.job_timeout_s * 1000),
                   (uint64_t)(s->cfg.job_timeout_s * 1000));
    return DIT_OK;
}

void dit_supervisor_cancel(dit_supervisor *s, uint64_t job_id)
{
    /* Any id is passed on while a job runs: it may name one member of a
     * batch, and the workers ignore ids they do not run. */
    if (s->phase != PH_RUNNING)
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
    for (int r = 0; r < s->L; r++)
        left += s->workers[r].alive;
    if (left)
        DIT_LOG(s->log, DIT_LOG_WARN, s->name, "%d worker(s) did not exit in time; killing them",
                left);
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
    if (s->phase == PH_RUNNING) {
        set_phase(s, PH_READY); /* the same public state: nobody hears of it */
        finish_job(s, DIT_ERR_CANCELLED, "the server is shutting down");
    }
    set_phase(s, PH_STOPPING);
    Ditserve__Ipc__Shutdown sd = DITSERVE__IPC__SHUTDOWN__INIT;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN;
    env.shutdown = &sd;
    conn *next;
    for (conn *c = s->conns; c; c = next) {
        next = c->next;
        if (!c->tcp || dit_joiners_joined(&c->jp))
            send_to(c, &env);
        else
            dit_joiners_refuse(s->joiners, &c->jp, false, "the daemon is shutting down");
    }
    uv_timer_start(&s->kill_timer, on_kill_timer, (uint64_t)(grace_s * 1000), 0);
    /* Connections close as workers exit (EOF); processes close from their
     * exit callbacks. Nothing running: done at once. */
    check_torn_down(s);
}

static void on_handle_closed(uv_handle_t *h)
{
    dit_supervisor *s = h->data;
    s->handles_open--;
    maybe_free(s);
}

static void on_listener_closed(uv_handle_t *h)
{
    dit_supervisor *s = h->data;
    unlink(s->sock_path);
    char lock_path[sizeof s->sock_dir + sizeof SOCK_LOCK_NAME + 1];
    snprintf(lock_path, sizeof lock_path, "%s/" SOCK_LOCK_NAME, s->sock_dir);
    unlink(lock_path);
    close(s->lock_fd);
    s->lock_fd = -1;
    rmdir(s->sock_dir);
    on_handle_closed(h);
}

void dit_supervisor_destroy(dit_supervisor *s)
{
    if (!s)
        return;
    drop_job_results(s);
    s->destroyed = true;
    /* Connections and processes still open (a destroy without a stop, after
     * a failed start) go too; each close callback counts down. */
    kill_all(s);
    while (s->conns)
        close_conn(s->conns);
    uv_handle_t *hs[8] = {(uv_handle_t *)&s->listener,        (uv_handle_t *)&s->startup_timer,
                          (uv_handle_t *)&s->watchdog_timer,  (uv_handle_t *)&s->backoff_timer,
                          (uv_handle_t *)&s->kill_timer,      (uv_handle_t *)&s->join_timer,
                          (uv_handle_t *)&s->straggler_timer, (uv_handle_t *)&s->join_listener};
    const int n = s->join_open ? 8 : 7;
    s->handles_open = n;
    for (int i = 0; i < n; i++)
        uv_close(hs[i], i == 0 ? on_listener_closed : on_handle_closed);
}

int64_t dit_supervisor_restarts(const dit_supervisor *s)
{
    return s->restarts;
}

int dit_supervisor_join_port(const dit_supervisor *s)
{
    return s->join_port;
}

const char *dit_supervisor_device(const dit_supervisor *s, int rank)
{
    return s->device[rank >= 0 && rank < s->N ? rank : 0];
}
