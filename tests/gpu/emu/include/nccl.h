/* The one NCCL call the cuda backend makes (its version, for reports), for
 * the host build on the SIMT emulator, which has no NCCL. */
#ifndef DIT_EMU_NCCL_H
#define DIT_EMU_NCCL_H

typedef enum { ncclSuccess = 0, ncclSystemError = 2 } ncclResult_t;

static inline ncclResult_t ncclGetVersion(int *v)
{
    *v = 0;
    return ncclSystemError;
}

#endif
