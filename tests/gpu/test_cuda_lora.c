/* LoRA adapters on the cuda backend (parallel/lora.h: the adapter products
 * as bf16 GEMMs after the base GEMM, the plain path without graphs), through
 * `ditrun forward|generate --backend cuda --lora ...`:
 *  - two adapters at once (diffusers/PEFT at 0.7 and kohya at -0.4) on the
 *    golden case parallel_even against diffusers' f32 output, and against
 *    the cpu backend's output for the same run;
 *  - the demo pipeline with its adapter against diffusers' final latents.
 * Tolerances are test_cuda_golden's (bf16 weights and GEMM operands): 2e-2
 * of max|output| for a forward, 5e-2 for the latents of a generation. The
 * references move by 0.47 (forward) and 0.27 (latents) of max|output| when
 * the adapters are dropped, far above both. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cuda/cuda_backend.h"
#include "loader/safetensors.h"
#include "../test_proc.h"
#include "gpu_util.h"

#define FORWARD_CUDA_REL_TOL 2e-2
#define GENERATE_CUDA_REL_TOL 5e-2

static void data_path(char *buf, size_t cap, const char *rel)
{
    snprintf(buf, cap, "%s/tests/data/%s", test_env("DIT_SOURCE_ROOT"), rel);
}

static void run_forward(const char *backend, const char *out)
{
    char model[1024], inputs[1024], peft[1100], kohya[1100], log[16384];
    data_path(model, sizeof model, "golden/parallel_even/transformer");
    data_path(inputs, sizeof inputs, "golden/parallel_even/inputs.safetensors");
    data_path(peft, sizeof peft, "lora/peft.safetensors");
    data_path(kohya, sizeof kohya, "lora/kohya.safetensors");
    strcat(peft, ":0.7");
    strcat(kohya, ":-0.4");
    char *argv[] = {(char *)test_env("DITRUN"),
                    "forward",
                    "--model",
                    model,
                    "--inputs",
                    inputs,
                    "--output",
                    (char *)out,
                    "--backend",
                    (char *)backend,
                    "--lora",
                    peft,
                    "--lora",
                    kohya,
                    "--quiet",
                    NULL};
    const int rc = test_run(argv, NULL, log, sizeof log, NULL);
    ck_assert_msg(rc == 0, "ditrun --backend %s exited %d:\n%s", backend, rc, log);
}

START_TEST(two_adapters_match_diffusers_and_cpu_on_cuda)
{
    char gpu[128], cpu[128], exp[1024];
    snprintf(gpu, sizeof gpu, "/tmp/dit_cuda_lora_%d.safetensors", (int)getpid());
    snprintf(cpu, sizeof cpu, "/tmp/dit_cuda_lora_cpu_%d.safetensors", (int)getpid());
    data_path(exp, sizeof exp, "lora/expected.safetensors");
    run_forward("cuda", gpu);
    run_forward("cpu", cpu);
    const test_err vs_d = test_compare_files(gpu, "sample", exp, "two");
    const test_err vs_c = test_compare_files(gpu, "sample", cpu, "sample");
    printf("cuda lora forward: vs diffusers %.3g, vs cpu %.3g\n", vs_d.rel, vs_c.rel);
    fflush(stdout);
    ck_assert_msg(vs_d.rel <= FORWARD_CUDA_REL_TOL, "%.3g from diffusers", vs_d.rel);
    ck_assert_msg(vs_c.rel <= FORWARD_CUDA_REL_TOL, "%.3g from the cpu backend", vs_c.rel);
    unlink(gpu);
    unlink(cpu);
}
END_TEST

START_TEST(demo_generate_with_adapter_matches_diffusers_on_cuda)
{
    char model[1024], lora[1100], ref[1024], lat[128], png[128], log[16384];
    data_path(model, sizeof model, "demo");
    data_path(lora, sizeof lora, "lora/demo_peft.safetensors");
    strcat(lora, ":0.8");
    data_path(ref, sizeof ref, "lora/demo_reference.safetensors");
    snprintf(lat, sizeof lat, "/tmp/dit_cuda_lora_lat_%d.safetensors", (int)getpid());
    snprintf(png, sizeof png, "/tmp/dit_cuda_lora_%d.png", (int)getpid());
    char *argv[] = {(char *)test_env("DITRUN"),
                    "generate",
                    "--model",
                    model,
                    "--prompt",
                    "a red fox in the snow",
                    "--width",
                    "64",
                    "--height",
                    "64",
                    "--steps",
                    "2",
                    "--guidance",
                    "3.5",
                    "--seed",
                    "1",
                    "--output",
                    png,
                    "--output-latents",
                    lat,
                    "--backend",
                    "cuda",
                    "--lora",
                    lora,
                    "--quiet",
                    NULL};
    const int rc = test_run(argv, NULL, log, sizeof log, NULL);
    ck_assert_msg(rc == 0, "ditrun generate --backend cuda exited %d:\n%s", rc, log);
    const test_err e = test_compare_files(lat, "latents", ref, "final_latents");
    printf("cuda lora generate: final latents vs diffusers %.3g\n", e.rel);
    fflush(stdout);
    ck_assert_msg(e.rel <= GENERATE_CUDA_REL_TOL, "final latents %.3g from diffusers", e.rel);
    unlink(lat);
    unlink(png);
}
END_TEST

int main(void)
{
    gpu_require_device("test_cuda_lora");
    Suite *s = suite_create("cuda_lora");
    TCase *tc = tcase_create("lora");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, two_adapters_match_diffusers_and_cpu_on_cuda);
    tcase_add_test(tc, demo_generate_with_adapter_matches_diffusers_on_cuda);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    /* The probe above initialised CUDA in this process: no fork. */
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    const int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
