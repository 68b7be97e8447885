/* cpu backend: direct 2-D convolution at stride 1 for layers of few output
 * channels, where im2col + GEMM is narrow: with M = Co rows, packing the
 * column buffer (K x Ho*Wo, written by im2col, copied again by the GEMM)
 * costs more than the multiply (the demo VAEs' 4- to 32-channel layers,
 * every VAE's 3-channel conv_out). Per output row and tile of DC_T pixels,
 * each block of DC_O output channels keeps its DC_O x DC_NV vector
 * accumulators in registers over the K = Ci*kh*kw taps, in (c, i, j)
 * order, with fused multiply-adds from zero: what OpenBLAS's GEMM kernel
 * does over one K block, so the demo pipelines' outputs are byte-identical
 * to the GEMM path's (a K split into several blocks may round otherwise).
 * Built where the compiler targets AVX2+FMA or AVX-512; elsewhere it
 * declines and the GEMM runs. */
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "backend/cpu/cpu_internal.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define DC_DIRECT 1
typedef __m512 dc_vec;
enum { DC_L = 16 };
#define DC_ZERO() _mm512_setzero_ps()
#define DC_LOAD(p) _mm512_loadu_ps(p)
#define DC_SET1(v) _mm512_set1_ps(v)
#define DC_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define DC_STORE(p, v) _mm512_storeu_ps(p, v)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DC_DIRECT 1
typedef __m256 dc_vec;
enum { DC_L = 8 };
#define DC_ZERO() _mm256_setzero_ps()
#define DC_LOAD(p) _mm256_loadu_ps(p)
#define DC_SET1(v) _mm256_set1_ps(v)
#define DC_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define DC_STORE(p, v) _mm256_storeu_ps(p, v)
#else
#define DC_DIRECT 0
#endif

#if DC_DIRECT
/* DC_O x DC_NV = 12 accumulators hide the FMA latency and leave registers
 * for the DC_NV input vectors and a broadcast weight. */
enum { DC_O = 4, DC_NV = 3, DC_T = DC_NV * DC_L, DC_MAX_CO = 64, DC_MAX_K = 7 };
/* Per-thread scratch bound (floats): beyond it the GEMM path is used. */
enum { DC_SCRATCH_FLOATS = 4 << 20 };

/* A padded input row: every tile's DC_T + kw - 1 reads fit. */
static int64_t dc_row_floats(int64_t Wo, int64_t kw)
{
    return (Wo + DC_T - 1) / DC_T * DC_T + kw - 1;
}

/* d[k] = row[u0 + k] for k < n, zero where u0 + k falls outside [0, W). */
static void dc_copy_span(float *d, int64_t n, const float *row, int64_t W, int64_t u0)
{
    int64_t lo = -u0, hi = W - u0;
    lo = lo < 0 ? 0 : (lo > n ? n : lo);
    hi = hi < lo ? lo : (hi > n ? n : hi);
    memset(d, 0, sizeof(float) * (size_t)lo);
    memcpy(d + lo, row + u0 + lo, sizeof(float) * (size_t)(hi - lo));
    memset(d + hi, 0, sizeof(float) * (size_t)(n - hi));
}

/* wpack[ob][k][o] = w[ob*DC_O + o][k], zero for o past Co. */
static void dc_pack_weights(const float *w, float *wpack, int64_t Co, int64_t K)
{
    const int64_t n_ob = (Co + DC_O - 1) / DC_O;
    for (int64_t ob = 0; ob < n_ob; ob++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t o = 0; o < DC_O; o++) {
                const int64_t co = ob * DC_O + o;
                wpack[(ob * K + k) * DC_O + o] = co < Co ? w[co * K + k] : 0.0f;
            }
}

/* One tile: DC_O channels x DC_T pixels. Channel c's tap row i starts at
 * in + c*cs + ioff[i] (at the tile's first pixel, tap j = 0); tap rows
 * outside [i0, i1) lie in the zero padding and are skipped. */
typedef struct dc_src {
    const float *in;
    int64_t cs, i0, i1;
    int64_t ioff[DC_MAX_K];
} dc_src;

static void dc_tile(const dc_src *src, const float *wk, int64_t Ci, int64_t kh, int64_t kw,
                    float out[DC_O][DC_T])
{
    dc_vec acc[DC_O][DC_NV];
    for (int o = 0; o < DC_O; o++)
        for (int v = 0; v < DC_NV; v++)
            acc[o][v] = DC_ZERO();
    for (int64_t c = 0; c < Ci; c++)
        for (int64_t i = src->i0; i < src->i1; i++) {
            const float *row = src->in + c * src->cs + src->ioff[i];
            const float *wr = wk + (c * kh + i) * kw * DC_O;
            for (int64_t j = 0; j < kw; j++, wr += DC_O) {
                dc_vec s[DC_NV];
                for (int v = 0; v < DC_NV; v++)
                    s[v] = DC_LOAD(row + j + v * DC_L);
                for (int o = 0; o < DC_O; o++) {
                    const dc_vec wv = DC_SET1(wr[o]);
                    for (int v = 0; v < DC_NV; v++)
                        acc[o][v] = DC_FMA(wv, s[v], acc[o][v]);
                }
            }
        }
    for (int o = 0; o < DC_O; o++)
        for (int v = 0; v < DC_NV; v++)
            DC_STORE(out[o] + v * DC_L, acc[o][v]);
}

/* Each thread makes a run of output rows. Its scratch holds, per input
 * channel, the kh input rows its current output row reads, zero-padded to
 * dc_row_floats and kept in a ring (input row iy in slot iy mod kh), so each
 * input row is copied once per thread, not kh times; the copy also keeps
 * the channels' rows apart (rows of a large image a power of two apart
 * would share L1 sets). */
static void conv_direct(const float *xb, const float *wpack, float *scratch, float *yb, int64_t Ci,
                        int64_t H, int64_t W, int64_t Co, int64_t kh, int64_t kw, int64_t pad,
                        int64_t Ho, int64_t Wo, int nt)
{
    const int64_t n_ob = (Co + DC_O - 1) / DC_O, K = Ci * kh * kw, wp = dc_row_floats(Wo, kw);
#pragma omp parallel num_threads(nt)
    {
        const int64_t me = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t ya = Ho * me / n, yz = Ho * (me + 1) / n;
        float *ring = scratch + me * Ci * kh * wp;
        float out[DC_O][DC_T];
        for (int64_t oy = ya; oy < yz; oy++) {
            /* Bring in input rows oy - pad .. oy - pad + kh - 1 (all of
             * them for the run's first row, the last one after it). */
            for (int64_t iy = oy == ya ? oy - pad : oy - pad + kh - 1; iy < oy - pad + kh; iy++) {
                const int64_t slot = ((iy % kh) + kh) % kh;
                for (int64_t c = 0; c < Ci; c++) {
                    float *d = ring + (c * kh + slot) * wp;
                    if (iy < 0 || iy >= H)
                        memset(d, 0, sizeof(float) * (size_t)wp);
                    else
                        dc_copy_span(d, wp, xb + (c * H + iy) * W, W, -pad);
                }
            }
            dc_src src = {ring,
                          kh * wp,
                          pad - oy > 0 ? pad - oy : 0,
                          H + pad - oy < kh ? H + pad - oy : kh,
                          {0}};
            for (int64_t i = 0; i < kh; i++)
                src.ioff[i] = (((oy - pad + i) % kh + kh) % kh) * wp;
            /* Channel blocks inside the tile loop: the tile's input stays
             * in L1 across them. */
            for (int64_t x0 = 0; x0 < Wo; x0 += DC_T) {
                const int64_t nx = Wo - x0 < DC_T ? Wo - x0 : DC_T;
                for (int64_t ob = 0; ob < n_ob; ob++) {
                    const int64_t o0 = ob * DC_O, no = Co - o0 < DC_O ? Co - o0 : DC_O;
                    src.in = ring + x0;
                    dc_tile(&src, wpack + ob * K * DC_O, Ci, kh, kw, out);
                    for (int64_t o = 0; o < no; o++)
                        memcpy(yb + ((o0 + o) * Ho + oy) * Wo + x0, out[o],
                               sizeof(float) * (size_t)nx);
                }
            }
        }
    }
}

dit_status dit_cpu_conv2d_direct(int nt, const float *x, const float *w, float *y, int64_t B,
                                 int64_t Ci, int64_t H, int64_t W, int64_t Co, int64_t kh,
                                 int64_t kw, int64_t pad)
{
    const int64_t Ho = H + 2 * pad - kh + 1, Wo = W + 2 * pad - kw + 1, K = Ci * kh * kw;
    if (Co > DC_MAX_CO || kh > DC_MAX_K || Ho < 1 || Wo < 1 ||
        Ci * kh * dc_row_floats(Wo, kw) > DC_SCRATCH_FLOATS)
        return DIT_ERR_UNSUPPORTED;
    const int64_t n_ob = (Co + DC_O - 1) / DC_O;
    float *wpack = malloc(sizeof(float) * (size_t)(n_ob * K * DC_O));
    float *scratch = malloc(sizeof(float) * (size_t)(nt * Ci * kh * dc_row_floats(Wo, kw)));
    dit_status st = DIT_ERR_NOMEM;
    if (!wpack || !scratch)
        goto cleanup;
    dc_pack_weights(w, wpack, Co, K);
    for (int64_t b = 0; b < B; b++)
        conv_direct(x + b * Ci * H * W, wpack, scratch, y + b * Co * Ho * Wo, Ci, H, W, Co, kh, kw,
                    pad, Ho, Wo, nt);
    st = DIT_OK;
cleanup:
    free(wpack);
    free(scratch);
    return st;
}
#else
dit_status dit_cpu_conv2d_direct(int nt, const float *x, const float *w, float *y, int64_t B,
                                 int64_t Ci, int64_t H, int64_t W, int64_t Co, int64_t kh,
                                 int64_t kw, int64_t pad)
{
    (void)nt, (void)x, (void)w, (void)y, (void)B, (void)Ci, (void)H, (void)W, (void)Co, (void)kh,
        (void)kw, (void)pad;
    return DIT_ERR_UNSUPPORTED;
}
#endif
