/* The served model's description (daemon/model_info.c): config values,
 * the layout's token rule, and the num_frames / fps rules per task. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "model_info.h"

static int64_t config_of(const dit_model_info *m, const char *key)
{
    for (int i = 0; i < m->n_config; i++)
        if (strcmp(m->config[i].key, key) == 0)
            return m->config[i].value;
    return -1;
}

/* An image model as ditd describes FLUX (ditd.c), by hand. */
static dit_model_info image_model(void)
{
    dit_model_info m = {0};
    m.pipeline_class = "FluxPipeline";
    m.transformer_class = "FluxTransformer2DModel";
    m.task = DIT_TASK_TEXT_TO_IMAGE;
    m.default_num_frames = 1;
    return m;
}

START_TEST(config_values_keep_their_order_and_bound)
{
    dit_model_info m = image_model();
    ck_assert(dit_model_info_add_config(&m, "joint_attention_dim", 32));
    ck_assert(dit_model_info_add_config(&m, "guidance_embeds", 1));
    ck_assert_int_eq(config_of(&m, "joint_attention_dim"), 32);
    ck_assert_int_eq(config_of(&m, "guidance_embeds"), 1);
    ck_assert_str_eq(m.config[0].key, "joint_attention_dim");
    for (int i = 2; i < DIT_MODEL_MAX_CONFIG; i++)
        ck_assert(dit_model_info_add_config(&m, "k", i));
    ck_assert(!dit_model_info_add_config(&m, "one_too_many", 0));
    ck_assert_int_eq(m.n_config, DIT_MODEL_MAX_CONFIG);
}
END_TEST

START_TEST(token_divisor_follows_the_layout)
{
    dit_model_info m = image_model();
    dit_parallel_config pc = dit_parallel_config_single();
    dit_model_info_set_layout(&m, &pc);
    ck_assert_int_eq(m.token_divisor, 1);
    pc.world_size = 4;
    pc.ring_degree = 2;
    pc.ulysses_degree = 2;
    dit_model_info_set_layout(&m, &pc);
    ck_assert_int_eq(m.token_divisor, 4);
    pc.ring_anything = true;
    dit_model_info_set_layout(&m, &pc);
    ck_assert_int_eq(m.token_divisor, 1); /* uneven chunks allowed */
    pc = dit_parallel_config_single();
    pc.world_size = 2;
    pc.tp_degree = 2;
    dit_model_info_set_layout(&m, &pc);
    ck_assert_int_eq(m.token_divisor, 1); /* TP does not split tokens */
}
END_TEST

START_TEST(images_take_one_frame_and_no_rate)
{
    const dit_model_info m = image_model();
    dit_diag d;
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_model_info_check_frames(&m, 0, 0, &d), DIT_OK);
    ck_assert_int_eq(dit_model_info_check_frames(&m, 1, 0, &d), DIT_OK);
    ck_assert_int_eq(dit_model_info_check_frames(&m, 2, 0, &d), DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(d.msg, "num_frames 2") && strstr(d.msg, "FluxPipeline makes images"), "%s",
                  d.msg);
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_model_info_check_frames(&m, -1, 0, &d), DIT_ERR_INVALID_ARG);
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_model_info_check_frames(&m, 1, 24, &d), DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(d.msg, "fps 24"), "%s", d.msg);
}
END_TEST

START_TEST(video_frames_follow_the_frame_step)
{
    dit_model_info m = {0};
    m.pipeline_class = "WanPipeline";
    m.task = DIT_TASK_TEXT_TO_VIDEO;
    m.default_num_frames = 81;
    m.default_fps = 16;
    m.frame_step = 4;
    dit_diag d;
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_model_info_check_frames(&m, 0, 0, &d), DIT_OK);
    ck_assert_int_eq(dit_model_info_check_frames(&m, 81, 24, &d), DIT_OK);
    ck_assert_int_eq(dit_model_info_check_frames(&m, 1, 16, &d), DIT_OK);
    ck_assert_int_eq(dit_model_info_check_frames(&m, 80, 16, &d), DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(d.msg, "num_frames 80") && strstr(d.msg, "4 x k + 1"), "%s", d.msg);
    dit_diag_clear(&d);
    ck_assert_int_eq(dit_model_info_check_frames(&m, 81, -1, &d), DIT_ERR_INVALID_ARG);
    ck_assert_str_eq(dit_task_name(m.task), "text-to-video");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("daemon_model_info");
    TCase *tc = tcase_create("describe");
    tcase_add_test(tc, config_values_keep_their_order_and_bound);
    tcase_add_test(tc, token_divisor_follows_the_layout);
    tcase_add_test(tc, images_take_one_frame_and_no_rate);
    tcase_add_test(tc, video_frames_follow_the_frame_step);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
