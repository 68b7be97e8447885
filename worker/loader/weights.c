#include "loader/weights.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WEIGHT_ALIGN 256

void dit_weight_list_add(dit_weight_list *l, dit_tensor *dst, bool optional, int ndim,
                         const int64_t *shape, const char *fmt, ...)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 128;
        dit_weight_spec *ni = realloc(l->items, cap * sizeof *ni);
        if (!ni) {
            l->oom = true;
            return;
        }
        l->items = ni;
        l->cap = cap;
    }
    dit_weight_spec *s = &l->items[l->n++];
    memset(s, 0, sizeof *s);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->name, sizeof s->name, fmt, ap);
    va_end(ap);
    s->ndim = ndim;
    for (int i = 0; i < ndim && i < DIT_MAX_DIMS; i++)
        s->shape[i] = shape[i];
    s->dst = dst;
    s->optional = optional;
}

void dit_weight_list_free(dit_weight_list *l)
{
    free(l->items);
    memset(l, 0, sizeof *l);
}

static void shape_text(const int64_t *s, int ndim, char *buf, size_t cap)
{
    size_t used = 0;
    int n = snprintf(buf, cap, "(");
    used = n > 0 ? (size_t)n : 0;
    for (int i = 0; i < ndim && used < cap; i++) {
        n = snprintf(buf + used, cap - used, "%s%lld", i ? ", " : "", (long long)s[i]);
        used += n > 0 ? (size_t)n : 0;
    }
    if (used < cap)
        snprintf(buf + used, cap - used, ")");
}

dit_status dit_weights_load(dit_backend *be, const dit_st_set *set, const dit_weight_list *l,
                            bool strict, const char *what, void **buffer, size_t *bytes,
                            dit_diag *diag)
{
    dit_status st = DIT_OK;
    const size_t count = dit_st_set_count(set);
    bool *used = calloc(count ? count : 1, sizeof *used);
    const dit_st_entry **found = calloc(l->n ? l->n : 1, sizeof *found);
    void *base = NULL;
    if (!used || !found || l->oom) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", what);
        goto cleanup;
    }
    /* Check every spec first, then size the one allocation. */
    size_t total = 0;
    for (size_t i = 0; i < l->n; i++) {
        const dit_weight_spec *s = &l->items[i];
        const dit_st_entry *e = dit_st_set_find(set, s->name);
        if (!e) {
            if (s->optional)
                continue;
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: tensor '%s' is missing from the checkpoint (does config.json "
                              "belong to these weights?)",
                              what, s->name);
            goto cleanup;
        }
        bool ok = e->view.ndim == s->ndim;
        for (int d = 0; ok && d < s->ndim; d++)
            ok = e->view.ne[d] == s->shape[d];
        if (!ok) {
            char want[96], got[96];
            shape_text(s->shape, s->ndim, want, sizeof want);
            dit_tensor_shape_str(&e->view, got, sizeof got);
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: tensor '%s' has shape %s, but config.json implies %s", e->file,
                              s->name, got, want);
            goto cleanup;
        }
        found[i] = e;
        used[e - dit_st_set_at(set, 0)] = true;
        dit_dtype dt = s->ndim >= 2 ? be->ops->weight_dtype : DIT_F32;
        dit_tensor t = dit_tensor_make(NULL, dt, s->ndim, s->shape);
        total += (dit_tensor_nbytes(&t) + WEIGHT_ALIGN - 1) / WEIGHT_ALIGN * WEIGHT_ALIGN;
    }
    if (strict) {
        for (size_t i = 0; i < count; i++) {
            if (!used[i]) {
                const dit_st_entry *e = dit_st_set_at(set, i);
                st = dit_diag_set(diag, DIT_ERR_FORMAT,
                                  "%s: unexpected tensor '%s' (not a parameter of this model "
                                  "with this config.json)",
                                  e->file, e->name);
                goto cleanup;
            }
        }
    }
    st = dit_backend_alloc(be, total ? total : WEIGHT_ALIGN, &base);
    if (st != DIT_OK) {
        st = dit_diag_set(diag, st, "%s: cannot allocate %.1f MiB of weights", what,
                          (double)total / 1048576.0);
        goto cleanup;
    }
    size_t off = 0;
    for (size_t i = 0; i < l->n; i++) {
        const dit_weight_spec *s = &l->items[i];
        if (!found[i]) {
            memset(s->dst, 0, sizeof *s->dst);
            continue;
        }
        dit_dtype dt = s->ndim >= 2 ? be->ops->weight_dtype : DIT_F32;
        *s->dst = dit_tensor_make((char *)base + off, dt, s->ndim, s->shape);
        off += (dit_tensor_nbytes(s->dst) + WEIGHT_ALIGN - 1) / WEIGHT_ALIGN * WEIGHT_ALIGN;
        st = be->ops->upload(be, s->dst, &found[i]->view);
        if (st != DIT_OK) {
            st = dit_diag_set(diag, st, "%s: uploading '%s' failed", what, s->name);
            goto cleanup;
        }
    }
    *buffer = base;
    *bytes = total;
    base = NULL;
cleanup:
    if (base)
        dit_backend_free(be, base);
    free(used);
    free(found);
    return st;
}
