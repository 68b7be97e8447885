#include "backend/arena.h"

#include <stdlib.h>

#define ARENA_ALIGN 64

typedef struct arena_block {
    struct arena_block *next;
    void *base;
    size_t size;
    size_t used;
} arena_block;

struct dit_arena {
    dit_backend *be;
    arena_block *head; /* the block allocations come from */
    size_t in_use;     /* bytes handed out since the last reset, all blocks */
    size_t high_water;
};

static dit_status block_new(dit_arena *a, size_t size, arena_block **out)
{
    arena_block *blk = calloc(1, sizeof *blk);
    if (!blk)
        return DIT_ERR_NOMEM;
    dit_status st = dit_backend_alloc(a->be, size, &blk->base);
    if (st != DIT_OK) {
        free(blk);
        return st;
    }
    blk->size = size;
    *out = blk;
    return DIT_OK;
}

static void blocks_free(dit_arena *a)
{
    arena_block *blk = a->head;
    while (blk) {
        arena_block *next = blk->next;
        dit_backend_free(a->be, blk->base);
        free(blk);
        blk = next;
    }
    a->head = NULL;
}

dit_status dit_arena_create(dit_backend *be, size_t initial_bytes, dit_arena **out)
{
    dit_arena *a = calloc(1, sizeof *a);
    if (!a)
        return DIT_ERR_NOMEM;
    a->be = be;
    if (initial_bytes > 0) {
        dit_status st = block_new(a, initial_bytes, &a->head);
        if (st != DIT_OK) {
            free(a);
            return st;
        }
    }
    *out = a;
    return DIT_OK;
}

void dit_arena_destroy(dit_arena *a)
{
    if (!a)
        return;
    blocks_free(a);
    free(a);
}

dit_status dit_arena_bytes(dit_arena *a, size_t bytes, void **out)
{
    size_t need = (bytes + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
    if (need == 0)
        need = ARENA_ALIGN;
    if (!a->head || a->head->size - a->head->used < need) {
        size_t grow = a->head ? a->head->size * 2 : (size_t)1 << 20;
        arena_block *blk;
        dit_status st = block_new(a, need > grow ? need : grow, &blk);
        if (st != DIT_OK)
            return st;
        blk->next = a->head;
        a->head = blk;
    }
    *out = (char *)a->head->base + a->head->used;
    a->head->used += need;
    a->in_use += need;
    if (a->in_use > a->high_water)
        a->high_water = a->in_use;
    return DIT_OK;
}

dit_status dit_arena_tensor(dit_arena *a, dit_dtype dt, int ndim, const int64_t *shape,
                            dit_tensor *out)
{
    dit_tensor t = dit_tensor_make(NULL, dt, ndim, shape);
    void *p;
    dit_status st = dit_arena_bytes(a, dit_tensor_nbytes(&t), &p);
    if (st != DIT_OK)
        return st;
    t.data = p;
    *out = t;
    return DIT_OK;
}

dit_arena_mark dit_arena_get_mark(const dit_arena *a)
{
    dit_arena_mark m = {a->head, a->head ? a->head->used : 0, a->in_use};
    return m;
}

void dit_arena_release(dit_arena *a, dit_arena_mark mark)
{
    /* Blocks added after the mark go back to the backend; reset() later
     * replaces the chain by one block of the high-water size anyway. */
    while (a->head && a->head != (arena_block *)mark.block) {
        arena_block *next = a->head->next;
        dit_backend_free(a->be, a->head->base);
        free(a->head);
        a->head = next;
    }
    if (a->head)
        a->head->used = mark.used;
    a->in_use = mark.in_use;
}

void dit_arena_reset(dit_arena *a)
{
    if (!a)
        return;
    if (a->high_water > 0 && (!a->head || a->head->next || a->head->size < a->high_water)) {
        /* The pass needed more than one block: replace them by one that fits
         * the high-water mark, so the next pass allocates without growing. */
        blocks_free(a);
        if (block_new(a, a->high_water, &a->head) != DIT_OK)
            a->head = NULL; /* the next allocation retries */
    }
    if (a->head)
        a->head->used = 0;
    a->in_use = 0;
}

size_t dit_arena_high_water(const dit_arena *a)
{
    return a->high_water;
}
