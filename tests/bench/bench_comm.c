/* Bandwidth of the shared-memory comm backend, in the style of nccl-tests.
 *
 *   bench_comm [--ranks N (2)] [--min-bytes 1K] [--max-bytes 64M] [--iters 20]
 *              [--warmup 5] [--slot-bytes 8M] [--timeout 60]
 *
 * Forks N rank processes on one segment. For each op (all_reduce_sum f32,
 * all_gather, all_to_all, sendrecv ring, broadcast from rank 0) and each size
 * doubling from --min-bytes to --max-bytes: warm-up runs, a barrier, then
 * --iters back-to-back runs timed on every rank; the reported time is the
 * largest per-rank average. Sizes take K/M/G suffixes (powers of 1024).
 *
 * Columns follow nccl-tests: "size" is the bytes of the op's buffer as
 * nccl-tests counts them (all_gather: the whole output; all_to_all: the
 * whole per-rank send buffer), "count" the f32 elements in it,
 * algbw = size / time, busbw = algbw times the op's factor (all_reduce
 * 2(n-1)/n; all_gather and all_to_all (n-1)/n; broadcast and sendrecv 1),
 * which makes the numbers comparable with the link bandwidth whatever n is.
 * "#wrong" counts elements that differed from the expected result in one
 * checked run per size (outside the timed runs). */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm/comm.h"
#include "comm/shm/comm_shm.h"

enum { OP_ALL_REDUCE, OP_ALL_GATHER, OP_ALL_TO_ALL, OP_SENDRECV, OP_BROADCAST, OP_COUNT };

static const char *const op_names[OP_COUNT] = {
    "all_reduce", "all_gather", "all_to_all", "sendrecv", "broadcast",
};

typedef struct bench_opts {
    int ranks;
    size_t min_bytes, max_bytes, slot_bytes;
    long iters, warmup;
    double timeout_s;
} bench_opts;

/* One rank's view: its comm and two buffers of max_bytes. */
typedef struct bench_rank {
    const bench_opts *o;
    dit_comm *c;
    int rank, n;
    unsigned char *a, *b;
} bench_rank;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* "64M" -> 64 << 20; 0 on a malformed value. */
static size_t parse_size(const char *s)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s)
        return 0;
    switch (*end) {
    case 'k':
    case 'K':
        v <<= 10;
        end++;
        break;
    case 'm':
    case 'M':
        v <<= 20;
        end++;
        break;
    case 'g':
    case 'G':
        v <<= 30;
        end++;
        break;
    default:
        break;
    }
    if (*end == 'B' || *end == 'b')
        end++;
    return *end ? 0 : (size_t)v;
}

static double bus_factor(int op, int n)
{
    switch (op) {
    case OP_ALL_REDUCE:
        return 2.0 * (n - 1) / n;
    case OP_ALL_GATHER:
    case OP_ALL_TO_ALL:
        return (double)(n - 1) / n;
    default:
        return 1.0;
    }
}

/* The bytes each rank hands to the op for a nominal size (what nccl-tests
 * calls sendcount), rounded down to whole f32 elements; the nominal size
 * becomes per-rank bytes times the op's multiplier. */
static size_t per_rank_bytes(int op, size_t size, int n)
{
    if (op == OP_ALL_GATHER || op == OP_ALL_TO_ALL)
        return size / (size_t)n / 4 * 4;
    return size / 4 * 4;
}

static size_t nominal_bytes(int op, size_t per_rank, int n)
{
    return (op == OP_ALL_GATHER || op == OP_ALL_TO_ALL) ? per_rank * (size_t)n : per_rank;
}

static dit_status run_op(bench_rank *br, int op, size_t per, dit_diag *diag)
{
    dit_comm *c = br->c;
    const int n = br->n;
    switch (op) {
    case OP_ALL_REDUCE:
        return c->ops->all_reduce_sum(c, br->a, per / 4, DIT_F32, diag);
    case OP_ALL_GATHER:
        return c->ops->all_gather(c, br->a, per, br->b, diag);
    case OP_ALL_TO_ALL:
        return c->ops->all_to_all(c, br->a, per, br->b, diag);
    case OP_SENDRECV:
        return dit_comm_sendrecv(c, br->a, per, (br->rank + 1) % n, br->b, per,
                                 (br->rank - 1 + n) % n, diag);
    default:
        return c->ops->broadcast(c, br->a, per, 0, diag);
    }
}

/* Value element i of rank r starts with in the checked run: small integers,
 * so all_reduce sums are exact. */
static float init_val(int r, size_t i)
{
    return (float)((i * 3 + (size_t)r * 7) % 31);
}

/* One run on known data; returns the number of wrong f32 elements. */
static long checked_run(bench_rank *br, int op, size_t per, dit_diag *diag, dit_status *st)
{
    const int n = br->n, r = br->rank;
    float *a = (float *)br->a, *b = (float *)br->b;
    const size_t ne = per / 4;
    /* all_to_all sends n blocks of `per` bytes: fill the whole send buffer. */
    const size_t fill = op == OP_ALL_TO_ALL ? ne * (size_t)n : ne;
    for (size_t i = 0; i < fill; i++)
        a[i] = init_val(r, i);
    *st = run_op(br, op, per, diag);
    if (*st != DIT_OK)
        return -1;
    long wrong = 0;
    switch (op) {
    case OP_ALL_REDUCE:
        for (size_t i = 0; i < ne; i++) {
            float want = 0;
            for (int k = 0; k < n; k++)
                want += init_val(k, i);
            wrong += a[i] != want;
        }
        break;
    case OP_ALL_GATHER:
        for (int k = 0; k < n; k++)
            for (size_t i = 0; i < ne; i++)
                wrong += b[(size_t)k * ne + i] != init_val(k, i);
        break;
    case OP_ALL_TO_ALL:
        /* Block k of the output is block r of rank k's input. */
        for (int k = 0; k < n; k++)
            for (size_t i = 0; i < ne; i++)
                wrong += b[(size_t)k * ne + i] != init_val(k, (size_t)r * ne + i);
        break;
    case OP_SENDRECV:
        for (size_t i = 0; i < ne; i++)
            wrong += b[i] != init_val((r - 1 + n) % n, i);
        break;
    default:
        for (size_t i = 0; i < ne; i++)
            wrong += a[i] != init_val(0, i);
        break;
    }
    return wrong;
}

/* Every rank runs this; rank 0 prints. Returns 0 on success. */
static int bench_rank_main(bench_rank *br)
{
    const bench_opts *o = br->o;
    const int n = br->n;
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_status st = DIT_OK;
    if (br->rank == 0) {
        printf("# bench_comm: shm backend, %d ranks, slot %zu B%s, iters %ld, warmup %ld, "
               "f32\n",
               n, o->slot_bytes ? o->slot_bytes : DIT_SHM_DEFAULT_SLOT_BYTES,
               o->slot_bytes ? "" : " (default)", o->iters, o->warmup);
        printf("# time: max over ranks of the average of %ld back-to-back runs\n#\n", o->iters);
        printf("# %-10s %12s %12s %11s %11s %11s %7s\n", "op", "size(B)", "count", "time(us)",
               "algbw(GB/s)", "busbw(GB/s)", "#wrong");
        fflush(stdout);
    }
    for (int op = 0; op < OP_COUNT; op++) {
        double bus_sum = 0;
        int bus_n = 0;
        for (size_t size = o->min_bytes; size <= o->max_bytes; size *= 2) {
            const size_t per = per_rank_bytes(op, size, n);
            const size_t nominal = nominal_bytes(op, per, n);
            if (per == 0)
                continue;
            long wrong = checked_run(br, op, per, &diag, &st);
            if (st != DIT_OK)
                goto fail;
            for (long i = 0; i < o->warmup; i++)
                if ((st = run_op(br, op, per, &diag)) != DIT_OK)
                    goto fail;
            if ((st = br->c->ops->barrier(br->c, &diag)) != DIT_OK)
                goto fail;
            const double t0 = now_s();
            for (long i = 0; i < o->iters; i++)
                if ((st = run_op(br, op, per, &diag)) != DIT_OK)
                    goto fail;
            double mine[2] = {(now_s() - t0) / (double)o->iters, (double)wrong};
            double all[2 * DIT_SHM_MAX_RANKS];
            if ((st = br->c->ops->all_gather(br->c, mine, sizeof mine, all, &diag)) != DIT_OK)
                goto fail;
            if (br->rank == 0) {
                double t = 0, w = 0;
                for (int k = 0; k < n; k++) {
                    t = all[2 * k] > t ? all[2 * k] : t;
                    w += all[2 * k + 1];
                }
                const double algbw = (double)nominal / t / 1e9;
                const double busbw = algbw * bus_factor(op, n);
                bus_sum += busbw;
                bus_n++;
                printf("  %-10s %12zu %12zu %11.2f %11.3f %11.3f %7.0f\n", op_names[op], nominal,
                       nominal / 4, t * 1e6, algbw, busbw, w);
                fflush(stdout);
            }
        }
        if (br->rank == 0 && bus_n)
            printf("# %s: average busbw %.3f GB/s\n", op_names[op], bus_sum / bus_n);
    }
    return 0;
fail:
    fprintf(stderr, "bench_comm: rank %d: %s: %s\n", br->rank, dit_status_name(st),
            dit_diag_msg(&diag));
    return 1;
}

static int child(const bench_opts *o, const dit_shm_config *cfg, int rank)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    bench_rank br = {.o = o, .rank = rank, .n = o->ranks};
    dit_status st = dit_shm_comm_join(cfg, rank, &br.c, &diag);
    if (st != DIT_OK) {
        fprintf(stderr, "bench_comm: rank %d: join: %s\n", rank, dit_diag_msg(&diag));
        return 1;
    }
    /* all_to_all sends max_bytes from a and receives max_bytes into b; the
     * other ops use at most that. Touch the pages now so that page faults
     * do not land in the first timed runs. */
    br.a = malloc(o->max_bytes);
    br.b = malloc(o->max_bytes);
    int rc = 1;
    if (!br.a || !br.b) {
        fprintf(stderr, "bench_comm: rank %d: out of memory\n", rank);
        /* Tell the others rather than leave them waiting for the timeout. */
        br.c->ops->abort(br.c);
    } else {
        memset(br.a, 0, o->max_bytes);
        memset(br.b, 0, o->max_bytes);
        rc = bench_rank_main(&br);
    }
    free(br.a);
    free(br.b);
    dit_comm_destroy(br.c);
    return rc;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: bench_comm [--ranks N] [--min-bytes SIZE] [--max-bytes SIZE] "
               "[--iters N] [--warmup N] [--slot-bytes SIZE] [--timeout S]\n");
}

int main(int argc, char **argv)
{
    bench_opts o = {.ranks = 2,
                    .min_bytes = 1 << 10,
                    .max_bytes = (size_t)64 << 20,
                    .slot_bytes = 0,
                    .iters = 20,
                    .warmup = 5,
                    .timeout_s = 60};
    static const struct option opts[] = {
        {"ranks", required_argument, NULL, 'n'},
        {"min-bytes", required_argument, NULL, 'b'},
        {"max-bytes", required_argument, NULL, 'e'},
        {"iters", required_argument, NULL, 'i'},
        {"warmup", required_argument, NULL, 'w'},
        {"slot-bytes", required_argument, NULL, 's'},
        {"timeout", required_argument, NULL, 't'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'n':
            o.ranks = atoi(optarg);
            break;
        case 'b':
            o.min_bytes = parse_size(optarg);
            break;
        case 'e':
            o.max_bytes = parse_size(optarg);
            break;
        case 'i':
            o.iters = atol(optarg);
            break;
        case 'w':
            o.warmup = atol(optarg);
            break;
        case 's':
            o.slot_bytes = parse_size(optarg);
            if (o.slot_bytes == 0) {
                fprintf(stderr, "bench_comm: bad --slot-bytes %s\n", optarg);
                return 2;
            }
            break;
        case 't':
            o.timeout_s = atof(optarg);
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc || o.ranks < 1 || o.ranks > DIT_SHM_MAX_RANKS || o.min_bytes == 0 ||
        o.max_bytes < o.min_bytes || o.iters < 1 || o.warmup < 0 || o.timeout_s <= 0) {
        usage(stderr);
        return 2;
    }

    dit_shm_config cfg;
    memset(&cfg, 0, sizeof cfg);
    dit_shm_make_name(&cfg);
    cfg.world_size = o.ranks;
    cfg.slot_bytes = o.slot_bytes;
    cfg.timeout_s = o.timeout_s;
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_shm_segment *seg = NULL;
    if (dit_shm_segment_create(&cfg, &seg, &diag) != DIT_OK) {
        fprintf(stderr, "bench_comm: %s\n", dit_diag_msg(&diag));
        return 1;
    }
    pid_t pids[DIT_SHM_MAX_RANKS];
    int started = 0, rc = 0;
    fflush(NULL);
    for (int r = 0; r < o.ranks; r++) {
        pid_t pid = fork();
        if (pid == 0) {
            int crc = child(&o, &cfg, r);
            fflush(NULL);
            _exit(crc);
        }
        if (pid < 0) {
            fprintf(stderr, "bench_comm: fork: %s\n", strerror(errno));
            dit_shm_segment_abort(seg, r);
            rc = 1;
            break;
        }
        pids[started++] = pid;
    }
    /* Like a launcher: when a rank dies, abort the segment so the others
     * stop at once instead of detecting it themselves. */
    for (int left = started; left > 0; left--) {
        int ws;
        pid_t pid = wait(&ws);
        if (pid < 0)
            break;
        if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
            int r = 0;
            while (r < started && pids[r] != pid)
                r++;
            if (WIFSIGNALED(ws))
                fprintf(stderr, "bench_comm: rank %d killed by signal %d\n", r, WTERMSIG(ws));
            dit_shm_segment_abort(seg, r);
            rc = 1;
        }
    }
    dit_shm_segment_destroy(seg);
    return rc;
}
