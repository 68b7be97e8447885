/* What the coordinator (ditd) uses of the worker's lower layers, in one
 * place: the backend names it parses --backend with (backend/backend.h;
 * ditd links only backend_kind.c of it) and the shared-memory segments a
 * mesh of CPU workers talks through, which the supervisor creates, aborts
 * and reclaims (comm/shm/comm_shm.h; the host comm library, no CUDA).
 * ditd includes this header rather than those layers, so the layer check
 * (tests/layers/check_layers.py) sees it use serve only.
 *
 * Owner: declarations only. */
#ifndef DIT_SERVE_HOST_H
#define DIT_SERVE_HOST_H

#include "backend/backend.h"
#include "comm/shm/comm_shm.h"

#endif
