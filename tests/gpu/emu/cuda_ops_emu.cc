/* backend/cuda/cuda_ops.cu built for the host on the SIMT emulator. */
#include "backend/cuda/cuda_ops.cu"
