/* bf16 for the host build on the SIMT emulator: the emulator's own
 * __nv_bfloat16 and conversions (simt_emu.h), which also stand in for the
 * warp-level instructions of backend/cuda/cuda_mma.cuh. */
#ifndef DIT_EMU_CUDA_BF16_H
#define DIT_EMU_CUDA_BF16_H

#include "simt_emu.h"

/* cuda_mma.cuh's inline PTX is the emulator's to model: its guard is taken. */
#define DIT_BACKEND_CUDA_MMA_CUH

#endif
