/* Forward-pass benchmark on random weights: ms per forward and GFLOP/s.
 *
 *   bench_flux_forward [--heads 8] [--head-dim 128] [--double 4] [--single 8]
 *                      [--img-tokens 1024] [--txt-tokens 128] [--batch 1]
 *                      [--threads N] [--warmup 1] [--iters 5] [--backend cpu|cuda]
 *                      [--flux-dev] [--graph both|on|off] [--flop-per-step F]
 *                      [--summary FILE] [--cuda-path legacy|fast|both]
 *                      [--cuda-attn v1|v2|cudnn|both|all]
 *
 * Defaults are the mid-size config that tests/bench/bench_diffusers_forward.py
 * times in PyTorch, so the two print comparable lines.
 *
 * --flux-dev: FLUX.1-dev dimensions (19 + 38 blocks, 24 x 128 heads, 4096
 * image + 512 text tokens). --graph: time eager passes, CUDA-graph replays,
 * or both (cuda backend; graph passes need two warm-up passes: eager, then
 * capture). --flop-per-step: the FLOP count TFLOP/s is computed from
 * (default: dit_flux_forward_flops). --summary: append "key: value" lines
 * (ms per step, TFLOP/s, memory) to FILE.
 *
 * On the cuda backend it also reports, per cuda path (DIT_CUDA_PATH; with
 * --cuda-path both, legacy then fast, keys prefixed "legacy_" / "fast_";
 * the unprefixed keys are those of the path the backend started with):
 *  - device time per kind of op for one double and one single block (the
 *    second of each, so that nothing before the blocks is counted), from
 *    CUDA events around every op: GEMMs, attention, elementwise, the bf16
 *    casts of GEMM inputs, the span from first start to last end, and the
 *    host's time to issue the block's ops (keys double_block_*_ms,
 *    single_block_*_ms);
 *  - GEMM calls of one eager forward and how many ran without their fused
 *    epilogue or on the CUDA-core fallback kernel (gemm_*);
 *  - graph-vs-eager agreement of the output (graph_vs_eager_max_abs and the
 *    number of values that differ in any bit) and NaN/Inf counts of the
 *    eager and graph outputs (nan_count_eager, nan_count_graph).
 *
 * --cuda-attn (DIT_CUDA_ATTN): the attention kernel of the fast path's bf16
 * q/k/v, v1 (64 queries a block), v2 (pipelined, 128 queries) or cudnn
 * (cuDNN's SDPA); with both, each fast-path measurement is repeated on v2
 * with keys prefixed "fast_attn_v2_", with all on v2 and then on cudnn
 * ("fast_attn_cudnn_"); the legacy path's f32 q/k/v always run v1. A single
 * kernel prefixes nothing new; every set of keys has a cuda_attn key
 * naming the kernel it ran. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <stdbool.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/backend.h"
#ifdef DIT_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif
#include "backend/arena.h"
#include "models/flux/flux.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* What one cuda path (or the one path of another backend) measured. */
typedef struct bench_result {
    bool have_eager, have_graph, graph_fallback;
    double eager_med, eager_min, graph_med, graph_min;
    bool have_prof;
    double prof[2][6]; /* [double, single][gemm, attention, elementwise, cast, span, host] */
    bool have_stats;
    unsigned long long gemm_calls, gemm_unfused, gemm_fallback, fb_shapes, unf_shapes;
    unsigned long long attn_calls[4]; /* v1, v2, cudnn, cudnn's fallbacks to v1 */
    bool have_agree;
    double agree_max_abs;
    size_t agree_differ;
    long long nan_eager, nan_graph;
} bench_result;

typedef struct bench_ctx {
    dit_backend *be;
    dit_flux *m;
    dit_arena *arena;
    const dit_flux_inputs *in;
    const dit_tensor *out;
    dit_diag *diag;
    double flop;
    long warmup, iters;
    double *times;
    bool want_graph, want_eager;
    FILE *sum;
    size_t n_out;
    bench_result r;
} bench_ctx;

static int run_once(bench_ctx *b)
{
    dit_backend *be = b->be;
    if (dit_flux_forward(b->m, b->arena, b->in, b->out, b->diag) != DIT_OK ||
        be->ops->sync(be) != DIT_OK) {
        if (be->ops->last_error && b->diag->status == DIT_OK)
            dit_diag_set(b->diag, DIT_ERR_DEVICE, "%s", be->ops->last_error(be));
        return -1;
    }
    dit_arena_reset(b->arena);
    return 0;
}

/* Host copy of the output (caller frees), NULL on failure. */
static float *fetch_out(bench_ctx *b)
{
    float *h = malloc((b->n_out ? b->n_out : 1) * sizeof *h);
    if (!h)
        return NULL;
    dit_tensor ht = dit_tensor_3d(h, DIT_F32, b->out->ne[0], b->out->ne[1], b->out->ne[2]);
    if (b->be->ops->download(b->be, &ht, b->out) != DIT_OK) {
        free(h);
        return NULL;
    }
    return h;
}

static long long count_nonfinite(const float *p, size_t n)
{
    long long k = 0;
    for (size_t i = 0; i < n; i++)
        k += !isfinite(p[i]);
    return k;
}

#ifdef DIT_HAVE_CUDA
/* Profiles the second double and the second single block (the first of
 * each when there is only one; then the ops before it count too). */
typedef struct prof_hook {
    bench_ctx *b;
    int d_end, s_end; /* block indices whose end closes an interval */
    double t_host;
    int failed;
} prof_hook;

static void prof_close(prof_hook *h, int which)
{
    double host = now_ms() - h->t_host;
    dit_cuda_profile p;
    if (dit_cuda_backend_profile_take(h->b->be, &p) != DIT_OK) {
        h->failed = 1;
        return;
    }
    double *o = h->b->r.prof[which];
    o[0] = p.gemm_ms;
    o[1] = p.attention_ms;
    o[2] = p.elementwise_ms;
    o[3] = p.cast_ms;
    o[4] = p.span_ms;
    o[5] = host;
    if (p.overflow)
        h->failed = 1;
}

static void prof_open(prof_hook *h)
{
    dit_cuda_profile p;
    if (dit_cuda_backend_profile_take(h->b->be, &p) != DIT_OK)
        h->failed = 1;
    h->t_host = now_ms();
}

static dit_status prof_block_done(void *ctx, int index, dit_diag *diag)
{
    (void)diag;
    prof_hook *h = ctx;
    if (index == h->d_end)
        prof_close(h, 0);
    if (index == h->s_end)
        prof_close(h, 1);
    if (index == h->d_end - 1 || index == h->s_end - 1)
        prof_open(h);
    return DIT_OK;
}

static int profile_blocks(bench_ctx *b)
{
    const dit_flux_config *c = dit_flux_config_of(b->m);
    if (c->num_layers < 1 || c->num_single_layers < 1)
        return 0;
    prof_hook h = {.b = b,
                   .d_end = c->num_layers >= 2 ? 1 : 0,
                   .s_end = c->num_layers + (c->num_single_layers >= 2 ? 1 : 0)};
    if (dit_cuda_backend_profile_start(b->be, 4096) != DIT_OK)
        return -1;
    dit_flux_hooks hooks = {.ctx = &h, .block_done = prof_block_done};
    dit_flux_set_hooks(b->m, &hooks);
    prof_open(&h); /* intervals that start with the forward */
    const int rc = run_once(b);
    dit_flux_set_hooks(b->m, NULL);
    dit_cuda_backend_profile_stop(b->be);
    if (rc != 0 || h.failed)
        return -1;
    b->r.have_prof = true;
    const char *names[2] = {"double", "single"};
    for (int w = 0; w < 2; w++) {
        const double *o = b->r.prof[w];
        printf("%s block (one, eager, profiled): gemm %.3f ms, attention %.3f ms, elementwise "
               "%.3f ms, cast %.3f ms; device span %.3f ms, host issue %.3f ms\n",
               names[w], o[0], o[1], o[2], o[3], o[4], o[5]);
    }
    return 0;
}
#endif

/* Everything measured for the backend's current path. */
static int measure(bench_ctx *b)
{
    dit_backend *be = b->be;
    memset(&b->r, 0, sizeof b->r);
    float *out_eager = NULL, *out_graph = NULL;
    int rc = -1;
    for (int mode = 0; mode < 2; mode++) {
        const bool graph = mode == 1;
        if ((graph && !b->want_graph) || (!graph && !b->want_eager))
            continue;
        dit_flux_set_graphs(b->m, graph);
        /* Graph replay starts at the third pass: eager, capture, replay. */
        const long wu = graph && b->warmup < 2 ? 2 : b->warmup;
        for (long i = 0; i < wu + b->iters; i++) {
            double t1 = now_ms();
            if (run_once(b) != 0)
                goto done;
            double dt = now_ms() - t1;
            if (i >= wu)
                b->times[i - wu] = dt;
        }
        const char *label = graph ? "graph" : "eager";
        if (graph && !dit_flux_graph_captured(b->m)) {
            printf("graph: no graph was captured (backend %s has no graph support or capture "
                   "failed); the numbers below are eager\n",
                   be->ops->name);
            label = "graph_fallback_eager";
            b->r.graph_fallback = true;
        }
        qsort(b->times, (size_t)b->iters, sizeof *b->times, cmp_double);
        const double med = b->times[b->iters / 2];
        printf("%s forward: median %.2f ms, min %.2f ms, %.1f TFLOP/s (%.2f TFLOP per step), "
               "backend %s\n",
               label, med, b->times[0], b->flop / (med / 1e3) / 1e12, b->flop / 1e12,
               be->ops->name);
        if (graph) {
            b->r.have_graph = true;
            b->r.graph_med = med;
            b->r.graph_min = b->times[0];
            if (!(out_graph = fetch_out(b)))
                goto done;
        } else {
            b->r.have_eager = true;
            b->r.eager_med = med;
            b->r.eager_min = b->times[0];
            if (!(out_eager = fetch_out(b)))
                goto done;
        }
    }
    dit_flux_set_graphs(b->m, false);
    if (out_eager)
        b->r.nan_eager = count_nonfinite(out_eager, b->n_out);
    if (out_graph)
        b->r.nan_graph = count_nonfinite(out_graph, b->n_out);
    if (out_eager && out_graph) {
        b->r.have_agree = true;
        for (size_t i = 0; i < b->n_out; i++) {
            if (memcmp(&out_eager[i], &out_graph[i], sizeof(float)) != 0)
                b->r.agree_differ++;
            const double d = fabs((double)out_eager[i] - out_graph[i]);
            b->r.agree_max_abs = isnan(d) ? INFINITY : fmax(b->r.agree_max_abs, d);
        }
        printf("graph vs eager: max abs %.3g, %zu of %zu values differ\n", b->r.agree_max_abs,
               b->r.agree_differ, b->n_out);
    }
    if (out_eager || out_graph)
        printf("non-finite outputs: eager %lld, graph %lld\n", b->r.nan_eager, b->r.nan_graph);
#ifdef DIT_HAVE_CUDA
    if (dit_backend_is_cuda(be)) {
        /* GEMM modes over one eager forward (a fresh plan cache is not
         * needed: plans keep their mode, calls are counted as issued). */
        dit_cuda_stats st;
        dit_cuda_backend_reset_stats(be);
        if (run_once(b) != 0)
            goto done;
        dit_cuda_backend_stats(be, &st);
        b->r.have_stats = true;
        b->r.gemm_calls = st.gemm_calls;
        b->r.gemm_unfused = st.gemm_unfused_calls;
        b->r.gemm_fallback = st.gemm_fallback_calls;
        /* Shapes count since creation: plans made by any pass so far. */
        b->r.fb_shapes = st.gemm_fallback_shapes;
        b->r.unf_shapes = st.gemm_unfused_shapes;
        b->r.attn_calls[0] = st.attn_v1_calls;
        b->r.attn_calls[1] = st.attn_v2_calls;
        b->r.attn_calls[2] = st.attn_cudnn_calls;
        b->r.attn_calls[3] = st.attn_cudnn_fallback_calls;
        printf("gemms per eager forward: %llu, of which %llu without their fused epilogue and "
               "%llu on the CUDA-core fallback\n",
               b->r.gemm_calls, b->r.gemm_unfused, b->r.gemm_fallback);
        printf("attention calls per eager forward: v1 %llu, v2 %llu, cudnn %llu (cudnn's "
               "fallbacks to v1 %llu)\n",
               b->r.attn_calls[0], b->r.attn_calls[1], b->r.attn_calls[2], b->r.attn_calls[3]);
        if (profile_blocks(b) != 0) {
            fprintf(stderr, "bench_flux_forward: block profile failed: %s\n",
                    be->ops->last_error ? be->ops->last_error(be) : "");
            goto done;
        }
    }
#endif
    rc = 0;
done:
    free(out_eager);
    free(out_graph);
    return rc;
}

/* The keys of the last measure(), each prefixed. */
static void write_keys(bench_ctx *b, const char *px)
{
    FILE *f = b->sum;
    const bench_result *r = &b->r;
    if (r->have_eager)
        fprintf(f,
                "%seager_ms_median: %.3f\n%seager_ms_min: %.3f\n%seager_tflops: %.2f\n"
                "%seager_iters: %ld\n",
                px, r->eager_med, px, r->eager_min, px, b->flop / (r->eager_med / 1e3) / 1e12, px,
                b->iters);
    if (r->have_graph) {
        const char *g = r->graph_fallback ? "graph_fallback_eager" : "graph";
        fprintf(f,
                "%s%s_ms_median: %.3f\n%s%s_ms_min: %.3f\n%s%s_tflops: %.2f\n"
                "%s%s_iters: %ld\n",
                px, g, r->graph_med, px, g, r->graph_min, px, g,
                b->flop / (r->graph_med / 1e3) / 1e12, px, g, b->iters);
    }
    if (r->have_agree)
        fprintf(f, "%sgraph_vs_eager_max_abs: %.6g\n%sgraph_vs_eager_differing: %zu\n", px,
                r->agree_max_abs, px, r->agree_differ);
    if (r->have_eager)
        fprintf(f, "%snan_count_eager: %lld\n", px, r->nan_eager);
    if (r->have_graph)
        fprintf(f, "%snan_count_graph: %lld\n", px, r->nan_graph);
    if (r->have_stats)
        fprintf(f,
                "%sgemm_calls: %llu\n%sgemm_unfused_calls: %llu\n%sgemm_fallback_calls: %llu\n"
                "%sgemm_unfused_shapes: %llu\n%sgemm_fallback_shapes: %llu\n",
                px, r->gemm_calls, px, r->gemm_unfused, px, r->gemm_fallback, px, r->unf_shapes, px,
                r->fb_shapes);
    if (r->have_stats)
        fprintf(f,
                "%sattn_v1_calls: %llu\n%sattn_v2_calls: %llu\n%sattn_cudnn_calls: %llu\n"
                "%sattn_cudnn_fallback_calls: %llu\n",
                px, r->attn_calls[0], px, r->attn_calls[1], px, r->attn_calls[2], px,
                r->attn_calls[3]);
    if (r->have_prof) {
        static const char *blk[2] = {"double_block", "single_block"};
        static const char *part[6] = {"gemm", "attention", "elementwise", "cast", "span", "host"};
        for (int w = 0; w < 2; w++)
            for (int k = 0; k < 6; k++)
                fprintf(f, "%s%s_%s_ms: %.4f\n", px, blk[w], part[k], r->prof[w][k]);
    }
    fflush(f);
}

int main(int argc, char **argv)
{
    dit_cpu_blas_core_fix(argv, true);
    dit_flux_config cfg = dit_flux_config_flux1_dev();
    cfg.num_attention_heads = 8;
    cfg.num_layers = 4;
    cfg.num_single_layers = 8;
    long img = 1024, txt = 128, batch = 1, threads = 0, warmup = 1, iters = 5;
    const char *graph_mode = "off", *summary_path = NULL, *cuda_path = NULL, *cuda_attn = NULL;
    double flop_override = 0.0;
    dit_backend_kind kind = DIT_BACKEND_CPU;
    static const struct option opts[] = {
        {"heads", required_argument, NULL, 'H'},
        {"head-dim", required_argument, NULL, 'D'},
        {"double", required_argument, NULL, 'd'},
        {"single", required_argument, NULL, 's'},
        {"img-tokens", required_argument, NULL, 'i'},
        {"txt-tokens", required_argument, NULL, 't'},
        {"batch", required_argument, NULL, 'b'},
        {"threads", required_argument, NULL, 'j'},
        {"warmup", required_argument, NULL, 'w'},
        {"iters", required_argument, NULL, 'n'},
        {"backend", required_argument, NULL, 'B'},
        {"flux-dev", no_argument, NULL, 'F'},
        {"graph", required_argument, NULL, 'G'},
        {"summary", required_argument, NULL, 'S'},
        {"flop-per-step", required_argument, NULL, 'P'},
        {"cuda-path", required_argument, NULL, 'C'},
        {"cuda-attn", required_argument, NULL, 'A'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        long v = optarg ? strtol(optarg, NULL, 10) : 0;
        switch (c) {
        case 'H':
            cfg.num_attention_heads = (int)v;
            break;
        case 'D':
            cfg.attention_head_dim = (int)v;
            break;
        case 'd':
            cfg.num_layers = (int)v;
            break;
        case 's':
            cfg.num_single_layers = (int)v;
            break;
        case 'i':
            img = v;
            break;
        case 't':
            txt = v;
            break;
        case 'b':
            batch = v;
            break;
        case 'j':
            threads = v;
            break;
        case 'w':
            warmup = v;
            break;
        case 'n':
            iters = v;
            break;
        case 'B':
            if (dit_backend_kind_parse(optarg, &kind) != DIT_OK) {
                fprintf(stderr, "unknown backend %s\n", optarg);
                return 2;
            }
            break;
        case 'F':
            cfg = dit_flux_config_flux1_dev();
            img = 4096;
            txt = 512;
            break;
        case 'G':
            graph_mode = optarg;
            break;
        case 'S':
            summary_path = optarg;
            break;
        case 'P':
            flop_override = strtod(optarg, NULL);
            break;
        case 'C':
            cuda_path = optarg;
            break;
        case 'A':
            cuda_attn = optarg;
            break;
        default:
            fprintf(stderr, "usage: see the comment at the top of bench_flux_forward.c\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (cfg.attention_head_dim != 128) {
        /* Keep the rope axes consistent with the head dim: one axis of all of it. */
        cfg.n_axes = 1;
        cfg.axes_dims_rope[0] = cfg.attention_head_dim;
    }
    if (strcmp(graph_mode, "off") != 0 && strcmp(graph_mode, "on") != 0 &&
        strcmp(graph_mode, "both") != 0) {
        fprintf(stderr, "--graph takes off, on or both\n");
        return 2;
    }
    if (cuda_path && strcmp(cuda_path, "legacy") != 0 && strcmp(cuda_path, "fast") != 0 &&
        strcmp(cuda_path, "both") != 0) {
        fprintf(stderr, "--cuda-path takes legacy, fast or both\n");
        return 2;
    }
    if (cuda_attn && strcmp(cuda_attn, "v1") != 0 && strcmp(cuda_attn, "v2") != 0 &&
        strcmp(cuda_attn, "cudnn") != 0 && strcmp(cuda_attn, "both") != 0 &&
        strcmp(cuda_attn, "all") != 0) {
        fprintf(stderr, "--cuda-attn takes v1, v2, cudnn, both or all\n");
        return 2;
    }
    if (iters < 1 || img < 1 || txt < 0 || batch < 1) {
        fprintf(stderr, "bad sizes\n");
        return 2;
    }

    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be = NULL;
    dit_flux *m = NULL;
    dit_arena *arena = NULL;
    void *dev = NULL;
    float *host = NULL, *ids = NULL, *tsteps = NULL;
    double *times = NULL;
    FILE *sum = NULL;
    int rc = 1;
    dit_backend_config bcfg = {.kind = kind, .n_threads = (int)threads};
    if (dit_backend_create(&bcfg, &be, &diag) != DIT_OK)
        goto cleanup;
    double t0 = now_ms();
    if (dit_flux_create_random(be, &cfg, NULL, 1234, &m, &diag) != DIT_OK)
        goto cleanup;
    double t_init = now_ms() - t0;
    cfg = *dit_flux_config_of(m);

    const size_t n_hs = (size_t)(batch * img * cfg.in_channels);
    const size_t n_ehs = (size_t)(batch * txt * cfg.joint_attention_dim);
    const size_t n_pool = (size_t)(batch * cfg.pooled_projection_dim);
    const size_t n_out = (size_t)(batch * img * cfg.out_dim);
    const size_t n_all = n_hs + n_ehs + n_pool + n_out;
    host = malloc(n_all * sizeof *host);
    ids = calloc((size_t)(img + txt) * (size_t)cfg.n_axes, sizeof *ids);
    tsteps = malloc(2 * (size_t)batch * sizeof *tsteps);
    times = malloc((size_t)iters * sizeof *times);
    if (!host || !ids || !tsteps || !times ||
        dit_backend_alloc(be, n_all * sizeof(float), &dev) != DIT_OK) {
        fprintf(stderr, "out of memory\n");
        goto cleanup;
    }
    uint64_t s = 42;
    for (size_t i = 0; i < n_all; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        host[i] = (float)((double)(s >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    }
    const long side = (long)sqrt((double)img);
    for (long i = 0; i < img; i++) {
        float *row = ids + (size_t)(txt + i) * (size_t)cfg.n_axes;
        row[cfg.n_axes - 1] = (float)(i % (side ? side : 1));
        if (cfg.n_axes > 1)
            row[cfg.n_axes - 2] = (float)(i / (side ? side : 1));
    }
    for (long b = 0; b < batch; b++) {
        tsteps[b] = 0.5f;
        tsteps[batch + b] = 3.5f;
    }
    dit_tensor h_all = dit_tensor_1d(host, DIT_F32, (int64_t)n_all);
    dit_tensor d_all = dit_tensor_1d(dev, DIT_F32, (int64_t)n_all);
    if (be->ops->upload(be, &d_all, &h_all) != DIT_OK)
        goto cleanup;
    float *d = dev;
    dit_flux_inputs in = {
        .hidden_states = dit_tensor_3d(d, DIT_F32, batch, img, cfg.in_channels),
        .encoder_hidden_states =
            dit_tensor_3d(d + n_hs, DIT_F32, batch, txt, cfg.joint_attention_dim),
        .pooled_projections =
            dit_tensor_2d(d + n_hs + n_ehs, DIT_F32, batch, cfg.pooled_projection_dim),
        .timestep = tsteps,
        .guidance = cfg.guidance_embeds ? tsteps + batch : NULL,
        .txt_ids = ids,
        .img_ids = ids + (size_t)txt * (size_t)cfg.n_axes,
    };
    dit_tensor out = dit_tensor_3d(d + n_hs + n_ehs + n_pool, DIT_F32, batch, img, cfg.out_dim);
    if (dit_arena_create(be, 0, &arena) != DIT_OK)
        goto cleanup;
    if (summary_path && !(sum = fopen(summary_path, "a"))) {
        fprintf(stderr, "cannot open %s\n", summary_path);
        goto cleanup;
    }
    const double flop =
        flop_override > 0 ? flop_override : dit_flux_forward_flops(&cfg, batch, txt, img);
    printf("config: %d double + %d single blocks, %d heads x %d (hidden %d), batch %ld, "
           "%ld image + %ld text tokens\n",
           cfg.num_layers, cfg.num_single_layers, cfg.num_attention_heads, cfg.attention_head_dim,
           cfg.inner_dim, batch, img, txt);
    if (sum)
        fprintf(sum,
                "backend: %s\nconfig: %d double + %d single, %d x %d heads, batch %ld, "
                "%ld img + %ld txt tokens\nflop_per_step: %.4g\nweights_mib: %.1f\n"
                "weights_init_ms: %.0f\n",
                be->ops->name, cfg.num_layers, cfg.num_single_layers, cfg.num_attention_heads,
                cfg.attention_head_dim, batch, img, txt, flop,
                (double)dit_flux_weight_bytes(m) / 1048576.0, t_init);
    /* The cuda paths to measure: the one the backend started with, or what
     * --cuda-path asks for; each with the attention kernel the backend
     * started with or the one --cuda-attn names, and with both, the fast
     * path once more on v2, with all on v2 and on cudnn. */
    int paths[4] = {-1, -1, -1, -1}, attns[4] = {-1, -1, -1, -1}, n_paths = 1;
    int start_path = -1, start_attn = -1;
#ifdef DIT_HAVE_CUDA
    if (dit_backend_is_cuda(be)) {
        start_path = (int)dit_cuda_backend_path(be);
        start_attn = (int)dit_cuda_backend_attn(be);
        paths[0] = start_path;
        if (cuda_path && strcmp(cuda_path, "both") == 0) {
            paths[0] = DIT_CUDA_PATH_LEGACY;
            paths[1] = DIT_CUDA_PATH_FAST;
            n_paths = 2;
        } else if (cuda_path) {
            dit_cuda_path p;
            dit_cuda_path_parse(cuda_path, &p);
            paths[0] = (int)p;
        }
        const bool all = cuda_attn && strcmp(cuda_attn, "all") == 0;
        const bool both = all || (cuda_attn && strcmp(cuda_attn, "both") == 0);
        int a0 = start_attn;
        if (cuda_attn && !both) {
            dit_cuda_attn k;
            dit_cuda_attn_parse(cuda_attn, &k);
            a0 = (int)k;
        } else if (both) {
            a0 = DIT_CUDA_ATTN_V1;
        }
        for (int i = 0; i < n_paths; i++)
            attns[i] = a0;
        if (both && paths[n_paths - 1] == DIT_CUDA_PATH_FAST) {
            paths[n_paths] = DIT_CUDA_PATH_FAST;
            attns[n_paths] = DIT_CUDA_ATTN_V2;
            n_paths++;
            if (all) {
                paths[n_paths] = DIT_CUDA_PATH_FAST;
                attns[n_paths] = DIT_CUDA_ATTN_CUDNN;
                n_paths++;
            }
        }
    }
#else
    if (cuda_path || cuda_attn)
        fprintf(stderr, "--cuda-path, --cuda-attn: this build has no cuda backend; ignored\n");
    (void)attns;
    (void)start_attn;
#endif
    bench_ctx bc = {.be = be,
                    .m = m,
                    .arena = arena,
                    .in = &in,
                    .out = &out,
                    .diag = &diag,
                    .flop = flop,
                    .warmup = warmup,
                    .iters = iters,
                    .times = times,
                    .want_graph = strcmp(graph_mode, "off") != 0,
                    .want_eager = strcmp(graph_mode, "on") != 0,
                    .sum = sum,
                    .n_out = (size_t)dit_tensor_numel(&out)};
    for (int pi = 0; pi < n_paths; pi++) {
        char prefix[32] = "";
        bool extra = false; /* the fast path again, on another attention kernel */
#ifdef DIT_HAVE_CUDA
        if (paths[pi] >= 0) {
            dit_cuda_backend_set_path(be, (dit_cuda_path)paths[pi]);
            dit_cuda_backend_set_attn(be, (dit_cuda_attn)attns[pi]);
            extra = pi > 0 && paths[pi] == paths[pi - 1];
            if (attns[pi] == DIT_CUDA_ATTN_CUDNN) {
                /* Say which cuDNN (or why none) before timing it. */
                char why[400];
                dit_cuda_backend_cudnn(be, why, sizeof why);
                printf("cudnn: %s\n", why);
                if (sum)
                    fprintf(sum, "%scudnn: %s\n", extra ? "fast_attn_cudnn_" : "", why);
            }
            printf("cuda path: %s, attention %s\n", dit_cuda_path_name((dit_cuda_path)paths[pi]),
                   dit_cuda_attn_name((dit_cuda_attn)attns[pi]));
            if (extra)
                snprintf(prefix, sizeof prefix, "%s_attn_%s_",
                         dit_cuda_path_name((dit_cuda_path)paths[pi]),
                         dit_cuda_attn_name((dit_cuda_attn)attns[pi]));
            else if (cuda_path)
                snprintf(prefix, sizeof prefix, "%s_",
                         dit_cuda_path_name((dit_cuda_path)paths[pi]));
        }
#endif
        if (measure(&bc) != 0)
            goto cleanup;
        /* Unprefixed keys: the path the backend started with, or the only
         * one measured. Each set says which attention kernel it ran. */
        const char *attn_name = "";
#ifdef DIT_HAVE_CUDA
        if (attns[pi] >= 0)
            attn_name = dit_cuda_attn_name((dit_cuda_attn)attns[pi]);
#endif
        if (sum && prefix[0] && !extra && (n_paths == 1 || paths[pi] == start_path)) {
            write_keys(&bc, "");
            if (attn_name[0])
                fprintf(sum, "cuda_attn: %s\n", attn_name);
        }
        if (sum) {
            write_keys(&bc, prefix);
            if (attn_name[0])
                fprintf(sum, "%scuda_attn: %s\n", prefix, attn_name);
        }
    }
#ifdef DIT_HAVE_CUDA
    if (start_path >= 0) {
        dit_cuda_backend_set_path(be, (dit_cuda_path)start_path);
        dit_cuda_backend_set_attn(be, (dit_cuda_attn)start_attn);
    }
#endif
    dit_flux_set_graphs(m, false);
    printf("weights: %.1f MiB (random, made in %.0f ms); activations: %.1f MiB\n",
           (double)dit_flux_weight_bytes(m) / 1048576.0, t_init,
           (double)dit_arena_high_water(arena) / 1048576.0);
    if (sum)
        fprintf(sum, "activations_mib: %.1f\n", (double)dit_arena_high_water(arena) / 1048576.0);
#ifdef DIT_HAVE_CUDA
    if (dit_backend_is_cuda(be)) {
        dit_cuda_memory mem;
        if (dit_cuda_backend_memory(be, &mem) == DIT_OK) {
            printf("gpu memory: backend peak %.1f MiB, device in use %.1f of %.1f MiB\n",
                   mem.backend_peak_bytes / 1048576.0, mem.device_used_bytes / 1048576.0,
                   mem.device_total_bytes / 1048576.0);
            if (sum)
                fprintf(sum,
                        "gpu_backend_peak_mib: %.1f\ngpu_device_used_mib: %.1f\n"
                        "gpu_device_total_mib: %.1f\n",
                        mem.backend_peak_bytes / 1048576.0, mem.device_used_bytes / 1048576.0,
                        mem.device_total_bytes / 1048576.0);
        }
    }
#endif
    if (sum)
        fclose(sum);
    sum = NULL;
    rc = 0;
cleanup:
    if (rc)
        fprintf(stderr, "bench_flux_forward: %s\n", dit_diag_msg(&diag));
    if (sum)
        fclose(sum);
    dit_arena_destroy(arena);
    if (be)
        dit_backend_free(be, dev);
    dit_flux_destroy(m);
    dit_backend_destroy(be);
    free(host);
    free(ids);
    free(tsteps);
    free(times);
    return rc;
}
