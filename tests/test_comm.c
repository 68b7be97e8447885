/* The shared-memory comm backend: every collective on inputs whose exact
 * result is known, on world sizes 1-8 and on the sub-groups the parallel mesh
 * splits off, with slots small enough that large messages go through the
 * chunked paths; and the failure contract: a rank that dies, stalls or aborts
 * makes its peers fail promptly with an error naming it, never hang.
 *
 * Each test creates a segment, forks one child per rank; every child joins as
 * its rank, runs a scenario and exits 0, or prints what mismatched and exits
 * non-zero. Children never call ck_assert: Check's assertions report to the
 * test process, so the parent collects the children's exit codes (with a
 * deadline after which it kills them) and asserts on those. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"
#include "comm/shm/comm_shm.h"
#include "core/status.h"
#include "test_util.h"

#define MAX_RANKS 8
#define SMALL_SLOT ((size_t)4096)
#define GUARD_BYTES 64
#define GUARD_FILL 0xa5
#define JUNK_FILL 0xee
#define ANY_DST 255 /* pattern "destination" for data every rank receives */

/* ---------------------------------------------------------------- clocks */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_s(double s)
{
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* ------------------------------------------------------------- harness */

/* Memory the parent maps shared before forking, so ranks can observe each
 * other independently of the backend under test (the barrier test counts
 * arrivals here; the mid-op death test records when the victim died). */
typedef struct shared_scratch {
    _Atomic int counter[4096];
    _Atomic double death_time;
} shared_scratch;

typedef struct run_spec run_spec;
typedef struct rank_ctx rank_ctx;
typedef int (*rank_fn)(rank_ctx *cx);

struct run_spec {
    int world_size;
    size_t slot_bytes; /* 0: backend default */
    double timeout_s;  /* comm timeout; 0: 20 s */
    double deadline_s; /* the parent kills the ranks after this; 0: 90 s */
    rank_fn fn;
    int no_join;             /* fn joins by itself (the join tests) */
    int op;                  /* scenario parameters */
    int victim;              /* the rank that dies, stalls or aborts */
    double delay_s;          /* how long the victim waits before misbehaving */
    int launcher_abort;      /* the parent calls dit_shm_segment_abort(victim) ... */
    double launcher_abort_s; /* ... this long after forking */
};

typedef struct run_result {
    int status[MAX_RANKS]; /* exit code, 128 + signal, or -1: killed at the deadline */
    int failed_rank;       /* dit_shm_segment_failed_rank after all ranks ended */
    int deadline_hit;
    int leftovers; /* /dev/shm entries with the segment's name after destroy */
    char name[64];
} run_result;

/* Allocations are tracked so that a scenario can bail out on the first
 * mismatch with a bare `return 1` and the child still frees everything
 * (the sanitizer build would otherwise report the early exits as leaks). */
#define CX_MAX_ALLOCS 64

struct rank_ctx {
    const run_spec *spec;
    const dit_shm_config *cfg;
    dit_comm *world;
    int rank;
    int size;
    shared_scratch *shared;
    test_rng rng; /* per-rank jitter */
    void *allocs[CX_MAX_ALLOCS];
    int n_allocs;
};

static void child_fail(const rank_ctx *cx, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void child_fail(const rank_ctx *cx, const char *file, int line, const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "[rank %d of %d] %s:%d: %s\n", cx->rank, cx->size, file, line, msg);
    fflush(stderr);
}

#define FAILF(cx, ...) (child_fail((cx), __FILE__, __LINE__, __VA_ARGS__), 1)
#define REQUIRE(cx, cond, ...)                                                                     \
    do {                                                                                           \
        if (!(cond))                                                                               \
            return FAILF(cx, __VA_ARGS__);                                                         \
    } while (0)
/* Evaluates a comm call with a fresh diag (dit_diag_set keeps the first
 * message, so a reused diag would show a stale one). */
#define REQUIRE_OK(cx, what, call)                                                                 \
    do {                                                                                           \
        dit_diag d_;                                                                               \
        dit_diag_clear(&d_);                                                                       \
        dit_diag *diag = &d_;                                                                      \
        dit_status st_ = (call);                                                                   \
        if (st_ != DIT_OK)                                                                         \
            return FAILF(cx, "%s: %s returned %s: %s", what, #call, dit_status_name(st_),          \
                         dit_diag_msg(&d_));                                                       \
    } while (0)

/* malloc with GUARD_BYTES of GUARD_FILL after n, to catch writes past the
 * expected size in builds without the sanitizer. Never NULL. */
static void *cx_alloc(rank_ctx *cx, size_t n)
{
    if (cx->n_allocs == CX_MAX_ALLOCS) {
        fprintf(stderr, "[rank %d] test bug: too many allocations\n", cx->rank);
        exit(20);
    }
    unsigned char *p = malloc(n + GUARD_BYTES);
    if (!p) {
        fprintf(stderr, "[rank %d] out of memory (%zu bytes)\n", cx->rank, n);
        exit(21);
    }
    memset(p, JUNK_FILL, n);
    memset(p + n, GUARD_FILL, GUARD_BYTES);
    cx->allocs[cx->n_allocs++] = p;
    return p;
}

/* Frees everything allocated after `mark` (a previous cx->n_allocs). */
static void cx_release(rank_ctx *cx, int mark)
{
    while (cx->n_allocs > mark)
        free(cx->allocs[--cx->n_allocs]);
}

static int guard_intact(const void *p, size_t n)
{
    const unsigned char *g = (const unsigned char *)p + n;
    for (size_t i = 0; i < GUARD_BYTES; i++)
        if (g[i] != GUARD_FILL)
            return 0;
    return 1;
}

static _Noreturn void child_exit(int rc)
{
    /* exit, not _exit: the sanitizer's leak check runs at exit and should see
     * what the backend left behind. stdio was flushed before fork, so nothing
     * is written twice. */
    fflush(NULL);
    exit(rc);
}

static _Noreturn void child_main(const run_spec *sp, const dit_shm_config *cfg, int rank,
                                 shared_scratch *sh)
{
    rank_ctx cx = {.spec = sp, .cfg = cfg, .rank = rank, .size = sp->world_size, .shared = sh};
    cx.rng.s = 0x5eed0000u + (uint64_t)rank * 7919u + (uint64_t)getpid();
    int rc;
    if (sp->no_join) {
        rc = sp->fn(&cx);
    } else {
        dit_diag d;
        dit_diag_clear(&d);
        dit_status st = dit_shm_comm_join(cfg, rank, &cx.world, &d);
        if (st != DIT_OK) {
            fprintf(stderr, "[rank %d] dit_shm_comm_join: %s: %s\n", rank, dit_status_name(st),
                    dit_diag_msg(&d));
            child_exit(10);
        }
        if (dit_comm_rank(cx.world) != rank || dit_comm_size(cx.world) != sp->world_size) {
            fprintf(stderr, "[rank %d] world group says rank %d of %d, want %d of %d\n", rank,
                    dit_comm_rank(cx.world), dit_comm_size(cx.world), rank, sp->world_size);
            child_exit(11);
        }
        rc = sp->fn(&cx);
        dit_comm_destroy(cx.world);
    }
    cx_release(&cx, 0);
    child_exit(rc);
}

/* Counts /dev/shm entries named after the segment (without its leading '/'):
 * the name itself, or the name followed by a separator, so that helper
 * objects named after it count too but another segment whose name merely
 * extends this one ("/dit-1-2" vs "/dit-1-23") does not. */
static int count_shm_entries(const char *name)
{
    const char *base = name[0] == '/' ? name + 1 : name;
    const size_t len = strlen(base);
    DIR *dir = opendir("/dev/shm");
    if (!dir)
        return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL)
        if (strncmp(e->d_name, base, len) == 0 && strchr("-._", e->d_name[len]) != NULL)
            n++;
    closedir(dir);
    return n;
}

/* Creates a segment, forks the ranks, waits for them (killing them at the
 * deadline), records the outcome and destroys the segment. */
static void run_ranks(const run_spec *sp, run_result *res)
{
    const int n = sp->world_size;
    ck_assert_int_le(n, MAX_RANKS);
    memset(res, 0, sizeof *res);
    dit_shm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    dit_shm_make_name(&cfg);
    cfg.world_size = n;
    cfg.slot_bytes = sp->slot_bytes;
    cfg.timeout_s = sp->timeout_s > 0 ? sp->timeout_s : 20.0;
    snprintf(res->name, sizeof res->name, "%s", cfg.name);
    ck_assert_msg(strncmp(cfg.name, "/dit-", 5) == 0, "segment name %s", cfg.name);

    dit_diag d;
    dit_diag_clear(&d);
    dit_shm_segment *seg = NULL;
    dit_status st = dit_shm_segment_create(&cfg, &seg, &d);
    ck_assert_msg(st == DIT_OK, "dit_shm_segment_create(%s): %s", cfg.name, dit_diag_msg(&d));
    /* Makes the leftover check below meaningful. */
    ck_assert_msg(count_shm_entries(cfg.name) >= 1, "no /dev/shm entry for %s", cfg.name);

    shared_scratch *sh =
        mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    ck_assert(sh != MAP_FAILED);
    memset(sh, 0, sizeof *sh);

    pid_t pids[MAX_RANKS] = {0};
    fflush(NULL);
    for (int r = 0; r < n; r++) {
        pid_t pid = fork();
        if (pid == 0)
            child_main(sp, &cfg, r, sh);
        if (pid < 0) {
            for (int k = 0; k < r; k++) {
                kill(pids[k], SIGKILL);
                waitpid(pids[k], NULL, 0);
            }
            dit_shm_segment_destroy(seg);
            ck_abort_msg("fork: %s", strerror(errno));
        }
        pids[r] = pid;
    }

    /* Reap promptly: a dead child left as a zombie still "exists" to kill(),
     * and a real launcher reaps too. */
    const double t0 = now_s();
    const double deadline = sp->deadline_s > 0 ? sp->deadline_s : 90.0;
    int alive = n, aborted = 0;
    while (alive > 0) {
        for (int r = 0; r < n; r++) {
            int ws;
            if (pids[r] > 0 && waitpid(pids[r], &ws, WNOHANG) == pids[r]) {
                res->status[r] = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
                pids[r] = 0;
                alive--;
            }
        }
        const double el = now_s() - t0;
        if (sp->launcher_abort && !aborted && el >= sp->launcher_abort_s) {
            dit_shm_segment_abort(seg, sp->victim);
            aborted = 1;
        }
        if (alive > 0 && el > deadline) {
            res->deadline_hit = 1;
            for (int r = 0; r < n; r++) {
                if (pids[r] > 0) {
                    fprintf(stderr, "rank %d still running after %.0f s: killed\n", r, deadline);
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], NULL, 0);
                    res->status[r] = -1;
                    pids[r] = 0;
                }
            }
            break;
        }
        if (alive > 0)
            sleep_s(0.002);
    }
    res->failed_rank = dit_shm_segment_failed_rank(seg);
    dit_shm_segment_destroy(seg);
    res->leftovers = count_shm_entries(cfg.name);
    munmap(sh, sizeof *sh);
}

/* Asserts that every rank exited with want[r] (NULL: all 0), that no deadline
 * was hit and that the segment left nothing in /dev/shm. */
static void expect_statuses(const run_spec *sp, const run_result *res, const int *want)
{
    char buf[256] = "";
    int bad = 0;
    for (int r = 0; r < sp->world_size; r++) {
        int w = want ? want[r] : 0;
        size_t len = strlen(buf);
        snprintf(buf + len, sizeof buf - len, " %d", res->status[r]);
        if (res->status[r] != w)
            bad = 1;
    }
    ck_assert_msg(!res->deadline_hit, "ranks still running at the deadline; exit codes:%s", buf);
    ck_assert_msg(!bad, "unexpected rank exit codes:%s (see the ranks' messages above)", buf);
    ck_assert_msg(res->leftovers == 0, "%d /dev/shm entries named %s* remain after destroy",
                  res->leftovers, res->name);
}

/* A healthy run: every rank succeeded and nobody was recorded as failed. */
static void run_expect_ok(const run_spec *sp)
{
    run_result res;
    run_ranks(sp, &res);
    expect_statuses(sp, &res, NULL);
    ck_assert_int_eq(res.failed_rank, -1);
}

/* ---------------------------------------------------------- known data */

/* A byte that depends on (source world rank, destination world rank, index)
 * through a mixing hash, so data delivered from the wrong rank, to the wrong
 * rank or at the wrong offset (a chunk shifted by a slot) is caught. */
static uint8_t pat(int src, int dst, size_t idx)
{
    uint64_t h = ((uint64_t)src + 1) * 0x9e3779b97f4a7c15ull ^
                 ((uint64_t)dst + 1) * 0xc2b2ae3d27d4eb4full ^
                 ((uint64_t)idx + 1) * 0x165667b19e3779f9ull;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return (uint8_t)h;
}

static void fill_pat(void *buf, size_t n, int src, int dst)
{
    uint8_t *p = buf;
    for (size_t i = 0; i < n; i++)
        p[i] = pat(src, dst, i);
}

/* A group as the tests see it: the comm and, for each group rank, the world
 * rank behind it, so expected results are computed from world ranks and a
 * result that mixes in data from outside the group is caught. */
typedef struct group {
    dit_comm *c;
    const char *name;
    int n;
    int me;
    int members[MAX_RANKS];
    int counter_id;   /* unique per group instance within a scenario: selects */
    int barrier_uses; /* the shared counters check_barrier uses */
} group;

static void world_group(rank_ctx *cx, group *g)
{
    memset(g, 0, sizeof *g);
    g->c = cx->world;
    g->name = "world";
    g->n = cx->size;
    g->me = cx->rank;
    for (int i = 0; i < g->n; i++)
        g->members[i] = i;
    g->counter_id = 0;
}

static int expect_pat(rank_ctx *cx, const group *g, const char *what, const void *buf, size_t n,
                      int src, int dst)
{
    const uint8_t *p = buf;
    for (size_t i = 0; i < n; i++)
        if (p[i] != pat(src, dst, i))
            return FAILF(cx,
                         "%s (%d ranks) %s: byte %zu of %zu is 0x%02x, want 0x%02x "
                         "(data from world rank %d for %d)",
                         g->name, g->n, what, i, n, p[i], pat(src, dst, i), src, dst);
    return 0;
}

#define REQUIRE_GUARD(cx, g, what, buf, n)                                                         \
    REQUIRE(cx, guard_intact(buf, n), "%s: %s wrote past its %zu bytes", (g)->name, what,          \
            (size_t)(n))

/* Integer-valued floats in [-1000, 1000]: sums of up to 8 are exact in f32. */
static float ar_val(int w, size_t i)
{
    return (float)((int)((i * 7 + (size_t)w * 13 + (i >> 10) * 5) % 2001) - 1000);
}

/* -------------------------------------------------------- op checkers */

static int check_all_reduce_exact_one(rank_ctx *cx, const group *g, size_t count)
{
    const int mark = cx->n_allocs;
    float *buf = cx_alloc(cx, count * sizeof(float));
    const int w = g->members[g->me];
    for (size_t i = 0; i < count; i++)
        buf[i] = ar_val(w, i);
    REQUIRE_OK(cx, g->name, g->c->ops->all_reduce_sum(g->c, buf, count, DIT_F32, diag));
    for (size_t i = 0; i < count; i++) {
        int sum = 0;
        for (int m = 0; m < g->n; m++)
            sum += (int)ar_val(g->members[m], i);
        const float want = (float)sum;
        REQUIRE(cx, memcmp(&buf[i], &want, sizeof want) == 0,
                "%s all_reduce_sum count %zu: [%zu] = %.9g, want exactly %d", g->name, count, i,
                (double)buf[i], sum);
    }
    REQUIRE_GUARD(cx, g, "all_reduce_sum", buf, count * sizeof(float));
    cx_release(cx, mark);
    return 0;
}

static int check_all_reduce_exact(rank_ctx *cx, const group *g)
{
    static const size_t counts[] = {0, 1, 2, 3, 5, 1023, 1024, 1025, 4097, 12345, 65539};
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++)
        if (check_all_reduce_exact_one(cx, g, counts[k]))
            return 1;
    return 0;
}

static uint64_t fnv1a(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* Floats whose sum depends on the order of addition: the contract is that
 * every rank nevertheless gets the same bits, so each rank hashes its result
 * and the hashes are compared through all_gather. */
static int check_all_reduce_same_bits(rank_ctx *cx, const group *g)
{
    static const size_t counts[] = {1, 7, 1000, 4099, 50001};
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        const size_t count = counts[k];
        const int mark = cx->n_allocs;
        float *buf = cx_alloc(cx, count * sizeof(float));
        double *want = cx_alloc(cx, count * sizeof(double));
        double *mag = cx_alloc(cx, count * sizeof(double));
        for (size_t i = 0; i < count; i++)
            want[i] = mag[i] = 0;
        for (int m = 0; m < g->n; m++) {
            test_rng r = {.s = 1000u * (uint64_t)g->members[m] + count};
            for (size_t i = 0; i < count; i++) {
                /* Magnitudes from 1e-3 to 1e3, both signs: order changes bits. */
                float v = test_rng_uniform(&r, -1.0f, 1.0f) *
                          powf(10.0f, test_rng_uniform(&r, -3.0f, 3.0f));
                if (m == g->me)
                    buf[i] = v;
                want[i] += v;
                mag[i] += fabs((double)v);
            }
        }
        REQUIRE_OK(cx, g->name, g->c->ops->all_reduce_sum(g->c, buf, count, DIT_F32, diag));
        for (size_t i = 0; i < count; i++)
            REQUIRE(cx, fabs((double)buf[i] - want[i]) <= 1e-6 * mag[i] + 1e-30,
                    "%s all_reduce_sum count %zu: [%zu] = %.9g, want %.9g", g->name, count, i,
                    (double)buf[i], want[i]);
        uint64_t h = fnv1a(buf, count * sizeof(float));
        uint64_t *all = cx_alloc(cx, (size_t)g->n * sizeof h);
        REQUIRE_OK(cx, g->name, g->c->ops->all_gather(g->c, &h, sizeof h, all, diag));
        for (int m = 0; m < g->n; m++)
            REQUIRE(cx, all[m] == h,
                    "%s all_reduce_sum count %zu: rank %d got different bits than rank %d", g->name,
                    count, m, g->me);
        cx_release(cx, mark);
    }
    return 0;
}

static int check_all_gather_one(rank_ctx *cx, const group *g, size_t bytes)
{
    const int mark = cx->n_allocs;
    uint8_t *send = cx_alloc(cx, bytes);
    uint8_t *recv = cx_alloc(cx, bytes * (size_t)g->n);
    fill_pat(send, bytes, g->members[g->me], ANY_DST);
    REQUIRE_OK(cx, g->name, g->c->ops->all_gather(g->c, send, bytes, recv, diag));
    for (int i = 0; i < g->n; i++)
        if (expect_pat(cx, g, "all_gather", recv + (size_t)i * bytes, bytes, g->members[i],
                       ANY_DST))
            return 1;
    if (expect_pat(cx, g, "all_gather send buffer", send, bytes, g->members[g->me], ANY_DST))
        return 1;
    REQUIRE_GUARD(cx, g, "all_gather", recv, bytes * (size_t)g->n);
    cx_release(cx, mark);
    return 0;
}

static int check_all_gather(rank_ctx *cx, const group *g)
{
    static const size_t sizes[] = {0, 1, 3, 4096, 4097, 10000, 100003};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
        if (check_all_gather_one(cx, g, sizes[k]))
            return 1;
    return 0;
}

#define N_GATHERV_PATTERNS 6

/* Bytes rank r of n contributes in all_gather_v pattern k (zeros included). */
static size_t gatherv_count(int k, int r, int n)
{
    switch (k) {
    case 0:
        return r % 2 ? 0 : 3000 + 1111 * (size_t)r;
    case 1:
        return r == n - 1 ? 9000 : 0;
    case 2:
        return 0;
    case 3:
        return 2500 * (size_t)r + 7;
    case 4:
        return r == 0 ? 20000 : 1;
    default:
        return r % 3 == 1 ? 0 : 4096 * (size_t)(r + 1);
    }
}

static int check_all_gather_v_one(rank_ctx *cx, const group *g, int k)
{
    const int mark = cx->n_allocs;
    size_t counts[MAX_RANKS], total = 0;
    for (int r = 0; r < g->n; r++)
        total += counts[r] = gatherv_count(k, r, g->n);
    uint8_t *send = cx_alloc(cx, counts[g->me]);
    uint8_t *recv = cx_alloc(cx, total);
    fill_pat(send, counts[g->me], g->members[g->me], ANY_DST);
    REQUIRE_OK(cx, g->name, g->c->ops->all_gather_v(g->c, send, recv, counts, diag));
    size_t off = 0;
    for (int i = 0; i < g->n; i++) {
        if (expect_pat(cx, g, "all_gather_v", recv + off, counts[i], g->members[i], ANY_DST))
            return FAILF(cx, "(all_gather_v pattern %d, block of rank %d at offset %zu)", k, i,
                         off);
        off += counts[i];
    }
    REQUIRE_GUARD(cx, g, "all_gather_v", recv, total);
    cx_release(cx, mark);
    return 0;
}

static int check_all_gather_v(rank_ctx *cx, const group *g)
{
    for (int k = 0; k < N_GATHERV_PATTERNS; k++)
        if (check_all_gather_v_one(cx, g, k))
            return 1;
    return 0;
}

static int check_all_to_all_one(rank_ctx *cx, const group *g, size_t bytes)
{
    const int mark = cx->n_allocs;
    const size_t total = bytes * (size_t)g->n;
    uint8_t *send = cx_alloc(cx, total);
    uint8_t *recv = cx_alloc(cx, total);
    const int me = g->members[g->me];
    for (int j = 0; j < g->n; j++)
        fill_pat(send + (size_t)j * bytes, bytes, me, g->members[j]);
    REQUIRE_OK(cx, g->name, g->c->ops->all_to_all(g->c, send, bytes, recv, diag));
    for (int i = 0; i < g->n; i++)
        if (expect_pat(cx, g, "all_to_all", recv + (size_t)i * bytes, bytes, g->members[i], me))
            return 1;
    REQUIRE_GUARD(cx, g, "all_to_all", recv, total);
    cx_release(cx, mark);
    return 0;
}

static int check_all_to_all(rank_ctx *cx, const group *g)
{
    static const size_t sizes[] = {0, 1, 7, 1024, 4096, 5000, 30001};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
        if (check_all_to_all_one(cx, g, sizes[k]))
            return 1;
    return 0;
}

#define N_ALLTOALLV_PATTERNS 6

/* Bytes group rank i sends to group rank j in all_to_all_v pattern k. */
static size_t a2av_count(int k, int i, int j, int n)
{
    switch (k) {
    case 0:
        return (size_t)((i * 7 + j * 3) % 5) * 1500;
    case 1:
        return i == j ? 0 : 5000 + 100 * (size_t)i + (size_t)j;
    case 2:
        return i == j ? 9000 : 0;
    case 3:
        return 0;
    case 4:
        return (size_t)(i + 1) * (size_t)(j + 1) * 777;
    default:
        return j == (i + 1) % n ? 20000 : 1;
    }
}

static int check_all_to_all_v_one(rank_ctx *cx, const group *g, int k)
{
    const int mark = cx->n_allocs;
    size_t sc[MAX_RANKS], rc[MAX_RANKS], stot = 0, rtot = 0;
    for (int r = 0; r < g->n; r++) {
        stot += sc[r] = a2av_count(k, g->me, r, g->n);
        rtot += rc[r] = a2av_count(k, r, g->me, g->n);
    }
    uint8_t *send = cx_alloc(cx, stot);
    uint8_t *recv = cx_alloc(cx, rtot);
    const int me = g->members[g->me];
    size_t off = 0;
    for (int j = 0; j < g->n; j++) {
        fill_pat(send + off, sc[j], me, g->members[j]);
        off += sc[j];
    }
    REQUIRE_OK(cx, g->name, g->c->ops->all_to_all_v(g->c, send, sc, recv, rc, diag));
    off = 0;
    for (int i = 0; i < g->n; i++) {
        if (expect_pat(cx, g, "all_to_all_v", recv + off, rc[i], g->members[i], me))
            return FAILF(cx, "(all_to_all_v pattern %d, block from rank %d at offset %zu)", k, i,
                         off);
        off += rc[i];
    }
    REQUIRE_GUARD(cx, g, "all_to_all_v", recv, rtot);
    cx_release(cx, mark);
    return 0;
}

static int check_all_to_all_v(rank_ctx *cx, const group *g)
{
    for (int k = 0; k < N_ALLTOALLV_PATTERNS; k++)
        if (check_all_to_all_v_one(cx, g, k))
            return 1;
    return 0;
}

/* Bytes group rank r sends around the ring in sendrecv size pattern k:
 * k < 5 uniform sizes, then uneven ones (some zero). */
#define N_SENDRECV_PATTERNS 8
static size_t ring_bytes(int k, int r)
{
    static const size_t uniform[] = {0, 1, 4096, 4097, 50000};
    if (k < 5)
        return uniform[k];
    if (k == 5)
        return 1000 * (size_t)(r + 1) + 37 * (size_t)r;
    if (k == 6)
        return r % 2 ? 0 : 6000;
    return r == 0 ? 70000 : 3;
}

/* Something for a rank to do while an exchange is in flight, with a
 * rank-dependent length so that ranks reach sendrecv_wait at different
 * times. */
static uint64_t local_work(rank_ctx *cx)
{
    uint64_t acc = 0;
    const long n = 20000 + (long)(test_rng_next(&cx->rng) % 200000);
    for (long i = 0; i < n; i++)
        acc = acc * 6364136223846793005ull + (uint64_t)i;
    return acc;
}

/* Ring rotation: send to (me+1)%n, receive from (me-1+n)%n; blocking
 * (dit_comm_sendrecv) or split into start, local work and wait. */
static int check_sendrecv_one(rank_ctx *cx, const group *g, int k, int split)
{
    const int mark = cx->n_allocs;
    const int dst = (g->me + 1) % g->n, src = (g->me - 1 + g->n) % g->n;
    const size_t sb = ring_bytes(k, g->me), rb = ring_bytes(k, src);
    uint8_t *send = cx_alloc(cx, sb);
    uint8_t *recv = cx_alloc(cx, rb);
    const int me = g->members[g->me];
    fill_pat(send, sb, me, g->members[dst]);
    if (split) {
        dit_comm_request req;
        memset(&req, 0x5a, sizeof req); /* the backend must not rely on its contents */
        REQUIRE_OK(cx, g->name,
                   g->c->ops->sendrecv_start(g->c, send, sb, dst, recv, rb, src, &req, diag));
        volatile uint64_t sink = local_work(cx);
        (void)sink;
        REQUIRE_OK(cx, g->name, g->c->ops->sendrecv_wait(g->c, &req, diag));
    } else {
        REQUIRE_OK(cx, g->name, dit_comm_sendrecv(g->c, send, sb, dst, recv, rb, src, diag));
    }
    if (expect_pat(cx, g, split ? "sendrecv_start/wait" : "sendrecv", recv, rb, g->members[src],
                   me))
        return FAILF(cx, "(sendrecv size pattern %d)", k);
    if (expect_pat(cx, g, "sendrecv send buffer", send, sb, me, g->members[dst]))
        return 1;
    REQUIRE_GUARD(cx, g, "sendrecv", recv, rb);
    cx_release(cx, mark);
    return 0;
}

static int check_sendrecv(rank_ctx *cx, const group *g, int split)
{
    for (int k = 0; k < N_SENDRECV_PATTERNS; k++)
        if (check_sendrecv_one(cx, g, k, split))
            return 1;
    return 0;
}

/* The ring-attention pattern: n-1 steps passing blocks around the ring with
 * two buffers, computing on the block in hand (the one being sent) while the
 * next arrives. After step s a rank holds the block of rank me-s. Blocks of
 * uneven size when `uneven` (sequence shards of different lengths). */
static int check_ring_pass(rank_ctx *cx, const group *g, size_t base, int uneven)
{
    const int mark = cx->n_allocs;
    size_t maxb = 0;
    for (int r = 0; r < g->n; r++) {
        size_t b = base + (uneven ? 1700 * (size_t)r : 0);
        if (b > maxb)
            maxb = b;
    }
    uint8_t *buf[2] = {cx_alloc(cx, maxb), cx_alloc(cx, maxb)};
    const int dst = (g->me + 1) % g->n, src = (g->me - 1 + g->n) % g->n;
#define RING_BLOCK_BYTES(origin) (base + (uneven ? 1700 * (size_t)(origin) : 0))
    int holder = g->me; /* whose block buf[cur] holds */
    int cur = 0;
    fill_pat(buf[cur], RING_BLOCK_BYTES(holder), g->members[holder], ANY_DST);
    for (int s = 1; s < g->n; s++) {
        const int incoming = (g->me - s + g->n) % g->n;
        dit_comm_request req;
        REQUIRE_OK(cx, g->name,
                   g->c->ops->sendrecv_start(g->c, buf[cur], RING_BLOCK_BYTES(holder), dst,
                                             buf[!cur], RING_BLOCK_BYTES(incoming), src, &req,
                                             diag));
        /* "Attention" on the block in hand: read it while it is being sent. */
        if (expect_pat(cx, g, "ring block in hand", buf[cur], RING_BLOCK_BYTES(holder),
                       g->members[holder], ANY_DST))
            return FAILF(cx, "(ring pass step %d)", s);
        REQUIRE_OK(cx, g->name, g->c->ops->sendrecv_wait(g->c, &req, diag));
        cur = !cur;
        holder = incoming;
        if (expect_pat(cx, g, "ring block received", buf[cur], RING_BLOCK_BYTES(holder),
                       g->members[holder], ANY_DST))
            return FAILF(cx, "(ring pass step %d, base %zu, uneven %d)", s, base, uneven);
    }
#undef RING_BLOCK_BYTES
    REQUIRE_GUARD(cx, g, "ring pass", buf[0], maxb);
    REQUIRE_GUARD(cx, g, "ring pass", buf[1], maxb);
    cx_release(cx, mark);
    return 0;
}

static int check_broadcast_one(rank_ctx *cx, const group *g, size_t bytes, int root)
{
    const int mark = cx->n_allocs;
    uint8_t *buf = cx_alloc(cx, bytes);
    if (g->me == root)
        fill_pat(buf, bytes, g->members[root], ANY_DST);
    REQUIRE_OK(cx, g->name, g->c->ops->broadcast(g->c, buf, bytes, root, diag));
    if (expect_pat(cx, g, "broadcast", buf, bytes, g->members[root], ANY_DST))
        return FAILF(cx, "(broadcast of %zu bytes from group rank %d)", bytes, root);
    REQUIRE_GUARD(cx, g, "broadcast", buf, bytes);
    cx_release(cx, mark);
    return 0;
}

static int check_broadcast(rank_ctx *cx, const group *g)
{
    static const size_t sizes[] = {0, 1, 4096, 4097, 100000};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
        for (int root = 0; root < g->n; root++)
            if (check_broadcast_one(cx, g, sizes[k], root))
                return 1;
    return 0;
}

/* Each rank arrives at a random moment and counts itself in shared memory
 * the backend knows nothing of; after the barrier every rank must see all
 * of the group counted. A barrier that lets a rank through early fails. */
#define BARRIER_ROUNDS 25
#define BARRIER_USES 4 /* per group instance */
static int check_barrier(rank_ctx *cx, group *g)
{
    const int base = (g->counter_id * BARRIER_USES + g->barrier_uses++) * BARRIER_ROUNDS;
    REQUIRE(cx, g->barrier_uses <= BARRIER_USES && base + BARRIER_ROUNDS <= 4096,
            "test bug: out of barrier counters (group id %d)", g->counter_id);
    for (int round = 0; round < BARRIER_ROUNDS; round++) {
        sleep_s((double)(test_rng_next(&cx->rng) % 1500) * 1e-6);
        _Atomic int *ctr = &cx->shared->counter[base + round];
        atomic_fetch_add(ctr, 1);
        REQUIRE_OK(cx, g->name, g->c->ops->barrier(g->c, diag));
        const int seen = atomic_load(ctr);
        REQUIRE(cx, seen == g->n, "%s barrier round %d: passed with %d of %d ranks arrived",
                g->name, round, seen, g->n);
    }
    return 0;
}

/* A few of every op back to back on one group (used on sub-groups). */
static int check_group_ops(rank_ctx *cx, group *g)
{
    if (check_all_reduce_exact_one(cx, g, 5000) || check_all_gather_one(cx, g, 6000) ||
        check_all_gather_v_one(cx, g, 0) || check_all_to_all_one(cx, g, 5000) ||
        check_all_to_all_v_one(cx, g, 1) || check_sendrecv_one(cx, g, 5, 0) ||
        check_sendrecv_one(cx, g, 4, 1) || check_ring_pass(cx, g, 3000, 1))
        return 1;
    for (int root = 0; root < g->n; root++)
        if (check_broadcast_one(cx, g, 9000, root))
            return 1;
    return check_barrier(cx, g);
}

/* ------------------------------------------------ shapes and scenarios */

typedef struct shape {
    int world;
    size_t slot;
} shape;

/* World sizes 1-4 and 8 with 4 KiB slots (so most messages are chunked),
 * and 4 with the default slot (single-chunk paths). */
static const shape shapes[] = {
    {1, SMALL_SLOT}, {2, SMALL_SLOT}, {3, SMALL_SLOT}, {4, SMALL_SLOT}, {4, 0}, {8, SMALL_SLOT},
};
#define N_SHAPES ((int)(sizeof shapes / sizeof shapes[0]))

static void run_on_shape(int i, rank_fn fn)
{
    run_spec sp = {.world_size = shapes[i].world, .slot_bytes = shapes[i].slot, .fn = fn};
    run_expect_ok(&sp);
}

#define WORLD_SCENARIO(fn_name, body)                                                              \
    static int fn_name(rank_ctx *cx)                                                               \
    {                                                                                              \
        group g;                                                                                   \
        world_group(cx, &g);                                                                       \
        return body;                                                                               \
    }

WORLD_SCENARIO(sc_all_reduce_exact, check_all_reduce_exact(cx, &g))
WORLD_SCENARIO(sc_all_reduce_same_bits, check_all_reduce_same_bits(cx, &g))
WORLD_SCENARIO(sc_all_gather, check_all_gather(cx, &g))
WORLD_SCENARIO(sc_all_gather_v, check_all_gather_v(cx, &g))
WORLD_SCENARIO(sc_all_to_all, check_all_to_all(cx, &g))
WORLD_SCENARIO(sc_all_to_all_v, check_all_to_all_v(cx, &g))
WORLD_SCENARIO(sc_sendrecv_blocking, check_sendrecv(cx, &g, 0))
WORLD_SCENARIO(sc_sendrecv_split, check_sendrecv(cx, &g, 1))
WORLD_SCENARIO(sc_ring_pass, check_ring_pass(cx, &g, 1, 0) || check_ring_pass(cx, &g, 5000, 0) ||
                                 check_ring_pass(cx, &g, 40000, 0) ||
                                 check_ring_pass(cx, &g, 2000, 1))
WORLD_SCENARIO(sc_broadcast, check_broadcast(cx, &g))
WORLD_SCENARIO(sc_barrier, check_barrier(cx, &g))

/* Random op sequence, the same on every rank (shared seed), with random
 * per-rank delays before each op so that ranks arrive in every order: a fast
 * rank starting the next op must not disturb a slow one still reading the
 * previous op's data out of the slots. */
static int sc_mixed_sequence(rank_ctx *cx)
{
    group g;
    world_group(cx, &g);
    test_rng seq = {.s = 77};
    for (int step = 0; step < 80; step++) {
        const uint64_t op = test_rng_next(&seq) % 8;
        const size_t bytes = (size_t)(test_rng_next(&seq) % 9000);
        const int root = (int)(test_rng_next(&seq) % (uint64_t)g.n);
        sleep_s((double)(test_rng_next(&cx->rng) % 400) * 1e-6);
        int bad = 0;
        switch (op) {
        case 0:
            bad = check_all_reduce_exact_one(cx, &g, bytes / 4);
            break;
        case 1:
            bad = check_all_gather_one(cx, &g, bytes);
            break;
        case 2:
            bad = check_all_to_all_one(cx, &g, bytes / (size_t)g.n);
            break;
        case 3:
            bad = check_broadcast_one(cx, &g, bytes, root);
            break;
        case 4:
            bad = check_sendrecv_one(cx, &g, (int)(bytes % N_SENDRECV_PATTERNS), (int)(bytes & 1));
            break;
        case 5:
            bad = check_all_gather_v_one(cx, &g, (int)(bytes % N_GATHERV_PATTERNS));
            break;
        case 6:
            bad = check_all_to_all_v_one(cx, &g, (int)(bytes % N_ALLTOALLV_PATTERNS));
            break;
        default:
            REQUIRE_OK(cx, "world", g.c->ops->barrier(g.c, diag));
        }
        if (bad)
            return FAILF(cx, "(mixed sequence step %d, op %d)", step, (int)op);
    }
    return 0;
}

/* Exchanges where every rank sends nothing, alternating with 1-byte ones:
 * an empty exchange must still keep a fast rank's next exchange from being
 * mistaken for the current one by a slow rank. */
static int sc_sendrecv_alternating_empty(rank_ctx *cx)
{
    group g;
    world_group(cx, &g);
    for (int it = 0; it < 300; it++)
        if (check_sendrecv_one(cx, &g, it % 2, it % 7 == 0))
            return FAILF(cx, "(alternating exchange %d)", it);
    return 0;
}

/* --------------------------------------------------- collectives tests */

START_TEST(all_reduce_sum_exact)
{
    run_on_shape(_i, sc_all_reduce_exact);
}
END_TEST

START_TEST(all_reduce_sum_same_bits_on_every_rank)
{
    run_on_shape(_i, sc_all_reduce_same_bits);
}
END_TEST

START_TEST(all_gather_even)
{
    run_on_shape(_i, sc_all_gather);
}
END_TEST

START_TEST(all_gather_v_uneven_with_zeros)
{
    run_on_shape(_i, sc_all_gather_v);
}
END_TEST

START_TEST(all_to_all_even)
{
    run_on_shape(_i, sc_all_to_all);
}
END_TEST

START_TEST(all_to_all_v_uneven_with_zeros)
{
    run_on_shape(_i, sc_all_to_all_v);
}
END_TEST

START_TEST(sendrecv_ring_blocking)
{
    run_on_shape(_i, sc_sendrecv_blocking);
}
END_TEST

START_TEST(sendrecv_ring_start_wait_around_local_work)
{
    run_on_shape(_i, sc_sendrecv_split);
}
END_TEST

START_TEST(sendrecv_ring_pass_double_buffered)
{
    run_on_shape(_i, sc_ring_pass);
}
END_TEST

START_TEST(sendrecv_alternating_empty_exchanges)
{
    run_on_shape(_i, sc_sendrecv_alternating_empty);
}
END_TEST

START_TEST(broadcast_from_every_root)
{
    run_on_shape(_i, sc_broadcast);
}
END_TEST

START_TEST(barrier_holds_until_all_arrive)
{
    run_on_shape(_i, sc_barrier);
}
END_TEST

START_TEST(mixed_op_sequence_with_skewed_arrival)
{
    run_on_shape(_i, sc_mixed_sequence);
}
END_TEST

/* ------------------------------------------------------------- groups */

/* Splits g by (color, key) and checks the result against the expected
 * membership (world ranks in group-rank order; n == 0: expect NULL). The
 * membership is also confirmed through the new group itself (all_gather of
 * world ranks), which shows its collectives are group-local. */
static int split_expect(rank_ctx *cx, const group *parent, int color, int key, const char *name,
                        int n, const int *members, int counter_id, group *out)
{
    memset(out, 0, sizeof *out);
    dit_comm *sub = (dit_comm *)(uintptr_t)0x1; /* must be overwritten, with NULL if color < 0 */
    REQUIRE_OK(cx, name, parent->c->ops->split(parent->c, color, key, &sub, diag));
    if (n == 0) {
        REQUIRE(cx, sub == NULL, "%s: split with color %d gave a group, want NULL", name, color);
        return 0;
    }
    REQUIRE(cx, sub != NULL && sub != (dit_comm *)(uintptr_t)0x1, "%s: split gave no group", name);
    out->c = sub;
    out->name = name;
    out->n = n;
    out->counter_id = counter_id;
    out->me = -1;
    for (int i = 0; i < n; i++) {
        out->members[i] = members[i];
        if (members[i] == cx->rank)
            out->me = i;
    }
    REQUIRE(cx, dit_comm_size(sub) == n && dit_comm_rank(sub) == out->me,
            "%s: group says rank %d of %d, want %d of %d", name, dit_comm_rank(sub),
            dit_comm_size(sub), out->me, n);
    int32_t w = cx->rank, got[MAX_RANKS];
    REQUIRE_OK(cx, name, sub->ops->all_gather(sub, &w, sizeof w, got, diag));
    for (int i = 0; i < n; i++)
        REQUIRE(cx, got[i] == members[i], "%s: group rank %d is world rank %d, want %d", name, i,
                (int)got[i], members[i]);
    return 0;
}

/* World 4 as the mesh lays it out: rank = ring_idx * U + ulysses_idx with
 * R = U = 2. Ulysses groups share ring_idx ({0,1}, {2,3}); ring groups share
 * ulysses_idx ({0,2}, {1,3}). Ops on both kinds interleave with world ops. */
static int sc_split_mesh_2d(rank_ctx *cx)
{
    enum { R = 2, U = 2 };
    group w, ug, rg;
    world_group(cx, &w);
    const int ring_idx = cx->rank / U, uly = cx->rank % U;
    int um[U], rm[R];
    for (int u = 0; u < U; u++)
        um[u] = ring_idx * U + u;
    for (int r = 0; r < R; r++)
        rm[r] = r * U + uly;
    if (split_expect(cx, &w, ring_idx, cx->rank, "ulysses", U, um, 1 + ring_idx, &ug))
        return 1;
    int bad = split_expect(cx, &w, uly, ring_idx, "ring", R, rm, 3 + uly, &rg);
    for (int rep = 0; !bad && rep < 2; rep++)
        bad = check_group_ops(cx, &ug) || check_group_ops(cx, &rg) ||
              check_all_reduce_exact_one(cx, &w, 3000);
    dit_comm_destroy(rg.c);
    dit_comm_destroy(ug.c);
    return bad;
}

/* World 8 = ring 2 x ulysses 2 x tp 2, rank = (ring * 2 + ulysses) * 2 + tp:
 * tp groups are contiguous pairs, ulysses groups share ring and tp, ring
 * groups share ulysses and tp. */
static int sc_split_mesh_3d(rank_ctx *cx)
{
    group w, tg, ug, rg;
    world_group(cx, &w);
    const int tp = cx->rank % 2, uly = (cx->rank / 2) % 2, ring = cx->rank / 4;
#define MESH_RANK(r_, u_, t_) (((r_)*2 + (u_)) * 2 + (t_))
    const int tm[2] = {MESH_RANK(ring, uly, 0), MESH_RANK(ring, uly, 1)};
    const int um[2] = {MESH_RANK(ring, 0, tp), MESH_RANK(ring, 1, tp)};
    const int rm[2] = {MESH_RANK(0, uly, tp), MESH_RANK(1, uly, tp)};
#undef MESH_RANK
    memset(&ug, 0, sizeof ug);
    memset(&rg, 0, sizeof rg);
    if (split_expect(cx, &w, ring * 2 + uly, tp, "tp", 2, tm, 1 + ring * 2 + uly, &tg))
        return 1;
    int bad = split_expect(cx, &w, ring * 2 + tp, uly, "ulysses", 2, um, 5 + ring * 2 + tp, &ug);
    if (!bad)
        bad = split_expect(cx, &w, uly * 2 + tp, ring, "ring", 2, rm, 9 + uly * 2 + tp, &rg);
    /* The order a transformer block would use them in: tp all_reduce, ulysses
     * all_to_all, ring exchange, then everything on every level. */
    if (!bad)
        bad = check_all_reduce_exact_one(cx, &tg, 4099) || check_all_to_all_one(cx, &ug, 6000) ||
              check_ring_pass(cx, &rg, 7000, 0) || check_group_ops(cx, &tg) ||
              check_group_ops(cx, &ug) || check_group_ops(cx, &rg) ||
              check_all_gather_one(cx, &w, 5000);
    dit_comm_destroy(rg.c);
    dit_comm_destroy(ug.c);
    dit_comm_destroy(tg.c);
    return bad;
}

/* The same 3-level mesh built by nested splits (world -> context-parallel
 * group of 4 sharing tp -> ulysses and ring within it) gives the same
 * groups; sub-groups are destroyed before the groups they came from. */
static int sc_split_nested(rank_ctx *cx)
{
    group w, cp, ug, rg;
    world_group(cx, &w);
    const int tp = cx->rank % 2, uly = (cx->rank / 2) % 2, ring = cx->rank / 4;
    const int cpm[4] = {0 + tp, 2 + tp, 4 + tp, 6 + tp};
    const int um[2] = {(ring * 2 + 0) * 2 + tp, (ring * 2 + 1) * 2 + tp};
    const int rm[2] = {(0 * 2 + uly) * 2 + tp, (1 * 2 + uly) * 2 + tp};
    memset(&ug, 0, sizeof ug);
    memset(&rg, 0, sizeof rg);
    if (split_expect(cx, &w, tp, cx->rank, "cp", 4, cpm, 1 + tp, &cp))
        return 1;
    /* In cp, group rank = ring * 2 + ulysses. */
    int bad = split_expect(cx, &cp, ring, uly, "cp/ulysses", 2, um, 3 + ring * 2 + tp, &ug);
    if (!bad)
        bad = split_expect(cx, &cp, uly, ring, "cp/ring", 2, rm, 7 + uly * 2 + tp, &rg);
    if (!bad)
        bad = check_group_ops(cx, &cp) || check_group_ops(cx, &ug) || check_group_ops(cx, &rg);
    dit_comm_destroy(rg.c);
    dit_comm_destroy(ug.c);
    dit_comm_destroy(cp.c);
    return bad;
}

/* Groups are independent: the ulysses group {0,1} runs more ops than {2,3}
 * before all meet again in ring groups and the world. */
static int sc_split_independent_progress(rank_ctx *cx)
{
    group w, ug, rg;
    world_group(cx, &w);
    const int ring_idx = cx->rank / 2, uly = cx->rank % 2;
    const int um[2] = {ring_idx * 2, ring_idx * 2 + 1}, rm[2] = {uly, 2 + uly};
    if (split_expect(cx, &w, ring_idx, cx->rank, "ulysses", 2, um, 1 + ring_idx, &ug))
        return 1;
    int bad = split_expect(cx, &w, uly, cx->rank, "ring", 2, rm, 3 + uly, &rg);
    const int extra = ring_idx == 0 ? 7 : 1;
    for (int i = 0; !bad && i < extra; i++)
        bad = check_all_to_all_one(cx, &ug, 3000 + 1000 * (size_t)i) ||
              check_all_reduce_exact_one(cx, &ug, 2000);
    if (!bad)
        bad = check_sendrecv_one(cx, &rg, 7, 1) || check_all_gather_one(cx, &w, 3333) ||
              check_barrier(cx, &w);
    dit_comm_destroy(rg.c);
    dit_comm_destroy(ug.c);
    return bad;
}

/* color < 0 takes part in the split and gets NULL; the others get a group;
 * the world stays usable. Then every rank passing a negative color. */
static int sc_split_negative_color(rank_ctx *cx)
{
    group w, eg, none;
    world_group(cx, &w);
    int em[MAX_RANKS], ne = 0;
    for (int r = 0; r < cx->size; r += 2)
        em[ne++] = r;
    const int even = cx->rank % 2 == 0;
    if (split_expect(cx, &w, even ? 7 : -1, cx->rank, "even", even ? ne : 0, em, 1, &eg))
        return 1;
    int bad = 0;
    if (even)
        bad =
            check_all_reduce_exact_one(cx, &eg, 3000) || check_broadcast_one(cx, &eg, 5000, ne - 1);
    if (!bad)
        bad = check_all_reduce_exact_one(cx, &w, 3000);
    if (!bad)
        bad = split_expect(cx, &w, -1 - cx->rank, 0, "none", 0, NULL, 0, &none);
    if (!bad)
        bad = check_all_gather_one(cx, &w, 100);
    dit_comm_destroy(eg.c);
    return bad;
}

/* Ranks are ordered by (key, rank): descending keys reverse the order,
 * equal keys keep rank order, and mixed keys interleave. */
static int sc_split_key_order(rank_ctx *cx)
{
    group w, g;
    world_group(cx, &w);
    const int n = cx->size;
    int rev[MAX_RANKS], same[MAX_RANKS], parity[MAX_RANKS], k = 0;
    for (int i = 0; i < n; i++) {
        rev[i] = n - 1 - i;
        same[i] = i;
    }
    for (int r = 0; r < n; r += 2)
        parity[k++] = r;
    for (int r = 1; r < n; r += 2)
        parity[k++] = r;
    if (split_expect(cx, &w, 0, 100 - cx->rank, "descending keys", n, rev, 1, &g))
        return 1;
    int bad = check_group_ops(cx, &g);
    dit_comm_destroy(g.c);
    if (bad || split_expect(cx, &w, 3, 5, "equal keys", n, same, 2, &g))
        return 1;
    bad = check_all_reduce_exact_one(cx, &g, 100);
    dit_comm_destroy(g.c);
    if (bad || split_expect(cx, &w, 1, cx->rank % 2, "keys rank%2", n, parity, 3, &g))
        return 1;
    bad = check_sendrecv_one(cx, &g, 5, 1) || check_all_to_all_one(cx, &g, 100);
    dit_comm_destroy(g.c);
    return bad;
}

/* Splitting and destroying many times in a row keeps working (40 rounds of
 * two groups: within the backend's table even if it does not reclaim). */
static int sc_split_repeatedly(rank_ctx *cx)
{
    group w, g;
    world_group(cx, &w);
    for (int it = 0; it < 40; it++) {
        const int color = (cx->rank + it) % 2;
        int m[MAX_RANKS], n = 0;
        for (int r = 0; r < cx->size; r++)
            if ((r + it) % 2 == color)
                m[n++] = r;
        if (split_expect(cx, &w, color, cx->rank, "re-split", n, m, 1, &g))
            return FAILF(cx, "(iteration %d)", it);
        int bad = check_all_reduce_exact_one(cx, &g, 1500);
        dit_comm_destroy(g.c);
        if (bad)
            return FAILF(cx, "(iteration %d)", it);
    }
    return 0;
}

/* World of 1: a split gives a group of 1 that works like the world. */
static int sc_split_world1(rank_ctx *cx)
{
    group w, g;
    world_group(cx, &w);
    const int m[1] = {0};
    if (split_expect(cx, &w, 5, 9, "self", 1, m, 1, &g))
        return 1;
    int bad = check_group_ops(cx, &g);
    dit_comm_destroy(g.c);
    return bad;
}

/* The 2 x 2 mesh of sc_split_mesh_2d, for the exchange tests below. */
static int split_2d(rank_ctx *cx, group *w, group *ug, group *rg)
{
    world_group(cx, w);
    const int ring_idx = cx->rank / 2, uly = cx->rank % 2;
    const int um[2] = {ring_idx * 2, ring_idx * 2 + 1}, rm[2] = {uly, 2 + uly};
    memset(rg, 0, sizeof *rg);
    if (split_expect(cx, w, ring_idx, cx->rank, "ulysses", 2, um, 1 + ring_idx, ug))
        return 1;
    return split_expect(cx, w, uly, cx->rank, "ring", 2, rm, 3 + uly, rg);
}

/* Ring rotation on g of `bytes` (+ 100 per world rank, so sizes differ). */
typedef struct open_exchange {
    uint8_t *send, *recv;
    size_t sb, rb;
    int dst, src;
    dit_comm_request req;
} open_exchange;

static int exchange_start(rank_ctx *cx, const group *g, size_t bytes, open_exchange *x)
{
    x->dst = (g->me + 1) % g->n;
    x->src = (g->me - 1 + g->n) % g->n;
    x->sb = bytes + 100 * (size_t)g->members[g->me];
    x->rb = bytes + 100 * (size_t)g->members[x->src];
    x->send = cx_alloc(cx, x->sb);
    x->recv = cx_alloc(cx, x->rb);
    fill_pat(x->send, x->sb, g->members[g->me], g->members[x->dst]);
    REQUIRE_OK(cx, g->name,
               g->c->ops->sendrecv_start(g->c, x->send, x->sb, x->dst, x->recv, x->rb, x->src,
                                         &x->req, diag));
    return 0;
}

static int exchange_finish(rank_ctx *cx, const group *g, open_exchange *x)
{
    REQUIRE_OK(cx, g->name, g->c->ops->sendrecv_wait(g->c, &x->req, diag));
    if (expect_pat(cx, g, "open exchange", x->recv, x->rb, g->members[x->src], g->members[g->me]))
        return 1;
    REQUIRE_GUARD(cx, g, "open exchange", x->recv, x->rb);
    return 0;
}

/* An exchange stays open while collectives run on its own group, on another
 * group and on the world (overlapping the ring exchange with Ulysses). */
static int sc_exchange_across_collectives(rank_ctx *cx)
{
    group w, ug, rg;
    open_exchange x;
    int bad = split_2d(cx, &w, &ug, &rg) || exchange_start(cx, &rg, 9000, &x) ||
              check_all_to_all_one(cx, &ug, 5000) || check_all_reduce_exact_one(cx, &w, 3000) ||
              check_all_gather_one(cx, &rg, 5000) || check_broadcast_one(cx, &ug, 6000, 1) ||
              exchange_finish(cx, &rg, &x);
    dit_comm_destroy(rg.c);
    dit_comm_destroy(ug.c);
    return bad;
}

/* One exchange open on each of two groups at once ("at most one exchange is
 * open per group" allows it). */
static int sc_exchange_two_groups(rank_ctx *cx)
{
    group w, ug, rg;
    open_exchange xr, xu;
    int bad = split_2d(cx, &w, &ug, &rg) || exchange_start(cx, &rg, 9000, &xr) ||
              exchange_start(cx, &ug, 7000, &xu) || exchange_finish(cx, &ug, &xu) ||
              exchange_finish(cx, &rg, &xr);
    dit_comm_destroy(rg.c);
    dit_comm_destroy(ug.c);
    return bad;
}

START_TEST(sendrecv_open_across_collectives)
{
    run_spec sp = {.world_size = 4, .slot_bytes = SMALL_SLOT, .fn = sc_exchange_across_collectives};
    run_expect_ok(&sp);
}
END_TEST

START_TEST(sendrecv_open_on_two_groups_at_once)
{
    run_spec sp = {.world_size = 4, .slot_bytes = SMALL_SLOT, .fn = sc_exchange_two_groups};
    run_expect_ok(&sp);
}
END_TEST

START_TEST(split_mesh_ring_ulysses_world4)
{
    run_spec sp = {.world_size = 4, .slot_bytes = SMALL_SLOT, .fn = sc_split_mesh_2d};
    run_expect_ok(&sp);
}
END_TEST

START_TEST(split_mesh_ring_ulysses_tp_world8)
{
    run_spec sp = {.world_size = 8, .slot_bytes = SMALL_SLOT, .fn = sc_split_mesh_3d};
    run_expect_ok(&sp);
}
END_TEST

START_TEST(split_nested_world8)
{
    run_spec sp = {.world_size = 8, .slot_bytes = SMALL_SLOT, .fn = sc_split_nested};
    run_expect_ok(&sp);
}
END_TEST

START_TEST(split_groups_progress_independently)
{
    run_spec sp = {.world_size = 4, .slot_bytes = SMALL_SLOT, .fn = sc_split_independent_progress};
    run_expect_ok(&sp);
}
END_TEST

START_TEST(split_negative_color_gives_null)
{
    run_spec sp = {.world_size = 4 + _i, .slot_bytes = SMALL_SLOT, .fn = sc_split_negative_color};
    run_expect_ok(&sp);
}
END_TEST

START_TEST(split_key_orders_ranks)
{
    run_spec sp = {.world_size = 4, .slot_bytes = SMALL_SLOT, .fn = sc_split_key_order};
    run_expect_ok(&sp);
}
END_TEST

START_TEST(split_and_destroy_repeatedly)
{
    run_spec sp = {.world_size = 4, .slot_bytes = SMALL_SLOT, .fn = sc_split_repeatedly};
    run_expect_ok(&sp);
}
END_TEST

START_TEST(split_world1)
{
    run_spec sp = {.world_size = 1, .slot_bytes = SMALL_SLOT, .fn = sc_split_world1};
    run_expect_ok(&sp);
}
END_TEST

/* ----------------------------------------------------------- failures */

/* Does msg name rank r ("rank 3", "rank=3", "peer 3", "ranks 1, 3")? Looks
 * for the number as a whole token after "rank"/"peer". */
static int names_rank(const char *msg, int r)
{
    char num[16];
    snprintf(num, sizeof num, "%d", r);
    const size_t nl = strlen(num);
    for (const char *p = msg; *p; p++) {
        if (strncasecmp(p, "rank", 4) != 0 && strncasecmp(p, "peer", 4) != 0)
            continue;
        /* Scan the next few characters for the number as a token. */
        for (const char *q = p + 4; *q && q < p + 24; q++) {
            if (strncmp(q, num, nl) == 0 && !(q[nl] >= '0' && q[nl] <= '9') &&
                !(q[-1] >= '0' && q[-1] <= '9'))
                return 1;
            if (*q == '.' || *q == ';' || *q == ':')
                break;
        }
    }
    return 0;
}

enum {
    OP_BARRIER,
    OP_ALL_REDUCE,
    OP_ALL_GATHER,
    OP_ALL_GATHER_V,
    OP_ALL_TO_ALL,
    OP_ALL_TO_ALL_V,
    OP_SENDRECV,
    OP_BROADCAST,
    OP_SPLIT,
    OP_COUNT
};

static const char *const op_names[OP_COUNT] = {
    "barrier",      "all_reduce_sum", "all_gather", "all_gather_v", "all_to_all",
    "all_to_all_v", "sendrecv",       "broadcast",  "split",
};

/* One op with 64 KiB messages (many chunks through 4 KiB slots); returns its
 * status with the message in *diag. */
static dit_status run_op(rank_ctx *cx, dit_comm *c, int op, int root, dit_diag *diag)
{
    const int n = dit_comm_size(c);
    const size_t bytes = 64 << 10;
    const int mark = cx->n_allocs;
    size_t counts[MAX_RANKS];
    for (int r = 0; r < n; r++)
        counts[r] = bytes;
    uint8_t *a = cx_alloc(cx, bytes * (size_t)n), *b = cx_alloc(cx, bytes * (size_t)n);
    dit_diag_clear(diag);
    dit_status st = DIT_ERR_INTERNAL;
    dit_comm *sub = NULL;
    switch (op) {
    case OP_BARRIER:
        st = c->ops->barrier(c, diag);
        break;
    case OP_ALL_REDUCE:
        memset(a, 0, bytes);
        st = c->ops->all_reduce_sum(c, a, bytes / sizeof(float), DIT_F32, diag);
        break;
    case OP_ALL_GATHER:
        st = c->ops->all_gather(c, a, bytes, b, diag);
        break;
    case OP_ALL_GATHER_V:
        st = c->ops->all_gather_v(c, a, b, counts, diag);
        break;
    case OP_ALL_TO_ALL:
        st = c->ops->all_to_all(c, a, bytes, b, diag);
        break;
    case OP_ALL_TO_ALL_V:
        st = c->ops->all_to_all_v(c, a, counts, b, counts, diag);
        break;
    case OP_SENDRECV:
        st = dit_comm_sendrecv(c, a, bytes, (dit_comm_rank(c) + 1) % n, b, bytes,
                               (dit_comm_rank(c) - 1 + n) % n, diag);
        break;
    case OP_BROADCAST:
        st = c->ops->broadcast(c, a, bytes, root, diag);
        break;
    case OP_SPLIT:
        st = c->ops->split(c, 0, 0, &sub, diag);
        dit_comm_destroy(sub);
        break;
    }
    cx_release(cx, mark);
    return st;
}

/* Checks a survivor's result: an error of the expected kind, naming
 * `culprit`, returned within max_s of t0. */
static int expect_peer_error(rank_ctx *cx, const char *what, dit_status st, const dit_diag *d,
                             double t0, double min_s, double max_s, int culprit, int allow_timeout)
{
    const double dt = now_s() - t0;
    REQUIRE(cx, st == DIT_ERR_PEER || (allow_timeout && st == DIT_ERR_TIMEOUT),
            "%s: got %s (%s) after %.2f s, want DIT_ERR_PEER%s", what, dit_status_name(st),
            dit_diag_msg(d), dt, allow_timeout ? " or DIT_ERR_TIMEOUT" : "");
    REQUIRE(cx, dt >= min_s && dt < max_s, "%s: returned %s after %.2f s, want %.1f..%.1f s", what,
            dit_status_name(st), dt, min_s, max_s);
    REQUIRE(cx, names_rank(d->msg, culprit), "%s: message does not name rank %d: \"%s\"", what,
            culprit, d->msg);
    return 0;
}

/* A rank exits after the opening barrier (after delay_s, so that the others
 * are already waiting in the op when it dies); the others must fail in the
 * op, naming it, in far less than the 20 s timeout. Ops in which a rank
 * may legitimately complete without the dead one (its exchange partners in
 * sendrecv are alive; broadcast data already staged) must then fail at the
 * next barrier. */
static int sc_dead_rank(rank_ctx *cx)
{
    const run_spec *sp = cx->spec;
    REQUIRE_OK(cx, "world", cx->world->ops->barrier(cx->world, diag));
    if (cx->rank == sp->victim) {
        if (sp->delay_s > 0)
            sleep_s(sp->delay_s);
        fflush(NULL);
        _exit(3);
    }
    const double t0 = now_s();
    dit_diag d;
    const int root = (sp->victim + 1) % cx->size;
    dit_status st = run_op(cx, cx->world, sp->op, root, &d);
    if (st == DIT_OK && (sp->op == OP_SENDRECV || sp->op == OP_BROADCAST)) {
        fprintf(stderr, "[rank %d] note: %s completed without dead rank %d; checking barrier\n",
                cx->rank, op_names[sp->op], sp->victim);
        dit_diag_clear(&d);
        st = cx->world->ops->barrier(cx->world, &d);
    }
    if (expect_peer_error(cx, op_names[sp->op], st, &d, t0, 0.0, 5.0, sp->victim, 1))
        return 1;
    fprintf(stderr, "[rank %d] %s after rank %d died: %s after %.3f s: %s\n", cx->rank,
            op_names[sp->op], sp->victim, dit_status_name(st), now_s() - t0, d.msg);
    return 0;
}

static void run_dead_rank(int world, int victim, int op, double delay_s)
{
    run_spec sp = {.world_size = world,
                   .slot_bytes = SMALL_SLOT,
                   .timeout_s = 20.0,
                   .deadline_s = 40.0,
                   .fn = sc_dead_rank,
                   .op = op,
                   .victim = victim,
                   .delay_s = delay_s};
    run_result res;
    run_ranks(&sp, &res);
    int want[MAX_RANKS] = {0};
    want[victim] = 3;
    expect_statuses(&sp, &res, want);
    ck_assert_msg(res.failed_rank == victim, "%s: failed_rank %d, want %d", op_names[op],
                  res.failed_rank, victim);
}

START_TEST(dead_rank_before_all_reduce)
{
    /* _i = 0: dies at once (others may not have entered the op yet);
     * _i = 1: dies while the others are asleep in it. */
    run_dead_rank(4, 2, OP_ALL_REDUCE, _i ? 0.3 : 0.0);
}
END_TEST

START_TEST(dead_rank_in_each_op)
{
    run_dead_rank(3, _i % 3, _i, 0.2);
}
END_TEST

/* The victim dies from a second thread while every rank is inside a long
 * chunked all_reduce, so the others are caught between chunks. */
static void *die_soon(void *arg)
{
    shared_scratch *sh = arg;
    sleep_s(0.15);
    atomic_store(&sh->death_time, now_s());
    fflush(NULL);
    _exit(3);
}

static int sc_dead_mid_op(rank_ctx *cx)
{
    const size_t count = (size_t)1 << 20; /* 4 MiB: ~1000 chunks of 4 KiB */
    float *buf = cx_alloc(cx, count * sizeof(float));
    memset(buf, 0, count * sizeof(float));
    REQUIRE_OK(cx, "world", cx->world->ops->barrier(cx->world, diag));
    if (cx->rank == cx->spec->victim) {
        pthread_t th;
        REQUIRE(cx, pthread_create(&th, NULL, die_soon, cx->shared) == 0, "pthread_create");
    }
    for (int it = 0; it < 100000; it++) {
        dit_diag d;
        dit_diag_clear(&d);
        dit_status st = cx->world->ops->all_reduce_sum(cx->world, buf, count, DIT_F32, &d);
        if (st == DIT_OK)
            continue;
        const double died = atomic_load(&cx->shared->death_time);
        REQUIRE(cx, died > 0, "all_reduce failed before the victim died: %s: %s",
                dit_status_name(st), d.msg);
        if (expect_peer_error(cx, "all_reduce_sum (victim died mid-op)", st, &d, died, 0.0, 5.0,
                              cx->spec->victim, 1))
            return 1;
        fprintf(stderr, "[rank %d] iteration %d: %s %.3f s after the death: %s\n", cx->rank, it,
                dit_status_name(st), now_s() - died, d.msg);
        return 0;
    }
    return FAILF(cx, "all_reduce kept succeeding after rank %d died", cx->spec->victim);
}

START_TEST(dead_rank_mid_chunked_op)
{
    run_spec sp = {.world_size = 3,
                   .slot_bytes = SMALL_SLOT,
                   .timeout_s = 20.0,
                   .deadline_s = 40.0,
                   .fn = sc_dead_mid_op,
                   .victim = 1};
    run_result res;
    run_ranks(&sp, &res);
    const int want[3] = {0, 3, 0};
    expect_statuses(&sp, &res, want);
    ck_assert_int_eq(res.failed_rank, 1);
}
END_TEST

/* The victim sleeps 4 s past a 1 s timeout before the op: the others time
 * out in about 1 s naming it; when it wakes, its own op fails promptly too
 * (the group is broken, or it times out waiting for the others). */
static const int stall_ops[] = {OP_ALL_REDUCE, OP_BARRIER, OP_SENDRECV, OP_BROADCAST};

static int sc_stalled_rank(rank_ctx *cx)
{
    const run_spec *sp = cx->spec;
    REQUIRE_OK(cx, "world", cx->world->ops->barrier(cx->world, diag));
    dit_diag d;
    if (cx->rank == sp->victim) {
        sleep_s(4.0);
        const double t0 = now_s();
        dit_status st = run_op(cx, cx->world, sp->op, sp->victim, &d);
        const double dt = now_s() - t0;
        REQUIRE(cx, st != DIT_OK && dt < sp->timeout_s + 1.5,
                "late rank's %s after its peers gave up: %s after %.2f s", op_names[sp->op],
                dit_status_name(st), dt);
        fprintf(stderr, "[rank %d] late rank's own %s: %s after %.3f s: %s\n", cx->rank,
                op_names[sp->op], dit_status_name(st), dt, d.msg);
        return 0;
    }
    const double t0 = now_s();
    dit_status st = run_op(cx, cx->world, sp->op, sp->victim, &d);
    if (expect_peer_error(cx, op_names[sp->op], st, &d, t0, 0.8 * sp->timeout_s, 3.0, sp->victim,
                          1))
        return 1;
    fprintf(stderr, "[rank %d] %s with rank %d stalled: %s after %.3f s: %s\n", cx->rank,
            op_names[sp->op], sp->victim, dit_status_name(st), now_s() - t0, d.msg);
    return 0;
}

START_TEST(stalled_rank_times_out)
{
    run_spec sp = {.world_size = 3,
                   .slot_bytes = SMALL_SLOT,
                   .timeout_s = 1.0,
                   .deadline_s = 30.0,
                   .fn = sc_stalled_rank,
                   .op = stall_ops[_i],
                   .victim = 1};
    run_result res;
    run_ranks(&sp, &res);
    expect_statuses(&sp, &res, NULL);
    /* Not asserted: the contract leaves open whether a timeout is recorded,
     * and the late rank, waking after its peers left, may record one of them. */
    fprintf(stderr, "stalled %s: failed_rank %d\n", op_names[sp.op], res.failed_rank);
}
END_TEST

/* The victim calls ops->abort while the others wait in an all_reduce, then
 * its own next op fails fast too, and it exits normally. */
static int sc_abort(rank_ctx *cx)
{
    const run_spec *sp = cx->spec;
    REQUIRE_OK(cx, "world", cx->world->ops->barrier(cx->world, diag));
    dit_diag d;
    if (cx->rank == sp->victim) {
        sleep_s(sp->delay_s);
        cx->world->ops->abort(cx->world);
        const double t0 = now_s();
        dit_status st = run_op(cx, cx->world, OP_ALL_REDUCE, 0, &d);
        REQUIRE(cx, st != DIT_OK && now_s() - t0 < 1.0,
                "all_reduce after this rank's own abort: %s after %.2f s", dit_status_name(st),
                now_s() - t0);
        /* Ops with nothing to move (no barrier to meet) fail as well. */
        float none[1] = {0};
        size_t zeros[DIT_SHM_MAX_RANKS] = {0};
        st = cx->world->ops->all_reduce_sum(cx->world, none, 0, DIT_F32, &d);
        REQUIRE(cx, st == DIT_ERR_PEER, "empty all_reduce after the abort: %s",
                dit_status_name(st));
        st = cx->world->ops->broadcast(cx->world, none, 0, 0, &d);
        REQUIRE(cx, st == DIT_ERR_PEER, "empty broadcast after the abort: %s", dit_status_name(st));
        st = cx->world->ops->all_gather_v(cx->world, none, none, zeros, &d);
        REQUIRE(cx, st == DIT_ERR_PEER, "empty all_gather_v after the abort: %s",
                dit_status_name(st));
        return 0;
    }
    const double t0 = now_s();
    dit_status st = run_op(cx, cx->world, OP_ALL_REDUCE, 0, &d);
    if (expect_peer_error(cx, "all_reduce_sum (peer aborted)", st, &d, t0, 0.0, 5.0, sp->victim, 0))
        return 1;
    /* Later ops fail fast as well. */
    const double t1 = now_s();
    st = run_op(cx, cx->world, OP_BARRIER, 0, &d);
    REQUIRE(cx, st != DIT_OK && now_s() - t1 < 1.0, "barrier after the abort: %s after %.2f s",
            dit_status_name(st), now_s() - t1);
    return 0;
}

START_TEST(abort_fails_peers_fast)
{
    run_spec sp = {.world_size = 4,
                   .slot_bytes = SMALL_SLOT,
                   .timeout_s = 20.0,
                   .deadline_s = 40.0,
                   .fn = sc_abort,
                   .victim = 2,
                   .delay_s = 0.3};
    run_result res;
    run_ranks(&sp, &res);
    expect_statuses(&sp, &res, NULL);
    ck_assert_int_eq(res.failed_rank, 2);
}
END_TEST

/* The launcher aborts the segment naming a hung rank while the others wait
 * in an all_reduce; they fail fast, and so does the hung rank when it wakes. */
static int sc_launcher_abort(rank_ctx *cx)
{
    const run_spec *sp = cx->spec;
    REQUIRE_OK(cx, "world", cx->world->ops->barrier(cx->world, diag));
    dit_diag d;
    if (cx->rank == sp->victim) {
        sleep_s(2.0);
        const double t0 = now_s();
        dit_status st = run_op(cx, cx->world, OP_ALL_REDUCE, 0, &d);
        REQUIRE(cx, st == DIT_ERR_PEER && now_s() - t0 < 1.0,
                "hung rank's all_reduce after the launcher's abort: %s after %.2f s: %s",
                dit_status_name(st), now_s() - t0, d.msg);
        return 0;
    }
    const double t0 = now_s();
    dit_status st = run_op(cx, cx->world, OP_ALL_REDUCE, 0, &d);
    if (expect_peer_error(cx, "all_reduce_sum (launcher abort)", st, &d, t0, 0.0, 5.0, sp->victim,
                          0))
        return 1;
    fprintf(stderr, "[rank %d] launcher abort: %s after %.3f s: %s\n", cx->rank,
            dit_status_name(st), now_s() - t0, d.msg);
    return 0;
}

START_TEST(launcher_abort_fails_ranks_fast)
{
    run_spec sp = {.world_size = 4,
                   .slot_bytes = SMALL_SLOT,
                   .timeout_s = 20.0,
                   .deadline_s = 40.0,
                   .fn = sc_launcher_abort,
                   .victim = 1,
                   .launcher_abort = 1,
                   .launcher_abort_s = 0.5};
    run_result res;
    run_ranks(&sp, &res);
    expect_statuses(&sp, &res, NULL);
    ck_assert_int_eq(res.failed_rank, 1);
}
END_TEST

/* A rank of a sub-group dies: its group partner fails naming it, and the
 * world's next barrier fails for every survivor. */
static int sc_dead_in_subgroup(rank_ctx *cx)
{
    group w, ug;
    world_group(cx, &w);
    const int ring_idx = cx->rank / 2;
    const int um[2] = {ring_idx * 2, ring_idx * 2 + 1};
    if (split_expect(cx, &w, ring_idx, cx->rank, "ulysses", 2, um, 1 + ring_idx, &ug))
        return 1;
    int bad = 0;
    REQUIRE_OK(cx, "world", w.c->ops->barrier(w.c, diag));
    if (cx->rank == 3) {
        sleep_s(0.2);
        fflush(NULL);
        _exit(3);
    }
    dit_diag d;
    double t0 = now_s();
    dit_status st = run_op(cx, ug.c, OP_ALL_TO_ALL, 0, &d);
    if (cx->rank == 2) {
        /* Either numbering identifies the peer: world rank 3 or group rank 1;
         * the world rank is what an operator can act on. */
        if (!names_rank(d.msg, 3))
            fprintf(stderr, "[rank 2] note: message names the group rank, not world rank 3: %s\n",
                    d.msg);
        bad = st == DIT_OK || (!names_rank(d.msg, 3) && !names_rank(d.msg, 1));
        if (bad)
            (void)FAILF(cx, "all_to_all in {2,3} after rank 3 died: %s: %s", dit_status_name(st),
                        d.msg);
    } else {
        fprintf(stderr, "[rank %d] all_to_all in healthy group {0,1}: %s\n", cx->rank,
                dit_status_name(st));
    }
    if (!bad) {
        t0 = now_s();
        st = run_op(cx, w.c, OP_BARRIER, 0, &d);
        bad = expect_peer_error(cx, "world barrier after rank 3 died", st, &d, t0, 0.0, 5.0, 3, 1);
    }
    dit_comm_destroy(ug.c);
    return bad;
}

START_TEST(dead_rank_in_subgroup)
{
    run_spec sp = {.world_size = 4,
                   .slot_bytes = SMALL_SLOT,
                   .timeout_s = 20.0,
                   .deadline_s = 40.0,
                   .fn = sc_dead_in_subgroup};
    run_result res;
    run_ranks(&sp, &res);
    const int want[4] = {0, 0, 0, 3};
    expect_statuses(&sp, &res, want);
    ck_assert_int_eq(res.failed_rank, 3);
}
END_TEST

/* ------------------------------------------------------ join, segment */

/* Rank 1 never joins: rank 0's join times out after about the timeout. */
static int sc_join_alone(rank_ctx *cx)
{
    if (cx->rank != 0)
        return 0;
    dit_comm *c = NULL;
    dit_diag d;
    dit_diag_clear(&d);
    const double t0 = now_s();
    dit_status st = dit_shm_comm_join(cx->cfg, 0, &c, &d);
    const double dt = now_s() - t0;
    if (st == DIT_OK)
        dit_comm_destroy(c);
    REQUIRE(cx, st == DIT_ERR_TIMEOUT, "join without rank 1: %s (%s), want DIT_ERR_TIMEOUT",
            dit_status_name(st), d.msg);
    REQUIRE(cx, dt >= 0.8 && dt < 3.0, "join gave up after %.2f s with a 1 s timeout", dt);
    if (!names_rank(d.msg, 1))
        fprintf(stderr, "[rank 0] note: join timeout message does not name rank 1: %s\n", d.msg);
    return 0;
}

START_TEST(join_times_out_without_all_ranks)
{
    run_spec sp = {
        .world_size = 2, .timeout_s = 1.0, .deadline_s = 20.0, .fn = sc_join_alone, .no_join = 1};
    run_result res;
    run_ranks(&sp, &res);
    expect_statuses(&sp, &res, NULL);
}
END_TEST

START_TEST(segment_rejects_bad_arguments)
{
    dit_shm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    dit_shm_make_name(&cfg);
    cfg.world_size = 2;
    cfg.timeout_s = 1.0;
    dit_diag d;
    dit_diag_clear(&d);
    dit_shm_segment *seg = NULL, *dup = NULL, *bad = NULL;
    ck_assert_int_eq(dit_shm_segment_create(&cfg, &seg, &d), DIT_OK);
    ck_assert_int_eq(dit_shm_segment_failed_rank(seg), -1);

    /* The name exists: a second create fails and leaves the first intact. */
    dit_diag_clear(&d);
    ck_assert_int_ne(dit_shm_segment_create(&cfg, &dup, &d), DIT_OK);
    ck_assert_msg(d.msg[0] != '\0', "no message for an existing segment name");

    /* Ranks outside 0..world_size-1 are refused at once, without waiting. */
    const int bad_ranks[] = {-1, 2, 100};
    for (size_t i = 0; i < sizeof bad_ranks / sizeof bad_ranks[0]; i++) {
        dit_comm *c = NULL;
        dit_diag_clear(&d);
        const double t0 = now_s();
        dit_status st = dit_shm_comm_join(&cfg, bad_ranks[i], &c, &d);
        ck_assert_msg(st != DIT_OK, "join as rank %d of 2 succeeded", bad_ranks[i]);
        ck_assert_msg(now_s() - t0 < 0.5, "join as rank %d took %.2f s", bad_ranks[i],
                      now_s() - t0);
    }
    dit_shm_segment_destroy(seg);
    ck_assert_int_eq(count_shm_entries(cfg.name), 0);

    /* World sizes outside 1..DIT_SHM_MAX_RANKS. */
    const int bad_sizes[] = {0, -1, DIT_SHM_MAX_RANKS + 1};
    for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++) {
        dit_shm_make_name(&cfg);
        cfg.world_size = bad_sizes[i];
        dit_diag_clear(&d);
        ck_assert_msg(dit_shm_segment_create(&cfg, &bad, &d) != DIT_OK,
                      "segment with world size %d created", bad_sizes[i]);
        ck_assert_int_eq(count_shm_entries(cfg.name), 0);
    }

    /* Joining a segment that does not exist fails rather than waiting. */
    dit_shm_make_name(&cfg);
    cfg.world_size = 2;
    dit_comm *c = NULL;
    dit_diag_clear(&d);
    ck_assert_int_ne(dit_shm_comm_join(&cfg, 0, &c, &d), DIT_OK);

    dit_shm_segment_destroy(NULL);
}
END_TEST

START_TEST(make_name_is_unique)
{
    enum { N = 200 };
    static char names[N][64];
    for (int i = 0; i < N; i++) {
        dit_shm_config cfg;
        memset(&cfg, 0, sizeof cfg);
        dit_shm_make_name(&cfg);
        ck_assert_msg(strncmp(cfg.name, "/dit-", 5) == 0 && strchr(cfg.name + 1, '/') == NULL,
                      "bad name %s", cfg.name);
        memcpy(names[i], cfg.name, sizeof cfg.name);
        for (int j = 0; j < i; j++)
            ck_assert_msg(strcmp(names[i], names[j]) != 0, "calls %d and %d both gave %s", j, i,
                          names[i]);
    }
}
END_TEST

/* Messages larger than the default (8 MiB) slot, on the default slot size:
 * the chunked paths with big chunks. */
static int sc_large_default_slot(rank_ctx *cx)
{
    group g;
    world_group(cx, &g);
    return check_all_gather_one(cx, &g, (size_t)9 << 20) ||
           check_all_reduce_exact_one(cx, &g, (size_t)3 << 20) ||
           check_all_to_all_one(cx, &g, (size_t)5 << 20);
}

START_TEST(large_messages_default_slot)
{
    run_spec sp = {.world_size = 2, .fn = sc_large_default_slot};
    run_expect_ok(&sp);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("comm");

    TCase *tc = tcase_create("collectives");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, all_reduce_sum_exact, 0, N_SHAPES);
    tcase_add_loop_test(tc, all_reduce_sum_same_bits_on_every_rank, 0, N_SHAPES);
    tcase_add_loop_test(tc, all_gather_even, 0, N_SHAPES);
    tcase_add_loop_test(tc, all_gather_v_uneven_with_zeros, 0, N_SHAPES);
    tcase_add_loop_test(tc, all_to_all_even, 0, N_SHAPES);
    tcase_add_loop_test(tc, all_to_all_v_uneven_with_zeros, 0, N_SHAPES);
    tcase_add_loop_test(tc, sendrecv_ring_blocking, 0, N_SHAPES);
    tcase_add_loop_test(tc, sendrecv_ring_start_wait_around_local_work, 0, N_SHAPES);
    tcase_add_loop_test(tc, sendrecv_ring_pass_double_buffered, 0, N_SHAPES);
    tcase_add_loop_test(tc, sendrecv_alternating_empty_exchanges, 0, N_SHAPES);
    tcase_add_loop_test(tc, broadcast_from_every_root, 0, N_SHAPES);
    tcase_add_loop_test(tc, barrier_holds_until_all_arrive, 0, N_SHAPES);
    tcase_add_loop_test(tc, mixed_op_sequence_with_skewed_arrival, 0, N_SHAPES);
    tcase_add_test(tc, large_messages_default_slot);
    suite_add_tcase(s, tc);

    TCase *groups = tcase_create("groups");
    tcase_set_timeout(groups, 120);
    tcase_add_test(groups, split_mesh_ring_ulysses_world4);
    tcase_add_test(groups, split_mesh_ring_ulysses_tp_world8);
    tcase_add_test(groups, split_nested_world8);
    tcase_add_test(groups, split_groups_progress_independently);
    tcase_add_loop_test(groups, split_negative_color_gives_null, 0, 2);
    tcase_add_test(groups, split_key_orders_ranks);
    tcase_add_test(groups, split_and_destroy_repeatedly);
    tcase_add_test(groups, split_world1);
    tcase_add_test(groups, sendrecv_open_across_collectives);
    tcase_add_test(groups, sendrecv_open_on_two_groups_at_once);
    suite_add_tcase(s, groups);

    TCase *fail = tcase_create("failures");
    tcase_set_timeout(fail, 60);
    tcase_add_loop_test(fail, dead_rank_before_all_reduce, 0, 2);
    tcase_add_loop_test(fail, dead_rank_in_each_op, 0, OP_COUNT);
    tcase_add_test(fail, dead_rank_mid_chunked_op);
    tcase_add_test(fail, dead_rank_in_subgroup);
    tcase_add_loop_test(fail, stalled_rank_times_out, 0,
                        (int)(sizeof stall_ops / sizeof stall_ops[0]));
    tcase_add_test(fail, abort_fails_peers_fast);
    tcase_add_test(fail, launcher_abort_fails_ranks_fast);
    tcase_add_test(fail, join_times_out_without_all_ranks);
    tcase_add_test(fail, segment_rejects_bad_arguments);
    tcase_add_test(fail, make_name_is_unique);
    suite_add_tcase(s, fail);

    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
