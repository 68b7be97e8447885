/* The whole text-to-image pipeline against diffusers' FluxPipeline
 * (tests/golden/gen_demo_pipeline.py): same seed -> same initial noise (bit
 * for bit), final latents and decoded image within tolerance, and the PNG's
 * pixels equal to the PIL image diffusers saved. Then `ditrun generate`
 * end to end, and its errors. */
#include <check.h>
#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "media/png.h"
#include "loader/json_util.h"
#include "loader/safetensors.h"
#include "pipelines/flux_pipeline.h"
#include "runtime/runner.h"
#include "test_proc.h"

/* Per forward the transformer agrees with diffusers to ~5e-6 relative and
 * the text encoders to ~1e-6; up to 4 Euler steps (8 forwards with true CFG)
 * accumulate that linearly, and the VAE adds ~1e-6. 1e-4 leaves a factor of
 * two over that budget without hiding a real mistake, which shows up as
 * errors of order 1e-2 or more. */
#define LATENT_TOL 1e-4
#define IMAGE_TOL 1e-4

enum { MAX_CASES = 16 };
static char cases[MAX_CASES][1400];
static int n_cases;
static char golden[1024];

static char *dup_string(const cJSON *o, const char *key)
{
    const cJSON *it = cJSON_GetObjectItem(o, key);
    return cJSON_IsString(it) ? strdup(cJSON_GetStringValue(it)) : NULL;
}

static double num(const cJSON *o, const char *key, double def)
{
    const cJSON *it = cJSON_GetObjectItem(o, key);
    return cJSON_IsNumber(it) ? cJSON_GetNumberValue(it) : def;
}

typedef struct case_params {
    dit_gen_params gp;
    char *prompt, *negative;
    char pipeline[1200];
} case_params;

static void load_params(const char *dir, case_params *cp)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/params.json", dir);
    cJSON *j = NULL;
    ck_assert_int_eq(dit_json_load_file(path, &j, NULL), DIT_OK);
    memset(cp, 0, sizeof *cp);
    cp->prompt = dup_string(j, "prompt");
    cp->negative = dup_string(j, "negative_prompt");
    cp->gp.prompt = cp->prompt;
    cp->gp.negative_prompt = cp->negative;
    cp->gp.width = (int)num(j, "width", 0);
    cp->gp.height = (int)num(j, "height", 0);
    cp->gp.steps = (int)num(j, "steps", 0);
    cp->gp.guidance_scale = (float)num(j, "guidance_scale", 3.5);
    cp->gp.true_cfg_scale = (float)num(j, "true_cfg_scale", 1.0);
    cp->gp.seed = (uint64_t)num(j, "seed", 0);
    cp->gp.max_sequence_length = (int)num(j, "max_sequence_length", 512);
    const char *name = strrchr(dir, '/') + 1;
    if (strcmp(name, "no_guidance_embeds") == 0)
        snprintf(cp->pipeline, sizeof cp->pipeline, "%s/noguidance_pipeline", golden);
    else
        snprintf(cp->pipeline, sizeof cp->pipeline, "%s/tests/data/demo",
                 test_env("DIT_SOURCE_ROOT"));
    cJSON_Delete(j);
}

static test_err compare_floats(const float *got, const dit_st_entry *want)
{
    dit_tensor g = want->view;
    g.data = (void *)got;
    g.dtype = DIT_F32;
    g = dit_tensor_make((void *)got, DIT_F32, want->view.ndim, want->view.ne);
    return test_compare_views(&g, &want->view);
}

START_TEST(pipeline_matches_diffusers)
{
    const char *dir = cases[_i];
    const char *name = strrchr(dir, '/') + 1;
    case_params cp;
    load_params(dir, &cp);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be;
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&bc, &be, NULL), DIT_OK);
    dit_pipeline *p = NULL;
    ck_assert_msg(dit_pipeline_load(be, cp.pipeline, NULL, true, &p, &diag) == DIT_OK, "%s",
                  diag.msg);
    dit_runner *runner = NULL;
    ck_assert_int_eq(dit_runner_create(be, dit_pipeline_transformer(p), NULL, &runner, NULL),
                     DIT_OK);
    dit_gen_result res;
    const dit_denoiser den = dit_runner_denoiser(runner);
    ck_assert_msg(dit_pipeline_generate(p, &den, &cp.gp, true, NULL, NULL, &res, &diag) == DIT_OK,
                  "%s: %s", name, diag.msg);

    char path[1200];
    snprintf(path, sizeof path, "%s/reference.safetensors", dir);
    dit_st_file *ref = NULL;
    ck_assert_int_eq(dit_st_file_open(path, &ref, NULL), DIT_OK);
    const dit_st_entry *init = dit_st_file_find(ref, "initial_latents");
    const dit_st_entry *fin = dit_st_file_find(ref, "final_latents");
    const dit_st_entry *img = dit_st_file_find(ref, "image");
    ck_assert(init && fin && img);
    ck_assert_int_eq(dit_tensor_numel(&init->view), res.latent_tokens * res.latent_dim);
    test_err e0 = compare_floats(res.initial_latents, init);
    test_err e1 = compare_floats(res.latents, fin);
    test_err e2 = compare_floats(res.image, img);

    /* PNG: our encoder on our image vs the PIL image diffusers saved. */
    uint8_t *png = NULL, *mine = NULL, *theirs = NULL;
    size_t len = 0;
    ck_assert_int_eq(dit_png_encode_rgb(res.image, res.height, res.width, &png, &len, NULL),
                     DIT_OK);
    int64_t w1, h1, w2, h2;
    ck_assert_int_eq(dit_png_decode_rgb8(png, len, &mine, &w1, &h1, NULL), DIT_OK);
    snprintf(path, sizeof path, "%s/expected.png", dir);
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    long elen = ftell(f);
    rewind(f);
    uint8_t *ebuf = malloc((size_t)elen);
    ck_assert_int_eq((long)fread(ebuf, 1, (size_t)elen, f), elen);
    fclose(f);
    ck_assert_int_eq(dit_png_decode_rgb8(ebuf, (size_t)elen, &theirs, &w2, &h2, NULL), DIT_OK);
    ck_assert(w1 == w2 && h1 == h2);
    int64_t off_by_one = 0, worse = 0;
    for (int64_t i = 0; i < w1 * h1 * 3; i++) {
        int d = abs((int)mine[i] - (int)theirs[i]);
        off_by_one += d == 1;
        worse += d > 1;
    }
    printf("%-24s %dx%d %d steps: initial latents %s, final latents rel %.2g, image rel %.2g, "
           "PNG values off by one %lld of %lld\n",
           name, res.width, res.height, cp.gp.steps, e0.max_abs == 0 ? "bit-exact" : "DIFFER",
           e1.rel, e2.rel, (long long)off_by_one, (long long)(w1 * h1 * 3));
    fflush(stdout);
    ck_assert_msg(e0.max_abs == 0, "%s: initial noise differs from torch's (%.3g)", name,
                  e0.max_abs);
    ck_assert_msg(e1.rel <= LATENT_TOL, "%s: final latents rel error %.3g", name, e1.rel);
    ck_assert_msg(e2.rel <= IMAGE_TOL, "%s: image rel error %.3g", name, e2.rel);
    /* A pixel can only move by one level, and only when its value sat within
     * the image error of a rounding boundary: a handful, not a pattern. */
    ck_assert_int_eq(worse, 0);
    ck_assert_msg(off_by_one * 1000 <= w1 * h1 * 3, "%lld values off by one",
                  (long long)off_by_one);
    if (strcmp(name, "long_prompt_truncated") == 0)
        ck_assert(res.prompt_truncated);

    free(png);
    free(mine);
    free(theirs);
    free(ebuf);
    dit_st_file_close(ref);
    dit_gen_result_free(&res);
    dit_runner_destroy(runner);
    dit_pipeline_free(p);
    dit_backend_destroy(be);
    free(cp.prompt);
    free(cp.negative);
}
END_TEST

START_TEST(ditrun_generate_writes_png_and_latents)
{
    char out[16384], png[128], lat[128], demo[1100];
    snprintf(png, sizeof png, "/tmp/dit_gen_%d.png", (int)getpid());
    snprintf(lat, sizeof lat, "/tmp/dit_gen_%d.safetensors", (int)getpid());
    snprintf(demo, sizeof demo, "%s/tests/data/demo", test_env("DIT_SOURCE_ROOT"));
    char *argv[] = {(char *)test_env("DITRUN"),
                    "generate",
                    "--model",
                    demo,
                    "--prompt",
                    "a red fox in the snow",
                    "--width",
                    "64",
                    "--height",
                    "64",
                    "--steps",
                    "2",
                    "--seed",
                    "1",
                    "--output",
                    png,
                    "--output-latents",
                    lat,
                    NULL};
    int rc = test_run(argv, NULL, out, sizeof out, NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    ck_assert_msg(strstr(out, "time: tokenize"), "%s", out);
    /* Same request as the square_2steps case: same final latents. */
    char ref[1200];
    snprintf(ref, sizeof ref, "%s/square_2steps/reference.safetensors", golden);
    test_err e = test_compare_files(lat, "latents", ref, "final_latents");
    ck_assert_msg(e.rel <= LATENT_TOL, "rel %.3g", e.rel);
    FILE *f = fopen(png, "rb");
    ck_assert_ptr_nonnull(f);
    unsigned char sig[8];
    ck_assert_int_eq((int)fread(sig, 1, 8, f), 8);
    fclose(f);
    ck_assert_int_eq(memcmp(sig, "\x89PNG\r\n\x1a\n", 8), 0);

    /* The same request on a mesh: CP and TP together. */
    char *argv_par[] = {(char *)test_env("DITRUN"),
                        "generate",
                        "--model",
                        demo,
                        "--prompt",
                        "a red fox in the snow",
                        "--width",
                        "64",
                        "--height",
                        "64",
                        "--steps",
                        "2",
                        "--seed",
                        "1",
                        "--output",
                        png,
                        "--output-latents",
                        lat,
                        "--world-size",
                        "4",
                        "--ring",
                        "2",
                        "--tp",
                        "2",
                        NULL};
    rc = test_run(argv_par, NULL, out, sizeof out, NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    e = test_compare_files(lat, "latents", ref, "final_latents");
    printf("ditrun generate on ring 2 x tp 2: final latents rel %.2g\n", e.rel);
    ck_assert_msg(e.rel <= LATENT_TOL, "rel %.3g", e.rel);

    /* --num-images 2: FILE_0.png, FILE_1.png and (2, tokens, dim) latents
     * whose image 0 is the n = 1 request's. */
    char *argv_n[] = {(char *)test_env("DITRUN"),
                      "generate",
                      "--model",
                      demo,
                      "--prompt",
                      "a red fox in the snow",
                      "--width",
                      "64",
                      "--height",
                      "64",
                      "--steps",
                      "2",
                      "--seed",
                      "1",
                      "--num-images",
                      "2",
                      "--output",
                      png,
                      "--output-latents",
                      lat,
                      NULL};
    rc = test_run(argv_n, NULL, out, sizeof out, NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    ck_assert_msg(strstr(out, "wrote 2 images, "), "%s", out);
    char png_k[160];
    for (int k = 0; k < 2; k++) {
        snprintf(png_k, sizeof png_k, "%.*s_%d.png", (int)(strlen(png) - 4), png, k);
        ck_assert_msg(access(png_k, R_OK) == 0, "no %s:\n%s", png_k, out);
        unlink(png_k);
    }
    dit_st_file *lf = NULL, *rf = NULL;
    ck_assert_int_eq(dit_st_file_open(lat, &lf, NULL), DIT_OK);
    ck_assert_int_eq(dit_st_file_open(ref, &rf, NULL), DIT_OK);
    const dit_st_entry *le = dit_st_file_find(lf, "latents");
    const dit_st_entry *re = dit_st_file_find(rf, "final_latents");
    ck_assert(le && re);
    ck_assert_int_eq(le->view.ne[0], 2);
    const dit_tensor l0 = dit_tensor_narrow(&le->view, 0, 0, 1);
    e = test_compare_views(&l0, &re->view);
    printf("ditrun generate --num-images 2: image 0's final latents rel %.2g\n", e.rel);
    ck_assert_msg(e.rel <= LATENT_TOL, "rel %.3g", e.rel);
    dit_st_file_close(lf);
    dit_st_file_close(rf);
    unlink(png);
    unlink(lat);
}
END_TEST

/* True CFG as one batch-2 forward per step (the default) against two
 * forwards (cond, then uncond): the same latents to float rounding, not bit
 * for bit (the batch-2 forward's GEMMs have twice the rows, and the kernels
 * pick blocking and thread split by shape). */
#define CFG_BATCH_TOL 1e-5

START_TEST(true_cfg_batch_matches_two_passes)
{
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/true_cfg", golden);
    case_params cp;
    load_params(dir, &cp);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be;
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&bc, &be, NULL), DIT_OK);
    dit_pipeline *p = NULL;
    ck_assert_msg(dit_pipeline_load(be, cp.pipeline, NULL, true, &p, &diag) == DIT_OK, "%s",
                  diag.msg);
    dit_runner *runner = NULL;
    ck_assert_int_eq(dit_runner_create(be, dit_pipeline_transformer(p), NULL, &runner, NULL),
                     DIT_OK);
    const dit_denoiser den = dit_runner_denoiser(runner);
    dit_gen_result two, one;
    cp.gp.cfg_two_pass = true;
    ck_assert_msg(dit_pipeline_generate(p, &den, &cp.gp, false, NULL, NULL, &two, &diag) == DIT_OK,
                  "%s", diag.msg);
    cp.gp.cfg_two_pass = false;
    ck_assert_msg(dit_pipeline_generate(p, &den, &cp.gp, false, NULL, NULL, &one, &diag) == DIT_OK,
                  "%s", diag.msg);
    const dit_tensor a = dit_tensor_make(one.latents, DIT_F32, one.latents_ndim, one.latents_shape);
    const dit_tensor b = dit_tensor_make(two.latents, DIT_F32, two.latents_ndim, two.latents_shape);
    const test_err e = test_compare_views(&a, &b);
    printf("true CFG, batch 2 vs two passes: final latents %s (max |diff| %.3g, rel %.2g)\n",
           e.max_abs == 0 ? "bit-identical" : "differ", e.max_abs, e.rel);
    fflush(stdout);
    ck_assert_msg(e.rel <= CFG_BATCH_TOL, "rel %.3g", e.rel);
    dit_gen_result_free(&one);
    dit_gen_result_free(&two);
    dit_runner_destroy(runner);
    dit_pipeline_free(p);
    dit_backend_destroy(be);
    free(cp.prompt);
    free(cp.negative);
}
END_TEST

/* num_images_per_prompt = 2 on the square_2steps request (true_cfg with
 * _i = 1: batch 4). diffusers draws one randn((2, C, h, w)) from the seed and
 * denoises the entries independently, so: image 0's noise is the n = 1
 * noise bit for bit and its latents and image match diffusers' n = 1
 * reference; image 1's noise is the next stretch of the stream, and its
 * latents equal a one-image generation from that noise. */
START_TEST(num_images_two)
{
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/%s", golden, _i ? "true_cfg" : "square_2steps");
    case_params cp;
    load_params(dir, &cp);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be;
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&bc, &be, NULL), DIT_OK);
    dit_pipeline *p = NULL;
    ck_assert_msg(dit_pipeline_load(be, cp.pipeline, NULL, true, &p, &diag) == DIT_OK, "%s",
                  diag.msg);
    dit_runner *runner = NULL;
    ck_assert_int_eq(dit_runner_create(be, dit_pipeline_transformer(p), NULL, &runner, NULL),
                     DIT_OK);
    const dit_denoiser den = dit_runner_denoiser(runner);
    dit_gen_result two, one;
    cp.gp.num_images = 2;
    ck_assert_msg(dit_pipeline_generate(p, &den, &cp.gp, true, NULL, NULL, &two, &diag) == DIT_OK,
                  "%s", diag.msg);
    ck_assert_int_eq(two.num_images, 2);
    ck_assert_int_eq(two.latents_shape[0], 2);
    const int64_t N = two.latent_tokens * two.latent_dim;
    const int64_t I = 3 * (int64_t)two.height * two.width;

    char path[1300];
    snprintf(path, sizeof path, "%s/reference.safetensors", dir);
    dit_st_file *ref = NULL;
    ck_assert_int_eq(dit_st_file_open(path, &ref, NULL), DIT_OK);
    const test_err e0 =
        compare_floats(two.initial_latents, dit_st_file_find(ref, "initial_latents"));
    const test_err e1 = compare_floats(two.latents, dit_st_file_find(ref, "final_latents"));
    const test_err e2 = compare_floats(two.image, dit_st_file_find(ref, "image"));

    /* Image 1 alone, from its own noise. */
    cp.gp.num_images = 1;
    cp.gp.latents = two.initial_latents + N;
    ck_assert_msg(dit_pipeline_generate(p, &den, &cp.gp, true, NULL, NULL, &one, &diag) == DIT_OK,
                  "%s", diag.msg);
    const int64_t sh[1] = {N}, shi[1] = {I};
    const dit_tensor a = dit_tensor_make(two.latents + N, DIT_F32, 1, sh);
    const dit_tensor b = dit_tensor_make(one.latents, DIT_F32, 1, sh);
    const test_err e3 = test_compare_views(&a, &b);
    const dit_tensor ai = dit_tensor_make(two.image + I, DIT_F32, 1, shi);
    const dit_tensor bi = dit_tensor_make(one.image, DIT_F32, 1, shi);
    const test_err e4 = test_compare_views(&ai, &bi);
    /* The two images differ (different noise). */
    const dit_tensor a0 = dit_tensor_make(two.latents, DIT_F32, 1, sh);
    const test_err e5 = test_compare_views(&a0, &b);
    printf("num_images 2 (%s): image 0 vs diffusers n=1: initial %s, latents rel %.2g, image rel "
           "%.2g; image 1 vs alone from its noise: latents rel %.2g, image rel %.2g\n",
           _i ? "true_cfg, batch 4" : "square_2steps", e0.max_abs == 0 ? "bit-exact" : "DIFFER",
           e1.rel, e2.rel, e3.rel, e4.rel);
    fflush(stdout);
    ck_assert(e0.max_abs == 0);
    ck_assert_msg(e1.rel <= LATENT_TOL, "rel %.3g", e1.rel);
    ck_assert_msg(e2.rel <= IMAGE_TOL, "rel %.3g", e2.rel);
    ck_assert_msg(e3.rel <= 1e-5, "rel %.3g", e3.rel);
    ck_assert_msg(e4.rel <= 1e-5, "rel %.3g", e4.rel);
    ck_assert_msg(e5.rel > 1e-2, "the two images are the same (rel %.3g)", e5.rel);

    /* Out of range. */
    dit_gen_result_free(&one);
    cp.gp.latents = NULL;
    cp.gp.num_images = DIT_GEN_MAX_IMAGES + 1;
    ck_assert_int_eq(dit_pipeline_generate(p, &den, &cp.gp, false, NULL, NULL, &one, &diag),
                     DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(diag.msg, "num_images 9 must be between 1 and 8"));

    dit_st_file_close(ref);
    dit_gen_result_free(&one);
    dit_gen_result_free(&two);
    dit_runner_destroy(runner);
    dit_pipeline_free(p);
    dit_backend_destroy(be);
    free(cp.prompt);
    free(cp.negative);
}
END_TEST

/* The batch-2 forward on meshes: each layout splits both entries' sequences
 * the same way. Against diffusers' true_cfg reference. */
/* num_images = n against diffusers' own num_images_per_prompt = n: n = 1 is
 * the single-image golden (tests/data/pipeline_golden), n = 2 and 4 come from
 * gen_demo_pipeline.py --num-images N (tests/data/pipeline_golden_n<N>): one
 * randn((n, ...)) from the seed, every image's latents and pixels, at the
 * tolerances of the one-image cases. */
static const struct {
    const char *fixture, *name;
    int n;
} batch_cases[] = {
    {"pipeline_golden", "square_2steps", 1},    {"pipeline_golden", "true_cfg", 1},
    {"pipeline_golden_n2", "square_2steps", 2}, {"pipeline_golden_n2", "true_cfg", 2},
    {"pipeline_golden_n4", "square_2steps", 4},
};

START_TEST(num_images_matches_diffusers)
{
    const char *const name = batch_cases[_i].name;
    const int n = batch_cases[_i].n;
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/tests/data/%s/%s", test_env("DIT_SOURCE_ROOT"),
             batch_cases[_i].fixture, name);
    case_params cp;
    load_params(dir, &cp);
    cp.gp.num_images = n;
    snprintf(cp.pipeline, sizeof cp.pipeline, "%s/tests/data/demo", test_env("DIT_SOURCE_ROOT"));
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be;
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&bc, &be, NULL), DIT_OK);
    dit_pipeline *p = NULL;
    ck_assert_msg(dit_pipeline_load(be, cp.pipeline, NULL, true, &p, &diag) == DIT_OK, "%s",
                  diag.msg);
    dit_runner *runner = NULL;
    ck_assert_int_eq(dit_runner_create(be, dit_pipeline_transformer(p), NULL, &runner, NULL),
                     DIT_OK);
    dit_gen_result res;
    const dit_denoiser den = dit_runner_denoiser(runner);
    ck_assert_msg(dit_pipeline_generate(p, &den, &cp.gp, true, NULL, NULL, &res, &diag) == DIT_OK,
                  "%s n=%d: %s", name, n, diag.msg);
    ck_assert_int_eq(res.num_images, n);
    char path[1300];
    snprintf(path, sizeof path, "%s/reference.safetensors", dir);
    dit_st_file *ref = NULL;
    ck_assert_int_eq(dit_st_file_open(path, &ref, NULL), DIT_OK);
    const dit_st_entry *init = dit_st_file_find(ref, "initial_latents");
    const dit_st_entry *fin = dit_st_file_find(ref, "final_latents");
    const dit_st_entry *img = dit_st_file_find(ref, "image");
    ck_assert(init && fin && img);
    /* The references hold exactly n images: (n, tokens, dim) latents and an
     * (n, 3, H, W) image, or (3, H, W) for the one-image golden. */
    ck_assert_int_eq(init->view.ne[0], n);
    ck_assert_int_eq(fin->view.ne[0], n);
    ck_assert_int_eq(img->view.ndim, n == 1 ? 3 : 4);
    if (n > 1)
        ck_assert_int_eq(img->view.ne[0], n);
    test_err e0 = compare_floats(res.initial_latents, init);
    test_err e1 = compare_floats(res.latents, fin);
    test_err e2 = compare_floats(res.image, img);
    printf("%-24s num_images %d vs diffusers' num_images_per_prompt %d: initial latents %s, "
           "final latents rel %.2g, images rel %.2g\n",
           name, n, n, e0.max_abs == 0 ? "bit-exact" : "DIFFER", e1.rel, e2.rel);
    fflush(stdout);
    ck_assert_msg(e0.max_abs == 0, "%s n=%d: noise differs from torch's (%.3g)", name, n,
                  e0.max_abs);
    ck_assert_msg(e1.rel <= LATENT_TOL, "%s n=%d: final latents rel error %.3g", name, n, e1.rel);
    ck_assert_msg(e2.rel <= IMAGE_TOL, "%s n=%d: image rel error %.3g", name, n, e2.rel);
    dit_st_file_close(ref);
    dit_gen_result_free(&res);
    dit_runner_destroy(runner);
    dit_pipeline_free(p);
    dit_backend_destroy(be);
    free(cp.prompt);
    free(cp.negative);
}
END_TEST

START_TEST(ditrun_true_cfg_on_meshes)
{
    char out[16384], png[128], lat[128], demo[1100], ref[1200];
    snprintf(png, sizeof png, "/tmp/dit_cfg_%d.png", (int)getpid());
    snprintf(lat, sizeof lat, "/tmp/dit_cfg_%d.safetensors", (int)getpid());
    snprintf(demo, sizeof demo, "%s/tests/data/demo", test_env("DIT_SOURCE_ROOT"));
    snprintf(ref, sizeof ref, "%s/true_cfg/reference.safetensors", golden);
    char *single[] = {NULL};
    char *two_pass[] = {"--cfg-two-pass", NULL};
    char *ring_uly[] = {"--world-size", "4", "--ring", "2", "--ulysses", "2", NULL};
    char *ring_tp[] = {"--world-size", "4", "--ring", "2", "--tp", "2", NULL};
    char *uly[] = {"--world-size", "2", "--ulysses", "2", NULL};
    char *ring_any[] = {"--world-size", "3", "--ring", "3", "--ring-anything", NULL};
    /* CFG parallel: each group runs its half of the batch-2 CFG forward. */
    char *cfg[] = {"--world-size", "2", "--cfg-parallel", NULL};
    char *cfg_ring[] = {"--world-size", "4", "--cfg-parallel", "--ring", "2", NULL};
    char *const *layouts[] = {single, two_pass, ring_uly, ring_tp, uly, ring_any, cfg, cfg_ring};
    const char *names[] = {"one rank",
                           "one rank, two passes",
                           "ring 2 x ulysses 2",
                           "ring 2 x tp 2",
                           "ulysses 2",
                           "ring 3 (uneven)",
                           "cfg 2",
                           "cfg 2 x ring 2"};
    for (size_t k = 0; k < sizeof layouts / sizeof *layouts; k++) {
        char *argv[32] = {(char *)test_env("DITRUN"),
                          "generate",
                          "--model",
                          demo,
                          "--prompt",
                          "a bowl of ramen",
                          "--negative-prompt",
                          "blurry",
                          "--true-cfg",
                          "3",
                          "--width",
                          "64",
                          "--height",
                          "96",
                          "--steps",
                          "3",
                          "--seed",
                          "7",
                          "--output",
                          png,
                          "--output-latents",
                          lat};
        int n = 22;
        for (int i = 0; layouts[k][i]; i++)
            argv[n++] = layouts[k][i];
        argv[n] = NULL;
        const int rc = test_run(argv, NULL, out, sizeof out, NULL);
        ck_assert_msg(rc == 0, "%s: exit %d:\n%s", names[k], rc, out);
        const test_err e = test_compare_files(lat, "latents", ref, "final_latents");
        printf("ditrun generate true CFG, %s: final latents rel %.2g\n", names[k], e.rel);
        fflush(stdout);
        ck_assert_msg(e.rel <= LATENT_TOL, "%s: rel %.3g", names[k], e.rel);
    }
    unlink(png);
    unlink(lat);
}
END_TEST

START_TEST(ditrun_generate_reports_bad_requests)
{
    char out[16384], demo[1100];
    snprintf(demo, sizeof demo, "%s/tests/data/demo", test_env("DIT_SOURCE_ROOT"));
    char *ditrun = (char *)test_env("DITRUN");
    struct {
        const char *opt, *val, *needle;
        int rc;
    } bad[] = {
        {"--width", "100", "width 100 must be a positive multiple of 16", 2},
        {"--height", "0", "--height 0: give a positive value, or leave the flag out", 2},
        {"--height", "8", "height 8 must be a positive multiple of 16", 2},
        {"--steps", "0", "--steps 0: give a positive value", 2},
        {"--steps", "-3", "num_inference_steps -3 must be between 1 and 1000", 2},
        {"--steps", "5000", "between 1 and 1000", 2},
        {"--max-sequence-length", "1000", "max_sequence_length 1000", 2},
        {"--guidance", "-1", "guidance_scale -1", 2},
        {"--seed", "-4", "--seed wants a non-negative integer", 2},
        {"--latents", "/nonexistent.safetensors", "/nonexistent.safetensors", 1},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char *argv[] = {ditrun,
                        "generate",
                        "--model",
                        demo,
                        "--prompt",
                        "x",
                        "--width",
                        "64",
                        "--height",
                        "64",
                        "--steps",
                        "1",
                        (char *)bad[i].opt,
                        (char *)bad[i].val,
                        "--output",
                        "/tmp/unused.png",
                        NULL};
        int rc = test_run(argv, NULL, out, sizeof out, NULL);
        ck_assert_msg(rc == bad[i].rc, "%s %s: exit %d:\n%s", bad[i].opt, bad[i].val, rc, out);
        ck_assert_msg(strstr(out, bad[i].needle), "%s %s: '%s' not in:\n%s", bad[i].opt, bad[i].val,
                      bad[i].needle, out);
    }
    char *nomodel[] = {ditrun,     "generate",        "--model", "/nonexistent", "--prompt", "x",
                       "--output", "/tmp/unused.png", NULL};
    ck_assert_int_eq(test_run(nomodel, NULL, out, sizeof out, NULL), 1);
    ck_assert_ptr_nonnull(strstr(out, "/nonexistent/model_index.json"));
    char *noprompt[] = {ditrun, "generate", "--model", demo, "--output", "/tmp/unused.png", NULL};
    ck_assert_int_eq(test_run(noprompt, NULL, out, sizeof out, NULL), 2);
    ck_assert_ptr_nonnull(strstr(out, "--prompt is required"));
}
END_TEST

static int cmp_str(const void *a, const void *b)
{
    return strcmp((const char *)a, (const char *)b);
}

int main(void)
{
    snprintf(golden, sizeof golden, "%s/tests/data/pipeline_golden", test_env("DIT_SOURCE_ROOT"));
    DIR *d = opendir(golden);
    if (!d) {
        fprintf(stderr, "cannot open %s\n", golden);
        return 1;
    }
    struct dirent *de;
    while ((de = readdir(d)) && n_cases < MAX_CASES) {
        char probe[2048];
        snprintf(probe, sizeof probe, "%s/%s/params.json", golden, de->d_name);
        if (de->d_name[0] == '.' || access(probe, R_OK) != 0)
            continue;
        snprintf(cases[n_cases++], sizeof cases[0], "%s/%s", golden, de->d_name);
    }
    closedir(d);
    qsort(cases, (size_t)n_cases, sizeof cases[0], cmp_str);
    if (n_cases < 5) {
        fprintf(stderr, "expected 5 pipeline cases under %s, found %d\n", golden, n_cases);
        return 1;
    }
    Suite *s = suite_create("pipeline");
    TCase *tc = tcase_create("golden");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, pipeline_matches_diffusers, 0, n_cases);
    tcase_add_test(tc, true_cfg_batch_matches_two_passes);
    tcase_add_loop_test(tc, num_images_two, 0, 2);
    tcase_add_loop_test(tc, num_images_matches_diffusers, 0,
                        (int)(sizeof batch_cases / sizeof *batch_cases));
    suite_add_tcase(s, tc);
    TCase *cli = tcase_create("cli");
    tcase_set_timeout(cli, 300);
    tcase_add_test(cli, ditrun_generate_writes_png_and_latents);
    tcase_add_test(cli, ditrun_generate_reports_bad_requests);
    tcase_add_test(cli, ditrun_true_cfg_on_meshes);
    suite_add_tcase(s, cli);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
