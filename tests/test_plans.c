/* The model plug-in seams: the registries find classes by their diffusers
 * names, the tensor-parallel plan's patterns pick the styles diffusers'
 * Flux plan gives, and the context-parallel plan splits and scatters
 * inputs by its table as torch.tensor_split does; a sequence the model
 * forms itself (Wan's video tokens) lays out the same way. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "backend/arena.h"
#include "backend/backend.h"
#include "models/flux/flux_model.h"
#include "models/model.h"
#include "models/wan/wan_model.h"
#include "parallel/cp_plan.h"
#include "parallel/tp_plan.h"

START_TEST(registry_finds_flux_by_class_name)
{
    ck_assert_ptr_eq(dit_model_class_find("FluxTransformer2DModel"), &dit_flux_model_class);
    ck_assert_ptr_eq(dit_model_class_find("WanTransformer3DModel"), &dit_wan_model_class);
    ck_assert_ptr_null(dit_model_class_find("NoSuchTransformerModel"));
    ck_assert_ptr_null(dit_model_class_find(NULL));
}
END_TEST

START_TEST(tp_patterns_match_one_component_per_star)
{
    ck_assert(
        dit_tp_pattern_match("transformer_blocks.*.attn.to_q", "transformer_blocks.12.attn.to_q"));
    ck_assert(!dit_tp_pattern_match("transformer_blocks.*.attn.to_q",
                                    "single_transformer_blocks.1.attn.to_q"));
    ck_assert(
        !dit_tp_pattern_match("transformer_blocks.*.attn.to_q", "transformer_blocks.1.attn.to_qk"));
    ck_assert(!dit_tp_pattern_match("transformer_blocks.*.attn", "transformer_blocks.1.2.attn"));
    ck_assert(dit_tp_pattern_match("proj_out", "proj_out"));
}
END_TEST

START_TEST(flux_tp_plan_gives_diffusers_styles)
{
    const dit_model_class *c = &dit_flux_model_class;
    const dit_tp_plan tp = {.rules = c->tp_plan, .n_rules = *c->n_tp, .tp_degree = 2};
    ck_assert_int_eq(dit_tp_plan_style(&tp, "transformer_blocks.0.attn.to_k"), DIT_TP_COLWISE);
    ck_assert_int_eq(dit_tp_plan_style(&tp, "transformer_blocks.3.ff.net.2"), DIT_TP_ROWWISE);
    ck_assert_int_eq(dit_tp_plan_style(&tp, "single_transformer_blocks.5.proj_out"),
                     DIT_TP_PACKED_ROWS);
    ck_assert_int_eq(dit_tp_plan_style(&tp, "transformer_blocks.1.norm1.linear"),
                     DIT_TP_COLWISE_GATHER);
    ck_assert_int_eq(dit_tp_plan_style(&tp, "proj_out"), DIT_TP_REPLICATE);
    ck_assert_int_eq(dit_tp_plan_style(&tp, "x_embedder"), DIT_TP_REPLICATE);
}
END_TEST

START_TEST(cp_plan_splits_like_tensor_split)
{
    const dit_model_class *c = &dit_flux_model_class;
    float hs[2 * 7 * 4], ehs[2 * 3 * 5], ids_i[7 * 3], ids_t[3 * 3], pooled[2 * 6], t[2];
    for (size_t i = 0; i < sizeof hs / sizeof *hs; i++)
        hs[i] = (float)i;
    memset(ehs, 0, sizeof ehs);
    for (int i = 0; i < 21; i++)
        ids_i[i] = (float)i;
    dit_named_tensors in = {0};
    const int64_t s_hs[3] = {2, 7, 4}, s_ehs[3] = {2, 3, 5}, s_ii[2] = {7, 3}, s_it[2] = {3, 3};
    const int64_t s_p[2] = {2, 6}, s_t[1] = {2};
    dit_tensor x;
    x = dit_tensor_make(hs, DIT_F32, 3, s_hs);
    dit_named_tensors_set(&in, "hidden_states", &x);
    x = dit_tensor_make(ehs, DIT_F32, 3, s_ehs);
    dit_named_tensors_set(&in, "encoder_hidden_states", &x);
    x = dit_tensor_make(ids_i, DIT_F32, 2, s_ii);
    dit_named_tensors_set(&in, "img_ids", &x);
    x = dit_tensor_make(ids_t, DIT_F32, 2, s_it);
    dit_named_tensors_set(&in, "txt_ids", &x);
    x = dit_tensor_make(pooled, DIT_F32, 2, s_p);
    dit_named_tensors_set(&in, "pooled_projections", &x);
    x = dit_tensor_make(t, DIT_F32, 1, s_t);
    dit_named_tensors_set(&in, "timestep", &x);

    dit_cp_layout lay;
    ck_assert_int_eq(dit_cp_plan_layout(c->cp_plan, c->n_cp, 2, &in, 3, 1, &lay, NULL), DIT_OK);
    /* 7 image tokens over 3 ranks: 3, 2, 2; 3 text tokens: 1, 1, 1. */
    ck_assert_int_eq(lay.len[0][0], 3);
    ck_assert_int_eq(lay.off[0][1], 3);
    ck_assert_int_eq(lay.len[0][1], 2);
    ck_assert_int_eq(lay.attn_len[0], 4);
    ck_assert_int_eq(lay.attn_len[2], 3);

    dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 1};
    dit_backend *be = NULL;
    dit_arena *arena = NULL;
    ck_assert_int_eq(dit_backend_create(&bc, &be, NULL), DIT_OK);
    ck_assert_int_eq(dit_arena_create(be, 0, &arena), DIT_OK);
    dit_named_tensors local;
    ck_assert_int_eq(dit_cp_plan_scatter(c->cp_plan, c->n_cp, &lay, be, arena, &in, &local, NULL),
                     DIT_OK);
    const dit_tensor *lh = dit_named_tensors_get(&local, "hidden_states");
    ck_assert_int_eq(lh->ne[1], 2);
    /* batch 1, token 3 (this rank's first), channel 0 */
    ck_assert(((const float *)lh->data)[2 * 4] == hs[(7 + 3) * 4]);
    const dit_tensor *li = dit_named_tensors_get(&local, "img_ids");
    ck_assert(((const float *)li->data)[0] == 9.0f); /* row 3 of the ids, host view */
    /* An input no rule names is refused. */
    x = dit_tensor_make(t, DIT_F32, 1, s_t);
    dit_named_tensors_set(&in, "not_an_input", &x);
    dit_arena_reset(arena);
    ck_assert_int_eq(dit_cp_plan_scatter(c->cp_plan, c->n_cp, &lay, be, arena, &in, &local, NULL),
                     DIT_ERR_INVALID_ARG);
    dit_arena_destroy(arena);
    dit_backend_destroy(be);
}
END_TEST

/* Wan's plan: the video tokens are a sequence the model forms (TOKENS),
 * with the class's lengths and finish; their layout is tensor_split's. */
START_TEST(wan_plan_splits_its_own_tokens)
{
    const dit_model_class *c = &dit_wan_model_class;
    const dit_cp_rule *o = dit_cp_plan_output(c->cp_plan, c->n_cp);
    ck_assert_ptr_nonnull(o);
    ck_assert_int_eq(o->dim, 1);
    int tokens = 0;
    for (int i = 0; i < c->n_cp; i++)
        tokens += c->cp_plan[i].kind == DIT_CP_TOKENS;
    ck_assert_int_eq(tokens, 1);
    ck_assert(c->seq_lens && c->gathered_shape && c->cp_finish);
    ck_assert_ptr_null(dit_flux_model_class.seq_lens);
    dit_cp_layout lay;
    const int64_t lens[1] = {45};
    ck_assert_int_eq(dit_cp_layout_from_lengths(1, lens, 4, 3, &lay, NULL), DIT_OK);
    /* torch.arange(45).tensor_split(4) -> 12, 11, 11, 11 */
    ck_assert_int_eq(lay.len[0][0], 12);
    ck_assert_int_eq(lay.off[0][1], 12);
    ck_assert_int_eq(lay.off[0][3], 34);
    ck_assert_int_eq(lay.attn_len[3], 11);
    ck_assert_int_eq(dit_cp_layout_from_lengths(1, lens, 4, 4, &lay, NULL), DIT_ERR_INTERNAL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("plans");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, registry_finds_flux_by_class_name);
    tcase_add_test(tc, tp_patterns_match_one_component_per_star);
    tcase_add_test(tc, flux_tp_plan_gives_diffusers_styles);
    tcase_add_test(tc, cp_plan_splits_like_tensor_split);
    tcase_add_test(tc, wan_plan_splits_its_own_tokens);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
