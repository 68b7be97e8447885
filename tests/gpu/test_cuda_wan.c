/* Wan 2.1's three models on the cuda backend against the references the cpu
 * suites use (outputs computed by diffusers / transformers in f32):
 *  - wan_golden: every WanTransformer3DModel case of tests/data/wan_golden
 *    through `ditrun forward --backend cuda` (as test_wan_golden does on
 *    the cpu);
 *  - wan_vae: AutoencoderKLWan decode of 1, 2 and 3 latent frames of
 *    tests/data/wan_vae, in process on a cuda backend (as test_wan_vae);
 *  - umt5: UMT5EncoderModel's masked forward, prompt by prompt and as one
 *    batch of mixed lengths, and WanPipeline's prompt embeds (cleaning,
 *    tokenizer, zero rows past each prompt) of tests/data/umt5 (as
 *    test_umt5).
 *
 * Tolerance: max|cuda - reference| / max|reference| <= 2e-2, the golden
 * suite's bound (test_cuda_golden.c explains it: bf16 weights and GEMM
 * inputs, f32 accumulation, ~5e-3 measured on FLUX's cases); a wrong kernel
 * or a view an op reads wrongly gives errors of order 1. The prompt
 * embeds' rows past a prompt's tokens must still be exactly zero.
 *
 * The VAE decodes and the pipeline's videos have a bound of their own: the
 * tiny random Wan VAE amplifies rounding (bf16 rounding of any one of its
 * convolutions alone moves its output by 3e-3 to 1e-2), so that diffusers'
 * own decode with bf16 operands lands 1.1e-2 to 2.2e-2 off its f32 one, and
 * its whole pipeline's videos 5e-2 to 9e-2 off. tests/golden/
 * gen_wan_bf16_error.py measures these and writes them to the fixtures'
 * bf16_error.json; those results are bound here by twice diffusers' bf16
 * error (never below 2e-2): a correct bf16 backend lands near 1x, a wrong
 * kernel orders of magnitude above.
 *
 * Exits 77 (meson: SKIP) without a usable CUDA device, 1 instead with
 * DIT_GPU_REQUIRED=1. */
#include <check.h>
#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/arena.h"
#include "encoders/t5_tokenizer.h"
#include "encoders/umt5_encoder.h"
#include "loader/json_util.h"
#include "loader/safetensors.h"
#include "pipelines/pipeline.h"
#include "runtime/runner.h"
#include "vae/autoencoder_kl_wan.h"
#include "../test_proc.h"
#include "gpu_util.h"

#define WAN_CUDA_REL_TOL 2e-2
/* The bound on a result the VAE decodes, as a multiple of diffusers' own
 * bf16-operand error on it (bf16_error.json). */
#define WAN_CUDA_BF16_FACTOR 2.0

enum { MAX_CASES = 64 };
static char case_dirs[MAX_CASES][1024]; /* filled once in main, read-only after */
static int n_cases;
static dit_backend *g_gpu; /* set in main, read-only afterwards */
static char data_dir[600];

static void report_within(const char *what, test_err e, double tol)
{
    printf("%-28s cuda vs reference f32: max abs %.3g, max|ref| %.3g, rel %.3g (bound %.3g)\n",
           what, e.max_abs, e.max_ref, e.rel, tol);
    fflush(stdout);
    ck_assert_msg(e.rel <= tol, "%s: relative error %.3g exceeds %.3g", what, e.rel, tol);
}

static void report(const char *what, test_err e)
{
    report_within(what, e, WAN_CUDA_REL_TOL);
}

/* The bound on a decoded result: WAN_CUDA_BF16_FACTOR times diffusers'
 * bf16-operand error on it, as <fixture>/bf16_error.json records it at
 * `key` (an array index when idx >= 0, else field `field` of object `key`),
 * and never below WAN_CUDA_REL_TOL. */
static double bf16_bound(const char *fixture, const char *key, int idx, const char *field)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/%s/bf16_error.json", data_dir, fixture);
    cJSON *j = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_json_load_file(path, &j, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    v = idx >= 0 ? cJSON_GetArrayItem(v, idx) : cJSON_GetObjectItemCaseSensitive(v, field);
    ck_assert_msg(cJSON_IsNumber(v) && v->valuedouble > 0 && v->valuedouble < 1,
                  "%s: no error for %s[%d]%s", path, key, idx, field ? field : "");
    const double tol = WAN_CUDA_BF16_FACTOR * v->valuedouble;
    cJSON_Delete(j);
    return tol > WAN_CUDA_REL_TOL ? tol : WAN_CUDA_REL_TOL;
}

/* ---- WanTransformer3DModel through ditrun -------------------------------- */

START_TEST(wan_golden_case_on_cuda)
{
    const char *dir = case_dirs[_i];
    const char *name = strrchr(dir, '/') + 1;
    char model[1100], inputs[1100], expected[1100], output[1100], log[8192], what[64];
    snprintf(model, sizeof model, "%s/transformer", dir);
    snprintf(inputs, sizeof inputs, "%s/inputs.safetensors", dir);
    snprintf(expected, sizeof expected, "%s/expected.safetensors", dir);
    snprintf(output, sizeof output, "/tmp/dit_cuda_wan_%d_%s.safetensors", (int)getpid(), name);
    char *argv[] = {(char *)test_env("DITRUN"),
                    "forward",
                    "--model",
                    model,
                    "--inputs",
                    inputs,
                    "--output",
                    output,
                    "--backend",
                    "cuda",
                    "--quiet",
                    NULL};
    int rc = test_run(argv, NULL, log, sizeof log, NULL);
    ck_assert_msg(rc == 0, "%s: ditrun --backend cuda exited %d:\n%s", name, rc, log);
    snprintf(what, sizeof what, "wan %s", name);
    report(what, test_compare_files(output, "sample", expected, "sample"));
    unlink(output);
}
END_TEST

/* ---- AutoencoderKLWan decode ------------------------------------------- */

START_TEST(wan_vae_decode_on_cuda)
{
    const int k = _i + 1;
    char vdir[1200], io[1200], key[24], what[64];
    snprintf(vdir, sizeof vdir, "%s/wan_vae/vae", data_dir);
    snprintf(io, sizeof io, "%s/wan_vae/io.safetensors", data_dir);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_wan_vae *v = NULL;
    ck_assert_msg(dit_wan_vae_load(g_gpu, vdir, &v, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    dit_st_file *f = NULL;
    ck_assert_msg(dit_st_file_open(io, &f, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    snprintf(key, sizeof key, "z%d", k);
    const dit_st_entry *ze = dit_st_file_find(f, key);
    snprintf(key, sizeof key, "video%d", k);
    const dit_st_entry *re = dit_st_file_find(f, key);
    ck_assert_msg(ze && re, "io.safetensors lacks z%d or video%d", k, k);
    ck_assert_int_eq(ze->view.dtype, DIT_F32);
    /* decode reads a contiguous f32 host copy (the mapped file is
     * read-only) and writes f32 into its own buffer. */
    float *zbuf = malloc(dit_tensor_nbytes(&ze->view));
    float *vbuf = malloc((size_t)dit_tensor_numel(&re->view) * sizeof *vbuf);
    ck_assert(zbuf && vbuf);
    memcpy(zbuf, ze->view.data, dit_tensor_nbytes(&ze->view));
    dit_tensor z = dit_tensor_make(zbuf, DIT_F32, ze->view.ndim, ze->view.ne);
    dit_tensor out = dit_tensor_make(vbuf, DIT_F32, re->view.ndim, re->view.ne);
    ck_assert_msg(dit_wan_vae_decode(v, &z, &out, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    snprintf(what, sizeof what, "wan vae %d latent frames", k);
    report_within(what, test_compare_views(&out, &re->view),
                  bf16_bound("wan_vae", "decode", _i, NULL));
    free(zbuf);
    free(vbuf);
    dit_st_file_close(f);
    dit_wan_vae_free(v);
}
END_TEST

/* ---- UMT5 encoder and prompt embeds ------------------------------------ */

typedef struct umt5_fx {
    cJSON *root;
    dit_st_file *io;
    dit_t5_tokenizer *tok;
    dit_umt5_encoder *enc;
    dit_arena *arena;
    int L, D, P;
} umt5_fx;

static const cJSON *prompt_at(const umt5_fx *g, int k)
{
    return cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(g->root, "prompts"), k);
}

static int int_of(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    ck_assert_msg(cJSON_IsNumber(v), "cases.json: no number %s", key);
    return v->valueint;
}

static const char *str_of(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    ck_assert_msg(cJSON_IsString(v), "cases.json: no string %s", key);
    return v->valuestring;
}

static void umt5_open(umt5_fx *g)
{
    memset(g, 0, sizeof *g);
    char p[1100];
    dit_diag diag;
    dit_diag_clear(&diag);
    snprintf(p, sizeof p, "%s/umt5/cases.json", data_dir);
    ck_assert_msg(dit_json_load_file(p, &g->root, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    g->L = int_of(g->root, "max_sequence_length");
    g->P = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(g->root, "prompts"));
    snprintf(p, sizeof p, "%s/%s", data_dir, str_of(g->root, "tokenizer"));
    ck_assert_msg(dit_t5_tokenizer_load(p, &g->tok, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    snprintf(p, sizeof p, "%s/umt5/text_encoder", data_dir);
    ck_assert_msg(dit_umt5_encoder_load(g_gpu, p, &g->enc, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    g->D = dit_umt5_encoder_d_model(g->enc);
    snprintf(p, sizeof p, "%s/umt5/io.safetensors", data_dir);
    ck_assert_msg(dit_st_file_open(p, &g->io, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_int_eq(dit_arena_create(g_gpu, 0, &g->arena), DIT_OK);
}

static void umt5_close(umt5_fx *g)
{
    dit_arena_destroy(g->arena);
    dit_st_file_close(g->io);
    dit_umt5_encoder_free(g->enc);
    dit_t5_tokenizer_free(g->tok);
    cJSON_Delete(g->root);
}

/* A host f32 copy of io.safetensors' tensor `name` (want_n elements). */
static float *io_tensor(const umt5_fx *g, const char *name, size_t want_n)
{
    const dit_st_entry *e = dit_st_file_find(g->io, name);
    ck_assert_msg(e != NULL, "io.safetensors: no %s", name);
    size_t n = (size_t)dit_tensor_numel(&e->view);
    ck_assert_uint_eq(n, want_n);
    float *p = malloc(n * sizeof *p + 1);
    ck_assert_ptr_nonnull(p);
    dit_convert_to_f32(p, e->view.data, e->view.dtype, n);
    return p;
}

static test_err compare_rows(const float *got, const float *want, size_t n)
{
    dit_tensor a = dit_tensor_1d((void *)got, DIT_F32, (int64_t)n);
    dit_tensor b = dit_tensor_1d((void *)want, DIT_F32, (int64_t)n);
    return test_compare_views(&a, &b);
}

/* The masked forward over all L rows against UMT5EncoderModel(ids,
 * mask).last_hidden_state: each prompt alone (pass 0), then all prompts as
 * one batch of different lengths (pass 1). */
START_TEST(umt5_masked_forward_on_cuda)
{
    umt5_fx g;
    umt5_open(&g);
    const int L = g.L, D = g.D, P = g.P;
    int32_t *ids = malloc(sizeof *ids * (size_t)(P * L));
    int32_t *lens = malloc(sizeof *lens * (size_t)P);
    float *want = malloc(sizeof *want * (size_t)(P * L * D));
    float *got = malloc(sizeof *got * (size_t)(P * L * D));
    ck_assert(ids && lens && want && got);
    for (int k = 0; k < P; k++) {
        char name[32];
        snprintf(name, sizeof name, "p%d.ids", k);
        float *f = io_tensor(&g, name, (size_t)L);
        for (int i = 0; i < L; i++)
            ids[k * L + i] = (int32_t)f[i];
        free(f);
        lens[k] = int_of(prompt_at(&g, k), "n_tokens");
        snprintf(name, sizeof name, "p%d.hidden", k);
        f = io_tensor(&g, name, (size_t)(L * D));
        memcpy(want + (size_t)k * L * D, f, sizeof *f * (size_t)(L * D));
        free(f);
    }
    dit_diag diag;
    dit_diag_clear(&diag);
    for (int pass = 0; pass < 2; pass++) {
        const int64_t B = pass == 0 ? 1 : P;
        for (int k = 0; k < (pass == 0 ? P : 1); k++) {
            const int64_t shp[3] = {B, L, D};
            dit_tensor out;
            ck_assert_int_eq(dit_arena_tensor(g.arena, DIT_F32, 3, shp, &out), DIT_OK);
            ck_assert_msg(dit_umt5_encoder_forward(g.enc, g.arena, ids + k * L, lens + k, B, L,
                                                   &out, &diag) == DIT_OK,
                          "%s", dit_diag_msg(&diag));
            dit_tensor host = dit_tensor_3d(got + (size_t)k * L * D, DIT_F32, B, L, D);
            GPU_OK(g_gpu, g_gpu->ops->download(g_gpu, &host, &out));
            dit_arena_reset(g.arena);
        }
        test_err worst = {0, 0, 0};
        for (int k = 0; k < P; k++) {
            test_err e =
                compare_rows(got + (size_t)k * L * D, want + (size_t)k * L * D, (size_t)(L * D));
            if (!(e.rel <= worst.rel))
                worst = e;
        }
        report(pass == 0 ? "umt5 forward, each prompt" : "umt5 forward, mixed batch", worst);
    }
    free(got);
    free(want);
    free(ids);
    free(lens);
    umt5_close(&g);
}
END_TEST

/* dit_umt5_prompt_embeds on the raw prompts against WanPipeline's
 * _get_t5_prompt_embeds of the whole list; rows from each prompt's token
 * count on exactly zero. */
START_TEST(umt5_prompt_embeds_on_cuda)
{
    umt5_fx g;
    umt5_open(&g);
    const int L = g.L, D = g.D, P = g.P;
    const char **prompts = calloc((size_t)P, sizeof *prompts);
    int32_t *n_tok = calloc((size_t)P, sizeof *n_tok);
    float *got = malloc(sizeof *got * (size_t)(P * L * D));
    ck_assert(prompts && n_tok && got);
    for (int k = 0; k < P; k++)
        prompts[k] = str_of(prompt_at(&g, k), "text");
    float *want = io_tensor(&g, "batch.embeds", (size_t)(P * L * D));
    const int64_t shp[3] = {P, L, D};
    dit_tensor out;
    ck_assert_int_eq(dit_arena_tensor(g.arena, DIT_F32, 3, shp, &out), DIT_OK);
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_umt5_prompt_embeds(g.enc, g.tok, g.arena, prompts, P, L, &out, n_tok, NULL,
                                         &diag) == DIT_OK,
                  "%s", dit_diag_msg(&diag));
    dit_tensor host = dit_tensor_3d(got, DIT_F32, P, L, D);
    GPU_OK(g_gpu, g_gpu->ops->download(g_gpu, &host, &out));
    dit_arena_reset(g.arena);
    report("umt5 prompt embeds", compare_rows(got, want, (size_t)(P * L * D)));
    for (int k = 0; k < P; k++) {
        const int n = int_of(prompt_at(&g, k), "n_tokens");
        ck_assert_int_eq(n_tok[k], n);
        const float *row = got + (size_t)k * L * D;
        for (int i = n; i < L; i++)
            for (int d = 0; d < D; d++)
                ck_assert_msg(row[(size_t)i * D + d] == 0.0f, "prompt %d row %d is not zero", k, i);
    }
    free(want);
    free(got);
    free(n_tok);
    free(prompts);
    umt5_close(&g);
}
END_TEST

/* ---- WanPipeline end to end ----------------------------------------------- */

/* The whole pipeline on cuda (UMT5, the transformer through the runner,
 * UniPC, the VAE) against diffusers' references of tests/data/wan_demo. */
START_TEST(wan_pipeline_on_cuda)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/wan_demo/reference.json", data_dir);
    cJSON *j = NULL;
    ck_assert_int_eq(dit_json_load_file(path, &j, NULL), DIT_OK);
    const cJSON *c = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "cases"), _i);
    ck_assert_ptr_nonnull(c);
    const char *name = cJSON_GetStringValue(cJSON_GetObjectItem(c, "name"));
    const cJSON *neg = cJSON_GetObjectItem(c, "negative_prompt");
    dit_gen_params gp;
    memset(&gp, 0, sizeof gp);
    gp.prompt = cJSON_GetStringValue(cJSON_GetObjectItem(c, "prompt"));
    gp.negative_prompt = cJSON_IsString(neg) ? cJSON_GetStringValue(neg) : NULL;
    gp.width = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(c, "width"));
    gp.height = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(c, "height"));
    gp.frames = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(c, "num_frames"));
    gp.steps = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(c, "num_inference_steps"));
    gp.guidance_scale = (float)cJSON_GetNumberValue(cJSON_GetObjectItem(c, "guidance_scale"));
    gp.true_cfg_scale = 1.0f;
    gp.seed = (uint64_t)cJSON_GetNumberValue(cJSON_GetObjectItem(c, "seed"));
    gp.max_sequence_length =
        (int)cJSON_GetNumberValue(cJSON_GetObjectItem(c, "max_sequence_length"));
    dit_diag diag;
    dit_diag_clear(&diag);
    snprintf(path, sizeof path, "%s/wan_demo", data_dir);
    dit_pipeline *p = NULL;
    ck_assert_msg(dit_pipeline_load(g_gpu, path, NULL, true, &p, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    dit_runner *runner = NULL;
    ck_assert_int_eq(dit_runner_create(g_gpu, dit_pipeline_transformer(p), NULL, &runner, NULL),
                     DIT_OK);
    const dit_denoiser den = dit_runner_denoiser(runner);
    dit_gen_result res;
    ck_assert_msg(dit_pipeline_generate(p, &den, &gp, true, NULL, NULL, &res, &diag) == DIT_OK,
                  "%s: %s", name, dit_diag_msg(&diag));
    snprintf(path, sizeof path, "%s/wan_demo/reference.safetensors", data_dir);
    dit_st_file *ref = NULL;
    ck_assert_int_eq(dit_st_file_open(path, &ref, NULL), DIT_OK);
    const char *what[2] = {"latents", "video"};
    const float *got[2] = {res.latents, res.image};
    for (int k = 0; k < 2; k++) {
        char key[96], label[128];
        snprintf(key, sizeof key, "%s.%s", name, what[k]);
        const dit_st_entry *e = dit_st_file_find(ref, key);
        ck_assert_msg(e != NULL, "no %s", key);
        const dit_tensor g = dit_tensor_make((void *)got[k], DIT_F32, e->view.ndim, e->view.ne);
        snprintf(label, sizeof label, "pipeline %s", key);
        const test_err err = test_compare_views(&g, &e->view);
        if (k == 0)
            report(label, err);
        else
            report_within(label, err, bf16_bound("wan_demo", name, -1, "video"));
    }
    dit_st_file_close(ref);
    dit_gen_result_free(&res);
    dit_runner_destroy(runner);
    dit_pipeline_free(p);
    cJSON_Delete(j);
}
END_TEST

static int cmp_str(const void *a, const void *b)
{
    return strcmp((const char *)a, (const char *)b);
}

int main(void)
{
    gpu_require_device("test_cuda_wan");
    snprintf(data_dir, sizeof data_dir, "%s/tests/data", test_env("DIT_SOURCE_ROOT"));
    char root[700];
    snprintf(root, sizeof root, "%s/wan_golden", data_dir);
    DIR *d = opendir(root);
    if (!d) {
        fprintf(stderr, "cannot open %s\n", root);
        return 1;
    }
    struct dirent *de;
    while ((de = readdir(d)) && n_cases < MAX_CASES) {
        if (de->d_name[0] == '.')
            continue;
        char probe[1200 + 256];
        struct stat sb;
        snprintf(probe, sizeof probe, "%s/%s/expected.safetensors", root, de->d_name);
        if (stat(probe, &sb) != 0)
            continue;
        snprintf(case_dirs[n_cases++], sizeof case_dirs[0], "%s/%s", root, de->d_name);
    }
    closedir(d);
    qsort(case_dirs, (size_t)n_cases, sizeof case_dirs[0], cmp_str);
    if (n_cases < 7) {
        fprintf(stderr, "expected at least 7 Wan golden cases under %s, found %d\n", root, n_cases);
        return 1;
    }
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend_config gc = {.kind = DIT_BACKEND_CUDA, .device = 0};
    if (dit_backend_create(&gc, &g_gpu, &diag) != DIT_OK) {
        fprintf(stderr, "test_cuda_wan: %s\n", dit_diag_msg(&diag));
        return 1;
    }
    Suite *s = suite_create("cuda_wan");
    TCase *tc = tcase_create("wan");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, wan_golden_case_on_cuda, 0, n_cases);
    tcase_add_loop_test(tc, wan_vae_decode_on_cuda, 0, 3);
    tcase_add_test(tc, umt5_masked_forward_on_cuda);
    tcase_add_test(tc, umt5_prompt_embeds_on_cuda);
    tcase_add_loop_test(tc, wan_pipeline_on_cuda, 0, 4);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    /* The probe above initialised CUDA in this process: no fork. */
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    dit_backend_destroy(g_gpu);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
