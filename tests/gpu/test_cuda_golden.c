/* The golden forward cases (tests/data/golden, outputs diffusers computed in
 * f32) through `ditrun forward --backend cuda`, and one whole `ditrun
 * generate --backend cuda` of the demo pipeline against diffusers' latents.
 *
 * Tolerances. The cpu suite holds 1e-5 relative (f32 against f32). The cuda
 * backend stores weights in bf16 and rounds every GEMM input to bf16
 * (relative rounding 2^-9 ~ 2e-3 per operand), while accumulating in f32;
 * attention rounds its softmax weights to bf16 as well. Errors of
 * independent roundings add roughly in quadrature through the few blocks of
 * these models and measure around 5e-3 of max|output|, so:
 *  - forward: max|cuda - diffusers| / max|diffusers| <= 2e-2;
 *  - generate (2 Euler steps, text encoders and VAE in bf16 too): final
 *    latents <= 5e-2 of max|latents|.
 * A wrong kernel shows up as errors of order 1, far above both. */
#include <check.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/cuda/cuda_backend.h"
#include "loader/safetensors.h"
#include "../test_proc.h"
#include "gpu_util.h"

#define GOLDEN_CUDA_REL_TOL 2e-2
#define GENERATE_CUDA_REL_TOL 5e-2

enum { MAX_CASES = 64 };
static char case_dirs[MAX_CASES][1024]; /* filled once in main, read-only after */
static int n_cases;

START_TEST(golden_case_matches_diffusers_on_cuda)
{
    const char *dir = case_dirs[_i];
    const char *name = strrchr(dir, '/') + 1;
    char model[1100], inputs[1100], expected[1100], output[1100], log[8192];
    snprintf(model, sizeof model, "%s/transformer", dir);
    snprintf(inputs, sizeof inputs, "%s/inputs.safetensors", dir);
    snprintf(expected, sizeof expected, "%s/expected.safetensors", dir);
    snprintf(output, sizeof output, "/tmp/dit_cuda_golden_%d_%s.safetensors", (int)getpid(), name);
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
    test_err e = test_compare_files(output, "sample", expected, "sample");
    printf("%-28s cuda vs diffusers f32: max abs %.3g, max|ref| %.3g, rel %.3g\n", name, e.max_abs,
           e.max_ref, e.rel);
    fflush(stdout);
    ck_assert_msg(e.rel <= GOLDEN_CUDA_REL_TOL, "%s: relative error %.3g exceeds %.1g", name, e.rel,
                  GOLDEN_CUDA_REL_TOL);
    unlink(output);
}
END_TEST

START_TEST(demo_generate_matches_diffusers_on_cuda)
{
    char out[16384], png[128], lat[128], demo[1100], ref[1200];
    snprintf(png, sizeof png, "/tmp/dit_cuda_gen_%d.png", (int)getpid());
    snprintf(lat, sizeof lat, "/tmp/dit_cuda_gen_%d.safetensors", (int)getpid());
    snprintf(demo, sizeof demo, "%s/tests/data/demo", test_env("DIT_SOURCE_ROOT"));
    snprintf(ref, sizeof ref, "%s/tests/data/pipeline_golden/square_2steps/reference.safetensors",
             test_env("DIT_SOURCE_ROOT"));
    /* The request of the square_2steps golden case. */
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
                    "--backend",
                    "cuda",
                    NULL};
    int rc = test_run(argv, NULL, out, sizeof out, NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    test_err e = test_compare_files(lat, "latents", ref, "final_latents");
    printf("ditrun generate --backend cuda: final latents rel %.3g (max abs %.3g)\n", e.rel,
           e.max_abs);
    ck_assert_msg(e.rel <= GENERATE_CUDA_REL_TOL, "final latents rel error %.3g exceeds %.1g",
                  e.rel, GENERATE_CUDA_REL_TOL);
    unlink(png);
    unlink(lat);
}
END_TEST

static int cmp_str(const void *a, const void *b)
{
    return strcmp((const char *)a, (const char *)b);
}

int main(void)
{
    gpu_require_device("test_cuda_golden");
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
    Suite *s = suite_create("cuda_golden");
    TCase *tc = tcase_create("golden");
    tcase_set_timeout(tc, 300);
    tcase_add_loop_test(tc, golden_case_matches_diffusers_on_cuda, 0, n_cases);
    tcase_add_test(tc, demo_generate_matches_diffusers_on_cuda);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    /* The probe above initialised CUDA in this process: no fork. */
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
