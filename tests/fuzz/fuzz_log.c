/* ditd's log lines with client-chosen text in them: the request log
 * (request_id, model, adapters, the refusal's detail) and a message quoting
 * a client's string, in JSON and in text. The input is the fields, split
 * at NUL bytes (a C string cannot hold one): request_id, model, loras,
 * detail, message.
 *
 * Properties: each call writes exactly one line; a JSON line parses (cJSON)
 * as one object whose string fields are valid UTF-8 and, for a field that
 * was valid UTF-8 without control bytes and short enough, equal to what
 * the client sent; a text line holds no control byte, is valid UTF-8, and
 * its id= and model= values contain no space (so no field can forge
 * another). */
#include <cjson/cJSON.h>
#include <stdbool.h>
#include <string.h>
#include <unistd.h>

#include "core/utf8.h"
#include "fuzz.h"
#include "log.h"

#define N_FIELDS 5
#define OUT_MAX 65536

typedef struct log_ctx {
    char path[256];
    int fd;
    char out[OUT_MAX + 1];
} log_ctx;

static void teardown(void *p)
{
    log_ctx *c = p;
    if (c->fd >= 0) {
        close(c->fd);
        unlink(c->path);
    }
    free(c);
}

static void *setup(const char *root)
{
    (void)root;
    log_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->fd = dit_fuzz_scratch(c->path, sizeof c->path, "log", false);
    if (c->fd < 0) {
        free(c);
        return NULL;
    }
    return c;
}

/* Runs both log calls with stderr sent to the context's file; the lines
 * they wrote end up in c->out (NUL-terminated), their length returned. */
static size_t capture(log_ctx *c, const dit_log *lg, char *const *f)
{
    fflush(stderr);
    const int saved = dup(2);
    if (saved < 0 || ftruncate(c->fd, 0) != 0 || lseek(c->fd, 0, SEEK_SET) != 0 ||
        dup2(c->fd, 2) < 0)
        DIT_FUZZ_FAIL("cannot redirect stderr");
    dit_log_request(lg, f[0], f[1], 64, 48, 8, f[2], 1.5, 20.25, "INVALID_ARGUMENT", f[3]);
    dit_log_write(lg, DIT_LOG_WARN, "request", "request %s refused: %s", f[0], f[4]);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    ssize_t n = pread(c->fd, c->out, OUT_MAX, 0);
    DIT_FUZZ_REQUIRE(n >= 0, "cannot read the log back");
    c->out[n] = 0;
    return (size_t)n;
}

/* The lines of out: exactly two, each ending in '\n'; their starts. */
static void split_lines(char *out, size_t n, char **lines)
{
    char *nl = memchr(out, '\n', n);
    DIT_FUZZ_REQUIRE(nl, "no end of line");
    char *nl2 = memchr(nl + 1, '\n', n - (size_t)(nl + 1 - out));
    DIT_FUZZ_REQUIRE(nl2 && nl2 == out + n - 1, "not exactly two lines: \"%s\"", out);
    *nl = *nl2 = 0;
    lines[0] = out;
    lines[1] = nl + 1;
}

/* A field that the log must carry as it is. */
static bool plain(const char *s, size_t max)
{
    size_t n = strlen(s);
    if (n > max || !dit_utf8_valid(s, n))
        return false;
    for (const char *p = s; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f || *p == '"' || *p == '\\')
            return false;
    return true;
}

static const char *json_string(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    DIT_FUZZ_REQUIRE(cJSON_IsString(v) && v->valuestring, "no string \"%s\"", key);
    DIT_FUZZ_REQUIRE(dit_utf8_valid(v->valuestring, strlen(v->valuestring)),
                     "\"%s\" is not valid UTF-8", key);
    return v->valuestring;
}

static void check_json(char *out, size_t n, char *const *f)
{
    char *lines[2];
    split_lines(out, n, lines);
    cJSON *req = cJSON_Parse(lines[0]), *msg = cJSON_Parse(lines[1]);
    DIT_FUZZ_REQUIRE(cJSON_IsObject(req), "the request line is not a JSON object: %s", lines[0]);
    DIT_FUZZ_REQUIRE(cJSON_IsObject(msg), "the message line is not a JSON object: %s", lines[1]);
    static const char *const keys[] = {"request_id", "model", NULL, "detail"};
    for (int i = 0; i < 4; i++) {
        if (!keys[i])
            continue;
        const char *got = json_string(req, keys[i]);
        if (plain(f[i], 150))
            DIT_FUZZ_REQUIRE(!strcmp(got, f[i]), "%s \"%s\" logged as \"%s\"", keys[i], f[i], got);
    }
    if (*f[2]) {
        const char *got = json_string(req, "loras");
        if (plain(f[2], 150))
            DIT_FUZZ_REQUIRE(!strcmp(got, f[2]), "loras \"%s\" logged as \"%s\"", f[2], got);
    }
    json_string(msg, "msg");
    cJSON_Delete(req);
    cJSON_Delete(msg);
}

static void check_text_line(const char *line)
{
    size_t n = strlen(line);
    DIT_FUZZ_REQUIRE(dit_utf8_valid(line, n), "a text line that is not UTF-8");
    for (const char *p = line; *p; p++)
        DIT_FUZZ_REQUIRE((unsigned char)*p >= 0x20 && *p != 0x7f, "a control byte in \"%s\"", line);
}

static void check_text(char *out, size_t n)
{
    char *lines[2];
    split_lines(out, n, lines);
    check_text_line(lines[0]);
    check_text_line(lines[1]);
    const char *id = strstr(lines[0], " request: id=");
    DIT_FUZZ_REQUIRE(id, "no id= in \"%s\"", lines[0]);
    const char *sp = strchr(id + strlen(" request: id="), ' ');
    DIT_FUZZ_REQUIRE(sp && !strncmp(sp, " model=", 7), "id= runs into \"%s\"", sp ? sp : "");
    sp = strchr(sp + 7, ' ');
    DIT_FUZZ_REQUIRE(sp && !strncmp(sp, " shape=64x48 steps=8", 20), "model= runs into \"%s\"",
                     sp ? sp : "");
}

static int run(void *p, const uint8_t *data, size_t size)
{
    log_ctx *c = p;
    char *buf = malloc(size + 1);
    if (!buf)
        return -1;
    memcpy(buf, data, size);
    buf[size] = 0;
    char *f[N_FIELDS];
    char *at = buf, *end = buf + size;
    for (int i = 0; i < N_FIELDS; i++) { /* field i: up to the next NUL */
        f[i] = at;
        if (at < end)
            at += strlen(at) + (at + strlen(at) < end);
    }
    dit_log json = {.level = DIT_LOG_DEBUG, .json = true};
    size_t n = capture(c, &json, f);
    check_json(c->out, n, f);
    dit_log text = {.level = DIT_LOG_DEBUG, .json = false};
    n = capture(c, &text, f);
    check_text(c->out, n);
    free(buf);
    return 0;
}

const dit_fuzz_target dit_fuzz_target_def = {
    .name = "log", .setup = setup, .run = run, .teardown = teardown};
