/* The tokenizers' shared base. See tokenizer_base.h. */
#include "encoders/tokenizer_base.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "loader/json_util.h"

/* Values of model_max_length above this are not a length anyone can
 * encode. */
#define DIT_TOK_MAX_LENGTH_CAP (1 << 20)

/* ---- UTF-8 and Unicode ------------------------------------------------------------ */

int32_t dit_tok_utf8_next(const char *s, size_t len, size_t *i)
{
    utf8proc_int32_t cp = 0;
    utf8proc_ssize_t n =
        utf8proc_iterate((const utf8proc_uint8_t *)s + *i, (utf8proc_ssize_t)(len - *i), &cp);
    *i += n > 0 ? (size_t)n : 1;
    return n > 0 ? cp : 0xFFFD;
}

size_t dit_tok_utf8_back(const char *s, size_t i)
{
    size_t j = i - 1;
    while (j > 0 && ((unsigned char)s[j] & 0xC0) == 0x80)
        j--;
    return j;
}

int32_t dit_tok_utf8_prev(const char *s, size_t i)
{
    size_t k = dit_tok_utf8_back(s, i);
    return dit_tok_utf8_next(s, i, &k);
}

bool dit_tok_utf8_valid(const char *s, size_t len, size_t *bad_at)
{
    size_t i = 0;
    while (i < len) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t n =
            utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(len - i), &cp);
        if (n <= 0) {
            *bad_at = i;
            return false;
        }
        i += (size_t)n;
    }
    return true;
}

bool dit_tok_is_ws(int32_t c)
{
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

/* ---- growable byte buffer ----------------------------------------------------------- */

bool dit_tok_buf_reserve(dit_tok_buf *b, size_t extra)
{
    if (b->n + extra + 1 <= b->cap)
        return true;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra + 1)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p)
        return false;
    b->p = p;
    b->cap = cap;
    return true;
}

bool dit_tok_buf_put(dit_tok_buf *b, const void *s, size_t n)
{
    if (!dit_tok_buf_reserve(b, n))
        return false;
    if (n) /* s may be NULL then (an empty buffer's p) */
        memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return true;
}

bool dit_tok_buf_put_cp(dit_tok_buf *b, int32_t cp)
{
    utf8proc_uint8_t tmp[4];
    utf8proc_ssize_t n = utf8proc_encode_char(cp, tmp);
    return dit_tok_buf_put(b, tmp, (size_t)n);
}

/* ---- string -> id map --------------------------------------------------------------- */

uint64_t dit_tok_hash_bytes(const void *p, size_t n)
{
    const unsigned char *s = p;
    uint64_t h = DIT_TOK_HASH_INIT;
    for (size_t i = 0; i < n; i++)
        h = dit_tok_hash_step(h, s[i]);
    return dit_tok_hash_final(h);
}

bool dit_tok_map_init(dit_tok_map *m, size_t entries, size_t key_bytes)
{
    m->cap = 16;
    while (m->cap < entries * 2 + 1)
        m->cap *= 2;
    m->slots = calloc(m->cap, sizeof *m->slots);
    m->pool = malloc(key_bytes ? key_bytes : 1);
    m->pool_used = 0;
    m->pool_cap = key_bytes;
    return m->slots && m->pool;
}

void dit_tok_map_put(dit_tok_map *m, const char *key, size_t len, int32_t val)
{
    assert(len + 1 <= m->pool_cap - m->pool_used);
    char *copy = m->pool + m->pool_used;
    memcpy(copy, key, len);
    copy[len] = '\0';
    m->pool_used += len + 1;
    size_t i = dit_tok_hash_bytes(key, len) & (m->cap - 1);
    while (m->slots[i].key) {
        if (m->slots[i].len == len && memcmp(m->slots[i].key, key, len) == 0)
            break;
        i = (i + 1) & (m->cap - 1);
    }
    m->slots[i].key = copy;
    m->slots[i].len = len;
    m->slots[i].val = val;
}

bool dit_tok_map_get_hashed(const dit_tok_map *m, const char *key, size_t len, uint64_t h,
                            int32_t *val)
{
    size_t i = h & (m->cap - 1);
    while (m->slots[i].key) {
        if (m->slots[i].len == len && memcmp(m->slots[i].key, key, len) == 0) {
            *val = m->slots[i].val;
            return true;
        }
        i = (i + 1) & (m->cap - 1);
    }
    return false;
}

bool dit_tok_map_get(const dit_tok_map *m, const char *key, size_t len, int32_t *val)
{
    return dit_tok_map_get_hashed(m, key, len, dit_tok_hash_bytes(key, len), val);
}

void dit_tok_map_free(dit_tok_map *m)
{
    if (!m)
        return;
    free(m->slots);
    free(m->pool);
    memset(m, 0, sizeof *m);
}

/* ---- spans ------------------------------------------------------------------------------ */

bool dit_tok_span_push(dit_tok_span_list *l, size_t off, size_t len, int32_t id, bool first)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        dit_tok_span *v = realloc(l->v, cap * sizeof *v);
        if (!v)
            return false;
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = (dit_tok_span){off, len, id, first};
    return true;
}

/* ---- output ids --------------------------------------------------------------------------- */

int dit_tok_ids_finish(int32_t *ids, int max_length, const int32_t *prefix, int n_prefix,
                       int n_text, const int32_t *suffix, int n_suffix, int32_t pad_id)
{
    for (int i = 0; i < n_prefix; i++)
        ids[i] = prefix[i];
    int n = n_prefix + n_text;
    for (int i = 0; i < n_suffix; i++)
        ids[n++] = suffix[i];
    for (int i = n; i < max_length; i++)
        ids[i] = pad_id;
    return n;
}

/* ---- added tokens ------------------------------------------------------------------------- */

dit_tok_added *dit_tok_added_find(const dit_tok_added_set *set, const char *content)
{
    for (int k = 0; k < set->n; k++)
        if (strcmp(set->v[k].content, content) == 0)
            return &set->v[k];
    return NULL;
}

dit_status dit_tok_added_add(dit_tok_added_set *set, const dit_tok_map *vocab, const char *content,
                             int64_t id_hint, dit_tok_added **out)
{
    dit_tok_added *a = dit_tok_added_find(set, content);
    if (!a) {
        int32_t vid;
        int64_t id = id_hint;
        if (dit_tok_map_get(vocab, content, strlen(content), &vid))
            id = vid;
        if (id < 0 || id > INT32_MAX)
            return DIT_ERR_NOT_FOUND;
        dit_tok_added *v = realloc(set->v, (size_t)(set->n + 1) * sizeof *v);
        if (!v)
            return DIT_ERR_NOMEM;
        set->v = v;
        a = &set->v[set->n];
        memset(a, 0, sizeof *a);
        a->content = strdup(content);
        if (!a->content)
            return DIT_ERR_NOMEM;
        a->id = (int32_t)id;
        set->n++;
    }
    *out = a;
    return DIT_OK;
}

bool dit_tok_added_set_match(dit_tok_added_set *set, int k, const char *match, size_t len)
{
    dit_tok_added *a = &set->v[k];
    free(a->match);
    a->match = malloc(len + 1);
    a->match_len = 0;
    if (!a->match)
        return false;
    if (len)
        memcpy(a->match, match, len);
    a->match[len] = '\0';
    a->match_len = len;
    if (len > 0)
        set->first_byte[a->flags.normalized][(unsigned char)a->match[0]] = true;
    return true;
}

/* The longest token of the given kind matching at s[i]; NULL if none. */
static const dit_tok_added *added_at(const dit_tok_added_set *set, bool normalized, const char *s,
                                     size_t len, size_t i)
{
    const dit_tok_added *best = NULL;
    if (!set->first_byte[normalized][(unsigned char)s[i]])
        return NULL;
    for (int k = 0; k < set->n; k++) {
        const dit_tok_added *a = &set->v[k];
        if (a->flags.normalized != normalized || a->match_len == 0 || a->match_len > len - i)
            continue;
        if ((!best || a->match_len > best->match_len) && memcmp(s + i, a->match, a->match_len) == 0)
            best = a;
    }
    return best;
}

bool dit_tok_added_split(const dit_tok_added_set *set, bool normalized, const char *s, size_t len,
                         bool first, dit_tok_span_list *out)
{
    size_t start_offset = 0, i = 0;
    while (i < len) {
        const dit_tok_added *a = added_at(set, normalized, s, len, i);
        if (!a) {
            i++;
            continue;
        }
        size_t start = i, stop = i + a->match_len;
        i = stop;
        if (a->flags.single_word) {
            bool start_ok = start == 0 || !set->is_word(dit_tok_utf8_prev(s, start));
            size_t k = stop;
            bool stop_ok = stop == len || !set->is_word(dit_tok_utf8_next(s, len, &k));
            if (!start_ok || !stop_ok)
                continue;
        }
        if (a->flags.lstrip)
            while (start > start_offset && dit_tok_is_ws(dit_tok_utf8_prev(s, start)))
                start = dit_tok_utf8_back(s, start);
        if (a->flags.rstrip) {
            while (stop < len) {
                size_t k = stop;
                if (!dit_tok_is_ws(dit_tok_utf8_next(s, len, &k)))
                    break;
                stop = k;
            }
            i = stop;
        }
        if (start_offset < start && !dit_tok_span_push(out, start_offset, start - start_offset, -1,
                                                       first && start_offset == 0))
            return false;
        if (!dit_tok_span_push(out, start, stop - start, a->id, false))
            return false;
        start_offset = stop;
    }
    if (start_offset < len &&
        !dit_tok_span_push(out, start_offset, len - start_offset, -1, first && start_offset == 0))
        return false;
    return true;
}

void dit_tok_added_free(dit_tok_added_set *set)
{
    if (!set)
        return;
    for (int k = 0; k < set->n; k++) {
        free(set->v[k].content);
        free(set->v[k].match);
    }
    free(set->v);
    set->v = NULL;
    set->n = 0;
    memset(set->first_byte, 0, sizeof set->first_byte);
}

/* ---- the encoding pipeline ----------------------------------------------------------------- */

dit_status dit_tok_encode_text(const dit_tok_added_set *set, const char *s, size_t len,
                               dit_tok_normalize_fn normalize, dit_tok_model_fn model, void *ctx,
                               dit_tok_span_list *outer, dit_tok_span_list *inner, dit_tok_ids *out)
{
    dit_status st = DIT_OK;
    outer->n = 0;
    if (!dit_tok_added_split(set, false, s, len, true, outer))
        return DIT_ERR_NOMEM;
    for (size_t i = 0; i < outer->n && !out->overflow; i++) {
        const dit_tok_span g = outer->v[i];
        if (g.id >= 0) {
            dit_tok_ids_push(out, g.id);
            continue;
        }
        const char *ns = NULL;
        size_t nn = 0;
        st = normalize(ctx, s + g.off, g.len, &ns, &nn);
        if (st != DIT_OK)
            return st;
        inner->n = 0;
        if (!dit_tok_added_split(set, true, ns, nn, g.first, inner))
            return DIT_ERR_NOMEM;
        for (size_t j = 0; j < inner->n && !out->overflow; j++) {
            const dit_tok_span h = inner->v[j];
            if (h.id >= 0)
                dit_tok_ids_push(out, h.id);
            else if ((st = model(ctx, ns + h.off, h.len, h.first, out)) != DIT_OK)
                return st;
        }
    }
    return DIT_OK;
}

/* ---- configuration files -------------------------------------------------------------- */

char *dit_tok_path_join(const char *dir, const char *name)
{
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p)
        snprintf(p, n, "%s/%s", dir, name);
    return p;
}

dit_status dit_tok_json_load_optional(const char *path, cJSON **out, dit_diag *diag)
{
    /* A sub-diagnostic, so that an absent file leaves `diag` untouched. */
    dit_diag sub = {0};
    *out = NULL;
    dit_status st = dit_json_load_file(path, out, &sub);
    if (st == DIT_ERR_NOT_FOUND)
        return DIT_OK;
    if (st != DIT_OK)
        return dit_diag_set(diag, st, "%s", dit_diag_msg(&sub));
    return DIT_OK;
}

bool dit_tok_json_id(const cJSON *v, int64_t *id)
{
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > INT32_MAX ||
        v->valuedouble != (double)(int32_t)v->valuedouble)
        return false;
    *id = (int64_t)v->valuedouble;
    return true;
}

bool dit_tok_key_id(const char *s, int64_t *id)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || !*s || *end || v < 0 || v > INT32_MAX)
        return false;
    *id = v;
    return true;
}

bool dit_tok_json_flag(const cJSON *obj, const char *key, bool def, bool *out)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!it || cJSON_IsNull(it)) {
        *out = def;
        return true;
    }
    if (!cJSON_IsBool(it))
        return false;
    *out = cJSON_IsTrue(it);
    return true;
}

dit_status dit_tok_config_max_length(const cJSON *cfg, const char *path, int min_len, int def,
                                     int *out, dit_diag *diag)
{
    *out = def;
    const cJSON *ml = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, "model_max_length") : NULL;
    if (!ml || cJSON_IsNull(ml))
        return DIT_OK;
    if (!cJSON_IsNumber(ml) || ml->valuedouble < min_len) {
        if (min_len == 1)
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: \"model_max_length\" must be a positive number", path);
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: \"model_max_length\" must be a number of at least %d", path,
                            min_len);
    }
    if (ml->valuedouble <= DIT_TOK_MAX_LENGTH_CAP && ml->valuedouble == (int)ml->valuedouble)
        *out = (int)ml->valuedouble;
    return DIT_OK;
}
