/* A fuzz target's main without libFuzzer: runs every seed input, then
 * --runs deterministic mutations of the seeds (and of earlier mutations),
 * so a run is repeatable from its seed and reproducible by index.
 *
 *   fuzz_NAME [--runs N] [--seed S] [--max-len L] [--dict FILE]
 *             [--trace] [--save K FILE] [--root DIR] CORPUS...
 *
 * CORPUS is files or folders of files. --dict reads libFuzzer's dictionary
 * format (one "token" per line, \\ \" and \xNN escapes, # comments); its
 * tokens are inserted and overwritten as one of the mutations. --trace
 * prints each run's index before running it (the last printed is the one
 * that failed); --save K FILE writes run K's input to FILE and runs
 * nothing more (the runs before it run, since the inputs a run keeps are
 * bases for later ones), for the libFuzzer build or a debugger. --root is the source tree
 * (default $DIT_SOURCE_ROOT, else "."). */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "fuzz.h"

#define POOL_RECENT 256 /* mutations kept as bases for later ones */

typedef struct blob {
    uint8_t *p;
    size_t n;
} blob;

typedef struct blobs {
    blob *v;
    size_t n, cap;
} blobs;

typedef struct driver {
    blobs seeds, dict;
    blob recent[POOL_RECENT];
    size_t n_recent;
    uint64_t rng;
    size_t max_len;
} driver;

static uint64_t next_u64(uint64_t *s)
{
    /* splitmix64 */
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static size_t below(uint64_t *s, size_t n)
{
    return n ? (size_t)(next_u64(s) % n) : 0;
}

static bool blobs_add(blobs *b, const uint8_t *p, size_t n)
{
    if (b->n == b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 16;
        blob *v = realloc(b->v, cap * sizeof *v);
        if (!v)
            return false;
        b->v = v;
        b->cap = cap;
    }
    uint8_t *copy = malloc(n ? n : 1);
    if (!copy)
        return false;
    if (n)
        memcpy(copy, p, n);
    b->v[b->n++] = (blob){copy, n};
    return true;
}

static void blobs_free(blobs *b)
{
    for (size_t i = 0; i < b->n; i++)
        free(b->v[i].p);
    free(b->v);
}

static bool read_whole(const char *path, blobs *into)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fuzz: %s: %s\n", path, strerror(errno));
        return false;
    }
    uint8_t *buf = NULL;
    size_t n = 0, cap = 0;
    bool ok = true;
    for (;;) {
        if (n == cap) {
            cap = cap ? 2 * cap : 4096;
            uint8_t *nb = realloc(buf, cap);
            if (!nb) {
                ok = false;
                break;
            }
            buf = nb;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(f))
        ok = false;
    fclose(f);
    if (ok)
        ok = blobs_add(into, buf, n);
    free(buf);
    if (!ok)
        fprintf(stderr, "fuzz: cannot read %s\n", path);
    return ok;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* A file, or every regular file of a folder in name order (so the pool,
 * and with it every run, is the same on every machine). */
static bool add_corpus(const char *path, blobs *into)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "fuzz: %s: %s\n", path, strerror(errno));
        return false;
    }
    if (!S_ISDIR(st.st_mode))
        return read_whole(path, into);
    DIR *d = opendir(path);
    if (!d) {
        fprintf(stderr, "fuzz: %s: %s\n", path, strerror(errno));
        return false;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    bool ok = true;
    struct dirent *e;
    while (ok && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 32;
            char **nv = realloc(names, cap * sizeof *nv);
            if (!nv) {
                ok = false;
                break;
            }
            names = nv;
        }
        size_t len = strlen(path) + strlen(e->d_name) + 2;
        names[n] = malloc(len);
        if (!names[n]) {
            ok = false;
            break;
        }
        snprintf(names[n], len, "%s/%s", path, e->d_name);
        n++;
    }
    closedir(d);
    if (ok)
        qsort(names, n, sizeof *names, cmp_names);
    for (size_t i = 0; i < n; i++) {
        if (ok && stat(names[i], &st) == 0 && S_ISREG(st.st_mode))
            ok = read_whole(names[i], into);
        free(names[i]);
    }
    free(names);
    return ok;
}

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* libFuzzer's dictionary format: [name=]"token" per line. */
static bool read_dict(const char *path, blobs *into)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "fuzz: %s: %s\n", path, strerror(errno));
        return false;
    }
    char line[4096];
    int lineno = 0;
    bool ok = true;
    while (ok && fgets(line, sizeof line, f)) {
        lineno++;
        char *q = strchr(line, '"');
        char *hash = strchr(line, '#');
        if (!q || (hash && hash < q))
            continue;
        uint8_t tok[4096];
        size_t n = 0;
        bool closed = false;
        for (char *c = q + 1; *c && n < sizeof tok; c++) {
            if (*c == '"') {
                closed = true;
                break;
            }
            if (*c == '\\' && (c[1] == '\\' || c[1] == '"')) {
                c++;
                tok[n++] = (uint8_t)*c;
            } else if (*c == '\\' && c[1] == 'x' && hexval(c[2]) >= 0 && hexval(c[3]) >= 0) {
                tok[n++] = (uint8_t)(hexval(c[2]) * 16 + hexval(c[3]));
                c += 3;
            } else if (*c == '\\') { /* as libFuzzer: no other escapes */
                fprintf(stderr, "fuzz: %s:%d: an escape other than \\\\, \\\" or \\xNN\n", path,
                        lineno);
                ok = false;
                break;
            } else {
                tok[n++] = (uint8_t)*c;
            }
        }
        if (!ok)
            break;
        if (!closed) {
            fprintf(stderr, "fuzz: %s:%d: a token without its closing quote\n", path, lineno);
            ok = false;
        } else {
            ok = blobs_add(into, tok, n);
        }
    }
    fclose(f);
    return ok;
}

/* The mutable input: capacity max_len + slack for inserts. */
typedef struct input {
    uint8_t *p;
    size_t n, cap;
} input;

static void insert_bytes(input *in, size_t at, const uint8_t *src, size_t n)
{
    if (in->n + n > in->cap)
        n = in->cap - in->n;
    memmove(in->p + at + n, in->p + at, in->n - at);
    memcpy(in->p + at, src, n);
    in->n += n;
}

static const uint8_t interesting_bytes[] = {0,   1,   0x7f, 0x80, 0xff, '"', '\\', '&', ';', '<',
                                            '{', '}', '[',  ']',  ',',  ':', ' ',  '#', '\n'};
static const uint64_t interesting_ints[] = {
    0,          1,          0x7f,       0x80,       0xff,      0x100,      0xffff,
    0x7fffffff, 0x80000000, 0xffffffff, 1ULL << 32, INT64_MAX, UINT64_MAX, 1ULL << 63};

static void mutate_once(driver *d, input *in)
{
    uint64_t *s = &d->rng;
    size_t at = below(s, in->n + 1);
    switch (below(s, 10)) {
    case 0: /* flip a bit */
        if (in->n)
            in->p[below(s, in->n)] ^= (uint8_t)(1u << below(s, 8));
        break;
    case 1: /* a random byte */
        if (in->n)
            in->p[below(s, in->n)] = (uint8_t)next_u64(s);
        break;
    case 2: /* an interesting byte */
        if (in->n)
            in->p[below(s, in->n)] = interesting_bytes[below(s, sizeof interesting_bytes)];
        break;
    case 3: { /* insert random bytes */
        uint8_t r[8];
        size_t n = 1 + below(s, sizeof r);
        for (size_t i = 0; i < n; i++)
            r[i] = (uint8_t)next_u64(s);
        insert_bytes(in, at, r, n);
        break;
    }
    case 4: { /* erase a range */
        if (at < in->n) {
            size_t n = 1 + below(s, 16);
            if (n > in->n - at)
                n = in->n - at;
            memmove(in->p + at, in->p + at + n, in->n - at - n);
            in->n -= n;
        }
        break;
    }
    case 5: { /* repeat a range of the input at another place */
        if (in->n) {
            size_t from = below(s, in->n), n = 1 + below(s, 32);
            if (n > in->n - from)
                n = in->n - from;
            uint8_t tmp[32];
            memcpy(tmp, in->p + from, n);
            insert_bytes(in, at, tmp, n);
        }
        break;
    }
    case 6: { /* an interesting integer, little endian, over 1, 2, 4 or 8 bytes */
        size_t w = (size_t)1 << below(s, 4);
        if (in->n >= w) {
            uint64_t v = interesting_ints[below(s, sizeof interesting_ints / 8)];
            if (next_u64(s) & 1)
                v = (uint64_t)0 - v;
            size_t pos = below(s, in->n - w + 1);
            for (size_t i = 0; i < w; i++)
                in->p[pos + i] = (uint8_t)(v >> (8 * i));
        }
        break;
    }
    case 7:
    case 8: { /* a dictionary token, inserted or over the bytes there */
        if (!d->dict.n)
            break;
        const blob *t = &d->dict.v[below(s, d->dict.n)];
        if ((next_u64(s) & 1) && at + t->n <= in->n)
            memcpy(in->p + at, t->p, t->n);
        else
            insert_bytes(in, at, t->p, t->n);
        break;
    }
    default: { /* splice in a piece of a seed */
        if (!d->seeds.n)
            break;
        const blob *o = &d->seeds.v[below(s, d->seeds.n)];
        if (!o->n)
            break;
        size_t from = below(s, o->n), n = 1 + below(s, o->n - from);
        if (next_u64(s) & 1) { /* the rest of the input replaced */
            in->n = at;
            if (n > in->cap - in->n)
                n = in->cap - in->n;
            memcpy(in->p + in->n, o->p + from, n);
            in->n += n;
        } else {
            insert_bytes(in, at, o->p + from, n);
        }
        break;
    }
    }
    if (in->n > d->max_len)
        in->n = d->max_len;
}

/* Run k's input (k counts from 0 after the seeds): a base from the pool
 * (a seed half the time, else an earlier input the target kept), given to
 * the target's own mutator half the time (and then now and then one
 * byte-level mutation on top), else mutated 1 to 8 times byte by byte. */
static void make_input(driver *d, void *ctx, input *in)
{
    const blob *b = NULL;
    if (d->n_recent && (!d->seeds.n || (next_u64(&d->rng) & 1)))
        b = &d->recent[below(&d->rng, d->n_recent)];
    else if (d->seeds.n)
        b = &d->seeds.v[below(&d->rng, d->seeds.n)];
    in->n = 0;
    if (b) {
        in->n = b->n < d->max_len ? b->n : d->max_len;
        memcpy(in->p, b->p, in->n);
    }
    size_t times = 1 + below(&d->rng, 8);
    if (dit_fuzz_target_def.mutate && (next_u64(&d->rng) & 1)) {
        size_t n = dit_fuzz_target_def.mutate(ctx, in->p, in->n, d->max_len, next_u64(&d->rng));
        if (n) {
            in->n = n;
            times = below(&d->rng, 8) == 0;
        }
    }
    for (size_t t = 0; t < times; t++)
        mutate_once(d, in);
}

/* An input the target kept (it got past the parsing) becomes a base for
 * later runs, in place of a random earlier one once the pool is full. */
static bool keep_input(driver *d, const input *in)
{
    size_t slot = d->n_recent < POOL_RECENT ? d->n_recent++ : below(&d->rng, POOL_RECENT);
    uint8_t *copy = realloc(d->recent[slot].p, in->n ? in->n : 1);
    if (!copy)
        return false;
    memcpy(copy, in->p, in->n);
    d->recent[slot] = (blob){copy, in->n};
    return true;
}

static bool parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s || *end || *s == '-')
        return false;
    *out = v;
    return true;
}

static void usage(FILE *to, const char *prog)
{
    fprintf(to,
            "usage: %s [--runs N] [--seed S] [--max-len L] [--dict FILE] [--trace]\n"
            "       [--save K FILE] [--root DIR] CORPUS...\n"
            "Runs the %s fuzz target on every seed file (CORPUS: files or folders),\n"
            "then on N deterministic mutations of them (default 1000, seed 1, inputs\n"
            "up to 4096 bytes). --trace prints each run's index first; --save writes\n"
            "run K's input to FILE and stops before running it.\n",
            prog, dit_fuzz_target_def.name);
}

int main(int argc, char **argv)
{
    driver d = {.rng = 1, .max_len = 4096};
    uint64_t runs = 1000, seed = 1, save_k = 0;
    const char *save_path = NULL, *root = getenv("DIT_SOURCE_ROOT");
    bool trace = false;
    int rc = 1;
    input in = {0};
    void *ctx = NULL;
    if (!root)
        root = ".";

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool more = i + 1 < argc;
        uint64_t v;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout, argv[0]);
            rc = 0;
            goto cleanup;
        } else if (!strcmp(a, "--runs") && more && parse_u64(argv[i + 1], &v)) {
            runs = v;
            i++;
        } else if (!strcmp(a, "--seed") && more && parse_u64(argv[i + 1], &v)) {
            seed = v;
            i++;
        } else if (!strcmp(a, "--max-len") && more && parse_u64(argv[i + 1], &v) && v > 0 &&
                   v <= (1u << 24)) {
            d.max_len = (size_t)v;
            i++;
        } else if (!strcmp(a, "--dict") && more) {
            if (!read_dict(argv[++i], &d.dict))
                goto cleanup;
        } else if (!strcmp(a, "--root") && more) {
            root = argv[++i];
        } else if (!strcmp(a, "--trace")) {
            trace = true;
        } else if (!strcmp(a, "--save") && i + 2 < argc && parse_u64(argv[i + 1], &v)) {
            save_k = v;
            save_path = argv[i + 2];
            i += 2;
        } else if (a[0] == '-') {
            fprintf(stderr, "%s: unknown or incomplete option %s\n", argv[0], a);
            usage(stderr, argv[0]);
            goto cleanup;
        } else if (!add_corpus(a, &d.seeds)) {
            goto cleanup;
        }
    }
    d.rng = seed;
    in.cap = d.max_len + 64;
    in.p = malloc(in.cap);
    if (!in.p)
        goto cleanup;

    ctx = dit_fuzz_target_def.setup(root);
    if (!ctx)
        goto cleanup;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (size_t i = 0; i < d.seeds.n; i++) {
        if (trace)
            fprintf(stderr, "seed %zu\n", i);
        dit_fuzz_target_def.run(ctx, d.seeds.v[i].p, d.seeds.v[i].n);
    }
    for (uint64_t k = 0; k < runs || (save_path && k <= save_k); k++) {
        make_input(&d, ctx, &in);
        if (save_path && k == save_k) {
            FILE *f = fopen(save_path, "wb");
            bool ok = f && fwrite(in.p, 1, in.n, f) == in.n;
            if (f && fclose(f) != 0)
                ok = false;
            if (!ok) {
                fprintf(stderr, "fuzz: cannot write %s\n", save_path);
                goto cleanup;
            }
            printf("run %" PRIu64 " (%zu bytes) written to %s\n", save_k, in.n, save_path);
            rc = 0;
            goto cleanup;
        }
        if (trace)
            fprintf(stderr, "run %" PRIu64 "\n", k);
        if (dit_fuzz_target_def.run(ctx, in.p, in.n) == 0 && !keep_input(&d, &in))
            goto cleanup;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("%s: %zu seeds and %" PRIu64 " mutations (seed %" PRIu64 ") passed in %.2f s\n",
           dit_fuzz_target_def.name, d.seeds.n, runs, seed, s);
    rc = 0;

cleanup:
    if (ctx)
        dit_fuzz_target_def.teardown(ctx);
    free(in.p);
    for (size_t i = 0; i < d.n_recent; i++)
        free(d.recent[i].p);
    blobs_free(&d.seeds);
    blobs_free(&d.dict);
    return rc;
}
