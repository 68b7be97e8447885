#include "core/options.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "core/cli_util.h"

/* getopt_long's value for table entry i: past every byte a short option can have. */
#define LONG_BASE 1000
#define OPT_HELP (LONG_BASE - 1)
#define OPT_VERSION (LONG_BASE - 2)
#define MAX_OPTS 256

static int parse_value(const dit_option *opt, void *target, const char *val, char *err, size_t cap)
{
    char *p = (char *)target + opt->offset;
    char *end;
    switch (opt->kind) {
    case DIT_OPT_STRING:
        *(const char **)p = val;
        return 0;
    case DIT_OPT_FLAG:
        if (!val || strcmp(val, "1") == 0 || strcmp(val, "true") == 0 || strcmp(val, "yes") == 0) {
            if (opt->set)
                return opt->set(target, "1", err, cap) == 0 ? 0 : -1;
            *(bool *)p = true;
            return 0;
        }
        if (strcmp(val, "0") == 0 || strcmp(val, "false") == 0 || strcmp(val, "no") == 0 ||
            strcmp(val, "") == 0) {
            if (opt->set)
                return opt->set(target, "0", err, cap) == 0 ? 0 : -1;
            *(bool *)p = false;
            return 0;
        }
        snprintf(err, cap, "wants 1/0, true/false or yes/no, not '%s'", val);
        return -1;
    case DIT_OPT_INT:
    case DIT_OPT_BYTES: {
        errno = 0;
        const long long v = strtoll(val, &end, 10);
        if (errno || *val == '\0' || *end != '\0' || (double)v < opt->lo || (double)v > opt->hi) {
            snprintf(err, cap, "wants an integer from %lld to %lld, not '%s'", (long long)opt->lo,
                     (long long)opt->hi, val);
            return -1;
        }
        *(long long *)p = v;
        return 0;
    }
    case DIT_OPT_DOUBLE: {
        errno = 0;
        const double v = strtod(val, &end);
        if (errno || *val == '\0' || *end != '\0' || !isfinite(v) || v < opt->lo || v > opt->hi) {
            snprintf(err, cap, "wants a number from %g to %g, not '%s'", opt->lo, opt->hi, val);
            return -1;
        }
        *(double *)p = v;
        return 0;
    }
    case DIT_OPT_SECONDS: {
        errno = 0;
        const double v = strtod(val, &end);
        if (errno || *val == '\0' || *end != '\0' || !(v > 0) || v > 1e7) {
            snprintf(err, cap, "wants a positive number of seconds, not '%s'", val);
            return -1;
        }
        *(double *)p = v;
        return 0;
    }
    case DIT_OPT_CUSTOM:
        if (!opt->set) {
            snprintf(err, cap, "has no setter");
            return -1;
        }
        return opt->set(target, val, err, cap) == 0 ? 0 : -1;
    }
    snprintf(err, cap, "has an unknown kind");
    return -1;
}

/* "PROG: MESSAGE (see --help)", or the message and the program's own
 * pointer to its help on the next line. */
static int usage_error(const dit_options *o, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static int usage_error(const dit_options *o, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", o->prog);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (o->see_also)
        fprintf(stderr, "\n%s\n", o->see_also);
    else
        fputs(" (see --help)\n", stderr);
    return 2;
}

int dit_options_set(const dit_options *o, const dit_option *opt, void *target, const char *val,
                    const char *origin)
{
    char err[512];
    if (parse_value(opt, target, val, err, sizeof err) == 0)
        return 0;
    if (o->see_also)
        return usage_error(o, "%s %s", origin, err);
    fprintf(stderr, "%s: %s %s\n", o->prog, origin, err);
    return 2;
}

/* "--name", or "-n" for a short-only option. */
static void display_name(const dit_option *d, char *buf, size_t cap)
{
    if (d->name)
        snprintf(buf, cap, "--%s", d->name);
    else
        snprintf(buf, cap, "-%c", d->short_name);
}

const dit_option *dit_options_find(const dit_options *o, const char *name)
{
    for (size_t i = 0; i < o->n_opts; i++)
        if (o->opts[i].name && strcmp(o->opts[i].name, name) == 0)
            return &o->opts[i];
    return NULL;
}

/* Writes text from column COL, wrapped before column WIDTH; the first line
 * continues where the cursor is (at column COL). */
#define COL 33
#define WIDTH 100
static void put_wrapped(FILE *out, const char *text)
{
    int col = COL;
    while (*text) {
        const size_t word = strcspn(text, " ");
        if (col > COL && col + 1 + (int)word > WIDTH) {
            fprintf(out, "\n%*s", COL, "");
            col = COL;
        } else if (col > COL) {
            fputc(' ', out);
            col++;
        }
        fwrite(text, 1, word, out);
        col += (int)word;
        text += word;
        while (*text == ' ')
            text++;
    }
    fputc('\n', out);
}

void dit_options_print_list(const dit_option *opts, size_t n, FILE *out)
{
    for (size_t i = 0; i < n; i++) {
        const dit_option *d = &opts[i];
        if (d->hidden)
            continue;
        const char *arg = d->arg ? d->arg : "";
        const char *sp = d->arg ? " " : "";
        char left[80];
        if (d->name && d->short_name)
            snprintf(left, sizeof left, "-%c, --%s%s%s", d->short_name, d->name, sp, arg);
        else if (d->name)
            snprintf(left, sizeof left, "--%s%s%s", d->name, sp, arg);
        else
            snprintf(left, sizeof left, "-%c%s%s", d->short_name, sp, arg);
        char text[1024];
        int len = snprintf(text, sizeof text, "%s", d->help);
        if (d->def && d->kind != DIT_OPT_FLAG && len < (int)sizeof text)
            len += snprintf(text + len, sizeof text - (size_t)len, " (default %s)", d->def);
        if (d->env && len < (int)sizeof text)
            snprintf(text + len, sizeof text - (size_t)len, " [%s]", d->env);
        if (strlen(left) > COL - 3)
            fprintf(out, "  %s\n%*s", left, COL, "");
        else
            fprintf(out, "  %-*s", COL - 2, left);
        put_wrapped(out, text);
    }
}

void dit_options_print_help(const dit_options *o, FILE *out)
{
    if (o->print_help) {
        o->print_help(o, out);
        return;
    }
    fputs(o->usage, out);
    fputs("\nOptions", out);
    bool any_env = false;
    for (size_t i = 0; i < o->n_opts; i++)
        any_env |= o->opts[i].env != NULL;
    fputs(any_env ? " (one with a [VARIABLE] is also read from it; the flag wins):\n" : ":\n", out);
    dit_options_print_list(o->opts, o->n_opts, out);
    fprintf(out, "  %-*s%s\n", COL - 2, "-h, --help", "show this help");
    if (o->version)
        fprintf(out, "  %-*s%s\n", COL - 2, "--version", "print the version");
    if (o->epilog) {
        fputc('\n', out);
        fputs(o->epilog, out);
    }
}

int dit_options_parse(const dit_options *o, void *target, int argc, char **argv, int *first_arg)
{
    if (o->n_opts + o->n_foreign > MAX_OPTS) {
        fprintf(stderr, "%s: too many options in the table\n", o->prog);
        return 2;
    }
    int rc;
    for (size_t i = 0; i < o->n_opts; i++) {
        const dit_option *d = &o->opts[i];
        if (d->def) {
            char name[80], origin[96];
            display_name(d, name, sizeof name);
            snprintf(origin, sizeof origin, "the default of %s", name);
            if ((rc = dit_options_set(o, d, target, d->def, origin)) != 0)
                return rc;
        }
    }
    for (size_t i = 0; i < o->n_opts; i++) {
        const char *v = o->opts[i].env ? getenv(o->opts[i].env) : NULL;
        if (v && !v[0] && o->empty_env_unset)
            v = NULL;
        if (v && (rc = dit_options_set(o, &o->opts[i], target, v, o->opts[i].env)) != 0)
            return rc;
    }
    struct option lopts[MAX_OPTS + 3];
    /* ':' first: a missing value is reported as ':' rather than '?'. */
    char shorts[2 * MAX_OPTS + 8];
    snprintf(shorts, sizeof shorts, "%s", o->stop_at_positional ? "+:h" : ":h");
    size_t ns = strlen(shorts);
    size_t n = 0;
    for (size_t i = 0; i < o->n_opts; i++) {
        const dit_option *d = &o->opts[i];
        const bool has_arg = d->kind != DIT_OPT_FLAG;
        if (d->name)
            lopts[n++] = (struct option){d->name, has_arg ? required_argument : no_argument, NULL,
                                         LONG_BASE + (int)i};
        if (d->short_name) {
            shorts[ns++] = (char)d->short_name;
            if (has_arg)
                shorts[ns++] = ':';
        }
    }
    /* Sibling commands' options, unless this command has one of that name. */
    for (size_t i = 0; i < o->n_foreign; i++) {
        const dit_option *d = &o->foreign[i];
        if (!d->name || dit_options_find(o, d->name))
            continue;
        const bool has_arg = d->kind != DIT_OPT_FLAG;
        lopts[n++] = (struct option){d->name, has_arg ? required_argument : no_argument, NULL,
                                     LONG_BASE + MAX_OPTS + (int)i};
        if (d->short_name && !memchr(shorts, d->short_name, ns)) {
            shorts[ns++] = (char)d->short_name;
            if (has_arg)
                shorts[ns++] = ':';
        }
    }
    shorts[ns] = '\0';
    lopts[n++] = (struct option){"help", no_argument, NULL, OPT_HELP};
    if (o->version)
        lopts[n++] = (struct option){"version", no_argument, NULL, OPT_VERSION};
    lopts[n] = (struct option){NULL, 0, NULL, 0};
    opterr = 0;
    optind = 0; /* restart getopt (GNU): several tables may parse in one process */
    int c;
    while ((c = getopt_long(argc, argv, shorts, lopts, NULL)) != -1) {
        if (c == 'h' || c == OPT_HELP) {
            dit_options_print_help(o, stdout);
            return 1;
        }
        if (c == OPT_VERSION) {
            printf("%s %s\n", o->prog, o->version);
            return 1;
        }
        if (c == ':')
            return usage_error(o, "option '%s' needs a value", argv[optind - 1]);
        const dit_option *d = NULL;
        char foreign[80] = "";
        if (c >= LONG_BASE + MAX_OPTS)
            snprintf(foreign, sizeof foreign, "--%s", o->foreign[c - LONG_BASE - MAX_OPTS].name);
        else if (c >= LONG_BASE && c < LONG_BASE + (int)o->n_opts)
            d = &o->opts[c - LONG_BASE];
        else if (c != '?' && c < LONG_BASE) {
            for (size_t i = 0; i < o->n_opts && !d; i++)
                if (o->opts[i].short_name == c)
                    d = &o->opts[i];
            for (size_t i = 0; i < o->n_foreign && !d && !foreign[0]; i++)
                if (o->foreign[i].short_name == c)
                    snprintf(foreign, sizeof foreign, "-%c", c);
        }
        if (foreign[0])
            return usage_error(o, "option '%s' does not apply to this command", foreign);
        if (!d && optopt >= LONG_BASE && optopt < LONG_BASE + (int)o->n_opts)
            return usage_error(o, "option --%s takes no value", o->opts[optopt - LONG_BASE].name);
        if (!d) {
            const char *bad = argv[optind - 1];
            char shortbuf[3] = {'-', (char)optopt, '\0'};
            /* An unknown short option inside a cluster ("-xq") is named alone. */
            if (optopt && optopt < LONG_BASE && strncmp(bad, "--", 2) != 0)
                bad = shortbuf;
            const char *near = strncmp(bad, "--", 2) == 0 ? dit_suggest_option(bad, lopts) : NULL;
            return usage_error(o, "unknown option '%s'%s%s%s", bad,
                               near ? "; did you mean '--" : "", near ? near : "",
                               near ? "'?" : "");
        }
        /* Named the way it was written: "-n" or "--requests". */
        char origin[96];
        if (c < LONG_BASE)
            snprintf(origin, sizeof origin, "-%c", c);
        else
            display_name(d, origin, sizeof origin);
        if ((rc = dit_options_set(o, d, target, optarg, origin)) != 0)
            return rc;
    }
    if (!o->positional && !o->stop_at_positional && optind < argc)
        return usage_error(o, "unexpected argument '%s'", argv[optind]);
    if (first_arg)
        *first_arg = optind;
    return 0;
}
