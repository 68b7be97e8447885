/* End-to-end: every WanTransformer3DModel case under tests/data/wan_golden
 * goes through the real `ditrun forward` binary and is compared with what
 * diffusers computed for the same weights and inputs (f32). Also the
 * messages for what is refused: the image-conditioned (i2v) variant, inputs
 * that do not fit the config. */
#include <check.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loader/safetensors.h"
#include "test_proc.h"

/* Relative tolerance on max|ours - diffusers| / max|diffusers|. */
#define GOLDEN_REL_TOL 1e-5

enum { MAX_CASES = 64 };
static char case_dirs[MAX_CASES][1024]; /* filled once in main, read-only after */
static int n_cases;

/* Runs ditrun forward on case `dir` with extra arguments; returns its exit
 * status and writes the output to `output`. */
static int run_case(const char *dir, const char *output, char *const *extra, char *log, size_t cap)
{
    char model[1100], inputs[1100];
    snprintf(model, sizeof model, "%s/transformer", dir);
    snprintf(inputs, sizeof inputs, "%s/inputs.safetensors", dir);
    char *argv[32] = {(char *)test_env("DITRUN"),
                      "forward",
                      "--model",
                      model,
                      "--inputs",
                      inputs,
                      "--output",
                      (char *)output,
                      "--threads",
                      "2",
                      "--quiet"};
    int n = 11;
    for (int i = 0; extra && extra[i] && n < 31; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    return test_run(argv, NULL, log, cap, NULL);
}

static test_err compare_with_expected(const char *dir, const char *output)
{
    char expected[1100];
    snprintf(expected, sizeof expected, "%s/expected.safetensors", dir);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_st_file *got = NULL, *want = NULL;
    ck_assert_msg(dit_st_file_open(output, &got, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_msg(dit_st_file_open(expected, &want, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    const dit_st_entry *g = dit_st_file_find(got, "sample");
    const dit_st_entry *w = dit_st_file_find(want, "sample");
    ck_assert_ptr_nonnull(g);
    ck_assert_ptr_nonnull(w);
    ck_assert(dit_tensor_same_shape(&g->view, &w->view));
    test_err e = test_compare_views(&g->view, &w->view);
    dit_st_file_close(got);
    dit_st_file_close(want);
    return e;
}

START_TEST(golden_case_matches_diffusers)
{
    const char *dir = case_dirs[_i];
    const char *name = strrchr(dir, '/') + 1;
    char output[1100], log[8192];
    snprintf(output, sizeof output, "/tmp/dit_wan_golden_%d_%s.safetensors", (int)getpid(), name);
    int rc = run_case(dir, output, NULL, log, sizeof log);
    ck_assert_msg(rc == 0, "%s: ditrun exited %d:\n%s", name, rc, log);
    test_err e = compare_with_expected(dir, output);
    printf("%-16s vs diffusers f32: max abs %.3g, max|ref| %.3g, rel %.3g\n", name, e.max_abs,
           e.max_ref, e.rel);
    fflush(stdout);
    ck_assert_msg(e.rel <= GOLDEN_REL_TOL, "%s: relative error %.3g exceeds %.1g", name, e.rel,
                  GOLDEN_REL_TOL);
    unlink(output);
}
END_TEST

/* A config with the image embedder is refused by name. */
START_TEST(i2v_config_is_refused)
{
    char tmp[] = "/tmp/dit_wan_i2v_XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(tmp));
    char path[256], out[8192];
    snprintf(path, sizeof path, "%s/config.json", tmp);
    FILE *fp = fopen(path, "w");
    ck_assert_ptr_nonnull(fp);
    fputs("{\"_class_name\": \"WanTransformer3DModel\", \"image_dim\": 1280, "
          "\"added_kv_proj_dim\": 5120}\n",
          fp);
    fclose(fp);
    char inputs[1100];
    snprintf(inputs, sizeof inputs, "%s/inputs.safetensors", case_dirs[0]);
    char *argv[] = {
        (char *)test_env("DITRUN"), "forward", "--model", tmp, "--inputs", inputs, "--output",
        "/tmp/unused.safetensors",  NULL};
    ck_assert_int_eq(test_run(argv, NULL, out, sizeof out, NULL), 1);
    ck_assert_msg(strstr(out, "image-conditioned"), "unhelpful: %s", out);
    unlink(path);
    rmdir(tmp);
}
END_TEST

/* Inputs that do not fit: a frame count the temporal patch does not divide,
 * a misspelt name. */
START_TEST(bad_inputs_are_named)
{
    int c = -1;
    for (int i = 0; i < n_cases; i++)
        if (strstr(case_dirs[i], "sharded_pt2"))
            c = i;
    ck_assert_int_ge(c, 0);
    const char *dir = case_dirs[c];
    char model[1100], inputs[1100], out[8192];
    snprintf(model, sizeof model, "%s/transformer", dir);
    snprintf(inputs, sizeof inputs, "%s/inputs.safetensors", dir);
    dit_st_file *in = NULL;
    ck_assert_int_eq(dit_st_file_open(inputs, &in, NULL), DIT_OK);
    size_t n = dit_st_file_count(in);
    ck_assert_uint_le(n, 7);
    dit_st_write_item items[8];
    dit_tensor views[8];
    for (size_t i = 0; i < n; i++) {
        views[i] = dit_st_file_at(in, i)->view;
        items[i].name = dit_st_file_at(in, i)->name;
        items[i].tensor = &views[i];
    }
    char broken[128];
    snprintf(broken, sizeof broken, "/tmp/dit_wan_broken_%d.safetensors", (int)getpid());
    char *argv[] = {
        (char *)test_env("DITRUN"), "forward", "--model", model, "--inputs", broken, "--output",
        "/tmp/unused.safetensors",  NULL};
    const dit_st_entry *hs = dit_st_file_find(in, "hidden_states");
    ck_assert_ptr_nonnull(hs);
    size_t hi = (size_t)(hs - dit_st_file_at(in, 0));
    dit_tensor saved = views[hi];
    views[hi] = dit_tensor_narrow(&saved, 2, 0, saved.ne[2] - 1); /* patch t is 2 */
    ck_assert_int_eq(dit_st_write(broken, items, n, NULL), DIT_OK);
    ck_assert_int_eq(test_run(argv, NULL, out, sizeof out, NULL), 1);
    ck_assert_msg(strstr(out, "input 'hidden_states'"), "unhelpful: %s", out);
    views[hi] = saved;

    items[n].name = "encoder_hidden_state";
    items[n].tensor = &views[0];
    ck_assert_int_eq(dit_st_write(broken, items, n + 1, NULL), DIT_OK);
    ck_assert_int_eq(test_run(argv, NULL, out, sizeof out, NULL), 1);
    ck_assert_msg(strstr(out, "unknown input 'encoder_hidden_state'"), "unhelpful: %s", out);
    unlink(broken);
    dit_st_file_close(in);
}
END_TEST

static int find_case(const char *name)
{
    for (int i = 0; i < n_cases; i++)
        if (strcmp(strrchr(case_dirs[i], '/') + 1, name) == 0)
            return i;
    ck_abort_msg("no golden case '%s'", name);
    return -1;
}

/* Tensor parallelism (heads and FFN columns split, the across-heads q/k
 * norm's sum of squares all-reduced) against diffusers' one-device output. */
START_TEST(tensor_parallel_matches_diffusers)
{
    static const char *const degrees[] = {"2", "4"};
    const char *dir = case_dirs[find_case("parallel_even")];
    for (int i = 0; i < 2; i++) {
        char output[1100], log[8192];
        snprintf(output, sizeof output, "/tmp/dit_wan_tp_%d_%s.safetensors", (int)getpid(),
                 degrees[i]);
        char *extra[] = {"--world-size", (char *)degrees[i], "--tp", (char *)degrees[i], NULL};
        int rc = run_case(dir, output, extra, log, sizeof log);
        ck_assert_msg(rc == 0, "tp %s: ditrun exited %d:\n%s", degrees[i], rc, log);
        test_err e = compare_with_expected(dir, output);
        printf("parallel_even tp %s vs diffusers f32: rel %.3g\n", degrees[i], e.rel);
        fflush(stdout);
        ck_assert_msg(e.rel <= GOLDEN_REL_TOL, "tp %s: relative error %.3g", degrees[i], e.rel);
        unlink(output);
    }
}
END_TEST

/* Context parallelism splits the video tokens after the patch embedding
 * (tests/test_parallel.c runs every mode); a plain split of a token count
 * the context-parallel size does not divide is refused by name. */
START_TEST(uneven_tokens_need_an_anything_mode)
{
    const char *dir = case_dirs[find_case("parallel_odd")];
    char log[8192];
    char *extra[] = {"--world-size", "2", "--ring", "2", NULL};
    int rc = run_case(dir, "/tmp/unused.safetensors", extra, log, sizeof log);
    ck_assert_int_ne(rc, 0);
    ck_assert_msg(strstr(log, "45 video tokens are not divisible by the context-parallel size 2"),
                  "unhelpful: %s", log);
    ck_assert_msg(strstr(log, "ring_anything"), "unhelpful: %s", log);
}
END_TEST

static int cmp_str(const void *a, const void *b)
{
    return strcmp((const char *)a, (const char *)b);
}

int main(void)
{
    char root[600];
    snprintf(root, sizeof root, "%s/tests/data/wan_golden", test_env("DIT_SOURCE_ROOT"));
    DIR *d = opendir(root);
    if (!d) {
        fprintf(stderr, "cannot open %s\n", root);
        return 1;
    }
    struct dirent *de;
    while ((de = readdir(d)) && n_cases < MAX_CASES) {
        if (de->d_name[0] == '.')
            continue;
        char probe[1024 + 64];
        struct stat sb;
        snprintf(probe, sizeof probe, "%s/%s/expected.safetensors", root, de->d_name);
        if (stat(probe, &sb) != 0)
            continue;
        snprintf(case_dirs[n_cases++], sizeof case_dirs[0], "%s/%s", root, de->d_name);
    }
    closedir(d);
    qsort(case_dirs, (size_t)n_cases, sizeof case_dirs[0], cmp_str);
    if (n_cases < 5) {
        fprintf(stderr, "expected at least 5 golden cases under %s, found %d\n", root, n_cases);
        return 1;
    }

    Suite *s = suite_create("wan_golden");
    TCase *tc = tcase_create("golden");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, golden_case_matches_diffusers, 0, n_cases);
    suite_add_tcase(s, tc);
    TCase *cli = tcase_create("refusals");
    tcase_set_timeout(cli, 120);
    tcase_add_test(cli, i2v_config_is_refused);
    tcase_add_test(cli, bad_inputs_are_named);
    tcase_add_test(cli, tensor_parallel_matches_diffusers);
    tcase_add_test(cli, uneven_tokens_need_an_anything_mode);
    suite_add_tcase(s, cli);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
