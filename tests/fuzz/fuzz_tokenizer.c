/* Tokenizer files, which come with a model folder from anywhere: the
 * input's first byte picks what the rest is,
 *   0  the raw precompiled_charsmap of T5's Precompiled normalizer (the
 *      double-array trie and its replacement strings), put base64-encoded
 *      into the fixture's tokenizer.json (tests/data/tokenizers/t5);
 *   1  a whole T5 (SentencePiece unigram) tokenizer.json;
 *   2  a whole CLIP (byte-level BPE) tokenizer.json;
 * written into a folder with the fixture's tokenizer_config.json and
 * loaded as the pipelines load them, then used on a few fixed prompts.
 *
 * Properties: a folder that does not load says why, naming the file; one
 * that loads encodes every prompt into a row of the documented shape
 * (tokens, then padding; truncated exactly when they did not fit), or, for
 * a charsmap whose trie points outside itself, refuses the prompt with a
 * message instead of reading past it. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "encoders/clip_tokenizer.h"
#include "encoders/t5_tokenizer.h"
#include "fuzz.h"
#include "fuzz_json.h"

#define ROW 24

typedef struct tok_ctx {
    char dir[256], json_path[300], config_path[300];
    cJSON *t5_template; /* the fixture's tokenizer.json */
    char *config;       /* the fixture's tokenizer_config.json */
    size_t config_len;
} tok_ctx;

static const char *const prompts[] = {
    "a lighthouse on a cliff",
    "Tom &amp; Jerry's   big day",
    "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e",
    "caf\xc3\xa9 \xef\xbc\xa1\xef\xbc\xa2 \xe2\x84\xab e\xcc\x81",
    "\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x92\xbb x",
    "</s><pad> <|endoftext|> it's",
    "",
};

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    long n = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (n >= 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)n + 1))) {
        if (fread(buf, 1, (size_t)n, f) != (size_t)n) {
            free(buf);
            buf = NULL;
        } else {
            buf[n] = 0;
            *len = (size_t)n;
        }
    }
    fclose(f);
    return buf;
}

static bool write_all(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return false;
    bool ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

static void teardown(void *p)
{
    tok_ctx *c = p;
    unlink(c->json_path);
    unlink(c->config_path);
    rmdir(c->dir);
    cJSON_Delete(c->t5_template);
    free(c->config);
    free(c);
}

static void *setup(const char *root)
{
    tok_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    char path[4096];
    size_t n = 0;
    snprintf(path, sizeof path, "%s/tests/data/tokenizers/t5/tokenizer.json", root);
    char *text = read_all(path, &n);
    c->t5_template = text ? cJSON_Parse(text) : NULL;
    free(text);
    snprintf(path, sizeof path, "%s/tests/data/tokenizers/t5/tokenizer_config.json", root);
    c->config = read_all(path, &c->config_len);
    if (!c->t5_template || !c->config || dit_fuzz_scratch(c->dir, sizeof c->dir, "tok", true) < 0) {
        fprintf(stderr, "fuzz_tokenizer: cannot read the fixtures under %s or make a folder\n",
                root);
        cJSON_Delete(c->t5_template);
        free(c->config);
        free(c);
        return NULL;
    }
    snprintf(c->json_path, sizeof c->json_path, "%s/tokenizer.json", c->dir);
    snprintf(c->config_path, sizeof c->config_path, "%s/tokenizer_config.json", c->dir);
    return c;
}

static char *base64(const uint8_t *p, size_t n)
{
    static const char a[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char *out = malloc((n + 2) / 3 * 4 + 1), *o = out;
    if (!out)
        return NULL;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) |
                     (i + 2 < n ? p[i + 2] : 0);
        *o++ = a[v >> 18 & 63];
        *o++ = a[v >> 12 & 63];
        *o++ = i + 1 < n ? a[v >> 6 & 63] : '=';
        *o++ = i + 2 < n ? a[v & 63] : '=';
    }
    *o = 0;
    return out;
}

/* The fixture's tokenizer.json with this charsmap. */
static char *with_charsmap(tok_ctx *c, const uint8_t *p, size_t n)
{
    cJSON *norm = cJSON_GetObjectItemCaseSensitive(c->t5_template, "normalizer");
    char *b64 = base64(p, n);
    if (!norm || !b64) {
        free(b64);
        return NULL;
    }
    cJSON *s = cJSON_CreateString(b64);
    free(b64);
    if (!s || !cJSON_ReplaceItemInObjectCaseSensitive(norm, "precompiled_charsmap", s)) {
        cJSON_Delete(s);
        return NULL;
    }
    return cJSON_PrintUnformatted(c->t5_template);
}

static void check_row(const int32_t *ids, int n_tokens, bool truncated, int32_t pad,
                      const char *which)
{
    DIT_FUZZ_REQUIRE(n_tokens >= 0 && n_tokens <= ROW, "%s: %d tokens", which, n_tokens);
    DIT_FUZZ_REQUIRE(!truncated || n_tokens == ROW, "%s: truncated at %d", which, n_tokens);
    for (int i = 0; i < ROW; i++) {
        DIT_FUZZ_REQUIRE(ids[i] >= 0, "%s: id %d", which, ids[i]);
        if (i >= n_tokens)
            DIT_FUZZ_REQUIRE(ids[i] == pad, "%s: %d after the tokens, pad %d", which, ids[i], pad);
    }
}

static int run(void *p, const uint8_t *data, size_t size)
{
    tok_ctx *c = p;
    if (size < 1)
        return -1;
    const int mode = data[0] % 3;
    char *owned = mode == 0 ? with_charsmap(c, data + 1, size - 1) : NULL;
    const void *json = mode == 0 ? (const void *)owned : (const void *)(data + 1);
    const size_t json_len = mode == 0 ? (owned ? strlen(owned) : 0) : size - 1;
    /* CLIP's folder goes without the config (it is optional there). */
    if (!json || !write_all(c->json_path, json, json_len) ||
        (mode == 2 ? unlink(c->config_path) != 0 && errno != ENOENT
                   : !write_all(c->config_path, c->config, c->config_len)))
        DIT_FUZZ_FAIL("cannot write the tokenizer folder %s", c->dir);
    free(owned);

    dit_diag d;
    dit_diag_clear(&d);
    int32_t ids[ROW];
    int keep = 0;
    if (mode == 2) {
        dit_clip_tokenizer *t = NULL;
        if (dit_clip_tokenizer_load(c->dir, &t, &d) != DIT_OK) {
            DIT_FUZZ_REQUIRE(strstr(d.msg, c->dir), "a refusal not naming the folder: %s", d.msg);
            return -1;
        }
        for (size_t i = 0; i < sizeof prompts / sizeof *prompts; i++) {
            int nt = -1;
            bool cut = false;
            dit_status st = dit_clip_tokenizer_encode(t, prompts[i], ids, ROW, &nt, &cut, &d);
            DIT_FUZZ_REQUIRE(st == DIT_OK, "CLIP: \"%s\" refused: %s", prompts[i], d.msg);
            DIT_FUZZ_REQUIRE(nt >= 2, "CLIP: %d tokens", nt);
            check_row(ids, nt, cut, dit_clip_tokenizer_pad_id(t), "CLIP");
            DIT_FUZZ_REQUIRE(ids[0] == dit_clip_tokenizer_bos_id(t) &&
                                 ids[nt - 1] == dit_clip_tokenizer_eos_id(t),
                             "CLIP: not BOS ... EOS");
        }
        dit_clip_tokenizer_free(t);
        return keep;
    }
    dit_t5_tokenizer *t = NULL;
    if (dit_t5_tokenizer_load(c->dir, &t, &d) != DIT_OK) {
        DIT_FUZZ_REQUIRE(strstr(d.msg, c->dir), "a refusal not naming the folder: %s", d.msg);
        return -1;
    }
    for (size_t i = 0; i < sizeof prompts / sizeof *prompts; i++) {
        int nt = -1;
        bool cut = false;
        dit_diag_clear(&d);
        dit_status st = dit_t5_tokenizer_encode(t, prompts[i], ids, ROW, &nt, &cut, &d);
        if (st == DIT_ERR_FORMAT) { /* a corrupt trie, found on the way */
            DIT_FUZZ_REQUIRE(d.msg[0], "T5: a format error without a message");
            continue;
        }
        DIT_FUZZ_REQUIRE(st == DIT_OK, "T5: \"%s\" refused (%s): %s", prompts[i],
                         dit_status_name(st), d.msg);
        check_row(ids, nt, cut, dit_t5_tokenizer_pad_id(t), "T5");
    }
    dit_t5_tokenizer_free(t);
    return keep;
}

/* Modes 1 and 2: the JSON edited through its tree. */
static size_t mutate(void *ctx, uint8_t *data, size_t size, size_t max_size, uint64_t seed)
{
    (void)ctx;
    if (size < 2 || max_size < 2 || data[0] % 3 == 0)
        return 0;
    size_t n = dit_fuzz_json_mutate(data + 1, size - 1, max_size - 1, seed);
    return n ? n + 1 : 0;
}

const dit_fuzz_target dit_fuzz_target_def = {
    .name = "tokenizer", .setup = setup, .run = run, .teardown = teardown, .mutate = mutate};
