/* The cudnn attention kernel's cuDNN operation, checked without a GPU: the
 * tensor and SDPA-forward descriptors that DIT_CUDA_ATTN=cudnn builds for a
 * call are made and finalised by the real libcudnn.so.9, which checks
 * their sizes, strides and types (what a GPU run would otherwise be the
 * first to find). Engines, plans and numbers need a device: test_cuda_ops'
 * attn_cudnn case. Skips (77) where libcudnn.so.9 9.13.1+ cannot be loaded. */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_backend.h"
#include "core/tensor.h"

/* A fake, 256-byte aligned device address: the check reads no data. */
#define FAKE ((void *)(uintptr_t)0x7f0000000000ull)

/* q, k, v as head views of fused (B, S, 3 H D) projections (FLUX's layout)
 * and out as (B, Sq, H, D) of a (B, Sq, H D) buffer. */
typedef struct views {
    dit_tensor q, k, v, out, lse;
} views;

static views make_views(int64_t B, int64_t Sq, int64_t Skv, int64_t H, int64_t D, int64_t Dv)
{
    views w;
    const int64_t shq[3] = {B, Sq, 3 * H * D}, shk[3] = {B, Skv, 3 * H * D};
    const int64_t sho[3] = {B, Sq, H * Dv}, shl[3] = {B, H, Sq};
    const dit_tensor pq = dit_tensor_make(FAKE, DIT_BF16, 3, shq);
    const dit_tensor pk = dit_tensor_make(FAKE, DIT_BF16, 3, shk);
    dit_tensor f = dit_tensor_narrow(&pq, 2, 0, H * D);
    w.q = dit_tensor_split_last(&f, D);
    f = dit_tensor_narrow(&pk, 2, H * D, H * D);
    w.k = dit_tensor_split_last(&f, D);
    f = dit_tensor_narrow(&pk, 2, 2 * H * D, H * Dv);
    w.v = dit_tensor_split_last(&f, Dv);
    const dit_tensor o = dit_tensor_make(FAKE, DIT_BF16, 3, sho);
    w.out = dit_tensor_split_last(&o, Dv);
    w.lse = dit_tensor_make(FAKE, DIT_F32, 3, shl);
    return w;
}

static bool have_cudnn(void)
{
    views w = make_views(1, 64, 64, 1, 64, 64);
    char why[512];
    const dit_status st = dit_cudnn_sdpa_check(&w.out, NULL, &w.q, &w.k, &w.v, why, sizeof why);
    if (st == DIT_ERR_UNSUPPORTED)
        printf("cudnn_sdpa: SKIP: %s\n", why);
    else
        printf("cudnn_sdpa: %s\n", why);
    return st != DIT_ERR_UNSUPPORTED;
}

typedef struct sdpa_case {
    int64_t B, Sq, Skv, H, D;
    bool lse;
} sdpa_case;

/* FLUX.1-dev at 1024² (4608 joint tokens, 24 x 128), a ring shard
 * (Sq != Skv, statistics for the merge), uneven lengths, batch 2, D 64. */
static const sdpa_case cases[] = {
    {1, 4608, 4608, 24, 128, false}, {1, 4608, 4608, 24, 128, true}, {1, 2304, 4608, 24, 128, true},
    {2, 97, 53, 3, 128, true},       {1, 1000, 77, 2, 64, false},    {2, 256, 1000, 4, 64, true},
};

START_TEST(sdpa_op_is_accepted)
{
    const sdpa_case *c = &cases[_i];
    views w = make_views(c->B, c->Sq, c->Skv, c->H, c->D, c->D);
    char why[512];
    const dit_status st =
        dit_cudnn_sdpa_check(&w.out, c->lse ? &w.lse : NULL, &w.q, &w.k, &w.v, why, sizeof why);
    ck_assert_msg(st == DIT_OK, "B %lld Sq %lld Skv %lld H %lld D %lld%s: %s", (long long)c->B,
                  (long long)c->Sq, (long long)c->Skv, (long long)c->H, (long long)c->D,
                  c->lse ? " with stats" : "", why);
}
END_TEST

/* cuDNN does check what the kernel hands it: V narrower than Q and K (and
 * out as wide as V) is a valid SDPA, but a K whose head dim differs from
 * Q's is refused, with cuDNN's own reason passed on. */
START_TEST(sdpa_op_checks_shapes)
{
    views w = make_views(1, 128, 128, 2, 128, 64);
    char why[512];
    dit_status st = dit_cudnn_sdpa_check(&w.out, NULL, &w.q, &w.k, &w.v, why, sizeof why);
    ck_assert_msg(st == DIT_OK, "d_v 64 with d_qk 128: %s", why);
    views bad = make_views(1, 128, 128, 2, 128, 128);
    const dit_tensor k64 = dit_tensor_narrow(&bad.k, 3, 0, 64);
    st = dit_cudnn_sdpa_check(&bad.out, NULL, &bad.q, &k64, &bad.v, why, sizeof why);
    ck_assert_int_eq(st, DIT_ERR_INVALID_ARG);
    ck_assert_msg(strstr(why, "SDPA operation finalize") != NULL, "reason: %s", why);
    printf("refused as it should be: %s\n", why);
}
END_TEST

int main(void)
{
    if (!have_cudnn())
        return 77;
    Suite *s = suite_create("cudnn_sdpa");
    TCase *tc = tcase_create("op");
    tcase_add_loop_test(tc, sdpa_op_is_accepted, 0, (int)(sizeof cases / sizeof cases[0]));
    tcase_add_test(tc, sdpa_op_checks_shapes);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    const int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
