/* ditctl's shared pieces: option parsing common to every command, the
 * request options generate and bench share, and error reporting. */
#ifndef DIT_CLIENT_DITCTL_H
#define DIT_CLIENT_DITCTL_H

#include <getopt.h>
#include <stdatomic.h>
#include <stdbool.h>

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
typedef struct ctl_request {
    Ditserve__V1__GenerateRequest req;
    Google__Protobuf__FloatValue guidance, true_cfg;
    Google__Protobuf__UInt64Value seed;
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

/* Help text for the connection options, shared by every command's help. */
extern const char ctl_common_help[];
/* Help text for the request options of generate and bench. */
extern const char ctl_request_help[];

void ctl_request_init(ctl_request *r);

/* Warns on stderr about request options that would have no effect (a
 * negative prompt without --true-cfg above 1, or the reverse), as diffusers
 * does. Returns true when it printed a warning. */
bool ctl_request_warn(const ctl_request *r);

/* Parses a command's arguments. The table `cmd_opts` (terminated by a zero
 * entry; may be NULL) holds the command's own options, which `handle` gets
 * with their getopt value; connection options, --help, and (when `req` is
 * not NULL) the request options are handled here. `usage` is printed for
 * --help. Returns 0, CTL_HELP_SHOWN, or CTL_EXIT_USAGE (already reported). */
typedef int (*ctl_opt_handler)(void *ctx, int opt, const char *arg);
int ctl_parse(int argc, char **argv, const char *cmd, const char *usage,
              const struct option *cmd_opts, const char *cmd_shortopts, ctl_opt_handler handle,
              void *ctx, ctl_common *common, ctl_request *req);

bool ctl_parse_long(const char *s, long lo, long hi, long *out);
bool ctl_parse_double(const char *s, double lo, double hi, double *out);

int ctl_generate(int argc, char **argv, ctl_common *common);
int ctl_bench(int argc, char **argv, ctl_common *common);

#endif
