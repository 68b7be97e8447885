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
 * With GCC on x86-64 the kernel is built for AVX2+FMA and for AVX-512
 * whatever -march says (cpu_conv_direct_isa.inc, once per set under its
 * target pragma) and the CPU's own set is picked at run time, so a build
 * for any x86-64 (the container image's, -Dmarch=) has it too; the
 * AVX-512 one where the CPU has it, as OpenBLAS picks its kernel. On a
 * CPU without either, or with another compiler, it declines and the GEMM
 * runs. */
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "backend/cpu/cpu_internal.h"

/* DC_O x DC_NV = 12 accumulators hide the FMA latency and leave registers
 * for the DC_NV input vectors and a broadcast weight. */
enum { DC_O = 4, DC_NV = 3, DC_MAX_CO = 64, DC_MAX_K = 7 };
/* Per-thread scratch bound (floats): beyond it the GEMM path is used. */
enum { DC_SCRATCH_FLOATS = 4 << 20 };

#define DC_CAT2(a, b) a##_##b
#define DC_CAT(a, b) DC_CAT2(a, b)
#define DC_FN(name) DC_CAT(name, DC_ISA)

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DC_DISPATCH
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define DC_ISA avx2
typedef __m256 dc_vec_avx2;
#define dc_vec dc_vec_avx2
#define DC_L 8
#define DC_ZERO() _mm256_setzero_ps()
#define DC_LOAD(p) _mm256_loadu_ps(p)
#define DC_SET1(v) _mm256_set1_ps(v)
#define DC_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define DC_STORE(p, v) _mm256_storeu_ps(p, v)
#include "backend/cpu/cpu_conv_direct_isa.inc"
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
#define DC_ISA avx512
typedef __m512 dc_vec_avx512;
#define dc_vec dc_vec_avx512
#define DC_L 16
#define DC_ZERO() _mm512_setzero_ps()
#define DC_LOAD(p) _mm512_loadu_ps(p)
#define DC_SET1(v) _mm512_set1_ps(v)
#define DC_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define DC_STORE(p, v) _mm512_storeu_ps(p, v)
#include "backend/cpu/cpu_conv_direct_isa.inc"
#pragma GCC pop_options

#endif

dit_status dit_cpu_conv2d_direct_isa(dit_cpu_isa isa, int nt, const float *x, const float *w,
                                     float *y, int64_t B, int64_t Ci, int64_t H, int64_t W,
                                     int64_t Co, int64_t kh, int64_t kw, int64_t pad)
{
#ifdef DC_DISPATCH
    const bool has512 = __builtin_cpu_supports("avx512f");
    const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == DIT_CPU_ISA_AVX512 || (isa == DIT_CPU_ISA_BEST && has512))
        return has512 ? conv2d_direct_avx512(nt, x, w, y, B, Ci, H, W, Co, kh, kw, pad)
                      : DIT_ERR_UNSUPPORTED;
    if (isa == DIT_CPU_ISA_AVX2 || isa == DIT_CPU_ISA_BEST)
        return has2 ? conv2d_direct_avx2(nt, x, w, y, B, Ci, H, W, Co, kh, kw, pad)
                    : DIT_ERR_UNSUPPORTED;
    return DIT_ERR_UNSUPPORTED;
#else
    (void)isa, (void)nt, (void)x, (void)w, (void)y, (void)B, (void)Ci, (void)H, (void)W, (void)Co,
        (void)kh, (void)kw, (void)pad;
    return DIT_ERR_UNSUPPORTED;
#endif
}

dit_status dit_cpu_conv2d_direct(int nt, const float *x, const float *w, float *y, int64_t B,
                                 int64_t Ci, int64_t H, int64_t W, int64_t Co, int64_t kh,
                                 int64_t kw, int64_t pad)
{
    return dit_cpu_conv2d_direct_isa(DIT_CPU_ISA_BEST, nt, x, w, y, B, Ci, H, W, Co, kh, kw, pad);
}
