#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/utf8.h"

static const char *const level_names[] = {"debug", "info", "warn", "error"};

bool dit_log_level_parse(const char *s, dit_log_level *out)
{
    for (int i = 0; i < 4; i++)
        if (strcmp(s, level_names[i]) == 0) {
            *out = (dit_log_level)i;
            return true;
        }
    return false;
}

static void timestamp(char *buf, size_t cap)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(buf + n, cap - n, ".%03ldZ", ts.tv_nsec / 1000000);
}

/* Copies in (NULL: empty) into out (cap bytes, NUL-terminated) so that it
 * cannot break the line it goes into: control bytes, and bytes that are not
 * UTF-8, escaped (\n, \xNN in text; \uNNNN in JSON, with quotes and
 * backslashes); in text also spaces when `word` (key=value fields). Strings
 * come from clients, so the output is capped: past cap it ends in "...". */
static void escape(const char *in, char *out, size_t cap, bool json, bool word)
{
    const unsigned char *p = (const unsigned char *)(in ? in : "");
    size_t n = strlen((const char *)p), o = 0;
    const size_t room = cap - 4; /* for "..." and the NUL */
    while (n > 0) {
        char tmp[8];
        size_t t = 0, used = 1;
        const unsigned c = *p;
        const size_t u = dit_utf8_len((const char *)p, n);
        if (c == '\\' || (json && c == '"')) {
            tmp[t++] = '\\';
            tmp[t++] = (char)c;
        } else if (c < 0x20 || c == 0x7f || u == 0 || (word && c == ' ')) {
            if (json)
                t = (size_t)snprintf(tmp, sizeof tmp, "\\u%04x", u == 0 ? 0xfffdu : c);
            else if (c == '\n')
                t = (size_t)snprintf(tmp, sizeof tmp, "\\n");
            else if (c == '\r')
                t = (size_t)snprintf(tmp, sizeof tmp, "\\r");
            else if (c == '\t')
                t = (size_t)snprintf(tmp, sizeof tmp, "\\t");
            else
                t = (size_t)snprintf(tmp, sizeof tmp, "\\x%02x", c);
        } else {
            used = u;
            memcpy(tmp, p, u);
            t = u;
        }
        if (o + t > room) {
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        memcpy(out + o, tmp, t);
        o += t;
        p += used;
        n -= used;
    }
    out[o] = '\0';
}

void dit_log_write(const dit_log *lg, dit_log_level lvl, const char *subsys, const char *fmt, ...)
{
    char msg[2048], ts[40];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    timestamp(ts, sizeof ts);
    /* Messages may quote what clients sent: escaped in both formats, so
     * that none can start a line of its own. */
    char esc[4096];
    escape(msg, esc, sizeof esc, lg->json, false);
    if (lg->json)
        fprintf(
            stderr,
            "{\"time\":\"%s\",\"level\":\"%s\",\"pid\":%d,\"subsystem\":\"%s\",\"msg\":\"%s\"}\n",
            ts, level_names[lvl], (int)getpid(), subsys, esc);
    else
        fprintf(stderr, "%s %-5s ditd[%d] %s: %s\n", ts, level_names[lvl], (int)getpid(), subsys,
                esc);
}

void dit_log_request(const dit_log *lg, const char *request_id, const char *model, int width,
                     int height, int steps, const char *loras, double queue_ms, double compute_ms,
                     const char *status, const char *detail)
{
    if (!dit_log_enabled(lg, DIT_LOG_INFO))
        return;
    char ts[40];
    timestamp(ts, sizeof ts);
    /* Every field a client chose is escaped and capped (DIT_LOG_FIELD_MAX
     * and the detail's buffer), whatever it holds. */
    char id[DIT_LOG_FIELD_MAX], mod[DIT_LOG_FIELD_MAX], det[1200], lor[1200] = "";
    escape(request_id, id, sizeof id, lg->json, !lg->json);
    escape(model, mod, sizeof mod, lg->json, !lg->json);
    if (loras && *loras)
        escape(loras, lor, sizeof lor, lg->json, !lg->json);
    escape(detail, det, sizeof det, lg->json, false);
    if (lg->json) {
        fprintf(
            stderr,
            "{\"time\":\"%s\",\"level\":\"info\",\"pid\":%d,\"subsystem\":\"request\","
            "\"request_id\":\"%s\",\"model\":\"%s\",\"width\":%d,\"height\":%d,\"steps\":%d,"
            "%s%s%s\"queue_ms\":%.1f,\"compute_ms\":%.1f,\"status\":\"%s\",\"detail\":\"%s\"}\n",
            ts, (int)getpid(), id, mod, width, height, steps, lor[0] ? "\"loras\":\"" : "", lor,
            lor[0] ? "\"," : "", queue_ms, compute_ms, status, det);
    } else {
        fprintf(stderr,
                "%s info  ditd[%d] request: id=%s model=%s shape=%dx%d steps=%d%s%s queue_ms=%.1f "
                "compute_ms=%.1f status=%s%s%s\n",
                ts, (int)getpid(), id, mod, width, height, steps, lor[0] ? " loras=" : "", lor,
                queue_ms, compute_ms, status, det[0] ? " detail=" : "", det);
    }
}
