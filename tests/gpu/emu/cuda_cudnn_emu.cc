/* backend/cuda/cuda_cudnn.cu built for the host on the SIMT emulator. */
#include "backend/cuda/cuda_cudnn.cu"
