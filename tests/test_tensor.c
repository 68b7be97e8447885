/* Tensor views, dtype conversions, the arena and the status/diag helpers. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/arena.h"
#include "core/status.h"
#include "core/tensor.h"

START_TEST(bf16_rounds_to_nearest_even)
{
    /* Values and their bf16 bit patterns as torch.tensor(x).bfloat16() gives. */
    ck_assert_uint_eq(dit_f32_to_bf16(1.0f), 0x3f80);
    ck_assert_uint_eq(dit_f32_to_bf16(-2.5f), 0xc020);
    ck_assert_uint_eq(dit_f32_to_bf16(3.14159265f), 0x4049);
    ck_assert_uint_eq(dit_f32_to_bf16(1.00390625f), 0x3f80); /* tie: rounds to even */
    ck_assert_uint_eq(dit_f32_to_bf16(1.01171875f), 0x3f82); /* tie: rounds up to even */
    ck_assert_uint_eq(dit_f32_to_bf16(INFINITY), 0x7f80);
    ck_assert(isnan(dit_bf16_to_f32(dit_f32_to_bf16(NAN))));
    for (int i = -128; i <= 128; i++) { /* 8 significant bits: exact in bf16 */
        float f = (float)i * 0.25f;
        ck_assert_float_eq(dit_bf16_to_f32(dit_f32_to_bf16(f)), f);
    }
}
END_TEST

START_TEST(f16_round_trips_and_rounds)
{
    ck_assert_uint_eq(dit_f32_to_f16(1.0f), 0x3c00);
    ck_assert_uint_eq(dit_f32_to_f16(-2.0f), 0xc000);
    ck_assert_uint_eq(dit_f32_to_f16(65504.0f), 0x7bff);
    ck_assert_uint_eq(dit_f32_to_f16(65520.0f), 0x7c00); /* overflows to inf */
    ck_assert_uint_eq(dit_f32_to_f16(5.9604645e-08f), 0x0001); /* smallest subnormal */
    ck_assert_uint_eq(dit_f32_to_f16(6.097555e-05f), 0x03ff);  /* largest subnormal */
    ck_assert_uint_eq(dit_f32_to_f16(1.0f + 1.0f / 2048.0f), 0x3c00); /* tie to even */
    ck_assert_float_eq(dit_f16_to_f32(0x0001), 5.9604645e-08f);
    ck_assert_float_eq(dit_f16_to_f32(0x7bff), 65504.0f);
    ck_assert(isinf(dit_f16_to_f32(0x7c00)));
    ck_assert(isnan(dit_f16_to_f32(0x7e00)));
    /* Every finite half converts to f32 and back unchanged. */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00)
            continue;
        ck_assert_uint_eq(dit_f32_to_f16(dit_f16_to_f32((uint16_t)h)), h);
    }
}
END_TEST

START_TEST(views_narrow_and_split)
{
    float buf[2 * 3 * 8];
    for (int i = 0; i < 48; i++)
        buf[i] = (float)i;
    dit_tensor t = dit_tensor_3d(buf, DIT_F32, 2, 3, 8);
    ck_assert(dit_tensor_is_contiguous(&t));
    ck_assert_int_eq(dit_tensor_numel(&t), 48);
    dit_tensor cols = dit_tensor_narrow(&t, 2, 4, 4);
    ck_assert(!dit_tensor_is_contiguous(&cols));
    ck_assert(dit_tensor_rows_dense(&cols));
    dit_tensor heads = dit_tensor_split_last(&cols, 2); /* (2, 3, 2, 2) */
    ck_assert_int_eq(heads.ndim, 4);
    ck_assert_int_eq(heads.ne[2], 2);
    ck_assert_int_eq(heads.nb[2], 8);
    const float *p = (const float *)((const char *)heads.data + 1 * heads.nb[0] + 2 * heads.nb[1] +
                                     1 * heads.nb[2] + 1 * heads.nb[3]);
    ck_assert_float_eq(*p, (float)(1 * 24 + 2 * 8 + 4 + 2 + 1));
    char s[64];
    dit_tensor_shape_str(&heads, s, sizeof s);
    ck_assert_str_eq(s, "(2, 3, 2, 2) f32");
}
END_TEST

START_TEST(row_stride_only_for_evenly_spaced_rows)
{
    float buf[2 * 3 * 24];
    dit_tensor t = dit_tensor_3d(buf, DIT_F32, 2, 3, 24);
    ck_assert_int_eq(dit_tensor_row_stride(&t), 24 * 4);
    /* A column slice keeps the parent's row spacing. */
    dit_tensor cols = dit_tensor_narrow(&t, 2, 8, 8);
    ck_assert_int_eq(dit_tensor_row_stride(&cols), 24 * 4);
    /* Heads of a fused projection: (2, 3, 2, 4) from columns [8, 16) of
     * rows of 24 — rows (b, s, h) step by 16 bytes within a token, 96
     * between tokens: not evenly spaced. */
    dit_tensor heads = dit_tensor_split_last(&cols, 4);
    ck_assert_int_eq(dit_tensor_row_stride(&heads), -1);
    /* The same split of a whole contiguous tensor is evenly spaced. */
    dit_tensor all_heads = dit_tensor_split_last(&t, 4);
    ck_assert_int_eq(dit_tensor_row_stride(&all_heads), 16);
    /* A sequence slice of one batch entry, and of two. */
    dit_tensor one = dit_tensor_narrow(&t, 0, 1, 1);
    one = dit_tensor_narrow(&one, 1, 1, 2);
    ck_assert_int_eq(dit_tensor_row_stride(&one), 24 * 4);
    dit_tensor two = dit_tensor_narrow(&t, 1, 1, 2);
    ck_assert_int_eq(dit_tensor_row_stride(&two), -1);
    /* One row, and size-1 dims anywhere. */
    dit_tensor row = dit_tensor_narrow(&one, 1, 0, 1);
    ck_assert_int_eq(dit_tensor_row_stride(&row), 0);
    dit_tensor v = dit_tensor_1d(buf, DIT_F32, 7);
    ck_assert_int_eq(dit_tensor_row_stride(&v), 0);
    dit_tensor s1 = dit_tensor_narrow(&t, 1, 2, 1); /* (2, 1, 24) */
    ck_assert_int_eq(dit_tensor_row_stride(&s1), 3 * 24 * 4);
}
END_TEST

START_TEST(arena_reuses_addresses_after_reset)
{
    dit_backend *be;
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = 1};
    ck_assert_int_eq(dit_backend_create(&cfg, &be, NULL), DIT_OK);
    dit_arena *a;
    ck_assert_int_eq(dit_arena_create(be, 0, &a), DIT_OK);
    dit_tensor t1[3], t2[3];
    const int64_t shapes[3][2] = {{100, 1000}, {3000, 1000}, {7, 9}};
    /* First pass grows through several blocks. */
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(dit_arena_tensor(a, DIT_F32, 2, shapes[i], &t1[i]), DIT_OK);
        ck_assert_uint_eq((uintptr_t)t1[i].data % 64, 0);
        memset(t1[i].data, 0xab, dit_tensor_nbytes(&t1[i]));
    }
    size_t hw = dit_arena_high_water(a);
    ck_assert_uint_ge(hw, (100 * 1000 + 3000 * 1000 + 63) * 4);
    dit_arena_reset(a);
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(dit_arena_tensor(a, DIT_F32, 2, shapes[i], &t2[i]), DIT_OK);
    dit_arena_reset(a);
    /* Same sequence again: same addresses, no growth. */
    for (int i = 0; i < 3; i++) {
        dit_tensor t3;
        ck_assert_int_eq(dit_arena_tensor(a, DIT_F32, 2, shapes[i], &t3), DIT_OK);
        ck_assert_ptr_eq(t3.data, t2[i].data);
    }
    ck_assert_uint_eq(dit_arena_high_water(a), hw);
    dit_arena_destroy(a);
    dit_backend_destroy(be);
}
END_TEST

START_TEST(diag_keeps_first_cause_and_prefixes)
{
    dit_diag d;
    dit_diag_clear(&d);
    ck_assert_str_eq(dit_diag_msg(&d), "ok");
    ck_assert_int_eq(dit_diag_set(&d, DIT_ERR_FORMAT, "%s: bad header", "a.safetensors"),
                     DIT_ERR_FORMAT);
    dit_diag_set(&d, DIT_ERR_IO, "outer message");
    ck_assert_str_eq(dit_diag_msg(&d), "a.safetensors: bad header");
    dit_diag_prefix(&d, "loading %s: ", "transformer");
    ck_assert_str_eq(dit_diag_msg(&d), "loading transformer: a.safetensors: bad header");
    ck_assert_int_eq(dit_diag_set(NULL, DIT_ERR_IO, "dropped"), DIT_ERR_IO);
    ck_assert_str_eq(dit_status_name(DIT_ERR_TIMEOUT), "DIT_ERR_TIMEOUT");
    ck_assert_str_eq(dit_status_str(DIT_STATUS_COUNT), "unknown status");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("tensor");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, bf16_rounds_to_nearest_even);
    tcase_add_test(tc, f16_round_trips_and_rounds);
    tcase_add_test(tc, views_narrow_and_split);
    tcase_add_test(tc, row_stride_only_for_evenly_spaced_rows);
    tcase_add_test(tc, arena_reuses_addresses_after_reset);
    tcase_add_test(tc, diag_keeps_first_cause_and_prefixes);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
