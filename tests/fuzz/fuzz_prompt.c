/* Prompts: the text a client sends, through everything that reads it in a
 * worker: UTF-8 checking, Wan's prompt_clean (html.unescape twice, the
 * whitespace rules), CLIP's BPE tokenizer, T5's unigram tokenizer and the
 * UMT5 tokenizer of the Wan demo pipeline. The input is the prompt's bytes
 * (a NUL ends it, as protobuf-c hands strings over).
 *
 * Properties: invalid UTF-8 is refused with DIT_ERR_INVALID_ARG by each
 * reader, valid text is accepted; cleaned text is valid UTF-8 with no
 * whitespace but single spaces between words; token rows are max_length
 * ids of the documented shape (BOS .. EOS for CLIP, then padding),
 * truncated exactly when the text did not fit, and the same on a second
 * encode. */
#include <stdbool.h>
#include <string.h>

#include "core/utf8.h"
#include "encoders/clip_tokenizer.h"
#include "encoders/prompt_clean.h"
#include "encoders/t5_tokenizer.h"
#include "fuzz.h"

#define MAX_IDS 512

typedef struct prompt_ctx {
    dit_clip_tokenizer *clip;
    dit_t5_tokenizer *t5, *umt5;
    int32_t ids[MAX_IDS], again[MAX_IDS];
} prompt_ctx;

static void teardown(void *p)
{
    prompt_ctx *c = p;
    dit_clip_tokenizer_free(c->clip);
    dit_t5_tokenizer_free(c->t5);
    dit_t5_tokenizer_free(c->umt5);
    free(c);
}

static void *setup(const char *root)
{
    prompt_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    char path[4096];
    dit_diag d;
    dit_diag_clear(&d);
    snprintf(path, sizeof path, "%s/tests/data/tokenizers/clip", root);
    if (dit_clip_tokenizer_load(path, &c->clip, &d) != DIT_OK)
        goto fail;
    snprintf(path, sizeof path, "%s/tests/data/tokenizers/t5", root);
    if (dit_t5_tokenizer_load(path, &c->t5, &d) != DIT_OK)
        goto fail;
    snprintf(path, sizeof path, "%s/tests/data/wan_demo/tokenizer", root);
    if (dit_t5_tokenizer_load(path, &c->umt5, &d) != DIT_OK)
        goto fail;
    return c;
fail:
    fprintf(stderr, "fuzz_prompt: %s\n", dit_diag_msg(&d));
    teardown(c);
    return NULL;
}

static uint32_t decode(const char *p, size_t len)
{
    const unsigned char *u = (const unsigned char *)p;
    switch (len) {
    case 1:
        return u[0];
    case 2:
        return ((uint32_t)(u[0] & 0x1f) << 6) | (u[1] & 0x3f);
    case 3:
        return ((uint32_t)(u[0] & 0x0f) << 12) | ((uint32_t)(u[1] & 0x3f) << 6) | (u[2] & 0x3f);
    default:
        return ((uint32_t)(u[0] & 0x07) << 18) | ((uint32_t)(u[1] & 0x3f) << 12) |
               ((uint32_t)(u[2] & 0x3f) << 6) | (u[3] & 0x3f);
    }
}

/* prompt_clean's output: valid UTF-8, words separated by one U+0020, no
 * space at either end, no other whitespace. */
static void check_clean(const char *s)
{
    size_t n = strlen(s);
    DIT_FUZZ_REQUIRE(dit_utf8_valid(s, n), "prompt_clean gave invalid UTF-8");
    bool prev_space = true; /* a leading space counts as a double one */
    for (size_t i = 0; i < n;) {
        size_t len = dit_utf8_len(s + i, n - i);
        uint32_t cp = decode(s + i, len);
        bool space = dit_unicode_is_space(cp);
        DIT_FUZZ_REQUIRE(!space || cp == ' ', "prompt_clean left whitespace U+%04X", cp);
        DIT_FUZZ_REQUIRE(!(space && prev_space), "prompt_clean left a space at %zu of \"%s\"", i,
                         s);
        prev_space = space;
        i += len;
    }
    DIT_FUZZ_REQUIRE(n == 0 || !prev_space, "prompt_clean left a trailing space");
}

static void check_row(const int32_t *ids, int max_length, int n_tokens, bool truncated, int32_t pad,
                      const char *which)
{
    DIT_FUZZ_REQUIRE(n_tokens >= 1 && n_tokens <= max_length, "%s: %d tokens of %d", which,
                     n_tokens, max_length);
    DIT_FUZZ_REQUIRE(!truncated || n_tokens == max_length, "%s: truncated at %d of %d", which,
                     n_tokens, max_length);
    for (int i = 0; i < max_length; i++) {
        DIT_FUZZ_REQUIRE(ids[i] >= 0, "%s: id %d at %d", which, ids[i], i);
        if (i >= n_tokens)
            DIT_FUZZ_REQUIRE(ids[i] == pad, "%s: %d after the tokens, not the pad %d", which,
                             ids[i], pad);
    }
}

static void encode_clip(prompt_ctx *c, const char *s, bool valid, int L)
{
    int nt = -1;
    bool cut = false;
    dit_diag d;
    dit_diag_clear(&d);
    dit_status st = dit_clip_tokenizer_encode(c->clip, s, c->ids, L, &nt, &cut, &d);
    if (!valid) {
        DIT_FUZZ_REQUIRE(st == DIT_ERR_INVALID_ARG, "CLIP took invalid UTF-8 (%s)",
                         dit_status_name(st));
        return;
    }
    DIT_FUZZ_REQUIRE(st == DIT_OK, "CLIP refused valid UTF-8: %s", dit_diag_msg(&d));
    DIT_FUZZ_REQUIRE(nt >= 2, "CLIP: %d tokens", nt);
    check_row(c->ids, L, nt, cut, dit_clip_tokenizer_pad_id(c->clip), "CLIP");
    DIT_FUZZ_REQUIRE(c->ids[0] == dit_clip_tokenizer_bos_id(c->clip), "CLIP: no BOS first");
    DIT_FUZZ_REQUIRE(c->ids[nt - 1] == dit_clip_tokenizer_eos_id(c->clip), "CLIP: no EOS last");
    int nt2 = -1;
    bool cut2 = false;
    st = dit_clip_tokenizer_encode(c->clip, s, c->again, L, &nt2, &cut2, &d);
    DIT_FUZZ_REQUIRE(st == DIT_OK && nt2 == nt && cut2 == cut &&
                         !memcmp(c->ids, c->again, sizeof(int32_t) * (size_t)L),
                     "CLIP: a second encode differs");
}

static void encode_t5(const dit_t5_tokenizer *t, int32_t *ids, const char *s, bool valid, int L,
                      const char *which)
{
    int nt = -1;
    bool cut = false;
    dit_diag d;
    dit_diag_clear(&d);
    dit_status st = dit_t5_tokenizer_encode(t, s, ids, L, &nt, &cut, &d);
    if (!valid) {
        DIT_FUZZ_REQUIRE(st == DIT_ERR_INVALID_ARG, "%s took invalid UTF-8 (%s)", which,
                         dit_status_name(st));
        return;
    }
    DIT_FUZZ_REQUIRE(st == DIT_OK, "%s refused valid UTF-8: %s", which, dit_diag_msg(&d));
    check_row(ids, L, nt, cut, dit_t5_tokenizer_pad_id(t), which);
}

static int run(void *p, const uint8_t *data, size_t size)
{
    prompt_ctx *c = p;
    char *s = malloc(size + 1);
    char *once = NULL, *clean = NULL;
    if (!s)
        return -1;
    memcpy(s, data, size);
    s[size] = 0;
    const size_t n = strlen(s);
    const bool valid = dit_utf8_valid(s, n);
    dit_diag d;
    dit_diag_clear(&d);

    dit_status st = dit_html_unescape(s, &once, &d);
    DIT_FUZZ_REQUIRE(valid ? st == DIT_OK : st == DIT_ERR_INVALID_ARG,
                     "html_unescape on %s UTF-8: %s", valid ? "valid" : "invalid",
                     dit_status_name(st));
    if (st == DIT_OK)
        DIT_FUZZ_REQUIRE(dit_utf8_valid(once, strlen(once)), "html_unescape gave invalid UTF-8");

    st = dit_wan_prompt_clean(s, &clean, &d);
    DIT_FUZZ_REQUIRE(valid ? st == DIT_OK : st == DIT_ERR_INVALID_ARG,
                     "prompt_clean on %s UTF-8: %s", valid ? "valid" : "invalid",
                     dit_status_name(st));
    if (st == DIT_OK)
        check_clean(clean);

    /* Long rows as the pipelines use them, and short ones for truncation. */
    encode_clip(c, s, valid, 77);
    encode_clip(c, s, valid, 5);
    encode_t5(c->t5, c->ids, s, valid, MAX_IDS, "T5");
    encode_t5(c->t5, c->ids, s, valid, 4, "T5");
    if (clean) {
        encode_t5(c->umt5, c->ids, clean, true, MAX_IDS, "UMT5");
        encode_t5(c->umt5, c->ids, clean, true, 3, "UMT5");
    } else {
        encode_t5(c->umt5, c->ids, s, valid, 16, "UMT5");
    }
    free(once);
    free(clean);
    free(s);
    return valid ? 0 : -1;
}

const dit_fuzz_target dit_fuzz_target_def = {
    .name = "prompt", .setup = setup, .run = run, .teardown = teardown};
