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

extern "C" dit_status dit_cuda_backend_create(int device, dit_backend **out, dit_diag *diag)
{
    (void)out;
    int n = dit_cuda_device_count();
    if (n == 0)
        return dit_diag_set(diag, DIT_ERR_DEVICE,
                            "cuda backend: no CUDA device is visible (no GPU or no driver)");
    if (device < 0 || device >= n)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "cuda backend: device %d does not exist (%d visible)", device, n);
    return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                        "cuda backend: compute ops are not part of this build yet; use --backend cpu");
}
