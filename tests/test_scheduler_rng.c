/* The flow-match scheduler and torch-compatible noise against values that
 * diffusers and torch computed (tests/golden/gen_scheduler_rng_golden.py):
 * both must be bit-identical. */
#include <check.h>
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/json_util.h"
#include "loader/safetensors.h"
#include "pipelines/flux_pipeline.h"
#include "schedulers/flow_match_euler.h"
#include "core/torch_rng.h"
#include "test_proc.h"

static char root[1024];

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

START_TEST(schedules_match_diffusers_bit_for_bit)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/cases.json", root);
    cJSON *doc = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_json_load_file(path, &doc, &diag) == DIT_OK, "%s", diag.msg);
    const cJSON *cases = cJSON_GetObjectItem(doc, "cases");
    int n = 0, bad = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cases)
    {
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItem(c, "config"));
        int steps = (int)cJSON_GetNumberValue(cJSON_GetObjectItem(c, "steps"));
        int64_t seq = (int64_t)cJSON_GetNumberValue(cJSON_GetObjectItem(c, "image_seq_len"));
        snprintf(path, sizeof path, "%s/%s/scheduler_config.json", root, name);
        dit_flow_scheduler s;
        ck_assert_msg(dit_flow_scheduler_load(path, &s, &diag) == DIT_OK, "%s", diag.msg);
        float sig[64], ts[64];
        ck_assert_int_eq(dit_flow_scheduler_schedule(&s, steps, seq, sig, ts, &diag), DIT_OK);
        const cJSON *ws = cJSON_GetObjectItem(c, "sigmas"),
                    *wt = cJSON_GetObjectItem(c, "timesteps");
        ck_assert_int_eq(cJSON_GetArraySize(ws), steps + 1);
        for (int i = 0; i <= steps; i++) {
            uint32_t want = (uint32_t)cJSON_GetNumberValue(cJSON_GetArrayItem(ws, i));
            if (f2u(sig[i]) != want) {
                if (bad++ < 5)
                    fprintf(stderr, "%s steps %d seq %lld: sigma[%d] %08x want %08x\n", name, steps,
                            (long long)seq, i, f2u(sig[i]), want);
            }
        }
        for (int i = 0; i < steps; i++) {
            uint32_t want = (uint32_t)cJSON_GetNumberValue(cJSON_GetArrayItem(wt, i));
            if (f2u(ts[i]) != want && bad++ < 5)
                fprintf(stderr, "%s steps %d seq %lld: timestep[%d] %08x want %08x\n", name, steps,
                        (long long)seq, i, f2u(ts[i]), want);
        }
        n++;
    }
    printf("scheduler: %d cases, %d values differ\n", n, bad);
    ck_assert_int_ge(n, 100);
    ck_assert_int_eq(bad, 0);
    cJSON_Delete(doc);
}
END_TEST

START_TEST(scheduler_rejects_what_it_does_not_implement)
{
    char dir[] = "/tmp/dit_sched_XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/scheduler_config.json", dir);
    const char *bad[][2] = {
        {"{\"use_karras_sigmas\": true}", "use_karras_sigmas is not supported"},
        {"{\"stochastic_sampling\": true}", "stochastic_sampling is not supported"},
        {"{\"_class_name\": \"DDIMScheduler\"}", "DDIMScheduler"},
        {"{\"time_shift_type\": \"cubic\"}", "unknown time_shift_type"},
        {"{\"base_image_seq_len\": 7, \"max_image_seq_len\": 7}", "equals max_image_seq_len"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        FILE *f = fopen(path, "w");
        fputs(bad[i][0], f);
        fclose(f);
        dit_flow_scheduler s;
        dit_diag diag;
        dit_diag_clear(&diag);
        ck_assert_int_ne(dit_flow_scheduler_load(path, &s, &diag), DIT_OK);
        ck_assert_msg(strstr(diag.msg, bad[i][1]), "'%s' not in: %s", bad[i][1], diag.msg);
    }
    unlink(path);
    rmdir(dir);
    float x[3] = {1, 2, 3}, v[3] = {1, -1, 0.5f};
    dit_flow_scheduler_step(x, v, 3, 1.0f, 0.75f);
    ck_assert_float_eq(x[0], 0.75f);
    ck_assert_float_eq(x[1], 2.25f);
    ck_assert_float_eq(x[2], 2.875f);
}
END_TEST

START_TEST(randn_matches_torch_bit_for_bit)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/randn.safetensors", root);
    dit_st_file *f = NULL;
    ck_assert_int_eq(dit_st_file_open(path, &f, NULL), DIT_OK);
    int checked = 0;
    for (size_t i = 0; i < dit_st_file_count(f); i++) {
        const dit_st_entry *e = dit_st_file_at(f, i);
        unsigned long long seed;
        unsigned long n;
        if (sscanf(e->name, "seed%llu_n%lu", &seed, &n) != 2)
            continue;
        float *want = malloc(n * sizeof *want), *got = malloc(n * sizeof *got);
        dit_convert_to_f32(want, e->view.data, e->view.dtype, n);
        dit_mt19937 g;
        dit_mt19937_seed(&g, seed);
        dit_torch_randn(&g, got, n);
        size_t diff = 0;
        for (size_t k = 0; k < n; k++)
            diff += f2u(got[k]) != f2u(want[k]);
        ck_assert_msg(diff == 0, "%s: %zu of %lu values differ", e->name, diff, n);
        free(want);
        free(got);
        checked++;
    }
    ck_assert_int_ge(checked, 30);

    /* FluxPipeline.prepare_latents: randn (1, 16, 64, 48), then packed. */
    const dit_st_entry *pe = dit_st_file_find(f, "packed_seed7_16x64x48");
    ck_assert_ptr_nonnull(pe);
    const size_t n = 16 * 64 * 48;
    float *noise = malloc(n * sizeof *noise), *packed = malloc(n * sizeof *packed);
    float *want = malloc(n * sizeof *want), *back = malloc(n * sizeof *back);
    dit_mt19937 g;
    dit_mt19937_seed(&g, 7);
    dit_torch_randn(&g, noise, n);
    dit_flux_pack_latents(noise, 16, 64, 48, packed);
    dit_convert_to_f32(want, pe->view.data, pe->view.dtype, n);
    ck_assert_int_eq(memcmp(packed, want, n * sizeof *want), 0);
    dit_flux_unpack_latents(packed, 16, 64, 48, back);
    ck_assert_int_eq(memcmp(back, noise, n * sizeof *back), 0);
    free(noise);
    free(packed);
    free(want);
    free(back);
    dit_st_file_close(f);
}
END_TEST

int main(void)
{
    snprintf(root, sizeof root, "%s/tests/data/scheduler", test_env("DIT_SOURCE_ROOT"));
    Suite *s = suite_create("scheduler_rng");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, schedules_match_diffusers_bit_for_bit);
    tcase_add_test(tc, scheduler_rejects_what_it_does_not_implement);
    tcase_add_test(tc, randn_matches_torch_bit_for_bit);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
