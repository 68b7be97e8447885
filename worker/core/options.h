/* One option table per program, with the defaults inside it: ditd, ditrun
 * (and its subcommands), ditctl and ditworker describe their flags as an
 * array of dit_option, and one function reads the environment variables,
 * parses argv, range-checks every value, suggests the nearest flag for a
 * mistyped one, and prints --help from the same table, so that the help,
 * the defaults and the parser cannot disagree.
 *
 * Values land in a caller struct at each option's offset: DIT_OPT_STRING in
 * a `const char *`, DIT_OPT_INT and DIT_OPT_BYTES in a `long long`,
 * DIT_OPT_DOUBLE and DIT_OPT_SECONDS in a `double`, DIT_OPT_FLAG in a
 * `bool`; DIT_OPT_CUSTOM calls the option's setter instead (and so does a
 * DIT_OPT_FLAG that has one, with "1" or "0"). Every option
 * with a default is first set from it (parsed like a value the user wrote),
 * then from its environment variable, then from the command line: the
 * flags win. Strings point into the table, the environment or argv; nothing
 * is allocated.
 *
 * Depends on libc alone (ditctl links it without the compute core).
 *
 * Owner: none; the table is constant, the target belongs to the caller. */
#ifndef DIT_CORE_OPTIONS_H
#define DIT_CORE_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

typedef enum dit_opt_kind {
    DIT_OPT_STRING,  /* const char * */
    DIT_OPT_INT,     /* long long in [lo, hi] */
    DIT_OPT_BYTES,   /* long long in [lo, hi], a byte count */
    DIT_OPT_DOUBLE,  /* double in [lo, hi] */
    DIT_OPT_SECONDS, /* double, above 0 and at most 1e7 */
    DIT_OPT_FLAG,    /* bool; no value on the command line; 1/0, true/false, yes/no from the
                        environment */
    DIT_OPT_CUSTOM,  /* set() parses and stores the value */
} dit_opt_kind;

/* Parses val and stores it in target; returns 0, or -1 with what is wrong
 * in err (e.g. "wants cpu or cuda, not 'tpu'"; the caller prefixes the
 * program and the flag or variable name). */
typedef int (*dit_opt_setter)(void *target, const char *val, char *err, size_t errcap);

typedef struct dit_option {
    const char *name; /* long name without dashes: "max-queue"; NULL: short only */
    int short_name;   /* 'n', or 0 for none */
    dit_opt_kind kind;
    const char *def;    /* default as it would be written ("16", "0.0.0.0:50051"); NULL: none */
    const char *arg;    /* metavariable in --help ("N"); NULL for flags */
    const char *help;   /* one sentence; the default and the variable are appended */
    const char *env;    /* environment variable read before argv, or NULL */
    size_t offset;      /* of the value in the target struct (offsetof) */
    double lo, hi;      /* range of INT, BYTES and DOUBLE values */
    dit_opt_setter set; /* DIT_OPT_CUSTOM; optional for DIT_OPT_FLAG */
    bool hidden;        /* internal (e.g. set by a launcher): parsed, left out of --help */
} dit_option;

typedef struct dit_options dit_options;
struct dit_options {
    const char *prog;    /* program name in messages: "ditd", "ditrun generate" */
    const char *usage;   /* --help's first lines, e.g. "usage: ditd --model DIR [options]\n" */
    const char *epilog;  /* printed after the options, or NULL */
    const char *version; /* non-NULL: --version prints "PROG VERSION" */
    const dit_option *opts;
    size_t n_opts;
    bool positional; /* arguments that are not options are allowed (returned in *first_arg) */
    /* Options of sibling commands (ditrun forward's --inputs for ditrun
     * generate): read with their values like the program's own, then
     * refused with "option '--inputs' does not apply to this command". */
    const dit_option *foreign;
    size_t n_foreign;
    /* The first argument that is not an option ends the options (a command
     * name: what follows is the command's). */
    bool stop_at_positional;
    /* An empty environment variable counts as unset. */
    bool empty_env_unset;
    /* Printed on its own line after a usage error instead of " (see
     * --help)", e.g. "run 'ditctl health --help' for its options". */
    const char *see_also;
    /* --help prints with this instead of dit_options_print_help (for
     * programs whose help has several option lists); help_ctx is theirs. */
    void (*print_help)(const dit_options *o, FILE *out);
    const void *help_ctx;
};

/* Sets every default, then the environment, then argv (argv[0] is the
 * program and is skipped). Returns 0 to run (*first_arg: the index of the
 * first argument that is not an option, argc when none; may be NULL when
 * positional is false), 1 when --help or --version was printed to stdout,
 * 2 after printing a usage error to stderr ("PROG: --max-queue wants an
 * integer from 0 to 100000, not 'x'", "PROG: unknown option '--widht'; did
 * you mean '--width'? (see --help)"). Uses getopt_long; restarts it. */
int dit_options_parse(const dit_options *o, void *target, int argc, char **argv, int *first_arg);

/* --help: the usage, then one entry per option ("  -n, --name ARG" and
 * the help, "(default DEF)" and "[ENV]"), then --help / --version and the
 * epilog. */
void dit_options_print_help(const dit_options *o, FILE *out);

/* The lines of one option list, as --help prints them (for programs that
 * print several lists under their own headings). */
void dit_options_print_list(const dit_option *opts, size_t n, FILE *out);

/* Sets one option from a value the way the parser does (origin names where
 * the value came from, for the message). Returns 0 or 2 (message printed
 * to stderr). For callers that take values from elsewhere (a config file). */
int dit_options_set(const dit_options *o, const dit_option *opt, void *target, const char *val,
                    const char *origin);

/* The option called name, or NULL. */
const dit_option *dit_options_find(const dit_options *o, const char *name);

#endif
