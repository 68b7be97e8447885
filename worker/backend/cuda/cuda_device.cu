/* Device discovery for the cuda backend. */
#include <cstdio>

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

extern "C" int dit_cuda_device_probe(char *why, size_t why_size)
{
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        if (why && why_size)
            snprintf(why, why_size, "cudaGetDeviceCount: %s: %s", cudaGetErrorName(e),
                     cudaGetErrorString(e));
        cudaGetLastError();
        return 0;
    }
    if (n == 0 && why && why_size)
        snprintf(why, why_size, "cudaGetDeviceCount: 0 devices");
    return n;
}

extern "C" int dit_cuda_nccl_version(void)
{
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess)
        return 0;
    return v;
}
