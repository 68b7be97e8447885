/* gRPC server reflection (grpc.reflection.v1 and v1alpha, identical on the
 * wire) answered from the descriptor set embedded at build time, so that
 * grpcurl and other tools work against ditd with no .proto files.
 *
 * Owner: the loop thread; the index is read-only after creation. */
#ifndef DIT_DAEMON_REFLECTION_H
#define DIT_DAEMON_REFLECTION_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

typedef struct dit_reflection dit_reflection;

/* Indexes a serialized FileDescriptorSet; `services` are the full names
 * list_services reports. */
dit_status dit_reflection_create(const uint8_t *set, size_t len, const char *const *services,
                                 int n_services, dit_reflection **out, dit_diag *diag);
void dit_reflection_free(dit_reflection *r);

/* Answers one serialized ServerReflectionRequest with a serialized
 * ServerReflectionResponse (malloc'ed). -1 when the request does not parse. */
int dit_reflection_answer(const dit_reflection *r, const uint8_t *req, size_t len, uint8_t **resp,
                          size_t *resp_len);

#endif
