/* The daemon's logger: lines tagged with time, level, pid and subsystem,
 * filtered by level before anything is formatted, as text or as JSON.
 *
 * Owner: main creates it; every module of the daemon's loop thread uses it
 * through a pointer. Writes are single fprintf calls, so lines from other
 * threads do not interleave. */
#ifndef DIT_DAEMON_LOG_H
#define DIT_DAEMON_LOG_H

#include <stdbool.h>

typedef enum dit_log_level {
    DIT_LOG_DEBUG = 0,
    DIT_LOG_INFO,
    DIT_LOG_WARN,
    DIT_LOG_ERROR,
} dit_log_level;

typedef struct dit_log {
    dit_log_level level;
    bool json;
} dit_log;

/* Parses debug / info / warn / error. */
bool dit_log_level_parse(const char *s, dit_log_level *out);

#define dit_log_enabled(lg, lvl) ((lg) && (lvl) >= (lg)->level)

void dit_log_write(const dit_log *lg, dit_log_level lvl, const char *subsys, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Bytes a client-chosen field (request_id, model) takes in a log line at
 * most, escapes included; longer ones end in "...". */
#define DIT_LOG_FIELD_MAX 200

/* One JSON object per request (or a text line): the request log. Every
 * string is escaped (control bytes, invalid UTF-8; spaces in request_id and
 * model in text) and capped, in both formats. loras: the adapters the
 * request used ("name:scale,..."), NULL or "" for none (then left out). */
void dit_log_request(const dit_log *lg, const char *request_id, const char *model, int width,
                     int height, int steps, const char *loras, double queue_ms, double compute_ms,
                     const char *status, const char *detail);

#define DIT_LOG(lg, lvl, subsys, ...)                                                              \
    do {                                                                                           \
        if (dit_log_enabled(lg, lvl))                                                              \
            dit_log_write(lg, lvl, subsys, __VA_ARGS__);                                           \
    } while (0)

#endif
