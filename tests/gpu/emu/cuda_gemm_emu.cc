/* backend/cuda/cuda_gemm.cu built for the host on the SIMT emulator. */
#include "backend/cuda/cuda_gemm.cu"
