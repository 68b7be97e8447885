/* ditctl bench: N Generate calls with at most C in flight, one thread per
 * slot sharing one dit_client (the client is thread-safe; all calls travel on
 * one HTTP/2 connection, as a real front end's would).
 *
 * It answers two questions: how fast is the service as a whole (latency
 * percentiles, throughput), and what does the daemon add on top of the
 * worker's compute. The Result's timings say how long the worker computed
 * (tokenize + text encoders + denoising + VAE + encoding); whatever the
 * client waited beyond that is the daemon's overhead: queueing, IPC, the
 * gRPC stream, scheduling.
 *
 * With -c 1,4,16 the same workload (N requests each) runs at every level in
 * turn, on the same connection, and a table with one row per level follows
 * the per-level reports. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ditctl.h"

static const ctl_help bench_help = {
    "usage: ditctl bench -n N -c C[,C...] --prompt TEXT [request options] [--quiet]\n"
    "                    [connection options]\n"
    "\n"
    "Sends N Generate requests, at most C in flight at once (C threads sharing one\n"
    "connection), each with the same request options. -c takes one level or a\n"
    "comma-separated list (-c 1,4,16: at most 16 levels, each from 1 to 1024); the\n"
    "same N requests then run at each level in turn. Per level it prints:\n"
    "  - latency (client-observed, call start to final status) of the OK requests:\n"
    "    mean, p50, p90, p99, min, max in ms; throughput in requests/s;\n"
    "  - the count of requests per final status (OK, RESOURCE_EXHAUSTED, ...);\n"
    "  - the mean server-side timings from Result.timings (queue, tokenize,\n"
    "    text_encode, denoise, vae, encode, total);\n"
    "  - worker compute = tokenize + text_encode + denoise + vae + encode (+ the\n"
    "    other members' own stages for a batched request, batch_others), and the\n"
    "    daemon overhead = latency - worker compute (mean and p50), also without the\n"
    "    queue wait and outside the server (latency - server total).\n"
    "Then a table, one row per level: concurrency, requests sent, ok, failed,\n"
    "req/s (OK requests per second of wall time), latency p50/p90/p99/max of the OK\n"
    "requests, and the daemon's overhead per request (mean and p50) =\n"
    "latency - Result.timings.queue_ms - worker compute: what the daemon adds\n"
    "besides the time a request waited in the queue behind others and the\n"
    "workers' compute (the gRPC stream, the IPC to the workers, scheduling, the\n"
    "image's trip back). All times in ms; percentiles are nearest-rank (the\n"
    "ceil(p/100 * n)-th smallest of n values).\n"
    "The images are received and dropped. With --request-id ID the requests are\n"
    "named ID-0, ID-1, ... (ID-cC-0, ... with several levels); with --seed every\n"
    "request uses that seed.\n",
    "Exit status: 0 when every request at every level ended OK; 1 when any failed;\n"
    "2 on bad command-line arguments; 130 when interrupted (143 for SIGTERM). The\n"
    "report is printed either way; an interrupt skips the levels not yet run.\n"};

#define BENCH_MAX_LEVELS 16
#define BENCH_MAX_CONCURRENCY 1024

typedef struct bench_args {
    ctl_request r;
    long n;
    long levels[BENCH_MAX_LEVELS]; /* -c, in the order given */
    int n_levels;
    bool quiet;
} bench_args;

#define BARGS(t) ((bench_args *)((ctl_target *)(t))->cmd)

static int set_requests(void *t, const char *v, char *err, size_t cap)
{
    if (!ctl_parse_long(v, 1, 10000000, &BARGS(t)->n)) {
        snprintf(err, cap, "wants a number of requests from 1 to 10000000, not '%s'", v);
        return -1;
    }
    return 0;
}

/* -c: "C" or "C1,C2,...". Each item is plain decimal digits (no sign, no
 * space) from 1 to BENCH_MAX_CONCURRENCY; an empty item, a trailing comma or
 * more than BENCH_MAX_LEVELS items are refused with what is wrong. */
static int set_concurrency(void *t, const char *v, char *err, size_t cap)
{
    bench_args *a = BARGS(t);
    long levels[BENCH_MAX_LEVELS];
    int n = 0;
    const char *p = v;
    for (;;) {
        const char *comma = strchr(p, ',');
        const size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len == 0) {
            snprintf(err, cap,
                     "wants concurrency levels from 1 to %d, one or a comma-separated list "
                     "(1,4,16); '%.64s' has an empty item",
                     BENCH_MAX_CONCURRENCY, v);
            return -1;
        }
        long c = 0;
        bool digits = len <= 9;
        for (size_t i = 0; digits && i < len; i++)
            digits = p[i] >= '0' && p[i] <= '9';
        for (size_t i = 0; digits && i < len; i++)
            c = c * 10 + (p[i] - '0');
        if (!digits || c < 1 || c > BENCH_MAX_CONCURRENCY) {
            snprintf(err, cap,
                     "wants concurrency levels from 1 to %d, one or a comma-separated list "
                     "(1,4,16), not '%.*s'",
                     BENCH_MAX_CONCURRENCY, (int)(len < 64 ? len : 64), p);
            return -1;
        }
        if (n == BENCH_MAX_LEVELS) {
            snprintf(err, cap, "takes at most %d concurrency levels", BENCH_MAX_LEVELS);
            return -1;
        }
        levels[n++] = c;
        if (!comma)
            break;
        p = comma + 1;
    }
    memcpy(a->levels, levels, (size_t)n * sizeof *levels);
    a->n_levels = n;
    return 0;
}

static int set_quiet(void *t, const char *v, char *err, size_t cap)
{
    (void)err;
    (void)cap;
    BARGS(t)->quiet = v[0] == '1';
    return 0;
}

/* The defaults are set through the setters, like any value. */
static const dit_option bench_opts[] = {
    {"requests", 'n', DIT_OPT_CUSTOM, "10", "N", "requests to send", NULL, 0, 0, 0, set_requests,
     false},
    {"concurrency", 'c', DIT_OPT_CUSTOM, "1", "C[,C...]",
     "most requests in flight at once, 1 to 1024; a comma-separated list runs each level in turn",
     NULL, 0, 0, 0, set_concurrency, false},
    {"quiet", 'q', DIT_OPT_FLAG, NULL, NULL,
     "no progress line and no warnings about the request on stderr", NULL, 0, 0, 0, set_quiet,
     false},
};

typedef struct rec {
    int code; /* -1: not sent (interrupted) */
    double latency_ms;
    bool has_timings;
    Ditserve__V1__Timings t; /* plain values copied out of the Result */
} rec;

/* One level's run: its threads share it, the counters are atomic, the rest
 * is written under mu or before the threads start. */
typedef struct bench {
    dit_client *client;
    const bench_args *a;
    long c;            /* this level's concurrency */
    char id_base[200]; /* request ids are id_base-i; empty: none */
    rec *recs;
    atomic_int next;
    atomic_int done;
    atomic_int threads_left;
    pthread_mutex_t mu;
    double end_s;                          /* when the last request ended (under mu) */
    char example[DIT_RPC_CODE_COUNT][200]; /* the first details per failing status */
} bench;

typedef struct summary {
    double mean, p50, p90, p99, min, max;
} summary;

/* One row of the closing table. */
typedef struct level_row {
    long c;
    size_t sent, ok, failed, timed;
    double wall_s;
    summary lat;  /* of the OK requests */
    summary over; /* latency - queue - worker compute, of the OK requests with timings */
} level_row;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *bench_thread(void *arg)
{
    bench *b = arg;
    dit_call_opts co = {.cancel = &ctl_interrupted};
    for (;;) {
        if (atomic_load(&ctl_interrupted))
            break;
        int i = atomic_fetch_add(&b->next, 1);
        if (i >= b->a->n)
            break;
        /* A shallow copy: the strings and wrappers are shared read-only. */
        Ditserve__V1__GenerateRequest req = b->a->r.req;
        char rid[256];
        if (b->id_base[0]) {
            snprintf(rid, sizeof rid, "%s-%d", b->id_base, i);
            req.request_id = rid;
        }
        dit_gen_output out;
        dit_rpc_status st;
        dit_rpc_code code = dit_client_generate(b->client, &req, NULL, &co, &out, &st);
        rec *r = &b->recs[i];
        r->code = code;
        r->latency_ms = out.latency_ms;
        if (out.result && out.result->timings) {
            r->has_timings = true;
            r->t = *out.result->timings;
        }
        if (code != DIT_RPC_OK) {
            pthread_mutex_lock(&b->mu);
            if (!b->example[code][0])
                snprintf(b->example[code], sizeof b->example[code], "%.199s",
                         st.details[0] ? st.details : "(no details)");
            pthread_mutex_unlock(&b->mu);
        }
        dit_gen_output_free(&out);
        /* The wall time ends with the last request, not when the main
         * thread next looks. */
        pthread_mutex_lock(&b->mu);
        double t = now_s();
        if (t > b->end_s)
            b->end_s = t;
        pthread_mutex_unlock(&b->mu);
        atomic_fetch_add(&b->done, 1);
    }
    atomic_fetch_sub(&b->threads_left, 1);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of sorted v[0..n): the ceil(p/100 * n)-th
 * smallest value (1-based), so p99 of 10 values is the largest. */
static double pct(const double *v, size_t n, double p)
{
    size_t k = (size_t)ceil(p / 100.0 * (double)n);
    return v[k ? k - 1 : 0];
}

/* Sorts v in place. */
static summary summarize(double *v, size_t n)
{
    summary s = {0};
    if (n == 0)
        return s;
    qsort(v, n, sizeof *v, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    s.mean = sum / (double)n;
    s.p50 = pct(v, n, 50);
    s.p90 = pct(v, n, 90);
    s.p99 = pct(v, n, 99);
    s.min = v[0];
    s.max = v[n - 1];
    return s;
}

static double compute_ms(const Ditserve__V1__Timings *t)
{
    /* A batched request also waited for the other members' own stages. */
    return t->tokenize_ms + t->text_encode_ms + t->denoise_ms + t->vae_ms + t->encode_ms +
           t->batch_others_ms;
}

/* Prints one level's report and fills its row of the closing table. */
static void report(const bench *b, double wall_s, level_row *row)
{
    const long n = b->a->n;
    size_t sent = 0, ok = 0, timed = 0;
    int counts[DIT_RPC_CODE_COUNT] = {0};
    for (long i = 0; i < n; i++) {
        if (b->recs[i].code < 0)
            continue;
        sent++;
        counts[b->recs[i].code]++;
        if (b->recs[i].code == DIT_RPC_OK) {
            ok++;
            if (b->recs[i].has_timings)
                timed++;
        }
    }
    row->c = b->c;
    row->sent = sent;
    row->ok = ok;
    row->failed = sent - ok;
    row->wall_s = wall_s;
    printf("requests: %zu sent of %ld, concurrency %ld, wall %.3f s%s\n", sent, n, b->c, wall_s,
           atomic_load(&ctl_interrupted) ? " (interrupted)" : "");
    printf("throughput: %.3f requests/s (%.3f OK/s)\n", wall_s > 0 ? (double)sent / wall_s : 0,
           wall_s > 0 ? (double)ok / wall_s : 0);
    printf("status:");
    bool first = true;
    for (int c = 0; c < DIT_RPC_CODE_COUNT; c++) {
        if (counts[c]) {
            printf("%s %s %d", first ? "" : ",", dit_rpc_code_name(c), counts[c]);
            first = false;
        }
    }
    printf("%s\n", first ? " none" : "");
    for (int c = 1; c < DIT_RPC_CODE_COUNT; c++)
        if (counts[c])
            printf("  %s, e.g.: %s\n", dit_rpc_code_name(c), b->example[c]);
    if (ok == 0) {
        printf("latency: no request ended OK\n");
        return;
    }

    double *lat = malloc(ok * sizeof *lat);
    double *comp = malloc((timed ? timed : 1) * sizeof *comp);
    double *over = malloc((timed ? timed : 1) * sizeof *over);
    double *over_nq = malloc((timed ? timed : 1) * sizeof *over_nq);
    double *outside = malloc((timed ? timed : 1) * sizeof *outside);
    if (!lat || !comp || !over || !over_nq || !outside) {
        fprintf(stderr, "ditctl: out of memory\n");
        goto cleanup;
    }
    Ditserve__V1__Timings sum = DITSERVE__V1__TIMINGS__INIT;
    size_t k = 0, j = 0;
    for (long i = 0; i < n; i++) {
        const rec *r = &b->recs[i];
        if (r->code != DIT_RPC_OK)
            continue;
        lat[k++] = r->latency_ms;
        if (!r->has_timings)
            continue;
        const Ditserve__V1__Timings *t = &r->t;
        sum.queue_ms += t->queue_ms;
        sum.tokenize_ms += t->tokenize_ms;
        sum.text_encode_ms += t->text_encode_ms;
        sum.denoise_ms += t->denoise_ms;
        sum.vae_ms += t->vae_ms;
        sum.encode_ms += t->encode_ms;
        sum.total_ms += t->total_ms;
        comp[j] = compute_ms(t);
        over[j] = r->latency_ms - comp[j];
        over_nq[j] = over[j] - t->queue_ms;
        outside[j] = r->latency_ms - t->total_ms;
        j++;
    }
    summary ls = summarize(lat, ok);
    row->lat = ls;
    printf("latency ms (OK requests): mean %.1f  p50 %.1f  p90 %.1f  p99 %.1f  min %.1f  "
           "max %.1f\n",
           ls.mean, ls.p50, ls.p90, ls.p99, ls.min, ls.max);
    if (timed == 0) {
        printf("server timings: none reported\n");
        goto cleanup;
    }
    const double dn = (double)timed;
    printf("server ms (mean of %zu): queue %.1f  tokenize %.1f  text_encode %.1f  denoise %.1f  "
           "vae %.1f  encode %.1f  total %.1f\n",
           timed, sum.queue_ms / dn, sum.tokenize_ms / dn, sum.text_encode_ms / dn,
           sum.denoise_ms / dn, sum.vae_ms / dn, sum.encode_ms / dn, sum.total_ms / dn);
    summary cs = summarize(comp, timed), os = summarize(over, timed),
            qs = summarize(over_nq, timed), xs = summarize(outside, timed);
    row->timed = timed;
    row->over = qs;
    printf("worker compute ms (tokenize+text_encode+denoise+vae+encode+batch_others): mean %.1f  "
           "p50 %.1f\n",
           cs.mean, cs.p50);
    printf("daemon overhead ms (latency - worker compute): mean %.1f  p50 %.1f\n", os.mean, os.p50);
    printf("  without the queue wait (latency - compute - queue): mean %.1f  p50 %.1f\n", qs.mean,
           qs.p50);
    printf("  outside the server (latency - server total): mean %.1f  p50 %.1f\n", xs.mean, xs.p50);
cleanup:
    free(lat);
    free(comp);
    free(over);
    free(over_nq);
    free(outside);
}

/* The closing table: one row per level that ran. "-" where no request ended
 * OK (latency) or none reported timings (overhead). */
static void print_table(const level_row *rows, int n_rows)
{
    printf("\nper concurrency level (ms; latency of the OK requests, nearest-rank percentiles; "
           "overhead = latency - queue - worker compute):\n");
    printf("%11s %8s %6s %6s %9s %8s %8s %8s %8s %9s %9s\n", "concurrency", "requests", "ok",
           "failed", "req/s", "p50", "p90", "p99", "max", "ovh_mean", "ovh_p50");
    for (int i = 0; i < n_rows; i++) {
        const level_row *r = &rows[i];
        printf("%11ld %8zu %6zu %6zu %9.2f", r->c, r->sent, r->ok, r->failed,
               r->wall_s > 0 ? (double)r->ok / r->wall_s : 0.0);
        if (r->ok)
            printf(" %8.1f %8.1f %8.1f %8.1f", r->lat.p50, r->lat.p90, r->lat.p99, r->lat.max);
        else
            printf(" %8s %8s %8s %8s", "-", "-", "-", "-");
        if (r->timed)
            printf(" %9.1f %9.1f\n", r->over.mean, r->over.p50);
        else
            printf(" %9s %9s\n", "-", "-");
    }
}

/* Runs the workload once at concurrency c on the open client, prints its
 * report and fills row. Returns CTL_EXIT_OK when every request ended OK. */
static int run_level(dit_client *client, const bench_args *a, long c, level_row *row)
{
    int rc = CTL_EXIT_FAIL;
    bench b;
    memset(&b, 0, sizeof b);
    b.client = client;
    b.a = a;
    b.c = c;
    const char *base_id = a->r.req.request_id;
    if (base_id && base_id[0]) {
        if (a->n_levels > 1)
            snprintf(b.id_base, sizeof b.id_base, "%.180s-c%ld", base_id, c);
        else
            snprintf(b.id_base, sizeof b.id_base, "%s", base_id);
    }
    pthread_mutex_init(&b.mu, NULL);
    const long nthreads = c < a->n ? c : a->n;
    pthread_t *th = calloc((size_t)nthreads, sizeof *th);
    b.recs = calloc((size_t)a->n, sizeof *b.recs);
    if (!th || !b.recs) {
        fprintf(stderr, "ditctl: out of memory\n");
        goto cleanup;
    }
    for (long i = 0; i < a->n; i++)
        b.recs[i].code = -1;

    const bool show = !a->quiet && isatty(STDERR_FILENO);
    const double t0 = now_s();
    b.end_s = t0;
    long started = 0;
    atomic_store(&b.threads_left, (int)nthreads);
    for (; started < nthreads; started++) {
        if (pthread_create(&th[started], NULL, bench_thread, &b) != 0) {
            atomic_fetch_sub(&b.threads_left, (int)(nthreads - started));
            fprintf(stderr, "ditctl: could start only %ld threads\n", started);
            break;
        }
    }
    while (show && atomic_load(&b.threads_left) > 0) {
        fprintf(stderr, "\r\033[Kbench -c %ld: %d/%ld done, %.1f s", c, atomic_load(&b.done), a->n,
                now_s() - t0);
        fflush(stderr);
        usleep(200 * 1000);
    }
    for (long i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    const double wall = b.end_s - t0;
    if (show)
        fputs("\r\033[K", stderr);
    report(&b, wall, row);
    rc = CTL_EXIT_OK;
    for (long i = 0; i < a->n; i++)
        if (b.recs[i].code != DIT_RPC_OK)
            rc = CTL_EXIT_FAIL;
cleanup:
    pthread_mutex_destroy(&b.mu);
    free(b.recs);
    free(th);
    return rc;
}

int ctl_bench(int argc, char **argv, ctl_common *common)
{
    bench_args a;
    memset(&a, 0, sizeof a);
    ctl_request_init(&a.r);
    int rc = ctl_parse(argc, argv, "bench", &bench_help, bench_opts,
                       sizeof bench_opts / sizeof *bench_opts, &a, common, &a.r);
    if (rc)
        return rc == CTL_HELP_SHOWN ? 0 : rc;

    dit_client *client = NULL;
    level_row rows[BENCH_MAX_LEVELS];
    memset(rows, 0, sizeof rows);
    int n_rows = 0;
    if (!a.quiet)
        ctl_request_warn(&a.r);
    if ((rc = ctl_open(common, 0, &client)))
        goto cleanup;
    /* The channel connects on its first call (TCP, HTTP/2, TLS): one
     * health check first, outside every level, so that the first level's
     * first request does not pay for it and the levels compare. Its answer
     * does not matter (a refusal shows in the requests). */
    {
        const dit_call_opts warm = {.timeout_s = 10, .cancel = &ctl_interrupted};
        dit_health hs;
        dit_rpc_status st;
        dit_client_health(client, "", &warm, &hs, &st);
    }

    rc = CTL_EXIT_OK;
    for (int l = 0; l < a.n_levels; l++) {
        if (atomic_load(&ctl_interrupted)) {
            rc = CTL_EXIT_FAIL;
            break;
        }
        if (a.n_levels > 1)
            printf("%s== concurrency %ld ==\n", l ? "\n" : "", a.levels[l]);
        if (run_level(client, &a, a.levels[l], &rows[n_rows++]) != CTL_EXIT_OK)
            rc = CTL_EXIT_FAIL;
    }
    print_table(rows, n_rows);
    if (n_rows < a.n_levels)
        printf("(interrupted: %d of %d levels not run)\n", a.n_levels - n_rows, a.n_levels);
cleanup:
    dit_client_close(client);
    return rc;
}
