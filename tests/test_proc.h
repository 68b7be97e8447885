/* Helpers for tests that run the real programs: spawn with captured output,
 * and compare safetensors outputs. */
#ifndef DIT_TESTS_TEST_PROC_H
#define DIT_TESTS_TEST_PROC_H

#include <check.h>
#include <fcntl.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "loader/safetensors.h"

extern char **environ;

static inline const char *test_env(const char *name)
{
    const char *v = getenv(name);
    if (!v) {
        fprintf(stderr, "%s is not set; run this test through meson\n", name);
        exit(1);
    }
    return v;
}

/* Runs argv (argv[0] a path) with stdout and stderr captured into out;
 * returns the exit status, or 128 + signal. *seconds gets the wall time
 * when not NULL. */
static inline int test_run(char *const argv[], char *const envp[], char *out, size_t cap,
                           double *seconds)
{
    char path[] = "/tmp/dit_test_out_XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd, 1);
    posix_spawn_file_actions_adddup2(&fa, fd, 2);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pid_t pid;
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, envp ? envp : environ);
    posix_spawn_file_actions_destroy(&fa);
    ck_assert_msg(rc == 0, "cannot start %s", argv[0]);
    int status;
    waitpid(pid, &status, 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (seconds)
        *seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    lseek(fd, 0, SEEK_SET);
    ssize_t n = read(fd, out, cap - 1);
    out[n > 0 ? n : 0] = '\0';
    close(fd);
    unlink(path);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

typedef struct test_err {
    double max_abs, max_ref, rel;
} test_err;

/* max |a - b| and that relative to max |b|; NaN counts as infinite. */
static inline test_err test_compare_views(const dit_tensor *a, const dit_tensor *b)
{
    test_err e = {0, 0, 0};
    size_t n = (size_t)dit_tensor_numel(a);
    float *pa = malloc((n ? n : 1) * sizeof *pa), *pb = malloc((n ? n : 1) * sizeof *pb);
    dit_convert_to_f32(pa, a->data, a->dtype, n);
    dit_convert_to_f32(pb, b->data, b->dtype, n);
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)pa[i] - pb[i]);
        if (!(d <= e.max_abs))
            e.max_abs = isnan(d) ? INFINITY : d;
        if (fabs(pb[i]) > e.max_ref)
            e.max_ref = fabs(pb[i]);
    }
    e.rel = e.max_ref > 0 ? e.max_abs / e.max_ref : e.max_abs;
    free(pa);
    free(pb);
    return e;
}

/* Compares tensor `name_a` of file a with `name_b` of file b. */
static inline test_err test_compare_files(const char *a, const char *name_a, const char *b,
                                          const char *name_b)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_st_file *fa = NULL, *fb = NULL;
    ck_assert_msg(dit_st_file_open(a, &fa, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    ck_assert_msg(dit_st_file_open(b, &fb, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    const dit_st_entry *ea = dit_st_file_find(fa, name_a), *eb = dit_st_file_find(fb, name_b);
    ck_assert_msg(ea && eb, "tensor %s / %s missing", name_a, name_b);
    ck_assert_msg(dit_tensor_same_shape(&ea->view, &eb->view), "shapes differ");
    test_err e = test_compare_views(&ea->view, &eb->view);
    dit_st_file_close(fa);
    dit_st_file_close(fb);
    return e;
}

#endif
