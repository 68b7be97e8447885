#include "core/suggest.h"

#include <stdbool.h>
#include <string.h>

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
