/* Loading a Flux transformer folder: every way a checkpoint can disagree
 * with its config.json is an error that names the tensor and the file. The
 * cases are made by rewriting a golden fixture into a temporary folder. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "loader/safetensors.h"
#include "models/flux/flux.h"

static char src_dir[1024];
static char tmp_dir[64];
static dit_backend *be;

static void setup(void)
{
    snprintf(src_dir, sizeof src_dir, "%s/tests/data/golden/double_only/transformer",
             getenv("DIT_SOURCE_ROOT"));
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/dit_flux_load_XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(tmp_dir));
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = 1};
    ck_assert_int_eq(dit_backend_create(&cfg, &be, NULL), DIT_OK);
}

static void teardown(void)
{
    char p[256];
    snprintf(p, sizeof p, "%s/config.json", tmp_dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/diffusion_pytorch_model.safetensors", tmp_dir);
    unlink(p);
    rmdir(tmp_dir);
    dit_backend_destroy(be);
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

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    char *buf = malloc((size_t)n + 1);
    ck_assert_uint_eq(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void copy_config(void)
{
    char p[1100];
    snprintf(p, sizeof p, "%s/config.json", src_dir);
    char *text = read_text(p);
    write_file("config.json", text);
    free(text);
}

typedef enum edit_kind { EDIT_NONE, EDIT_DROP, EDIT_EXTRA, EDIT_RESHAPE } edit_kind;

/* Rewrites the golden weights into tmp_dir with one edit applied to `name`. */
static void write_weights(edit_kind kind, const char *name)
{
    char p[1100];
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

static void expect_error(dit_status want, const char *needle1, const char *needle2)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_flux *m = NULL;
    dit_status st = dit_flux_load(be, tmp_dir, NULL, &m, &diag);
    ck_assert_ptr_null(m);
    ck_assert_msg(st == want, "status %s, want %s (%s)", dit_status_name(st), dit_status_name(want),
                  dit_diag_msg(&diag));
    ck_assert_msg(strstr(diag.msg, needle1), "'%s' not in: %s", needle1, diag.msg);
    if (needle2)
        ck_assert_msg(strstr(diag.msg, needle2), "'%s' not in: %s", needle2, diag.msg);
}

START_TEST(unmodified_copy_loads)
{
    copy_config();
    write_weights(EDIT_NONE, "");
    dit_flux *m = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_flux_load(be, tmp_dir, NULL, &m, &diag) == DIT_OK, "%s", diag.msg);
    ck_assert_int_eq(dit_flux_config_of(m)->num_layers, 2);
    ck_assert_uint_gt(dit_flux_weight_bytes(m), 0);
    dit_flux_destroy(m);
}
END_TEST

START_TEST(missing_tensor_is_named)
{
    copy_config();
    write_weights(EDIT_DROP, "transformer_blocks.1.attn.to_k.weight");
    expect_error(DIT_ERR_FORMAT, "missing", "transformer_blocks.1.attn.to_k.weight");
}
END_TEST

START_TEST(unexpected_tensor_is_named)
{
    copy_config();
    write_weights(EDIT_EXTRA, "transformer_blocks.7.attn.to_q.weight");
    expect_error(DIT_ERR_FORMAT, "unexpected tensor 'transformer_blocks.7.attn.to_q.weight'",
                 "diffusion_pytorch_model.safetensors");
}
END_TEST

START_TEST(wrong_shape_is_named)
{
    copy_config();
    write_weights(EDIT_RESHAPE, "transformer_blocks.0.ff.net.2.weight");
    expect_error(DIT_ERR_FORMAT, "'transformer_blocks.0.ff.net.2.weight' has shape",
                 "config.json implies");
}
END_TEST

START_TEST(config_that_disagrees_with_weights)
{
    char p[1100];
    snprintf(p, sizeof p, "%s/config.json", src_dir);
    char *text = read_text(p);
    char *at = strstr(text, "\"num_layers\": 2");
    ck_assert_ptr_nonnull(at);
    at[strlen("\"num_layers\": ")] = '3';
    write_file("config.json", text);
    free(text);
    write_weights(EDIT_NONE, "");
    expect_error(DIT_ERR_FORMAT, "transformer_blocks.2.", "does config.json belong");
}
END_TEST

/* A config that describes a far larger model than its checkpoint (87381
 * heads of 12: an inner width just under config.json's limit of 2^20,
 * terabytes of weights) is refused for the checkpoint's shapes, before any
 * of that memory is asked for. */
START_TEST(wide_config_is_refused_before_allocating)
{
    char p[1100];
    snprintf(p, sizeof p, "%s/config.json", src_dir);
    char *text = read_text(p);
    char *at = strstr(text, "\"num_attention_heads\": 2,");
    ck_assert_ptr_nonnull(at);
    char edited[4096];
    snprintf(edited, sizeof edited, "%.*s\"num_attention_heads\": 87381,%s", (int)(at - text), text,
             at + strlen("\"num_attention_heads\": 2,"));
    free(text);
    write_file("config.json", edited);
    write_weights(EDIT_NONE, "");
    expect_error(DIT_ERR_FORMAT, "has shape", "config.json implies");
}
END_TEST

/* Weights that cannot be allocated are an error with a message (the plan
 * was freed twice on this path once). */
START_TEST(weights_too_large_are_reported)
{
    dit_flux_config cfg = {.patch_size = 1,
                           .in_channels = 8,
                           .out_channels = 8,
                           .num_layers = 1,
                           .num_single_layers = 1,
                           .attention_head_dim = 12,
                           .num_attention_heads = 87381,
                           .joint_attention_dim = 16,
                           .pooled_projection_dim = 12,
                           .n_axes = 3,
                           .axes_dims_rope = {4, 4, 4}};
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_flux *m = NULL;
    ck_assert_int_eq(dit_flux_create_random(be, &cfg, NULL, 1, &m, &diag), DIT_ERR_NOMEM);
    ck_assert_ptr_null(m);
    ck_assert_ptr_nonnull(strstr(diag.msg, "cannot allocate"));
}
END_TEST

START_TEST(bad_configs)
{
    write_weights(EDIT_NONE, "");
    write_file("config.json", "{\"num_layers\": 1,");
    expect_error(DIT_ERR_FORMAT, "config.json", "invalid JSON");
    write_file("config.json", "{\"_class_name\": \"SD3Transformer2DModel\"}");
    expect_error(DIT_ERR_UNSUPPORTED, "SD3Transformer2DModel", NULL);
    write_file("config.json", "{\"attention_head_dim\": 16, \"axes_dims_rope\": [4, 4, 4]}");
    expect_error(DIT_ERR_FORMAT, "axes_dims_rope sums to 12", "attention_head_dim is 16");
    write_file("config.json", "{\"num_layers\": -1}");
    expect_error(DIT_ERR_FORMAT, "num_layers", NULL);
    write_file("config.json", "{\"guidance_embeds\": \"yes\"}");
    expect_error(DIT_ERR_FORMAT, "guidance_embeds", NULL);
    write_file("config.json", "[1, 2]");
    expect_error(DIT_ERR_FORMAT, "not a JSON object", NULL);
}
END_TEST

START_TEST(missing_folder_names_the_path)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_flux *m = NULL;
    ck_assert_int_eq(dit_flux_load(be, "/nonexistent/transformer", NULL, &m, &diag),
                     DIT_ERR_NOT_FOUND);
    ck_assert_ptr_nonnull(strstr(diag.msg, "/nonexistent/transformer/config.json"));
}
END_TEST

START_TEST(tensor_parallel_degree_must_divide_heads)
{
    copy_config();
    write_weights(EDIT_NONE, "");
    dit_flux_shard shard = {.tp_degree = 3, .tp_rank = 0}; /* 2 heads */
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_flux *m = NULL;
    ck_assert_int_eq(dit_flux_load(be, tmp_dir, &shard, &m, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(diag.msg, "num_attention_heads 2"));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("flux_load");
    TCase *tc = tcase_create("load");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_add_test(tc, unmodified_copy_loads);
    tcase_add_test(tc, missing_tensor_is_named);
    tcase_add_test(tc, unexpected_tensor_is_named);
    tcase_add_test(tc, wrong_shape_is_named);
    tcase_add_test(tc, config_that_disagrees_with_weights);
    tcase_add_test(tc, wide_config_is_refused_before_allocating);
    tcase_add_test(tc, weights_too_large_are_reported);
    tcase_add_test(tc, bad_configs);
    tcase_add_test(tc, missing_folder_names_the_path);
    tcase_add_test(tc, tensor_parallel_degree_must_divide_heads);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
