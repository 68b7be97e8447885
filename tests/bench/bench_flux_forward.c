/* Forward-pass benchmark on random weights: ms per forward and GFLOP/s.
 *
 *   bench_flux_forward [--heads 8] [--head-dim 128] [--double 4] [--single 8]
 *                      [--img-tokens 1024] [--txt-tokens 128] [--batch 1]
 *                      [--threads N] [--warmup 1] [--iters 5] [--backend cpu|cuda]
 *                      [--flux-dev] [--graph both|on|off] [--flop-per-step F]
 *                      [--summary FILE]
 *
 * Defaults are the mid-size config that tests/bench/bench_diffusers_forward.py
 * times in PyTorch, so the two print comparable lines.
 *
 * --flux-dev: FLUX.1-dev dimensions (19 + 38 blocks, 24 x 128 heads, 4096
 * image + 512 text tokens). --graph: time eager passes, CUDA-graph replays,
 * or both (cuda backend; graph passes need two warm-up passes: eager, then
 * capture). --flop-per-step: the FLOP count TFLOP/s is computed from
 * (default: dit_flux_forward_flops). --summary: append "key: value" lines
 * (ms per step, TFLOP/s, memory) to FILE. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#ifdef DIT_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif
#include "core/arena.h"
#include "model/flux.h"

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

int main(int argc, char **argv)
{
    dit_flux_config cfg = dit_flux_config_flux1_dev();
    cfg.num_attention_heads = 8;
    cfg.num_layers = 4;
    cfg.num_single_layers = 8;
    long img = 1024, txt = 128, batch = 1, threads = 0, warmup = 1, iters = 5;
    const char *graph_mode = "off", *summary_path = NULL;
    double flop_override = 0.0;
    dit_backend_kind kind = DIT_BACKEND_CPU;
    static const struct option opts[] = {
        {"heads", required_argument, NULL, 'H'},      {"head-dim", required_argument, NULL, 'D'},
        {"double", required_argument, NULL, 'd'},     {"single", required_argument, NULL, 's'},
        {"img-tokens", required_argument, NULL, 'i'}, {"txt-tokens", required_argument, NULL, 't'},
        {"batch", required_argument, NULL, 'b'},      {"threads", required_argument, NULL, 'j'},
        {"warmup", required_argument, NULL, 'w'},     {"iters", required_argument, NULL, 'n'},
        {"backend", required_argument, NULL, 'B'},    {"flux-dev", no_argument, NULL, 'F'},
        {"graph", required_argument, NULL, 'G'},      {"summary", required_argument, NULL, 'S'},
        {"flop-per-step", required_argument, NULL, 'P'},
        {"help", no_argument, NULL, 'h'},             {NULL, 0, NULL, 0},
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
    if (!host || !ids || !tsteps || !times || dit_backend_alloc(be, n_all * sizeof(float), &dev) != DIT_OK) {
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
        .encoder_hidden_states = dit_tensor_3d(d + n_hs, DIT_F32, batch, txt, cfg.joint_attention_dim),
        .pooled_projections = dit_tensor_2d(d + n_hs + n_ehs, DIT_F32, batch, cfg.pooled_projection_dim),
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
    const double flop = flop_override > 0 ? flop_override
                                          : dit_flux_forward_flops(&cfg, batch, txt, img);
    printf("config: %d double + %d single blocks, %d heads x %d (hidden %d), batch %ld, "
           "%ld image + %ld text tokens\n",
           cfg.num_layers, cfg.num_single_layers, cfg.num_attention_heads, cfg.attention_head_dim,
           cfg.inner_dim, batch, img, txt);
    if (sum)
        fprintf(sum, "backend: %s\nconfig: %d double + %d single, %d x %d heads, batch %ld, "
                     "%ld img + %ld txt tokens\nflop_per_step: %.4g\nweights_mib: %.1f\n"
                     "weights_init_ms: %.0f\n",
                be->ops->name, cfg.num_layers, cfg.num_single_layers, cfg.num_attention_heads,
                cfg.attention_head_dim, batch, img, txt, flop,
                (double)dit_flux_weight_bytes(m) / 1048576.0, t_init);
    /* Modes to time: eager and/or graph replay. */
    const bool want_graph = strcmp(graph_mode, "off") != 0;
    const bool want_eager = strcmp(graph_mode, "on") != 0;
    for (int mode = 0; mode < 2; mode++) {
        const bool graph = mode == 1;
        if ((graph && !want_graph) || (!graph && !want_eager))
            continue;
        dit_flux_set_graphs(m, graph);
        /* Graph replay starts at the third pass: eager, capture, replay. */
        const long wu = graph && warmup < 2 ? 2 : warmup;
        for (long i = 0; i < wu + iters; i++) {
            double t1 = now_ms();
            if (dit_flux_forward(m, arena, &in, &out, &diag) != DIT_OK ||
                be->ops->sync(be) != DIT_OK) {
                if (be->ops->last_error && diag.status == DIT_OK)
                    dit_diag_set(&diag, DIT_ERR_DEVICE, "%s", be->ops->last_error(be));
                goto cleanup;
            }
            double dt = now_ms() - t1;
            if (i >= wu)
                times[i - wu] = dt;
            dit_arena_reset(arena);
        }
        const char *label = graph ? "graph" : "eager";
        if (graph && !dit_flux_graph_captured(m)) {
            printf("graph: no graph was captured (backend %s has no graph support or capture "
                   "failed); the numbers below are eager\n", be->ops->name);
            label = "graph_fallback_eager";
        }
        qsort(times, (size_t)iters, sizeof *times, cmp_double);
        const double med = times[iters / 2];
        printf("%s forward: median %.2f ms, min %.2f ms, %.1f TFLOP/s (%.2f TFLOP per step), "
               "backend %s\n",
               label, med, times[0], flop / (med / 1e3) / 1e12, flop / 1e12, be->ops->name);
        if (sum)
            fprintf(sum, "%s_ms_median: %.3f\n%s_ms_min: %.3f\n%s_tflops: %.2f\n%s_iters: %ld\n",
                    label, med, label, times[0], label, flop / (med / 1e3) / 1e12, label, iters);
    }
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
                fprintf(sum, "gpu_backend_peak_mib: %.1f\ngpu_device_used_mib: %.1f\n"
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
