/* Device discovery for the cuda backend. */
#include <cuda_runtime.h>
#include <nccl.h>

#include "backend/cuda/cuda_backend.h"

extern "C" int dit_cuda_device_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* clear the sticky "no driver" error */
        return 0;
    }
    return n;
}

extern "C" int dit_cuda_nccl_version(void)
{
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess)
        return 0;
    return v;
}
