/* ditworker's side of request batching, without the daemon: this test
 * plays ditd on the private socket (Hello, Setup, Ready, Job, Cancel,
 * JobProgress, JobDone, Shutdown) for one rank and for a ring-2 mesh of two
 * worker processes in shared memory. A batched Job (Job.batch) runs its
 * members in the same forwards; a Cancel naming member 1 makes it leave
 * while members 0 and 2 finish equal (raw f32 images within 1e-5) to the
 * same requests sent as single jobs; progress carries the job's id; every
 * rank agrees on who left; cancelling every member cancels the job; a batch
 * whose members cannot share forwards fails as a whole; a job of more
 * members than a worker runs fails on every rank, which serve on; with
 * Setup.decode_on_every_rank the images of a job (a batch's, one request's
 * num_images) are decoded round robin on both ranks; rank 0
 * losing the daemon's socket mid-job tells the other rank to stop at that
 * step (CANCELLED, and it serves on) and exits with status 1. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm/shm/comm_shm.h"
#include "ipc_wire.h"
#include "test_proc.h"

#define MAX_RANKS 2

typedef struct fake_daemon {
    int world;
    bool spread; /* Setup.decode_on_every_rank */
    int listen_fd;
    char path[108];
    int fd[MAX_RANKS];
    pid_t pid[MAX_RANKS];
    dit_ipc_reader rd[MAX_RANKS];
    dit_shm_segment *seg;
} fake_daemon;

static Ditserve__Ipc__Envelope *recv_env(fake_daemon *d, int r)
{
    Ditserve__Ipc__Envelope *e = NULL;
    ck_assert_msg(dit_ipc_read_fd(d->fd[r], &d->rd[r], &e) == 0, "rank %d closed the socket", r);
    return e;
}

static void send_env(fake_daemon *d, int r, Ditserve__Ipc__Envelope *e)
{
    ck_assert_int_eq(dit_ipc_write_fd(d->fd[r], e), 0);
}

static void daemon_start(fake_daemon *d, int world, bool spread)
{
    memset(d, 0, sizeof *d);
    d->world = world;
    d->spread = spread;
    snprintf(d->path, sizeof d->path, "/tmp/dit_wb_%d.sock", (int)getpid());
    unlink(d->path);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", d->path);
    d->listen_fd = socket(AF_UNIX, SOCK_STREAM, 0);
    ck_assert_int_ge(d->listen_fd, 0);
    ck_assert_int_eq(bind(d->listen_fd, (struct sockaddr *)&addr, sizeof addr), 0);
    ck_assert_int_eq(listen(d->listen_fd, 4), 0);
    dit_shm_config sc = {.world_size = world, .timeout_s = 60};
    if (world > 1) {
        dit_shm_make_name(&sc);
        ck_assert_int_eq(dit_shm_segment_create(&sc, &d->seg, NULL), DIT_OK);
    }
    for (int r = 0; r < world; r++) {
        char rank[16];
        snprintf(rank, sizeof rank, "%d", r);
        d->pid[r] = fork();
        ck_assert_int_ge(d->pid[r], 0);
        if (d->pid[r] == 0) {
            /* As ditd's uv_spawn starts workers: every signal at its default. */
            signal(SIGPIPE, SIG_DFL);
            execl(test_env("DITWORKER"), "ditworker", "--connect", d->path, "--rank", rank,
                  (char *)NULL);
            _exit(127);
        }
    }
    char demo[1100];
    snprintf(demo, sizeof demo, "%s/tests/data/demo", test_env("DIT_SOURCE_ROOT"));
    for (int i = 0; i < world; i++) {
        int fd = accept(d->listen_fd, NULL, NULL);
        ck_assert_int_ge(fd, 0);
        dit_ipc_reader rd;
        dit_ipc_reader_init(&rd);
        Ditserve__Ipc__Envelope *e = NULL;
        ck_assert_int_eq(dit_ipc_read_fd(fd, &rd, &e), 0);
        ck_assert_int_eq(e->msg_case, DITSERVE__IPC__ENVELOPE__MSG_HELLO);
        const int r = e->hello->rank;
        ditserve__ipc__envelope__free_unpacked(e, NULL);
        d->fd[r] = fd;
        d->rd[r] = rd;
    }
    for (int r = 0; r < world; r++) {
        Ditserve__Ipc__Setup s = DITSERVE__IPC__SETUP__INIT;
        s.world_size = world;
        s.ring_degree = world;
        s.ulysses_degree = 1;
        s.tp_degree = 1;
        s.fp32_merge = true;
        s.shm_name = world > 1 ? sc.name : "";
        s.model_dir = demo;
        s.backend = "cpu";
        s.threads = world > 1 ? 1 : 2;
        s.comm_timeout_s = 60;
        s.device = -1;
        s.rank = r;
        s.decode_on_every_rank = spread;
        Ditserve__Ipc__Envelope e = DITSERVE__IPC__ENVELOPE__INIT;
        e.msg_case = DITSERVE__IPC__ENVELOPE__MSG_SETUP;
        e.setup = &s;
        send_env(d, r, &e);
    }
    for (int r = 0; r < world; r++) {
        Ditserve__Ipc__Envelope *e = recv_env(d, r);
        ck_assert_msg(e->msg_case == DITSERVE__IPC__ENVELOPE__MSG_READY, "rank %d: not ready", r);
        ditserve__ipc__envelope__free_unpacked(e, NULL);
    }
    if (d->seg)
        dit_shm_segment_unlink(d->seg);
}

static void daemon_stop(fake_daemon *d)
{
    for (int r = 0; r < d->world; r++) {
        Ditserve__Ipc__Shutdown sd = DITSERVE__IPC__SHUTDOWN__INIT;
        Ditserve__Ipc__Envelope e = DITSERVE__IPC__ENVELOPE__INIT;
        e.msg_case = DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN;
        e.shutdown = &sd;
        send_env(d, r, &e);
    }
    for (int r = 0; r < d->world; r++) {
        int status = 0;
        ck_assert_int_eq(waitpid(d->pid[r], &status, 0), d->pid[r]);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank %d ended with %d", r,
                      status);
        close(d->fd[r]);
        dit_ipc_reader_free(&d->rd[r]);
    }
    dit_shm_segment_destroy(d->seg);
    close(d->listen_fd);
    unlink(d->path);
}

/* A FLUX true-CFG request on the demo pipeline, raw f32 output. */
typedef struct req_store {
    Ditserve__V1__GenerateRequest req;
    Google__Protobuf__FloatValue guidance, true_cfg;
    Google__Protobuf__UInt64Value seed;
} req_store;

static void make_req(req_store *s, const char *prompt, uint64_t seed, float guidance,
                     float true_cfg, int steps)
{
    ditserve__v1__generate_request__init(&s->req);
    google__protobuf__float_value__init(&s->guidance);
    google__protobuf__float_value__init(&s->true_cfg);
    google__protobuf__uint64_value__init(&s->seed);
    s->req.prompt = (char *)prompt;
    s->req.negative_prompt = "blurry";
    s->req.width = 64;
    s->req.height = 48;
    s->req.num_inference_steps = steps;
    s->req.max_sequence_length = 32;
    s->guidance.value = guidance;
    s->true_cfg.value = true_cfg;
    s->seed.value = seed;
    s->req.guidance_scale = &s->guidance;
    s->req.true_cfg_scale = &s->true_cfg;
    s->req.seed = &s->seed;
    s->req.output_format = DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR;
}

/* Sends the job (n members: reqs[0] the job, reqs[1..] Job.batch with ids
 * id + k) to every rank; after rank 0's first progress, cancels the members
 * cancel[k]. Returns every rank's JobDone (free with free_unpacked). */
static void run_job(fake_daemon *d, uint64_t id, int n, req_store *reqs, const bool *cancel,
                    Ditserve__Ipc__Envelope **done, int *progress_seen)
{
    Ditserve__Ipc__BatchMember mem[4], *memp[4];
    for (int k = 1; k < n; k++) {
        ditserve__ipc__batch_member__init(&mem[k]);
        mem[k].job_id = id + (uint64_t)k;
        mem[k].request = &reqs[k].req;
        memp[k - 1] = &mem[k];
    }
    Ditserve__Ipc__Job job = DITSERVE__IPC__JOB__INIT;
    job.job_id = id;
    job.request = &reqs[0].req;
    job.n_batch = (size_t)(n - 1);
    job.batch = memp;
    Ditserve__Ipc__Envelope e = DITSERVE__IPC__ENVELOPE__INIT;
    e.msg_case = DITSERVE__IPC__ENVELOPE__MSG_JOB;
    e.job = &job;
    for (int r = 0; r < d->world; r++)
        send_env(d, r, &e);
    *progress_seen = 0;
    for (;;) {
        Ditserve__Ipc__Envelope *in = recv_env(d, 0);
        if (in->msg_case == DITSERVE__IPC__ENVELOPE__MSG_DONE) {
            done[0] = in;
            break;
        }
        ck_assert_int_eq(in->msg_case, DITSERVE__IPC__ENVELOPE__MSG_PROGRESS);
        ck_assert_uint_eq(in->progress->job_id, id);
        if (++*progress_seen == 1 && cancel)
            for (int k = 0; k < n; k++) {
                if (!cancel[k])
                    continue;
                Ditserve__Ipc__Cancel c = DITSERVE__IPC__CANCEL__INIT;
                c.job_id = id + (uint64_t)k;
                Ditserve__Ipc__Envelope ce = DITSERVE__IPC__ENVELOPE__INIT;
                ce.msg_case = DITSERVE__IPC__ENVELOPE__MSG_CANCEL;
                ce.cancel = &c;
                send_env(d, 0, &ce);
            }
        ditserve__ipc__envelope__free_unpacked(in, NULL);
    }
    for (int r = 1; r < d->world; r++) {
        done[r] = recv_env(d, r);
        ck_assert_int_eq(done[r]->msg_case, DITSERVE__IPC__ENVELOPE__MSG_DONE);
        if (!d->spread) /* rank 0 decoded every member */
            ck_assert_int_eq(done[r]->done->n_batch, 0);
    }
}

static double raw_rel(const ProtobufCBinaryData *a, const ProtobufCBinaryData *b)
{
    ck_assert_uint_eq(a->len, b->len);
    const int64_t sh[1] = {(int64_t)(a->len / sizeof(float))};
    const dit_tensor ta = dit_tensor_make(a->data, DIT_F32, 1, sh);
    const dit_tensor tb = dit_tensor_make(b->data, DIT_F32, 1, sh);
    return test_compare_views(&ta, &tb).rel;
}

START_TEST(worker_runs_batched_jobs)
{
    const int world = _i ? 2 : 1;
    fake_daemon d;
    daemon_start(&d, world, false);
    req_store reqs[3];
    make_req(&reqs[0], "a red fox", 7, 3.5f, 3.0f, 4);
    make_req(&reqs[1], "a bowl of ramen", 3, 5.0f, 2.0f, 4);
    make_req(&reqs[2], "a lighthouse", 9, 2.0f, 4.0f, 4);
    Ditserve__Ipc__Envelope *done[MAX_RANKS], *solo[MAX_RANKS];
    int progress = 0;

    /* The batch; member 1 cancelled after the first step. */
    const bool cancel1[3] = {false, true, false};
    run_job(&d, 100, 3, reqs, cancel1, done, &progress);
    const Ditserve__Ipc__JobDone *jd = done[0]->done;
    ck_assert_msg(jd->status == DIT_OK, "%s", jd->message);
    ck_assert_uint_eq(jd->job_id, 100);
    ck_assert_int_eq(progress, 4 + 1); /* 4 steps and "decoding" */
    /* One entry per member, member 0 first; the message's own result
     * fields stay empty. */
    ck_assert_int_eq(jd->n_batch, 3);
    ck_assert_uint_eq(jd->image.len, 0);
    ck_assert_uint_eq(jd->batch[0]->job_id, 100);
    ck_assert_msg(jd->batch[0]->status == DIT_OK, "%s", jd->batch[0]->message);
    ck_assert_int_eq(jd->batch[0]->seed, 7);
    ck_assert_uint_eq(jd->batch[1]->job_id, 101);
    ck_assert_int_eq(jd->batch[1]->status, DIT_ERR_CANCELLED);
    ck_assert_str_eq(jd->batch[1]->message, "cancelled");
    ck_assert_uint_eq(jd->batch[1]->image.len, 0);
    ck_assert_uint_eq(jd->batch[2]->job_id, 102);
    ck_assert_msg(jd->batch[2]->status == DIT_OK, "%s", jd->batch[2]->message);
    ck_assert_int_eq(jd->batch[2]->seed, 9);
    ck_assert_int_eq(jd->batch[2]->width, 64);
    ck_assert_int_eq(jd->batch[2]->n_shape, 3);
    ck_assert_int_eq(jd->batch[2]->n_image_bytes, 1);
    ck_assert_ptr_nonnull(jd->batch[2]->timings);
    ck_assert_uint_eq(jd->batch[0]->image.len, (size_t)3 * 48 * 64 * sizeof(float));
    ck_assert_uint_eq(jd->batch[2]->image.len, jd->batch[0]->image.len);
    for (int r = 1; r < world; r++)
        ck_assert_int_eq(done[r]->done->status, DIT_OK);

    /* Members 0 and 2 alone. */
    for (int k = 0; k < 3; k += 2) {
        run_job(&d, 200 + (uint64_t)k, 1, &reqs[k], NULL, solo, &progress);
        ck_assert_msg(solo[0]->done->status == DIT_OK, "%s", solo[0]->done->message);
        ck_assert_int_eq(solo[0]->done->n_batch, 0);
        const double rel = raw_rel(&jd->batch[k]->image, &solo[0]->done->image);
        printf("ditworker %s, batch of 3 (member 1 cancelled): member %d vs alone: image rel "
               "%.2g\n",
               world > 1 ? "ring 2" : "one rank", k, rel);
        fflush(stdout);
        ck_assert_msg(rel <= 1e-5, "member %d rel %.3g", k, rel);
        for (int r = 0; r < world; r++)
            ditserve__ipc__envelope__free_unpacked(solo[r], NULL);
    }
    for (int r = 0; r < world; r++)
        ditserve__ipc__envelope__free_unpacked(done[r], NULL);

    /* Member 0 cancelled: the job goes on for the others and ran (OK on
     * every rank); member 0's entry says CANCELLED. */
    const bool cancel0[2] = {true, false};
    run_job(&d, 300, 2, reqs, cancel0, done, &progress);
    ck_assert_int_eq(done[0]->done->n_batch, 2);
    ck_assert_int_eq(done[0]->done->batch[0]->status, DIT_ERR_CANCELLED);
    ck_assert_uint_eq(done[0]->done->batch[0]->image.len, 0);
    ck_assert_int_eq(done[0]->done->batch[1]->status, DIT_OK);
    ck_assert_uint_gt(done[0]->done->batch[1]->image.len, 0);
    for (int r = 0; r < world; r++) {
        ck_assert_int_eq(done[r]->done->status, DIT_OK);
        ditserve__ipc__envelope__free_unpacked(done[r], NULL);
    }

    /* Every member cancelled: the job is cancelled on every rank. */
    const bool cancel_all[2] = {true, true};
    run_job(&d, 400, 2, reqs, cancel_all, done, &progress);
    ck_assert_int_eq(done[0]->done->status, DIT_ERR_CANCELLED);
    ck_assert_int_eq(done[0]->done->n_batch, 2);
    ck_assert_int_eq(done[0]->done->batch[0]->status, DIT_ERR_CANCELLED);
    ck_assert_int_eq(done[0]->done->batch[1]->status, DIT_ERR_CANCELLED);
    ck_assert_int_lt(progress, 4);
    for (int r = 0; r < world; r++) {
        ck_assert_int_eq(done[r]->done->status, DIT_ERR_CANCELLED);
        ditserve__ipc__envelope__free_unpacked(done[r], NULL);
    }

    /* Members that cannot share forwards: the whole job fails. */
    req_store bad[2];
    make_req(&bad[0], "a", 1, 3.5f, 3.0f, 2);
    make_req(&bad[1], "b", 2, 3.5f, 3.0f, 3);
    run_job(&d, 500, 2, bad, NULL, done, &progress);
    ck_assert_int_eq(done[0]->done->status, DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(done[0]->done->message, "cannot run in the same forwards"));
    ck_assert_int_eq(done[0]->done->n_batch, 2);
    ck_assert_int_eq(done[0]->done->batch[0]->status, DIT_ERR_INVALID_ARG);
    ck_assert_int_eq(done[0]->done->batch[1]->status, DIT_ERR_INVALID_ARG);
    for (int r = 0; r < world; r++)
        ditserve__ipc__envelope__free_unpacked(done[r], NULL);

    daemon_stop(&d);
}
END_TEST

/* Member k's images from the ranks holding them, in image order (rank 0's
 * entry names the rank of each; each holder's entry has its images of the
 * member one after another), as ditd puts them together: ni raw images of
 * `one` bytes, malloc'ed. */
static uint8_t *member_images(Ditserve__Ipc__Envelope **done, size_t k, int ni, size_t one)
{
    const Ditserve__Ipc__JobDone *e0 = done[0]->done->batch[k];
    ck_assert_int_eq(e0->n_image_ranks, ni);
    uint8_t *out = malloc((size_t)ni * one);
    ck_assert_ptr_nonnull(out);
    int next[MAX_RANKS] = {0};
    for (int i = 0; i < ni; i++) {
        const int r = e0->image_ranks[i];
        ck_assert(r >= 0 && r < MAX_RANKS);
        const Ditserve__Ipc__JobDone *held = done[r]->done->batch[k];
        ck_assert_msg(held->status == DIT_OK, "member %zu on rank %d: %s", k, r, held->message);
        ck_assert_uint_ge(held->image.len, (size_t)(next[r] + 1) * one);
        ck_assert_int_eq(held->image_bytes[next[r]], (int64_t)one);
        memcpy(out + (size_t)i * one, held->image.data + (size_t)next[r] * one, one);
        next[r]++;
    }
    /* Each holder sent its images and no more. */
    for (int r = 0; r < MAX_RANKS; r++)
        if (next[r]) {
            ck_assert_int_eq(done[r]->done->batch[k]->n_image_bytes, next[r]);
            ck_assert_uint_eq(done[r]->done->batch[k]->image.len, (size_t)next[r] * one);
        }
    return out;
}

static double rel_n(const uint8_t *a, const uint8_t *b, size_t bytes)
{
    const ProtobufCBinaryData x = {bytes, (uint8_t *)a}, y = {bytes, (uint8_t *)b};
    return raw_rel(&x, &y);
}

/* Setup.decode_on_every_rank on a ring-2 mesh: the images of a job go
 * round robin over both ranks, each rank decoding and encoding its own. A
 * batch of three (1, 2 and 1 images): member 0 on rank 0, member 1's image
 * 0 on rank 1 and image 1 on rank 0, member 2 on rank 1; rank 0's entries
 * name the rank of each image, each holder's entry carries its images, and
 * every member equals (within 1e-5) the request run alone. A single job of
 * three images lists itself as a batch of one, its images on ranks 0, 1
 * and 0, bit for bit what rank 0 alone decodes on a mesh that does not
 * spread; a single job of one image keeps its own fields. A member of rank
 * 1 that leaves says CANCELLED in rank 1's entry. */
START_TEST(worker_spreads_decodes)
{
    fake_daemon d;
    daemon_start(&d, 2, true);
    req_store reqs[3];
    make_req(&reqs[0], "a red fox", 7, 3.5f, 3.0f, 3);
    make_req(&reqs[1], "a bowl of ramen", 3, 5.0f, 2.0f, 3);
    reqs[1].req.num_images = 2;
    make_req(&reqs[2], "a lighthouse", 9, 2.0f, 4.0f, 3);
    Ditserve__Ipc__Envelope *done[MAX_RANKS], *solo[MAX_RANKS];
    int progress = 0;
    run_job(&d, 100, 3, reqs, NULL, done, &progress);
    const Ditserve__Ipc__JobDone *d0 = done[0]->done, *d1 = done[1]->done;
    ck_assert_msg(d0->status == DIT_OK && d1->status == DIT_OK, "%s / %s", d0->message,
                  d1->message);
    ck_assert_int_eq(d0->n_batch, 3);
    ck_assert_int_eq(d1->n_batch, 3);
    const int ni[3] = {1, 2, 1};
    const int owner[3][2] = {{0}, {1, 0}, {1}};
    const size_t one = (size_t)3 * 48 * 64 * sizeof(float);
    for (int k = 0; k < 3; k++) {
        ck_assert_uint_eq(d0->batch[k]->job_id, 100 + (uint64_t)k);
        ck_assert_uint_eq(d1->batch[k]->job_id, 100 + (uint64_t)k);
        ck_assert_int_eq(d0->batch[k]->rank, owner[k][0]);
        for (int i = 0; i < ni[k]; i++)
            ck_assert_int_eq(d0->batch[k]->image_ranks[i], owner[k][i]);
        uint8_t *imgs = member_images(done, (size_t)k, ni[k], one);
        /* A rank holding none of the member's images sends none of them. */
        for (int r = 0; r < 2; r++) {
            bool holds = false;
            for (int i = 0; i < ni[k]; i++)
                holds = holds || owner[k][i] == r;
            if (!holds)
                ck_assert_uint_eq(done[r]->done->batch[k]->image.len, 0);
            else
                ck_assert(done[r]->done->batch[k]->timings->vae_ms > 0);
        }
        /* Alone: one image in the job's own fields, two as a batch of one
         * spread the same way. */
        run_job(&d, 200 + (uint64_t)k, 1, &reqs[k], NULL, solo, &progress);
        ck_assert_msg(solo[0]->done->status == DIT_OK, "%s", solo[0]->done->message);
        double rel;
        if (ni[k] == 1) {
            ck_assert_int_eq(solo[0]->done->n_batch, 0);
            ck_assert_int_eq(solo[1]->done->n_batch, 0);
            rel = rel_n(imgs, solo[0]->done->image.data, one);
            ck_assert_uint_eq(solo[0]->done->image.len, one);
        } else {
            ck_assert_int_eq(solo[0]->done->n_batch, 1);
            uint8_t *alone = member_images(solo, 0, ni[k], one);
            rel = rel_n(imgs, alone, (size_t)ni[k] * one);
            free(alone);
        }
        printf("ditworker ring 2, decodes spread: member %d (%d image%s) vs alone: image rel "
               "%.2g\n",
               k, ni[k], ni[k] > 1 ? "s" : "", rel);
        fflush(stdout);
        ck_assert_msg(rel <= 1e-5, "member %d rel %.3g", k, rel);
        free(imgs);
        for (int r = 0; r < 2; r++)
            ditserve__ipc__envelope__free_unpacked(solo[r], NULL);
    }
    for (int r = 0; r < 2; r++)
        ditserve__ipc__envelope__free_unpacked(done[r], NULL);

    /* Member 2, rank 1's, leaves after the first step. */
    const bool cancel2[3] = {false, false, true};
    run_job(&d, 300, 3, reqs, cancel2, done, &progress);
    ck_assert_int_eq(done[0]->done->status, DIT_OK);
    ck_assert_int_eq(done[1]->done->n_batch, 3);
    ck_assert_int_eq(done[1]->done->batch[2]->status, DIT_ERR_CANCELLED);
    ck_assert_uint_eq(done[1]->done->batch[2]->image.len, 0);
    ck_assert_int_eq(done[0]->done->batch[0]->status, DIT_OK);
    ck_assert_uint_eq(done[0]->done->batch[0]->image.len, one);
    ck_assert_int_eq(done[1]->done->batch[1]->status, DIT_OK);
    ck_assert_uint_eq(done[1]->done->batch[1]->image.len, one);
    for (int r = 0; r < 2; r++)
        ditserve__ipc__envelope__free_unpacked(done[r], NULL);

    /* One request of three images: ranks 0, 1, 0. */
    req_store three;
    make_req(&three, "a paper boat", 11, 3.5f, 3.0f, 3);
    three.req.num_images = 3;
    run_job(&d, 400, 1, &three, NULL, done, &progress);
    ck_assert_msg(done[0]->done->status == DIT_OK, "%s", done[0]->done->message);
    ck_assert_int_eq(done[0]->done->n_batch, 1);
    ck_assert_int_eq(done[1]->done->n_batch, 1);
    ck_assert_uint_eq(done[0]->done->image.len, 0);
    const int own3[3] = {0, 1, 0};
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(done[0]->done->batch[0]->image_ranks[i], own3[i]);
    uint8_t *spread = member_images(done, 0, 3, one);
    for (int r = 0; r < 2; r++)
        ditserve__ipc__envelope__free_unpacked(done[r], NULL);
    daemon_stop(&d);

    /* The same on a mesh where rank 0 decodes everything. */
    daemon_start(&d, 2, false);
    run_job(&d, 500, 1, &three, NULL, done, &progress);
    ck_assert_msg(done[0]->done->status == DIT_OK, "%s", done[0]->done->message);
    ck_assert_int_eq(done[0]->done->n_batch, 0);
    ck_assert_uint_eq(done[0]->done->image.len, 3 * one);
    ck_assert_int_eq(memcmp(spread, done[0]->done->image.data, 3 * one), 0);
    free(spread);
    for (int r = 0; r < 2; r++)
        ditserve__ipc__envelope__free_unpacked(done[r], NULL);
    daemon_stop(&d);
}
END_TEST

/* Sends one job to every rank without reading the answers. */
static void send_job(fake_daemon *d, const Ditserve__Ipc__Job *job)
{
    Ditserve__Ipc__Envelope e = DITSERVE__IPC__ENVELOPE__INIT;
    e.msg_case = DITSERVE__IPC__ENVELOPE__MSG_JOB;
    e.job = (Ditserve__Ipc__Job *)job;
    for (int r = 0; r < d->world; r++)
        send_env(d, r, &e);
}

START_TEST(worker_limits_and_lost_daemon)
{
    fake_daemon d;
    daemon_start(&d, 2, false);
    req_store rq;
    make_req(&rq, "a red fox", 7, 3.5f, 3.0f, 2);

    /* More members than a worker runs together: refused alike on both
     * ranks, before any forward. */
    enum { BIG = DIT_IPC_MAX_MEMBERS };
    Ditserve__Ipc__BatchMember mem[BIG], *memp[BIG];
    for (int k = 0; k < BIG; k++) {
        ditserve__ipc__batch_member__init(&mem[k]);
        mem[k].job_id = 601 + (uint64_t)k;
        mem[k].request = &rq.req;
        memp[k] = &mem[k];
    }
    Ditserve__Ipc__Job job = DITSERVE__IPC__JOB__INIT;
    job.job_id = 600;
    job.request = &rq.req;
    job.n_batch = BIG;
    job.batch = memp;
    send_job(&d, &job);
    for (int r = 0; r < 2; r++) {
        Ditserve__Ipc__Envelope *e = recv_env(&d, r);
        ck_assert_int_eq(e->msg_case, DITSERVE__IPC__ENVELOPE__MSG_DONE);
        ck_assert_int_eq(e->done->status, DIT_ERR_INVALID_ARG);
        ck_assert_msg(strstr(e->done->message, "a worker runs at most 64 together"), "%s",
                      e->done->message);
        ditserve__ipc__envelope__free_unpacked(e, NULL);
    }

    /* Rank 0's socket closes after its first progress report. */
    make_req(&rq, "a red fox", 7, 3.5f, 3.0f, 200);
    Ditserve__Ipc__Job one = DITSERVE__IPC__JOB__INIT;
    one.job_id = 700;
    one.request = &rq.req;
    send_job(&d, &one);
    Ditserve__Ipc__Envelope *e = recv_env(&d, 0);
    ck_assert_int_eq(e->msg_case, DITSERVE__IPC__ENVELOPE__MSG_PROGRESS);
    ditserve__ipc__envelope__free_unpacked(e, NULL);
    close(d.fd[0]);
    e = recv_env(&d, 1);
    ck_assert_int_eq(e->msg_case, DITSERVE__IPC__ENVELOPE__MSG_DONE);
    ck_assert_msg(e->done->status == DIT_ERR_CANCELLED, "rank 1: %s (status %d)", e->done->message,
                  e->done->status);
    ditserve__ipc__envelope__free_unpacked(e, NULL);
    int status = 0;
    ck_assert_int_eq(waitpid(d.pid[0], &status, 0), d.pid[0]);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 1,
                  "rank 0 ended with wait status %d (a signal: %d)", status,
                  WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    /* Rank 1 still answers, and exits cleanly when told. */
    Ditserve__Ipc__Shutdown sd = DITSERVE__IPC__SHUTDOWN__INIT;
    Ditserve__Ipc__Envelope se = DITSERVE__IPC__ENVELOPE__INIT;
    se.msg_case = DITSERVE__IPC__ENVELOPE__MSG_SHUTDOWN;
    se.shutdown = &sd;
    send_env(&d, 1, &se);
    ck_assert_int_eq(waitpid(d.pid[1], &status, 0), d.pid[1]);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "rank 1 ended with %d", status);
    close(d.fd[1]);
    for (int r = 0; r < 2; r++)
        dit_ipc_reader_free(&d.rd[r]);
    dit_shm_segment_destroy(d.seg);
    close(d.listen_fd);
    unlink(d.path);
}
END_TEST

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    Suite *s = suite_create("worker_batch");
    TCase *tc = tcase_create("ipc");
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, worker_runs_batched_jobs, 0, 2);
    tcase_add_test(tc, worker_spreads_decodes);
    tcase_add_test(tc, worker_limits_and_lost_daemon);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
