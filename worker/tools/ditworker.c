/* ditworker: one rank of ditd's mesh.
 *
 *   ditworker --connect SOCKET --rank R        (started by ditd)
 *   ditworker --join HOST:PORT --secret-file FILE [--rank R] [--device D] ...
 *
 * ditd starts one per local rank (uv_spawn); the worker connects to the
 * daemon's Unix socket and says hello. On other hosts, workers join over TCP:
 * they answer the daemon's challenge with an HMAC of the shared secret
 * (serve/join_auth.h), wait until the daemon gives them a rank, and when
 * that mesh ends (a failure anywhere, the daemon restarting or going away)
 * connect again, with backoff, until stopped. Either way the worker then
 * receives the mesh setup, joins the mesh (shared memory on the cpu backend;
 * NCCL on cuda, rank 0's id relayed by the daemon), loads the pipeline (with
 * its tensor-parallel slice), reports ready, and runs the jobs the daemon
 * sends until told to shut down or the socket closes. Rank 0
 * reports progress after every step and sends the result; a cancel request
 * reaches rank 0, which tells every rank at the next step boundary so that
 * the whole mesh stops at the same step.
 *
 * A worker never speaks gRPC. It exits non-zero when its mesh breaks; the
 * daemon then rebuilds the mesh. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <omp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "comm/shm/comm_shm.h"
#include "media/mp4.h"
#include "backend/cpu/cpu_backend.h"
#include "media/png.h"
#include "ipc_wire.h"
#include "parallel/lora.h"
#include "parallel/mesh.h"
#include "pipelines/pipeline.h"
#include "core/cli_util.h"
#include "core/options.h"
#include "serve/join_auth.h"
#include "serve/request.h"
#include "runtime/runner.h"
#ifdef DIT_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#include "comm/nccl/comm_nccl.h"
#endif

static const char *const usage =
    "usage: ditworker --connect SOCKET --rank R [--parent-pid PID]\n"
    "       ditworker --join HOST:PORT --secret-file FILE [options]\n"
    "\n"
    "One rank of a ditd mesh; it receives the mesh setup and the model to load from\n"
    "the daemon and runs the jobs it is sent. --connect SOCKET is how ditd starts its\n"
    "local workers (by hand it is only useful for debugging); --join and the options\n"
    "after it join a daemon on another host (ditd --join-listen, --local-ranks).\n";

static const char *const epilog =
    "A joined worker reconnects (1 s, doubling to 30 s) whenever its mesh ends or the\n"
    "daemon cannot be reached or refuses it before proving that it holds the secret\n"
    "(a wrong secret among them: it is logged each time), until SIGTERM. Exit status:\n"
    "0 after a clean end, 1 on a failure, 2 on bad usage, 3 when the daemon, after\n"
    "proving the secret, refused it for good (wrong host for the cpu backend, a rank\n"
    "it does not have).\n";

/* Settings of a joined worker that override the daemon's setup. */
typedef struct join_opts {
    const char *address;
    const char *secret_file;
    int want_rank; /* -1: any */
    int device;
    int threads; /* 0: the daemon's */
    const char *model;
    bool once;
} join_opts;

/* A loaded LoRA adapter, by file. */
typedef struct lora_entry {
    char *path;
    dit_lora *lora;
    size_t bytes;
    uint64_t last_use;
    bool pinned; /* preloaded: never evicted */
} lora_entry;

/* The adapters this rank keeps loaded. Every rank sees the same jobs in
 * the same order, so every rank loads and evicts the same adapters at the
 * same points. */
typedef struct lora_cache {
    lora_entry *e;
    size_t n, cap;
    /* What the last memory report listed (rebuilt for each). */
    Ditserve__Ipc__JobLora *report, **report_ptrs;
    size_t bytes, limit;
    uint64_t clock;
    int64_t loads, hits, evictions; /* reported with the memory */
} lora_cache;

typedef struct worker {
    int fd;
    int statm_fd; /* /proc/self/statm, open while serving (-1: not) */
    int rank;
    const join_opts *join; /* NULL for a worker ditd started */
    dit_ipc_reader reader;
    dit_comm *world;
    dit_mesh *mesh;
    dit_backend *be;
    dit_pipeline *pipe;
    dit_runner *runner;
    int threads;          /* host threads (the cpu backend's, or for encoding results) */
    bool decode_anywhere; /* Setup.decode_on_every_rank: a job's images spread over the ranks */
    lora_cache loras;
    void *flag_buf;  /* backend memory for the step decision's broadcast */
    size_t flag_cap; /* floats flag_buf holds */
    /* The job in progress: its members (member 0 is the job itself) and
     * rank 0's step decision [stop, active 0 .. n-1]. */
    uint64_t job_id;
    int n_members;
    uint64_t *member_ids;
    bool *member_cancel;
    float *flags;
    bool cancel_seen;
    bool socket_lost; /* rank 0 lost the daemon mid-job and told the others to stop */
    /* Why the step callback failed (its status reaches the pipeline, which
     * passes it on without a message of its own). */
    dit_diag step_diag;
    bool shutdown_seen; /* the daemon asked us to exit */
    bool ready;         /* this mesh came up (a joined worker's backoff resets) */
    bool device_failed; /* a device error: the process should not go on */
    /* A joined worker refused by the daemon after its proof: why (escaped;
     * empty: not refused) and whether for good. */
    char refusal[512];
    bool refused_for_good;
} worker;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int send_env(worker *w, Ditserve__Ipc__Envelope *env)
{
    return dit_ipc_write_fd(w->fd, env);
}

/* Fills the memory figures the daemon exports as metrics. */
static void read_memory(worker *w, Ditserve__Ipc__WorkerMemory *m)
{
    /* One pread on a descriptor kept open: this runs between a job's last
     * stage and its JobDone, where an fopen cost tens of microseconds. */
    long pages = 0, resident = 0;
    char text[128];
    const ssize_t got = w->statm_fd >= 0 ? pread(w->statm_fd, text, sizeof text - 1, 0) : -1;
    if (got > 0) {
        text[got] = '\0';
        if (sscanf(text, "%ld %ld", &pages, &resident) != 2)
            resident = 0;
    }
    m->host_rss_bytes = (int64_t)resident * sysconf(_SC_PAGESIZE);
#ifdef DIT_HAVE_CUDA
    dit_cuda_memory cm;
    if (w->be && dit_backend_is_cuda(w->be) && dit_cuda_backend_memory(w->be, &cm) == DIT_OK) {
        m->device_used_bytes = (int64_t)cm.device_used_bytes;
        m->device_total_bytes = (int64_t)cm.device_total_bytes;
        m->device_peak_bytes = (int64_t)cm.backend_peak_bytes;
    }
#else
    (void)w;
#endif
    lora_cache *c = &w->loras;
    free(c->report);
    free(c->report_ptrs);
    c->report = c->n ? calloc(c->n, sizeof *c->report) : NULL;
    c->report_ptrs = c->n ? calloc(c->n, sizeof *c->report_ptrs) : NULL;
    if (c->report && c->report_ptrs) {
        for (size_t i = 0; i < c->n; i++) {
            ditserve__ipc__job_lora__init(&c->report[i]);
            c->report[i].path = c->e[i].path;
            c->report[i].bytes = (int64_t)c->e[i].bytes;
            c->report_ptrs[i] = &c->report[i];
        }
        m->loras = c->report_ptrs;
        m->n_loras = c->n;
    }
    m->lora_loads = c->loads;
    m->lora_hits = c->hits;
    m->lora_evictions = c->evictions;
}

/* Reports a failure the daemon can relay, then lets the caller exit. */
static void send_done_error(worker *w, uint64_t job_id, dit_status st, const char *msg)
{
    Ditserve__Ipc__JobDone done = DITSERVE__IPC__JOB_DONE__INIT;
    done.job_id = job_id;
    done.rank = w->rank;
    done.status = (int32_t)st;
    done.message = (char *)msg;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_DONE;
    env.done = &done;
    send_env(w, &env);
}

/* Makes the flag buffer hold n floats (every rank gets the same jobs, so
 * every rank grows it at the same point). */
static dit_status flag_buf_reserve(worker *w, size_t n, dit_diag *diag)
{
    if (n <= w->flag_cap)
        return DIT_OK;
    /* The old buffer stays until the new one exists: a rank that cannot
     * grow it still has one for agree_to_run. */
    void *grown = NULL;
    dit_status st = dit_backend_alloc(w->be, sizeof(float) * n, &grown);
    if (st != DIT_OK)
        return dit_diag_set(diag, st, "out of device memory");
    dit_backend_free(w->be, w->flag_buf);
    w->flag_buf = grown;
    w->flag_cap = n;
    return DIT_OK;
}

/* Every rank starts a job's generation, or none does: each says whether
 * it failed to prepare (its members, adapters, buffers), and the sum goes
 * to all. Without it a failure on one rank alone (an adapter file it cannot
 * read, memory) would leave the others waiting in the forward's first
 * collective until the comm timeout, and the mesh would restart. *others
 * says that another rank failed. Only a comm failure is returned. */
static dit_status agree_to_run(worker *w, bool failed, bool *others, dit_diag *diag)
{
    *others = false;
    if (!w->world || dit_comm_size(w->world) <= 1)
        return DIT_OK;
    float v = failed ? 1.0f : 0.0f;
    dit_tensor host = dit_tensor_1d(&v, DIT_F32, 1), dev = dit_tensor_1d(w->flag_buf, DIT_F32, 1);
    dit_status st = w->be->ops->upload(w->be, &dev, &host);
    if (st == DIT_OK)
        st = w->world->ops->all_reduce_sum(w->world, w->flag_buf, 1, DIT_F32, diag);
    if (st == DIT_OK)
        st = w->be->ops->download(w->be, &host, &dev);
    if (st != DIT_OK)
        return dit_diag_set(diag, st, "agreeing to run the job failed: %s", dit_status_str(st));
    *others = v > (failed ? 1.5f : 0.5f);
    return DIT_OK;
}

/* Called by every rank after every step with the members still active.
 * Rank 0 reports progress (under the job's id) and reads the daemon's
 * messages: a Cancel naming a member makes it leave, Shutdown stops the
 * whole job. It broadcasts its decision, [stop, active member 0, 1, ...]
 * as floats, so that every rank drops the same members at the same step.
 * When no member would be left, the job stops with DIT_ERR_CANCELLED (the
 * single-request behaviour). */
static dit_status on_step(void *ctx, int step, int total, double elapsed_ms, bool *active)
{
    worker *w = ctx;
    dit_diag *diag = &w->step_diag;
    const int n = w->n_members;
    float *flags = w->flags; /* n + 1 */
    bool lost = false;       /* rank 0: the daemon's socket is gone */
    if (w->rank == 0) {
        Ditserve__Ipc__JobProgress pr = DITSERVE__IPC__JOB_PROGRESS__INIT;
        pr.job_id = w->job_id;
        pr.step = step;
        pr.total_steps = total;
        pr.elapsed_ms = elapsed_ms;
        pr.stage = "denoising";
        Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
        env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_PROGRESS;
        env.progress = &pr;
        /* A lost socket still takes part in the step's broadcast, as a
         * stop: the other ranks wait in it (on NCCL, until the comm
         * timeout, however this rank leaves). A report that cannot be
         * encoded (-2, no memory) is only skipped. */
        lost = send_env(w, &env) == -1;
        Ditserve__Ipc__Envelope *in = NULL;
        int got = 0;
        while (!lost && (got = dit_ipc_poll_fd(w->fd, &w->reader, &in)) == 1) {
            if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_CANCEL)
                for (int k = 0; k < n; k++)
                    if (in->cancel->job_id == w->member_ids[k])
                        w->member_cancel[k] = true;
            /* Shutdown mid-job: stop at this step, then exit. */
            if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN)
                w->cancel_seen = w->shutdown_seen = true;
            ditserve__ipc__envelope__free_unpacked(in, NULL);
        }
        lost = lost || got < 0;
        bool any = false;
        for (int k = 0; k < n; k++) {
            flags[1 + k] = active[k] && !w->member_cancel[k] ? 1.0f : 0.0f;
            any = any || flags[1 + k] != 0.0f;
        }
        flags[0] = lost || w->cancel_seen || !any ? 1.0f : 0.0f;
    }
    if (w->world && dit_comm_size(w->world) > 1) {
        /* Through backend memory, so that a device-side comm can send it. */
        dit_tensor host = dit_tensor_1d(flags, DIT_F32, n + 1),
                   dev = dit_tensor_1d(w->flag_buf, DIT_F32, n + 1);
        dit_status st = w->be->ops->upload(w->be, &dev, &host);
        if (st == DIT_OK)
            st = w->world->ops->broadcast(w->world, w->flag_buf, sizeof(float) * (size_t)(n + 1), 0,
                                          diag);
        if (st == DIT_OK)
            st = w->be->ops->download(w->be, &host, &dev);
        if (st != DIT_OK) /* the broadcast's own message, if it set one */
            return dit_diag_set(diag, st, "sharing the step's decision failed: %s",
                                dit_status_str(st));
    }
    if (lost) {
        w->socket_lost = true;
        return dit_diag_set(diag, DIT_ERR_PEER, "lost the daemon's socket");
    }
    if (flags[0] != 0.0f)
        return DIT_ERR_CANCELLED;
    for (int k = 0; k < n; k++)
        if (flags[1 + k] == 0.0f)
            active[k] = false;
    if (w->rank == 0 && step == total) {
        /* Rank 0 decodes right after the last step: without this the client
         * would see nothing happen for the whole VAE decode. */
        Ditserve__Ipc__JobProgress pr = DITSERVE__IPC__JOB_PROGRESS__INIT;
        pr.job_id = w->job_id;
        pr.step = step;
        pr.total_steps = total;
        pr.elapsed_ms = elapsed_ms;
        pr.stage = "decoding";
        Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
        env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_PROGRESS;
        env.progress = &pr;
        if (send_env(w, &env) == -1) {
            /* Its own loss, as after the broadcast above: not a peer's
             * failure, and no reason to abort the others' comm (they are
             * past every collective of the job). */
            w->socket_lost = true;
            return dit_diag_set(diag, DIT_ERR_PEER, "lost the daemon's socket");
        }
    }
    return DIT_OK;
}

static bool mesh_fatal(dit_status st)
{
    return st == DIT_ERR_PEER || st == DIT_ERR_TIMEOUT || st == DIT_ERR_DEVICE;
}

/* Image m of the result in the request's format: PNG, MP4 or the raw f32
 * values (channels, frames, height, width) as the VAE decoded them. */
static dit_status encode_image(const dit_gen_result *whole, int m, const dit_request *rq,
                               uint8_t **bytes, size_t *nbytes, dit_diag *diag)
{
    dit_gen_result one = *whole;
    const dit_gen_result *res = &one;
    one.image = whole->image + (size_t)m * 3 * (size_t)whole->frames * (size_t)whole->width *
                                   (size_t)whole->height;
    const size_t n = (size_t)3 * (size_t)res->frames * (size_t)res->width * (size_t)res->height;
    switch (rq->output_format) {
    case DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR:
        /* The daemon refuses such requests; a result that would not fit
         * the message must not end the worker either. */
        if (sizeof(float) * n > DIT_IPC_MAX_RESULT)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "the raw result would be %zu bytes, past the %zu a worker sends",
                                sizeof(float) * n, (size_t)DIT_IPC_MAX_RESULT);
        *nbytes = sizeof(float) * n;
        *bytes = malloc(*nbytes);
        if (!*bytes)
            return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for the result");
        memcpy(*bytes, res->image, *nbytes);
        return DIT_OK;
    case DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_MP4:
        return dit_mp4_encode(res->image, res->frames, res->height, res->width, rq->gp.fps, bytes,
                              nbytes, diag);
    default:
        return dit_png_encode_rgb(res->image, res->height, res->width, bytes, nbytes, diag);
    }
}

static void lora_cache_free(lora_cache *c)
{
    for (size_t i = 0; i < c->n; i++) {
        dit_lora_destroy(c->e[i].lora);
        free(c->e[i].path);
    }
    free(c->e);
    free(c->report);
    free(c->report_ptrs);
    *c = (lora_cache){0};
}

static dit_lora_sites *lora_sites(worker *w)
{
    return dit_model_lora_sites((dit_model *)dit_pipeline_transformer(w->pipe));
}

/* Frees entry i (its adapter, path and bytes); the last entry takes its
 * place. */
static void lora_cache_drop(lora_cache *c, size_t i)
{
    dit_lora_destroy(c->e[i].lora);
    free(c->e[i].path);
    c->bytes -= c->e[i].bytes;
    c->e[i] = c->e[--c->n];
}

/* Drops the least recently used adapters (not pinned, not in keep[0..nkeep))
 * while the cache holds more than its limit. */
static void lora_cache_trim(lora_cache *c, const dit_lora *const *keep, int nkeep)
{
    while (c->bytes > c->limit) {
        size_t victim = c->n;
        for (size_t i = 0; i < c->n; i++) {
            bool kept = c->e[i].pinned;
            for (int k = 0; k < nkeep && !kept; k++)
                kept = keep[k] == c->e[i].lora;
            if (!kept && (victim == c->n || c->e[i].last_use < c->e[victim].last_use))
                victim = i;
        }
        if (victim == c->n)
            return;
        fprintf(stderr, "ditworker: LoRA adapter %s evicted (%zu bytes)\n", c->e[victim].path,
                c->e[victim].bytes);
        lora_cache_drop(c, victim);
        c->evictions++;
    }
}

/* The file a JobLora names as ditd saw it. */
static dit_file_id job_lora_file(const Ditserve__Ipc__JobLora *jl)
{
    return (dit_file_id){.dev = jl->file_dev,
                         .ino = jl->file_ino,
                         .size = jl->file_size,
                         .mtime_ns = jl->file_mtime_ns};
}

/* A job that names one file twice (two adapter names for the same path)
 * with two versions of it: the daemon saw the file change between its two
 * looks. Loading the second would drop the first while the job holds it;
 * the job is refused instead. */
static dit_status check_one_version(Ditserve__Ipc__JobLora *const *loras, size_t n, dit_diag *diag)
{
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++) {
            if (strcmp(loras[i]->path, loras[j]->path) != 0)
                continue;
            const dit_file_id a = job_lora_file(loras[i]), b = job_lora_file(loras[j]);
            const bool same =
                dit_file_id_known(&a) ? dit_file_id_equal(&a, &b) : !dit_file_id_known(&b);
            if (!same)
                return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                    "LoRA adapters '%s' and '%s' are one file, which changed "
                                    "while the request was admitted; send it again",
                                    loras[i]->name, loras[j]->name);
        }
    return DIT_OK;
}

/* A loader's message for a client: every mention of `path` (the server's
 * folders) becomes the file's own name. */
static void client_message(const char *why, const char *path, char *out, size_t cap)
{
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    const size_t pn = strlen(path);
    size_t o = 0;
    out[0] = '\0';
    while (*why && o + 1 < cap) {
        if (pn && strncmp(why, path, pn) == 0) {
            o += (size_t)snprintf(out + o, cap - o, "%s", base);
            why += pn;
        } else {
            out[o++] = *why++;
            out[o] = '\0';
        }
    }
}

/* The adapter of file `path`, loaded now unless the cache has it. A file
 * that cannot be loaded is the request's fault (INVALID_ARGUMENT, naming
 * the adapter and the loader's reason, which names the key); out of memory
 * and device errors stay what they are. expect: the file as ditd saw it
 * (JobLora's file_*; unknown: whatever is there): a cached adapter of
 * another version is loaded again, and a file that is not that version by
 * the time it is read is refused, so the ranks never mix versions. */
static dit_status lora_get(worker *w, const char *name, const char *path, const dit_file_id *expect,
                           bool pin, const dit_lora **out, dit_diag *diag)
{
    lora_cache *c = &w->loras;
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->e[i].path, path) == 0) {
            const dit_file_id have = dit_lora_get_info(c->e[i].lora).file;
            if (dit_file_id_known(expect) && !dit_file_id_equal(&have, expect)) {
                /* Replaced or rewritten since it was read: the old version
                 * goes (no job holds it: adapters are detached after each
                 * job, and a job names a file once), the new one loads. */
                pin = pin || c->e[i].pinned;
                lora_cache_drop(c, i);
                break;
            }
            c->e[i].last_use = ++c->clock;
            c->e[i].pinned |= pin;
            c->hits++;
            *out = c->e[i].lora;
            return DIT_OK;
        }
    dit_lora_sites *sites = lora_sites(w);
    if (!sites)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s takes no LoRA adapters",
                            dit_pipeline_get_info(w->pipe)->class_name);
    if (c->n == c->cap) {
        const size_t cap = c->cap ? 2 * c->cap : 8;
        lora_entry *e = realloc(c->e, cap * sizeof *e);
        if (!e)
            return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        c->e = e;
        c->cap = cap;
    }
    char *dup = strdup(path);
    if (!dup)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    dit_lora *l = NULL;
    dit_diag d;
    dit_diag_clear(&d);
    /* A file over 8 times the cache's bound (f32 twice bf16, split four
     * ways) and 64 MiB of header is not read. */
    const uint64_t max_file = pin ? 0 : (uint64_t)c->limit * 8 + (64u << 20);
    dit_status st = dit_lora_load(w->be, sites, path, max_file, &l, &d);
    if (st != DIT_OK) {
        free(dup);
        if (st != DIT_ERR_NOMEM && st != DIT_ERR_DEVICE)
            st = DIT_ERR_INVALID_ARG;
        /* The client learns the file's name, not where the server keeps it. */
        const char *why = dit_diag_msg(&d);
        const size_t pn = strlen(path);
        if (strncmp(why, path, pn) == 0 && strncmp(why + pn, ": ", 2) == 0)
            why += pn + 2;
        char msg[DIT_DIAG_MAX];
        client_message(why, path, msg, sizeof msg);
        return dit_diag_set(diag, st, "LoRA adapter '%s' (file %s) cannot be loaded: %s", name,
                            base, msg);
    }
    const dit_lora_info info = dit_lora_get_info(l);
    if (dit_file_id_known(expect) && !dit_file_id_equal(&info.file, expect)) {
        free(dup);
        dit_lora_destroy(l);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "LoRA adapter '%s' (file %s) changed on disk while the request was "
                            "on its way to the workers; send the request again",
                            name, base);
    }
    c->e[c->n++] = (lora_entry){
        .path = dup, .lora = l, .bytes = info.bytes, .last_use = ++c->clock, .pinned = pin};
    c->bytes += info.bytes;
    c->loads++;
    fprintf(stderr, "ditworker rank %d: LoRA adapter %s loaded (%d modules, %zu bytes)\n", w->rank,
            name, info.n_modules, info.bytes);
    *out = l;
    return DIT_OK;
}

/* Loads (or finds) the job's adapters and attaches them; *attached tells
 * whether the caller must detach. */
static dit_status lora_attach_job(worker *w, const Ditserve__Ipc__Job *job, bool *attached,
                                  dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_lora_use uses[DIT_REQUEST_MAX_LORAS];
    const dit_lora *keep[DIT_REQUEST_MAX_LORAS];
    int n = 0;
    *attached = false;
    if (job->n_loras == 0) {
        /* What the last job with adapters held beyond the bound goes now. */
        lora_cache_trim(&w->loras, NULL, 0);
        return DIT_OK;
    }
    if (job->n_loras > DIT_REQUEST_MAX_LORAS)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "a job has at most %d LoRA adapters",
                            DIT_REQUEST_MAX_LORAS);
    if ((st = check_one_version(job->loras, job->n_loras, diag)) != DIT_OK)
        return st;
    for (size_t i = 0; i < job->n_loras; i++) {
        const Ditserve__Ipc__JobLora *jl = job->loras[i];
        const dit_lora *l = NULL;
        const dit_file_id want = job_lora_file(jl);
        if ((st = lora_get(w, jl->name, jl->path, &want, false, &l, diag)) != DIT_OK) {
            /* The ones loaded for it so far stay cached within the bound. */
            if (n > 0)
                lora_cache_trim(&w->loras, keep, n);
            return st;
        }
        uses[n].lora = l;
        uses[n].scale = jl->scale;
        keep[n++] = l;
    }
    lora_cache_trim(&w->loras, keep, n);
    if ((st = dit_lora_attach(lora_sites(w), uses, n, diag)) != DIT_OK)
        return st;
    *attached = true;
    return DIT_OK;
}

/* LoadLora / UnloadLora: drops the adapters of lora_evict, loads loras. */
static dit_status lora_only_job(worker *w, const Ditserve__Ipc__Job *job, dit_diag *diag)
{
    lora_cache *c = &w->loras;
    if (job->n_loras > DIT_REQUEST_MAX_LORAS)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "a job loads at most %d LoRA adapters",
                            DIT_REQUEST_MAX_LORAS);
    dit_status vst = check_one_version(job->loras, job->n_loras, diag);
    if (vst != DIT_OK)
        return vst;
    for (size_t k = 0; k < job->n_lora_evict; k++)
        for (size_t i = 0; i < c->n; i++)
            if (!c->e[i].pinned && strcmp(c->e[i].path, job->lora_evict[k]) == 0) {
                lora_cache_drop(c, i); /* an unload, not an eviction */
                break;
            }
    const dit_lora *keep[DIT_REQUEST_MAX_LORAS];
    int n = 0;
    for (size_t i = 0; i < job->n_loras; i++) {
        const dit_file_id want = job_lora_file(job->loras[i]);
        dit_status st =
            lora_get(w, job->loras[i]->name, job->loras[i]->path, &want, false, &keep[n], diag);
        if (st != DIT_OK) {
            if (n > 0)
                lora_cache_trim(c, keep, n);
            return st;
        }
        n++;
    }
    lora_cache_trim(c, keep, n);
    return DIT_OK;
}

/* One member's JobDone fields (status, message, result and timings); the
 * pointers must outlive the message. */
static void fill_done(Ditserve__Ipc__JobDone *done, Ditserve__V1__Timings *tm, bool video,
                      uint64_t job_id, dit_status st, const char *msg, const dit_gen_result *res,
                      const dit_request *rq, uint8_t *bytes, size_t nbytes, int64_t *image_bytes,
                      int n_images, int64_t *shape, double t_encode, double others_ms)
{
    done->job_id = job_id;
    done->status = (int32_t)st;
    done->message = st == DIT_OK ? "" : (char *)msg;
    if (st != DIT_OK)
        return;
    /* Raw tensors: (3, H, W) for an image, (3, F, H, W) for a video, each
     * image its own tensor of that shape. */
    shape[0] = 3;
    shape[1] = video ? res->frames : res->height;
    shape[2] = video ? res->height : res->width;
    shape[3] = video ? res->width : 0;
    done->image.data = bytes;
    done->image.len = nbytes;
    if (n_images > 0) { /* the images this message holds */
        done->n_image_bytes = (size_t)n_images;
        done->image_bytes = image_bytes;
    }
    done->width = res->width;
    done->height = res->height;
    done->num_frames = res->frames;
    done->fps = video ? rq->gp.fps : 0;
    done->seed = rq->gp.seed;
    done->prompt_truncated = res->prompt_truncated;
    tm->tokenize_ms = res->tokenize_ms;
    tm->text_encode_ms = res->encode_ms;
    tm->denoise_ms = res->denoise_ms;
    tm->step_ms_min = res->step_ms_min;
    tm->step_ms_max = res->step_ms_max;
    tm->vae_ms = res->vae_ms;
    tm->encode_ms = t_encode;
    tm->batch_others_ms = others_ms;
    done->timings = tm;
    if (rq->output_format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR) {
        done->n_shape = video ? 4 : 3;
        done->shape = shape;
    }
}

/* A member's own outcome, kept for its JobDone entry. */
typedef struct member_out {
    dit_status st;
    char msg[DIT_DIAG_MAX];
    uint8_t *bytes;
    size_t nbytes;
    int64_t image_bytes[DIT_GEN_MAX_IMAGES];
    int64_t shape[4];
    double t_encode;
    Ditserve__V1__Timings tm;
} member_out;

/* One image of one member, for one thread to encode. */
typedef struct encode_item {
    int k, m; /* member, image */
    dit_status st;
    uint8_t *bytes;
    size_t nbytes;
    double start_ms, end_ms; /* now_ms() around its encoding */
    char msg[DIT_DIAG_MAX];
} encode_item;

/* Puts member k's encoded images (items[0 .. ni-1]) one after another into
 * mo->bytes with each one's size, if they fit what one message carries
 * beside the `total` bytes of the members before it; takes the items'
 * bytes either way. */
static dit_status join_images(encode_item *items, int ni, size_t total, member_out *mo)
{
    dit_status st = DIT_OK;
    size_t len = 0;
    /* The member's encoding time is the span its images took, which ran on
     * several threads at once: their sum would count that time several
     * times over (and the member's batch_others_ms could go negative). */
    double first = 0, last = 0;
    for (int i = 0; i < ni; i++) {
        first = i == 0 || items[i].start_ms < first ? items[i].start_ms : first;
        last = i == 0 || items[i].end_ms > last ? items[i].end_ms : last;
    }
    mo->t_encode = last - first;
    for (int i = 0; i < ni; i++) {
        if (st == DIT_OK && items[i].st != DIT_OK) {
            st = items[i].st;
            snprintf(mo->msg, sizeof mo->msg, "%s", items[i].msg);
        }
        len += items[i].nbytes;
    }
    if (st == DIT_OK && ni > 1 && len > DIT_IPC_MAX_RESULT) {
        st = DIT_ERR_INVALID_ARG;
        snprintf(mo->msg, sizeof mo->msg,
                 "the %d results would be over %zu bytes, past what a worker sends", ni,
                 (size_t)DIT_IPC_MAX_RESULT);
    } else if (st == DIT_OK && total + len > DIT_IPC_MAX_RESULT) {
        st = DIT_ERR_INVALID_ARG;
        snprintf(mo->msg, sizeof mo->msg,
                 "the batch's results would be over %zu bytes, past what a worker sends",
                 (size_t)DIT_IPC_MAX_RESULT);
    }
    if (st == DIT_OK && ni == 1) {
        mo->bytes = items[0].bytes;
        mo->nbytes = items[0].nbytes;
        mo->image_bytes[0] = (int64_t)items[0].nbytes;
        items[0].bytes = NULL;
    } else if (st == DIT_OK) {
        mo->bytes = malloc(len ? len : 1);
        if (!mo->bytes) {
            st = DIT_ERR_NOMEM;
            snprintf(mo->msg, sizeof mo->msg, "out of memory for the result");
        }
        size_t off = 0;
        for (int i = 0; st == DIT_OK && i < ni; i++) {
            memcpy(mo->bytes + off, items[i].bytes, items[i].nbytes);
            mo->image_bytes[i] = (int64_t)items[i].nbytes;
            off += items[i].nbytes;
        }
        mo->nbytes = st == DIT_OK ? len : 0;
    }
    for (int i = 0; i < ni; i++) {
        free(items[i].bytes);
        items[i].bytes = NULL;
    }
    return st;
}

/* A member's images: num_images, at least 1. */
static int images_of(const dit_request *rq)
{
    return rq->gp.num_images > 1 ? rq->gp.num_images : 1;
}

/* How many images of a member with ni images the mask names. */
static int mask_count(dit_gen_decode mask, int ni)
{
    int c = 0;
    for (int i = 0; i < ni && i < DIT_GEN_MAX_IMAGES; i++)
        c += (int)(mask >> i & 1u);
    return c;
}

/* Encodes this rank's images (mine[k]'s) of every member that finished
 * (mst[k] OK) in its format, spread over `threads` threads one image each
 * (a PNG encodes on one thread; MP4s go one at a time, libx264 has threads
 * of its own), then joins each member's into mo[k] in member and image
 * order, within what one message carries in all; a member that does not
 * fit, or whose image fails, gets that status in mst[k] and the message in
 * mo[k].msg. Each mo[k].t_encode is the wall time its own images took
 * (first start to last end); returns the wall time of the whole. */
static double encode_members(int threads, bool video, int n, const dit_gen_result *res,
                             const dit_request *rq, const dit_gen_decode *mine, dit_status *mst,
                             member_out *mo)
{
    const double t0 = now_ms();
    int n_items = 0;
    for (int k = 0; k < n; k++)
        if (mst[k] == DIT_OK)
            n_items += mask_count(mine[k], images_of(&rq[k]));
    encode_item *items = calloc(n_items > 0 ? (size_t)n_items : 1, sizeof *items);
    if (!items) {
        for (int k = 0; k < n; k++)
            if (mine[k] && mst[k] == DIT_OK) {
                mst[k] = DIT_ERR_NOMEM;
                snprintf(mo[k].msg, sizeof mo[k].msg, "out of memory for the result");
            }
        return now_ms() - t0;
    }
    for (int k = 0, i = 0; k < n; k++)
        for (int m = 0; mst[k] == DIT_OK && m < images_of(&rq[k]); m++)
            if (mine[k] >> m & 1u) {
                items[i].k = k;
                items[i].m = m;
                i++;
            }
    int nt = video ? 1 : threads < n_items ? threads : n_items;
    nt = nt > 0 ? nt : 1;
    /* Static, round robin: with schedule(dynamic) here the cpu backend's
     * next VAE decode ran 20 % slower (measured, libgomp), static costs
     * nothing: the images of a batch take about the same time. */
#pragma omp parallel for schedule(static, 1) num_threads(nt)
    for (int i = 0; i < n_items; i++) {
        encode_item *it = &items[i];
        dit_diag d;
        dit_diag_clear(&d);
        it->start_ms = now_ms();
        it->st = encode_image(&res[it->k], it->m, &rq[it->k], &it->bytes, &it->nbytes, &d);
        it->end_ms = now_ms();
        if (it->st != DIT_OK)
            snprintf(it->msg, sizeof it->msg, "%s", dit_diag_msg(&d));
    }
    size_t total = 0;
    for (int k = 0, i = 0; k < n; k++) {
        if (!mine[k] || mst[k] != DIT_OK)
            continue;
        const int ni = mask_count(mine[k], images_of(&rq[k]));
        mst[k] = join_images(&items[i], ni, total, &mo[k]);
        i += ni;
        total += mo[k].nbytes;
    }
    free(items);
    return now_ms() - t0;
}

/* Which rank decodes and encodes each image of each member
 * (owner[k * DIT_GEN_MAX_IMAGES + i], image i of member k): the images of
 * all members in order, round robin over the mesh's `world` ranks (1: rank
 * 0 decodes every one), so that the ranks decode in parallel instead of
 * rank 0 decoding one image after the other while the rest wait. Every
 * rank computes the same from the same job; JobDone's entries name the
 * owners. Returns how many ranks got an image. */
static int assign_decoders(int n, const dit_request *rq, int world, int32_t *owner)
{
    int j = 0;
    for (int k = 0; k < n; k++)
        for (int i = 0; i < images_of(&rq[k]); i++, j++)
            owner[k * DIT_GEN_MAX_IMAGES + i] = world > 1 ? j % world : 0;
    return world < j ? world : j;
}

/* Resolves the job's members (member 0: the job's own request, then
 * Job.batch) into rq[0 .. n-1] and checks that they may share forwards. */
static dit_status resolve_members(const Ditserve__Ipc__Job *job, const dit_pipeline_info *info,
                                  int n, dit_request *rq, dit_diag *diag)
{
    for (int k = 0; k < n; k++) {
        const Ditserve__V1__GenerateRequest *req = k ? job->batch[k - 1]->request : job->request;
        if (!req)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "batch member %d has no request", k);
        dit_status st = dit_request_resolve(req, info, 0, &rq[k], diag);
        if (st != DIT_OK) {
            if (n > 1)
                dit_diag_prefix(diag, "batch member %d: ", k);
            return st;
        }
    }
    /* Defence in depth: the daemon batches only what dit_request_batchable
     * accepts. */
    for (int a = 0; a < n; a++)
        for (int b = a + 1; b < n; b++) {
            const Ditserve__V1__GenerateRequest *ra = a ? job->batch[a - 1]->request : job->request;
            const Ditserve__V1__GenerateRequest *rb = job->batch[b - 1]->request;
            if (!dit_request_batchable(ra, rb, info))
                return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                    "batch members %d and %d cannot run in the same forwards "
                                    "(model, size, frames, steps, text length, CFG or LoRA "
                                    "adapters differ)",
                                    a, b);
        }
    return DIT_OK;
}

/* Runs one job: its request and, batched, the requests of Job.batch in the
 * same forwards (member 0 is the job itself). A single job's JobDone
 * carries its outcome in its own fields. A batched job's JobDone says the
 * job's status in its own (OK when the generation ran; what failed it as a
 * whole otherwise: a bad member, a mesh error, every member gone), on every
 * rank; rank 0's has one entry per member, member 0 first, with that
 * member's status and result (a member that left says DIT_ERR_CANCELLED).
 * Returns non-zero when the mesh is broken and the worker must exit. */
static int run_job(worker *w, const Ditserve__Ipc__Job *job)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    /* Every rank gets the same job: a batch too large fails on each alike. */
    const bool too_many = !job->lora_only && job->n_batch >= DIT_IPC_MAX_MEMBERS;
    const int n = job->lora_only || too_many ? 1 : 1 + (int)job->n_batch;
    const size_t nn = (size_t)n;
    dit_request *rq = calloc(nn, sizeof *rq);
    dit_gen_result *res = calloc(nn, sizeof *res);
    dit_gen_params *gps = calloc(nn, sizeof *gps);
    dit_status *mst = calloc(nn, sizeof *mst);
    member_out *mo = calloc(nn, sizeof *mo);
    uint64_t *ids = calloc(nn, sizeof *ids);
    bool *cancel = calloc(nn, sizeof *cancel);
    float *flags = calloc(nn + 1, sizeof *flags);
    Ditserve__Ipc__JobDone *entries = calloc(nn, sizeof *entries);
    Ditserve__Ipc__JobDone **entry_ptrs = calloc(nn, sizeof *entry_ptrs);
    /* The rank decoding each image, and the images of each member this
     * rank decodes. */
    int32_t *owner = calloc(nn * DIT_GEN_MAX_IMAGES, sizeof *owner);
    dit_gen_decode *mine = calloc(nn, sizeof *mine);
    const dit_pipeline_info *info = dit_pipeline_get_info(w->pipe);
    const bool video = info->frame_step > 0;
    double enc_wall = 0;   /* the results' encoding, wall time */
    bool owns_any = false; /* this rank decodes an image */
    /* The message lists its members (JobDone.batch): a batch, or one
     * request whose images several ranks decode. */
    bool listed = n > 1;
    bool attached = false;
    bool peer_failed = false; /* this rank's failure only follows another's */
    bool abort_comm = false;
    dit_status st = DIT_OK;
    if (too_many || !rq || !res || !gps || !mst || !mo || !ids || !cancel || !flags || !entries ||
        !entry_ptrs || !owner || !mine) {
        if (too_many)
            st = dit_diag_set(&diag, DIT_ERR_INVALID_ARG,
                              "a job of %zu requests; a worker runs at most %d together",
                              job->n_batch + 1, DIT_IPC_MAX_MEMBERS);
        else
            st = dit_diag_set(&diag, DIT_ERR_NOMEM, "out of memory for a batch of %d", n);
        if (!job->lora_only) { /* the other ranks wait for this rank's word */
            bool others;
            dit_diag ad;
            dit_diag_clear(&ad);
            if (agree_to_run(w, true, &others, &ad) != DIT_OK)
                abort_comm = true;
        }
        goto report;
    }
    w->job_id = job->job_id;
    w->cancel_seen = false;
    w->socket_lost = false;
    dit_diag_clear(&w->step_diag);
    w->n_members = n;
    w->member_ids = ids;
    w->member_cancel = cancel;
    w->flags = flags;
    for (int k = 0; k < n; k++) {
        ids[k] = k ? job->batch[k - 1]->job_id : job->job_id;
        mst[k] = DIT_OK;
    }
    if (job->lora_only) {
        st = lora_only_job(w, job, &diag);
        goto report;
    }
    st = resolve_members(job, info, n, rq, &diag);
    if (st == DIT_OK) {
        const int decoders = assign_decoders(
            n, rq, w->world && w->decode_anywhere ? dit_comm_size(w->world) : 1, owner);
        listed = n > 1 || decoders > 1;
        for (int k = 0; k < n; k++)
            for (int i = 0; i < images_of(&rq[k]); i++)
                if (owner[k * DIT_GEN_MAX_IMAGES + i] == w->rank)
                    mine[k] |= 1u << i;
        st = flag_buf_reserve(w, nn + 1, &diag);
    }
    const dit_denoiser den = dit_runner_denoiser(w->runner);
    /* Job.loras apply to every member. */
    if (st == DIT_OK)
        st = lora_attach_job(w, job, &attached, &diag);
    for (int k = 0; k < n; k++)
        gps[k] = rq[k].gp;
    bool others = false;
    dit_diag adiag;
    dit_diag_clear(&adiag);
    const dit_status ast = agree_to_run(w, st != DIT_OK, &others, &adiag);
    if (ast != DIT_OK) {
        st = ast;
        diag = adiag;
    } else if (others && st == DIT_OK) {
        st = DIT_ERR_INVALID_ARG;
        peer_failed = true;
        dit_diag_set(&diag, st, "another rank could not start this job");
    }
    if (st == DIT_OK) {
        st = dit_pipeline_generate_batch(w->pipe, &den, n, gps, mine, on_step, w, res, mst, &diag);
        /* A failure inside the forward is left as it was: every rank meets
         * the same shapes, so most (memory for the activations) happen on
         * all ranks alike and the mesh goes on; aborting the comm would
         * restart it for them. One on a rank alone leaves the others in a
         * collective: ditd tears the mesh down when they have not reported
         * soon after this rank's failure (supervisor.c). */
        if (st == DIT_ERR_PEER && !w->socket_lost)
            peer_failed = true; /* most likely another rank's abort */
    }
    /* A failure of the step callback comes back as its status alone. */
    if (st != DIT_OK && w->step_diag.msg[0])
        dit_diag_set(&diag, st, "%s", w->step_diag.msg);
    /* A device's failure comes back from the backend op that met it as its
     * status alone: the backend's own words (the op, the CUDA error's name)
     * say what happened. */
    const char *be_err = st == DIT_ERR_DEVICE && !diag.msg[0] && w->be->ops->last_error
                             ? w->be->ops->last_error(w->be)
                             : NULL;
    if (be_err && be_err[0])
        dit_diag_set(&diag, st, "%s: %s", dit_status_str(st), be_err);
    if (attached)
        dit_lora_detach(lora_sites(w));
    /* Each finished member decoded here, in its own format. */
    for (int k = 0; mine && k < n; k++)
        owns_any = owns_any || mine[k];
    if (st == DIT_OK && owns_any && !job->warmup) {
        enc_wall = encode_members(w->threads, video, n, res, rq, mine, mst, mo);
        if (n == 1)
            mo[0].t_encode = enc_wall;
    }
report:;
    if (st != DIT_OK && !diag.msg[0]) /* never "ok" for a failure */
        dit_diag_set(&diag, st, "%s", dit_status_str(st));
    /* A single job's status is the message's own; a listed job's (a batch,
     * or one request whose images several ranks decode) message says the
     * job's, its entries the members'. (A listed single request whose own
     * encoding failed here said that status with the message "ok".) */
    const dit_status st0 = st != DIT_OK || listed ? st : mst ? mst[0] : DIT_OK;
    /* Out of memory for the bookkeeping: a bare JobDone with the status. */
    const bool books = rq && res && mst && mo && entries && entry_ptrs && owner && mine;
    for (int k = 0; books && k < n; k++) {
        mo[k].st = st != DIT_OK ? st : mst[k];
        if (mo[k].st == DIT_ERR_CANCELLED && mo[k].msg[0] == '\0')
            snprintf(mo[k].msg, sizeof mo[k].msg, "cancelled");
        else if (mo[k].msg[0] == '\0')
            snprintf(mo[k].msg, sizeof mo[k].msg, "%s", dit_diag_msg(&diag));
    }
    Ditserve__Ipc__JobDone done = DITSERVE__IPC__JOB_DONE__INIT;
    Ditserve__V1__Timings tm0 = DITSERVE__V1__TIMINGS__INIT;
    Ditserve__Ipc__WorkerMemory mem = DITSERVE__IPC__WORKER_MEMORY__INIT;
    int64_t shape0[4] = {0};
    read_memory(w, &mem);
    done.memory = &mem;
    done.rank = w->rank;
    done.peer_failed = peer_failed;
    /* As decided below, after the message goes. */
    done.worker_exits = (mesh_fatal(st) && !w->socket_lost) || abort_comm;
    if (!books || listed) {
        done.job_id = job->job_id;
        done.status = (int32_t)st0;
        done.message = st0 == DIT_OK ? "" : (char *)dit_diag_msg(&diag);
    } else {
        /* Single jobs keep their message: the diag's for a failure,
         * cancellation included. */
        const char *msg0 = n == 1 && st != DIT_OK ? dit_diag_msg(&diag) : mo[0].msg;
        fill_done(&done, &tm0, video, job->job_id, st0, msg0, &res[0], &rq[0], mo[0].bytes,
                  mo[0].nbytes, mo[0].image_bytes,
                  !job->warmup && w->rank == 0 ? images_of(&rq[0]) : 0, shape0, mo[0].t_encode, 0);
    }
    if (books && listed && (w->rank == 0 || owns_any)) {
        /* Each member's own stages; a member's result also waited for the
         * others'. Rank 0 lists every member, naming the rank that holds
         * each of its images; another rank that decoded images sends the
         * entries too, with its images of each member (ditd takes each
         * image from its owner and puts each member's together). */
        double own_all = enc_wall;
        for (int k = 0; k < n; k++)
            own_all += res[k].tokenize_ms + res[k].encode_ms + res[k].vae_ms;
        for (int k = 0; k < n; k++) {
            const double own =
                res[k].tokenize_ms + res[k].encode_ms + res[k].vae_ms + mo[k].t_encode;
            ditserve__ipc__job_done__init(&entries[k]);
            mo[k].tm = (Ditserve__V1__Timings)DITSERVE__V1__TIMINGS__INIT;
            fill_done(&entries[k], &mo[k].tm, video, ids[k], mo[k].st, mo[k].msg, &res[k], &rq[k],
                      mo[k].bytes, mo[k].nbytes, mo[k].image_bytes,
                      job->warmup ? 0 : mask_count(mine[k], images_of(&rq[k])), mo[k].shape,
                      mo[k].t_encode, own_all - own);
            entries[k].rank = owner[k * DIT_GEN_MAX_IMAGES];
            entries[k].n_image_ranks = (size_t)images_of(&rq[k]);
            entries[k].image_ranks = &owner[k * DIT_GEN_MAX_IMAGES];
            entry_ptrs[k] = &entries[k];
        }
        done.batch = entry_ptrs;
        done.n_batch = nn;
    }
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_DONE;
    env.done = &done;
    int rc = send_env(w, &env);
    if (rc == -2) {
        /* The results do not fit one message, or the memory to pack them is
         * not there: the job fails, this worker does not. */
        const size_t bytes = ditserve__ipc__envelope__get_packed_size(&env);
        char msg[200];
        snprintf(msg, sizeof msg,
                 bytes > DIT_IPC_MAX_FRAME
                     ? "the job's results come to %zu bytes, more than one worker message holds"
                     : "out of memory for the job's results' message (%zu bytes)",
                 bytes);
        Ditserve__Ipc__JobDone bare = DITSERVE__IPC__JOB_DONE__INIT;
        bare.job_id = job->job_id;
        bare.rank = w->rank;
        /* A failed job's own status and what it says of the mesh stay (the
         * daemon must not hand the next job to a worker about to exit). */
        if (st != DIT_OK) {
            bare.status = (int32_t)st;
            bare.message = (char *)dit_diag_msg(&diag);
        } else {
            bare.status =
                (int32_t)(bytes > DIT_IPC_MAX_FRAME ? DIT_ERR_INVALID_ARG : DIT_ERR_NOMEM);
            bare.message = msg;
        }
        bare.worker_exits = done.worker_exits;
        bare.peer_failed = done.peer_failed;
        bare.memory = &mem;
        env.done = &bare;
        rc = send_env(w, &env);
    }
    rc = rc != 0 ? 1 : 0;
    if (st == DIT_ERR_DEVICE)
        w->device_failed = true;
    /* Peers that were told to stop at the step need no abort, which could
     * reach them before they have read the decision. */
    if ((mesh_fatal(st) && !w->socket_lost) || abort_comm) {
        fprintf(stderr, "ditworker rank %d: %s\n", w->rank, dit_diag_msg(&diag));
        if (w->world)
            w->world->ops->abort(w->world);
        rc = 1;
    }
    for (int k = 0; k < n; k++) {
        if (mo)
            free(mo[k].bytes);
        if (res)
            dit_gen_result_free(&res[k]);
        if (rq)
            dit_request_free(&rq[k]);
    }
    w->n_members = 0;
    w->member_ids = NULL;
    w->member_cancel = NULL;
    w->flags = NULL;
    free(rq);
    free(res);
    free(gps);
    free(mst);
    free(mo);
    free(ids);
    free(cancel);
    free(flags);
    free(entries);
    free(entry_ptrs);
    free(owner);
    free(mine);
    return rc;
}

#ifdef DIT_HAVE_CUDA
/* NCCL across the ranks: rank 0 makes the id and sends it to the daemon,
 * which relays it to the others in their setup. */
static dit_status join_nccl(worker *w, const Ditserve__Ipc__Setup *s, int device, dit_diag *diag)
{
    dit_nccl_config nc = {.rank = w->rank,
                          .world_size = s->world_size,
                          .device = device,
                          .stream = dit_cuda_backend_stream(w->be),
                          .timeout_s = s->comm_timeout_s};
    dit_status st;
    if (w->rank == 0) {
        if ((st = dit_nccl_unique_id(nc.id, diag)) != DIT_OK)
            return st;
        Ditserve__Ipc__MeshId mid = DITSERVE__IPC__MESH_ID__INIT;
        mid.nccl_id.data = nc.id;
        mid.nccl_id.len = sizeof nc.id;
        Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
        env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_MESH_ID;
        env.mesh_id = &mid;
        if (send_env(w, &env) != 0)
            return dit_diag_set(diag, DIT_ERR_PEER, "cannot send the NCCL id to the daemon");
    } else {
        if (s->nccl_id.len != sizeof nc.id)
            return dit_diag_set(diag, DIT_ERR_FORMAT, "the setup carries no NCCL id");
        memcpy(nc.id, s->nccl_id.data, sizeof nc.id);
    }
    if ((st = dit_nccl_comm_create(&nc, &w->world, diag)) != DIT_OK)
        return st;
    /* The backend's host waits (downloads after a gather, frees) must not
     * hang behind a kernel stuck on a dead peer. */
    dit_cuda_backend_set_wait_check(w->be, dit_nccl_wait_check, w->world);
    return DIT_OK;
}
#endif

static dit_status setup(worker *w, const Ditserve__Ipc__Setup *s, dit_diag *diag)
{
    dit_parallel_config pc = dit_parallel_config_single();
    pc.world_size = s->world_size;
    pc.ring_degree = s->ring_degree;
    pc.ulysses_degree = s->ulysses_degree;
    pc.tp_degree = s->tp_degree;
    pc.cfg_degree = s->cfg_degree ? s->cfg_degree : 1; /* unset by older daemons */
    w->decode_anywhere = s->decode_on_every_rank;
    pc.ulysses_anything = s->ulysses_anything;
    pc.ring_anything = s->ring_anything;
    pc.unified_anything = s->unified_anything;
    pc.fp32_merge = s->fp32_merge;
    const join_opts *jo = w->join;
    const int device = s->device >= 0 ? s->device : (jo ? jo->device : 0);
    const char *model = jo && jo->model ? jo->model : s->model_dir;
    dit_backend_config bc = {.n_threads = jo && jo->threads > 0 ? jo->threads : s->threads,
                             .device = device};
    w->threads = bc.n_threads > 0 ? bc.n_threads : omp_get_max_threads();
    if (dit_backend_kind_parse(s->backend, &bc.kind) != DIT_OK)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "unknown backend '%s'", s->backend);
    dit_status st;
    if ((st = dit_backend_create(&bc, &w->be, diag)) != DIT_OK)
        return st;
    if (pc.world_size > 1) {
        if (bc.kind == DIT_BACKEND_CUDA) {
#ifdef DIT_HAVE_CUDA
            st = join_nccl(w, s, device, diag);
#else
            st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "this ditworker was built without CUDA");
#endif
        } else {
            dit_shm_config sc = {.world_size = pc.world_size, .timeout_s = s->comm_timeout_s};
            snprintf(sc.name, sizeof sc.name, "%s", s->shm_name);
            st = dit_shm_comm_join(&sc, w->rank, &w->world, diag);
        }
        if (st != DIT_OK)
            return st;
        if ((st = dit_mesh_create(&pc, w->world, &w->mesh, diag)) != DIT_OK)
            return st;
    }
    if ((st = flag_buf_reserve(w, 2, diag)) != DIT_OK)
        return st;
    dit_shard shard = {.tp_degree = pc.tp_degree,
                       .tp_rank = w->mesh ? dit_mesh_tp_rank(w->mesh) : 0};
    if ((st = dit_pipeline_load(w->be, model, &shard, w->rank == 0 || w->decode_anywhere, &w->pipe,
                                diag)) != DIT_OK)
        return st;
    if ((st = dit_runner_create(w->be, dit_pipeline_transformer(w->pipe), w->mesh, &w->runner,
                                diag)) != DIT_OK)
        return st;
    /* ditd --lora-fuse: merged into this rank's weights for good. Unlike a
     * preload, a file that cannot be fused stops the worker: the operator
     * asked for a different model. */
    if (s->fuse_lora && s->fuse_lora->name && s->fuse_lora->name[0]) {
        dit_lora_sites *sites = lora_sites(w);
        dit_lora *l = NULL;
        if (!sites)
            return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                                "--lora-fuse %s: this model takes no adapters", s->fuse_lora->name);
        st = dit_lora_load(w->be, sites, s->fuse_lora->path, 0, &l, diag);
        if (st == DIT_OK)
            st = dit_lora_fuse(sites, l, s->fuse_lora->scale, diag);
        dit_lora_destroy(l);
        if (st != DIT_OK) {
            char why[DIT_DIAG_MAX];
            snprintf(why, sizeof why, "%s", dit_diag_msg(diag));
            return dit_diag_set(diag, st, "--lora-fuse %s: %s", s->fuse_lora->name, why);
        }
    }
    w->loras.limit = s->lora_cache_bytes > 0 ? (size_t)s->lora_cache_bytes : 0;
    /* A preloaded adapter whose file cannot load is left out, loudly: the
     * mesh serves the base model and the other adapters, and requests that
     * name it get the loader's reason. Memory and device errors stop it. */
    for (size_t i = 0; i < s->n_preload_loras; i++) {
        const dit_lora *l;
        dit_diag d;
        dit_diag_clear(&d);
        const dit_file_id want = job_lora_file(s->preload_loras[i]);
        st = lora_get(w, s->preload_loras[i]->name, s->preload_loras[i]->path, &want, true, &l, &d);
        if (st == DIT_ERR_NOMEM || st == DIT_ERR_DEVICE)
            return dit_diag_set(diag, st, "%s", dit_diag_msg(&d));
        if (st != DIT_OK)
            fprintf(stderr, "ditworker rank %d: warning: --lora %s not preloaded: %s\n", w->rank,
                    s->preload_loras[i]->name, dit_diag_msg(&d));
    }
    return DIT_OK;
}

static void teardown(worker *w)
{
    /* A joined worker's mesh has ended (or failed) when it gets here, and its
     * peers may be gone: abort instead of waiting to finalize with them. */
    if (w->join && w->world)
        w->world->ops->abort(w->world);
#ifdef DIT_HAVE_CUDA
    if (w->be && w->world && dit_backend_is_cuda(w->be)) {
        /* Drain the stream while the group can still cut the wait short
         * (aborting its communicators, whose kernels then exit); after that
         * the frees below wait plainly and free for real, and nothing asks
         * the group once it is destroyed. */
        (void)w->be->ops->sync(w->be);
        dit_cuda_backend_set_wait_check(w->be, NULL, NULL);
    }
#endif
    dit_runner_destroy(w->runner);
    if (w->pipe)
        dit_lora_detach(lora_sites(w));
    lora_cache_free(&w->loras);
    dit_pipeline_free(w->pipe);
    if (w->be)
        dit_backend_free(w->be, w->flag_buf);
    /* The comm enqueues on the backend's stream: it goes first. */
    dit_mesh_destroy(w->mesh);
    dit_comm_destroy(w->world);
    dit_backend_destroy(w->be);
    dit_ipc_reader_free(&w->reader);
    if (w->fd >= 0)
        close(w->fd);
}

/* Receives the setup, joins the mesh, loads the pipeline, reports ready and
 * runs jobs. Returns 0 after a clean end (shutdown, or the daemon closing
 * the connection), 1 on a failure. */
static int serve(worker *w)
{
    int rc = 1;
    dit_diag diag;
    dit_diag_clear(&diag);
    Ditserve__Ipc__Envelope *in = NULL;
    w->statm_fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
    if (dit_ipc_read_fd(w->fd, &w->reader, &in) != 0) {
        in = NULL;
        if (w->join)
            rc = 0; /* the daemon closed a waiting connection (its mesh restarts) */
        else
            fprintf(stderr, "ditworker rank %d: no setup from the daemon\n", w->rank);
        goto out;
    }
    if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN) {
        rc = 0;
        goto out;
    }
    if (w->join && in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_REFUSED) {
        /* It follows the daemon's proof (handshake): the daemon's word. */
        char reason[400];
        dit_join_escape(in->refused->reason, reason, sizeof reason);
        snprintf(w->refusal, sizeof w->refusal, "refused: %s", reason);
        w->refused_for_good = in->refused->permanent;
        goto out;
    }
    if (in->msg_case != DITSERVE__IPC__ENVELOPE__MSG_SETUP) {
        fprintf(stderr, "ditworker rank %d: expected the setup, got message %d\n", w->rank,
                (int)in->msg_case);
        goto out;
    }
    if (w->join) {
        w->rank = in->setup->rank;
        fprintf(stderr, "ditworker: playing rank %d of %d\n", w->rank, in->setup->world_size);
    }
    double t0 = now_ms();
    dit_status st = setup(w, in->setup, &diag);
    ditserve__ipc__envelope__free_unpacked(in, NULL);
    in = NULL;
    if (st == DIT_ERR_DEVICE)
        w->device_failed = true;
    if (st != DIT_OK) {
        fprintf(stderr, "ditworker rank %d: %s\n", w->rank, dit_diag_msg(&diag));
        send_done_error(w, 0, st, dit_diag_msg(&diag));
        if (w->world)
            w->world->ops->abort(w->world);
        goto out;
    }
    Ditserve__Ipc__Ready ready = DITSERVE__IPC__READY__INIT;
    ready.rank = w->rank;
    ready.load_ms = now_ms() - t0;
    ready.device = (char *)w->be->ops->name;
#ifdef DIT_HAVE_CUDA
    if (dit_backend_is_cuda(w->be))
        ready.device = (char *)dit_cuda_backend_device_name(w->be);
#endif
    char blas[200];
    dit_cpu_blas_describe(blas, sizeof blas);
    char kernels[64];
    dit_cpu_backend_kernels_describe(w->be, kernels, sizeof kernels);
    if (kernels[0])
        snprintf(blas + strlen(blas), sizeof blas - strlen(blas), ", cpu kernels %s", kernels);
    ready.blas = blas;
    const dit_model *tm = dit_pipeline_transformer(w->pipe);
    ready.weight_bytes = (int64_t)tm->cls->weight_bytes(tm->impl);
    Ditserve__Ipc__WorkerMemory mem = DITSERVE__IPC__WORKER_MEMORY__INIT;
    read_memory(w, &mem);
    ready.memory = &mem;
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_READY;
    env.ready = &ready;
    if (send_env(w, &env) != 0)
        goto out;
    w->ready = true;

    for (;;) {
        if (dit_ipc_read_fd(w->fd, &w->reader, &in) != 0) {
            /* The daemon went away or ended this mesh. */
            rc = 0;
            break;
        }
        if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN) {
            rc = 0;
            break;
        }
        if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_JOB) {
            if (run_job(w, in->job) != 0)
                break;
            if (w->shutdown_seen) {
                rc = 0;
                break;
            }
        }
        /* A cancel for a job that already ended needs no answer. */
        ditserve__ipc__envelope__free_unpacked(in, NULL);
        in = NULL;
    }
out:
    if (in)
        ditserve__ipc__envelope__free_unpacked(in, NULL);
    if (w->statm_fd >= 0)
        close(w->statm_fd);
    w->statm_fd = -1;
    return rc;
}

/* parent: the daemon's pid (--parent-pid), 0 when not given. */
static int run_local(const char *path, int rank, long long parent)
{
    /* Die with the daemon, even one that exits without stopping us (a
     * second SIGTERM, a crash): a worker has no reason to outlive it. A
     * daemon that died before the line below took effect is no longer our
     * parent: the process that adopted us is. With --parent-pid that is
     * any other pid; without, pid 1 stands for it, which is wrong where
     * ditd is itself pid 1 (a container's entrypoint), hence the flag. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (parent > 0 ? (long long)getppid() != parent : getppid() == 1)
        return 1;
    worker w;
    memset(&w, 0, sizeof w);
    w.fd = -1;
    w.rank = rank;
    dit_ipc_reader_init(&w.reader);
    int rc = 1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) {
        fprintf(stderr, "ditworker: socket path too long: %s\n", path);
        goto cleanup;
    }
    strcpy(addr.sun_path, path);
    w.fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (w.fd < 0 || connect(w.fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        fprintf(stderr, "ditworker rank %d: cannot connect to %s: %s\n", w.rank, path,
                strerror(errno));
        goto cleanup;
    }
    Ditserve__Ipc__Hello hello = DITSERVE__IPC__HELLO__INIT;
    hello.rank = w.rank;
    hello.pid = (int32_t)getpid();
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_HELLO;
    env.hello = &hello;
    if (send_env(&w, &env) != 0) {
        fprintf(stderr, "ditworker rank %d: cannot say hello to the daemon\n", w.rank);
        goto cleanup;
    }
    rc = serve(&w);
cleanup:
    teardown(&w);
    return rc;
}

/* ---- Joining over TCP -------------------------------------------------- */

enum { JOIN_OK = 0, JOIN_RETRY = 1, JOIN_REFUSED = 3 };

static int tcp_connect(const char *address, char *err, size_t errn)
{
    char host[256];
    int port;
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_join_split_address(address, host, sizeof host, &port, &diag) != DIT_OK) {
        snprintf(err, errn, "%s", dit_diag_msg(&diag));
        return -1;
    }
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host, service, &hints, &res);
    if (gai != 0) {
        snprintf(err, errn, "cannot resolve %s: %s", host, gai_strerror(gai));
        return -1;
    }
    int fd = -1;
    snprintf(err, errn, "no address for %s", host);
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0)
            continue;
        /* On Linux the send timeout bounds connect() too. */
        struct timeval tv = {.tv_sec = 10};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
            tv.tv_sec = 0;
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
            break;
        }
        snprintf(err, errn, "cannot connect to %s: %s", address, strerror(errno));
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return -1;
    /* A host that vanishes without closing is noticed within about a
     * minute, with data in flight or not. */
    if (dit_join_socket_options(fd) != 0)
        fprintf(stderr, "ditworker: cannot set the connection's TCP options: %s\n",
                strerror(errno));
    return fd;
}

/* Reads one frame from the daemon before it has proved the secret: at most
 * DIT_JOIN_PREAUTH_BYTES (a longer length prefix is refused before anything
 * is reserved for it), and only until deadline_ms (now_ms's clock), however
 * slowly the bytes come. It reads no further than the frame, so what follows
 * stays in the socket. 0 with *out, or -1 with why in msg. */
static int read_preauth(worker *w, double deadline_ms, Ditserve__Ipc__Envelope **out, char *msg,
                        size_t msgn)
{
    dit_ipc_reader *r = &w->reader;
    for (;;) {
        size_t want = 4 - r->len;
        if (r->len >= 4) {
            const size_t n = (size_t)r->buf[0] | (size_t)r->buf[1] << 8 | (size_t)r->buf[2] << 16 |
                             (size_t)r->buf[3] << 24;
            if (n > DIT_JOIN_PREAUTH_BYTES) {
                snprintf(msg, msgn,
                         "the peer sent a frame of %zu bytes before proving the secret (at "
                         "most %d)",
                         n, DIT_JOIN_PREAUTH_BYTES);
                return -1;
            }
            const int got = dit_ipc_reader_next(r, out);
            if (got > 0)
                return 0;
            if (got < 0) {
                snprintf(msg, msgn, "the peer sent a corrupt message during the handshake");
                return -1;
            }
            want = 4 + n - r->len;
        }
        const double left_ms = deadline_ms - now_ms();
        if (left_ms <= 0) {
            snprintf(msg, msgn, "the handshake did not finish within %d s", DIT_JOIN_HANDSHAKE_S);
            return -1;
        }
        struct pollfd p = {.fd = w->fd, .events = POLLIN};
        const int pr = poll(&p, 1, (int)left_ms + 1);
        if (pr < 0 && errno != EINTR) {
            snprintf(msg, msgn, "cannot wait for the daemon: %s", strerror(errno));
            return -1;
        }
        if (pr <= 0)
            continue;
        uint8_t *room;
        size_t cap;
        if (dit_ipc_reader_room(r, want, want, &room, &cap) != 0) {
            snprintf(msg, msgn, "out of memory");
            return -1;
        }
        const ssize_t got = read(w->fd, room, want);
        if (got < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        if (got <= 0) {
            snprintf(msg, msgn, "the daemon closed the connection during the handshake");
            return -1;
        }
        dit_ipc_reader_commit(r, (size_t)got);
    }
}

/* A refusal that came before the daemon proved the secret, into msg. */
static void unproved_refusal(const Ditserve__Ipc__JoinRefused *r, char *msg, size_t msgn)
{
    char reason[400];
    dit_join_escape(r->reason, reason, sizeof reason);
    snprintf(msg, msgn, "refused before the daemon proved the secret, so not for good: %s", reason);
}

/* The challenge-response of serve/join_auth.h. Until the daemon has proved
 * that it holds the secret, what it sends could come from anyone who can
 * reach this connection: a refusal, a first message that is not a
 * challenge, a proof that does not check are reasons to try again later
 * (JOIN_RETRY, with the backoff), never to give up. A refusal after the
 * proof (serve() reads it) is the daemon's word. */
static int handshake(worker *w, const dit_join_secret *secret, char *msg, size_t msgn)
{
    int rc = JOIN_RETRY;
    dit_diag diag;
    dit_diag_clear(&diag);
    Ditserve__Ipc__Envelope *in = NULL;
    unsigned char mine[DIT_JOIN_NONCE_BYTES], theirs[DIT_JOIN_NONCE_BYTES], mac[DIT_JOIN_MAC_BYTES];
    const double deadline_ms = now_ms() + DIT_JOIN_HANDSHAKE_S * 1e3;
    if (read_preauth(w, deadline_ms, &in, msg, msgn) != 0)
        goto out;
    if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_REFUSED) {
        unproved_refusal(in->refused, msg, msgn);
        goto out;
    }
    if (in->msg_case != DITSERVE__IPC__ENVELOPE__MSG_CHALLENGE ||
        in->challenge->nonce.len != sizeof theirs) {
        snprintf(msg, msgn, "the peer is not a ditd join port (unexpected first message)");
        goto out;
    }
    if (in->challenge->protocol != DIT_JOIN_PROTOCOL) {
        snprintf(msg, msgn, "the daemon speaks join protocol %d, this worker %d",
                 in->challenge->protocol, DIT_JOIN_PROTOCOL);
        goto out;
    }
    memcpy(theirs, in->challenge->nonce.data, sizeof theirs);
    ditserve__ipc__envelope__free_unpacked(in, NULL);
    in = NULL;
    if (dit_join_nonce(mine, &diag) != DIT_OK ||
        dit_join_mac(secret, "worker", theirs, sizeof theirs, mine, sizeof mine, mac, &diag) !=
            DIT_OK) {
        snprintf(msg, msgn, "%s", dit_diag_msg(&diag));
        goto out;
    }
    char host_id[320];
    dit_join_host_id(host_id, sizeof host_id);
    Ditserve__Ipc__JoinRequest jr = DITSERVE__IPC__JOIN_REQUEST__INIT;
    jr.protocol = DIT_JOIN_PROTOCOL;
    jr.nonce.data = mine;
    jr.nonce.len = sizeof mine;
    jr.mac.data = mac;
    jr.mac.len = sizeof mac;
    jr.rank = w->join->want_rank;
    jr.host_id = host_id;
    jr.pid = (int32_t)getpid();
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_JOIN;
    env.join = &jr;
    if (send_env(w, &env) != 0) {
        snprintf(msg, msgn, "the daemon closed the connection during the handshake");
        goto out;
    }
    if (read_preauth(w, deadline_ms, &in, msg, msgn) != 0)
        goto out;
    if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_REFUSED) {
        unproved_refusal(in->refused, msg, msgn);
        goto out;
    }
    if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN) {
        snprintf(msg, msgn, "the daemon is shutting down");
        goto out;
    }
    if (in->msg_case != DITSERVE__IPC__ENVELOPE__MSG_ACCEPT ||
        dit_join_mac(secret, "daemon", mine, sizeof mine, theirs, sizeof theirs, mac, &diag) !=
            DIT_OK ||
        !dit_join_mac_equal(in->accept->mac.data, in->accept->mac.len, mac)) {
        snprintf(msg, msgn, "the daemon could not prove it holds the secret");
        goto out;
    }
    rc = JOIN_OK; /* from here frames may be large, and the wait for a rank long */
out:
    if (in)
        ditserve__ipc__envelope__free_unpacked(in, NULL);
    return rc;
}

static int run_joined(const join_opts *jo)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    /* What the worker can check itself is final: retrying cannot mend it. */
    char host[256];
    int port;
    if (dit_join_split_address(jo->address, host, sizeof host, &port, &diag) != DIT_OK) {
        fprintf(stderr, "ditworker: --join: %s\n", dit_diag_msg(&diag));
        return 2;
    }
    dit_join_secret *secret = malloc(sizeof *secret);
    if (!secret || dit_join_secret_read(jo->secret_file, secret, &diag) != DIT_OK) {
        fprintf(stderr, "ditworker: %s\n", secret ? dit_diag_msg(&diag) : "out of memory");
        free(secret);
        return 2;
    }
    double backoff_s = 1;
    int rc;
    for (;;) {
        worker w;
        memset(&w, 0, sizeof w);
        w.join = jo;
        w.rank = -1;
        dit_ipc_reader_init(&w.reader);
        char msg[700];
        bool joined = false;
        w.fd = tcp_connect(jo->address, msg, sizeof msg);
        rc = w.fd < 0 ? JOIN_RETRY : handshake(&w, secret, msg, sizeof msg);
        if (rc == JOIN_OK) {
            fprintf(stderr, "ditworker: joined %s; waiting for a rank\n", jo->address);
            joined = true;
            rc = serve(&w);
            if (w.refusal[0]) {
                snprintf(msg, sizeof msg, "%s", w.refusal);
                rc = w.refused_for_good ? JOIN_REFUSED : JOIN_RETRY;
            } else {
                snprintf(msg, sizeof msg, rc == 0 ? "the mesh ended" : "the mesh failed");
            }
        }
        const bool was_ready = w.ready, device_failed = w.device_failed;
        teardown(&w);
        if (rc == JOIN_REFUSED) {
            fprintf(stderr, "ditworker: %s: %s\n", jo->address, msg);
            break;
        }
        if (device_failed) {
            /* A CUDA context after a device error stays broken: let a fresh
             * process (the orchestrator's restart) take over. */
            fprintf(stderr, "ditworker: a device error ended the mesh; exiting\n");
            rc = 1;
            break;
        }
        if (jo->once && joined)
            break;
        /* A mesh that came up resets the backoff; one that failed to set up
         * (a missing model, no GPU) does not. */
        if (was_ready)
            backoff_s = 1;
        fprintf(stderr, "ditworker: %s; joining %s again in %.0f s\n", msg, jo->address, backoff_s);
        struct timespec ts = {.tv_sec = (time_t)backoff_s};
        nanosleep(&ts, NULL);
        if (!was_ready)
            backoff_s = backoff_s * 2 > 30 ? 30 : backoff_s * 2;
    }
    dit_join_secret_wipe(secret);
    free(secret);
    return rc;
}

/* The command line, filled from the option table below. */
typedef struct worker_args {
    const char *connect, *join, *secret_file, *model;
    long long rank, device, threads, parent_pid;
    bool rank_given, once;
} worker_args;

/* --rank: 0 .. DIT_SHM_MAX_RANKS-1; whether it was given matters (with
 * --connect it is required, with --join it asks for a rank). */
static int set_rank(void *target, const char *val, char *err, size_t cap)
{
    worker_args *a = target;
    char *end;
    errno = 0;
    const long v = strtol(val, &end, 10);
    if (errno || *val == '\0' || *end != '\0' || v < 0 || v >= DIT_SHM_MAX_RANKS) {
        snprintf(err, cap, "wants 0 to %d, not '%s'", DIT_SHM_MAX_RANKS - 1, val);
        return -1;
    }
    a->rank = v;
    a->rank_given = true;
    return 0;
}

#define WOFF(f) offsetof(worker_args, f)
static const dit_option worker_opts[] = {
    {"connect", 0, DIT_OPT_STRING, NULL, "SOCKET", "the daemon's Unix socket", NULL, WOFF(connect),
     0, 0, NULL, false},
    {"rank", 0, DIT_OPT_CUSTOM, NULL, "R",
     "with --connect: this worker's rank; with --join: ask for this remote rank (default: any "
     "free one)",
     NULL, 0, 0, 0, set_rank, false},
    {"join", 0, DIT_OPT_STRING, NULL, "HOST:PORT", "the daemon's join address", "DITWORKER_JOIN",
     WOFF(join), 0, 0, NULL, false},
    {"secret-file", 0, DIT_OPT_STRING, NULL, "FILE",
     "the shared secret (same bytes as ditd --join-secret-file)", "DITWORKER_SECRET_FILE",
     WOFF(secret_file), 0, 0, NULL, false},
    {"device", 0, DIT_OPT_INT, "0", "D", "GPU ordinal on this host", "DITWORKER_DEVICE",
     WOFF(device), 0, 1023, NULL, false},
    {"threads", 0, DIT_OPT_INT, NULL, "N", "cpu threads (default: the daemon's choice)", NULL,
     WOFF(threads), 1, 4096, NULL, false},
    {"model", 0, DIT_OPT_STRING, NULL, "DIR",
     "the pipeline folder on this host (default: the daemon's path)", "DITWORKER_MODEL",
     WOFF(model), 0, 0, NULL, false},
    {"once", 0, DIT_OPT_FLAG, NULL, NULL, "exit when the first mesh ends instead of joining again",
     NULL, WOFF(once), 0, 0, NULL, false},
    {"parent-pid", 0, DIT_OPT_INT, NULL, "PID",
     "with --connect: the daemon's pid (ditd passes its own): a worker whose parent is another "
     "process (the daemon died before it started) exits at once",
     NULL, WOFF(parent_pid), 1, 4194304, NULL, false},
};

/* SIGTERM or SIGINT as pid 1: the end it is elsewhere (async-signal-safe). */
static void on_stop_signal(int sig)
{
    _exit(128 + sig);
}

int main(int argc, char **argv)
{
    dit_cpu_blas_core_fix(argv, false);
    dit_tune_malloc();
    worker_args wa = {0};
    const dit_options table = {.prog = "ditworker",
                               .usage = usage,
                               .epilog = epilog,
                               .opts = worker_opts,
                               .n_opts = sizeof worker_opts / sizeof worker_opts[0]};
    const int prc = dit_options_parse(&table, &wa, argc, argv, NULL);
    if (prc != 0)
        return prc == 1 ? 0 : 2;
    /* A broken connection must be an error on write, not a signal (ditd's
     * uv_spawn starts workers with every signal at its default). */
    signal(SIGPIPE, SIG_IGN);
    if (getpid() == 1) {
        /* pid 1 of a container (a joined worker's pod): the kernel drops
         * the signals it has no handler for, so SIGTERM would wait out the
         * pod's grace period and end in SIGKILL. It ends the worker, as it
         * does anywhere else. */
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_stop_signal;
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
    }
    const char *path = wa.connect;
    const bool rank_given = wa.rank_given;
    const long rank = (long)wa.rank;
    join_opts jo = {.address = wa.join,
                    .secret_file = wa.secret_file,
                    .want_rank = -1,
                    .device = (int)wa.device,
                    .threads = (int)wa.threads,
                    .model = wa.model,
                    .once = wa.once};
    if (path && jo.address && getenv("DITWORKER_JOIN") != jo.address) {
        fprintf(stderr, "ditworker: --connect and --join exclude each other\n");
        return 2;
    }
    if (path) {
        if (!rank_given) {
            fprintf(stderr, "ditworker: --connect needs --rank (see --help)\n");
            return 2;
        }
        return run_local(path, (int)rank, wa.parent_pid);
    }
    if (!jo.address) {
        fprintf(stderr,
                "ditworker: --connect SOCKET or --join HOST:PORT is required (see --help)\n");
        return 2;
    }
    if (!jo.secret_file) {
        fprintf(stderr, "ditworker: --join needs --secret-file (or DITWORKER_SECRET_FILE)\n");
        return 2;
    }
    jo.want_rank = rank_given ? (int)rank : -1;
    return run_joined(&jo);
}
