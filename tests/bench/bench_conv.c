/* The VAE's 3x3 convolutions (stride 1, padding 1) on the cpu backend:
 * milliseconds (best of --iters) and GFLOP/s per layer shape, one line
 * each. Default shapes are the demo VAE decoder's at 512² and a
 * full-size decoder's narrow layers.
 *
 *   bench_conv [--threads 1] [--iters 9] [CI,CO,H,W ...] */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "backend/backend.h"
#include "core/status.h"

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int run_shape(dit_backend *be, int64_t Ci, int64_t Co, int64_t H, int64_t W, int iters)
{
    int rc = 1;
    float *x = malloc(sizeof(float) * (size_t)(Ci * H * W));
    float *w = malloc(sizeof(float) * (size_t)(Co * Ci * 9));
    float *b = malloc(sizeof(float) * (size_t)Co);
    float *y = malloc(sizeof(float) * (size_t)(Co * H * W));
    if (!x || !w || !b || !y)
        goto cleanup;
    for (int64_t i = 0; i < Ci * H * W; i++)
        x[i] = (float)(i % 7) * 0.1f - 0.3f;
    for (int64_t i = 0; i < Co * Ci * 9; i++)
        w[i] = (float)(i % 5) * 0.01f - 0.02f;
    for (int64_t i = 0; i < Co; i++)
        b[i] = 0.1f;
    dit_tensor tx = dit_tensor_4d(x, DIT_F32, 1, Ci, H, W);
    dit_tensor tw = dit_tensor_4d(w, DIT_F32, Co, Ci, 3, 3);
    dit_tensor tb = dit_tensor_1d(b, DIT_F32, Co), ty = dit_tensor_4d(y, DIT_F32, 1, Co, H, W);
    double best = 0;
    for (int r = 0; r < iters; r++) {
        const double t0 = now_ms();
        if (be->ops->conv2d(be, &ty, &tx, &tw, &tb, 1, 1) != DIT_OK)
            goto cleanup;
        const double t = now_ms() - t0;
        if (r == 0 || t < best)
            best = t;
    }
    printf("conv 3x3 Ci %3" PRId64 " Co %3" PRId64 " %4" PRId64 "x%-4" PRId64
           ": %8.2f ms %7.1f GFLOP/s\n",
           Ci, Co, H, W, best, 2.0 * (double)(Ci * Co * 9 * H * W) / best / 1e6);
    rc = 0;
cleanup:
    free(x);
    free(w);
    free(b);
    free(y);
    return rc;
}

int main(int argc, char **argv)
{
    int threads = 1, iters = 9;
    static const struct option opts[] = {
        {"threads", required_argument, NULL, 't'}, {"iters", required_argument, NULL, 'i'}, {0}};
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 't')
            threads = atoi(optarg);
        else if (c == 'i')
            iters = atoi(optarg);
        else {
            fprintf(stderr, "usage: bench_conv [--threads N] [--iters N] [CI,CO,H,W ...]\n");
            return 2;
        }
    }
    if (threads < 1 || iters < 1) {
        fprintf(stderr, "bench_conv: --threads and --iters must be at least 1\n");
        return 2;
    }
    dit_backend *be = NULL;
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = threads};
    if (dit_backend_create(&cfg, &be, NULL) != DIT_OK) {
        fprintf(stderr, "bench_conv: no cpu backend\n");
        return 1;
    }
    static const int64_t defaults[][4] = {{16, 16, 512, 512}, {16, 8, 512, 512},
                                          {8, 3, 512, 512},   {16, 16, 256, 256},
                                          {128, 3, 512, 512}, {64, 32, 256, 256}};
    int rc = 0;
    if (optind < argc) {
        for (int a = optind; a < argc && rc == 0; a++) {
            int64_t s[4];
            if (sscanf(argv[a], "%" SCNd64 ",%" SCNd64 ",%" SCNd64 ",%" SCNd64, &s[0], &s[1], &s[2],
                       &s[3]) != 4 ||
                s[0] < 1 || s[1] < 1 || s[2] < 1 || s[3] < 1 || s[0] > 4096 || s[1] > 4096 ||
                s[2] > 8192 || s[3] > 8192) {
                fprintf(stderr, "bench_conv: '%s' is not CI,CO,H,W\n", argv[a]);
                rc = 2;
                break;
            }
            rc = run_shape(be, s[0], s[1], s[2], s[3], iters);
        }
    } else {
        for (size_t k = 0; k < sizeof defaults / sizeof defaults[0] && rc == 0; k++)
            rc = run_shape(be, defaults[k][0], defaults[k][1], defaults[k][2], defaults[k][3],
                           iters);
    }
    dit_backend_destroy(be);
    return rc;
}
