/* WanPipeline against diffusers' whole-pipeline references
 * (tests/data/wan_demo, written by tests/golden/gen_wan_pipeline.py: CFG on
 * and off, 1, 5 and 9 frames, square, wide and portrait):
 *   - the whole pipeline in this process (UMT5 prompt embeds, the seed's
 *     noise, UniPC with CFG, de-normalisation, VAE decode): final latents
 *     and video against diffusers';
 *   - the VAE decode of diffusers' own final latents, alone;
 *   - `ditrun generate` on one rank and on meshes (CP, TP), writing the
 *     video as safetensors and the latents, and taking initial latents;
 *   - ditrun's refusals of requests WanPipeline cannot make. */
#include <check.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "core/torch_rng.h"
#include "loader/json_util.h"
#include "loader/safetensors.h"
#include "pipelines/pipeline.h"
#include "runtime/runner.h"
#include "test_proc.h"
#include "vae/autoencoder_kl_wan.h"

/* Per forward the transformer agrees with diffusers to ~1e-6 relative and
 * UMT5 to ~1e-6; a few UniPC steps (two forwards each with CFG) accumulate
 * that, and the VAE adds ~1e-6: the 1e-4 holds with room, and a real
 * mistake shows as 1e-2 or more. */
#define LATENT_TOL 1e-4
#define VIDEO_TOL 1e-4

enum { MAX_CASES = 8 };

typedef struct wan_case {
    char name[32];
    char prompt[256], negative[256];
    bool has_negative;
    int width, height, frames, steps, seed, max_len;
    double guidance;
} wan_case;

static wan_case cases[MAX_CASES];
static int n_cases;
static char data_dir[1024], ref_path[1200];

static void copy_string(const cJSON *o, const char *key, char *out, size_t cap, bool *present)
{
    const cJSON *it = cJSON_GetObjectItem(o, key);
    if (present)
        *present = cJSON_IsString(it);
    snprintf(out, cap, "%s", cJSON_IsString(it) ? cJSON_GetStringValue(it) : "");
}

static int num(const cJSON *o, const char *key)
{
    return (int)cJSON_GetNumberValue(cJSON_GetObjectItem(o, key));
}

/* reference.json's cases. */
static int load_cases(void)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/reference.json", data_dir);
    cJSON *j = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_json_load_file(path, &j, &diag) != DIT_OK) {
        fprintf(stderr, "%s\n", dit_diag_msg(&diag));
        return -1;
    }
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(j, "cases"))
    {
        if (n_cases == MAX_CASES)
            break;
        wan_case *w = &cases[n_cases++];
        copy_string(c, "name", w->name, sizeof w->name, NULL);
        copy_string(c, "prompt", w->prompt, sizeof w->prompt, NULL);
        copy_string(c, "negative_prompt", w->negative, sizeof w->negative, &w->has_negative);
        w->width = num(c, "width");
        w->height = num(c, "height");
        w->frames = num(c, "num_frames");
        w->steps = num(c, "num_inference_steps");
        w->seed = num(c, "seed");
        w->max_len = num(c, "max_sequence_length");
        w->guidance = cJSON_GetNumberValue(cJSON_GetObjectItem(c, "guidance_scale"));
    }
    cJSON_Delete(j);
    return 0;
}

static dit_gen_params params_of(const wan_case *w)
{
    dit_gen_params gp;
    memset(&gp, 0, sizeof gp);
    gp.prompt = w->prompt;
    gp.negative_prompt = w->has_negative ? w->negative : NULL;
    gp.width = w->width;
    gp.height = w->height;
    gp.frames = w->frames;
    gp.steps = w->steps;
    gp.guidance_scale = (float)w->guidance;
    gp.true_cfg_scale = 1.0f;
    gp.seed = (uint64_t)w->seed;
    gp.max_sequence_length = w->max_len;
    return gp;
}

static test_err compare_to(const float *got, dit_st_file *ref, const char *name, const char *what)
{
    char key[96];
    snprintf(key, sizeof key, "%s.%s", name, what);
    const dit_st_entry *e = dit_st_file_find(ref, key);
    ck_assert_msg(e != NULL, "reference.safetensors has no %s", key);
    const dit_tensor g = dit_tensor_make((void *)got, DIT_F32, e->view.ndim, e->view.ne);
    return test_compare_views(&g, &e->view);
}

START_TEST(pipeline_matches_diffusers)
{
    const wan_case *w = &cases[_i];
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be = NULL;
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&bc, &be, NULL), DIT_OK);
    dit_pipeline *p = NULL;
    ck_assert_msg(dit_pipeline_load(be, data_dir, NULL, true, &p, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    const dit_pipeline_info *info = dit_pipeline_get_info(p);
    ck_assert_str_eq(info->task, "text-to-video");
    ck_assert_int_eq(info->frame_step, 4);
    dit_runner *runner = NULL;
    ck_assert_int_eq(dit_runner_create(be, dit_pipeline_transformer(p), NULL, &runner, NULL),
                     DIT_OK);
    const dit_denoiser den = dit_runner_denoiser(runner);
    const dit_gen_params gp = params_of(w);
    dit_gen_result res;
    ck_assert_msg(dit_pipeline_generate(p, &den, &gp, true, NULL, NULL, &res, &diag) == DIT_OK,
                  "%s: %s", w->name, dit_diag_msg(&diag));
    ck_assert_int_eq(res.frames, w->frames);
    ck_assert_int_eq(res.latents_ndim, 5);

    dit_st_file *ref = NULL;
    ck_assert_int_eq(dit_st_file_open(ref_path, &ref, NULL), DIT_OK);
    const test_err el = compare_to(res.latents, ref, w->name, "latents");
    const test_err ev = compare_to(res.image, ref, w->name, "video");
    printf("%-12s %dx%d, %d frames, %d steps, guidance %g: latents rel %.2g, video rel %.2g\n",
           w->name, w->width, w->height, w->frames, w->steps, w->guidance, el.rel, ev.rel);
    fflush(stdout);
    ck_assert_msg(el.rel <= LATENT_TOL, "%s: final latents rel error %.3g", w->name, el.rel);
    ck_assert_msg(ev.rel <= VIDEO_TOL, "%s: video rel error %.3g", w->name, ev.rel);

    /* The initial latents are torch.randn from the seed, bit for bit. */
    float *noise = malloc(sizeof(float) * (size_t)(res.latent_tokens * res.latent_dim));
    ck_assert_ptr_nonnull(noise);
    dit_mt19937 g;
    dit_mt19937_seed(&g, (uint64_t)w->seed);
    dit_torch_randn(&g, noise, (size_t)(res.latent_tokens * res.latent_dim));
    ck_assert_int_eq(memcmp(noise, res.initial_latents,
                            sizeof(float) * (size_t)(res.latent_tokens * res.latent_dim)),
                     0);
    free(noise);
    dit_st_file_close(ref);
    dit_gen_result_free(&res);
    dit_runner_destroy(runner);
    dit_pipeline_free(p);
    dit_backend_destroy(be);
}
END_TEST

/* Classic CFG as one batch-2 forward per step (the default) against two
 * forwards (cond, then uncond), for every CFG case: the same latents to
 * float rounding. */
#define CFG_BATCH_TOL 1e-5

START_TEST(cfg_batch_matches_two_passes)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be = NULL;
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&bc, &be, NULL), DIT_OK);
    dit_pipeline *p = NULL;
    ck_assert_msg(dit_pipeline_load(be, data_dir, NULL, true, &p, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    dit_runner *runner = NULL;
    ck_assert_int_eq(dit_runner_create(be, dit_pipeline_transformer(p), NULL, &runner, NULL),
                     DIT_OK);
    const dit_denoiser den = dit_runner_denoiser(runner);
    int n_cfg = 0;
    for (int i = 0; i < n_cases; i++) {
        if (cases[i].guidance <= 1.0)
            continue;
        n_cfg++;
        dit_gen_params gp = params_of(&cases[i]);
        dit_gen_result two, one;
        gp.cfg_two_pass = true;
        ck_assert_msg(dit_pipeline_generate(p, &den, &gp, false, NULL, NULL, &two, &diag) == DIT_OK,
                      "%s", dit_diag_msg(&diag));
        gp.cfg_two_pass = false;
        ck_assert_msg(dit_pipeline_generate(p, &den, &gp, false, NULL, NULL, &one, &diag) == DIT_OK,
                      "%s", dit_diag_msg(&diag));
        const dit_tensor a =
            dit_tensor_make(one.latents, DIT_F32, one.latents_ndim, one.latents_shape);
        const dit_tensor b =
            dit_tensor_make(two.latents, DIT_F32, two.latents_ndim, two.latents_shape);
        const test_err e = test_compare_views(&a, &b);
        printf("%s: CFG batch 2 vs two passes: final latents %s (max |diff| %.3g, rel %.2g)\n",
               cases[i].name, e.max_abs == 0 ? "bit-identical" : "differ", e.max_abs, e.rel);
        fflush(stdout);
        ck_assert_msg(e.rel <= CFG_BATCH_TOL, "%s: rel %.3g", cases[i].name, e.rel);
        dit_gen_result_free(&one);
        dit_gen_result_free(&two);
    }
    ck_assert_int_ge(n_cfg, 2);
    dit_runner_destroy(runner);
    dit_pipeline_free(p);
    dit_backend_destroy(be);
}
END_TEST

/* num_videos_per_prompt = 2 on f1_cfg (CFG: batch 4): video 0 is diffusers'
 * n = 1 result, video 1 a one-video run from the next stretch of the seed's
 * stream. */
START_TEST(num_videos_two)
{
    const wan_case *w = NULL;
    for (int i = 0; i < n_cases; i++)
        if (strcmp(cases[i].name, "f1_cfg") == 0)
            w = &cases[i];
    ck_assert_ptr_nonnull(w);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be = NULL;
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&bc, &be, NULL), DIT_OK);
    dit_pipeline *p = NULL;
    ck_assert_msg(dit_pipeline_load(be, data_dir, NULL, true, &p, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    dit_runner *runner = NULL;
    ck_assert_int_eq(dit_runner_create(be, dit_pipeline_transformer(p), NULL, &runner, NULL),
                     DIT_OK);
    const dit_denoiser den = dit_runner_denoiser(runner);
    dit_gen_params gp = params_of(w);
    gp.num_images = 2;
    dit_gen_result two, one;
    ck_assert_msg(dit_pipeline_generate(p, &den, &gp, true, NULL, NULL, &two, &diag) == DIT_OK,
                  "%s", dit_diag_msg(&diag));
    ck_assert_int_eq(two.num_images, 2);
    const int64_t N = two.latent_tokens * two.latent_dim;
    const int64_t V = 3 * (int64_t)two.frames * two.height * two.width;
    float *noise = malloc(sizeof(float) * (size_t)(2 * N));
    ck_assert_ptr_nonnull(noise);
    dit_mt19937 g;
    dit_mt19937_seed(&g, (uint64_t)w->seed);
    dit_torch_randn(&g, noise, (size_t)(2 * N));
    ck_assert_int_eq(memcmp(noise, two.initial_latents, sizeof(float) * (size_t)(2 * N)), 0);
    dit_st_file *ref = NULL;
    ck_assert_int_eq(dit_st_file_open(ref_path, &ref, NULL), DIT_OK);
    const test_err el = compare_to(two.latents, ref, w->name, "latents");
    const test_err ev = compare_to(two.image, ref, w->name, "video");
    gp.num_images = 1;
    gp.latents = two.initial_latents + N;
    ck_assert_msg(dit_pipeline_generate(p, &den, &gp, true, NULL, NULL, &one, &diag) == DIT_OK,
                  "%s", dit_diag_msg(&diag));
    const int64_t sh[1] = {N}, shv[1] = {V};
    const dit_tensor a = dit_tensor_make(two.latents + N, DIT_F32, 1, sh);
    const dit_tensor b = dit_tensor_make(one.latents, DIT_F32, 1, sh);
    const dit_tensor av = dit_tensor_make(two.image + V, DIT_F32, 1, shv);
    const dit_tensor bv = dit_tensor_make(one.image, DIT_F32, 1, shv);
    const test_err e1 = test_compare_views(&a, &b), e2 = test_compare_views(&av, &bv);
    printf("%s, num_videos 2: video 0 vs diffusers n=1: latents rel %.2g, video rel %.2g; video 1 "
           "vs alone from its noise: latents rel %.2g, video rel %.2g\n",
           w->name, el.rel, ev.rel, e1.rel, e2.rel);
    fflush(stdout);
    ck_assert_msg(el.rel <= LATENT_TOL, "rel %.3g", el.rel);
    ck_assert_msg(ev.rel <= VIDEO_TOL, "rel %.3g", ev.rel);
    ck_assert_msg(e1.rel <= 1e-5, "rel %.3g", e1.rel);
    ck_assert_msg(e2.rel <= 1e-5, "rel %.3g", e2.rel);
    free(noise);
    dit_st_file_close(ref);
    dit_gen_result_free(&one);
    dit_gen_result_free(&two);
    dit_runner_destroy(runner);
    dit_pipeline_free(p);
    dit_backend_destroy(be);
}
END_TEST

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
    const char *name = cases[_i].name;
    char vdir[1200], key[64];
    snprintf(vdir, sizeof vdir, "%s/vae", data_dir);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be = NULL;
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&bc, &be, NULL), DIT_OK);
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
    const test_err e = test_compare_views(&out, &rs);
    fprintf(stderr, "wan pipeline %s decode: max |diff| %.3g, max |ref| %.3g\n", name, e.max_abs,
            e.max_ref);
    ck_assert_msg(e.rel <= VIDEO_TOL, "%s: video rel error %.3g", name, e.rel);
    free(got);
    free(lat);
    free(ref);
    dit_st_file_close(f);
    dit_wan_vae_free(v);
    dit_backend_destroy(be);
}
END_TEST

/* ditrun generate for case `w` with extra flags; returns the exit code. */
static int run_generate(const wan_case *w, const char *out_path, const char *lat_path,
                        char *const *extra, char *log, size_t cap)
{
    char width[16], height[16], frames[16], steps[16], seed[24], guidance[32], maxlen[16];
    snprintf(width, sizeof width, "%d", w->width);
    snprintf(height, sizeof height, "%d", w->height);
    snprintf(frames, sizeof frames, "%d", w->frames);
    snprintf(steps, sizeof steps, "%d", w->steps);
    snprintf(seed, sizeof seed, "%d", w->seed);
    snprintf(guidance, sizeof guidance, "%.17g", w->guidance);
    snprintf(maxlen, sizeof maxlen, "%d", w->max_len);
    char *argv[48] = {(char *)test_env("DITRUN"),
                      "generate",
                      "--model",
                      data_dir,
                      "--prompt",
                      (char *)w->prompt,
                      "--width",
                      width,
                      "--height",
                      height,
                      "--frames",
                      frames,
                      "--steps",
                      steps,
                      "--seed",
                      seed,
                      "--guidance",
                      guidance,
                      "--max-sequence-length",
                      maxlen,
                      "--output",
                      (char *)out_path,
                      "--output-latents",
                      (char *)lat_path};
    int n = 24;
    if (w->has_negative) {
        argv[n++] = "--negative-prompt";
        argv[n++] = (char *)w->negative;
    }
    for (int i = 0; extra && extra[i] && n < 46; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    return test_run(argv, NULL, log, cap, NULL);
}

/* One rank, then meshes: every result against diffusers'. */
START_TEST(ditrun_generate_video_on_meshes)
{
    const wan_case *w = NULL;
    for (int i = 0; i < n_cases; i++)
        if (strcmp(cases[i].name, "f9_cfg_neg") == 0)
            w = &cases[i];
    ck_assert_ptr_nonnull(w);
    char out[16384], vid[128], lat[128], want[96];
    snprintf(vid, sizeof vid, "/tmp/dit_wan_%d.safetensors", (int)getpid());
    snprintf(lat, sizeof lat, "/tmp/dit_wan_lat_%d.safetensors", (int)getpid());
    char *single[] = {NULL};
    char *ring_uly[] = {"--world-size", "4", "--ring", "2", "--ulysses", "2", NULL};
    char *ring_tp[] = {"--world-size", "4", "--ring", "2", "--tp", "2", NULL};
    char *ring_any[] = {"--world-size", "5", "--ring", "5", "--ring-anything", NULL};
    char *cfg[] = {"--world-size", "2", "--cfg-parallel", NULL};
    char *cfg_ring[] = {"--world-size", "4", "--cfg-parallel", "--ring", "2", NULL};
    char *const *layouts[] = {single, ring_uly, ring_tp, ring_any, cfg, cfg_ring};
    const char *names[] = {"one rank", "ring 2 x ulysses 2", "ring 2 x tp 2", "ring 5 (uneven)",
                           "cfg 2",    "cfg 2 x ring 2"};
    for (size_t k = 0; k < sizeof layouts / sizeof *layouts; k++) {
        const int rc = run_generate(w, vid, lat, layouts[k], out, sizeof out);
        ck_assert_msg(rc == 0, "%s: exit %d:\n%s", names[k], rc, out);
        ck_assert_msg(k > 0 || strstr(out, "9 frames at 16 fps"), "%s", out);
        snprintf(want, sizeof want, "%s.latents", w->name);
        const test_err el = test_compare_files(lat, "latents", ref_path, want);
        snprintf(want, sizeof want, "%s.video", w->name);
        /* The file holds (3, F, H, W); the reference (1, 3, F, H, W). */
        dit_st_file *f = NULL, *r = NULL;
        ck_assert_int_eq(dit_st_file_open(vid, &f, NULL), DIT_OK);
        ck_assert_int_eq(dit_st_file_open(ref_path, &r, NULL), DIT_OK);
        const dit_st_entry *ev = dit_st_file_find(f, "video"), *er = dit_st_file_find(r, want);
        ck_assert(ev && er);
        ck_assert_int_eq(ev->view.ndim, 4);
        for (int d = 0; d < 4; d++)
            ck_assert_int_eq(ev->view.ne[d], er->view.ne[d + 1]);
        const dit_tensor flat = dit_tensor_make(ev->view.data, DIT_F32, 5, er->view.ne);
        const test_err e = test_compare_views(&flat, &er->view);
        printf("ditrun generate %s, %s: latents rel %.2g, video rel %.2g\n", w->name, names[k],
               el.rel, e.rel);
        fflush(stdout);
        ck_assert_msg(el.rel <= LATENT_TOL, "%s: latents rel %.3g", names[k], el.rel);
        ck_assert_msg(e.rel <= VIDEO_TOL, "%s: video rel %.3g", names[k], e.rel);
        dit_st_file_close(f);
        dit_st_file_close(r);
    }
    /* The same as an H.264 MP4 (ISO BMFF: 'ftyp' first; test_mp4 decodes
     * the encoder's output back). */
    char mp4[128];
    snprintf(mp4, sizeof mp4, "/tmp/dit_wan_%d.mp4", (int)getpid());
    const int rc = run_generate(w, mp4, lat, single, out, sizeof out);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    FILE *f = fopen(mp4, "rb");
    ck_assert_ptr_nonnull(f);
    unsigned char head[8];
    ck_assert_int_eq((int)fread(head, 1, 8, f), 8);
    fclose(f);
    ck_assert_int_eq(memcmp(head + 4, "ftyp", 4), 0);
    unlink(mp4);
    unlink(vid);
    unlink(lat);
}
END_TEST

/* --latents: torch's noise for the case's seed, written by hand, given
 * with another seed, gives the seed's result. */
START_TEST(ditrun_generate_takes_initial_latents)
{
    const wan_case *w = &cases[0];
    char out[16384], vid[128], lat[128], init[128], want[96];
    snprintf(vid, sizeof vid, "/tmp/dit_wanl_%d.safetensors", (int)getpid());
    snprintf(lat, sizeof lat, "/tmp/dit_wanl_lat_%d.safetensors", (int)getpid());
    snprintf(init, sizeof init, "/tmp/dit_wanl_init_%d.safetensors", (int)getpid());
    const int64_t shape[5] = {1, 4, (w->frames - 1) / 4 + 1, w->height / 8, w->width / 8};
    const int64_t n = shape[1] * shape[2] * shape[3] * shape[4];
    float *noise = malloc(sizeof(float) * (size_t)n);
    ck_assert_ptr_nonnull(noise);
    dit_mt19937 g;
    dit_mt19937_seed(&g, (uint64_t)w->seed);
    dit_torch_randn(&g, noise, (size_t)n);
    const dit_tensor t = dit_tensor_make(noise, DIT_F32, 5, shape);
    const dit_st_write_item item = {.name = "latents", .tensor = &t};
    ck_assert_int_eq(dit_st_write(init, &item, 1, NULL), DIT_OK);
    wan_case other = *w;
    other.seed = w->seed + 1000;
    char *extra[] = {"--latents", init, NULL};
    int rc = run_generate(&other, vid, lat, extra, out, sizeof out);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    snprintf(want, sizeof want, "%s.latents", w->name);
    const test_err e = test_compare_files(lat, "latents", ref_path, want);
    ck_assert_msg(e.rel <= LATENT_TOL, "latents rel %.3g", e.rel);

    /* Latents of another shape are refused, naming the one needed. */
    other.width = w->width + 16;
    rc = run_generate(&other, vid, lat, extra, out, sizeof out);
    ck_assert_msg(rc == 1, "exit %d:\n%s", rc, out);
    ck_assert_msg(strstr(out, "this request needs latents (1, 4, 1, 4, 8)"), "%s", out);
    free(noise);
    unlink(vid);
    unlink(lat);
    unlink(init);
}
END_TEST

/* A size the mesh cannot split gets the nearest sizes and frame counts
 * that work, kept within Wan's limits (sides up to 8192): on 3 ring ranks
 * 8192x16 at one frame is 512 tokens; 8208 wide would be 513, but is over
 * the limit, so the width goes down two steps. */
START_TEST(mesh_advice_names_sizes_and_frames)
{
    dit_pipeline_info info;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_pipeline_probe(data_dir, &info, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_parallel_config pc = dit_parallel_config_single();
    pc.world_size = pc.ring_degree = 3;
    dit_gen_params gp = {.prompt = "x", .width = 8192, .height = 16, .frames = 1, .steps = 1};
    dit_gen_apply_defaults(&info, &gp);
    ck_assert_int_eq(dit_gen_check(&info, &gp, &diag), DIT_OK);
    ck_assert_int_ne(dit_gen_check_mesh(&info, &gp, &pc, &diag), DIT_OK);
    char buf[600];
    ck_assert(dit_gen_mesh_advice(&info, &gp, &pc, buf, sizeof buf));
    ck_assert_msg(
        strstr(buf, "a 8192x16 video of 1 frame is 512 tokens (1 latent frame of 512x1") &&
            strstr(buf, "multiple of 3. The nearest sizes that work: 8160x16, 8192x48; "
                        "or num_frames 9") &&
            !strstr(buf, "8208") && !strstr(buf, "anything"),
        "%s", buf);
    /* 9 frames of 48x32 are 3 latent frames of 3x2 tokens: 18, not a
     * multiple of 4; a side one step off, 64 high, or one latent frame fewer
     * or more fixes it (48x16 would be 9 tokens, 0 high is no size). */
    pc.world_size = pc.ring_degree = 4;
    gp.width = 48;
    gp.height = 32;
    gp.frames = 9;
    ck_assert(dit_gen_mesh_advice(&info, &gp, &pc, buf, sizeof buf));
    ck_assert_msg(strstr(buf, "is 18 tokens (3 latent frames of 3x2") &&
                      strstr(buf, "nearest sizes that work: 32x32, 64x32, 48x64; or num_frames "
                                  "5 or 13"),
                  "%s", buf);
    /* A split that works, or an uneven mode, has no advice. */
    gp.frames = 5;
    ck_assert(!dit_gen_mesh_advice(&info, &gp, &pc, buf, sizeof buf));
    gp.frames = 9;
    pc.ring_anything = true;
    ck_assert(!dit_gen_mesh_advice(&info, &gp, &pc, buf, sizeof buf));
}
END_TEST

START_TEST(ditrun_generate_refuses_what_wan_cannot_make)
{
    char out[16384];
    struct {
        const char *opt, *val, *output, *needle;
        int rc;
    } bad[] = {
        {"--frames", "4", "/tmp/unused.safetensors",
         "num_frames 4: WanPipeline makes 4 k + 1 frames (1, 5, 9, ... 1025; the VAE decodes 4 "
         "frames per latent frame after the first), e.g. 1 or 5",
         2},
        {"--frames", "0", "/tmp/unused.safetensors", "", 0},
        {"--width", "40", "/tmp/unused.safetensors", "width 40 must be a positive multiple of 16",
         2},
        {"--true-cfg", "4", "/tmp/unused.safetensors", "WanPipeline guides with guidance_scale", 2},
        {"--true-cfg", "-2", "/tmp/unused.safetensors", "WanPipeline guides with guidance_scale",
         2},
        {"--prompt-2", "x", "/tmp/unused.safetensors", "WanPipeline has one text encoder", 2},
        {"--fps", "500", "/tmp/unused.safetensors", "fps 500 must be between 1 and 240 (0: 16)", 2},
        {"--frames", "5", "/tmp/unused.png", "a PNG holds one image, and this is a 5-frame video",
         2},
        {"--frames", "5", "/tmp/unused.gif", "name it .png (an image), .mp4 (a video) or", 2},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        if (bad[i].rc == 0)
            continue; /* the default (81 frames) is valid but slow; covered by the probe */
        char *argv[] = {(char *)test_env("DITRUN"),
                        "generate",
                        "--model",
                        data_dir,
                        "--prompt",
                        "x",
                        "--width",
                        "32",
                        "--height",
                        "32",
                        "--frames",
                        "1",
                        "--steps",
                        "1",
                        (char *)bad[i].opt,
                        (char *)bad[i].val,
                        "--output",
                        (char *)bad[i].output,
                        NULL};
        const int rc = test_run(argv, NULL, out, sizeof out, NULL);
        ck_assert_msg(rc == bad[i].rc, "%s %s: exit %d:\n%s", bad[i].opt, bad[i].val, rc, out);
        ck_assert_msg(strstr(out, bad[i].needle), "%s %s: '%s' not in:\n%s", bad[i].opt, bad[i].val,
                      bad[i].needle, out);
    }
    /* A negative prompt without guidance above 1 has no effect: a warning. */
    char vid[128];
    snprintf(vid, sizeof vid, "/tmp/dit_wanw_%d.safetensors", (int)getpid());
    char *warn[] = {(char *)test_env("DITRUN"),
                    "generate",
                    "--model",
                    data_dir,
                    "--prompt",
                    "x",
                    "--negative-prompt",
                    "y",
                    "--guidance",
                    "1",
                    "--width",
                    "32",
                    "--height",
                    "32",
                    "--frames",
                    "1",
                    "--steps",
                    "1",
                    "--output",
                    vid,
                    NULL};
    const int rc = test_run(warn, NULL, out, sizeof out, NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    ck_assert_msg(strstr(out, "warning: --negative-prompt has no effect: classifier-free guidance "
                              "needs --guidance above 1 (it is 1)"),
                  "%s", out);
    unlink(vid);
}
END_TEST

static Suite *wan_pipeline_suite(void)
{
    Suite *s = suite_create("wan_pipeline");
    TCase *tc = tcase_create("reference");
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, pipeline_matches_diffusers, 0, n_cases);
    tcase_add_loop_test(tc, decode_of_final_latents_matches_diffusers, 0, n_cases);
    tcase_add_test(tc, cfg_batch_matches_two_passes);
    tcase_add_test(tc, num_videos_two);
    tcase_add_test(tc, ditrun_generate_video_on_meshes);
    tcase_add_test(tc, ditrun_generate_takes_initial_latents);
    tcase_add_test(tc, ditrun_generate_refuses_what_wan_cannot_make);
    tcase_add_test(tc, mesh_advice_names_sizes_and_frames);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    snprintf(data_dir, sizeof data_dir, "%s/tests/data/wan_demo", test_env("DIT_SOURCE_ROOT"));
    snprintf(ref_path, sizeof ref_path, "%s/reference.safetensors", data_dir);
    if (load_cases() != 0 || n_cases < 4) {
        fprintf(stderr, "%s: expected at least 4 reference cases\n", data_dir);
        return 1;
    }
    SRunner *sr = srunner_create(wan_pipeline_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
