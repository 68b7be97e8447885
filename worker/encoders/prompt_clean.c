/* WanPipeline's prompt_clean: html.unescape twice, whitespace runs to one
 * space, stripped. See prompt_clean.h; the comments here say where Python's
 * html.unescape (Lib/html/__init__.py) is followed step by step. */
#include "encoders/prompt_clean.h"

#include <stdlib.h>
#include <string.h>

#include "core/utf8.h"
#include "encoders/html_entities.h"

/* A growing output string. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
    bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void sb_put_cp(sbuf *b, uint32_t cp)
{
    char u[4];
    size_t n;
    if (cp < 0x80) {
        u[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        u[0] = (char)(0xC0 | (cp >> 6));
        u[1] = (char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | (cp >> 12));
        u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        u[0] = (char)(0xF0 | (cp >> 18));
        u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    sb_put(b, u, n);
}

/* Decodes the code point at s (valid UTF-8, checked beforehand); returns
 * its length in bytes. */
static size_t utf8_next(const unsigned char *s, uint32_t *cp)
{
    if (s[0] < 0x80) {
        *cp = s[0];
        return 1;
    }
    if (s[0] < 0xE0) {
        *cp = ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F);
        return 2;
    }
    if (s[0] < 0xF0) {
        *cp = ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
        return 3;
    }
    *cp = ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
          ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
    return 4;
}

bool dit_unicode_is_space(uint32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* html._invalid_charrefs for 0x80..0x9f: what Windows-1252 puts there (the
 * HTML spec's table); 0x81, 0x8d, 0x8f, 0x90, 0x9d map to themselves. */
static const uint16_t CP1252[32] = {
    0x20AC, 0x81,   0x201A, 0x0192, 0x201E, 0x2026, 0x2020, 0x2021, 0x02C6, 0x2030, 0x0160,
    0x2039, 0x0152, 0x8D,   0x017D, 0x8F,   0x90,   0x2018, 0x2019, 0x201C, 0x201D, 0x2022,
    0x2013, 0x2014, 0x02DC, 0x2122, 0x0161, 0x203A, 0x0153, 0x9D,   0x017E, 0x0178,
};

/* html._replace_charref for a numeric reference. num is saturated at
 * 0x110000 by the caller (anything larger behaves the same). */
static void put_numeric(sbuf *b, uint32_t num)
{
    if (num == 0) {
        sb_put_cp(b, 0xFFFD);
    } else if (num == 0x0D) {
        sb_put_cp(b, 0x0D);
    } else if (num >= 0x80 && num <= 0x9F) {
        sb_put_cp(b, CP1252[num - 0x80]);
    } else if ((num >= 0xD800 && num <= 0xDFFF) || num > 0x10FFFF) {
        sb_put_cp(b, 0xFFFD);
    } else if ((num >= 0x01 && num <= 0x08) || num == 0x0B || (num >= 0x0E && num <= 0x1F) ||
               (num >= 0x7F && num <= 0x9F) || (num >= 0xFDD0 && num <= 0xFDEF) ||
               (num & 0xFFFE) == 0xFFFE) {
        /* html._invalid_codepoints: dropped. */
    } else {
        sb_put_cp(b, num);
    }
}

static const char *entity_find(const char *name, size_t n)
{
    size_t lo = 0, hi = sizeof DIT_HTML_ENTITIES / sizeof DIT_HTML_ENTITIES[0];
    while (lo < hi) {
        const size_t mid = lo + (hi - lo) / 2;
        const char *k = DIT_HTML_ENTITIES[mid].name;
        int c = strncmp(k, name, n);
        if (c == 0 && k[n] != '\0')
            c = 1; /* k is longer: after name */
        if (c == 0)
            return DIT_HTML_ENTITIES[mid].utf8;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static int hex_val(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* One pass of html.unescape over valid UTF-8: every match of
 *   &(#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[^\t\n\f <&#;]{1,32};?)
 * is replaced, left to right, by _replace_charref's result. */
static void unescape_into(const unsigned char *s, sbuf *b)
{
    size_t i = 0;
    while (s[i]) {
        if (s[i] != '&') {
            size_t j = i;
            while (s[j] && s[j] != '&')
                j++;
            sb_put(b, (const char *)s + i, j - i);
            i = j;
            continue;
        }
        const size_t j = i + 1;
        if (s[j] == '#') {
            const bool hex = (s[j + 1] == 'x' || s[j + 1] == 'X') && hex_val(s[j + 2]) >= 0;
            const bool dec = s[j + 1] >= '0' && s[j + 1] <= '9';
            if (!hex && !dec) {
                /* No alternative matches ('#' is not a name character). */
                sb_put(b, "&", 1);
                i = j;
                continue;
            }
            size_t k = hex ? j + 2 : j + 1;
            uint32_t num = 0;
            for (int d;
                 (d = hex ? hex_val(s[k]) : (s[k] >= '0' && s[k] <= '9' ? s[k] - '0' : -1)) >= 0;
                 k++) {
                num = num * (hex ? 16u : 10u) + (uint32_t)d;
                if (num > 0x110000)
                    num = 0x110000;
            }
            if (s[k] == ';')
                k++;
            put_numeric(b, num);
            i = k;
            continue;
        }
        /* Named: up to 32 code points outside "\t\n\f <&#;", then ';'?. */
        size_t k = j;
        int chars = 0;
        while (chars < 32 && s[k] && !strchr("\t\n\f <&#;", s[k])) {
            uint32_t cp;
            k += utf8_next(s + k, &cp);
            chars++;
        }
        if (chars == 0) {
            sb_put(b, "&", 1);
            i = j;
            continue;
        }
        if (s[k] == ';')
            k++;
        const char *name = (const char *)s + j;
        const size_t len = k - j;
        const char *v = entity_find(name, len);
        if (v) {
            sb_put(b, v, strlen(v));
            i = k;
            continue;
        }
        /* The longest prefix of at least two characters that is a name
         * (only the legacy names without ';' can be: the match holds no ';'
         * before its end). Names are ASCII, so a prefix cut inside a
         * multi-byte character never matches; byte lengths do. */
        size_t x = len - 1;
        for (; x >= 2; x--) {
            v = entity_find(name, x);
            if (v)
                break;
        }
        if (x >= 2 && v) {
            sb_put(b, v, strlen(v));
            sb_put(b, name + x, len - x);
        } else {
            sb_put(b, "&", 1);
            sb_put(b, name, len);
        }
        i = k;
    }
}

dit_status dit_html_unescape(const char *utf8, char **out, dit_diag *diag)
{
    if (!utf8 || !dit_utf8_valid(utf8, strlen(utf8)))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "prompt is not valid UTF-8");
    sbuf b = {0};
    sb_put(&b, "", 0);
    unescape_into((const unsigned char *)utf8, &b);
    if (b.oom) {
        free(b.p);
        return dit_diag_set(diag, DIT_ERR_NOMEM, "prompt cleaning: out of memory");
    }
    *out = b.p;
    return DIT_OK;
}

dit_status dit_wan_prompt_clean(const char *utf8, char **out, dit_diag *diag)
{
    char *once = NULL, *twice = NULL;
    dit_status st = dit_html_unescape(utf8, &once, diag);
    if (st != DIT_OK)
        return st;
    /* The first pass's output is valid UTF-8 (it writes only whole
     * characters), so the second pass's check cannot fail. */
    st = dit_html_unescape(once, &twice, diag);
    free(once);
    if (st != DIT_OK)
        return st;
    /* strip(), runs of \s to one space, strip(): the words joined by single
     * spaces. */
    sbuf b = {0};
    sb_put(&b, "", 0);
    bool pending = false;
    for (const unsigned char *p = (const unsigned char *)twice; *p;) {
        uint32_t cp;
        const size_t n = utf8_next(p, &cp);
        if (dit_unicode_is_space(cp)) {
            pending = b.n > 0;
        } else {
            if (pending)
                sb_put(&b, " ", 1);
            pending = false;
            sb_put(&b, (const char *)p, n);
        }
        p += n;
    }
    free(twice);
    if (b.oom) {
        free(b.p);
        return dit_diag_set(diag, DIT_ERR_NOMEM, "prompt cleaning: out of memory");
    }
    *out = b.p;
    return DIT_OK;
}
