/* ditctl's command-line contract and the client library, without ditd.
 *
 * Three groups:
 *   cli:      help texts, usage errors (exit 2), a closed port (UNAVAILABLE,
 *             exit 1, fast), a silent peer (DEADLINE_EXCEEDED within
 *             --timeout), unreadable PEM files.
 *   fake:     ditctl against a fake ditserve.v1 server that runs in the test
 *             process (gRPC C core, one call at a time): every command, the
 *             request fields as the server received them, PNG and raw
 *             outputs, server errors, broken result streams, tokens,
 *             deadlines, Ctrl-C, bench statistics.
 *   library:  dit_client directly: event callbacks in order, cancelling
 *             from a callback and from a flag, 8 threads on one client.
 * The fake server starts in a checked fixture, so in each forked test
 * process, after the fork; gRPC is never initialised in Check's parent. */
#include <arpa/inet.h>
#include <check.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <sys/socket.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>

#include "ditclient.h"
#include "grpc_health_v1_health.pb-c.h"
#include "test_proc.h"

#define OUT_CAP (1 << 16)

static const char *ditctl_path(void)
{
    static char path[4096];
    const char *p = getenv("DITCTL");
    if (p && p[0])
        return p;
    snprintf(path, sizeof path, "%s/client/ditctl", test_env("DIT_BUILD_ROOT"));
    return path;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Runs ditctl with up to 40 arguments (NULL-terminated); output (stdout
 * and stderr together) into out. */
static int ctl_run(char *out, double *seconds, ...)
{
    char *argv[42];
    int n = 0;
    argv[n++] = (char *)ditctl_path();
    va_list ap;
    va_start(ap, seconds);
    const char *a;
    while ((a = va_arg(ap, const char *)) && n < 41)
        argv[n++] = (char *)a;
    va_end(ap);
    argv[n] = NULL;
    return test_run(argv, NULL, out, OUT_CAP, seconds);
}

#define HAS(out, s) ck_assert_msg(strstr((out), (s)) != NULL, "missing '%s' in:\n%s", (s), (out))
#define HASNT(out, s)                                                                              \
    ck_assert_msg(strstr((out), (s)) == NULL, "unexpected '%s' in:\n%s", (s), (out))

/* A TCP port on 127.0.0.1 that nothing listens on (bound, then closed). */
static int closed_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    socklen_t len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    close(fd);
    return ntohs(sa.sin_port);
}

/* ======================================================================== */
/* cli: no server */

START_TEST(test_main_help)
{
    char out[OUT_CAP];
    ck_assert_int_eq(ctl_run(out, NULL, "--help", NULL), 0);
    HAS(out, "usage: ditctl");
    const char *cmds[] = {"generate", "health",   "info",          "models",       "warmup",
                          "bench",    "--target", "--timeout",     "--ca",         "--cert",
                          "--key",    "--token",  "DITCTL_TARGET", "DITCTL_TOKEN", "Exit status"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++)
        HAS(out, cmds[i]);
    ck_assert_int_eq(ctl_run(out, NULL, "help", NULL), 0);
    HAS(out, "usage: ditctl");
    ck_assert_int_eq(ctl_run(out, NULL, "--version", NULL), 0);
    HAS(out, "ditctl ");
}
END_TEST

START_TEST(test_command_help)
{
    static const struct {
        const char *cmd;
        const char *words[24];
    } cases[] = {
        {"generate",
         {"usage: ditctl generate",
          "--prompt",
          "--negative-prompt",
          "--prompt-2",
          "--width",
          "--height",
          "--steps",
          "--guidance",
          "--true-cfg",
          "--seed",
          "--max-sequence-length",
          "--priority",
          "--request-id",
          "--model",
          "--raw",
          "-o FILE",
          "--quiet",
          "--target",
          "--timeout",
          "--ca",
          "--cert",
          "--key",
          "--token",
          "Exit status"}},
        {"health",
         {"usage: ditctl health", "--service", "SERVING", "NOT_SERVING", "--target",
          "Exit status: 0 only when SERVING"}},
        {"info", {"usage: ditctl info", "GetServerInfo", "--target", "Exit status"}},
        {"models", {"usage: ditctl models", "ListModels", "--target", "Exit status"}},
        {"warmup",
         {"usage: ditctl warmup", "--width", "--height", "--steps", "--model", "Exit status"}},
        {"bench",
         {"usage: ditctl bench", "-n", "-c", "C[,C...]", "-c 1,4,16", "p50", "p90", "p99", "max",
          "throughput", "overhead", "queue_ms", "nearest-rank", "--prompt", "--seed", "--target",
          "Exit status"}},
    };
    char out[OUT_CAP], out2[OUT_CAP];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ck_assert_int_eq(ctl_run(out, NULL, cases[i].cmd, "--help", NULL), 0);
        for (size_t j = 0; j < 24 && cases[i].words[j]; j++)
            HAS(out, cases[i].words[j]);
        ck_assert_int_eq(ctl_run(out2, NULL, "help", cases[i].cmd, NULL), 0);
        ck_assert_str_eq(out, out2);
        ck_assert_int_eq(ctl_run(out2, NULL, cases[i].cmd, "-h", NULL), 0);
        ck_assert_str_eq(out, out2);
    }
}
END_TEST

/* Every line of the usage errors: exit 2 and a message naming the problem. */
START_TEST(test_usage_errors)
{
    static const struct {
        const char *args[8];
        const char *msg;
    } cases[] = {
        {{NULL}, "a command is required"},
        {{"frobnicate"}, "unknown command 'frobnicate'"},
        {{"--bogus", "health"}, "unknown option '--bogus'"},
        {{"health", "--bogus"}, "unknown option '--bogus'"},
        {{"health", "extra"}, "unexpected argument 'extra'"},
        {{"help", "frobnicate"}, "unknown command"},
        {{"generate", "-o", "x.png"}, "--prompt is required"},
        {{"generate", "--prompt", "p"}, "--output (-o) is required"},
        {{"generate", "--prompt"}, "'--prompt' needs a value"},
        {{"generate", "--prompt", "p", "-o", "x", "--width", "abc"}, "--width wants an integer"},
        {{"generate", "--prompt", "p", "-o", "x", "--width", "-16"}, "--width wants an integer"},
        {{"generate", "--prompt", "p", "-o", "x", "--height", "9999999999"}, "--height wants"},
        {{"generate", "--prompt", "p", "-o", "x", "--steps", "1.5"}, "--steps wants"},
        {{"generate", "--prompt", "p", "-o", "x", "--seed", "-1"}, "--seed wants"},
        {{"generate", "--prompt", "p", "-o", "x", "--seed", "18446744073709551616"},
         "--seed wants"},
        {{"generate", "--prompt", "p", "-o", "x", "--guidance", "nan"}, "--guidance wants"},
        {{"generate", "--prompt", "p", "-o", "x", "--true-cfg", "x"}, "--true-cfg wants"},
        {{"generate", "--prompt", "p", "-o", "x", "--max-sequence-length", "0"}, "--max-sequence"},
        {{"generate", "--prompt", "p", "-o", "x", "--priority", "high"}, "--priority wants"},
        {{"generate", "--prompt", "p", "-o", ""}, "-o is empty"},
        {{"--timeout", "-1", "health"}, "--timeout wants"},
        {{"health", "--timeout", "soon"}, "--timeout wants"},
        {{"--target", "", "health"}, "--target is empty"},
        {{"info", "--cert", "c.pem"}, "--cert and --key go together"},
        {{"info", "--key", "k.pem"}, "--cert and --key go together"},
        {{"health", "--token", ""}, "--token is empty"},
        {{"warmup", "--width", "-1"}, "--width wants"},
        {{"warmup", "--steps", "many"}, "--steps wants"},
        {{"bench", "--prompt", "p", "-n", "0"}, "-n wants"},
        {{"bench", "--prompt", "p", "-c", "0"}, "-c wants"},
        {{"bench", "--prompt", "p", "-c", "5000"}, "-c wants"},
        {{"bench", "--prompt", "p", "-c", "1025"}, "-c wants concurrency levels from 1 to 1024"},
        {{"bench", "--prompt", "p", "-c", "1,,2"}, "'1,,2' has an empty item"},
        {{"bench", "--prompt", "p", "-c", "1,2,"}, "'1,2,' has an empty item"},
        {{"bench", "--prompt", "p", "-c", ""}, "has an empty item"},
        {{"bench", "--prompt", "p", "-c", "x"}, "(1,4,16), not 'x'"},
        {{"bench", "--prompt", "p", "-c", "1,0"}, "(1,4,16), not '0'"},
        {{"bench", "--prompt", "p", "-c", "4,-1"}, "not '-1'"},
        {{"bench", "--prompt", "p", "-c", "1, 2"}, "not ' 2'"},
        {{"bench", "--prompt", "p", "-c", "99999999999999999999"}, "-c wants"},
        {{"bench", "--prompt", "p", "-c", "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17"},
         "-c takes at most 16 concurrency levels"},
        {{"bench", "-n", "3"}, "--prompt is required"},
        {{"info", "--prompt", "p"}, "unknown option '--prompt'"},
        {{"health", "-o", "x"}, "unknown option '-o'"},
    };
    char out[OUT_CAP];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *argv[12];
        int n = 0;
        argv[n++] = (char *)ditctl_path();
        for (int j = 0; j < 8 && cases[i].args[j]; j++)
            argv[n++] = (char *)cases[i].args[j];
        argv[n] = NULL;
        int rc = test_run(argv, NULL, out, sizeof out, NULL);
        ck_assert_msg(rc == 2, "case %zu (%s): exit %d, output:\n%s", i, cases[i].msg, rc, out);
        HAS(out, "ditctl: ");
        HAS(out, cases[i].msg);
        HAS(out, "--help");
    }
}
END_TEST

/* Nothing listens: every command fails fast with UNAVAILABLE and exit 1. */
START_TEST(test_closed_port)
{
    char target[64], out[OUT_CAP];
    snprintf(target, sizeof target, "127.0.0.1:%d", closed_port());
    const char *cmds[][6] = {
        {"health", NULL},
        {"info", NULL},
        {"models", NULL},
        {"warmup", "--width", "64", NULL},
        {"generate", "--prompt", "p", "-o", "/tmp/ditctl_never.png", NULL},
    };
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char *argv[12];
        int n = 0;
        argv[n++] = (char *)ditctl_path();
        argv[n++] = (char *)"--target";
        argv[n++] = target;
        argv[n++] = (char *)"--timeout";
        argv[n++] = (char *)"5";
        for (int j = 0; cmds[i][j]; j++)
            argv[n++] = (char *)cmds[i][j];
        argv[n] = NULL;
        double secs;
        int rc = test_run(argv, NULL, out, sizeof out, &secs);
        ck_assert_msg(rc == 1, "%s: exit %d:\n%s", cmds[i][0], rc, out);
        HAS(out, "ditctl: UNAVAILABLE: ");
        ck_assert_msg(secs < 5.0, "%s took %.2f s", cmds[i][0], secs);
    }
    ck_assert_int_eq(access("/tmp/ditctl_never.png", F_OK), -1);

    /* The environment supplies the target too. */
    setenv("DITCTL_TARGET", target, 1);
    ck_assert_int_eq(ctl_run(out, NULL, "health", NULL), 1);
    HAS(out, "UNAVAILABLE");
    HAS(out, target);
    unsetenv("DITCTL_TARGET");

    /* bench reports the failures by status and exits 1. */
    ck_assert_int_eq(ctl_run(out, NULL, "--target", target, "bench", "-n", "3", "-c", "2",
                             "--prompt", "p", NULL),
                     1);
    HAS(out, "requests: 3 sent of 3");
    HAS(out, "status: UNAVAILABLE 3");
    HAS(out, "no request ended OK");
}
END_TEST

/* A peer that accepts TCP connections but never speaks: the call ends with
 * DEADLINE_EXCEEDED when --timeout passes, not later. */
START_TEST(test_silent_peer_deadline)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    ck_assert_int_eq(listen(fd, 16), 0);
    socklen_t len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    char target[64], out[OUT_CAP];
    snprintf(target, sizeof target, "127.0.0.1:%d", ntohs(sa.sin_port));
    double secs;
    int rc = ctl_run(out, &secs, "--target", target, "--timeout", "1", "info", NULL);
    ck_assert_msg(rc == 1, "exit %d:\n%s", rc, out);
    HAS(out, "ditctl: DEADLINE_EXCEEDED: ");
    ck_assert_msg(secs >= 0.9 && secs < 4.0, "took %.2f s", secs);
    close(fd);
}
END_TEST

START_TEST(test_unreadable_pem)
{
    char out[OUT_CAP];
    ck_assert_int_eq(ctl_run(out, NULL, "--ca", "/nonexistent/ca.pem", "info", NULL), 1);
    HAS(out, "ditctl: cannot read CA file /nonexistent/ca.pem");
    ck_assert_int_eq(ctl_run(out, NULL, "info", "--cert", "/nonexistent/c.pem", "--key",
                             "/nonexistent/k.pem", NULL),
                     1);
    HAS(out, "cannot read certificate /nonexistent/c.pem");
}
END_TEST

/* ======================================================================== */
/* A fake ditserve.v1 server */

typedef struct seen_request {
    char model[64], prompt[128], prompt_2[128], negative[128], request_id[128];
    int width, height, steps, max_seq, priority, format, frames, fps;
    bool has_guidance, has_cfg, has_seed;
    float guidance, cfg;
    uint64_t seed;
} seen_request;

typedef struct fake_server {
    grpc_server *server;
    grpc_completion_queue *cq;
    pthread_t thread;
    int port;
    char target[64];
    const char *token; /* required on every call but health when set */
    bool shutdown_done;
    char shutdown_tag;
    atomic_int generate_calls;
    atomic_int health_calls;
    atomic_int health_with_auth;
    atomic_int client_gone; /* generate calls whose client went away mid-stream */
    pthread_mutex_t mu;
    seen_request last;
} fake_server;

static fake_server fs;

static bool srv_wait(fake_server *s, void *tag)
{
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            return false;
        if (ev.tag == &s->shutdown_tag) {
            s->shutdown_done = true;
            continue;
        }
        if (ev.tag == tag)
            return ev.success != 0;
    }
}

static bool srv_batch(fake_server *s, grpc_call *call, grpc_op *ops, size_t n)
{
    char tag;
    if (grpc_call_start_batch(call, ops, n, &tag, NULL) != GRPC_CALL_OK)
        return false;
    return srv_wait(s, &tag);
}

static bool srv_send(fake_server *s, grpc_call *call, const ProtobufCMessage *m)
{
    size_t n = protobuf_c_message_get_packed_size(m);
    grpc_slice sl = grpc_slice_malloc(n);
    protobuf_c_message_pack(m, GRPC_SLICE_START_PTR(sl));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_MESSAGE;
    op.data.send_message.send_message = bb;
    bool ok = srv_batch(s, call, &op, 1);
    grpc_byte_buffer_destroy(bb);
    return ok;
}

static ProtobufCMessage *srv_unpack(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *d)
{
    if (!bb)
        return NULL;
    grpc_byte_buffer_reader r;
    grpc_byte_buffer_reader_init(&r, bb);
    grpc_slice sl = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    ProtobufCMessage *m =
        protobuf_c_message_unpack(d, NULL, GRPC_SLICE_LENGTH(sl), GRPC_SLICE_START_PTR(sl));
    grpc_slice_unref(sl);
    return m;
}

static const char *md_find(const grpc_metadata_array *md, const char *key, char *buf, size_t cap)
{
    for (size_t i = 0; i < md->count; i++) {
        if (grpc_slice_str_cmp(md->metadata[i].key, key) == 0) {
            size_t n = GRPC_SLICE_LENGTH(md->metadata[i].value);
            if (n >= cap)
                n = cap - 1;
            memcpy(buf, GRPC_SLICE_START_PTR(md->metadata[i].value), n);
            buf[n] = '\0';
            return buf;
        }
    }
    return NULL;
}

/* The bytes the fake sends as a PNG: a recognisable pattern. */
static uint8_t fake_png_byte(size_t i)
{
    return (uint8_t)(i * 7 + 3);
}
#define FAKE_PNG_SIZE 10000

static float fake_raw_value(int c, int y, int x, int w)
{
    return (float)(c * 1000 + y * w + x) * 1e-3f;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Streams the events of one generation; returns the final status. */
static grpc_status_code fake_generate(fake_server *s, grpc_call *call,
                                      const Ditserve__V1__GenerateRequest *rq, char *details,
                                      size_t cap)
{
    int n = atomic_fetch_add(&s->generate_calls, 1);
    pthread_mutex_lock(&s->mu);
    seen_request *l = &s->last;
    snprintf(l->model, sizeof l->model, "%s", rq->model);
    snprintf(l->prompt, sizeof l->prompt, "%s", rq->prompt);
    snprintf(l->prompt_2, sizeof l->prompt_2, "%s", rq->prompt_2);
    snprintf(l->negative, sizeof l->negative, "%s", rq->negative_prompt);
    snprintf(l->request_id, sizeof l->request_id, "%s", rq->request_id);
    l->width = rq->width;
    l->height = rq->height;
    l->steps = rq->num_inference_steps;
    l->max_seq = rq->max_sequence_length;
    l->frames = rq->num_frames;
    l->fps = rq->fps;
    l->priority = rq->priority;
    l->format = rq->output_format;
    l->has_guidance = rq->guidance_scale != NULL;
    l->guidance = rq->guidance_scale ? rq->guidance_scale->value : 0;
    l->has_cfg = rq->true_cfg_scale != NULL;
    l->cfg = rq->true_cfg_scale ? rq->true_cfg_scale->value : 0;
    l->has_seed = rq->seed != NULL;
    l->seed = rq->seed ? rq->seed->value : 0;
    pthread_mutex_unlock(&s->mu);

    const char *p = rq->prompt;
    if (strcmp(p, "invalid") == 0) {
        snprintf(details, cap, "width must be a multiple of 16, got %d", rq->width);
        return GRPC_STATUS_INVALID_ARGUMENT;
    }
    if (strcmp(p, "flaky") == 0 && n % 2 == 1) {
        snprintf(details, cap, "queue is full (1 waiting)");
        return GRPC_STATUS_RESOURCE_EXHAUSTED;
    }
    const bool slow = strcmp(p, "slow") == 0;
    const char *rid = rq->request_id[0] ? rq->request_id : "fake-request";
    const int steps = slow ? 100 : rq->num_inference_steps ? rq->num_inference_steps : 4;
    const int w = rq->width ? rq->width : 16, h = rq->height ? rq->height : 16;
    const bool raw = rq->output_format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR;

    Ditserve__V1__GenerateEvent ev = DITSERVE__V1__GENERATE_EVENT__INIT;
    ev.request_id = (char *)rid;
    Ditserve__V1__Queued q = DITSERVE__V1__QUEUED__INIT;
    ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_QUEUED;
    ev.queued = &q;
    for (int pos = 1; pos >= 0; pos--) {
        q.position = pos;
        q.queue_depth = pos + 1;
        if (!srv_send(s, call, &ev.base))
            goto gone;
    }
    Ditserve__V1__Started st = DITSERVE__V1__STARTED__INIT;
    st.queue_ms = 5;
    ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_STARTED;
    ev.started = &st;
    if (!srv_send(s, call, &ev.base))
        goto gone;
    Ditserve__V1__Progress pr = DITSERVE__V1__PROGRESS__INIT;
    ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_PROGRESS;
    ev.progress = &pr;
    for (int i = 1; i <= steps; i++) {
        if (slow)
            sleep_ms(50);
        pr.step = i;
        pr.total_steps = steps;
        pr.elapsed_ms = 5.0 * i;
        if (!srv_send(s, call, &ev.base))
            goto gone;
    }
    /* The VAE starts, as ditd reports it. */
    pr.stage = "decoding";
    if (!srv_send(s, call, &ev.base))
        goto gone;

    size_t size = raw ? (size_t)3 * h * w * 4 : FAKE_PNG_SIZE;
    uint8_t *data = malloc(size);
    if (raw) {
        for (int c = 0; c < 3; c++)
            for (int y = 0; y < h; y++)
                for (int x = 0; x < w; x++) {
                    float v = fake_raw_value(c, y, x, w);
                    memcpy(data + 4 * (((size_t)c * h + y) * w + x), &v, 4);
                }
    } else {
        for (size_t i = 0; i < size; i++)
            data[i] = fake_png_byte(i);
    }
    Ditserve__V1__ResultChunk ch = DITSERVE__V1__RESULT_CHUNK__INIT;
    ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_CHUNK;
    ev.chunk = &ch;
    const bool gap = strcmp(p, "gap") == 0;
    for (size_t off = 0; off < size; off += 4096) {
        ch.offset = (int64_t)off + (gap && off > 0 ? 100 : 0);
        ch.data.data = data + off;
        ch.data.len = size - off < 4096 ? size - off : 4096;
        if (!srv_send(s, call, &ev.base)) {
            free(data);
            goto gone;
        }
    }
    free(data);
    if (strcmp(p, "noresult") == 0)
        return GRPC_STATUS_OK;

    Ditserve__V1__Timings t = DITSERVE__V1__TIMINGS__INIT;
    t.queue_ms = 5;
    t.tokenize_ms = 1;
    t.text_encode_ms = 2;
    t.denoise_ms = 20;
    t.step_ms_min = 4.5;
    t.step_ms_max = 5.5;
    t.vae_ms = 3;
    t.encode_ms = 1;
    t.total_ms = 40;
    Ditserve__V1__Result res = DITSERVE__V1__RESULT__INIT;
    int64_t shape[3] = {3, h, w};
    res.format = raw ? DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR
                     : DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_PNG;
    res.seed = rq->seed ? rq->seed->value : 12345;
    res.width = w;
    res.height = h;
    res.total_bytes = (int64_t)size + (strcmp(p, "short") == 0 ? 1 : 0);
    if (raw) {
        res.dtype = DITSERVE__V1__DTYPE__DTYPE_F32;
        res.n_shape = 3;
        res.shape = shape;
    }
    /* Hostile image sizes: one that wraps (size_t of -1) and two that do
     * not add up to the bytes sent. */
    int64_t bad_sizes[2] = {1, -1};
    if (strcmp(p, "negsize") == 0 || strcmp(p, "oversize") == 0) {
        bad_sizes[0] = strcmp(p, "negsize") == 0 ? 1 : (int64_t)size;
        bad_sizes[1] = strcmp(p, "negsize") == 0 ? -1 : 1;
        res.n_image_bytes = 2;
        res.image_bytes = bad_sizes;
    }
    res.prompt_truncated = strcmp(p, "long") == 0;
    char *warnings[1] = {"negative_prompt has no effect (fake)"};
    if (strcmp(p, "warn") == 0) {
        res.n_warnings = 1;
        res.warnings = warnings;
    }
    res.timings = &t;
    ev.event_case = DITSERVE__V1__GENERATE_EVENT__EVENT_RESULT;
    ev.result = &res;
    if (!srv_send(s, call, &ev.base))
        goto gone;
    return GRPC_STATUS_OK;
gone:
    atomic_fetch_add(&s->client_gone, 1);
    snprintf(details, cap, "client went away");
    return GRPC_STATUS_CANCELLED;
}

static void fake_handle(fake_server *s, grpc_call *call, const grpc_call_details *cd,
                        const grpc_metadata_array *md)
{
    grpc_byte_buffer *req = NULL;
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_RECV_MESSAGE;
    ops[1].data.recv_message.recv_message = &req;
    srv_batch(s, call, ops, 2);

    char method[128];
    size_t mn = GRPC_SLICE_LENGTH(cd->method);
    snprintf(method, sizeof method, "%.*s", (int)mn,
             (const char *)GRPC_SLICE_START_PTR(cd->method));
    grpc_status_code code = GRPC_STATUS_OK;
    char details[256] = "";
    char auth[256];
    const bool is_health = strcmp(method, "/grpc.health.v1.Health/Check") == 0;

    if (is_health) {
        atomic_fetch_add(&s->health_calls, 1);
        if (md_find(md, "authorization", auth, sizeof auth))
            atomic_fetch_add(&s->health_with_auth, 1);
    } else if (s->token) {
        char want[256];
        snprintf(want, sizeof want, "Bearer %s", s->token);
        if (!md_find(md, "authorization", auth, sizeof auth) || strcmp(auth, want) != 0) {
            code = GRPC_STATUS_UNAUTHENTICATED;
            snprintf(details, sizeof details, "missing or wrong bearer token");
            goto status;
        }
    }

    if (is_health) {
        Grpc__Health__V1__HealthCheckRequest *hr =
            (void *)srv_unpack(req, &grpc__health__v1__health_check_request__descriptor);
        Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
        const char *svc = hr ? hr->service : "";
        if (strcmp(svc, "") == 0 || strcmp(svc, "ditserve.v1.Generation") == 0) {
            resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
        } else if (strcmp(svc, "down") == 0) {
            resp.status = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
        } else {
            code = GRPC_STATUS_NOT_FOUND;
            snprintf(details, sizeof details, "unknown service %s", svc);
        }
        if (hr)
            protobuf_c_message_free_unpacked(&hr->base, NULL);
        if (code == GRPC_STATUS_OK)
            srv_send(s, call, &resp.base);
    } else if (strcmp(method, "/ditserve.v1.Generation/GetServerInfo") == 0) {
        Ditserve__V1__ParallelLayout l = DITSERVE__V1__PARALLEL_LAYOUT__INIT;
        l.ring_degree = 2;
        l.ulysses_degree = 1;
        l.tp_degree = 2;
        l.ring_anything = 1;
        char *devs[] = {(char *)"cpu:0", (char *)"cpu:1"};
        Ditserve__V1__ServerInfo si = DITSERVE__V1__SERVER_INFO__INIT;
        si.version = (char *)"9.9.9-fake";
        si.world_size = 4;
        si.layout = &l;
        si.backend = (char *)"cpu";
        si.n_devices = 2;
        si.devices = devs;
        si.queue_depth = 3;
        si.max_queue = 64;
        si.running = 1;
        si.mesh_state = (char *)"ready";
        si.comm = (char *)"shm";
        si.worker_restarts = 7;
        /* A video model, so that the frame fields show. */
        Ditserve__V1__ModelInfo m = DITSERVE__V1__MODEL_INFO__INIT;
        m.name = (char *)"wan";
        m.pipeline = (char *)"WanPipeline";
        m.transformer = (char *)"WanTransformer3DModel";
        m.task = DITSERVE__V1__TASK__TASK_TEXT_TO_VIDEO;
        m.default_width = 832;
        m.default_height = 480;
        m.default_steps = 50;
        m.default_num_frames = 81;
        m.default_fps = 16;
        Ditserve__V1__LayoutRules lr = DITSERVE__V1__LAYOUT_RULES__INIT;
        lr.size_multiple = lr.pixels_per_token = 16;
        lr.token_divisor = 1;
        lr.max_pixels = 921600;
        lr.max_steps = 1000;
        lr.max_sequence_length = 512;
        lr.frame_step = 4;
        m.layout = &lr;
        si.model = &m;
        srv_send(s, call, &si.base);
    } else if (strcmp(method, "/ditserve.v1.Generation/ListModels") == 0) {
        Ditserve__V1__ModelInfo m = DITSERVE__V1__MODEL_INFO__INIT;
        m.name = (char *)"demo";
        m.pipeline = (char *)"FluxPipeline";
        m.transformer = (char *)"FluxTransformer2DModel";
        m.task = DITSERVE__V1__TASK__TASK_TEXT_TO_IMAGE;
        m.has_text_encoders = 1;
        m.default_width = m.default_height = 1024;
        m.default_steps = 28;
        m.default_num_frames = 1;
        Ditserve__V1__LayoutRules l = DITSERVE__V1__LAYOUT_RULES__INIT;
        l.size_multiple = l.pixels_per_token = 16;
        l.token_divisor = 2;
        l.max_pixels = 4194304;
        l.max_steps = 1000;
        l.max_sequence_length = 512;
        m.layout = &l;
        Ditserve__V1__ModelInfo__ConfigEntry e[2] = {DITSERVE__V1__MODEL_INFO__CONFIG_ENTRY__INIT,
                                                     DITSERVE__V1__MODEL_INFO__CONFIG_ENTRY__INIT};
        e[0].key = (char *)"joint_attention_dim";
        e[0].value = 64;
        e[1].key = (char *)"pooled_projection_dim";
        e[1].value = 48;
        Ditserve__V1__ModelInfo__ConfigEntry *ep[] = {&e[0], &e[1]};
        m.n_config = 2;
        m.config = ep;
        Ditserve__V1__ModelInfo *ms[] = {&m};
        Ditserve__V1__ListModelsResponse r = DITSERVE__V1__LIST_MODELS_RESPONSE__INIT;
        r.n_models = 1;
        r.models = ms;
        srv_send(s, call, &r.base);
    } else if (strcmp(method, "/ditserve.v1.Generation/Warmup") == 0) {
        Ditserve__V1__WarmupRequest *wr =
            (void *)srv_unpack(req, &ditserve__v1__warmup_request__descriptor);
        char detail[128];
        snprintf(detail, sizeof detail, "warmed %dx%d, %d steps", wr ? wr->width : -1,
                 wr ? wr->height : -1, wr ? wr->num_inference_steps : -1);
        if (wr)
            protobuf_c_message_free_unpacked(&wr->base, NULL);
        Ditserve__V1__WarmupResponse r = DITSERVE__V1__WARMUP_RESPONSE__INIT;
        r.elapsed_ms = 12.5;
        r.detail = detail;
        srv_send(s, call, &r.base);
    } else if (strcmp(method, "/ditserve.v1.Generation/Generate") == 0) {
        Ditserve__V1__GenerateRequest *rq =
            (void *)srv_unpack(req, &ditserve__v1__generate_request__descriptor);
        if (!rq) {
            code = GRPC_STATUS_INVALID_ARGUMENT;
            snprintf(details, sizeof details, "undecodable request");
        } else {
            code = fake_generate(s, call, rq, details, sizeof details);
            protobuf_c_message_free_unpacked(&rq->base, NULL);
        }
    } else {
        code = GRPC_STATUS_UNIMPLEMENTED;
        snprintf(details, sizeof details, "no method %s", method);
    }

status:
    if (req)
        grpc_byte_buffer_destroy(req);
    int cancelled = 0;
    grpc_slice ds = grpc_slice_from_copied_string(details);
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[0].data.send_status_from_server.status = code;
    ops[0].data.send_status_from_server.status_details = &ds;
    ops[1].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[1].data.recv_close_on_server.cancelled = &cancelled;
    srv_batch(s, call, ops, 2);
    grpc_slice_unref(ds);
}

static void *fake_loop(void *arg)
{
    fake_server *s = arg;
    for (;;) {
        grpc_call *call = NULL;
        grpc_call_details cd;
        grpc_metadata_array md;
        grpc_call_details_init(&cd);
        grpc_metadata_array_init(&md);
        char tag;
        bool ok = grpc_server_request_call(s->server, &call, &cd, &md, s->cq, s->cq, &tag) ==
                      GRPC_CALL_OK &&
                  srv_wait(s, &tag);
        if (ok && call)
            fake_handle(s, call, &cd, &md);
        if (call)
            grpc_call_unref(call);
        grpc_call_details_destroy(&cd);
        grpc_metadata_array_destroy(&md);
        if (!ok)
            break;
    }
    while (!s->shutdown_done) {
        grpc_event ev =
            grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN || ev.tag == &s->shutdown_tag)
            s->shutdown_done = true;
    }
    return NULL;
}

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = calloc(1, 1 << 16);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* tls_dir: NULL for plaintext, else a folder with ca.pem, server.pem and
 * server.key; the server then requires a client certificate from that CA. */
static void quiet_log(gpr_log_func_args *args)
{
    (void)args;
}

static void fake_start_tls(const char *token, const char *tls_dir)
{
    /* The failed handshakes the TLS test provokes would log errors. */
    if (!getenv("GRPC_VERBOSITY"))
        gpr_set_log_function(quiet_log);
    memset(&fs, 0, sizeof fs);
    pthread_mutex_init(&fs.mu, NULL);
    fs.token = token;
    grpc_init();
    fs.server = grpc_server_create(NULL, NULL);
    fs.cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(fs.server, fs.cq, NULL);
    grpc_server_credentials *creds;
    if (tls_dir) {
        char p[3][4096];
        snprintf(p[0], sizeof p[0], "%s/ca.pem", tls_dir);
        snprintf(p[1], sizeof p[1], "%s/server.pem", tls_dir);
        snprintf(p[2], sizeof p[2], "%s/server.key", tls_dir);
        char *ca = slurp(p[0]), *cert = slurp(p[1]), *key = slurp(p[2]);
        if (!ca || !cert || !key) {
            fprintf(stderr, "fake server: cannot read the PEM files in %s\n", tls_dir);
            abort();
        }
        grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
        creds = grpc_ssl_server_credentials_create_ex(
            ca, &pair, 1, GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, NULL);
        free(ca);
        free(cert);
        free(key);
    } else {
        creds = grpc_insecure_server_credentials_create();
    }
    fs.port = grpc_server_add_http2_port(fs.server, "127.0.0.1:0", creds);
    grpc_server_credentials_release(creds);
    if (fs.port <= 0) { /* not ck_assert: --serve runs outside Check */
        fprintf(stderr, "fake server: cannot bind 127.0.0.1:0\n");
        abort();
    }
    /* An IP, also with TLS (the server certificate names it): resolving
     * "localhost" goes through c-ares, which leaks a few bytes per process
     * and would fail the sanitizer build. */
    snprintf(fs.target, sizeof fs.target, "127.0.0.1:%d", fs.port);
    grpc_server_start(fs.server);
    pthread_create(&fs.thread, NULL, fake_loop, &fs);
}

static void fake_start(const char *token)
{
    fake_start_tls(token, NULL);
}

static void fake_setup(void)
{
    fake_start(NULL);
}

static void fake_setup_token(void)
{
    fake_start("s3cret");
}

static void fake_teardown(void)
{
    grpc_server_shutdown_and_notify(fs.server, fs.cq, &fs.shutdown_tag);
    grpc_server_cancel_all_calls(fs.server);
    pthread_join(fs.thread, NULL);
    grpc_server_destroy(fs.server);
    grpc_completion_queue_shutdown(fs.cq);
    while (grpc_completion_queue_next(fs.cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(fs.cq);
    grpc_shutdown();
}

/* ======================================================================== */
/* fake: ditctl against the fake server */

START_TEST(test_fake_health)
{
    char out[OUT_CAP];
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "health", NULL), 0);
    ck_assert_str_eq(out, "SERVING\n");
    ck_assert_int_eq(ctl_run(out, NULL, "health", "--target", fs.target, "--service", "down", NULL),
                     1);
    ck_assert_str_eq(out, "NOT_SERVING\n");
    ck_assert_int_eq(ctl_run(out, NULL, "health", "--target", fs.target, "--service", "nope", NULL),
                     1);
    HAS(out, "ditctl: NOT_FOUND: unknown service nope");
    /* The token is not sent to health. */
    ck_assert_int_eq(ctl_run(out, NULL, "health", "--target", fs.target, "--token", "abc", NULL),
                     0);
    ck_assert_int_eq(atomic_load(&fs.health_calls), 4);
    ck_assert_int_eq(atomic_load(&fs.health_with_auth), 0);
}
END_TEST

START_TEST(test_fake_info_models_warmup)
{
    char out[OUT_CAP];
    ck_assert_int_eq(ctl_run(out, NULL, "info", "--target", fs.target, NULL), 0);
    const char *lines[] = {"version: 9.9.9-fake\n",
                           "world_size: 4\n",
                           "layout: ring 2, ulysses 1, tp 2, ring_anything\n",
                           "backend: cpu\n",
                           "devices: cpu:0, cpu:1\n",
                           "queue_depth: 3\n",
                           "max_queue: 64\n",
                           "running: 1\n",
                           "mesh_state: ready\n",
                           "comm: shm\n",
                           "worker_restarts: 7\n",
                           "model: wan: WanPipeline (text-to-video), transformer "
                           "WanTransformer3DModel, text encoders no\n"
                           "  defaults: 832x480, 50 steps, 81 frames at 16 fps\n"
                           "  allows: width and height multiples of 16, 16x16 pixels per token, "
                           "token counts multiples of 1, at most 921600 pixels, 1000 steps, 512 "
                           "text tokens, num_frames 4 x k + 1\n"};
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++)
        HAS(out, lines[i]);
    ck_assert_int_eq(ctl_run(out, NULL, "models", "--target", fs.target, NULL), 0);
    HAS(out, "demo: FluxPipeline (text-to-image), transformer FluxTransformer2DModel, text "
             "encoders yes\n"
             "  defaults: 1024x1024, 28 steps\n"
             "  allows: width and height multiples of 16, 16x16 pixels per token, token counts "
             "multiples of 2, at most 4194304 pixels, 1000 steps, 512 text tokens\n"
             "  config: joint_attention_dim 64, pooled_projection_dim 48\n");
    ck_assert_int_eq(ctl_run(out, NULL, "warmup", "--target", fs.target, "--width", "64",
                             "--height", "32", "--steps", "2", NULL),
                     0);
    ck_assert_str_eq(out, "warmup: 12.5 ms: warmed 64x32, 2 steps\n");
}
END_TEST

START_TEST(test_fake_generate_png)
{
    char out[OUT_CAP], path[] = "/tmp/ditctl_test_XXXXXX.png";
    int fd = mkstemps(path, 4);
    close(fd);
    int rc = ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "a red fox",
                     "--prompt-2", "t5 fox", "--negative-prompt", "blurry", "--width", "64",
                     "--height", "48", "--steps", "6", "--guidance", "4.5", "--true-cfg", "2",
                     "--seed", "18446744073709551615", "--max-sequence-length", "77", "--priority",
                     "-3", "--request-id", "req-1", "--model", "demo", "--frames", "1", "--fps",
                     "12", "-o", path, NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    /* The request as the server saw it. */
    seen_request *l = &fs.last;
    ck_assert_str_eq(l->prompt, "a red fox");
    ck_assert_str_eq(l->prompt_2, "t5 fox");
    ck_assert_str_eq(l->negative, "blurry");
    ck_assert_str_eq(l->model, "demo");
    ck_assert_str_eq(l->request_id, "req-1");
    ck_assert_int_eq(l->width, 64);
    ck_assert_int_eq(l->height, 48);
    ck_assert_int_eq(l->steps, 6);
    ck_assert_int_eq(l->max_seq, 77);
    ck_assert_int_eq(l->priority, -3);
    /* The .png output asks for PNG; --frames and --fps travel as given. */
    ck_assert_int_eq(l->format, DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_PNG);
    ck_assert_int_eq(l->frames, 1);
    ck_assert_int_eq(l->fps, 12);
    ck_assert(l->has_guidance && l->guidance == 4.5f);
    ck_assert(l->has_cfg && l->cfg == 2.0f);
    ck_assert(l->has_seed && l->seed == UINT64_MAX);
    /* The output (not a terminal: plain progress lines). */
    HAS(out, "queued: 1 ahead (queue depth 2)\n");
    HAS(out, "queued: 0 ahead (queue depth 1)\n");
    HAS(out, "started after 5.0 ms in the queue\n");
    HAS(out, "step 6/6");
    HAS(out, "wrote ");
    HAS(out, "(10000 bytes, PNG)\n");
    HAS(out, "request: req-1\n");
    HAS(out, "seed: 18446744073709551615\n");
    HAS(out, "size: 64x48\n");
    HAS(out, "time: queue 5.0 ms, tokenize 1.0 ms, text encoders 2.0 ms, denoising 20.0 ms (4.5 "
             "to 5.5 ms per step), VAE decode 3.0 ms, PNG 1.0 ms, server total 40.0 ms\n");
    HAS(out, "latency: ");
    HASNT(out, "\r");
    /* The bytes. */
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    uint8_t buf[FAKE_PNG_SIZE + 1];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    ck_assert_uint_eq(n, FAKE_PNG_SIZE);
    for (size_t i = 0; i < n; i++)
        ck_assert_uint_eq(buf[i], fake_png_byte(i));
    struct stat sb;
    stat(path, &sb);
    ck_assert_int_ne(sb.st_mode & 0044, 0); /* not mkstemp's 0600 */

    /* --quiet: nothing on success; defaults leave the wrappers unset. */
    rc = ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "", "-q", "-o", path,
                 NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    ck_assert_str_eq(out, "");
    ck_assert_str_eq(fs.last.prompt, "");
    ck_assert(!fs.last.has_guidance && !fs.last.has_cfg && !fs.last.has_seed);
    ck_assert_int_eq(fs.last.width, 0);
    unlink(path);
}
END_TEST

START_TEST(test_fake_generate_raw)
{
    char out[OUT_CAP], path[] = "/tmp/ditctl_test_XXXXXX.safetensors";
    int fd = mkstemps(path, 12);
    close(fd);
    int rc = ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "p", "--raw",
                     "--width", "32", "--height", "16", "--seed", "7", "-o", path, NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    ck_assert_int_eq(fs.last.format, DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR);
    HAS(out, "safetensors, tensor 'image'");
    HAS(out, "seed: 7\n");
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_st_file *f = NULL;
    ck_assert_msg(dit_st_file_open(path, &f, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
    const dit_st_entry *e = dit_st_file_find(f, "image");
    ck_assert_ptr_nonnull(e);
    ck_assert_int_eq(e->view.dtype, DIT_F32);
    ck_assert_int_eq(e->view.ndim, 3);
    ck_assert_int_eq(e->view.ne[0], 3);
    ck_assert_int_eq(e->view.ne[1], 16);
    ck_assert_int_eq(e->view.ne[2], 32);
    for (int c = 0; c < 3; c++)
        for (int y = 0; y < 16; y++)
            for (int x = 0; x < 32; x++) {
                float v;
                memcpy(&v, (const uint8_t *)e->view.data + 4 * ((c * 16 + y) * 32 + x), 4);
                ck_assert_float_eq(v, fake_raw_value(c, y, x, 32));
            }
    ck_assert_str_eq(dit_st_file_metadata(f, "seed"), "7");
    dit_st_file_close(f);
    unlink(path);
}
END_TEST

START_TEST(test_fake_generate_errors)
{
    char out[OUT_CAP];
    const char *png = "/tmp/ditctl_test_err.png";
    unlink(png);
    int rc = ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "invalid", "--width",
                     "17", "-o", png, NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "ditctl: INVALID_ARGUMENT: width must be a multiple of 16, got 17\n");
    /* A gap between chunks, a size that disagrees, no Result: DATA_LOSS. */
    rc = ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "gap", "-o", png, NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "ditctl: DATA_LOSS: client: result chunk at offset 4196, expected 4096\n");
    rc =
        ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "short", "-o", png, NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "ditctl: DATA_LOSS: client: Result announces 10001 bytes, 10000 arrived\n");
    /* Image sizes from a hostile server: negative, or more than arrived. */
    rc = ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "negsize", "-o", png,
                 NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "ditctl: DATA_LOSS: client: the Result's image 1 has -1 bytes\n");
    rc = ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "oversize", "-o", png,
                 NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "ditctl: DATA_LOSS: client: the Result's 2 images come to 10001 bytes, 10000 "
             "arrived\n");
    rc = ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "noresult", "-o", png,
                 NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "ditctl: DATA_LOSS: client: the stream ended OK without a Result\n");
    ck_assert_int_eq(access(png, F_OK), -1);
    /* An output that cannot be written: refused before the request is sent. */
    const int calls = atomic_load(&fs.generate_calls);
    rc = ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "p", "-o",
                 "/nonexistent/dir/x.png", NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "ditctl: cannot write /nonexistent/dir/x.png: the folder /nonexistent/dir does not "
             "exist\n");
    rc = ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "p", "-o", "/tmp", NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "ditctl: cannot write /tmp: it is a folder\n");
    ck_assert_int_eq(atomic_load(&fs.generate_calls), calls);
    /* The deadline passes mid-stream. */
    double secs;
    rc = ctl_run(out, &secs, "--target", fs.target, "--timeout", "0.5", "generate", "--prompt",
                 "slow", "-o", png, NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "ditctl: DEADLINE_EXCEEDED: ");
    ck_assert_msg(secs < 3.0, "took %.2f s", secs);
    ck_assert_int_eq(access(png, F_OK), -1);
}
END_TEST

START_TEST(test_fake_token)
{
    char out[OUT_CAP];
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "info", NULL), 1);
    HAS(out, "ditctl: UNAUTHENTICATED: missing or wrong bearer token\n");
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "info", "--token", "wrong", NULL),
                     1);
    HAS(out, "UNAUTHENTICATED");
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "info", "--token", "s3cret", NULL),
                     0);
    HAS(out, "version: 9.9.9-fake");
    setenv("DITCTL_TOKEN", "s3cret", 1);
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "models", NULL), 0);
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "p", "-q",
                             "-o", "/tmp/ditctl_test_token.png", NULL),
                     0);
    unlink("/tmp/ditctl_test_token.png");
    /* The flag wins over the environment. */
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "--token", "x", "models", NULL), 1);
    unsetenv("DITCTL_TOKEN");
    /* Health needs none. */
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "health", NULL), 0);
}
END_TEST

/* Ctrl-C during a generation cancels the call; the server sees the client
 * go away; ditctl reports CANCELLED. */
START_TEST(test_fake_sigint)
{
    char path[] = "/tmp/ditctl_sigint_XXXXXX";
    int fd = mkstemp(path);
    char *argv[] = {(char *)ditctl_path(),
                    (char *)"--target",
                    fs.target,
                    (char *)"generate",
                    (char *)"--prompt",
                    (char *)"slow",
                    (char *)"-o",
                    (char *)"/tmp/ditctl_sigint.png",
                    NULL};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, fd, 1);
    posix_spawn_file_actions_adddup2(&fa, fd, 2);
    pid_t pid;
    ck_assert_int_eq(posix_spawn(&pid, argv[0], &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    /* Wait until the stream is under way. */
    for (int i = 0; i < 100 && atomic_load(&fs.generate_calls) == 0; i++)
        sleep_ms(20);
    sleep_ms(300);
    /* Ctrl-C, and a SIGTERM (e.g. from a supervisor), in turn. */
    const int sig = _i == 0 ? SIGINT : SIGTERM;
    double t0 = now_s();
    kill(pid, sig);
    int status;
    waitpid(pid, &status, 0);
    double secs = now_s() - t0;
    char out[OUT_CAP];
    lseek(fd, 0, SEEK_SET);
    ssize_t n = read(fd, out, sizeof out - 1);
    out[n > 0 ? n : 0] = '\0';
    close(fd);
    unlink(path);
    /* 128 + the signal (130 for SIGINT): interrupted, as shells report it. */
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 128 + sig, "status %d:\n%s", status,
                  out);
    HAS(out, "ditctl: CANCELLED: ");
    ck_assert_msg(secs < 1.5, "took %.2f s to stop", secs);
    for (int i = 0; i < 100 && atomic_load(&fs.client_gone) == 0; i++)
        sleep_ms(20);
    ck_assert_int_eq(atomic_load(&fs.client_gone), 1);
    ck_assert_int_eq(access("/tmp/ditctl_sigint.png", F_OK), -1);
}
END_TEST

START_TEST(test_fake_bench)
{
    char out[OUT_CAP];
    int rc = ctl_run(out, NULL, "--target", fs.target, "bench", "-n", "9", "-c", "3", "--prompt",
                     "p", "--steps", "2", "--request-id", "b", NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    ck_assert_int_eq(atomic_load(&fs.generate_calls), 9);
    HAS(out, "requests: 9 sent of 9, concurrency 3, wall ");
    HAS(out, "throughput: ");
    HAS(out, "status: OK 9\n");
    HAS(out, "latency ms (OK requests): mean ");
    HAS(out, " p50 ");
    HAS(out, " p90 ");
    HAS(out, " p99 ");
    HAS(out, "server ms (mean of 9): queue 5.0  tokenize 1.0  text_encode 2.0  denoise 20.0  "
             "vae 3.0  encode 1.0  total 40.0\n");
    HAS(out, "worker compute ms (tokenize+text_encode+denoise+vae+encode+batch_others): mean 27.0  "
             "p50 27.0\n");
    HAS(out, "daemon overhead ms (latency - worker compute): mean ");
    HAS(out, "without the queue wait");
    /* Request ids are numbered. */
    ck_assert_msg(strncmp(fs.last.request_id, "b-", 2) == 0, "%s", fs.last.request_id);

    /* Failures are counted by status; the exit status says some failed. */
    rc = ctl_run(out, NULL, "--target", fs.target, "bench", "-n", "6", "-c", "2", "--prompt",
                 "flaky", "--quiet", NULL);
    ck_assert_msg(rc == 1, "exit %d:\n%s", rc, out);
    HAS(out, "status: OK 3, RESOURCE_EXHAUSTED 3\n");
    HAS(out, "RESOURCE_EXHAUSTED, e.g.: queue is full (1 waiting)\n");
}
END_TEST

/* Counts the rows of bench's closing table whose first two columns are
 * concurrency c and requests n, and checks the table's header is there. */
static int table_rows(const char *out, long c, long n)
{
    const char *t = strstr(out, "\nper concurrency level (ms; ");
    if (!t)
        return -1;
    t = strstr(t, "concurrency requests");
    if (!t)
        return -1;
    int rows = 0;
    for (const char *line = strchr(t, '\n'); line && line[1]; line = strchr(line + 1, '\n')) {
        long lc, ln;
        if (sscanf(line + 1, "%ld %ld", &lc, &ln) == 2 && lc == c && ln == n)
            rows++;
    }
    return rows;
}

/* -c 1,2: the same n requests at each level in turn, one report per level
 * and one table row per level with the right counts. */
START_TEST(test_fake_bench_levels)
{
    char out[OUT_CAP];
    const int before = atomic_load(&fs.generate_calls);
    int rc = ctl_run(out, NULL, "--target", fs.target, "bench", "-n", "4", "-c", "1,2", "--prompt",
                     "p", "--steps", "2", "--request-id", "lv", NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    ck_assert_int_eq(atomic_load(&fs.generate_calls) - before, 8);
    HAS(out, "== concurrency 1 ==\nrequests: 4 sent of 4, concurrency 1, wall ");
    HAS(out, "== concurrency 2 ==\nrequests: 4 sent of 4, concurrency 2, wall ");
    HAS(out, "concurrency requests     ok failed     req/s      p50      p90      p99      max  "
             "ovh_mean   ovh_p50\n");
    ck_assert_msg(table_rows(out, 1, 4) == 1, "%s", out);
    ck_assert_msg(table_rows(out, 2, 4) == 1, "%s", out);
    /* Each row: 4 ok, 0 failed. */
    const char *t = strstr(out, "ovh_p50\n");
    ck_assert_ptr_nonnull(t);
    long c, n, ok, failed;
    ck_assert_int_eq(sscanf(t + 8, "%ld %ld %ld %ld", &c, &n, &ok, &failed), 4);
    ck_assert(c == 1 && n == 4 && ok == 4 && failed == 0);
    t = strchr(t + 8, '\n');
    ck_assert_int_eq(sscanf(t + 1, "%ld %ld %ld %ld", &c, &n, &ok, &failed), 4);
    ck_assert(c == 2 && n == 4 && ok == 4 && failed == 0);
    /* With several levels the request ids say the level. */
    ck_assert_msg(strncmp(fs.last.request_id, "lv-c2-", 6) == 0, "%s", fs.last.request_id);

    /* A single level keeps the plain report and gets one row. */
    rc = ctl_run(out, NULL, "--target", fs.target, "bench", "-n", "3", "-c", "2", "--prompt", "p",
                 "--quiet", NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    ck_assert_ptr_null(strstr(out, "== concurrency"));
    ck_assert_msg(table_rows(out, 2, 3) == 1, "%s", out);

    /* Failures show in the row's counts and the exit status. */
    rc = ctl_run(out, NULL, "--target", fs.target, "bench", "-n", "6", "-c", "2,3", "--prompt",
                 "flaky", "--quiet", NULL);
    ck_assert_msg(rc == 1, "exit %d:\n%s", rc, out);
    ck_assert_msg(table_rows(out, 2, 6) == 1 && table_rows(out, 3, 6) == 1, "%s", out);
}
END_TEST

/* ======================================================================== */
/* library: dit_client in this process */

typedef struct trace {
    char log[4096];
    size_t len;
    int cancel_at_step;
} trace;

__attribute__((format(printf, 2, 3))) static void trace_add(trace *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->log + t->len, sizeof t->log - t->len, fmt, ap);
    va_end(ap);
    if (n > 0 && t->len + (size_t)n < sizeof t->log)
        t->len += (size_t)n;
}

static int tr_queued(void *u, const char *rid, int pos, int depth)
{
    trace_add(u, "Q%d/%d(%s) ", pos, depth, rid);
    return 0;
}

static int tr_started(void *u, const char *rid, double q)
{
    (void)rid;
    trace_add(u, "S%.0f ", q);
    return 0;
}

static int tr_progress(void *u, const char *rid, int step, int total, double ms)
{
    trace *t = u;
    (void)rid;
    (void)ms;
    trace_add(t, "P%d/%d ", step, total);
    return t->cancel_at_step && step == t->cancel_at_step;
}

static int tr_chunk(void *u, const char *rid, size_t got)
{
    (void)rid;
    trace_add(u, "C%zu ", got);
    return 0;
}

static int tr_result(void *u, const char *rid, const Ditserve__V1__Result *r, const uint8_t *d,
                     size_t n)
{
    (void)rid;
    trace_add(u, "R%lld:%zu:%d", (long long)r->total_bytes, n, d[0]);
    return 0;
}

static const dit_gen_callbacks tr_callbacks = {
    .queued = tr_queued,
    .started = tr_started,
    .progress = tr_progress,
    .chunk = tr_chunk,
    .result = tr_result,
};

START_TEST(test_lib_events_in_order)
{
    dit_client_opts o = {.target = fs.target, .timeout_s = 10};
    dit_client *c;
    dit_rpc_status st;
    ck_assert_int_eq(dit_client_open(&o, &c, &st), DIT_RPC_OK);
    ck_assert_str_eq(dit_client_target(c), fs.target);
    Ditserve__V1__GenerateRequest rq = DITSERVE__V1__GENERATE_REQUEST__INIT;
    rq.prompt = (char *)"p";
    rq.num_inference_steps = 3;
    trace t = {.len = 0};
    dit_gen_callbacks cb = tr_callbacks;
    cb.user = &t;
    dit_gen_output out;
    ck_assert_int_eq(dit_client_generate(c, &rq, &cb, NULL, &out, &st), DIT_RPC_OK);
    ck_assert_str_eq(t.log, "Q1/2(fake-request) Q0/1(fake-request) S5 P1/3 P2/3 P3/3 C4096 "
                            "C8192 C10000 R10000:10000:3");
    ck_assert_str_eq(out.request_id, "fake-request");
    ck_assert_uint_eq(out.size, FAKE_PNG_SIZE);
    ck_assert_uint_eq(out.data[9999], fake_png_byte(9999));
    ck_assert_int_eq(out.result->seed, 12345);
    ck_assert(out.latency_ms > 0);
    dit_gen_output_free(&out);

    /* A callback that returns nonzero cancels. */
    t = (trace){.cancel_at_step = 2};
    ck_assert_int_eq(dit_client_generate(c, &rq, &cb, NULL, &out, &st), DIT_RPC_CANCELLED);
    ck_assert_str_eq(st.details, "client: cancelled by the caller");
    ck_assert_ptr_null(out.result);
    dit_gen_output_free(&out);
    ck_assert_str_eq(dit_rpc_code_name(st.code), "CANCELLED");

    /* Health and the unary calls through the same client. */
    dit_health h;
    ck_assert_int_eq(dit_client_health(c, NULL, NULL, &h, &st), DIT_RPC_OK);
    ck_assert_int_eq(h, DIT_HEALTH_SERVING);
    ck_assert_int_eq(dit_client_warmup(c, NULL, 0, 0, 0, 0, NULL, NULL, &st), DIT_RPC_OK);
    dit_client_close(c);
}
END_TEST

typedef struct canceller {
    atomic_int *flag;
    int after_ms;
} canceller;

static void *cancel_later(void *arg)
{
    canceller *k = arg;
    sleep_ms(k->after_ms);
    atomic_store(k->flag, 1);
    return NULL;
}

START_TEST(test_lib_cancel_flag)
{
    dit_client *c;
    dit_rpc_status st;
    dit_client_opts o = {.target = fs.target};
    ck_assert_int_eq(dit_client_open(&o, &c, &st), DIT_RPC_OK);
    Ditserve__V1__GenerateRequest rq = DITSERVE__V1__GENERATE_REQUEST__INIT;
    rq.prompt = (char *)"slow";
    atomic_int flag = 0;
    canceller k = {.flag = &flag, .after_ms = 300};
    pthread_t th;
    pthread_create(&th, NULL, cancel_later, &k);
    dit_call_opts co = {.cancel = &flag};
    double t0 = now_s();
    ck_assert_int_eq(dit_client_generate(c, &rq, NULL, &co, NULL, &st), DIT_RPC_CANCELLED);
    double secs = now_s() - t0;
    pthread_join(th, NULL);
    ck_assert_msg(secs < 1.0, "took %.2f s", secs);
    /* A per-call deadline overrides the client's none. */
    co = (dit_call_opts){.timeout_s = 0.3};
    ck_assert_int_eq(dit_client_generate(c, &rq, NULL, &co, NULL, &st), DIT_RPC_DEADLINE_EXCEEDED);
    dit_client_close(c);
}
END_TEST

typedef struct worker_arg {
    dit_client *c;
    int ok;
} worker_arg;

static void *lib_worker(void *arg)
{
    worker_arg *w = arg;
    Ditserve__V1__GenerateRequest rq = DITSERVE__V1__GENERATE_REQUEST__INIT;
    rq.prompt = (char *)"p";
    rq.num_inference_steps = 2;
    for (int i = 0; i < 3; i++) {
        dit_gen_output out;
        dit_rpc_status st;
        if (dit_client_generate(w->c, &rq, NULL, NULL, &out, &st) == DIT_RPC_OK &&
            out.size == FAKE_PNG_SIZE)
            w->ok++;
        dit_gen_output_free(&out);
    }
    return NULL;
}

/* More threads than a shared pluck queue would allow (6). */
START_TEST(test_lib_threads)
{
    dit_client *c;
    dit_rpc_status st;
    dit_client_opts o = {.target = fs.target, .timeout_s = 30};
    ck_assert_int_eq(dit_client_open(&o, &c, &st), DIT_RPC_OK);
    enum { N = 8 };
    pthread_t th[N];
    worker_arg w[N];
    for (int i = 0; i < N; i++) {
        w[i] = (worker_arg){.c = c};
        pthread_create(&th[i], NULL, lib_worker, &w[i]);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(w[i].ok, 3);
    }
    ck_assert_int_eq(atomic_load(&fs.generate_calls), 3 * N);
    dit_client_close(c);
}
END_TEST

START_TEST(test_lib_open_errors)
{
    dit_client *c = (dit_client *)1;
    dit_rpc_status st;
    dit_client_opts o = {.target = ""};
    ck_assert_int_eq(dit_client_open(&o, &c, &st), DIT_RPC_INVALID_ARGUMENT);
    ck_assert_ptr_null(c);
    o = (dit_client_opts){.cert_file = "/x"};
    ck_assert_int_eq(dit_client_open(&o, &c, &st), DIT_RPC_INVALID_ARGUMENT);
    o = (dit_client_opts){.token = "a\nb"};
    ck_assert_int_eq(dit_client_open(&o, &c, &st), DIT_RPC_INVALID_ARGUMENT);
    o = (dit_client_opts){.timeout_s = -1};
    ck_assert_int_eq(dit_client_open(&o, &c, &st), DIT_RPC_INVALID_ARGUMENT);
    /* Names of every code, and of numbers outside the table. */
    ck_assert_str_eq(dit_rpc_code_name(0), "OK");
    ck_assert_str_eq(dit_rpc_code_name(4), "DEADLINE_EXCEEDED");
    ck_assert_str_eq(dit_rpc_code_name(8), "RESOURCE_EXHAUSTED");
    ck_assert_str_eq(dit_rpc_code_name(12), "UNIMPLEMENTED");
    ck_assert_str_eq(dit_rpc_code_name(14), "UNAVAILABLE");
    ck_assert_str_eq(dit_rpc_code_name(16), "UNAUTHENTICATED");
    ck_assert_str_eq(dit_rpc_code_name(99), "UNKNOWN");
    ck_assert_str_eq(dit_health_name(DIT_HEALTH_NOT_SERVING), "NOT_SERVING");
}
END_TEST

/* ======================================================================== */
/* tls: certificates made with openssl at run time */

static char tls_dir[] = "/tmp/ditctl_tls_XXXXXX";
static bool tls_ready;

static void tls_setup(void)
{
    tls_ready = false;
    if (access("/usr/bin/openssl", X_OK) != 0) {
        fprintf(stderr, "openssl not found: the TLS tests only check that they are skipped\n");
        return;
    }
    ck_assert_ptr_nonnull(mkdtemp(tls_dir));
    char script[4096];
    snprintf(script, sizeof script,
             "set -e; cd %s; K='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'\n"
             "openssl req -x509 $K -keyout ca.key -out ca.pem -days 2 -subj /CN=ditctl-test-ca\n"
             "openssl req $K -keyout server.key -out server.csr -subj /CN=localhost\n"
             "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > san.ext\n"
             "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "-out server.pem -days 2 -extfile san.ext\n"
             "openssl req $K -keyout client.key -out client.csr -subj /CN=ditctl-client\n"
             "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "-out client.pem -days 2\n"
             "openssl req -x509 $K -keyout other.key -out other.pem -days 2 -subj /CN=other-ca\n",
             tls_dir);
    char *argv[] = {(char *)"/bin/sh", (char *)"-c", script, NULL};
    char out[OUT_CAP];
    int rc = test_run(argv, NULL, out, sizeof out, NULL);
    ck_assert_msg(rc == 0, "making certificates failed:\n%s", out);
    fake_start_tls(NULL, tls_dir);
    tls_ready = true;
}

static void tls_teardown(void)
{
    if (tls_ready)
        fake_teardown();
    if (tls_dir[strlen(tls_dir) - 1] != 'X') {
        char cmd[4200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tls_dir);
        if (system(cmd) != 0)
            fprintf(stderr, "cannot remove %s\n", tls_dir);
    }
}

START_TEST(test_tls)
{
    if (!tls_ready)
        return;
    char out[OUT_CAP], ca[4200], cert[4200], key[4200], other[4200];
    snprintf(ca, sizeof ca, "%s/ca.pem", tls_dir);
    snprintf(cert, sizeof cert, "%s/client.pem", tls_dir);
    snprintf(key, sizeof key, "%s/client.key", tls_dir);
    snprintf(other, sizeof other, "%s/other.pem", tls_dir);
    /* Mutual TLS: our CA verifies the server, the client certificate the
     * client. */
    int rc = ctl_run(out, NULL, "--target", fs.target, "--ca", ca, "--cert", cert, "--key", key,
                     "info", NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    HAS(out, "version: 9.9.9-fake");
    rc = ctl_run(out, NULL, "--target", fs.target, "--ca", ca, "--cert", cert, "--key", key,
                 "generate", "--prompt", "p", "-q", "-o", "/tmp/ditctl_tls.png", NULL);
    ck_assert_msg(rc == 0, "exit %d:\n%s", rc, out);
    unlink("/tmp/ditctl_tls.png");
    /* Without a client certificate, with the wrong CA, or in plaintext, the
     * handshake fails: UNAVAILABLE. */
    const char *bad[][8] = {
        {"--ca", ca, "info", NULL},
        {"--ca", other, "--cert", cert, "--key", key, "info", NULL},
        {"info", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *argv[16];
        int n = 0;
        argv[n++] = (char *)ditctl_path();
        argv[n++] = (char *)"--target";
        argv[n++] = fs.target;
        argv[n++] = (char *)"--timeout";
        argv[n++] = (char *)"5";
        for (int j = 0; bad[i][j]; j++)
            argv[n++] = (char *)bad[i][j];
        argv[n] = NULL;
        double secs;
        rc = test_run(argv, NULL, out, sizeof out, &secs);
        ck_assert_msg(rc == 1, "case %zu: exit %d:\n%s", i, rc, out);
        HAS(out, "ditctl: UNAVAILABLE: ");
        ck_assert_msg(secs < 5.0, "case %zu took %.2f s", i, secs);
    }
    /* Files that are not PEM of the right kind fail before connecting. */
    rc = ctl_run(out, NULL, "--target", fs.target, "--ca", key, "info", NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "holds no PEM '-----BEGIN CERTIFICATE-----' block");
    rc = ctl_run(out, NULL, "--target", fs.target, "--ca", ca, "--cert", cert, "--key", cert,
                 "info", NULL);
    ck_assert_int_eq(rc, 1);
    HAS(out, "holds no PEM 'PRIVATE KEY-----' block");
}
END_TEST

/* ======================================================================== */
/* first use: what a new user runs into */

START_TEST(test_first_use_default_port)
{
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"localhost", "localhost:50051"},
        {"localhost:7000", "localhost:7000"},
        {"10.0.0.5", "10.0.0.5:50051"},
        {"::1", "[::1]:50051"},
        {"[::1]", "[::1]:50051"},
        {"[::1]:7000", "[::1]:7000"},
        {"dns:///svc.ns", "dns:///svc.ns:50051"},
        {"dns://8.8.8.8/svc", "dns://8.8.8.8/svc:50051"},
        {"dns:///svc:80", "dns:///svc:80"},
        {"unix:/run/ditd.sock", "unix:/run/ditd.sock"},
        {"ipv4:10.0.0.1:1,10.0.0.2:2", "ipv4:10.0.0.1:1,10.0.0.2:2"},
    };
    char buf[256];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ck_assert(dit_client_target_with_port(cases[i].in, buf, sizeof buf));
        ck_assert_str_eq(buf, cases[i].want);
    }
    ck_assert(!dit_client_target_with_port("localhost", buf, 8));
    /* ditctl dials 50051, not gRPC's 443, for a host alone. */
    char out[OUT_CAP];
    int rc = ctl_run(out, NULL, "--target", "127.0.0.1", "--timeout", "3", "health", NULL);
    if (rc != 0) { /* nobody serves ditd's port here, as expected */
        HAS(out, "127.0.0.1:50051");
        HASNT(out, ":443");
    }
    ck_assert_int_eq(ctl_run(out, NULL, "--help", NULL), 0);
    HAS(out, "a HOST alone means HOST:50051");
}
END_TEST

START_TEST(test_first_use_suggestions)
{
    static const struct {
        const char *args[6];
        const char *msg;
    } cases[] = {
        {{"generate", "--prompt", "p", "-o", "x.png", "--widht"},
         "unknown option '--widht'; did you mean '--width'?"},
        {{"generate", "--prompt", "p", "-o", "x.png", "--negativ-prompt"},
         "did you mean '--negative-prompt'?"},
        {{"health", "--sevrice", "x"}, "did you mean '--service'?"},
        {{"--tagret", "x", "health"}, "unknown option '--tagret'; did you mean '--target'?"},
        {{"info", "--timeuot=3"}, "did you mean '--timeout'?"},
        {{"generat"}, "unknown command 'generat'; did you mean 'generate'?"},
        {{"help", "modles"}, "did you mean 'models'?"},
    };
    char out[OUT_CAP];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *argv[10];
        int n = 0;
        argv[n++] = (char *)ditctl_path();
        for (int j = 0; j < 6 && cases[i].args[j]; j++)
            argv[n++] = (char *)cases[i].args[j];
        argv[n] = NULL;
        ck_assert_int_eq(test_run(argv, NULL, out, sizeof out, NULL), 2);
        HAS(out, cases[i].msg);
    }
    /* Far from every option: no guess. */
    ck_assert_int_eq(ctl_run(out, NULL, "info", "--frobnicate", NULL), 2);
    HAS(out, "unknown option '--frobnicate'\n");
}
END_TEST

START_TEST(test_first_use_cfg_warnings)
{
    char out[OUT_CAP], path[] = "/tmp/ditctl_warn_XXXXXX.png";
    close(mkstemps(path, 4));
    /* A negative prompt alone: whether it does anything is the model's
     * matter (Wan's CFG uses it), so the daemon's warning speaks. */
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "p",
                             "--negative-prompt", "blurry", "-o", path, NULL),
                     0);
    HASNT(out, "ditctl: warning:");
    /* With --true-cfg at 1 or below it does nothing. */
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "p",
                             "--negative-prompt", "blurry", "--true-cfg", "1", "-o", path, NULL),
                     0);
    HAS(out, "--negative-prompt has no effect");
    /* Nor does --true-cfg without a negative prompt. */
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "p",
                             "--true-cfg", "4", "-o", path, NULL),
                     0);
    HAS(out, "ditctl: warning: --true-cfg 4 has no effect without --negative-prompt");
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "bench", "-n", "1", "--prompt", "p",
                             "--true-cfg", "4", NULL),
                     0);
    HAS(out, "--true-cfg 4 has no effect");
    /* Both: true CFG runs, nothing to say. --quiet says nothing either way. */
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "p",
                             "--negative-prompt", "blurry", "--true-cfg", "4", "-o", path, NULL),
                     0);
    HASNT(out, "warning");
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "p",
                             "--true-cfg", "4", "-q", "-o", path, NULL),
                     0);
    ck_assert_str_eq(out, "");
    /* The daemon's own warnings (Result.warnings) are shown. */
    ck_assert_int_eq(
        ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "warn", "-o", path, NULL),
        0);
    HAS(out, "ditctl: warning from the daemon: negative_prompt has no effect (fake)\n");
    unlink(path);
}
END_TEST

START_TEST(test_first_use_progress_rate_and_decode)
{
    char out[OUT_CAP], path[] = "/tmp/ditctl_rate_XXXXXX.png";
    close(mkstemps(path, 4));
    /* The fake reports step i at 5 i ms: 200 steps/s. */
    ck_assert_int_eq(ctl_run(out, NULL, "--target", fs.target, "generate", "--prompt", "p",
                             "--steps", "10", "-o", path, NULL),
                     0);
    HAS(out, "step 5/10  0.0 s  200.00 steps/s, ETA 0.0 s\n");
    HAS(out, "step 10/10  0.1 s  200.00 steps/s, ETA 0.0 s\n");
    HAS(out, "decoding (VAE) after 0.1 s of denoising\n");
    unlink(path);
}
END_TEST

static Suite *ditctl_suite(void)
{
    Suite *s = suite_create("ditctl");
    TCase *cli = tcase_create("cli");
    tcase_add_test(cli, test_main_help);
    tcase_add_test(cli, test_command_help);
    tcase_add_test(cli, test_usage_errors);
    tcase_add_test(cli, test_closed_port);
    tcase_add_test(cli, test_silent_peer_deadline);
    tcase_add_test(cli, test_unreadable_pem);
    tcase_add_test(cli, test_lib_open_errors);
    suite_add_tcase(s, cli);

    TCase *fake = tcase_create("fake");
    tcase_add_checked_fixture(fake, fake_setup, fake_teardown);
    tcase_add_test(fake, test_fake_health);
    tcase_add_test(fake, test_fake_info_models_warmup);
    tcase_add_test(fake, test_fake_generate_png);
    tcase_add_test(fake, test_fake_generate_raw);
    tcase_add_test(fake, test_fake_generate_errors);
    tcase_add_loop_test(fake, test_fake_sigint, 0, 2);
    tcase_add_test(fake, test_fake_bench);
    tcase_add_test(fake, test_fake_bench_levels);
    tcase_add_test(fake, test_lib_events_in_order);
    tcase_add_test(fake, test_lib_cancel_flag);
    tcase_add_test(fake, test_lib_threads);
    suite_add_tcase(s, fake);

    TCase *first = tcase_create("first_use");
    tcase_add_checked_fixture(first, fake_setup, fake_teardown);
    tcase_add_test(first, test_first_use_default_port);
    tcase_add_test(first, test_first_use_suggestions);
    tcase_add_test(first, test_first_use_cfg_warnings);
    tcase_add_test(first, test_first_use_progress_rate_and_decode);
    suite_add_tcase(s, first);

    TCase *tok = tcase_create("token");
    tcase_add_checked_fixture(tok, fake_setup_token, fake_teardown);
    tcase_add_test(tok, test_fake_token);
    suite_add_tcase(s, tok);

    TCase *tls = tcase_create("tls");
    tcase_add_checked_fixture(tls, tls_setup, tls_teardown);
    tcase_add_test(tls, test_tls);
    suite_add_tcase(s, tls);
    return s;
}

int main(int argc, char **argv)
{
    /* For trying ditctl by hand (a terminal's progress bar, say):
     * `test_ditctl_cli --serve [TOKEN]` prints the fake's target and serves
     * until killed; with DITCTL_FAKE_TLS_DIR set, over mutual TLS. */
    if (argc >= 2 && strcmp(argv[1], "--serve") == 0) {
        fake_start_tls(argc >= 3 && argv[2][0] ? argv[2] : NULL, getenv("DITCTL_FAKE_TLS_DIR"));
        printf("%s\n", fs.target);
        fflush(stdout);
        for (;;)
            pause();
    }
    SRunner *sr = srunner_create(ditctl_suite());
    srunner_run_all(sr, CK_ENV); /* CK_VERBOSITY picks the output; normal by default */
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
