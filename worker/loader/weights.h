/* Loading a model component's weights from a safetensors set into one
 * backend allocation, by a table of expected tensors.
 *
 * Each spec names a checkpoint tensor, its expected shape and the tensor
 * (a dit_tensor the caller owns) that receives it. Tensors of two or more
 * dims are stored in the backend's weight dtype, vectors in f32. Errors name
 * the file and the tensor: a missing tensor, a wrong shape, and (when
 * `strict`) a tensor in the checkpoint that no spec consumes.
 *
 * Owner: the caller owns the returned buffer (free it with
 * dit_backend_free); the specs' dst tensors point into it. */
#ifndef DIT_LOADER_WEIGHTS_H
#define DIT_LOADER_WEIGHTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "loader/safetensors.h"

typedef struct dit_weight_spec {
    char name[160];
    int ndim;
    int64_t shape[DIT_MAX_DIMS];
    dit_tensor *dst;
    bool optional; /* absent -> dst->data stays NULL */
} dit_weight_spec;

/* A growable list of specs, filled by a component's loader. */
typedef struct dit_weight_list {
    dit_weight_spec *items;
    size_t n, cap;
    bool oom;
} dit_weight_list;

/* Appends a spec: name printf-style, then the shape as ndim values. */
void dit_weight_list_add(dit_weight_list *l, dit_tensor *dst, bool optional, int ndim,
                         const int64_t *shape, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
void dit_weight_list_free(dit_weight_list *l);

/* Loads every spec of `l` from `set`; `what` prefixes error messages (the
 * folder, e.g. "vae"). On success *buffer holds all the weights. */
dit_status dit_weights_load(dit_backend *be, const dit_st_set *set, const dit_weight_list *l,
                            bool strict, const char *what, void **buffer, size_t *bytes,
                            dit_diag *diag);

#endif
