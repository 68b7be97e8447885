#include "backend/graph_cache.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct graph_slot {
    unsigned char key[DIT_GRAPH_CACHE_KEY_MAX];
    dit_backend_graph *g; /* NULL: free slot */
    uint64_t used;
} graph_slot;

struct dit_graph_cache {
    dit_backend *be;
    size_t key_size;
    char what[64];
    bool on, broken, pending_set;
    graph_slot slot[DIT_GRAPH_CACHE_SLOTS];
    uint64_t clock;
    unsigned char pending[DIT_GRAPH_CACHE_KEY_MAX];
};

dit_status dit_graph_cache_create(dit_backend *be, size_t key_size, const char *what,
                                  dit_graph_cache **out, dit_diag *diag)
{
    if (key_size > DIT_GRAPH_CACHE_KEY_MAX)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "graph cache: a %zu-byte key is too long",
                            key_size);
    dit_graph_cache *c = calloc(1, sizeof *c);
    if (!c)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    c->be = be;
    c->key_size = key_size;
    snprintf(c->what, sizeof c->what, "%s", what);
    *out = c;
    return DIT_OK;
}

void dit_graph_cache_destroy(dit_graph_cache *c)
{
    if (!c)
        return;
    dit_graph_cache_set_enabled(c, false);
    free(c);
}

void dit_graph_cache_set_enabled(dit_graph_cache *c, bool on)
{
    c->on = on;
    c->broken = false;
    c->pending_set = false;
    for (int i = 0; !on && i < DIT_GRAPH_CACHE_SLOTS; i++) {
        if (c->slot[i].g)
            c->be->ops->graph_destroy(c->be, c->slot[i].g);
        c->slot[i].g = NULL;
    }
}

bool dit_graph_cache_captured(const dit_graph_cache *c)
{
    for (int i = 0; i < DIT_GRAPH_CACHE_SLOTS; i++)
        if (c->slot[i].g)
            return true;
    return false;
}

dit_status dit_graph_cache_run(dit_graph_cache *c, const void *key, bool eager,
                               dit_graph_body_fn body, void *ctx, dit_diag *diag)
{
    dit_backend *be = c->be;
    if (!c->on || c->broken || !be->ops->graph_begin || eager)
        return body(ctx, diag);
    dit_status st;
    graph_slot *slot = &c->slot[0];
    for (int i = 0; i < DIT_GRAPH_CACHE_SLOTS; i++) {
        graph_slot *gi = &c->slot[i];
        if (gi->g && memcmp(key, gi->key, c->key_size) == 0) {
            gi->used = ++c->clock;
            st = be->ops->graph_launch(be, gi->g);
            if (st != DIT_OK)
                st = dit_diag_set(diag, st, "%s: graph replay failed: %s", c->what,
                                  be->ops->last_error ? be->ops->last_error(be) : "");
            return st;
        }
        if (!gi->g ? slot->g != NULL : (slot->g && gi->used < slot->used))
            slot = gi; /* a free slot, else the least recently used */
    }
    if (!c->pending_set || memcmp(key, c->pending, c->key_size) != 0) {
        memcpy(c->pending, key, c->key_size);
        c->pending_set = true;
        return body(ctx, diag);
    }
    if (slot->g) {
        be->ops->graph_destroy(be, slot->g);
        slot->g = NULL;
    }
    /* Messages of a failed capture must not reach the caller's diag. */
    dit_diag cap_diag;
    dit_diag_clear(&cap_diag);
    dit_backend_graph *g = NULL;
    st = be->ops->graph_begin(be);
    if (st == DIT_OK) {
        st = body(ctx, &cap_diag);
        dit_status st_end = be->ops->graph_end(be, &g);
        if (st == DIT_OK)
            st = st_end;
    }
    if (st == DIT_OK && g) {
        slot->g = g;
        memcpy(slot->key, key, c->key_size);
        slot->used = ++c->clock;
        c->pending_set = false;
        st = be->ops->graph_launch(be, g);
        if (st != DIT_OK)
            st = dit_diag_set(diag, st, "%s: graph launch failed: %s", c->what,
                              be->ops->last_error ? be->ops->last_error(be) : "");
        return st;
    }
    if (g)
        be->ops->graph_destroy(be, g);
    fprintf(stderr, "%s: graph capture failed (%s%s%s); running eagerly from now on\n", c->what,
            dit_diag_msg(&cap_diag), be->ops->last_error ? ": " : "",
            be->ops->last_error ? be->ops->last_error(be) : "");
    c->broken = true;
    return body(ctx, diag);
}
