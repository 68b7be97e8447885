/* The one place a dit_status becomes a gRPC status code (design §7):
 * bad request -> INVALID_ARGUMENT, unknown model -> NOT_FOUND, out of
 * memory -> RESOURCE_EXHAUSTED, a lost or stalled worker or device ->
 * UNAVAILABLE, unsupported -> UNIMPLEMENTED, cancelled -> CANCELLED,
 * anything else -> INTERNAL.
 *
 * Owner: none; a pure function. */
#ifndef DIT_DAEMON_STATUS_MAP_H
#define DIT_DAEMON_STATUS_MAP_H

#include <grpc/status.h>

#include "core/status.h"

grpc_status_code dit_status_to_grpc(dit_status st);

#endif
