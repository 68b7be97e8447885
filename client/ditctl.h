/* ditctl's shared pieces: option parsing common to every command, the
 * request options generate and bench share, and error reporting. */
#ifndef DIT_CLIENT_DITCTL_H
#define DIT_CLIENT_DITCTL_H

#include <stdatomic.h>
#include <stdbool.h>

#include "core/options.h"
#include "ditclient.h"

enum {
    CTL_EXIT_OK = 0,
    CTL_EXIT_FAIL = 1,  /* a gRPC error, an unhealthy server, a file that cannot be written */
    CTL_EXIT_USAGE = 2, /* bad command-line arguments; interrupted: 128 + the signal */
    CTL_HELP_SHOWN = -1 /* from the parsers: --help was printed, exit 0 */
};

/* Connection options, taken from the command line (before or after the
 * command name) and the environment. */
typedef struct ctl_common {
    dit_client_opts copts;
    bool timeout_set;
} ctl_common;

/* The GenerateRequest and the storage for its optional wrapper fields. */
#define CTL_MAX_LORAS 8

typedef struct ctl_request {
    Ditserve__V1__GenerateRequest req;
    Google__Protobuf__FloatValue guidance, true_cfg;
    Google__Protobuf__UInt64Value seed;
    Ditserve__V1__LoraUse lora[CTL_MAX_LORAS];
    char lora_names[CTL_MAX_LORAS][256];
    Ditserve__V1__LoraUse *lora_ptrs[CTL_MAX_LORAS];
    bool have_prompt;
    bool raw;
} ctl_request;

/* The signal number once SIGINT or SIGTERM arrived, else 0; passed to every
 * call as its cancel flag. */
extern atomic_int ctl_interrupted;
void ctl_catch_signals(void);

/* Prints "ditctl: <message>" and a pointer to the command's --help to
 * stderr; returns CTL_EXIT_USAGE. */
int ctl_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prints "ditctl: <STATUS_NAME>: <details>" to stderr; returns CTL_EXIT_FAIL. */
int ctl_rpc_error(const dit_rpc_status *st);

/* Opens the client; default_timeout applies unless --timeout was given.
 * Prints the reason and returns CTL_EXIT_FAIL on failure. */
int ctl_open(const ctl_common *common, double default_timeout, dit_client **out);

/* Where the option setters write: connection options to common, request
 * options to req, a command's own options to cmd (its argument struct). */
typedef struct ctl_target {
    ctl_common *common;
    ctl_request *req;
    void *cmd;
} ctl_target;

void ctl_request_init(ctl_request *r);

/* Warns on stderr about request options that would have no effect (a
 * negative prompt without --true-cfg above 1, or the reverse), as diffusers
 * does. Returns true when it printed a warning. */
bool ctl_request_warn(const ctl_request *r);

/* A command's help: `intro` (the usage lines and what it does), its own
 * options, the request options (with a request), the connection options,
 * then `epilog` (its exit status). */
typedef struct ctl_help {
    const char *intro, *epilog;
} ctl_help;

/* Parses a command's arguments with one option table (core/options.h): the
 * command's own options (`cmd_opts`, n_cmd of them; their setters get a
 * ctl_target whose cmd is `cmd`), the request options when `req` is not
 * NULL, and the connection options. --help prints from the same tables.
 * Returns 0, CTL_HELP_SHOWN, or CTL_EXIT_USAGE (already reported). */
int ctl_parse(int argc, char **argv, const char *cmd, const ctl_help *help,
              const dit_option *cmd_opts, size_t n_cmd, void *cmd_ctx, ctl_common *common,
              ctl_request *req);

bool ctl_parse_long(const char *s, long lo, long hi, long *out);
bool ctl_parse_double(const char *s, double lo, double hi, double *out);

int ctl_generate(int argc, char **argv, ctl_common *common);
int ctl_bench(int argc, char **argv, ctl_common *common);

#endif
