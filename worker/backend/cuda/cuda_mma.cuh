/* The warp-level instructions the tensor-core kernels are written with
 * (flash_attention.cuh): bf16 mma.sync, ldmatrix, cp.async, and the
 * declaration of a kernel's dynamic shared memory. A host emulator of them
 * (tests/gpu/simt_emu.h) lets the same kernels run on the CPU; the
 * semantics each comment states are what the emulator models. */
#ifndef DIT_BACKEND_CUDA_MMA_CUH
#define DIT_BACKEND_CUDA_MMA_CUH

#include <cstdint>

#include <cuda_bf16.h>

/* The kernel's dynamic shared memory as `unsigned char name[]`. */
#define DIT_DYN_SMEM(name) extern __shared__ __align__(16) unsigned char name[]

/* c += a b for a 16 x 16 bf16 A (row-major fragment) and a 16 x 8 bf16 B
 * (column fragment), f32 accumulators. With g = lane / 4, t = lane % 4:
 * a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9],
 * a[3] = A[g+8][2t+8, 2t+9]; b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g];
 * c[0..1] = C[g][2t, 2t+1], c[2..3] = C[g+8][2t, 2t+1] (lower index in the
 * low half of each 32-bit register). */
__device__ __forceinline__ void mma_bf16_16816(float c[4], const uint32_t a[4], uint32_t b0,
                                               uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared, asynchronously; zero-filled when !valid (then
 * nothing is read, but src must still be a mapped address). */
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

__device__ __forceinline__ void cp_async_wait_all()
{
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

/* Four 8x8 bf16 tiles from shared memory: lane l gives the address of row
 * l % 8 of tile l / 8 (16 bytes, 16-byte aligned) and receives in register
 * i the elements (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1) of tile i,
 * the first in the low half; ldsm_x4_trans the elements (2 (l % 4), l / 4)
 * and (2 (l % 4) + 1, l / 4), i.e. of the transposed tile. */
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const __nv_bfloat16 *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const __nv_bfloat16 *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

#endif
