/* WanPipeline's text side: prompt_clean, the T5 unigram tokenizer on a
 * prompt, UMT5EncoderModel with its attention mask and per-layer relative
 * bias, and the whole prompt -> prompt_embeds path, on the CPU backend
 * against tests/data/umt5 (made by tests/golden/gen_umt5_golden.py with
 * transformers and diffusers' own prompt_clean). Plus the strict loader:
 * unexpected, missing and foreign checkpoints are errors naming the tensor
 * or key. */
#include <check.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/arena.h"
#include "encoders/prompt_clean.h"
#include "encoders/t5_tokenizer.h"
#include "encoders/umt5_encoder.h"
#include "loader/json_util.h"
#include "loader/safetensors.h"

/* max|ours - transformers| / max|transformers| (f32, summation order). */
#define REL_TOL 1e-5

static dit_backend *be;
static dit_arena *arena;
static char tmp_dir[64];
static char data_dir[1024];

static void setup(void)
{
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = 0};
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_backend_create(&cfg, &be, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_int_eq(dit_arena_create(be, 0, &arena), DIT_OK);
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/dit_umt5_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(tmp_dir));
    const char *root = getenv("DIT_SOURCE_ROOT");
    snprintf(data_dir, sizeof data_dir, "%s/tests/data", root ? root : ".");
}

static void teardown(void)
{
    const char *files[] = {"config.json", "model.safetensors"};
    for (size_t i = 0; i < 2; i++) {
        char p[128];
        snprintf(p, sizeof p, "%s/%s", tmp_dir, files[i]);
        unlink(p);
    }
    rmdir(tmp_dir);
    dit_arena_destroy(arena);
    dit_backend_destroy(be);
}

static cJSON *load_cases(void)
{
    char p[1100];
    snprintf(p, sizeof p, "%s/umt5/cases.json", data_dir);
    cJSON *root = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_json_load_file(p, &root, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    return root;
}

static const char *str_of(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    ck_assert_msg(cJSON_IsString(v), "cases.json: no string %s", key);
    return v->valuestring;
}

static int int_of(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    ck_assert_msg(cJSON_IsNumber(v), "cases.json: no number %s", key);
    return v->valueint;
}

static float *io_tensor(dit_st_file *io, const char *name, size_t want_n)
{
    const dit_st_entry *e = dit_st_file_find(io, name);
    ck_assert_msg(e != NULL, "io.safetensors: no %s", name);
    size_t n = (size_t)dit_tensor_numel(&e->view);
    ck_assert_uint_eq(n, want_n);
    float *p = malloc(n * sizeof *p + 1);
    dit_convert_to_f32(p, e->view.data, e->view.dtype, n);
    return p;
}

static double rel_err(const float *got, const float *want, size_t n)
{
    double max_abs = 0, max_ref = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)got[i] - (double)want[i]);
        if (!(d <= max_abs))
            max_abs = d;
        if (fabs((double)want[i]) > max_ref)
            max_ref = fabs((double)want[i]);
    }
    return max_ref > 0 ? max_abs / max_ref : max_abs;
}

/* ------------------------------------------------------------------------ */
/* prompt_clean                                                              */

static void check_clean(const char *text, const char *want)
{
    char *got = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_wan_prompt_clean(text, &got, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_msg(strcmp(got, want) == 0, "prompt_clean(\"%s\") = \"%s\", Python says \"%s\"", text,
                  got, want);
    free(got);
}

START_TEST(prompt_clean_matches_python)
{
    cJSON *root = load_cases();
    const cJSON *c;
    int n = 0;
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(root, "clean"))
    {
        check_clean(str_of(c, "text"), str_of(c, "clean"));
        n++;
    }
    cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(root, "prompts"))
    {
        check_clean(str_of(c, "text"), str_of(c, "clean"));
        n++;
    }
    ck_assert_int_ge(n, 20);
    cJSON_Delete(root);
}
END_TEST

START_TEST(html_unescape_basics)
{
    const char *cases[][2] = {
        {"a &amp; b", "a & b"},
        {"&amp;amp;", "&amp;"}, /* once only */
        {"&lt&gt", "<>"},
        {"&#x1F600;", "\xF0\x9F\x98\x80"},
        {"&#150;", "\xE2\x80\x93"},
        {"&#1;x", "x"},
        {"&#xD800;", "\xEF\xBF\xBD"},
        {"&notit;", "\xC2\xACit;"},
        {"&foo", "&foo"},
        {"", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *got = NULL;
        dit_diag diag;
        dit_diag_clear(&diag);
        ck_assert_int_eq(dit_html_unescape(cases[i][0], &got, &diag), DIT_OK);
        ck_assert_msg(strcmp(got, cases[i][1]) == 0, "unescape(\"%s\") = \"%s\"", cases[i][0], got);
        free(got);
    }
    char *got = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_wan_prompt_clean("bad \xC3(", &got, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_ptr_null(got);
    ck_assert(dit_unicode_is_space(0x3000) && dit_unicode_is_space(0x85));
    ck_assert(!dit_unicode_is_space(0x200B) && !dit_unicode_is_space(0xFEFF));
}
END_TEST

/* ------------------------------------------------------------------------ */
/* Tokenizer, encoder, prompt embeds                                         */

typedef struct golden {
    cJSON *root;
    dit_st_file *io;
    dit_t5_tokenizer *tok;
    dit_umt5_encoder *enc;
    int L, D, P;
} golden;

static void golden_open(golden *g)
{
    char p[1100];
    dit_diag diag;
    dit_diag_clear(&diag);
    g->root = load_cases();
    g->L = int_of(g->root, "max_sequence_length");
    g->P = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(g->root, "prompts"));
    snprintf(p, sizeof p, "%s/%s", data_dir, str_of(g->root, "tokenizer"));
    ck_assert_msg(dit_t5_tokenizer_load(p, &g->tok, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    snprintf(p, sizeof p, "%s/umt5/text_encoder", data_dir);
    ck_assert_msg(dit_umt5_encoder_load(be, p, &g->enc, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    g->D = dit_umt5_encoder_d_model(g->enc);
    snprintf(p, sizeof p, "%s/umt5/io.safetensors", data_dir);
    ck_assert_msg(dit_st_file_open(p, &g->io, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
}

static void golden_close(golden *g)
{
    dit_st_file_close(g->io);
    dit_umt5_encoder_free(g->enc);
    dit_t5_tokenizer_free(g->tok);
    cJSON_Delete(g->root);
}

static const cJSON *prompt_at(const golden *g, int k)
{
    return cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(g->root, "prompts"), k);
}

START_TEST(tokenizer_ids_match_transformers)
{
    golden g;
    golden_open(&g);
    int32_t *ids = malloc(sizeof *ids * (size_t)g.L);
    for (int k = 0; k < g.P; k++) {
        char name[32];
        snprintf(name, sizeof name, "p%d.ids", k);
        float *want = io_tensor(g.io, name, (size_t)g.L);
        int n = 0;
        dit_diag diag;
        dit_diag_clear(&diag);
        ck_assert_msg(dit_t5_tokenizer_encode(g.tok, str_of(prompt_at(&g, k), "clean"), ids, g.L,
                                              &n, NULL, &diag) == DIT_OK,
                      "%s", dit_diag_msg(&diag));
        ck_assert_int_eq(n, int_of(prompt_at(&g, k), "n_tokens"));
        for (int i = 0; i < g.L; i++)
            ck_assert_msg(ids[i] == (int32_t)want[i], "prompt %d token %d: %d, transformers %d", k,
                          i, ids[i], (int)want[i]);
        free(want);
    }
    free(ids);
    golden_close(&g);
}
END_TEST

/* The masked forward over all L rows (padding rows included) against
 * UMT5EncoderModel(ids, mask).last_hidden_state: one prompt at a time, then
 * all prompts in one batch of different lengths. */
START_TEST(masked_forward_matches_transformers)
{
    golden g;
    golden_open(&g);
    const int L = g.L, D = g.D, P = g.P;
    int32_t *ids = malloc(sizeof *ids * (size_t)(P * L));
    int32_t *lens = malloc(sizeof *lens * (size_t)P);
    float *want = malloc(sizeof *want * (size_t)(P * L * D));
    for (int k = 0; k < P; k++) {
        char name[32];
        snprintf(name, sizeof name, "p%d.ids", k);
        float *f = io_tensor(g.io, name, (size_t)L);
        for (int i = 0; i < L; i++)
            ids[k * L + i] = (int32_t)f[i];
        free(f);
        lens[k] = int_of(prompt_at(&g, k), "n_tokens");
        snprintf(name, sizeof name, "p%d.hidden", k);
        f = io_tensor(g.io, name, (size_t)(L * D));
        memcpy(want + (size_t)k * L * D, f, sizeof *f * (size_t)(L * D));
        free(f);
    }
    float *got = malloc(sizeof *got * (size_t)(P * L * D));
    dit_diag diag;
    dit_diag_clear(&diag);
    for (int pass = 0; pass < 2; pass++) {
        const int64_t B = pass == 0 ? 1 : P;
        for (int k = 0; k < (pass == 0 ? P : 1); k++) {
            const int64_t shp[3] = {B, L, D};
            dit_tensor out;
            ck_assert_int_eq(dit_arena_tensor(arena, DIT_F32, 3, shp, &out), DIT_OK);
            ck_assert_msg(dit_umt5_encoder_forward(g.enc, arena, ids + k * L, lens + k, B, L, &out,
                                                   &diag) == DIT_OK,
                          "%s", dit_diag_msg(&diag));
            dit_tensor host = dit_tensor_3d(got + (size_t)k * L * D, DIT_F32, B, L, D);
            ck_assert_int_eq(be->ops->download(be, &host, &out), DIT_OK);
            dit_arena_reset(arena);
        }
        for (int k = 0; k < P; k++) {
            const double e =
                rel_err(got + (size_t)k * L * D, want + (size_t)k * L * D, (size_t)(L * D));
            ck_assert_msg(e <= REL_TOL, "pass %d prompt %d: rel error %g", pass, k, e);
        }
    }
    /* Without the mask the padding tokens change the prompt's rows. */
    {
        const int k = 1; /* "a cat": 4 tokens, 12 padding */
        ck_assert_int_lt(lens[k], L);
        const int64_t shp[3] = {1, L, D};
        dit_tensor out;
        ck_assert_int_eq(dit_arena_tensor(arena, DIT_F32, 3, shp, &out), DIT_OK);
        ck_assert_int_eq(
            dit_umt5_encoder_forward(g.enc, arena, ids + k * L, NULL, 1, L, &out, &diag), DIT_OK);
        dit_tensor host = dit_tensor_3d(got, DIT_F32, 1, L, D);
        ck_assert_int_eq(be->ops->download(be, &host, &out), DIT_OK);
        dit_arena_reset(arena);
        ck_assert_double_gt(rel_err(got, want + (size_t)k * L * D, (size_t)(lens[k] * D)), 1e-3);
    }
    /* Lengths outside [1, S] are refused. */
    {
        const int64_t shp[3] = {1, L, D};
        dit_tensor out;
        ck_assert_int_eq(dit_arena_tensor(arena, DIT_F32, 3, shp, &out), DIT_OK);
        const int32_t bad[2] = {0, L + 1};
        for (int i = 0; i < 2; i++)
            ck_assert_int_eq(
                dit_umt5_encoder_forward(g.enc, arena, ids, bad + i, 1, L, &out, &diag),
                DIT_ERR_INVALID_ARG);
        dit_arena_reset(arena);
    }
    free(got);
    free(want);
    free(ids);
    free(lens);
    golden_close(&g);
}
END_TEST

/* dit_umt5_prompt_embeds on the raw prompts (cleaning included) against
 * _get_t5_prompt_embeds of the whole list: values within tolerance, and the
 * rows from each prompt's token count on exactly zero. */
START_TEST(prompt_embeds_match_wan_pipeline)
{
    golden g;
    golden_open(&g);
    const int L = g.L, D = g.D, P = g.P;
    const char **prompts = calloc((size_t)P, sizeof *prompts);
    for (int k = 0; k < P; k++)
        prompts[k] = str_of(prompt_at(&g, k), "text");
    float *want = io_tensor(g.io, "batch.embeds", (size_t)(P * L * D));
    float *got = malloc(sizeof *got * (size_t)(P * L * D));
    int32_t *n_tok = calloc((size_t)P, sizeof *n_tok);
    const int64_t shp[3] = {P, L, D};
    dit_tensor out;
    ck_assert_int_eq(dit_arena_tensor(arena, DIT_F32, 3, shp, &out), DIT_OK);
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_umt5_prompt_embeds(g.enc, g.tok, arena, prompts, P, L, &out, n_tok, NULL,
                                         &diag) == DIT_OK,
                  "%s", dit_diag_msg(&diag));
    dit_tensor host = dit_tensor_3d(got, DIT_F32, P, L, D);
    ck_assert_int_eq(be->ops->download(be, &host, &out), DIT_OK);
    for (int k = 0; k < P; k++) {
        const int n = int_of(prompt_at(&g, k), "n_tokens");
        ck_assert_int_eq(n_tok[k], n);
        const float *row = got + (size_t)k * L * D;
        const double e = rel_err(row, want + (size_t)k * L * D, (size_t)(L * D));
        ck_assert_msg(e <= REL_TOL, "prompt %d: rel error %g", k, e);
        for (int i = n; i < L; i++)
            for (int d = 0; d < D; d++)
                ck_assert_msg(row[(size_t)i * D + d] == 0.0f, "prompt %d row %d not zero", k, i);
        for (int d = 0; d < D; d++)
            ck_assert(row[(size_t)(n - 1) * D + d] != 0.0f || d > 0);
        /* Each prompt alone gives the same rows (per-prompt reference). */
        char name[32];
        snprintf(name, sizeof name, "p%d.embeds", k);
        float *one = io_tensor(g.io, name, (size_t)(L * D));
        ck_assert_double_le(rel_err(row, one, (size_t)(L * D)), REL_TOL);
        free(one);
    }
    free(n_tok);
    free(got);
    free(want);
    free(prompts);
    golden_close(&g);
}
END_TEST

/* ------------------------------------------------------------------------ */
/* Strict loading                                                            */

static void copy_config(const char *edit_from, const char *edit_to)
{
    char p[1100];
    snprintf(p, sizeof p, "%s/umt5/text_encoder/config.json", data_dir);
    FILE *f = fopen(p, "r");
    ck_assert_ptr_nonnull(f);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    char out[8300];
    char *hit = edit_from ? strstr(buf, edit_from) : NULL;
    if (hit)
        snprintf(out, sizeof out, "%.*s%s%s", (int)(hit - buf), buf, edit_to,
                 hit + strlen(edit_from));
    else
        snprintf(out, sizeof out, "%s", buf);
    snprintf(p, sizeof p, "%s/config.json", tmp_dir);
    f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(out, f);
    fclose(f);
}

/* model.safetensors less `drop` (or NULL), plus `extra` (a copy of
 * shared.weight under that name, or NULL). */
static void write_weights(const char *drop, const char *extra)
{
    char p[1100];
    snprintf(p, sizeof p, "%s/umt5/text_encoder/model.safetensors", data_dir);
    dit_st_file *f;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_st_file_open(p, &f, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    const size_t n = dit_st_file_count(f);
    dit_st_write_item *items = calloc(n + 1, sizeof *items);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const dit_st_entry *e = dit_st_file_at(f, i);
        if (drop && strcmp(e->name, drop) == 0)
            continue;
        items[k].name = e->name;
        items[k].tensor = &e->view;
        k++;
    }
    if (extra) {
        items[k].name = extra;
        items[k].tensor = &dit_st_file_find(f, "shared.weight")->view;
        k++;
    }
    snprintf(p, sizeof p, "%s/model.safetensors", tmp_dir);
    ck_assert_msg(dit_st_write(p, items, k, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    free(items);
    dit_st_file_close(f);
}

static void expect_load_error(dit_status want, const char *needle)
{
    dit_umt5_encoder *m = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_umt5_encoder_load(be, tmp_dir, &m, &diag), want);
    ck_assert_ptr_null(m);
    ck_assert_msg(strstr(dit_diag_msg(&diag), needle) != NULL, "message \"%s\" lacks \"%s\"",
                  dit_diag_msg(&diag), needle);
}

START_TEST(load_is_strict)
{
    const char *bias1 = "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight";
    /* The unmodified copy loads, with the embedding under either name or
     * both. */
    copy_config(NULL, NULL);
    write_weights(NULL, "encoder.embed_tokens.weight");
    dit_umt5_encoder *m = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_umt5_encoder_load(be, tmp_dir, &m, &diag) == DIT_OK, "%s",
                  dit_diag_msg(&diag));
    dit_umt5_encoder_free(m);
    /* Every layer's own bias table is required. */
    write_weights(bias1, NULL);
    expect_load_error(DIT_ERR_FORMAT, bias1);
    /* Anything else in the checkpoint is an error, decoder tensors too. */
    write_weights(NULL, "decoder.final_layer_norm.extra");
    expect_load_error(DIT_ERR_FORMAT, "decoder.final_layer_norm.extra");
    write_weights(NULL, "encoder.block.0.layer.0.SelfAttention.bias_extra");
    expect_load_error(DIT_ERR_FORMAT, "bias_extra");
    /* A config for other weights: the shapes disagree. */
    write_weights(NULL, NULL);
    copy_config("\"d_ff\": 64", "\"d_ff\": 48");
    expect_load_error(DIT_ERR_FORMAT, "wi_0");
    /* A T5 config is not a UMT5 one. */
    copy_config("\"model_type\": \"umt5\"", "\"model_type\": \"t5\"");
    expect_load_error(DIT_ERR_UNSUPPORTED, "model_type");
}
END_TEST

static Suite *umt5_suite(void)
{
    Suite *s = suite_create("umt5");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, prompt_clean_matches_python);
    tcase_add_test(tc, html_unescape_basics);
    tcase_add_test(tc, tokenizer_ids_match_transformers);
    tcase_add_test(tc, masked_forward_matches_transformers);
    tcase_add_test(tc, prompt_embeds_match_wan_pipeline);
    tcase_add_test(tc, load_is_strict);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(umt5_suite());
    srunner_run_all(sr, CK_NORMAL);
    const int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
