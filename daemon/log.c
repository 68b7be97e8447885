#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

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

/* Escapes a string for a JSON value (quotes, backslashes, control bytes). */
static void json_escape(const char *in, char *out, size_t cap)
{
    size_t o = 0;
    for (; in && *in && o + 7 < cap; in++) {
        unsigned char c = (unsigned char)*in;
        if (c == '"' || c == '\\') {
            out[o++] = '\\';
            out[o++] = (char)c;
        } else if (c < 0x20) {
            o += (size_t)snprintf(out + o, cap - o, "\\u%04x", c);
        } else {
            out[o++] = (char)c;
        }
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
    if (lg->json) {
        char esc[4096];
        json_escape(msg, esc, sizeof esc);
        fprintf(stderr, "{\"time\":\"%s\",\"level\":\"%s\",\"pid\":%d,\"subsystem\":\"%s\",\"msg\":\"%s\"}\n",
                ts, level_names[lvl], (int)getpid(), subsys, esc);
    } else {
        fprintf(stderr, "%s %-5s ditd[%d] %s: %s\n", ts, level_names[lvl], (int)getpid(), subsys,
                msg);
    }
}

void dit_log_request(const dit_log *lg, const char *request_id, const char *model, int width,
                     int height, int steps, double queue_ms, double compute_ms, const char *status,
                     const char *detail)
{
    if (!dit_log_enabled(lg, DIT_LOG_INFO))
        return;
    char ts[40];
    timestamp(ts, sizeof ts);
    if (lg->json) {
        char id[300], mod[600], det[1200];
        json_escape(request_id, id, sizeof id);
        json_escape(model, mod, sizeof mod);
        json_escape(detail, det, sizeof det);
        fprintf(stderr,
                "{\"time\":\"%s\",\"level\":\"info\",\"pid\":%d,\"subsystem\":\"request\","
                "\"request_id\":\"%s\",\"model\":\"%s\",\"width\":%d,\"height\":%d,\"steps\":%d,"
                "\"queue_ms\":%.1f,\"compute_ms\":%.1f,\"status\":\"%s\",\"detail\":\"%s\"}\n",
                ts, (int)getpid(), id, mod, width, height, steps, queue_ms, compute_ms, status, det);
    } else {
        fprintf(stderr,
                "%s info  ditd[%d] request: id=%s model=%s shape=%dx%d steps=%d queue_ms=%.1f "
                "compute_ms=%.1f status=%s%s%s\n",
                ts, (int)getpid(), request_id, model, width, height, steps, queue_ms, compute_ms,
                status, detail && *detail ? " detail=" : "", detail ? detail : "");
    }
}
