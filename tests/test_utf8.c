/* The UTF-8 check (worker/core/utf8.c) that ditd's HTTP front end, its log
 * escaping and the request reader share: the cases clients send on purpose
 * (overlong forms, surrogates, code points past U+10FFFF, cut-off and stray
 * bytes), NUL, and every lead byte against RFC 3629's grammar. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "core/utf8.h"

#define LEN(lit) dit_utf8_len(lit, sizeof lit - 1)
#define VALID(lit) dit_utf8_valid(lit, sizeof lit - 1)

START_TEST(valid_text)
{
    ck_assert_uint_eq(LEN("a"), 1);
    ck_assert_uint_eq(LEN("\x7f"), 1);
    ck_assert_uint_eq(LEN("\xc2\x80"), 2);         /* U+0080, the first 2-byte */
    ck_assert_uint_eq(LEN("\xc3\xa9"), 2);         /* é */
    ck_assert_uint_eq(LEN("\xdf\xbf"), 2);         /* U+07FF */
    ck_assert_uint_eq(LEN("\xe0\xa0\x80"), 3);     /* U+0800, the first 3-byte */
    ck_assert_uint_eq(LEN("\xe2\x82\xac"), 3);     /* € */
    ck_assert_uint_eq(LEN("\xed\x9f\xbf"), 3);     /* U+D7FF, below the surrogates */
    ck_assert_uint_eq(LEN("\xee\x80\x80"), 3);     /* U+E000, above them */
    ck_assert_uint_eq(LEN("\xef\xbf\xbf"), 3);     /* U+FFFF */
    ck_assert_uint_eq(LEN("\xf0\x90\x80\x80"), 4); /* U+10000, the first 4-byte */
    ck_assert_uint_eq(LEN("\xf0\x9f\x98\x80"), 4); /* an emoji */
    ck_assert_uint_eq(LEN("\xf4\x8f\xbf\xbf"), 4); /* U+10FFFF, the last */
    /* Only the sequence at p counts, not what follows it. */
    ck_assert_uint_eq(LEN("\xc3\xa9\xff"), 2);
    ck_assert(VALID(""));
    ck_assert(dit_utf8_valid(NULL, 0));
    ck_assert(VALID("plain ASCII, with punctuation!"));
    ck_assert(VALID("caf\xc3\xa9 \xe2\x82\xac 5, \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e, "
                    "\xf0\x9f\x8c\x8a \xd0\x9f\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82"));
}
END_TEST

START_TEST(overlong_forms)
{
    ck_assert_uint_eq(LEN("\xc0\x80"), 0); /* NUL in two bytes */
    ck_assert_uint_eq(LEN("\xc0\xaf"), 0); /* '/' */
    ck_assert_uint_eq(LEN("\xc1\xbf"), 0); /* U+007F */
    ck_assert_uint_eq(LEN("\xe0\x80\x80"), 0);
    ck_assert_uint_eq(LEN("\xe0\x9f\xbf"), 0); /* U+07FF in three bytes */
    ck_assert_uint_eq(LEN("\xf0\x80\x80\x80"), 0);
    ck_assert_uint_eq(LEN("\xf0\x8f\xbf\xbf"), 0); /* U+FFFF in four bytes */
    ck_assert(!VALID("a\xc0\x80z"));
    ck_assert(!VALID("a\xe0\x80\x80z"));
    ck_assert(!VALID("a\xf0\x80\x80\x80z"));
}
END_TEST

START_TEST(surrogates)
{
    ck_assert_uint_eq(LEN("\xed\xa0\x80"), 0); /* U+D800 */
    ck_assert_uint_eq(LEN("\xed\xaf\xbf"), 0); /* U+DBFF */
    ck_assert_uint_eq(LEN("\xed\xb0\x80"), 0); /* U+DC00 */
    ck_assert_uint_eq(LEN("\xed\xbf\xbf"), 0); /* U+DFFF */
    /* A pair in CESU-8 is two surrogates, not one code point. */
    ck_assert(!VALID("\xed\xa0\xbd\xed\xb8\x80"));
    ck_assert(!VALID("x\xed\xa0\x80"));
}
END_TEST

START_TEST(past_u10ffff)
{
    ck_assert_uint_eq(LEN("\xf4\x90\x80\x80"), 0); /* U+110000 */
    ck_assert_uint_eq(LEN("\xf4\xbf\xbf\xbf"), 0);
    ck_assert_uint_eq(LEN("\xf5\x80\x80\x80"), 0);
    ck_assert_uint_eq(LEN("\xf7\xbf\xbf\xbf"), 0);
    /* Lead bytes of the old 5- and 6-byte forms, and 0xfe, 0xff. */
    ck_assert_uint_eq(LEN("\xf8\x88\x80\x80\x80"), 0);
    ck_assert_uint_eq(LEN("\xfc\x84\x80\x80\x80\x80"), 0);
    ck_assert_uint_eq(LEN("\xfe"), 0);
    ck_assert_uint_eq(LEN("\xff"), 0);
    ck_assert(!VALID("ok \xf4\x90\x80\x80"));
}
END_TEST

START_TEST(truncated_at_the_end)
{
    /* Each lead byte with fewer continuation bytes than it announces, cut off
     * by the end of the buffer (n), even where more bytes follow in memory. */
    const char *full[] = {"\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80"};
    for (size_t k = 0; k < 3; k++) {
        const size_t len = strlen(full[k]);
        ck_assert_uint_eq(dit_utf8_len(full[k], len), len);
        ck_assert(dit_utf8_valid(full[k], len));
        for (size_t n = 1; n < len; n++) {
            ck_assert_uint_eq(dit_utf8_len(full[k], n), 0);
            ck_assert(!dit_utf8_valid(full[k], n));
        }
    }
    ck_assert(!VALID("text then \xe2\x82"));
    ck_assert(!VALID("text then \xf0"));
    /* Cut short inside the buffer: the next byte is no continuation. */
    ck_assert_uint_eq(LEN("\xe2\x82z"), 0);
    ck_assert_uint_eq(LEN("\xf0\x9f\x98z"), 0);
    ck_assert(!VALID("\xc3z"));
    ck_assert_uint_eq(dit_utf8_len("a", 0), 0); /* nothing to read */
}
END_TEST

START_TEST(lone_continuation_bytes)
{
    for (unsigned c = 0x80; c <= 0xbf; c++) {
        const char b[2] = {(char)c, 'a'};
        ck_assert_uint_eq(dit_utf8_len(b, 2), 0);
    }
    ck_assert(!VALID("\x80"));
    ck_assert(!VALID("ab\xbf"));
    ck_assert(!VALID("\xc3\xa9\xa9")); /* one continuation byte too many */
}
END_TEST

START_TEST(nul)
{
    /* NUL is U+0000, well-formed; refusing it is the callers' business (the
     * HTTP body check does, before it asks for sequences). */
    ck_assert_uint_eq(dit_utf8_len("\0", 1), 1);
    ck_assert(dit_utf8_valid("a\0b", 3));
    ck_assert(dit_utf8_valid("\xc3\xa9\0", 3));
    /* A NUL is not a continuation byte: it ends no sequence. */
    ck_assert_uint_eq(dit_utf8_len("\xc3\0", 2), 0);
    ck_assert_uint_eq(dit_utf8_len("\xe2\x82\0", 3), 0);
}
END_TEST

/* RFC 3629, section 4: the length of the sequence at b (n bytes), or 0. */
static size_t rfc3629_len(const unsigned char *b, size_t n)
{
    const unsigned c = b[0];
    unsigned lo = 0x80, hi = 0xbf;
    size_t len;
    if (c <= 0x7f)
        return 1;
    if (c >= 0xc2 && c <= 0xdf)
        len = 2;
    else if (c >= 0xe0 && c <= 0xef)
        len = 3, lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
    else if (c >= 0xf0 && c <= 0xf4)
        len = 4, lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
    else
        return 0;
    if (n < len || b[1] < lo || b[1] > hi)
        return 0;
    for (size_t k = 2; k < len; k++)
        if (b[k] < 0x80 || b[k] > 0xbf)
            return 0;
    return len;
}

START_TEST(every_prefix_against_the_grammar)
{
    /* Every first three bytes, each cut to 1..3 bytes and completed by a
     * fourth from the boundary values. */
    static const unsigned char fourth[] = {0x00, 0x41, 0x7f, 0x80, 0xbf, 0xc0, 0xf4, 0xff};
    unsigned char b[4];
    for (unsigned x = 0; x < 1u << 24; x++) {
        b[0] = (unsigned char)(x >> 16), b[1] = (unsigned char)(x >> 8), b[2] = (unsigned char)x;
        for (size_t n = 1; n <= 3; n++)
            if (dit_utf8_len((const char *)b, n) != rfc3629_len(b, n))
                ck_abort_msg("%02x %02x %02x, n %zu: %zu, not %zu", b[0], b[1], b[2], n,
                             dit_utf8_len((const char *)b, n), rfc3629_len(b, n));
        for (size_t k = 0; k < sizeof fourth; k++) {
            b[3] = fourth[k];
            if (dit_utf8_len((const char *)b, 4) != rfc3629_len(b, 4))
                ck_abort_msg("%02x %02x %02x %02x: %zu, not %zu", b[0], b[1], b[2], b[3],
                             dit_utf8_len((const char *)b, 4), rfc3629_len(b, 4));
        }
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("utf8");
    TCase *tc = tcase_create("check");
    tcase_add_test(tc, valid_text);
    tcase_add_test(tc, overlong_forms);
    tcase_add_test(tc, surrogates);
    tcase_add_test(tc, past_u10ffff);
    tcase_add_test(tc, truncated_at_the_end);
    tcase_add_test(tc, lone_continuation_bytes);
    tcase_add_test(tc, nul);
    tcase_add_test(tc, every_prefix_against_the_grammar);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
