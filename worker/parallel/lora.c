/* LoRA adapters: file parsing against a model's sites, this rank's slices
 * in backend memory, attachment as per-linear lists, and the unfused
 * product inside the linear. See lora.h. */
#include "parallel/lora.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "loader/safetensors.h"

#define RET(expr)                                                                                  \
    do {                                                                                           \
        dit_status r_ = (expr);                                                                    \
        if (r_ != DIT_OK)                                                                          \
            return r_;                                                                             \
    } while (0)

typedef struct lora_site {
    char module[128];
    int64_t N, K;
    dit_linear *dst;
    int64_t row0, n0, nl, k0, kl;
} lora_site;

/* One module's output side within a group: y[:, row0 : row0 + nl] +=
 * t[:, col0 : col0 + r] B^T. */
typedef struct lora_out {
    dit_tensor B; /* (nl, r), weight dtype, the file's scaling folded in */
    int64_t row0; /* first output row of the linear it adds to */
    int64_t col0; /* its rank columns in the group's t */
} lora_out;

/* The modules of one adapter that land in one linear (FLUX's fused q, k, v
 * and proj_mlp: one input), their A's stacked so that x is read once. */
typedef struct lora_group {
    size_t site;  /* any of its sites: they share the destination */
    dit_tensor A; /* (R, kl): the modules' A's, R their ranks summed */
    size_t out0, n_outs;
} lora_group;

struct dit_lora_op {
    const dit_lora_op *next;
    dit_tensor A;     /* (R, kl), weight dtype */
    dit_tensor scale; /* (1, R) f32, every element the use's scale */
    const lora_out *outs;
    size_t n_outs;
};

struct dit_lora_sites {
    lora_site *items;
    size_t n, cap;
    bool oom;
    dit_lora_kohya_fn kohya;
    /* The attached set. */
    dit_backend *be;
    dit_lora_op *ops;
    void *scales; /* backend f32, n_uses * max rank */
    bool active;
};

struct dit_lora {
    dit_backend *be;
    const dit_lora_sites *sites;
    void *buf;
    size_t bytes;
    lora_group *groups;
    size_t n_groups;
    lora_out *outs;
    size_t n_outs;
    int n_modules, max_rank;
    int64_t max_group_rank;
    dit_file_id file;
};

dit_status dit_lora_sites_create(dit_lora_kohya_fn kohya, dit_lora_sites **out, dit_diag *diag)
{
    dit_lora_sites *s = calloc(1, sizeof *s);
    if (!s)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "lora: out of memory");
    s->kohya = kohya;
    *out = s;
    return DIT_OK;
}

void dit_lora_sites_destroy(dit_lora_sites *s)
{
    if (!s)
        return;
    dit_lora_detach(s);
    free(s->items);
    free(s);
}

void dit_lora_sites_add(dit_lora_sites *s, const char *module, int64_t N, int64_t K,
                        dit_linear *dst, int64_t row0, int64_t n0, int64_t nl, int64_t k0,
                        int64_t kl)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        lora_site *p = realloc(s->items, cap * sizeof *p);
        if (!p) {
            s->oom = true;
            return;
        }
        s->items = p;
        s->cap = cap;
    }
    lora_site *t = &s->items[s->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->module, sizeof t->module, "%s", module);
    t->N = N;
    t->K = K;
    t->dst = dst;
    t->row0 = row0;
    t->n0 = n0;
    t->nl = nl;
    t->k0 = k0;
    t->kl = kl;
}

size_t dit_lora_sites_count(const dit_lora_sites *s)
{
    return s->n;
}

bool dit_lora_sites_active(const dit_lora_sites *s)
{
    return s && s->active;
}

/* The first site of `module`, or -1. */
static long site_find(const dit_lora_sites *s, const char *module)
{
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->items[i].module, module) == 0)
            return (long)i;
    return -1;
}

/* ------------------------------------------------------------------------ */
/* Parsing                                                                   */

/* One module's change as the file gives it: A (r, K) and B rows
 * [b_row0, b_row0 + N) of `up`, times `mult`. */
typedef struct lora_mod {
    char module[128];
    const dit_st_entry *A, *B;
    int64_t b_row0;
    float mult;
    bool swap_halves;
    const char *key; /* the file's key, for messages */
} lora_mod;

typedef struct mod_list {
    lora_mod *items;
    size_t n, cap;
} mod_list;

static lora_mod *mods_add(mod_list *l)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        lora_mod *p = realloc(l->items, cap * sizeof *p);
        if (!p)
            return NULL;
        l->items = p;
        l->cap = cap;
    }
    lora_mod *m = &l->items[l->n++];
    memset(m, 0, sizeof *m);
    return m;
}

static bool ends_with(const char *s, const char *suf, size_t *stem)
{
    size_t n = strlen(s), k = strlen(suf);
    if (n <= k || strcmp(s + n - k, suf) != 0)
        return false;
    *stem = n - k;
    return true;
}

/* The module name of a diffusers/PEFT key and which part it is (0 A, 1 B,
 * 2 alpha), or false. */
static bool peft_key(const char *name, char *module, size_t cap, int *part)
{
    static const char *const suf[3] = {".lora_A.weight", ".lora_B.weight", ".alpha"};
    const char *s = strncmp(name, "transformer.", 12) == 0 ? name + 12 : name;
    for (int i = 0; i < 3; i++) {
        size_t stem;
        if (ends_with(s, suf[i], &stem) && stem < cap) {
            memcpy(module, s, stem);
            module[stem] = '\0';
            *part = i;
            return true;
        }
    }
    return false;
}

static bool kohya_key(const char *name, char *base, size_t cap, int *part)
{
    static const char *const suf[3] = {".lora_down.weight", ".lora_up.weight", ".alpha"};
    if (strncmp(name, "lora_unet_", 10) != 0)
        return false;
    for (int i = 0; i < 3; i++) {
        size_t stem;
        if (ends_with(name, suf[i], &stem) && stem - 10 < cap) {
            memcpy(base, name + 10, stem - 10);
            base[stem - 10] = '\0';
            *part = i;
            return true;
        }
    }
    return false;
}

static dit_status alpha_of(const dit_st_file *f, const char *name, int64_t rank, float *mult,
                           dit_diag *diag)
{
    const dit_st_entry *e = dit_st_file_find(f, name);
    *mult = 1.0f;
    if (!e)
        return DIT_OK;
    float alpha;
    RET(dit_st_entry_scalar(e, &alpha, diag));
    *mult = alpha / (float)rank;
    if (!isfinite(alpha) || !isfinite(*mult))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: key '%s' is %g, not a finite alpha", e->file,
                            name, (double)alpha);
    return DIT_OK;
}

/* diffusers' "lora_adapter_metadata" (PEFT's LoraConfig as JSON, its keys
 * prefixed "transformer." when a pipeline saved it): *mult = lora_alpha / r
 * (/ sqrt(r) with use_rslora) for every diffusers-format module, and the r
 * every module must have; *has false without metadata. What would change
 * the scaling per module, or is not a plain LoRA, is refused. */
typedef struct lora_meta {
    bool has;
    double mult;
    int64_t r;
} lora_meta;

static const cJSON *meta_get(const cJSON *j, const char *key)
{
    char buf[64];
    snprintf(buf, sizeof buf, "transformer.%s", key);
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, buf);
    return v ? v : cJSON_GetObjectItemCaseSensitive(j, key);
}

static dit_status parse_meta(const dit_st_file *f, const char *path, lora_meta *out, dit_diag *diag)
{
    memset(out, 0, sizeof *out);
    const char *raw = dit_st_file_metadata(f, "lora_adapter_metadata");
    if (!raw)
        return DIT_OK;
    cJSON *j = cJSON_Parse(raw);
    dit_status st = DIT_OK;
    if (!j || !cJSON_IsObject(j)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: lora_adapter_metadata is not a JSON object",
                          path);
        goto cleanup;
    }
    const cJSON *alpha = meta_get(j, "lora_alpha"), *r = meta_get(j, "r");
    if (!cJSON_IsNumber(alpha) || !cJSON_IsNumber(r)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: lora_adapter_metadata has no numeric 'lora_alpha' and 'r'", path);
        goto cleanup;
    }
    /* As PEFT's LoraConfig: r a positive integer (bounded here so that it
     * converts), lora_alpha finite. */
    if (!(r->valuedouble >= 1 && r->valuedouble <= (double)INT32_MAX &&
          r->valuedouble == floor(r->valuedouble)) ||
        !isfinite(alpha->valuedouble)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: lora_adapter_metadata's 'r' must be a positive integer and "
                          "'lora_alpha' finite (r = %g, lora_alpha = %g)",
                          path, r->valuedouble, alpha->valuedouble);
        goto cleanup;
    }
    static const char *const patterns[] = {"alpha_pattern", "rank_pattern"};
    for (int i = 0; i < 2; i++) {
        const cJSON *p = meta_get(j, patterns[i]);
        if (p && !cJSON_IsNull(p) && !(cJSON_IsObject(p) && !p->child)) {
            st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                              "%s: lora_adapter_metadata's '%s' (per-module scalings) is not "
                              "supported",
                              path, patterns[i]);
            goto cleanup;
        }
    }
    static const char *const flags[] = {"use_dora", "lora_bias"};
    for (int i = 0; i < 2; i++)
        if (cJSON_IsTrue(meta_get(j, flags[i]))) {
            st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                              "%s: lora_adapter_metadata has %s: only plain LoRA is supported",
                              path, flags[i]);
            goto cleanup;
        }
    out->has = true;
    out->r = (int64_t)r->valuedouble;
    out->mult = alpha->valuedouble /
                (cJSON_IsTrue(meta_get(j, "use_rslora")) ? sqrt(r->valuedouble) : r->valuedouble);
    if (!isfinite((float)out->mult))
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: lora_adapter_metadata's lora_alpha / r = %g is out of range", path,
                          out->mult);
cleanup:
    cJSON_Delete(j);
    return st;
}

/* Fills `mods` from the file, checking every key is understood and paired. */
static dit_status parse(const dit_st_file *f, const dit_lora_sites *sites, const char *path,
                        mod_list *mods, dit_diag *diag)
{
    lora_meta meta;
    RET(parse_meta(f, path, &meta, diag));
    /* A diffusers-format module with its own .alpha and one without: what
     * diffusers then gives the second (the alpha most modules have) is not
     * what the file says, so such files are refused. */
    const char *with_alpha = NULL, *without_alpha = NULL;
    const size_t n = dit_st_file_count(f);
    for (size_t i = 0; i < n; i++) {
        const dit_st_entry *e = dit_st_file_at(f, i);
        char mod[160], other[200];
        int part;
        if (strncmp(e->name, "lora_unet_", 10) != 0 && peft_key(e->name, mod, sizeof mod, &part)) {
            const char *pre = strncmp(e->name, "transformer.", 12) == 0 ? "transformer." : "";
            if (part == 2) {
                snprintf(other, sizeof other, "%s%s.lora_A.weight", pre, mod);
                if (!dit_st_file_find(f, other))
                    return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: '%s' has no '%s'", path, e->name,
                                        other);
                continue;
            }
            snprintf(other, sizeof other, "%s%s.lora_%c.weight", pre, mod, part ? 'A' : 'B');
            const dit_st_entry *o = dit_st_file_find(f, other);
            if (!o)
                return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: '%s' has no '%s'", path, e->name,
                                    other);
            if (part == 1)
                continue; /* the pair is added from its A */
            if (site_find(sites, mod) < 0)
                return dit_diag_set(diag, DIT_ERR_FORMAT,
                                    "%s: key '%s': the model has no linear '%s'", path, e->name,
                                    mod);
            lora_mod *m = mods_add(mods);
            if (!m)
                return dit_diag_set(diag, DIT_ERR_NOMEM, "lora: out of memory");
            snprintf(m->module, sizeof m->module, "%.127s", mod);
            m->A = e;
            m->B = o;
            m->key = e->name;
            if (e->view.ndim == 2) {
                snprintf(other, sizeof other, "%s%s.alpha", pre, mod);
                RET(alpha_of(f, other, e->view.ne[0], &m->mult, diag));
                if (dit_st_file_find(f, other))
                    with_alpha = e->name;
                else
                    without_alpha = e->name;
            }
            if (meta.has) {
                /* As diffusers: metadata and .alpha keys do not go together. */
                if (dit_st_file_find(f, other))
                    return dit_diag_set(diag, DIT_ERR_FORMAT,
                                        "%s: key '%s' and lora_adapter_metadata both give the "
                                        "scaling",
                                        path, other);
                if (e->view.ndim == 2 && e->view.ne[0] != meta.r)
                    return dit_diag_set(diag, DIT_ERR_FORMAT,
                                        "%s: key '%s' has rank %lld, lora_adapter_metadata says "
                                        "r = %lld",
                                        path, e->name, (long long)e->view.ne[0], (long long)meta.r);
                m->mult = (float)meta.mult;
            }
            continue;
        }
        if (kohya_key(e->name, mod, sizeof mod, &part)) {
            if (part == 2) {
                snprintf(other, sizeof other, "lora_unet_%s.lora_down.weight", mod);
                if (!dit_st_file_find(f, other))
                    return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: '%s' has no '%s'", path, e->name,
                                        other);
                continue;
            }
            snprintf(other, sizeof other, "lora_unet_%s.lora_%s.weight", mod, part ? "down" : "up");
            const dit_st_entry *o = dit_st_file_find(f, other);
            if (!o)
                return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: '%s' has no '%s'", path, e->name,
                                    other);
            if (part == 1)
                continue;
            dit_lora_kohya_target tg[8];
            int nt = sites->kohya ? sites->kohya(mod, tg, 8) : 0;
            if (nt <= 0)
                return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                                    "%s: key '%s': no module of this model is named '%s' in "
                                    "kohya's naming",
                                    path, e->name, mod);
            float mult = 1.0f;
            if (e->view.ndim == 2) {
                snprintf(other, sizeof other, "lora_unet_%s.alpha", mod);
                RET(alpha_of(f, other, e->view.ne[0], &mult, diag));
            }
            int64_t row = 0;
            for (int t = 0; t < nt; t++) {
                long si = site_find(sites, tg[t].module);
                if (si < 0)
                    return dit_diag_set(diag, DIT_ERR_FORMAT,
                                        "%s: key '%s': the model has no linear '%s'", path, e->name,
                                        tg[t].module);
                lora_mod *m = mods_add(mods);
                if (!m)
                    return dit_diag_set(diag, DIT_ERR_NOMEM, "lora: out of memory");
                snprintf(m->module, sizeof m->module, "%.127s", tg[t].module);
                m->A = e;
                m->B = o;
                m->b_row0 = row;
                m->mult = tg[t].no_alpha ? 1.0f : mult;
                m->swap_halves = tg[t].swap_halves;
                m->key = e->name;
                row += sites->items[si].N;
            }
            /* up must hold exactly the modules' rows. */
            if (o->view.ndim == 2 && o->view.ne[0] != row)
                return dit_diag_set(diag, DIT_ERR_FORMAT,
                                    "%s: key '%s' has %lld rows, the model's '%s' takes %lld", path,
                                    o->name, (long long)o->view.ne[0], mod, (long long)row);
            continue;
        }
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: unknown key '%s' (expected diffusers' "
                            "'transformer.<module>.lora_A.weight' / '.lora_B.weight' / '.alpha' "
                            "or kohya's 'lora_unet_<module>.lora_down.weight' / "
                            "'.lora_up.weight' / '.alpha')",
                            path, e->name);
    }
    if (mods->n == 0)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: no LoRA weights in the file", path);
    if (with_alpha && without_alpha)
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: key '%s' has an .alpha but '%s' has none; give every module "
                            "its alpha, or none",
                            path, with_alpha, without_alpha);
    return DIT_OK;
}

/* Checks one module's A and B against the model. */
static dit_status check_mod(const lora_mod *m, const lora_site *s, const char *path, dit_diag *diag)
{
    const dit_tensor *A = &m->A->view, *B = &m->B->view;
    if (A->ndim != 2 || B->ndim != 2) {
        char sa[64], sb[64];
        dit_tensor_shape_str(A, sa, sizeof sa);
        dit_tensor_shape_str(B, sb, sizeof sb);
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: key '%s' is %s with its pair '%s' %s; a linear's LoRA is 2-D",
                            path, m->A->name, sa, m->B->name, sb);
    }
    if (A->ne[0] != B->ne[1])
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: key '%s' has rank %lld but '%s' has rank %lld (A/B rank mismatch)",
                            path, m->A->name, (long long)A->ne[0], m->B->name, (long long)B->ne[1]);
    if (A->ne[0] < 1)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: key '%s' has rank 0", path, m->A->name);
    /* B A has rank min(r, N, K) at most: a larger r adds nothing but memory
     * and scratch. */
    const int64_t full = s->N < s->K ? s->N : s->K;
    if (A->ne[0] > full)
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: key '%s' has rank %lld, more than the %lld x %lld linear '%s' "
                            "can use (at most %lld)",
                            path, m->A->name, (long long)A->ne[0], (long long)s->N, (long long)s->K,
                            s->module, (long long)full);
    if (A->ne[1] != s->K)
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: key '%s' has %lld input features, the model's '%s' takes %lld",
                            path, m->A->name, (long long)A->ne[1], s->module, (long long)s->K);
    if (m->b_row0 + s->N > B->ne[0])
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: key '%s' has %lld output features, the model's '%s' gives %lld",
                            path, m->B->name, (long long)B->ne[0], s->module, (long long)s->N);
    return DIT_OK;
}

/* Index of the first value of p[0..n) that is not finite, or n. */
static size_t first_nonfinite(const float *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(p[i]))
            return i;
    return n;
}

/* A piece (module i at site j) and the linear it lands in, for grouping. */
typedef struct lora_pref {
    size_t mod, site;
    const dit_linear *dst;
} lora_pref;

/* By destination (any order keeps a group together), then in file order. */
static int pref_cmp(const void *pa, const void *pb)
{
    const lora_pref *a = pa, *b = pb;
    if (a->dst != b->dst)
        return (uintptr_t)a->dst < (uintptr_t)b->dst ? -1 : 1;
    if (a->mod != b->mod)
        return a->mod < b->mod ? -1 : 1;
    return a->site < b->site ? -1 : a->site > b->site;
}

dit_status dit_lora_load(dit_backend *be, const dit_lora_sites *sites, const char *path,
                         uint64_t max_file_bytes, dit_lora **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_st_file *f = NULL;
    mod_list mods = {0};
    float *hA = NULL, *hB = NULL, *stage = NULL;
    lora_pref *pieces = NULL;
    dit_lora *l = NULL;
    if (sites->oom) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "lora: out of memory recording the model's linears");
        goto cleanup;
    }
    /* Read, not mapped: the file may change while it is in use. */
    DIT_CHECK(dit_st_file_read(path, max_file_bytes, &f, diag));
    DIT_CHECK(parse(f, sites, path, &mods, diag));

    /* Shapes first (nothing is allocated for a file that is refused), and
     * the backend bytes of every piece. Diffusers-format modules must give
     * exactly the module's output rows. */
    size_t n_pieces = 0, stage_n = 0;
    for (size_t i = 0; i < mods.n; i++) {
        const lora_mod *m = &mods.items[i];
        long si = site_find(sites, m->module);
        const lora_site *s = &sites->items[si];
        const dit_tensor *A = &m->A->view, *B = &m->B->view;
        if (A->ndim == 2 && B->ndim == 2 && m->b_row0 == 0 && strncmp(m->key, "lora_unet_", 10) &&
            B->ne[0] != s->N) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: key '%s' has %lld output features, the model's '%s' gives %lld",
                              path, m->B->name, (long long)B->ne[0], s->module, (long long)s->N);
            goto cleanup;
        }
        DIT_CHECK(check_mod(m, s, path, diag));
        for (size_t j = (size_t)si; j < sites->n; j++) {
            const lora_site *p = &sites->items[j];
            if (strcmp(p->module, m->module) != 0)
                continue;
            const int64_t r = A->ne[0];
            n_pieces++;
            if ((size_t)(r * p->kl) > stage_n)
                stage_n = (size_t)(r * p->kl);
            if ((size_t)(r * p->nl) > stage_n)
                stage_n = (size_t)(r * p->nl);
        }
        for (size_t j = 0; j < i; j++)
            if (strcmp(mods.items[j].module, m->module) == 0) {
                st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: key '%s': module '%s' appears twice",
                                  path, m->key, m->module);
                goto cleanup;
            }
    }

    /* Every (module, site) piece, grouped by the linear it lands in. */
    pieces = calloc(n_pieces ? n_pieces : 1, sizeof *pieces);
    l = calloc(1, sizeof *l);
    if (!pieces || !l || !(l->groups = calloc(n_pieces ? n_pieces : 1, sizeof *l->groups)) ||
        !(l->outs = calloc(n_pieces ? n_pieces : 1, sizeof *l->outs)) ||
        !(stage = malloc((stage_n ? stage_n : 1) * sizeof *stage))) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "lora: out of memory");
        goto cleanup;
    }
    size_t np = 0;
    for (size_t i = 0; i < mods.n; i++)
        for (size_t j = 0; j < sites->n; j++)
            if (strcmp(sites->items[j].module, mods.items[i].module) == 0)
                pieces[np++] = (lora_pref){.mod = i, .site = j, .dst = sites->items[j].dst};
    qsort(pieces, np, sizeof *pieces, pref_cmp);

    l->be = be;
    l->sites = sites;
    const dit_dtype wdt = be->ops->weight_dtype;
    const size_t esz = dit_dtype_size(wdt);
    /* Each group's A and each B 64-byte aligned. */
    size_t bytes = 0;
    for (size_t g0 = 0, g1; g0 < np; g0 = g1) {
        size_t rows = 0;
        for (g1 = g0; g1 < np && pieces[g1].dst == pieces[g0].dst; g1++) {
            const lora_site *p = &sites->items[pieces[g1].site];
            const int64_t r = mods.items[pieces[g1].mod].A->view.ne[0];
            rows += (size_t)r;
            bytes += ((size_t)(r * p->nl) * esz + 63) / 64 * 64;
        }
        bytes += (rows * (size_t)sites->items[pieces[g0].site].kl * esz + 63) / 64 * 64;
    }
    if ((st = dit_backend_alloc(be, bytes ? bytes : 64, &l->buf)) != DIT_OK) {
        dit_diag_set(diag, st, "lora: cannot allocate %zu bytes for the adapter: %s", bytes,
                     dit_status_str(st));
        goto cleanup;
    }
    l->bytes = bytes;
    for (size_t i = 0; i < mods.n; i++) {
        const int64_t r = mods.items[i].A->view.ne[0];
        if (r > l->max_rank)
            l->max_rank = (int)r;
    }
    l->n_modules = (int)mods.n;
    l->file = dit_st_file_id(f);

    size_t off = 0;
    for (size_t g0 = 0, g1; g0 < np; g0 = g1) {
        lora_group *grp = &l->groups[l->n_groups++];
        const lora_site *first = &sites->items[pieces[g0].site];
        int64_t R = 0;
        for (g1 = g0; g1 < np && pieces[g1].dst == pieces[g0].dst; g1++)
            R += mods.items[pieces[g1].mod].A->view.ne[0];
        grp->site = pieces[g0].site;
        grp->A = dit_tensor_2d((char *)l->buf + off, wdt, R, first->kl);
        grp->out0 = l->n_outs;
        off += ((size_t)(R * first->kl) * esz + 63) / 64 * 64;
        if (R > l->max_group_rank)
            l->max_group_rank = R;
        int64_t col0 = 0;
        for (size_t q = g0; q < g1; q++) {
            const lora_mod *m = &mods.items[pieces[q].mod];
            const lora_site *p = &sites->items[pieces[q].site];
            const dit_tensor *A = &m->A->view, *B = &m->B->view;
            const int64_t r = A->ne[0], K = A->ne[1], NB = B->ne[0];
            const int64_t N = p->N;
            free(hA);
            free(hB);
            hA = malloc((size_t)(r * K) * sizeof *hA);
            hB = malloc((size_t)(NB * r) * sizeof *hB);
            if (!hA || !hB) {
                st = dit_diag_set(diag, DIT_ERR_NOMEM, "lora: out of memory");
                goto cleanup;
            }
            DIT_CHECK(
                dit_st_entry_convert(m->A, NULL, DIT_F32, hA, (size_t)(r * K) * sizeof *hA, diag));
            DIT_CHECK(
                dit_st_entry_convert(m->B, NULL, DIT_F32, hB, (size_t)(NB * r) * sizeof *hB, diag));
            const size_t badA = first_nonfinite(hA, (size_t)(r * K));
            const size_t badB = first_nonfinite(hB, (size_t)(NB * r));
            if (badA < (size_t)(r * K) || badB < (size_t)(NB * r)) {
                const bool a = badA < (size_t)(r * K);
                st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: key '%s' holds %g at element %zu",
                                  path, a ? m->A->name : m->B->name,
                                  (double)(a ? hA[badA] : hB[badB]), a ? badA : badB);
                goto cleanup;
            }
            /* A's columns [k0, k0 + kl) into rows [col0, col0 + r) of the
             * group's A. */
            for (int64_t a = 0; a < r; a++)
                memcpy(stage + a * p->kl, hA + a * K + p->k0, (size_t)p->kl * sizeof *stage);
            dit_tensor dA = dit_tensor_narrow(&grp->A, 0, col0, r);
            dit_tensor hv = dit_tensor_2d(stage, DIT_F32, r, p->kl);
            DIT_CHECK(be->ops->upload(be, &dA, &hv));
            /* B's rows [n0, n0 + nl) of this module (after the swap of
             * halves), times the file's scaling. */
            for (int64_t n = 0; n < p->nl; n++) {
                int64_t row = p->n0 + n;
                if (m->swap_halves)
                    row = row < N / 2 ? row + N / 2 : row - N / 2;
                const float *src = hB + (m->b_row0 + row) * r;
                for (int64_t a = 0; a < r; a++)
                    stage[n * r + a] = src[a] * m->mult;
            }
            if (first_nonfinite(stage, (size_t)(p->nl * r)) < (size_t)(p->nl * r)) {
                st = dit_diag_set(diag, DIT_ERR_FORMAT,
                                  "%s: key '%s' times the file's scaling %g overflows", path,
                                  m->B->name, (double)m->mult);
                goto cleanup;
            }
            lora_out *o = &l->outs[l->n_outs++];
            o->B = dit_tensor_2d((char *)l->buf + off, wdt, p->nl, r);
            o->row0 = p->row0;
            o->col0 = col0;
            off += ((size_t)(r * p->nl) * esz + 63) / 64 * 64;
            hv = dit_tensor_2d(stage, DIT_F32, p->nl, r);
            DIT_CHECK(be->ops->upload(be, &o->B, &hv));
            col0 += r;
        }
        grp->n_outs = l->n_outs - grp->out0;
    }
    DIT_CHECK(be->ops->sync(be));
    *out = l;
    l = NULL;
cleanup:
    dit_lora_destroy(l);
    free(hA);
    free(hB);
    free(stage);
    free(pieces);
    free(mods.items);
    dit_st_file_close(f);
    return st;
}

void dit_lora_destroy(dit_lora *l)
{
    if (!l)
        return;
    if (l->buf)
        dit_backend_free(l->be, l->buf);
    free(l->groups);
    free(l->outs);
    free(l);
}

dit_lora_info dit_lora_get_info(const dit_lora *l)
{
    return (dit_lora_info){
        .n_modules = l->n_modules, .max_rank = l->max_rank, .bytes = l->bytes, .file = l->file};
}

/* ------------------------------------------------------------------------ */
/* Attachment                                                                */

void dit_lora_detach(dit_lora_sites *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n; i++)
        s->items[i].dst->lora = NULL;
    free(s->ops);
    s->ops = NULL;
    if (s->scales)
        dit_backend_free(s->be, s->scales);
    s->scales = NULL;
    s->be = NULL;
    s->active = false;
}

dit_status dit_lora_attach(dit_lora_sites *s, const dit_lora_use *uses, int n_uses, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_lora_detach(s);
    size_t n_ops = 0;
    int64_t max_rank = 0;
    dit_backend *be = NULL;
    for (int u = 0; u < n_uses; u++) {
        const dit_lora *l = uses[u].lora;
        if (!l || l->sites != s)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "lora %d was not loaded for this model",
                                u);
        if (be && l->be != be)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "lora %d is on another backend", u);
        be = l->be;
        if (uses[u].scale == 0.0f)
            continue;
        n_ops += l->n_groups;
        if (l->max_group_rank > max_rank)
            max_rank = l->max_group_rank;
    }
    if (n_ops == 0)
        return DIT_OK;
    s->ops = calloc(n_ops, sizeof *s->ops);
    if (!s->ops)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "lora: out of memory");
    s->be = be;
    DIT_CHECK(dit_backend_alloc(be, (size_t)n_uses * (size_t)max_rank * sizeof(float), &s->scales));
    size_t k = 0;
    for (int u = 0; u < n_uses; u++) {
        const dit_lora *l = uses[u].lora;
        if (uses[u].scale == 0.0f)
            continue;
        float *sc = (float *)s->scales + (size_t)u * (size_t)max_rank;
        dit_tensor all = dit_tensor_2d(sc, DIT_F32, 1, max_rank);
        DIT_CHECK(be->ops->fill(be, &all, uses[u].scale));
        for (size_t i = 0; i < l->n_groups; i++) {
            const lora_group *g = &l->groups[i];
            dit_linear *dst = s->items[g->site].dst;
            dit_lora_op *op = &s->ops[k++];
            op->A = g->A;
            /* Every element holds the scale: a dense (1, R) view. */
            op->scale = dit_tensor_2d(sc, DIT_F32, 1, g->A.ne[0]);
            op->outs = l->outs + g->out0;
            op->n_outs = g->n_outs;
            op->next = dst->lora;
            dst->lora = op;
        }
    }
    DIT_CHECK(be->ops->sync(be));
    s->active = true;
cleanup:
    if (st != DIT_OK)
        dit_lora_detach(s);
    return st;
}

/* ------------------------------------------------------------------------ */
/* Fusing                                                                    */

dit_status dit_lora_fuse(dit_lora_sites *s, const dit_lora *l, float scale, dit_diag *diag)
{
    dit_status st = DIT_OK;
    float *hA = NULL, *hB = NULL, *hW = NULL;
    if (l->sites != s)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "lora fuse: not loaded for this model");
    if (s->active)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "lora fuse: detach the attached adapters first");
    dit_backend *be = l->be;
    for (size_t g = 0; g < l->n_groups; g++) {
        const lora_group *grp = &l->groups[g];
        const dit_linear *dst = s->items[grp->site].dst;
        const int64_t kl = grp->A.ne[1];
        for (size_t i = 0; i < grp->n_outs; i++) {
            const lora_out *o = &l->outs[grp->out0 + i];
            const int64_t nl = o->B.ne[0], r = o->B.ne[1];
            free(hA);
            free(hB);
            free(hW);
            hA = malloc((size_t)(r * kl) * sizeof *hA);
            hB = malloc((size_t)(nl * r) * sizeof *hB);
            hW = malloc((size_t)(nl * kl) * sizeof *hW);
            if (!hA || !hB || !hW) {
                st = dit_diag_set(diag, DIT_ERR_NOMEM, "lora fuse: out of memory");
                goto cleanup;
            }
            const dit_tensor A = dit_tensor_narrow(&grp->A, 0, o->col0, r);
            const dit_tensor W = dit_tensor_narrow(&dst->w, 0, o->row0, nl);
            dit_tensor ha = dit_tensor_2d(hA, DIT_F32, r, kl);
            dit_tensor hb = dit_tensor_2d(hB, DIT_F32, nl, r);
            dit_tensor hw = dit_tensor_2d(hW, DIT_F32, nl, kl);
            DIT_CHECK(be->ops->download(be, &ha, &A));
            DIT_CHECK(be->ops->download(be, &hb, &o->B));
            DIT_CHECK(be->ops->download(be, &hw, &W));
            /* W (nl, kl) += scale B (nl, r) A (r, kl), row by row. */
            for (int64_t n = 0; n < nl; n++) {
                float *w = hW + n * kl;
                for (int64_t a = 0; a < r; a++) {
                    const float c = scale * hB[n * r + a];
                    const float *ar = hA + a * kl;
                    for (int64_t k = 0; k < kl; k++)
                        w[k] += c * ar[k];
                }
            }
            DIT_CHECK(be->ops->upload(be, &W, &hw));
        }
    }
    st = be->ops->sync(be);
cleanup:
    if (st != DIT_OK)
        dit_diag_set(diag, st, "lora fuse: %s", dit_status_str(st));
    free(hA);
    free(hB);
    free(hW);
    return st;
}

/* ------------------------------------------------------------------------ */
/* The product                                                               */

dit_status dit_lora_linear(dit_backend *be, dit_arena *arena, const dit_tensor *y,
                           const dit_tensor *x, const dit_linear *L, dit_act act, float beta)
{
    const dit_tensor *bias = L->has_b ? &L->b : NULL;
    if (!L->lora)
        return be->ops->linear(be, y, x, &L->w, bias, act, beta);
    if (act != DIT_ACT_NONE && beta != 0.0f)
        return DIT_ERR_INVALID_ARG;
    dit_status st = be->ops->linear(be, y, x, &L->w, bias, DIT_ACT_NONE, beta);
    if (st != DIT_OK)
        return st;
    /* Each adapter's scratch is released before the next one's: the arena
     * grows to one (rows, R) pair, not to all of them. */
    for (const dit_lora_op *op = L->lora; op && st == DIT_OK; op = op->next) {
        const dit_arena_mark mark = dit_arena_get_mark(arena);
        const int64_t R = op->A.ne[0];
        int64_t shape[3];
        const int nd = x->ndim;
        for (int d = 0; d < nd - 1; d++)
            shape[d] = x->ne[d];
        shape[nd - 1] = R;
        dit_tensor t0, t1;
        st = dit_arena_tensor(arena, DIT_F32, nd, shape, &t0);
        if (st == DIT_OK)
            st = dit_arena_tensor(arena, DIT_F32, nd, shape, &t1);
        /* t0 = x A^T for the stacked A's; t1 = scale t0 (as (1, rows, R)
         * against the (1, R) scale); then each module's
         * y[:, row0 : row0 + nl] += t1[:, col0 : col0 + r] B^T. */
        if (st == DIT_OK)
            st = be->ops->linear(be, &t0, x, &op->A, NULL, DIT_ACT_NONE, 0.0f);
        if (st == DIT_OK)
            st = be->ops->fill(be, &t1, 0.0f);
        if (st == DIT_OK) {
            const int64_t rows = dit_tensor_numel(&t0) / R;
            dit_tensor f0 = dit_tensor_3d(t0.data, DIT_F32, 1, rows, R);
            dit_tensor f1 = dit_tensor_3d(t1.data, DIT_F32, 1, rows, R);
            st = be->ops->gated_add(be, &f1, &f0, &op->scale);
        }
        for (size_t i = 0; i < op->n_outs && st == DIT_OK; i++) {
            const lora_out *o = &op->outs[i];
            dit_tensor ys = dit_tensor_narrow(y, y->ndim - 1, o->row0, o->B.ne[0]);
            dit_tensor ts = dit_tensor_narrow(&t1, nd - 1, o->col0, o->B.ne[1]);
            st = be->ops->linear(be, &ys, &ts, &o->B, NULL, DIT_ACT_NONE, 1.0f);
        }
        dit_arena_release(arena, mark);
    }
    if (st == DIT_OK && act != DIT_ACT_NONE)
        st = be->ops->activate(be, y, y, act);
    return st;
}
