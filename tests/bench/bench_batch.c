/* Request batching's step cost on a pipeline folder: the denoising step of
 * dit_pipeline_generate_batch with n members of one image each (different
 * prompts and seeds), for each n of --batches, as ms per step (one
 * transformer forward over the n images, plus the scheduler) and ms per
 * image.
 *
 *   bench_batch --model DIR [--batches 1,2,4] [--threads N] [--width W]
 *               [--height H] [--steps S] [--warmup K] [--true-cfg]
 *
 * Each n runs one generation of warmup + steps steps; the median of the
 * last `steps` step times is reported (no VAE decode). */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/backend.h"
#include "pipelines/pipeline.h"
#include "runtime/runner.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct step_times {
    double last, t[1000];
    int n;
} step_times;

static dit_status on_step(void *ctx, int step, int total, double elapsed_ms, bool *active)
{
    (void)step;
    (void)total;
    (void)elapsed_ms;
    (void)active;
    step_times *s = ctx;
    const double t = now_ms();
    if (s->n < 1000)
        s->t[s->n++] = t - s->last;
    s->last = t;
    return DIT_OK;
}

int main(int argc, char **argv)
{
    dit_cpu_blas_core_fix(argv, true);
    const char *model = NULL, *batches = "1,2,4";
    long threads = 0, width = 256, height = 256, steps = 5, warmup = 1;
    bool true_cfg = false;
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},
        {"batches", required_argument, NULL, 'b'},
        {"threads", required_argument, NULL, 'j'},
        {"width", required_argument, NULL, 'W'},
        {"height", required_argument, NULL, 'H'},
        {"steps", required_argument, NULL, 's'},
        {"warmup", required_argument, NULL, 'w'},
        {"true-cfg", no_argument, NULL, 'c'},
        {NULL, 0, NULL, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        const long v = optarg ? strtol(optarg, NULL, 10) : 0;
        switch (c) {
        case 'm':
            model = optarg;
            break;
        case 'b':
            batches = optarg;
            break;
        case 'j':
            threads = v;
            break;
        case 'W':
            width = v;
            break;
        case 'H':
            height = v;
            break;
        case 's':
            steps = v;
            break;
        case 'w':
            warmup = v;
            break;
        case 'c':
            true_cfg = true;
            break;
        default:
            fprintf(stderr, "usage: bench_batch --model DIR [--batches 1,2,4] [--threads N] "
                            "[--width W] [--height H] [--steps S] [--warmup K] [--true-cfg]\n");
            return 2;
        }
    }
    if (!model || steps < 1 || warmup < 0 || steps + warmup > 1000) {
        fprintf(stderr, "bench_batch: --model is required; 1 <= steps, steps + warmup <= 1000\n");
        return 2;
    }
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be = NULL;
    dit_pipeline *p = NULL;
    dit_runner *runner = NULL;
    int rc = 1;
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = (int)threads};
    if (dit_backend_create(&bc, &be, &diag) != DIT_OK ||
        dit_pipeline_load(be, model, NULL, false, &p, &diag) != DIT_OK ||
        dit_runner_create(be, dit_pipeline_transformer(p), NULL, &runner, &diag) != DIT_OK) {
        fprintf(stderr, "bench_batch: %s\n", dit_diag_msg(&diag));
        goto done;
    }
    const dit_denoiser den = dit_runner_denoiser(runner);
    static const char *const prompts[] = {"a red fox in the snow", "a bowl of ramen",
                                          "a lighthouse at dusk", "a cat playing piano"};
    printf("%s, %ldx%ld, %s, %ld thread%s: median of %ld steps after %ld warm-up\n", model, width,
           height, true_cfg ? "true CFG" : "no CFG", threads, threads == 1 ? "" : "s", steps,
           warmup);
    for (const char *s = batches; *s;) {
        char *end;
        const long n = strtol(s, &end, 10);
        if (n < 1 || n > 64) {
            fprintf(stderr, "bench_batch: bad --batches %s\n", batches);
            goto done;
        }
        s = *end == ',' ? end + 1 : end;
        dit_gen_params *gps = calloc((size_t)n, sizeof *gps);
        dit_gen_result *res = calloc((size_t)n, sizeof *res);
        dit_status *mst = calloc((size_t)n, sizeof *mst);
        step_times *st = calloc(1, sizeof *st);
        if (!gps || !res || !mst || !st) {
            fprintf(stderr, "bench_batch: out of memory\n");
            goto done;
        }
        for (long k = 0; k < n; k++) {
            gps[k].prompt = prompts[k % 4];
            gps[k].negative_prompt = true_cfg ? "blurry" : NULL;
            gps[k].true_cfg_scale = true_cfg ? 3.0f : 1.0f;
            gps[k].guidance_scale = 3.5f;
            gps[k].width = (int)width;
            gps[k].height = (int)height;
            gps[k].steps = (int)(steps + warmup);
            gps[k].seed = (uint64_t)k;
            gps[k].max_sequence_length = 64;
        }
        st->last = now_ms();
        /* The first interval includes the text encoders: it is a warm-up
         * step's. */
        dit_status r =
            dit_pipeline_generate_batch(p, &den, (int)n, gps, NULL, on_step, st, res, mst, &diag);
        if (r == DIT_OK) {
            const int skip = (int)warmup, m = st->n - skip;
            qsort(st->t + skip, (size_t)m, sizeof(double), cmp_double);
            const double med = st->t[skip + m / 2];
            printf("batch %ld: %.2f ms per step (forward), %.2f ms per image\n", n, med,
                   med / (double)n);
            fflush(stdout);
        }
        for (long k = 0; k < n; k++)
            dit_gen_result_free(&res[k]);
        free(gps);
        free(res);
        free(mst);
        free(st);
        if (r != DIT_OK) {
            fprintf(stderr, "bench_batch: %s\n", dit_diag_msg(&diag));
            goto done;
        }
    }
    rc = 0;
done:
    dit_runner_destroy(runner);
    dit_pipeline_free(p);
    dit_backend_destroy(be);
    return rc;
}
