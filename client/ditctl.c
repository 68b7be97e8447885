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

#define EXIT_HELP                                                                                  \
    "Exit status: 0 on success, 1 on a gRPC error (printed as 'ditctl: STATUS: details'),\n"       \
    "2 on bad command-line arguments, 130 when interrupted (Ctrl-C; 143 for SIGTERM).\n"

static const char main_usage[] =
    "usage: ditctl [connection options] <command> [options]\n"
    "\n"
    "The command-line client of ditd, the ditserve daemon (gRPC API ditserve.v1).\n"
    "\n"
    "Commands:\n"
    "  generate   text to image or video: writes the PNG or MP4 (or the raw tensor)\n"
    "             and prints the seed, size and timings\n"
    "  health     asks grpc.health.v1 whether the server is SERVING\n"
    "  info       version, parallel layout, backend, devices, queue state\n"
    "  models     the models the daemon serves\n"
    "  loras      the LoRA adapters the daemon serves; --load / --unload NAME\n"
    "  warmup     runs one generation of a shape so that later ones start at full speed\n"
    "  bench      N generations, C at a time: latency percentiles, throughput, and\n"
    "             the daemon's overhead over the worker's compute\n"
    "\n"
    "'ditctl <command> --help' or 'ditctl help <command>' shows a command's options.\n"
    "gRPC's own log lines are hidden unless GRPC_VERBOSITY is set (e.g. =debug).\n";

static const ctl_help health_help = {
    "usage: ditctl health [--service NAME] [connection options]\n"
    "\n"
    "Calls grpc.health.v1.Health/Check and prints the state: SERVING, NOT_SERVING,\n"
    "UNKNOWN or SERVICE_UNKNOWN. No token is sent (health checks are unauthenticated).\n",
    "Exit status: 0 only when SERVING; 1 for any other state or a gRPC error (printed as\n"
    "'ditctl: STATUS: details'); 2 on bad command-line arguments; 130 when interrupted.\n"};

static const ctl_help info_help = {
    "usage: ditctl info [connection options]\n"
    "\n"
    "Calls GetServerInfo and prints its fields, one 'key: value' per line,\n"
    "then the served model as 'ditctl models' shows it.\n",
    EXIT_HELP};

static const ctl_help models_help = {
    "usage: ditctl models [connection options]\n"
    "\n"
    "Calls ListModels and prints each model: its pipeline, task, transformer and text\n"
    "encoders, then the defaults a request's zeros stand for, the sizes the server\n"
    "allows, and the config values a client needs to build tensors.\n",
    EXIT_HELP};

static const ctl_help loras_help = {
    "usage: ditctl loras [--load NAME | --unload NAME] [connection options]\n"
    "\n"
    "Calls ListLoras and prints each adapter requests may name (generate --lora NAME):\n"
    "whether the workers hold it loaded, its bytes on rank 0, whether it is preloaded.\n"
    "--load and --unload call LoadLora and UnloadLora first.\n",
    EXIT_HELP};

static const ctl_help warmup_help = {
    "usage: ditctl warmup [--model NAME] [--width W] [--height H] [--frames F] [--steps N]\n"
    "                     [connection options]\n"
    "\n"
    "Calls Warmup: the daemon runs one generation of this shape so that later requests\n"
    "of the same shape start at full speed. Prints the time it took.\n",
    EXIT_HELP};

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
     * off unless the scale is above 1 (its default is 1). Whether a
     * negative prompt alone does anything depends on the model (FLUX: no;
     * Wan: yes, with guidance above 1): the daemon says so in the Result.
     * Only an explicit --true-cfg (FLUX's true CFG) is judged here. */
    const bool neg = r->req.negative_prompt && r->req.negative_prompt[0];
    const double cfg = r->req.true_cfg_scale ? r->req.true_cfg_scale->value : 1.0;
    if (neg && r->req.true_cfg_scale && !(cfg > 1.0)) {
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

/* ------------------------------------------------------------------------ */
/* The option tables                                                          */

/* Setters: each writes one field through the ctl_target. */
#define CTL(t) ((ctl_target *)(t))
#define UNUSED_ERR ((void)err, (void)cap)

static int set_target(void *t, const char *v, char *err, size_t cap)
{
    if (v[0] == '\0') {
        snprintf(err, cap, "is empty");
        return -1;
    }
    CTL(t)->common->copts.target = v;
    return 0;
}

static int set_timeout(void *t, const char *v, char *err, size_t cap)
{
    double d;
    if (!ctl_parse_double(v, 0, 1e7, &d)) {
        snprintf(err, cap, "wants seconds (0 or more), not '%s'", v);
        return -1;
    }
    CTL(t)->common->copts.timeout_s = d;
    CTL(t)->common->timeout_set = true;
    return 0;
}

static int set_tls(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    CTL(t)->common->copts.tls = v[0] == '1';
    return 0;
}

static int set_ca(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    CTL(t)->common->copts.ca_file = v;
    return 0;
}

static int set_cert(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    CTL(t)->common->copts.cert_file = v;
    return 0;
}

static int set_key(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    CTL(t)->common->copts.key_file = v;
    return 0;
}

static int set_token(void *t, const char *v, char *err, size_t cap)
{
    if (v[0] == '\0' || strpbrk(v, "\r\n")) {
        snprintf(err, cap, "is empty or holds a line break");
        return -1;
    }
    CTL(t)->common->copts.token = v;
    return 0;
}

#define CUSTOM(name, sh, arg, help, env, fn)                                                       \
    {                                                                                              \
        name, sh, DIT_OPT_CUSTOM, NULL, arg, help, env, 0, 0, 0, fn, false                         \
    }
#define CFLAG(name, help, fn)                                                                      \
    {                                                                                              \
        name, 0, DIT_OPT_FLAG, NULL, NULL, help, NULL, 0, 0, 0, fn, false                          \
    }

/* Also accepted before the command name. */
static const dit_option common_opts[] = {
    CUSTOM("target", 0, "HOST:PORT",
           "the daemon; a HOST alone means HOST:50051, ditd's port (default 127.0.0.1:50051)",
           "DITCTL_TARGET", set_target),
    CUSTOM("timeout", 0, "SECONDS",
           "deadline of each call; 0: none (default 10 for health, info, models and loras; none "
           "for generate, warmup, bench and loras --load/--unload)",
           NULL, set_timeout),
    CFLAG("tls", "use TLS, verifying the server with the system's roots", set_tls),
    CUSTOM("ca", 0, "FILE", "use TLS, verifying the server with the PEM roots in FILE", NULL,
           set_ca),
    CUSTOM("cert", 0, "FILE", "client certificate chain (PEM) for mutual TLS; needs --key", NULL,
           set_cert),
    CUSTOM("key", 0, "FILE", "private key (PEM) of --cert", NULL, set_key),
    CUSTOM("token", 0, "TOKEN",
           "bearer token, sent as 'authorization: Bearer TOKEN' on every call but health checks",
           "DITCTL_TOKEN", set_token),
};
#define N_COMMON (sizeof common_opts / sizeof common_opts[0])

/* Integers of the request: int32 on the wire; the daemon checks ranges. */
static int request_int(const char *v, long lo, int32_t *out, char *err, size_t cap)
{
    long n;
    if (!ctl_parse_long(v, lo, INT32_MAX, &n)) {
        snprintf(err, cap, "wants an integer from %ld to %d, not '%s'", lo, INT32_MAX, v);
        return -1;
    }
    *out = (int32_t)n;
    return 0;
}

static int request_float(const char *v, Google__Protobuf__FloatValue *w,
                         Google__Protobuf__FloatValue **field, char *err, size_t cap)
{
    double d;
    if (!ctl_parse_double(v, -3.4e38, 3.4e38, &d)) {
        snprintf(err, cap, "wants a number, not '%s'", v);
        return -1;
    }
    w->value = (float)d;
    *field = w;
    return 0;
}

#define REQ(t) (CTL(t)->req)

static int set_prompt(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    REQ(t)->req.prompt = (char *)v;
    REQ(t)->have_prompt = true;
    return 0;
}

static int set_prompt_2(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    REQ(t)->req.prompt_2 = (char *)v;
    return 0;
}

static int set_neg(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    REQ(t)->req.negative_prompt = (char *)v;
    return 0;
}

static int set_neg_2(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    REQ(t)->req.negative_prompt_2 = (char *)v;
    return 0;
}

static int set_width(void *t, const char *v, char *err, size_t cap)
{
    return request_int(v, 1, &REQ(t)->req.width, err, cap);
}

static int set_height(void *t, const char *v, char *err, size_t cap)
{
    return request_int(v, 1, &REQ(t)->req.height, err, cap);
}

static int set_steps(void *t, const char *v, char *err, size_t cap)
{
    return request_int(v, 1, &REQ(t)->req.num_inference_steps, err, cap);
}

static int set_frames(void *t, const char *v, char *err, size_t cap)
{
    return request_int(v, 1, &REQ(t)->req.num_frames, err, cap);
}

static int set_fps(void *t, const char *v, char *err, size_t cap)
{
    return request_int(v, 1, &REQ(t)->req.fps, err, cap);
}

static int set_num_images(void *t, const char *v, char *err, size_t cap)
{
    return request_int(v, 1, &REQ(t)->req.num_images, err, cap);
}

static int set_max_seq(void *t, const char *v, char *err, size_t cap)
{
    return request_int(v, 1, &REQ(t)->req.max_sequence_length, err, cap);
}

static int set_priority(void *t, const char *v, char *err, size_t cap)
{
    return request_int(v, INT32_MIN, &REQ(t)->req.priority, err, cap);
}

static int set_guidance(void *t, const char *v, char *err, size_t cap)
{
    return request_float(v, &REQ(t)->guidance, &REQ(t)->req.guidance_scale, err, cap);
}

static int set_true_cfg(void *t, const char *v, char *err, size_t cap)
{
    return request_float(v, &REQ(t)->true_cfg, &REQ(t)->req.true_cfg_scale, err, cap);
}

static int set_seed(void *t, const char *v, char *err, size_t cap)
{
    if (!parse_u64(v, &REQ(t)->seed.value)) {
        snprintf(err, cap, "wants an integer from 0 to 2^64-1, not '%s'", v);
        return -1;
    }
    REQ(t)->req.seed = &REQ(t)->seed;
    return 0;
}

static int set_request_id(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    REQ(t)->req.request_id = (char *)v;
    return 0;
}

static int set_model(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    REQ(t)->req.model = (char *)v;
    return 0;
}

/* --lora NAME[:SCALE] (scale 1 without one); the daemon checks the name. */
static int set_lora(void *t, const char *v, char *err, size_t cap)
{
    ctl_request *r = REQ(t);
    if (r->req.n_loras >= CTL_MAX_LORAS) {
        snprintf(err, cap, "takes at most %d adapters", CTL_MAX_LORAS);
        return -1;
    }
    Ditserve__V1__LoraUse *u = &r->lora[r->req.n_loras];
    ditserve__v1__lora_use__init(u);
    u->scale = 1.0f;
    const char *colon = strrchr(v, ':');
    const size_t n = colon ? (size_t)(colon - v) : strlen(v);
    if (colon) {
        char *end;
        errno = 0;
        const float f = strtof(colon + 1, &end);
        if (errno || end == colon + 1 || *end || !isfinite(f)) {
            snprintf(err, cap, "wants NAME[:SCALE], not '%s'", v);
            return -1;
        }
        u->scale = f;
    }
    char *name = r->lora_names[r->req.n_loras];
    if (n == 0 || n >= sizeof r->lora_names[0]) {
        snprintf(err, cap, "wants NAME[:SCALE] with a name of 1 to %zu bytes",
                 sizeof r->lora_names[0] - 1);
        return -1;
    }
    memcpy(name, v, n);
    name[n] = '\0';
    u->name = name;
    r->lora_ptrs[r->req.n_loras] = u;
    r->req.loras = r->lora_ptrs;
    r->req.n_loras++;
    return 0;
}

static int set_raw(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    REQ(t)->raw = v[0] == '1';
    REQ(t)->req.output_format = REQ(t)->raw
                                    ? DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR
                                    : DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_UNSPECIFIED;
    return 0;
}

/* The request options of generate and bench. The defaults are the
 * daemon's (an unset field means "yours"), so the table names them in
 * words rather than setting them. */
static const dit_option request_opts[] = {
    CUSTOM("prompt", 0, "TEXT", "the prompt (required; may be empty: --prompt '')", NULL,
           set_prompt),
    CUSTOM("prompt-2", 0, "TEXT", "a different prompt for T5", NULL, set_prompt_2),
    CUSTOM("negative-prompt", 0, "TEXT",
           "FLUX: with --true-cfg above 1, true classifier-free guidance; Wan: the negative side "
           "of its guidance (above 1)",
           NULL, set_neg),
    CUSTOM("negative-prompt-2", 0, "TEXT", "the negative prompt for T5", NULL, set_neg_2),
    CUSTOM("width", 0, "W",
           "pixels, a multiple of 16 (default: the model's, as 'ditctl models' lists)", NULL,
           set_width),
    CUSTOM("height", 0, "H", "pixels, a multiple of 16 (default: the model's)", NULL, set_height),
    CUSTOM("frames", 0, "F",
           "video frames, 4 k + 1 for Wan (default: the model's; images take 1 only)", NULL,
           set_frames),
    CUSTOM("fps", 0, "N", "video frames per second, 1 to 240 (default: the model's)", NULL,
           set_fps),
    CUSTOM("steps", 0, "N", "denoising steps, 1 to 1000 (default: the model's)", NULL, set_steps),
    CUSTOM("num-images", 0, "N",
           "images (videos) from one batched generation, 1 to 8 (num_images_per_prompt); N > 1 "
           "writes FILE_0.ext .. FILE_{N-1}.ext",
           NULL, set_num_images),
    CUSTOM("guidance", 0, "G",
           "FLUX: distilled guidance; Wan: classifier-free guidance above 1 (default: the "
           "model's)",
           NULL, set_guidance),
    CUSTOM("true-cfg", 0, "S", "true CFG scale (default: the daemon's, 1: off)", NULL,
           set_true_cfg),
    CUSTOM("seed", 0, "N", "noise seed, 0 to 2^64-1 (default: random, reported)", NULL, set_seed),
    CUSTOM("max-sequence-length", 0, "N", "T5 tokens, 1 to 512 (default: the daemon's, 512)", NULL,
           set_max_seq),
    CUSTOM("priority", 0, "P", "higher runs first; equal priorities in arrival order (default 0)",
           NULL, set_priority),
    CUSTOM("request-id", 0, "ID", "echoed in every event (default: the daemon makes one up)", NULL,
           set_request_id),
    CUSTOM("model", 0, "NAME", "the model (default: the daemon's only model)", NULL, set_model),
    CUSTOM("lora", 0, "NAME[:SCALE]",
           "a LoRA adapter the daemon serves (ditd --lora-dir or --lora), times SCALE (default "
           "1); repeat for several, up to 8",
           NULL, set_lora),
    CFLAG("raw",
          "ask for the decoded values as an f32 tensor, (3, H, W) for an image or (3, F, H, W) "
          "for a video, instead of a PNG or MP4",
          set_raw),
};
#define N_REQUEST (sizeof request_opts / sizeof request_opts[0])

/* The connection options' lines with their variables (for --help). */
static void print_common(FILE *out)
{
    fputs("Connection options (also accepted before the command name):\n", out);
    dit_options_print_list(common_opts, N_COMMON, out);
}

typedef struct help_ctx {
    const ctl_help *help;
    const dit_option *cmd_opts;
    size_t n_cmd;
    bool request;
} help_ctx;

static void print_command_help(const dit_options *o, FILE *out)
{
    const help_ctx *h = o->help_ctx;
    fputs(h->help->intro, out);
    fputs("\nOptions:\n", out);
    dit_options_print_list(h->cmd_opts, h->n_cmd, out);
    fprintf(out, "  %-31s%s\n", "-h, --help", "this help");
    if (h->request) {
        fputs("\nRequest options (range checks beyond 'is it a number' are the daemon's:\n"
              "INVALID_ARGUMENT):\n",
              out);
        dit_options_print_list(request_opts, N_REQUEST, out);
    }
    fputc('\n', out);
    print_common(out);
    fputc('\n', out);
    fputs(h->help->epilog, out);
}

int ctl_parse(int argc, char **argv, const char *cmd, const ctl_help *help,
              const dit_option *cmd_opts, size_t n_cmd, void *cmd_ctx, ctl_common *common,
              ctl_request *req)
{
    /* The command's table: its own options, the request's, and the
     * connection options once more (main read their variables already). */
    dit_option opts[64];
    size_t n = 0;
    for (size_t i = 0; i < n_cmd && n < 64; i++)
        opts[n++] = cmd_opts[i];
    for (size_t i = 0; req && i < N_REQUEST && n < 64; i++)
        opts[n++] = request_opts[i];
    for (size_t i = 0; i < N_COMMON && n < 64; i++) {
        opts[n] = common_opts[i];
        opts[n++].env = NULL;
    }
    char see_also[96];
    snprintf(see_also, sizeof see_also, "run 'ditctl %s --help' for its options", cmd);
    const help_ctx hc = {
        .help = help, .cmd_opts = cmd_opts, .n_cmd = n_cmd, .request = req != NULL};
    const dit_options table = {.prog = "ditctl",
                               .opts = opts,
                               .n_opts = n,
                               .see_also = see_also,
                               .print_help = print_command_help,
                               .help_ctx = &hc};
    ctl_target t = {.common = common, .req = req, .cmd = cmd_ctx};
    const int rc = dit_options_parse(&table, &t, argc, argv, NULL);
    if (rc == 1)
        return CTL_HELP_SHOWN;
    if (rc != 0)
        return CTL_EXIT_USAGE;
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

static int set_service(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    ((health_args *)CTL(t)->cmd)->service = v;
    return 0;
}

static const dit_option health_opts[] = {
    CUSTOM("service", 0, "NAME",
           "the service to ask about, e.g. ditserve.v1.Generation (default '': the server as a "
           "whole)",
           NULL, set_service),
};

static int cmd_health(int argc, char **argv, ctl_common *common)
{
    health_args a = {.service = ""};
    int rc = ctl_parse(argc, argv, "health", &health_help, health_opts,
                       sizeof health_opts / sizeof *health_opts, &a, common, NULL);
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
           video                                               ? "text-to-video"
           : m->task == DITSERVE__V1__TASK__TASK_TEXT_TO_IMAGE ? "text-to-image"
                                                               : "task not reported",
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
    int rc = ctl_parse(argc, argv, "info", &info_help, NULL, 0, NULL, common, NULL);
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
        if (l->cfg_degree > 1)
            printf(", cfg parallel");
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
    if (si->max_batch > 0)
        printf("max_batch: %d\n", si->max_batch);
    if (si->replicas > 0)
        printf("replicas: %d\n", si->replicas);
    /* One line per mesh: what it runs and has run. */
    for (size_t i = 0; i < si->n_meshes; i++) {
        const Ditserve__V1__MeshInfo *m = si->meshes[i];
        printf("mesh %d: %s, running %d, %lld generation(s) of %lld request(s), busy %.1f s, "
               "%lld restart(s)\n",
               m->index, m->state, m->running, (long long)m->jobs, (long long)m->requests,
               m->busy_seconds, (long long)m->worker_restarts);
    }
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
    int rc = ctl_parse(argc, argv, "models", &models_help, NULL, 0, NULL, common, NULL);
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
/* loras */

typedef struct loras_args {
    const char *load, *unload;
} loras_args;

#define LARG(t) ((loras_args *)CTL(t)->cmd)

static int set_l_load(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    LARG(t)->load = v;
    return 0;
}

static int set_l_unload(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    LARG(t)->unload = v;
    return 0;
}

static const dit_option loras_opts[] = {
    CUSTOM("load", 0, "NAME", "load this adapter on every worker first", NULL, set_l_load),
    CUSTOM("unload", 0, "NAME", "free this adapter on every worker first", NULL, set_l_unload),
};

static int cmd_loras(int argc, char **argv, ctl_common *common)
{
    loras_args a = {0};
    int rc = ctl_parse(argc, argv, "loras", &loras_help, loras_opts,
                       sizeof loras_opts / sizeof *loras_opts, &a, common, NULL);
    if (rc)
        return rc == CTL_HELP_SHOWN ? 0 : rc;
    dit_client *c;
    /* A load or unload waits in the daemon's queue: no default deadline. */
    if ((rc = ctl_open(common, a.load || a.unload ? 0 : QUICK_TIMEOUT_S, &c)))
        return rc;
    dit_call_opts co = {.cancel = &ctl_interrupted};
    dit_rpc_status st;
    Ditserve__V1__ListLorasResponse *ll = NULL;
    char text[400];
    for (int k = 0; k < 2; k++) {
        const char *name = k == 0 ? a.unload : a.load;
        if (!name)
            continue;
        if (dit_client_lora_op(c, k == 1, name, &co, text, sizeof text, &st) != DIT_RPC_OK) {
            rc = ctl_rpc_error(&st);
            goto cleanup;
        }
        printf("%s\n", text);
    }
    if (dit_client_list_loras(c, &co, &ll, &st) != DIT_RPC_OK) {
        rc = ctl_rpc_error(&st);
        goto cleanup;
    }
    if (ll->n_loras == 0)
        printf("(no adapters)\n");
    for (size_t i = 0; i < ll->n_loras; i++) {
        const Ditserve__V1__LoraInfo *li = ll->loras[i];
        if (li->loaded)
            printf("%s: loaded, %lld bytes%s\n", li->name, (long long)li->bytes,
                   li->preloaded ? ", preloaded" : "");
        else
            printf("%s: not loaded%s\n", li->name, li->preloaded ? ", preloaded" : "");
    }
    printf("cache limit per worker: %lld bytes\n", (long long)ll->cache_limit_bytes);
cleanup:
    if (ll)
        ditserve__v1__list_loras_response__free_unpacked(ll, NULL);
    dit_client_close(c);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* warmup */

typedef struct warmup_args {
    const char *model;
    int width, height, frames, steps;
} warmup_args;

static int warmup_int(const char *v, int *out, char *err, size_t cap)
{
    long n;
    if (!ctl_parse_long(v, 0, INT32_MAX, &n)) {
        snprintf(err, cap, "wants an integer from 0, not '%s'", v);
        return -1;
    }
    *out = (int)n;
    return 0;
}

#define WARG(t) ((warmup_args *)CTL(t)->cmd)

static int set_w_model(void *t, const char *v, char *err, size_t cap)
{
    UNUSED_ERR;
    WARG(t)->model = v;
    return 0;
}

static int set_w_width(void *t, const char *v, char *err, size_t cap)
{
    return warmup_int(v, &WARG(t)->width, err, cap);
}

static int set_w_height(void *t, const char *v, char *err, size_t cap)
{
    return warmup_int(v, &WARG(t)->height, err, cap);
}

static int set_w_frames(void *t, const char *v, char *err, size_t cap)
{
    return warmup_int(v, &WARG(t)->frames, err, cap);
}

static int set_w_steps(void *t, const char *v, char *err, size_t cap)
{
    return warmup_int(v, &WARG(t)->steps, err, cap);
}

static const dit_option warmup_opts[] = {
    CUSTOM("model", 0, "NAME", "the model (default: the daemon's only model)", NULL, set_w_model),
    CUSTOM("width", 0, "W", "pixels (default 0: the model's default)", NULL, set_w_width),
    CUSTOM("height", 0, "H", "pixels (default 0: the model's default)", NULL, set_w_height),
    CUSTOM("frames", 0, "F", "video frames (default 0: the model's default; images: 1)", NULL,
           set_w_frames),
    CUSTOM("steps", 0, "N", "denoising steps (default 0: the daemon's default, 1)", NULL,
           set_w_steps),
};

static int cmd_warmup(int argc, char **argv, ctl_common *common)
{
    warmup_args a = {0};
    int rc = ctl_parse(argc, argv, "warmup", &warmup_help, warmup_opts,
                       sizeof warmup_opts / sizeof *warmup_opts, &a, common, NULL);
    if (rc)
        return rc == CTL_HELP_SHOWN ? 0 : rc;
    dit_client *c;
    if ((rc = ctl_open(common, 0, &c)))
        return rc;
    dit_call_opts co = {.cancel = &ctl_interrupted};
    dit_rpc_status st;
    Ditserve__V1__WarmupResponse *wr = NULL;
    if (dit_client_warmup(c, a.model, a.width, a.height, a.frames, a.steps, &co, &wr, &st) !=
        DIT_RPC_OK) {
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
    {"loras", cmd_loras},
};

static void print_main_help(const dit_options *o, FILE *out)
{
    (void)o;
    fputs(main_usage, out);
    fprintf(out, "\nOptions:\n  %-31s%s\n  %-31s%s\n\n", "-h, --help", "this help", "--version",
            "print the version");
    print_common(out);
    fputc('\n', out);
    fputs(EXIT_HELP, out);
}

static const char *const command_names[] = {"generate", "health", "info", "models", "warmup",
                                            "bench",    "loras",  "help", NULL};

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
    dit_tune_malloc();
    ctl_common common;
    memset(&common, 0, sizeof common);
    /* The connection options before the command, and their variables (an
     * empty one counts as unset); the command's own parse reads the same
     * options after its name. */
    const dit_options table = {.prog = "ditctl",
                               .version = DIT_VERSION,
                               .opts = common_opts,
                               .n_opts = N_COMMON,
                               .stop_at_positional = true,
                               .empty_env_unset = true,
                               .see_also = "run 'ditctl --help' for the commands",
                               .print_help = print_main_help};
    ctl_target t = {.common = &common};
    int first = 0;
    const int prc = dit_options_parse(&table, &t, argc, argv, &first);
    if (prc != 0)
        return prc == 1 ? 0 : CTL_EXIT_USAGE;
    if (first >= argc)
        return ctl_usage_error(NULL, "%s", "a command is required");
    const char *name = argv[first];
    if (strcmp(name, "help") == 0) {
        if (first + 1 >= argc) {
            print_main_help(NULL, stdout);
            return 0;
        }
        const command *cmd = find_command(argv[first + 1]);
        if (!cmd)
            return unknown_command(argv[first + 1]);
        char *help_argv[] = {argv[first + 1], (char *)"--help", NULL};
        return cmd->run(2, help_argv, &common);
    }
    const command *cmd = find_command(name);
    if (!cmd)
        return unknown_command(name);
    ctl_catch_signals();
    if (!getenv("GRPC_VERBOSITY"))
        gpr_set_log_function(drop_grpc_log);
    const int rc = cmd->run(argc - first, argv + first, &common);
    /* A call stopped by Ctrl-C ends CANCELLED; say "interrupted" the way
     * shells and scripts expect (128 + the signal: 130 for SIGINT, 143 for
     * SIGTERM), not "failed". */
    const int sig = atomic_load(&ctl_interrupted);
    return rc != CTL_EXIT_OK && sig ? 128 + sig : rc;
}
