/* The cuda backend's entry points, callable from C. Compiled only when the
 * build has CUDA (DIT_HAVE_CUDA); backend.c guards every call. */
#ifndef DIT_BACKEND_CUDA_BACKEND_H
#define DIT_BACKEND_CUDA_BACKEND_H

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices; 0 when there is no driver or no GPU (the
 * CUDA runtime reports a missing driver as an error, which means "none"). */
int dit_cuda_device_count(void);

/* NCCL's version as major*10000 + minor*100 + patch, proving NCCL is linked. */
int dit_cuda_nccl_version(void);

dit_status dit_cuda_backend_create(int device, dit_backend **out, dit_diag *diag);

#ifdef __cplusplus
}
#endif

#endif
