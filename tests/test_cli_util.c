/* worker/core/cli_util.c: the "did you mean" distance and suggestions, the
 * output-path check, and the allocator settings dit_tune_malloc makes (a
 * 1 MiB buffer comes from the heap and its pages stay mapped after a free,
 * where glibc's defaults map and unmap it afresh). */
#include <check.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "core/cli_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

START_TEST(distance_and_suggestions)
{
    ck_assert_int_eq(dit_suggest_distance("width", "width"), 0);
    ck_assert_int_eq(dit_suggest_distance("widht", "width"), 1); /* a swap is one slip */
    ck_assert_int_eq(dit_suggest_distance("with", "width"), 1);
    ck_assert_int_eq(dit_suggest_distance("", "abc"), 3);
    static const struct option opts[] = {{"width", required_argument, NULL, 0},
                                         {"height", required_argument, NULL, 0},
                                         {"steps", required_argument, NULL, 0},
                                         {NULL, 0, NULL, 0}};
    ck_assert_str_eq(dit_suggest_option("--widht=64", opts), "width");
    ck_assert_str_eq(dit_suggest_option("heigth", opts), "height");
    ck_assert_ptr_null(dit_suggest_option("--seed", opts)); /* not a typo of any */
    ck_assert_ptr_null(dit_suggest_option("--", opts));
    const char *const words[] = {"generate", "health", "info", NULL};
    ck_assert_str_eq(dit_suggest_word("genrate", words), "generate");
    ck_assert_ptr_null(dit_suggest_word("bench", words));
}
END_TEST

START_TEST(output_paths)
{
    char dir[] = "/tmp/dit-cli-util-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char path[256], err[512];
    snprintf(path, sizeof path, "%s/out.png", dir);
    ck_assert_int_eq(dit_check_output_path(path, err, sizeof err), 0);
    snprintf(path, sizeof path, "%s/missing/out.png", dir);
    ck_assert_int_eq(dit_check_output_path(path, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "does not exist"), "%s", err);
    ck_assert_int_eq(dit_check_output_path(dir, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "it is a folder"), "%s", err);
    rmdir(dir);
}
END_TEST

START_TEST(malloc_keeps_result_sized_buffers)
{
#if defined(__GLIBC__) && !defined(UNDER_ASAN) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
    dit_tune_malloc();
    /* A result-sized buffer (above glibc's initial 128 KiB mmap threshold)
     * is heap memory: no mapped chunk. */
    const struct mallinfo2 before = mallinfo2();
    char *p = malloc(1 << 20);
    ck_assert_ptr_nonnull(p);
    memset(p, 1, 1 << 20);
    const struct mallinfo2 during = mallinfo2();
    ck_assert_uint_eq(during.hblks, before.hblks);
    ck_assert_uint_ge(during.uordblks, before.uordblks + (1 << 20));
    /* Freed, it stays with the process (not trimmed back to the kernel). */
    free(p);
    const struct mallinfo2 after = mallinfo2();
    ck_assert_uint_ge(after.arena, during.arena);
    ck_assert_uint_ge(after.fordblks, (size_t)1 << 20);
    /* Past 32 MiB a buffer is mapped on its own, as before. */
    char *big = malloc((size_t)40 << 20);
    ck_assert_ptr_nonnull(big);
    ck_assert_uint_eq(mallinfo2().hblks, before.hblks + 1);
    free(big);
#else
    dit_tune_malloc(); /* the allocator here is not glibc's (or is ASan's): nothing to see */
#endif
}
END_TEST

int main(void)
{
    Suite *s = suite_create("cli_util");
    TCase *tc = tcase_create("cli_util");
    tcase_add_test(tc, distance_and_suggestions);
    tcase_add_test(tc, output_paths);
    tcase_add_test(tc, malloc_keeps_result_sized_buffers);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
