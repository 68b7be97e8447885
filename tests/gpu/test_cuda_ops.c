/* Op-by-op parity of the cuda backend against the cpu reference: the same
 * random inputs on both, every op of dit_backend_ops, several shapes
 * (uneven lengths, strided views like the model's), head dims 16/64/128.
 *
 * Tolerances (|gpu - cpu| <= atol + rtol |cpu|), and why:
 *  - f32 elementwise and row ops (norms, modulation, RoPE, gated add,
 *    activations, lse_merge, GroupNorm, upsample, embedding, copies):
 *    atol 2e-5, rtol 2e-5. Both sides compute in f32; only reduction order
 *    and exp/tanh implementations (a few ulp) differ.
 *  - linear and conv2d: inputs and weights are rounded to bf16 on the host
 *    first, so the device's bf16 operands are exact and the products are
 *    exact in f32; what remains is f32 accumulation order over K terms:
 *    atol 1e-4, rtol 1e-4 (outputs are O(1)). With GELU fused into
 *    cuBLASLt's epilogue (its own GELU implementation), atol 2e-3.
 *  - attention, head dim 64 / 128 (bf16 tensor-core path): q, k, v rounded
 *    to bf16 so QK^T is exact; the softmax weights P are rounded to bf16
 *    (relative 2^-9) before P V: out atol 4e-3, rtol 4e-3. lse comes from
 *    the f32 scores and f32 row sums: atol 1e-4, rtol 1e-5.
 *  - attention, other head dims and attention_masked (f32 path): atol 2e-5,
 *    rtol 1e-4. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu_util.h"

/* Set once in main before the runner starts; read-only in the tests. */
static dit_backend *g_cpu, *g_gpu;

#define CPU g_cpu
#define GPU g_gpu

/* q, k, v as (B, S, H, D) head views of fused projections (B, S, >= 3 H D),
 * as the models make them: q from the first H D columns of qp, k and v from
 * the second and third H D of kp (which may be qp). */
static void qkv_views(const dit_tensor *qp, const dit_tensor *kp, int64_t H, int64_t D,
                      dit_tensor *q, dit_tensor *k, dit_tensor *v)
{
    dit_tensor f = dit_tensor_narrow(qp, 2, 0, H * D);
    *q = dit_tensor_split_last(&f, D);
    f = dit_tensor_narrow(kp, 2, H * D, H * D);
    *k = dit_tensor_split_last(&f, D);
    f = dit_tensor_narrow(kp, 2, 2 * H * D, H * D);
    *v = dit_tensor_split_last(&f, D);
}

/* How many values of two views on the gpu differ in any bit (downloaded as
 * f32, which bf16 values are exactly). */
static size_t gpu_bit_differences(const dit_tensor *a, const dit_tensor *b)
{
    const size_t n = (size_t)dit_tensor_numel(a);
    float *x = gpu_fetch(GPU, a), *y = gpu_fetch(GPU, b);
    size_t d = 0;
    for (size_t i = 0; i < n; i++)
        d += memcmp(&x[i], &y[i], sizeof x[i]) != 0;
    free(x);
    free(y);
    return d;
}

/* ---- memory ops ---------------------------------------------------------- */

START_TEST(upload_download_copy_fill_roundtrip)
{
    test_rng r = {101};
    const int64_t shape[3] = {3, 17, 40};
    const size_t n = 3 * 17 * 40;
    float *h = gpu_rand(&r, n, -2, 2, false);
    /* f32 on the device: exact round trip. */
    gpu_pair a = gpu_pair_make(CPU, GPU, DIT_F32, 3, shape, h);
    ck_assert_int_eq(gpu_compare_views("roundtrip f32", CPU, &a.c, GPU, &a.g, 0, 0), 0);
    /* bf16 on the device: the host's rounding (round to nearest even). */
    gpu_pair b = gpu_pair_make(CPU, GPU, DIT_BF16, 3, shape, h);
    float *got = gpu_fetch(GPU, &b.g);
    for (size_t i = 0; i < n; i++)
        ck_assert_float_eq(got[i], dit_bf16_to_f32(dit_f32_to_bf16(h[i])));
    free(got);
    /* A strided host source (a column slice) into a bf16 device tensor. */
    dit_tensor hfull = dit_tensor_3d(h, DIT_F32, 3, 17, 40);
    dit_tensor hcols = dit_tensor_narrow(&hfull, 2, 5, 20);
    const int64_t sh2[3] = {3, 17, 20};
    gpu_pair c = gpu_pair_make(CPU, GPU, DIT_BF16, 3, sh2, NULL);
    GPU_OK(GPU, GPU->ops->upload(GPU, &c.g, &hcols));
    GPU_OK(CPU, CPU->ops->upload(CPU, &c.c, &hcols));
    ck_assert_int_eq(gpu_compare_views("strided upload", CPU, &c.c, GPU, &c.g, 4e-3, 4e-3), 0);
    /* Device copy between strided views, and fill. */
    dit_tensor gsrc = dit_tensor_narrow(&a.g, 1, 2, 9), csrc = dit_tensor_narrow(&a.c, 1, 2, 9);
    gpu_pair d = gpu_pair_make(CPU, GPU, DIT_F32, 3, (int64_t[]){3, 9, 40}, NULL);
    GPU_OK(GPU, GPU->ops->copy(GPU, &d.g, &gsrc));
    GPU_OK(CPU, CPU->ops->copy(CPU, &d.c, &csrc));
    ck_assert_int_eq(gpu_compare_views("copy", CPU, &d.c, GPU, &d.g, 0, 0), 0);
    dit_tensor gf = dit_tensor_narrow(&a.g, 2, 3, 7), cf = dit_tensor_narrow(&a.c, 2, 3, 7);
    GPU_OK(GPU, GPU->ops->fill(GPU, &gf, 0.25f));
    GPU_OK(CPU, CPU->ops->fill(CPU, &cf, 0.25f));
    ck_assert_int_eq(gpu_compare_views("fill", CPU, &a.c, GPU, &a.g, 0, 0), 0);
    /* The three ways kernels find a row (cuda_internal.cuh): evenly spaced
     * rows (above), one division (head views of one batch entry's tokens),
     * and two (head views of a token slice of several batch entries). */
    {
        const int64_t H = 2, D = 8, shp[3] = {3, 9, 3 * H * D};
        float *hp = gpu_rand(&r, (size_t)(3 * 9 * 3 * H * D), -2, 2, false);
        gpu_pair p = gpu_pair_make(CPU, GPU, DIT_F32, 3, shp, hp);
        for (int v = 0; v < 2; v++) {
            dit_tensor vc = dit_tensor_narrow(&p.c, 2, H * D, H * D);
            dit_tensor vg = dit_tensor_narrow(&p.g, 2, H * D, H * D);
            vc = dit_tensor_split_last(&vc, D);
            vg = dit_tensor_split_last(&vg, D);
            if (v == 1) { /* tokens 2..6 of every batch entry: two divisions */
                vc = dit_tensor_narrow(&vc, 1, 2, 5);
                vg = dit_tensor_narrow(&vg, 1, 2, 5);
            }
            gpu_pair e = gpu_pair_make(CPU, GPU, DIT_F32, 4, (int64_t[]){3, v ? 5 : 9, H, D}, NULL);
            GPU_OK(GPU, GPU->ops->copy(GPU, &e.g, &vg));
            GPU_OK(CPU, CPU->ops->copy(CPU, &e.c, &vc));
            ck_assert_int_eq(
                gpu_compare_views(v ? "copy, two-division rows" : "copy, one-division rows", CPU,
                                  &e.c, GPU, &e.g, 0, 0),
                0);
            GPU_OK(GPU, GPU->ops->fill(GPU, &vg, 1.5f));
            GPU_OK(CPU, CPU->ops->fill(CPU, &vc, 1.5f));
            ck_assert_int_eq(gpu_compare_views("fill of a head view", CPU, &p.c, GPU, &p.g, 0, 0),
                             0);
            gpu_pair_free(CPU, GPU, &e);
        }
        gpu_pair_free(CPU, GPU, &p);
        free(hp);
    }
    gpu_pair_free(CPU, GPU, &a);
    gpu_pair_free(CPU, GPU, &b);
    gpu_pair_free(CPU, GPU, &c);
    gpu_pair_free(CPU, GPU, &d);
    free(h);
}
END_TEST

/* 5-D tensors (video latents (B, C, F, H, W)) through upload, download,
 * copy, fill and activate: the cuda views fold them to 4 dims; a view that
 * cannot fold is refused, not mangled. */
START_TEST(five_dims_match_cpu)
{
    test_rng r = {107};
    const int64_t shape[5] = {2, 3, 4, 5, 6};
    const size_t n = 2 * 3 * 4 * 5 * 6;
    float *h = gpu_rand(&r, n, -2, 2, true);
    gpu_pair a = gpu_pair_make(CPU, GPU, DIT_F32, 5, shape, h);
    gpu_pair b = gpu_pair_make(CPU, GPU, DIT_BF16, 5, shape, h);
    ck_assert_int_eq(gpu_compare_views("5-D f32 upload", CPU, &a.c, GPU, &a.g, 0, 0), 0);
    ck_assert_int_eq(gpu_compare_views("5-D bf16 upload", CPU, &b.c, GPU, &b.g, 0, 0), 0);
    /* A strided host source: channels [1, 3), frames [1, 3), columns 1..4. */
    dit_tensor hv = dit_tensor_5d(h, DIT_F32, 2, 3, 4, 5, 6);
    hv = dit_tensor_narrow(&hv, 1, 1, 2);
    hv = dit_tensor_narrow(&hv, 2, 1, 2);
    hv = dit_tensor_narrow(&hv, 4, 1, 4);
    const int64_t sh2[5] = {2, 2, 2, 5, 4};
    gpu_pair c = gpu_pair_make(CPU, GPU, DIT_BF16, 5, sh2, NULL);
    GPU_OK(GPU, GPU->ops->upload(GPU, &c.g, &hv));
    GPU_OK(CPU, CPU->ops->upload(CPU, &c.c, &hv));
    ck_assert_int_eq(gpu_compare_views("5-D strided upload", CPU, &c.c, GPU, &c.g, 0, 0), 0);
    /* Device copy out of the same slice of a device tensor, and a fill. */
    dit_tensor gv = dit_tensor_narrow(&a.g, 1, 1, 2), cv = dit_tensor_narrow(&a.c, 1, 1, 2);
    gv = dit_tensor_narrow(&gv, 2, 1, 2);
    cv = dit_tensor_narrow(&cv, 2, 1, 2);
    gv = dit_tensor_narrow(&gv, 4, 1, 4);
    cv = dit_tensor_narrow(&cv, 4, 1, 4);
    gpu_pair d = gpu_pair_make(CPU, GPU, DIT_F32, 5, sh2, NULL);
    GPU_OK(GPU, GPU->ops->copy(GPU, &d.g, &gv));
    GPU_OK(CPU, CPU->ops->copy(CPU, &d.c, &cv));
    ck_assert_int_eq(gpu_compare_views("5-D copy", CPU, &d.c, GPU, &d.g, 0, 0), 0);
    GPU_OK(GPU, GPU->ops->fill(GPU, &gv, -0.5f));
    GPU_OK(CPU, CPU->ops->fill(CPU, &cv, -0.5f));
    ck_assert_int_eq(gpu_compare_views("5-D fill", CPU, &a.c, GPU, &a.g, 0, 0), 0);
    /* Download of a strided 5-D device view (gpu_fetch downloads). */
    ck_assert_int_eq(gpu_compare_views("5-D strided download", CPU, &cv, GPU, &gv, 0, 0), 0);
    /* activate over all of a 5-D tensor. */
    gpu_pair e = gpu_pair_make(CPU, GPU, DIT_F32, 5, shape, NULL);
    GPU_OK(GPU, GPU->ops->activate(GPU, &e.g, &a.g, DIT_ACT_SILU));
    GPU_OK(CPU, CPU->ops->activate(CPU, &e.c, &a.c, DIT_ACT_SILU));
    ck_assert_int_eq(gpu_compare_views("5-D activate", CPU, &e.c, GPU, &e.g, 2e-5, 2e-5), 0);
    /* Narrowed in dims 1, 2 and 3: no two outer dims merge. */
    dit_tensor u = dit_tensor_narrow(&a.g, 1, 0, 2);
    u = dit_tensor_narrow(&u, 2, 0, 3);
    u = dit_tensor_narrow(&u, 3, 0, 4);
    gpu_pair f = gpu_pair_make(CPU, GPU, DIT_F32, 5, (int64_t[]){2, 2, 3, 4, 6}, NULL);
    ck_assert_int_eq(GPU->ops->copy(GPU, &f.g, &u), DIT_ERR_UNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(GPU->ops->last_error(GPU), "fold"));
    ck_assert_int_eq(GPU->ops->fill(GPU, &u, 0.0f), DIT_ERR_INVALID_ARG);
    gpu_pair_free(CPU, GPU, &a);
    gpu_pair_free(CPU, GPU, &b);
    gpu_pair_free(CPU, GPU, &c);
    gpu_pair_free(CPU, GPU, &d);
    gpu_pair_free(CPU, GPU, &e);
    gpu_pair_free(CPU, GPU, &f);
    free(h);
}
END_TEST

/* An f8_e4m3 host tensor uploads into f32, bf16 and f16 device tensors
 * exactly (converted on the host); no device op takes f8_e4m3. */
START_TEST(f8_upload_converts_exactly)
{
    uint8_t q[2 * 256];
    for (int i = 0; i < 512; i++)
        q[i] = (uint8_t)(i * 37 + 11); /* every pattern twice, scrambled */
    const int64_t shape[5] = {2, 4, 4, 4, 4};
    dit_tensor hq = dit_tensor_make(q, DIT_F8_E4M3, 5, shape);
    const dit_dtype dts[3] = {DIT_F32, DIT_BF16, DIT_F16};
    for (int k = 0; k < 3; k++) {
        gpu_pair p = gpu_pair_make(CPU, GPU, dts[k], 5, shape, NULL);
        GPU_OK(GPU, GPU->ops->upload(GPU, &p.g, &hq));
        float *got = gpu_fetch(GPU, &p.g);
        for (int i = 0; i < 512; i++) {
            float want = dit_f8e4m3_to_f32(q[i]);
            if (isnan(want))
                ck_assert_msg(isnan(got[i]), "%s [%d]", dit_dtype_name(dts[k]), i);
            else
                ck_assert_msg(got[i] == want, "%s [%d]: %g, want %g", dit_dtype_name(dts[k]), i,
                              (double)got[i], (double)want);
        }
        free(got);
        gpu_pair_free(CPU, GPU, &p);
    }
    /* A strided f8 source: every other column. */
    dit_tensor hs = hq;
    hs.ne[4] = 2;
    hs.nb[4] = 2;
    const int64_t sh2[5] = {2, 4, 4, 4, 2};
    gpu_pair s = gpu_pair_make(CPU, GPU, DIT_BF16, 5, sh2, NULL);
    GPU_OK(GPU, GPU->ops->upload(GPU, &s.g, &hs));
    GPU_OK(CPU, CPU->ops->upload(CPU, &s.c, &hs));
    float *got = gpu_fetch(GPU, &s.g), *want = gpu_fetch(CPU, &s.c);
    for (int i = 0; i < 256; i++)
        ck_assert(isnan(want[i]) ? isnan(got[i]) : got[i] == want[i]);
    free(got);
    free(want);
    /* Downloading into f8, or copying on the device from f8, is refused. */
    uint8_t back[256];
    dit_tensor hb = dit_tensor_make(back, DIT_F8_E4M3, 5, sh2);
    ck_assert_int_eq(GPU->ops->download(GPU, &hb, &s.g), DIT_ERR_UNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(GPU->ops->last_error(GPU), "f8_e4m3"));
    dit_tensor gq = s.g;
    gq.dtype = DIT_F8_E4M3;
    ck_assert_int_eq(GPU->ops->copy(GPU, &s.g, &gq), DIT_ERR_UNSUPPORTED);
    gpu_pair_free(CPU, GPU, &s);
}
END_TEST

/* The host generator of dit_flux_create_random, for init_uniform. */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

START_TEST(init_uniform_matches_host_generator)
{
    const int64_t N = 37, K = 29, row0 = 5, col0 = 11;
    const uint64_t base = 0x1234abcdull;
    const float a = 0.125f;
    void *buf = NULL;
    GPU_OK(GPU, dit_backend_alloc(GPU, (size_t)(N * K) * 4, &buf));
    dit_tensor t = dit_tensor_2d(buf, DIT_F32, N, K);
    GPU_OK(GPU, GPU->ops->init_uniform(GPU, &t, base, row0, col0, a));
    float *got = gpu_fetch(GPU, &t);
    for (int64_t r = 0; r < N; r++) {
        uint64_t s = base + (uint64_t)(row0 + r) * 0x2545f4914f6cdd1dull;
        for (int64_t k = 0; k < col0; k++)
            s += 0x9e3779b97f4a7c15ull;
        for (int64_t c = 0; c < K; c++) {
            s += 0x9e3779b97f4a7c15ull;
            double u = (double)(mix64(s) >> 11) * 0x1.0p-53;
            float want = (float)((2.0 * u - 1.0) * a);
            ck_assert_msg(got[r * K + c] == want, "(%lld, %lld): %g vs %g", (long long)r,
                          (long long)c, got[r * K + c], want);
        }
    }
    free(got);
    /* A vector (a bias, or a row-split slice of one) is N rows of one
     * column to the host generator: element r is (row0 + r, col0). */
    dit_tensor v = dit_tensor_1d(buf, DIT_F32, N);
    GPU_OK(GPU, GPU->ops->init_uniform(GPU, &v, base, row0, col0, a));
    got = gpu_fetch(GPU, &v);
    for (int64_t r = 0; r < N; r++) {
        uint64_t s = base + (uint64_t)(row0 + r) * 0x2545f4914f6cdd1dull +
                     (uint64_t)(col0 + 1) * 0x9e3779b97f4a7c15ull;
        double u = (double)(mix64(s) >> 11) * 0x1.0p-53;
        float want = (float)((2.0 * u - 1.0) * a);
        ck_assert_msg(got[r] == want, "vector (%lld): %g vs %g", (long long)r, got[r], want);
    }
    free(got);
    dit_backend_free(GPU, buf);
}
END_TEST

/* ---- linear -------------------------------------------------------------- */

typedef struct lin_case {
    int64_t B, M, K, N;
    bool strided; /* x and y as column slices of wider buffers */
} lin_case;

static const lin_case lin_cases[] = {
    {1, 1, 16, 8, false},   {1, 37, 64, 96, false}, {1, 130, 256, 200, true},
    {3, 17, 48, 40, false}, {2, 33, 96, 72, true},  {1, 5, 7, 3, false},
};

enum { N_LIN = sizeof lin_cases / sizeof lin_cases[0] };

/* Each case in the three GEMM modes (cuda_backend.h): as planned, forced
 * without fused epilogues (what a heuristic miss on the epilogue runs), and
 * forced onto the fallback kernel (what a miss on the shape runs). */
START_TEST(linear_matches_cpu)
{
    const lin_case *lc = &lin_cases[_i % N_LIN];
    const dit_cuda_gemm_force force = (dit_cuda_gemm_force)(_i / N_LIN);
    GPU_OK(GPU, dit_cuda_backend_force_gemm(GPU, force));
    dit_cuda_stats st0, st1;
    dit_cuda_backend_stats(GPU, &st0);
    uint64_t calls = 0, epilogue_calls = 0;
    test_rng r = {200 + (uint64_t)(_i % N_LIN)};
    const int64_t B = lc->B, M = lc->M, K = lc->K, N = lc->N;
    const int64_t pad = lc->strided ? 24 : 0; /* extra columns around the views */
    const int64_t xs[3] = {B, M, K + pad}, ys[3] = {B, M, N + pad}, ws[2] = {N, K};
    float *hx = gpu_rand(&r, (size_t)(B * M * (K + pad)), -1, 1, true);
    float *hw = gpu_rand(&r, (size_t)(N * K), -0.25f, 0.25f, true);
    float *hb = gpu_rand(&r, (size_t)N, -0.5f, 0.5f, false);
    float *hy = gpu_rand(&r, (size_t)(B * M * (N + pad)), -1, 1, false);
    gpu_pair x = gpu_pair_make(CPU, GPU, DIT_F32, 3, xs, hx);
    gpu_pair w = gpu_pair_make(CPU, GPU, GPU->ops->weight_dtype, 2, ws, hw);
    gpu_pair bias = gpu_pair_make(CPU, GPU, DIT_F32, 1, &N, hb);
    const dit_act acts[] = {DIT_ACT_NONE, DIT_ACT_GELU_TANH, DIT_ACT_SILU, DIT_ACT_GELU_ERF,
                            DIT_ACT_QUICK_GELU};
    for (int fused = 0; fused < 2; fused++) {
        dit_cuda_backend_set_lt_gelu(GPU, fused == 1);
        for (size_t ai = 0; ai < sizeof acts / sizeof acts[0]; ai++) {
            for (int with_bias = 0; with_bias < 2; with_bias++) {
                for (int bi = 0; bi < 2; bi++) {
                    const float beta = bi ? 1.0f : 0.0f;
                    if (beta != 0.0f && acts[ai] != DIT_ACT_NONE)
                        continue;
                    gpu_pair y = gpu_pair_make(CPU, GPU, DIT_F32, 3, ys, hy);
                    dit_tensor xc = dit_tensor_narrow(&x.c, 2, pad / 2, K);
                    dit_tensor xg = dit_tensor_narrow(&x.g, 2, pad / 2, K);
                    dit_tensor yc = dit_tensor_narrow(&y.c, 2, pad / 3, N);
                    dit_tensor yg = dit_tensor_narrow(&y.g, 2, pad / 3, N);
                    if (B == 1) { /* also the 2-D form */
                        xc = dit_tensor_2d(xc.data, DIT_F32, M, K);
                        xc.nb[0] = x.c.nb[1];
                        xg = dit_tensor_2d(xg.data, DIT_F32, M, K);
                        xg.nb[0] = x.g.nb[1];
                        yc = dit_tensor_2d(yc.data, DIT_F32, M, N);
                        yc.nb[0] = y.c.nb[1];
                        yg = dit_tensor_2d(yg.data, DIT_F32, M, N);
                        yg.nb[0] = y.g.nb[1];
                    }
                    GPU_OK(CPU, CPU->ops->linear(CPU, &yc, &xc, &w.c, with_bias ? &bias.c : NULL,
                                                 acts[ai], beta));
                    GPU_OK(GPU, GPU->ops->linear(GPU, &yg, &xg, &w.g, with_bias ? &bias.g : NULL,
                                                 acts[ai], beta));
                    if (K > 0) {
                        const int64_t gemms = B > 1 && !(yg.nb[0] == M * yg.nb[1]) ? B : 1;
                        calls += (uint64_t)gemms;
                        if (with_bias || (fused && acts[ai] == DIT_ACT_GELU_TANH))
                            epilogue_calls += (uint64_t)gemms;
                    }
                    char what[160];
                    snprintf(what, sizeof what,
                             "linear B%lld M%lld K%lld N%lld act %d bias %d "
                             "beta %g lt_gelu %d gemm mode %d",
                             (long long)B, (long long)M, (long long)K, (long long)N, (int)acts[ai],
                             with_bias, beta, fused, (int)force);
                    const double atol = fused && acts[ai] == DIT_ACT_GELU_TANH ? 2e-3 : 1e-4;
                    /* The whole buffer: the columns outside the view must be untouched. */
                    ck_assert_int_eq(gpu_compare_views(what, CPU, &y.c, GPU, &y.g, atol, 1e-4), 0);
                    gpu_pair_free(CPU, GPU, &y);
                }
            }
        }
    }
    dit_cuda_backend_set_lt_gelu(GPU, true);
    dit_cuda_backend_stats(GPU, &st1);
    printf("linear B%lld M%lld K%lld N%lld mode %d: %llu GEMMs, %llu unfused, %llu fallback\n",
           (long long)B, (long long)M, (long long)K, (long long)N, (int)force,
           (unsigned long long)(st1.gemm_calls - st0.gemm_calls),
           (unsigned long long)(st1.gemm_unfused_calls - st0.gemm_unfused_calls),
           (unsigned long long)(st1.gemm_fallback_calls - st0.gemm_fallback_calls));
    ck_assert_uint_eq(st1.gemm_calls - st0.gemm_calls, calls);
    if (force == DIT_CUDA_GEMM_FALLBACK)
        ck_assert_uint_eq(st1.gemm_fallback_calls - st0.gemm_fallback_calls, calls);
    if (force == DIT_CUDA_GEMM_NO_EPILOGUE) {
        /* Every call with an epilogue ran unfused, unless its shape has no
         * cuBLASLt algorithm at all (then it fell back, as in AUTO). */
        const uint64_t unf = st1.gemm_unfused_calls - st0.gemm_unfused_calls;
        const uint64_t fb = st1.gemm_fallback_calls - st0.gemm_fallback_calls;
        ck_assert_uint_le(unf, epilogue_calls);
        ck_assert_uint_ge(unf + fb, epilogue_calls);
    }
    GPU_OK(GPU, dit_cuda_backend_force_gemm(GPU, DIT_CUDA_GEMM_AUTO));
    gpu_pair_free(CPU, GPU, &x);
    gpu_pair_free(CPU, GPU, &w);
    gpu_pair_free(CPU, GPU, &bias);
    free(hx);
    free(hw);
    free(hb);
    free(hy);
}
END_TEST

/* ---- the fast path's bf16 operands ------------------------------------- */

/* What DIT_CUDA_PATH=fast runs (backend.h, operand_dtype): linear reading
 * bf16 x in place (column slices, batches that fold and that do not) and
 * writing bf16 y with bias and fused GELU; layer_norm_mod and
 * rms_norm_rope_to writing bf16; attention on bf16 q, k, v writing f32 or
 * bf16. The cpu backend computes the same in f32 from the same (bf16-exact)
 * inputs; a bf16 result adds its own rounding, 2^-9 relative: rtol 4e-3
 * more than the f32 form's tolerance. */
START_TEST(bf16_operands_match_cpu)
{
    test_rng r = {1300};
    /* linear */
    for (int v = 0; v < 4; v++) {
        const int64_t B = 2, M = 21, K = 64, N = 48, pad = 16;
        const bool y_bf16 = v & 1, fold = v & 2;
        const int64_t xs[3] = {B, M, K + pad}, ys[3] = {B, M, N}, ws[2] = {N, K};
        float *hx = gpu_rand(&r, (size_t)(B * M * (K + pad)), -1, 1, true);
        float *hw = gpu_rand(&r, (size_t)(N * K), -0.25f, 0.25f, true);
        float *hb = gpu_rand(&r, (size_t)N, -0.5f, 0.5f, false);
        gpu_pair x = gpu_pair_make(CPU, GPU, DIT_BF16, 3, xs, hx);
        gpu_pair w = gpu_pair_make(CPU, GPU, GPU->ops->weight_dtype, 2, ws, hw);
        gpu_pair bias = gpu_pair_make(CPU, GPU, DIT_F32, 1, &N, hb);
        gpu_pair y = gpu_pair_make(CPU, GPU, y_bf16 ? DIT_BF16 : DIT_F32, 3, ys, NULL);
        /* fold: x's rows evenly spaced over the batch (all K + pad columns
         * but the view's K); otherwise a batch stride of its own. */
        dit_tensor xc = dit_tensor_narrow(&x.c, 2, pad / 2, K),
                   xg = dit_tensor_narrow(&x.g, 2, pad / 2, K);
        if (!fold) {
            xc = dit_tensor_narrow(&xc, 1, 1, M - 1);
            xg = dit_tensor_narrow(&xg, 1, 1, M - 1);
        }
        dit_tensor yc = y.c, yg = y.g;
        if (!fold) {
            yc = dit_tensor_narrow(&yc, 1, 0, M - 1);
            yg = dit_tensor_narrow(&yg, 1, 0, M - 1);
        }
        for (int act = 0; act < 2; act++) {
            const dit_act a = act ? DIT_ACT_GELU_TANH : DIT_ACT_NONE;
            GPU_OK(CPU, CPU->ops->linear(CPU, &yc, &xc, &w.c, &bias.c, a, 0.0f));
            GPU_OK(GPU, GPU->ops->linear(GPU, &yg, &xg, &w.g, &bias.g, a, 0.0f));
            char what[96];
            snprintf(what, sizeof what, "linear bf16 x, %s y, fold %d, act %d",
                     y_bf16 ? "bf16" : "f32", (int)fold, act);
            ck_assert_int_eq(gpu_compare_views(what, CPU, &yc, GPU, &yg, act ? 2e-3 : 1e-4,
                                               (y_bf16 ? 4e-3 : 0) + 1e-4),
                             0);
        }
        if (y_bf16) /* beta needs an f32 y */
            ck_assert_int_eq(GPU->ops->linear(GPU, &yg, &xg, &w.g, NULL, DIT_ACT_NONE, 1.0f),
                             DIT_ERR_INVALID_ARG);
        gpu_pair_free(CPU, GPU, &x);
        gpu_pair_free(CPU, GPU, &w);
        gpu_pair_free(CPU, GPU, &bias);
        gpu_pair_free(CPU, GPU, &y);
        free(hx);
        free(hw);
        free(hb);
    }
    /* layer_norm_mod into bf16 */
    {
        const int64_t B = 2, S = 17, C = 96, sh[3] = {B, S, C}, shv[2] = {B, C};
        float *hx = gpu_rand(&r, (size_t)(B * S * C), -2, 2, false);
        float *hs = gpu_rand(&r, (size_t)(B * C), -1, 1, false);
        float *hc = gpu_rand(&r, (size_t)(B * C), -1, 1, false);
        gpu_pair x = gpu_pair_make(CPU, GPU, DIT_F32, 3, sh, hx);
        gpu_pair shift = gpu_pair_make(CPU, GPU, DIT_F32, 2, shv, hs);
        gpu_pair scale = gpu_pair_make(CPU, GPU, DIT_F32, 2, shv, hc);
        gpu_pair y = gpu_pair_make(CPU, GPU, DIT_BF16, 3, sh, NULL);
        GPU_OK(CPU, CPU->ops->layer_norm_mod(CPU, &y.c, &x.c, &shift.c, &scale.c, 1e-6f));
        GPU_OK(GPU, GPU->ops->layer_norm_mod(GPU, &y.g, &x.g, &shift.g, &scale.g, 1e-6f));
        ck_assert_int_eq(
            gpu_compare_views("layer_norm_mod -> bf16", CPU, &y.c, GPU, &y.g, 2e-5, 4e-3), 0);
        gpu_pair_free(CPU, GPU, &x);
        gpu_pair_free(CPU, GPU, &shift);
        gpu_pair_free(CPU, GPU, &scale);
        gpu_pair_free(CPU, GPU, &y);
        free(hx);
        free(hs);
        free(hc);
    }
    /* rms_norm_rope_to, f32 and bf16 outputs, from a fused projection's
     * head view into another's (the fast path's y -> qkvb). */
    {
        const int64_t B = 1, S = 19, H = 3, D = 64;
        const int64_t shx[3] = {B, S, 2 * H * D}, shy[3] = {B, S, 3 * H * D}, shc[2] = {S, D};
        float *hx = gpu_rand(&r, (size_t)(B * S * 2 * H * D), -2, 2, false);
        float *hw = gpu_rand(&r, (size_t)D, 0.5f, 1.5f, false);
        float *hcos = gpu_rand(&r, (size_t)(S * D), -1, 1, false);
        float *hsin = gpu_rand(&r, (size_t)(S * D), -1, 1, false);
        gpu_pair w = gpu_pair_make(CPU, GPU, DIT_F32, 1, &D, hw);
        gpu_pair cs = gpu_pair_make(CPU, GPU, DIT_F32, 2, shc, hcos);
        gpu_pair sn = gpu_pair_make(CPU, GPU, DIT_F32, 2, shc, hsin);
        for (int ybf = 0; ybf < 2; ybf++) {
            gpu_pair x = gpu_pair_make(CPU, GPU, DIT_F32, 3, shx, hx);
            gpu_pair y = gpu_pair_make(CPU, GPU, ybf ? DIT_BF16 : DIT_F32, 3, shy, NULL);
            dit_tensor fx = dit_tensor_narrow(&x.c, 2, H * D, H * D);
            dit_tensor kc = dit_tensor_split_last(&fx, D);
            fx = dit_tensor_narrow(&x.g, 2, H * D, H * D);
            dit_tensor kg = dit_tensor_split_last(&fx, D);
            dit_tensor fy = dit_tensor_narrow(&y.g, 2, H * D, H * D);
            dit_tensor og = dit_tensor_split_last(&fy, D);
            GPU_OK(CPU, CPU->ops->rms_norm_rope(CPU, &kc, &w.c, 1e-6f, &cs.c, &sn.c));
            GPU_OK(GPU, GPU->ops->rms_norm_rope_to(GPU, &og, &kg, &w.g, 1e-6f, &cs.g, &sn.g));
            ck_assert_int_eq(
                gpu_compare_views(ybf ? "rms_norm_rope_to bf16" : "rms_norm_rope_to f32", CPU, &kc,
                                  GPU, &og, 2e-5, ybf ? 4e-3 : 2e-5),
                0);
            /* x itself is left alone. */
            float *xin = gpu_fetch(GPU, &x.g);
            ck_assert(memcmp(xin, hx, sizeof(float) * (size_t)(B * S * 2 * H * D)) == 0);
            free(xin);
            gpu_pair_free(CPU, GPU, &x);
            gpu_pair_free(CPU, GPU, &y);
        }
        gpu_pair_free(CPU, GPU, &w);
        gpu_pair_free(CPU, GPU, &cs);
        gpu_pair_free(CPU, GPU, &sn);
        free(hx);
        free(hw);
        free(hcos);
        free(hsin);
    }
    /* attention on bf16 q, k, v (views of a fused bf16 projection), out f32
     * and bf16, at head dims 128 (tensor cores) and 16 (f32 kernel). */
    for (int v = 0; v < 4; v++) {
        const int64_t B = 1, Sq = 97, H = 2, D = v & 2 ? 16 : 128;
        const bool out_bf16 = v & 1;
        const int64_t shp[3] = {B, Sq, 3 * H * D}, sho[3] = {B, Sq, H * D}, shl[3] = {B, H, Sq};
        float *hp = gpu_rand(&r, (size_t)(B * Sq * 3 * H * D), -2, 2, true);
        gpu_pair p = gpu_pair_make(CPU, GPU, DIT_BF16, 3, shp, hp);
        gpu_pair o = gpu_pair_make(CPU, GPU, out_bf16 ? DIT_BF16 : DIT_F32, 3, sho, NULL);
        gpu_pair l = gpu_pair_make(CPU, GPU, DIT_F32, 3, shl, NULL);
        dit_tensor q[2], k[2], vv[2], out[2];
        const dit_tensor *pb[2] = {&p.c, &p.g}, *ob[2] = {&o.c, &o.g};
        for (int s = 0; s < 2; s++) {
            qkv_views(pb[s], pb[s], H, D, &q[s], &k[s], &vv[s]);
            out[s] = dit_tensor_split_last(ob[s], D);
        }
        const float scale = 1.0f / sqrtf((float)D);
        GPU_OK(CPU, CPU->ops->attention(CPU, &out[0], &l.c, &q[0], &k[0], &vv[0], scale));
        GPU_OK(GPU, GPU->ops->attention(GPU, &out[1], &l.g, &q[1], &k[1], &vv[1], scale));
        char what[96];
        snprintf(what, sizeof what, "attention bf16 q/k/v D%lld -> %s", (long long)D,
                 out_bf16 ? "bf16" : "f32");
        const double tol = (D == 128 ? 4e-3 : 1e-4) + (out_bf16 ? 4e-3 : 0);
        ck_assert_int_eq(gpu_compare_views(what, CPU, &o.c, GPU, &o.g, tol, tol), 0);
        ck_assert_int_eq(gpu_compare_views("lse (bf16 q/k/v)", CPU, &l.c, GPU, &l.g, 1e-4, 1e-5),
                         0);
        gpu_pair_free(CPU, GPU, &p);
        gpu_pair_free(CPU, GPU, &o);
        gpu_pair_free(CPU, GPU, &l);
        free(hp);
    }
}
END_TEST

/* ---- row ops ------------------------------------------------------------- */

START_TEST(activate_matches_cpu)
{
    test_rng r = {300};
    const int64_t sh[3] = {2, 13, 70};
    float *h = gpu_rand(&r, 2 * 13 * 70, -6, 6, false);
    const dit_act acts[] = {DIT_ACT_NONE, DIT_ACT_GELU_TANH, DIT_ACT_SILU, DIT_ACT_GELU_ERF,
                            DIT_ACT_QUICK_GELU};
    for (size_t ai = 0; ai < 5; ai++) {
        gpu_pair x = gpu_pair_make(CPU, GPU, DIT_F32, 3, sh, h);
        dit_tensor vc = dit_tensor_narrow(&x.c, 2, 10, 50), vg = dit_tensor_narrow(&x.g, 2, 10, 50);
        GPU_OK(CPU, CPU->ops->activate(CPU, &vc, &vc, acts[ai]));
        GPU_OK(GPU, GPU->ops->activate(GPU, &vg, &vg, acts[ai]));
        ck_assert_int_eq(gpu_compare_views("activate", CPU, &x.c, GPU, &x.g, 2e-5, 2e-5), 0);
        gpu_pair_free(CPU, GPU, &x);
    }
    free(h);
}
END_TEST

START_TEST(norms_match_cpu)
{
    test_rng r = {400};
    const int64_t B = 2, S = 33, C = 96;
    const int64_t sh[3] = {B, S, C}, shv[2] = {B, C};
    float *hx = gpu_rand(&r, (size_t)(B * S * C), -3, 5, false);
    float *hs = gpu_rand(&r, (size_t)(B * C), -1, 1, false);
    float *hc = gpu_rand(&r, (size_t)(B * C), -1, 1, false);
    float *hw = gpu_rand(&r, (size_t)C, 0.5f, 1.5f, false);
    gpu_pair shift = gpu_pair_make(CPU, GPU, DIT_F32, 2, shv, hs);
    gpu_pair scale = gpu_pair_make(CPU, GPU, DIT_F32, 2, shv, hc);
    gpu_pair w = gpu_pair_make(CPU, GPU, DIT_F32, 1, &C, hw);
    gpu_pair bias = gpu_pair_make(CPU, GPU, DIT_F32, 1, &C, hs);
    for (int v = 0; v < 4; v++) {
        gpu_pair x = gpu_pair_make(CPU, GPU, DIT_F32, 3, sh, hx);
        gpu_pair y = gpu_pair_make(CPU, GPU, DIT_F32, 3, sh, NULL);
        const dit_tensor *sc = v & 1 ? &shift.c : NULL, *sg = v & 1 ? &shift.g : NULL;
        const dit_tensor *cc = v & 2 ? &scale.c : NULL, *cg = v & 2 ? &scale.g : NULL;
        GPU_OK(CPU, CPU->ops->layer_norm_mod(CPU, &y.c, &x.c, sc, cc, 1e-6f));
        GPU_OK(GPU, GPU->ops->layer_norm_mod(GPU, &y.g, &x.g, sg, cg, 1e-6f));
        ck_assert_int_eq(gpu_compare_views("layer_norm_mod", CPU, &y.c, GPU, &y.g, 2e-5, 2e-5), 0);
        /* In place (y aliases x). */
        GPU_OK(CPU, CPU->ops->layer_norm_mod(CPU, &x.c, &x.c, sc, cc, 1e-6f));
        GPU_OK(GPU, GPU->ops->layer_norm_mod(GPU, &x.g, &x.g, sg, cg, 1e-6f));
        ck_assert_int_eq(
            gpu_compare_views("layer_norm_mod alias", CPU, &x.c, GPU, &x.g, 2e-5, 2e-5), 0);
        gpu_pair_free(CPU, GPU, &x);
        x = gpu_pair_make(CPU, GPU, DIT_F32, 3, sh, hx);
        GPU_OK(CPU, CPU->ops->layer_norm(CPU, &y.c, &x.c, v & 1 ? &w.c : NULL,
                                         v & 2 ? &bias.c : NULL, 1e-5f));
        GPU_OK(GPU, GPU->ops->layer_norm(GPU, &y.g, &x.g, v & 1 ? &w.g : NULL,
                                         v & 2 ? &bias.g : NULL, 1e-5f));
        ck_assert_int_eq(gpu_compare_views("layer_norm", CPU, &y.c, GPU, &y.g, 2e-5, 2e-5), 0);
        GPU_OK(CPU, CPU->ops->rms_norm(CPU, &y.c, &x.c, &w.c, 1e-6f));
        GPU_OK(GPU, GPU->ops->rms_norm(GPU, &y.g, &x.g, &w.g, 1e-6f));
        ck_assert_int_eq(gpu_compare_views("rms_norm", CPU, &y.c, GPU, &y.g, 2e-5, 2e-5), 0);
        gpu_pair_free(CPU, GPU, &x);
        gpu_pair_free(CPU, GPU, &y);
    }
    gpu_pair_free(CPU, GPU, &shift);
    gpu_pair_free(CPU, GPU, &scale);
    gpu_pair_free(CPU, GPU, &w);
    gpu_pair_free(CPU, GPU, &bias);
    free(hx);
    free(hs);
    free(hc);
    free(hw);
}
END_TEST

static const int64_t head_dims[] = {16, 64, 128};

START_TEST(rms_norm_rope_matches_cpu)
{
    test_rng r = {500 + (uint64_t)_i};
    const int64_t B = 2, S = 19, H = 3, D = head_dims[_i];
    /* q as the first H*D columns of a (B, S, 3 H D) projection, like flux. */
    const int64_t sh[3] = {B, S, 3 * H * D}, shc[2] = {S, D};
    float *hx = gpu_rand(&r, (size_t)(B * S * 3 * H * D), -2, 2, false);
    float *hw = gpu_rand(&r, (size_t)D, 0.5f, 1.5f, false);
    float *hcos = gpu_rand(&r, (size_t)(S * D), -1, 1, false);
    float *hsin = gpu_rand(&r, (size_t)(S * D), -1, 1, false);
    gpu_pair w = gpu_pair_make(CPU, GPU, DIT_F32, 1, &D, hw);
    gpu_pair cs = gpu_pair_make(CPU, GPU, DIT_F32, 2, shc, hcos);
    gpu_pair sn = gpu_pair_make(CPU, GPU, DIT_F32, 2, shc, hsin);
    for (int v = 0; v < 4; v++) {
        gpu_pair x = gpu_pair_make(CPU, GPU, DIT_F32, 3, sh, hx);
        dit_tensor fc = dit_tensor_narrow(&x.c, 2, H * D, H * D);
        dit_tensor fg = dit_tensor_narrow(&x.g, 2, H * D, H * D);
        dit_tensor qc = dit_tensor_split_last(&fc, D), qg = dit_tensor_split_last(&fg, D);
        GPU_OK(CPU, CPU->ops->rms_norm_rope(CPU, &qc, v & 1 ? &w.c : NULL, 1e-6f,
                                            v & 2 ? &cs.c : NULL, v & 2 ? &sn.c : NULL));
        GPU_OK(GPU, GPU->ops->rms_norm_rope(GPU, &qg, v & 1 ? &w.g : NULL, 1e-6f,
                                            v & 2 ? &cs.g : NULL, v & 2 ? &sn.g : NULL));
        ck_assert_int_eq(gpu_compare_views("rms_norm_rope", CPU, &x.c, GPU, &x.g, 2e-5, 2e-5), 0);
        gpu_pair_free(CPU, GPU, &x);
    }
    gpu_pair_free(CPU, GPU, &w);
    gpu_pair_free(CPU, GPU, &cs);
    gpu_pair_free(CPU, GPU, &sn);
    free(hx);
    free(hw);
    free(hcos);
    free(hsin);
}
END_TEST

START_TEST(gated_add_matches_cpu)
{
    test_rng r = {600};
    const int64_t B = 2, S = 21, C = 40;
    const int64_t sh[3] = {B, S, C}, shv[2] = {B, 3 * C};
    float *hr = gpu_rand(&r, (size_t)(B * S * C), -1, 1, false);
    float *hx = gpu_rand(&r, (size_t)(B * S * C), -1, 1, false);
    float *hg = gpu_rand(&r, (size_t)(B * 3 * C), -1, 1, false);
    gpu_pair gate = gpu_pair_make(CPU, GPU, DIT_F32, 2, shv, hg);
    dit_tensor gc = dit_tensor_narrow(&gate.c, 1, C, C), gg = dit_tensor_narrow(&gate.g, 1, C, C);
    for (int v = 0; v < 2; v++) {
        gpu_pair res = gpu_pair_make(CPU, GPU, DIT_F32, 3, sh, hr);
        gpu_pair x = gpu_pair_make(CPU, GPU, DIT_F32, 3, sh, hx);
        GPU_OK(CPU, CPU->ops->gated_add(CPU, &res.c, &x.c, v ? &gc : NULL));
        GPU_OK(GPU, GPU->ops->gated_add(GPU, &res.g, &x.g, v ? &gg : NULL));
        ck_assert_int_eq(gpu_compare_views("gated_add", CPU, &res.c, GPU, &res.g, 2e-6, 2e-6), 0);
        gpu_pair_free(CPU, GPU, &res);
        gpu_pair_free(CPU, GPU, &x);
    }
    gpu_pair_free(CPU, GPU, &gate);
    free(hr);
    free(hx);
    free(hg);
}
END_TEST

START_TEST(embedding_matches_cpu)
{
    test_rng r = {700};
    const int64_t V = 50, C = 24, n = 13;
    const int64_t sht[2] = {V, C}, shy[2] = {n, C};
    float *ht = gpu_rand(&r, (size_t)(V * C), -1, 1, true);
    int32_t ids[13];
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)(test_rng_next(&r) % (uint64_t)V);
    gpu_pair t = gpu_pair_make(CPU, GPU, GPU->ops->weight_dtype, 2, sht, ht);
    gpu_pair y = gpu_pair_make(CPU, GPU, DIT_F32, 2, shy, NULL);
    GPU_OK(CPU, CPU->ops->embedding(CPU, &y.c, &t.c, ids, n));
    GPU_OK(GPU, GPU->ops->embedding(GPU, &y.g, &t.g, ids, n));
    ck_assert_int_eq(gpu_compare_views("embedding", CPU, &y.c, GPU, &y.g, 0, 0), 0);
    ids[3] = (int32_t)V; /* out of range: an error, not a crash */
    ck_assert_int_eq(GPU->ops->embedding(GPU, &y.g, &t.g, ids, n), DIT_ERR_INVALID_ARG);
    gpu_pair_free(CPU, GPU, &t);
    gpu_pair_free(CPU, GPU, &y);
    free(ht);
}
END_TEST

/* T5's position bias: the same table and buckets on both backends give the
 * same values exactly (a gather), square and with keys narrowed; a bucket
 * outside the table is an error. */
START_TEST(relative_bias_matches_cpu)
{
    test_rng r = {750};
    const int64_t H = 6, NB = 32, S = 77;
    const int64_t sht[2] = {NB, H};
    float *ht = gpu_rand(&r, (size_t)(NB * H), -3, 3, false);
    int32_t bk[2 * 77 - 1];
    for (int64_t i = 0; i < 2 * S - 1; i++)
        bk[i] = (int32_t)(test_rng_next(&r) % (uint64_t)NB);
    gpu_pair t = gpu_pair_make(CPU, GPU, DIT_F32, 2, sht, ht);
    for (int64_t skv = S; skv >= 20; skv -= S - 20) {
        const int64_t shy[3] = {H, S, skv};
        gpu_pair y = gpu_pair_make(CPU, GPU, DIT_F32, 3, shy, NULL);
        GPU_OK(CPU, CPU->ops->relative_bias(CPU, &y.c, &t.c, bk));
        GPU_OK(GPU, GPU->ops->relative_bias(GPU, &y.g, &t.g, bk));
        ck_assert_int_eq(gpu_compare_views("relative_bias", CPU, &y.c, GPU, &y.g, 0, 0), 0);
        if (skv == S) {
            bk[5] = (int32_t)NB;
            ck_assert_int_eq(GPU->ops->relative_bias(GPU, &y.g, &t.g, bk), DIT_ERR_INVALID_ARG);
            bk[5] = 0;
        }
        gpu_pair_free(CPU, GPU, &y);
    }
    gpu_pair_free(CPU, GPU, &t);
    free(ht);
}
END_TEST

/* ---- attention ----------------------------------------------------------- */

typedef struct attn_case {
    int64_t B, Sq, Skv, H, D;
    float qscale; /* larger scores: peaked softmax */
} attn_case;

static const attn_case attn_cases[] = {
    {1, 1, 1, 1, 16, 1},      {2, 37, 53, 3, 16, 1},  {1, 130, 70, 2, 64, 1},
    {1, 200, 333, 2, 128, 1}, {2, 64, 64, 1, 128, 4}, {1, 65, 129, 3, 64, 3},
    {1, 9, 0, 2, 64, 1},      {1, 45, 17, 2, 32, 1},  {1, 77, 91, 2, 80, 2},
    {1, 97, 130, 1, 384, 2},  {1, 70, 45, 1, 512, 1}, /* wide heads: four queries a warp */
};

START_TEST(attention_matches_cpu)
{
    const attn_case *ac = &attn_cases[_i];
    test_rng r = {800 + (uint64_t)_i};
    const int64_t B = ac->B, Sq = ac->Sq, Skv = ac->Skv, H = ac->H, D = ac->D;
    const bool fast = D == 64 || D == 128;
    /* q, k, v as head views of fused (B, S, 3 H D) projections, like flux. */
    const int64_t shq[3] = {B, Sq, 3 * H * D}, shk[3] = {B, Skv, 3 * H * D};
    const int64_t sho[3] = {B, Sq, H * D}, shl[3] = {B, H, Sq};
    float *hq = gpu_rand(&r, (size_t)(B * Sq * 3 * H * D), -ac->qscale, ac->qscale, fast);
    float *hk = gpu_rand(&r, (size_t)(B * Skv * 3 * H * D), -1, 1, fast);
    gpu_pair qa = gpu_pair_make(CPU, GPU, DIT_F32, 3, shq, hq);
    gpu_pair ka = gpu_pair_make(CPU, GPU, DIT_F32, 3, shk, hk);
    for (int with_lse = 0; with_lse < 2; with_lse++) {
        gpu_pair o = gpu_pair_make(CPU, GPU, DIT_F32, 3, sho, NULL);
        gpu_pair l = gpu_pair_make(CPU, GPU, DIT_F32, 3, shl, NULL);
        dit_tensor q[2], k[2], v[2], out[2];
        const dit_tensor *qb[2] = {&qa.c, &qa.g}, *kb[2] = {&ka.c, &ka.g};
        const dit_tensor *ob[2] = {&o.c, &o.g};
        for (int s = 0; s < 2; s++) {
            qkv_views(qb[s], kb[s], H, D, &q[s], &k[s], &v[s]);
            out[s] = dit_tensor_split_last(ob[s], D);
        }
        const float scale = 1.0f / sqrtf((float)D);
        GPU_OK(CPU, CPU->ops->attention(CPU, &out[0], with_lse ? &l.c : NULL, &q[0], &k[0], &v[0],
                                        scale));
        GPU_OK(GPU, GPU->ops->attention(GPU, &out[1], with_lse ? &l.g : NULL, &q[1], &k[1], &v[1],
                                        scale));
        char what[128];
        snprintf(what, sizeof what, "attention B%lld Sq%lld Skv%lld H%lld D%lld lse %d",
                 (long long)B, (long long)Sq, (long long)Skv, (long long)H, (long long)D, with_lse);
        ck_assert_int_eq(
            gpu_compare_views(what, CPU, &o.c, GPU, &o.g, fast ? 4e-3 : 2e-5, fast ? 4e-3 : 1e-4),
            0);
        if (with_lse)
            ck_assert_int_eq(
                gpu_compare_views("lse", CPU, &l.c, GPU, &l.g, fast ? 1e-4 : 2e-5, 1e-5), 0);
        gpu_pair_free(CPU, GPU, &o);
        gpu_pair_free(CPU, GPU, &l);
    }
    gpu_pair_free(CPU, GPU, &qa);
    gpu_pair_free(CPU, GPU, &ka);
    free(hq);
    free(hk);
}
END_TEST

/* A fused (S, 3 H D) q|k|v projection of random bf16-exact values, q
 * scaled up 3x: scores of a few units, a softmax that is neither flat nor
 * one-hot, like normalised q/k after RMSNorm. */
static float *flux_proj(test_rng *r, int64_t S, int64_t H, int64_t D)
{
    float *hp = gpu_rand(r, (size_t)(S * 3 * H * D), -1, 1, true);
    for (int64_t t = 0; t < S; t++)
        for (int64_t c = 0; c < H * D; c++)
            hp[t * 3 * H * D + c] = dit_bf16_to_f32(dit_f32_to_bf16(3.0f * hp[t * 3 * H * D + c]));
    return hp;
}

/* Max |a - b| over n values (a NaN anywhere: infinity) and max |a|. */
static double max_abs_diff(const float *a, const float *b, size_t n)
{
    double e = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - b[i]);
        e = isnan(d) ? INFINITY : fmax(e, d);
    }
    return e;
}

static double max_abs(const float *a, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        m = fmax(m, fabs(a[i]));
    return m;
}

/* Max |error| over `rows` random (query, head) rows of n_out outputs ho[k]
 * (each (S, H, D), batch 1) against float64 attention of flux_proj's hp,
 * into e64[k]. */
static void flux_f64_rows(test_rng *r, const float *hp, int64_t S, int64_t H, int64_t D, int rows,
                          float *const *ho, int n_out, double *e64)
{
    double *p = malloc((size_t)S * sizeof *p);
    ck_assert_ptr_nonnull(p);
    for (int k = 0; k < n_out; k++)
        e64[k] = 0;
    for (int t = 0; t < rows; t++) {
        const int64_t i = (int64_t)(test_rng_next(r) % (uint64_t)S);
        const int64_t h = (int64_t)(test_rng_next(r) % (uint64_t)H);
        const float *qi = hp + i * 3 * H * D + h * D;
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < S; j++) {
            const float *kj = hp + j * 3 * H * D + H * D + h * D;
            double acc = 0;
            for (int64_t d = 0; d < D; d++)
                acc += (double)qi[d] * kj[d];
            p[j] = acc / sqrt((double)D);
            mx = fmax(mx, p[j]);
        }
        for (int64_t j = 0; j < S; j++) {
            p[j] = exp(p[j] - mx);
            sum += p[j];
        }
        for (int64_t d = 0; d < D; d++) {
            double o = 0;
            for (int64_t j = 0; j < S; j++)
                o += p[j] * hp[j * 3 * H * D + 2 * H * D + h * D + d];
            o /= sum;
            for (int k = 0; k < n_out; k++)
                e64[k] = fmax(e64[k], fabs(o - ho[k][(i * H + h) * D + d]));
        }
    }
    free(p);
}

/* FLUX.1-dev's attention at 1024 x 1024: B 1, S 4096 + 512, H 24, D 128,
 * q/k/v as head views of the fused (S, 3 H D) projection. Too large for
 * the cpu backend here, so the tensor-core kernel is compared with the f32
 * CUDA-core kernel on the same device (bf16-exact inputs: the difference is
 * P's rounding to bf16, as in attention_matches_cpu), and 48 (query, head)
 * rows of both with a float64 host reference. */
START_TEST(flux_size_attention_matches_f32_kernel)
{
    const int64_t B = 1, S = 4608, H = 24, D = 128;
    test_rng r = {4608};
    const int64_t shp[3] = {B, S, 3 * H * D}, sho[3] = {B, S, H * D}, shl[3] = {B, H, S};
    const size_t np = (size_t)(B * S * 3 * H * D), no = (size_t)(B * S * H * D);
    float *hp = flux_proj(&r, S, H, D);
    void *pbuf = NULL, *obuf[2] = {NULL, NULL}, *lbuf[2] = {NULL, NULL};
    GPU_OK(GPU, dit_backend_alloc(GPU, np * 4, &pbuf));
    dit_tensor proj = dit_tensor_make(pbuf, DIT_F32, 3, shp);
    dit_tensor hproj = dit_tensor_make(hp, DIT_F32, 3, shp);
    GPU_OK(GPU, GPU->ops->upload(GPU, &proj, &hproj));
    dit_tensor q, k, v;
    qkv_views(&proj, &proj, H, D, &q, &k, &v);
    dit_tensor out[2], lse[2];
    float *ho[2], *hl[2];
    for (int f32 = 0; f32 < 2; f32++) {
        GPU_OK(GPU, dit_backend_alloc(GPU, no * 4, &obuf[f32]));
        GPU_OK(GPU, dit_backend_alloc(GPU, (size_t)(B * H * S) * 4, &lbuf[f32]));
        dit_tensor o3 = dit_tensor_make(obuf[f32], DIT_F32, 3, sho);
        out[f32] = dit_tensor_split_last(&o3, D);
        lse[f32] = dit_tensor_make(lbuf[f32], DIT_F32, 3, shl);
        dit_cuda_backend_set_attention_f32(GPU, f32 == 1);
        GPU_OK(GPU,
               GPU->ops->attention(GPU, &out[f32], &lse[f32], &q, &k, &v, 1.0f / sqrtf((float)D)));
        dit_cuda_backend_set_attention_f32(GPU, false);
        ho[f32] = gpu_fetch(GPU, &o3);
        hl[f32] = gpu_fetch(GPU, &lse[f32]);
    }
    const double eo = max_abs_diff(ho[0], ho[1], no), ref = max_abs(ho[1], no);
    const double el = max_abs_diff(hl[0], hl[1], (size_t)(B * H * S));
    /* float64 reference rows. */
    double e64[2];
    flux_f64_rows(&r, hp, S, H, D, 48, ho, 2, e64);
    printf("flux-size attention (S %lld, H %lld, D %lld): tensor-core vs f32 kernel max abs %.3g "
           "(max|out| %.3g), lse max abs %.3g; vs float64 rows: tensor-core %.3g, f32 %.3g\n",
           (long long)S, (long long)H, (long long)D, eo, ref, el, e64[0], e64[1]);
    ck_assert_msg(eo <= 4e-3, "tensor-core vs f32 kernel: %.3g", eo);
    ck_assert_msg(el <= 1e-3, "lse: %.3g", el);
    ck_assert_msg(e64[1] <= 1e-4, "f32 kernel vs float64: %.3g", e64[1]);
    ck_assert_msg(e64[0] <= 4e-3, "tensor-core kernel vs float64: %.3g", e64[0]);
    for (int f32 = 0; f32 < 2; f32++) {
        free(ho[f32]);
        free(hl[f32]);
        dit_backend_free(GPU, obuf[f32]);
        dit_backend_free(GPU, lbuf[f32]);
    }
    dit_backend_free(GPU, pbuf);
    free(hp);
}
END_TEST

/* FLUX.1-dev's attention at 1024 x 1024 on bf16 q, k, v (the fast path's
 * operands), bf16 out: the pipelined kernel bit for bit against v1, both
 * timed (one warm-up call each, then the median of 5). */
static double attn_time_ms(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                           const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                           float scale)
{
    double t[5];
    GPU_OK(be, be->ops->attention(be, out, lse, q, k, v, scale));
    GPU_OK(be, be->ops->sync(be));
    for (int i = 0; i < 5; i++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        GPU_OK(be, be->ops->attention(be, out, lse, q, k, v, scale));
        GPU_OK(be, be->ops->sync(be));
        clock_gettime(CLOCK_MONOTONIC, &b);
        t[i] = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
    }
    for (int i = 1; i < 5; i++)
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            const double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    return t[2];
}

/* The FLUX VAE's mid-block attention at 1024 x 1024: one 512-wide head over
 * 128 x 128 = 16384 latent tokens, f32 q, k, v, on the f32 kernel with four
 * queries a warp (the default for wide heads) and with one: bit for bit,
 * both timed, and 16 rows against float64. */
START_TEST(vae_size_attention_qpw_matches)
{
    const int64_t S = 16384, D = 512;
    test_rng r = {16384};
    const int64_t sh[4] = {1, S, 1, D}, shl[3] = {1, 1, S};
    const size_t n = (size_t)(S * D);
    float *hq = gpu_rand(&r, n, -1, 1, false), *hk = gpu_rand(&r, n, -1, 1, false);
    float *hv = gpu_rand(&r, n, -1, 1, false);
    dit_tensor t[3], out[2], lse[2];
    float *hs[3] = {hq, hk, hv};
    void *buf[7] = {NULL};
    for (int i = 0; i < 3; i++) {
        GPU_OK(GPU, dit_backend_alloc(GPU, n * 4, &buf[i]));
        t[i] = dit_tensor_make(buf[i], DIT_F32, 4, sh);
        const dit_tensor h = dit_tensor_make(hs[i], DIT_F32, 4, sh);
        GPU_OK(GPU, GPU->ops->upload(GPU, &t[i], &h));
    }
    double ms[2];
    const float scale = 1.0f / sqrtf((float)D);
    for (int w = 0; w < 2; w++) {
        GPU_OK(GPU, dit_backend_alloc(GPU, n * 4, &buf[3 + w]));
        GPU_OK(GPU, dit_backend_alloc(GPU, (size_t)S * 4, &buf[5 + w]));
        out[w] = dit_tensor_make(buf[3 + w], DIT_F32, 4, sh);
        lse[w] = dit_tensor_make(buf[5 + w], DIT_F32, 3, shl);
        dit_cuda_backend_set_generic_qpw(GPU, w == 0 ? 0 : 1);
        ms[w] = attn_time_ms(GPU, &out[w], &lse[w], &t[0], &t[1], &t[2], scale);
    }
    dit_cuda_backend_set_generic_qpw(GPU, 0);
    const size_t d_out = gpu_bit_differences(&out[0], &out[1]);
    const size_t d_lse = gpu_bit_differences(&lse[0], &lse[1]);
    float *ho = gpu_fetch(GPU, &out[0]);
    double e64 = 0;
    double *p = malloc((size_t)S * sizeof *p);
    ck_assert_ptr_nonnull(p);
    for (int tr = 0; tr < 16; tr++) {
        const int64_t i = (int64_t)(test_rng_next(&r) % (uint64_t)S);
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < S; j++) {
            double acc = 0;
            for (int64_t d = 0; d < D; d++)
                acc += (double)hq[i * D + d] * hk[j * D + d];
            p[j] = acc * scale;
            mx = fmax(mx, p[j]);
        }
        for (int64_t j = 0; j < S; j++)
            sum += p[j] = exp(p[j] - mx);
        for (int64_t d = 0; d < D; d++) {
            double o = 0;
            for (int64_t j = 0; j < S; j++)
                o += p[j] * hv[j * D + d];
            e64 = fmax(e64, fabs(o / sum - ho[i * D + d]));
        }
    }
    const double tflop = 4.0 * (double)S * (double)S * (double)D / 1e12;
    printf("vae-size attention (S %lld, one %lld-wide head, f32): 4 vs 1 queries a warp %zu "
           "outputs and %zu lse differ; 4 a warp %.2f ms (%.1f TFLOP/s), 1 a warp %.2f ms "
           "(%.1f TFLOP/s); vs float64 rows %.3g\n",
           (long long)S, (long long)D, d_out, d_lse, ms[0], tflop / (ms[0] / 1e3), ms[1],
           tflop / (ms[1] / 1e3), e64);
    ck_assert_uint_eq(d_out, 0);
    ck_assert_uint_eq(d_lse, 0);
    ck_assert_msg(e64 <= 1e-4, "f32 kernel vs float64: %.3g", e64);
    free(p);
    free(ho);
    for (int i = 0; i < 7; i++)
        dit_backend_free(GPU, buf[i]);
    free(hq);
    free(hk);
    free(hv);
}
END_TEST

START_TEST(flux_size_attention_v2_matches_v1)
{
    const int64_t B = 1, S = 4608, H = 24, D = 128;
    test_rng r = {4609};
    const int64_t shp[3] = {B, S, 3 * H * D}, sho[3] = {B, S, H * D}, shl[3] = {B, H, S};
    const size_t np = (size_t)(B * S * 3 * H * D), no = (size_t)(B * S * H * D);
    float *hp = gpu_rand(&r, np, -3, 3, true);
    void *pbuf = NULL, *obuf[2] = {NULL, NULL}, *lbuf[2] = {NULL, NULL};
    GPU_OK(GPU, dit_backend_alloc(GPU, np * 2, &pbuf));
    dit_tensor proj = dit_tensor_make(pbuf, DIT_BF16, 3, shp);
    dit_tensor hproj = dit_tensor_make(hp, DIT_F32, 3, shp);
    GPU_OK(GPU, GPU->ops->upload(GPU, &proj, &hproj));
    dit_tensor q, k, v;
    qkv_views(&proj, &proj, H, D, &q, &k, &v);
    const float scale = 1.0f / sqrtf((float)D);
    const dit_cuda_attn was = dit_cuda_backend_attn(GPU);
    dit_tensor o3[2], lse[2];
    double ms[2];
    for (int kv = 0; kv < 2; kv++) {
        GPU_OK(GPU, dit_backend_alloc(GPU, no * 2, &obuf[kv]));
        GPU_OK(GPU, dit_backend_alloc(GPU, (size_t)(B * H * S) * 4, &lbuf[kv]));
        o3[kv] = dit_tensor_make(obuf[kv], DIT_BF16, 3, sho);
        const dit_tensor out = dit_tensor_split_last(&o3[kv], D);
        lse[kv] = dit_tensor_make(lbuf[kv], DIT_F32, 3, shl);
        dit_cuda_backend_set_attn(GPU, kv ? DIT_CUDA_ATTN_V2 : DIT_CUDA_ATTN_V1);
        ms[kv] = attn_time_ms(GPU, &out, &lse[kv], &q, &k, &v, scale);
    }
    dit_cuda_backend_set_attn(GPU, was);
    const size_t diff = gpu_bit_differences(&o3[0], &o3[1]);
    const size_t ldiff = gpu_bit_differences(&lse[0], &lse[1]);
    const double tflop = 4.0 * (double)S * (double)S * (double)(H * D) / 1e12;
    printf("flux-size attention bf16 (S %lld, H %lld, D %lld): v2 vs v1 %zu outputs and %zu lse "
           "values differ; v1 %.3f ms (%.0f TFLOP/s), v2 %.3f ms (%.0f TFLOP/s)\n",
           (long long)S, (long long)H, (long long)D, diff, ldiff, ms[0], tflop / (ms[0] / 1e3),
           ms[1], tflop / (ms[1] / 1e3));
    ck_assert_uint_eq(diff, 0);
    ck_assert_uint_eq(ldiff, 0);
    for (int kv = 0; kv < 2; kv++) {
        dit_backend_free(GPU, obuf[kv]);
        dit_backend_free(GPU, lbuf[kv]);
    }
    dit_backend_free(GPU, pbuf);
    free(hp);
}
END_TEST

/* FLUX.1-dev's attention at 1024² on cuDNN's SDPA against v1: bf16 q, k, v
 * as head views of the fused projection, bf16 outputs, the LSE; both
 * timed, and 32 rows against float64. */
START_TEST(flux_size_attention_cudnn)
{
    const int64_t B = 1, S = 4608, H = 24, D = 128;
    test_rng r = {4610};
    const int64_t shp[3] = {B, S, 3 * H * D}, sho[3] = {B, S, H * D}, shl[3] = {B, H, S};
    const size_t np = (size_t)(B * S * 3 * H * D), no = (size_t)(B * S * H * D);
    float *hp = flux_proj(&r, S, H, D);
    void *pbuf = NULL, *obuf[2] = {NULL, NULL}, *lbuf[2] = {NULL, NULL};
    GPU_OK(GPU, dit_backend_alloc(GPU, np * 2, &pbuf));
    dit_tensor proj = dit_tensor_make(pbuf, DIT_BF16, 3, shp);
    dit_tensor hproj = dit_tensor_make(hp, DIT_F32, 3, shp);
    GPU_OK(GPU, GPU->ops->upload(GPU, &proj, &hproj));
    dit_tensor q, k, v;
    qkv_views(&proj, &proj, H, D, &q, &k, &v);
    const float scale = 1.0f / sqrtf((float)D);
    const dit_cuda_attn was = dit_cuda_backend_attn(GPU);
    dit_tensor o3[2], lse[2];
    float *ho[2], *hl[2];
    double ms[2];
    dit_cuda_stats st0, st1;
    for (int kv = 0; kv < 2; kv++) {
        GPU_OK(GPU, dit_backend_alloc(GPU, no * 2, &obuf[kv]));
        GPU_OK(GPU, dit_backend_alloc(GPU, (size_t)(B * H * S) * 4, &lbuf[kv]));
        o3[kv] = dit_tensor_make(obuf[kv], DIT_BF16, 3, sho);
        const dit_tensor out = dit_tensor_split_last(&o3[kv], D);
        lse[kv] = dit_tensor_make(lbuf[kv], DIT_F32, 3, shl);
        dit_cuda_backend_set_attn(GPU, kv ? DIT_CUDA_ATTN_CUDNN : DIT_CUDA_ATTN_V1);
        dit_cuda_backend_stats(GPU, &st0);
        ms[kv] = attn_time_ms(GPU, &out, &lse[kv], &q, &k, &v, scale);
        dit_cuda_backend_stats(GPU, &st1);
        if (kv)
            ck_assert_uint_eq(st1.attn_cudnn_calls - st0.attn_cudnn_calls, 6);
        ho[kv] = gpu_fetch(GPU, &o3[kv]);
        hl[kv] = gpu_fetch(GPU, &lse[kv]);
    }
    dit_cuda_backend_set_attn(GPU, was);
    const double eo = max_abs_diff(ho[0], ho[1], no), ref = max_abs(ho[0], no);
    const double el = max_abs_diff(hl[0], hl[1], (size_t)(B * H * S));
    double e64[2];
    flux_f64_rows(&r, hp, S, H, D, 32, ho, 2, e64);
    const double tflop = 4.0 * (double)S * (double)S * (double)(H * D) / 1e12;
    printf("flux-size attention bf16 (S %lld, H %lld, D %lld): cudnn vs v1 max abs %.3g of "
           "max|out| %.3g, lse %.3g; vs float64 rows: v1 %.3g, cudnn %.3g; v1 %.3f ms (%.0f "
           "TFLOP/s), cudnn %.3f ms (%.0f TFLOP/s)\n",
           (long long)S, (long long)H, (long long)D, eo, ref, el, e64[0], e64[1], ms[0],
           tflop / (ms[0] / 1e3), ms[1], tflop / (ms[1] / 1e3));
    /* bf16 outputs: each kernel rounds to bf16 (2^-9 relative) after its
     * own f32 sums and its own rounding of P; 8e-3 of max|out| is the
     * bf16-output tolerance of the parity cases. */
    ck_assert_msg(eo <= 8e-3 * ref, "cudnn vs v1 %.3g (max|out| %.3g)", eo, ref);
    ck_assert_msg(e64[1] <= 8e-3 * ref, "cudnn vs float64 %.3g (max|out| %.3g)", e64[1], ref);
    ck_assert_msg(el <= 1e-4, "cudnn lse vs v1 %.3g", el);
    for (int kv = 0; kv < 2; kv++) {
        free(ho[kv]);
        free(hl[kv]);
        dit_backend_free(GPU, obuf[kv]);
        dit_backend_free(GPU, lbuf[kv]);
    }
    dit_backend_free(GPU, pbuf);
    free(hp);
}
END_TEST

/* The pipelined kernel (DIT_CUDA_ATTN=v2) against the 64-query one (v1)
 * and the cpu backend, on bf16 q, k, v as head views of a fused
 * projection: v2 does v1's arithmetic in v1's order, so every output and
 * LSE value must be bit-identical to v1's, and within the tensor-core
 * tolerance of the cpu's. Sequence ends inside and on tile edges (64 keys,
 * 128 queries), Skv 0, batch 2, bf16 output; `pad` widens the projection's
 * rows by 4 elements, which leaves them 8- but not 16-byte aligned: v2
 * cannot take them and the call must run (and be counted) on v1. */
typedef struct attn2_case {
    int64_t B, Sq, Skv, H, D;
    float qscale;
    bool out_bf16, pad;
} attn2_case;

static const attn2_case attn2_cases[] = {
    {1, 1, 1, 1, 64, 1, false, false},      {2, 97, 53, 3, 128, 1, false, false},
    {1, 128, 64, 2, 128, 1, false, false},  {1, 129, 65, 2, 64, 1, false, false},
    {1, 300, 333, 2, 128, 3, false, false}, {2, 64, 200, 1, 64, 1, true, false},
    {1, 9, 0, 2, 128, 1, false, false},     {1, 200, 130, 2, 128, 2, true, false},
    {1, 77, 91, 1, 64, 1, false, true},     {1, 256, 1000, 2, 128, 4, true, false},
    {2, 97, 53, 3, 128, 1, true, false},    {1, 129, 65, 2, 64, 1, true, false},
    {1, 300, 333, 2, 128, 3, true, false},
};

/* A case's bf16 inputs on both backends: q from a (B, Sq, W) projection, k
 * and v from a (B, Skv, W) one (W = 3 H D, plus 4 with pad), as head
 * views; [0] cpu, [1] gpu. */
typedef struct attn2_inputs {
    float *hq, *hk;
    gpu_pair qa, ka;
    dit_tensor q[2], k[2], v[2];
} attn2_inputs;

static void attn2_inputs_make(const attn2_case *ac, uint64_t seed, attn2_inputs *in)
{
    test_rng r = {seed};
    const int64_t W = 3 * ac->H * ac->D + (ac->pad ? 4 : 0);
    const int64_t shq[3] = {ac->B, ac->Sq, W}, shk[3] = {ac->B, ac->Skv, W};
    in->hq = gpu_rand(&r, (size_t)(ac->B * ac->Sq * W), -ac->qscale, ac->qscale, true);
    in->hk = gpu_rand(&r, (size_t)(ac->B * ac->Skv * W), -1, 1, true);
    in->qa = gpu_pair_make(CPU, GPU, DIT_BF16, 3, shq, in->hq);
    in->ka = gpu_pair_make(CPU, GPU, DIT_BF16, 3, shk, in->hk);
    const dit_tensor *qb[2] = {&in->qa.c, &in->qa.g}, *kb[2] = {&in->ka.c, &in->ka.g};
    for (int s = 0; s < 2; s++)
        qkv_views(qb[s], kb[s], ac->H, ac->D, &in->q[s], &in->k[s], &in->v[s]);
}

static void attn2_inputs_free(attn2_inputs *in)
{
    gpu_pair_free(CPU, GPU, &in->qa);
    gpu_pair_free(CPU, GPU, &in->ka);
    free(in->hq);
    free(in->hk);
}

START_TEST(attention_v2_matches_v1_bitwise)
{
    const attn2_case *ac = &attn2_cases[_i];
    const int64_t B = ac->B, Sq = ac->Sq, Skv = ac->Skv, H = ac->H, D = ac->D;
    const int64_t sho[3] = {B, Sq, H * D}, shl[3] = {B, H, Sq};
    attn2_inputs in;
    attn2_inputs_make(ac, 1700 + (uint64_t)_i, &in);
    const dit_dtype odt = ac->out_bf16 ? DIT_BF16 : DIT_F32;
    gpu_pair o1 = gpu_pair_make(CPU, GPU, odt, 3, sho, NULL);
    gpu_pair o2 = gpu_pair_make(CPU, GPU, odt, 3, sho, NULL);
    gpu_pair l1 = gpu_pair_make(CPU, GPU, DIT_F32, 3, shl, NULL);
    gpu_pair l2 = gpu_pair_make(CPU, GPU, DIT_F32, 3, shl, NULL);
    const dit_tensor *q = in.q, *k = in.k, *v = in.v;
    dit_tensor out1[2], out2[2];
    const dit_tensor *ob1[2] = {&o1.c, &o1.g}, *ob2[2] = {&o2.c, &o2.g};
    for (int s = 0; s < 2; s++) {
        out1[s] = dit_tensor_split_last(ob1[s], D);
        out2[s] = dit_tensor_split_last(ob2[s], D);
    }
    const float scale = 1.0f / sqrtf((float)D);
    GPU_OK(CPU, CPU->ops->attention(CPU, &out1[0], &l1.c, &q[0], &k[0], &v[0], scale));
    const dit_cuda_attn was = dit_cuda_backend_attn(GPU);
    dit_cuda_stats st0, st1, st2;
    dit_cuda_backend_stats(GPU, &st0);
    dit_cuda_backend_set_attn(GPU, DIT_CUDA_ATTN_V1);
    GPU_OK(GPU, GPU->ops->attention(GPU, &out1[1], &l1.g, &q[1], &k[1], &v[1], scale));
    dit_cuda_backend_stats(GPU, &st1);
    dit_cuda_backend_set_attn(GPU, DIT_CUDA_ATTN_V2);
    GPU_OK(GPU, GPU->ops->attention(GPU, &out2[1], &l2.g, &q[1], &k[1], &v[1], scale));
    dit_cuda_backend_stats(GPU, &st2);
    dit_cuda_backend_set_attn(GPU, was);
    ck_assert_uint_eq(st1.attn_v1_calls - st0.attn_v1_calls, 1);
    if (ac->pad) {
        ck_assert_uint_eq(st2.attn_v1_calls - st1.attn_v1_calls, 1);
        ck_assert_uint_eq(st2.attn_v2_calls - st1.attn_v2_calls, 0);
    } else {
        ck_assert_uint_eq(st2.attn_v2_calls - st1.attn_v2_calls, 1);
        ck_assert_uint_eq(st2.attn_v1_calls - st1.attn_v1_calls, 0);
    }
    char what[128];
    snprintf(what, sizeof what, "attention v2 B%lld Sq%lld Skv%lld H%lld D%lld -> %s%s",
             (long long)B, (long long)Sq, (long long)Skv, (long long)H, (long long)D,
             ac->out_bf16 ? "bf16" : "f32", ac->pad ? " (8-byte rows: v1)" : "");
    const double tol = 4e-3 + (ac->out_bf16 ? 4e-3 : 0);
    ck_assert_int_eq(gpu_compare_views(what, CPU, &o1.c, GPU, &o2.g, tol, tol), 0);
    ck_assert_int_eq(gpu_compare_views("lse v2", CPU, &l1.c, GPU, &l2.g, 1e-4, 1e-5), 0);
    /* Bit for bit against v1. */
    const size_t no = (size_t)(B * Sq * H * D), nl = (size_t)(B * H * Sq);
    const size_t diff = gpu_bit_differences(&o1.g, &o2.g),
                 ldiff = gpu_bit_differences(&l1.g, &l2.g);
    printf("%s: %zu of %zu outputs and %zu of %zu lse values differ from v1\n", what, diff, no,
           ldiff, nl);
    ck_assert_uint_eq(diff, 0);
    ck_assert_uint_eq(ldiff, 0);
    attn2_inputs_free(&in);
    gpu_pair_free(CPU, GPU, &o1);
    gpu_pair_free(CPU, GPU, &o2);
    gpu_pair_free(CPU, GPU, &l1);
    gpu_pair_free(CPU, GPU, &l2);
}
END_TEST

/* DIT_CUDA_ATTN=cudnn: cuDNN's SDPA forward against the cpu backend on the
 * v2 cases. It takes bf16 outputs with 16-byte aligned rows and at least
 * one key; the rest (f32 outputs, 8-byte rows, Skv 0) must run, and be
 * counted, on v1. Its own kernel: within the tensor-core tolerance of the
 * cpu, not bit-identical to v1. */
START_TEST(attention_cudnn_matches_cpu)
{
    const attn2_case *ac = &attn2_cases[_i];
    const int64_t B = ac->B, Sq = ac->Sq, Skv = ac->Skv, H = ac->H, D = ac->D;
    const int64_t sho[3] = {B, Sq, H * D}, shl[3] = {B, H, Sq};
    attn2_inputs in;
    attn2_inputs_make(ac, 1800 + (uint64_t)_i, &in);
    const dit_dtype odt = ac->out_bf16 ? DIT_BF16 : DIT_F32;
    gpu_pair o = gpu_pair_make(CPU, GPU, odt, 3, sho, NULL);
    gpu_pair l = gpu_pair_make(CPU, GPU, DIT_F32, 3, shl, NULL);
    const dit_tensor *q = in.q, *k = in.k, *v = in.v;
    dit_tensor out[2] = {dit_tensor_split_last(&o.c, D), dit_tensor_split_last(&o.g, D)};
    const float scale = 1.0f / sqrtf((float)D);
    GPU_OK(CPU, CPU->ops->attention(CPU, &out[0], &l.c, &q[0], &k[0], &v[0], scale));
    const dit_cuda_attn was = dit_cuda_backend_attn(GPU);
    dit_cuda_stats st0, st1;
    dit_cuda_backend_stats(GPU, &st0);
    dit_cuda_backend_set_attn(GPU, DIT_CUDA_ATTN_CUDNN);
    GPU_OK(GPU, GPU->ops->attention(GPU, &out[1], &l.g, &q[1], &k[1], &v[1], scale));
    dit_cuda_backend_stats(GPU, &st1);
    dit_cuda_backend_set_attn(GPU, was);
    const bool takes = ac->out_bf16 && !ac->pad && Skv > 0;
    ck_assert_uint_eq(st1.attn_cudnn_calls - st0.attn_cudnn_calls, takes ? 1 : 0);
    ck_assert_uint_eq(st1.attn_v1_calls - st0.attn_v1_calls, takes ? 0 : 1);
    ck_assert_uint_eq(st1.attn_cudnn_fallback_calls - st0.attn_cudnn_fallback_calls, 0);
    char what[128];
    snprintf(what, sizeof what, "attention cudnn B%lld Sq%lld Skv%lld H%lld D%lld -> %s%s",
             (long long)B, (long long)Sq, (long long)Skv, (long long)H, (long long)D,
             ac->out_bf16 ? "bf16" : "f32", takes ? "" : " (v1)");
    const double tol = 4e-3 + (ac->out_bf16 ? 4e-3 : 0);
    ck_assert_int_eq(gpu_compare_views(what, CPU, &o.c, GPU, &o.g, tol, tol), 0);
    ck_assert_int_eq(gpu_compare_views("lse cudnn", CPU, &l.c, GPU, &l.g, 1e-4, 1e-5), 0);
    attn2_inputs_free(&in);
    gpu_pair_free(CPU, GPU, &o);
    gpu_pair_free(CPU, GPU, &l);
}
END_TEST

/* cuDNN loads on this machine (9.13.1 or newer): the other cudnn cases
 * would otherwise fail on their call counts alone. */
START_TEST(cudnn_loads)
{
    char why[512];
    const dit_status st = dit_cuda_backend_cudnn(GPU, why, sizeof why);
    printf("cudnn: %s\n", why);
    ck_assert_msg(st == DIT_OK, "DIT_CUDA_ATTN=cudnn cannot be used: %s", why);
}
END_TEST

START_TEST(attention_masked_matches_cpu)
{
    test_rng r = {900 + (uint64_t)_i};
    const int64_t B = 2, S = 23 + 20 * _i, H = 2, D = _i == 0 ? 16 : 64;
    const int64_t sh[4] = {B, S, H, D}, shb[3] = {H, S, S};
    const size_t n = (size_t)(B * S * H * D);
    float *hq = gpu_rand(&r, n, -1, 1, false), *hk = gpu_rand(&r, n, -1, 1, false);
    float *hv = gpu_rand(&r, n, -1, 1, false);
    float *hb = gpu_rand(&r, (size_t)(H * S * S), -2, 2, false);
    gpu_pair q = gpu_pair_make(CPU, GPU, DIT_F32, 4, sh, hq);
    gpu_pair k = gpu_pair_make(CPU, GPU, DIT_F32, 4, sh, hk);
    gpu_pair v = gpu_pair_make(CPU, GPU, DIT_F32, 4, sh, hv);
    gpu_pair bias = gpu_pair_make(CPU, GPU, DIT_F32, 3, shb, hb);
    for (int mode = 0; mode < 3; mode++) {
        const bool causal = mode != 1;
        const bool with_bias = mode != 0;
        gpu_pair o = gpu_pair_make(CPU, GPU, DIT_F32, 4, sh, NULL);
        GPU_OK(CPU, CPU->ops->attention_masked(CPU, &o.c, &q.c, &k.c, &v.c, 0.125f,
                                               with_bias ? &bias.c : NULL, causal));
        GPU_OK(GPU, GPU->ops->attention_masked(GPU, &o.g, &q.g, &k.g, &v.g, 0.125f,
                                               with_bias ? &bias.g : NULL, causal));
        ck_assert_int_eq(gpu_compare_views("attention_masked", CPU, &o.c, GPU, &o.g, 2e-5, 1e-4),
                         0);
        gpu_pair_free(CPU, GPU, &o);
    }
    gpu_pair_free(CPU, GPU, &q);
    gpu_pair_free(CPU, GPU, &k);
    gpu_pair_free(CPU, GPU, &v);
    gpu_pair_free(CPU, GPU, &bias);
    free(hq);
    free(hk);
    free(hv);
    free(hb);
}
END_TEST

START_TEST(lse_merge_matches_cpu)
{
    test_rng r = {1000};
    const int64_t B = 2, S = 29, H = 3, D = 64;
    const int64_t sh[4] = {B, S, H, D}, shl[3] = {B, H, S};
    const size_t n = (size_t)(B * S * H * D), nl = (size_t)(B * H * S);
    float *ho = gpu_rand(&r, n, -1, 1, false), *hob = gpu_rand(&r, n, -1, 1, false);
    float *hl = gpu_rand(&r, nl, -5, 5, false), *hlb = gpu_rand(&r, nl, -5, 5, false);
    /* Empty partial results on either side (lse = -inf). */
    hl[0] = -INFINITY;
    hlb[1] = -INFINITY;
    hl[2] = hlb[2] = -INFINITY;
    gpu_pair o = gpu_pair_make(CPU, GPU, DIT_F32, 4, sh, ho);
    gpu_pair ob = gpu_pair_make(CPU, GPU, DIT_F32, 4, sh, hob);
    gpu_pair l = gpu_pair_make(CPU, GPU, DIT_F32, 3, shl, hl);
    gpu_pair lb = gpu_pair_make(CPU, GPU, DIT_F32, 3, shl, hlb);
    GPU_OK(CPU, CPU->ops->lse_merge(CPU, &o.c, &l.c, &ob.c, &lb.c));
    GPU_OK(GPU, GPU->ops->lse_merge(GPU, &o.g, &l.g, &ob.g, &lb.g));
    ck_assert_int_eq(gpu_compare_views("lse_merge out", CPU, &o.c, GPU, &o.g, 2e-6, 1e-5), 0);
    ck_assert_int_eq(gpu_compare_views("lse_merge lse", CPU, &l.c, GPU, &l.g, 2e-6, 1e-6), 0);
    gpu_pair_free(CPU, GPU, &o);
    gpu_pair_free(CPU, GPU, &ob);
    gpu_pair_free(CPU, GPU, &l);
    gpu_pair_free(CPU, GPU, &lb);
    free(ho);
    free(hob);
    free(hl);
    free(hlb);
}
END_TEST

/* ---- VAE ops ------------------------------------------------------------- */

typedef struct conv_case {
    int64_t B, Ci, H, W, Co, kh;
    int stride, pad;
} conv_case;

static const conv_case conv_cases[] = {
    {1, 8, 13, 11, 6, 3, 1, 1},
    {2, 5, 16, 9, 7, 3, 2, 1},
    {1, 12, 7, 10, 4, 1, 1, 0},
    {1, 3, 9, 9, 16, 3, 1, 0},
};

START_TEST(conv2d_matches_cpu)
{
    const conv_case *cc = &conv_cases[_i];
    test_rng r = {1100 + (uint64_t)_i};
    const int64_t Ho = (cc->H + 2 * cc->pad - cc->kh) / cc->stride + 1;
    const int64_t Wo = (cc->W + 2 * cc->pad - cc->kh) / cc->stride + 1;
    const int64_t shx[4] = {cc->B, cc->Ci, cc->H, cc->W}, shw[4] = {cc->Co, cc->Ci, cc->kh, cc->kh};
    const int64_t shy[4] = {cc->B, cc->Co, Ho, Wo};
    float *hx = gpu_rand(&r, (size_t)(cc->B * cc->Ci * cc->H * cc->W), -1, 1, true);
    float *hw = gpu_rand(&r, (size_t)(cc->Co * cc->Ci * cc->kh * cc->kh), -0.3f, 0.3f, true);
    float *hb = gpu_rand(&r, (size_t)cc->Co, -1, 1, false);
    gpu_pair x = gpu_pair_make(CPU, GPU, DIT_F32, 4, shx, hx);
    gpu_pair w = gpu_pair_make(CPU, GPU, GPU->ops->weight_dtype, 4, shw, hw);
    gpu_pair b = gpu_pair_make(CPU, GPU, DIT_F32, 1, &cc->Co, hb);
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        gpu_pair y = gpu_pair_make(CPU, GPU, DIT_F32, 4, shy, NULL);
        GPU_OK(CPU, CPU->ops->conv2d(CPU, &y.c, &x.c, &w.c, with_bias ? &b.c : NULL, cc->stride,
                                     cc->pad));
        GPU_OK(GPU, GPU->ops->conv2d(GPU, &y.g, &x.g, &w.g, with_bias ? &b.g : NULL, cc->stride,
                                     cc->pad));
        ck_assert_int_eq(gpu_compare_views("conv2d", CPU, &y.c, GPU, &y.g, 1e-4, 1e-4), 0);
        gpu_pair_free(CPU, GPU, &y);
    }
    gpu_pair_free(CPU, GPU, &x);
    gpu_pair_free(CPU, GPU, &w);
    gpu_pair_free(CPU, GPU, &b);
    free(hx);
    free(hw);
    free(hb);
}
END_TEST

START_TEST(group_norm_and_upsample_match_cpu)
{
    test_rng r = {1200};
    const int64_t sh[4] = {2, 8, 9, 7}, C = 8, shu[4] = {2, 8, 18, 14};
    const size_t n = 2 * 8 * 9 * 7;
    float *hx = gpu_rand(&r, n, -2, 3, false);
    float *hw = gpu_rand(&r, 8, 0.5f, 1.5f, false), *hb = gpu_rand(&r, 8, -1, 1, false);
    gpu_pair w = gpu_pair_make(CPU, GPU, DIT_F32, 1, &C, hw);
    gpu_pair b = gpu_pair_make(CPU, GPU, DIT_F32, 1, &C, hb);
    for (int silu = 0; silu < 2; silu++) {
        gpu_pair x = gpu_pair_make(CPU, GPU, DIT_F32, 4, sh, hx);
        gpu_pair y = gpu_pair_make(CPU, GPU, DIT_F32, 4, sh, NULL);
        const dit_act act = silu ? DIT_ACT_SILU : DIT_ACT_NONE;
        GPU_OK(CPU, CPU->ops->group_norm(CPU, &y.c, &x.c, &w.c, &b.c, 4, 1e-6f, act));
        GPU_OK(GPU, GPU->ops->group_norm(GPU, &y.g, &x.g, &w.g, &b.g, 4, 1e-6f, act));
        ck_assert_int_eq(gpu_compare_views("group_norm", CPU, &y.c, GPU, &y.g, 2e-5, 2e-5), 0);
        gpu_pair u = gpu_pair_make(CPU, GPU, DIT_F32, 4, shu, NULL);
        GPU_OK(CPU, CPU->ops->upsample2x(CPU, &u.c, &x.c));
        GPU_OK(GPU, GPU->ops->upsample2x(GPU, &u.g, &x.g));
        ck_assert_int_eq(gpu_compare_views("upsample2x", CPU, &u.c, GPU, &u.g, 0, 0), 0);
        gpu_pair_free(CPU, GPU, &x);
        gpu_pair_free(CPU, GPU, &y);
        gpu_pair_free(CPU, GPU, &u);
    }
    gpu_pair_free(CPU, GPU, &w);
    gpu_pair_free(CPU, GPU, &b);
    free(hx);
    free(hw);
    free(hb);
}
END_TEST

START_TEST(bad_arguments_are_errors_with_messages)
{
    void *buf = NULL;
    GPU_OK(GPU, dit_backend_alloc(GPU, 4096, &buf));
    dit_tensor x = dit_tensor_3d(buf, DIT_F32, 1, 4, 8), w = dit_tensor_2d(buf, DIT_BF16, 5, 9);
    dit_tensor y = dit_tensor_3d(buf, DIT_F32, 1, 4, 5);
    ck_assert_int_eq(GPU->ops->linear(GPU, &y, &x, &w, NULL, DIT_ACT_NONE, 0.0f),
                     DIT_ERR_INVALID_ARG);
    ck_assert_ptr_nonnull(strstr(GPU->ops->last_error(GPU), "linear"));
    dit_backend_free(GPU, buf);
}
END_TEST

int main(void)
{
    gpu_require_device("test_cuda_ops");
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend_config cc = {.kind = DIT_BACKEND_CPU, .n_threads = 2};
    dit_backend_config gc = {.kind = DIT_BACKEND_CUDA, .device = 0};
    if (dit_backend_create(&cc, &g_cpu, &diag) != DIT_OK ||
        dit_backend_create(&gc, &g_gpu, &diag) != DIT_OK) {
        fprintf(stderr, "test_cuda_ops: %s\n", dit_diag_msg(&diag));
        return 1;
    }
    Suite *s = suite_create("cuda_ops");
    TCase *tc = tcase_create("parity");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, upload_download_copy_fill_roundtrip);
    tcase_add_test(tc, five_dims_match_cpu);
    tcase_add_test(tc, f8_upload_converts_exactly);
    tcase_add_test(tc, init_uniform_matches_host_generator);
    tcase_add_loop_test(tc, linear_matches_cpu, 0, 3 * N_LIN);
    tcase_add_test(tc, bf16_operands_match_cpu);
    tcase_add_test(tc, activate_matches_cpu);
    tcase_add_test(tc, norms_match_cpu);
    tcase_add_loop_test(tc, rms_norm_rope_matches_cpu, 0, 3);
    tcase_add_test(tc, gated_add_matches_cpu);
    tcase_add_test(tc, embedding_matches_cpu);
    tcase_add_test(tc, relative_bias_matches_cpu);
    tcase_add_loop_test(tc, attention_matches_cpu, 0,
                        (int)(sizeof attn_cases / sizeof attn_cases[0]));
    tcase_add_loop_test(tc, attention_masked_matches_cpu, 0, 2);
    tcase_add_test(tc, lse_merge_matches_cpu);
    tcase_add_loop_test(tc, conv2d_matches_cpu, 0, (int)(sizeof conv_cases / sizeof conv_cases[0]));
    tcase_add_test(tc, group_norm_and_upsample_match_cpu);
    tcase_add_test(tc, bad_arguments_are_errors_with_messages);
    suite_add_tcase(s, tc);
    /* The pipelined attention kernel, in a case of its own so that the GPU
     * check can run it alone under compute-sanitizer's racecheck and
     * synccheck (CK_RUN_CASE=attn_v2). */
    TCase *t2 = tcase_create("attn_v2");
    tcase_set_timeout(t2, 300);
    tcase_add_loop_test(t2, attention_v2_matches_v1_bitwise, 0,
                        (int)(sizeof attn2_cases / sizeof attn2_cases[0]));
    suite_add_tcase(s, t2);
    /* cuDNN's SDPA (DIT_CUDA_ATTN=cudnn). */
    TCase *tn = tcase_create("attn_cudnn");
    tcase_set_timeout(tn, 300);
    tcase_add_test(tn, cudnn_loads);
    tcase_add_loop_test(tn, attention_cudnn_matches_cpu, 0,
                        (int)(sizeof attn2_cases / sizeof attn2_cases[0]));
    suite_add_tcase(s, tn);
    /* Its own case, so that a slow run (compute-sanitizer) can leave it
     * out with CK_RUN_CASE=parity. */
    TCase *tl = tcase_create("large");
    tcase_set_timeout(tl, 300);
    tcase_add_test(tl, flux_size_attention_matches_f32_kernel);
    tcase_add_test(tl, flux_size_attention_v2_matches_v1);
    tcase_add_test(tl, flux_size_attention_cudnn);
    tcase_add_test(tl, vae_size_attention_qpw_matches);
    suite_add_tcase(s, tl);
    SRunner *sr = srunner_create(s);
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    dit_backend_destroy(g_gpu);
    dit_backend_destroy(g_cpu);
    return failed ? 1 : 0;
}
