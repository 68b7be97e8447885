/* PNG encoding and decoding through libpng, from and to memory. libpng
 * reports errors by longjmp-ing out of the call that failed; every entry
 * point here sets its jump buffer, records libpng's message in a context and
 * turns it into a dit_status. Everything touched after setjmp lives behind
 * pointers (the context structs), so no local needs to be volatile. */
#include "media/png.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <png.h>
#include <zlib.h>

/* Larger than any image this server makes, small enough that H * W * 3
 * fits comfortably in size_t and int. */
#define PNG_MAX_SIDE (1 << 16)

uint8_t dit_png_quantize(float x)
{
    /* torch: images * 0.5 + 0.5 in float32 (x * 0.5 is exact, so an FMA
     * contraction cannot change it), then clamp(0, 1), which keeps NaN. */
    float v = x * 0.5f + 0.5f;
    if (!(v == v))
        return 0;
    v = v < 0.0f ? 0.0f : (v > 1.0f ? 1.0f : v);
    /* numpy: (images * 255) in float32, then round() = rint in the default
     * round-to-nearest-even mode. */
    const float p = v * 255.0f;
    return (uint8_t)rintf(p);
}

void dit_png_to_rgb8(const float *chw, int64_t H, int64_t W, uint8_t *rgb)
{
    const int64_t plane = H * W;
    for (int64_t y = 0; y < H; y++)
        for (int64_t x = 0; x < W; x++) {
            const int64_t p = y * W + x;
            uint8_t *px = rgb + 3 * p;
            px[0] = dit_png_quantize(chw[p]);
            px[1] = dit_png_quantize(chw[plane + p]);
            px[2] = dit_png_quantize(chw[2 * plane + p]);
        }
}

/* ------------------------------------------------------------------------ */
/* libpng glue                                                               */

typedef struct png_ctx {
    char msg[256];
    /* Encoder output. */
    uint8_t *out;
    size_t len, cap;
    /* Decoder input. */
    const uint8_t *in;
    size_t in_len, in_pos;
} png_ctx;

static void on_error(png_structp png, png_const_charp msg)
{
    png_ctx *c = png_get_error_ptr(png);
    snprintf(c->msg, sizeof c->msg, "%s", msg ? msg : "libpng error");
    png_longjmp(png, 1);
}

static void on_warning(png_structp png, png_const_charp msg)
{
    (void)png;
    (void)msg; /* warnings (e.g. unknown chunks) do not affect the pixels */
}

static void on_write(png_structp png, png_bytep data, size_t n)
{
    png_ctx *c = png_get_io_ptr(png);
    if (n > c->cap - c->len) {
        size_t cap = c->cap ? c->cap : 4096;
        while (cap - c->len < n) {
            if (cap > SIZE_MAX / 2)
                png_error(png, "output too large");
            cap *= 2;
        }
        uint8_t *p = realloc(c->out, cap);
        if (!p)
            png_error(png, "out of memory");
        c->out = p;
        c->cap = cap;
    }
    memcpy(c->out + c->len, data, n);
    c->len += n;
}

static void on_flush(png_structp png)
{
    (void)png;
}

static void on_read(png_structp png, png_bytep data, size_t n)
{
    png_ctx *c = png_get_io_ptr(png);
    if (n > c->in_len - c->in_pos)
        png_error(png, "truncated PNG data");
    memcpy(data, c->in + c->in_pos, n);
    c->in_pos += n;
}

static bool side_ok(int64_t v)
{
    return v >= 1 && v <= PNG_MAX_SIDE;
}

/* ------------------------------------------------------------------------ */
/* Encoding                                                                  */

/* The libpng part of encoding; on a libpng error returns false with the
 * message in c->msg. Kept apart from the caller so that setjmp's frame
 * holds nothing but pointers that do not change after it. */
static bool encode_rows(png_structp png, png_infop info, png_ctx *c, const uint8_t *rgb, int64_t H,
                        int64_t W)
{
    if (setjmp(png_jmpbuf(png)))
        return false;
    png_set_write_fn(png, c, on_write, on_flush);
    png_set_IHDR(png, info, (png_uint_32)W, (png_uint_32)H, 8, PNG_COLOR_TYPE_RGB,
                 PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    /* The Paeth filter on every row, then deflate with run-length matches
     * only (Z_RLE): on photographic images as large as libpng's default
     * (all five filters tried per row, then deflate level 6) to within 2 %,
     * in a fifth to a seventh of the time (README, "PNG encoding"). */
    png_set_filter(png, PNG_FILTER_TYPE_BASE, PNG_FILTER_PAETH);
    png_set_compression_strategy(png, Z_RLE);
    png_write_info(png, info);
    for (int64_t y = 0; y < H; y++)
        png_write_row(png, rgb + (size_t)y * (size_t)W * 3);
    png_write_end(png, NULL);
    return true;
}

dit_status dit_png_encode_rgb8(const uint8_t *rgb, int64_t H, int64_t W, uint8_t **png_out,
                               size_t *len, dit_diag *diag)
{
    if (!rgb || !png_out || !len || !side_ok(H) || !side_ok(W))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "png: cannot encode a %lld x %lld image",
                            (long long)H, (long long)W);
    png_ctx c;
    memset(&c, 0, sizeof c);
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &c, on_error, on_warning);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!png || !info) {
        png_destroy_write_struct(png ? &png : NULL, NULL);
        return dit_diag_set(diag, DIT_ERR_NOMEM, "png: out of memory");
    }
    bool ok = encode_rows(png, info, &c, rgb, H, W);
    png_destroy_write_struct(&png, &info);
    if (!ok) {
        free(c.out);
        return dit_diag_set(diag, strstr(c.msg, "out of memory") ? DIT_ERR_NOMEM : DIT_ERR_INTERNAL,
                            "png: encoding failed: %s", c.msg);
    }
    *png_out = c.out;
    *len = c.len;
    return DIT_OK;
}

dit_status dit_png_encode_rgb(const float *chw, int64_t H, int64_t W, uint8_t **png, size_t *len,
                              dit_diag *diag)
{
    if (!chw || !side_ok(H) || !side_ok(W))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "png: cannot encode a %lld x %lld image",
                            (long long)H, (long long)W);
    uint8_t *rgb = malloc((size_t)H * (size_t)W * 3);
    if (!rgb)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "png: out of memory");
    dit_png_to_rgb8(chw, H, W, rgb);
    dit_status st = dit_png_encode_rgb8(rgb, H, W, png, len, diag);
    free(rgb);
    return st;
}

static dit_status errno_status(int err)
{
    switch (err) {
    case ENOENT:
    case ENOTDIR:
        return DIT_ERR_NOT_FOUND;
    case ENOMEM:
        return DIT_ERR_NOMEM;
    default:
        return DIT_ERR_IO;
    }
}

dit_status dit_png_write_file(const char *path, const uint8_t *buf, size_t len, dit_diag *diag)
{
    char *tmp = NULL;
    int fd = -1;
    dit_status st = DIT_OK;
    if (!path || (!buf && len))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "png: nothing to write");
    /* A name unique to this thread, in the target's folder so that rename()
     * stays within one file system; O_EXCL refuses to reuse a leftover. */
    if (asprintf(&tmp, "%s.tmp.%ld.%ld", path, (long)getpid(), (long)gettid()) < 0) {
        tmp = NULL;
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "png: out of memory");
        goto cleanup;
    }
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        int err = errno;
        st = dit_diag_set(diag, errno_status(err), "cannot create %s: %s", tmp, strerror(err));
        goto cleanup;
    }
    for (size_t off = 0; off < len;) {
        ssize_t n = write(fd, buf + off, len - off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            int err = n < 0 ? errno : EIO;
            st = dit_diag_set(diag, errno_status(err), "cannot write %s: %s", tmp, strerror(err));
            goto cleanup;
        }
        off += (size_t)n;
    }
    /* fsync before rename, or a crash may leave `path` naming an empty file. */
    int err = fsync(fd) != 0 ? errno : 0;
    if (close(fd) != 0 && !err)
        err = errno;
    fd = -1;
    if (err) {
        st = dit_diag_set(diag, errno_status(err), "cannot write %s: %s", tmp, strerror(err));
        goto cleanup;
    }
    if (rename(tmp, path) != 0) {
        err = errno;
        st = dit_diag_set(diag, errno_status(err), "cannot rename %s to %s: %s", tmp, path,
                          strerror(err));
        goto cleanup;
    }
    free(tmp);
    tmp = NULL;
cleanup:
    if (fd >= 0)
        close(fd);
    if (tmp) {
        unlink(tmp);
        free(tmp);
    }
    return st;
}

/* ------------------------------------------------------------------------ */
/* Decoding                                                                  */

typedef struct decode_out {
    uint8_t *rgb;
    png_bytep *rows;
    png_uint_32 w, h;
    const char *why; /* set when the image is refused without a libpng error */
} decode_out;

static bool decode_rows(png_structp png, png_infop info, png_ctx *c, decode_out *o)
{
    if (setjmp(png_jmpbuf(png)))
        return false;
    png_set_read_fn(png, c, on_read);
    png_read_info(png, info);
    int depth, color, interlace;
    png_get_IHDR(png, info, &o->w, &o->h, &depth, &color, &interlace, NULL, NULL);
    if (!side_ok(o->w) || !side_ok(o->h)) {
        o->why = "image size out of range";
        return true;
    }
    /* Whatever the file holds, hand back 8-bit RGB. */
    png_set_expand(png);
    png_set_strip_16(png);
    png_set_strip_alpha(png);
    if (color == PNG_COLOR_TYPE_GRAY || color == PNG_COLOR_TYPE_GRAY_ALPHA)
        png_set_gray_to_rgb(png);
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
    if (png_get_rowbytes(png, info) != (size_t)o->w * 3) {
        o->why = "unexpected row layout after conversion to RGB";
        return true;
    }
    o->rgb = malloc((size_t)o->h * o->w * 3);
    o->rows = malloc((size_t)o->h * sizeof *o->rows);
    if (!o->rgb || !o->rows)
        png_error(png, "out of memory");
    for (png_uint_32 y = 0; y < o->h; y++)
        o->rows[y] = o->rgb + (size_t)y * o->w * 3;
    png_read_image(png, o->rows);
    png_read_end(png, NULL);
    return true;
}

dit_status dit_png_decode_rgb8(const uint8_t *data, size_t len, uint8_t **rgb, int64_t *H,
                               int64_t *W, dit_diag *diag)
{
    if (!data || !rgb || !H || !W)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "png: nothing to decode");
    if (len < 8 || png_sig_cmp(data, 0, 8) != 0)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "png: not a PNG (bad signature)");
    png_ctx c;
    memset(&c, 0, sizeof c);
    c.in = data;
    c.in_len = len;
    decode_out o;
    memset(&o, 0, sizeof o);
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &c, on_error, on_warning);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!png || !info) {
        png_destroy_read_struct(png ? &png : NULL, NULL, NULL);
        return dit_diag_set(diag, DIT_ERR_NOMEM, "png: out of memory");
    }
    bool ok = decode_rows(png, info, &c, &o);
    png_destroy_read_struct(&png, &info, NULL);
    free(o.rows);
    if (!ok || o.why) {
        free(o.rgb);
        if (!ok)
            return dit_diag_set(diag,
                                strstr(c.msg, "out of memory") ? DIT_ERR_NOMEM : DIT_ERR_FORMAT,
                                "png: decoding failed: %s", c.msg);
        return dit_diag_set(diag, DIT_ERR_FORMAT, "png: %s", o.why);
    }
    *rgb = o.rgb;
    *H = o.h;
    *W = o.w;
    return DIT_OK;
}
