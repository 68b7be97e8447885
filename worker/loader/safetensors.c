/* safetensors reader (mmap) and writer.
 *
 * The header is untrusted input: a checkpoint may come from anywhere, and a
 * wrong offset would otherwise turn into an out-of-bounds read deep inside a
 * GEMM. So every field is checked, and every tensor's byte range proven to lie
 * inside the mapping, before any view is handed out. Nothing here dereferences
 * tensor data but the conversions of dit_st_entry_convert and
 * dit_st_entry_scalar: a view may be misaligned for its dtype when a writer
 * used odd offsets, and only memcpy-based conversions touch it. */
#include "loader/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

/* The reference implementation refuses headers above 100 MB; a real header
 * for a 12B-parameter model is well under 1 MB. */
#define ST_MAX_HEADER ((uint64_t)100 << 20)
/* Index files list one line per tensor: a few hundred kB at most. */
#define ST_MAX_INDEX ((off_t)64 << 20)
/* cJSON numbers are doubles: integers at or above 2^53 may have been rounded
 * while parsing, so they cannot be trusted as offsets or dims. */
#define ST_MAX_JSON_INT 9007199254740992.0
#define ST_METADATA_KEY "__metadata__"

typedef struct st_meta {
    char *key;
    char *value;
} st_meta;

struct dit_st_file {
    char *path;
    void *map;
    size_t map_len;
    bool heap;             /* map is a malloc'ed copy of the file, not a mapping */
    dit_file_id id;        /* fstat's, at open */
    dit_st_entry *entries; /* sorted by name; names owned here */
    size_t n;
    st_meta *meta;
    size_t n_meta;
};

struct dit_st_set {
    dit_st_file **files;
    size_t n_files;
    dit_st_entry *entries; /* copies of the files' entries, sorted by name */
    size_t n;
};

/* ---- small helpers ---------------------------------------------------- */

static int entry_cmp_name(const void *a, const void *b)
{
    const dit_st_entry *x = a, *y = b;
    return strcmp(x->name, y->name);
}

static const dit_st_entry *entries_find(const dit_st_entry *e, size_t n, const char *name)
{
    if (!name)
        return NULL;
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, e[mid].name);
        if (c == 0)
            return &e[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

/* safetensors spells dtypes in upper case; dit_dtype_name is lower case. */
static const char *st_dtype_name(dit_dtype dt)
{
    switch (dt) {
    case DIT_F32:
        return "F32";
    case DIT_BF16:
        return "BF16";
    case DIT_F16:
        return "F16";
    case DIT_F8_E4M3:
        return "F8_E4M3";
    default:
        return NULL;
    }
}

static bool st_dtype_parse(const char *s, dit_dtype *out)
{
    for (int i = 0; i < DIT_DTYPE_COUNT; i++) {
        const char *name = st_dtype_name((dit_dtype)i);
        if (name && strcmp(s, name) == 0) {
            *out = (dit_dtype)i;
            return true;
        }
    }
    return false;
}

/* "(3, 4)" for error messages. */
static void shape_str(const int64_t *ne, int ndim, char *buf, size_t cap)
{
    size_t used = 0;
    buf[0] = '\0';
    int w = snprintf(buf, cap, "(");
    used = w > 0 ? (size_t)w : 0;
    for (int i = 0; i < ndim && used < cap; i++) {
        w = snprintf(buf + used, cap - used, "%s%lld", i ? ", " : "", (long long)ne[i]);
        used += w > 0 ? (size_t)w : 0;
    }
    if (used < cap)
        snprintf(buf + used, cap - used, ")");
}

static dit_status errno_status(int err)
{
    if (err == ENOENT || err == ENOTDIR)
        return DIT_ERR_NOT_FOUND;
    if (err == ENOMEM)
        return DIT_ERR_NOMEM;
    return DIT_ERR_IO;
}

/* A JSON number that is an exact non-negative integer below 2^53. Returns
 * false for anything else (fractions, negatives, inf, huge values). */
static bool json_uint(const cJSON *item, uint64_t *out)
{
    if (!cJSON_IsNumber(item))
        return false;
    double d = item->valuedouble;
    if (!isfinite(d) || d < 0.0 || d >= ST_MAX_JSON_INT || d != floor(d))
        return false;
    *out = (uint64_t)d;
    return true;
}

static uint64_t read_u64_le(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static void put_u64_le(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* ---- one file ----------------------------------------------------------- */

/* One parsed header entry before the file's arrays are built. */
typedef struct st_raw {
    dit_st_entry e;
    uint64_t begin, end;
} st_raw;

static int raw_cmp_begin(const void *a, const void *b)
{
    const st_raw *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

static int raw_cmp_name(const void *a, const void *b)
{
    const st_raw *x = a, *y = b;
    return strcmp(x->e.name, y->e.name);
}

/* Checks one tensor entry and fills `r` (name already set) with a view into
 * the data buffer [data, data + data_len). */
static dit_status parse_entry(const char *path, const cJSON *item, unsigned char *data,
                              uint64_t data_len, st_raw *r, dit_diag *diag)
{
    const char *name = r->e.name;
    if (!cJSON_IsObject(item))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s': entry is not a JSON object",
                            path, name);

    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!jd)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s': missing \"dtype\"", path, name);
    if (!cJSON_IsString(jd) || !jd->valuestring)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s': \"dtype\" is not a string",
                            path, name);
    if (!js)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s': missing \"shape\"", path, name);
    if (!cJSON_IsArray(js))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s': \"shape\" is not an array",
                            path, name);
    if (!jo)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s': missing \"data_offsets\"", path,
                            name);
    if (!cJSON_IsArray(jo))
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: tensor '%s': \"data_offsets\" is not an array", path, name);

    dit_dtype dt;
    if (!st_dtype_parse(jd->valuestring, &dt))
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "%s: tensor '%s': dtype '%s' is not supported (supported: F32, "
                            "BF16, F16, F8_E4M3)",
                            path, name, jd->valuestring);

    int ndim = cJSON_GetArraySize(js);
    if (ndim > DIT_MAX_DIMS)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "%s: tensor '%s': shape has %d dims, at most %d are supported", path,
                            name, ndim, DIT_MAX_DIMS);
    int64_t ne[DIT_MAX_DIMS] = {0};
    int k = 0;
    for (const cJSON *d = js->child; d; d = d->next, k++) {
        uint64_t v;
        if (!json_uint(d, &v))
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: tensor '%s': shape[%d] is not a non-negative integer", path,
                                name, k);
        ne[k] = (int64_t)v;
    }

    uint64_t off[2];
    if (cJSON_GetArraySize(jo) != 2 || !json_uint(jo->child, &off[0]) ||
        !json_uint(jo->child->next, &off[1]))
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: tensor '%s': \"data_offsets\" is not two non-negative integers",
                            path, name);
    if (off[0] > off[1])
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: tensor '%s': data_offsets [%llu, %llu] begin after end", path,
                            name, (unsigned long long)off[0], (unsigned long long)off[1]);
    if (off[1] > data_len)
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: tensor '%s': data_offsets [%llu, %llu] run past the end of the "
                            "data (%llu bytes; file truncated?)",
                            path, name, (unsigned long long)off[0], (unsigned long long)off[1],
                            (unsigned long long)data_len);

    /* Bytes the shape needs. `span` multiplies dims clamped to >= 1: it bounds
     * every stride dit_tensor_make computes, which must fit int64 even for a
     * zero-element tensor such as (0, 2^40, 2^40). */
    char sbuf[128];
    uint64_t esize = dit_dtype_size(dt), bytes = esize, span = esize;
    bool overflow = false;
    for (int i = 0; i < ndim; i++) {
        uint64_t d = (uint64_t)ne[i];
        overflow |= __builtin_mul_overflow(bytes, d, &bytes);
        overflow |= __builtin_mul_overflow(span, d ? d : 1, &span);
    }
    if (overflow || span > (uint64_t)INT64_MAX) {
        shape_str(ne, ndim, sbuf, sizeof sbuf);
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s': shape %s %s is too large", path,
                            name, sbuf, st_dtype_name(dt));
    }
    if (bytes != off[1] - off[0]) {
        shape_str(ne, ndim, sbuf, sizeof sbuf);
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: tensor '%s': data_offsets [%llu, %llu] but shape %s %s needs "
                            "%llu bytes",
                            path, name, (unsigned long long)off[0], (unsigned long long)off[1],
                            sbuf, st_dtype_name(dt), (unsigned long long)bytes);
    }

    /* A scalar (shape []) becomes ndim 0: numel is the empty product, 1. The
     * mapping is read-only; the view's non-const pointer is never written. */
    r->e.view = dit_tensor_make(data + off[0], dt, ndim, ne);
    r->begin = off[0];
    r->end = off[1];
    return DIT_OK;
}

static dit_status parse_metadata(dit_st_file *f, const cJSON *item, dit_diag *diag)
{
    if (!cJSON_IsObject(item))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" is not a JSON object", f->path,
                            ST_METADATA_KEY);
    size_t n = 0;
    for (const cJSON *c = item->child; c; c = c->next) {
        if (!cJSON_IsString(c) || !c->valuestring || !c->string)
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" value of '%s' is not a string",
                                f->path, ST_METADATA_KEY, c->string ? c->string : "");
        n++;
    }
    if (n == 0)
        return DIT_OK;
    f->meta = calloc(n, sizeof *f->meta);
    if (!f->meta)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", f->path);
    for (const cJSON *c = item->child; c; c = c->next) {
        st_meta *m = &f->meta[f->n_meta];
        m->key = strdup(c->string);
        m->value = strdup(c->valuestring);
        f->n_meta++; /* counted first so a half-built pair is still freed */
        if (!m->key || !m->value)
            return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", f->path);
    }
    return DIT_OK;
}

/* Parses and validates the header; fills f->entries and f->meta. */
static dit_status parse_header(dit_st_file *f, dit_diag *diag)
{
    dit_status st = DIT_OK;
    char *text = NULL;
    cJSON *root = NULL;
    st_raw *raw = NULL;
    size_t n_raw = 0;
    const char *path = f->path;
    const unsigned char *base = f->map;

    uint64_t hlen = read_u64_le(base);
    uint64_t avail = (uint64_t)f->map_len - 8;
    if (hlen > avail) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: header length %llu runs past the end of the file (%zu bytes)", path,
                          (unsigned long long)hlen, f->map_len);
        goto cleanup;
    }
    if (hlen > ST_MAX_HEADER) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: header length %llu is larger than the %llu byte limit", path,
                          (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER);
        goto cleanup;
    }
    /* Parse a NUL-terminated copy: the parser then cannot run off the end of
     * the header even if it looked one byte further than told. */
    text = malloc((size_t)hlen + 1);
    if (!text) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory for the header", path);
        goto cleanup;
    }
    memcpy(text, base + 8, (size_t)hlen);
    text[hlen] = '\0';
    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts(text, (size_t)hlen, &end, false);
    if (!root) {
        /* On failure cJSON points `end` at the error (cJSON_GetErrorPtr is
         * process-global, so racy between loader threads). */
        size_t pos = (end && end >= text && end <= text + hlen) ? (size_t)(end - text) : 0;
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: header is not valid JSON (error near byte %zu of %llu)", path, pos,
                          (unsigned long long)hlen);
        goto cleanup;
    }
    /* Writers pad the header with spaces to align the data; anything else
     * after the JSON value means the length or the text is wrong. */
    for (const char *p = end; p && p < text + hlen; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: header has trailing bytes after the JSON (at byte %zu)", path,
                              (size_t)(p - text));
            goto cleanup;
        }
    }
    if (!cJSON_IsObject(root)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: header is not a JSON object", path);
        goto cleanup;
    }

    size_t n_items = 0;
    for (const cJSON *c = root->child; c; c = c->next)
        n_items++;
    if (n_items) {
        raw = calloc(n_items, sizeof *raw);
        if (!raw) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
            goto cleanup;
        }
    }

    unsigned char *data = (unsigned char *)f->map + 8 + hlen;
    uint64_t data_len = avail - hlen;
    bool seen_meta = false;
    for (const cJSON *c = root->child; c; c = c->next) {
        if (!c->string) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: header entry without a name", path);
            goto cleanup;
        }
        if (strcmp(c->string, ST_METADATA_KEY) == 0) {
            if (seen_meta) {
                st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" appears twice", path,
                                  ST_METADATA_KEY);
                goto cleanup;
            }
            seen_meta = true;
            DIT_CHECK(parse_metadata(f, c, diag));
            continue;
        }
        st_raw *r = &raw[n_raw];
        r->e.name = strdup(c->string);
        if (!r->e.name) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
            goto cleanup;
        }
        n_raw++;
        r->e.file = f->path;
        DIT_CHECK(parse_entry(path, c, data, data_len, r, diag));
    }

    /* Duplicate names: JSON allows repeated keys and cJSON keeps them all,
     * but a lookup could only ever return one of them. */
    if (n_raw > 1)
        qsort(raw, n_raw, sizeof *raw, raw_cmp_name);
    for (size_t i = 1; i < n_raw; i++) {
        if (strcmp(raw[i - 1].e.name, raw[i].e.name) == 0) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s' appears twice in the header",
                              path, raw[i].e.name);
            goto cleanup;
        }
    }

    /* Overlaps: in begin order, each non-empty range must start at or after
     * the furthest end seen so far. Empty tensors occupy no bytes. */
    if (n_raw > 1) {
        qsort(raw, n_raw, sizeof *raw, raw_cmp_begin);
        const st_raw *prev = NULL;
        for (size_t i = 0; i < n_raw; i++) {
            if (raw[i].begin == raw[i].end)
                continue;
            if (prev && raw[i].begin < prev->end) {
                st = dit_diag_set(diag, DIT_ERR_FORMAT,
                                  "%s: tensor '%s' (bytes [%llu, %llu]) overlaps tensor '%s' "
                                  "(bytes [%llu, %llu])",
                                  path, raw[i].e.name, (unsigned long long)raw[i].begin,
                                  (unsigned long long)raw[i].end, prev->e.name,
                                  (unsigned long long)prev->begin, (unsigned long long)prev->end);
                goto cleanup;
            }
            if (!prev || raw[i].end > prev->end)
                prev = &raw[i];
        }
        qsort(raw, n_raw, sizeof *raw, raw_cmp_name);
    }

    if (n_raw) {
        f->entries = calloc(n_raw, sizeof *f->entries);
        if (!f->entries) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
            goto cleanup;
        }
        /* The names move to f->entries; raw no longer owns them. */
        for (size_t i = 0; i < n_raw; i++)
            f->entries[i] = raw[i].e;
        f->n = n_raw;
        n_raw = 0;
    }

cleanup:
    for (size_t i = 0; i < n_raw; i++)
        free((char *)raw[i].e.name);
    free(raw);
    cJSON_Delete(root);
    free(text);
    return st;
}

/* Reads all of fd's `len` bytes into a new buffer; a file that is shorter
 * than it was (truncated meanwhile) is an I/O error, not a short read. */
static dit_status read_whole(int fd, const char *path, size_t len, void **out, dit_diag *diag)
{
    unsigned char *buf = malloc(len);
    if (!buf)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory reading %zu bytes", path, len);
    size_t got = 0;
    while (got < len) {
        const ssize_t n = pread(fd, buf + got, len - got, (off_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            const int err = n < 0 ? errno : 0;
            free(buf);
            if (n == 0)
                return dit_diag_set(diag, DIT_ERR_IO,
                                    "%s: the file ended at %zu of its %zu bytes (changed while "
                                    "being read)",
                                    path, got, len);
            return dit_diag_set(diag, errno_status(err), "cannot read %s: %s", path, strerror(err));
        }
        got += (size_t)n;
    }
    *out = buf;
    return DIT_OK;
}

/* Opens `path` mapped (copy false) or read into memory (copy true, at most
 * max_bytes when nonzero). */
static dit_status file_open(const char *path, bool copy, uint64_t max_bytes, dit_st_file **out,
                            dit_diag *diag)
{
    dit_status st = DIT_OK;
    int fd = -1;
    dit_st_file *f = NULL;

    *out = NULL;
    if (!path) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "safetensors: NULL path");
        goto cleanup;
    }
    f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        goto cleanup;
    }
    /* O_NONBLOCK: a FIFO put in the file's place opens without a writer
     * (and is then refused as not a regular file). */
    fd = open(path, O_RDONLY | O_CLOEXEC | (copy ? O_NONBLOCK : 0));
    if (fd < 0) {
        int err = errno;
        st = dit_diag_set(diag, errno_status(err), "cannot open %s: %s", path, strerror(err));
        goto cleanup;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int err = errno;
        st = dit_diag_set(diag, DIT_ERR_IO, "cannot stat %s: %s", path, strerror(err));
        goto cleanup;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: not a regular file", path);
        goto cleanup;
    }
    dit_file_id_from_stat(&sb, &f->id);
    if (sb.st_size < 8) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: file is %lld bytes, too short for a safetensors header", path,
                          (long long)sb.st_size);
        goto cleanup;
    }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "%s: file too large to map", path);
        goto cleanup;
    }
    if (copy) {
        if (max_bytes && (uint64_t)sb.st_size > max_bytes) {
            st = dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                              "%s: file is %lld bytes, over the limit of %llu", path,
                              (long long)sb.st_size, (unsigned long long)max_bytes);
            goto cleanup;
        }
        DIT_CHECK(read_whole(fd, path, (size_t)sb.st_size, &f->map, diag));
        f->heap = true;
        f->map_len = (size_t)sb.st_size;
    } else {
        /* MAP_PRIVATE + PROT_READ: pages come from the page cache, shared
         * with every other process reading the same checkpoint. If the
         * file is truncated under us, reads fault (SIGBUS); replacing it by
         * rename, as every writer should, is safe. */
        void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            int err = errno;
            st = dit_diag_set(diag, errno_status(err), "cannot mmap %s: %s", path, strerror(err));
            goto cleanup;
        }
        f->map = map;
        f->map_len = (size_t)sb.st_size;
    }

    DIT_CHECK(parse_header(f, diag));
    *out = f;
    f = NULL;

cleanup:
    if (fd >= 0)
        close(fd);
    dit_st_file_close(f);
    return st;
}

dit_status dit_st_file_open(const char *path, dit_st_file **out, dit_diag *diag)
{
    return file_open(path, false, 0, out, diag);
}

dit_status dit_st_file_read(const char *path, uint64_t max_bytes, dit_st_file **out, dit_diag *diag)
{
    return file_open(path, true, max_bytes, out, diag);
}

dit_file_id dit_st_file_id(const dit_st_file *f)
{
    return f->id;
}

void dit_st_file_close(dit_st_file *f)
{
    if (!f)
        return;
    for (size_t i = 0; i < f->n; i++)
        free((char *)f->entries[i].name);
    free(f->entries);
    for (size_t i = 0; i < f->n_meta; i++) {
        free(f->meta[i].key);
        free(f->meta[i].value);
    }
    free(f->meta);
    if (f->heap)
        free(f->map);
    else if (f->map)
        munmap(f->map, f->map_len);
    free(f->path);
    free(f);
}

size_t dit_st_file_count(const dit_st_file *f)
{
    return f ? f->n : 0;
}

const dit_st_entry *dit_st_file_at(const dit_st_file *f, size_t i)
{
    return f && i < f->n ? &f->entries[i] : NULL;
}

const dit_st_entry *dit_st_file_find(const dit_st_file *f, const char *name)
{
    return f ? entries_find(f->entries, f->n, name) : NULL;
}

const char *dit_st_file_metadata(const dit_st_file *f, const char *key)
{
    if (!f || !key)
        return NULL;
    /* A handful of keys at most ("format": "pt"): a scan is enough. */
    for (size_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[i].key, key) == 0)
            return f->meta[i].value;
    return NULL;
}

/* ---- sets --------------------------------------------------------------- */

void dit_st_set_close(dit_st_set *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n_files; i++)
        dit_st_file_close(s->files[i]);
    free(s->files);
    free(s->entries);
    free(s);
}

size_t dit_st_set_count(const dit_st_set *s)
{
    return s ? s->n : 0;
}

const dit_st_entry *dit_st_set_at(const dit_st_set *s, size_t i)
{
    return s && i < s->n ? &s->entries[i] : NULL;
}

const dit_st_entry *dit_st_set_find(const dit_st_set *s, const char *name)
{
    return s ? entries_find(s->entries, s->n, name) : NULL;
}

dit_status dit_st_entry_scalar(const dit_st_entry *e, float *out, dit_diag *diag)
{
    if (dit_tensor_numel(&e->view) != 1) {
        char sbuf[128];
        shape_str(e->view.ne, e->view.ndim, sbuf, sizeof sbuf);
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s': shape %s is not a single value",
                            e->file, e->name, sbuf);
    }
    dit_convert_to_f32(out, e->view.data, e->view.dtype, 1);
    return DIT_OK;
}

dit_status dit_st_entry_convert(const dit_st_entry *e, const dit_st_entry *scale, dit_dtype dt,
                                void *dst, size_t dst_bytes, dit_diag *diag)
{
    const dit_tensor *t = &e->view;
    const size_t n = (size_t)dit_tensor_numel(t), de = dit_dtype_size(dt);
    if (de == 0 || dst_bytes / de < n)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "%s: tensor '%s': %zu elements do not fit %zu bytes of %s", e->file,
                            e->name, n, dst_bytes, dit_dtype_name(dt));
    if (!scale) {
        dit_convert_scaled(dst, dt, t->data, t->dtype, n, 1.0f);
        return DIT_OK;
    }
    /* One scale for the whole tensor, or one per index of dim 0 (an (N)
     * or (N, 1) scale of an (N, K) weight: per output channel). */
    const size_t ns = (size_t)dit_tensor_numel(&scale->view);
    const size_t outer = ns == 1 ? 1 : t->ndim >= 1 ? (size_t)t->ne[0] : 1;
    if (ns != outer) {
        char sa[128], sb[128];
        shape_str(t->ne, t->ndim, sa, sizeof sa);
        shape_str(scale->view.ne, scale->view.ndim, sb, sizeof sb);
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: tensor '%s': scale '%s' has shape %s; a tensor of shape %s "
                            "needs one value or one per index of its first dim",
                            scale->file, e->name, scale->name, sb, sa);
    }
    const size_t inner = outer ? n / outer : 0, se = dit_dtype_size(t->dtype);
    for (size_t i = 0; i < outer; i++) {
        float f;
        const size_t ss = dit_dtype_size(scale->view.dtype);
        dit_convert_to_f32(&f, (const char *)scale->view.data + i * ss, scale->view.dtype, 1);
        if (!isfinite(f))
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: tensor '%s': scale '%s' value %zu is %g, not finite",
                                scale->file, e->name, scale->name, i, (double)f);
        dit_convert_scaled((char *)dst + i * inner * de, dt, (const char *)t->data + i * inner * se,
                           t->dtype, inner, f);
    }
    return DIT_OK;
}

/* Collects the entries of all files into s->entries, sorted by name. */
static dit_status set_build_entries(dit_st_set *s, const char *what, dit_diag *diag)
{
    size_t total = 0;
    for (size_t i = 0; i < s->n_files; i++)
        total += s->files[i]->n;
    if (total == 0)
        return DIT_OK;
    s->entries = calloc(total, sizeof *s->entries);
    if (!s->entries)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", what);
    for (size_t i = 0; i < s->n_files; i++)
        for (size_t j = 0; j < s->files[i]->n; j++)
            s->entries[s->n++] = s->files[i]->entries[j];
    qsort(s->entries, s->n, sizeof *s->entries, entry_cmp_name);
    return DIT_OK;
}

static dit_status set_open_single(const char *path, dit_st_set **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_st_set *s = calloc(1, sizeof *s);
    if (!s || !(s->files = calloc(1, sizeof *s->files))) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        goto cleanup;
    }
    DIT_CHECK(dit_st_file_open(path, &s->files[0], diag));
    s->n_files = 1;
    DIT_CHECK(set_build_entries(s, path, diag));
    *out = s;
    s = NULL;

cleanup:
    dit_st_set_close(s);
    return st;
}

/* Reads a small text file whole, NUL-terminated. */
static dit_status read_small_file(const char *path, off_t limit, char **out, size_t *out_len,
                                  dit_diag *diag)
{
    dit_status st = DIT_OK;
    char *buf = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int err = errno;
        st = dit_diag_set(diag, errno_status(err), "cannot open %s: %s", path, strerror(err));
        goto cleanup;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int err = errno;
        st = dit_diag_set(diag, DIT_ERR_IO, "cannot stat %s: %s", path, strerror(err));
        goto cleanup;
    }
    if (!S_ISREG(sb.st_mode)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: not a regular file", path);
        goto cleanup;
    }
    if (sb.st_size > limit) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: %lld bytes, larger than the %lld byte limit",
                          path, (long long)sb.st_size, (long long)limit);
        goto cleanup;
    }
    size_t cap = (size_t)sb.st_size;
    buf = malloc(cap + 1);
    if (!buf) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        goto cleanup;
    }
    size_t len = 0;
    while (len < cap) {
        ssize_t r = read(fd, buf + len, cap - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int err = errno;
            st = dit_diag_set(diag, DIT_ERR_IO, "cannot read %s: %s", path, strerror(err));
            goto cleanup;
        }
        if (r == 0)
            break; /* shrank since fstat: parse what is there */
        len += (size_t)r;
    }
    buf[len] = '\0';
    *out = buf;
    *out_len = len;
    buf = NULL;

cleanup:
    free(buf);
    if (fd >= 0)
        close(fd);
    return st;
}

/* A shard name from an index must name a file beside the index: no
 * directories, so a hostile index cannot make us map /etc/shadow or a file
 * in some other model's folder. */
static bool shard_name_ok(const char *s)
{
    return s[0] != '\0' && strchr(s, '/') == NULL && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

typedef struct st_wm {
    const char *tensor; /* strings point into the index's cJSON tree */
    const char *shard;
    size_t file; /* index into the set's files */
} st_wm;

static int wm_cmp_tensor(const void *a, const void *b)
{
    const st_wm *x = a, *y = b;
    return strcmp(x->tensor, y->tensor);
}

static int str_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static const st_wm *wm_find(const st_wm *wm, size_t n, const char *name)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, wm[mid].tensor);
        if (c == 0)
            return &wm[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

static dit_status set_open_index(const char *index_path, dit_st_set **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    char *text = NULL, *dir = NULL, *shard_path = NULL;
    cJSON *root = NULL;
    st_wm *wm = NULL;
    const char **shards = NULL;
    size_t n_wm = 0, n_shards = 0;
    dit_st_set *s = NULL;

    size_t len = 0;
    DIT_CHECK(read_small_file(index_path, ST_MAX_INDEX, &text, &len, diag));
    root = cJSON_ParseWithLength(text, len);
    if (!root) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: not valid JSON", index_path);
        goto cleanup;
    }
    if (!cJSON_IsObject(root)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: not a JSON object", index_path);
        goto cleanup;
    }
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!map) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: missing \"weight_map\"", index_path);
        goto cleanup;
    }
    if (!cJSON_IsObject(map)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"weight_map\" is not a JSON object",
                          index_path);
        goto cleanup;
    }

    for (const cJSON *c = map->child; c; c = c->next)
        n_wm++;
    if (n_wm) {
        wm = calloc(n_wm, sizeof *wm);
        shards = calloc(n_wm, sizeof *shards);
        if (!wm || !shards) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", index_path);
            goto cleanup;
        }
    }
    size_t i = 0;
    for (const cJSON *c = map->child; c; c = c->next, i++) {
        const char *t = c->string ? c->string : "";
        if (!cJSON_IsString(c) || !c->valuestring) {
            st =
                dit_diag_set(diag, DIT_ERR_FORMAT,
                             "%s: weight_map value for tensor '%s' is not a string", index_path, t);
            goto cleanup;
        }
        if (!shard_name_ok(c->valuestring)) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: tensor '%s': shard '%s' is not a plain file name", index_path, t,
                              c->valuestring);
            goto cleanup;
        }
        wm[i].tensor = t;
        wm[i].shard = c->valuestring;
        shards[i] = c->valuestring;
    }
    if (n_wm > 1)
        qsort(wm, n_wm, sizeof *wm, wm_cmp_tensor);
    for (i = 1; i < n_wm; i++) {
        if (strcmp(wm[i - 1].tensor, wm[i].tensor) == 0) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s' appears twice in weight_map",
                              index_path, wm[i].tensor);
            goto cleanup;
        }
    }

    /* Distinct shard names, each opened once. */
    if (n_wm > 1)
        qsort(shards, n_wm, sizeof *shards, str_cmp);
    for (i = 0; i < n_wm; i++)
        if (n_shards == 0 || strcmp(shards[n_shards - 1], shards[i]) != 0)
            shards[n_shards++] = shards[i];
    for (i = 0; i < n_wm; i++) {
        const char **hit = bsearch(&wm[i].shard, shards, n_shards, sizeof *shards, str_cmp);
        wm[i].file = (size_t)(hit - shards);
    }

    /* Shards resolve in the index's own directory. */
    const char *slash = strrchr(index_path, '/');
    dir = slash ? strndup(index_path, (size_t)(slash - index_path) + 1) : strdup("");
    s = calloc(1, sizeof *s);
    if (!dir || !s || (n_shards && !(s->files = calloc(n_shards, sizeof *s->files)))) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", index_path);
        goto cleanup;
    }
    for (i = 0; i < n_shards; i++) {
        free(shard_path);
        if (asprintf(&shard_path, "%s%s", dir, shards[i]) < 0) {
            shard_path = NULL;
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", index_path);
            goto cleanup;
        }
        st = dit_st_file_open(shard_path, &s->files[i], diag);
        if (st != DIT_OK) {
            dit_diag_prefix(diag, "%s: ", index_path);
            goto cleanup;
        }
        s->n_files++;
    }
    DIT_CHECK(set_build_entries(s, index_path, diag));

    /* The index and the shards must agree exactly: a tensor in two shards,
     * or one the index does not know about, means a mixed-up folder (say a
     * shard from another revision), which would load the wrong weights. */
    for (i = 1; i < s->n; i++) {
        if (strcmp(s->entries[i - 1].name, s->entries[i].name) == 0) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: tensor '%s' is in both %s and %s",
                              index_path, s->entries[i].name, s->entries[i - 1].file,
                              s->entries[i].file);
            goto cleanup;
        }
    }
    for (i = 0; i < s->n; i++) {
        const dit_st_entry *e = &s->entries[i];
        const st_wm *w = wm_find(wm, n_wm, e->name);
        if (!w) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: tensor '%s' is not listed in the weight_map of %s", e->file,
                              e->name, index_path);
            goto cleanup;
        }
        if (strcmp(s->files[w->file]->path, e->file) != 0) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: tensor '%s' is listed in the weight_map of %s under shard '%s'",
                              e->file, e->name, index_path, w->shard);
            goto cleanup;
        }
    }
    for (i = 0; i < n_wm; i++) {
        const dit_st_file *sf = s->files[wm[i].file];
        if (!dit_st_file_find(sf, wm[i].tensor)) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: tensor '%s' is mapped to shard '%s', but %s does not contain it",
                              index_path, wm[i].tensor, wm[i].shard, sf->path);
            goto cleanup;
        }
    }

    *out = s;
    s = NULL;

cleanup:
    dit_st_set_close(s);
    free(shard_path);
    free(dir);
    free(shards);
    free(wm);
    cJSON_Delete(root);
    free(text);
    return st;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

dit_status dit_st_set_open_path(const char *path, dit_st_set **out, dit_diag *diag)
{
    *out = NULL;
    if (!path)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "safetensors: NULL path");
    if (ends_with(path, ".json"))
        return set_open_index(path, out, diag);
    return set_open_single(path, out, diag);
}

dit_status dit_st_set_open_dir(const char *dir, const char *base, dit_st_set **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    char *single = NULL, *index = NULL;
    struct stat sb;

    *out = NULL;
    if (!dir || !base) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "safetensors: NULL directory or base name");
        goto cleanup;
    }
    if (asprintf(&single, "%s/%s.safetensors", dir, base) < 0) {
        single = NULL;
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
        goto cleanup;
    }
    if (asprintf(&index, "%s/%s.safetensors.index.json", dir, base) < 0) {
        index = NULL;
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", dir);
        goto cleanup;
    }
    /* Only "does not exist" moves on to the index: a single file that exists
     * but cannot be read is an error worth reporting as such. */
    if (stat(single, &sb) == 0 || (errno != ENOENT && errno != ENOTDIR)) {
        st = set_open_single(single, out, diag);
    } else if (stat(index, &sb) == 0 || (errno != ENOENT && errno != ENOTDIR)) {
        st = set_open_index(index, out, diag);
    } else {
        st = dit_diag_set(diag, DIT_ERR_NOT_FOUND, "no weights: neither %s nor %s exists", single,
                          index);
    }

cleanup:
    free(index);
    free(single);
    return st;
}

/* ---- writing ------------------------------------------------------------ */

/* Buffered writer over a file descriptor, so strided tensors can be gathered
 * one element at a time without a syscall per element. */
typedef struct st_writer {
    int fd;
    int err; /* first errno seen; later writes are skipped */
    size_t used;
    unsigned char buf[1 << 16];
} st_writer;

static void writer_flush(st_writer *w)
{
    size_t off = 0;
    while (off < w->used && !w->err) {
        ssize_t r = write(w->fd, w->buf + off, w->used - off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            w->err = errno;
        else
            off += (size_t)r;
    }
    w->used = 0;
}

static void writer_put(st_writer *w, const void *p, size_t n)
{
    const unsigned char *src = p;
    while (n > 0 && !w->err) {
        size_t room = sizeof w->buf - w->used;
        size_t k = n < room ? n : room;
        memcpy(w->buf + w->used, src, k);
        w->used += k;
        src += k;
        n -= k;
        if (w->used == sizeof w->buf)
            writer_flush(w);
    }
}

/* Writes a tensor's elements in row-major order, contiguous. */
static void write_tensor(st_writer *w, const dit_tensor *t)
{
    if (dit_tensor_numel(t) == 0)
        return;
    size_t es = dit_dtype_size(t->dtype);
    if (dit_tensor_is_contiguous(t)) {
        writer_put(w, t->data, dit_tensor_nbytes(t));
        return;
    }
    /* Row by row (a 0-D tensor is contiguous, so ndim >= 1 here); rows with
     * unit stride go out in one piece. */
    const int last = t->ndim - 1;
    const int64_t rows = dit_tensor_nrows(t), cols = t->ne[last], cs = t->nb[last];
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)t->data + dit_tensor_row_offset(t, r);
        if (cs == (int64_t)es) {
            writer_put(w, row, (size_t)cols * es);
            continue;
        }
        for (int64_t c = 0; c < cols; c++)
            writer_put(w, row + c * cs, es);
    }
}

typedef struct st_out {
    size_t item; /* index into the caller's items */
    uint64_t bytes;
    uint64_t begin;
} st_out;

/* Larger elements first, then the caller's order: with the data buffer
 * starting at a multiple of 8, every tensor then starts aligned for its
 * dtype (as the reference writer arranges it). */
static int out_cmp(const void *a, const void *b, void *arg)
{
    const st_out *x = a, *y = b;
    const dit_st_write_item *items = arg;
    size_t ex = dit_dtype_size(items[x->item].tensor->dtype);
    size_t ey = dit_dtype_size(items[y->item].tensor->dtype);
    if (ex != ey)
        return ex > ey ? -1 : 1;
    return x->item < y->item ? -1 : x->item > y->item;
}

static int name_ptr_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static cJSON *json_u64(uint64_t v)
{
    /* Raw text, not a double: offsets print exactly at any size. */
    char buf[24];
    snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
    return cJSON_CreateRaw(buf);
}

/* Validates the items and computes each tensor's bytes. */
static dit_status write_check(const char *path, const dit_st_write_item *items, size_t n,
                              st_out *outs, dit_diag *diag)
{
    dit_status st = DIT_OK;
    const char **names = NULL;
    if (n > 0 && !items)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: NULL items", path);
    for (size_t i = 0; i < n; i++) {
        const char *name = items[i].name;
        const dit_tensor *t = items[i].tensor;
        if (!name || strcmp(name, ST_METADATA_KEY) == 0)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: item %zu: invalid tensor name",
                                path, i);
        if (!t || (unsigned)t->dtype >= DIT_DTYPE_COUNT || t->ndim < 0 || t->ndim > DIT_MAX_DIMS)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "%s: tensor '%s': missing tensor, bad dtype or bad rank", path,
                                name);
        uint64_t bytes = dit_dtype_size(t->dtype);
        bool overflow = false;
        for (int d = 0; d < t->ndim; d++) {
            if (t->ne[d] < 0)
                return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                    "%s: tensor '%s': negative size in dim %d", path, name, d);
            overflow |= __builtin_mul_overflow(bytes, (uint64_t)t->ne[d], &bytes);
        }
        if (overflow)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: tensor '%s': too large", path,
                                name);
        if (bytes > 0 && !t->data)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: tensor '%s': NULL data", path,
                                name);
        outs[i].item = i;
        outs[i].bytes = bytes;
    }
    if (n > 1) {
        names = malloc(n * sizeof *names);
        if (!names)
            return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        for (size_t i = 0; i < n; i++)
            names[i] = items[i].name;
        qsort(names, n, sizeof *names, name_ptr_cmp);
        for (size_t i = 1; i < n; i++) {
            if (strcmp(names[i - 1], names[i]) == 0) {
                st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: tensor '%s' given twice", path,
                                  names[i]);
                break;
            }
        }
        free(names);
    }
    return st;
}

/* The header JSON for `outs` (in data order), assigning each tensor its
 * offsets. NULL when out of memory. */
static char *build_header(const dit_st_write_item *items, st_out *outs, size_t n)
{
    char *text = NULL;
    cJSON *root = cJSON_CreateObject();
    if (!root)
        goto cleanup;
    uint64_t offset = 0;
    for (size_t k = 0; k < n; k++) {
        const dit_tensor *t = items[outs[k].item].tensor;
        outs[k].begin = offset;
        offset += outs[k].bytes;
        cJSON *e = cJSON_CreateObject();
        if (!e || !cJSON_AddItemToObject(root, items[outs[k].item].name, e)) {
            cJSON_Delete(e);
            goto cleanup;
        }
        cJSON *shape = cJSON_AddArrayToObject(e, "shape");
        cJSON *offs = cJSON_AddArrayToObject(e, "data_offsets");
        if (!cJSON_AddStringToObject(e, "dtype", st_dtype_name(t->dtype)) || !shape || !offs)
            goto cleanup;
        for (int d = 0; d < t->ndim; d++)
            if (!cJSON_AddItemToArray(shape, json_u64((uint64_t)t->ne[d])))
                goto cleanup;
        if (!cJSON_AddItemToArray(offs, json_u64(outs[k].begin)) ||
            !cJSON_AddItemToArray(offs, json_u64(offset)))
            goto cleanup;
    }
    text = cJSON_PrintUnformatted(root);

cleanup:
    cJSON_Delete(root);
    return text;
}

dit_status dit_st_write(const char *path, const dit_st_write_item *items, size_t n, dit_diag *diag)
{
    dit_status st = DIT_OK;
    st_out *outs = NULL;
    char *header = NULL, *tmp = NULL;
    st_writer *w = NULL;
    int fd = -1;
    bool tmp_exists = false;

    if (!path)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "safetensors: NULL output path");
    outs = calloc(n ? n : 1, sizeof *outs);
    w = malloc(sizeof *w);
    if (!outs || !w) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        goto cleanup;
    }
    DIT_CHECK(write_check(path, items, n, outs, diag));
    if (n > 1)
        qsort_r(outs, n, sizeof *outs, out_cmp, (void *)items);
    header = build_header(items, outs, n);
    if (!header || asprintf(&tmp, "%s.tmp.%ld", path, (long)getpid()) < 0) {
        tmp = NULL;
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        goto cleanup;
    }

    /* Pad with spaces so the data buffer starts 8-aligned in the file (and
     * so in any page-aligned mapping of it). */
    size_t hlen = strlen(header);
    size_t padded = (hlen + 7) / 8 * 8;
    unsigned char lenbuf[8];
    put_u64_le(lenbuf, padded);

    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        int err = errno;
        st = dit_diag_set(diag, errno_status(err), "cannot create %s: %s", tmp, strerror(err));
        goto cleanup;
    }
    tmp_exists = true;
    w->fd = fd;
    w->err = 0;
    w->used = 0;
    writer_put(w, lenbuf, sizeof lenbuf);
    writer_put(w, header, hlen);
    for (size_t i = hlen; i < padded; i++)
        writer_put(w, " ", 1);
    for (size_t k = 0; k < n; k++)
        write_tensor(w, items[outs[k].item].tensor);
    writer_flush(w);
    /* fsync before rename: otherwise a crash can leave the new name pointing
     * at an empty file instead of the old contents or the new. */
    if (!w->err && fsync(fd) != 0)
        w->err = errno;
    if (close(fd) != 0 && !w->err)
        w->err = errno;
    fd = -1;
    if (w->err) {
        st = dit_diag_set(diag, DIT_ERR_IO, "cannot write %s: %s", tmp, strerror(w->err));
        goto cleanup;
    }
    if (rename(tmp, path) != 0) {
        int err = errno;
        st = dit_diag_set(diag, DIT_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(err));
        goto cleanup;
    }
    tmp_exists = false;

cleanup:
    if (fd >= 0)
        close(fd);
    if (tmp_exists)
        unlink(tmp);
    free(tmp);
    free(header);
    free(w);
    free(outs);
    return st;
}
