/* AutoencoderKLWan decoder against diffusers (tests/golden/gen_wan_vae_golden.py):
 *  - WanPipeline's de-normalisation of the latents, bit for bit;
 *  - vae.decode of 1, 2 and 3 latent frames (1, 5 and 9 video frames,
 *    non-square) within 1e-5 of the largest reference value (about 1e-6
 *    is reached);
 *  - decode refuses latents or a video of the wrong shape, naming the right one;
 *  - loader errors name the file and the tensor or key. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "loader/safetensors.h"
#include "vae/autoencoder_kl_wan.h"

static char data_dir[1024];
static dit_backend *be;

static void setup(void)
{
    const char *root = getenv("DIT_SOURCE_ROOT");
    ck_assert_msg(root != NULL, "DIT_SOURCE_ROOT is not set");
    snprintf(data_dir, sizeof data_dir, "%s/tests/data/wan_vae", root);
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&cfg, &be, NULL), DIT_OK);
}

static void teardown(void)
{
    dit_backend_destroy(be);
    be = NULL;
}

/* A host f32 copy of io.safetensors' tensor `key`. */
static float *read_tensor(dit_st_file *f, const char *key, dit_tensor *shape)
{
    const dit_st_entry *e = dit_st_file_find(f, key);
    ck_assert_msg(e != NULL, "io.safetensors has no %s", key);
    ck_assert_int_eq(e->view.dtype, DIT_F32);
    float *p = malloc(dit_tensor_nbytes(&e->view));
    ck_assert_ptr_nonnull(p);
    memcpy(p, e->view.data, dit_tensor_nbytes(&e->view));
    *shape = e->view;
    shape->data = p;
    return p;
}

START_TEST(denormalize_matches_pipeline)
{
    char vdir[1200], io[1200], key[16];
    snprintf(vdir, sizeof vdir, "%s/vae", data_dir);
    snprintf(io, sizeof io, "%s/io.safetensors", data_dir);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_wan_vae *v = NULL;
    ck_assert_msg(dit_wan_vae_load(be, vdir, &v, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_st_file *f = NULL;
    ck_assert_msg(dit_st_file_open(io, &f, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    for (int k = 1; k <= 3; k++) {
        dit_tensor ls, zs;
        snprintf(key, sizeof key, "latents%d", k);
        float *lat = read_tensor(f, key, &ls);
        snprintf(key, sizeof key, "z%d", k);
        float *z = read_tensor(f, key, &zs);
        const int64_t n = ls.ne[2] * ls.ne[3] * ls.ne[4];
        dit_wan_vae_denormalize(v, lat, n);
        for (int64_t i = 0; i < dit_tensor_numel(&ls); i++)
            ck_assert_msg(lat[i] == z[i], "latents%d[%lld]: %.9g, diffusers %.9g", k, (long long)i,
                          lat[i], z[i]);
        free(lat);
        free(z);
    }
    dit_st_file_close(f);
    dit_wan_vae_free(v);
}
END_TEST

START_TEST(decode_matches_diffusers)
{
    const int k = _i + 1;
    char vdir[1200], io[1200], key[16];
    snprintf(vdir, sizeof vdir, "%s/vae", data_dir);
    snprintf(io, sizeof io, "%s/io.safetensors", data_dir);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_wan_vae *v = NULL;
    ck_assert_msg(dit_wan_vae_load(be, vdir, &v, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_int_eq(dit_wan_vae_z_dim(v), 4);
    ck_assert_int_eq(dit_wan_vae_out_channels(v), 3);
    ck_assert_int_eq(dit_wan_vae_spatial_scale(v), 8);
    ck_assert_int_eq(dit_wan_vae_frames(v, k), 1 + 4 * (k - 1));
    dit_st_file *f = NULL;
    ck_assert_msg(dit_st_file_open(io, &f, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_tensor zs, rs;
    snprintf(key, sizeof key, "z%d", k);
    float *z = read_tensor(f, key, &zs);
    snprintf(key, sizeof key, "video%d", k);
    float *ref = read_tensor(f, key, &rs);
    const int64_t n = dit_tensor_numel(&rs);
    float *got = malloc((size_t)n * sizeof *got);
    ck_assert_ptr_nonnull(got);
    dit_tensor out = rs;
    out.data = got;
    ck_assert_msg(dit_wan_vae_decode(v, &zs, &out, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    double max_abs = 0, max_ref = 0;
    int64_t worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (!(d <= max_abs)) {
            max_abs = d;
            worst = i;
        }
        if (fabs(ref[i]) > max_ref)
            max_ref = fabs(ref[i]);
    }
    fprintf(stderr, "wan vae %d latent frames: max |diff| %.3g, max |ref| %.3g\n", k, max_abs,
            max_ref);
    ck_assert_msg(max_abs <= 1e-5 * max_ref,
                  "%d latent frames: element %lld is %.9g, diffusers %.9g", k, (long long)worst,
                  got[worst], ref[worst]);
    free(got);
    free(z);
    free(ref);
    dit_st_file_close(f);
    dit_wan_vae_free(v);
}
END_TEST

START_TEST(decode_rejects_bad_shapes)
{
    char vdir[1200];
    snprintf(vdir, sizeof vdir, "%s/vae", data_dir);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_wan_vae *v = NULL;
    ck_assert_msg(dit_wan_vae_load(be, vdir, &v, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    static float zbuf[4 * 2 * 3 * 5], vbuf[3 * 5 * 24 * 40];
    dit_tensor z = dit_tensor_5d(zbuf, DIT_F32, 1, 4, 2, 3, 5);
    dit_tensor good = dit_tensor_5d(vbuf, DIT_F32, 1, 3, 5, 24, 40);
    /* Two latent frames make 5 frames, not 4. */
    dit_tensor bad_frames = dit_tensor_5d(vbuf, DIT_F32, 1, 3, 4, 24, 40);
    ck_assert_int_eq(dit_wan_vae_decode(v, &z, &bad_frames, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(dit_diag_msg(&diag), "(1, 3, 5, 24, 40)"));
    dit_diag_clear(&diag);
    dit_tensor bad_z = dit_tensor_5d(zbuf, DIT_F32, 1, 3, 2, 3, 5);
    ck_assert_int_eq(dit_wan_vae_decode(v, &bad_z, &good, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(dit_diag_msg(&diag), "(1, 4, T, h, w)"));
    dit_wan_vae_free(v);
}
END_TEST

/* A copy of the fixture's vae/ folder with config.json replaced. */
static void temp_vae(char *dir, size_t len, const char *config)
{
    snprintf(dir, len, "/tmp/dit_wan_vae_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char src[1300], dst[1300];
    snprintf(src, sizeof src, "%s/vae/diffusion_pytorch_model.safetensors", data_dir);
    snprintf(dst, sizeof dst, "%s/diffusion_pytorch_model.safetensors", dir);
    ck_assert_int_eq(symlink(src, dst), 0);
    snprintf(dst, sizeof dst, "%s/config.json", dir);
    FILE *f = fopen(dst, "w");
    ck_assert_ptr_nonnull(f);
    fputs(config, f);
    fclose(f);
}

static void temp_vae_remove(const char *dir)
{
    char p[1300];
    snprintf(p, sizeof p, "%s/diffusion_pytorch_model.safetensors", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/config.json", dir);
    unlink(p);
    rmdir(dir);
}

static void expect_load_error(const char *config, const char *needle)
{
    char dir[64];
    temp_vae(dir, sizeof dir, config);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_wan_vae *v = NULL;
    dit_status st = dit_wan_vae_load(be, dir, &v, &diag);
    ck_assert_int_ne(st, DIT_OK);
    ck_assert_ptr_null(v);
    ck_assert_msg(strstr(dit_diag_msg(&diag), needle) != NULL, "message \"%s\" lacks \"%s\"",
                  dit_diag_msg(&diag), needle);
    temp_vae_remove(dir);
}

#define GOOD_KEYS                                                                                  \
    "\"_class_name\": \"AutoencoderKLWan\", \"base_dim\": 8, \"z_dim\": 4, "                       \
    "\"num_res_blocks\": 1, \"latents_mean\": [0, 0, 0, 0], \"latents_std\": [1, 1, 1, 1], "

START_TEST(load_errors_name_the_problem)
{
    /* The last up block without temporal upsampling: its time_conv is
     * unexpected. */
    expect_load_error("{" GOOD_KEYS "\"dim_mult\": [1, 2, 2, 2], "
                      "\"temperal_downsample\": [false, true, false]}",
                      "unexpected tensor 'decoder.up_blocks.0.upsamplers.0.time_conv.");
    /* One block fewer than the checkpoint: the widths move, and the first
     * mis-shaped tensor is named. */
    expect_load_error("{" GOOD_KEYS
                      "\"dim_mult\": [1, 2, 2], \"temperal_downsample\": [false, true]}",
                      "'decoder.up_blocks.2.resnets.0.conv1.weight' has shape");
    expect_load_error("{" GOOD_KEYS "\"dim_mult\": [1, 2, 2, 2], \"temperal_downsample\": [false]}",
                      "temperal_downsample");
    expect_load_error("{\"_class_name\": \"AutoencoderKLWan\", \"base_dim\": 8, \"z_dim\": 4, "
                      "\"latents_mean\": [0, 0, 0], \"latents_std\": [1, 1, 1, 1]}",
                      "latents_mean");
    expect_load_error("{" GOOD_KEYS "\"is_residual\": true}", "is_residual");
    expect_load_error("{\"_class_name\": \"AutoencoderKL\"}", "AutoencoderKLWan");
}
END_TEST

static Suite *wan_vae_suite(void)
{
    Suite *s = suite_create("wan_vae");
    TCase *tc = tcase_create("decoder");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, denormalize_matches_pipeline);
    tcase_add_loop_test(tc, decode_matches_diffusers, 0, 3);
    tcase_add_test(tc, decode_rejects_bad_shapes);
    tcase_add_test(tc, load_errors_name_the_problem);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(wan_vae_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
