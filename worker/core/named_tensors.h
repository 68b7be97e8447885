/* A small set of named tensors: how a model's forward inputs travel between
 * layers that must not know the model (pipelines, the runtime, the CP plan),
 * under the names diffusers gives the forward's arguments
 * ("hidden_states", "encoder_hidden_states", "timestep", ...).
 *
 * The set does not own the tensors, nor the names (string literals or
 * storage that outlives the set); it is a fixed array, filled in place.
 *
 * Owner: the caller that declared it (usually a stack variable). */
#ifndef DIT_CORE_NAMED_TENSORS_H
#define DIT_CORE_NAMED_TENSORS_H

#include <stddef.h>

#include "core/status.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DIT_NAMED_TENSORS_MAX 16

typedef struct dit_named_tensor {
    const char *name;
    dit_tensor t;
} dit_named_tensor;

typedef struct dit_named_tensors {
    int n;
    dit_named_tensor v[DIT_NAMED_TENSORS_MAX];
} dit_named_tensors;

/* Adds (or replaces) `name`. DIT_ERR_INTERNAL when the set is full. */
dit_status dit_named_tensors_set(dit_named_tensors *s, const char *name, const dit_tensor *t);

/* The tensor named `name`, or NULL. */
const dit_tensor *dit_named_tensors_get(const dit_named_tensors *s, const char *name);

#ifdef __cplusplus
}
#endif

#endif
