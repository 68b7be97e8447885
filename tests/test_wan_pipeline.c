/* WanPipeline against diffusers' whole-pipeline references
 * (tests/data/wan_demo, written by tests/golden/gen_wan_pipeline.py).
 *
 * So far the last stage: the VAE decode of the pipeline's final latents
 * (WanPipeline's de-normalisation, then AutoencoderKLWan.decode) against the
 * video diffusers decoded from them, for every reference case. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "loader/safetensors.h"
#include "vae/autoencoder_kl_wan.h"

static const char *const cases[] = {"f1_cfg", "f5_nocfg"};

static char data_dir[1024];
static dit_backend *be;

static void setup(void)
{
    const char *root = getenv("DIT_SOURCE_ROOT");
    ck_assert_msg(root != NULL, "DIT_SOURCE_ROOT is not set");
    snprintf(data_dir, sizeof data_dir, "%s/tests/data/wan_demo", root);
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&cfg, &be, NULL), DIT_OK);
}

static void teardown(void)
{
    dit_backend_destroy(be);
    be = NULL;
}

/* A host f32 copy of reference.safetensors' tensor `key`. */
static float *read_tensor(dit_st_file *f, const char *key, dit_tensor *shape)
{
    const dit_st_entry *e = dit_st_file_find(f, key);
    ck_assert_msg(e != NULL, "reference.safetensors has no %s", key);
    ck_assert_int_eq(e->view.dtype, DIT_F32);
    float *p = malloc(dit_tensor_nbytes(&e->view));
    ck_assert_ptr_nonnull(p);
    memcpy(p, e->view.data, dit_tensor_nbytes(&e->view));
    *shape = e->view;
    shape->data = p;
    return p;
}

START_TEST(decode_of_final_latents_matches_diffusers)
{
    const char *name = cases[_i];
    char vdir[1200], ref_path[1200], key[64];
    snprintf(vdir, sizeof vdir, "%s/vae", data_dir);
    snprintf(ref_path, sizeof ref_path, "%s/reference.safetensors", data_dir);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_wan_vae *v = NULL;
    ck_assert_msg(dit_wan_vae_load(be, vdir, &v, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_st_file *f = NULL;
    ck_assert_msg(dit_st_file_open(ref_path, &f, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_tensor ls, rs;
    snprintf(key, sizeof key, "%s.latents", name);
    float *lat = read_tensor(f, key, &ls);
    snprintf(key, sizeof key, "%s.video", name);
    float *ref = read_tensor(f, key, &rs);
    ck_assert_int_eq(dit_wan_vae_frames(v, (int)ls.ne[2]), (int)rs.ne[2]);
    dit_wan_vae_denormalize(v, lat, ls.ne[2] * ls.ne[3] * ls.ne[4]);
    const int64_t n = dit_tensor_numel(&rs);
    float *got = malloc((size_t)n * sizeof *got);
    ck_assert_ptr_nonnull(got);
    dit_tensor out = rs;
    out.data = got;
    ck_assert_msg(dit_wan_vae_decode(v, &ls, &out, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
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
    fprintf(stderr, "wan pipeline %s decode: max |diff| %.3g, max |ref| %.3g\n", name, max_abs,
            max_ref);
    ck_assert_msg(max_abs <= 1e-4 * max_ref, "%s: element %lld is %.9g, diffusers %.9g", name,
                  (long long)worst, got[worst], ref[worst]);
    free(got);
    free(lat);
    free(ref);
    dit_st_file_close(f);
    dit_wan_vae_free(v);
}
END_TEST

static Suite *wan_pipeline_suite(void)
{
    Suite *s = suite_create("wan_pipeline");
    TCase *tc = tcase_create("reference");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_loop_test(tc, decode_of_final_latents_matches_diffusers, 0,
                        (int)(sizeof cases / sizeof cases[0]));
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(wan_pipeline_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
