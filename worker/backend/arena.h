/* Activation arena: bump allocation from backend memory, released in one
 * call. After the first reset the arena holds one block as large as the
 * most it was ever asked for, so a forward pass that allocates the same
 * sequence again gets the same addresses (which CUDA graph replay needs).
 *
 * Owner: the thread that runs the forward pass using it. */
#ifndef DIT_BACKEND_ARENA_H
#define DIT_BACKEND_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "core/status.h"
#include "core/tensor.h"

typedef struct dit_arena dit_arena;

/* initial_bytes may be 0: the first allocation sizes the first block. */
dit_status dit_arena_create(dit_backend *be, size_t initial_bytes, dit_arena **out);
void dit_arena_destroy(dit_arena *a);

/* A contiguous tensor of `shape` from the arena, 64-byte aligned. */
dit_status dit_arena_tensor(dit_arena *a, dit_dtype dt, int ndim, const int64_t *shape,
                            dit_tensor *out);

/* Raw bytes from the arena, 64-byte aligned. */
dit_status dit_arena_bytes(dit_arena *a, size_t bytes, void **out);

/* A position in the arena; dit_arena_release(a, mark) frees everything
 * allocated after dit_arena_mark returned it (scoped scratch). */
typedef struct dit_arena_mark {
    void *block;
    size_t used;
    size_t in_use;
} dit_arena_mark;

dit_arena_mark dit_arena_get_mark(const dit_arena *a);
void dit_arena_release(dit_arena *a, dit_arena_mark mark);

/* Releases everything allocated since the last reset. */
void dit_arena_reset(dit_arena *a);

/* Largest number of bytes in use at once since creation. */
size_t dit_arena_high_water(const dit_arena *a);

#endif
