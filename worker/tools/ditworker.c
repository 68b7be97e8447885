/* ditworker: one rank of ditd's mesh.
 *
 *   ditworker --connect SOCKET --rank R
 *
 * ditd starts one per rank (uv_spawn). The worker connects to the daemon's
 * Unix socket, says hello, receives the mesh setup, joins the mesh, loads the
 * pipeline (with its tensor-parallel slice), reports ready, and then runs the
 * jobs the daemon sends until told to shut down or the socket closes. Rank 0
 * reports progress after every step and sends the result; a cancel request
 * reaches rank 0, which tells every rank at the next step boundary so that
 * the whole mesh stops at the same step.
 *
 * A worker never speaks gRPC. It exits non-zero when its mesh breaks; the
 * daemon then rebuilds the mesh. */
#include <errno.h>
#include <getopt.h>
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
#include "image/png.h"
#include "ipc_wire.h"
#include "parallel/mesh.h"
#include "pipeline/flux_pipeline.h"
#include "runtime/request.h"
#include "runtime/runner.h"

static const char *const usage =
    "usage: ditworker --connect SOCKET --rank R\n"
    "\n"
    "One rank of a ditd mesh. ditd starts these itself; running one by hand is only\n"
    "useful for debugging. It connects to the daemon's Unix socket, receives the mesh\n"
    "setup and the model to load, and runs the jobs it is sent.\n";

typedef struct worker {
    int fd;
    int rank;
    dit_ipc_reader reader;
    dit_comm *world;
    dit_mesh *mesh;
    dit_backend *be;
    dit_pipeline *pipe;
    dit_runner *runner;
    void *flag_buf; /* backend memory for the cancel flag broadcast */
    /* The job in progress. */
    uint64_t job_id;
    bool cancel_seen;
    bool shutdown_seen; /* the daemon asked us to exit */
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

/* Called by every rank after every step. Rank 0 reports progress and looks
 * for a cancel request; the decision is broadcast so every rank agrees. */
static dit_status on_step(void *ctx, int step, int total, double elapsed_ms)
{
    worker *w = ctx;
    dit_diag diag;
    dit_diag_clear(&diag);
    int32_t stop = 0;
    if (w->rank == 0) {
        Ditserve__Ipc__JobProgress pr = DITSERVE__IPC__JOB_PROGRESS__INIT;
        pr.job_id = w->job_id;
        pr.step = step;
        pr.total_steps = total;
        pr.elapsed_ms = elapsed_ms;
        Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
        env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_PROGRESS;
        env.progress = &pr;
        if (send_env(w, &env) != 0)
            return DIT_ERR_PEER; /* the daemon is gone */
        Ditserve__Ipc__Envelope *in = NULL;
        int got;
        while ((got = dit_ipc_poll_fd(w->fd, &w->reader, &in)) == 1) {
            if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_CANCEL && in->cancel->job_id == w->job_id)
                w->cancel_seen = true;
            /* Shutdown mid-job: stop at this step, then exit. */
            if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN)
                w->cancel_seen = w->shutdown_seen = true;
            ditserve__ipc__envelope__free_unpacked(in, NULL);
        }
        if (got < 0)
            return DIT_ERR_PEER;
        stop = w->cancel_seen;
    }
    if (w->world && dit_comm_size(w->world) > 1) {
        /* Through backend memory, so that a device-side comm can send it. */
        float f = (float)stop;
        dit_tensor host = dit_tensor_1d(&f, DIT_F32, 1), dev = dit_tensor_1d(w->flag_buf, DIT_F32, 1);
        dit_status st = w->be->ops->upload(w->be, &dev, &host);
        if (st == DIT_OK)
            st = w->world->ops->broadcast(w->world, w->flag_buf, sizeof(float), 0, &diag);
        if (st == DIT_OK)
            st = w->be->ops->download(w->be, &host, &dev);
        if (st != DIT_OK)
            return st;
        stop = f != 0.0f;
    }
    return stop ? DIT_ERR_CANCELLED : DIT_OK;
}

static bool mesh_fatal(dit_status st)
{
    return st == DIT_ERR_PEER || st == DIT_ERR_TIMEOUT || st == DIT_ERR_DEVICE;
}

/* Runs one job; returns non-zero when the mesh is broken and the worker
 * must exit. */
static int run_job(worker *w, const Ditserve__Ipc__Job *job)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_request rq;
    dit_gen_result res;
    memset(&res, 0, sizeof res);
    uint8_t *bytes = NULL;
    size_t nbytes = 0;
    const dit_pipeline_info *info = dit_pipeline_get_info(w->pipe);
    w->job_id = job->job_id;
    w->cancel_seen = false;
    double t_encode = 0;
    dit_status st = dit_request_resolve(job->request, info, 0, &rq, &diag);
    if (st == DIT_OK)
        st = dit_pipeline_generate(w->pipe, w->runner, &rq.gp, w->rank == 0, on_step, w, &res, &diag);
    if (st == DIT_OK && w->rank == 0 && !job->warmup) {
        double t0 = now_ms();
        if (rq.output_format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR) {
            nbytes = sizeof(float) * 3 * (size_t)res.width * (size_t)res.height;
            bytes = malloc(nbytes);
            if (bytes)
                memcpy(bytes, res.image, nbytes);
            else
                st = dit_diag_set(&diag, DIT_ERR_NOMEM, "out of memory for the result");
        } else {
            st = dit_png_encode_rgb(res.image, res.height, res.width, &bytes, &nbytes, &diag);
        }
        t_encode = now_ms() - t0;
    }
    Ditserve__Ipc__JobDone done = DITSERVE__IPC__JOB_DONE__INIT;
    Ditserve__V1__Timings tm = DITSERVE__V1__TIMINGS__INIT;
    done.job_id = job->job_id;
    done.rank = w->rank;
    done.status = (int32_t)st;
    done.message = st == DIT_OK ? "" : (char *)dit_diag_msg(&diag);
    int64_t shape[3] = {3, res.height, res.width};
    if (st == DIT_OK) {
        done.image.data = bytes;
        done.image.len = nbytes;
        done.width = res.width;
        done.height = res.height;
        done.seed = rq.gp.seed;
        done.prompt_truncated = res.prompt_truncated;
        tm.tokenize_ms = res.tokenize_ms;
        tm.text_encode_ms = res.encode_ms;
        tm.denoise_ms = res.denoise_ms;
        tm.step_ms_min = res.step_ms_min;
        tm.step_ms_max = res.step_ms_max;
        tm.vae_ms = res.vae_ms;
        tm.encode_ms = t_encode;
        done.timings = &tm;
        if (rq.output_format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR) {
            done.n_shape = 3;
            done.shape = shape;
        }
    }
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_DONE;
    env.done = &done;
    int rc = send_env(w, &env) != 0 ? 1 : 0;
    if (mesh_fatal(st)) {
        fprintf(stderr, "ditworker rank %d: %s\n", w->rank, dit_diag_msg(&diag));
        if (w->world)
            w->world->ops->abort(w->world);
        rc = 1;
    }
    free(bytes);
    dit_gen_result_free(&res);
    dit_request_free(&rq);
    return rc;
}

static dit_status setup(worker *w, const Ditserve__Ipc__Setup *s, dit_diag *diag)
{
    dit_parallel_config pc = dit_parallel_config_single();
    pc.world_size = s->world_size;
    pc.ring_degree = s->ring_degree;
    pc.ulysses_degree = s->ulysses_degree;
    pc.tp_degree = s->tp_degree;
    pc.ulysses_anything = s->ulysses_anything;
    pc.ring_anything = s->ring_anything;
    pc.unified_anything = s->unified_anything;
    pc.fp32_merge = s->fp32_merge;
    dit_status st;
    if (pc.world_size > 1) {
        dit_shm_config sc = {.world_size = pc.world_size, .timeout_s = s->comm_timeout_s};
        snprintf(sc.name, sizeof sc.name, "%s", s->shm_name);
        if ((st = dit_shm_comm_join(&sc, w->rank, &w->world, diag)) != DIT_OK)
            return st;
        if ((st = dit_mesh_create(&pc, w->world, &w->mesh, diag)) != DIT_OK)
            return st;
    }
    dit_backend_config bc = {.n_threads = s->threads, .device = s->device};
    if (dit_backend_kind_parse(s->backend, &bc.kind) != DIT_OK)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "unknown backend '%s'", s->backend);
    if ((st = dit_backend_create(&bc, &w->be, diag)) != DIT_OK)
        return st;
    if ((st = dit_backend_alloc(w->be, sizeof(float), &w->flag_buf)) != DIT_OK)
        return dit_diag_set(diag, st, "out of device memory");
    dit_flux_shard shard = {.tp_degree = pc.tp_degree,
                            .tp_rank = w->mesh ? dit_mesh_tp_rank(w->mesh) : 0};
    if ((st = dit_pipeline_load(w->be, s->model_dir, &shard, w->rank == 0, &w->pipe, diag)) != DIT_OK)
        return st;
    return dit_runner_create(w->be, dit_pipeline_transformer(w->pipe), w->mesh, &w->runner, diag);
}

static void teardown(worker *w)
{
    dit_runner_destroy(w->runner);
    dit_pipeline_free(w->pipe);
    if (w->be)
        dit_backend_free(w->be, w->flag_buf);
    dit_backend_destroy(w->be);
    dit_mesh_destroy(w->mesh);
    dit_comm_destroy(w->world);
    dit_ipc_reader_free(&w->reader);
    if (w->fd >= 0)
        close(w->fd);
}

int main(int argc, char **argv)
{
    const char *path = NULL;
    long rank = -1;
    static const struct option opts[] = {
        {"connect", required_argument, NULL, 'c'},
        {"rank", required_argument, NULL, 'r'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 'c') {
            path = optarg;
        } else if (c == 'r') {
            char *end;
            rank = strtol(optarg, &end, 10);
            if (*end || rank < 0 || rank >= DIT_SHM_MAX_RANKS)
                rank = -2;
        } else if (c == 'h') {
            fputs(usage, stdout);
            return 0;
        } else {
            fputs(usage, stderr);
            return 2;
        }
    }
    if (!path || rank < 0) {
        fprintf(stderr, "ditworker: --connect and a valid --rank are required\n\n%s", usage);
        return 2;
    }
    /* Die with the daemon, even one that exits without stopping us (a
     * second SIGTERM, a crash): a worker has no reason to outlive it. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() == 1)
        return 1;
    worker w;
    memset(&w, 0, sizeof w);
    w.fd = -1;
    w.rank = (int)rank;
    dit_ipc_reader_init(&w.reader);
    int rc = 1;
    dit_diag diag;
    dit_diag_clear(&diag);
    Ditserve__Ipc__Envelope *in = NULL;

    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) {
        fprintf(stderr, "ditworker: socket path too long: %s\n", path);
        goto cleanup;
    }
    strcpy(addr.sun_path, path);
    w.fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (w.fd < 0 || connect(w.fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        fprintf(stderr, "ditworker rank %d: cannot connect to %s: %s\n", w.rank, path, strerror(errno));
        goto cleanup;
    }
    Ditserve__Ipc__Hello hello = DITSERVE__IPC__HELLO__INIT;
    hello.rank = w.rank;
    hello.pid = (int32_t)getpid();
    Ditserve__Ipc__Envelope env = DITSERVE__IPC__ENVELOPE__INIT;
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_HELLO;
    env.hello = &hello;
    if (send_env(&w, &env) != 0 || dit_ipc_read_fd(w.fd, &w.reader, &in) != 0 ||
        in->msg_case != DITSERVE__IPC__ENVELOPE__MSG_SETUP) {
        fprintf(stderr, "ditworker rank %d: no setup from the daemon\n", w.rank);
        goto cleanup;
    }
    double t0 = now_ms();
    dit_status st = setup(&w, in->setup, &diag);
    ditserve__ipc__envelope__free_unpacked(in, NULL);
    in = NULL;
    if (st != DIT_OK) {
        fprintf(stderr, "ditworker rank %d: %s\n", w.rank, dit_diag_msg(&diag));
        send_done_error(&w, 0, st, dit_diag_msg(&diag));
        if (w.world)
            w.world->ops->abort(w.world);
        goto cleanup;
    }
    Ditserve__Ipc__Ready ready = DITSERVE__IPC__READY__INIT;
    ready.rank = w.rank;
    ready.load_ms = now_ms() - t0;
    ready.device = (char *)w.be->ops->name;
    ready.weight_bytes = (int64_t)dit_flux_weight_bytes(dit_pipeline_transformer(w.pipe));
    env.msg_case = DITSERVE__IPC__ENVELOPE__MSG_READY;
    env.ready = &ready;
    if (send_env(&w, &env) != 0)
        goto cleanup;

    for (;;) {
        if (dit_ipc_read_fd(w.fd, &w.reader, &in) != 0) {
            /* The daemon went away: nothing left to serve. */
            rc = 0;
            break;
        }
        if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN) {
            rc = 0;
            break;
        }
        if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_JOB) {
            if (run_job(&w, in->job) != 0)
                break;
            if (w.shutdown_seen) {
                rc = 0;
                break;
            }
        }
        /* A cancel for a job that already ended needs no answer. */
        ditserve__ipc__envelope__free_unpacked(in, NULL);
        in = NULL;
    }
cleanup:
    if (in)
        ditserve__ipc__envelope__free_unpacked(in, NULL);
    teardown(&w);
    return rc;
}
