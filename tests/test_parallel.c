/* Context and tensor parallelism across real rank processes: every mode of
 * the parallel issue runs through `ditrun forward --world-size N` and must
 * match both the single-rank output and diffusers; every validation rule
 * has its message checked; a rank killed mid-forward makes the run fail
 * fast. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "models/flux/flux.h"
#include "models/flux/flux_model.h"
#include "parallel/mesh.h"
#include "test_proc.h"

/* Parallel runs differ from one rank only in summation order. */
#define VS_SINGLE_TOL 1e-6
#define VS_DIFFUSERS_TOL 1e-5

typedef struct mode {
    const char *name;
    const char *fixture; /* golden case: FLUX's, or "wan_golden/<case>" */
    const char *args[12];
} mode;

static const mode modes[] = {
    {"ring 2", "parallel_even", {"--world-size", "2", "--ring", "2"}},
    {"ring 4", "parallel_even", {"--world-size", "4", "--ring", "4"}},
    {"ulysses 2", "parallel_even", {"--world-size", "2", "--ulysses", "2"}},
    {"ulysses 4", "parallel_even", {"--world-size", "4", "--ulysses", "4"}},
    {"ring 2 x ulysses 2", "parallel_even", {"--world-size", "4", "--ring", "2", "--ulysses", "2"}},
    {"ulysses-anything 2",
     "parallel_odd",
     {"--world-size", "2", "--ulysses", "2", "--ulysses-anything"}},
    {"ulysses-anything 4",
     "parallel_odd",
     {"--world-size", "4", "--ulysses", "4", "--ulysses-anything"}},
    {"ring-anything 2", "parallel_odd", {"--world-size", "2", "--ring", "2", "--ring-anything"}},
    {"ring-anything 4", "parallel_odd", {"--world-size", "4", "--ring", "4", "--ring-anything"}},
    {"unified-anything 2x2",
     "parallel_odd",
     {"--world-size", "4", "--ring", "2", "--ulysses", "2", "--unified-anything"}},
    {"tp 2", "parallel_even", {"--world-size", "2", "--tp", "2"}},
    {"tp 4", "parallel_even", {"--world-size", "4", "--tp", "4"}},
    {"tp 2 x ulysses 2", "parallel_even", {"--world-size", "4", "--tp", "2", "--ulysses", "2"}},
    {"tp 2 x ring 2", "parallel_even", {"--world-size", "4", "--tp", "2", "--ring", "2"}},
    {"tp 2 x ring 2 x ulysses 2",
     "parallel_even",
     {"--world-size", "8", "--tp", "2", "--ring", "2", "--ulysses", "2"}},
    {"ring 2, no fp32 merge",
     "parallel_even",
     {"--world-size", "2", "--ring", "2", "--no-fp32-merge"}},
    /* Wan: the video tokens split after the patch embedding. */
    {"wan ring 2", "wan_golden/parallel_even", {"--world-size", "2", "--ring", "2"}},
    {"wan ring 4", "wan_golden/parallel_even", {"--world-size", "4", "--ring", "4"}},
    {"wan ulysses 2", "wan_golden/parallel_even", {"--world-size", "2", "--ulysses", "2"}},
    {"wan ulysses 4", "wan_golden/parallel_even", {"--world-size", "4", "--ulysses", "4"}},
    {"wan ring 2 x ulysses 2",
     "wan_golden/parallel_even",
     {"--world-size", "4", "--ring", "2", "--ulysses", "2"}},
    {"wan ulysses 3", "wan_golden/parallel_odd", {"--world-size", "3", "--ulysses", "3"}},
    {"wan ulysses-anything 2",
     "wan_golden/parallel_odd",
     {"--world-size", "2", "--ulysses", "2", "--ulysses-anything"}},
    {"wan ring-anything 2",
     "wan_golden/parallel_odd",
     {"--world-size", "2", "--ring", "2", "--ring-anything"}},
    {"wan ring-anything 4",
     "wan_golden/parallel_odd",
     {"--world-size", "4", "--ring", "4", "--ring-anything"}},
    {"wan unified-anything 2x2",
     "wan_golden/parallel_odd",
     {"--world-size", "4", "--ring", "2", "--ulysses", "2", "--unified-anything"}},
    {"wan tp 2 x ring 2",
     "wan_golden/parallel_even",
     {"--world-size", "4", "--tp", "2", "--ring", "2"}},
    {"wan tp 2 x ulysses 2",
     "wan_golden/parallel_even",
     {"--world-size", "4", "--tp", "2", "--ulysses", "2"}},
    /* CFG parallelism: batch-2 fixtures halve over the two groups; batch-1
     * ones (parallel_odd, wan parallel_even) run whole on both. */
    {"cfg 2", "parallel_even", {"--world-size", "2", "--cfg-parallel"}},
    {"cfg 2 x ring 2", "parallel_even", {"--world-size", "4", "--cfg-parallel", "--ring", "2"}},
    {"cfg 2 x ulysses 2",
     "parallel_even",
     {"--world-size", "4", "--cfg-parallel", "--ulysses", "2"}},
    {"cfg 2 x tp 2", "parallel_even", {"--world-size", "4", "--cfg-parallel", "--tp", "2"}},
    {"cfg 2, batch 1", "parallel_odd", {"--world-size", "2", "--cfg-parallel"}},
    {"cfg 2 x ring-anything 2, batch 1",
     "parallel_odd",
     {"--world-size", "4", "--cfg-parallel", "--ring", "2", "--ring-anything"}},
    {"wan cfg 2", "wan_golden/bf16_batch2", {"--world-size", "2", "--cfg-parallel"}},
    {"wan cfg 2 x ring 2",
     "wan_golden/bf16_batch2",
     {"--world-size", "4", "--cfg-parallel", "--ring", "2"}},
    {"wan cfg 2 x ulysses 2, batch 1",
     "wan_golden/parallel_even",
     {"--world-size", "4", "--cfg-parallel", "--ulysses", "2"}},
};

static void fixture_paths(const char *fixture, char *model, char *inputs, char *expected,
                          size_t cap)
{
    const char *root = test_env("DIT_SOURCE_ROOT");
    const char *dir = strchr(fixture, '/') ? "" : "golden/";
    snprintf(model, cap, "%s/tests/data/%s%s/transformer", root, dir, fixture);
    snprintf(inputs, cap, "%s/tests/data/%s%s/inputs.safetensors", root, dir, fixture);
    snprintf(expected, cap, "%s/tests/data/%s%s/expected.safetensors", root, dir, fixture);
}

/* Runs ditrun forward on a fixture with extra arguments. */
static int run_forward(const char *fixture, const char *const *extra, const char *output,
                       char *const envp[], char *log, size_t cap, double *seconds)
{
    char model[1024], inputs[1024], expected[1024];
    fixture_paths(fixture, model, inputs, expected, sizeof model);
    char *argv[32] = {(char *)test_env("DITRUN"),
                      "forward",
                      "--model",
                      model,
                      "--inputs",
                      inputs,
                      "--output",
                      (char *)output,
                      "--quiet"};
    int k = 9;
    for (int i = 0; extra && extra[i] && k < 30; i++)
        argv[k++] = (char *)extra[i];
    argv[k] = NULL;
    return test_run(argv, envp, log, cap, seconds);
}

START_TEST(mode_matches_single_rank_and_diffusers)
{
    const mode *m = &modes[_i];
    char single[128], par[128], log[16384], model[1024], inputs[1024], expected[1024];
    snprintf(single, sizeof single, "/tmp/dit_par_single_%d_%d.safetensors", (int)getpid(), _i);
    snprintf(par, sizeof par, "/tmp/dit_par_%d_%d.safetensors", (int)getpid(), _i);
    fixture_paths(m->fixture, model, inputs, expected, sizeof model);

    int rc = run_forward(m->fixture, NULL, single, NULL, log, sizeof log, NULL);
    ck_assert_msg(rc == 0, "single rank failed (%d):\n%s", rc, log);
    double secs;
    rc = run_forward(m->fixture, m->args, par, NULL, log, sizeof log, &secs);
    ck_assert_msg(rc == 0, "%s: ditrun exited %d:\n%s", m->name, rc, log);

    test_err vs1 = test_compare_files(par, "sample", single, "sample");
    test_err vsd = test_compare_files(par, "sample", expected, "sample");
    printf("%-28s %-14s vs single rank %.3g, vs diffusers %.3g (%.2f s)\n", m->name, m->fixture,
           vs1.rel, vsd.rel, secs);
    fflush(stdout);
    /* One limit for every model: the modes reorder f32 sums (ring merges,
     * all-reduces), a few ulps; measured up to 2.8e-7 (Wan, -O2 builds). */
    ck_assert_msg(vs1.rel <= VS_SINGLE_TOL, "%s: %.3g from the single-rank output", m->name,
                  vs1.rel);
    ck_assert_msg(vsd.rel <= VS_DIFFUSERS_TOL, "%s: %.3g from diffusers", m->name, vsd.rel);
    unlink(single);
    unlink(par);
}
END_TEST

static dit_parallel_config layout(int world, int R, int U, int T)
{
    dit_parallel_config pc = dit_parallel_config_single();
    pc.world_size = world;
    pc.ring_degree = R;
    pc.ulysses_degree = U;
    pc.tp_degree = T;
    return pc;
}

static void expect_layout_error(const dit_parallel_config *pc, const char *needle)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_parallel_validate(pc, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(diag.msg, needle), "'%s' not in: %s", needle, diag.msg);
}

START_TEST(layout_rules_have_clear_messages)
{
    dit_parallel_config pc = layout(2, 1, 1, 1);
    expect_layout_error(&pc, "either ring_degree or ulysses_degree must be greater than 1");
    pc = layout(2, 0, 2, 1);
    expect_layout_error(&pc, "must all be >= 1");
    pc = layout(4, 2, 1, 1);
    expect_layout_error(&pc, "= 2 must equal the world size (4)");
    pc = layout(8, 2, 2, 1);
    expect_layout_error(&pc, "must equal the world size (8)");
    pc = layout(2, 2, 1, 1);
    pc.ulysses_anything = true;
    expect_layout_error(&pc, "ulysses_degree must be greater than 1 for ulysses_anything");
    pc = layout(4, 2, 2, 1);
    pc.ulysses_anything = true;
    expect_layout_error(&pc, "ulysses_anything cannot be enabled when ring_degree > 1");
    pc = layout(2, 1, 2, 1);
    pc.ring_anything = true;
    expect_layout_error(&pc, "ring_degree must be greater than 1 for ring_anything");
    pc = layout(4, 2, 2, 1);
    pc.ring_anything = true;
    expect_layout_error(&pc, "ring_anything cannot be enabled when ulysses_degree > 1");
    pc = layout(4, 2, 2, 1);
    pc.ring_anything = pc.ulysses_anything = true;
    expect_layout_error(&pc, "cannot both be enabled");
    pc = layout(2, 2, 1, 1);
    pc.unified_anything = true;
    expect_layout_error(&pc, "unified_anything needs ring_degree > 1 and ulysses_degree > 1");
    pc = layout(4, 2, 2, 1);
    pc.unified_anything = pc.ring_anything = true;
    expect_layout_error(&pc, "enable only one anything mode");
    pc = layout(2, 1, 1, 1);
    pc.cfg_degree = 3;
    expect_layout_error(&pc, "cfg_degree must be 1 or 2");
    pc.cfg_degree = 0;
    expect_layout_error(&pc, "cfg_degree must be 1 or 2");
    pc = layout(2, 1, 1, 1);
    expect_layout_error(&pc, "or cfg_degree 2 for CFG parallelism");
    pc = layout(2, 2, 1, 1);
    pc.cfg_degree = 2;
    expect_layout_error(&pc,
                        "cfg_degree (2) x ring_degree (2) x ulysses_degree (1) x tp_degree (1) "
                        "= 4 must equal the world size (2)");
    pc = layout(3, 1, 1, 1);
    pc.cfg_degree = 2;
    expect_layout_error(&pc, "= 2 must equal the world size (3)");
    pc = layout(1, 1, 1, 1);
    pc.cfg_degree = 2;
    expect_layout_error(&pc, "must equal the world size (1)");
    /* valid layouts */
    dit_parallel_config ok[] = {layout(1, 1, 1, 1), layout(2, 1, 1, 2), layout(8, 2, 2, 2),
                                layout(2, 1, 1, 1), layout(8, 2, 1, 2)};
    ok[3].cfg_degree = ok[4].cfg_degree = 2;
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++)
        ck_assert_int_eq(dit_parallel_validate(&ok[i], NULL), DIT_OK);
}
END_TEST

static void expect_model_error(const dit_parallel_config *pc, int heads, int64_t img, int64_t txt,
                               const char *needle)
{
    dit_flux_config mc = dit_flux_config_flux1_dev();
    mc.num_attention_heads = heads;
    ck_assert_int_eq(dit_flux_config_finish(&mc, "test", NULL), DIT_OK);
    dit_diag diag;
    dit_diag_clear(&diag);
    const dit_parallel_req req = dit_flux_model_class.parallel_req(&mc);
    const int64_t lens[2] = {img, txt};
    ck_assert_int_eq(dit_parallel_validate_model(pc, &req, lens, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(diag.msg, needle), "'%s' not in: %s", needle, diag.msg);
}

START_TEST(model_rules_have_clear_messages)
{
    dit_parallel_config pc = layout(2, 1, 1, 2);
    expect_model_error(&pc, 3, 64, 8, "num_attention_heads (3) must be divisible by tp_degree (2)");
    pc = layout(2, 1, 2, 1);
    expect_model_error(&pc, 3, 64, 8,
                       "num_attention_heads (3) must be divisible by ulysses_degree (2)");
    expect_model_error(&pc, 3, 64, 8, "ulysses_anything allows uneven heads");
    pc = layout(4, 1, 2, 2);
    expect_model_error(&pc, 2, 64, 8, "heads per tensor-parallel rank");
    pc = layout(2, 2, 1, 1);
    expect_model_error(&pc, 4, 35, 8,
                       "35 image tokens are not divisible by the context-parallel size 2");
    expect_model_error(&pc, 4, 35, 8, "ring_anything splits them unevenly");
    expect_model_error(&pc, 4, 64, 7, "7 text tokens are not divisible");
    pc = layout(4, 2, 2, 1);
    expect_model_error(&pc, 4, 66, 8, "unified_anything splits them unevenly");
    pc = layout(2, 1, 2, 1);
    expect_model_error(&pc, 4, 33, 8, "ulysses_anything splits them unevenly");
    /* The FFN rule: a model whose FFN width is not divisible by T. With
     * mlp = 4 * heads * head_dim that needs T not dividing 4 * inner. */
    dit_flux_config mc = dit_flux_config_flux1_dev();
    mc.num_attention_heads = 3;
    mc.attention_head_dim = 2;
    mc.n_axes = 1;
    mc.axes_dims_rope[0] = 2;
    ck_assert_int_eq(dit_flux_config_finish(&mc, "test", NULL), DIT_OK);
    mc.mlp_dim = 25; /* as a differently shaped checkpoint would have it */
    pc = layout(3, 1, 1, 3);
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_parallel_req req = dit_flux_model_class.parallel_req(&mc);
    const int64_t lens88[2] = {8, 8};
    ck_assert_int_eq(dit_parallel_validate_model(&pc, &req, lens88, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(diag.msg, "FFN width (25) must be divisible by tp_degree (3)"));
    /* anything modes lift the divisibility rules */
    pc = layout(2, 1, 2, 1);
    pc.ulysses_anything = true;
    mc = dit_flux_config_flux1_dev();
    mc.num_attention_heads = 3;
    ck_assert_int_eq(dit_flux_config_finish(&mc, "test", NULL), DIT_OK);
    req = dit_flux_model_class.parallel_req(&mc);
    const int64_t lens357[2] = {35, 7};
    ck_assert_int_eq(dit_parallel_validate_model(&pc, &req, lens357, NULL), DIT_OK);
}
END_TEST

START_TEST(partition_matches_tensor_split)
{
    /* torch.arange(35).tensor_split(4) -> sizes 9, 9, 9, 8 */
    int64_t off, len;
    const int64_t want_len[4] = {9, 9, 9, 8}, want_off[4] = {0, 9, 18, 27};
    for (int i = 0; i < 4; i++) {
        dit_partition(35, 4, i, &off, &len);
        ck_assert_int_eq(len, want_len[i]);
        ck_assert_int_eq(off, want_off[i]);
    }
    dit_partition(2, 4, 3, &off, &len); /* fewer items than parts */
    ck_assert_int_eq(len, 0);
    ck_assert_int_eq(off, 2);
}
END_TEST

START_TEST(cli_rejects_bad_layouts_with_exit_2)
{
    char log[8192];
    const char *bad1[] = {"--world-size", "4", "--ring", "2", NULL};
    ck_assert_int_eq(
        run_forward("parallel_even", bad1, "/tmp/unused.safetensors", NULL, log, sizeof log, NULL),
        2);
    ck_assert_msg(strstr(log, "must equal the world size (4)"), "%s", log);
    const char *bad2[] = {"--world-size", "2", "--ring", "2", NULL};
    ck_assert_int_eq(
        run_forward("parallel_odd", bad2, "/tmp/unused.safetensors", NULL, log, sizeof log, NULL),
        2);
    ck_assert_msg(strstr(log, "ring_anything splits them unevenly"), "%s", log);
    const char *bad3[] = {"--world-size", "2", "--ulysses", "2", NULL};
    ck_assert_int_eq(
        run_forward("parallel_odd", bad3, "/tmp/unused.safetensors", NULL, log, sizeof log, NULL),
        2);
    ck_assert_msg(strstr(log, "must be divisible by ulysses_degree (2)"), "%s", log);
    /* Host shared memory cannot carry device buffers: cuda meshes are ditd's. */
    const char *bad4[] = {"--world-size", "2", "--ring", "2", "--backend", "cuda", NULL};
    ck_assert_int_eq(
        run_forward("parallel_even", bad4, "/tmp/unused.safetensors", NULL, log, sizeof log, NULL),
        2);
    ck_assert_msg(strstr(log, "needs --backend cpu"), "%s", log);
    const char *bad5[] = {"--world-size", "2", "--cfg-parallel", "--ring", "2", NULL};
    ck_assert_int_eq(
        run_forward("parallel_even", bad5, "/tmp/unused.safetensors", NULL, log, sizeof log, NULL),
        2);
    ck_assert_msg(strstr(log, "= 4 must equal the world size (2)"), "%s", log);
    /* Inside each CFG group the usual model rules hold. */
    const char *bad6[] = {"--world-size", "4", "--cfg-parallel", "--ring", "2", NULL};
    ck_assert_int_eq(
        run_forward("parallel_odd", bad6, "/tmp/unused.safetensors", NULL, log, sizeof log, NULL),
        2);
    ck_assert_msg(strstr(log, "ring_anything splits them unevenly"), "%s", log);
}
END_TEST

/* A batch of 2 halves (rank 0 sends its half of the (2, 24, 8) sample, 768
 * bytes); a batch of 1 runs whole on both groups and exchanges nothing. */
START_TEST(cfg_parallel_halves_even_batches_only)
{
    char log[16384];
    const char *args[] = {"--world-size", "2", "--cfg-parallel", NULL};
    char model[1024], inputs[1024], expected[1024];
    const char *fixtures[2] = {"parallel_even", "parallel_odd"};
    const char *want[2] = {"cfg: rank 0 exchanged 768 bytes of output per forward (each group ran "
                           "half of the batch)",
                           "cfg: rank 0 exchanged 0 bytes of output per forward (odd batch: both "
                           "groups ran all of it)"};
    for (int k = 0; k < 2; k++) {
        fixture_paths(fixtures[k], model, inputs, expected, sizeof model);
        char *argv[16] = {(char *)test_env("DITRUN"),
                          "forward",
                          "--model",
                          model,
                          "--inputs",
                          inputs,
                          "--output",
                          "/tmp/dit_cfg_halves.safetensors"};
        int n = 8;
        for (int i = 0; args[i]; i++)
            argv[n++] = (char *)args[i];
        argv[n] = NULL;
        ck_assert_int_eq(test_run(argv, NULL, log, sizeof log, NULL), 0);
        ck_assert_msg(strstr(log, want[k]), "%s", log);
    }
    unlink("/tmp/dit_cfg_halves.safetensors");
}
END_TEST

START_TEST(tensor_parallel_shrinks_weights)
{
    /* FLUX.1-dev's proportions at a small width: every block linear,
     * AdaLN included, is split; only the embedders stay whole. */
    dit_flux_config mc = dit_flux_config_flux1_dev();
    mc.num_attention_heads = 8;
    mc.attention_head_dim = 32;
    mc.n_axes = 1;
    mc.axes_dims_rope[0] = 32;
    mc.num_layers = 2;
    mc.num_single_layers = 4;
    mc.joint_attention_dim = 256;
    mc.pooled_projection_dim = 64;
    dit_backend *be;
    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 1};
    ck_assert_int_eq(dit_backend_create(&bc, &be, NULL), DIT_OK);
    size_t bytes[5] = {0};
    for (int T = 1; T <= 4; T *= 2) {
        dit_flux_shard shard = {.tp_degree = T, .tp_rank = T - 1};
        dit_flux *m;
        ck_assert_int_eq(dit_flux_create_random(be, &mc, &shard, 1, &m, NULL), DIT_OK);
        bytes[T] = dit_flux_weight_bytes(m);
        dit_flux_destroy(m);
    }
    printf("weights per rank: tp 1 %.2f MiB, tp 2 %.2f MiB (%.3f), tp 4 %.2f MiB (%.3f)\n",
           bytes[1] / 1048576.0, bytes[2] / 1048576.0, (double)bytes[2] / bytes[1],
           bytes[4] / 1048576.0, (double)bytes[4] / bytes[1]);
    ck_assert_double_le((double)bytes[2] / bytes[1], 0.5 + 0.05);
    ck_assert_double_le((double)bytes[4] / bytes[1], 0.25 + 0.05);
    dit_backend_destroy(be);
}
END_TEST

START_TEST(killed_rank_fails_the_run_fast)
{
    char log[16384];
    /* Rank 1 kills itself after block 1; the comm timeout is 30 s, but the
     * others notice the dead peer within a fraction of a second. */
    const char *args[] = {"--world-size",   "4",  "--ring", "2", "--ulysses", "2",
                          "--comm-timeout", "30", NULL};
    char *envp[64];
    int k = 0;
    for (char **e = environ; *e && k < 60; e++)
        envp[k++] = *e;
    envp[k++] = "DIT_FAULT_KILL_RANK=1";
    envp[k++] = "DIT_FAULT_KILL_BLOCK=1";
    envp[k] = NULL;
    double secs;
    unlink("/tmp/dit_par_killed.safetensors");
    int rc = run_forward("parallel_even", args, "/tmp/dit_par_killed.safetensors", envp, log,
                         sizeof log, &secs);
    printf("killed rank: exit %d after %.2f s:\n%s", rc, secs, log);
    ck_assert_int_eq(rc, 1);
    ck_assert_msg(secs < 10.0, "took %.1f s", secs);
    ck_assert_msg(strstr(log, "rank 1 failed: it was killed by signal 9"), "%s", log);
    /* the survivors say why they stopped */
    ck_assert_msg(strstr(log, "rank 1 (pid") || strstr(log, "because rank 1 failed"), "%s", log);
    ck_assert_msg(access("/tmp/dit_par_killed.safetensors", F_OK) != 0, "output written anyway");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("parallel");
    TCase *rules = tcase_create("rules");
    tcase_add_test(rules, layout_rules_have_clear_messages);
    tcase_add_test(rules, model_rules_have_clear_messages);
    tcase_add_test(rules, partition_matches_tensor_split);
    tcase_add_test(rules, cli_rejects_bad_layouts_with_exit_2);
    tcase_add_test(rules, tensor_parallel_shrinks_weights);
    tcase_add_test(rules, cfg_parallel_halves_even_batches_only);
    suite_add_tcase(s, rules);
    TCase *tm = tcase_create("modes");
    tcase_set_timeout(tm, 300);
    tcase_add_loop_test(tm, mode_matches_single_rank_and_diffusers, 0,
                        (int)(sizeof modes / sizeof *modes));
    suite_add_tcase(s, tm);
    TCase *tf = tcase_create("failure");
    tcase_set_timeout(tf, 120);
    tcase_add_test(tf, killed_rank_fails_the_run_fast);
    suite_add_tcase(s, tf);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
