/* The one status enum of ditserve, and the diagnostic buffer that carries a
 * human-readable message next to it.
 *
 * Every fallible function returns a dit_status. Functions that can say more
 * than the code (which file, which tensor, which rank) also take a
 * `dit_diag *` and fill it on failure; a NULL diag is allowed and simply drops
 * the message. Foreign error codes (errno, CUDA, NCCL, gRPC, libuv) are
 * converted to a dit_status at exactly one place per library.
 *
 * Owner: whoever declared the dit_diag (usually a stack variable). */
#ifndef DIT_CORE_STATUS_H
#define DIT_CORE_STATUS_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, gRPC-ish meaning shown to users) */
#define DIT_STATUS_LIST(X)                                                                         \
    X(DIT_OK, "ok")                                                                                \
    X(DIT_ERR_INVALID_ARG, "invalid argument")                                                     \
    X(DIT_ERR_NOMEM, "out of memory")                                                              \
    X(DIT_ERR_IO, "i/o error")                                                                     \
    X(DIT_ERR_FORMAT, "malformed input")                                                           \
    X(DIT_ERR_NOT_FOUND, "not found")                                                              \
    X(DIT_ERR_UNSUPPORTED, "unsupported")                                                          \
    X(DIT_ERR_TIMEOUT, "timed out")                                                                \
    X(DIT_ERR_PEER, "peer failed")                                                                 \
    X(DIT_ERR_CANCELLED, "cancelled")                                                              \
    X(DIT_ERR_DEVICE, "device error")                                                              \
    X(DIT_ERR_INTERNAL, "internal error")

typedef enum dit_status {
#define DIT_X_ENUM(name, text) name,
    DIT_STATUS_LIST(DIT_X_ENUM)
#undef DIT_X_ENUM
        DIT_STATUS_COUNT
} dit_status;

/* Short English text for a status; never NULL. */
const char *dit_status_str(dit_status st);

/* Stable identifier ("DIT_ERR_FORMAT") for logs and wire formats. */
const char *dit_status_name(dit_status st);

#define DIT_DIAG_MAX 1024

typedef struct dit_diag {
    dit_status status;
    char msg[DIT_DIAG_MAX];
} dit_diag;

/* Resets a diag to DIT_OK with an empty message. NULL-safe. */
void dit_diag_clear(dit_diag *d);

/* Records `st` with a printf-style message and returns `st`, so callers can
 * write `return dit_diag_set(d, DIT_ERR_FORMAT, "%s: ...", path);`.
 * The first message set wins: deeper layers describe the cause, outer layers
 * should use dit_diag_prefix to add context. NULL-safe. */
dit_status dit_diag_set(dit_diag *d, dit_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prepends context ("loading transformer: ") to an existing message. */
void dit_diag_prefix(dit_diag *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The message, or the status text when no message was set. */
const char *dit_diag_msg(const dit_diag *d);

/* goto-cleanup helper: evaluate, and on failure jump to `cleanup`. The
 * enclosing function must declare `dit_status st` and a `cleanup:` label. */
#define DIT_CHECK(expr)                                                                            \
    do {                                                                                           \
        st = (expr);                                                                               \
        if (st != DIT_OK)                                                                          \
            goto cleanup;                                                                          \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif
