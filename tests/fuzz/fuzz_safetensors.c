/* safetensors files, whose headers come with checkpoints and LoRA adapters
 * downloaded from anywhere: the input is the whole file (the 8-byte header
 * length, the JSON header, the data), written to a temporary file and
 * opened as the loader opens weights (mmap, then every header field checked
 * before anything is dereferenced).
 *
 * Properties: a file that does not open says why, naming the file; one
 * that opens has entries whose views hold exactly numel x dtype bytes, all
 * of them within the file's data and disjoint from each other, each found
 * again by its name; every entry converts to f32 (every byte of it read);
 * one-element entries read as scalars and others are refused as scalars. */
#include <stdbool.h>
#include <string.h>
#include <unistd.h>

#include "fuzz.h"
#include "loader/safetensors.h"

typedef struct st_ctx {
    char path[256];
    int fd;
    float *buf;
    size_t buf_cap;
} st_ctx;

static void teardown(void *p)
{
    st_ctx *c = p;
    if (c->fd >= 0) {
        close(c->fd);
        unlink(c->path);
    }
    free(c->buf);
    free(c);
}

static void *setup(const char *root)
{
    (void)root;
    st_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->fd = dit_fuzz_scratch(c->path, sizeof c->path, "st", false);
    if (c->fd < 0) {
        free(c);
        return NULL;
    }
    return c;
}

typedef struct span {
    const uint8_t *lo, *hi;
} span;

static int span_cmp(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

static int run(void *p, const uint8_t *data, size_t size)
{
    st_ctx *c = p;
    if (ftruncate(c->fd, 0) != 0 || pwrite(c->fd, data, size, 0) != (ssize_t)size)
        DIT_FUZZ_FAIL("cannot write %s", c->path);
    dit_st_file *f = NULL;
    dit_diag d;
    dit_diag_clear(&d);
    if (dit_st_file_open(c->path, &f, &d) != DIT_OK) {
        DIT_FUZZ_REQUIRE(strstr(d.msg, c->path) != NULL, "a refusal not naming the file: %s",
                         d.msg);
        return -1;
    }
    /* Where the data starts in the input: 8 + the header length. */
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | data[i];
    DIT_FUZZ_REQUIRE(size >= 8 && hlen <= size - 8, "opened with a header past the end");
    const uint64_t data_len = size - 8 - hlen;

    const size_t n = dit_st_file_count(f);
    span *spans = calloc(n ? n : 1, sizeof *spans);
    if (!spans)
        goto done;
    size_t n_spans = 0;
    for (size_t i = 0; i < n; i++) {
        const dit_st_entry *e = dit_st_file_at(f, i);
        DIT_FUZZ_REQUIRE(e && e->name && dit_st_file_find(f, e->name) == e, "entry %zu", i);
        const dit_tensor *t = &e->view;
        const int64_t numel = dit_tensor_numel(t);
        DIT_FUZZ_REQUIRE(numel >= 0, "numel %lld", (long long)numel);
        const uint64_t bytes = (uint64_t)numel * dit_dtype_size(t->dtype);
        DIT_FUZZ_REQUIRE(bytes <= data_len, "'%s' holds %llu bytes of %llu", e->name,
                         (unsigned long long)bytes, (unsigned long long)data_len);
        if (bytes)
            spans[n_spans++] = (span){t->data, (const uint8_t *)t->data + bytes};
        size_t need = (size_t)numel * sizeof(float);
        if (need > c->buf_cap) {
            float *nb = realloc(c->buf, need);
            if (!nb)
                continue;
            c->buf = nb;
            c->buf_cap = need;
        }
        dit_diag_clear(&d);
        dit_status st = dit_st_entry_convert(e, NULL, DIT_F32, c->buf, need, &d);
        DIT_FUZZ_REQUIRE(st == DIT_OK, "'%s' does not convert: %s", e->name, d.msg);
        float v;
        st = dit_st_entry_scalar(e, &v, &d);
        DIT_FUZZ_REQUIRE((st == DIT_OK) == (numel == 1), "'%s' (%lld elements) as a scalar: %s",
                         e->name, (long long)numel, dit_status_name(st));
        if (st == DIT_OK)
            DIT_FUZZ_REQUIRE(memcmp(&v, c->buf, sizeof v) == 0 ||
                                 (v != v && c->buf[0] != c->buf[0]),
                             "'%s': scalar and conversion differ", e->name);
    }
    /* The views (all in one mapping) are disjoint and span no more than
     * the data. */
    qsort(spans, n_spans, sizeof *spans, span_cmp);
    const uint8_t *top = n_spans ? spans[0].hi : NULL;
    for (size_t i = 1; i < n_spans; i++) {
        DIT_FUZZ_REQUIRE(spans[i].lo >= spans[i - 1].hi, "tensor data overlaps");
        top = spans[i].hi;
    }
    if (n_spans)
        DIT_FUZZ_REQUIRE((uint64_t)(top - spans[0].lo) <= data_len,
                         "the tensors span more than the data");
    free(spans);
done:
    dit_st_file_close(f);
    return 0;
}

const dit_fuzz_target dit_fuzz_target_def = {
    .name = "safetensors", .setup = setup, .run = run, .teardown = teardown};
