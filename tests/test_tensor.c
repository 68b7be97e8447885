/* Tensor views (up to 5 dims), dtype conversions, the arena and the
 * status/diag helpers. */
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

START_TEST(views_of_five_dims)
{
    /* A video latent (B, C, F, H, W) = (2, 3, 4, 5, 6), element i = i. */
    enum { N = 2 * 3 * 4 * 5 * 6 };
    float buf[N];
    for (int i = 0; i < N; i++)
        buf[i] = (float)i;
    dit_tensor t = dit_tensor_5d(buf, DIT_F32, 2, 3, 4, 5, 6);
    ck_assert_int_eq(t.ndim, 5);
    ck_assert_int_eq(t.nb[0], 3 * 4 * 5 * 6 * 4);
    ck_assert_int_eq(t.nb[4], 4);
    ck_assert_int_eq(dit_tensor_numel(&t), N);
    ck_assert_uint_eq(dit_tensor_nbytes(&t), sizeof buf);
    ck_assert(dit_tensor_is_contiguous(&t));
    ck_assert(dit_tensor_rows_dense(&t));
    ck_assert_int_eq(dit_tensor_row_stride(&t), 6 * 4);
    ck_assert_int_eq(dit_tensor_nrows(&t), 2 * 3 * 4 * 5);
    char s[96];
    dit_tensor_shape_str(&t, s, sizeof s);
    ck_assert_str_eq(s, "(2, 3, 4, 5, 6) f32");
    /* Frames [1, 3): no longer contiguous, rows still dense but unevenly
     * spaced (a jump between channels). */
    dit_tensor fr = dit_tensor_narrow(&t, 2, 1, 2);
    ck_assert(!dit_tensor_is_contiguous(&fr));
    ck_assert(dit_tensor_rows_dense(&fr));
    ck_assert_int_eq(dit_tensor_row_stride(&fr), -1);
    ck_assert_int_eq(dit_tensor_nrows(&fr), 2 * 3 * 2 * 5);
    /* Row r of the view starts at element (b, c, 1 + f, h, 0). */
    for (int64_t r = 0; r < dit_tensor_nrows(&fr); r++) {
        int64_t h = r % 5, f = (r / 5) % 2, c = (r / 10) % 3, b = r / 30;
        const float *p = (const float *)((const char *)fr.data + dit_tensor_row_offset(&fr, r));
        ck_assert_float_eq(*p, (float)((((b * 3 + c) * 4 + 1 + f) * 5 + h) * 6));
    }
    /* One batch entry and one channel: evenly spaced again. */
    dit_tensor one = dit_tensor_narrow(&t, 0, 1, 1);
    one = dit_tensor_narrow(&one, 1, 2, 1);
    ck_assert_int_eq(dit_tensor_row_stride(&one), 6 * 4);
    /* A column slice: dense rows, not contiguous. */
    dit_tensor cols = dit_tensor_narrow(&t, 4, 2, 4);
    ck_assert(dit_tensor_rows_dense(&cols));
    ck_assert(!dit_tensor_is_contiguous(&cols));
    dit_tensor_shape_str(&cols, s, sizeof s);
    ck_assert_str_eq(s, "(2, 3, 4, 5, 4) f32");
    /* (B, C, F, H*W) split into (B, C, F, H, W). */
    dit_tensor flat = dit_tensor_4d(buf, DIT_F32, 2, 3, 4, 30);
    dit_tensor split = dit_tensor_split_last(&flat, 6);
    ck_assert(dit_tensor_same_shape(&split, &t));
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(split.nb[i], t.nb[i]);
    /* Widest shape string: five 19-digit dims fit a 128-byte buffer. */
    int64_t big[5] = {INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX, INT64_MAX};
    dit_tensor wide = dit_tensor_make(NULL, DIT_BF16, 5, big);
    char w[128];
    dit_tensor_shape_str(&wide, w, sizeof w);
    ck_assert_str_eq(w, "(9223372036854775807, 9223372036854775807, 9223372036854775807, "
                        "9223372036854775807, 9223372036854775807) bf16");
    /* A short buffer truncates and stays terminated. */
    dit_tensor_shape_str(&t, s, 8);
    ck_assert_str_eq(s, "(2, 3, ");
}
END_TEST

START_TEST(cpu_copy_converts_five_dims)
{
    dit_backend *be;
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&cfg, &be, NULL), DIT_OK);
    /* bf16 source (2, 3, 4, 5, 6), values exact in bf16. */
    enum { N = 2 * 3 * 4 * 5 * 6 };
    uint16_t src[N];
    for (int i = 0; i < N; i++)
        src[i] = dit_f32_to_bf16((float)(i % 251) - 125.0f);
    dit_tensor ts = dit_tensor_5d(src, DIT_BF16, 2, 3, 4, 5, 6);
    /* Channels [1, 3), frames [2, 4), columns 1, 3, 5 (a strided inner dim)
     * into a contiguous f32 (2, 2, 2, 5, 3). */
    dit_tensor v = dit_tensor_narrow(&ts, 1, 1, 2);
    v = dit_tensor_narrow(&v, 2, 2, 2);
    v = dit_tensor_narrow(&v, 4, 1, 5);
    v.ne[4] = 3;
    v.nb[4] *= 2;
    float dst[2 * 2 * 2 * 5 * 3];
    dit_tensor td = dit_tensor_5d(dst, DIT_F32, 2, 2, 2, 5, 3);
    ck_assert_int_eq(be->ops->copy(be, &td, &v), DIT_OK);
    int k = 0;
    for (int b = 0; b < 2; b++)
        for (int c = 0; c < 2; c++)
            for (int f = 0; f < 2; f++)
                for (int h = 0; h < 5; h++)
                    for (int w = 0; w < 3; w++) {
                        int i = (((b * 3 + 1 + c) * 4 + 2 + f) * 5 + h) * 6 + 1 + 2 * w;
                        ck_assert_float_eq(dst[k++], (float)(i % 251) - 125.0f);
                    }
    /* And back into a bf16 5-D view through upload (f32 -> bf16), then a
     * fill of the same view. */
    uint16_t back[N];
    memset(back, 0, sizeof back);
    dit_tensor tb = dit_tensor_5d(back, DIT_BF16, 2, 3, 4, 5, 6);
    dit_tensor vb = dit_tensor_narrow(&tb, 1, 1, 2);
    vb = dit_tensor_narrow(&vb, 2, 2, 2);
    vb = dit_tensor_narrow(&vb, 4, 1, 5);
    vb.ne[4] = 3;
    vb.nb[4] *= 2;
    ck_assert_int_eq(be->ops->upload(be, &vb, &td), DIT_OK);
    for (int i = 0; i < N; i++) {
        int w = i % 6, f = (i / 30) % 4, c = (i / 120) % 3;
        bool in = c >= 1 && f >= 2 && (w & 1);
        ck_assert_uint_eq(back[i], in ? src[i] : 0);
    }
    float ones[N];
    memset(ones, 0, sizeof ones);
    dit_tensor to = dit_tensor_5d(ones, DIT_F32, 2, 3, 4, 5, 6);
    dit_tensor vo = dit_tensor_narrow(&to, 3, 1, 3);
    ck_assert_int_eq(be->ops->fill(be, &vo, 1.0f), DIT_OK);
    for (int i = 0; i < N; i++) {
        int h = (i / 6) % 5;
        ck_assert_float_eq(ones[i], h >= 1 && h < 4 ? 1.0f : 0.0f);
    }
    /* Shapes must still match. */
    dit_tensor t4 = dit_tensor_4d(dst, DIT_F32, 2, 2, 10, 3);
    ck_assert_int_eq(be->ops->copy(be, &t4, &v), DIT_ERR_INVALID_ARG);
    dit_backend_destroy(be);
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
    tcase_add_test(tc, views_of_five_dims);
    tcase_add_test(tc, cpu_copy_converts_five_dims);
    tcase_add_test(tc, arena_reuses_addresses_after_reset);
    tcase_add_test(tc, diag_keeps_first_cause_and_prefixes);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
