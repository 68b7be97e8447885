/* Tensor views (up to 5 dims), dtype conversions (FP8 E4M3 included), the
 * arena and the status/diag helpers. */
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
    ck_assert_uint_eq(dit_f32_to_f16(65520.0f), 0x7c00);              /* overflows to inf */
    ck_assert_uint_eq(dit_f32_to_f16(5.9604645e-08f), 0x0001);        /* smallest subnormal */
    ck_assert_uint_eq(dit_f32_to_f16(6.097555e-05f), 0x03ff);         /* largest subnormal */
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
    dit_tensor wide = dit_tensor_make(NULL, DIT_F8_E4M3, 5, big);
    char w[128];
    dit_tensor_shape_str(&wide, w, sizeof w);
    ck_assert_str_eq(w, "(9223372036854775807, 9223372036854775807, 9223372036854775807, "
                        "9223372036854775807, 9223372036854775807) f8_e4m3");
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

/* The E4M3 value of bit pattern b from its definition, in double:
 * (-1)^s 2^(e-7) (1 + m/8) for e > 0, (-1)^s 2^-6 (m/8) for e == 0;
 * S.1111.111 is NaN. */
static double e4m3_reference(unsigned b, bool *is_nan)
{
    unsigned s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    *is_nan = e == 15 && m == 7;
    double mag = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, (int)e - 7);
    return s ? -mag : mag;
}

START_TEST(f8e4m3_every_pattern_to_f32)
{
    for (unsigned b = 0; b < 256; b++) {
        bool nan;
        double want = e4m3_reference(b, &nan);
        float got = dit_f8e4m3_to_f32((uint8_t)b);
        if (nan) {
            ck_assert_msg(isnan(got), "0x%02x", b);
            uint32_t u;
            memcpy(&u, &got, sizeof u);
            ck_assert_uint_eq(u, (b & 0x80 ? 0x80000000u : 0) | 0x7ff00000u);
            continue;
        }
        ck_assert_msg((double)got == want, "0x%02x: %.9g, want %.9g", b, (double)got, want);
        ck_assert_int_eq(signbit(got) != 0, (b & 0x80) != 0); /* -0 stays -0 */
    }
    /* Landmarks of the format. */
    ck_assert_float_eq(dit_f8e4m3_to_f32(0x38), 1.0f);
    ck_assert_float_eq(dit_f8e4m3_to_f32(0x7e), 448.0f);
    ck_assert_float_eq(dit_f8e4m3_to_f32(0xfe), -448.0f);
    ck_assert_float_eq(dit_f8e4m3_to_f32(0x08), 0x1p-6f);   /* smallest normal */
    ck_assert_float_eq(dit_f8e4m3_to_f32(0x07), 0x1.cp-7f); /* largest subnormal */
    ck_assert_float_eq(dit_f8e4m3_to_f32(0x01), 0x1p-9f);   /* smallest subnormal */
    ck_assert_float_eq(dit_f8e4m3_to_f32(0x78), 256.0f);    /* 0x78: exponent 15 is finite */
    ck_assert_uint_eq(dit_dtype_size(DIT_F8_E4M3), 1);
    ck_assert_str_eq(dit_dtype_name(DIT_F8_E4M3), "f8_e4m3");
}
END_TEST

/* Nearest E4M3 pattern to x by search over every finite value, ties to the
 * even pattern; magnitudes above 464 (the midpoint past 448) give NaN. */
static uint8_t e4m3_nearest(float x)
{
    if (isnan(x))
        return signbit(x) ? 0xff : 0x7f;
    uint8_t sign = signbit(x) ? 0x80 : 0;
    double a = fabs((double)x);
    if (a > 464.0)
        return sign | 0x7f;
    unsigned best = 0;
    double best_err = INFINITY;
    for (unsigned b = 0; b < 0x7f; b++) {
        bool nan;
        double err = fabs(e4m3_reference(b, &nan) - a);
        if (err < best_err || (err == best_err && (b & 1) == 0)) {
            best = b;
            best_err = err;
        }
    }
    return sign | (uint8_t)best;
}

START_TEST(f8e4m3_from_f32_rounds_like_torch)
{
    /* Every value, -0 and both NaNs included, converts back to its own
     * pattern. */
    for (unsigned b = 0; b < 256; b++)
        ck_assert_uint_eq(dit_f32_to_f8e4m3(dit_f8e4m3_to_f32((uint8_t)b)), b);
    /* Midpoints between neighbours go to the even pattern, and one f32 ulp
     * either side goes to the nearer one. */
    for (unsigned b = 0; b < 0x7e; b++) {
        float lo = dit_f8e4m3_to_f32((uint8_t)b), hi = dit_f8e4m3_to_f32((uint8_t)(b + 1));
        float mid = (lo + hi) / 2; /* exact: 4 significant bits */
        uint8_t even = (b & 1) ? (uint8_t)(b + 1) : (uint8_t)b;
        ck_assert_msg(dit_f32_to_f8e4m3(mid) == even, "tie after 0x%02x", b);
        ck_assert_uint_eq(dit_f32_to_f8e4m3(-mid), 0x80 | even);
        ck_assert_uint_eq(dit_f32_to_f8e4m3(nextafterf(mid, 0.0f)), b);
        ck_assert_uint_eq(dit_f32_to_f8e4m3(nextafterf(mid, INFINITY)), b + 1);
    }
    /* Named edge cases. */
    ck_assert_uint_eq(dit_f32_to_f8e4m3(0x1p-10f), 0x00);  /* tie 0 | 2^-9: even */
    ck_assert_uint_eq(dit_f32_to_f8e4m3(0x1.8p-9f), 0x02); /* tie 1 | 2 steps */
    ck_assert_uint_eq(dit_f32_to_f8e4m3(0x1.ep-7f), 0x08); /* 7.5 steps: normal */
    ck_assert_uint_eq(dit_f32_to_f8e4m3(-0x1p-11f), 0x80); /* underflow keeps sign */
    ck_assert_uint_eq(dit_f32_to_f8e4m3(0x1p-149f), 0x00); /* f32 subnormal */
    ck_assert_uint_eq(dit_f32_to_f8e4m3(1.0625f), 0x38);   /* tie 1 | 1.125 */
    ck_assert_uint_eq(dit_f32_to_f8e4m3(1.1875f), 0x3a);   /* tie 1.125 | 1.25 */
    ck_assert_uint_eq(dit_f32_to_f8e4m3(15.5f), 0x58);     /* carry into exponent */
    /* Overflow as torch: 448 stays, 464 ties down to 448, anything larger
     * (and infinity, and NaN) is NaN. */
    ck_assert_uint_eq(dit_f32_to_f8e4m3(448.0f), 0x7e);
    ck_assert_uint_eq(dit_f32_to_f8e4m3(464.0f), 0x7e);
    ck_assert_uint_eq(dit_f32_to_f8e4m3(-464.0f), 0xfe);
    ck_assert_uint_eq(dit_f32_to_f8e4m3(nextafterf(464.0f, INFINITY)), 0x7f);
    ck_assert_uint_eq(dit_f32_to_f8e4m3(479.9f), 0x7f);
    ck_assert_uint_eq(dit_f32_to_f8e4m3(480.0f), 0x7f);
    ck_assert_uint_eq(dit_f32_to_f8e4m3(-1e30f), 0xff);
    ck_assert_uint_eq(dit_f32_to_f8e4m3(INFINITY), 0x7f);
    ck_assert_uint_eq(dit_f32_to_f8e4m3(-INFINITY), 0xff);
    ck_assert_uint_eq(dit_f32_to_f8e4m3(NAN), 0x7f);
    ck_assert_uint_eq(dit_f32_to_f8e4m3(-NAN), 0xff);
    ck_assert(isnan(dit_f8e4m3_to_f32(dit_f32_to_f8e4m3(500.0f))));
    /* Saturation is a clamp away. */
    ck_assert_uint_eq(dit_f32_to_f8e4m3(fminf(1e30f, DIT_F8_E4M3_MAX)), 0x7e);
    /* Pseudo-random f32 values over the whole range against the search. */
    uint32_t x = 12345;
    for (int i = 0; i < 200000; i++) {
        x = x * 1664525u + 1013904223u;
        /* Exponents 2^-14 .. 2^9 cover underflow, subnormals, normals and
         * overflow; the low bits fill the mantissa and sign. */
        uint32_t bits = (x & 0x807fffffu) | ((uint32_t)(113 + (x >> 8) % 24) << 23);
        float f;
        memcpy(&f, &bits, sizeof f);
        ck_assert_msg(dit_f32_to_f8e4m3(f) == e4m3_nearest(f), "%a", (double)f);
    }
}
END_TEST

START_TEST(convert_scaled_rounds_once)
{
    uint8_t q[256];
    for (int i = 0; i < 256; i++)
        q[i] = (uint8_t)i;
    float plain[256], scaled[256], via[256];
    dit_convert_to_f32(plain, q, DIT_F8_E4M3, 256);
    /* Scale 1 is the plain conversion, bit for bit (NaN included). */
    dit_convert_scaled(scaled, DIT_F32, q, DIT_F8_E4M3, 256, 1.0f);
    ck_assert_int_eq(memcmp(plain, scaled, sizeof plain), 0);
    /* f32 product, then one rounding to bf16. */
    const float s = 0.0123f;
    uint16_t bf[256];
    dit_convert_scaled(bf, DIT_BF16, q, DIT_F8_E4M3, 256, s);
    for (int i = 0; i < 256; i++) {
        float want = plain[i] * s;
        if (isnan(want)) {
            ck_assert(isnan(dit_bf16_to_f32(bf[i])));
            continue;
        }
        ck_assert_uint_eq(bf[i], dit_f32_to_bf16(want));
    }
    /* Between two non-f32 dtypes with a block boundary inside (300 > 256). */
    uint16_t h[300];
    for (int i = 0; i < 300; i++)
        h[i] = dit_f32_to_f16((float)i);
    dit_convert_scaled(via, DIT_F32, h, DIT_F16, 256, 2.0f);
    uint8_t q2[300];
    dit_convert_scaled(q2, DIT_F8_E4M3, h, DIT_F16, 300, 0.5f);
    for (int i = 0; i < 256; i++)
        ck_assert_float_eq(via[i], 2.0f * (float)i);
    for (int i = 0; i < 300; i++)
        ck_assert_uint_eq(q2[i], dit_f32_to_f8e4m3(0.5f * (float)i));
    /* to/from f32 of f8 through the generic converters. */
    uint8_t q3[256];
    dit_convert_from_f32(q3, DIT_F8_E4M3, plain, 256);
    ck_assert_int_eq(memcmp(q3, q, 256), 0);
}
END_TEST

START_TEST(cpu_upload_converts_f8)
{
    dit_backend *be;
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = 1};
    ck_assert_int_eq(dit_backend_create(&cfg, &be, NULL), DIT_OK);
    uint8_t q[16 * 16];
    for (int i = 0; i < 256; i++)
        q[i] = (uint8_t)i;
    dit_tensor tq = dit_tensor_2d(q, DIT_F8_E4M3, 16, 16);
    float f[256];
    uint16_t b[256];
    dit_tensor tf = dit_tensor_2d(f, DIT_F32, 16, 16), tb = dit_tensor_2d(b, DIT_BF16, 16, 16);
    ck_assert_int_eq(be->ops->upload(be, &tf, &tq), DIT_OK);
    ck_assert_int_eq(be->ops->copy(be, &tb, &tq), DIT_OK);
    for (int i = 0; i < 256; i++) {
        bool nan;
        double want = e4m3_reference((unsigned)i, &nan);
        if (nan) {
            ck_assert(isnan(f[i]) && isnan(dit_bf16_to_f32(b[i])));
            continue;
        }
        ck_assert((double)f[i] == want);
        ck_assert((double)dit_bf16_to_f32(b[i]) == want); /* exact in bf16 */
    }
    /* f32 back to f8 through the backend's copy. */
    uint8_t r[256];
    dit_tensor tr = dit_tensor_2d(r, DIT_F8_E4M3, 16, 16);
    ck_assert_int_eq(be->ops->copy(be, &tr, &tf), DIT_OK);
    ck_assert_int_eq(memcmp(r, q, sizeof q), 0);
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
    tcase_add_test(tc, f8e4m3_every_pattern_to_f32);
    tcase_add_test(tc, f8e4m3_from_f32_rounds_like_torch);
    tcase_add_test(tc, convert_scaled_rounds_once);
    tcase_add_test(tc, cpu_upload_converts_f8);
    tcase_add_test(tc, arena_reuses_addresses_after_reset);
    tcase_add_test(tc, diag_keeps_first_cause_and_prefixes);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
