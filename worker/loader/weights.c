#include "loader/weights.h"

#include <math.h>
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

/* ------------------------------------------------------------------------ */
/* Sliced loading                                                            */

dit_status dit_weight_check_blocks(const dit_st_set *set, const char *prefix, int n,
                                   const char *key, const char *dir, dit_diag *diag)
{
    if (n <= 0)
        return DIT_OK;
    char want[160];
    const int len = snprintf(want, sizeof want, "%s.%d.", prefix, n - 1);
    if (len <= 0 || (size_t)len >= sizeof want)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "block prefix '%s' too long", prefix);
    for (size_t i = 0, count = dit_st_set_count(set); i < count; i++)
        if (strncmp(dit_st_set_at(set, i)->name, want, (size_t)len) == 0)
            return DIT_OK;
    return dit_diag_set(diag, DIT_ERR_FORMAT,
                        "%s: config.json has %s %d, but the checkpoint has no tensor '%s*' "
                        "(does config.json belong to these weights?)",
                        dir, key, n, want);
}

void dit_weight_plan_init(dit_weight_plan *p, dit_dtype mat_dtype)
{
    memset(p, 0, sizeof *p);
    p->mat_dtype = mat_dtype;
}

void dit_weight_plan_free(dit_weight_plan *p)
{
    free(p->items);
    free(p->tensors);
    dit_weight_plan_init(p, p->mat_dtype); /* empty again: a second free is harmless */
}

/* Reserves space for a destination tensor; its data pointer holds the byte
 * offset until dit_weight_plan_place() adds the buffer base. */
void dit_weight_plan_tensor(dit_weight_plan *p, dit_tensor *t, dit_dtype dt, int ndim, int64_t n0,
                            int64_t n1)
{
    int64_t shape[2] = {n0, n1};
    *t = dit_tensor_make(NULL, dt, ndim, shape);
    t->data = (void *)(uintptr_t)p->bytes;
    p->bytes += (dit_tensor_nbytes(t) + WEIGHT_ALIGN - 1) / WEIGHT_ALIGN * WEIGHT_ALIGN;
    if (p->nt == p->tcap) {
        size_t cap = p->tcap ? p->tcap * 2 : 256;
        dit_tensor **nt = realloc(p->tensors, cap * sizeof *nt);
        if (!nt) {
            p->oom = true;
            return;
        }
        p->tensors = nt;
        p->tcap = cap;
    }
    p->tensors[p->nt++] = t;
}

void dit_weight_plan_place(dit_weight_plan *p, void *base)
{
    for (size_t i = 0; i < p->nt; i++)
        p->tensors[i]->data = (char *)base + (uintptr_t)p->tensors[i]->data;
}

dit_weight_piece *dit_weight_plan_piece(dit_weight_plan *p, const char *name, int ndim, int64_t s0,
                                        int64_t s1)
{
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 512;
        dit_weight_piece *ni = realloc(p->items, cap * sizeof *ni);
        if (!ni) {
            p->oom = true;
            return NULL;
        }
        p->items = ni;
        p->cap = cap;
    }
    dit_weight_piece *w = &p->items[p->n++];
    memset(w, 0, sizeof *w);
    snprintf(w->name, sizeof w->name, "%s", name);
    w->ndim = ndim;
    w->shape[0] = s0;
    w->shape[1] = s1;
    w->r0 = 0;
    w->nr = s0;
    w->c0 = 0;
    w->nc = s1;
    return w;
}

void dit_weight_plan_vector(dit_weight_plan *p, dit_tensor *dst, const char *name, int64_t n)
{
    dit_weight_plan_tensor(p, dst, DIT_F32, 1, n, 0);
    dit_weight_piece *w = dit_weight_plan_piece(p, name, 1, n, 0);
    if (w)
        w->dst = dst;
}

/* A whole (replicated) linear: name.weight (N, K), name.bias (N). */
/* Host view of the slice a piece takes from a checkpoint tensor. */
static dit_tensor piece_src(const dit_weight_piece *w, const dit_tensor *full)
{
    dit_tensor v = dit_tensor_narrow(full, 0, w->r0, w->nr);
    if (w->ndim == 2)
        v = dit_tensor_narrow(&v, 1, w->c0, w->nc);
    return v;
}

static dit_tensor piece_dst(const dit_weight_piece *w)
{
    return dit_tensor_narrow(w->dst, 0, w->dst_row0, w->nr);
}

/* A contiguous checkpoint tensor of more dims than a piece reads flattened:
 * as (n0, the rest) for a matrix (a convolution whose kernel equals its
 * stride is a linear over flattened patches), as all its elements for a
 * vector (a (1, 6, C) parameter table). */
static dit_tensor flat_view(const dit_tensor *v, int ndim)
{
    if (v->ndim <= ndim || !dit_tensor_is_contiguous(v))
        return *v;
    const int64_t n = dit_tensor_numel(v);
    if (ndim == 1)
        return dit_tensor_1d(v->data, v->dtype, n);
    return dit_tensor_2d(v->data, v->dtype, v->ne[0], v->ne[0] ? n / v->ne[0] : 0);
}

static void shape_str(const int64_t *s, int ndim, char *buf, size_t cap)
{
    if (ndim == 1)
        snprintf(buf, cap, "(%lld)", (long long)s[0]);
    else
        snprintf(buf, cap, "(%lld, %lld)", (long long)s[0], (long long)s[1]);
}

/* Every piece against set, uploaded through be (NULL: checked only). */
static dit_status plan_walk(const dit_weight_plan *p, dit_backend *be, const dit_st_set *set,
                            const char *dir, const char *model_class, dit_diag *diag)
{
    if (p->bad)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "%s: %s", dir, p->bad_msg);
    dit_status st = DIT_OK;
    size_t count = dit_st_set_count(set);
    bool *used = calloc(count ? count : 1, sizeof *used);
    if (!used)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);

    size_t missing = 0;
    char first_missing[3][160];
    for (size_t i = 0; i < p->n; i++) {
        const dit_weight_piece *w = &p->items[i];
        const dit_st_entry *e = dit_st_set_find(set, w->name);
        if (!e) {
            if (missing < 3)
                snprintf(first_missing[missing], sizeof first_missing[0], "%s", w->name);
            missing++;
            continue;
        }
        used[e - dit_st_set_at(set, 0)] = true;
        const dit_tensor view = flat_view(&e->view, w->ndim);
        bool ok = view.ndim == w->ndim && view.ne[0] == w->shape[0] &&
                  (w->ndim == 1 || view.ne[1] == w->shape[1]);
        if (!ok) {
            char want[64], got[64];
            shape_str(w->shape, w->ndim, want, sizeof want);
            dit_tensor_shape_str(&e->view, got, sizeof got);
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: tensor '%s' has shape %s, but config.json implies %s", e->file,
                              w->name, got, want);
            goto cleanup;
        }
        if (!be || !w->dst)
            continue;
        dit_tensor src = piece_src(w, &view);
        dit_tensor dst = piece_dst(w);
        st = be->ops->upload(be, &dst, &src);
        if (st != DIT_OK) {
            st = dit_diag_set(diag, st, "%s: uploading tensor '%s' failed", e->file, w->name);
            goto cleanup;
        }
    }
    if (missing) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: %zu tensor(s) the config needs are missing from the checkpoint, "
                          "e.g. '%s'%s%s%s%s (does config.json belong to these weights?)",
                          dir, missing, first_missing[0], missing > 1 ? ", '" : "",
                          missing > 1 ? first_missing[1] : "", missing > 1 ? "'" : "",
                          missing > 2 ? ", ..." : "");
        goto cleanup;
    }
    for (size_t i = 0; i < count; i++) {
        if (!used[i]) {
            const dit_st_entry *e = dit_st_set_at(set, i);
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: unexpected tensor '%s': %s with this config.json has no such "
                              "parameter",
                              e->file, e->name, model_class);
            goto cleanup;
        }
    }
cleanup:
    free(used);
    return st;
}

dit_status dit_weight_plan_check(const dit_weight_plan *p, const dit_st_set *set, const char *dir,
                                 const char *model_class, dit_diag *diag)
{
    return plan_walk(p, NULL, set, dir, model_class, diag);
}

dit_status dit_weight_plan_load(dit_weight_plan *p, dit_backend *be, const dit_st_set *set,
                                const char *dir, const char *model_class, dit_diag *diag)
{
    return plan_walk(p, be, set, dir, model_class, diag);
}

/* splitmix64: a tiny, well-mixed generator for reproducible random weights. */
static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t hash_str(const char *s, uint64_t h)
{
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

dit_status dit_weight_plan_randomize(dit_weight_plan *p, dit_backend *be, uint64_t seed,
                                     dit_diag *diag)
{
    if (p->bad)
        return dit_diag_set(diag, DIT_ERR_INTERNAL, "%s", p->bad_msg);
    dit_status st = DIT_OK;
    float *host = NULL;
    size_t host_cap = 0;
    for (size_t i = 0; i < p->n; i++) {
        const dit_weight_piece *w = &p->items[i];
        if (!w->dst)
            continue;
        size_t n = (size_t)w->nr * (size_t)(w->ndim == 2 ? w->nc : 1);
        if (n > host_cap && !be->ops->init_uniform) {
            free(host);
            host = malloc(n * sizeof *host);
            host_cap = n;
            if (!host) {
                st = dit_diag_set(diag, DIT_ERR_NOMEM, "random weights: out of memory");
                goto cleanup;
            }
        }
        const bool is_bias = strstr(w->name, ".bias") != NULL;
        const bool is_norm = w->ndim == 1 && !is_bias;
        /* Uniform(-a, a) with a = 1/sqrt(fan_in), like nn.Linear's default. */
        const float a = w->ndim == 2 ? 1.0f / sqrtf((float)w->shape[1]) : 0.02f;
        const uint64_t base = hash_str(w->name, 0xcbf29ce484222325ull ^ seed);
        if (be->ops->init_uniform) {
            /* The same numbers generated on the device: FLUX.1-dev's 12 B
             * parameters need no host buffer and no transfer. */
            dit_tensor dst = piece_dst(w);
            st = is_norm ? be->ops->fill(be, &dst, 1.0f)
                         : be->ops->init_uniform(be, &dst, base, w->r0, w->c0, a);
            if (st != DIT_OK) {
                st = dit_diag_set(diag, st, "random weights: init of '%s' failed", w->name);
                goto cleanup;
            }
            continue;
        }
        const int64_t cols = w->ndim == 2 ? w->nc : 1;
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < w->nr; r++) {
            /* Seeded by the global row, so slices of a split tensor are
             * slices of the same whole. */
            uint64_t s = base + (uint64_t)(w->r0 + r) * 0x2545f4914f6cdd1dull;
            for (int64_t k = 0; k < w->c0; k++)
                splitmix64(&s);
            for (int64_t cidx = 0; cidx < cols; cidx++) {
                double u = (double)(splitmix64(&s) >> 11) * 0x1.0p-53;
                host[r * cols + cidx] = is_norm ? 1.0f : (float)((2.0 * u - 1.0) * a);
            }
        }
        dit_tensor src = w->ndim == 2 ? dit_tensor_2d(host, DIT_F32, w->nr, w->nc)
                                      : dit_tensor_1d(host, DIT_F32, w->nr);
        dit_tensor dst = piece_dst(w);
        st = be->ops->upload(be, &dst, &src);
        if (st != DIT_OK) {
            st = dit_diag_set(diag, st, "random weights: upload of '%s' failed", w->name);
            goto cleanup;
        }
    }
cleanup:
    free(host);
    return st;
}
