/* UniPCMultistepScheduler against diffusers (tests/golden/gen_unipc_golden.py):
 * for every fixture config and step count, the sigmas (f32) and the int64
 * timesteps bit for bit, and every intermediate sample of a run of step()
 * over fixed f32 model outputs (diffusers computes the whole step in f32 when
 * the model output and the sample are f32):
 *   - bit-identical to diffusers' run with the scalar log correctly rounded
 *     (exactlog_N), as ours is, for solver orders 1 and 2; within 1e-6 of the
 *     sample's largest magnitude at order 3, whose 3 x 3 solves MKL rounds
 *     differently;
 *   - within SAMPLE_TOL of the sample's largest magnitude of diffusers' own
 *     run (samples_N): torch's vectorized f32 log is off by an ulp at times,
 *     which moves later samples by up to ~2e-5 at order 3 (and differs
 *     between CPUs torch dispatches differently). */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "loader/safetensors.h"
#include "schedulers/scheduler.h"
#include "schedulers/unipc.h"
#include "test_proc.h"

static char root[1024];

#define SAMPLE_TOL 5e-5

static const char *const configs[] = {"wan_480p",      "wan_720p",         "order1",   "order3",
                                      "bh1_sigma_min", "no_corrector_0_3", "sigma_min"};
static const int steps_list[] = {1, 2, 3, 5, 10, 50};

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static const float *f32_of(const dit_st_file *f, const char *name, size_t n)
{
    const dit_st_entry *e = dit_st_file_find(f, name);
    ck_assert_msg(e != NULL, "%s missing", name);
    ck_assert_int_eq(e->view.dtype, DIT_F32);
    size_t count = 1;
    for (int d = 0; d < e->view.ndim; d++)
        count *= (size_t)e->view.ne[d];
    ck_assert_msg(count == n, "%s: %zu elements, want %zu", name, count, n);
    return e->view.data;
}

START_TEST(schedules_and_steps_match_diffusers)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/inputs.safetensors", root);
    dit_st_file *in = NULL;
    dit_diag od;
    dit_diag_clear(&od);
    ck_assert_msg(dit_st_file_open(path, &in, &od) == DIT_OK, "%s", od.msg);
    const size_t n = 1 * 4 * 1 * 3 * 5;
    float x0[60], v[60], x[60], want[60], exact[60];
    memcpy(x0, f32_of(in, "x0", n), sizeof x0);
    const float *mo = f32_of(in, "model_outputs", 50 * n);
    const char *cfg = configs[_i];
    snprintf(path, sizeof path, "%s/%s/expected.safetensors", root, cfg);
    dit_st_file *ex = NULL;
    ck_assert_msg(dit_st_file_open(path, &ex, &od) == DIT_OK, "%s", od.msg);
    snprintf(path, sizeof path, "%s/%s/scheduler_config.json", root, cfg);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_unipc_config c;
    ck_assert_msg(dit_unipc_config_load(path, &c, &diag) == DIT_OK, "%s", diag.msg);
    dit_scheduler *s = NULL;
    ck_assert_msg(dit_scheduler_load(path, "UniPCMultistepScheduler", &s, &diag) == DIT_OK, "%s",
                  diag.msg);
    double worst = 0.0, worst_exact = 0.0;
    /* Order 3 solves 3 x 3 systems, where MKL's rounding is not ours. */
    const bool exact_bits = c.solver_order <= 2;
    for (size_t k = 0; k < sizeof steps_list / sizeof *steps_list; k++) {
        const int N = steps_list[k];
        char name[64];
        float sig[51];
        int64_t ts[50];
        ck_assert_int_eq(dit_unipc_schedule(&c, N, sig, ts, &diag), DIT_OK);
        snprintf(name, sizeof name, "sigmas_%d", N);
        const float *wsig = f32_of(ex, name, (size_t)N + 1);
        snprintf(name, sizeof name, "timesteps_%d", N);
        const float *wts = f32_of(ex, name, (size_t)N);
        for (int i = 0; i <= N; i++) {
            float w;
            memcpy(&w, wsig + i, sizeof w);
            ck_assert_msg(f2u(sig[i]) == f2u(w), "%s N=%d sigma[%d] %08x want %08x", cfg, N, i,
                          f2u(sig[i]), f2u(w));
        }
        ck_assert_msg(dit_scheduler_set_timesteps(s, N, 0, &diag) == DIT_OK, "%s", diag.msg);
        for (int i = 0; i < N; i++) {
            float w;
            memcpy(&w, wts + i, sizeof w);
            ck_assert_msg((float)ts[i] == w, "%s N=%d timestep[%d] %lld want %g", cfg, N, i,
                          (long long)ts[i], (double)w);
            ck_assert_msg(dit_scheduler_timestep(s, i) == w, "%s N=%d timestep[%d]", cfg, N, i);
        }
        snprintf(name, sizeof name, "samples_%d", N);
        const float *wx = f32_of(ex, name, ((size_t)N + 1) * n);
        snprintf(name, sizeof name, "exactlog_%d", N);
        const float *wl = f32_of(ex, name, ((size_t)N + 1) * n);
        memcpy(x, x0, sizeof x);
        for (int i = 0; i < N; i++) {
            memcpy(v, mo + (size_t)i * n, sizeof v);
            ck_assert_int_eq(dit_scheduler_step(s, i, x, v, n, &diag), DIT_OK);
            memcpy(want, wx + (size_t)(i + 1) * n, sizeof want);
            memcpy(exact, wl + (size_t)(i + 1) * n, sizeof exact);
            double scale = 0.0, scale_l = 0.0;
            for (size_t e = 0; e < n; e++) {
                scale = fmax(scale, fabs((double)want[e]));
                scale_l = fmax(scale_l, fabs((double)exact[e]));
            }
            for (size_t e = 0; e < n; e++) {
                const double d = fabs((double)x[e] - (double)want[e]);
                const double dl = fabs((double)x[e] - (double)exact[e]);
                worst = fmax(worst, d / scale);
                worst_exact = fmax(worst_exact, dl / scale_l);
                ck_assert_msg(exact_bits ? f2u(x[e]) == f2u(exact[e]) : dl <= 1e-6 * scale_l,
                              "%s N=%d step %d [%zu]: %.9g want %.9g (exact log; diff %.3g)", cfg,
                              N, i, e, (double)x[e], (double)exact[e], dl);
                ck_assert_msg(d <= SAMPLE_TOL * scale,
                              "%s N=%d step %d [%zu]: %.9g want %.9g (diff %.3g, sample max %.3g)",
                              cfg, N, i, e, (double)x[e], (double)want[e], d, scale);
            }
        }
    }
    printf("unipc %s: sigmas and timesteps bit-identical; samples within %.3g of diffusers' "
           "and %.3g of diffusers' with an exact log (%s), of the sample's largest value\n",
           cfg, worst, worst_exact, exact_bits ? "required bit-identical" : "order 3");
    dit_scheduler_free(s);
    dit_st_file_close(ex);
    dit_st_file_close(in);
}
END_TEST

/* Sigmas and timesteps alone, at flow_shift 1, 3, 5 and 7 and 45 step counts
 * up to 1000. */
START_TEST(schedules_match_diffusers_at_many_step_counts)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/schedules.safetensors", root);
    dit_st_file *f = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_st_file_open(path, &f, &diag) == DIT_OK, "%s", diag.msg);
    snprintf(path, sizeof path, "%s/wan_480p/scheduler_config.json", root);
    dit_unipc_config c;
    ck_assert_msg(dit_unipc_config_load(path, &c, &diag) == DIT_OK, "%s", diag.msg);
    float *sig = malloc(sizeof(float) * 1001);
    int64_t *ts = malloc(sizeof(int64_t) * 1000);
    int cases = 0;
    for (size_t i = 0; i < dit_st_file_count(f); i++) {
        const dit_st_entry *e = dit_st_file_at(f, i);
        int shift, N;
        if (sscanf(e->name, "shift%d_sigmas_%d", &shift, &N) != 2)
            continue;
        char name[64];
        snprintf(name, sizeof name, "shift%d_timesteps_%d", shift, N);
        const float *wsig = f32_of(f, e->name, (size_t)N + 1);
        const float *wts = f32_of(f, name, (size_t)N);
        c.flow_shift = shift;
        ck_assert_int_eq(dit_unipc_schedule(&c, N, sig, ts, &diag), DIT_OK);
        for (int k = 0; k <= N; k++) {
            float w;
            memcpy(&w, wsig + k, sizeof w);
            ck_assert_msg(f2u(sig[k]) == f2u(w), "shift %d N=%d sigma[%d] %08x want %08x", shift, N,
                          k, f2u(sig[k]), f2u(w));
        }
        for (int k = 0; k < N; k++) {
            float w;
            memcpy(&w, wts + k, sizeof w);
            ck_assert_msg((float)ts[k] == w, "shift %d N=%d timestep[%d] %lld want %g", shift, N, k,
                          (long long)ts[k], (double)w);
        }
        cases++;
    }
    printf("unipc schedules: %d cases bit-identical\n", cases);
    ck_assert_int_eq(cases, 4 * 45);
    free(sig);
    free(ts);
    dit_st_file_close(f);
}
END_TEST

START_TEST(rejects_what_it_does_not_implement)
{
    char dir[] = "/tmp/dit_unipc_XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/scheduler_config.json", dir);
#define FLOW                                                                                       \
    "\"_class_name\": \"UniPCMultistepScheduler\", \"prediction_type\": "                          \
    "\"flow_prediction\", \"use_flow_sigmas\": true"
    const char *bad[][2] = {
        {"{\"_class_name\": \"UniPCMultistepScheduler\"}", "prediction_type \"epsilon\""},
        {"{\"prediction_type\": \"flow_prediction\"}", "use_flow_sigmas false"},
        {"{" FLOW ", \"solver_order\": 4}", "solver_order 4"},
        {"{" FLOW ", \"thresholding\": true}", "thresholding true"},
        {"{" FLOW ", \"use_karras_sigmas\": true}", "use_karras_sigmas true"},
        {"{" FLOW ", \"use_dynamic_shifting\": true}", "use_dynamic_shifting true"},
        {"{" FLOW ", \"shift_terminal\": 0.1}", "shift_terminal"},
        {"{" FLOW ", \"solver_p\": {}}", "solver_p"},
        {"{" FLOW ", \"predict_x0\": false}", "predict_x0 false"},
        {"{" FLOW ", \"solver_type\": \"bh1\"}", "solver_type bh1 and final_sigmas_type zero"},
        {"{" FLOW ", \"solver_type\": \"bh3\"}", "unknown solver_type \"bh3\""},
        {"{" FLOW ", \"final_sigmas_type\": \"one\"}", "unknown final_sigmas_type"},
    };
#undef FLOW
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        FILE *f = fopen(path, "w");
        fputs(bad[i][0], f);
        fclose(f);
        dit_diag diag;
        dit_diag_clear(&diag);
        dit_scheduler *s = NULL;
        ck_assert_int_ne(dit_scheduler_load(path, "UniPCMultistepScheduler", &s, &diag), DIT_OK);
        ck_assert_ptr_null(s);
        ck_assert_msg(strstr(diag.msg, bad[i][1]), "'%s' not in: %s", bad[i][1], diag.msg);
        ck_assert_msg(strstr(diag.msg, path), "the path not in: %s", diag.msg);
    }
    unlink(path);
    rmdir(dir);
}
END_TEST

/* Memory for the multistep history that cannot be had is a status, not an
 * abort (a worker would take its mesh down with it), and the scheduler
 * takes steps again once there is memory; a step other than 0 without
 * step 0 before it is refused. */
START_TEST(history_out_of_memory_is_a_status)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/wan_480p/scheduler_config.json", root);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_scheduler *s = NULL;
    ck_assert_msg(dit_scheduler_load(path, "UniPCMultistepScheduler", &s, &diag) == DIT_OK, "%s",
                  diag.msg);
    ck_assert_int_eq(dit_scheduler_set_timesteps(s, 4, 64, &diag), DIT_OK);
    float x[8] = {0}, v[8] = {0};
    const size_t huge = SIZE_MAX / 2;
    ck_assert_int_eq(dit_scheduler_step(s, 0, x, v, huge, &diag), DIT_ERR_NOMEM);
    ck_assert_msg(strstr(diag.msg, "out of memory"), "%s", diag.msg);
    ck_assert_int_eq(dit_scheduler_step(s, 1, x, v, 8, &diag), DIT_ERR_INTERNAL);
    for (int i = 0; i < 4; i++)
        ck_assert_int_eq(dit_scheduler_step(s, i, x, v, 8, &diag), DIT_OK);
    dit_scheduler_free(s);
}
END_TEST

int main(void)
{
    snprintf(root, sizeof root, "%s/tests/data/scheduler/unipc", test_env("DIT_SOURCE_ROOT"));
    Suite *s = suite_create("scheduler_unipc");
    TCase *tc = tcase_create("core");
    tcase_add_loop_test(tc, schedules_and_steps_match_diffusers, 0,
                        (int)(sizeof configs / sizeof *configs));
    tcase_add_test(tc, schedules_match_diffusers_at_many_step_counts);
    tcase_add_test(tc, rejects_what_it_does_not_implement);
    tcase_add_test(tc, history_out_of_memory_is_a_status);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
