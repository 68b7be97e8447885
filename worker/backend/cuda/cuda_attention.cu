/* cuda backend: flash attention and the log-sum-exp merge of ring attention.
 *
 * Fast path (head dims 64 and 128): FlashAttention-2 style. A block of 4
 * warps owns 64 queries of one (batch, head); each warp owns 16 query rows.
 * Per tile of 64 keys: the block stages the K tile (and V, stored
 * transposed) in shared memory as bf16 (f32 inputs are rounded there, tile
 * by tile; the fast path's bf16 inputs are copied as they are, half the
 * bytes), every warp computes its 16 x 64
 * score tile with bf16 mma.sync (m16n8k16, f32 accumulation), keeps a
 * running row max m and denominator l in registers (online softmax, base-2
 * exponentials of scale*log2(e)-scaled scores), rescales its 16 x D output
 * accumulator and adds P V with P rounded to bf16. Nothing of size Sq x Skv
 * exists. lse = (m + log2 l) ln 2 is the natural-log convention of the cpu op.
 *
 * Pipelined path (DIT_CUDA_ATTN=v2, bf16 q/k/v at D 64 and 128): the same
 * arithmetic with 128 queries a block, ldmatrix fragments and cp.async
 * copies overlapping the MMAs; bit-identical to the path above (see
 * k_flash_pipe).
 *
 * cuDNN path (DIT_CUDA_ATTN=cudnn, bf16 q/k/v and out): cuDNN's fused SDPA
 * forward, see cuda_cudnn.cu.
 *
 * Generic path (any D <= 512, e.g. the VAE's single 512-wide head, and every
 * attention_masked call): f32 on CUDA
 * cores, one warp per query row, keys in tiles of 32 staged in shared
 * memory; the same online softmax with natural exponentials, plus the
 * additive bias and causal mask the text encoders need. */
#include <cmath>

#include "backend/cuda/cuda_internal.cuh"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/flash_attention.cuh"

/* ------------------------------------------------------------------------ */
/* Host side                                                                 */

/* The generic kernel with GEN_QPW_WIDE queries a warp serves heads wider
 * than GEN_WIDE_D (the VAEs' single 384- and 512-wide heads over thousands
 * of tokens), where staging K and V per query dominates; narrower heads
 * (text encoders, the demo's 16) keep one query a warp and more blocks. */
enum { GEN_QPW_WIDE = 4, GEN_WIDE_D = 128 };

template <int QPW> static dit_status generic_init(dit_cuda_backend *cb, const char *op)
{
    const size_t want = gen_smem_bytes(GEN_MAXD, QPW);
    const int bytes = (int)(want < cb->gen_smem_max ? want : cb->gen_smem_max);
    CUDA_TRY(cb, op,
             cudaFuncSetAttribute(k_attn_generic<QPW, float, float>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CUDA_TRY(cb, op,
             cudaFuncSetAttribute(k_attn_generic<QPW, __nv_bfloat16, float>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    CUDA_TRY(cb, op,
             cudaFuncSetAttribute(k_attn_generic<QPW, __nv_bfloat16, __nv_bfloat16>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return DIT_OK;
}

/* The (input, output) type pairs the kernels are built for: f32 -> f32
 * (legacy path, text encoders, VAE), bf16 -> f32 and bf16 -> bf16 (fast
 * path). */
template <int D> static dit_status flash_init(dit_cuda_backend *cb, const char *op)
{
    CUDA_TRY(cb, op,
             cudaFuncSetAttribute(k_flash_mma<D, float, float>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, fa_smem<D>::BYTES));
    CUDA_TRY(cb, op,
             cudaFuncSetAttribute(k_flash_mma<D, __nv_bfloat16, float>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, fa_smem<D>::BYTES));
    CUDA_TRY(cb, op,
             cudaFuncSetAttribute(k_flash_mma<D, __nv_bfloat16, __nv_bfloat16>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, fa_smem<D>::BYTES));
    return DIT_OK;
}

template <int D> static dit_status flash_pipe_init(dit_cuda_backend *cb, const char *op)
{
    CUDA_TRY(cb, op,
             cudaFuncSetAttribute(k_flash_pipe<D, float>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, f2_smem<D>::BYTES));
    CUDA_TRY(cb, op,
             cudaFuncSetAttribute(k_flash_pipe<D, __nv_bfloat16>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, f2_smem<D>::BYTES));
    return DIT_OK;
}

dit_status dit_cuda_attention_init(dit_cuda_backend *cb)
{
    const char *op = "attention init";
    DIT_CHECK_RET(flash_init<64>(cb, op));
    DIT_CHECK_RET(flash_init<128>(cb, op));
    DIT_CHECK_RET(flash_pipe_init<64>(cb, op));
    DIT_CHECK_RET(flash_pipe_init<128>(cb, op));
    /* The generic kernel's widest head (512) wants ~128 KiB for its tiles
     * (and 32 KiB more for four queries a warp): what the GPU allows per
     * block (sm_86/89 allow less than sm_80/90) caps its D. */
    int optin = 0;
    CUDA_TRY(cb, op,
             cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, cb->device));
    cb->gen_smem_max = (size_t)optin;
    DIT_CHECK_RET(generic_init<1>(cb, op));
    DIT_CHECK_RET(generic_init<GEN_QPW_WIDE>(cb, op));
    return DIT_OK;
}

static bool is_bshd(const dit_tensor *t)
{
    return t && t->dtype == DIT_F32 && t->ndim == 4 && dit_tensor_rows_dense(t);
}

/* (B, S, H, D) with dense rows, f32 or bf16. */
static bool is_bshd_any(const dit_tensor *t)
{
    return t && (t->dtype == DIT_F32 || t->dtype == DIT_BF16) && t->ndim == 4 &&
           dit_tensor_rows_dense(t);
}

/* The tensor-core kernel reads 4 elements at a time: 16-byte aligned rows
 * for f32, 8-byte for bf16. */
static bool aligned_rows(const dit_tensor *t, int bytes)
{
    return ((uintptr_t)t->data % (uintptr_t)bytes) == 0 && t->nb[0] % bytes == 0 &&
           t->nb[1] % bytes == 0 && t->nb[2] % bytes == 0;
}

/* v1 (fast) or the generic kernel with qpw queries a warp, over a
 * (ceil(Sq / queries a block), H, B) grid. */
template <typename TI, typename TO>
static void launch_attention(dit_cuda_backend *cb, bool fast, int qpw, int64_t B,
                             const attn_args &a)
{
    const int64_t per = fast ? FA_BQ : GEN_WARPS * qpw;
    const dim3 grid((unsigned)((a.Sq + per - 1) / per), (unsigned)a.H, (unsigned)B);
    /* One launch through a kernel pointer (DIT_CUDA_LAUNCH takes no
     * template argument list with commas). */
    void (*kern)(attn_args) = k_attn_generic<1, TI, TO>;
    unsigned threads = GEN_WARPS * 32;
    size_t smem = gen_smem_bytes(a.D, 1);
    if (fast) {
        kern = a.D == 64 ? k_flash_mma<64, TI, TO> : k_flash_mma<128, TI, TO>;
        threads = FA_WARPS * 32;
        smem = a.D == 64 ? fa_smem<64>::BYTES : fa_smem<128>::BYTES;
    } else if (qpw == GEN_QPW_WIDE) {
        kern = k_attn_generic<GEN_QPW_WIDE, TI, TO>;
        smem = gen_smem_bytes(a.D, GEN_QPW_WIDE);
    }
    DIT_CUDA_LAUNCH(kern, grid, threads, smem, cb->stream, a);
}

static dit_status attention_core(dit_cuda_backend *cb, const char *op, const dit_tensor *out,
                                 const dit_tensor *lse, const dit_tensor *q, const dit_tensor *k,
                                 const dit_tensor *v, float scale, const dit_tensor *bias,
                                 bool causal)
{
    if (!is_bshd_any(q) || !is_bshd_any(k) || !is_bshd_any(v) || !is_bshd_any(out) ||
        k->dtype != q->dtype || v->dtype != q->dtype ||
        (q->dtype == DIT_F32 && out->dtype != DIT_F32))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op,
                            "q, k, v, out must be (B, S, H, D): q, k, v all f32 (out f32) or "
                            "all bf16 (out f32 or bf16)");
    const int64_t B = q->ne[0], Sq = q->ne[1], H = q->ne[2], D = q->ne[3];
    const int64_t Skv = k->ne[1];
    if (!dit_tensor_same_shape(k, v) || k->ne[0] != B || k->ne[2] != H || k->ne[3] != D ||
        !dit_tensor_same_shape(q, out))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "q, k, v, out shapes disagree");
    if (lse && (lse->dtype != DIT_F32 || lse->ndim != 3 || lse->ne[0] != B || lse->ne[1] != H ||
                lse->ne[2] != Sq || !dit_tensor_is_contiguous(lse)))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "lse must be (B, H, Sq) f32 contiguous");
    if (bias && (bias->dtype != DIT_F32 || bias->ndim != 3 || bias->ne[0] != H ||
                 bias->ne[1] != Sq || bias->ne[2] != Skv || !dit_tensor_is_contiguous(bias)))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "bias must be (H, Sq, Skv) f32");
    if (B == 0 || Sq == 0 || H == 0)
        return DIT_OK;
    if (B > 65535 || H > 65535)
        return dit_cuda_bad(cb, DIT_ERR_UNSUPPORTED, op, "batch or heads above 65535");
    const int64_t ie = q->dtype == DIT_F32 ? 4 : 2, oe = out->dtype == DIT_F32 ? 4 : 2;
    attn_args a;
    a.q = q->data;
    a.k = k->data;
    a.v = v->data;
    a.out = out->data;
    a.lse = lse ? (float *)lse->data : NULL;
    a.bias = bias ? (const float *)bias->data : NULL;
    a.q_b = q->nb[0] / ie, a.q_s = q->nb[1] / ie, a.q_h = q->nb[2] / ie;
    a.k_b = k->nb[0] / ie, a.k_s = k->nb[1] / ie, a.k_h = k->nb[2] / ie;
    a.v_b = v->nb[0] / ie, a.v_s = v->nb[1] / ie, a.v_h = v->nb[2] / ie;
    a.o_b = out->nb[0] / oe, a.o_s = out->nb[1] / oe, a.o_h = out->nb[2] / oe;
    a.Sq = Sq, a.Skv = Skv, a.H = H, a.D = D;
    a.scale = scale;
    a.causal = causal;

    const int in_al = (int)(4 * ie), out_al = (int)(2 * oe);
    const bool fast = !cb->attn_f32 && !bias && !causal && (D == 64 || D == 128) &&
                      aligned_rows(q, in_al) && aligned_rows(k, in_al) && aligned_rows(v, in_al) &&
                      aligned_rows(out, out_al);
    if (!fast && (D > GEN_MAXD || gen_smem_bytes(D, 1) > cb->gen_smem_max))
        return dit_cuda_bad(cb, DIT_ERR_UNSUPPORTED, op,
                            "head dim %lld is too wide for this GPU's attention kernels",
                            (long long)D);
    const int qpw =
        cb->gen_qpw != 1 && D > GEN_WIDE_D && gen_smem_bytes(D, GEN_QPW_WIDE) <= cb->gen_smem_max
            ? GEN_QPW_WIDE
            : 1;
    /* cuDNN's SDPA (DIT_CUDA_ATTN=cudnn): bf16 q, k, v and out; what it
     * cannot take, or has no plan for, runs on v1. */
    if (fast && cb->attn == DIT_CUDA_ATTN_CUDNN && dit_cuda_cudnn_eligible(out, lse, q, k, v)) {
        bool ran = false;
        DIT_CHECK_RET(dit_cuda_cudnn_attention(cb, op, out, lse, q, k, v, scale, &ran));
        if (ran)
            return DIT_OK;
    }
    /* The pipelined kernel: bf16 q, k, v whose rows cp.async can copy in
     * 16-byte pieces. */
    const bool pipe = fast && cb->attn == DIT_CUDA_ATTN_V2 && q->dtype == DIT_BF16 &&
                      aligned_rows(q, 16) && aligned_rows(k, 16) && aligned_rows(v, 16) &&
                      Sq <= INT32_MAX - F2_BQ && Skv <= INT32_MAX - F2_BK;
    if (pipe) {
        const dim3 grid((unsigned)((Sq + F2_BQ - 1) / F2_BQ), (unsigned)H, (unsigned)B);
        const unsigned threads = F2_WARPS * 32;
        void (*kern)(attn_args) =
            out->dtype == DIT_F32
                ? (D == 64 ? k_flash_pipe<64, float> : k_flash_pipe<128, float>)
                : (D == 64 ? k_flash_pipe<64, __nv_bfloat16> : k_flash_pipe<128, __nv_bfloat16>);
        DIT_CUDA_LAUNCH(kern, grid, threads, D == 64 ? f2_smem<64>::BYTES : f2_smem<128>::BYTES,
                        cb->stream, a);
        cb->stats.attn_v2_calls++;
        CUDA_LAUNCHED(cb, op);
        return DIT_OK;
    }
    if (fast)
        cb->stats.attn_v1_calls++;
    else
        cb->stats.attn_generic_calls++;
    if (q->dtype == DIT_F32)
        launch_attention<float, float>(cb, fast, qpw, B, a);
    else if (out->dtype == DIT_F32)
        launch_attention<__nv_bfloat16, float>(cb, fast, qpw, B, a);
    else
        launch_attention<__nv_bfloat16, __nv_bfloat16>(cb, fast, qpw, B, a);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

extern "C" dit_status dit_cuda_attention(dit_backend *be, const dit_tensor *out,
                                         const dit_tensor *lse, const dit_tensor *q,
                                         const dit_tensor *k, const dit_tensor *v, float scale)
{
    return attention_core(cuda_of(be), "attention", out, lse, q, k, v, scale, NULL, false);
}

extern "C" dit_status dit_cuda_attention_masked(dit_backend *be, const dit_tensor *out,
                                                const dit_tensor *q, const dit_tensor *k,
                                                const dit_tensor *v, float scale,
                                                const dit_tensor *bias, bool causal)
{
    return attention_core(cuda_of(be), "attention_masked", out, NULL, q, k, v, scale, bias, causal);
}

/* One warp per (b, s, h) row. */
__global__ void k_lse_merge(cuda_view out, float *la, const cuda_view outb, const float *lb,
                            int64_t S, int64_t H, int64_t rows)
{
    const int64_t r = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows)
        return;
    const int lane = threadIdx.x & 31;
    const int64_t h = r % H, s = (r / H) % S, b = r / (H * S);
    const int64_t li = (b * H + h) * S + s;
    const float x = la[li], y = lb[li];
    if (y == -INFINITY)
        return;
    float *o = (float *)cuda_view_at(out, r, 0);
    const float *ob = (const float *)cuda_view_at(outb, r, 0);
    const int64_t D = out.ne[3];
    if (x == -INFINITY) {
        for (int64_t d = lane; d < D; d += 32)
            o[d] = ob[d];
    } else {
        const float mx = fmaxf(x, y);
        const float ea = expf(x - mx), eb = expf(y - mx);
        const float sum = ea + eb;
        const float wa = ea / sum, wb = eb / sum;
        for (int64_t d = lane; d < D; d += 32)
            o[d] = wa * o[d] + wb * ob[d];
    }
    __syncwarp();
    if (lane == 0)
        la[li] =
            x == -INFINITY ? y : fmaxf(x, y) + logf(expf(x - fmaxf(x, y)) + expf(y - fmaxf(x, y)));
}

extern "C" dit_status dit_cuda_lse_merge(dit_backend *be, const dit_tensor *out,
                                         const dit_tensor *lse, const dit_tensor *out_b,
                                         const dit_tensor *lse_b)
{
    dit_cuda_backend *cb = cuda_of(be);
    const char *op = "lse_merge";
    if (!is_bshd(out) || !is_bshd(out_b) || !dit_tensor_same_shape(out, out_b))
        return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "out, out_b must be (B, S, H, D) f32");
    const int64_t B = out->ne[0], S = out->ne[1], H = out->ne[2];
    const dit_tensor *ls[2] = {lse, lse_b};
    for (int i = 0; i < 2; i++)
        if (!ls[i] || ls[i]->dtype != DIT_F32 || ls[i]->ndim != 3 || ls[i]->ne[0] != B ||
            ls[i]->ne[1] != H || ls[i]->ne[2] != S || !dit_tensor_is_contiguous(ls[i]))
            return dit_cuda_bad(cb, DIT_ERR_INVALID_ARG, op, "lse must be (B, H, S) f32");
    const int64_t rows = B * S * H;
    if (rows == 0)
        return DIT_OK;
    const int warps = 8;
    DIT_CUDA_LAUNCH(k_lse_merge, (unsigned)((rows + warps - 1) / warps), 32 * warps, 0, cb->stream,
                    cuda_view_of(out), (float *)lse->data, cuda_view_of(out_b),
                    (const float *)lse_b->data, S, H, rows);
    CUDA_LAUNCHED(cb, op);
    return DIT_OK;
}

extern "C" void dit_cuda_backend_set_attention_f32(dit_backend *be, bool on)
{
    if (dit_backend_is_cuda(be))
        cuda_of(be)->attn_f32 = on;
}

extern "C" void dit_cuda_backend_set_generic_qpw(dit_backend *be, int qpw)
{
    if (dit_backend_is_cuda(be))
        cuda_of(be)->gen_qpw = qpw == 1 ? 1 : 0;
}
