/* Request batching in the pipelines (dit_pipeline_generate_batch): each
 * member of a batch against the same request generated alone, for FLUX
 * (distilled guidance, true CFG, num_images) and Wan (classic CFG); members
 * leaving between steps; every member leaving; bad batches; and ditrun
 * --member on parallel meshes against one rank alone.
 *
 * Batched results are not bit-identical to lone ones: the transformer's
 * GEMMs have more rows (M) in a batch, and the CPU kernels pick blocking and
 * the thread split by shape, so sums round in another order. The noise is
 * bit-exact (each member draws from its own seed), and the latents agree to
 * float rounding: within BATCH_TOL relative (max |diff| / max |solo|). */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "loader/safetensors.h"
#include "pipelines/pipeline.h"
#include "runtime/runner.h"
#include "test_proc.h"

#define BATCH_TOL 1e-5
/* The VAE amplifies the latents' rounding differences (Wan's up to ~1e-5
 * relative on the decoded video); the pipeline tests' image tolerance. */
#define IMAGE_TOL 1e-4

typedef struct fixture {
    dit_backend *be;
    dit_pipeline *p;
    dit_runner *runner;
    dit_denoiser den;
} fixture;

static void fixture_open(fixture *f, const char *sub)
{
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/tests/data/%s", test_env("DIT_SOURCE_ROOT"), sub);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&bc, &f->be, NULL), DIT_OK);
    ck_assert_msg(dit_pipeline_load(f->be, dir, NULL, true, &f->p, &diag) == DIT_OK, "%s",
                  diag.msg);
    ck_assert_int_eq(
        dit_runner_create(f->be, dit_pipeline_transformer(f->p), NULL, &f->runner, NULL), DIT_OK);
    f->den = dit_runner_denoiser(f->runner);
}

static void fixture_close(fixture *f)
{
    dit_runner_destroy(f->runner);
    dit_pipeline_free(f->p);
    dit_backend_destroy(f->be);
}

static test_err compare_n(const float *a, const float *b, int64_t n)
{
    const int64_t sh[1] = {n};
    const dit_tensor ta = dit_tensor_make((void *)a, DIT_F32, 1, sh);
    const dit_tensor tb = dit_tensor_make((void *)b, DIT_F32, 1, sh);
    return test_compare_views(&ta, &tb);
}

static int64_t latent_numel(const dit_gen_result *r)
{
    int64_t n = 1;
    for (int i = 0; i < r->latents_ndim; i++)
        n *= r->latents_shape[i];
    return n;
}

/* The leave plan of a test's callback: member k leaves after step leave[k]
 * (0: stays); calls counts the callback's calls. */
typedef struct leave_plan {
    int leave[8];
    int calls;
} leave_plan;

static dit_status leave_step(void *ctx, int step, int total, double elapsed_ms, bool *active)
{
    (void)total;
    (void)elapsed_ms;
    leave_plan *lp = ctx;
    lp->calls++;
    for (int k = 0; k < 8; k++)
        if (lp->leave[k] == step)
            active[k] = false;
    return DIT_OK;
}

/* Runs gps[0 .. n-1] as one batch (with the leave plan, if any) and each
 * member that stays alone; checks noise bit-exact and latents (and images
 * when decoding) within BATCH_TOL, prints the figures. */
static void check_batch_vs_solo(fixture *f, const char *what, int n, const dit_gen_params *gps,
                                leave_plan *lp, bool decode)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_gen_result res[8];
    dit_status mst[8];
    dit_gen_decode dm[8];
    for (int k = 0; k < 8; k++)
        dm[k] = decode ? DIT_GEN_DECODE_ALL : 0;
    ck_assert_msg(dit_pipeline_generate_batch(f->p, &f->den, n, gps, dm, lp ? leave_step : NULL, lp,
                                              res, mst, &diag) == DIT_OK,
                  "%s: %s", what, diag.msg);
    double worst = 0, worst_img = 0;
    bool identical = true;
    for (int k = 0; k < n; k++) {
        if (lp && lp->leave[k]) {
            ck_assert_int_eq(mst[k], DIT_ERR_CANCELLED);
            ck_assert_ptr_null(res[k].latents);
            ck_assert_ptr_null(res[k].image);
            ck_assert_int_eq(res[k].num_images, 0);
            continue;
        }
        ck_assert_int_eq(mst[k], DIT_OK);
        dit_gen_result solo;
        ck_assert_msg(dit_pipeline_generate(f->p, &f->den, &gps[k], decode, NULL, NULL, &solo,
                                            &diag) == DIT_OK,
                      "%s: %s", what, diag.msg);
        ck_assert_int_eq(res[k].num_images, solo.num_images);
        ck_assert_int_eq(res[k].latents_ndim, solo.latents_ndim);
        for (int i = 0; i < solo.latents_ndim; i++)
            ck_assert_int_eq(res[k].latents_shape[i], solo.latents_shape[i]);
        const int64_t nl = latent_numel(&solo);
        const test_err e0 = compare_n(res[k].initial_latents, solo.initial_latents, nl);
        const test_err e1 = compare_n(res[k].latents, solo.latents, nl);
        ck_assert_msg(e0.max_abs == 0, "%s: member %d's noise differs", what, k);
        ck_assert_msg(e1.rel <= BATCH_TOL, "%s: member %d latents rel %.3g", what, k, e1.rel);
        worst = e1.rel > worst ? e1.rel : worst;
        identical = identical && e1.max_abs == 0;
        if (decode) {
            const int64_t ni =
                (int64_t)3 * solo.frames * solo.height * solo.width * solo.num_images;
            ck_assert_ptr_nonnull(res[k].image);
            const test_err e2 = compare_n(res[k].image, solo.image, ni);
            ck_assert_msg(e2.rel <= IMAGE_TOL, "%s: member %d image rel %.3g", what, k, e2.rel);
            worst_img = e2.rel > worst_img ? e2.rel : worst_img;
        }
        /* Members differ from each other (their own prompts and seeds). */
        if (k > 0 && res[0].latents && latent_numel(&res[0]) <= nl) {
            const test_err d = compare_n(res[0].latents, res[k].latents, latent_numel(&res[0]));
            ck_assert_msg(d.rel > 1e-2, "%s: members 0 and %d are the same", what, k);
        }
        dit_gen_result_free(&solo);
    }
    printf("%-44s batch vs alone: latents max rel %.2g (%s)", what, worst,
           identical ? "bit-identical" : "not bit-identical");
    if (decode)
        printf(", images max rel %.2g", worst_img);
    printf("\n");
    fflush(stdout);
    for (int k = 0; k < n; k++)
        dit_gen_result_free(&res[k]);
}

static dit_gen_params flux_base(void)
{
    dit_gen_params gp;
    memset(&gp, 0, sizeof gp);
    gp.width = 64;
    gp.height = 48;
    gp.steps = 3;
    gp.guidance_scale = 3.5f;
    gp.true_cfg_scale = 1.0f;
    gp.max_sequence_length = 32;
    return gp;
}

static dit_gen_params wan_base(void)
{
    dit_gen_params gp;
    memset(&gp, 0, sizeof gp);
    gp.width = 64;
    gp.height = 48;
    gp.frames = 5;
    gp.steps = 3;
    gp.guidance_scale = 4.0f;
    gp.true_cfg_scale = 1.0f;
    gp.max_sequence_length = 32;
    return gp;
}

/* Three FLUX members: their own prompts, seeds and distilled guidance, one
 * with two images (batch 4 per forward). */
START_TEST(flux_batch_matches_alone)
{
    fixture f;
    fixture_open(&f, "demo");
    dit_gen_params gps[3] = {flux_base(), flux_base(), flux_base()};
    gps[0].prompt = "a red fox in the snow";
    gps[0].seed = 7;
    gps[1].prompt = "a bowl of ramen";
    gps[1].seed = 3;
    gps[1].guidance_scale = 5.0f;
    gps[1].num_images = 2;
    gps[2].prompt = "a lighthouse";
    gps[2].seed = 11;
    gps[2].guidance_scale = 2.0f;
    check_batch_vs_solo(&f, "FLUX 3 members (1 + 2 + 1 images)", 3, gps, NULL, true);
    fixture_close(&f);
}
END_TEST

/* True CFG: each member's own negative prompt and true_cfg_scale; the
 * forward is [cond of every member, then uncond of every member]; also as
 * two passes. */
START_TEST(flux_true_cfg_batch_matches_alone)
{
    fixture f;
    fixture_open(&f, "demo");
    dit_gen_params gps[3] = {flux_base(), flux_base(), flux_base()};
    const char *prompts[3] = {"a red fox", "a bowl of ramen", "a lighthouse at dusk"};
    const char *negs[3] = {"blurry", "", "low quality, watermark"};
    const float scales[3] = {3.0f, 1.5f, 5.0f};
    for (int k = 0; k < 3; k++) {
        gps[k].prompt = prompts[k];
        gps[k].negative_prompt = negs[k];
        gps[k].true_cfg_scale = scales[k];
        gps[k].seed = (uint64_t)(20 + k);
        gps[k].cfg_two_pass = _i == 1;
    }
    gps[2].num_images = 2;
    check_batch_vs_solo(
        &f, _i ? "FLUX true CFG 3 members, two passes" : "FLUX true CFG 3 members (one forward)", 3,
        gps, NULL, _i == 0);
    fixture_close(&f);
}
END_TEST

START_TEST(wan_cfg_batch_matches_alone)
{
    fixture f;
    fixture_open(&f, "wan_demo");
    dit_gen_params gps[2] = {wan_base(), wan_base()};
    gps[0].prompt = "a boat on a lake";
    gps[0].negative_prompt = "ugly";
    gps[0].seed = 5;
    gps[1].prompt = "a cat playing piano";
    gps[1].seed = 9;
    gps[1].guidance_scale = 6.0f;
    check_batch_vs_solo(&f, "Wan CFG 2 members", 2, gps, NULL, true);
    fixture_close(&f);
}
END_TEST

/* A member leaving after step 1 of 3 (FLUX, true CFG) and after step 2
 * (Wan: UniPC keeps a history, the others' must not notice): the others
 * equal their lone runs, the one that left is CANCELLED and empty. */
START_TEST(member_leaves_mid_batch)
{
    fixture f;
    fixture_open(&f, _i ? "wan_demo" : "demo");
    dit_gen_params gps[3];
    const char *prompts[3] = {"a red fox", "a bowl of ramen", "a lighthouse"};
    for (int k = 0; k < 3; k++) {
        gps[k] = _i ? wan_base() : flux_base();
        gps[k].prompt = prompts[k];
        gps[k].negative_prompt = "blurry";
        gps[k].true_cfg_scale = _i ? 1.0f : 2.0f + (float)k;
        gps[k].seed = (uint64_t)(30 + k);
    }
    leave_plan lp = {.leave = {0}};
    lp.leave[_i ? 0 : 1] = _i ? 2 : 1;
    check_batch_vs_solo(
        &f, _i ? "Wan, member 0 leaves after step 2" : "FLUX, member 1 leaves after step 1", 3, gps,
        &lp, true);
    ck_assert_int_eq(lp.calls, 3);
    fixture_close(&f);
}
END_TEST

/* Members bringing embeddings next to members encoding text: the text
 * length is the batch's (here member 0's embeddings say 32 tokens, and its
 * max_sequence_length is left at the default). */
START_TEST(flux_embeddings_and_text_members)
{
    fixture f;
    fixture_open(&f, "demo");
    enum { L = 32, D = 32 };
    static float emb[L * D], pooled[D];
    for (int i = 0; i < L * D; i++)
        emb[i] = sinf(0.37f * (float)i);
    for (int i = 0; i < D; i++)
        pooled[i] = cosf(0.91f * (float)i);
    dit_gen_params gps[2] = {flux_base(), flux_base()};
    gps[0].max_sequence_length = 0;
    gps[0].prompt_embeds = emb;
    gps[0].prompt_embeds_len = L;
    gps[0].pooled_prompt_embeds = pooled;
    gps[0].seed = 4;
    gps[1].prompt = "a bowl of ramen";
    gps[1].seed = 5;
    check_batch_vs_solo(&f, "FLUX embeddings member + text member", 2, gps, NULL, false);
    fixture_close(&f);
}
END_TEST

static dit_status stop_all(void *ctx, int step, int total, double elapsed_ms, bool *active)
{
    (void)total;
    (void)elapsed_ms;
    int *calls = ctx;
    (*calls)++;
    if (step == 1) {
        active[0] = false;
        active[1] = false;
    }
    return DIT_OK;
}

static dit_status fail_step2(void *ctx, int step, int total, double elapsed_ms, bool *active)
{
    (void)ctx;
    (void)total;
    (void)elapsed_ms;
    (void)active;
    return step == 2 ? DIT_ERR_PEER : DIT_OK;
}

/* The decode masks: only the members and images they name are decoded (a
 * mesh spreads a batch's images over its ranks), each image bit for bit
 * what decoding every one gives (the forwards are the same); a member with
 * none keeps its latents and no image. With no masks nothing is
 * decoded. */
START_TEST(decode_mask_names_members)
{
    fixture f;
    fixture_open(&f, "demo");
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_gen_params gps[3] = {flux_base(), flux_base(), flux_base()};
    gps[0].prompt = "a red fox";
    gps[1].prompt = "a bowl of ramen";
    gps[1].seed = 3;
    gps[1].num_images = 2;
    gps[2].prompt = "a lighthouse";
    gps[2].seed = 5;
    dit_gen_result all[3], some[3], none[3], part[3];
    dit_status mst[3];
    const dit_gen_decode every[3] = {DIT_GEN_DECODE_ALL, DIT_GEN_DECODE_ALL, DIT_GEN_DECODE_ALL};
    const dit_gen_decode skip0[3] = {0, DIT_GEN_DECODE_ALL, DIT_GEN_DECODE_ALL};
    const dit_gen_decode second[3] = {0, 2u, 1u}; /* member 1's image 1, member 2's image 0 */
    ck_assert_msg(dit_pipeline_generate_batch(f.p, &f.den, 3, gps, every, NULL, NULL, all, mst,
                                              &diag) == DIT_OK,
                  "%s", diag.msg);
    ck_assert_msg(dit_pipeline_generate_batch(f.p, &f.den, 3, gps, skip0, NULL, NULL, some, mst,
                                              &diag) == DIT_OK,
                  "%s", diag.msg);
    ck_assert_msg(dit_pipeline_generate_batch(f.p, &f.den, 3, gps, NULL, NULL, NULL, none, mst,
                                              &diag) == DIT_OK,
                  "%s", diag.msg);
    ck_assert_msg(dit_pipeline_generate_batch(f.p, &f.den, 3, gps, second, NULL, NULL, part, mst,
                                              &diag) == DIT_OK,
                  "%s", diag.msg);
    for (int k = 0; k < 3; k++) {
        ck_assert_int_eq(mst[k], DIT_OK);
        const int64_t nl = latent_numel(&all[k]);
        ck_assert_int_eq(compare_n(some[k].latents, all[k].latents, nl).max_abs, 0);
        ck_assert_int_eq(compare_n(none[k].latents, all[k].latents, nl).max_abs, 0);
        ck_assert_ptr_nonnull(all[k].image);
        ck_assert_ptr_null(none[k].image);
        ck_assert_int_eq(compare_n(part[k].latents, all[k].latents, nl).max_abs, 0);
        if (k == 0) {
            ck_assert_ptr_null(some[k].image);
            ck_assert(some[k].vae_ms == 0.0);
            ck_assert_ptr_null(part[k].image);
            continue;
        }
        ck_assert_ptr_nonnull(some[k].image);
        const int64_t one = (int64_t)3 * all[k].height * all[k].width;
        ck_assert_int_eq(compare_n(some[k].image, all[k].image, one * all[k].num_images).max_abs,
                         0);
        /* The image its mask names, in its own place. */
        ck_assert_ptr_nonnull(part[k].image);
        const int64_t at = k == 1 ? one : 0;
        ck_assert_int_eq(compare_n(part[k].image + at, all[k].image + at, one).max_abs, 0);
        ck_assert(part[k].vae_ms > 0.0);
    }
    for (int k = 0; k < 3; k++) {
        dit_gen_result_free(&all[k]);
        dit_gen_result_free(&some[k]);
        dit_gen_result_free(&none[k]);
        dit_gen_result_free(&part[k]);
    }
    fixture_close(&f);
}
END_TEST

/* Every member leaving: DIT_ERR_CANCELLED, every result empty. A callback
 * failing stops the batch with its status. Members that cannot share
 * forwards are refused. */
START_TEST(all_leave_and_bad_batches)
{
    fixture f;
    fixture_open(&f, "demo");
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_gen_params gps[2] = {flux_base(), flux_base()};
    gps[0].prompt = "a";
    gps[1].prompt = "b";
    gps[1].seed = 1;
    dit_gen_result res[2];
    dit_status mst[2];
    const dit_gen_decode all_true[2] = {DIT_GEN_DECODE_ALL, DIT_GEN_DECODE_ALL};
    int calls = 0;
    ck_assert_int_eq(dit_pipeline_generate_batch(f.p, &f.den, 2, gps, all_true, stop_all, &calls,
                                                 res, mst, &diag),
                     DIT_ERR_CANCELLED);
    ck_assert_int_eq(calls, 1);
    ck_assert_ptr_nonnull(strstr(diag.msg, "every member of the batch left"));
    for (int k = 0; k < 2; k++) {
        ck_assert_int_eq(mst[k], DIT_ERR_CANCELLED);
        ck_assert_ptr_null(res[k].latents);
        ck_assert_ptr_null(res[k].initial_latents);
        ck_assert_ptr_null(res[k].image);
    }

    ck_assert_int_eq(dit_pipeline_generate_batch(f.p, &f.den, 2, gps, all_true, fail_step2, NULL,
                                                 res, mst, &diag),
                     DIT_ERR_PEER);
    for (int k = 0; k < 2; k++) {
        ck_assert_int_eq(mst[k], DIT_ERR_PEER);
        ck_assert_ptr_null(res[k].latents);
    }

    /* Different steps; CFG on for one only; different sizes. */
    dit_gen_params bad[2] = {gps[0], gps[1]};
    bad[1].steps = 4;
    dit_diag_clear(&diag);
    ck_assert_int_eq(
        dit_pipeline_generate_batch(f.p, &f.den, 2, bad, NULL, NULL, NULL, res, mst, &diag),
        DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(diag.msg, "batch member 1 cannot share forwards"));
    ck_assert_int_eq(mst[0], DIT_ERR_INVALID_ARG);
    bad[1] = gps[1];
    bad[1].negative_prompt = "x";
    bad[1].true_cfg_scale = 2.0f;
    dit_diag_clear(&diag);
    ck_assert_int_eq(
        dit_pipeline_generate_batch(f.p, &f.den, 2, bad, NULL, NULL, NULL, res, mst, &diag),
        DIT_ERR_INVALID_ARG);
    bad[1] = gps[1];
    bad[1].width = 32;
    dit_diag_clear(&diag);
    ck_assert_int_eq(
        dit_pipeline_generate_batch(f.p, &f.den, 2, bad, NULL, NULL, NULL, res, mst, &diag),
        DIT_ERR_INVALID_ARG);
    /* A member failing its own check names the member. */
    bad[1] = gps[1];
    bad[1].steps = 0;
    bad[0].steps = 0;
    dit_diag_clear(&diag);
    ck_assert_int_eq(
        dit_pipeline_generate_batch(f.p, &f.den, 2, bad, NULL, NULL, NULL, res, mst, &diag),
        DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(diag.msg, "batch member 0: "));
    dit_diag_clear(&diag);
    ck_assert_int_eq(
        dit_pipeline_generate_batch(f.p, &f.den, 0, gps, NULL, NULL, NULL, res, mst, &diag),
        DIT_ERR_INVALID_ARG);
    fixture_close(&f);
}
END_TEST

/* ditrun generate --member: a batch of 2 (true CFG, member 1 with two
 * images) on one rank, on ring 2 and on Ulysses 2, against each member
 * alone on one rank; a third member leaving after step 1 writes nothing. */
START_TEST(ditrun_batch_on_meshes)
{
    char out[16384], demo[1100], png[128], lat[128], solo_lat[2][128], path[256];
    const int pid = (int)getpid();
    snprintf(demo, sizeof demo, "%s/tests/data/demo", test_env("DIT_SOURCE_ROOT"));
    snprintf(png, sizeof png, "/tmp/dit_batch_%d.png", pid);
    snprintf(lat, sizeof lat, "/tmp/dit_batch_%d.safetensors", pid);
    char *ditrun = (char *)test_env("DITRUN");
    const char *members[3] = {"prompt=a red fox;seed=7;true_cfg=3",
                              ("prompt=a bowl of ramen;negative_prompt=low quality;seed=3;"
                               "true_cfg=2;guidance=5;num_images=2"),
                              "prompt=a lighthouse;seed=9;true_cfg=2;leave=1"};
    const char *solo_args[2][8] = {
        {"--prompt", "a red fox", "--seed", "7", "--true-cfg", "3", NULL},
        {"--prompt", "a bowl of ramen", "--negative-prompt", "low quality", "--seed", "3",
         "--true-cfg", "2"}};
    /* Each member alone (member 1 with --guidance 5 --num-images 2). */
    for (int k = 0; k < 2; k++) {
        snprintf(solo_lat[k], sizeof solo_lat[k], "/tmp/dit_batch_solo%d_%d.safetensors", k, pid);
        char *argv[40] = {ditrun,      "generate", "--model",  demo,       "--negative-prompt",
                          "blurry",    "--width",  "64",       "--height", "48",
                          "--steps",   "3",        "--output", png,        "--output-latents",
                          solo_lat[k], "-q"};
        int n = 17;
        for (int i = 0; i < 8 && solo_args[k][i]; i++)
            argv[n++] = (char *)solo_args[k][i];
        if (k == 1) {
            argv[n++] = "--guidance";
            argv[n++] = "5";
            argv[n++] = "--num-images";
            argv[n++] = "2";
        }
        argv[n] = NULL;
        const int rc = test_run(argv, NULL, out, sizeof out, NULL);
        ck_assert_msg(rc == 0, "solo %d: exit %d:\n%s", k, rc, out);
    }
    char *single[] = {NULL};
    char *ring[] = {"--world-size", "2", "--ring", "2", NULL};
    char *uly[] = {"--world-size", "2", "--ulysses", "2", NULL};
    char *const *layouts[] = {single, ring, uly};
    const char *names[] = {"one rank", "ring 2", "ulysses 2"};
    for (int l = 0; l < 3; l++) {
        char *argv[40] = {ditrun,
                          "generate",
                          "--model",
                          demo,
                          "--prompt",
                          "unused",
                          "--negative-prompt",
                          "blurry",
                          "--width",
                          "64",
                          "--height",
                          "48",
                          "--steps",
                          "3",
                          "--output",
                          png,
                          "--output-latents",
                          lat,
                          "--member",
                          (char *)members[0],
                          "--member",
                          (char *)members[1],
                          "--member",
                          (char *)members[2]};
        int n = 24;
        for (int i = 0; layouts[l][i]; i++)
            argv[n++] = layouts[l][i];
        argv[n] = NULL;
        const int rc = test_run(argv, NULL, out, sizeof out, NULL);
        ck_assert_msg(rc == 0, "%s: exit %d:\n%s", names[l], rc, out);
        ck_assert_msg(strstr(out, "member 2: left the batch after step 1"), "%s:\n%s", names[l],
                      out);
        for (int k = 0; k < 2; k++) {
            snprintf(path, sizeof path, "/tmp/dit_batch_%d_%d.safetensors", pid, k);
            const test_err e = test_compare_files(path, "latents", solo_lat[k], "latents");
            printf("ditrun --member batch, %-9s member %d vs alone on one rank: latents rel "
                   "%.2g\n",
                   names[l], k, e.rel);
            fflush(stdout);
            ck_assert_msg(e.rel <= BATCH_TOL, "%s member %d: rel %.3g", names[l], k, e.rel);
            unlink(path);
        }
        snprintf(path, sizeof path, "/tmp/dit_batch_%d_2.safetensors", pid);
        ck_assert_int_ne(access(path, F_OK), 0);
        snprintf(path, sizeof path, "/tmp/dit_batch_%d_0.png", pid);
        ck_assert_int_eq(access(path, F_OK), 0);
        unlink(path);
        for (int j = 0; j < 2; j++) {
            snprintf(path, sizeof path, "/tmp/dit_batch_%d_1_%d.png", pid, j);
            ck_assert_msg(access(path, F_OK) == 0, "%s: %s missing", names[l], path);
            unlink(path);
        }
    }
    for (int k = 0; k < 2; k++)
        unlink(solo_lat[k]);
    snprintf(path, sizeof path, "/tmp/dit_batch_%d_0.png", pid);
    unlink(path);

    /* Bad specs. */
    const char *bad[][2] = {{"seed=x", "seed=x is not a valid value"},
                            {"colour=red", "unknown key 'colour'"},
                            {"prompt", "'prompt' is not KEY=VALUE"},
                            {"num_images=9", "num_images=9"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char *argv[] = {ditrun, "generate", "--model",         demo, "--prompt", "x", "--output",
                        png,    "--member", (char *)bad[i][0], NULL};
        ck_assert_int_eq(test_run(argv, NULL, out, sizeof out, NULL), 2);
        ck_assert_msg(strstr(out, bad[i][1]), "'%s' not in:\n%s", bad[i][1], out);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("batch");
    TCase *tc = tcase_create("pipeline");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, flux_batch_matches_alone);
    tcase_add_loop_test(tc, flux_true_cfg_batch_matches_alone, 0, 2);
    tcase_add_test(tc, wan_cfg_batch_matches_alone);
    tcase_add_test(tc, flux_embeddings_and_text_members);
    tcase_add_loop_test(tc, member_leaves_mid_batch, 0, 2);
    tcase_add_test(tc, decode_mask_names_members);
    tcase_add_test(tc, all_leave_and_bad_batches);
    suite_add_tcase(s, tc);
    TCase *cli = tcase_create("cli");
    tcase_set_timeout(cli, 600);
    tcase_add_test(cli, ditrun_batch_on_meshes);
    suite_add_tcase(s, cli);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
