/* PNG encoding: our encoder (dit_png_encode_rgb8) against libpng's default
 * settings (every filter tried per row, deflate level 6), bytes and
 * milliseconds (median of --iters), one line per image.
 *
 *   bench_png [--iters 9] [FILE.png ...]
 *
 * Without files: synthetic 256², 512² and 1024² images (smooth colour
 * fields with fine texture and a little noise, a stand-in for photographs);
 * with files: each decoded and re-encoded both ways. */
#include <getopt.h>
#include <math.h>
#include <png.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/status.h"
#include "media/png.h"
#include "test_util.h"

typedef struct membuf {
    unsigned char *p;
    size_t n, cap;
    bool oom;
} membuf;

static void mem_write(png_structp png, png_bytep data, size_t n)
{
    membuf *b = png_get_io_ptr(png);
    if (b->oom)
        return;
    if (b->n + n > b->cap) {
        size_t cap = (b->n + n) * 2;
        unsigned char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
}

static void mem_flush(png_structp png)
{
    (void)png;
}

/* libpng with nothing set: the baseline. Returns the byte count, 0 on
 * failure. */
static size_t encode_libpng_default(const uint8_t *rgb, int64_t H, int64_t W)
{
    membuf b = {0};
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, NULL, NULL, NULL);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    size_t n = 0;
    if (!png || !info)
        goto done;
    if (setjmp(png_jmpbuf(png)))
        goto done;
    png_set_write_fn(png, &b, mem_write, mem_flush);
    png_set_IHDR(png, info, (png_uint_32)W, (png_uint_32)H, 8, PNG_COLOR_TYPE_RGB,
                 PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    for (int64_t y = 0; y < H; y++)
        png_write_row(png, (png_bytep)(rgb + (size_t)y * (size_t)W * 3));
    png_write_end(png, NULL);
    n = b.oom ? 0 : b.n;
done:
    png_destroy_write_struct(png ? &png : NULL, info ? &info : NULL);
    free(b.p);
    return n;
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Times both encoders on one image and prints the line. */
static int bench_image(const char *name, const uint8_t *rgb, int64_t H, int64_t W, int iters)
{
    double *t[2] = {calloc((size_t)iters, sizeof(double)), calloc((size_t)iters, sizeof(double))};
    size_t bytes[2] = {0, 0};
    int rc = 1;
    if (!t[0] || !t[1])
        goto done;
    for (int i = 0; i < iters; i++) {
        uint8_t *png = NULL;
        size_t len = 0;
        double a = now_ms();
        if (dit_png_encode_rgb8(rgb, H, W, &png, &len, NULL) != DIT_OK)
            goto done;
        t[0][i] = now_ms() - a;
        bytes[0] = len;
        free(png);
        a = now_ms();
        bytes[1] = encode_libpng_default(rgb, H, W);
        t[1][i] = now_ms() - a;
        if (!bytes[1])
            goto done;
    }
    qsort(t[0], (size_t)iters, sizeof(double), cmp_double);
    qsort(t[1], (size_t)iters, sizeof(double), cmp_double);
    printf("%-28s %5lld x %-5lld ours %9zu bytes %8.2f ms | libpng default %9zu bytes %8.2f ms | "
           "size %+.1f %%, %.1fx faster\n",
           name, (long long)W, (long long)H, bytes[0], t[0][iters / 2], bytes[1], t[1][iters / 2],
           100.0 * ((double)bytes[0] / (double)bytes[1] - 1.0), t[1][iters / 2] / t[0][iters / 2]);
    rc = 0;
done:
    free(t[0]);
    free(t[1]);
    return rc;
}

/* A smooth colour field (a few low-frequency waves per channel), fine
 * texture and +-2 of noise. */
static uint8_t *synthetic(int64_t S, uint64_t seed)
{
    uint8_t *rgb = malloc((size_t)(S * S * 3));
    if (!rgb)
        return NULL;
    test_rng r = {seed};
    for (int64_t y = 0; y < S; y++)
        for (int64_t x = 0; x < S; x++)
            for (int c = 0; c < 3; c++) {
                const double u = (double)x / (double)S, v = (double)y / (double)S;
                double f = 128 + 60 * sin(6.3 * u * (c + 1) + 2.1 * v) +
                           40 * cos(4.7 * v * (3 - c) - 1.3 * u) + 8 * sin(90 * u + 70 * v);
                f += (double)(test_rng_next(&r) % 5) - 2.0;
                rgb[(y * S + x) * 3 + c] = (uint8_t)(f < 0 ? 0 : f > 255 ? 255 : f);
            }
    return rgb;
}

int main(int argc, char **argv)
{
    int iters = 9;
    static const struct option opts[] = {{"iters", required_argument, NULL, 'i'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 'i') {
            iters = atoi(optarg);
        } else {
            fprintf(stderr, "usage: bench_png [--iters N] [FILE.png ...]\n");
            return c == 'h' ? 0 : 2;
        }
    }
    if (iters < 1 || iters > 1000) {
        fprintf(stderr, "--iters takes 1 to 1000\n");
        return 2;
    }
    int rc = 0;
    if (optind == argc) {
        static const int64_t sides[3] = {256, 512, 1024};
        for (int i = 0; i < 3; i++) {
            uint8_t *rgb = synthetic(sides[i], 7 + (uint64_t)i);
            char name[32];
            snprintf(name, sizeof name, "synthetic %lld", (long long)sides[i]);
            rc |= !rgb || bench_image(name, rgb, sides[i], sides[i], iters);
            free(rgb);
        }
        return rc;
    }
    for (int i = optind; i < argc; i++) {
        FILE *f = fopen(argv[i], "rb");
        if (!f) {
            fprintf(stderr, "cannot open %s\n", argv[i]);
            rc = 1;
            continue;
        }
        fseek(f, 0, SEEK_END);
        const long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        uint8_t *bytes = n > 0 ? malloc((size_t)n) : NULL;
        uint8_t *rgb = NULL;
        int64_t H = 0, W = 0;
        dit_diag diag;
        dit_diag_clear(&diag);
        if (!bytes || fread(bytes, 1, (size_t)n, f) != (size_t)n ||
            dit_png_decode_rgb8(bytes, (size_t)n, &rgb, &H, &W, &diag) != DIT_OK) {
            fprintf(stderr, "cannot decode %s: %s\n", argv[i], dit_diag_msg(&diag));
            rc = 1;
        } else {
            const char *base = strrchr(argv[i], '/');
            rc |= bench_image(base ? base + 1 : argv[i], rgb, H, W, iters);
        }
        fclose(f);
        free(bytes);
        free(rgb);
    }
    return rc;
}
