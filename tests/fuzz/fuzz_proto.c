/* The protobuf-c message mutator of fuzz_proto.h. Memory follows
 * protobuf-c's own rules for unpacked messages (the system allocator): a
 * string, bytes or sub-message is freed unless it is the field's default,
 * so everything set here is malloc'd and free_unpacked releases it. */
#include "fuzz_proto.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 4
#define MAX_REPEATED 16

#define MEMBER(type, msg, off) (*(type *)(void *)((char *)(msg) + (off)))

typedef struct rng {
    uint64_t s;
} rng;

static uint64_t next(rng *r)
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static size_t below(rng *r, size_t n)
{
    return n ? (size_t)(next(r) % n) : 0;
}

/* Boundary values first; a few that mean something to the readers (sizes
 * that are multiples of 16, step and frame counts, 4k + 1 frames). */
static int64_t interesting(rng *r)
{
    static const int64_t v[] = {0,
                                1,
                                -1,
                                2,
                                3,
                                5,
                                8,
                                16,
                                17,
                                32,
                                64,
                                81,
                                100,
                                255,
                                256,
                                1000,
                                1001,
                                1024,
                                4096,
                                65535,
                                65536,
                                0x7fffffff,
                                -0x7fffffff - 1,
                                0x80000000LL,
                                INT64_MAX,
                                INT64_MIN,
                                0xffffffffLL};
    return v[below(r, sizeof v / sizeof v[0])];
}

static char *random_text(rng *r, size_t *len_out)
{
    static const char *const words[] = {
        "a",  " ",  "lighthouse", "&amp;",   "\xc3\xa9", "\xe3\x80\x80", "\xf0\x9f\x8c\x8a",
        "..", "/",  "demo",       "style_a", "\xff",     "\xed\xa0\x80", "\x01",
        "\"", "\\", "\n",         "%s",      "%n"};
    size_t n;
    switch (below(r, 8)) {
    case 0:
        n = 0;
        break;
    case 1: /* past the prompt and id limits (65536, 128 bytes) */
        n = below(r, 2) ? 129 : 65537;
        break;
    default:
        n = below(r, 48);
    }
    char *s = malloc(n + 8);
    if (!s)
        return NULL;
    size_t len = 0;
    if (n > 1000) { /* long: one repeated letter */
        memset(s, 'a' + (int)below(r, 26), n);
        len = n;
    }
    while (len < n) {
        const char *w = words[below(r, sizeof words / sizeof words[0])];
        size_t wl = strlen(w);
        if (len + wl > n)
            break;
        memcpy(s + len, w, wl);
        len += wl;
    }
    s[len] = 0;
    *len_out = len;
    return s;
}

static void set_scalar(rng *r, const ProtobufCFieldDescriptor *f, void *p)
{
    const int64_t i = below(r, 4) ? interesting(r) : (int64_t)next(r);
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_ENUM:
        if (f->type == PROTOBUF_C_TYPE_ENUM && below(r, 2)) { /* a known value */
            const ProtobufCEnumDescriptor *e = f->descriptor;
            *(int32_t *)p = e->n_values ? e->values[below(r, e->n_values)].value : 0;
        } else {
            *(int32_t *)p = (int32_t)i;
        }
        break;
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
        *(uint32_t *)p = (uint32_t)i;
        break;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        *(int64_t *)p = i;
        break;
    case PROTOBUF_C_TYPE_BOOL:
        *(protobuf_c_boolean *)p = below(r, 2);
        break;
    case PROTOBUF_C_TYPE_FLOAT:
    case PROTOBUF_C_TYPE_DOUBLE: {
        static const double fv[] = {0.0, 1.0, -1.0, 0.5, 1.5, 3.5, 100.0, 1e30, -1e30, 1e-45};
        double d;
        switch (below(r, 4)) {
        case 0:
            d = (double)__builtin_nan("");
            break;
        case 1:
            d = (double)(below(r, 2) ? __builtin_inf() : -__builtin_inf());
            break;
        default:
            d = fv[below(r, sizeof fv / sizeof fv[0])];
        }
        if (f->type == PROTOBUF_C_TYPE_FLOAT)
            *(float *)p = (float)d;
        else
            *(double *)p = d;
        break;
    }
    default:
        break;
    }
}

static void free_string(const ProtobufCFieldDescriptor *f, char *s)
{
    if (s && s != f->default_value && s != protobuf_c_empty_string)
        free(s);
}

static void free_bytes(const ProtobufCFieldDescriptor *f, ProtobufCBinaryData *b)
{
    const ProtobufCBinaryData *def = f->default_value;
    if (b->data && (!def || def->data != b->data))
        free(b->data);
    b->data = NULL;
    b->len = 0;
}

static void mutate_string(rng *r, const ProtobufCFieldDescriptor *f, char **sp)
{
    size_t len = 0;
    char *s = random_text(r, &len);
    if (!s)
        return;
    const char *old = *sp ? *sp : "";
    size_t ol = strlen(old);
    if (below(r, 3) == 0 && ol > 0) { /* keep a prefix of the old one */
        size_t keep = below(r, ol);
        char *t = malloc(keep + 1);
        if (!t) {
            free(s);
            return;
        }
        memcpy(t, old, keep);
        t[keep] = 0;
        free(s);
        s = t;
    }
    free_string(f, *sp);
    *sp = s;
}

static void mutate_bytes(rng *r, const ProtobufCFieldDescriptor *f, ProtobufCBinaryData *b)
{
    if (b->len && below(r, 2)) { /* same length, some bytes changed */
        for (size_t k = 0, n = 1 + below(r, 4); k < n; k++)
            b->data[below(r, b->len)] = (uint8_t)next(r);
        return;
    }
    static const size_t lens[] = {0, 1, 2, 3, 4, 31, 32, 33, 64, 128, 1024, 2048};
    size_t n = below(r, 2) ? lens[below(r, sizeof lens / sizeof lens[0])]
                           : (b->len ? b->len + below(r, 9) - 4 : below(r, 256));
    if (n > 8192)
        n = 8192;
    uint8_t *d = malloc(n ? n : 1);
    if (!d)
        return;
    for (size_t k = 0; k < n; k++)
        d[k] = (uint8_t)(below(r, 4) ? next(r) : 0);
    free_bytes(f, b);
    b->data = d;
    b->len = n;
}

static size_t elem_size(const ProtobufCFieldDescriptor *f)
{
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE:
        return 8;
    case PROTOBUF_C_TYPE_BOOL:
        return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING:
        return sizeof(char *);
    case PROTOBUF_C_TYPE_BYTES:
        return sizeof(ProtobufCBinaryData);
    case PROTOBUF_C_TYPE_MESSAGE:
        return sizeof(ProtobufCMessage *);
    default:
        return 4;
    }
}

static ProtobufCMessage *new_message(const ProtobufCMessageDescriptor *d)
{
    ProtobufCMessage *m = malloc(d->sizeof_message);
    if (m)
        protobuf_c_message_init(d, m);
    return m;
}

static void mutate_message(rng *r, ProtobufCMessage *m, int depth);

/* One element (or the field itself) at p, of field f's type. */
static void mutate_value(rng *r, const ProtobufCFieldDescriptor *f, void *p, int depth)
{
    switch (f->type) {
    case PROTOBUF_C_TYPE_STRING:
        mutate_string(r, f, (char **)p);
        break;
    case PROTOBUF_C_TYPE_BYTES:
        mutate_bytes(r, f, (ProtobufCBinaryData *)p);
        break;
    case PROTOBUF_C_TYPE_MESSAGE: {
        ProtobufCMessage **mp = p;
        if (!*mp) {
            *mp = new_message(f->descriptor);
        } else if (below(r, 5) == 0) {
            protobuf_c_message_free_unpacked(*mp, NULL);
            *mp = NULL;
            return;
        }
        if (*mp && depth < MAX_DEPTH)
            mutate_message(r, *mp, depth + 1);
        break;
    }
    default:
        set_scalar(r, f, p);
    }
}

/* Frees element i of a repeated field's array. */
static void free_elem(const ProtobufCFieldDescriptor *f, void *arr, size_t i)
{
    if (f->type == PROTOBUF_C_TYPE_STRING)
        free_string(f, ((char **)arr)[i]);
    else if (f->type == PROTOBUF_C_TYPE_BYTES)
        free_bytes(f, &((ProtobufCBinaryData *)arr)[i]);
    else if (f->type == PROTOBUF_C_TYPE_MESSAGE)
        protobuf_c_message_free_unpacked(((ProtobufCMessage **)arr)[i], NULL);
}

static void mutate_repeated(rng *r, const ProtobufCFieldDescriptor *f, ProtobufCMessage *m,
                            int depth)
{
    size_t *n = &MEMBER(size_t, m, f->quantifier_offset);
    void **arr = &MEMBER(void *, m, f->offset);
    const size_t es = elem_size(f);
    size_t op = below(r, 3);
    if (*n == 0 || (op == 0 && *n < MAX_REPEATED)) { /* grow by one, the new one set */
        void *na = realloc(*arr, (*n + 1) * es);
        if (!na)
            return;
        *arr = na;
        char *slot = (char *)na + *n * es;
        memset(slot, 0, es);
        if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
            ProtobufCMessage *sub = new_message(f->descriptor);
            if (!sub)
                return;
            *(ProtobufCMessage **)(void *)slot = sub;
            (*n)++;
            if (depth < MAX_DEPTH) /* never dropped: elements are never NULL */
                mutate_message(r, sub, depth + 1);
            return;
        } else if (f->type == PROTOBUF_C_TYPE_STRING) {
            char *e = malloc(1);
            if (!e)
                return;
            e[0] = 0;
            *(char **)(void *)slot = e;
        }
        (*n)++;
        mutate_value(r, f, slot, depth);
    } else if (op == 1) { /* drop the last */
        free_elem(f, *arr, *n - 1);
        (*n)--;
    } else {
        void *slot = (char *)*arr + below(r, *n) * es;
        if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
            ProtobufCMessage *sub = *(ProtobufCMessage **)slot;
            if (sub && depth < MAX_DEPTH)
                mutate_message(r, sub, depth + 1);
        } else {
            mutate_value(r, f, slot, depth);
        }
    }
}

/* Clears the oneof member now set in m (its case field at case_off). */
static void clear_oneof(ProtobufCMessage *m, size_t case_off)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    uint32_t active = MEMBER(uint32_t, m, case_off);
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *g = &d->fields[i];
        if (!(g->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) || g->quantifier_offset != case_off ||
            g->id != active)
            continue;
        void *p = (char *)m + g->offset;
        if (g->type == PROTOBUF_C_TYPE_MESSAGE) {
            protobuf_c_message_free_unpacked(*(ProtobufCMessage **)p, NULL);
            *(ProtobufCMessage **)p = NULL;
        } else if (g->type == PROTOBUF_C_TYPE_STRING) {
            free_string(g, *(char **)p);
            *(char **)p = NULL;
        } else if (g->type == PROTOBUF_C_TYPE_BYTES) {
            free_bytes(g, p);
        }
    }
    MEMBER(uint32_t, m, case_off) = 0;
}

static void mutate_message(rng *r, ProtobufCMessage *m, int depth)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    if (!d->n_fields)
        return;
    const ProtobufCFieldDescriptor *f = &d->fields[below(r, d->n_fields)];
    void *p = (char *)m + f->offset;
    if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
        uint32_t *cs = &MEMBER(uint32_t, m, f->quantifier_offset);
        if (*cs != f->id) { /* switch the oneof to this member */
            clear_oneof(m, f->quantifier_offset);
            if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
                *(ProtobufCMessage **)p = new_message(f->descriptor);
                if (!*(ProtobufCMessage **)p)
                    return;
            } else if (f->type == PROTOBUF_C_TYPE_STRING) {
                *(char **)p = NULL;
            } else if (f->type == PROTOBUF_C_TYPE_BYTES) {
                memset(p, 0, sizeof(ProtobufCBinaryData));
            }
            *cs = f->id;
        }
        mutate_value(r, f, p, depth);
        return;
    }
    if (f->label == PROTOBUF_C_LABEL_REPEATED) {
        mutate_repeated(r, f, m, depth);
        return;
    }
    if (f->label == PROTOBUF_C_LABEL_OPTIONAL && f->quantifier_offset &&
        f->type != PROTOBUF_C_TYPE_MESSAGE && f->type != PROTOBUF_C_TYPE_STRING)
        MEMBER(protobuf_c_boolean, m, f->quantifier_offset) = 1;
    mutate_value(r, f, p, depth);
}

size_t dit_fuzz_proto_mutate(const ProtobufCMessageDescriptor *desc, uint8_t *data, size_t size,
                             size_t max_size, uint64_t seed)
{
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, size, data);
    if (!m)
        return 0;
    rng r = {seed};
    for (size_t k = 0, n = 1 + below(&r, 4); k < n; k++)
        mutate_message(&r, m, 0);
    size_t out = protobuf_c_message_get_packed_size(m);
    if (out <= max_size)
        protobuf_c_message_pack(m, data);
    else
        out = 0;
    protobuf_c_message_free_unpacked(m, NULL);
    return out;
}
