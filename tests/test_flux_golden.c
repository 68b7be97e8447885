/* End-to-end: every case under tests/data/golden goes through the real
 * `ditrun forward` binary, and its output is compared with what diffusers
 * computed for the same weights and inputs. Also checks ditrun's command-line
 * contract (help, usage errors, clear messages for bad paths). */
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "loader/safetensors.h"
#include "test_proc.h"

/* Relative tolerance on max|ours - diffusers| / max|diffusers|. f32 CPU
 * implementations of the same graph differ by summation order only. */
#define GOLDEN_REL_TOL 1e-5

enum { MAX_CASES = 64 };
static char case_dirs[MAX_CASES][1024]; /* filled once in main, read-only after */
static int n_cases;

START_TEST(golden_case_matches_diffusers)
{
    const char *dir = case_dirs[_i];
    const char *name = strrchr(dir, '/') + 1;
    char model[1100], inputs[1100], expected[1100], output[1100], log[8192];
    snprintf(model, sizeof model, "%s/transformer", dir);
    snprintf(inputs, sizeof inputs, "%s/inputs.safetensors", dir);
    snprintf(expected, sizeof expected, "%s/expected.safetensors", dir);
    snprintf(output, sizeof output, "/tmp/dit_golden_%d_%s.safetensors", (int)getpid(), name);
    char *argv[] = {(char *)test_env("DITRUN"),
                    "forward",
                    "--model",
                    model,
                    "--inputs",
                    inputs,
                    "--output",
                    output,
                    "--threads",
                    "2",
                    "--quiet",
                    NULL};
    int rc = test_run(argv, NULL, log, sizeof log, NULL);
    ck_assert_msg(rc == 0, "%s: ditrun exited %d:\n%s", name, rc, log);

    dit_diag diag;
    dit_diag_clear(&diag);
    dit_st_file *got = NULL, *want = NULL;
    ck_assert_msg(dit_st_file_open(output, &got, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_msg(dit_st_file_open(expected, &want, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    const dit_st_entry *g = dit_st_file_find(got, "sample");
    const dit_st_entry *w = dit_st_file_find(want, "sample");
    const dit_st_entry *w64 = dit_st_file_find(want, "sample_f64");
    ck_assert_ptr_nonnull(g);
    ck_assert_ptr_nonnull(w);
    ck_assert(dit_tensor_same_shape(&g->view, &w->view));

    test_err e = test_compare_views(&g->view, &w->view);
    printf("%-28s vs diffusers f32: max abs %.3g, max|ref| %.3g, rel %.3g", name, e.max_abs,
           e.max_ref, e.rel);
    if (w64) {
        test_err e64 = test_compare_views(&g->view, &w64->view);
        test_err d64 = test_compare_views(&w->view, &w64->view);
        printf("; vs f64: ours %.3g, diffusers f32 %.3g", e64.rel, d64.rel);
    }
    printf("\n");
    fflush(stdout);
    ck_assert_msg(e.rel <= GOLDEN_REL_TOL, "%s: relative error %.3g exceeds %.1g", name, e.rel,
                  GOLDEN_REL_TOL);
    dit_st_file_close(got);
    dit_st_file_close(want);
    unlink(output);
}
END_TEST

START_TEST(cli_help_and_usage_errors)
{
    char out[8192];
    char *ditrun = (char *)test_env("DITRUN");
    char *help[] = {ditrun, "forward", "--help", NULL};
    ck_assert_int_eq(test_run(help, NULL, out, sizeof out, NULL), 0);
    ck_assert_ptr_nonnull(strstr(out, "--model DIR"));
    ck_assert_ptr_nonnull(strstr(out, "--inputs"));

    char *top[] = {ditrun, "--help", NULL};
    ck_assert_int_eq(test_run(top, NULL, out, sizeof out, NULL), 0);
    ck_assert_ptr_nonnull(strstr(out, "forward"));

    char *none[] = {ditrun, NULL};
    ck_assert_int_eq(test_run(none, NULL, out, sizeof out, NULL), 2);

    char *unknown_cmd[] = {ditrun, "frobnicate", NULL};
    ck_assert_int_eq(test_run(unknown_cmd, NULL, out, sizeof out, NULL), 2);
    ck_assert_ptr_nonnull(strstr(out, "unknown command 'frobnicate'"));

    char *missing[] = {ditrun, "forward", "--inputs", "x", "--output", "y", NULL};
    ck_assert_int_eq(test_run(missing, NULL, out, sizeof out, NULL), 2);
    ck_assert_ptr_nonnull(strstr(out, "--model is required"));

    char *bad_opt[] = {ditrun, "forward", "--bogus", NULL};
    ck_assert_int_eq(test_run(bad_opt, NULL, out, sizeof out, NULL), 2);
    ck_assert_ptr_nonnull(strstr(out, "unknown option '--bogus'"));

    char *bad_threads[] = {ditrun, "forward", "--threads", "zero", NULL};
    ck_assert_int_eq(test_run(bad_threads, NULL, out, sizeof out, NULL), 2);
    ck_assert_ptr_nonnull(strstr(out, "--threads"));
}
END_TEST

START_TEST(cli_reports_bad_model_and_inputs)
{
    char out[8192];
    char *ditrun = (char *)test_env("DITRUN");
    char *nomodel[] = {ditrun,     "forward", "--model",  "/nonexistent/model",
                       "--inputs", "x",       "--output", "/tmp/unused.safetensors",
                       NULL};
    ck_assert_int_eq(test_run(nomodel, NULL, out, sizeof out, NULL), 1);
    ck_assert_ptr_nonnull(strstr(out, "/nonexistent/model/config.json"));

    /* Case 0's model with deliberately broken copies of its own inputs. */
    char model[1100], inputs[1100];
    snprintf(model, sizeof model, "%s/transformer", case_dirs[0]);
    snprintf(inputs, sizeof inputs, "%s/inputs.safetensors", case_dirs[0]);
    dit_st_file *in = NULL;
    ck_assert_int_eq(dit_st_file_open(inputs, &in, NULL), DIT_OK);
    size_t n = dit_st_file_count(in);
    dit_st_write_item items[16];
    dit_tensor views[16];
    ck_assert_uint_le(n, 15);
    for (size_t i = 0; i < n; i++) {
        views[i] = dit_st_file_at(in, i)->view;
        items[i].name = dit_st_file_at(in, i)->name;
        items[i].tensor = &views[i];
    }
    char broken[128];
    snprintf(broken, sizeof broken, "/tmp/dit_golden_broken_%d.safetensors", (int)getpid());
    char *argv[] = {ditrun,     "forward", "--model",  model,
                    "--inputs", broken,    "--output", "/tmp/unused.safetensors",
                    NULL};

    /* hidden_states with one channel too few */
    const dit_st_entry *hs = dit_st_file_find(in, "hidden_states");
    ck_assert_ptr_nonnull(hs);
    size_t hi = (size_t)(hs - dit_st_file_at(in, 0));
    dit_tensor saved = views[hi];
    views[hi] = dit_tensor_narrow(&saved, 2, 0, saved.ne[2] - 1);
    ck_assert_int_eq(dit_st_write(broken, items, n, NULL), DIT_OK);
    ck_assert_int_eq(test_run(argv, NULL, out, sizeof out, NULL), 1);
    ck_assert_msg(strstr(out, "input 'hidden_states'"), "unhelpful: %s", out);
    views[hi] = saved;

    /* a misspelt extra input */
    items[n].name = "guidence";
    items[n].tensor = &views[0];
    ck_assert_int_eq(dit_st_write(broken, items, n + 1, NULL), DIT_OK);
    ck_assert_int_eq(test_run(argv, NULL, out, sizeof out, NULL), 1);
    ck_assert_msg(strstr(out, "unknown input 'guidence'"), "unhelpful: %s", out);

    /* a required input left out */
    ck_assert_int_eq(dit_st_write(broken, items + 1, n - 1, NULL), DIT_OK);
    ck_assert_int_eq(test_run(argv, NULL, out, sizeof out, NULL), 1);
    ck_assert_msg(strstr(out, "is missing"), "unhelpful: %s", out);

    unlink(broken);
    dit_st_file_close(in);
}
END_TEST

static int cmp_str(const void *a, const void *b)
{
    return strcmp((const char *)a, (const char *)b);
}

int main(void)
{
    char root[600];
    snprintf(root, sizeof root, "%s/tests/data/golden", test_env("DIT_SOURCE_ROOT"));
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
    if (n_cases < 6) {
        fprintf(stderr, "expected at least 6 golden cases under %s, found %d\n", root, n_cases);
        return 1;
    }

    Suite *s = suite_create("flux_golden");
    TCase *tc = tcase_create("golden");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, golden_case_matches_diffusers, 0, n_cases);
    suite_add_tcase(s, tc);
    TCase *cli = tcase_create("cli");
    tcase_set_timeout(cli, 120);
    tcase_add_test(cli, cli_help_and_usage_errors);
    tcase_add_test(cli, cli_reports_bad_model_and_inputs);
    suite_add_tcase(s, cli);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
