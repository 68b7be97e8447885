/* Time and size of MP4 encoding (worker/media/mp4.c) on a generated-video
 * sized clip.
 *
 *   bench_mp4 [FRAMES (81)] [HEIGHT (480)] [WIDTH (832)] [FPS (16)] [ITERS (3)]
 *
 * Two clips of (FRAMES, 3, HEIGHT, WIDTH) f32: "smooth", moving sinusoidal
 * colour patterns (what a diffusion model's large structures look like to
 * the codec), and "noisy", the same plus uniform noise of +-0.1 on every
 * value (fine texture and grain: the expensive case). For each, the fastest
 * of ITERS encodes (everything dit_mp4_encode does: quantisation, swscale,
 * libx264, muxing with faststart) and the bytes it produced. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "media/mp4.h"

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static float *make_clip(int F, int H, int W, float noise)
{
    const size_t plane = (size_t)H * W;
    float *v = malloc((size_t)F * 3 * plane * sizeof *v);
    if (!v)
        return NULL;
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int f = 0; f < F; f++)
        for (int c = 0; c < 3; c++)
            for (int y = 0; y < H; y++)
                for (int x = 0; x < W; x++) {
                    float a = 0.6f *
                              sinf(0.031f * (float)x + 0.047f * (float)y + 0.2f * (float)f +
                                   2.1f * (float)c) *
                              cosf(0.017f * (float)x - 0.023f * (float)y - 0.11f * (float)f);
                    s = s * 6364136223846793005ull + 1442695040888963407ull;
                    float u = (float)(s >> 40) / (float)(1 << 24); /* [0, 1) */
                    v[((size_t)c * F + f) * plane + (size_t)y * W + x] =
                        a + noise * (2.0f * u - 1.0f);
                }
    return v;
}

int main(int argc, char **argv)
{
    const int F = argc > 1 ? atoi(argv[1]) : 81;
    const int H = argc > 2 ? atoi(argv[2]) : 480;
    const int W = argc > 3 ? atoi(argv[3]) : 832;
    const int fps = argc > 4 ? atoi(argv[4]) : 16;
    const int iters = argc > 5 ? atoi(argv[5]) : 3;
    if (argc > 6 || iters < 1) {
        fprintf(stderr, "usage: bench_mp4 [FRAMES] [HEIGHT] [WIDTH] [FPS] [ITERS]\n");
        return 2;
    }
    const char *names[2] = {"smooth", "noisy"};
    const float noise[2] = {0.0f, 0.1f};
    for (int k = 0; k < 2; k++) {
        float *clip = make_clip(F > 0 ? F : 1, H > 0 ? H : 2, W > 0 ? W : 2, noise[k]);
        if (!clip) {
            fprintf(stderr, "bench_mp4: out of memory\n");
            return 1;
        }
        double best = INFINITY;
        size_t bytes = 0;
        for (int i = 0; i < iters; i++) {
            uint8_t *mp4 = NULL;
            dit_diag diag;
            dit_diag_clear(&diag);
            const double t0 = now_ms();
            dit_status st = dit_mp4_encode(clip, F, H, W, fps, &mp4, &bytes, &diag);
            const double t = now_ms() - t0;
            if (st != DIT_OK) {
                fprintf(stderr, "bench_mp4: %s\n", dit_diag_msg(&diag));
                free(clip);
                return 1;
            }
            free(mp4);
            best = t < best ? t : best;
        }
        printf("mp4 %s: %d frames %d x %d @ %d fps: %.0f ms (%.1f ms per frame), %zu bytes "
               "(%.0f kbit/s)\n",
               names[k], F, H, W, fps, best, best / F, bytes,
               (double)bytes * 8.0 / 1000.0 / ((double)F / fps));
        free(clip);
    }
    return 0;
}
