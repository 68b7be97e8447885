/* CLIP byte-level BPE, reproducing transformers' CLIPTokenizer.
 *
 * Reference: the installed transformers (5.x) builds CLIPTokenizer on the
 * `tokenizers` library (models/clip/tokenization_clip.py):
 *   normalizer    Sequence[NFC, Replace(Regex("\s+"), " "), Lowercase]
 *   pre_tokenizer Sequence[Split(Regex(CLIP_PATTERN), "removed", invert),
 *                          ByteLevel(add_prefix_space=False)]   (use_regex: GPT-2's)
 *   model         BPE(vocab.json, merges.txt, end_of_word_suffix="</w>",
 *                     fuse_unk=False, unk_token=<|endoftext|>)
 *   post          RobertaProcessing: <|startoftext|> ... <|endoftext|>
 * plus transformers' added (special) tokens, which are cut out of the text
 * before the pipeline runs. There is no slow tokenizer in transformers 5 and
 * ftfy plays no part; this file reproduces that behaviour, which is also the
 * one the fixtures were generated with (ftfy not installed). It differs from
 * transformers 4.x's slow CLIPTokenizer (BasicTokenizer + whitespace_clean
 * without ftfy) in two places: 4.x dropped control characters and split
 * every CJK ideograph into its own word, while 5.x keeps control characters
 * (they become byte symbols) and keeps a run of ideographs as one \p{L}+ word.
 *
 * Unicode data: the regex classes are Oniguruma's (Unicode 16 in the
 * installed tokenizers) and Lowercase is Rust's char::to_lowercase (full
 * mapping, no final-sigma rule). libutf8proc may carry older data (2.8:
 * Unicode 15), so the code points those versions added as letters, numbers
 * or lowercase mappings are listed below; with them the classes and case
 * mapping equal the installed tokenizers' for every code point (checked
 * exhaustively when the tables were made). NFC is utf8proc's; it equals the
 * one tokenizers uses for every code point and canonical decomposition
 * except U+11935 U+11930 (Dives Akuru), which utf8proc composes and
 * tokenizers' older tables do not. */
#include "encoders/clip_tokenizer.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>
#include <utf8proc.h>

#include "encoders/tokenizer_base.h"
#include "loader/json_util.h"

#define CLIP_DEFAULT_MAX_LENGTH 77
/* The real merges.txt is ~500 kB. */
#define CLIP_MAX_MERGES_BYTES ((long)64 << 20)
#define CLIP_EOW "</w>"

/* ---- Unicode classes ------------------------------------------------------ */

typedef struct cp_range {
    int32_t lo, hi;
} cp_range;

/* Letters (\p{L} in Oniguruma, Unicode 15.1/16.0) that Unicode 15.0 lacks. */
static const cp_range extra_letters[] = {
    {0x1C89, 0x1C8A},   {0xA7CB, 0xA7CD},   {0xA7DA, 0xA7DC},   {0x105C0, 0x105F3},
    {0x10D4A, 0x10D65}, {0x10D6F, 0x10D85}, {0x10EC2, 0x10EC4}, {0x11380, 0x11389},
    {0x1138B, 0x1138B}, {0x1138E, 0x1138E}, {0x11390, 0x113B5}, {0x113B7, 0x113B7},
    {0x113D1, 0x113D1}, {0x113D3, 0x113D3}, {0x11BC0, 0x11BE0}, {0x13460, 0x143FA},
    {0x16100, 0x1611D}, {0x16D40, 0x16D6C}, {0x18CFF, 0x18CFF}, {0x1E5D0, 0x1E5ED},
    {0x1E5F0, 0x1E5F0}, {0x2EBF0, 0x2EE5D},
};

/* Numbers (\p{N}) that Unicode 15.0 lacks. */
static const cp_range extra_numbers[] = {
    {0x10D40, 0x10D49}, {0x116D0, 0x116E3}, {0x11BF0, 0x11BF9}, {0x16130, 0x16139},
    {0x16D70, 0x16D79}, {0x1CCF0, 0x1CCF9}, {0x1E5F1, 0x1E5FA},
};

/* Lowercase mappings (Rust's, Unicode 16/17) that Unicode 15.0 lacks:
 * lo..hi map to cp + delta. */
static const struct {
    int32_t lo, hi, delta;
} extra_lower[] = {
    {0x1C89, 0x1C89, 1},    {0xA7CB, 0xA7CB, -42343}, {0xA7CC, 0xA7CC, 1}, {0xA7CE, 0xA7CE, 1},
    {0xA7D2, 0xA7D2, 1},    {0xA7D4, 0xA7D4, 1},      {0xA7DA, 0xA7DA, 1}, {0xA7DC, 0xA7DC, -42561},
    {0x10D50, 0x10D65, 32}, {0x16EA0, 0x16EB8, 27},
};

static bool in_ranges(int32_t c, const cp_range *r, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (c >= r[i].lo && c <= r[i].hi)
            return true;
    return false;
}

static bool is_letter(int32_t c)
{
    if (c < 0x80)
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    utf8proc_category_t cat = utf8proc_category(c);
    if (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO)
        return true;
    return in_ranges(c, extra_letters, sizeof extra_letters / sizeof extra_letters[0]);
}

static bool is_number(int32_t c)
{
    if (c < 0x80)
        return c >= '0' && c <= '9';
    utf8proc_category_t cat = utf8proc_category(c);
    if (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO)
        return true;
    return in_ranges(c, extra_numbers, sizeof extra_numbers / sizeof extra_numbers[0]);
}

/* Rust's regex \w, used only for added tokens marked single_word: letters,
 * marks, decimal digits, letter numbers, connector punctuation, ZWNJ/ZWJ
 * (Alphabetic symbols such as circled letters are not included). */
static bool is_word_char(int32_t c)
{
    if (c == 0x200C || c == 0x200D || is_letter(c))
        return true;
    utf8proc_category_t cat = utf8proc_category(c);
    return (cat >= UTF8PROC_CATEGORY_MN && cat <= UTF8PROC_CATEGORY_ND) ||
           cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_PC;
}

static int32_t lower_cp(int32_t c)
{
    for (size_t i = 0; i < sizeof extra_lower / sizeof extra_lower[0]; i++)
        if (c >= extra_lower[i].lo && c <= extra_lower[i].hi)
            return c + extra_lower[i].delta;
    return utf8proc_tolower(c);
}

/* ---- merge map ---------------------------------------------------------------- */

static uint64_t hash_u64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static size_t pow2_at_least(size_t n)
{
    size_t c = 16;
    while (c < n)
        c *= 2;
    return c;
}

/* (left id, right id) -> (rank, merged id). */
#define PMAP_EMPTY UINT64_MAX

typedef struct pmap_slot {
    uint64_t key;
    uint32_t rank;
    int32_t new_id;
} pmap_slot;

typedef struct pmap {
    pmap_slot *slots;
    size_t cap;
} pmap;

static bool pmap_init(pmap *m, size_t entries)
{
    m->cap = pow2_at_least(entries * 2 + 1);
    m->slots = malloc(m->cap * sizeof *m->slots);
    if (!m->slots)
        return false;
    for (size_t i = 0; i < m->cap; i++)
        m->slots[i].key = PMAP_EMPTY;
    return true;
}

static uint64_t pair_key(int32_t a, int32_t b)
{
    return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
}

static void pmap_put(pmap *m, uint64_t key, uint32_t rank, int32_t new_id)
{
    size_t i = hash_u64(key) & (m->cap - 1);
    while (m->slots[i].key != PMAP_EMPTY && m->slots[i].key != key)
        i = (i + 1) & (m->cap - 1);
    m->slots[i].key = key;
    m->slots[i].rank = rank;
    m->slots[i].new_id = new_id;
}

static const pmap_slot *pmap_get(const pmap *m, int32_t a, int32_t b)
{
    uint64_t key = pair_key(a, b);
    size_t i = hash_u64(key) & (m->cap - 1);
    while (m->slots[i].key != PMAP_EMPTY) {
        if (m->slots[i].key == key)
            return &m->slots[i];
        i = (i + 1) & (m->cap - 1);
    }
    return NULL;
}

/* ---- the tokenizer ------------------------------------------------------------ */

struct dit_clip_tokenizer {
    char *dir;
    dit_tok_map vocab;
    pmap merges;
    int32_t byte_id[256];     /* vocab id of the byte's symbol, or -1 */
    int32_t byte_eow_id[256]; /* ... of the symbol + "</w>", or -1 */
    int32_t unk_id;           /* -1: the unk token is not in the vocabulary */
    int32_t bos_id, eos_id, pad_id;
    int max_length;
    /* transformers' added tokens: matched in the text before the normalizer
     * (normalized = false) or in the normalized text (true). */
    dit_tok_added_set added;
};

/* GPT-2's byte -> printable character table. */
static void bytes_to_unicode(int32_t map[256])
{
    int n = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        map[b] = printable ? b : 256 + n++;
    }
}

static dit_status read_text_file(const char *path, long max_bytes, char **out, size_t *out_len,
                                 dit_diag *diag)
{
    dit_status st = DIT_OK;
    char *data = NULL;
    FILE *f = fopen(path, "rb");
    if (!f)
        return dit_diag_set(diag, errno == ENOENT ? DIT_ERR_NOT_FOUND : DIT_ERR_IO,
                            "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        st = dit_diag_set(diag, DIT_ERR_IO, "%s: not a regular file", path);
        goto cleanup;
    }
    if (sb.st_size > max_bytes) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: %lld bytes is too large", path,
                          (long long)sb.st_size);
        goto cleanup;
    }
    data = malloc((size_t)sb.st_size + 1);
    if (!data) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        goto cleanup;
    }
    if (fread(data, 1, (size_t)sb.st_size, f) != (size_t)sb.st_size) {
        st = dit_diag_set(diag, DIT_ERR_IO, "%s: short read", path);
        goto cleanup;
    }
    data[sb.st_size] = '\0';
    *out = data;
    *out_len = (size_t)sb.st_size;
    data = NULL;
cleanup:
    free(data);
    fclose(f);
    return st;
}

/* The vocabulary: a JSON object token -> id (vocab.json, or tokenizer.json's
 * model.vocab). `path` names the file in errors. */
static dit_status load_vocab(dit_clip_tokenizer *t, const cJSON *obj, const char *path,
                             dit_diag *diag)
{
    if (!cJSON_IsObject(obj))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: the vocabulary is not a JSON object", path);
    size_t n = 0, bytes = 0;
    for (const cJSON *it = obj->child; it; it = it->next) {
        int64_t id;
        if (!dit_tok_json_id(it, &id))
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: the id of token \"%.64s\" is not an integer in [0, 2^31)",
                                path, it->string ? it->string : "");
        n++;
        bytes += strlen(it->string) + 1;
    }
    if (n == 0)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: the vocabulary is empty", path);
    if (!dit_tok_map_init(&t->vocab, n, bytes))
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
    for (const cJSON *it = obj->child; it; it = it->next)
        dit_tok_map_put(&t->vocab, it->string, strlen(it->string), (int32_t)it->valuedouble);
    return DIT_OK;
}

/* One merge (rank = its index among the merges): both tokens and their
 * concatenation must be in the vocabulary, as tokenizers' BPE builder
 * requires. A later duplicate pair overwrites an earlier one (HashMap). */
static dit_status add_merge(dit_clip_tokenizer *t, const char *a, size_t la, const char *b,
                            size_t lb, uint32_t rank, dit_tok_buf *cat, const char *path,
                            const char *where, size_t index, dit_diag *diag)
{
    int32_t ia, ib, m;
    bool has_a = dit_tok_map_get(&t->vocab, a, la, &ia);
    if (!has_a || !dit_tok_map_get(&t->vocab, b, lb, &ib))
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: %s %zu: token \"%.*s\" is not in the vocabulary", path, where,
                            index, (int)(has_a ? lb : la), has_a ? b : a);
    cat->n = 0;
    if (!dit_tok_buf_put(cat, a, la) || !dit_tok_buf_put(cat, b, lb))
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
    if (!dit_tok_map_get(&t->vocab, cat->p, cat->n, &m))
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: %s %zu: merged token \"%.*s\" is not in the vocabulary", path,
                            where, index, (int)cat->n, cat->p);
    pmap_put(&t->merges, pair_key(ia, ib), rank, m);
    return DIT_OK;
}

/* merges.txt as tokenizers reads it: lines starting with "#version" are
 * skipped, every other line (a trailing "\r" dropped) must be exactly two
 * space-separated tokens. */
static dit_status load_merges_txt(dit_clip_tokenizer *t, const char *path, dit_diag *diag)
{
    dit_status st = DIT_OK;
    char *data = NULL;
    size_t len = 0;
    dit_tok_buf cat = {0};
    DIT_CHECK(read_text_file(path, CLIP_MAX_MERGES_BYTES, &data, &len, diag));

    size_t lines = 1;
    for (size_t i = 0; i < len; i++)
        lines += data[i] == '\n';
    if (!pmap_init(&t->merges, lines)) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        goto cleanup;
    }
    uint32_t rank = 0;
    size_t line_no = 0, pos = 0;
    while (pos < len) {
        char *line = data + pos;
        char *nl = memchr(line, '\n', len - pos);
        size_t n = nl ? (size_t)(nl - line) : len - pos;
        pos += n + (nl ? 1 : 0);
        line_no++;
        if (n > 0 && line[n - 1] == '\r')
            n--;
        if (n >= 8 && memcmp(line, "#version", 8) == 0)
            continue;
        char *sp = memchr(line, ' ', n);
        if (!sp || memchr(sp + 1, ' ', n - (size_t)(sp - line) - 1) || memchr(line, '\0', n)) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: line %zu is not two tokens separated by one space", path,
                              line_no);
            goto cleanup;
        }
        size_t la = (size_t)(sp - line);
        DIT_CHECK(
            add_merge(t, line, la, sp + 1, n - la - 1, rank++, &cat, path, "line", line_no, diag));
    }
cleanup:
    free(cat.p);
    free(data);
    return st;
}

/* tokenizer.json's model.merges: ["a", "b"] pairs, or "a b" strings in
 * files written by older versions of tokenizers. */
static dit_status load_merges_json(dit_clip_tokenizer *t, const cJSON *list, const char *path,
                                   dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_tok_buf cat = {0};
    int n = cJSON_IsArray(list) ? cJSON_GetArraySize(list) : -1;
    if (n < 0)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: model.merges is not a list", path);
    if (!pmap_init(&t->merges, (size_t)n))
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
    uint32_t rank = 0;
    for (const cJSON *it = list->child; it; it = it->next, rank++) {
        const char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        if (cJSON_IsString(it)) {
            const char *sp = strchr(it->valuestring, ' ');
            if (sp && !strchr(sp + 1, ' ')) {
                a = it->valuestring;
                la = (size_t)(sp - a);
                b = sp + 1;
                lb = strlen(b);
            }
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 && cJSON_IsString(it->child) &&
                   cJSON_IsString(it->child->next)) {
            a = it->child->valuestring;
            b = it->child->next->valuestring;
            la = strlen(a);
            lb = strlen(b);
        }
        if (!a) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: merge %u is not a pair of tokens", path,
                              rank);
            goto cleanup;
        }
        DIT_CHECK(add_merge(t, a, la, b, lb, rank, &cat, path, "merge", rank, diag));
    }
cleanup:
    free(cat.p);
    return st;
}

/* ---- normalizer ------------------------------------------------------------- */

/* NFC, every run of White_Space -> " ", lowercase (full mapping: U+0130
 * becomes "i" + U+0307; everything else maps to one code point). */
static dit_status clip_normalize(const char *s, size_t len, dit_tok_buf *out)
{
    out->n = 0;
    if (!dit_tok_buf_reserve(out, len))
        return DIT_ERR_NOMEM;
    if (len == 0)
        return DIT_OK;
    utf8proc_uint8_t *nfc = NULL;
    utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &nfc,
                                      UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (n < 0)
        return n == UTF8PROC_ERROR_NOMEM ? DIT_ERR_NOMEM : DIT_ERR_INVALID_ARG;
    const char *p = (const char *)nfc;
    size_t i = 0;
    bool in_ws = false;
    while (i < (size_t)n) {
        int32_t c = dit_tok_utf8_next(p, (size_t)n, &i);
        bool ok;
        if (dit_tok_is_ws(c)) {
            ok = in_ws || dit_tok_buf_put(out, " ", 1);
            in_ws = true;
        } else if (c == 0x130) {
            in_ws = false;
            ok = dit_tok_buf_put(out, "i\xCC\x87", 3);
        } else {
            in_ws = false;
            ok = dit_tok_buf_put_cp(out, lower_cp(c));
        }
        if (!ok) {
            free(nfc);
            return DIT_ERR_NOMEM;
        }
    }
    free(nfc);
    return DIT_OK;
}

/* ---- BPE -------------------------------------------------------------------- */

typedef struct sym {
    int32_t id;
    int32_t prev, next;
    bool alive;
} sym;

typedef struct merge_ent {
    uint32_t rank;
    uint32_t pos;
    int32_t new_id;
} merge_ent;

/* One encode call's working memory. */
typedef struct scratch {
    const dit_clip_tokenizer *t;
    sym *syms;
    merge_ent *heap;
    size_t sym_cap, heap_cap;
    dit_tok_buf norm;
    dit_tok_span_list outer, inner;
} scratch;

static bool ent_less(const merge_ent *a, const merge_ent *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(merge_ent *h, size_t *n, merge_ent e)
{
    size_t i = (*n)++;
    h[i] = e;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!ent_less(&h[i], &h[p]))
            break;
        merge_ent tmp = h[p];
        h[p] = h[i];
        h[i] = tmp;
        i = p;
    }
}

static merge_ent heap_pop(merge_ent *h, size_t *n)
{
    merge_ent top = h[0];
    h[0] = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < *n && ent_less(&h[l], &h[m]))
            m = l;
        if (r < *n && ent_less(&h[r], &h[m]))
            m = r;
        if (m == i)
            break;
        merge_ent tmp = h[m];
        h[m] = h[i];
        h[i] = tmp;
        i = m;
    }
    return top;
}

static void push_pair(const dit_clip_tokenizer *t, scratch *sc, size_t *hn, int32_t pos)
{
    const sym *s = &sc->syms[pos];
    if (s->next < 0)
        return;
    const pmap_slot *m = pmap_get(&t->merges, s->id, sc->syms[s->next].id);
    if (m)
        heap_push(sc->heap, hn, (merge_ent){m->rank, (uint32_t)pos, m->new_id});
}

/* One word (raw UTF-8 bytes): symbols are its bytes' printable characters,
 * the last one with "</w>"; merges are applied lowest rank first, leftmost
 * first among equal ranks (tokenizers' Word::merge_all). */
static dit_status bpe_word(const dit_clip_tokenizer *t, scratch *sc, const unsigned char *w,
                           size_t n, dit_tok_ids *out)
{
    if (n == 0)
        return DIT_OK;
    if (n > sc->sym_cap) {
        size_t cap = n * 2;
        sym *s = realloc(sc->syms, cap * sizeof *s);
        if (!s)
            return DIT_ERR_NOMEM;
        sc->syms = s;
        sc->sym_cap = cap;
    }
    if (3 * n > sc->heap_cap) {
        size_t cap = 6 * n;
        merge_ent *h = realloc(sc->heap, cap * sizeof *h);
        if (!h)
            return DIT_ERR_NOMEM;
        sc->heap = h;
        sc->heap_cap = cap;
    }
    int32_t ns = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = i + 1 == n ? t->byte_eow_id[w[i]] : t->byte_id[w[i]];
        if (id < 0) {
            /* Not in the vocabulary: the unk token (never fused for CLIP),
             * or nothing when there is no unk token. */
            if (t->unk_id < 0)
                continue;
            id = t->unk_id;
        }
        sc->syms[ns] = (sym){id, ns - 1, -1, true};
        if (ns > 0)
            sc->syms[ns - 1].next = ns;
        ns++;
    }
    if (ns == 0)
        return DIT_OK;
    size_t hn = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        push_pair(t, sc, &hn, i);
    while (hn > 0) {
        merge_ent top = heap_pop(sc->heap, &hn);
        sym *s = &sc->syms[top.pos];
        if (!s->alive || s->next < 0)
            continue;
        sym *r = &sc->syms[s->next];
        const pmap_slot *m = pmap_get(&t->merges, s->id, r->id);
        if (!m || m->new_id != top.new_id)
            continue; /* stale entry */
        s->id = top.new_id;
        r->alive = false;
        s->next = r->next;
        if (r->next >= 0)
            sc->syms[r->next].prev = (int32_t)top.pos;
        /* Each merge adds at most two entries: the heap never outgrows 3n. */
        if (s->prev >= 0)
            push_pair(t, sc, &hn, s->prev);
        push_pair(t, sc, &hn, (int32_t)top.pos);
    }
    for (int32_t i = 0; i >= 0; i = sc->syms[i].next)
        dit_tok_ids_push(out, sc->syms[i].id);
    return DIT_OK;
}

/* ---- pre-tokenizer ----------------------------------------------------------- */

/* Length of the contraction ('s 't 're 've 'm 'll 'd) at s, or 0. */
static size_t contraction_len(const char *s, size_t len)
{
    static const char *const forms[] = {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d"};
    if (len < 2 || s[0] != '\'')
        return 0;
    for (size_t k = 0; k < sizeof forms / sizeof forms[0]; k++) {
        size_t fl = strlen(forms[k]);
        if (fl <= len && memcmp(s, forms[k], fl) == 0)
            return fl;
    }
    return 0;
}

enum { CLS_WS, CLS_L, CLS_N, CLS_OTHER };

static int cp_class(int32_t c)
{
    if (dit_tok_is_ws(c))
        return CLS_WS;
    if (is_letter(c))
        return CLS_L;
    if (is_number(c))
        return CLS_N;
    return CLS_OTHER;
}

/* End of the run of class `cls` starting at s[i]. */
static size_t run_end(const char *s, size_t len, size_t i, int cls)
{
    while (i < len) {
        size_t k = i;
        if (cp_class(dit_tok_utf8_next(s, len, &k)) != cls)
            break;
        i = k;
    }
    return i;
}

/* ByteLevel's GPT-2 split of one CLIP piece (which holds no whitespace):
 * 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+ ; it only
 * changes anything for "<|startoftext|>"/"<|endoftext|>" pieces, which
 * become "<|", the word, "|>". */
static dit_status gpt2_split(const dit_clip_tokenizer *t, scratch *sc, const char *p, size_t len,
                             dit_tok_ids *out)
{
    size_t q = 0;
    while (q < len && !out->overflow) {
        size_t e = q + contraction_len(p + q, len - q);
        if (e == q) {
            size_t k = q;
            int cls = cp_class(dit_tok_utf8_next(p, len, &k));
            e = run_end(p, len, k, cls);
        }
        dit_status st = bpe_word(t, sc, (const unsigned char *)p + q, e - q, out);
        if (st != DIT_OK)
            return st;
        q = e;
    }
    return DIT_OK;
}

/* CLIP's split (matches kept, whitespace between them dropped):
 * <\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+ */
static dit_status pre_tokenize(const dit_clip_tokenizer *t, scratch *sc, const char *s, size_t len,
                               dit_tok_ids *out)
{
    static const char sot[] = "<|startoftext|>", eot[] = "<|endoftext|>";
    size_t i = 0;
    while (i < len && !out->overflow) {
        size_t k = i;
        int cls = cp_class(dit_tok_utf8_next(s, len, &k));
        if (cls == CLS_WS) {
            i = k;
            continue;
        }
        size_t e;
        if (len - i >= sizeof sot - 1 && memcmp(s + i, sot, sizeof sot - 1) == 0)
            e = i + sizeof sot - 1;
        else if (len - i >= sizeof eot - 1 && memcmp(s + i, eot, sizeof eot - 1) == 0)
            e = i + sizeof eot - 1;
        else if ((e = contraction_len(s + i, len - i)) > 0)
            e += i;
        else if (cls == CLS_N)
            e = k;
        else
            e = run_end(s, len, k, cls);
        dit_status st = gpt2_split(t, sc, s + i, e - i, out);
        if (st != DIT_OK)
            return st;
        i = e;
    }
    return DIT_OK;
}

/* ---- loading ---------------------------------------------------------------- */

/* A special-token value from a config: "text" or {"content": "text", ...}. */
typedef struct tok_spec {
    const char *content; /* NULL: absent */
    bool is_obj;
    dit_tok_flags flags;
} tok_spec;

static dit_status json_flag(const cJSON *obj, const char *key, bool def, bool *out,
                            const char *path, dit_diag *diag)
{
    if (!dit_tok_json_flag(obj, key, def, out))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"%s\" of an added token is not a boolean",
                            path, key);
    return DIT_OK;
}

/* Parses a token value. An object from special_tokens_map.json is always
 * special (transformers forces it); elsewhere "special" defaults to false.
 * AddedToken's "normalized" defaults to !special. */
static dit_status parse_tok_spec(const cJSON *v, bool from_map, const char *path, const char *what,
                                 tok_spec *out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    memset(out, 0, sizeof *out);
    if (!v || cJSON_IsNull(v))
        return DIT_OK;
    if (cJSON_IsString(v)) {
        out->content = v->valuestring;
        return DIT_OK;
    }
    const cJSON *c = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "content") : NULL;
    if (!cJSON_IsString(c))
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: %s is neither a string nor an object with a \"content\" string",
                            path, what);
    out->content = c->valuestring;
    out->is_obj = true;
    if (from_map)
        out->flags.special = true;
    else
        DIT_CHECK(json_flag(v, "special", false, &out->flags.special, path, diag));
    DIT_CHECK(json_flag(v, "lstrip", false, &out->flags.lstrip, path, diag));
    DIT_CHECK(json_flag(v, "rstrip", false, &out->flags.rstrip, path, diag));
    DIT_CHECK(json_flag(v, "single_word", false, &out->flags.single_word, path, diag));
    DIT_CHECK(json_flag(v, "normalized", !out->flags.special, &out->flags.normalized, path, diag));
cleanup:
    return st;
}

static bool tok_spec_equal(const tok_spec *a, const tok_spec *b)
{
    if (a->is_obj != b->is_obj || strcmp(a->content, b->content) != 0)
        return false;
    const dit_tok_flags *x = &a->flags, *y = &b->flags;
    return !a->is_obj ||
           (x->lstrip == y->lstrip && x->rstrip == y->rstrip && x->single_word == y->single_word &&
            x->normalized == y->normalized && x->special == y->special);
}

/* Adds (or, for a content already present, re-flags) an added token, as
 * tokenizers' add_tokens does: the id is the vocabulary's when the content
 * is in it, else `id_hint` (the added_tokens_decoder key). */
static dit_status add_token(dit_clip_tokenizer *t, const tok_spec *s, int64_t id_hint,
                            const char *path, dit_diag *diag)
{
    dit_tok_added *a = NULL;
    dit_status st = dit_tok_added_add(&t->added, &t->vocab, s->content, id_hint, &a);
    if (st == DIT_ERR_NOT_FOUND)
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: special token \"%.64s\" is not in vocab.json and has "
                            "no id in \"added_tokens_decoder\"",
                            path, s->content);
    if (st != DIT_OK)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
    if (s->is_obj) {
        a->flags = s->flags;
    } else {
        /* A plain string becomes AddedToken(content, special=True). */
        a->flags = (dit_tok_flags){.special = true};
    }
    return DIT_OK;
}

static const char *const special_keys[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                           "pad_token", "cls_token", "mask_token"};
enum { K_BOS, K_EOS, K_UNK, K_SEP, K_PAD, K_CLS, K_MASK, K_COUNT };

/* Added tokens listed with their ids: tokenizer_config.json's
 * "added_tokens_decoder" ({"<id>": {...}}) or tokenizer.json's
 * "added_tokens" ([{"id": <id>, ...}]); added by ascending id. */
typedef struct id_item {
    int64_t id;
    const cJSON *tok;
} id_item;

static int cmp_id_item(const void *a, const void *b)
{
    int64_t x = ((const id_item *)a)->id, y = ((const id_item *)b)->id;
    return (x > y) - (x < y);
}

static dit_status add_listed_tokens(dit_clip_tokenizer *t, const cJSON *list, bool is_array,
                                    const char *path, dit_diag *diag)
{
    dit_status st = DIT_OK;
    int n = cJSON_GetArraySize(list), k = 0;
    id_item *items = malloc(sizeof *items * (size_t)(n > 0 ? n : 1));
    if (!items)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
    for (const cJSON *it = list->child; it; it = it->next) {
        int64_t id = -1;
        bool ok = is_array ? dit_tok_json_id(cJSON_GetObjectItemCaseSensitive(it, "id"), &id)
                           : dit_tok_key_id(it->string, &id);
        if (!ok) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: added token \"%.32s\" has no valid id",
                              path, is_array ? "" : it->string);
            goto cleanup;
        }
        items[k++] = (id_item){id, it};
    }
    qsort(items, (size_t)n, sizeof *items, cmp_id_item);
    for (k = 0; k < n; k++) {
        tok_spec s;
        DIT_CHECK(parse_tok_spec(items[k].tok, false, path, "an added token", &s, diag));
        if (!s.is_obj) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: added token %lld is not an object", path,
                              (long long)items[k].id);
            goto cleanup;
        }
        DIT_CHECK(add_token(t, &s, items[k].id, path, diag));
    }
cleanup:
    free(items);
    return st;
}

/* Special and added tokens, resolved the way transformers 5 does:
 * - the special-token names come from tokenizer_config.json (CLIPTokenizer's
 *   defaults when absent); only when the config has no
 *   "added_tokens_decoder" does special_tokens_map.json override them;
 * - added tokens are the "added_tokens_decoder" entries (by ascending id),
 *   or without them those of tokenizer.json's "added_tokens", then every special token whose
 * content is not among them, in the order bos, eos, unk, sep, pad, cls, mask, skipping values equal
 * to one already queued; a later token with the same content re-flags the earlier one. A
 * plain-string special token is matched in the raw text (normalized = false); so a config with
 * pad_token "!" makes "!" a token of its own. */
static dit_status load_specials(dit_clip_tokenizer *t, const cJSON *json_added,
                                const char *json_path, dit_diag *diag)
{
    dit_status st = DIT_OK;
    cJSON *cfg = NULL, *map = NULL;
    char *cfg_path = dit_tok_path_join(t->dir, "tokenizer_config.json");
    char *map_path = dit_tok_path_join(t->dir, "special_tokens_map.json");
    tok_spec spec[K_COUNT], queue[K_COUNT];
    if (!cfg_path || !map_path) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    DIT_CHECK(dit_tok_json_load_optional(cfg_path, &cfg, diag));
    DIT_CHECK(
        dit_tok_config_max_length(cfg, cfg_path, 2, CLIP_DEFAULT_MAX_LENGTH, &t->max_length, diag));

    static const char *const defaults[K_COUNT] = {
        "<|startoftext|>", "<|endoftext|>", "<|endoftext|>", NULL, "<|endoftext|>", NULL, NULL};
    for (int k = 0; k < K_COUNT; k++) {
        const cJSON *v = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, special_keys[k]) : NULL;
        DIT_CHECK(parse_tok_spec(v, false, cfg_path, special_keys[k], &spec[k], diag));
        if (!spec[k].content && defaults[k])
            spec[k].content = defaults[k];
    }

    const cJSON *atd = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, "added_tokens_decoder") : NULL;
    if (atd && !cJSON_IsNull(atd)) {
        if (!cJSON_IsObject(atd)) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"added_tokens_decoder\" is not an object",
                              cfg_path);
            goto cleanup;
        }
        DIT_CHECK(add_listed_tokens(t, atd, false, cfg_path, diag));
    } else {
        DIT_CHECK(dit_tok_json_load_optional(map_path, &map, diag));
        for (int k = 0; map && k < K_COUNT; k++) {
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(map, special_keys[k]);
            tok_spec s;
            DIT_CHECK(parse_tok_spec(v, true, map_path, special_keys[k], &s, diag));
            if (s.content)
                spec[k] = s;
        }
        /* transformers then takes the added tokens from tokenizer.json. */
        if (json_added && !cJSON_IsNull(json_added)) {
            if (!cJSON_IsArray(json_added)) {
                st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"added_tokens\" is not a list",
                                  json_path);
                goto cleanup;
            }
            DIT_CHECK(add_listed_tokens(t, json_added, true, json_path, diag));
        }
    }

    /* Named special tokens not yet added, in attribute order, deduplicated
     * against the queue (tokenizers' AddedToken equality: all fields). */
    int nq = 0;
    for (int k = 0; k < K_COUNT; k++) {
        if (!spec[k].content)
            continue;
        bool skip = dit_tok_added_find(&t->added, spec[k].content) != NULL;
        for (int j = 0; j < nq && !skip; j++)
            skip = tok_spec_equal(&queue[j], &spec[k]);
        if (!skip)
            queue[nq++] = spec[k];
    }
    for (int j = 0; j < nq; j++)
        DIT_CHECK(add_token(t, &queue[j], -1, cfg_path, diag));

    int32_t *dst[K_COUNT] = {&t->bos_id, &t->eos_id, NULL, NULL, &t->pad_id, NULL, NULL};
    for (int k = 0; k < K_COUNT; k++) {
        if (!dst[k])
            continue;
        const dit_tok_added *a = dit_tok_added_find(&t->added, spec[k].content);
        *dst[k] = a ? a->id : -1;
    }
    t->unk_id = -1;
    if (spec[K_UNK].content)
        dit_tok_map_get(&t->vocab, spec[K_UNK].content, strlen(spec[K_UNK].content), &t->unk_id);
cleanup:
    cJSON_Delete(cfg);
    cJSON_Delete(map);
    free(cfg_path);
    free(map_path);
    return st;
}

/* Normalized added tokens are searched for in their normalized form. */
static dit_status prepare_added(dit_clip_tokenizer *t, dit_diag *diag)
{
    dit_tok_buf nb = {0};
    dit_status st = DIT_OK;
    for (int k = 0; k < t->added.n; k++) {
        const dit_tok_added *a = &t->added.v[k];
        const char *src = a->content;
        size_t len = strlen(src), bad;
        if (!dit_tok_utf8_valid(src, len, &bad)) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: added token %d is not valid UTF-8", t->dir,
                              a->id);
            goto cleanup;
        }
        if (a->flags.normalized) {
            st = clip_normalize(src, len, &nb);
            if (st != DIT_OK) {
                st = dit_diag_set(diag, st, "%s: cannot normalize added token %d", t->dir, a->id);
                goto cleanup;
            }
            src = nb.p;
            len = nb.n;
        }
        if (!dit_tok_added_set_match(&t->added, k, src, len)) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
            goto cleanup;
        }
    }
cleanup:
    free(nb.p);
    return st;
}

/* transformers prefers tokenizer.json (what its save_pretrained writes) and
 * otherwise reads vocab.json + merges.txt (the FLUX.1 repositories' layout);
 * either way only the vocabulary, the merges and the added tokens are taken,
 * since CLIPTokenizer rebuilds the rest of the pipeline itself. */
dit_status dit_clip_tokenizer_load(const char *dir, dit_clip_tokenizer **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    char *vocab_path = NULL, *merges_path = NULL, *json_path = NULL;
    cJSON *tj = NULL, *vj = NULL;
    dit_diag sub = {0};
    if (!dir || !out)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "clip tokenizer: NULL argument");
    *out = NULL;
    dit_clip_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    t->added.is_word = is_word_char;
    t->dir = strdup(dir);
    vocab_path = dit_tok_path_join(dir, "vocab.json");
    merges_path = dit_tok_path_join(dir, "merges.txt");
    json_path = dit_tok_path_join(dir, "tokenizer.json");
    if (!t->dir || !vocab_path || !merges_path || !json_path) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    st = dit_json_load_file(json_path, &tj, &sub);
    if (st == DIT_OK) {
        const cJSON *model = cJSON_GetObjectItemCaseSensitive(tj, "model");
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(model, "type");
        if (!cJSON_IsObject(model) ||
            (type && (!cJSON_IsString(type) || strcmp(type->valuestring, "BPE") != 0))) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"model\" is not a BPE model", json_path);
            goto cleanup;
        }
        DIT_CHECK(load_vocab(t, cJSON_GetObjectItemCaseSensitive(model, "vocab"), json_path, diag));
        DIT_CHECK(load_merges_json(t, cJSON_GetObjectItemCaseSensitive(model, "merges"), json_path,
                                   diag));
    } else if (st == DIT_ERR_NOT_FOUND) {
        DIT_CHECK(dit_json_load_file(vocab_path, &vj, diag));
        DIT_CHECK(load_vocab(t, vj, vocab_path, diag));
        DIT_CHECK(load_merges_txt(t, merges_path, diag));
    } else {
        st = dit_diag_set(diag, st, "%s", dit_diag_msg(&sub));
        goto cleanup;
    }

    int32_t map[256];
    bytes_to_unicode(map);
    for (int b = 0; b < 256; b++) {
        char s[16];
        utf8proc_ssize_t n = utf8proc_encode_char(map[b], (utf8proc_uint8_t *)s);
        memcpy(s + n, CLIP_EOW, sizeof CLIP_EOW);
        if (!dit_tok_map_get(&t->vocab, s, (size_t)n, &t->byte_id[b]))
            t->byte_id[b] = -1;
        if (!dit_tok_map_get(&t->vocab, s, (size_t)n + sizeof CLIP_EOW - 1, &t->byte_eow_id[b]))
            t->byte_eow_id[b] = -1;
    }

    DIT_CHECK(load_specials(t, tj ? cJSON_GetObjectItemCaseSensitive(tj, "added_tokens") : NULL,
                            json_path, diag));
    DIT_CHECK(prepare_added(t, diag));
    if (t->bos_id < 0 || t->eos_id < 0 || t->pad_id < 0) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: bos, eos or pad token has no id", dir);
        goto cleanup;
    }
    *out = t;
    t = NULL;
cleanup:
    cJSON_Delete(tj);
    cJSON_Delete(vj);
    free(vocab_path);
    free(merges_path);
    free(json_path);
    dit_clip_tokenizer_free(t);
    return st;
}

void dit_clip_tokenizer_free(dit_clip_tokenizer *t)
{
    if (!t)
        return;
    dit_tok_added_free(&t->added);
    dit_tok_map_free(&t->vocab);
    free(t->merges.slots);
    free(t->dir);
    free(t);
}

int dit_clip_tokenizer_max_length(const dit_clip_tokenizer *t)
{
    return t ? t->max_length : CLIP_DEFAULT_MAX_LENGTH;
}

int32_t dit_clip_tokenizer_bos_id(const dit_clip_tokenizer *t)
{
    return t->bos_id;
}

int32_t dit_clip_tokenizer_eos_id(const dit_clip_tokenizer *t)
{
    return t->eos_id;
}

int32_t dit_clip_tokenizer_pad_id(const dit_clip_tokenizer *t)
{
    return t->pad_id;
}

/* ---- encoding ---------------------------------------------------------------- */

/* The pipeline's normalizer and model (dit_tok_encode_text); ctx is the
 * scratch. */
static dit_status normalize_piece(void *ctx, const char *s, size_t len, const char **out,
                                  size_t *out_len)
{
    scratch *sc = ctx;
    dit_status st = clip_normalize(s, len, &sc->norm);
    *out = sc->norm.p ? sc->norm.p : "";
    *out_len = sc->norm.n;
    return st;
}

static dit_status tokenize_piece(void *ctx, const char *s, size_t len, bool first, dit_tok_ids *out)
{
    (void)first; /* CLIP's pre-tokenizer does not look at the position */
    scratch *sc = ctx;
    return pre_tokenize(sc->t, sc, s, len, out);
}

dit_status dit_clip_tokenizer_encode(const dit_clip_tokenizer *t, const char *utf8, int32_t *ids,
                                     int max_length, int *n_tokens, bool *truncated, dit_diag *diag)
{
    if (!t || !utf8 || !ids)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "clip tokenizer: NULL argument");
    if (max_length < 2)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "clip tokenizer: max_length %d leaves no room for BOS and EOS",
                            max_length);
    size_t len = strlen(utf8), bad = 0;
    if (!dit_tok_utf8_valid(utf8, len, &bad))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "clip tokenizer: prompt is not valid UTF-8 (byte %zu of %zu)", bad,
                            len);
    scratch sc = {.t = t};
    dit_tok_ids out = {ids + 1, 0, max_length - 2, false};
    dit_status st = dit_tok_encode_text(&t->added, utf8, len, normalize_piece, tokenize_piece, &sc,
                                        &sc.outer, &sc.inner, &out);
    free(sc.syms);
    free(sc.heap);
    free(sc.norm.p);
    free(sc.outer.v);
    free(sc.inner.v);
    if (st != DIT_OK)
        return dit_diag_set(diag, st, "clip tokenizer (%s): %s while encoding", t->dir,
                            st == DIT_ERR_NOMEM ? "out of memory" : dit_status_str(st));
    int n = dit_tok_ids_finish(ids, max_length, &t->bos_id, 1, out.n, &t->eos_id, 1, t->pad_id);
    if (n_tokens)
        *n_tokens = n;
    if (truncated)
        *truncated = out.overflow;
    return DIT_OK;
}
