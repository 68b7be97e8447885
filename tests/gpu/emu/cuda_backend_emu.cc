/* backend/cuda/cuda_backend.cu built for the host on the SIMT emulator. */
#include "backend/cuda/cuda_backend.cu"
