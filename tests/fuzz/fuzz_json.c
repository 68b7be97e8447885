/* The JSON mutator of fuzz_json.h, through cJSON's tree. */
#include "fuzz_json.h"

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

typedef struct pick {
    size_t want, seen;
    cJSON *node, *parent;
} pick;

static void find_node(cJSON *parent, cJSON *n, pick *p)
{
    for (; n && !p->node; n = n->next) {
        if (p->seen++ == p->want) {
            p->node = n;
            p->parent = parent;
            return;
        }
        find_node(n, n->child, p);
    }
}

static size_t count_nodes(const cJSON *n)
{
    size_t k = 0;
    for (; n; n = n->next)
        k += 1 + count_nodes(n->child);
    return k;
}

static uint64_t mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* A replacement for a node: another value of its kind or of another. */
static cJSON *new_value(uint64_t *s, const cJSON *old)
{
    static const double nums[] = {0,
                                  1,
                                  -1,
                                  2,
                                  255,
                                  256,
                                  65535,
                                  16,
                                  32,
                                  1048576,
                                  1048577,
                                  2147483647.0,
                                  4294967296.0,
                                  1e300,
                                  -1e300,
                                  0.5,
                                  9007199254740993.0};
    static const char *const strs[] = {"",
                                       "<unk>",
                                       "</s>",
                                       "<pad>",
                                       "\xe2\x96\x81",
                                       "\xc4\xa0",
                                       "</w>",
                                       "a b",
                                       "\\s+",
                                       "[\\p{L}]+",
                                       "(",
                                       "\xff\xfe",
                                       "Unigram",
                                       "BPE",
                                       "Precompiled",
                                       "Sequence",
                                       "Replace",
                                       "Strip",
                                       "NFC",
                                       "Metaspace",
                                       "WhitespaceSplit",
                                       "Split",
                                       "ByteLevel",
                                       "TemplateProcessing",
                                       "always"};
    switch (mix(s) % 6) {
    case 0:
        return cJSON_CreateNumber(nums[mix(s) % (sizeof nums / sizeof *nums)]);
    case 1:
        return cJSON_CreateString(strs[mix(s) % (sizeof strs / sizeof *strs)]);
    case 2:
        return mix(s) & 1 ? cJSON_CreateNull() : cJSON_CreateBool(mix(s) & 1);
    case 3:
        return mix(s) & 1 ? cJSON_CreateArray() : cJSON_CreateObject();
    default: /* the old one's kind, changed */
        if (cJSON_IsNumber(old))
            return cJSON_CreateNumber(old->valuedouble + (double)(int)(mix(s) % 5) - 2.0);
        if (cJSON_IsString(old) && old->valuestring) {
            size_t n = strlen(old->valuestring);
            char *t = strdup(old->valuestring);
            if (!t)
                return NULL;
            if (n)
                t[mix(s) % n] = (char)(mix(s) & 0xff ? mix(s) & 0xff : 'x');
            cJSON *v = cJSON_CreateString(t);
            free(t);
            return v;
        }
        return cJSON_Duplicate(old, true);
    }
}

size_t dit_fuzz_json_mutate(uint8_t *data, size_t size, size_t max_size, uint64_t seed)
{
    cJSON *root = cJSON_ParseWithLength((const char *)data, size);
    if (!root)
        return 0;
    uint64_t s = seed;
    for (int k = 0, n = 1 + (int)(mix(&s) % 3); k < n; k++) {
        size_t total = count_nodes(root->child);
        if (!total)
            break;
        pick p = {.want = mix(&s) % total};
        find_node(root, root->child, &p);
        if (!p.node)
            break;
        const uint64_t op = mix(&s) % 4;
        if (op == 0) { /* drop it */
            cJSON_Delete(cJSON_DetachItemViaPointer(p.parent, p.node));
        } else if (op == 1 && cJSON_IsArray(p.parent)) { /* repeat it */
            cJSON *dup = cJSON_Duplicate(p.node, true);
            if (dup)
                cJSON_AddItemToArray(p.parent, dup);
        } else {
            cJSON *v = new_value(&s, p.node);
            if (v && p.node->string) { /* an object's member keeps its key */
                cJSON_free(v->string); /* a duplicate's copy of it */
                v->string = strdup(p.node->string);
            }
            if (v && !cJSON_ReplaceItemViaPointer(p.parent, p.node, v))
                cJSON_Delete(v);
        }
    }
    char *text = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    size_t n = text ? strlen(text) : 0;
    if (!text || n > max_size) {
        free(text);
        return 0;
    }
    memcpy(data, text, n);
    free(text);
    return n;
}
