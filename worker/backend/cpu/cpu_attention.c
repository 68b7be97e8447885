/* cpu backend: block-wise (flash-style) softmax attention that also returns
 * the log-sum-exp, and the log-sum-exp merge used by ring attention.
 *
 * For each (batch, head, block of BQ queries) one thread keeps a running
 * maximum m, a running denominator l and an unnormalised output O, and walks
 * the keys in blocks of BK:
 *   S = scale * Q K^T                (BQ x BK, a GEMM)
 *   m' = max(m, rowmax S); P = e^(S - m'); l = l e^(m - m') + rowsum P
 *   O = O e^(m - m') + P V           (a GEMM)
 * and finally out = O / l, lse = m + log l. Memory per thread is
 * O(BQ * (BK + D)); the Sq x Skv score matrix never exists. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_math.h"

/* Query rows per task (at most) and keys per block. Big query blocks amortise
 * the packing OpenBLAS does for every small GEMM; they shrink when there
 * would otherwise be too few tasks to keep every thread busy. */
enum { ATTN_BQ_MAX = 256, ATTN_BQ_MIN = 32, ATTN_BK = 256 };

static bool is_bshd(const dit_tensor *t)
{
    return t && t->dtype == DIT_F32 && t->ndim == 4 && dit_tensor_rows_dense(t);
}

/* The kernel behind attention and attention_masked. bias (H, Sq, Skv) or
 * NULL; causal hides key j > query i. */
static dit_status attention_core(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                                 const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                                 float scale, const dit_tensor *bias, bool causal)
{
    if (!is_bshd(q) || !is_bshd(k) || !is_bshd(v) || !is_bshd(out))
        return DIT_ERR_INVALID_ARG;
    const int64_t B = q->ne[0], Sq = q->ne[1], H = q->ne[2], D = q->ne[3];
    const int64_t Skv = k->ne[1];
    if (!dit_tensor_same_shape(k, v) || k->ne[0] != B || k->ne[2] != H || k->ne[3] != D ||
        !dit_tensor_same_shape(q, out))
        return DIT_ERR_INVALID_ARG;
    if (lse && (lse->dtype != DIT_F32 || lse->ndim != 3 || lse->ne[0] != B || lse->ne[1] != H ||
                lse->ne[2] != Sq || !dit_tensor_is_contiguous(lse)))
        return DIT_ERR_INVALID_ARG;
    if (bias && (bias->dtype != DIT_F32 || bias->ndim != 3 || bias->ne[0] != H ||
                 bias->ne[1] != Sq || bias->ne[2] != Skv || !dit_tensor_is_contiguous(bias)))
        return DIT_ERR_INVALID_ARG;
    if (B == 0 || Sq == 0 || H == 0)
        return DIT_OK;
    const float *biasp = bias ? bias->data : NULL;

    /* Row strides in floats: consecutive tokens of one head. */
    const int64_t ldq = q->nb[1] / 4, ldk = k->nb[1] / 4, ldv = v->nb[1] / 4, ldo = out->nb[1] / 4;
    const int nt = B * Sq * Skv * H * D < 65536 ? 1 : dit_cpu_threads(be);
    int64_t bq_max = ATTN_BQ_MAX;
    while (bq_max > ATTN_BQ_MIN && B * H * ((Sq + bq_max - 1) / bq_max) < 4 * nt)
        bq_max /= 2;
    const int64_t n_qblk = (Sq + bq_max - 1) / bq_max;
    const int64_t n_tasks = B * H * n_qblk;
    dit_status st = DIT_OK;

#pragma omp parallel num_threads(nt)
    {
        float *s_blk = malloc(sizeof(float) * (size_t)(bq_max * ATTN_BK));
        float *o_acc = malloc(sizeof(float) * (size_t)(bq_max * D));
        float m[ATTN_BQ_MAX], l[ATTN_BQ_MAX];
        if (!s_blk || !o_acc) {
#pragma omp atomic write
            st = DIT_ERR_NOMEM;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n_tasks; task++) {
            if (!s_blk || !o_acc)
                continue;
            const int64_t qb = task % n_qblk;
            const int64_t h = (task / n_qblk) % H;
            const int64_t b = task / (n_qblk * H);
            const int64_t q0 = qb * bq_max;
            const int64_t bq = Sq - q0 < bq_max ? Sq - q0 : bq_max;
            const float *qp = (const float *)((const char *)q->data + b * q->nb[0] + q0 * q->nb[1] +
                                              h * q->nb[2]);
            const float *kp = (const float *)((const char *)k->data + b * k->nb[0] + h * k->nb[2]);
            const float *vp = (const float *)((const char *)v->data + b * v->nb[0] + h * v->nb[2]);

            for (int64_t i = 0; i < bq; i++) {
                m[i] = -INFINITY;
                l[i] = 0.0f;
            }
            memset(o_acc, 0, sizeof(float) * (size_t)(bq * D));

            /* Causal: no key past the block's last query matters. */
            const int64_t kv_end = causal && q0 + bq < Skv ? q0 + bq : Skv;
            for (int64_t k0 = 0; k0 < kv_end; k0 += ATTN_BK) {
                const int64_t bk = kv_end - k0 < ATTN_BK ? kv_end - k0 : ATTN_BK;
                /* S = scale * Q K^T  (bq x bk) */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)bq, (int)bk, (int)D,
                            scale, qp, (int)ldq, kp + k0 * ldk, (int)ldk, 0.0f, s_blk, (int)bk);
                if (biasp || causal) {
                    for (int64_t i = 0; i < bq; i++) {
                        float *srow = s_blk + i * bk;
                        if (biasp) {
                            const float *brow = biasp + (h * Sq + q0 + i) * Skv + k0;
                            for (int64_t j = 0; j < bk; j++)
                                srow[j] += brow[j];
                        }
                        if (causal)
                            for (int64_t j = q0 + i + 1 - k0 < 0 ? 0 : q0 + i + 1 - k0; j < bk; j++)
                                srow[j] = -INFINITY;
                    }
                }
                for (int64_t i = 0; i < bq; i++) {
                    float *srow = s_blk + i * bk;
                    /* The maximum is exact in any order: vectorised, the
                     * same value (NaN scores are skipped either way). */
                    float mx = m[i];
#pragma omp simd reduction(max : mx)
                    for (int64_t j = 0; j < bk; j++)
                        mx = srow[j] > mx ? srow[j] : mx;
                    float rowsum = 0.0f;
#pragma omp simd reduction(+ : rowsum)
                    for (int64_t j = 0; j < bk; j++) {
                        float p = dit_expf(srow[j] - mx);
                        srow[j] = p;
                        rowsum += p;
                    }
                    /* e^(m - m') is 0 on the first block (m = -inf). */
                    const float corr = m[i] == -INFINITY ? 0.0f : dit_expf(m[i] - mx);
                    l[i] = l[i] * corr + rowsum;
                    m[i] = mx;
                    if (corr != 1.0f) {
                        float *orow = o_acc + i * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++)
                            orow[d] *= corr;
                    }
                }
                /* O += P V  (bq x D) */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bq, (int)D, (int)bk,
                            1.0f, s_blk, (int)bk, vp + k0 * ldv, (int)ldv, 1.0f, o_acc, (int)D);
            }

            float *op =
                (float *)((char *)out->data + b * out->nb[0] + q0 * out->nb[1] + h * out->nb[2]);
            for (int64_t i = 0; i < bq; i++) {
                /* Skv == 0: the softmax is empty; out = 0 and lse = -inf so a
                 * later merge ignores this partial result. */
                const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
                float *orow = op + i * ldo;
                const float *arow = o_acc + i * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++)
                    orow[d] = arow[d] * inv;
                if (lse) {
                    float *lp = (float *)lse->data + (b * H + h) * Sq + q0 + i;
                    *lp = l[i] > 0.0f ? m[i] + logf(l[i]) : -INFINITY;
                }
            }
        }
        free(s_blk);
        free(o_acc);
    }
    return st;
}

dit_status DIT_CPU_KERNEL(attention)(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                                     const dit_tensor *q, const dit_tensor *k, const dit_tensor *v,
                                     float scale)
{
    return attention_core(be, out, lse, q, k, v, scale, NULL, false);
}

dit_status DIT_CPU_KERNEL(attention_masked)(dit_backend *be, const dit_tensor *out,
                                            const dit_tensor *q, const dit_tensor *k,
                                            const dit_tensor *v, float scale,
                                            const dit_tensor *bias, bool causal)
{
    return attention_core(be, out, NULL, q, k, v, scale, bias, causal);
}

dit_status DIT_CPU_KERNEL(lse_merge)(dit_backend *be, const dit_tensor *out, const dit_tensor *lse,
                                     const dit_tensor *out_b, const dit_tensor *lse_b)
{
    if (!is_bshd(out) || !is_bshd(out_b) || !dit_tensor_same_shape(out, out_b))
        return DIT_ERR_INVALID_ARG;
    const int64_t B = out->ne[0], S = out->ne[1], H = out->ne[2], D = out->ne[3];
    const dit_tensor *ls[2] = {lse, lse_b};
    for (int i = 0; i < 2; i++)
        if (!ls[i] || ls[i]->dtype != DIT_F32 || ls[i]->ndim != 3 || ls[i]->ne[0] != B ||
            ls[i]->ne[1] != H || ls[i]->ne[2] != S || !dit_tensor_is_contiguous(ls[i]))
            return DIT_ERR_INVALID_ARG;
    float *la = lse->data;
    const float *lb = lse_b->data;
#pragma omp parallel for num_threads(B *S *H *D < 16384 ? 1 : dit_cpu_threads(be)) schedule(static)
    for (int64_t r = 0; r < B * S * H; r++) {
        const int64_t h = r % H, s = (r / H) % S, b = r / (H * S);
        const int64_t li = (b * H + h) * S + s;
        const float a = la[li], c = lb[li];
        if (c == -INFINITY)
            continue; /* nothing to merge in */
        float *o = (float *)((char *)out->data + b * out->nb[0] + s * out->nb[1] + h * out->nb[2]);
        const float *ob = (const float *)((const char *)out_b->data + b * out_b->nb[0] +
                                          s * out_b->nb[1] + h * out_b->nb[2]);
        if (a == -INFINITY) {
            memcpy(o, ob, sizeof(float) * (size_t)D);
            la[li] = c;
            continue;
        }
        /* Weights relative to the larger lse, so neither exponential
         * overflows: wa + wb = 1. */
        const float mx = a > c ? a : c;
        const float ea = expf(a - mx), eb = expf(c - mx);
        const float sum = ea + eb;
        const float wa = ea / sum, wb = eb / sum;
        for (int64_t d = 0; d < D; d++)
            o[d] = wa * o[d] + wb * ob[d];
        la[li] = mx + logf(sum);
    }
    return DIT_OK;
}
