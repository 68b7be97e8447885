/* The tensor-core flash-attention kernels of the cuda backend (see
 * cuda_attention.cu for what each path is and when it runs): v1,
 * k_flash_mma, and v2, k_flash_pipe, with their argument block and
 * shared-memory layouts.
 *
 * Included by cuda_attention.cu under nvcc, and by the host emulator of
 * tests/gpu/test_flash_emu.cc, which runs these same kernels on the CPU
 * (one coroutine per thread). So the kernels use only CUDA builtins and the
 * primitives of backend/cuda/cuda_mma.cuh (mma, ldmatrix, cp.async,
 * DIT_DYN_SMEM), which the includer defines: nvcc gets the PTX, the
 * emulator its own model of each instruction. */
#ifndef DIT_BACKEND_CUDA_FLASH_ATTENTION_CUH
#define DIT_BACKEND_CUDA_FLASH_ATTENTION_CUH

#include <cmath>
#include <cstdint>

enum { FA_BQ = 64, FA_BK = 64, FA_WARPS = 4 };

struct attn_args {
    const void *q, *k, *v; /* TI: f32, or bf16 on the fast path */
    void *out;             /* TO: f32, or bf16 */
    float *lse;
    const float *bias;     /* (H, Sq, Skv) or NULL */
    int64_t q_b, q_s, q_h; /* strides in elements */
    int64_t k_b, k_s, k_h;
    int64_t v_b, v_s, v_h;
    int64_t o_b, o_s, o_h;
    int64_t Sq, Skv, H, D;
    float scale;
    bool causal;
};

/* ------------------------------------------------------------------------ */
/* Shared helpers                                                            */

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi); /* lo in the low half */
    return *(uint32_t *)&h;
}

/* Four consecutive elements as packed bf16 (element 0 in the low half of
 * .x, as in memory): f32 rounded, bf16 as they are. p is 8-byte aligned
 * for bf16 and 16-byte aligned for f32. */
__device__ __forceinline__ uint2 load4_bf16(const float *p)
{
    const float4 v = *(const float4 *)p;
    uint2 pk;
    pk.x = pack_bf16(v.x, v.y);
    pk.y = pack_bf16(v.z, v.w);
    return pk;
}

__device__ __forceinline__ uint2 load4_bf16(const __nv_bfloat16 *p)
{
    return *(const uint2 *)p;
}

__device__ __forceinline__ void store2(float *p, float a, float b)
{
    *(float2 *)p = make_float2(a, b);
}

__device__ __forceinline__ void store2(__nv_bfloat16 *p, float a, float b)
{
    *(__nv_bfloat162 *)p = __floats2bfloat162_rn(a, b);
}

/* ------------------------------------------------------------------------ */
/* The online softmax both tensor-core kernels run, per 16-row MMA tile      */

/* One key tile (keys k0 .. k0 + 63) of a 16-row tile whose rows g and g + 8
 * this thread shares with its quad: s, the tile's Q K^T accumulators,
 * becomes P (base-2 exponentials of scale * log2(e) scaled scores, keys at
 * or past Skv masked to 0); m0/m1 and l0/l1, the running maxima and the
 * thread's partial row sums (the quad reduces them only in fa_store_rows),
 * are updated; o, the 16 x D output accumulators, is rescaled. IDX (int64_t
 * or int) only sets the width of the index arithmetic. */
template <int D, typename IDX>
__device__ __forceinline__ void fa_softmax_tile(float (&s)[FA_BK / 8][4], float (&o)[D / 8][4],
                                                float &m0, float &m1, float &l0, float &l1, IDX k0,
                                                IDX Skv, int t, float sl2)
{
    /* Scale to base 2, mask keys past Skv, row maxima. */
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < FA_BK / 8; nt++) {
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const bool valid = k0 + nt * 8 + t * 2 + e < Skv;
            s[nt][e] = valid ? s[nt][e] * sl2 : -INFINITY;
            s[nt][2 + e] = valid ? s[nt][2 + e] * sl2 : -INFINITY;
            mx0 = fmaxf(mx0, s[nt][e]);
            mx1 = fmaxf(mx1, s[nt][2 + e]);
        }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    /* Every tile holds at least one valid key, so the maxima are finite. */
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float c0 = exp2f(m0 - mn0), c1 = exp2f(m1 - mn1); /* 0 on the first tile */
    m0 = mn0;
    m1 = mn1;
    float rs0 = 0.0f, rs1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < FA_BK / 8; nt++) {
        s[nt][0] = exp2f(s[nt][0] - mn0);
        s[nt][1] = exp2f(s[nt][1] - mn0);
        s[nt][2] = exp2f(s[nt][2] - mn1);
        s[nt][3] = exp2f(s[nt][3] - mn1);
        rs0 += s[nt][0] + s[nt][1];
        rs1 += s[nt][2] + s[nt][3];
    }
    l0 = l0 * c0 + rs0;
    l1 = l1 * c1 + rs1;
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) {
        o[nd][0] *= c0;
        o[nd][1] *= c0;
        o[nd][2] *= c1;
        o[nd][3] *= c1;
    }
}

/* P as the A fragments of k-chunk kk (keys 16 kk .. 16 kk + 15): the score
 * accumulators are already in A-fragment order. */
__device__ __forceinline__ void fa_p_fragment(const float (&s)[FA_BK / 8][4], int kk,
                                              uint32_t pa[4])
{
    pa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
    pa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    pa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

/* Rows r0 and r0 + 8 of (batch b, head h): the quad's row sums reduced,
 * out = o / l (rows at or past Sq skipped), and the natural-log LSE
 * (m + log2 l) ln 2 of the cpu op (-inf for a row without keys). */
template <int D, typename TO, typename IDX>
__device__ __forceinline__ void fa_store_rows(const attn_args &a, const float (&o)[D / 8][4],
                                              float m0, float m1, float l0, float l1, IDX r0,
                                              IDX Sq, int t, int64_t b, int64_t h)
{
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    const IDX r1 = r0 + 8;
    TO *op0 = (TO *)a.out + b * a.o_b + h * a.o_h + (int64_t)r0 * a.o_s;
    TO *op1 = op0 + 8 * a.o_s;
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) {
        const int c = nd * 8 + t * 2;
        if (r0 < Sq)
            store2(op0 + c, o[nd][0] * inv0, o[nd][1] * inv0);
        if (r1 < Sq)
            store2(op1 + c, o[nd][2] * inv1, o[nd][3] * inv1);
    }
    if (a.lse && t == 0) {
        const float ln2 = 0.6931471805599453f;
        float *lp = a.lse + (b * a.H + h) * a.Sq;
        if (r0 < Sq)
            lp[r0] = l0 > 0.0f ? (m0 + log2f(l0)) * ln2 : -INFINITY;
        if (r1 < Sq)
            lp[r1] = l1 > 0.0f ? (m1 + log2f(l1)) * ln2 : -INFINITY;
    }
}

/* ------------------------------------------------------------------------ */
/* v1: 64 queries a block                                                    */

template <int D> struct fa_smem {
    static const int LDQ = D + 8;     /* bf16 row stride of Qs, Ks (conflict-free) */
    static const int LDV = FA_BK + 8; /* bf16 row stride of Vt */
    static const int BYTES = (2 * FA_BQ * LDQ + D * LDV) * 2;
};

/* TI: the type of q, k, v (f32: rounded to bf16 while staged; bf16: staged
 * as they are, half the bytes read); TO: the type of out. */
template <int D, typename TI, typename TO>
__global__ void __launch_bounds__(FA_WARPS * 32) k_flash_mma(attn_args a)
{
    DIT_DYN_SMEM(smem_raw);
    typedef fa_smem<D> L;
    __nv_bfloat16 *Qs = (__nv_bfloat16 *)smem_raw;
    __nv_bfloat16 *Ks = Qs + FA_BQ * L::LDQ;
    __nv_bfloat16 *Vt = Ks + FA_BK * L::LDQ;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int64_t q0 = (int64_t)blockIdx.x * FA_BQ;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    const TI *qp = (const TI *)a.q + b * a.q_b + h * a.q_h;
    const TI *kp = (const TI *)a.k + b * a.k_b + h * a.k_h;
    const TI *vp = (const TI *)a.v + b * a.v_b + h * a.v_h;
    const float sl2 = a.scale * 1.4426950408889634f;

    /* Q tile -> bf16 shared memory (rows past Sq are zero). */
    for (int idx = tid; idx < FA_BQ * D / 4; idx += FA_WARPS * 32) {
        const int r = idx / (D / 4), c = (idx % (D / 4)) * 4;
        uint2 pk = make_uint2(0u, 0u);
        if (q0 + r < a.Sq)
            pk = load4_bf16(qp + (q0 + r) * a.q_s + c);
        *(uint2 *)(Qs + r * L::LDQ + c) = pk;
    }
    __syncthreads();
    uint32_t qf[D / 16][4];
    {
        const __nv_bfloat16 *q_lo = Qs + (warp * 16 + g) * L::LDQ;
        const __nv_bfloat16 *q_hi = q_lo + 8 * L::LDQ;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            qf[kk][0] = *(const uint32_t *)(q_lo + kk * 16 + t * 2);
            qf[kk][1] = *(const uint32_t *)(q_hi + kk * 16 + t * 2);
            qf[kk][2] = *(const uint32_t *)(q_lo + kk * 16 + 8 + t * 2);
            qf[kk][3] = *(const uint32_t *)(q_hi + kk * 16 + 8 + t * 2);
        }
    }

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++)
        o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    for (int64_t k0 = 0; k0 < a.Skv; k0 += FA_BK) {
        __syncthreads(); /* every warp is done with the previous K and V */
        for (int idx = tid; idx < FA_BK * D / 4; idx += FA_WARPS * 32) {
            const int r = idx / (D / 4), c = (idx % (D / 4)) * 4;
            uint2 pk = make_uint2(0u, 0u);
            if (k0 + r < a.Skv)
                pk = load4_bf16(kp + (k0 + r) * a.k_s + c);
            *(uint2 *)(Ks + r * L::LDQ + c) = pk;
        }
        /* V transposed; consecutive threads take consecutive keys so the
         * 16-bit shared stores do not collide on banks. */
        for (int idx = tid; idx < FA_BK * D / 4; idx += FA_WARPS * 32) {
            const int r = idx % FA_BK, c = (idx / FA_BK) * 4;
            uint2 pk = make_uint2(0u, 0u);
            if (k0 + r < a.Skv)
                pk = load4_bf16(vp + (k0 + r) * a.v_s + c);
            const __nv_bfloat16 *e = (const __nv_bfloat16 *)&pk;
            Vt[(c + 0) * L::LDV + r] = e[0];
            Vt[(c + 1) * L::LDV + r] = e[1];
            Vt[(c + 2) * L::LDV + r] = e[2];
            Vt[(c + 3) * L::LDV + r] = e[3];
        }
        __syncthreads();

        /* S = Q K^T for this warp's 16 rows: 8 tiles of 16 x 8. */
        float s[FA_BK / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_BK / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const __nv_bfloat16 *kr = Ks + (nt * 8 + g) * L::LDQ;
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                const uint32_t b0 = *(const uint32_t *)(kr + kk * 16 + t * 2);
                const uint32_t b1 = *(const uint32_t *)(kr + kk * 16 + 8 + t * 2);
                mma_bf16_16816(s[nt], qf[kk], b0, b1);
            }
        }
        fa_softmax_tile<D>(s, o, m0, m1, l0, l1, k0, a.Skv, t, sl2);
        /* O += P V. */
#pragma unroll
        for (int kk = 0; kk < FA_BK / 16; kk++) {
            uint32_t pa[4];
            fa_p_fragment(s, kk, pa);
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++) {
                const __nv_bfloat16 *vr = Vt + (nd * 8 + g) * L::LDV + kk * 16;
                const uint32_t b0 = *(const uint32_t *)(vr + t * 2);
                const uint32_t b1 = *(const uint32_t *)(vr + 8 + t * 2);
                mma_bf16_16816(o[nd], pa, b0, b1);
            }
        }
    }

    fa_store_rows<D, TO>(a, o, m0, m1, l0, l1, q0 + warp * 16 + g, a.Sq, t, b, h);
}

/* ------------------------------------------------------------------------ */
/* Pipelined tensor-core path (DIT_CUDA_ATTN=v2; bf16 q, k, v only)          */
/*
 * The same arithmetic as k_flash_mma, op for op and in the same order, so
 * its output and LSE are bit-identical to it (tests assert that); what
 * changes is how operands reach the tensor cores:
 *  - a block of 4 warps owns 128 queries and each warp 32 rows (two 16-row
 *    MMA tiles), so every K and V fragment read from shared memory feeds
 *    two MMAs instead of one (shared-memory bytes per flop halved);
 *  - fragments come from shared memory with ldmatrix (one instruction per
 *    four 8x8 tiles instead of eight 32-bit loads), V with ldmatrix.trans
 *    from its natural (key, dim) layout, so V is never transposed;
 *  - K, V and Q tiles are copied with cp.async (16 bytes a thread, zero
 *    fill past the sequence end), V of tile j while the warps compute
 *    Q K_j^T, K of tile j+1 while they do the softmax and P V_j.
 * Shared memory: Q (128 rows), one K and one V tile (64 rows), rows padded
 * by 16 bytes so the 8 rows an ldmatrix reads fall on distinct banks. Needs
 * 16-byte aligned rows (row, head and batch strides multiples of 8). */

enum { F2_BQ = 128, F2_BK = 64, F2_WARPS = 4 };
static_assert((int)F2_BK == (int)FA_BK, "v2 runs v1's softmax on v1's key tiles");

template <int D> struct f2_smem {
    static const int LD = D + 8; /* bf16 row stride of every tile */
    static const int BYTES = (F2_BQ + 2 * F2_BK) * LD * 2;
};

/* rows x D bf16 from src (row stride ld_src elements) into dst (stride
 * L::LD), rows at or past `valid` zero-filled. Thread tid copies column
 * piece tid % (D / 8) of rows tid / (D / 8) + i * PASS; the source pointer
 * steps by PASS rows (a hoisted address per piece would cost registers the
 * MMAs need). */
template <int D, int ROWS>
__device__ __forceinline__ void f2_load_tile(__nv_bfloat16 *dst, const __nv_bfloat16 *src,
                                             int64_t ld_src, int valid, int tid)
{
    typedef f2_smem<D> L;
    const int PASS = F2_WARPS * 32 / (D / 8);
    const int r0 = tid / (D / 8), c = (tid % (D / 8)) * 8;
    const __nv_bfloat16 *sp = src + r0 * ld_src + c;
    __nv_bfloat16 *dp = dst + r0 * L::LD + c;
#pragma unroll
    for (int i = 0; i < ROWS / PASS; i++) {
        const bool ok = r0 + i * PASS < valid;
        cp_async16(dp + i * PASS * L::LD, ok ? sp : src, ok);
        sp += PASS * ld_src;
    }
}

template <int D, typename TO>
__global__ void __launch_bounds__(F2_WARPS * 32) k_flash_pipe(attn_args a)
{
    DIT_DYN_SMEM(smem_raw);
    typedef f2_smem<D> L;
    __nv_bfloat16 *Qs = (__nv_bfloat16 *)smem_raw;
    __nv_bfloat16 *Ks = Qs + F2_BQ * L::LD;
    __nv_bfloat16 *Vs = Ks + F2_BK * L::LD;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    /* Sequence positions fit an int (the host checks): 32-bit index math
     * leaves the registers to the accumulators. */
    const int Sq = (int)a.Sq, Skv = (int)a.Skv;
    const int q0 = (int)blockIdx.x * F2_BQ;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    const __nv_bfloat16 *qp = (const __nv_bfloat16 *)a.q + b * a.q_b + h * a.q_h;
    const __nv_bfloat16 *kp = (const __nv_bfloat16 *)a.k + b * a.k_b + h * a.k_h;
    const __nv_bfloat16 *vp = (const __nv_bfloat16 *)a.v + b * a.v_b + h * a.v_h;
    const float sl2 = a.scale * 1.4426950408889634f;

    /* Lane roles in the ldmatrix addressing (see ldsm_x4): A tiles of Q as
     * (rows 0-7, 8-15) x (k 0-7, 8-15); B tiles of K as (keys n, n+8) x
     * (k 0-7, 8-15); B tiles of V as (keys 0-7, 8-15) x (dims n, n+8). */
    const int lr = lane & 7, lq = lane >> 3;
    const int a_row = lr + (lq & 1) * 8, a_col = (lq >> 1) * 8;
    const int kb_row = lr + (lq >> 1) * 8, kb_col = (lq & 1) * 8;
    const int vb_row = lr + (lq & 1) * 8, vb_col = (lq >> 1) * 8;

    f2_load_tile<D, F2_BQ>(Qs, qp + q0 * a.q_s, a.q_s, Sq - q0, tid);
    f2_load_tile<D, F2_BK>(Ks, kp, a.k_s, Skv, tid);
    cp_async_commit();

    float o[2][D / 8][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int i = 0; i < D / 8; i++)
            o[mi][i][0] = o[mi][i][1] = o[mi][i][2] = o[mi][i][3] = 0.0f;
    /* Running max and denominator of rows g and g + 8 of each 16-row tile. */
    float m[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
    float l[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    const __nv_bfloat16 *qw = Qs + (warp * 32 + a_row) * L::LD + a_col;

    for (int k0 = 0; k0 < Skv; k0 += F2_BK) {
        cp_async_wait_all();
        __syncthreads(); /* K (and Q) landed; every warp is done with V */
        f2_load_tile<D, F2_BK>(Vs, vp + k0 * a.v_s, a.v_s, Skv - k0, tid);
        cp_async_commit();

        /* S = Q K^T for this warp's 32 rows: 2 x 8 tiles of 16 x 8. */
        float s[2][F2_BK / 8][4];
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int nt = 0; nt < F2_BK / 8; nt++)
                s[mi][nt][0] = s[mi][nt][1] = s[mi][nt][2] = s[mi][nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t qa[2][4];
            ldsm_x4(qa[0], qw + kk * 16);
            ldsm_x4(qa[1], qw + 16 * L::LD + kk * 16);
#pragma unroll
            for (int nt = 0; nt < F2_BK / 8; nt += 2) {
                uint32_t kb[4];
                ldsm_x4(kb, Ks + (nt * 8 + kb_row) * L::LD + kk * 16 + kb_col);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    mma_bf16_16816(s[mi][nt], qa[mi], kb[0], kb[1]);
                    mma_bf16_16816(s[mi][nt + 1], qa[mi], kb[2], kb[3]);
                }
            }
        }

        cp_async_wait_all();
        __syncthreads(); /* V landed; every warp is done with K */
        if (k0 + F2_BK < Skv) {
            f2_load_tile<D, F2_BK>(Ks, kp + (k0 + F2_BK) * a.k_s, a.k_s, Skv - k0 - F2_BK, tid);
            cp_async_commit();
        }

#pragma unroll
        for (int mi = 0; mi < 2; mi++)
            fa_softmax_tile<D>(s[mi], o[mi], m[mi][0], m[mi][1], l[mi][0], l[mi][1], k0, Skv, t,
                               sl2);

            /* O += P V: P in A-fragment order already, V's B tiles by
             * ldmatrix.trans, each feeding both 16-row tiles. */
#pragma unroll
        for (int kk = 0; kk < F2_BK / 16; kk++) {
            uint32_t pa[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
                fa_p_fragment(s[mi], kk, pa[mi]);
#pragma unroll
            for (int nd = 0; nd < D / 8; nd += 2) {
                uint32_t vb[4];
                ldsm_x4_trans(vb, Vs + (kk * 16 + vb_row) * L::LD + nd * 8 + vb_col);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    mma_bf16_16816(o[mi][nd], pa[mi], vb[0], vb[1]);
                    mma_bf16_16816(o[mi][nd + 1], pa[mi], vb[2], vb[3]);
                }
            }
        }
    }
    cp_async_wait_all(); /* Skv == 0: the prologue's copies are still in flight */

#pragma unroll
    for (int mi = 0; mi < 2; mi++)
        fa_store_rows<D, TO>(a, o[mi], m[mi][0], m[mi][1], l[mi][0], l[mi][1],
                             q0 + warp * 32 + mi * 16 + g, Sq, t, b, h);
}

/* ------------------------------------------------------------------------ */
/* Generic f32 path                                                          */
/*
 * Any D <= GEN_MAXD, an optional additive bias and causal mask. Lane j of a
 * warp scores key k0 + j of each 32-key tile staged in shared memory (f32,
 * rows padded by one float); an online softmax with natural exponentials.
 * A warp owns QPW queries and runs each over the staged tile, so a block of
 * GEN_WARPS warps stages K and V once for GEN_WARPS * QPW queries: at the
 * VAE's D = 512 a tile is 128 KiB, and with QPW = 1 the tiles read per
 * query are what bounds the kernel. Every query sees the same operations in
 * the same order whatever QPW is (the other queries only share the loads),
 * so QPW changes no bit of the output. */

enum { GEN_BK = 32, GEN_WARPS = 4, GEN_MAXD = 512 };

/* Dynamic shared memory of k_attn_generic<QPW> at head dim D: the K and V
 * tiles and one q row per query. */
static inline size_t gen_smem_bytes(int64_t D, int qpw)
{
    return (size_t)(2 * GEN_BK * (D + 1) + GEN_WARPS * qpw * D) * sizeof(float);
}

__device__ __forceinline__ float ld1(const float *p)
{
    return *p;
}

__device__ __forceinline__ float ld1(const __nv_bfloat16 *p)
{
    return __bfloat162float(*p);
}

__device__ __forceinline__ void st1(float *p, float v)
{
    *p = v;
}

__device__ __forceinline__ void st1(__nv_bfloat16 *p, float v)
{
    *p = __float2bfloat16_rn(v);
}

template <int QPW, typename TI, typename TO>
__global__ void __launch_bounds__(GEN_WARPS * 32) k_attn_generic(attn_args a)
{
    DIT_DYN_SMEM(gsm_raw);
    float *gsm = (float *)gsm_raw;
    const int64_t D = a.D, ld = D + 1;
    float *Kt = gsm, *Vs = Kt + GEN_BK * ld, *Qr = Vs + GEN_BK * ld;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t h = blockIdx.y, b = blockIdx.z;
    const int64_t qbase = (int64_t)blockIdx.x * GEN_WARPS * QPW;
    const TI *kp = (const TI *)a.k + b * a.k_b + h * a.k_h;
    const TI *vp = (const TI *)a.v + b * a.v_b + h * a.v_h;
    /* This warp's queries qi[r] = qbase + warp * QPW + r, their q rows, and
     * per query the running max m, denominator l and output o. */
    int64_t qi[QPW];
    bool active[QPW];
    const float *qrow[QPW];
    float o[QPW][GEN_MAXD / 32], m[QPW], l[QPW];
#pragma unroll
    for (int r = 0; r < QPW; r++) {
        qi[r] = qbase + warp * QPW + r;
        active[r] = qi[r] < a.Sq;
        float *q = Qr + (warp * QPW + r) * D;
        qrow[r] = q;
        if (active[r]) {
            const TI *qp = (const TI *)a.q + b * a.q_b + h * a.q_h + qi[r] * a.q_s;
            for (int64_t d = lane; d < D; d += 32)
                q[d] = ld1(qp + d);
        }
#pragma unroll
        for (int i = 0; i < GEN_MAXD / 32; i++)
            o[r][i] = 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    bool any = false; /* warp-uniform */
#pragma unroll
    for (int r = 0; r < QPW; r++)
        any = any || active[r];
    int64_t kv_end = a.Skv;
    if (a.causal) {
        const int64_t last = qbase + GEN_WARPS * QPW; /* keys <= the block's last query */
        kv_end = last < kv_end ? last : kv_end;
    }
    for (int64_t k0 = 0; k0 < kv_end; k0 += GEN_BK) {
        __syncthreads();
        for (int64_t idx = tid; idx < GEN_BK * D; idx += GEN_WARPS * 32) {
            const int64_t r = idx / D, c = idx % D;
            const bool ok = k0 + r < a.Skv;
            Kt[r * ld + c] = ok ? ld1(kp + (k0 + r) * a.k_s + c) : 0.0f;
            Vs[r * ld + c] = ok ? ld1(vp + (k0 + r) * a.v_s + c) : 0.0f;
        }
        __syncthreads();
        if (!any)
            continue;
        /* Scores of key j for every query: one pass over the key's row. */
        const int64_t j = k0 + lane;
        const float *kr = Kt + lane * ld;
        float acc[QPW];
#pragma unroll
        for (int r = 0; r < QPW; r++)
            acc[r] = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            const float kd = kr[d];
#pragma unroll
            for (int r = 0; r < QPW; r++)
                acc[r] += qrow[r][d] * kd;
        }
        /* The softmax update of each query; live[r]: whether query r takes
         * this tile (not when it is inactive or everything so far is masked). */
        float p[QPW];
        bool live[QPW];
#pragma unroll
        for (int r = 0; r < QPW; r++) {
            live[r] = false;
            p[r] = 0.0f;
            if (!active[r])
                continue;
            float s = -INFINITY;
            if (j < a.Skv && !(a.causal && j > qi[r])) {
                s = acc[r] * a.scale;
                if (a.bias)
                    s += a.bias[(h * a.Sq + qi[r]) * a.Skv + j];
            }
            float mx = s;
            for (int off = 16; off > 0; off >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float mn = fmaxf(m[r], mx);
            if (mn == -INFINITY)
                continue; /* everything so far is masked */
            const float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - mn);
            p[r] = s == -INFINITY ? 0.0f : expf(s - mn);
            float ps = p[r];
            for (int off = 16; off > 0; off >>= 1)
                ps += __shfl_xor_sync(0xffffffffu, ps, off);
            l[r] = l[r] * corr + ps;
            m[r] = mn;
#pragma unroll
            for (int i = 0; i < GEN_MAXD / 32; i++)
                o[r][i] *= corr;
            live[r] = true;
        }
        /* o += p v, key by key; a zero weight adds nothing (not even a -0). */
        const int nk = (int)(a.Skv - k0 < (int64_t)GEN_BK ? a.Skv - k0 : (int64_t)GEN_BK);
        for (int jj = 0; jj < nk; jj++) {
            float pj[QPW];
            bool anyp = false;
#pragma unroll
            for (int r = 0; r < QPW; r++) {
                pj[r] = live[r] ? __shfl_sync(0xffffffffu, p[r], jj) : 0.0f;
                anyp = anyp || pj[r] != 0.0f;
            }
            if (!anyp)
                continue;
            const float *vr = Vs + jj * ld;
#pragma unroll
            for (int i = 0; i < GEN_MAXD / 32; i++) {
                const int64_t d = lane + 32 * i;
                if (d < D) {
                    const float vd = vr[d];
#pragma unroll
                    for (int r = 0; r < QPW; r++)
                        if (pj[r] != 0.0f)
                            o[r][i] += pj[r] * vd;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QPW; r++) {
        if (!active[r])
            continue;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        TO *op = (TO *)a.out + b * a.o_b + h * a.o_h + qi[r] * a.o_s;
#pragma unroll
        for (int i = 0; i < GEN_MAXD / 32; i++) {
            const int64_t d = lane + 32 * i;
            if (d < D)
                st1(op + d, o[r][i] * inv);
        }
        if (a.lse && lane == 0)
            a.lse[(b * a.H + h) * a.Sq + qi[r]] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
    }
}

#endif
