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

/* ------------------------------------------------------------------------
 * Sliced loading: the same loader for weights that are cut (a tensor-
 * parallel rank's rows or columns, parallel/tp_plan.h) or fused (several
 * checkpoint tensors stacked into one device tensor). A plan reserves
 * destination tensors in one allocation and lists pieces: a checkpoint
 * tensor (or a slice of its rows and columns), its full expected shape, and
 * the destination rows it fills. Loading checks every piece's shape, uploads
 * the slices, and is strict: a checkpoint tensor no piece consumes is an
 * error naming the model class. A piece without a destination is checked
 * and consumed only (a bias another rank adds).
 *
 * Owner: the model that builds the plan, for the duration of its load. */

/* One checkpoint tensor (or a slice of it) and where it goes. */
typedef struct dit_weight_piece {
    char name[160];
    int ndim;
    int64_t shape[2]; /* full shape expected in the checkpoint */
    int64_t r0, nr;   /* rows taken (dim 0) */
    int64_t c0, nc;   /* columns taken (dim 1; 2-D only) */
    dit_tensor *dst;  /* NULL: checked and consumed, not stored on this rank */
    int64_t dst_row0; /* first row of dst it fills */
} dit_weight_piece;

typedef struct dit_weight_plan {
    dit_weight_piece *items;
    size_t n, cap;
    dit_tensor **tensors; /* destination tensors whose data is an offset until placed */
    size_t nt, tcap;
    size_t bytes;
    dit_dtype mat_dtype;
    bool oom;
    bool bad; /* a plan that contradicts itself (bad_msg says how) */
    char bad_msg[192];
} dit_weight_plan;

/* Empty plan; matrices are reserved in `mat_dtype`. */
void dit_weight_plan_init(dit_weight_plan *p, dit_dtype mat_dtype);
/* Frees what the plan holds and leaves it empty. */
void dit_weight_plan_free(dit_weight_plan *p);

/* Reserves a destination tensor (1 or 2 dims); its data pointer holds the
 * byte offset until dit_weight_plan_place. */
void dit_weight_plan_tensor(dit_weight_plan *p, dit_tensor *t, dit_dtype dt, int ndim, int64_t n0,
                            int64_t n1);

/* Adds a piece taking all of `name` (full shape s0, s1); the caller narrows
 * r0/nr, c0/nc and sets dst and dst_row0. NULL when out of memory (the plan
 * remembers it). */
dit_weight_piece *dit_weight_plan_piece(dit_weight_plan *p, const char *name, int ndim, int64_t s0,
                                        int64_t s1);

/* A whole f32 vector `name` (n) into a tensor reserved here. */
void dit_weight_plan_vector(dit_weight_plan *p, dit_tensor *dst, const char *name, int64_t n);

/* Points every reserved tensor into `base` (p->bytes bytes). */
void dit_weight_plan_place(dit_weight_plan *p, void *base);

/* Whether `set` holds block n - 1 of a stack of n blocks named
 * "<prefix>.<i>." (n from config.json's `key`): DIT_ERR_FORMAT naming both
 * otherwise. Checked before a plan is built, so that a config asking for
 * more blocks than its checkpoint holds is refused at once instead of
 * planning (and reserving) weights the file cannot have. */
dit_status dit_weight_check_blocks(const dit_st_set *set, const char *prefix, int n,
                                   const char *key, const char *dir, dit_diag *diag);

/* Checks the plan against `set` as dit_weight_plan_load does (every piece
 * present with its shape, no tensor the plan does not read), touching no
 * destination: called before the weights are allocated, so that a config
 * that disagrees with its checkpoint is refused for that, whatever size of
 * model it describes, instead of first reserving that model's memory. */
dit_status dit_weight_plan_check(const dit_weight_plan *p, const dit_st_set *set, const char *dir,
                                 const char *model_class, dit_diag *diag);

/* Loads every piece from `set` (`dir` and `model_class` for messages). */
dit_status dit_weight_plan_load(dit_weight_plan *p, dit_backend *be, const dit_st_set *set,
                                const char *dir, const char *model_class, dit_diag *diag);

/* Deterministic pseudo-random weights in place of a checkpoint: uniform in
 * +-1/sqrt(fan_in) (nn.Linear's default), norms 1, seeded per tensor name
 * and global row so that every rank's slice is a slice of the same whole. */
dit_status dit_weight_plan_randomize(dit_weight_plan *p, dit_backend *be, uint64_t seed,
                                     dit_diag *diag);

#endif
