/* T5 SentencePiece unigram, reproducing transformers' T5TokenizerFast.
 *
 * Reference: the `tokenizers` library (0.23) that the installed transformers
 * (5.x) runs. T5TokenizerFast rebuilds its pipeline from tokenizer.json's
 * vocabulary and precompiled charsmap as Precompiled + [WhitespaceSplit,
 * Metaspace("▁", prepend_scheme="always", split=true)] + Unigram + "$A </s>",
 * which is exactly what its save_pretrained writes (older transformers wrote
 * the same pipeline with the legacy Metaspace(add_prefix_space=true)
 * spelling). This file runs whatever supported pipeline tokenizer.json
 * holds, so for a file whose pipeline differs (e.g. transformers 4.4x's
 * Strip + Replace(" {2,}") without WhitespaceSplit) it gives what the
 * `tokenizers` library (and transformers 4.x) gives, not transformers 5's
 * rebuilt pipeline. The special ids (EOS) come from the file's
 * TemplateProcessing, the unknown id from its Unigram "unk_id" (transformers
 * 5 hard-codes 2, which is T5's).
 *
 * The steps, as tokenizers performs them:
 * 1. Added tokens (tokenizer_config.json "added_tokens_decoder", else
 *    tokenizer.json "added_tokens") are cut out of the raw text:
 *    leftmost-longest matches of the non-normalized ones; the normalized
 *    ones are then searched for in each normalized piece.
 * 2. Normalizer. Precompiled is SentencePiece's rule set compiled into a
 *    Darts double-array trie over UTF-8 bytes plus a blob of NUL-terminated
 *    replacement strings. tokenizers walks the text by extended grapheme
 *    cluster: a cluster shorter than 6 bytes is looked up whole, and if any
 *    prefix of it is a key, the SHORTEST such key's replacement stands for
 *    the whole cluster (so "Ａ" + U+0301 becomes "A": the accent is lost,
 *    unlike SentencePiece's own longest-match normalizer); otherwise each
 *    code point is looked up on its own. Nothing else of SentencePiece's
 *    normalizer (whitespace trimming and collapsing) happens here: the
 *    pre-tokenizer does the whitespace work.
 * 3. Pre-tokenizer: WhitespaceSplit drops Unicode White_Space and splits
 *    there; Metaspace replaces " " by "▁", prepends "▁" to a piece that does
 *    not start with it (always; first: only to the piece that starts the
 *    text: approximated as "starts at byte 0 of the text", which differs
 *    only when the normalizer deletes leading characters), and splits
 *    before every "▁".
 * 4. Unigram Viterbi (tokenizers' encode_optimized): the best-scoring
 *    segmentation into vocabulary pieces, scores summed in double; a
 *    position no one-character piece covers gets an <unk> node scored
 *    min_score - 10; ties keep the first candidate found. Consecutive <unk>
 *    nodes are fused into one token (looked up again: a fused string that is
 *    itself a piece gets that piece's id).
 * 5. TemplateProcessing, truncation (text tokens first), padding.
 *
 * Grapheme clusters come from utf8proc, tokenizers uses unicode-segmentation;
 * they differ only in rare clusters of newer Unicode versions (e.g. the
 * Unicode 15.1 Indic conjunct rule), where the cluster is 6 bytes or more
 * and so is looked up per code point either way. */
#include "encoders/t5_tokenizer.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <utf8proc.h>

#include "encoders/tokenizer_base.h"
#include "loader/json_util.h"

#define T5_DEFAULT_MAX_LENGTH 512
/* tokenizers' K_UNK_PENALTY. */
#define T5_UNK_PENALTY 10.0
/* Graphemes shorter than this many bytes are looked up whole. */
#define T5_GRAPHEME_WHOLE 6
#define T5_MAX_STEPS 16

/* ---- Unicode ---------------------------------------------------------------------- */

/* Rust's regex \w (used only for single_word added tokens), approximated
 * by letters, marks, decimal digits, letter numbers, connector punctuation
 * and ZWNJ/ZWJ. */
static bool is_word_char(int32_t c)
{
    if (c == 0x200C || c == 0x200D)
        return true;
    utf8proc_category_t cat = utf8proc_category(c);
    return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_ND) ||
           cat == UTF8PROC_CATEGORY_NL || cat == UTF8PROC_CATEGORY_PC;
}

/* ---- pipeline components ------------------------------------------------------------ */

typedef enum norm_kind { N_PRECOMPILED, N_REPLACE, N_STRIP } norm_kind;

/* Replace patterns: a literal string, or a regex made of one atom (a literal
 * character or \s) and a quantifier (+, {n}, {n,}, {n,m}) such as " {2,}". */
typedef struct norm_step {
    norm_kind kind;
    /* Precompiled */
    uint32_t *trie;
    size_t n_units;
    char *blob;
    size_t blob_len;
    /* Replace */
    char *literal; /* NULL for a regex */
    size_t literal_len;
    int32_t atom; /* -1: \s */
    size_t min_rep, max_rep;
    char *content;
    size_t content_len;
    /* Strip */
    bool left, right;
} norm_step;

typedef enum pre_kind { P_WHITESPACE_SPLIT, P_METASPACE } pre_kind;
typedef enum prepend_scheme { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER } prepend_scheme;

typedef struct pre_step {
    pre_kind kind;
    char repl[5]; /* Metaspace replacement, UTF-8 */
    size_t repl_len;
    prepend_scheme prepend;
    bool split;
} pre_step;

struct dit_t5_tokenizer {
    char *dir;
    char *json_path;
    norm_step norm[T5_MAX_STEPS];
    int n_norm;
    pre_step pre[T5_MAX_STEPS];
    int n_pre;
    dit_tok_map vocab;
    double *scores; /* by id */
    int32_t n_pieces;
    size_t max_piece_len;
    double min_score;
    int32_t unk_id;
    dit_tok_added_set added;
    int32_t *prefix_ids, *suffix_ids; /* template specials around $A */
    int n_prefix, n_suffix;
    int32_t pad_id;
    int max_length;
};

/* ---- loading: normalizer ------------------------------------------------------------- */

static int b64_val(unsigned char c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == '+')
        return 62;
    if (c == '/')
        return 63;
    return -1;
}

/* Standard base64 with optional '=' padding; anything else is an error. */
static bool b64_decode(const char *s, unsigned char **out, size_t *out_len)
{
    size_t n = strlen(s);
    while (n > 0 && s[n - 1] == '=')
        n--;
    if (n % 4 == 1)
        return false;
    unsigned char *o = malloc(n / 4 * 3 + 3);
    if (!o)
        return false;
    size_t k = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        int v = b64_val((unsigned char)s[i]);
        if (v < 0) {
            free(o);
            return false;
        }
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            o[k++] = (unsigned char)(acc >> bits);
        }
    }
    *out = o;
    *out_len = k;
    return true;
}

static uint32_t rd_u32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* precompiled_charsmap: u32 LE byte size of the trie, the trie's u32 units,
 * then the replacement blob (valid UTF-8, NUL-terminated entries). */
static dit_status parse_precompiled(const char *path, const cJSON *j, norm_step *ns, dit_diag *diag)
{
    const cJSON *cm = cJSON_GetObjectItemCaseSensitive(j, "precompiled_charsmap");
    if (!cJSON_IsString(cm))
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: Precompiled normalizer without a \"precompiled_charsmap\" string",
                            path);
    unsigned char *raw = NULL;
    size_t n = 0;
    if (!b64_decode(cm->valuestring, &raw, &n))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: precompiled_charsmap is not valid base64",
                            path);
    dit_status st = DIT_OK;
    if (n < 4) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: precompiled_charsmap is too short", path);
        goto cleanup;
    }
    uint32_t trie_bytes = rd_u32(raw);
    size_t units = trie_bytes / 4;
    if (units == 0 || units > (n - 4) / 4) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "%s: precompiled_charsmap trie size %u does not fit its %zu bytes", path,
                          trie_bytes, n);
        goto cleanup;
    }
    ns->trie = malloc(units * sizeof *ns->trie);
    size_t blob_off = 4 + units * 4;
    ns->blob_len = n - blob_off;
    ns->blob = malloc(ns->blob_len + 1);
    if (!ns->trie || !ns->blob) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        goto cleanup;
    }
    for (size_t i = 0; i < units; i++)
        ns->trie[i] = rd_u32(raw + 4 + 4 * i);
    ns->n_units = units;
    memcpy(ns->blob, raw + blob_off, ns->blob_len);
    ns->blob[ns->blob_len] = '\0';
    /* tokenizers refuses a blob that is not UTF-8; NULs are entry ends. */
    for (size_t i = 0; i < ns->blob_len;) {
        if (ns->blob[i] == '\0') {
            i++;
            continue;
        }
        size_t e = i;
        while (e < ns->blob_len && ns->blob[e])
            e++;
        size_t bad;
        if (!dit_tok_utf8_valid(ns->blob + i, e - i, &bad)) {
            st = dit_diag_set(diag, DIT_ERR_FORMAT,
                              "%s: precompiled_charsmap strings are not valid UTF-8", path);
            goto cleanup;
        }
        i = e;
    }
cleanup:
    free(raw);
    return st;
}

/* Parses a Replace pattern regex of the supported form. */
static bool parse_mini_regex(const char *re, norm_step *ns)
{
    size_t i = 0, len = strlen(re);
    if (len == 0)
        return false;
    if (re[0] == '\\') {
        if (len < 2)
            return false;
        if (re[1] == 's') {
            ns->atom = -1;
        } else if (strchr("\\.+*?()[]{}|^$ -", re[1])) {
            ns->atom = (unsigned char)re[1];
        } else {
            return false;
        }
        i = 2;
    } else {
        if (strchr(".+*?()[]{}|^$", re[0]))
            return false;
        size_t k = 0;
        ns->atom = dit_tok_utf8_next(re, len, &k);
        i = k;
    }
    if (i == len) {
        ns->min_rep = ns->max_rep = 1;
        return true;
    }
    if (re[i] == '+' && i + 1 == len) {
        ns->min_rep = 1;
        ns->max_rep = SIZE_MAX;
        return true;
    }
    if (re[i] != '{')
        return false;
    char *end = NULL;
    errno = 0;
    unsigned long lo = strtoul(re + i + 1, &end, 10);
    if (errno || end == re + i + 1 || lo == 0 || lo > 1000000)
        return false;
    unsigned long hi = lo;
    if (*end == ',') {
        if (end[1] == '}') {
            hi = ULONG_MAX;
            end++;
        } else {
            char *e2 = NULL;
            hi = strtoul(end + 1, &e2, 10);
            if (errno || e2 == end + 1 || hi < lo)
                return false;
            end = e2;
        }
    }
    if (*end != '}' || end[1] != '\0')
        return false;
    ns->min_rep = lo;
    ns->max_rep = hi == ULONG_MAX ? SIZE_MAX : hi;
    return true;
}

static dit_status parse_normalizer(dit_t5_tokenizer *t, const cJSON *j, int depth, dit_diag *diag)
{
    const char *path = t->json_path;
    if (!j || cJSON_IsNull(j))
        return DIT_OK;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(j, "type");
    if (!cJSON_IsObject(j) || !cJSON_IsString(type))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: normalizer without a \"type\"", path);
    const char *ty = type->valuestring;
    if (strcmp(ty, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(j, "normalizers");
        if (!cJSON_IsArray(list) || depth > 4)
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: Sequence normalizer without a \"normalizers\" list", path);
        for (const cJSON *it = list->child; it; it = it->next) {
            dit_status st = parse_normalizer(t, it, depth + 1, diag);
            if (st != DIT_OK)
                return st;
        }
        return DIT_OK;
    }
    if (t->n_norm == T5_MAX_STEPS)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "%s: more than %d normalizers", path,
                            T5_MAX_STEPS);
    norm_step *ns = &t->norm[t->n_norm];
    memset(ns, 0, sizeof *ns);
    if (strcmp(ty, "Precompiled") == 0) {
        ns->kind = N_PRECOMPILED;
        t->n_norm++;
        return parse_precompiled(path, j, ns, diag);
    }
    if (strcmp(ty, "Strip") == 0) {
        const cJSON *l = cJSON_GetObjectItemCaseSensitive(j, "strip_left");
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(j, "strip_right");
        if ((l && !cJSON_IsBool(l)) || (r && !cJSON_IsBool(r)))
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: Strip flags must be booleans", path);
        ns->kind = N_STRIP;
        ns->left = cJSON_IsTrue(l);
        ns->right = cJSON_IsTrue(r);
        t->n_norm++;
        return DIT_OK;
    }
    if (strcmp(ty, "Replace") == 0) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(j, "pattern");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(j, "content");
        const cJSON *lit = cJSON_GetObjectItemCaseSensitive(pat, "String");
        const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
        if (!cJSON_IsString(content) || (!cJSON_IsString(lit) && !cJSON_IsString(re)))
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: Replace normalizer needs a \"pattern\" (String or Regex) and "
                                "a \"content\" string",
                                path);
        size_t bad;
        const char *ps = cJSON_IsString(lit) ? lit->valuestring : re->valuestring;
        if (!dit_tok_utf8_valid(content->valuestring, strlen(content->valuestring), &bad) ||
            !dit_tok_utf8_valid(ps, strlen(ps), &bad))
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: Replace strings are not valid UTF-8",
                                path);
        ns->kind = N_REPLACE;
        t->n_norm++;
        ns->content = strdup(content->valuestring);
        ns->content_len = strlen(content->valuestring);
        if (!ns->content)
            return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        if (cJSON_IsString(lit)) {
            if (!lit->valuestring[0])
                return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: Replace with an empty pattern",
                                    path);
            ns->literal = strdup(lit->valuestring);
            ns->literal_len = strlen(lit->valuestring);
            if (!ns->literal)
                return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
            return DIT_OK;
        }
        if (!parse_mini_regex(re->valuestring, ns))
            return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                                "%s: Replace regex \"%.64s\" is not supported (only one "
                                "character or \\s with +, {n}, {n,} or {n,m})",
                                path, re->valuestring);
        return DIT_OK;
    }
    return dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "%s: normalizer type \"%.64s\" is not supported",
                        path, ty);
}

static dit_status parse_pre_tokenizer(dit_t5_tokenizer *t, const cJSON *j, int depth,
                                      dit_diag *diag)
{
    const char *path = t->json_path;
    if (!j || cJSON_IsNull(j))
        return DIT_OK;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(j, "type");
    if (!cJSON_IsObject(j) || !cJSON_IsString(type))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: pre_tokenizer without a \"type\"", path);
    const char *ty = type->valuestring;
    if (strcmp(ty, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(j, "pretokenizers");
        if (!cJSON_IsArray(list) || depth > 4)
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: Sequence pre_tokenizer without a \"pretokenizers\" list",
                                path);
        for (const cJSON *it = list->child; it; it = it->next) {
            dit_status st = parse_pre_tokenizer(t, it, depth + 1, diag);
            if (st != DIT_OK)
                return st;
        }
        return DIT_OK;
    }
    if (t->n_pre == T5_MAX_STEPS)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "%s: more than %d pre-tokenizers", path,
                            T5_MAX_STEPS);
    pre_step *ps = &t->pre[t->n_pre];
    memset(ps, 0, sizeof *ps);
    if (strcmp(ty, "WhitespaceSplit") == 0) {
        ps->kind = P_WHITESPACE_SPLIT;
        t->n_pre++;
        return DIT_OK;
    }
    if (strcmp(ty, "Metaspace") == 0) {
        const cJSON *rep = cJSON_GetObjectItemCaseSensitive(j, "replacement");
        size_t k = 0;
        size_t bad;
        if (!cJSON_IsString(rep) || !rep->valuestring[0] ||
            !dit_tok_utf8_valid(rep->valuestring, strlen(rep->valuestring), &bad) ||
            (dit_tok_utf8_next(rep->valuestring, strlen(rep->valuestring), &k),
             k != strlen(rep->valuestring)))
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: Metaspace \"replacement\" must be one character", path);
        ps->kind = P_METASPACE;
        memcpy(ps->repl, rep->valuestring, k);
        ps->repl_len = k;
        /* tokenizers: prepend_scheme defaults to always; the legacy
         * add_prefix_space=false means never (and must not contradict an
         * explicit scheme); split defaults to true. */
        ps->prepend = PREPEND_ALWAYS;
        const cJSON *sch = cJSON_GetObjectItemCaseSensitive(j, "prepend_scheme");
        if (sch && !cJSON_IsNull(sch)) {
            const char *v = cJSON_IsString(sch) ? sch->valuestring : "";
            if (strcmp(v, "always") == 0)
                ps->prepend = PREPEND_ALWAYS;
            else if (strcmp(v, "first") == 0)
                ps->prepend = PREPEND_FIRST;
            else if (strcmp(v, "never") == 0)
                ps->prepend = PREPEND_NEVER;
            else
                return dit_diag_set(diag, DIT_ERR_FORMAT,
                                    "%s: Metaspace \"prepend_scheme\" must be always, first or "
                                    "never",
                                    path);
        }
        const cJSON *aps = cJSON_GetObjectItemCaseSensitive(j, "add_prefix_space");
        if (aps && cJSON_IsFalse(aps)) {
            if (ps->prepend != PREPEND_NEVER && sch && !cJSON_IsNull(sch))
                return dit_diag_set(diag, DIT_ERR_FORMAT,
                                    "%s: Metaspace add_prefix_space does not match "
                                    "prepend_scheme",
                                    path);
            ps->prepend = PREPEND_NEVER;
        }
        const cJSON *split = cJSON_GetObjectItemCaseSensitive(j, "split");
        ps->split = !split || cJSON_IsNull(split) || cJSON_IsTrue(split);
        t->n_pre++;
        return DIT_OK;
    }
    return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                        "%s: pre_tokenizer type \"%.64s\" is not supported", path, ty);
}

/* ---- loading: model, added tokens, template ---------------------------------------------- */

static dit_status parse_model(dit_t5_tokenizer *t, const cJSON *m, dit_diag *diag)
{
    const char *path = t->json_path;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(m, "type");
    if (!cJSON_IsObject(m))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: missing \"model\" object", path);
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "Unigram") != 0)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "%s: model type \"%.64s\" is not Unigram",
                            path, cJSON_IsString(type) ? type->valuestring : "(none)");
    const cJSON *bf = cJSON_GetObjectItemCaseSensitive(m, "byte_fallback");
    if (cJSON_IsTrue(bf))
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "%s: Unigram with byte_fallback is not supported", path);
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(m, "vocab");
    int n = cJSON_IsArray(vocab) ? cJSON_GetArraySize(vocab) : 0;
    if (n <= 0)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: Unigram \"vocab\" is missing or empty",
                            path);
    size_t bytes = 0;
    int k = 0;
    for (const cJSON *it = vocab->child; it; it = it->next, k++) {
        const cJSON *p = cJSON_GetArrayItem(it, 0), *s = cJSON_GetArrayItem(it, 1);
        if (!cJSON_IsArray(it) || cJSON_GetArraySize(it) != 2 || !cJSON_IsString(p) ||
            !cJSON_IsNumber(s) || !isfinite(s->valuedouble))
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: Unigram vocab entry %d is not [piece, score]", path, k);
        size_t len = strlen(p->valuestring), bad;
        if (!dit_tok_utf8_valid(p->valuestring, len, &bad))
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: Unigram vocab entry %d is not valid UTF-8", path, k);
        bytes += len + 1;
    }
    t->scores = malloc(sizeof *t->scores * (size_t)n);
    if (!t->scores || !dit_tok_map_init(&t->vocab, (size_t)n, bytes))
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
    t->min_score = INFINITY;
    k = 0;
    for (const cJSON *it = vocab->child; it; it = it->next, k++) {
        const char *ps = cJSON_GetArrayItem(it, 0)->valuestring;
        double sc = cJSON_GetArrayItem(it, 1)->valuedouble;
        size_t len = strlen(ps);
        dit_tok_map_put(&t->vocab, ps, len, k);
        t->scores[k] = sc;
        if (sc < t->min_score)
            t->min_score = sc;
        if (len > t->max_piece_len)
            t->max_piece_len = len;
    }
    t->n_pieces = n;
    int64_t unk;
    if (!dit_tok_json_id(cJSON_GetObjectItemCaseSensitive(m, "unk_id"), &unk) || unk >= n)
        return dit_diag_set(diag, DIT_ERR_FORMAT,
                            "%s: Unigram \"unk_id\" must be an id of the vocabulary", path);
    t->unk_id = (int32_t)unk;
    return DIT_OK;
}

static dit_status json_flag(const cJSON *obj, const char *key, bool def, bool *out,
                            const char *path, dit_diag *diag)
{
    if (!dit_tok_json_flag(obj, key, def, out))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: added token flag \"%s\" is not a boolean",
                            path, key);
    return DIT_OK;
}

/* One added token from {"content": ..., flags...}; AddedToken's defaults:
 * special false, normalized = !special. A content seen before re-flags the
 * earlier token, as tokenizers' add_tokens does. */
static dit_status add_token(dit_t5_tokenizer *t, const cJSON *obj, int64_t id, const char *path,
                            dit_diag *diag)
{
    dit_status st = DIT_OK;
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(obj, "content");
    if (!cJSON_IsObject(obj) || !cJSON_IsString(c) || !c->valuestring[0])
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: added token %lld has no \"content\"", path,
                            (long long)id);
    size_t len = strlen(c->valuestring), bad;
    if (!dit_tok_utf8_valid(c->valuestring, len, &bad))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: added token %lld is not valid UTF-8", path,
                            (long long)id);
    dit_tok_flags f = {0};
    DIT_CHECK(json_flag(obj, "special", false, &f.special, path, diag));
    DIT_CHECK(json_flag(obj, "lstrip", false, &f.lstrip, path, diag));
    DIT_CHECK(json_flag(obj, "rstrip", false, &f.rstrip, path, diag));
    DIT_CHECK(json_flag(obj, "single_word", false, &f.single_word, path, diag));
    DIT_CHECK(json_flag(obj, "normalized", !f.special, &f.normalized, path, diag));
    dit_tok_added *a = NULL;
    st = dit_tok_added_add(&t->added, &t->vocab, c->valuestring, id, &a);
    if (st == DIT_ERR_NOT_FOUND)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: added token \"%.64s\" has no id", path,
                            c->valuestring);
    if (st != DIT_OK)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
    a->flags = f;
cleanup:
    return st;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* transformers takes the added tokens from tokenizer_config.json's
 * "added_tokens_decoder" when it has one (ascending ids), else from
 * tokenizer.json's "added_tokens". */
static dit_status load_added(dit_t5_tokenizer *t, const cJSON *tok_json, const cJSON *cfg,
                             const char *cfg_path, dit_diag *diag)
{
    dit_status st = DIT_OK;
    int64_t *ids = NULL;
    const cJSON *atd = cfg ? cJSON_GetObjectItemCaseSensitive(cfg, "added_tokens_decoder") : NULL;
    if (atd && !cJSON_IsNull(atd)) {
        if (!cJSON_IsObject(atd))
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: \"added_tokens_decoder\" is not an object", cfg_path);
        int n = cJSON_GetArraySize(atd), k = 0;
        ids = malloc(sizeof *ids * (size_t)(n > 0 ? n : 1));
        if (!ids)
            return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        for (const cJSON *it = atd->child; it; it = it->next) {
            int64_t id;
            if (!dit_tok_key_id(it->string, &id)) {
                st = dit_diag_set(diag, DIT_ERR_FORMAT,
                                  "%s: \"added_tokens_decoder\" key \"%.32s\" is not a token id",
                                  cfg_path, it->string);
                goto cleanup;
            }
            ids[k++] = id;
        }
        qsort(ids, (size_t)n, sizeof *ids, cmp_i64);
        for (k = 0; k < n; k++) {
            char key[32];
            snprintf(key, sizeof key, "%lld", (long long)ids[k]);
            DIT_CHECK(
                add_token(t, cJSON_GetObjectItemCaseSensitive(atd, key), ids[k], cfg_path, diag));
        }
    } else {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(tok_json, "added_tokens");
        if (list && !cJSON_IsNull(list) && !cJSON_IsArray(list))
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: \"added_tokens\" is not a list",
                                t->json_path);
        for (const cJSON *it = list ? list->child : NULL; it; it = it->next) {
            int64_t id;
            if (!dit_tok_json_id(cJSON_GetObjectItemCaseSensitive(it, "id"), &id)) {
                st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: an added token has no valid \"id\"",
                                  t->json_path);
                goto cleanup;
            }
            DIT_CHECK(add_token(t, it, id, t->json_path, diag));
        }
    }
cleanup:
    free(ids);
    return st;
}

static bool token_id(const dit_t5_tokenizer *t, const char *s, int32_t *id)
{
    const dit_tok_added *a = dit_tok_added_find(&t->added, s);
    if (a) {
        *id = a->id;
        return true;
    }
    return dit_tok_map_get(&t->vocab, s, strlen(s), id);
}

static dit_status push_ids(int32_t **v, int *n, const cJSON *ids, const char *path, dit_diag *diag)
{
    for (const cJSON *it = ids->child; it; it = it->next) {
        int64_t id;
        if (!dit_tok_json_id(it, &id))
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: TemplateProcessing special token ids must be integers", path);
        int32_t *nv = realloc(*v, sizeof **v * (size_t)(*n + 1));
        if (!nv)
            return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        *v = nv;
        (*v)[(*n)++] = (int32_t)id;
    }
    return DIT_OK;
}

/* TemplateProcessing's "single" template: special tokens around one $A.
 * Without a post_processor, transformers' T5 class appends eos_token. */
static dit_status parse_post(dit_t5_tokenizer *t, const cJSON *pp, const char *eos, dit_diag *diag)
{
    const char *path = t->json_path;
    if (!pp || cJSON_IsNull(pp)) {
        int32_t id;
        if (!token_id(t, eos, &id))
            return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: eos token \"%.64s\" has no id", path,
                                eos);
        t->suffix_ids = malloc(sizeof *t->suffix_ids);
        if (!t->suffix_ids)
            return dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", path);
        t->suffix_ids[0] = id;
        t->n_suffix = 1;
        return DIT_OK;
    }
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(pp, "type");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "TemplateProcessing") != 0)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "%s: post_processor type \"%.64s\" is not supported", path,
                            cJSON_IsString(type) ? type->valuestring : "(none)");
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(pp, "single");
    const cJSON *specials = cJSON_GetObjectItemCaseSensitive(pp, "special_tokens");
    if (!cJSON_IsArray(single) || (specials && !cJSON_IsObject(specials)))
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: TemplateProcessing needs a \"single\" list",
                            path);
    int seen_a = 0;
    for (const cJSON *it = single->child; it; it = it->next) {
        const cJSON *seq = cJSON_GetObjectItemCaseSensitive(it, "Sequence");
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(it, "SpecialToken");
        if (seq) {
            const cJSON *id = cJSON_GetObjectItemCaseSensitive(seq, "id");
            if (!cJSON_IsString(id) || strcmp(id->valuestring, "A") != 0 || seen_a)
                return dit_diag_set(diag, DIT_ERR_FORMAT,
                                    "%s: the \"single\" template must hold $A once", path);
            seen_a = 1;
            continue;
        }
        const cJSON *name = sp ? cJSON_GetObjectItemCaseSensitive(sp, "id") : NULL;
        const cJSON *entry = cJSON_IsString(name) && specials
                                 ? cJSON_GetObjectItemCaseSensitive(specials, name->valuestring)
                                 : NULL;
        const cJSON *ids = entry ? cJSON_GetObjectItemCaseSensitive(entry, "ids") : NULL;
        if (!cJSON_IsArray(ids))
            return dit_diag_set(diag, DIT_ERR_FORMAT,
                                "%s: template special token without ids in \"special_tokens\"",
                                path);
        dit_status st = seen_a ? push_ids(&t->suffix_ids, &t->n_suffix, ids, path, diag)
                               : push_ids(&t->prefix_ids, &t->n_prefix, ids, path, diag);
        if (st != DIT_OK)
            return st;
    }
    if (!seen_a)
        return dit_diag_set(diag, DIT_ERR_FORMAT, "%s: the \"single\" template has no $A", path);
    return DIT_OK;
}

static const char *token_content(const cJSON *v)
{
    if (cJSON_IsString(v))
        return v->valuestring;
    const cJSON *c = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "content") : NULL;
    return cJSON_IsString(c) ? c->valuestring : NULL;
}

static dit_status normalize(const dit_t5_tokenizer *t, const char *s, size_t len, dit_tok_buf *a,
                            dit_tok_buf *b, dit_tok_buf **res);

/* tokenizers matches a normalized added token by its normalized content. */
static dit_status prepare_added(dit_t5_tokenizer *t, dit_diag *diag)
{
    dit_tok_buf a = {0}, b = {0};
    dit_status st = DIT_OK;
    for (int k = 0; k < t->added.n && st == DIT_OK; k++) {
        const dit_tok_added *ad = &t->added.v[k];
        const char *src = ad->content;
        size_t len = strlen(src);
        dit_tok_buf *res = NULL;
        if (ad->flags.normalized) {
            st = normalize(t, src, len, &a, &b, &res);
            if (st != DIT_OK) {
                st = dit_diag_set(diag, st, "%s: cannot normalize added token \"%.64s\"",
                                  t->json_path, ad->content);
                break;
            }
            src = res->p;
            len = res->n;
        }
        if (!dit_tok_added_set_match(&t->added, k, src, len)) {
            st = dit_diag_set(diag, DIT_ERR_NOMEM, "%s: out of memory", t->json_path);
            break;
        }
    }
    free(a.p);
    free(b.p);
    return st;
}

dit_status dit_t5_tokenizer_load(const char *dir, dit_t5_tokenizer **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    cJSON *tj = NULL, *cfg = NULL;
    char *cfg_path = NULL;
    if (!dir || !out)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "t5 tokenizer: NULL argument");
    *out = NULL;
    dit_t5_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    t->added.is_word = is_word_char;
    t->dir = strdup(dir);
    t->json_path = dit_tok_path_join(dir, "tokenizer.json");
    cfg_path = dit_tok_path_join(dir, "tokenizer_config.json");
    if (!t->dir || !t->json_path || !cfg_path) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    DIT_CHECK(dit_json_load_file(t->json_path, &tj, diag));
    DIT_CHECK(dit_tok_json_load_optional(cfg_path, &cfg, diag));

    DIT_CHECK(parse_model(t, cJSON_GetObjectItemCaseSensitive(tj, "model"), diag));
    DIT_CHECK(parse_normalizer(t, cJSON_GetObjectItemCaseSensitive(tj, "normalizer"), 0, diag));
    DIT_CHECK(
        parse_pre_tokenizer(t, cJSON_GetObjectItemCaseSensitive(tj, "pre_tokenizer"), 0, diag));
    DIT_CHECK(load_added(t, tj, cfg, cfg_path, diag));
    DIT_CHECK(prepare_added(t, diag));

    /* T5Tokenizer's defaults for what the config does not name. */
    const char *pad =
        cfg ? token_content(cJSON_GetObjectItemCaseSensitive(cfg, "pad_token")) : NULL;
    const char *eos =
        cfg ? token_content(cJSON_GetObjectItemCaseSensitive(cfg, "eos_token")) : NULL;
    if (!pad)
        pad = "<pad>";
    if (!eos)
        eos = "</s>";
    if (!token_id(t, pad, &t->pad_id)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "%s: pad token \"%.64s\" is not in the vocabulary",
                          cfg_path, pad);
        goto cleanup;
    }
    DIT_CHECK(parse_post(t, cJSON_GetObjectItemCaseSensitive(tj, "post_processor"), eos, diag));

    DIT_CHECK(
        dit_tok_config_max_length(cfg, cfg_path, 1, T5_DEFAULT_MAX_LENGTH, &t->max_length, diag));
    *out = t;
    t = NULL;
cleanup:
    cJSON_Delete(tj);
    cJSON_Delete(cfg);
    free(cfg_path);
    dit_t5_tokenizer_free(t);
    return st;
}

void dit_t5_tokenizer_free(dit_t5_tokenizer *t)
{
    if (!t)
        return;
    for (int i = 0; i < t->n_norm; i++) {
        free(t->norm[i].trie);
        free(t->norm[i].blob);
        free(t->norm[i].literal);
        free(t->norm[i].content);
    }
    dit_tok_added_free(&t->added);
    dit_tok_map_free(&t->vocab);
    free(t->scores);
    free(t->prefix_ids);
    free(t->suffix_ids);
    free(t->json_path);
    free(t->dir);
    free(t);
}

int dit_t5_tokenizer_max_length(const dit_t5_tokenizer *t)
{
    return t ? t->max_length : T5_DEFAULT_MAX_LENGTH;
}

int32_t dit_t5_tokenizer_pad_id(const dit_t5_tokenizer *t)
{
    return t->pad_id;
}

/* ---- normalizers --------------------------------------------------------------------- */

/* The replacement for the shortest key that is a prefix of s[0..len), as
 * spm_precompiled's transform() returns it. DIT_ERR_FORMAT when the trie
 * points outside itself or its blob. */
static dit_status charsmap_lookup(const norm_step *ns, const unsigned char *s, size_t len,
                                  const char **rep, size_t *rep_len)
{
    *rep = NULL;
    const uint32_t *a = ns->trie;
    size_t pos = 0;
#define UNIT_OFFSET(u) (((size_t)(u) >> 10) << (((u) & (1u << 9)) >> 6))
#define UNIT_LABEL(u) ((u) & ((1u << 31) | 0xFFu))
#define UNIT_HAS_LEAF(u) ((((u) >> 8) & 1u) != 0)
    pos ^= UNIT_OFFSET(a[0]);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = s[i];
        if (c == 0)
            break;
        pos ^= c;
        if (pos >= ns->n_units)
            return DIT_ERR_FORMAT;
        uint32_t u = a[pos];
        if (UNIT_LABEL(u) != c)
            return DIT_OK;
        pos ^= UNIT_OFFSET(u);
        if (UNIT_HAS_LEAF(u)) {
            if (pos >= ns->n_units)
                return DIT_ERR_FORMAT;
            size_t v = a[pos] & 0x7FFFFFFFu;
            if (v > ns->blob_len ||
                (v < ns->blob_len && ((unsigned char)ns->blob[v] & 0xC0) == 0x80))
                return DIT_ERR_FORMAT;
            *rep = ns->blob + v;
            *rep_len = strlen(ns->blob + v);
            return DIT_OK;
        }
    }
#undef UNIT_OFFSET
#undef UNIT_LABEL
#undef UNIT_HAS_LEAF
    return DIT_OK;
}

static dit_status norm_precompiled(const norm_step *ns, const char *s, size_t len, dit_tok_buf *out)
{
    out->n = 0;
    if (!dit_tok_buf_reserve(out, len))
        return DIT_ERR_NOMEM;
    utf8proc_int32_t state = 0;
    size_t i = 0;
    while (i < len) {
        size_t g = i;
        int32_t c1 = dit_tok_utf8_next(s, len, &i);
        while (i < len) {
            size_t k = i;
            int32_t c2 = dit_tok_utf8_next(s, len, &k);
            if (utf8proc_grapheme_break_stateful(c1, c2, &state))
                break;
            c1 = c2;
            i = k;
        }
        const char *rep;
        size_t rep_len;
        dit_status st;
        if (i - g < T5_GRAPHEME_WHOLE) {
            st = charsmap_lookup(ns, (const unsigned char *)s + g, i - g, &rep, &rep_len);
            if (st != DIT_OK)
                return st;
            if (rep) {
                if (!dit_tok_buf_put(out, rep, rep_len))
                    return DIT_ERR_NOMEM;
                continue;
            }
        }
        for (size_t j = g; j < i;) {
            size_t k = j;
            dit_tok_utf8_next(s, len, &k);
            st = charsmap_lookup(ns, (const unsigned char *)s + j, k - j, &rep, &rep_len);
            if (st != DIT_OK)
                return st;
            if (!(rep ? dit_tok_buf_put(out, rep, rep_len) : dit_tok_buf_put(out, s + j, k - j)))
                return DIT_ERR_NOMEM;
            j = k;
        }
    }
    return DIT_OK;
}

/* Length of a Replace match at s[i], or 0. */
static size_t replace_match(const norm_step *ns, const char *s, size_t len, size_t i)
{
    if (ns->literal)
        return ns->literal_len <= len - i && memcmp(s + i, ns->literal, ns->literal_len) == 0
                   ? ns->literal_len
                   : 0;
    size_t k = i, reps = 0;
    while (k < len && reps < ns->max_rep) {
        size_t k2 = k;
        int32_t c = dit_tok_utf8_next(s, len, &k2);
        if (ns->atom < 0 ? !dit_tok_is_ws(c) : c != ns->atom)
            break;
        k = k2;
        reps++;
    }
    return reps >= ns->min_rep ? k - i : 0;
}

static dit_status norm_replace(const norm_step *ns, const char *s, size_t len, dit_tok_buf *out)
{
    out->n = 0;
    if (!dit_tok_buf_reserve(out, len))
        return DIT_ERR_NOMEM;
    size_t i = 0;
    while (i < len) {
        size_t m = replace_match(ns, s, len, i);
        bool ok;
        if (m) {
            ok = dit_tok_buf_put(out, ns->content, ns->content_len);
            i += m;
        } else {
            size_t k = i;
            dit_tok_utf8_next(s, len, &k);
            ok = dit_tok_buf_put(out, s + i, k - i);
            i = k;
        }
        if (!ok)
            return DIT_ERR_NOMEM;
    }
    return DIT_OK;
}

static dit_status norm_strip(const norm_step *ns, const char *s, size_t len, dit_tok_buf *out)
{
    size_t b = 0, e = len;
    if (ns->left)
        while (b < e) {
            size_t k = b;
            if (!dit_tok_is_ws(dit_tok_utf8_next(s, len, &k)))
                break;
            b = k;
        }
    if (ns->right)
        while (e > b) {
            size_t j = e - 1;
            while (j > b && ((unsigned char)s[j] & 0xC0) == 0x80)
                j--;
            size_t k = j;
            if (!dit_tok_is_ws(dit_tok_utf8_next(s, len, &k)))
                break;
            e = j;
        }
    out->n = 0;
    return dit_tok_buf_put(out, s + b, e - b) ? DIT_OK : DIT_ERR_NOMEM;
}

/* Runs the normalizer chain over s[0..len); the result is in *res (one of
 * the two buffers). */
static dit_status normalize(const dit_t5_tokenizer *t, const char *s, size_t len, dit_tok_buf *a,
                            dit_tok_buf *b, dit_tok_buf **res)
{
    a->n = 0;
    if (!dit_tok_buf_put(a, s, len))
        return DIT_ERR_NOMEM;
    dit_tok_buf *cur = a, *nxt = b;
    for (int i = 0; i < t->n_norm; i++) {
        const norm_step *ns = &t->norm[i];
        dit_status st;
        switch (ns->kind) {
        case N_PRECOMPILED:
            st = norm_precompiled(ns, cur->p, cur->n, nxt);
            break;
        case N_REPLACE:
            st = norm_replace(ns, cur->p, cur->n, nxt);
            break;
        default:
            st = norm_strip(ns, cur->p, cur->n, nxt);
            break;
        }
        if (st != DIT_OK)
            return st;
        dit_tok_buf *tmp = cur;
        cur = nxt;
        nxt = tmp;
    }
    *res = cur;
    return DIT_OK;
}

/* ---- pre-tokenizers ---------------------------------------------------------------------- */

/* Applies one pre-tokenizer to every text piece of `in` (strings in
 * `src`), writing the resulting pieces' strings to `dst` and the pieces to
 * `out`. Empty pieces are dropped, as tokenizers does. */
static dit_status pre_apply(const pre_step *ps, const dit_tok_buf *src, const dit_tok_span_list *in,
                            dit_tok_buf *dst, dit_tok_span_list *out)
{
    dst->n = 0;
    out->n = 0;
    for (size_t p = 0; p < in->n; p++) {
        const char *s = src->p + in->v[p].off;
        size_t len = in->v[p].len;
        bool first = in->v[p].first;
        if (ps->kind == P_WHITESPACE_SPLIT) {
            size_t i = 0;
            while (i < len) {
                size_t k = i;
                if (dit_tok_is_ws(dit_tok_utf8_next(s, len, &k))) {
                    i = k;
                    continue;
                }
                size_t b = i;
                while (i < len) {
                    k = i;
                    if (dit_tok_is_ws(dit_tok_utf8_next(s, len, &k)))
                        break;
                    i = k;
                }
                size_t off = dst->n;
                if (!dit_tok_buf_put(dst, s + b, i - b) ||
                    !dit_tok_span_push(out, off, i - b, -1, first && b == 0))
                    return DIT_ERR_NOMEM;
            }
            continue;
        }
        /* Metaspace: ' ' -> replacement, maybe prepend, maybe split. */
        size_t off = dst->n;
        /* tokenizers tests "starts with the replacement" after replacing
         * spaces, so a leading ' ' counts too. */
        bool starts = (len >= ps->repl_len && memcmp(s, ps->repl, ps->repl_len) == 0) ||
                      (len > 0 && s[0] == ' ');
        bool prepend = ps->prepend == PREPEND_ALWAYS  ? !starts
                       : ps->prepend == PREPEND_FIRST ? !starts && first
                                                      : false;
        if (prepend && !dit_tok_buf_put(dst, ps->repl, ps->repl_len))
            return DIT_ERR_NOMEM;
        for (size_t i = 0; i < len; i++) {
            bool ok = s[i] == ' ' ? dit_tok_buf_put(dst, ps->repl, ps->repl_len)
                                  : dit_tok_buf_put(dst, s + i, 1);
            if (!ok)
                return DIT_ERR_NOMEM;
        }
        size_t end = dst->n;
        if (!ps->split) {
            if (end > off && !dit_tok_span_push(out, off, end - off, -1, first))
                return DIT_ERR_NOMEM;
            continue;
        }
        /* MergedWithNext: a new piece starts at every replacement character,
         * consecutive ones included ("a▁▁b" -> "a", "▁", "▁b"). */
        size_t b = off, i = off;
        while (i < end) {
            if (end - i >= ps->repl_len && memcmp(dst->p + i, ps->repl, ps->repl_len) == 0) {
                if (i > b && !dit_tok_span_push(out, b, i - b, -1, first && b == off))
                    return DIT_ERR_NOMEM;
                b = i;
                i += ps->repl_len;
            } else {
                i++;
            }
        }
        if (end > b && !dit_tok_span_push(out, b, end - b, -1, first && b == off))
            return DIT_ERR_NOMEM;
    }
    return DIT_OK;
}

/* ---- unigram ------------------------------------------------------------------------------ */

typedef struct node {
    double score;
    int64_t start; /* -1: not reached yet */
    int32_t id;
} node;

/* One encode call's working memory. */
typedef struct scratch {
    const dit_t5_tokenizer *t;
    dit_tok_buf raw_norm[2];
    dit_tok_buf pre[2];
    dit_tok_span_list outer, inner, pl[2];
    node *lattice;
    size_t lattice_cap;
    int32_t *rev;
    size_t rev_cap;
} scratch;

static dit_status unigram(const dit_t5_tokenizer *t, scratch *sc, const char *s, size_t n,
                          dit_tok_ids *out)
{
    if (n == 0)
        return DIT_OK;
    if (n + 1 > sc->lattice_cap) {
        node *l = realloc(sc->lattice, (n + 1) * 2 * sizeof *l);
        int32_t *r = realloc(sc->rev, (n + 1) * 2 * sizeof *r);
        if (l)
            sc->lattice = l;
        if (r)
            sc->rev = r;
        if (!l || !r)
            return DIT_ERR_NOMEM;
        sc->lattice_cap = sc->rev_cap = (n + 1) * 2;
    }
    node *best = sc->lattice;
    for (size_t i = 0; i <= n; i++)
        best[i] = (node){0.0, -1, 0};
    const double unk_score = t->min_score - T5_UNK_PENALTY;
    size_t s0 = 0;
    while (s0 < n) {
        const double base = best[s0].score;
        size_t k = s0;
        dit_tok_utf8_next(s, n, &k);
        const size_t mblen = k - s0;
        bool has_single = false;
        uint64_t h = DIT_TOK_HASH_INIT;
        size_t lim = n - s0 < t->max_piece_len ? n - s0 : t->max_piece_len;
        for (size_t l = 1; l <= lim; l++) {
            h = dit_tok_hash_step(h, (unsigned char)s[s0 + l - 1]);
            /* Pieces are whole characters: skip lengths ending mid-character. */
            if (s0 + l < n && ((unsigned char)s[s0 + l] & 0xC0) == 0x80)
                continue;
            int32_t id;
            if (!dit_tok_map_get_hashed(&t->vocab, s + s0, l, dit_tok_hash_final(h), &id))
                continue;
            double cand = t->scores[id] + base;
            node *tn = &best[s0 + l];
            if (tn->start < 0 || cand > tn->score)
                *tn = (node){cand, (int64_t)s0, id};
            if (l == mblen)
                has_single = true;
        }
        if (!has_single) {
            double cand = unk_score + base;
            node *tn = &best[s0 + mblen];
            if (tn->start < 0 || cand > tn->score)
                *tn = (node){cand, (int64_t)s0, t->unk_id};
        }
        s0 += mblen;
    }
    /* Back-track; runs of <unk> nodes become one token. */
    size_t nr = 0, e = n;
    while (e > 0) {
        const node *nd = &best[e];
        size_t b = (size_t)nd->start;
        if (nd->id == t->unk_id) {
            size_t ue = e;
            while (b > 0 && best[b].id == t->unk_id)
                b = (size_t)best[b].start;
            /* tokenizers maps the fused string back through the vocabulary. */
            int32_t id;
            if (!dit_tok_map_get(&t->vocab, s + b, ue - b, &id))
                id = t->unk_id;
            sc->rev[nr++] = id;
        } else {
            sc->rev[nr++] = nd->id;
        }
        e = b;
    }
    while (nr > 0)
        dit_tok_ids_push(out, sc->rev[--nr]);
    return DIT_OK;
}

/* ---- encoding ------------------------------------------------------------------------------ */

/* The pipeline's normalizer and model (dit_tok_encode_text); ctx is the
 * scratch. */
static dit_status normalize_piece(void *ctx, const char *s, size_t len, const char **out,
                                  size_t *out_len)
{
    scratch *sc = ctx;
    dit_tok_buf *norm = NULL;
    dit_status st = normalize(sc->t, s, len, &sc->raw_norm[0], &sc->raw_norm[1], &norm);
    if (st != DIT_OK)
        return st;
    *out = norm->p;
    *out_len = norm->n;
    return DIT_OK;
}

/* The pre-tokenizers in turn (pl[0] over pre[0] <- the piece, then back and
 * forth), then Unigram on each resulting piece. */
static dit_status tokenize_piece(void *ctx, const char *s, size_t len, bool first, dit_tok_ids *out)
{
    scratch *sc = ctx;
    const dit_t5_tokenizer *t = sc->t;
    dit_tok_buf *src = &sc->pre[0], *dst = &sc->pre[1];
    dit_tok_span_list *pin = &sc->pl[0], *pout = &sc->pl[1];
    src->n = 0;
    pin->n = 0;
    if (!dit_tok_buf_put(src, s, len) || !dit_tok_span_push(pin, 0, len, -1, first))
        return DIT_ERR_NOMEM;
    for (int k = 0; k < t->n_pre; k++) {
        dit_status st = pre_apply(&t->pre[k], src, pin, dst, pout);
        if (st != DIT_OK)
            return st;
        dit_tok_buf *tb = src;
        src = dst;
        dst = tb;
        dit_tok_span_list *tl = pin;
        pin = pout;
        pout = tl;
    }
    for (size_t w = 0; w < pin->n && !out->overflow; w++) {
        dit_status st = unigram(t, sc, src->p + pin->v[w].off, pin->v[w].len, out);
        if (st != DIT_OK)
            return st;
    }
    return DIT_OK;
}

dit_status dit_t5_tokenizer_encode(const dit_t5_tokenizer *t, const char *utf8, int32_t *ids,
                                   int max_length, int *n_tokens, bool *truncated, dit_diag *diag)
{
    if (!t || !utf8 || !ids)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "t5 tokenizer: NULL argument");
    const int n_special = t->n_prefix + t->n_suffix;
    if (max_length < n_special || max_length < 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "t5 tokenizer: max_length %d leaves no room for %d special tokens",
                            max_length, n_special);
    size_t len = strlen(utf8), bad = 0;
    if (!dit_tok_utf8_valid(utf8, len, &bad))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "t5 tokenizer: prompt is not valid UTF-8 (byte %zu of %zu)", bad, len);
    scratch sc = {.t = t};
    dit_tok_ids out = {ids + t->n_prefix, 0, max_length - n_special, false};
    dit_status st = dit_tok_encode_text(&t->added, utf8, len, normalize_piece, tokenize_piece, &sc,
                                        &sc.outer, &sc.inner, &out);
    for (int i = 0; i < 2; i++) {
        free(sc.raw_norm[i].p);
        free(sc.pre[i].p);
        free(sc.pl[i].v);
    }
    free(sc.outer.v);
    free(sc.inner.v);
    free(sc.lattice);
    free(sc.rev);
    if (st != DIT_OK)
        return dit_diag_set(diag, st, "t5 tokenizer (%s): %s while encoding", t->json_path,
                            st == DIT_ERR_NOMEM    ? "out of memory"
                            : st == DIT_ERR_FORMAT ? "the precompiled_charsmap is corrupt"
                                                   : dit_status_str(st));
    int n = dit_tok_ids_finish(ids, max_length, t->prefix_ids, t->n_prefix, out.n, t->suffix_ids,
                               t->n_suffix, t->pad_id);
    if (n_tokens)
        *n_tokens = n;
    if (truncated)
        *truncated = out.overflow;
    return DIT_OK;
}
