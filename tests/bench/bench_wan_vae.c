/* AutoencoderKLWan decode: time and peak host memory of decoding random
 * latents with dit_wan_vae_decode on the cpu backend.
 *
 *   bench_wan_vae --vae DIR [--latent-frames 2] [--height 60] [--width 104]
 *                 [--threads N] [--seed 1]
 *
 * DIR is a diffusers AutoencoderKLWan folder (tests/bench/wan_vae_memory.sh
 * makes Wan 2.1's with random weights); height and width are latent sizes
 * (60 x 104 is 480 x 832 pixels). Prints one line per latent frame count
 * given (--latent-frames may be a comma list, each decoded in a fresh child
 * process so that every peak is its own):
 *
 *   wan vae decode: T latent frames -> F frames HxW: X s (Y s per latent
 *   frame), peak RSS P MiB = after load B MiB + output O MiB + decode W MiB
 *
 * "decode" is the peak resident memory beyond the loaded weights and the
 * output video (host f32, which the caller owns): the activations of one
 * latent frame's chunk and the causal-convolution caches. The decoder
 * works one latent frame at a time, so it should not grow with T. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/backend.h"
#include "vae/autoencoder_kl_wan.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Resident set size now, in bytes (/proc/self/statm). */
static double rss_now(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, resident = 0;
    if (!f)
        return 0;
    if (fscanf(f, "%ld %ld", &pages, &resident) != 2)
        resident = 0;
    fclose(f);
    return (double)resident * (double)sysconf(_SC_PAGESIZE);
}

/* Peak resident set size of this process so far, in bytes. */
static double rss_peak(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss * 1024.0;
}

static int decode_once(const char *dir, int64_t T, int64_t h, int64_t w, int threads, uint64_t seed)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_status st = DIT_OK;
    dit_backend *be = NULL;
    dit_wan_vae *v = NULL;
    float *z = NULL, *video = NULL;
    dit_backend_config bcfg = {.kind = DIT_BACKEND_CPU, .n_threads = threads};
    DIT_CHECK(dit_backend_create(&bcfg, &be, &diag));
    double t0 = now_s();
    DIT_CHECK(dit_wan_vae_load(be, dir, &v, &diag));
    const double t_load = now_s() - t0;
    const int64_t zc = dit_wan_vae_z_dim(v), oc = dit_wan_vae_out_channels(v);
    const int64_t s = dit_wan_vae_spatial_scale(v), F = dit_wan_vae_frames(v, T);
    const size_t nz = (size_t)(zc * T * h * w), nv = (size_t)(oc * F * h * s * w * s);
    z = malloc(nz * sizeof *z);
    if (!z) {
        st = dit_diag_set(&diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    /* Uniform in [-2, 2): latents of a denoised video's scale. */
    for (size_t i = 0; i < nz; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        z[i] = (float)((double)(seed >> 11) * 0x1.0p-53 * 4.0 - 2.0);
    }
    const double base = rss_now();
    video = malloc(nv * sizeof *video);
    if (!video) {
        st = dit_diag_set(&diag, DIT_ERR_NOMEM, "out of memory for the %.1f MiB video",
                          (double)nv * 4 / 1048576.0);
        goto cleanup;
    }
    const int64_t zs[5] = {1, zc, T, h, w}, vs[5] = {1, oc, F, h * s, w * s};
    dit_tensor zt = dit_tensor_make(z, DIT_F32, 5, zs), vt = dit_tensor_make(video, DIT_F32, 5, vs);
    t0 = now_s();
    DIT_CHECK(dit_wan_vae_decode(v, &zt, &vt, &diag));
    const double dt = now_s() - t0;
    const double peak = rss_peak(), out_b = (double)nv * sizeof *video;
    double sum = 0;
    for (size_t i = 0; i < nv; i++)
        sum += video[i];
    const double mib = 1048576.0;
    printf("wan vae decode: %lld latent frames -> %lld frames %lldx%lld: %.1f s (%.1f s per "
           "latent frame, load %.1f s), peak RSS %.0f MiB = after load %.0f MiB + output %.0f "
           "MiB + decode %.0f MiB (mean %.4f)\n",
           (long long)T, (long long)F, (long long)(h * s), (long long)(w * s), dt, dt / (double)T,
           t_load, peak / mib, base / mib, out_b / mib, (peak - base - out_b) / mib,
           sum / (double)nv);
    fflush(stdout);
cleanup:
    if (st != DIT_OK)
        fprintf(stderr, "bench_wan_vae: %s\n", dit_diag_msg(&diag));
    free(video);
    free(z);
    dit_wan_vae_free(v);
    dit_backend_destroy(be);
    return st == DIT_OK ? 0 : 1;
}

int main(int argc, char **argv)
{
    dit_cpu_blas_core_fix(argv, true);
    const char *dir = NULL;
    char frames[128] = "2";
    long h = 60, w = 104;
    int threads = 0;
    unsigned long long seed = 1;
    static const struct option opts[] = {
        {"vae", required_argument, NULL, 'v'},
        {"latent-frames", required_argument, NULL, 'f'},
        {"height", required_argument, NULL, 'H'},
        {"width", required_argument, NULL, 'W'},
        {"threads", required_argument, NULL, 'j'},
        {"seed", required_argument, NULL, 's'},
        {NULL, 0, NULL, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'v':
            dir = optarg;
            break;
        case 'f':
            snprintf(frames, sizeof frames, "%s", optarg);
            break;
        case 'H':
            h = strtol(optarg, NULL, 10);
            break;
        case 'W':
            w = strtol(optarg, NULL, 10);
            break;
        case 'j':
            threads = atoi(optarg);
            break;
        case 's':
            seed = strtoull(optarg, NULL, 10);
            break;
        default:
            fprintf(stderr, "usage: see the comment at the top of bench_wan_vae.c\n");
            return 2;
        }
    }
    if (!dir || h < 1 || w < 1 || threads < 0) {
        fprintf(stderr, "usage: bench_wan_vae --vae DIR [--latent-frames T[,T...]] [--height h] "
                        "[--width w] [--threads N]\n");
        return 2;
    }
    int failures = 0;
    for (char *save = NULL, *tok = strtok_r(frames, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        const long T = strtol(tok, NULL, 10);
        if (T < 1) {
            fprintf(stderr, "bench_wan_vae: bad frame count '%s'\n", tok);
            return 2;
        }
        /* A child per count: ru_maxrss is the peak of the whole process. */
        pid_t pid = fork();
        if (pid == 0)
            _exit(decode_once(dir, T, h, w, threads, seed));
        int status = 0;
        waitpid(pid, &status, 0);
        failures += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    return failures ? 1 : 0;
}
