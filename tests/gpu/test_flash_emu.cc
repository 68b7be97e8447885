/* The cuda backend's tensor-core attention kernels (flash_attention.cuh)
 * run on the CPU through the SIMT emulator (simt_emu.h): the kernel source
 * nvcc compiles, with the emulator's model of mma.sync, ldmatrix and
 * cp.async. It needs no GPU and no CUDA toolkit, so every build runs it.
 *
 *  - v1 (k_flash_mma, which has run on an H200 and passed every parity
 *    test there) against a float64 reference: this checks the emulator's
 *    model of the instructions as much as the kernel;
 *  - v2 (k_flash_pipe) bit for bit against v1 under four schedules: cp.async
 *    copies landing when issued and when waited for, threads round robin
 *    and warp by warp. v2 does v1's arithmetic in v1's order, so
 *    a difference is a wrong fragment, a wrong address or a missing wait or
 *    barrier.
 * Shapes: sequence ends inside and on tile edges, Skv 0, batch 2, several
 * heads, head dims 64 and 128, f32 and bf16 outputs, with the LSE.
 *  - The generic f32 kernel (any head dim, bias, causal mask) with one and
 *    with four queries a warp, against float64 and against each other bit
 *    for bit. */
#include <check.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "simt_emu.h"

#include "backend/cuda/flash_attention.cuh"

namespace
{

struct emu_case {
    int64_t B, Sq, Skv, H, D;
    float qscale;
    bool out_bf16;
};

const emu_case cases[] = {
    {1, 1, 1, 1, 64, 1, false},     {1, 130, 70, 2, 64, 1, false}, {2, 64, 64, 1, 128, 4, false},
    {1, 200, 333, 1, 128, 1, true}, {1, 9, 0, 1, 128, 1, false},   {1, 129, 129, 1, 128, 3, true},
    {1, 256, 65, 1, 64, 2, false},
};

/* A deterministic uniform stream (xorshift64*), values in [lo, hi) rounded
 * to bf16. */
struct rng {
    uint64_t s;
    float next(float lo, float hi)
    {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        const double u = (double)((s * 2685821657736338717ull) >> 11) / 9007199254740992.0;
        return __bfloat162float(__float2bfloat16_rn(lo + (float)u * (hi - lo)));
    }
};

struct problem {
    int64_t B, Sq, Skv, H, D, W;       /* W: the fused projection's row width, 3 H D */
    std::vector<__nv_bfloat16> qp, kp; /* (B, Sq, W) and (B, Skv, W): q | k | v */
    std::vector<float> qf, kf;         /* the same values in f32 */
};

problem make_problem(const emu_case &c, uint64_t seed)
{
    problem p;
    p.B = c.B, p.Sq = c.Sq, p.Skv = c.Skv, p.H = c.H, p.D = c.D, p.W = 3 * c.H * c.D;
    rng r{seed};
    const size_t nq = (size_t)(p.B * p.Sq * p.W), nk = (size_t)(p.B * p.Skv * p.W);
    /* At least one element each, so that data() is a real pointer when Skv is 0. */
    p.qf.resize(nq ? nq : 1);
    p.kf.resize(nk ? nk : 1);
    for (float &x : p.qf)
        x = r.next(-c.qscale, c.qscale);
    for (float &x : p.kf)
        x = r.next(-1, 1);
    p.qp.resize(p.qf.size());
    p.kp.resize(p.kf.size());
    for (size_t i = 0; i < p.qf.size(); i++)
        p.qp[i] = __float2bfloat16_rn(p.qf[i]);
    for (size_t i = 0; i < p.kf.size(); i++)
        p.kp[i] = __float2bfloat16_rn(p.kf[i]);
    return p;
}

attn_args make_args(const problem &p, void *out, float *lse)
{
    attn_args a;
    memset(&a, 0, sizeof a);
    a.q = p.qp.data();
    a.k = p.kp.data() + p.H * p.D;
    a.v = p.kp.data() + 2 * p.H * p.D;
    a.out = out;
    a.lse = lse;
    a.q_b = p.Sq * p.W, a.q_s = p.W, a.q_h = p.D;
    a.k_b = a.v_b = p.Skv * p.W, a.k_s = a.v_s = p.W, a.k_h = a.v_h = p.D;
    a.o_b = p.Sq * p.H * p.D, a.o_s = p.H * p.D, a.o_h = p.D;
    a.Sq = p.Sq, a.Skv = p.Skv, a.H = p.H, a.D = p.D;
    a.scale = 1.0f / sqrtf((float)p.D);
    return a;
}

/* Outputs of one kernel run, widened to f32 (bf16 outputs exactly). */
struct result {
    std::vector<float> out, lse;
};

template <typename TO>
result collect(const problem &p, const std::vector<TO> &o, const std::vector<float> &l);

template <>
result collect<float>(const problem &, const std::vector<float> &o, const std::vector<float> &l)
{
    return result{o, l};
}

template <>
result collect<__nv_bfloat16>(const problem &, const std::vector<__nv_bfloat16> &o,
                              const std::vector<float> &l)
{
    result r;
    r.out.resize(o.size());
    for (size_t i = 0; i < o.size(); i++)
        r.out[i] = __bfloat162float(o[i]);
    r.lse = l;
    return r;
}

template <int D, typename TO> result run_v1(const problem &p)
{
    std::vector<TO> out((size_t)(p.B * p.Sq * p.H * D));
    std::vector<float> lse((size_t)(p.B * p.H * p.Sq));
    const attn_args a = make_args(p, out.data(), lse.data());
    const dim3 grid((unsigned)((p.Sq + FA_BQ - 1) / FA_BQ), (unsigned)p.H, (unsigned)p.B);
    emu::launch(grid, dim3(FA_WARPS * 32), fa_smem<D>::BYTES, emu::COPY_AT_ISSUE,
                emu::SCHED_ROUND_ROBIN, 1, [a] { k_flash_mma<D, __nv_bfloat16, TO>(a); });
    return collect<TO>(p, out, lse);
}

template <int D, typename TO>
result run_v2(const problem &p, emu::copies mode, emu::schedule sched, uint64_t seed)
{
    std::vector<TO> out((size_t)(p.B * p.Sq * p.H * D));
    std::vector<float> lse((size_t)(p.B * p.H * p.Sq));
    const attn_args a = make_args(p, out.data(), lse.data());
    const dim3 grid((unsigned)((p.Sq + F2_BQ - 1) / F2_BQ), (unsigned)p.H, (unsigned)p.B);
    emu::launch(grid, dim3(F2_WARPS * 32), f2_smem<D>::BYTES, mode, sched, seed,
                [a] { k_flash_pipe<D, TO>(a); });
    return collect<TO>(p, out, lse);
}

/* softmax(q k^T scale) v and the natural-log LSE in float64, from the same
 * bf16 values. */
void reference(const problem &p, std::vector<double> &out, std::vector<double> &lse)
{
    const int64_t HD = p.H * p.D;
    out.assign((size_t)(p.B * p.Sq * HD), 0.0);
    lse.assign((size_t)(p.B * p.H * p.Sq), -INFINITY);
    const double scale = 1.0 / sqrt((double)p.D);
    std::vector<double> s((size_t)(p.Skv ? p.Skv : 1));
    for (int64_t b = 0; b < p.B; b++)
        for (int64_t h = 0; h < p.H; h++)
            for (int64_t i = 0; i < p.Sq; i++) {
                if (p.Skv == 0)
                    continue;
                const float *q = &p.qf[(size_t)((b * p.Sq + i) * p.W + h * p.D)];
                double mx = -INFINITY;
                for (int64_t j = 0; j < p.Skv; j++) {
                    const float *k = &p.kf[(size_t)((b * p.Skv + j) * p.W + HD + h * p.D)];
                    double acc = 0;
                    for (int64_t d = 0; d < p.D; d++)
                        acc += (double)q[d] * k[d];
                    s[(size_t)j] = acc * scale;
                    mx = fmax(mx, s[(size_t)j]);
                }
                double sum = 0;
                for (int64_t j = 0; j < p.Skv; j++) {
                    s[(size_t)j] = exp(s[(size_t)j] - mx);
                    sum += s[(size_t)j];
                }
                double *o = &out[(size_t)((b * p.Sq + i) * HD + h * p.D)];
                for (int64_t j = 0; j < p.Skv; j++) {
                    const float *v = &p.kf[(size_t)((b * p.Skv + j) * p.W + 2 * HD + h * p.D)];
                    for (int64_t d = 0; d < p.D; d++)
                        o[d] += s[(size_t)j] * v[d];
                }
                for (int64_t d = 0; d < p.D; d++)
                    o[d] /= sum;
                lse[(size_t)((b * p.H + h) * p.Sq + i)] = mx + log(sum);
            }
}

size_t count_bit_differences(const std::vector<float> &x, const std::vector<float> &y)
{
    if (x.size() != y.size())
        return (size_t)-1;
    size_t n = 0;
    for (size_t i = 0; i < x.size(); i++)
        n += memcmp(&x[i], &y[i], sizeof x[i]) != 0;
    return n;
}

template <int D, typename TO> void check_case(const emu_case &c, int idx)
{
    const problem p = make_problem(c, 9000 + (uint64_t)idx);
    std::vector<double> ro, rl;
    reference(p, ro, rl);
    const result v1 = run_v1<D, TO>(p);
    /* v1 against float64: P is rounded to bf16 before P V (relative 2^-9),
     * bf16 outputs once more. */
    const double tol = 4e-3 + (c.out_bf16 ? 4e-3 : 0.0);
    double eo = 0, el = 0;
    size_t bad = 0;
    for (size_t i = 0; i < ro.size(); i++) {
        const double d = fabs((double)v1.out[i] - ro[i]);
        eo = std::isnan(d) ? INFINITY : fmax(eo, d);
        bad += !(d <= tol + tol * fabs(ro[i]));
    }
    for (size_t i = 0; i < rl.size(); i++) {
        if (std::isinf(rl[i]) && std::isinf(v1.lse[i]) && rl[i] < 0 && v1.lse[i] < 0)
            continue;
        const double d = fabs((double)v1.lse[i] - rl[i]);
        el = std::isnan(d) ? INFINITY : fmax(el, d);
        bad += !(d <= 1e-4 + 1e-5 * fabs(rl[i]));
    }
    printf("emulated attention B%lld Sq%lld Skv%lld H%lld D%lld -> %s: v1 vs float64 max abs "
           "%.3g (lse %.3g)",
           (long long)c.B, (long long)c.Sq, (long long)c.Skv, (long long)c.H, (long long)D,
           c.out_bf16 ? "bf16" : "f32", eo, el);
    ck_assert_msg(bad == 0, "v1 against float64: %zu values outside the tolerance", bad);
    const struct {
        emu::copies mode;
        emu::schedule sched;
        uint64_t seed;
    } runs[4] = {{emu::COPY_AT_ISSUE, emu::SCHED_ROUND_ROBIN, 1},
                 {emu::COPY_AT_WAIT, emu::SCHED_ROUND_ROBIN, 2},
                 {emu::COPY_AT_ISSUE, emu::SCHED_WARP_GREEDY, 3},
                 {emu::COPY_AT_WAIT, emu::SCHED_WARP_GREEDY, 4}};
    for (const auto &rn : runs) {
        const result v2 = run_v2<D, TO>(p, rn.mode, rn.sched, rn.seed);
        const size_t d_out = count_bit_differences(v1.out, v2.out);
        const size_t d_lse = count_bit_differences(v1.lse, v2.lse);
        ck_assert_msg(d_out == 0 && d_lse == 0,
                      "v2 (copies %s, %s, seed %llu) differs from v1 in %zu outputs and %zu lse",
                      rn.mode == emu::COPY_AT_ISSUE ? "at issue" : "at wait",
                      rn.sched == emu::SCHED_ROUND_ROBIN ? "round robin" : "warp by warp",
                      (unsigned long long)rn.seed, d_out, d_lse);
    }
    printf("; v2 bit-identical to v1 (4 schedules)\n");
}

/* ---- The generic f32 kernel ---------------------------------------------- */

struct gen_case {
    int64_t Sq, Skv, H, D;
    bool bias, causal;
};

const gen_case gen_cases[] = {
    {37, 53, 2, 16, false, false},  {77, 77, 2, 64, false, true},  {45, 61, 3, 80, true, false},
    {50, 50, 1, 512, false, false}, {33, 70, 1, 384, true, false}, {20, 20, 2, 32, true, true},
};

/* q (Sq, H, D), k and v (Skv, H, D) f32 contiguous, batch 1, an optional
 * (H, Sq, Skv) bias; out and lse of k_attn_generic<QPW>. */
template <int QPW>
result run_generic(const gen_case &c, const std::vector<float> &q, const std::vector<float> &k,
                   const std::vector<float> &v, const std::vector<float> &bias)
{
    std::vector<float> out((size_t)(c.Sq * c.H * c.D)), lse((size_t)(c.H * c.Sq));
    attn_args a;
    memset(&a, 0, sizeof a);
    a.q = q.data(), a.k = k.data(), a.v = v.data(), a.out = out.data(), a.lse = lse.data();
    a.bias = c.bias ? bias.data() : nullptr;
    a.q_b = c.Sq * c.H * c.D, a.q_s = c.H * c.D, a.q_h = c.D;
    a.k_b = a.v_b = c.Skv * c.H * c.D, a.k_s = a.v_s = c.H * c.D, a.k_h = a.v_h = c.D;
    a.o_b = a.q_b, a.o_s = a.q_s, a.o_h = a.q_h;
    a.Sq = c.Sq, a.Skv = c.Skv, a.H = c.H, a.D = c.D;
    a.scale = 1.0f / sqrtf((float)c.D);
    a.causal = c.causal;
    const int64_t per = GEN_WARPS * QPW;
    const dim3 grid((unsigned)((c.Sq + per - 1) / per), (unsigned)c.H, 1);
    emu::launch(grid, dim3(GEN_WARPS * 32), gen_smem_bytes(c.D, QPW), emu::COPY_AT_ISSUE,
                emu::SCHED_WARP_GREEDY, 5, [a] { k_attn_generic<QPW, float, float>(a); });
    return result{out, lse};
}

} /* namespace */

/* The generic kernel with one query a warp (the launch every narrow head
 * gets) and with four (the VAEs' wide heads): both against float64, and
 * the two bit for bit, since a query's arithmetic does not depend on how
 * many queries share its warp. Bias, causal mask, head dims 16 to 512. */
START_TEST(generic_kernel_emulated)
{
    const gen_case &c = gen_cases[_i];
    rng r{7000 + (uint64_t)_i};
    std::vector<float> q((size_t)(c.Sq * c.H * c.D)), k((size_t)(c.Skv * c.H * c.D)), v(k.size()),
        bias((size_t)(c.H * c.Sq * c.Skv));
    for (float &x : q)
        x = r.next(-1, 1);
    for (float &x : k)
        x = r.next(-1, 1);
    for (float &x : v)
        x = r.next(-1, 1);
    for (float &x : bias)
        x = r.next(-2, 2);
    const result one = run_generic<1>(c, q, k, v, bias);
    const result four = run_generic<4>(c, q, k, v, bias);
    double eo = 0, el = 0;
    const double scale = 1.0 / sqrt((double)c.D);
    for (int64_t h = 0; h < c.H; h++)
        for (int64_t i = 0; i < c.Sq; i++) {
            std::vector<double> p((size_t)c.Skv, -INFINITY);
            double mx = -INFINITY;
            for (int64_t j = 0; j < c.Skv; j++) {
                if (c.causal && j > i)
                    continue;
                double acc = 0;
                for (int64_t d = 0; d < c.D; d++)
                    acc += (double)q[(size_t)((i * c.H + h) * c.D + d)] *
                           k[(size_t)((j * c.H + h) * c.D + d)];
                p[(size_t)j] =
                    acc * scale + (c.bias ? bias[(size_t)((h * c.Sq + i) * c.Skv + j)] : 0);
                mx = fmax(mx, p[(size_t)j]);
            }
            double sum = 0;
            for (double &x : p)
                sum += x = std::isinf(x) ? 0.0 : exp(x - mx);
            for (int64_t d = 0; d < c.D; d++) {
                double ov = 0;
                for (int64_t j = 0; j < c.Skv; j++)
                    ov += p[(size_t)j] * v[(size_t)((j * c.H + h) * c.D + d)];
                ov /= sum;
                const double got = one.out[(size_t)((i * c.H + h) * c.D + d)];
                eo = fmax(eo, fabs(got - ov));
                ck_assert_msg(fabs(got - ov) <= 2e-5 + 1e-4 * fabs(ov),
                              "out (%lld, %lld, %lld): %.9g vs %.9g", (long long)h, (long long)i,
                              (long long)d, got, ov);
            }
            const double lref = mx + log(sum), lgot = one.lse[(size_t)(h * c.Sq + i)];
            el = fmax(el, fabs(lgot - lref));
            ck_assert_msg(fabs(lgot - lref) <= 2e-5 + 1e-5 * fabs(lref), "lse %.9g vs %.9g", lgot,
                          lref);
        }
    const size_t d_out = count_bit_differences(one.out, four.out);
    const size_t d_lse = count_bit_differences(one.lse, four.lse);
    printf("emulated generic attention Sq%lld Skv%lld H%lld D%lld%s%s: vs float64 max abs %.3g "
           "(lse %.3g); 4 queries a warp vs 1: %zu outputs and %zu lse differ\n",
           (long long)c.Sq, (long long)c.Skv, (long long)c.H, (long long)c.D, c.bias ? " bias" : "",
           c.causal ? " causal" : "", eo, el, d_out, d_lse);
    ck_assert_uint_eq(d_out, 0);
    ck_assert_uint_eq(d_lse, 0);
}
END_TEST

START_TEST(flash_kernels_emulated)
{
    const emu_case &c = cases[_i];
    if (c.D == 64 && !c.out_bf16)
        check_case<64, float>(c, _i);
    else if (c.D == 64)
        check_case<64, __nv_bfloat16>(c, _i);
    else if (!c.out_bf16)
        check_case<128, float>(c, _i);
    else
        check_case<128, __nv_bfloat16>(c, _i);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("flash_emu");
    TCase *tc = tcase_create("kernels");
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, flash_kernels_emulated, 0, (int)(sizeof cases / sizeof cases[0]));
    tcase_add_loop_test(tc, generic_kernel_emulated, 0,
                        (int)(sizeof gen_cases / sizeof gen_cases[0]));
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    /* No fork: the emulator's coroutines and stacks stay in one process. */
    srunner_set_fork_status(sr, CK_NOFORK);
    srunner_run_all(sr, CK_NORMAL);
    const int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
