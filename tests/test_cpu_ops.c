/* cpu backend ops against naive double-precision references. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_math.h"
#include "test_util.h"

static dit_backend *be;

static void setup(void)
{
    dit_backend_config cfg = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    ck_assert_int_eq(dit_backend_create(&cfg, &be, NULL), DIT_OK);
}

static void teardown(void)
{
    dit_backend_destroy(be);
    be = NULL;
}

static double gelu_ref(double x)
{
    return 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

static double silu_ref(double x)
{
    return x / (1.0 + exp(-x));
}

START_TEST(expf_matches_libm)
{
    double worst = 0;
    for (int i = 0; i <= 200000; i++) {
        float x = -87.0f + 175.0f * (float)i / 200000.0f;
        double want = exp((double)x);
        double rel = fabs(dit_expf(x) - want) / want;
        worst = rel > worst ? rel : worst;
    }
    ck_assert_msg(worst < 4e-7, "dit_expf worst relative error %g", worst);
    ck_assert_float_eq(dit_expf(-100.0f), 0.0f);
    ck_assert(isinf(dit_expf(100.0f)));
    ck_assert_float_eq(dit_expf(0.0f), 1.0f);
}
END_TEST

START_TEST(gelu_and_silu_match_reference)
{
    enum { N = 4001 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    double *want = malloc(N * sizeof *want);
    for (int i = 0; i < N; i++)
        x[i] = -12.0f + 24.0f * (float)i / (N - 1);
    dit_tensor tx = dit_tensor_1d(x, DIT_F32, N), ty = dit_tensor_1d(y, DIT_F32, N);

    ck_assert_int_eq(be->ops->activate(be, &ty, &tx, DIT_ACT_GELU_TANH), DIT_OK);
    for (int i = 0; i < N; i++)
        want[i] = gelu_ref(x[i]);
    ck_assert_uint_eq(test_compare("gelu", y, want, N, 1e-7, 1e-6), 0);

    ck_assert_int_eq(be->ops->activate(be, &ty, &tx, DIT_ACT_SILU), DIT_OK);
    for (int i = 0; i < N; i++)
        want[i] = silu_ref(x[i]);
    ck_assert_uint_eq(test_compare("silu", y, want, N, 1e-7, 1e-6), 0);
    free(x);
    free(y);
    free(want);
}
END_TEST

/* y (B, M, N) as a view with row stride ldy inside a bigger buffer. */
static void check_linear(int64_t B, int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldy,
                         int64_t gap, bool bias, dit_act act, float beta)
{
    test_rng rng = {(uint64_t)(B * 1000003 + M * 1009 + N * 31 + K)};
    size_t xs = (size_t)(B * (M * ldx + gap)), ys = (size_t)(B * (M * ldy + gap));
    float *x = malloc(xs * sizeof *x), *w = malloc((size_t)(N * K) * sizeof *w);
    float *b = malloc((size_t)N * sizeof *b), *y = malloc(ys * sizeof *y);
    double *want = malloc((size_t)(B * M * N) * sizeof *want);
    float *got = malloc((size_t)(B * M * N) * sizeof *got);
    test_fill(&rng, x, xs, -1, 1);
    test_fill(&rng, w, (size_t)(N * K), -0.5f, 0.5f);
    test_fill(&rng, b, (size_t)N, -1, 1);
    test_fill(&rng, y, ys, -1, 1);

    dit_tensor tx = {.dtype = DIT_F32, .ndim = 3, .data = x};
    tx.ne[0] = B, tx.ne[1] = M, tx.ne[2] = K;
    tx.nb[2] = 4, tx.nb[1] = ldx * 4, tx.nb[0] = (M * ldx + gap) * 4;
    dit_tensor ty = tx;
    ty.data = y;
    ty.ne[2] = N;
    ty.nb[1] = ldy * 4, ty.nb[0] = (M * ldy + gap) * 4;
    dit_tensor tw = dit_tensor_2d(w, DIT_F32, N, K), tb = dit_tensor_1d(b, DIT_F32, N);

    for (int64_t bi = 0; bi < B; bi++)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) {
                double acc = bias ? b[n] : 0.0;
                for (int64_t k = 0; k < K; k++)
                    acc += (double)x[bi * (M * ldx + gap) + m * ldx + k] * w[n * K + k];
                if (act == DIT_ACT_GELU_TANH)
                    acc = gelu_ref(acc);
                else if (act == DIT_ACT_SILU)
                    acc = silu_ref(acc);
                acc += beta * (double)y[bi * (M * ldy + gap) + m * ldy + n];
                want[(bi * M + m) * N + n] = acc;
            }
    ck_assert_int_eq(be->ops->linear(be, &ty, &tx, &tw, bias ? &tb : NULL, act, beta), DIT_OK);
    for (int64_t bi = 0; bi < B; bi++)
        for (int64_t m = 0; m < M; m++)
            memcpy(got + (bi * M + m) * N, y + bi * (M * ldy + gap) + m * ldy,
                   (size_t)N * sizeof *got);
    ck_assert_uint_eq(test_compare("linear", got, want, (size_t)(B * M * N), 1e-5, 1e-5), 0);
    free(x);
    free(w);
    free(b);
    free(y);
    free(want);
    free(got);
}

START_TEST(linear_matches_reference)
{
    check_linear(1, 7, 5, 3, 3, 5, 0, true, DIT_ACT_NONE, 0.0f);
    check_linear(2, 33, 17, 40, 40, 17, 0, true, DIT_ACT_GELU_TANH, 0.0f);
    check_linear(3, 9, 12, 64, 70, 20, 5, false, DIT_ACT_SILU, 0.0f);   /* strided, gaps */
    check_linear(2, 65, 48, 129, 129, 48, 0, true, DIT_ACT_NONE, 1.0f); /* accumulate */
    check_linear(1, 1, 1, 1, 1, 1, 0, true, DIT_ACT_NONE, 0.0f);
}
END_TEST

/* OpenBLAS's fallback kernels on a CPU with AVX2/AVX-512 are replaced; a
 * core it chose itself, a CPU without AVX2 + FMA, or a name we do not know
 * are left alone. */
START_TEST(blas_core_advice)
{
    ck_assert_str_eq(dit_cpu_blas_core_advice("Prescott", true, true), "SkylakeX");
    ck_assert_str_eq(dit_cpu_blas_core_advice("Prescott", true, false), "Haswell");
    ck_assert_str_eq(dit_cpu_blas_core_advice("nehalem", true, false), "Haswell");
    ck_assert_str_eq(dit_cpu_blas_core_advice("Sandybridge", true, true), "SkylakeX");
    ck_assert_ptr_null(dit_cpu_blas_core_advice("Prescott", false, false));
    ck_assert_ptr_null(dit_cpu_blas_core_advice("Sandybridge", false, false));
    ck_assert_ptr_null(dit_cpu_blas_core_advice("Haswell", true, true));
    ck_assert_ptr_null(dit_cpu_blas_core_advice("Zen", true, true));
    ck_assert_ptr_null(dit_cpu_blas_core_advice("SkylakeX", true, true));
    ck_assert_ptr_null(dit_cpu_blas_core_advice("Cooperlake", true, true));
    ck_assert_ptr_null(dit_cpu_blas_core_advice("SomeFutureCore", true, true));
    ck_assert_ptr_null(dit_cpu_blas_core_advice(NULL, true, true));
}
END_TEST

/* The kernel set a backend gets: the build's own unless a level set above
 * it runs on the CPU; a named set only where the build has it and the CPU
 * reaches its level. */
START_TEST(kernel_sets_pick)
{
    char sets[128];
    dit_cpu_kernels_describe(sets, sizeof sets);
    const bool level_sets = strstr(sets, ", x86-64-v3, x86-64-v4") != NULL;
    const int build = dit_cpu_kernels_build_level();
    ck_assert(build == 0 || build == 3 || build == 4);
    const char *name = NULL;
    dit_diag diag;
    dit_diag_clear(&diag);
    for (int cpu = 0; cpu <= 4; cpu++) {
        ck_assert_int_eq(dit_cpu_kernels_pick(NULL, cpu, &name, &diag), DIT_OK);
        const char *want = "build";
        if (level_sets && cpu >= 4 && build < 4)
            want = "x86-64-v4";
        else if (level_sets && cpu >= 3 && build < 3)
            want = "x86-64-v3";
        ck_assert_str_eq(name, want);
        ck_assert_int_eq(dit_cpu_kernels_pick("auto", cpu, &name, &diag), DIT_OK);
        ck_assert_str_eq(name, want);
        ck_assert_int_eq(dit_cpu_kernels_pick("", cpu, &name, &diag), DIT_OK);
        ck_assert_str_eq(name, want);
    }
    ck_assert_int_eq(dit_cpu_kernels_pick("build", 4, &name, &diag), DIT_OK);
    ck_assert_str_eq(name, "build");
    dit_diag_clear(&diag);
    ck_assert_int_eq(dit_cpu_kernels_pick("avx9", 4, &name, &diag), DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(dit_diag_msg(&diag), "DIT_CPU_KERNELS=avx9"));
    if (level_sets) {
        ck_assert_int_eq(dit_cpu_kernels_pick("x86-64-v3", 3, &name, &diag), DIT_OK);
        ck_assert_str_eq(name, "x86-64-v3");
        ck_assert_int_eq(dit_cpu_kernels_pick("x86-64-v4", 4, &name, &diag), DIT_OK);
        ck_assert_str_eq(name, "x86-64-v4");
        dit_diag_clear(&diag);
        ck_assert_int_eq(dit_cpu_kernels_pick("x86-64-v4", 3, &name, &diag), DIT_ERR_UNSUPPORTED);
        ck_assert_ptr_nonnull(strstr(dit_diag_msg(&diag), "the set needs x86-64-v4"));
        ck_assert_int_eq(dit_cpu_kernels_pick("x86-64-v3", 0, &name, &diag), DIT_ERR_UNSUPPORTED);
    } else {
        ck_assert_int_eq(dit_cpu_kernels_pick("x86-64-v3", 4, &name, &diag), DIT_ERR_INVALID_ARG);
    }
    /* The backend of this test runs the set the environment names (the
     * 'kernels' suite) or the automatic one. */
    const char *env = getenv("DIT_CPU_KERNELS");
    ck_assert_int_eq(dit_cpu_kernels_pick(env, dit_cpu_kernels_cpu_level(), &name, &diag), DIT_OK);
    ck_assert_str_eq(dit_cpu_backend_kernels(be), name);
    if (env && env[0] && strcmp(env, "auto") != 0)
        ck_assert_str_eq(dit_cpu_backend_kernels(be), env);
}
END_TEST

START_TEST(linear_rejects_bad_shapes)
{
    float buf[64] = {0};
    dit_tensor x = dit_tensor_2d(buf, DIT_F32, 2, 4), w = dit_tensor_2d(buf, DIT_F32, 3, 5);
    dit_tensor y = dit_tensor_2d(buf, DIT_F32, 2, 3);
    ck_assert_int_eq(be->ops->linear(be, &y, &x, &w, NULL, DIT_ACT_NONE, 0.0f),
                     DIT_ERR_INVALID_ARG);
    w = dit_tensor_2d(buf, DIT_F32, 3, 4);
    ck_assert_int_eq(be->ops->linear(be, &y, &x, &w, NULL, DIT_ACT_GELU_TANH, 1.0f),
                     DIT_ERR_INVALID_ARG);
    ck_assert_int_eq(be->ops->linear(be, &y, &x, &w, NULL, DIT_ACT_NONE, 0.0f), DIT_OK);
}
END_TEST

START_TEST(layer_norm_mod_matches_reference)
{
    const int64_t B = 2, S = 5, C = 96;
    test_rng rng = {7};
    float *x = malloc(B * S * C * sizeof *x), *y = malloc(B * S * C * sizeof *y);
    float *emb = malloc(B * 3 * C * sizeof *emb);
    double *want = malloc(B * S * C * sizeof *want);
    test_fill(&rng, x, (size_t)(B * S * C), -3, 5); /* mean far from 0 */
    test_fill(&rng, emb, (size_t)(B * 3 * C), -1, 1);
    /* shift and scale are strided views into a (B, 3C) modulation tensor */
    dit_tensor temb = dit_tensor_2d(emb, DIT_F32, B, 3 * C);
    dit_tensor shift = dit_tensor_narrow(&temb, 1, 0, C), scale = dit_tensor_narrow(&temb, 1, C, C);
    for (int64_t r = 0; r < B * S; r++) {
        int64_t b = r / S;
        double mean = 0, var = 0;
        for (int64_t c = 0; c < C; c++)
            mean += x[r * C + c];
        mean /= C;
        for (int64_t c = 0; c < C; c++)
            var += (x[r * C + c] - mean) * (x[r * C + c] - mean);
        var /= C;
        for (int64_t c = 0; c < C; c++)
            want[r * C + c] =
                (x[r * C + c] - mean) / sqrt(var + 1e-6) * (1.0 + emb[b * 3 * C + C + c]) +
                emb[b * 3 * C + c];
    }
    dit_tensor tx = dit_tensor_3d(x, DIT_F32, B, S, C), ty = dit_tensor_3d(y, DIT_F32, B, S, C);
    ck_assert_int_eq(be->ops->layer_norm_mod(be, &ty, &tx, &shift, &scale, 1e-6f), DIT_OK);
    ck_assert_uint_eq(test_compare("layer_norm_mod", y, want, (size_t)(B * S * C), 1e-5, 1e-5), 0);
    /* in place, no modulation */
    for (int64_t r = 0; r < B * S; r++) {
        double mean = 0, var = 0;
        for (int64_t c = 0; c < C; c++)
            mean += x[r * C + c];
        mean /= C;
        for (int64_t c = 0; c < C; c++)
            var += (x[r * C + c] - mean) * (x[r * C + c] - mean);
        var /= C;
        for (int64_t c = 0; c < C; c++)
            want[r * C + c] = (x[r * C + c] - mean) / sqrt(var + 1e-6);
    }
    ck_assert_int_eq(be->ops->layer_norm_mod(be, &tx, &tx, NULL, NULL, 1e-6f), DIT_OK);
    ck_assert_uint_eq(test_compare("layer_norm", x, want, (size_t)(B * S * C), 1e-5, 1e-5), 0);
    free(x);
    free(y);
    free(emb);
    free(want);
}
END_TEST

START_TEST(rms_norm_rope_matches_reference)
{
    const int64_t B = 2, S = 6, H = 3, D = 8, ld = 5 * H * D; /* rows of a fused buffer */
    test_rng rng = {11};
    float *buf = malloc(B * S * ld * sizeof *buf), *w = malloc(D * sizeof *w);
    float *cs = malloc(S * D * sizeof *cs), *sn = malloc(S * D * sizeof *sn);
    double *want = malloc(B * S * H * D * sizeof *want);
    float *got = malloc(B * S * H * D * sizeof *got);
    test_fill(&rng, buf, (size_t)(B * S * ld), -2, 2);
    test_fill(&rng, w, (size_t)D, 0.5f, 1.5f);
    for (int64_t s = 0; s < S; s++)
        for (int64_t i = 0; i < D / 2; i++) {
            double ang = (double)s * pow(10000.0, -2.0 * (double)i / (double)D);
            cs[s * D + 2 * i] = cs[s * D + 2 * i + 1] = (float)cos(ang);
            sn[s * D + 2 * i] = sn[s * D + 2 * i + 1] = (float)sin(ang);
        }
    const int64_t off = H * D; /* the view starts at column H*D of each row */
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < S; s++)
            for (int64_t h = 0; h < H; h++) {
                const float *xr = buf + (b * S + s) * ld + off + h * D;
                double ms = 0;
                for (int64_t d = 0; d < D; d++)
                    ms += (double)xr[d] * xr[d];
                double rinv = 1.0 / sqrt(ms / D + 1e-6);
                double *wr = want + ((b * S + s) * H + h) * D;
                for (int64_t d = 0; d < D; d += 2) {
                    double a = xr[d] * rinv * w[d], c = xr[d + 1] * rinv * w[d + 1];
                    wr[d] = a * cs[s * D + d] - c * sn[s * D + d];
                    wr[d + 1] = c * cs[s * D + d + 1] + a * sn[s * D + d + 1];
                }
            }
    dit_tensor full = dit_tensor_3d(buf, DIT_F32, B, S, ld);
    dit_tensor cols = dit_tensor_narrow(&full, 2, off, H * D);
    dit_tensor x = dit_tensor_split_last(&cols, D);
    dit_tensor tw = dit_tensor_1d(w, DIT_F32, D);
    dit_tensor tc = dit_tensor_2d(cs, DIT_F32, S, D), ts = dit_tensor_2d(sn, DIT_F32, S, D);
    ck_assert_int_eq(be->ops->rms_norm_rope(be, &x, &tw, 1e-6f, &tc, &ts), DIT_OK);
    for (int64_t r = 0; r < B * S; r++)
        memcpy(got + r * H * D, buf + r * ld + off, (size_t)(H * D) * sizeof *got);
    ck_assert_uint_eq(test_compare("rms_norm_rope", got, want, (size_t)(B * S * H * D), 1e-6, 1e-5),
                      0);
    free(buf);
    free(w);
    free(cs);
    free(sn);
    free(want);
    free(got);
}
END_TEST

START_TEST(gated_add_matches_reference)
{
    const int64_t B = 2, S = 3, C = 10;
    test_rng rng = {5};
    float res[60], x[60], gate[20];
    double want[60];
    test_fill(&rng, res, 60, -1, 1);
    test_fill(&rng, x, 60, -1, 1);
    test_fill(&rng, gate, 20, -1, 1);
    for (int i = 0; i < 60; i++)
        want[i] = res[i] + (double)gate[(i / (S * C)) * C + i % C] * x[i];
    dit_tensor tr = dit_tensor_3d(res, DIT_F32, B, S, C), tx = dit_tensor_3d(x, DIT_F32, B, S, C);
    dit_tensor tg = dit_tensor_2d(gate, DIT_F32, B, C);
    ck_assert_int_eq(be->ops->gated_add(be, &tr, &tx, &tg), DIT_OK);
    ck_assert_uint_eq(test_compare("gated_add", res, want, 60, 1e-6, 1e-6), 0);
    for (int i = 0; i < 60; i++)
        want[i] = res[i] + (double)x[i];
    ck_assert_int_eq(be->ops->gated_add(be, &tr, &tx, NULL), DIT_OK);
    ck_assert_uint_eq(test_compare("add", res, want, 60, 1e-6, 1e-6), 0);
}
END_TEST

/* Naive attention in double: full score matrix, softmax, weighted sum. */
static void attention_ref(const float *q, const float *k, const float *v, int64_t B, int64_t Sq,
                          int64_t Skv, int64_t H, int64_t D, int64_t ldq, int64_t ldkv,
                          double scale, double *out, double *lse)
{
    double *s = malloc((size_t)(Skv ? Skv : 1) * sizeof *s);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Sq; i++) {
                const float *qr = q + (b * Sq + i) * ldq + h * D;
                double mx = -INFINITY;
                for (int64_t j = 0; j < Skv; j++) {
                    const float *kr = k + (b * Skv + j) * ldkv + h * D;
                    double acc = 0;
                    for (int64_t d = 0; d < D; d++)
                        acc += (double)qr[d] * kr[d];
                    s[j] = acc * scale;
                    mx = s[j] > mx ? s[j] : mx;
                }
                double sum = 0;
                for (int64_t j = 0; j < Skv; j++)
                    sum += exp(s[j] - mx);
                double *orow = out + ((b * Sq + i) * H + h) * D;
                for (int64_t d = 0; d < D; d++) {
                    double acc = 0;
                    for (int64_t j = 0; j < Skv; j++)
                        acc += exp(s[j] - mx) / sum * v[(b * Skv + j) * ldkv + h * D + d];
                    orow[d] = Skv ? acc : 0.0;
                }
                lse[(b * H + h) * Sq + i] = Skv ? mx + log(sum) : -INFINITY;
            }
    free(s);
}

/* q, k, v as views into fused (B, S, 3*H*D) buffers, like the model uses. */
static void check_attention(int64_t B, int64_t Sq, int64_t Skv, int64_t H, int64_t D)
{
    test_rng rng = {(uint64_t)(Sq * 7919 + Skv * 31 + H * 7 + D)};
    const int64_t C = H * D, ldq = 3 * C, ldkv = 3 * C;
    float *qb = malloc((size_t)(B * Sq * ldq + 1) * sizeof *qb);
    float *kvb = malloc((size_t)(B * Skv * ldkv + 1) * sizeof *kvb);
    float *out = malloc((size_t)(B * Sq * C + 1) * sizeof *out);
    float *lse = malloc((size_t)(B * H * Sq + 1) * sizeof *lse);
    double *want = malloc((size_t)(B * Sq * C + 1) * sizeof *want);
    double *want_lse = malloc((size_t)(B * H * Sq + 1) * sizeof *want_lse);
    test_fill(&rng, qb, (size_t)(B * Sq * ldq), -2, 2);
    test_fill(&rng, kvb, (size_t)(B * Skv * ldkv), -2, 2);
    const double scale = 1.0 / sqrt((double)D);
    attention_ref(qb, kvb + C, kvb + 2 * C, B, Sq, Skv, H, D, ldq, ldkv, scale, want, want_lse);

    dit_tensor qf = dit_tensor_3d(qb, DIT_F32, B, Sq, ldq),
               kvf = dit_tensor_3d(kvb, DIT_F32, B, Skv, ldkv);
    dit_tensor q3 = dit_tensor_narrow(&qf, 2, 0, C), k3 = dit_tensor_narrow(&kvf, 2, C, C);
    dit_tensor v3 = dit_tensor_narrow(&kvf, 2, 2 * C, C);
    dit_tensor q = dit_tensor_split_last(&q3, D), k = dit_tensor_split_last(&k3, D);
    dit_tensor v = dit_tensor_split_last(&v3, D);
    dit_tensor to = dit_tensor_4d(out, DIT_F32, B, Sq, H, D);
    dit_tensor tl = dit_tensor_3d(lse, DIT_F32, B, H, Sq);
    ck_assert_int_eq(be->ops->attention(be, &to, &tl, &q, &k, &v, (float)scale), DIT_OK);
    ck_assert_uint_eq(test_compare("attention out", out, want, (size_t)(B * Sq * C), 1e-5, 1e-5),
                      0);
    ck_assert_uint_eq(
        test_compare("attention lse", lse, want_lse, (size_t)(B * H * Sq), 1e-5, 1e-6), 0);

    /* Split the keys in two and merge: the ring-attention identity. */
    if (Skv >= 2) {
        int64_t s1 = Skv / 3 + 1;
        float *out2 = malloc((size_t)(B * Sq * C) * sizeof *out2);
        float *lse2 = malloc((size_t)(B * H * Sq) * sizeof *lse2);
        dit_tensor ka = dit_tensor_narrow(&k, 1, 0, s1), va = dit_tensor_narrow(&v, 1, 0, s1);
        dit_tensor kb = dit_tensor_narrow(&k, 1, s1, Skv - s1),
                   vb = dit_tensor_narrow(&v, 1, s1, Skv - s1);
        dit_tensor to2 = dit_tensor_4d(out2, DIT_F32, B, Sq, H, D);
        dit_tensor tl2 = dit_tensor_3d(lse2, DIT_F32, B, H, Sq);
        ck_assert_int_eq(be->ops->attention(be, &to, &tl, &q, &ka, &va, (float)scale), DIT_OK);
        ck_assert_int_eq(be->ops->attention(be, &to2, &tl2, &q, &kb, &vb, (float)scale), DIT_OK);
        ck_assert_int_eq(be->ops->lse_merge(be, &to, &tl, &to2, &tl2), DIT_OK);
        ck_assert_uint_eq(test_compare("merged out", out, want, (size_t)(B * Sq * C), 1e-5, 1e-5),
                          0);
        ck_assert_uint_eq(
            test_compare("merged lse", lse, want_lse, (size_t)(B * H * Sq), 1e-5, 1e-6), 0);
        free(out2);
        free(lse2);
    }
    free(qb);
    free(kvb);
    free(out);
    free(lse);
    free(want);
    free(want_lse);
}

START_TEST(attention_matches_reference)
{
    check_attention(1, 5, 7, 1, 8);
    check_attention(2, 70, 300, 3, 16);  /* several q and kv blocks, ragged ends */
    check_attention(1, 64, 256, 2, 128); /* exact block multiples */
    check_attention(1, 1, 1, 1, 4);
    check_attention(1, 3, 0, 2, 4); /* no keys: zeros and lse -inf */
}
END_TEST

START_TEST(attention_handles_large_scores)
{
    /* Scores around 80 would overflow a naive exp; the online max keeps it finite. */
    const int64_t Sq = 4, Skv = 300, D = 4;
    float q[16], kv[1200];
    for (int i = 0; i < 16; i++)
        q[i] = 10.0f;
    for (int i = 0; i < 1200; i++)
        kv[i] = (i % 7) * 0.7f;
    float out[16], lse[4];
    double want[16], want_lse[4];
    attention_ref(q, kv, kv, 1, Sq, Skv, 1, D, D, D, 1.0, want, want_lse);
    dit_tensor tq = dit_tensor_4d(q, DIT_F32, 1, Sq, 1, D),
               tk = dit_tensor_4d(kv, DIT_F32, 1, Skv, 1, D);
    dit_tensor to = dit_tensor_4d(out, DIT_F32, 1, Sq, 1, D),
               tl = dit_tensor_3d(lse, DIT_F32, 1, 1, Sq);
    ck_assert_int_eq(be->ops->attention(be, &to, &tl, &tq, &tk, &tk, 1.0f), DIT_OK);
    ck_assert_uint_eq(test_compare("large out", out, want, 16, 1e-5, 1e-5), 0);
    ck_assert_uint_eq(test_compare("large lse", lse, want_lse, 4, 1e-4, 1e-6), 0);
}
END_TEST

START_TEST(lse_merge_handles_empty_sides)
{
    float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
    float la[1] = {-INFINITY}, lb[1] = {0.5f};
    dit_tensor ta = dit_tensor_4d(a, DIT_F32, 1, 1, 1, 4),
               tb = dit_tensor_4d(b, DIT_F32, 1, 1, 1, 4);
    dit_tensor tla = dit_tensor_3d(la, DIT_F32, 1, 1, 1), tlb = dit_tensor_3d(lb, DIT_F32, 1, 1, 1);
    ck_assert_int_eq(be->ops->lse_merge(be, &ta, &tla, &tb, &tlb), DIT_OK);
    ck_assert_float_eq(a[2], 7.0f);
    ck_assert_float_eq(la[0], 0.5f);
    lb[0] = -INFINITY;
    b[2] = 100.0f;
    ck_assert_int_eq(be->ops->lse_merge(be, &ta, &tla, &tb, &tlb), DIT_OK);
    ck_assert_float_eq(a[2], 7.0f);
    ck_assert_float_eq(la[0], 0.5f);
}
END_TEST

START_TEST(upload_converts_strided_bf16)
{
    /* A (3, 4) bf16 host tensor; take columns 1..2 into a (3, 2) f32 tensor. */
    uint16_t src[12];
    for (int i = 0; i < 12; i++)
        src[i] = dit_f32_to_bf16((float)i * 0.5f);
    dit_tensor full = dit_tensor_2d(src, DIT_BF16, 3, 4);
    dit_tensor cols = dit_tensor_narrow(&full, 1, 1, 2);
    float dst[6];
    dit_tensor td = dit_tensor_2d(dst, DIT_F32, 3, 2);
    ck_assert_int_eq(be->ops->upload(be, &td, &cols), DIT_OK);
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 2; c++)
            ck_assert_float_eq(dst[r * 2 + c], (float)(r * 4 + c + 1) * 0.5f);
    float filled[6];
    dit_tensor tf = dit_tensor_2d(filled, DIT_F32, 3, 2);
    ck_assert_int_eq(be->ops->fill(be, &tf, 2.5f), DIT_OK);
    ck_assert_int_eq(be->ops->copy(be, &td, &tf), DIT_OK);
    ck_assert_float_eq(dst[5], 2.5f);
}
END_TEST

START_TEST(new_activations_match_reference)
{
    enum { N = 2001 };
    float x[N], y[N];
    double want[N];
    for (int i = 0; i < N; i++)
        x[i] = -10.0f + 20.0f * (float)i / (N - 1);
    dit_tensor tx = dit_tensor_1d(x, DIT_F32, N), ty = dit_tensor_1d(y, DIT_F32, N);
    ck_assert_int_eq(be->ops->activate(be, &ty, &tx, DIT_ACT_GELU_ERF), DIT_OK);
    for (int i = 0; i < N; i++)
        want[i] = 0.5 * x[i] * (1.0 + erf(x[i] / sqrt(2.0)));
    ck_assert_uint_eq(test_compare("gelu_erf", y, want, N, 2e-6, 2e-6), 0);
    ck_assert_int_eq(be->ops->activate(be, &ty, &tx, DIT_ACT_QUICK_GELU), DIT_OK);
    for (int i = 0; i < N; i++)
        want[i] = x[i] / (1.0 + exp(-1.702 * x[i]));
    ck_assert_uint_eq(test_compare("quick_gelu", y, want, N, 1e-7, 1e-6), 0);
}
END_TEST

START_TEST(layer_norm_affine_and_rms_norm)
{
    const int64_t B = 2, S = 3, C = 40;
    test_rng rng = {21};
    float x[240], y[240], w[40], b[40];
    double want[240];
    test_fill(&rng, x, 240, -2, 3);
    test_fill(&rng, w, 40, 0.5f, 1.5f);
    test_fill(&rng, b, 40, -1, 1);
    dit_tensor tx = dit_tensor_3d(x, DIT_F32, B, S, C), ty = dit_tensor_3d(y, DIT_F32, B, S, C);
    dit_tensor tw = dit_tensor_1d(w, DIT_F32, C), tb = dit_tensor_1d(b, DIT_F32, C);
    for (int64_t r = 0; r < B * S; r++) {
        double mean = 0, var = 0, ms = 0;
        for (int64_t c = 0; c < C; c++)
            mean += x[r * C + c];
        mean /= C;
        for (int64_t c = 0; c < C; c++)
            var += (x[r * C + c] - mean) * (x[r * C + c] - mean);
        var /= C;
        for (int64_t c = 0; c < C; c++)
            want[r * C + c] = (x[r * C + c] - mean) / sqrt(var + 1e-5) * w[c] + b[c];
        (void)ms;
    }
    ck_assert_int_eq(be->ops->layer_norm(be, &ty, &tx, &tw, &tb, 1e-5f), DIT_OK);
    ck_assert_uint_eq(test_compare("layer_norm", y, want, 240, 1e-5, 1e-5), 0);
    for (int64_t r = 0; r < B * S; r++) {
        double ms = 0;
        for (int64_t c = 0; c < C; c++)
            ms += (double)x[r * C + c] * x[r * C + c];
        ms /= C;
        for (int64_t c = 0; c < C; c++)
            want[r * C + c] = w[c] * (x[r * C + c] / sqrt(ms + 1e-6));
    }
    ck_assert_int_eq(be->ops->rms_norm(be, &ty, &tx, &tw, 1e-6f), DIT_OK);
    ck_assert_uint_eq(test_compare("rms_norm", y, want, 240, 1e-6, 1e-5), 0);
}
END_TEST

START_TEST(embedding_gathers_rows)
{
    float table[5 * 3], y[4 * 3];
    for (int i = 0; i < 15; i++)
        table[i] = (float)i;
    const int32_t ids[4] = {4, 0, 2, 4};
    dit_tensor tt = dit_tensor_2d(table, DIT_F32, 5, 3), ty = dit_tensor_2d(y, DIT_F32, 4, 3);
    ck_assert_int_eq(be->ops->embedding(be, &ty, &tt, ids, 4), DIT_OK);
    ck_assert_float_eq(y[0], 12.0f);
    ck_assert_float_eq(y[3], 0.0f);
    ck_assert_float_eq(y[7], 7.0f);
    ck_assert_float_eq(y[11], 14.0f);
    const int32_t bad[1] = {5};
    dit_tensor t1 = dit_tensor_2d(y, DIT_F32, 1, 3);
    ck_assert_int_eq(be->ops->embedding(be, &t1, &tt, bad, 1), DIT_ERR_INVALID_ARG);
}
END_TEST

/* y[h][i][j] = table[buckets[j - i + Sq - 1]][h], checked element by
 * element against the definition, for a square (H, S, S) bias and for
 * keys narrowed to Skv < Sq (UMT5's masked runs); out-of-range buckets and
 * a table of the wrong width are refused. */
START_TEST(relative_bias_matches_definition)
{
    enum { H = 3, NB = 7, S = 9 };
    float table[NB * H];
    for (int i = 0; i < NB * H; i++)
        table[i] = 0.25f * (float)i - 1.0f;
    int32_t buckets[2 * S - 1];
    for (int r = 0; r < 2 * S - 1; r++)
        buckets[r] = (r * 5 + 3) % NB;
    const dit_tensor tt = dit_tensor_2d(table, DIT_F32, NB, H);
    static float y[H * S * S];
    for (int skv = S; skv >= 4; skv -= S - 4) {
        dit_tensor ty = dit_tensor_3d(y, DIT_F32, H, S, skv);
        memset(y, 0, sizeof y);
        ck_assert_int_eq(be->ops->relative_bias(be, &ty, &tt, buckets), DIT_OK);
        for (int h = 0; h < H; h++)
            for (int i = 0; i < S; i++)
                for (int j = 0; j < skv; j++)
                    ck_assert_float_eq(y[(h * S + i) * skv + j],
                                       table[buckets[j - i + S - 1] * H + h]);
    }
    int32_t bad[2 * S - 1];
    memcpy(bad, buckets, sizeof bad);
    bad[2 * S - 2] = NB;
    dit_tensor ty = dit_tensor_3d(y, DIT_F32, H, S, S);
    ck_assert_int_eq(be->ops->relative_bias(be, &ty, &tt, bad), DIT_ERR_INVALID_ARG);
    bad[2 * S - 2] = -1;
    ck_assert_int_eq(be->ops->relative_bias(be, &ty, &tt, bad), DIT_ERR_INVALID_ARG);
    const dit_tensor narrow = dit_tensor_2d(table, DIT_F32, NB * H / 2, 2);
    ck_assert_int_eq(be->ops->relative_bias(be, &ty, &narrow, buckets), DIT_ERR_INVALID_ARG);
}
END_TEST

START_TEST(masked_attention_matches_reference)
{
    const int64_t B = 2, S = 70, H = 3, D = 8; /* S spans several query blocks */
    test_rng rng = {33};
    const size_t n = (size_t)(B * S * H * D);
    float *q = malloc(n * 4), *k = malloc(n * 4), *v = malloc(n * 4), *o = malloc(n * 4);
    float *bias = malloc((size_t)(H * S * S) * 4);
    double *want = malloc(n * sizeof *want), *sc = malloc((size_t)S * sizeof *sc);
    test_fill(&rng, q, n, -1, 1);
    test_fill(&rng, k, n, -1, 1);
    test_fill(&rng, v, n, -1, 1);
    test_fill(&rng, bias, (size_t)(H * S * S), -2, 2);
    for (int causal = 0; causal <= 1; causal++) {
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < S; i++) {
                    double mx = -INFINITY;
                    const int64_t last = causal ? i : S - 1;
                    for (int64_t j = 0; j <= last; j++) {
                        double acc = 0;
                        for (int64_t d = 0; d < D; d++)
                            acc += (double)q[((b * S + i) * H + h) * D + d] *
                                   k[((b * S + j) * H + h) * D + d];
                        sc[j] = acc * 0.5 + (causal ? 0.0 : bias[(h * S + i) * S + j]);
                        mx = sc[j] > mx ? sc[j] : mx;
                    }
                    double sum = 0;
                    for (int64_t j = 0; j <= last; j++)
                        sum += exp(sc[j] - mx);
                    for (int64_t d = 0; d < D; d++) {
                        double acc = 0;
                        for (int64_t j = 0; j <= last; j++)
                            acc += exp(sc[j] - mx) / sum * v[((b * S + j) * H + h) * D + d];
                        want[((b * S + i) * H + h) * D + d] = acc;
                    }
                }
        dit_tensor tq = dit_tensor_4d(q, DIT_F32, B, S, H, D),
                   tk = dit_tensor_4d(k, DIT_F32, B, S, H, D);
        dit_tensor tv = dit_tensor_4d(v, DIT_F32, B, S, H, D),
                   to = dit_tensor_4d(o, DIT_F32, B, S, H, D);
        dit_tensor tb = dit_tensor_3d(bias, DIT_F32, H, S, S);
        ck_assert_int_eq(
            be->ops->attention_masked(be, &to, &tq, &tk, &tv, 0.5f, causal ? NULL : &tb, causal),
            DIT_OK);
        ck_assert_uint_eq(test_compare(causal ? "causal" : "bias", o, want, n, 1e-5, 1e-5), 0);
    }
    free(q);
    free(k);
    free(v);
    free(o);
    free(bias);
    free(want);
    free(sc);
}
END_TEST

static void check_conv(int64_t B, int64_t Ci, int64_t H, int64_t W, int64_t Co, int64_t kk,
                       int stride, int pad, int *direct_sets)
{
    test_rng rng = {(uint64_t)(Ci * 131 + H * 17 + kk + stride)};
    const int64_t Ho = (H + 2 * pad - kk) / stride + 1, Wo = (W + 2 * pad - kk) / stride + 1;
    float *x = malloc((size_t)(B * Ci * H * W) * 4), *w = malloc((size_t)(Co * Ci * kk * kk) * 4);
    float *b = malloc((size_t)Co * 4), *y = malloc((size_t)(B * Co * Ho * Wo) * 4);
    double *want = malloc((size_t)(B * Co * Ho * Wo) * sizeof *want);
    test_fill(&rng, x, (size_t)(B * Ci * H * W), -1, 1);
    test_fill(&rng, w, (size_t)(Co * Ci * kk * kk), -0.3f, 0.3f);
    test_fill(&rng, b, (size_t)Co, -1, 1);
    for (int64_t bi = 0; bi < B; bi++)
        for (int64_t o = 0; o < Co; o++)
            for (int64_t oy = 0; oy < Ho; oy++)
                for (int64_t ox = 0; ox < Wo; ox++) {
                    double acc = b[o];
                    for (int64_t c = 0; c < Ci; c++)
                        for (int64_t i = 0; i < kk; i++)
                            for (int64_t j = 0; j < kk; j++) {
                                int64_t iy = oy * stride - pad + i, ix = ox * stride - pad + j;
                                if (iy < 0 || iy >= H || ix < 0 || ix >= W)
                                    continue;
                                acc += (double)x[((bi * Ci + c) * H + iy) * W + ix] *
                                       w[((o * Ci + c) * kk + i) * kk + j];
                            }
                    want[((bi * Co + o) * Ho + oy) * Wo + ox] = acc;
                }
    dit_tensor tx = dit_tensor_4d(x, DIT_F32, B, Ci, H, W),
               tw = dit_tensor_4d(w, DIT_F32, Co, Ci, kk, kk);
    dit_tensor tb = dit_tensor_1d(b, DIT_F32, Co), ty = dit_tensor_4d(y, DIT_F32, B, Co, Ho, Wo);
    ck_assert_int_eq(be->ops->conv2d(be, &ty, &tx, &tw, &tb, stride, pad), DIT_OK);
    ck_assert_uint_eq(test_compare("conv2d", y, want, (size_t)(B * Co * Ho * Wo), 1e-5, 1e-5), 0);
    /* The direct kernel on each instruction set this CPU has (no bias):
     * the reference's values, and the same bits on every set. */
    const size_t ny = (size_t)(B * Co * Ho * Wo);
    float *ys[2] = {malloc(ny * 4), malloc(ny * 4)};
    const dit_cpu_isa isas[2] = {DIT_CPU_ISA_AVX2, DIT_CPU_ISA_AVX512};
    bool ran[2] = {false, false};
    for (int k = 0; stride == 1 && k < 2; k++) {
        const dit_status st =
            dit_cpu_conv2d_direct_isa(isas[k], 2, x, w, ys[k], B, Ci, H, W, Co, kk, kk, pad);
        if (st == DIT_ERR_UNSUPPORTED)
            continue;
        ck_assert_int_eq(st, DIT_OK);
        ran[k] = true;
        for (size_t e = 0; e < ny; e++)
            ys[k][e] += b[(e / (size_t)(Ho * Wo)) % (size_t)Co];
        ck_assert_uint_eq(
            test_compare(k ? "conv2d avx512" : "conv2d avx2", ys[k], want, ny, 1e-5, 1e-5), 0);
    }
    if (ran[0] && ran[1])
        ck_assert_int_eq(memcmp(ys[0], ys[1], ny * 4), 0);
    *direct_sets |= (ran[0] ? 1 : 0) | (ran[1] ? 2 : 0);
    free(ys[0]);
    free(ys[1]);
    free(x);
    free(w);
    free(b);
    free(y);
    free(want);
}

START_TEST(conv2d_matches_reference)
{
    int sets = 0; /* the direct kernel's instruction sets that ran */
    check_conv(2, 3, 9, 7, 5, 3, 1, 1, &sets);
    check_conv(1, 4, 8, 8, 6, 3, 2, 1, &sets);
    check_conv(1, 5, 6, 5, 3, 1, 1, 0, &sets); /* pointwise path */
    check_conv(1, 2, 5, 5, 2, 3, 1, 0, &sets); /* no padding */
    /* Rows cut on both sides (a kernel wider than the padding; padding
     * wider than the row), the stride-1 copy's edge cases. */
    check_conv(1, 2, 4, 3, 2, 5, 1, 1, &sets);
    check_conv(1, 2, 3, 2, 3, 3, 1, 2, &sets);
    check_conv(2, 3, 6, 1, 2, 3, 1, 1, &sets);
    /* The direct path (stride 1, at most 64 outputs, kernels up to 7): full
     * tiles and a ragged last one (tiles are 48 or 24 pixels), a ragged
     * block of output channels (7 = 4 + 3), a 3-channel conv_out, rows
     * enough that each thread's ring of input rows turns over (3 and 5
     * rows), 40 outputs (10 blocks); then a layer of 70 outputs and a 9x9
     * kernel, which go through the GEMM. */
    check_conv(1, 5, 5, 150, 7, 3, 1, 1, &sets);
    check_conv(2, 4, 3, 130, 3, 3, 1, 1, &sets);
    check_conv(1, 3, 4, 70, 9, 5, 1, 2, &sets);
    check_conv(1, 3, 17, 60, 5, 3, 1, 1, &sets);
    check_conv(2, 2, 19, 50, 6, 5, 1, 2, &sets);
    check_conv(1, 2, 11, 9, 3, 7, 1, 3, &sets);
    check_conv(1, 6, 5, 9, 40, 3, 1, 1, &sets);
    check_conv(1, 6, 5, 9, 70, 3, 1, 1, &sets);
    check_conv(1, 2, 10, 12, 3, 9, 1, 4, &sets);
    printf("conv2d: direct kernel checked on%s%s%s\n", sets & 1 ? " AVX2+FMA" : "",
           sets & 2 ? " AVX-512" : "", sets ? "" : " no instruction set (this CPU has neither)");
    fflush(stdout);
}
END_TEST

START_TEST(group_norm_and_upsample)
{
    const int64_t B = 2, C = 8, H = 3, W = 5, G = 4;
    test_rng rng = {44};
    float x[240], y[240], w[8], b[8], up[960];
    double want[240];
    test_fill(&rng, x, 240, -2, 4);
    test_fill(&rng, w, 8, 0.5f, 1.5f);
    test_fill(&rng, b, 8, -1, 1);
    for (int silu = 0; silu <= 1; silu++) {
        for (int64_t bi = 0; bi < B; bi++)
            for (int64_t g = 0; g < G; g++) {
                const int64_t cg = C / G, n = cg * H * W, base = (bi * C + g * cg) * H * W;
                double mean = 0, var = 0;
                for (int64_t i = 0; i < n; i++)
                    mean += x[base + i];
                mean /= n;
                for (int64_t i = 0; i < n; i++)
                    var += (x[base + i] - mean) * (x[base + i] - mean);
                var /= n;
                for (int64_t i = 0; i < n; i++) {
                    int64_t c = g * cg + i / (H * W);
                    double v = (x[base + i] - mean) / sqrt(var + 1e-6) * w[c] + b[c];
                    want[base + i] = silu ? v / (1.0 + exp(-v)) : v;
                }
            }
        dit_tensor tx = dit_tensor_4d(x, DIT_F32, B, C, H, W),
                   ty = dit_tensor_4d(y, DIT_F32, B, C, H, W);
        dit_tensor tw = dit_tensor_1d(w, DIT_F32, C), tb = dit_tensor_1d(b, DIT_F32, C);
        ck_assert_int_eq(be->ops->group_norm(be, &ty, &tx, &tw, &tb, (int)G, 1e-6f,
                                             silu ? DIT_ACT_SILU : DIT_ACT_NONE),
                         DIT_OK);
        ck_assert_uint_eq(test_compare("group_norm", y, want, 240, 1e-5, 1e-5), 0);
    }
    dit_tensor tx = dit_tensor_4d(x, DIT_F32, B, C, H, W),
               tu = dit_tensor_4d(up, DIT_F32, B, C, 2 * H, 2 * W);
    ck_assert_int_eq(be->ops->upsample2x(be, &tu, &tx), DIT_OK);
    for (int64_t p = 0; p < B * C; p++)
        for (int64_t i = 0; i < 2 * H; i++)
            for (int64_t j = 0; j < 2 * W; j++)
                ck_assert_float_eq(up[(p * 2 * H + i) * 2 * W + j], x[(p * H + i / 2) * W + j / 2]);
}
END_TEST

static Suite *cpu_ops_suite(void)
{
    Suite *s = suite_create("cpu_ops");
    TCase *tc = tcase_create("ops");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, expf_matches_libm);
    tcase_add_test(tc, gelu_and_silu_match_reference);
    tcase_add_test(tc, linear_matches_reference);
    tcase_add_test(tc, linear_rejects_bad_shapes);
    tcase_add_test(tc, blas_core_advice);
    tcase_add_test(tc, kernel_sets_pick);
    tcase_add_test(tc, layer_norm_mod_matches_reference);
    tcase_add_test(tc, rms_norm_rope_matches_reference);
    tcase_add_test(tc, gated_add_matches_reference);
    tcase_add_test(tc, attention_matches_reference);
    tcase_add_test(tc, attention_handles_large_scores);
    tcase_add_test(tc, lse_merge_handles_empty_sides);
    tcase_add_test(tc, upload_converts_strided_bf16);
    tcase_add_test(tc, new_activations_match_reference);
    tcase_add_test(tc, layer_norm_affine_and_rms_norm);
    tcase_add_test(tc, embedding_gathers_rows);
    tcase_add_test(tc, relative_bias_matches_definition);
    tcase_add_test(tc, masked_attention_matches_reference);
    tcase_add_test(tc, conv2d_matches_reference);
    tcase_add_test(tc, group_norm_and_upsample);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(cpu_ops_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
