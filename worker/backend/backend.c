#include "backend/backend.h"

#include <string.h>

#include "backend/cpu/cpu_backend.h"
#ifdef DIT_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

bool dit_backend_available(dit_backend_kind kind)
{
    switch (kind) {
    case DIT_BACKEND_CPU:
        return true;
    case DIT_BACKEND_CUDA:
#ifdef DIT_HAVE_CUDA
        return true;
#else
        return false;
#endif
    }
    return false;
}

dit_status dit_backend_create(const dit_backend_config *cfg, dit_backend **out, dit_diag *diag)
{
    switch (cfg->kind) {
    case DIT_BACKEND_CPU:
        return dit_cpu_backend_create(cfg->n_threads, out, diag);
    case DIT_BACKEND_CUDA:
#ifdef DIT_HAVE_CUDA
        return dit_cuda_backend_create(cfg->device, out, diag);
#else
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "this build has no CUDA backend (reconfigure with -Dcuda=enabled)");
#endif
    }
    return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "unknown backend kind %d", (int)cfg->kind);
}

void dit_backend_destroy(dit_backend *be)
{
    if (be)
        be->ops->destroy(be);
}
