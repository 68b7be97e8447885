/* Backend names, apart from the backends: the coordinator parses
 * --backend with it and links no backend. */
#include <string.h>

#include "backend/backend.h"

dit_status dit_backend_kind_parse(const char *s, dit_backend_kind *out)
{
    if (strcmp(s, "cpu") == 0) {
        *out = DIT_BACKEND_CPU;
        return DIT_OK;
    }
    if (strcmp(s, "cuda") == 0) {
        *out = DIT_BACKEND_CUDA;
        return DIT_OK;
    }
    return DIT_ERR_INVALID_ARG;
}
