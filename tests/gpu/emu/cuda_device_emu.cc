/* backend/cuda/cuda_device.cu built for the host on the SIMT emulator. */
#include "backend/cuda/cuda_device.cu"
