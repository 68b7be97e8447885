/* cpu backend: the image ops of the VAE decoder (NCHW): 2-D convolution as
 * im2col + GEMM over bands of output rows (so the column buffer stays a few
 * MiB at any resolution) or, at stride 1 and few outputs, by the direct
 * kernel of cpu_conv_direct.c, GroupNorm with an optional fused SiLU, and nearest
 * 2x upsampling. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "backend/cpu/cpu_internal.h"
#include "backend/cpu/cpu_math.h"

static bool is_nchw(const dit_tensor *t)
{
    return t && t->dtype == DIT_F32 && t->ndim == 4 && dit_tensor_is_contiguous(t);
}

/* Column-buffer budget per band, in floats (8 MiB). */
enum { CONV_COL_FLOATS = 2 << 20 };

dit_status DIT_CPU_KERNEL(conv2d)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                  const dit_tensor *w, const dit_tensor *bias, int stride, int pad)
{
    if (!is_nchw(x) || !is_nchw(y) || !is_nchw(w) || stride < 1 || pad < 0)
        return DIT_ERR_INVALID_ARG;
    const int64_t B = x->ne[0], Ci = x->ne[1], H = x->ne[2], W = x->ne[3];
    const int64_t Co = w->ne[0], kh = w->ne[2], kw = w->ne[3];
    const int64_t Ho = (H + 2 * pad - kh) / stride + 1, Wo = (W + 2 * pad - kw) / stride + 1;
    if (w->ne[1] != Ci || y->ne[0] != B || y->ne[1] != Co || y->ne[2] != Ho || y->ne[3] != Wo)
        return DIT_ERR_INVALID_ARG;
    if (bias && (bias->dtype != DIT_F32 || bias->ndim != 1 || bias->ne[0] != Co))
        return DIT_ERR_INVALID_ARG;
    const int64_t K = Ci * kh * kw;
    const int nt = dit_cpu_threads(be);
    const bool pointwise = kh == 1 && kw == 1 && stride == 1 && pad == 0;
    /* Stride 1 at few outputs: the direct kernel (cpu_conv_direct.c). */
    bool direct = false;
    if (!pointwise && stride == 1) {
        const dit_status st =
            dit_cpu_conv2d_direct(nt, x->data, w->data, y->data, B, Ci, H, W, Co, kh, kw, pad);
        if (st != DIT_OK && st != DIT_ERR_UNSUPPORTED)
            return st;
        direct = st == DIT_OK;
    }
    float *col = NULL;
    int64_t band = CONV_COL_FLOATS / (K * Wo > 0 ? K * Wo : 1);
    band = band < 1 ? 1 : (band > Ho ? Ho : band);
    if (!direct && !pointwise) {
        col = malloc(sizeof(float) * (size_t)(K * band * Wo));
        if (!col)
            return DIT_ERR_NOMEM;
    }
    for (int64_t b = 0; b < B; b++) {
        const float *xb = (const float *)x->data + b * Ci * H * W;
        float *yb = (float *)y->data + b * Co * Ho * Wo;
        if (direct) {
            /* made above; the bias follows */
        } else if (pointwise) {
            /* 1x1: y (Co, HW) = w (Co, Ci) x (Ci, HW) directly. */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)Co, (int)(H * W), (int)Ci,
                        1.0f, w->data, (int)Ci, xb, (int)(H * W), 0.0f, yb, (int)(H * W));
        } else {
            for (int64_t r0 = 0; r0 < Ho; r0 += band) {
                const int64_t nr = Ho - r0 < band ? Ho - r0 : band;
                const int64_t ncol = nr * Wo;
                /* col (K, nr * Wo): row (c, i, j) holds x[c, oy*s - p + i, ox*s - p + j]. */
#pragma omp parallel for num_threads(nt) schedule(static)
                for (int64_t kk = 0; kk < K; kk++) {
                    const int64_t c = kk / (kh * kw), i = (kk / kw) % kh, j = kk % kw;
                    float *dst = col + kk * ncol;
                    for (int64_t oy = 0; oy < nr; oy++) {
                        const int64_t iy = (r0 + oy) * stride - pad + i;
                        float *d = dst + oy * Wo;
                        if (iy < 0 || iy >= H) {
                            memset(d, 0, sizeof(float) * (size_t)Wo);
                            continue;
                        }
                        const float *src = xb + (c * H + iy) * W;
                        if (stride == 1) {
                            /* ix = ox - pad + j: zeros left of the row, a
                             * copy of its [lo - pad + j, hi - pad + j), zeros
                             * right of it. */
                            int64_t lo = pad - j, hi = W + pad - j;
                            lo = lo < 0 ? 0 : (lo > Wo ? Wo : lo);
                            hi = hi < lo ? lo : (hi > Wo ? Wo : hi);
                            memset(d, 0, sizeof(float) * (size_t)lo);
                            memcpy(d + lo, src + lo - pad + j, sizeof(float) * (size_t)(hi - lo));
                            memset(d + hi, 0, sizeof(float) * (size_t)(Wo - hi));
                            continue;
                        }
                        for (int64_t ox = 0; ox < Wo; ox++) {
                            const int64_t ix = ox * stride - pad + j;
                            d[ox] = ix >= 0 && ix < W ? src[ix] : 0.0f;
                        }
                    }
                }
                /* y[:, r0:r0+nr, :] (Co, nr*Wo) = w (Co, K) col (K, nr*Wo); the
                 * band is contiguous in every output channel plane. */
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)Co, (int)ncol, (int)K,
                            1.0f, w->data, (int)K, col, (int)ncol, 0.0f, yb + r0 * Wo,
                            (int)(Ho * Wo));
            }
        }
        if (bias) {
            const float *bp = bias->data;
#pragma omp parallel for num_threads(nt) schedule(static)
            for (int64_t o = 0; o < Co; o++) {
                float *plane = yb + o * Ho * Wo;
#pragma omp simd
                for (int64_t p = 0; p < Ho * Wo; p++)
                    plane[p] += bp[o];
            }
        }
    }
    free(col);
    return DIT_OK;
}

dit_status DIT_CPU_KERNEL(group_norm)(dit_backend *be, const dit_tensor *y, const dit_tensor *x,
                                      const dit_tensor *weight, const dit_tensor *bias, int groups,
                                      float eps, dit_act act)
{
    if (!is_nchw(x) || !is_nchw(y) || !dit_tensor_same_shape(x, y) || groups < 1)
        return DIT_ERR_INVALID_ARG;
    const int64_t B = x->ne[0], C = x->ne[1], HW = x->ne[2] * x->ne[3];
    if (C % groups != 0 || !weight || !bias || weight->ne[0] != C || bias->ne[0] != C ||
        (act != DIT_ACT_NONE && act != DIT_ACT_SILU))
        return DIT_ERR_INVALID_ARG;
    const int64_t cg = C / groups;
    const float *wp = weight->data, *bp = bias->data;
#pragma omp parallel for num_threads(dit_cpu_threads(be)) schedule(static)
    for (int64_t t = 0; t < B * groups; t++) {
        const int64_t b = t / groups, g = t % groups;
        const float *xg = (const float *)x->data + (b * C + g * cg) * HW;
        float *yg = (float *)y->data + (b * C + g * cg) * HW;
        const int64_t n = cg * HW;
        /* Two passes in double: groups span up to millions of values. */
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++)
            sum += xg[i];
        const double mean = sum / (double)n;
        double sq = 0.0;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < n; i++)
            sq += ((double)xg[i] - mean) * ((double)xg[i] - mean);
        const float rstd = (float)(1.0 / sqrt(sq / (double)n + eps));
        const float fmean = (float)mean;
        for (int64_t c = 0; c < cg; c++) {
            const float a = rstd * wp[g * cg + c];
            const float off = bp[g * cg + c] - fmean * a;
            const float *xc = xg + c * HW;
            float *yc = yg + c * HW;
            if (act == DIT_ACT_SILU) {
#pragma omp simd
                for (int64_t i = 0; i < HW; i++)
                    yc[i] = dit_siluf(xc[i] * a + off);
            } else {
#pragma omp simd
                for (int64_t i = 0; i < HW; i++)
                    yc[i] = xc[i] * a + off;
            }
        }
    }
    return DIT_OK;
}

dit_status DIT_CPU_KERNEL(upsample2x)(dit_backend *be, const dit_tensor *y, const dit_tensor *x)
{
    if (!is_nchw(x) || !is_nchw(y))
        return DIT_ERR_INVALID_ARG;
    const int64_t B = x->ne[0], C = x->ne[1], H = x->ne[2], W = x->ne[3];
    if (y->ne[0] != B || y->ne[1] != C || y->ne[2] != 2 * H || y->ne[3] != 2 * W)
        return DIT_ERR_INVALID_ARG;
#pragma omp parallel for num_threads(dit_cpu_threads(be)) schedule(static)
    for (int64_t p = 0; p < B * C * H; p++) {
        const float *src = (const float *)x->data + p * W;
        const int64_t plane = p / H, iy = p % H;
        float *d0 = (float *)y->data + (plane * 2 * H + 2 * iy) * 2 * W;
        float *d1 = d0 + 2 * W;
        for (int64_t ix = 0; ix < W; ix++) {
            d0[2 * ix] = d0[2 * ix + 1] = src[ix];
            d1[2 * ix] = d1[2 * ix + 1] = src[ix];
        }
    }
    return DIT_OK;
}
