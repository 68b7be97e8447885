/* The AutoencoderKL decoder and PNG output against diffusers.
 *
 * decode:  every case under tests/data/vae (written by
 *          tests/golden/gen_vae_golden.py) is decoded on the cpu backend and
 *          compared with diffusers' float32 vae.decode: max|ours - ref| /
 *          max|ref| <= 1e-5.
 * png:     the postprocess quantisation (x * 0.5 + 0.5, clamp, * 255,
 *          round half to even) must reproduce the PIL images diffusers
 *          saved, byte for byte, including crafted exact ties.
 * load:    every way a checkpoint or config.json can disagree with the
 *          decoder is an error naming the tensor or key; the cases are made by
 *          rewriting a fixture into a temporary folder. */
#include <check.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/arena.h"
#include "media/png.h"
#include "loader/safetensors.h"
#include "vae/autoencoder_kl.h"

#define VAE_REL_TOL 1e-5

typedef struct vae_case {
    const char *name;
    int scale, latent;
    float scaling, shift;
} vae_case;

static const vae_case cases[] = {
    {"flux_like", 8, 16, 0.3611f, 0.1159f},
    {"sd_like", 4, 4, 0.18215f, 0.0f},
    {"no_attn_f16", 2, 8, 0.5f, -0.25f},
};
enum { N_CASES = sizeof cases / sizeof cases[0] };

static char data_dir[1024];
static dit_backend *be;

static void setup(void)
{
    const char *root = getenv("DIT_SOURCE_ROOT");
    ck_assert_msg(root != NULL, "DIT_SOURCE_ROOT is not set");
    snprintf(data_dir, sizeof data_dir, "%s/tests/data/vae", root);
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&cfg, &be, NULL), DIT_OK);
}

static void teardown(void)
{
    dit_backend_destroy(be);
    be = NULL;
}

static uint8_t *read_bytes(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    uint8_t *buf = malloc((size_t)n + 1);
    ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    buf[n] = 0;
    *len = (size_t)n;
    return buf;
}

/* A PNG file's pixels as 8-bit RGB. */
static uint8_t *read_png(const char *path, int64_t *H, int64_t *W)
{
    size_t len;
    uint8_t *bytes = read_bytes(path, &len), *rgb = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_png_decode_rgb8(bytes, len, &rgb, H, W, &diag) == DIT_OK, "%s: %s", path,
                  dit_diag_msg(&diag));
    free(bytes);
    return rgb;
}

/* ------------------------------------------------------------------------ */
/* Decoding                                                                  */

typedef struct decoded {
    float *got;       /* host copy of our image */
    int64_t n;        /* elements */
    dit_tensor shape; /* of the reference, data NULL */
    double max_abs, max_ref;
    size_t high_water, workspace;
} decoded;

/* Decodes io.safetensors' z<k> with the case's decoder. */
static decoded decode_case(const char *name, int k)
{
    char vdir[1200], io[1200], key[16];
    snprintf(vdir, sizeof vdir, "%s/%s/vae", data_dir, name);
    snprintf(io, sizeof io, "%s/%s/io.safetensors", data_dir, name);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_vae_decoder *v = NULL;
    ck_assert_msg(dit_vae_decoder_load(be, vdir, &v, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_st_file *f = NULL;
    ck_assert_msg(dit_st_file_open(io, &f, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    snprintf(key, sizeof key, "z%d", k);
    const dit_st_entry *ez = dit_st_file_find(f, key);
    snprintf(key, sizeof key, "image%d", k);
    const dit_st_entry *ei = dit_st_file_find(f, key);
    ck_assert_ptr_nonnull(ez);
    ck_assert_ptr_nonnull(ei);

    dit_tensor z = ez->view, img = ei->view;
    void *zb = NULL, *ib = NULL;
    ck_assert_int_eq(dit_backend_alloc(be, dit_tensor_nbytes(&z), &zb), DIT_OK);
    ck_assert_int_eq(dit_backend_alloc(be, dit_tensor_nbytes(&img), &ib), DIT_OK);
    z.data = zb;
    img.data = ib;
    ck_assert_int_eq(be->ops->upload(be, &z, &ez->view), DIT_OK);
    ck_assert_int_eq(be->ops->fill(be, &img, NAN), DIT_OK);

    dit_arena *arena = NULL;
    ck_assert_int_eq(dit_arena_create(be, 0, &arena), DIT_OK);
    ck_assert_msg(dit_vae_decode(v, arena, &z, &img, &diag) == DIT_OK, "%s: %s", name,
                  dit_diag_msg(&diag));

    decoded d;
    memset(&d, 0, sizeof d);
    d.n = dit_tensor_numel(&img);
    d.got = malloc((size_t)d.n * sizeof(float));
    dit_tensor host = dit_tensor_make(d.got, DIT_F32, 4, img.ne);
    ck_assert_int_eq(be->ops->download(be, &host, &img), DIT_OK);
    d.shape = ei->view;
    d.shape.data = NULL;
    float ref;
    for (int64_t i = 0; i < d.n; i++) {
        memcpy(&ref, (const char *)ei->view.data + i * 4, 4);
        double diff = isnan(d.got[i]) ? INFINITY : fabs((double)d.got[i] - ref);
        d.max_abs = diff > d.max_abs ? diff : d.max_abs;
        d.max_ref = fabs(ref) > d.max_ref ? fabs(ref) : d.max_ref;
    }
    d.high_water = dit_arena_high_water(arena);
    d.workspace = dit_vae_decode_workspace(v, z.ne[2], z.ne[3]);

    dit_arena_destroy(arena);
    dit_backend_free(be, zb);
    dit_backend_free(be, ib);
    dit_st_file_close(f);
    dit_vae_decoder_free(v);
    return d;
}

START_TEST(decode_matches_diffusers)
{
    const vae_case *c = &cases[_i / 2];
    const int k = _i % 2;
    decoded d = decode_case(c->name, k);
    const double rel = d.max_abs / d.max_ref;
    printf("vae %-12s image%d (%lld, %lld, %lld, %lld): max abs %.3g, max|ref| %.3g, rel %.3g; "
           "arena %zu of %zu bytes planned\n",
           c->name, k, (long long)d.shape.ne[0], (long long)d.shape.ne[1], (long long)d.shape.ne[2],
           (long long)d.shape.ne[3], d.max_abs, d.max_ref, rel, d.high_water, d.workspace);
    fflush(stdout);
    ck_assert_msg(rel <= VAE_REL_TOL, "%s image%d: relative error %.3g exceeds %.1g", c->name, k,
                  rel, VAE_REL_TOL);
    /* dit_vae_decode_workspace is a true bound: callers size arenas by it. */
    ck_assert_uint_le(d.high_water, d.workspace);
    free(d.got);
}
END_TEST

START_TEST(config_accessors)
{
    for (int i = 0; i < N_CASES; i++) {
        char vdir[1200];
        snprintf(vdir, sizeof vdir, "%s/%s/vae", data_dir, cases[i].name);
        dit_vae_decoder *v = NULL;
        dit_diag diag;
        dit_diag_clear(&diag);
        ck_assert_msg(dit_vae_decoder_load(be, vdir, &v, &diag) == DIT_OK, "%s",
                      dit_diag_msg(&diag));
        ck_assert_int_eq(dit_vae_scale_factor(v), cases[i].scale);
        ck_assert_int_eq(dit_vae_latent_channels(v), cases[i].latent);
        ck_assert_int_eq(dit_vae_out_channels(v), 3);
        ck_assert_float_eq(dit_vae_scaling_factor(v), cases[i].scaling);
        ck_assert_float_eq(dit_vae_shift_factor(v), cases[i].shift);
        ck_assert_uint_gt(dit_vae_weight_bytes(v), 0);
        dit_vae_decoder_free(v);
    }
    dit_vae_decoder_free(NULL);
}
END_TEST

START_TEST(decode_rejects_bad_shapes)
{
    char vdir[1200];
    snprintf(vdir, sizeof vdir, "%s/sd_like/vae", data_dir);
    dit_vae_decoder *v = NULL;
    ck_assert_int_eq(dit_vae_decoder_load(be, vdir, &v, NULL), DIT_OK);
    dit_arena *arena = NULL;
    ck_assert_int_eq(dit_arena_create(be, 0, &arena), DIT_OK);
    float zbuf[2 * 5 * 3 * 3], ibuf[2 * 3 * 12 * 12];
    dit_diag diag;

    /* 5 latent channels for a 4-channel VAE. */
    dit_tensor z = dit_tensor_4d(zbuf, DIT_F32, 1, 5, 3, 3);
    dit_tensor img = dit_tensor_4d(ibuf, DIT_F32, 1, 3, 12, 12);
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_vae_decode(v, arena, &z, &img, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(diag.msg, "'z' is (1, 5, 3, 3)") && strstr(diag.msg, "(1, 4, 3, 3)"), "%s",
                  diag.msg);

    /* Output at the wrong resolution (scale 4: 3x3 -> 12x12, not 6x6). */
    z = dit_tensor_4d(zbuf, DIT_F32, 1, 4, 3, 3);
    img = dit_tensor_4d(ibuf, DIT_F32, 1, 3, 6, 6);
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_vae_decode(v, arena, &z, &img, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(diag.msg, "'image (output)'") && strstr(diag.msg, "(1, 3, 12, 12)"), "%s",
                  diag.msg);

    /* Batch mismatch between z and image. */
    z = dit_tensor_4d(zbuf, DIT_F32, 2, 4, 3, 3);
    img = dit_tensor_4d(ibuf, DIT_F32, 1, 3, 12, 12);
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_vae_decode(v, arena, &z, &img, &diag), DIT_ERR_INVALID_ARG);

    /* A strided (non-contiguous) z. */
    dit_tensor big = dit_tensor_4d(zbuf, DIT_F32, 1, 4, 3, 6);
    z = dit_tensor_narrow(&big, 3, 0, 3);
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_vae_decode(v, arena, &z, &img, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(diag.msg, "strided"), "%s", diag.msg);

    /* Wrong dtype. */
    z = dit_tensor_4d(zbuf, DIT_BF16, 1, 4, 3, 3);
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_vae_decode(v, arena, &z, &img, &diag), DIT_ERR_INVALID_ARG);

    /* The arena is left as it was found. */
    ck_assert_uint_eq(dit_arena_high_water(arena), 0);
    dit_arena_destroy(arena);
    dit_vae_decoder_free(v);
}
END_TEST

/* ------------------------------------------------------------------------ */
/* PNG                                                                       */

START_TEST(quantize_matches_numpy_rules)
{
    ck_assert_uint_eq(dit_png_quantize(-1.0f), 0);
    ck_assert_uint_eq(dit_png_quantize(1.0f), 255);
    ck_assert_uint_eq(dit_png_quantize(-7.0f), 0);
    ck_assert_uint_eq(dit_png_quantize(7.0f), 255);
    ck_assert_uint_eq(dit_png_quantize(INFINITY), 255);
    ck_assert_uint_eq(dit_png_quantize(-INFINITY), 0);
    ck_assert_uint_eq(dit_png_quantize(NAN), 0);
    /* 0 -> 0.5 * 255 = 127.5 exactly: half to even gives 128. */
    ck_assert_uint_eq(dit_png_quantize(0.0f), 128);
    /* x = 2 * 2.5/255 - 1 is a tie at 2.5 -> 2 (even), not 3. */
    float x = 2.0f * (2.5f / 255.0f) - 1.0f;
    float p = (x * 0.5f + 0.5f) * 255.0f;
    if (p == 2.5f)
        ck_assert_uint_eq(dit_png_quantize(x), 2);
}
END_TEST

/* Pixels of `a` and `b` (n bytes each) that differ. */
static size_t count_diff(const uint8_t *a, const uint8_t *b, size_t n)
{
    size_t d = 0;
    for (size_t i = 0; i < n; i++)
        d += a[i] != b[i];
    return d;
}

/* Encodes chw (3, H, W), decodes the PNG again and returns its pixels. */
static uint8_t *png_round_trip(const float *chw, int64_t H, int64_t W)
{
    uint8_t *png = NULL, *rgb = NULL;
    size_t len = 0;
    int64_t h = 0, w = 0;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_png_encode_rgb(chw, H, W, &png, &len, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    ck_assert_uint_gt(len, 8);
    ck_assert_msg(dit_png_decode_rgb8(png, len, &rgb, &h, &w, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    ck_assert_int_eq(h, H);
    ck_assert_int_eq(w, W);
    /* The bytes PNG stored are exactly dit_png_to_rgb8's. */
    uint8_t *direct = malloc((size_t)(H * W * 3));
    dit_png_to_rgb8(chw, H, W, direct);
    ck_assert_uint_eq(count_diff(direct, rgb, (size_t)(H * W * 3)), 0);
    free(direct);
    free(png);
    return rgb;
}

/* A host (3, H, W) float copy of image<k>[b] from a case's io.safetensors. */
static float *reference_image(const char *name, int k, int b, int64_t *H, int64_t *W)
{
    char io[1200], key[16];
    snprintf(io, sizeof io, "%s/%s/io.safetensors", data_dir, name);
    dit_st_file *f = NULL;
    ck_assert_int_eq(dit_st_file_open(io, &f, NULL), DIT_OK);
    snprintf(key, sizeof key, "image%d", k);
    const dit_st_entry *e = dit_st_file_find(f, key);
    ck_assert_ptr_nonnull(e);
    *H = e->view.ne[2];
    *W = e->view.ne[3];
    size_t n = (size_t)(3 * *H * *W);
    float *out = malloc(n * sizeof *out);
    memcpy(out, (const char *)e->view.data + (size_t)b * n * 4, n * 4);
    dit_st_file_close(f);
    return out;
}

START_TEST(png_of_crafted_values_matches_pil)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/postprocess/postprocess.safetensors", data_dir);
    dit_st_file *f = NULL;
    ck_assert_int_eq(dit_st_file_open(path, &f, NULL), DIT_OK);
    const dit_st_entry *e = dit_st_file_find(f, "x");
    ck_assert_ptr_nonnull(e);
    const int64_t H = e->view.ne[2], W = e->view.ne[3];
    float *x = malloc((size_t)(3 * H * W) * sizeof *x);
    memcpy(x, e->view.data, (size_t)(3 * H * W) * 4);
    dit_st_file_close(f);

    uint8_t *ours = png_round_trip(x, H, W);
    int64_t h, w;
    snprintf(path, sizeof path, "%s/postprocess/postprocess.png", data_dir);
    uint8_t *pil = read_png(path, &h, &w);
    ck_assert_int_eq(h, H);
    ck_assert_int_eq(w, W);
    size_t bad = 0, ties = 0;
    for (int64_t c = 0; c < 3; c++)
        for (int64_t i = 0; i < H * W; i++) {
            const float xv = x[c * H * W + i];
            const uint8_t o = ours[i * 3 + c], p = pil[i * 3 + c];
            const float t = (xv * 0.5f + 0.5f) * 255.0f;
            ties += t == floorf(t) + 0.5f;
            if (o != p && bad++ < 5)
                fprintf(stderr, "postprocess: x = %.9g -> ours %u, PIL %u\n", (double)xv, o, p);
        }
    printf("png postprocess: %lld values (%zu exact .5 ties), %zu differ from PIL\n",
           (long long)(3 * H * W), ties, bad);
    ck_assert_uint_eq(bad, 0);
    ck_assert_uint_gt(ties, 100);
    free(x);
    free(ours);
    free(pil);
}
END_TEST

START_TEST(png_of_reference_image_matches_expected)
{
    int64_t H, W, h, w;
    float *ref = reference_image("flux_like", 0, 0, &H, &W);
    uint8_t *ours = png_round_trip(ref, H, W);
    char path[1200];
    snprintf(path, sizeof path, "%s/flux_like/expected.png", data_dir);
    uint8_t *pil = read_png(path, &h, &w);
    ck_assert_int_eq(h, H);
    ck_assert_int_eq(w, W);
    size_t bad = count_diff(ours, pil, (size_t)(H * W * 3));
    printf("png of diffusers' image0: %lld values, %zu differ from expected.png\n",
           (long long)(H * W * 3), bad);
    ck_assert_uint_eq(bad, 0);
    free(ref);
    free(ours);
    free(pil);
}
END_TEST

/* Our decoded image through the PNG path, against diffusers' PNG. A value
 * may differ only where diffusers' own value sits within the decode error of
 * a rounding boundary (k + 0.5 after scaling): the f32 decode is equal to
 * 1e-5 relative, not bit for bit. */
START_TEST(png_of_decoded_image_matches_expected)
{
    decoded d = decode_case("flux_like", 0);
    const int64_t H = d.shape.ne[2], W = d.shape.ne[3];
    int64_t h, w, H2, W2;
    float *ref = reference_image("flux_like", 0, 0, &H2, &W2);
    uint8_t *ours = png_round_trip(d.got, H, W);
    char path[1200];
    snprintf(path, sizeof path, "%s/flux_like/expected.png", data_dir);
    uint8_t *pil = read_png(path, &h, &w);
    ck_assert_int_eq(h, H);
    ck_assert_int_eq(w, W);
    /* |d(255 (x/2 + 1/2))| = 127.5 |dx|, plus a little for f32 rounding. */
    const double slack = 127.5 * d.max_abs + 1e-4;
    size_t bad = 0, excused = 0;
    double nearest = INFINITY;
    for (int64_t c = 0; c < 3; c++)
        for (int64_t i = 0; i < H * W; i++) {
            const double t = ((double)ref[c * H * W + i] * 0.5 + 0.5) * 255.0;
            const double to_boundary = fabs(t - floor(t) - 0.5);
            if (t > 0 && t < 255 && to_boundary < nearest)
                nearest = to_boundary;
            if (ours[i * 3 + c] == pil[i * 3 + c])
                continue;
            if (abs((int)ours[i * 3 + c] - (int)pil[i * 3 + c]) == 1 && to_boundary <= slack)
                excused++;
            else
                bad++;
        }
    printf("png of decoded image0: %lld values, %zu differ (%zu within %.2g of a rounding "
           "boundary, %zu unexplained); nearest reference value to a boundary: %.3g\n",
           (long long)(H * W * 3), bad + excused, excused, slack, bad, nearest);
    ck_assert_uint_eq(bad, 0);
    free(d.got);
    free(ref);
    free(ours);
    free(pil);
}
END_TEST

START_TEST(png_write_file_is_atomic_and_readable)
{
    char dir[64] = "/tmp/dit_png_XXXXXX", path[128];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/out.png", dir);
    int64_t H, W, h, w;
    float *ref = reference_image("sd_like", 1, 1, &H, &W);
    dit_diag diag;
    dit_diag_clear(&diag);
    uint8_t *png = NULL;
    size_t len = 0;
    ck_assert_int_eq(dit_png_encode_rgb(ref, H, W, &png, &len, NULL), DIT_OK);
    ck_assert_msg(dit_png_write_file(path, png, len, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    /* Overwriting an existing file works too (rename replaces it). */
    ck_assert_msg(dit_png_write_file(path, png, len, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    uint8_t *got = read_png(path, &h, &w);
    ck_assert_int_eq(h, H);
    ck_assert_int_eq(w, W);
    uint8_t *want = malloc((size_t)(H * W * 3));
    dit_png_to_rgb8(ref, H, W, want);
    ck_assert_uint_eq(count_diff(got, want, (size_t)(H * W * 3)), 0);

    /* Nothing but out.png is left in the folder. */
    DIR *dp = opendir(dir);
    struct dirent *de;
    int n = 0;
    while ((de = readdir(dp)))
        if (de->d_name[0] != '.') {
            ck_assert_str_eq(de->d_name, "out.png");
            n++;
        }
    closedir(dp);
    ck_assert_int_eq(n, 1);

    /* A folder that does not exist. */
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_png_write_file("/nonexistent/dir/out.png", png, len, &diag),
                     DIT_ERR_NOT_FOUND);
    ck_assert_ptr_nonnull(strstr(diag.msg, "/nonexistent/dir/out.png"));

    unlink(path);
    rmdir(dir);
    free(png);
    free(ref);
    free(got);
    free(want);
}
END_TEST

START_TEST(png_errors)
{
    dit_diag diag;
    uint8_t *out = NULL;
    size_t len = 0;
    int64_t h, w;
    float px[3] = {0, 0, 0};

    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_png_encode_rgb(px, 0, 1, &out, &len, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(diag.msg, "0 x 1"));

    const uint8_t junk[16] = "not a png file!";
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_png_decode_rgb8(junk, sizeof junk, &out, &h, &w, &diag), DIT_ERR_FORMAT);
    ck_assert_ptr_nonnull(strstr(diag.msg, "not a PNG"));

    /* A valid PNG cut short: libpng's longjmp comes back as a status. */
    uint8_t *png = NULL;
    ck_assert_int_eq(dit_png_encode_rgb(px, 1, 1, &png, &len, NULL), DIT_OK);
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_png_decode_rgb8(png, len / 2, &out, &h, &w, &diag), DIT_ERR_FORMAT);
    ck_assert_msg(strstr(diag.msg, "decoding failed"), "%s", diag.msg);

    /* A corrupted chunk CRC. */
    png[20] ^= 0xff; /* inside IHDR's data */
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_png_decode_rgb8(png, len, &out, &h, &w, &diag), DIT_ERR_FORMAT);
    ck_assert_msg(strstr(diag.msg, "decoding failed"), "%s", diag.msg);
    free(png);
}
END_TEST

/* ------------------------------------------------------------------------ */
/* Loading errors                                                            */

static char src_dir[1200];
static char tmp_dir[64];

static void load_setup(void)
{
    setup();
    snprintf(src_dir, sizeof src_dir, "%s/sd_like/vae", data_dir);
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/dit_vae_load_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(tmp_dir));
}

static void load_teardown(void)
{
    char p[256];
    snprintf(p, sizeof p, "%s/config.json", tmp_dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/diffusion_pytorch_model.safetensors", tmp_dir);
    unlink(p);
    rmdir(tmp_dir);
    teardown();
}

static void write_file(const char *name, const char *text)
{
    char p[256];
    snprintf(p, sizeof p, "%s/%s", tmp_dir, name);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

static char *source_config(void)
{
    char p[1300];
    size_t len;
    snprintf(p, sizeof p, "%s/config.json", src_dir);
    return (char *)read_bytes(p, &len);
}

/* Writes the source config with the first `from` replaced by `to`. */
static void write_config_edit(const char *from, const char *to)
{
    char *text = source_config();
    char *at = from ? strstr(text, from) : NULL;
    if (from)
        ck_assert_msg(at != NULL, "'%s' not in config.json", from);
    char *out = malloc(strlen(text) + (to ? strlen(to) : 0) + 1);
    if (at) {
        size_t pre = (size_t)(at - text);
        memcpy(out, text, pre);
        strcpy(out + pre, to);
        strcat(out, at + strlen(from));
    } else {
        strcpy(out, text);
    }
    write_file("config.json", out);
    free(out);
    free(text);
}

typedef enum edit_kind {
    EDIT_NONE,
    EDIT_DROP,
    EDIT_EXTRA,
    EDIT_RESHAPE,
    EDIT_DROP_PREFIX
} edit_kind;

/* Rewrites the source weights into tmp_dir with one edit applied to `name`
 * (EDIT_DROP_PREFIX drops every tensor whose name starts with it). */
static void write_weights(edit_kind kind, const char *name)
{
    char p[1300];
    snprintf(p, sizeof p, "%s/diffusion_pytorch_model.safetensors", src_dir);
    dit_st_file *f;
    ck_assert_int_eq(dit_st_file_open(p, &f, NULL), DIT_OK);
    size_t n = dit_st_file_count(f);
    dit_st_write_item *items = calloc(n + 1, sizeof *items);
    dit_tensor *views = calloc(n + 1, sizeof *views);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const dit_st_entry *e = dit_st_file_at(f, i);
        bool hit = strcmp(e->name, name) == 0;
        if (hit && kind == EDIT_DROP)
            continue;
        if (kind == EDIT_DROP_PREFIX && strncmp(e->name, name, strlen(name)) == 0)
            continue;
        views[k] = e->view;
        if (hit && kind == EDIT_RESHAPE)
            views[k] = dit_tensor_narrow(&e->view, 0, 0, e->view.ne[0] - 1);
        items[k].name = e->name;
        items[k].tensor = &views[k];
        k++;
    }
    if (kind == EDIT_EXTRA) {
        views[k] = dit_st_file_at(f, 0)->view;
        items[k].name = name;
        items[k].tensor = &views[k];
        k++;
    }
    snprintf(p, sizeof p, "%s/diffusion_pytorch_model.safetensors", tmp_dir);
    ck_assert_int_eq(dit_st_write(p, items, k, NULL), DIT_OK);
    free(items);
    free(views);
    dit_st_file_close(f);
}

static void expect_ok(void)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_vae_decoder *v = NULL;
    ck_assert_msg(dit_vae_decoder_load(be, tmp_dir, &v, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    ck_assert_ptr_nonnull(v);
    dit_vae_decoder_free(v);
}

static void expect_error(dit_status want, const char *needle1, const char *needle2)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_vae_decoder *v = (dit_vae_decoder *)&diag; /* must come back NULL */
    dit_status st = dit_vae_decoder_load(be, tmp_dir, &v, &diag);
    ck_assert_ptr_null(v);
    ck_assert_msg(st == want, "status %s, want %s (%s)", dit_status_name(st), dit_status_name(want),
                  dit_diag_msg(&diag));
    ck_assert_msg(strstr(diag.msg, needle1), "'%s' not in: %s", needle1, diag.msg);
    if (needle2)
        ck_assert_msg(strstr(diag.msg, needle2), "'%s' not in: %s", needle2, diag.msg);
}

START_TEST(unmodified_copy_loads)
{
    write_config_edit(NULL, NULL);
    write_weights(EDIT_NONE, "");
    expect_ok();
}
END_TEST

START_TEST(encoder_tensors_are_optional_and_ignored)
{
    write_config_edit(NULL, NULL);
    /* A decoder-only checkpoint loads... */
    write_weights(EDIT_DROP_PREFIX, "encoder.");
    expect_ok();
    /* ...and unknown tensors under encoder. / quant_conv. are not checked. */
    write_weights(EDIT_EXTRA, "encoder.down_blocks.9.whatever.weight");
    expect_ok();
    write_weights(EDIT_EXTRA, "quant_conv.extra");
    expect_ok();
}
END_TEST

START_TEST(missing_tensor_is_named)
{
    write_config_edit(NULL, NULL);
    write_weights(EDIT_DROP, "decoder.mid_block.attentions.0.to_k.weight");
    expect_error(DIT_ERR_FORMAT, "'decoder.mid_block.attentions.0.to_k.weight' is missing", NULL);
    write_weights(EDIT_DROP, "decoder.up_blocks.2.resnets.0.conv_shortcut.bias");
    expect_error(DIT_ERR_FORMAT, "'decoder.up_blocks.2.resnets.0.conv_shortcut.bias' is missing",
                 NULL);
    write_weights(EDIT_DROP, "post_quant_conv.weight");
    expect_error(DIT_ERR_FORMAT, "'post_quant_conv.weight' is missing", NULL);
}
END_TEST

START_TEST(wrong_shape_is_named)
{
    write_config_edit(NULL, NULL);
    write_weights(EDIT_RESHAPE, "decoder.conv_in.weight");
    expect_error(DIT_ERR_FORMAT, "'decoder.conv_in.weight' has shape (15, 4, 3, 3)",
                 "config.json implies (16, 4, 3, 3)");
    write_weights(EDIT_RESHAPE, "decoder.up_blocks.1.resnets.1.norm2.bias");
    expect_error(DIT_ERR_FORMAT, "'decoder.up_blocks.1.resnets.1.norm2.bias' has shape (15)",
                 "(16)");
}
END_TEST

START_TEST(unexpected_tensor_is_named)
{
    write_config_edit(NULL, NULL);
    write_weights(EDIT_EXTRA, "decoder.up_blocks.3.resnets.0.conv1.weight");
    expect_error(DIT_ERR_FORMAT, "unexpected tensor 'decoder.up_blocks.3.resnets.0.conv1.weight'",
                 "diffusion_pytorch_model.safetensors");
    write_weights(EDIT_EXTRA, "post_quant_conv.scale");
    expect_error(DIT_ERR_FORMAT, "unexpected tensor 'post_quant_conv.scale'", NULL);
    write_weights(EDIT_EXTRA, "something_else.weight");
    expect_error(DIT_ERR_FORMAT, "unexpected tensor 'something_else.weight'", NULL);
}
END_TEST

START_TEST(config_that_disagrees_with_weights)
{
    write_weights(EDIT_NONE, "");
    /* The checkpoint has a post_quant_conv the config says is not there. */
    write_config_edit("\"use_post_quant_conv\": true", "\"use_post_quant_conv\": false");
    expect_error(DIT_ERR_FORMAT, "unexpected tensor 'post_quant_conv.", NULL);
    /* One resnet more per up block than the checkpoint has. */
    write_config_edit("\"layers_per_block\": 1", "\"layers_per_block\": 2");
    expect_error(DIT_ERR_FORMAT, "resnets.2.", "does config.json belong");
    /* No mid-block attention in the config, but its tensors are present. */
    write_config_edit("\"mid_block_add_attention\": true", "\"mid_block_add_attention\": false");
    expect_error(DIT_ERR_FORMAT, "unexpected tensor 'decoder.mid_block.attentions.0.", NULL);
    /* Another latent width: conv_in and post_quant_conv no longer fit. */
    write_config_edit("\"latent_channels\": 4", "\"latent_channels\": 8");
    expect_error(DIT_ERR_FORMAT, "has shape", "config.json implies");
}
END_TEST

START_TEST(bad_configs)
{
    write_weights(EDIT_NONE, "");
    write_file("config.json", "{\"block_out_channels\": [8,");
    expect_error(DIT_ERR_FORMAT, "config.json", "invalid JSON");
    write_file("config.json", "[1, 2]");
    expect_error(DIT_ERR_FORMAT, "not a JSON object", NULL);
    write_config_edit("\"AutoencoderKL\"", "\"AutoencoderKLQwenImage\"");
    expect_error(DIT_ERR_UNSUPPORTED, "AutoencoderKLQwenImage", NULL);
    write_config_edit("\"UpDecoderBlock2D\"", "\"AttnUpDecoderBlock2D\"");
    expect_error(DIT_ERR_UNSUPPORTED, "\"up_block_types\"[0] is \"AttnUpDecoderBlock2D\"", NULL);
    write_config_edit("\"UpDecoderBlock2D\",", "");
    expect_error(DIT_ERR_FORMAT, "\"up_block_types\" has 2 entries", NULL);
    write_config_edit("\"norm_num_groups\": 8", "\"norm_num_groups\": 3");
    expect_error(DIT_ERR_FORMAT, "\"norm_num_groups\" = 3 does not divide", NULL);
    write_config_edit("\"act_fn\": \"silu\"", "\"act_fn\": \"gelu\"");
    expect_error(DIT_ERR_UNSUPPORTED, "\"act_fn\" is \"gelu\"", NULL);
    write_config_edit("\"layers_per_block\": 1", "\"layers_per_block\": -1");
    expect_error(DIT_ERR_FORMAT, "\"layers_per_block\"", NULL);
    write_config_edit("\"layers_per_block\": 1", "\"layers_per_block\": 1.5");
    expect_error(DIT_ERR_FORMAT, "\"layers_per_block\" must be an integer", NULL);
    write_config_edit("\"use_post_quant_conv\": true", "\"use_post_quant_conv\": \"yes\"");
    expect_error(DIT_ERR_FORMAT, "use_post_quant_conv", NULL);
    write_config_edit("\"scaling_factor\": 0.18215", "\"scaling_factor\": 0");
    expect_error(DIT_ERR_FORMAT, "\"scaling_factor\" must be positive", NULL);
    write_file("config.json", "{\"block_out_channels\": [8, 8, 8, 8, 8, 8, 8, 8, 8]}");
    expect_error(DIT_ERR_FORMAT, "\"block_out_channels\" has 9 entries", NULL);
    write_file("config.json", "{\"block_out_channels\": [8, 0], "
                              "\"up_block_types\": [\"UpDecoderBlock2D\", \"UpDecoderBlock2D\"]}");
    expect_error(DIT_ERR_FORMAT, "\"block_out_channels\"[1] = 0", NULL);
    write_file("config.json", "{\"block_out_channels\": [8, 8]}");
    expect_error(DIT_ERR_FORMAT, "\"up_block_types\" is missing", NULL);
}
END_TEST

START_TEST(missing_folder_names_the_path)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_vae_decoder *v = NULL;
    ck_assert_int_eq(dit_vae_decoder_load(be, "/nonexistent/vae", &v, &diag), DIT_ERR_NOT_FOUND);
    ck_assert_ptr_nonnull(strstr(diag.msg, "/nonexistent/vae/config.json"));
    ck_assert_ptr_null(v);
}
END_TEST

START_TEST(missing_weights_file)
{
    write_config_edit(NULL, NULL);
    expect_error(DIT_ERR_NOT_FOUND, "diffusion_pytorch_model", NULL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("vae");

    TCase *dec = tcase_create("decode");
    tcase_add_checked_fixture(dec, setup, teardown);
    tcase_add_loop_test(dec, decode_matches_diffusers, 0, 2 * N_CASES);
    tcase_add_test(dec, config_accessors);
    tcase_add_test(dec, decode_rejects_bad_shapes);
    suite_add_tcase(s, dec);

    TCase *png = tcase_create("png");
    tcase_add_checked_fixture(png, setup, teardown);
    tcase_add_test(png, quantize_matches_numpy_rules);
    tcase_add_test(png, png_of_crafted_values_matches_pil);
    tcase_add_test(png, png_of_reference_image_matches_expected);
    tcase_add_test(png, png_of_decoded_image_matches_expected);
    tcase_add_test(png, png_write_file_is_atomic_and_readable);
    tcase_add_test(png, png_errors);
    suite_add_tcase(s, png);

    TCase *load = tcase_create("load");
    tcase_add_checked_fixture(load, load_setup, load_teardown);
    tcase_add_test(load, unmodified_copy_loads);
    tcase_add_test(load, encoder_tensors_are_optional_and_ignored);
    tcase_add_test(load, missing_tensor_is_named);
    tcase_add_test(load, wrong_shape_is_named);
    tcase_add_test(load, unexpected_tensor_is_named);
    tcase_add_test(load, config_that_disagrees_with_weights);
    tcase_add_test(load, bad_configs);
    tcase_add_test(load, missing_folder_names_the_path);
    tcase_add_test(load, missing_weights_file);
    suite_add_tcase(s, load);

    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
