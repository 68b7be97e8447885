/* ditctl generate: one Generate call with a live view of its events, then
 * the image or video written to a file (PNG, MP4, or the raw tensor as
 * safetensors) and the server's timings printed. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "ditctl.h"
#include "ditctl_output.h"

static const ctl_help generate_help = {
    "usage: ditctl generate --prompt TEXT -o FILE [request options] [--quiet]\n"
    "                       [connection options]\n"
    "\n"
    "Sends one Generate request and follows its events: the queue position, the start,\n"
    "one progress update per denoising step, the result in chunks, and the final Result.\n"
    "Then writes the image or video and prints the request id, seed, size, the server's\n"
    "timings and the latency seen here. The output's extension picks the format: .png\n"
    "(an image), .mp4 (a video); with --raw, a safetensors file. Otherwise the model's\n"
    "own (PNG for images, MP4 for video).\n"
    "\n"
    "Progress goes to stderr: a bar when stderr is a terminal, otherwise a line for\n"
    "the queue, the start, every tenth of the steps and the VAE decode; both show the\n"
    "steps per second and the time left. The output path is checked before the request\n"
    "is sent. Ctrl-C cancels the request (exit 130).\n",
    "Exit status: 0 on success; 1 on a gRPC error (printed as 'ditctl: STATUS: details',\n"
    "e.g. INVALID_ARGUMENT for a bad size, UNAVAILABLE when no daemon listens) or when\n"
    "the output cannot be written; 2 on bad command-line arguments; 130 when interrupted.\n"};

typedef struct gen_args {
    ctl_request r;
    const char *output;
    bool quiet;
} gen_args;

static int set_output(void *t, const char *v, char *err, size_t cap)
{
    if (v[0] == '\0') {
        snprintf(err, cap, "is empty");
        return -1;
    }
    ((gen_args *)((ctl_target *)t)->cmd)->output = v;
    return 0;
}

static int set_quiet(void *t, const char *v, char *err, size_t cap)
{
    (void)err;
    (void)cap;
    ((gen_args *)((ctl_target *)t)->cmd)->quiet = v[0] == '1';
    return 0;
}

static const dit_option gen_opts[] = {
    {"output", 'o', DIT_OPT_CUSTOM, NULL, "FILE",
     "where to write the PNG or MP4; with --raw, a safetensors file holding the tensor 'image' "
     "(3, H, W) or 'video' (3, F, H, W) in the dtype the daemon sent (f32)",
     NULL, 0, 0, 0, set_output, false},
    {"quiet", 'q', DIT_OPT_FLAG, NULL, NULL, "print nothing but errors (no progress, no summary)",
     NULL, 0, 0, 0, set_quiet, false},
};

/* The live view on stderr. */
typedef struct view {
    bool show; /* anything at all */
    bool tty;  /* redraw one line in place */
    bool line_open;
    int last_tenth;
    int last_position;
} view;

/* "2.50 steps/s, ETA 4.8 s" from the steps done and the time they took;
 * slow steps read better as seconds per step. */
static void rate_text(int step, int total, double elapsed_ms, char *buf, size_t cap)
{
    if (step <= 0 || elapsed_ms <= 0) {
        snprintf(buf, cap, "%s", "");
        return;
    }
    const double rate = step / (elapsed_ms / 1e3);
    const double eta = (total - step) / rate;
    if (rate >= 1.0)
        snprintf(buf, cap, "  %.2f steps/s, ETA %.1f s", rate, eta);
    else
        snprintf(buf, cap, "  %.2f s/step, ETA %.1f s", 1.0 / rate, eta);
}

static void view_line(view *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void view_line(view *v, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (v->tty) {
        fputs("\r\033[K", stderr);
        vfprintf(stderr, fmt, ap);
        v->line_open = true;
    } else {
        vfprintf(stderr, fmt, ap);
        fputc('\n', stderr);
    }
    va_end(ap);
    fflush(stderr);
}

static void view_close(view *v)
{
    if (v->line_open) {
        fputc('\n', stderr);
        v->line_open = false;
    }
}

static int on_queued(void *user, const char *rid, int position, int depth)
{
    view *v = user;
    (void)rid;
    if (v->show && position != v->last_position)
        view_line(v, "queued: %d ahead (queue depth %d)", position, depth);
    v->last_position = position;
    return 0;
}

static int on_started(void *user, const char *rid, double queue_ms)
{
    view *v = user;
    (void)rid;
    if (v->show)
        view_line(v, "started after %.1f ms in the queue", queue_ms);
    return 0;
}

static int on_progress(void *user, const char *rid, int step, int total, double elapsed_ms)
{
    view *v = user;
    (void)rid;
    if (!v->show || total <= 0)
        return 0;
    if (v->tty) {
        enum { WIDTH = 30 };
        char bar[WIDTH + 1];
        int fill = (int)((long)step * WIDTH / total);
        for (int i = 0; i < WIDTH; i++)
            bar[i] = i < fill ? '#' : '.';
        bar[WIDTH] = '\0';
        char rate[64];
        rate_text(step, total, elapsed_ms, rate, sizeof rate);
        view_line(v, "[%s] step %d/%d  %.1f s%s", bar, step, total, elapsed_ms / 1e3, rate);
    } else {
        int tenth = (int)((long)step * 10 / total);
        if (tenth > v->last_tenth || step == total) {
            char rate[64];
            rate_text(step, total, elapsed_ms, rate, sizeof rate);
            view_line(v, "step %d/%d  %.1f s%s", step, total, elapsed_ms / 1e3, rate);
            v->last_tenth = tenth;
        }
    }
    return 0;
}

static int on_stage(void *user, const char *rid, const char *stage, double elapsed_ms)
{
    view *v = user;
    (void)rid;
    if (!v->show)
        return 0;
    if (strcmp(stage, "decoding") == 0)
        view_line(v, "decoding (VAE) after %.1f s of denoising", elapsed_ms / 1e3);
    else
        view_line(v, "%s", stage);
    return 0;
}

static int on_result(void *user, const char *rid, const Ditserve__V1__Result *res,
                     const uint8_t *data, size_t size)
{
    view *v = user;
    (void)rid;
    (void)res;
    (void)data;
    (void)size;
    view_close(v);
    return 0;
}

/* Image m's file of n: FILE.ext for one, FILE_m.ext for several. */
static void image_path(const char *output, size_t n, size_t m, char *path, size_t cap)
{
    if (n == 1) {
        snprintf(path, cap, "%s", output);
        return;
    }
    const char *slash = strrchr(output, '/'), *dot = strrchr(output, '.');
    if (!dot || (slash && dot < slash))
        dot = output + strlen(output);
    snprintf(path, cap, "%.*s_%zu%s", (int)(dot - output), output, m, dot);
}

int ctl_generate(int argc, char **argv, ctl_common *common)
{
    gen_args a;
    memset(&a, 0, sizeof a);
    ctl_request_init(&a.r);
    int rc = ctl_parse(argc, argv, "generate", &generate_help, gen_opts,
                       sizeof gen_opts / sizeof *gen_opts, &a, common, &a.r);
    if (rc)
        return rc == CTL_HELP_SHOWN ? 0 : rc;
    if (!a.output)
        return ctl_usage_error("generate", "%s", "--output (-o) is required");
    char err[512];
    /* A generation can take minutes: learn that its result has nowhere to go
     * before asking for it. */
    if (ctl_check_output(a.output, err, sizeof err) != 0) {
        fprintf(stderr, "ditctl: %s\n", err);
        return CTL_EXIT_FAIL;
    }
    const bool warned = !a.quiet && ctl_request_warn(&a.r);
    /* Without --raw, the file's extension names the format. */
    const size_t olen = strlen(a.output);
    if (!a.r.raw && olen >= 4 && strcasecmp(a.output + olen - 4, ".mp4") == 0)
        a.r.req.output_format = DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_MP4;
    else if (!a.r.raw && olen >= 4 && strcasecmp(a.output + olen - 4, ".png") == 0)
        a.r.req.output_format = DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_PNG;

    dit_client *c;
    if ((rc = ctl_open(common, 0, &c)))
        return rc;
    view v = {.show = !a.quiet, .tty = isatty(STDERR_FILENO) != 0, .last_position = -1};
    dit_gen_callbacks cb = {
        .user = &v,
        .queued = on_queued,
        .started = on_started,
        .progress = on_progress,
        .result = on_result,
        .stage = on_stage,
    };
    dit_call_opts co = {.cancel = &ctl_interrupted};
    dit_gen_output out;
    dit_rpc_status st;
    dit_rpc_code code = dit_client_generate(c, &a.r.req, &cb, &co, &out, &st);
    view_close(&v);
    if (code != DIT_RPC_OK) {
        rc = ctl_rpc_error(&st);
        goto cleanup;
    }
    const Ditserve__V1__Result *res = out.result;
    const bool got_raw = res->format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR;
    const bool got_mp4 = res->format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_MP4;
    const char *got_name = got_raw ? "a raw tensor" : got_mp4 ? "an MP4" : "a PNG";
    if (got_raw != a.r.raw ||
        (a.r.req.output_format != DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_UNSPECIFIED &&
         res->format != a.r.req.output_format)) {
        fprintf(stderr, "ditctl: the daemon sent %s, which was not asked for\n", got_name);
        rc = CTL_EXIT_FAIL;
        goto cleanup;
    }
    /* One file per image: FILE.ext for one, FILE_k.ext for several. */
    size_t written = 0, base = 0;
    const size_t n_images = res->n_image_bytes > 1 ? res->n_image_bytes : 1;
    char path[4096], first[4096] = "";
    for (size_t m = 0; m < n_images; m++) {
        const size_t len = res->n_image_bytes > 1 ? (size_t)res->image_bytes[m] : out.size;
        size_t w = len;
        if (len > out.size - base) { /* base <= out.size: no wrap */
            fprintf(stderr, "ditctl: the Result's image sizes exceed the %zu bytes received\n",
                    out.size);
            rc = CTL_EXIT_FAIL;
            goto cleanup;
        }
        image_path(a.output, n_images, m, path, sizeof path);
        if ((got_raw ? ctl_write_raw(path, res, out.request_id, out.data + base, len, &w, err,
                                     sizeof err)
                     : ctl_write_file(path, out.data + base, len, err, sizeof err)) != 0) {
            fprintf(stderr, "ditctl: %s\n", err);
            /* All of the request's images or none: the ones written go. */
            for (size_t k = 0; k < m; k++) {
                image_path(a.output, n_images, k, path, sizeof path);
                unlink(path);
            }
            rc = CTL_EXIT_FAIL;
            goto cleanup;
        }
        written += w;
        base += len;
        if (m == 0)
            snprintf(first, sizeof first, "%s", path);
    }
    if (!a.quiet) {
        const bool video = res->num_frames > 1 || got_mp4;
        const char *kind = got_raw   ? (res->n_shape == 4 ? "safetensors, tensor 'video'"
                                                          : "safetensors, tensor 'image'")
                           : got_mp4 ? "MP4"
                                     : "PNG";
        if (n_images > 1)
            printf("wrote %zu images, %s .. %s (%zu bytes, %s)\n", n_images, first, path, written,
                   kind);
        else
            printf("wrote %s (%zu bytes, %s)\n", a.output, written, kind);
        printf("request: %s\n", out.request_id ? out.request_id : "");
        printf("seed: %llu\n", (unsigned long long)res->seed);
        if (video)
            printf("size: %dx%d, %d frames at %d fps\n", res->width, res->height, res->num_frames,
                   res->fps);
        else
            printf("size: %dx%d\n", res->width, res->height);
        if (res->timings) {
            const Ditserve__V1__Timings *t = res->timings;
            printf("time: queue %.1f ms, tokenize %.1f ms, text encoders %.1f ms, denoising "
                   "%.1f ms (%.1f to %.1f ms per step), VAE decode %.1f ms, %s %.1f ms, "
                   "server total %.1f ms\n",
                   t->queue_ms, t->tokenize_ms, t->text_encode_ms, t->denoise_ms, t->step_ms_min,
                   t->step_ms_max, t->vae_ms,
                   got_raw   ? "encode"
                   : got_mp4 ? "MP4"
                             : "PNG",
                   t->encode_ms, t->total_ms);
        }
        printf("latency: %.1f ms (client, end to end)\n", out.latency_ms);
        if (res->prompt_truncated)
            printf("note: the prompt was truncated to the tokenizers' limit\n");
        /* The daemon's warnings; when ditctl warned already they say the
         * same thing again. */
        for (size_t i = 0; !warned && i < res->n_warnings; i++)
            fprintf(stderr, "ditctl: warning from the daemon: %s\n", res->warnings[i]);
    }
cleanup:
    dit_gen_output_free(&out);
    dit_client_close(c);
    return rc;
}
