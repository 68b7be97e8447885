/* Tests for the CLIP and T5 tokenizers against ids produced by transformers,
 * and for their shared base (tokenizer_base.h) where it has behaviour of its
 * own.
 *
 * tests/data/tokenizers/ holds a small trained CLIP BPE (clip/) and T5
 * unigram (t5/) tokenizer and cases.json with the ids transformers'
 * CLIPTokenizer / T5TokenizerFast give for several hundred strings at
 * several max_lengths (made by tests/text/gen_tokenizer_fixtures.py; no
 * Python is needed here). Variants re-run a subset of the strings with other
 * configs (CLIP) or other tokenizer.json pipelines (T5), written to a temp
 * directory. Malformed folders are built file by file so that each test
 * breaks one thing and checks the status and that the message names the
 * file. */
#include <check.h>
#include <ftw.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "loader/json_util.h"
#include "encoders/clip_tokenizer.h"
#include "encoders/t5_tokenizer.h"
#include "encoders/tokenizer_base.h"

/* ---- fixtures and temp directories ------------------------------------------ */

static char tmp_root[PATH_MAX];

static void tmp_setup(void)
{
    snprintf(tmp_root, sizeof tmp_root, "/tmp/dit_tok_test.XXXXXX");
    if (!mkdtemp(tmp_root)) {
        perror("mkdtemp");
        abort();
    }
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(path);
}

static void tmp_teardown(void)
{
    if (tmp_root[0])
        nftw(tmp_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    tmp_root[0] = '\0';
}

__attribute__((format(printf, 2, 3))) static void fmt_path(char *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out, PATH_MAX, fmt, ap);
    va_end(ap);
    ck_assert_msg(n >= 0 && n < PATH_MAX, "path too long");
}

static const char *data_dir(void)
{
    static char dir[PATH_MAX];
    const char *root = getenv("DIT_SOURCE_ROOT");
    ck_assert_msg(root != NULL, "DIT_SOURCE_ROOT is not set; run this test through meson");
    fmt_path(dir, "%s/tests/data/tokenizers", root);
    return dir;
}

static void fixture_dir(char *out, const char *name)
{
    fmt_path(out, "%s/%s", data_dir(), name);
}

/* A fresh directory per test (or per variant). */
static void make_dir(char *out, const char *name)
{
    fmt_path(out, "%s/%s", tmp_root, name);
    ck_assert_msg(mkdir(out, 0755) == 0, "mkdir %s failed", out);
}

static void write_file(const char *dir, const char *name, const void *data, size_t n)
{
    char path[PATH_MAX];
    fmt_path(path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    ck_assert_msg(f != NULL, "cannot create %s", path);
    ck_assert(fwrite(data, 1, n, f) == n);
    ck_assert(fclose(f) == 0);
}

static void write_text(const char *dir, const char *name, const char *text)
{
    write_file(dir, name, text, strlen(text));
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    ck_assert(fseek(f, 0, SEEK_END) == 0);
    long n = ftell(f);
    ck_assert(n >= 0);
    rewind(f);
    char *p = malloc((size_t)n + 1);
    ck_assert(p != NULL);
    ck_assert(fread(p, 1, (size_t)n, f) == (size_t)n);
    p[n] = '\0';
    fclose(f);
    if (len)
        *len = (size_t)n;
    return p;
}

static void copy_file(const char *from_dir, const char *to_dir, const char *name)
{
    char path[PATH_MAX];
    fmt_path(path, "%s/%s", from_dir, name);
    size_t n;
    char *p = read_all(path, &n);
    write_file(to_dir, name, p, n);
    free(p);
}

static void write_json(const char *dir, const char *name, const cJSON *j)
{
    char *s = cJSON_PrintUnformatted(j);
    ck_assert(s != NULL);
    write_text(dir, name, s);
    free(s);
}

static cJSON *load_json(const char *path)
{
    cJSON *j = NULL;
    dit_diag d = {0};
    dit_status st = dit_json_load_file(path, &j, &d);
    ck_assert_msg(st == DIT_OK, "%s", dit_diag_msg(&d));
    return j;
}

static cJSON *load_cases(void)
{
    char path[PATH_MAX];
    fmt_path(path, "%s/cases.json", data_dir());
    return load_json(path);
}

/* ---- comparing ids ------------------------------------------------------------ */

typedef dit_status (*encode_fn)(const void *tok, const char *text, int32_t *ids, int max_length,
                                int *n, bool *cut, dit_diag *diag);

static dit_status clip_encode(const void *tok, const char *text, int32_t *ids, int max_length,
                              int *n, bool *cut, dit_diag *diag)
{
    return dit_clip_tokenizer_encode(tok, text, ids, max_length, n, cut, diag);
}

static dit_status t5_encode(const void *tok, const char *text, int32_t *ids, int max_length, int *n,
                            bool *cut, dit_diag *diag)
{
    return dit_t5_tokenizer_encode(tok, text, ids, max_length, n, cut, diag);
}

static void print_ids(const char *label, const int32_t *ids, int n)
{
    fprintf(stderr, "    %s [", label);
    for (int i = 0; i < n; i++)
        fprintf(stderr, "%s%d", i ? ", " : "", ids[i]);
    fprintf(stderr, "]\n");
}

/* Encodes `text` and compares with the expected ids before padding (a JSON
 * array), the padding and the truncation flag. Returns 1 on a mismatch and
 * prints it when `report`. */
static int check_one(const char *what, encode_fn enc, const void *tok, const char *text,
                     const cJSON *want, bool want_cut, int max_length, int32_t pad_id, bool report)
{
    int nw = cJSON_GetArraySize(want);
    int32_t *exp = malloc(sizeof *exp * (size_t)max_length);
    int32_t *got = malloc(sizeof *got * (size_t)max_length);
    ck_assert(exp && got && nw <= max_length);
    int k = 0;
    for (const cJSON *it = want->child; it; it = it->next)
        exp[k++] = (int32_t)it->valuedouble;
    for (; k < max_length; k++)
        exp[k] = pad_id;
    int n = -1;
    bool cut = !want_cut;
    dit_diag d = {0};
    dit_status st = enc(tok, text, got, max_length, &n, &cut, &d);
    int bad = st != DIT_OK || n != nw || cut != want_cut ||
              memcmp(exp, got, sizeof *got * (size_t)max_length) != 0;
    if (bad && report) {
        fprintf(stderr, "%s, max_length %d: mismatch for \"%s\"\n", what, max_length, text);
        if (st != DIT_OK) {
            fprintf(stderr, "    error: %s\n", dit_diag_msg(&d));
        } else {
            fprintf(stderr, "    n_tokens %d (want %d), truncated %d (want %d)\n", n, nw, cut,
                    want_cut);
            print_ids("want", exp, max_length);
            print_ids("got ", got, max_length);
        }
    }
    free(exp);
    free(got);
    return bad;
}

static const char *case_text(const cJSON *strings, const cJSON *c)
{
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(c, "s");
    ck_assert(cJSON_IsNumber(s));
    const cJSON *t = cJSON_GetArrayItem(strings, (int)s->valuedouble);
    ck_assert(cJSON_IsString(t));
    return t->valuestring;
}

static bool cut_contains(const cJSON *c, int max_length)
{
    const cJSON *cut = cJSON_GetObjectItemCaseSensitive(c, "cut");
    if (cJSON_IsTrue(cut))
        return true;
    for (const cJSON *it = cut ? cut->child : NULL; it; it = it->next)
        if ((int)it->valuedouble == max_length)
            return true;
    return false;
}

/* Runs every case of cases.json[key] at every max length. */
static int check_main_cases(const char *key, encode_fn enc, const void *tok, int32_t pad_id,
                            int *total)
{
    cJSON *root = load_cases();
    const cJSON *strings = cJSON_GetObjectItemCaseSensitive(root, "strings");
    const cJSON *sec = cJSON_GetObjectItemCaseSensitive(root, key);
    const cJSON *lens = cJSON_GetObjectItemCaseSensitive(sec, "max_lengths");
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(sec, "cases");
    const cJSON *pad = cJSON_GetObjectItemCaseSensitive(sec, "pad_id");
    ck_assert(cJSON_IsArray(strings) && cJSON_IsArray(lens) && cJSON_IsArray(cases));
    ck_assert_int_eq((int)pad->valuedouble, pad_id);
    ck_assert_int_ge(cJSON_GetArraySize(cases), 200);
    int bad = 0;
    *total = 0;
    for (const cJSON *c = cases->child; c; c = c->next) {
        const char *text = case_text(strings, c);
        for (const cJSON *l = lens->child; l; l = l->next) {
            int L = (int)l->valuedouble;
            char key_l[16];
            snprintf(key_l, sizeof key_l, "%d", L);
            const cJSON *want = cJSON_GetObjectItemCaseSensitive(c, key_l);
            ck_assert(cJSON_IsArray(want));
            bad += check_one(key, enc, tok, text, want, cut_contains(c, L), L, pad_id, bad < 5);
            (*total)++;
        }
    }
    cJSON_Delete(root);
    return bad;
}

static int check_variant_cases(const char *what, encode_fn enc, const void *tok,
                               const cJSON *strings, const cJSON *variant, int *total)
{
    int L = (int)cJSON_GetObjectItemCaseSensitive(variant, "max_length")->valuedouble;
    int32_t pad = (int32_t)cJSON_GetObjectItemCaseSensitive(variant, "pad_id")->valuedouble;
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(variant, "cases");
    ck_assert(cJSON_IsArray(cases) && cJSON_GetArraySize(cases) > 0);
    int bad = 0;
    for (const cJSON *c = cases->child; c; c = c->next) {
        const cJSON *want = cJSON_GetObjectItemCaseSensitive(c, "ids");
        ck_assert(cJSON_IsArray(want));
        bad += check_one(what, enc, tok, case_text(strings, c), want, cut_contains(c, L), L, pad,
                         bad < 5);
        (*total)++;
    }
    return bad;
}

/* ---- transformers' ids ------------------------------------------------------------ */

START_TEST(test_clip_cases)
{
    char dir[PATH_MAX];
    fixture_dir(dir, "clip");
    dit_clip_tokenizer *t = NULL;
    dit_diag d = {0};
    ck_assert_msg(dit_clip_tokenizer_load(dir, &t, &d) == DIT_OK, "%s", dit_diag_msg(&d));
    ck_assert_int_eq(dit_clip_tokenizer_max_length(t), 77);
    int total = 0;
    int bad = check_main_cases("clip", clip_encode, t, dit_clip_tokenizer_pad_id(t), &total);
    fprintf(stderr, "clip: %d of %d encodings match transformers\n", total - bad, total);
    ck_assert_msg(bad == 0, "%d of %d CLIP encodings differ from transformers", bad, total);
    dit_clip_tokenizer_free(t);
}
END_TEST

START_TEST(test_t5_cases)
{
    char dir[PATH_MAX];
    fixture_dir(dir, "t5");
    dit_t5_tokenizer *t = NULL;
    dit_diag d = {0};
    ck_assert_msg(dit_t5_tokenizer_load(dir, &t, &d) == DIT_OK, "%s", dit_diag_msg(&d));
    ck_assert_int_eq(dit_t5_tokenizer_max_length(t), 512);
    int total = 0;
    int bad = check_main_cases("t5", t5_encode, t, dit_t5_tokenizer_pad_id(t), &total);
    fprintf(stderr, "t5: %d of %d encodings match transformers\n", total - bad, total);
    ck_assert_msg(bad == 0, "%d of %d T5 encodings differ from transformers", bad, total);
    dit_t5_tokenizer_free(t);
}
END_TEST

/* transformers 5's save_pretrained layout: tokenizer.json whose model holds
 * the vocabulary and the merges as pairs, plus the added tokens. */
static void write_clip_tokenizer_json(const char *src, const char *dir, const cJSON *added)
{
    char path[PATH_MAX];
    fmt_path(path, "%s/vocab.json", src);
    cJSON *vocab = load_json(path);
    fmt_path(path, "%s/merges.txt", src);
    char *text = read_all(path, NULL);
    cJSON *merges = cJSON_CreateArray();
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (strncmp(line, "#version", 8) == 0)
            continue;
        char *sp = strchr(line, ' ');
        ck_assert(sp != NULL);
        *sp = '\0';
        cJSON *pair = cJSON_CreateArray();
        cJSON_AddItemToArray(pair, cJSON_CreateString(line));
        cJSON_AddItemToArray(pair, cJSON_CreateString(sp + 1));
        cJSON_AddItemToArray(merges, pair);
    }
    free(text);
    cJSON *model = cJSON_CreateObject();
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddItemToObject(model, "vocab", vocab);
    cJSON_AddItemToObject(model, "merges", merges);
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "added_tokens", cJSON_Duplicate(added, 1));
    cJSON_AddItemToObject(root, "model", model);
    write_json(dir, "tokenizer.json", root);
    cJSON_Delete(root);
}

START_TEST(test_clip_variants)
{
    cJSON *root = load_cases();
    const cJSON *strings = cJSON_GetObjectItemCaseSensitive(root, "strings");
    const cJSON *vars = cJSON_GetObjectItemCaseSensitive(root, "clip_variants");
    char src[PATH_MAX];
    fixture_dir(src, "clip");
    int bad = 0, total = 0, nv = 0;
    for (const cJSON *v = vars ? vars->child : NULL; v; v = v->next, nv++) {
        const char *name = cJSON_GetObjectItemCaseSensitive(v, "name")->valuestring;
        char dir[PATH_MAX];
        make_dir(dir, name);
        const cJSON *layout = cJSON_GetObjectItemCaseSensitive(v, "layout");
        if (cJSON_IsString(layout) && strcmp(layout->valuestring, "tokenizer.json") == 0)
            write_clip_tokenizer_json(src, dir,
                                      cJSON_GetObjectItemCaseSensitive(v, "added_tokens"));
        else {
            copy_file(src, dir, "vocab.json");
            copy_file(src, dir, "merges.txt");
        }
        const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(v, "tokenizer_config");
        const cJSON *map = cJSON_GetObjectItemCaseSensitive(v, "special_tokens_map");
        if (cJSON_IsObject(cfg))
            write_json(dir, "tokenizer_config.json", cfg);
        if (cJSON_IsObject(map))
            write_json(dir, "special_tokens_map.json", map);
        dit_clip_tokenizer *t = NULL;
        dit_diag d = {0};
        ck_assert_msg(dit_clip_tokenizer_load(dir, &t, &d) == DIT_OK, "%s: %s", name,
                      dit_diag_msg(&d));
        char what[128];
        snprintf(what, sizeof what, "clip variant %s", name);
        bad += check_variant_cases(what, clip_encode, t, strings, v, &total);
        dit_clip_tokenizer_free(t);
    }
    ck_assert_int_ge(nv, 5);
    fprintf(stderr, "clip variants: %d of %d encodings match transformers\n", total - bad, total);
    ck_assert_msg(bad == 0, "%d of %d CLIP variant encodings differ", bad, total);
    cJSON_Delete(root);
}
END_TEST

/* Replaces every "@charsmap" string in `j` by the real charsmap. */
static void splice_charsmap(cJSON *j, const char *charsmap)
{
    for (cJSON *it = j ? j->child : NULL; it; it = it->next) {
        if (cJSON_IsString(it) && strcmp(it->valuestring, "@charsmap") == 0)
            ck_assert(cJSON_SetValuestring(it, charsmap) != NULL);
        else
            splice_charsmap(it, charsmap);
    }
}

START_TEST(test_t5_variants)
{
    cJSON *root = load_cases();
    const cJSON *strings = cJSON_GetObjectItemCaseSensitive(root, "strings");
    const cJSON *vars = cJSON_GetObjectItemCaseSensitive(root, "t5_variants");
    char src[PATH_MAX], path[PATH_MAX];
    fixture_dir(src, "t5");
    fmt_path(path, "%s/tokenizer.json", src);
    cJSON *base = load_json(path);
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(base, "normalizer");
    const cJSON *cm = cJSON_GetObjectItemCaseSensitive(norm, "precompiled_charsmap");
    ck_assert(cJSON_IsString(cm));
    char *charsmap = strdup(cm->valuestring);
    int bad = 0, total = 0, nv = 0;
    for (const cJSON *v = vars ? vars->child : NULL; v; v = v->next, nv++) {
        const char *name = cJSON_GetObjectItemCaseSensitive(v, "name")->valuestring;
        char dir[PATH_MAX];
        make_dir(dir, name);
        const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(v, "tokenizer_config");
        if (cfg)
            write_json(dir, "tokenizer_config.json", cfg);
        else
            copy_file(src, dir, "tokenizer_config.json");
        /* A variant replaces the components it names. */
        cJSON *tj = cJSON_Duplicate(base, 1);
        ck_assert(tj != NULL);
        static const char *const parts[] = {"normalizer", "pre_tokenizer"};
        for (int k = 0; k < 2; k++) {
            const cJSON *part = cJSON_GetObjectItemCaseSensitive(v, parts[k]);
            if (!part)
                continue;
            cJSON *dup = cJSON_Duplicate(part, 1);
            ck_assert(dup != NULL);
            splice_charsmap(dup, charsmap);
            ck_assert(cJSON_ReplaceItemInObjectCaseSensitive(tj, parts[k], dup));
        }
        write_json(dir, "tokenizer.json", tj);
        cJSON_Delete(tj);
        dit_t5_tokenizer *t = NULL;
        dit_diag d = {0};
        ck_assert_msg(dit_t5_tokenizer_load(dir, &t, &d) == DIT_OK, "%s: %s", name,
                      dit_diag_msg(&d));
        char what[128];
        snprintf(what, sizeof what, "t5 variant %s", name);
        bad += check_variant_cases(what, t5_encode, t, strings, v, &total);
        dit_t5_tokenizer_free(t);
    }
    ck_assert_int_ge(nv, 5);
    fprintf(stderr, "t5 variants: %d of %d encodings match tokenizers / transformers\n",
            total - bad, total);
    ck_assert_msg(bad == 0, "%d of %d T5 variant encodings differ", bad, total);
    free(charsmap);
    cJSON_Delete(base);
    cJSON_Delete(root);
}
END_TEST

/* ---- API behaviour ------------------------------------------------------------------ */

START_TEST(test_api_edges)
{
    char dir[PATH_MAX];
    dit_diag d = {0};
    dit_clip_tokenizer *c = NULL;
    dit_t5_tokenizer *t = NULL;
    fixture_dir(dir, "clip");
    ck_assert_int_eq(dit_clip_tokenizer_load(dir, &c, &d), DIT_OK);
    fixture_dir(dir, "t5");
    ck_assert_int_eq(dit_t5_tokenizer_load(dir, &t, &d), DIT_OK);

    int32_t ids[80];
    int n = 0;
    bool cut = true;
    /* Empty prompt: BOS EOS pad... / EOS pad... */
    ck_assert_int_eq(dit_clip_tokenizer_encode(c, "", ids, 77, &n, &cut, &d), DIT_OK);
    ck_assert_int_eq(n, 2);
    ck_assert(!cut);
    ck_assert_int_eq(ids[0], dit_clip_tokenizer_bos_id(c));
    ck_assert_int_eq(ids[1], dit_clip_tokenizer_eos_id(c));
    ck_assert_int_eq(ids[76], dit_clip_tokenizer_pad_id(c));
    ck_assert_int_eq(dit_t5_tokenizer_encode(t, "", ids, 8, &n, &cut, &d), DIT_OK);
    ck_assert_int_eq(n, 1);
    ck_assert_int_eq(ids[7], dit_t5_tokenizer_pad_id(t));
    /* The smallest lengths that hold the special tokens. */
    ck_assert_int_eq(dit_clip_tokenizer_encode(c, "hello world", ids, 2, &n, &cut, &d), DIT_OK);
    ck_assert(cut && n == 2);
    ck_assert_int_eq(dit_t5_tokenizer_encode(t, "hello world", ids, 1, &n, &cut, &d), DIT_OK);
    ck_assert(cut && n == 1);
    /* Too small, NULLs: errors, no crash; n_tokens / truncated optional. */
    ck_assert_int_eq(dit_clip_tokenizer_encode(c, "x", ids, 1, NULL, NULL, &d),
                     DIT_ERR_INVALID_ARG);
    ck_assert_int_eq(dit_t5_tokenizer_encode(t, "x", ids, 0, NULL, NULL, NULL),
                     DIT_ERR_INVALID_ARG);
    ck_assert_int_eq(dit_clip_tokenizer_encode(c, NULL, ids, 77, NULL, NULL, NULL),
                     DIT_ERR_INVALID_ARG);
    ck_assert_int_eq(dit_t5_tokenizer_encode(t, "x", NULL, 77, NULL, NULL, NULL),
                     DIT_ERR_INVALID_ARG);
    ck_assert_int_eq(dit_clip_tokenizer_encode(c, "x", ids, 77, NULL, NULL, NULL), DIT_OK);
    dit_clip_tokenizer_free(c);
    dit_t5_tokenizer_free(t);
    dit_clip_tokenizer_free(NULL);
    dit_t5_tokenizer_free(NULL);
}
END_TEST

START_TEST(test_invalid_utf8)
{
    static const char *const bad[] = {
        "\xff",                 /* never valid */
        "abc\xc3",              /* truncated 2-byte sequence */
        "\xe2\x82",             /* truncated 3-byte sequence */
        "\xc0\xaf",             /* overlong '/' */
        "\xed\xa0\x80",         /* UTF-16 surrogate */
        "\xf4\x90\x80\x80",     /* above U+10FFFF */
        "ok \x80 continuation", /* stray continuation byte */
    };
    char dir[PATH_MAX];
    dit_clip_tokenizer *c = NULL;
    dit_t5_tokenizer *t = NULL;
    dit_diag d = {0};
    fixture_dir(dir, "clip");
    ck_assert_int_eq(dit_clip_tokenizer_load(dir, &c, &d), DIT_OK);
    fixture_dir(dir, "t5");
    ck_assert_int_eq(dit_t5_tokenizer_load(dir, &t, &d), DIT_OK);
    int32_t ids[77];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        dit_diag_clear(&d);
        ck_assert_int_eq(dit_clip_tokenizer_encode(c, bad[i], ids, 77, NULL, NULL, &d),
                         DIT_ERR_INVALID_ARG);
        ck_assert_msg(strstr(dit_diag_msg(&d), "not valid UTF-8"), "%s", dit_diag_msg(&d));
        dit_diag_clear(&d);
        ck_assert_int_eq(dit_t5_tokenizer_encode(t, bad[i], ids, 64, NULL, NULL, &d),
                         DIT_ERR_INVALID_ARG);
        ck_assert_msg(strstr(dit_diag_msg(&d), "not valid UTF-8"), "%s", dit_diag_msg(&d));
    }
    dit_clip_tokenizer_free(c);
    dit_t5_tokenizer_free(t);
}
END_TEST

/* Random valid text of every kind of code point: no crash, ids in range,
 * the special tokens where they belong (ASan/UBSan do the rest). */
START_TEST(test_random_text)
{
    char dir[PATH_MAX];
    dit_clip_tokenizer *c = NULL;
    dit_t5_tokenizer *t = NULL;
    dit_diag d = {0};
    fixture_dir(dir, "clip");
    ck_assert_int_eq(dit_clip_tokenizer_load(dir, &c, &d), DIT_OK);
    fixture_dir(dir, "t5");
    ck_assert_int_eq(dit_t5_tokenizer_load(dir, &t, &d), DIT_OK);
    static const int32_t pools[][2] = {
        {0x20, 0x7E},       {0x01, 0x1F},       {0xA0, 0x24F},    {0x300, 0x36F},
        {0x370, 0x4FF},     {0x600, 0x6FF},     {0x900, 0x97F},   {0xE00, 0xE7F},
        {0x1100, 0x11FF},   {0x2000, 0x206F},   {0x3000, 0x30FF}, {0x4E00, 0x9FFF},
        {0xAC00, 0xD7A3},   {0xFB00, 0xFB06},   {0xFE00, 0xFE0F}, {0xFF00, 0xFFEF},
        {0x1F300, 0x1FAFF}, {0x1F3FB, 0x1F3FF}, {0x200D, 0x200D}, {0x10000, 0x10FFFF},
    };
    uint64_t s = 0x243f6a8885a308d3ull;
    char text[4096];
    int32_t ids[512];
    for (int iter = 0; iter < 400; iter++) {
        size_t len = 0;
        int ncp = (int)((s >> 7) % 300);
        for (int k = 0; k < ncp; k++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            const int32_t *p = pools[(s >> 33) % (sizeof pools / sizeof pools[0])];
            int32_t cp = p[0] + (int32_t)((s >> 11) % (uint64_t)(p[1] - p[0] + 1));
            if (cp >= 0xD800 && cp <= 0xDFFF)
                cp = 0x20;
            unsigned char *o = (unsigned char *)text + len;
            if (cp < 0x80) {
                o[0] = (unsigned char)cp;
                len += 1;
            } else if (cp < 0x800) {
                o[0] = (unsigned char)(0xC0 | cp >> 6);
                o[1] = (unsigned char)(0x80 | (cp & 0x3F));
                len += 2;
            } else if (cp < 0x10000) {
                o[0] = (unsigned char)(0xE0 | cp >> 12);
                o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
                o[2] = (unsigned char)(0x80 | (cp & 0x3F));
                len += 3;
            } else {
                o[0] = (unsigned char)(0xF0 | cp >> 18);
                o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
                o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
                o[3] = (unsigned char)(0x80 | (cp & 0x3F));
                len += 4;
            }
        }
        text[len] = '\0';
        int n = 0;
        bool cut = false;
        ck_assert_int_eq(dit_clip_tokenizer_encode(c, text, ids, 77, &n, &cut, &d), DIT_OK);
        ck_assert(n >= 2 && n <= 77);
        ck_assert_int_eq(ids[0], dit_clip_tokenizer_bos_id(c));
        ck_assert_int_eq(ids[n - 1], dit_clip_tokenizer_eos_id(c));
        for (int i = 0; i < 77; i++)
            ck_assert(ids[i] >= 0 && ids[i] <= dit_clip_tokenizer_eos_id(c));
        ck_assert_int_eq(dit_t5_tokenizer_encode(t, text, ids, 512, &n, &cut, &d), DIT_OK);
        ck_assert(n >= 1 && n <= 512);
        ck_assert_int_eq(ids[n - 1], 1);
        for (int i = 0; i < 512; i++)
            ck_assert(ids[i] >= 0 && ids[i] < 1 << 20);
    }
    dit_clip_tokenizer_free(c);
    dit_t5_tokenizer_free(t);
}
END_TEST

/* A prompt of a few hundred kB: linear time, and truncated. */
START_TEST(test_long_prompt)
{
    char dir[PATH_MAX];
    dit_clip_tokenizer *c = NULL;
    dit_t5_tokenizer *t = NULL;
    dit_diag d = {0};
    fixture_dir(dir, "clip");
    ck_assert_int_eq(dit_clip_tokenizer_load(dir, &c, &d), DIT_OK);
    fixture_dir(dir, "t5");
    ck_assert_int_eq(dit_t5_tokenizer_load(dir, &t, &d), DIT_OK);
    size_t n = 300000;
    char *text = malloc(n + 1);
    ck_assert(text != NULL);
    for (size_t i = 0; i < n; i++)
        text[i] = "abcdefghij"[i % 10];
    text[n] = '\0';
    int32_t ids[512];
    int nt = 0;
    bool cut = false;
    ck_assert_int_eq(dit_clip_tokenizer_encode(c, text, ids, 77, &nt, &cut, &d), DIT_OK);
    ck_assert(cut && nt == 77);
    ck_assert_int_eq(dit_t5_tokenizer_encode(t, text, ids, 512, &nt, &cut, &d), DIT_OK);
    ck_assert(cut && nt == 512);
    for (size_t i = 0; i < n; i++)
        text[i] = (i % 6 == 5) ? ' ' : 'x';
    ck_assert_int_eq(dit_clip_tokenizer_encode(c, text, ids, 77, &nt, &cut, &d), DIT_OK);
    ck_assert(cut && nt == 77);
    ck_assert_int_eq(dit_t5_tokenizer_encode(t, text, ids, 512, &nt, &cut, &d), DIT_OK);
    ck_assert(cut && nt == 512);
    free(text);
    dit_clip_tokenizer_free(c);
    dit_t5_tokenizer_free(t);
}
END_TEST

/* ---- the shared base ---------------------------------------------------------------- */

/* Validation names the first byte of the first bad sequence; iteration over
 * bad bytes yields U+FFFD one byte at a time; stepping back lands on the
 * start of the previous code point. */
START_TEST(test_base_utf8)
{
    static const struct {
        const char *s;
        size_t bad_at;
    } bad[] = {
        {"ab\xff", 2},
        {"abc\xc3", 3},
        {"\xe2\x82", 0},
        {"ok \xc0\xaf", 3},
        {"\xed\xa0\x80x", 0},
        {"abc\xf4\x90\x80\x80", 3},
        {"\xc3\xa9\xe4\xb8\xad\x80", 5},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t at = 999;
        ck_assert(!dit_tok_utf8_valid(bad[i].s, strlen(bad[i].s), &at));
        ck_assert_uint_eq(at, bad[i].bad_at);
    }
    /* "é中🙂" and the empty string are valid; *bad_at is left alone. */
    const char *ok = "\xc3\xa9\xe4\xb8\xad\xf0\x9f\x99\x82";
    size_t at = 7, n = strlen(ok);
    ck_assert(dit_tok_utf8_valid(ok, n, &at) && at == 7);
    ck_assert(dit_tok_utf8_valid("", 0, &at) && at == 7);
    size_t i = 0;
    ck_assert_int_eq(dit_tok_utf8_next(ok, n, &i), 0xE9);
    ck_assert_int_eq(dit_tok_utf8_next(ok, n, &i), 0x4E2D);
    ck_assert_int_eq(dit_tok_utf8_next(ok, n, &i), 0x1F642);
    ck_assert_uint_eq(i, n);
    ck_assert_uint_eq(dit_tok_utf8_back(ok, n), 5);
    ck_assert_int_eq(dit_tok_utf8_prev(ok, 5), 0x4E2D);
    ck_assert_int_eq(dit_tok_utf8_prev(ok, 2), 0xE9);
    i = 0;
    ck_assert_int_eq(dit_tok_utf8_next("\xff"
                                       "a",
                                       2, &i),
                     0xFFFD);
    ck_assert_uint_eq(i, 1);
    ck_assert(dit_tok_is_ws(0x3000) && dit_tok_is_ws('\n') && dit_tok_is_ws(0x85));
    ck_assert(!dit_tok_is_ws(0x200B) && !dit_tok_is_ws('_'));
}
END_TEST

/* The buffer stays NUL-terminated and takes empty appends, even from NULL. */
START_TEST(test_base_buf)
{
    dit_tok_buf b = {0};
    ck_assert(dit_tok_buf_put(&b, NULL, 0));
    ck_assert(b.p != NULL && b.n == 0 && b.p[0] == '\0');
    ck_assert(dit_tok_buf_put(&b, "ab", 2));
    ck_assert(dit_tok_buf_put_cp(&b, 0x1F642));
    for (int k = 0; k < 100; k++)
        ck_assert(dit_tok_buf_put(&b, "x", 1));
    ck_assert_uint_eq(b.n, 106);
    ck_assert(memcmp(b.p, "ab\xf0\x9f\x99\x82xx", 8) == 0 && b.p[b.n] == '\0');
    free(b.p);
}
END_TEST

/* A later insertion of a key overwrites the earlier value (a Rust HashMap
 * built from the same sequence); keys are bytes with lengths, copied. */
START_TEST(test_base_map)
{
    dit_tok_map m = {0};
    ck_assert(dit_tok_map_init(&m, 4, 32));
    char key[4] = "ab";
    dit_tok_map_put(&m, key, 2, 1);
    key[0] = 'z'; /* the map holds its own copy */
    dit_tok_map_put(&m, "a", 1, 2);
    dit_tok_map_put(&m, "ab", 2, 3);
    dit_tok_map_put(&m, "", 0, 4);
    int32_t v = -1;
    ck_assert(dit_tok_map_get(&m, "ab", 2, &v) && v == 3);
    ck_assert(dit_tok_map_get(&m, "abc", 1, &v) && v == 2);
    ck_assert(dit_tok_map_get(&m, "", 0, &v) && v == 4);
    ck_assert(!dit_tok_map_get(&m, "zb", 2, &v));
    ck_assert(!dit_tok_map_get(&m, "b", 1, &v));
    /* The incremental hash is the whole-key hash. */
    uint64_t h = DIT_TOK_HASH_INIT;
    h = dit_tok_hash_step(h, 'a');
    h = dit_tok_hash_step(h, 'b');
    ck_assert(dit_tok_hash_final(h) == dit_tok_hash_bytes("ab", 2));
    ck_assert(dit_tok_map_get_hashed(&m, "ab", 2, dit_tok_hash_final(h), &v) && v == 3);
    dit_tok_map_free(&m);
    ck_assert(m.slots == NULL && m.pool == NULL);
    dit_tok_map_free(NULL);
}
END_TEST

static bool ascii_word(int32_t c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

/* Builds an added token whose match is its content. */
static void base_add(dit_tok_added_set *set, const dit_tok_map *vocab, const char *content,
                     int64_t id, dit_tok_flags flags)
{
    dit_tok_added *a = NULL;
    ck_assert_int_eq(dit_tok_added_add(set, vocab, content, id, &a), DIT_OK);
    a->flags = flags;
    ck_assert(dit_tok_added_set_match(set, (int)(a - set->v), content, strlen(content)));
}

/* Splits `text` and compares with `want`: text pieces in [brackets], tokens
 * as <id>. */
static void expect_split(const dit_tok_added_set *set, bool normalized, const char *text,
                         const char *want)
{
    dit_tok_span_list l = {0};
    ck_assert(dit_tok_added_split(set, normalized, text, strlen(text), true, &l));
    char got[256] = "";
    size_t n = 0;
    for (size_t i = 0; i < l.n; i++) {
        const dit_tok_span *sp = &l.v[i];
        if (sp->id >= 0)
            n += (size_t)snprintf(got + n, sizeof got - n, "<%d>", sp->id);
        else
            n += (size_t)snprintf(got + n, sizeof got - n, "[%.*s]", (int)sp->len, text + sp->off);
        ck_assert(sp->first == (sp->id < 0 && sp->off == 0));
    }
    ck_assert_msg(strcmp(got, want) == 0, "split of \"%s\": got %s, want %s", text, got, want);
    free(l.v);
}

/* AddedVocabulary::find_matches: leftmost-longest, single_word, lstrip and
 * rstrip (never across an earlier match), raw versus normalized tokens, and
 * add_tokens' id rules. */
START_TEST(test_base_added)
{
    dit_tok_map vocab = {0};
    ck_assert(dit_tok_map_init(&vocab, 1, 8));
    dit_tok_map_put(&vocab, "ab", 2, 7);
    dit_tok_added_set set = {.is_word = ascii_word};
    base_add(&set, &vocab, "ab", 100, (dit_tok_flags){0}); /* the vocabulary's id wins */
    base_add(&set, &vocab, "abc", 101, (dit_tok_flags){0});
    base_add(&set, &vocab, "cat", 102, (dit_tok_flags){.single_word = true});
    base_add(&set, &vocab, "L", 103, (dit_tok_flags){.lstrip = true});
    base_add(&set, &vocab, "R", 104, (dit_tok_flags){.rstrip = true});
    base_add(&set, &vocab, "nn", 105, (dit_tok_flags){.normalized = true});
    ck_assert_int_eq(set.v[0].id, 7);

    expect_split(&set, false, "", "");
    expect_split(&set, false, "xabcd ab", "[x]<101>[d ]<7>");
    expect_split(&set, false, "cat concat cat.", "<102>[ concat ]<102>[.]");
    /* A discarded single_word match still moves the scan past it. */
    expect_split(&set, false, "xcat", "[xcat]");
    expect_split(&set, false, "a \t L b", "[a]<103>[ b]");
    expect_split(&set, false, "R  L", "<104><103>");
    expect_split(&set, false, "aR \n b", "[a]<104>[b]");
    expect_split(&set, false, "nn", "[nn]");
    expect_split(&set, true, "a nn b ab", "[a ]<105>[ b ab]");

    /* Adding a known content returns the same entry; a new one needs an id. */
    dit_tok_added *a = NULL;
    ck_assert_int_eq(dit_tok_added_add(&set, &vocab, "cat", 5, &a), DIT_OK);
    ck_assert(a == &set.v[2] && a->id == 102);
    ck_assert_int_eq(dit_tok_added_add(&set, &vocab, "dog", -1, &a), DIT_ERR_NOT_FOUND);
    ck_assert_int_eq(dit_tok_added_add(&set, &vocab, "dog", (int64_t)1 << 31, &a),
                     DIT_ERR_NOT_FOUND);
    ck_assert_int_eq(set.n, 6);
    ck_assert(dit_tok_added_find(&set, "abc") == &set.v[1]);
    ck_assert(dit_tok_added_find(&set, "ca") == NULL);
    dit_tok_added_free(&set);
    ck_assert(set.n == 0 && set.v == NULL);
    dit_tok_map_free(&vocab);
}
END_TEST

/* A normalizer that lowercases ASCII, and a model that gives one id per
 * piece: 1000 + its length, or 2000 + its length for the piece that starts
 * the text. */
static dit_status lower_ascii(void *ctx, const char *s, size_t len, const char **out,
                              size_t *out_len)
{
    dit_tok_buf *b = ctx;
    b->n = 0;
    for (size_t i = 0; i < len; i++) {
        char c = s[i] >= 'A' && s[i] <= 'Z' ? (char)(s[i] - 'A' + 'a') : s[i];
        if (!dit_tok_buf_put(b, &c, 1))
            return DIT_ERR_NOMEM;
    }
    *out = b->p;
    *out_len = b->n;
    return DIT_OK;
}

static dit_status piece_len(void *ctx, const char *s, size_t len, bool first, dit_tok_ids *out)
{
    (void)ctx;
    (void)s;
    dit_tok_ids_push(out, (first ? 2000 : 1000) + (int32_t)len);
    return DIT_OK;
}

/* Raw tokens are cut out before the normalizer, normalized ones after it;
 * encoding stops at the cap; the post-processor frames and pads. */
START_TEST(test_base_pipeline)
{
    dit_tok_map vocab = {0};
    ck_assert(dit_tok_map_init(&vocab, 1, 1));
    dit_tok_added_set set = {.is_word = ascii_word};
    base_add(&set, &vocab, "<s>", 50, (dit_tok_flags){.special = true});
    base_add(&set, &vocab, "ab", 60, (dit_tok_flags){.normalized = true});
    dit_tok_buf nb = {0};
    dit_tok_span_list outer = {0}, inner = {0};
    int32_t ids[16];
    dit_tok_ids out = {ids + 1, 0, 10, false};
    const char *text = "zAB<s>xAb<S>";
    ck_assert_int_eq(dit_tok_encode_text(&set, text, strlen(text), lower_ascii, piece_len, &nb,
                                         &outer, &inner, &out),
                     DIT_OK);
    static const int32_t want[] = {2001, 60, 50, 1001, 60, 1003};
    ck_assert_int_eq(out.n, 6);
    ck_assert(!out.overflow);
    ck_assert(memcmp(ids + 1, want, sizeof want) == 0);
    const int32_t bos = 1, eos[2] = {2, 3};
    ck_assert_int_eq(dit_tok_ids_finish(ids, 12, &bos, 1, out.n, eos, 2, 0), 9);
    static const int32_t framed[12] = {1, 2001, 60, 50, 1001, 60, 1003, 2, 3, 0, 0, 0};
    ck_assert(memcmp(ids, framed, sizeof framed) == 0);
    out = (dit_tok_ids){ids, 0, 3, false};
    ck_assert_int_eq(dit_tok_encode_text(&set, text, strlen(text), lower_ascii, piece_len, &nb,
                                         &outer, &inner, &out),
                     DIT_OK);
    ck_assert(out.n == 3 && out.overflow && ids[2] == 50);
    free(nb.p);
    free(outer.v);
    free(inner.v);
    dit_tok_added_free(&set);
    dit_tok_map_free(&vocab);
}
END_TEST

/* Token ids as JSON numbers and as added_tokens_decoder keys; the optional
 * config file; model_max_length's defaults and bounds. */
START_TEST(test_base_config)
{
    cJSON *j = cJSON_Parse("{\"a\": 3, \"b\": 3.5, \"c\": -1, \"d\": 2147483648, \"e\": \"3\","
                           " \"t\": true, \"n\": null, \"s\": \"yes\"}");
    ck_assert(j != NULL);
    int64_t id = -1;
    ck_assert(dit_tok_json_id(cJSON_GetObjectItem(j, "a"), &id) && id == 3);
    ck_assert(!dit_tok_json_id(cJSON_GetObjectItem(j, "b"), &id));
    ck_assert(!dit_tok_json_id(cJSON_GetObjectItem(j, "c"), &id));
    ck_assert(!dit_tok_json_id(cJSON_GetObjectItem(j, "d"), &id));
    ck_assert(!dit_tok_json_id(cJSON_GetObjectItem(j, "e"), &id));
    ck_assert(!dit_tok_json_id(NULL, &id));
    ck_assert(dit_tok_key_id("2147483647", &id) && id == INT32_MAX);
    ck_assert(!dit_tok_key_id("2147483648", &id));
    ck_assert(!dit_tok_key_id("-1", &id));
    ck_assert(!dit_tok_key_id("1x", &id));
    ck_assert(!dit_tok_key_id("", &id));
    bool f = false;
    ck_assert(dit_tok_json_flag(j, "t", false, &f) && f);
    ck_assert(dit_tok_json_flag(j, "n", true, &f) && f);
    ck_assert(dit_tok_json_flag(j, "missing", false, &f) && !f);
    ck_assert(!dit_tok_json_flag(j, "s", false, &f));
    cJSON_Delete(j);

    dit_diag d = {0};
    cJSON *cfg = (cJSON *)&d; /* must be reset to NULL */
    ck_assert_int_eq(dit_tok_json_load_optional("/nonexistent/tokenizer_config.json", &cfg, &d),
                     DIT_OK);
    ck_assert(cfg == NULL && dit_diag_msg(&d)[0] != '\0' && d.msg[0] == '\0');

    static const struct {
        const char *json;
        int min, want;
        dit_status st;
    } ml[] = {
        {"{}", 2, 77, DIT_OK},
        {"{\"model_max_length\": null}", 2, 77, DIT_OK},
        {"{\"model_max_length\": 64}", 2, 64, DIT_OK},
        {"{\"model_max_length\": 1e30}", 1, 77, DIT_OK},
        {"{\"model_max_length\": 64.5}", 1, 77, DIT_OK},
        {"{\"model_max_length\": 1}", 2, 77, DIT_ERR_FORMAT},
        {"{\"model_max_length\": \"64\"}", 1, 77, DIT_ERR_FORMAT},
    };
    for (size_t i = 0; i < sizeof ml / sizeof ml[0]; i++) {
        cJSON *c = cJSON_Parse(ml[i].json);
        ck_assert(c != NULL);
        int out = -1;
        dit_diag_clear(&d);
        ck_assert_int_eq(dit_tok_config_max_length(c, "cfg.json", ml[i].min, 77, &out, &d),
                         ml[i].st);
        ck_assert_int_eq(out, ml[i].want);
        if (ml[i].st != DIT_OK)
            ck_assert_msg(strstr(dit_diag_msg(&d), "cfg.json: \"model_max_length\" must be"), "%s",
                          dit_diag_msg(&d));
        cJSON_Delete(c);
    }
    int out = -1;
    ck_assert_int_eq(dit_tok_config_max_length(NULL, "cfg.json", 1, 512, &out, &d), DIT_OK);
    ck_assert_int_eq(out, 512);
}
END_TEST

/* ---- malformed folders: CLIP ------------------------------------------------------------ */

#define TEST_DIR(var)                                                                              \
    char var[PATH_MAX];                                                                            \
    make_dir(var, __func__)

static const char small_vocab[] = "{\"a\": 0, \"b\": 1, \"ab\": 2, \"a</w>\": 3, \"b</w>\": 4, "
                                  "\"ab</w>\": 5, \"<|startoftext|>\": 6, \"<|endoftext|>\": 7}";
static const char small_merges[] = "#version: 0.2\na b\na b</w>\n";

/* Loads a CLIP folder expecting `want`, with a message containing `needle`. */
static void expect_clip_error(const char *dir, dit_status want, const char *needle)
{
    dit_clip_tokenizer *t = (dit_clip_tokenizer *)&t; /* must be reset to NULL */
    dit_diag d = {0};
    dit_status st = dit_clip_tokenizer_load(dir, &t, &d);
    ck_assert_msg(st == want, "status %s, want %s (%s)", dit_status_name(st), dit_status_name(want),
                  dit_diag_msg(&d));
    ck_assert(t == NULL);
    ck_assert_msg(strstr(dit_diag_msg(&d), needle), "message \"%s\" lacks \"%s\"", dit_diag_msg(&d),
                  needle);
}

START_TEST(test_clip_small_ok)
{
    TEST_DIR(dir);
    write_text(dir, "vocab.json", small_vocab);
    write_text(dir, "merges.txt", small_merges);
    dit_clip_tokenizer *t = NULL;
    dit_diag d = {0};
    ck_assert_msg(dit_clip_tokenizer_load(dir, &t, &d) == DIT_OK, "%s", dit_diag_msg(&d));
    int32_t ids[8];
    int n;
    bool cut;
    /* "ab ab" -> <s> ab</w> ab</w> </s>; "b" -> b</w>; "c" has no symbol and
     * becomes the unk token (<|endoftext|>). */
    ck_assert_int_eq(dit_clip_tokenizer_encode(t, "AB ab b c", ids, 8, &n, &cut, &d), DIT_OK);
    int32_t want[8] = {6, 5, 5, 4, 7, 7, 7, 7};
    ck_assert_int_eq(n, 6);
    ck_assert_mem_eq(ids, want, sizeof want - 2 * sizeof(int32_t));
    dit_clip_tokenizer_free(t);
}
END_TEST

/* The same small tokenizer as transformers 5 saves it; older tokenizers
 * wrote merges as "a b" strings, newer ones as pairs: both load. */
START_TEST(test_clip_tokenizer_json_ok)
{
    TEST_DIR(dir);
    char json[1024];
    snprintf(json, sizeof json,
             "{\"added_tokens\": [{\"id\": 7, \"content\": \"<|endoftext|>\", \"special\": true}],"
             " \"model\": {\"type\": \"BPE\", \"vocab\": %s, \"merges\": [\"a b\", [\"a\", "
             "\"b</w>\"]]}}",
             small_vocab);
    write_text(dir, "tokenizer.json", json);
    dit_clip_tokenizer *t = NULL;
    dit_diag d = {0};
    ck_assert_msg(dit_clip_tokenizer_load(dir, &t, &d) == DIT_OK, "%s", dit_diag_msg(&d));
    int32_t ids[8];
    int n;
    bool cut;
    ck_assert_int_eq(dit_clip_tokenizer_encode(t, "AB ab b c", ids, 8, &n, &cut, &d), DIT_OK);
    int32_t want[8] = {6, 5, 5, 4, 7, 7, 7, 7};
    ck_assert_int_eq(n, 6);
    ck_assert_mem_eq(ids, want, sizeof want);
    dit_clip_tokenizer_free(t);
}
END_TEST

START_TEST(test_clip_tokenizer_json_malformed)
{
    TEST_DIR(dir);
    write_text(dir, "vocab.json", small_vocab);
    write_text(dir, "merges.txt", small_merges);
    /* tokenizer.json wins over vocab.json + merges.txt, so its errors show. */
    write_text(dir, "tokenizer.json", "{\"model\": ");
    expect_clip_error(dir, DIT_ERR_FORMAT, "tokenizer.json");
    write_text(dir, "tokenizer.json", "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "tokenizer.json: \"model\" is not a BPE model");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"type\": \"BPE\", \"vocab\": [], \"merges\": []}}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "tokenizer.json: the vocabulary is not a JSON object");
    write_text(dir, "tokenizer.json", "{\"model\": {\"vocab\": {\"a\": 0}, \"merges\": 3}}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "model.merges is not a list");
    write_text(dir, "tokenizer.json", "{\"model\": {\"vocab\": {\"a\": 0}, \"merges\": [[1, 2]]}}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "merge 0 is not a pair of tokens");
    write_text(dir, "tokenizer.json",
               "{\"model\": {\"vocab\": {\"a\": 0}, \"merges\": [\"a a\"]}}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "merge 0: merged token \"aa\" is not in the vocabulary");
    write_text(dir, "tokenizer.json",
               "{\"added_tokens\": {}, \"model\": {\"vocab\": {\"a\": 0}, \"merges\": []}}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "\"added_tokens\" is not a list");
    write_text(dir, "tokenizer.json",
               "{\"added_tokens\": [{\"content\": \"x\"}], \"model\": {\"vocab\": {\"a\": 0}, "
               "\"merges\": []}}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "has no valid id");
}
END_TEST

START_TEST(test_clip_missing_dir)
{
    char dir[PATH_MAX];
    fmt_path(dir, "%s/does_not_exist", tmp_root);
    expect_clip_error(dir, DIT_ERR_NOT_FOUND, "vocab.json");
}
END_TEST

START_TEST(test_clip_missing_merges)
{
    TEST_DIR(dir);
    write_text(dir, "vocab.json", small_vocab);
    expect_clip_error(dir, DIT_ERR_NOT_FOUND, "merges.txt");
}
END_TEST

START_TEST(test_clip_vocab_not_json)
{
    TEST_DIR(dir);
    write_text(dir, "vocab.json", "{\"a\": 0,");
    write_text(dir, "merges.txt", small_merges);
    expect_clip_error(dir, DIT_ERR_FORMAT, "vocab.json");
}
END_TEST

START_TEST(test_clip_vocab_bad_id)
{
    TEST_DIR(dir);
    write_text(dir, "vocab.json", "{\"a\": 0, \"b\": \"one\"}");
    write_text(dir, "merges.txt", small_merges);
    expect_clip_error(dir, DIT_ERR_FORMAT, "vocab.json: the id of token \"b\"");
    write_text(dir, "vocab.json", "{\"a\": -1}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "vocab.json");
    write_text(dir, "vocab.json", "{\"a\": 0.5}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "vocab.json");
    write_text(dir, "vocab.json", "[\"a\"]");
    expect_clip_error(dir, DIT_ERR_FORMAT, "vocab.json");
    write_text(dir, "vocab.json", "{}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "empty");
}
END_TEST

START_TEST(test_clip_merges_malformed)
{
    TEST_DIR(dir);
    write_text(dir, "vocab.json", small_vocab);
    write_text(dir, "merges.txt", "#version: 0.2\na b\na b c\n");
    expect_clip_error(dir, DIT_ERR_FORMAT, "merges.txt: line 3");
    write_text(dir, "merges.txt", "a b\n\n");
    expect_clip_error(dir, DIT_ERR_FORMAT, "merges.txt: line 2");
    write_text(dir, "merges.txt", "ab\n");
    expect_clip_error(dir, DIT_ERR_FORMAT, "line 1 is not two tokens");
    write_text(dir, "merges.txt", "a  b\n");
    expect_clip_error(dir, DIT_ERR_FORMAT, "line 1");
    write_text(dir, "merges.txt", "a x\n");
    expect_clip_error(dir, DIT_ERR_FORMAT, "token \"x\" is not in the vocabulary");
    write_text(dir, "merges.txt", "b a\n");
    expect_clip_error(dir, DIT_ERR_FORMAT, "merged token \"ba\" is not in the vocabulary");
    write_file(dir, "merges.txt", "a\0b\n", 4);
    expect_clip_error(dir, DIT_ERR_FORMAT, "merges.txt: line 1");
}
END_TEST

START_TEST(test_clip_config_malformed)
{
    TEST_DIR(dir);
    write_text(dir, "vocab.json", small_vocab);
    write_text(dir, "merges.txt", small_merges);
    write_text(dir, "tokenizer_config.json", "not json");
    expect_clip_error(dir, DIT_ERR_FORMAT, "tokenizer_config.json");
    write_text(dir, "tokenizer_config.json", "{\"model_max_length\": \"long\"}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "model_max_length");
    write_text(dir, "tokenizer_config.json", "{\"added_tokens_decoder\": {\"x\": {}}}");
    expect_clip_error(dir, DIT_ERR_FORMAT,
                      "tokenizer_config.json: added token \"x\" has no valid id");
    write_text(dir, "tokenizer_config.json", "{\"added_tokens_decoder\": {\"6\": 3}}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "tokenizer_config.json: an added token is neither");
    write_text(dir, "tokenizer_config.json", "{\"added_tokens_decoder\": [1]}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "\"added_tokens_decoder\" is not an object");
    write_text(dir, "tokenizer_config.json",
               "{\"added_tokens_decoder\": {\"6\": {\"content\": \"<|startoftext|>\", "
               "\"lstrip\": \"yes\"}}}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "\"lstrip\"");
    write_text(dir, "tokenizer_config.json", "{\"bos_token\": 5}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "bos_token");
    write_text(dir, "tokenizer_config.json", "{\"pad_token\": \"<nowhere>\"}");
    expect_clip_error(dir, DIT_ERR_FORMAT, "<nowhere>");
    char cfg[PATH_MAX];
    fmt_path(cfg, "%s/tokenizer_config.json", dir);
    ck_assert(unlink(cfg) == 0);
    write_text(dir, "special_tokens_map.json", "[1]");
    expect_clip_error(dir, DIT_ERR_FORMAT, "special_tokens_map.json");
}
END_TEST

/* ---- malformed folders: T5 ---------------------------------------------------------------- */

static void expect_t5_error(const char *dir, dit_status want, const char *needle)
{
    dit_t5_tokenizer *t = (dit_t5_tokenizer *)&t;
    dit_diag d = {0};
    dit_status st = dit_t5_tokenizer_load(dir, &t, &d);
    ck_assert_msg(st == want, "status %s, want %s (%s)", dit_status_name(st), dit_status_name(want),
                  dit_diag_msg(&d));
    ck_assert(t == NULL);
    ck_assert_msg(strstr(dit_diag_msg(&d), needle), "message \"%s\" lacks \"%s\"", dit_diag_msg(&d),
                  needle);
}

/* A tokenizer.json built from parts (NULL: the default part). */
static void write_t5_json(const char *dir, const char *normalizer, const char *pre,
                          const char *model, const char *post)
{
    char buf[8192];
    snprintf(buf, sizeof buf,
             "{\"version\": \"1.0\", \"added_tokens\": [{\"id\": 0, \"content\": \"<pad>\", "
             "\"special\": true}, {\"id\": 1, \"content\": \"</s>\", \"special\": true}], "
             "\"normalizer\": %s, \"pre_tokenizer\": %s, \"model\": %s, \"post_processor\": %s}",
             normalizer ? normalizer : "null",
             pre ? pre
                 : "{\"type\": \"Metaspace\", \"replacement\": \"\\u2581\", \"prepend_scheme\": "
                   "\"always\", \"split\": true}",
             model ? model
                   : "{\"type\": \"Unigram\", \"unk_id\": 2, \"vocab\": [[\"<pad>\", 0], "
                     "[\"</s>\", 0], [\"<unk>\", 0], [\"\\u2581\", -2], [\"a\", -3], "
                     "[\"\\u2581ab\", -1], [\"b\", -3]]}",
             post ? post
                  : "{\"type\": \"TemplateProcessing\", \"single\": [{\"Sequence\": {\"id\": "
                    "\"A\", \"type_id\": 0}}, {\"SpecialToken\": {\"id\": \"</s>\", "
                    "\"type_id\": 0}}], \"special_tokens\": {\"</s>\": {\"id\": \"</s>\", "
                    "\"ids\": [1], \"tokens\": [\"</s>\"]}}}");
    write_text(dir, "tokenizer.json", buf);
}

START_TEST(test_t5_small_ok)
{
    TEST_DIR(dir);
    write_t5_json(dir,
                  "{\"type\": \"Replace\", \"pattern\": {\"Regex\": \" {2,}\"}, \"content\": "
                  "\" \"}",
                  NULL, NULL, NULL);
    dit_t5_tokenizer *t = NULL;
    dit_diag d = {0};
    ck_assert_msg(dit_t5_tokenizer_load(dir, &t, &d) == DIT_OK, "%s", dit_diag_msg(&d));
    int32_t ids[8];
    int n;
    bool cut;
    /* "ab  ba" -> ▁ab ▁ b a; "xy" -> ▁ <unk> (x and y fused). */
    ck_assert_int_eq(dit_t5_tokenizer_encode(t, "ab  ba xy", ids, 8, &n, &cut, &d), DIT_OK);
    int32_t want[8] = {5, 3, 6, 4, 3, 2, 1, 0};
    ck_assert_int_eq(n, 7);
    ck_assert(!cut);
    ck_assert_mem_eq(ids, want, sizeof want);
    dit_t5_tokenizer_free(t);
}
END_TEST

START_TEST(test_t5_missing)
{
    char dir[PATH_MAX];
    fmt_path(dir, "%s/does_not_exist", tmp_root);
    expect_t5_error(dir, DIT_ERR_NOT_FOUND, "tokenizer.json");
}
END_TEST

START_TEST(test_t5_json_malformed)
{
    TEST_DIR(dir);
    write_text(dir, "tokenizer.json", "{\"model\": ");
    expect_t5_error(dir, DIT_ERR_FORMAT, "tokenizer.json");
    write_t5_json(dir, NULL, NULL, NULL, NULL);
    write_text(dir, "tokenizer_config.json", "{");
    expect_t5_error(dir, DIT_ERR_FORMAT, "tokenizer_config.json");
    write_text(dir, "tokenizer_config.json", "{\"pad_token\": \"<nope>\"}");
    expect_t5_error(dir, DIT_ERR_FORMAT, "pad token \"<nope>\"");
    write_text(dir, "tokenizer_config.json", "{\"added_tokens_decoder\": {\"0\": {}}}");
    expect_t5_error(dir, DIT_ERR_FORMAT, "tokenizer_config.json: added token 0");
}
END_TEST

START_TEST(test_t5_model_malformed)
{
    TEST_DIR(dir);
    write_t5_json(dir, NULL, NULL, "{\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}", NULL);
    expect_t5_error(dir, DIT_ERR_UNSUPPORTED, "model type \"BPE\"");
    write_t5_json(dir, NULL, NULL, "{\"type\": \"Unigram\", \"unk_id\": 0, \"vocab\": []}", NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "\"vocab\" is missing or empty");
    write_t5_json(dir, NULL, NULL,
                  "{\"type\": \"Unigram\", \"unk_id\": 0, \"vocab\": [[\"a\", \"x\"]]}", NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "entry 0 is not [piece, score]");
    write_t5_json(dir, NULL, NULL,
                  "{\"type\": \"Unigram\", \"unk_id\": 3, \"vocab\": [[\"a\", 0]]}", NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "unk_id");
    write_t5_json(dir, NULL, NULL,
                  "{\"type\": \"Unigram\", \"unk_id\": 0, \"byte_fallback\": true, \"vocab\": "
                  "[[\"a\", 0]]}",
                  NULL);
    expect_t5_error(dir, DIT_ERR_UNSUPPORTED, "byte_fallback");
    write_t5_json(dir, NULL, NULL, NULL, "{\"type\": \"RobertaProcessing\"}");
    expect_t5_error(dir, DIT_ERR_UNSUPPORTED, "post_processor type \"RobertaProcessing\"");
    write_t5_json(dir, NULL, NULL, NULL,
                  "{\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": "
                  "\"</s>\"}}], \"special_tokens\": {}}");
    expect_t5_error(dir, DIT_ERR_FORMAT, "without ids");
}
END_TEST

START_TEST(test_t5_components_unsupported)
{
    TEST_DIR(dir);
    write_t5_json(dir, "{\"type\": \"NFKC\"}", NULL, NULL, NULL);
    expect_t5_error(dir, DIT_ERR_UNSUPPORTED, "normalizer type \"NFKC\"");
    write_t5_json(dir, "{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Lowercase\"}]}",
                  NULL, NULL, NULL);
    expect_t5_error(dir, DIT_ERR_UNSUPPORTED, "normalizer type \"Lowercase\"");
    write_t5_json(dir, NULL, "{\"type\": \"ByteLevel\"}", NULL, NULL);
    expect_t5_error(dir, DIT_ERR_UNSUPPORTED, "pre_tokenizer type \"ByteLevel\"");
    write_t5_json(dir,
                  "{\"type\": \"Replace\", \"pattern\": {\"Regex\": \"[a-z]+\"}, "
                  "\"content\": \"x\"}",
                  NULL, NULL, NULL);
    expect_t5_error(dir, DIT_ERR_UNSUPPORTED, "Replace regex \"[a-z]+\"");
    write_t5_json(dir, "{\"type\": \"Replace\", \"content\": \"x\"}", NULL, NULL, NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "Replace normalizer needs");
    write_t5_json(dir, NULL,
                  "{\"type\": \"Metaspace\", \"replacement\": \"ab\", \"prepend_scheme\": "
                  "\"always\"}",
                  NULL, NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "one character");
    write_t5_json(dir, NULL,
                  "{\"type\": \"Metaspace\", \"replacement\": \"_\", \"prepend_scheme\": "
                  "\"sometimes\"}",
                  NULL, NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "prepend_scheme");
    write_t5_json(dir, "{\"normalizers\": []}", NULL, NULL, NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "normalizer without a \"type\"");
}
END_TEST

START_TEST(test_t5_charsmap_malformed)
{
    TEST_DIR(dir);
    write_t5_json(dir, "{\"type\": \"Precompiled\", \"precompiled_charsmap\": \"*not base64*\"}",
                  NULL, NULL, NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "not valid base64");
    write_t5_json(dir, "{\"type\": \"Precompiled\"}", NULL, NULL, NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "precompiled_charsmap");
    write_t5_json(dir, "{\"type\": \"Precompiled\", \"precompiled_charsmap\": \"\"}", NULL, NULL,
                  NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "too short");
    /* Trie size 0x100 bytes, but only one unit follows: AAEAAAAAAAA= */
    write_t5_json(dir, "{\"type\": \"Precompiled\", \"precompiled_charsmap\": \"AAEAAAAAAAA=\"}",
                  NULL, NULL, NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "does not fit");
    /* A blob that is not UTF-8: size 4, unit 0, blob FF: BAAAAAAAAAD/ */
    write_t5_json(dir, "{\"type\": \"Precompiled\", \"precompiled_charsmap\": \"BAAAAAAAAAD/\"}",
                  NULL, NULL, NULL);
    expect_t5_error(dir, DIT_ERR_FORMAT, "not valid UTF-8");
}
END_TEST

/* A trie whose root points far outside it loads (the format cannot be
 * checked up front) but encoding reports it instead of reading out of
 * bounds: size 4, unit 0xFFFFFC00 (offset 0x3FFFFF): BAAAAAD8//8= */
START_TEST(test_t5_charsmap_out_of_bounds)
{
    TEST_DIR(dir);
    write_t5_json(dir, "{\"type\": \"Precompiled\", \"precompiled_charsmap\": \"BAAAAAD8//8=\"}",
                  NULL, NULL, NULL);
    dit_t5_tokenizer *t = NULL;
    dit_diag d = {0};
    ck_assert_msg(dit_t5_tokenizer_load(dir, &t, &d) == DIT_OK, "%s", dit_diag_msg(&d));
    int32_t ids[8];
    ck_assert_int_eq(dit_t5_tokenizer_encode(t, "ab", ids, 8, NULL, NULL, &d), DIT_ERR_FORMAT);
    ck_assert_msg(strstr(dit_diag_msg(&d), "tokenizer.json") && strstr(dit_diag_msg(&d), "corrupt"),
                  "%s", dit_diag_msg(&d));
    dit_t5_tokenizer_free(t);
}
END_TEST

static Suite *tokenizers_suite(void)
{
    Suite *s = suite_create("tokenizers");

    TCase *ref = tcase_create("transformers");
    tcase_add_unchecked_fixture(ref, tmp_setup, tmp_teardown);
    tcase_set_timeout(ref, 300);
    tcase_add_test(ref, test_clip_cases);
    tcase_add_test(ref, test_t5_cases);
    tcase_add_test(ref, test_clip_variants);
    tcase_add_test(ref, test_t5_variants);
    suite_add_tcase(s, ref);

    TCase *api = tcase_create("api");
    tcase_set_timeout(api, 300);
    tcase_add_test(api, test_api_edges);
    tcase_add_test(api, test_invalid_utf8);
    tcase_add_test(api, test_random_text);
    tcase_add_test(api, test_long_prompt);
    suite_add_tcase(s, api);

    TCase *base = tcase_create("base");
    tcase_add_test(base, test_base_utf8);
    tcase_add_test(base, test_base_buf);
    tcase_add_test(base, test_base_map);
    tcase_add_test(base, test_base_added);
    tcase_add_test(base, test_base_pipeline);
    tcase_add_test(base, test_base_config);
    suite_add_tcase(s, base);

    TCase *bad = tcase_create("malformed");
    tcase_add_unchecked_fixture(bad, tmp_setup, tmp_teardown);
    tcase_add_test(bad, test_clip_small_ok);
    tcase_add_test(bad, test_clip_tokenizer_json_ok);
    tcase_add_test(bad, test_clip_tokenizer_json_malformed);
    tcase_add_test(bad, test_clip_missing_dir);
    tcase_add_test(bad, test_clip_missing_merges);
    tcase_add_test(bad, test_clip_vocab_not_json);
    tcase_add_test(bad, test_clip_vocab_bad_id);
    tcase_add_test(bad, test_clip_merges_malformed);
    tcase_add_test(bad, test_clip_config_malformed);
    tcase_add_test(bad, test_t5_small_ok);
    tcase_add_test(bad, test_t5_missing);
    tcase_add_test(bad, test_t5_json_malformed);
    tcase_add_test(bad, test_t5_model_malformed);
    tcase_add_test(bad, test_t5_components_unsupported);
    tcase_add_test(bad, test_t5_charsmap_malformed);
    tcase_add_test(bad, test_t5_charsmap_out_of_bounds);
    suite_add_tcase(s, bad);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(tokenizers_suite());
    srunner_run_all(sr, CK_ENV); /* CK_VERBOSITY picks the output; normal by default */
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
