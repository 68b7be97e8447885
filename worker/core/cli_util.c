#include "core/cli_util.h"

#include <errno.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_LEN 63

int dit_suggest_distance(const char *a, const char *b)
{
    const size_t n = strlen(a), m = strlen(b);
    if (n > MAX_LEN || m > MAX_LEN)
        return 1 << 20;
    /* d[i][j]: distance between the first i bytes of a and the first j of b. */
    int d[MAX_LEN + 1][MAX_LEN + 1];
    for (size_t i = 0; i <= n; i++)
        d[i][0] = (int)i;
    for (size_t j = 0; j <= m; j++)
        d[0][j] = (int)j;
    for (size_t i = 1; i <= n; i++)
        for (size_t j = 1; j <= m; j++) {
            const int cost = a[i - 1] != b[j - 1];
            int v = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < v)
                v = d[i][j - 1] + 1;
            if (d[i - 1][j - 1] + cost < v)
                v = d[i - 1][j - 1] + cost;
            /* "widht" for "width" is one slip of the fingers, not two. */
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
                d[i - 2][j - 2] + 1 < v)
                v = d[i - 2][j - 2] + 1;
            d[i][j] = v;
        }
    return d[n][m];
}

/* The bare name: no leading dashes, nothing from '=' on. */
static void bare_name(const char *arg, char *out, size_t cap)
{
    while (*arg == '-')
        arg++;
    size_t n = strcspn(arg, "=");
    if (n >= cap)
        n = cap - 1;
    memcpy(out, arg, n);
    out[n] = '\0';
}

/* Close enough to be a typo rather than a different word. */
static bool likely_typo(const char *name, int dist)
{
    const int len = (int)strlen(name);
    return dist <= 2 && dist * 2 < len;
}

const char *dit_suggest_option(const char *arg, const struct option *opts)
{
    char name[MAX_LEN + 1];
    bare_name(arg, name, sizeof name);
    if (!name[0])
        return NULL;
    const char *best = NULL;
    int best_d = 1 << 20;
    for (size_t i = 0; opts && opts[i].name; i++) {
        const int d = dit_suggest_distance(name, opts[i].name);
        if (d < best_d) {
            best_d = d;
            best = opts[i].name;
        }
    }
    return best && likely_typo(best, best_d) ? best : NULL;
}

const char *dit_suggest_word(const char *arg, const char *const *words)
{
    const char *best = NULL;
    int best_d = 1 << 20;
    for (size_t i = 0; words && words[i]; i++) {
        const int d = dit_suggest_distance(arg, words[i]);
        if (d < best_d) {
            best_d = d;
            best = words[i];
        }
    }
    return best && likely_typo(best, best_d) ? best : NULL;
}

int dit_check_output_path(const char *path, char *err, size_t errcap)
{
    /* The folder: everything before the last slash ("/" for "/x", "." for
     * a bare name). */
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == path)
        snprintf(dir, sizeof dir, "/");
    else
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        snprintf(err, errcap, "cannot write %s: the folder %s %s", path, dir,
                 errno == ENOENT ? "does not exist" : strerror(errno));
        return -1;
    }
    if (!S_ISDIR(sb.st_mode)) {
        snprintf(err, errcap, "cannot write %s: %s is not a folder", path, dir);
        return -1;
    }
    /* The writer makes a temporary file beside path, so the folder itself
     * must be writable even when path already exists. */
    if (access(dir, W_OK | X_OK) != 0) {
        snprintf(err, errcap, "cannot write %s: the folder %s: %s", path, dir, strerror(errno));
        return -1;
    }
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        snprintf(err, errcap, "cannot write %s: it is a folder", path);
        return -1;
    }
    return 0;
}

void dit_tune_malloc(void)
{
#ifdef __GLIBC__
    /* Fixed values also switch glibc's adaptive thresholds off. With them,
     * the daemon still faulted a result's pages in anew on every request
     * (perf: page faults under memmove were the largest cost of a 600 KB
     * result's trip), as the few result-sized buffers freed together pushed
     * the heap top past the trim threshold. */
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 64 << 20);
#endif
}
