/* ditctl: the command-line client of ditd.
 *
 *   ditctl [connection options] <command> [options]
 *
 * Commands: generate, health, info, models, warmup, bench. This file holds
 * main, the option parsing every command shares, and the small commands;
 * generate and bench live in ditctl_generate.c and ditctl_bench.c. */
#include "ditctl.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/support/log.h>

#include "core/cli_util.h"

#ifndef DIT_VERSION
#define DIT_VERSION "dev"
#endif

atomic_int ctl_interrupted;

/* Short timeouts for the quick calls, so that a hung server does not hang a
 * probe script; generation and warmup take as long as they take. */
#define QUICK_TIMEOUT_S 10.0

const char ctl_common_help[] =
    "Connection options (also accepted before the command name):\n"
    "  --target HOST:PORT   the daemon (default $DITCTL_TARGET, else 127.0.0.1:50051);\n"
    "                       a HOST alone means HOST:50051, ditd's port\n"
    "  --timeout SECONDS    deadline of each call; 0: none (default 10 for health,\n"
    "                       info and models; none for generate, warmup and bench)\n"
    "  --tls                use TLS, verifying the server with the system's roots\n"
    "  --ca FILE            use TLS, verifying the server with the PEM roots in FILE\n"
    "  --cert FILE          client certificate chain (PEM) for mutual TLS; needs --key\n"
    "  --key FILE           private key (PEM) of --cert\n"
    "  --token TOKEN        bearer token, sent as 'authorization: Bearer TOKEN' on every\n"
    "                       call but health checks (default $DITCTL_TOKEN)\n";

#define EXIT_HELP                                                                                  \
    "Exit status: 0 on success, 1 on a gRPC error (printed as 'ditctl: STATUS: details'),\n"       \
    "2 on bad command-line arguments, 130 when interrupted (Ctrl-C; 143 for SIGTERM).\n"

static const char main_usage[] =
    "usage: ditctl [connection options] <command> [options]\n"
    "\n"
    "The command-line client of ditd, the ditserve daemon (gRPC API ditserve.v1).\n"
    "\n"
    "Commands:\n"
    "  generate   text to image: writes the PNG (or the raw tensor) and prints the\n"
    "             seed, size and timings\n"
    "  health     asks grpc.health.v1 whether the server is SERVING\n"
    "  info       version, parallel layout, backend, devices, queue state\n"
    "  models     the models the daemon serves\n"
    "  warmup     runs one generation of a shape so that later ones start at full speed\n"
    "  bench      N generations, C at a time: latency percentiles, throughput, and\n"
    "             the daemon's overhead over the worker's compute\n"
    "\n"
    "Options:\n"
    "  --help, -h   this help; 'ditctl <command> --help' or 'ditctl help <command>'\n"
    "               for a command's options\n"
    "  --version    print the version\n"
    "gRPC's own log lines are hidden unless GRPC_VERBOSITY is set (e.g. =debug).\n"
    "\n"
    "%s"
    "\n" EXIT_HELP;

static const char health_usage[] =
    "usage: ditctl health [--service NAME] [connection options]\n"
    "\n"
    "Calls grpc.health.v1.Health/Check and prints the state: SERVING, NOT_SERVING,\n"
    "UNKNOWN or SERVICE_UNKNOWN. No token is sent (health checks are unauthenticated).\n"
    "\n"
    "  --service NAME   the service to ask about, e.g. ditserve.v1.Generation\n"
    "                   (default '': the server as a whole)\n"
    "\n"
    "%s"
    "\n"
    "Exit status: 0 only when SERVING; 1 for any other state or a gRPC error (printed as\n"
    "'ditctl: STATUS: details'); 2 on bad command-line arguments; 130 when interrupted.\n";

static const char info_usage[] = "usage: ditctl info [connection options]\n"
                                 "\n"
                                 "Calls GetServerInfo and prints its fields, one 'key: value' "
                                 "per line,\nthen the served model as 'ditctl models' shows it.\n"
                                 "\n"
                                 "%s"
                                 "\n" EXIT_HELP;

static const char models_usage[] = "usage: ditctl models [connection options]\n"
                                   "\n"
                                   "Calls ListModels and prints each model: its pipeline, task,\n"
                                   "transformer and text encoders, then the defaults a request's\n"
                                   "zeros stand for, the sizes the server allows, and the config\n"
                                   "values a client needs to build tensors.\n"
                                   "\n"
                                   "%s"
                                   "\n" EXIT_HELP;

static const char warmup_usage[] =
    "usage: ditctl warmup [--model NAME] [--width W] [--height H] [--steps N]\n"
    "                     [connection options]\n"
    "\n"
    "Calls Warmup: the daemon runs one generation of this shape so that later requests\n"
    "of the same shape start at full speed. Prints the time it took.\n"
    "\n"
    "  --model NAME    the model (default: the daemon's only model)\n"
    "  --width W       pixels (default 0: the daemon's default, 1024)\n"
    "  --height H      pixels (default 0: the daemon's default, 1024)\n"
    "  --steps N       denoising steps (default 0: the daemon's default, 1)\n"
    "\n"
    "%s"
    "\n" EXIT_HELP;

const char ctl_request_help[] =
    "Request options:\n"
    "  --prompt TEXT          the prompt (required; may be empty: --prompt '')\n"
    "  --prompt-2 TEXT        a different prompt for T5\n"
    "  --negative-prompt TEXT with --true-cfg above 1: true classifier-free guidance\n"
    "                         (either one alone has no effect: ditctl warns)\n"
    "  --negative-prompt-2 TEXT  the negative prompt for T5\n"
    "  --width W, --height H  pixels, multiples of 16 for FLUX (default: the daemon's, 1024)\n"
    "  --steps N              denoising steps, 1 to 1000 (default: the daemon's, 28)\n"
    "  --guidance G           distilled guidance scale (default: the daemon's, 3.5)\n"
    "  --true-cfg S           true CFG scale (default: the daemon's, 1: off)\n"
    "  --seed N               noise seed, 0 to 2^64-1 (default: random, reported)\n"
    "  --max-sequence-length N  T5 tokens, 1 to 512 (default: the daemon's, 512)\n"
    "  --priority P           higher runs first; equal priorities in arrival order\n"
    "                         (default 0)\n"
    "  --request-id ID        echoed in every event (default: the daemon makes one up)\n"
    "  --model NAME           the model (default: the daemon's only model)\n"
    "  --raw                  ask for the decoded image as an f32 tensor (3, H, W)\n"
    "                         instead of a PNG\n"
    "Range checks beyond 'is it a number' are the daemon's (INVALID_ARGUMENT).\n";

/* gRPC logs handshake and connection failures itself; ditctl reports the
 * call's final status, which carries the same cause, so the log lines are
 * noise unless someone asked for them with GRPC_VERBOSITY. */
static void drop_grpc_log(gpr_log_func_args *args)
{
    (void)args;
}

static void on_signal(int sig)
{
    atomic_store(&ctl_interrupted, sig); /* nonzero: the calls' cancel flag */
}

void ctl_catch_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

int ctl_usage_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("ditctl: ", stderr);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (cmd)
        fprintf(stderr, "\nrun 'ditctl %s --help' for its options\n", cmd);
    else
        fputs("\nrun 'ditctl --help' for the commands\n", stderr);
    return CTL_EXIT_USAGE;
}

int ctl_rpc_error(const dit_rpc_status *st)
{
    fprintf(stderr, "ditctl: %s: %s\n", dit_rpc_code_name(st->code),
            st->details[0] ? st->details : "(no details)");
    return CTL_EXIT_FAIL;
}

int ctl_open(const ctl_common *common, double default_timeout, dit_client **out)
{
    dit_client_opts o = common->copts;
    if (!common->timeout_set)
        o.timeout_s = default_timeout;
    dit_rpc_status st;
    if (dit_client_open(&o, out, &st) != DIT_RPC_OK) {
        fprintf(stderr, "ditctl: %s\n", st.details);
        return CTL_EXIT_FAIL;
    }
    return CTL_EXIT_OK;
}

bool ctl_parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || errno == ERANGE || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

bool ctl_parse_double(const char *s, double lo, double hi, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (*s == '\0' || *end != '\0' || !isfinite(v) || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

static bool parse_u64(const char *s, uint64_t *out)
{
    char *end;
    if (*s < '0' || *s > '9')
        return false;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end != '\0' || errno == ERANGE)
        return false;
    *out = (uint64_t)v;
    return true;
}

void ctl_request_init(ctl_request *r)
{
    memset(r, 0, sizeof *r);
    ditserve__v1__generate_request__init(&r->req);
    google__protobuf__float_value__init(&r->guidance);
    google__protobuf__float_value__init(&r->true_cfg);
    google__protobuf__uint64_value__init(&r->seed);
}

bool ctl_request_warn(const ctl_request *r)
{
    /* The daemon reads an empty negative prompt as none, and true CFG as
     * off unless the scale is above 1 (its default is 1). */
    const bool neg = r->req.negative_prompt && r->req.negative_prompt[0];
    const double cfg = r->req.true_cfg_scale ? r->req.true_cfg_scale->value : 1.0;
    if (neg && !(cfg > 1.0)) {
        fprintf(stderr, "ditctl: warning: --negative-prompt has no effect unless --true-cfg is "
                        "above 1 (true classifier-free guidance is off)\n");
        return true;
    }
    if (cfg > 1.0 && !neg) {
        fprintf(stderr,
                "ditctl: warning: --true-cfg %g has no effect without --negative-prompt "
                "(true classifier-free guidance needs one)\n",
                cfg);
        return true;
    }
    return false;
}

/* Option values: connection options, then request options. Commands use
 * single characters or values from CTL_OPT_CMD on. */
enum {
    OPT_TARGET = 1000,
    OPT_TIMEOUT,
    OPT_TLS,
    OPT_CA,
    OPT_CERT,
    OPT_KEY,
    OPT_TOKEN,
    OPT_PROMPT = 1100,
    OPT_PROMPT2,
    OPT_NEG,
    OPT_NEG2,
    OPT_WIDTH,
    OPT_HEIGHT,
    OPT_STEPS,
    OPT_GUIDANCE,
    OPT_CFG,
    OPT_SEED,
    OPT_MAXSEQ,
    OPT_PRIORITY,
    OPT_REQID,
    OPT_MODEL,
    OPT_RAW,
    OPT_VERSION = 1200,
};

static const struct option common_opts[] = {
    {"target", required_argument, NULL, OPT_TARGET},
    {"timeout", required_argument, NULL, OPT_TIMEOUT},
    {"tls", no_argument, NULL, OPT_TLS},
    {"ca", required_argument, NULL, OPT_CA},
    {"cert", required_argument, NULL, OPT_CERT},
    {"key", required_argument, NULL, OPT_KEY},
    {"token", required_argument, NULL, OPT_TOKEN},
};
#define N_COMMON (sizeof common_opts / sizeof common_opts[0])

static const struct option request_opts[] = {
    {"prompt", required_argument, NULL, OPT_PROMPT},
    {"prompt-2", required_argument, NULL, OPT_PROMPT2},
    {"negative-prompt", required_argument, NULL, OPT_NEG},
    {"negative-prompt-2", required_argument, NULL, OPT_NEG2},
    {"width", required_argument, NULL, OPT_WIDTH},
    {"height", required_argument, NULL, OPT_HEIGHT},
    {"steps", required_argument, NULL, OPT_STEPS},
    {"guidance", required_argument, NULL, OPT_GUIDANCE},
    {"true-cfg", required_argument, NULL, OPT_CFG},
    {"seed", required_argument, NULL, OPT_SEED},
    {"max-sequence-length", required_argument, NULL, OPT_MAXSEQ},
    {"priority", required_argument, NULL, OPT_PRIORITY},
    {"request-id", required_argument, NULL, OPT_REQID},
    {"model", required_argument, NULL, OPT_MODEL},
    {"raw", no_argument, NULL, OPT_RAW},
};
#define N_REQUEST (sizeof request_opts / sizeof request_opts[0])

/* The option as the user wrote it, for messages. */
static const char *opt_text(char **argv, int argc)
{
    return optind - 1 < argc && optind >= 1 ? argv[optind - 1] : "?";
}

/* An unknown option, with the nearest known one when it looks like a typo. */
static int unknown_option(const char *cmd, const char *text, const struct option *opts)
{
    const char *near = text[0] == '-' && text[1] == '-' ? dit_suggest_option(text, opts) : NULL;
    if (near)
        return ctl_usage_error(cmd, "unknown option '%s'; did you mean '--%s'?", text, near);
    return ctl_usage_error(cmd, "unknown option '%s'", text);
}

static int common_option(const char *cmd, ctl_common *cm, int c, const char *arg)
{
    double d;
    switch (c) {
    case OPT_TARGET:
        if (arg[0] == '\0')
            return ctl_usage_error(cmd, "%s", "--target is empty");
        cm->copts.target = arg;
        return 0;
    case OPT_TIMEOUT:
        if (!ctl_parse_double(arg, 0, 1e7, &d))
            return ctl_usage_error(cmd, "--timeout wants seconds (0 or more), not '%s'", arg);
        cm->copts.timeout_s = d;
        cm->timeout_set = true;
        return 0;
    case OPT_TLS:
        cm->copts.tls = true;
        return 0;
    case OPT_CA:
        cm->copts.ca_file = arg;
        return 0;
    case OPT_CERT:
        cm->copts.cert_file = arg;
        return 0;
    case OPT_KEY:
        cm->copts.key_file = arg;
        return 0;
    case OPT_TOKEN:
        if (arg[0] == '\0' || strpbrk(arg, "\r\n"))
            return ctl_usage_error(cmd, "%s", "--token is empty or holds a line break");
        cm->copts.token = arg;
        return 0;
    default:
        return -1;
    }
}

/* Integers of the request: int32 on the wire; the daemon checks ranges. */
static int request_int(const char *cmd, const char *name, const char *arg, long lo, int32_t *out)
{
    long v;
    if (!ctl_parse_long(arg, lo, INT32_MAX, &v))
        return ctl_usage_error(cmd, "%s wants an integer from %ld, not '%s'", name, lo, arg);
    *out = (int32_t)v;
    return 0;
}

static int request_option(const char *cmd, ctl_request *r, int c, const char *arg)
{
    double d;
    switch (c) {
    case OPT_PROMPT:
        r->req.prompt = (char *)arg;
        r->have_prompt = true;
        return 0;
    case OPT_PROMPT2:
        r->req.prompt_2 = (char *)arg;
        return 0;
    case OPT_NEG:
        r->req.negative_prompt = (char *)arg;
        return 0;
    case OPT_NEG2:
        r->req.negative_prompt_2 = (char *)arg;
        return 0;
    case OPT_WIDTH:
        return request_int(cmd, "--width", arg, 1, &r->req.width);
    case OPT_HEIGHT:
        return request_int(cmd, "--height", arg, 1, &r->req.height);
    case OPT_STEPS:
        return request_int(cmd, "--steps", arg, 1, &r->req.num_inference_steps);
    case OPT_MAXSEQ:
        return request_int(cmd, "--max-sequence-length", arg, 1, &r->req.max_sequence_length);
    case OPT_PRIORITY:
        return request_int(cmd, "--priority", arg, INT32_MIN, &r->req.priority);
    case OPT_GUIDANCE:
    case OPT_CFG:
        if (!ctl_parse_double(arg, -3.4e38, 3.4e38, &d))
            return ctl_usage_error(cmd, "%s wants a number, not '%s'",
                                   c == OPT_GUIDANCE ? "--guidance" : "--true-cfg", arg);
        if (c == OPT_GUIDANCE) {
            r->guidance.value = (float)d;
            r->req.guidance_scale = &r->guidance;
        } else {
            r->true_cfg.value = (float)d;
            r->req.true_cfg_scale = &r->true_cfg;
        }
        return 0;
    case OPT_SEED:
        if (!parse_u64(arg, &r->seed.value))
            return ctl_usage_error(cmd, "--seed wants an integer from 0 to 2^64-1, not '%s'", arg);
        r->req.seed = &r->seed;
        return 0;
    case OPT_REQID:
        r->req.request_id = (char *)arg;
        return 0;
    case OPT_MODEL:
        r->req.model = (char *)arg;
        return 0;
    case OPT_RAW:
        r->raw = true;
        r->req.output_format = DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR;
        return 0;
    default:
        return -1;
    }
}

/* Command usages hold one %s for the connection options, those with request
 * options one more before it. */
static void print_usage(const char *usage, bool with_request)
{
    if (with_request)
        printf(usage, ctl_request_help, ctl_common_help);
    else
        printf(usage, ctl_common_help);
}

int ctl_parse(int argc, char **argv, const char *cmd, const char *usage,
              const struct option *cmd_opts, const char *cmd_shortopts, ctl_opt_handler handle,
              void *ctx, ctl_common *common, ctl_request *req)
{
    struct option opts[64];
    size_t n = 0;
    for (size_t i = 0; i < N_COMMON; i++)
        opts[n++] = common_opts[i];
    if (req)
        for (size_t i = 0; i < N_REQUEST; i++)
            opts[n++] = request_opts[i];
    for (size_t i = 0; cmd_opts && cmd_opts[i].name && n < 62; i++)
        opts[n++] = cmd_opts[i];
    opts[n++] = (struct option){"help", no_argument, NULL, 'h'};
    opts[n] = (struct option){NULL, 0, NULL, 0};

    char shortopts[32];
    snprintf(shortopts, sizeof shortopts, ":h%s", cmd_shortopts ? cmd_shortopts : "");

    /* optind = 0 makes glibc re-initialise completely: main parsed the
     * global options with '+' (stop at the command), this parse permutes. */
    optind = 0;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, shortopts, opts, NULL)) != -1) {
        int rc;
        if (c == 'h') {
            print_usage(usage, req != NULL);
            return CTL_HELP_SHOWN;
        }
        if (c == ':')
            return ctl_usage_error(cmd, "option '%s' needs a value", opt_text(argv, argc));
        if (c == '?') {
            if (optopt && optopt < 256)
                return ctl_usage_error(cmd, "unknown option '-%c'", optopt);
            return unknown_option(cmd, opt_text(argv, argc), opts);
        }
        if ((rc = common_option(cmd, common, c, optarg)) >= 0) {
            if (rc)
                return rc;
            continue;
        }
        if (req && (rc = request_option(cmd, req, c, optarg)) >= 0) {
            if (rc)
                return rc;
            continue;
        }
        rc = handle ? handle(ctx, c, optarg) : -1;
        if (rc < 0)
            return unknown_option(cmd, opt_text(argv, argc), opts);
        if (rc)
            return rc;
    }
    if (optind < argc)
        return ctl_usage_error(cmd, "unexpected argument '%s'", argv[optind]);
    if (!common->copts.cert_file != !common->copts.key_file)
        return ctl_usage_error(cmd, "%s", "--cert and --key go together");
    if (req && !req->have_prompt)
        return ctl_usage_error(cmd, "%s", "--prompt is required (it may be empty: --prompt '')");
    return 0;
}

/* ------------------------------------------------------------------------ */
/* health */

typedef struct health_args {
    const char *service;
} health_args;

enum { OPT_SERVICE = 1300 };

static int health_opt(void *ctx, int c, const char *arg)
{
    health_args *a = ctx;
    if (c != OPT_SERVICE)
        return -1;
    a->service = arg;
    return 0;
}

static int cmd_health(int argc, char **argv, ctl_common *common)
{
    static const struct option opts[] = {
        {"service", required_argument, NULL, OPT_SERVICE},
        {NULL, 0, NULL, 0},
    };
    health_args a = {.service = ""};
    int rc = ctl_parse(argc, argv, "health", health_usage, opts, "", health_opt, &a, common, NULL);
    if (rc)
        return rc == CTL_HELP_SHOWN ? 0 : rc;
    dit_client *c;
    if ((rc = ctl_open(common, QUICK_TIMEOUT_S, &c)))
        return rc;
    dit_call_opts co = {.cancel = &ctl_interrupted};
    dit_rpc_status st;
    dit_health h;
    if (dit_client_health(c, a.service, &co, &h, &st) != DIT_RPC_OK) {
        rc = ctl_rpc_error(&st);
    } else {
        printf("%s\n", dit_health_name(h));
        rc = h == DIT_HEALTH_SERVING ? CTL_EXIT_OK : CTL_EXIT_FAIL;
    }
    dit_client_close(c);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* info */

/* One model as the server describes it: the pipeline and its task, the
 * defaults a request's zeros stand for, the shapes the server allows, and
 * the config values a client needs to build tensors. The first line starts
 * with first, the others with two spaces. */
static void print_model(const Ditserve__V1__ModelInfo *m, const char *first)
{
    const char *indent = "";
    const bool video = m->task == DITSERVE__V1__TASK__TASK_TEXT_TO_VIDEO;
    printf("%s%s: %s (%s), transformer %s, text encoders %s\n", first,
           m->name && m->name[0] ? m->name : "(unnamed)", m->pipeline,
           video ? "text-to-video"
                 : m->task == DITSERVE__V1__TASK__TASK_TEXT_TO_IMAGE ? "text-to-image" : "task not reported",
           m->transformer && m->transformer[0] ? m->transformer : "(not reported)",
           m->has_text_encoders ? "yes" : "no");
    printf("%s  defaults: %dx%d, %d steps", indent, m->default_width, m->default_height,
           m->default_steps);
    if (video)
        printf(", %d frames at %d fps", m->default_num_frames, m->default_fps);
    putchar('\n');
    if (m->layout) {
        const Ditserve__V1__LayoutRules *l = m->layout;
        printf("%s  allows: width and height multiples of %d, %dx%d pixels per token, token counts "
               "multiples of %d, at most %lld pixels, %d steps, %d text tokens",
               indent, l->size_multiple, l->pixels_per_token, l->pixels_per_token, l->token_divisor,
               (long long)l->max_pixels, l->max_steps, l->max_sequence_length);
        if (l->frame_step > 0)
            printf(", num_frames %d x k + 1", l->frame_step);
        putchar('\n');
    }
    if (m->n_config) {
        printf("%s  config:", indent);
        for (size_t i = 0; i < m->n_config; i++)
            printf("%s %s %lld", i ? "," : "", m->config[i]->key, (long long)m->config[i]->value);
        putchar('\n');
    }
}

static int cmd_info(int argc, char **argv, ctl_common *common)
{
    int rc = ctl_parse(argc, argv, "info", info_usage, NULL, "", NULL, NULL, common, NULL);
    if (rc)
        return rc == CTL_HELP_SHOWN ? 0 : rc;
    dit_client *c;
    if ((rc = ctl_open(common, QUICK_TIMEOUT_S, &c)))
        return rc;
    dit_call_opts co = {.cancel = &ctl_interrupted};
    dit_rpc_status st;
    Ditserve__V1__ServerInfo *si = NULL;
    if (dit_client_server_info(c, &co, &si, &st) != DIT_RPC_OK) {
        rc = ctl_rpc_error(&st);
        goto cleanup;
    }
    printf("version: %s\n", si->version);
    printf("world_size: %d\n", si->world_size);
    if (si->layout) {
        const Ditserve__V1__ParallelLayout *l = si->layout;
        printf("layout: ring %d, ulysses %d, tp %d", l->ring_degree, l->ulysses_degree,
               l->tp_degree);
        if (l->ulysses_anything)
            printf(", ulysses_anything");
        if (l->ring_anything)
            printf(", ring_anything");
        if (l->unified_anything)
            printf(", unified_anything");
        putchar('\n');
    } else {
        printf("layout: (not reported)\n");
    }
    printf("backend: %s\n", si->backend);
    printf("devices:");
    for (size_t i = 0; i < si->n_devices; i++)
        printf("%s %s", i ? "," : "", si->devices[i]);
    putchar('\n');
    printf("queue_depth: %d\n", si->queue_depth);
    printf("max_queue: %d\n", si->max_queue);
    printf("running: %d\n", si->running);
    if (strcmp(si->mesh_state, "warming_up") == 0)
        printf("mesh_state: warming_up (the startup warm-up runs; health says NOT_SERVING "
               "until it is done)\n");
    else
        printf("mesh_state: %s\n", si->mesh_state);
    printf("comm: %s\n", si->comm);
    printf("worker_restarts: %lld\n", (long long)si->worker_restarts);
    if (si->model)
        print_model(si->model, "model: ");
cleanup:
    if (si)
        ditserve__v1__server_info__free_unpacked(si, NULL);
    dit_client_close(c);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* models */

static int cmd_models(int argc, char **argv, ctl_common *common)
{
    int rc = ctl_parse(argc, argv, "models", models_usage, NULL, "", NULL, NULL, common, NULL);
    if (rc)
        return rc == CTL_HELP_SHOWN ? 0 : rc;
    dit_client *c;
    if ((rc = ctl_open(common, QUICK_TIMEOUT_S, &c)))
        return rc;
    dit_call_opts co = {.cancel = &ctl_interrupted};
    dit_rpc_status st;
    Ditserve__V1__ListModelsResponse *ml = NULL;
    if (dit_client_list_models(c, &co, &ml, &st) != DIT_RPC_OK) {
        rc = ctl_rpc_error(&st);
        goto cleanup;
    }
    if (ml->n_models == 0)
        printf("(no models)\n");
    for (size_t i = 0; i < ml->n_models; i++)
        print_model(ml->models[i], "");
cleanup:
    if (ml)
        ditserve__v1__list_models_response__free_unpacked(ml, NULL);
    dit_client_close(c);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* warmup */

typedef struct warmup_args {
    const char *model;
    int width, height, steps;
} warmup_args;

enum { OPT_W_MODEL = 1400, OPT_W_WIDTH, OPT_W_HEIGHT, OPT_W_STEPS };

static int warmup_opt(void *ctx, int c, const char *arg)
{
    warmup_args *a = ctx;
    long v;
    const char *name;
    int *dst;
    switch (c) {
    case OPT_W_MODEL:
        a->model = arg;
        return 0;
    case OPT_W_WIDTH:
        name = "--width", dst = &a->width;
        break;
    case OPT_W_HEIGHT:
        name = "--height", dst = &a->height;
        break;
    case OPT_W_STEPS:
        name = "--steps", dst = &a->steps;
        break;
    default:
        return -1;
    }
    if (!ctl_parse_long(arg, 0, INT32_MAX, &v))
        return ctl_usage_error("warmup", "%s wants an integer from 0, not '%s'", name, arg);
    *dst = (int)v;
    return 0;
}

static int cmd_warmup(int argc, char **argv, ctl_common *common)
{
    static const struct option opts[] = {
        {"model", required_argument, NULL, OPT_W_MODEL},
        {"width", required_argument, NULL, OPT_W_WIDTH},
        {"height", required_argument, NULL, OPT_W_HEIGHT},
        {"steps", required_argument, NULL, OPT_W_STEPS},
        {NULL, 0, NULL, 0},
    };
    warmup_args a = {0};
    int rc = ctl_parse(argc, argv, "warmup", warmup_usage, opts, "", warmup_opt, &a, common, NULL);
    if (rc)
        return rc == CTL_HELP_SHOWN ? 0 : rc;
    dit_client *c;
    if ((rc = ctl_open(common, 0, &c)))
        return rc;
    dit_call_opts co = {.cancel = &ctl_interrupted};
    dit_rpc_status st;
    Ditserve__V1__WarmupResponse *wr = NULL;
    if (dit_client_warmup(c, a.model, a.width, a.height, a.steps, &co, &wr, &st) != DIT_RPC_OK) {
        rc = ctl_rpc_error(&st);
    } else {
        printf("warmup: %.1f ms%s%s\n", wr->elapsed_ms, wr->detail[0] ? ": " : "", wr->detail);
        ditserve__v1__warmup_response__free_unpacked(wr, NULL);
    }
    dit_client_close(c);
    return rc;
}

/* ------------------------------------------------------------------------ */

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv, ctl_common *common);
} command;

static const command commands[] = {
    {"generate", ctl_generate}, {"health", cmd_health}, {"info", cmd_info},
    {"models", cmd_models},     {"warmup", cmd_warmup}, {"bench", ctl_bench},
};

static const char *const command_names[] = {"generate", "health", "info", "models",
                                            "warmup",   "bench",  "help", NULL};

static int unknown_command(const char *name)
{
    const char *near = dit_suggest_word(name, command_names);
    if (near)
        return ctl_usage_error(NULL, "unknown command '%s'; did you mean '%s'?", name, near);
    return ctl_usage_error(NULL, "unknown command '%s'", name);
}

static const command *find_command(const char *name)
{
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (strcmp(commands[i].name, name) == 0)
            return &commands[i];
    return NULL;
}

int main(int argc, char **argv)
{
    ctl_common common;
    memset(&common, 0, sizeof common);
    const char *env = getenv("DITCTL_TARGET");
    if (env && env[0])
        common.copts.target = env;
    env = getenv("DITCTL_TOKEN");
    if (env && env[0])
        common.copts.token = env;

    struct option opts[N_COMMON + 3];
    for (size_t i = 0; i < N_COMMON; i++)
        opts[i] = common_opts[i];
    opts[N_COMMON] = (struct option){"help", no_argument, NULL, 'h'};
    opts[N_COMMON + 1] = (struct option){"version", no_argument, NULL, OPT_VERSION};
    opts[N_COMMON + 2] = (struct option){NULL, 0, NULL, 0};

    /* '+': stop at the command name; what follows is the command's. */
    optind = 0;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "+:h", opts, NULL)) != -1) {
        int rc;
        if (c == 'h') {
            print_usage(main_usage, false);
            return 0;
        }
        if (c == OPT_VERSION) {
            printf("ditctl %s\n", DIT_VERSION);
            return 0;
        }
        if (c == ':')
            return ctl_usage_error(NULL, "option '%s' needs a value", opt_text(argv, argc));
        if ((rc = common_option(NULL, &common, c, optarg)) < 0)
            return unknown_option(NULL, opt_text(argv, argc), opts);
        if (rc)
            return rc;
    }
    if (optind >= argc)
        return ctl_usage_error(NULL, "%s", "a command is required");
    const char *name = argv[optind];
    if (strcmp(name, "help") == 0) {
        if (optind + 1 >= argc) {
            print_usage(main_usage, false);
            return 0;
        }
        const command *cmd = find_command(argv[optind + 1]);
        if (!cmd)
            return unknown_command(argv[optind + 1]);
        char *help_argv[] = {argv[optind + 1], (char *)"--help", NULL};
        return cmd->run(2, help_argv, &common);
    }
    const command *cmd = find_command(name);
    if (!cmd)
        return unknown_command(name);
    ctl_catch_signals();
    if (!getenv("GRPC_VERBOSITY"))
        gpr_set_log_function(drop_grpc_log);
    const int rc = cmd->run(argc - optind, argv + optind, &common);
    /* A call stopped by Ctrl-C ends CANCELLED; say "interrupted" the way
     * shells and scripts expect (128 + the signal: 130 for SIGINT, 143 for
     * SIGTERM), not "failed". */
    const int sig = atomic_load(&ctl_interrupted);
    return rc != CTL_EXIT_OK && sig ? 128 + sig : rc;
}
