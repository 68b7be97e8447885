/* The NCCL comm backend on one GPU, as a group of one rank: every op of
 * comm.h runs through NCCL (a world of one still launches NCCL's kernels,
 * its send/recv to self, its split and finalize), so that the first GPU run
 * shows comm_nccl.c working before a mesh of several GPUs depends on it.
 * Results are exactly known: with one rank a sum is the input, a gather or
 * all-to-all a copy, a send to self a copy.
 *
 * It also checks the dead-peer machinery that one rank can reach: the
 * family wait check (dit_nccl_wait_check) is quiet on a healthy group,
 * times out and aborts the group and its split children, after which their
 * ops fail fast; and the cuda backend's host waits stop when their wait
 * check says so instead of sitting in cudaStreamSynchronize. */
#include <check.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "comm/nccl/comm_nccl.h"
#include "gpu_util.h"

static dit_backend *g_gpu; /* set in main, read-only afterwards */

static const double TIMEOUT_S = 20.0;

static dit_comm *make_group(void)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_nccl_config nc;
    memset(&nc, 0, sizeof nc);
    nc.rank = 0;
    nc.world_size = 1;
    nc.device = 0;
    nc.stream = dit_cuda_backend_stream(g_gpu);
    nc.timeout_s = TIMEOUT_S;
    ck_assert_msg(dit_nccl_unique_id(nc.id, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_comm *c = NULL;
    dit_status st = dit_nccl_comm_create(&nc, &c, &diag);
    ck_assert_msg(st == DIT_OK, "create: %s", dit_diag_msg(&diag));
    ck_assert_int_eq(dit_comm_rank(c), 0);
    ck_assert_int_eq(dit_comm_size(c), 1);
    return c;
}

#define COMM_OK(call)                                                                              \
    do {                                                                                           \
        dit_diag d_;                                                                               \
        dit_diag_clear(&d_);                                                                       \
        dit_diag *diag_ = &d_;                                                                     \
        (void)diag_;                                                                               \
        dit_status st_ = (call);                                                                   \
        ck_assert_msg(st_ == DIT_OK, "%s: %s", #call, dit_diag_msg(&d_));                          \
    } while (0)

/* Overwrites a result buffer so that a copy that did not happen shows. */
static void poison(float *dev, size_t n)
{
    dit_tensor dd = dit_tensor_1d(dev, DIT_F32, (int64_t)n);
    GPU_OK(g_gpu, g_gpu->ops->fill(g_gpu, &dd, -7.0f));
}

/* n floats on the device, from host values. */
static float *dev_floats(const float *h, size_t n)
{
    void *p = NULL;
    GPU_OK(g_gpu, dit_backend_alloc(g_gpu, n * sizeof(float), &p));
    if (h) {
        dit_tensor hd = dit_tensor_1d((void *)h, DIT_F32, (int64_t)n);
        dit_tensor dd = dit_tensor_1d(p, DIT_F32, (int64_t)n);
        GPU_OK(g_gpu, g_gpu->ops->upload(g_gpu, &dd, &hd));
    } else {
        poison(p, n);
    }
    return p;
}

/* Max |device - want| over n floats (downloads, which waits). */
static double max_err(const char *what, const float *dev, const float *want, size_t n)
{
    dit_tensor dd = dit_tensor_1d((void *)dev, DIT_F32, (int64_t)n);
    float *got = gpu_fetch(g_gpu, &dd);
    double e = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - want[i]);
        e = isnan(d) ? INFINITY : fmax(e, d);
    }
    free(got);
    printf("nccl world 1: %-28s max error %.3g over %zu values\n", what, e, n);
    return e;
}

START_TEST(every_op_on_a_group_of_one)
{
    dit_comm *c = make_group();
    const size_t n = 4099; /* odd: no op may assume a multiple of anything */
    test_rng r = {31};
    float *h = gpu_rand(&r, n, -3, 3, false);
    float *a = dev_floats(h, n), *b = dev_floats(NULL, n);

    COMM_OK(c->ops->all_reduce_sum(c, a, n, DIT_F32, diag_));
    ck_assert(max_err("all_reduce_sum f32", a, h, n) == 0);

    /* bf16: the bits of bf16-exact values survive a sum over one rank. */
    {
        float *hb = gpu_rand(&r, n, -3, 3, true);
        void *pb = NULL;
        GPU_OK(g_gpu, dit_backend_alloc(g_gpu, n * 2, &pb));
        dit_tensor hd = dit_tensor_1d(hb, DIT_F32, (int64_t)n),
                   dd = dit_tensor_1d(pb, DIT_BF16, (int64_t)n);
        GPU_OK(g_gpu, g_gpu->ops->upload(g_gpu, &dd, &hd));
        COMM_OK(c->ops->all_reduce_sum(c, pb, n, DIT_BF16, diag_));
        float *got = gpu_fetch(g_gpu, &dd);
        double e = 0;
        for (size_t i = 0; i < n; i++)
            e = fmax(e, fabs((double)got[i] - hb[i]));
        printf("nccl world 1: %-28s max error %.3g over %zu values\n", "all_reduce_sum bf16", e, n);
        ck_assert(e == 0);
        free(got);
        free(hb);
        dit_backend_free(g_gpu, pb);
    }

    COMM_OK(c->ops->all_gather(c, a, n * sizeof(float), b, diag_));
    ck_assert(max_err("all_gather", b, h, n) == 0);
    {
        size_t counts[1] = {n * sizeof(float)};
        poison(b, n);
        COMM_OK(c->ops->all_gather_v(c, a, b, counts, diag_));
        ck_assert(max_err("all_gather_v", b, h, n) == 0);
    }
    poison(b, n);
    COMM_OK(c->ops->all_to_all(c, a, n * sizeof(float), b, diag_));
    ck_assert(max_err("all_to_all", b, h, n) == 0);
    {
        size_t sc[1] = {n * sizeof(float)}, rc[1] = {n * sizeof(float)};
        poison(b, n);
        COMM_OK(c->ops->all_to_all_v(c, a, sc, b, rc, diag_));
        ck_assert(max_err("all_to_all_v", b, h, n) == 0);
    }
    /* Send to self, receive from self: the ring exchange of a ring of one,
     * on the side stream, ordered back into the compute stream. */
    {
        float *z = dev_floats(NULL, n);
        dit_comm_request req;
        memset(&req, 0, sizeof req);
        COMM_OK(c->ops->sendrecv_start(c, a, n * sizeof(float), 0, z, n * sizeof(float), 0, &req,
                                       diag_));
        COMM_OK(c->ops->sendrecv_wait(c, &req, diag_));
        ck_assert(max_err("sendrecv to self", z, h, n) == 0);
        dit_backend_free(g_gpu, z);
        float *z2 = dev_floats(NULL, n);
        COMM_OK(dit_comm_sendrecv(c, a, n * sizeof(float), 0, z2, n * sizeof(float), 0, diag_));
        ck_assert(max_err("dit_comm_sendrecv to self", z2, h, n) == 0);
        dit_backend_free(g_gpu, z2);
    }
    COMM_OK(c->ops->broadcast(c, a, n * sizeof(float), 0, diag_));
    ck_assert(max_err("broadcast", a, h, n) == 0);
    COMM_OK(c->ops->barrier(c, diag_));

    /* Split: one child with colour 0, none with a negative colour. */
    dit_comm *child = NULL, *none = (dit_comm *)1;
    COMM_OK(c->ops->split(c, 0, 0, &child, diag_));
    ck_assert_ptr_nonnull(child);
    ck_assert_int_eq(dit_comm_size(child), 1);
    ck_assert_int_eq(dit_comm_rank(child), 0);
    COMM_OK(child->ops->all_reduce_sum(child, a, n, DIT_F32, diag_));
    ck_assert(max_err("all_reduce_sum (split)", a, h, n) == 0);
    COMM_OK(child->ops->barrier(child, diag_));
    COMM_OK(c->ops->split(c, -1, 0, &none, diag_));
    ck_assert_ptr_null(none);

    /* A healthy family: the wait check lets waits go on, and the backend's
     * download polls through it. */
    {
        dit_diag d;
        dit_diag_clear(&d);
        ck_assert_int_eq(dit_nccl_wait_check(c, 0.5, &d), DIT_OK);
        dit_cuda_backend_set_wait_check(g_gpu, dit_nccl_wait_check, c);
        COMM_OK(c->ops->all_reduce_sum(c, a, n, DIT_F32, diag_));
        ck_assert(max_err("all_reduce_sum, polled wait", a, h, n) == 0);
        dit_cuda_backend_set_wait_check(g_gpu, NULL, NULL);
    }

    /* Destroy healthy groups: finalize, then destroy (children first). */
    dit_comm_destroy(child);
    dit_comm_destroy(c);
    dit_backend_free(g_gpu, a);
    dit_backend_free(g_gpu, b);
    free(h);
}
END_TEST

START_TEST(wait_check_times_out_and_aborts_the_family)
{
    dit_comm *c = make_group();
    dit_comm *child = NULL;
    COMM_OK(c->ops->split(c, 0, 0, &child, diag_));
    ck_assert_ptr_nonnull(child);
    dit_diag d;
    dit_diag_clear(&d);
    /* Asked through the child: the check covers the whole family. */
    ck_assert_int_eq(dit_nccl_wait_check(child, TIMEOUT_S + 1.0, &d), DIT_ERR_TIMEOUT);
    printf("nccl world 1: timed-out wait check: %s\n", dit_diag_msg(&d));
    ck_assert_ptr_nonnull(strstr(dit_diag_msg(&d), "did not drain"));
    /* Both groups are aborted: their ops fail fast, naming the cause. */
    float *buf = dev_floats(NULL, 16);
    dit_diag_clear(&d);
    ck_assert_int_eq(c->ops->all_reduce_sum(c, buf, 16, DIT_F32, &d), DIT_ERR_PEER);
    ck_assert_ptr_nonnull(strstr(dit_diag_msg(&d), "unusable"));
    dit_diag_clear(&d);
    ck_assert_int_eq(child->ops->barrier(child, &d), DIT_ERR_PEER);
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_nccl_wait_check(c, 0.0, &d), DIT_ERR_PEER);
    dit_backend_free(g_gpu, buf);
    dit_comm_destroy(child);
    dit_comm_destroy(c);
}
END_TEST

/* ---- the backend's host waits ------------------------------------------ */

static void CUDART_CB sleep_on_stream(void *arg)
{
    const double s = *(const double *)arg;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

typedef struct stop_after {
    int calls, stop_at;
    double last_waited;
} stop_after;

static dit_status stop_check(void *ctx, double waited_s, dit_diag *diag)
{
    stop_after *s = ctx;
    s->last_waited = waited_s;
    if (++s->calls >= s->stop_at)
        return dit_diag_set(diag, DIT_ERR_PEER, "test: peer declared dead after %d polls",
                            s->calls);
    return DIT_OK;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

START_TEST(backend_waits_stop_when_the_check_says_so)
{
    cudaStream_t s = (cudaStream_t)dit_cuda_backend_stream(g_gpu);
    static double hold = 1.5; /* read by the host function while it runs */
    stop_after sa = {0, 50, 0};
    dit_cuda_backend_set_wait_check(g_gpu, stop_check, &sa);
    /* The stream is busy for 1.5 s (a host function stands in for a kernel
     * stuck on a peer); sync must return after the 50th poll, long before. */
    ck_assert_int_eq(cudaLaunchHostFunc(s, sleep_on_stream, &hold), cudaSuccess);
    const double t0 = now_s();
    dit_status st = g_gpu->ops->sync(g_gpu);
    const double took = now_s() - t0;
    printf("backend sync with a stopping wait check: %s after %.3f s, %d polls: %s\n",
           dit_status_str(st), took, sa.calls, g_gpu->ops->last_error(g_gpu));
    ck_assert_int_eq(st, DIT_ERR_PEER);
    ck_assert_int_eq(sa.calls, 50);
    ck_assert(took < 1.0);
    ck_assert_ptr_nonnull(strstr(g_gpu->ops->last_error(g_gpu), "declared dead"));
    /* Without a check the wait is plain again and sees the stream drain. */
    dit_cuda_backend_set_wait_check(g_gpu, NULL, NULL);
    GPU_OK(g_gpu, g_gpu->ops->sync(g_gpu));
    ck_assert(now_s() - t0 >= 1.4);
    /* A check that never stops: the wait ends when the stream drains. */
    sa.calls = 0;
    sa.stop_at = 1 << 30;
    hold = 0.2;
    dit_cuda_backend_set_wait_check(g_gpu, stop_check, &sa);
    ck_assert_int_eq(cudaLaunchHostFunc(s, sleep_on_stream, &hold), cudaSuccess);
    GPU_OK(g_gpu, g_gpu->ops->sync(g_gpu));
    printf("backend sync with a quiet wait check: %d polls over %.3f s\n", sa.calls,
           sa.last_waited);
    ck_assert_int_gt(sa.calls, 0);
    dit_cuda_backend_set_wait_check(g_gpu, NULL, NULL);
}
END_TEST

int main(void)
{
    gpu_require_device("test_cuda_nccl");
    printf("test_cuda_nccl: NCCL %d\n", dit_cuda_nccl_version());
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend_config gc = {.kind = DIT_BACKEND_CUDA, .device = 0};
    if (dit_backend_create(&gc, &g_gpu, &diag) != DIT_OK) {
        printf("test_cuda_nccl: FAIL: %s\n", dit_diag_msg(&diag));
        return 1;
    }
    Suite *s = suite_create("cuda_nccl");
    TCase *tc = tcase_create("world1");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, every_op_on_a_group_of_one);
    tcase_add_test(tc, wait_check_times_out_and_aborts_the_family);
    suite_add_tcase(s, tc);
    /* A case of its own: it needs a stream that runs while the host waits,
     * which the SIMT emulator's (run when waited for) is not, so the
     * emulated build runs only "world1" (tests/gpu/emu/meson.build). */
    TCase *tw = tcase_create("async_waits");
    tcase_set_timeout(tw, 120);
    tcase_add_test(tw, backend_waits_stop_when_the_check_says_so);
    suite_add_tcase(s, tw);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    dit_backend_destroy(g_gpu);
    return failed ? 1 : 0;
}
