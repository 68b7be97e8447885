/* The shared option table (worker/core/options.c): defaults from the table,
 * then the environment, then the flags; range and kind checks with the
 * option's name in the message; short options; custom setters; hidden and
 * sibling-command options; --help printed from the table. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/options.h"

typedef struct args {
    const char *name;
    long long n;
    double ratio, wait;
    bool verbose;
    int custom;
    const char *internal;
} args;

static int set_custom(void *target, const char *val, char *err, size_t cap)
{
    if (strcmp(val, "red") == 0 || strcmp(val, "blue") == 0) {
        ((args *)target)->custom = val[0] == 'r' ? 1 : 2;
        return 0;
    }
    snprintf(err, cap, "wants red or blue, not '%s'", val);
    return -1;
}

static const dit_option opts[] = {
    {"name", 'N', DIT_OPT_STRING, "anon", "NAME", "who", "TOPT_NAME", offsetof(args, name), 0, 0,
     NULL, false},
    {"count", 'n', DIT_OPT_INT, "3", "N", "how many", "TOPT_COUNT", offsetof(args, n), 1, 10, NULL,
     false},
    {"ratio", 0, DIT_OPT_DOUBLE, "0.5", "R", "a share", NULL, offsetof(args, ratio), 0, 1, NULL,
     false},
    {"wait", 0, DIT_OPT_SECONDS, "2", "S", "patience", NULL, offsetof(args, wait), 0, 0, NULL,
     false},
    {"verbose", 'v', DIT_OPT_FLAG, NULL, NULL, "say more", "TOPT_VERBOSE", offsetof(args, verbose),
     0, 0, NULL, false},
    {"colour", 0, DIT_OPT_CUSTOM, "blue", "C", "red or blue", NULL, 0, 0, 0, set_custom, false},
    {"internal", 0, DIT_OPT_STRING, NULL, "X", "for launchers only", NULL, offsetof(args, internal),
     0, 0, NULL, true},
};
static const dit_option sibling[] = {
    {"inputs", 'i', DIT_OPT_STRING, NULL, "FILE", "the other command's", NULL, 0, 0, 0, NULL,
     false},
};

static const dit_options table = {
    .prog = "topt",
    .usage = "usage: topt [options]\n",
    .epilog = "The end.\n",
    .version = "9.9",
    .opts = opts,
    .n_opts = sizeof opts / sizeof opts[0],
    .foreign = sibling,
    .n_foreign = 1,
};

static char out[16384], err[4096];

static int run(args *a, const char *const *argv_in)
{
    char *argv[32];
    int argc = 0;
    argv[argc++] = (char *)"topt";
    while (argv_in[argc - 1])
        argv[argc] = (char *)argv_in[argc - 1], argc++;
    argv[argc] = NULL;
    memset(a, 0, sizeof *a);
    fflush(stdout);
    fflush(stderr);
    FILE *fo = tmpfile(), *fe = tmpfile();
    const int so = dup(1), se = dup(2);
    dup2(fileno(fo), 1);
    dup2(fileno(fe), 2);
    const int rc = dit_options_parse(&table, a, argc, argv, NULL);
    fflush(stdout);
    fflush(stderr);
    dup2(so, 1);
    dup2(se, 2);
    close(so);
    close(se);
    rewind(fo);
    rewind(fe);
    out[fread(out, 1, sizeof out - 1, fo)] = '\0';
    err[fread(err, 1, sizeof err - 1, fe)] = '\0';
    fclose(fo);
    fclose(fe);
    return rc;
}

#define RUN(a, ...) run(a, (const char *const[]){__VA_ARGS__, NULL})

START_TEST(defaults_then_environment_then_flags)
{
    args a;
    unsetenv("TOPT_COUNT");
    unsetenv("TOPT_NAME");
    unsetenv("TOPT_VERBOSE");
    ck_assert_int_eq(run(&a, (const char *const[]){NULL}), 0);
    ck_assert_str_eq(a.name, "anon");
    ck_assert_int_eq(a.n, 3);
    ck_assert_double_eq(a.ratio, 0.5);
    ck_assert_double_eq(a.wait, 2);
    ck_assert(!a.verbose);
    ck_assert_int_eq(a.custom, 2);
    ck_assert_ptr_null(a.internal);
    setenv("TOPT_COUNT", "5", 1);
    setenv("TOPT_VERBOSE", "true", 1);
    ck_assert_int_eq(run(&a, (const char *const[]){NULL}), 0);
    ck_assert_int_eq(a.n, 5);
    ck_assert(a.verbose);
    ck_assert_int_eq(RUN(&a, "--count", "7", "-N", "bo", "--colour=red"), 0);
    ck_assert_int_eq(a.n, 7);
    ck_assert_str_eq(a.name, "bo");
    ck_assert_int_eq(a.custom, 1);
    ck_assert_int_eq(RUN(&a, "-vn9"), 0); /* a cluster of short options */
    ck_assert_int_eq(a.n, 9);
    unsetenv("TOPT_COUNT");
    unsetenv("TOPT_VERBOSE");
}
END_TEST

START_TEST(bad_values_name_the_option)
{
    args a;
    ck_assert_int_eq(RUN(&a, "--count", "11"), 2);
    ck_assert_str_eq(err, "topt: --count wants an integer from 1 to 10, not '11'\n");
    ck_assert_int_eq(RUN(&a, "--ratio", "nan"), 2);
    ck_assert_msg(strstr(err, "--ratio wants a number from 0 to 1, not 'nan'"), "%s", err);
    ck_assert_int_eq(RUN(&a, "--wait", "-1"), 2);
    ck_assert_msg(strstr(err, "--wait wants a positive number of seconds"), "%s", err);
    ck_assert_int_eq(RUN(&a, "--colour", "green"), 2);
    ck_assert_msg(strstr(err, "--colour wants red or blue, not 'green'"), "%s", err);
    setenv("TOPT_COUNT", "x", 1);
    ck_assert_int_eq(run(&a, (const char *const[]){NULL}), 2);
    ck_assert_msg(strstr(err, "topt: TOPT_COUNT wants an integer"), "%s", err);
    unsetenv("TOPT_COUNT");
}
END_TEST

START_TEST(usage_mistakes)
{
    args a;
    ck_assert_int_eq(RUN(&a, "--cuont", "2"), 2);
    ck_assert_msg(strstr(err, "unknown option '--cuont'; did you mean '--count'?"), "%s", err);
    ck_assert_int_eq(RUN(&a, "-x"), 2);
    ck_assert_msg(strstr(err, "unknown option '-x'"), "%s", err);
    ck_assert_int_eq(RUN(&a, "--count"), 2);
    ck_assert_msg(strstr(err, "option '--count' needs a value"), "%s", err);
    ck_assert_int_eq(RUN(&a, "--verbose=1"), 2);
    ck_assert_msg(strstr(err, "option --verbose takes no value"), "%s", err);
    ck_assert_int_eq(RUN(&a, "stray"), 2);
    ck_assert_msg(strstr(err, "unexpected argument 'stray'"), "%s", err);
    ck_assert_int_eq(RUN(&a, "--inputs", "f"), 2);
    ck_assert_msg(strstr(err, "option '--inputs' does not apply to this command"), "%s", err);
    ck_assert_int_eq(RUN(&a, "-i", "f"), 2);
    ck_assert_msg(strstr(err, "option '-i' does not apply to this command"), "%s", err);
    ck_assert_int_eq(RUN(&a, "--internal", "z"), 0); /* hidden, not refused */
    ck_assert_str_eq(a.internal, "z");
}
END_TEST

START_TEST(help_comes_from_the_table)
{
    args a;
    ck_assert_int_eq(RUN(&a, "--help"), 1);
    const char *want[] = {"usage: topt",
                          "-N, --name NAME",
                          "who (default anon) [TOPT_NAME]",
                          "-n, --count N",
                          "how many (default 3) [TOPT_COUNT]",
                          "--ratio R",
                          "-v, --verbose",
                          "--colour C",
                          "(default blue)",
                          "-h, --help",
                          "--version",
                          "The end."};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        ck_assert_msg(strstr(out, want[i]), "'%s' not in:\n%s", want[i], out);
    ck_assert_msg(!strstr(out, "--internal"), "hidden options stay out of --help:\n%s", out);
    ck_assert_int_eq(RUN(&a, "--version"), 1);
    ck_assert_str_eq(out, "topt 9.9\n");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("options");
    TCase *tc = tcase_create("table");
    tcase_add_test(tc, defaults_then_environment_then_flags);
    tcase_add_test(tc, bad_values_name_the_option);
    tcase_add_test(tc, usage_mistakes);
    tcase_add_test(tc, help_comes_from_the_table);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
