/* backend/cuda/cuda_attention.cu built for the host on the SIMT emulator. */
#include "backend/cuda/cuda_attention.cu"
