/* ditrun: runs the worker's compute code without the daemon.
 *
 *   ditrun forward --model DIR --inputs IN.safetensors --output OUT.safetensors
 *
 * It is the tool for tests, benchmarks and debugging: the same model code the
 * daemon's workers run, driven from files. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "core/arena.h"
#include "loader/safetensors.h"
#include "model/flux.h"

#define EXIT_USAGE 2

static const char *const forward_usage =
    "usage: ditrun forward --model DIR --inputs IN.safetensors --output OUT.safetensors\n"
    "                      [--backend cpu|cuda] [--threads N] [--repeat N]\n"
    "                      [--compare FILE] [--quiet]\n"
    "\n"
    "Runs one FluxTransformer2DModel forward pass, as diffusers' model(...) would.\n"
    "\n"
    "  --model DIR     a diffusers transformer folder: config.json and\n"
    "                  diffusion_pytorch_model.safetensors (or a sharded\n"
    "                  diffusion_pytorch_model.safetensors.index.json)\n"
    "  --inputs FILE   safetensors with the forward arguments, named as diffusers names\n"
    "                  them: hidden_states (B, S_img, in_channels),\n"
    "                  encoder_hidden_states (B, S_txt, joint_attention_dim),\n"
    "                  pooled_projections (B, pooled_projection_dim), timestep (B),\n"
    "                  img_ids (S_img, n_axes), txt_ids (S_txt, n_axes), and guidance (B)\n"
    "                  when the config has guidance_embeds. f32, bf16 or f16.\n"
    "  --output FILE   safetensors to write; it holds 'sample' (B, S_img, out_dim) f32\n"
    "  --backend NAME  cpu (default) or cuda\n"
    "  --threads N     cpu threads (default: all online cores)\n"
    "  --repeat N      run the forward N times and report the fastest (default 1)\n"
    "  --compare FILE  also compare 'sample' with the tensor of that name in FILE\n"
    "                  (e.g. diffusers' output) and print the difference\n"
    "  --quiet         print nothing on success\n"
    "\n"
    "Exit status: 0 on success, 1 when the model or inputs cannot be used, 2 on bad\n"
    "command-line arguments.\n";

static const char *const main_usage =
    "usage: ditrun <command> [options]\n"
    "\n"
    "Commands:\n"
    "  forward   one transformer forward pass from a safetensors file of inputs\n"
    "\n"
    "Options:\n"
    "  --help      show this help (ditrun <command> --help for a command's options)\n"
    "  --version   print the version and the backends built in\n";

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int usage_error(const char *usage, const char *fmt, const char *arg)
{
    fprintf(stderr, "ditrun: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n\n%s", usage);
    return EXIT_USAGE;
}

static bool parse_int(const char *s, long lo, long hi, long *out)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

typedef struct forward_args {
    const char *model, *inputs, *output, *compare;
    dit_backend_kind backend;
    int threads, repeat;
    bool quiet;
} forward_args;

/* Host copy of one input tensor as f32, with the expected rank checked. */
typedef struct host_input {
    float *data;
    dit_tensor view; /* over data, contiguous f32 */
} host_input;

static dit_status take_input(const dit_st_set *set, const char *file, const char *name,
                             bool required, int ndim_a, int ndim_b, host_input *out,
                             dit_diag *diag)
{
    memset(out, 0, sizeof *out);
    const dit_st_entry *e = dit_st_set_find(set, name);
    if (!e) {
        if (!required)
            return DIT_OK;
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is missing", file, name);
    }
    if (e->view.ndim != ndim_a && e->view.ndim != ndim_b) {
        char got[64];
        dit_tensor_shape_str(&e->view, got, sizeof got);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: input '%s' is %s; expected %d dims",
                            file, name, got, ndim_a);
    }
    size_t n = (size_t)dit_tensor_numel(&e->view);
    out->data = malloc((n ? n : 1) * sizeof(float));
    if (!out->data)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory reading '%s'", name);
    out->view = dit_tensor_make(out->data, DIT_F32, e->view.ndim, e->view.ne);
    dit_convert_to_f32(out->data, e->view.data, e->view.dtype, n);
    return DIT_OK;
}

static const char *const known_inputs[] = {
    "hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
    "img_ids",       "txt_ids",               "guidance",
};

static void print_stats(const char *name, const float *p, size_t n)
{
    double sum = 0, sq = 0;
    float mn = INFINITY, mx = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        sum += p[i];
        sq += (double)p[i] * p[i];
        mn = p[i] < mn ? p[i] : mn;
        mx = p[i] > mx ? p[i] : mx;
    }
    double mean = n ? sum / (double)n : 0, var = n ? sq / (double)n - mean * mean : 0;
    printf("%s: mean %.6f, std %.6f, min %.6f, max %.6f\n", name, mean, sqrt(var > 0 ? var : 0),
           mn, mx);
}

/* Prints max |ours - ref| and that relative to max |ref| for `sample`. */
static dit_status compare_sample(const char *path, const float *got, const dit_tensor *shape,
                                 dit_diag *diag)
{
    dit_st_file *f = NULL;
    dit_status st = dit_st_file_open(path, &f, diag);
    if (st != DIT_OK)
        return st;
    const dit_st_entry *e = dit_st_file_find(f, "sample");
    float *ref = NULL;
    if (!e || !dit_tensor_same_shape(&e->view, shape)) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: no 'sample' tensor of the output's shape",
                          path);
        goto cleanup;
    }
    size_t n = (size_t)dit_tensor_numel(shape);
    ref = malloc((n ? n : 1) * sizeof *ref);
    if (!ref) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    dit_convert_to_f32(ref, e->view.data, e->view.dtype, n);
    double max_abs = 0, max_ref = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        max_abs = d > max_abs || isnan(d) ? d : max_abs;
        max_ref = fabs(ref[i]) > max_ref ? fabs(ref[i]) : max_ref;
    }
    printf("compared with %s: max abs diff %.3g, relative to max |ref| %.3g\n", path, max_abs,
           max_ref > 0 ? max_abs / max_ref : max_abs);
cleanup:
    free(ref);
    dit_st_file_close(f);
    return st;
}

static int run_forward(const forward_args *a)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_status st = DIT_OK;
    dit_backend *be = NULL;
    dit_flux *model = NULL;
    dit_st_set *in_set = NULL;
    dit_arena *arena = NULL;
    host_input hs = {0}, ehs = {0}, pooled = {0}, ts = {0}, img = {0}, txt = {0}, gd = {0};
    float *out_host = NULL;
    void *dev_in = NULL, *dev_out = NULL;

    dit_backend_config bcfg = {.kind = a->backend, .n_threads = a->threads, .device = 0};
    DIT_CHECK(dit_backend_create(&bcfg, &be, &diag));
    double t0 = now_ms();
    DIT_CHECK(dit_flux_load(be, a->model, NULL, &model, &diag));
    double t_load = now_ms() - t0;
    const dit_flux_config *cfg = dit_flux_config_of(model);

    DIT_CHECK(dit_st_set_open_path(a->inputs, &in_set, &diag));
    for (size_t i = 0; i < dit_st_set_count(in_set); i++) {
        const char *name = dit_st_set_at(in_set, i)->name;
        bool known = false;
        for (size_t k = 0; k < sizeof known_inputs / sizeof *known_inputs; k++)
            known = known || strcmp(name, known_inputs[k]) == 0;
        if (!known) {
            st = dit_diag_set(&diag, DIT_ERR_INVALID_ARG,
                              "%s: unknown input '%s' (expected hidden_states, "
                              "encoder_hidden_states, pooled_projections, timestep, img_ids, "
                              "txt_ids, guidance)",
                              a->inputs, name);
            goto cleanup;
        }
    }
    DIT_CHECK(take_input(in_set, a->inputs, "hidden_states", true, 3, 3, &hs, &diag));
    DIT_CHECK(take_input(in_set, a->inputs, "encoder_hidden_states", true, 3, 3, &ehs, &diag));
    DIT_CHECK(take_input(in_set, a->inputs, "pooled_projections", true, 2, 2, &pooled, &diag));
    DIT_CHECK(take_input(in_set, a->inputs, "timestep", true, 1, 1, &ts, &diag));
    /* diffusers still accepts (B, S, n_axes) ids and uses batch 0 of them. */
    DIT_CHECK(take_input(in_set, a->inputs, "img_ids", true, 2, 3, &img, &diag));
    DIT_CHECK(take_input(in_set, a->inputs, "txt_ids", true, 2, 3, &txt, &diag));
    DIT_CHECK(take_input(in_set, a->inputs, "guidance", false, 1, 1, &gd, &diag));

    const int64_t B = hs.view.ne[0], Si = hs.view.ne[1], St = ehs.view.ne[1];
    const int64_t nax = cfg->n_axes;
    const host_input *ids[2] = {&img, &txt};
    const int64_t want_len[2] = {Si, St};
    const char *id_names[2] = {"img_ids", "txt_ids"};
    for (int i = 0; i < 2; i++) {
        const dit_tensor *v = &ids[i]->view;
        int64_t len = v->ne[v->ndim - 2], ax = v->ne[v->ndim - 1];
        if (len != want_len[i] || ax != nax) {
            char got[64];
            dit_tensor_shape_str(v, got, sizeof got);
            st = dit_diag_set(&diag, DIT_ERR_INVALID_ARG,
                              "%s: input '%s' is %s; expected (%lld, %lld) to match %s tokens "
                              "and the config's %lld rope axes",
                              a->inputs, id_names[i], got, (long long)want_len[i],
                              (long long)nax, i == 0 ? "hidden_states" : "encoder_hidden_states",
                              (long long)nax);
            goto cleanup;
        }
    }
    if (ts.view.ne[0] != B || (gd.data && gd.view.ne[0] != B)) {
        st = dit_diag_set(&diag, DIT_ERR_INVALID_ARG,
                          "%s: timestep and guidance need one value per batch entry (%lld)",
                          a->inputs, (long long)B);
        goto cleanup;
    }

    /* Big inputs go to the backend; ids and scalars stay on the host. */
    size_t n_hs = (size_t)dit_tensor_numel(&hs.view), n_ehs = (size_t)dit_tensor_numel(&ehs.view);
    size_t n_pool = (size_t)dit_tensor_numel(&pooled.view);
    size_t n_out = (size_t)(B * Si * cfg->out_dim);
    DIT_CHECK(dit_backend_alloc(be, (n_hs + n_ehs + n_pool) * sizeof(float), &dev_in));
    DIT_CHECK(dit_backend_alloc(be, n_out * sizeof(float), &dev_out));
    dit_flux_inputs in = {
        .hidden_states = dit_tensor_make(dev_in, DIT_F32, 3, hs.view.ne),
        .encoder_hidden_states =
            dit_tensor_make((float *)dev_in + n_hs, DIT_F32, 3, ehs.view.ne),
        .pooled_projections =
            dit_tensor_make((float *)dev_in + n_hs + n_ehs, DIT_F32, 2, pooled.view.ne),
        .timestep = ts.data,
        .guidance = gd.data,
        .img_ids = img.data,
        .txt_ids = txt.data,
    };
    DIT_CHECK(be->ops->upload(be, &in.hidden_states, &hs.view));
    DIT_CHECK(be->ops->upload(be, &in.encoder_hidden_states, &ehs.view));
    DIT_CHECK(be->ops->upload(be, &in.pooled_projections, &pooled.view));
    dit_tensor sample = dit_tensor_3d(dev_out, DIT_F32, B, Si, cfg->out_dim);

    DIT_CHECK(dit_arena_create(be, 0, &arena));
    double best = INFINITY;
    for (int r = 0; r < a->repeat; r++) {
        double t1 = now_ms();
        DIT_CHECK(dit_flux_forward(model, arena, &in, &sample, &diag));
        DIT_CHECK(be->ops->sync(be));
        double dt = now_ms() - t1;
        best = dt < best ? dt : best;
        dit_arena_reset(arena);
    }

    out_host = malloc((n_out ? n_out : 1) * sizeof(float));
    if (!out_host) {
        st = dit_diag_set(&diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    dit_tensor host_sample = dit_tensor_3d(out_host, DIT_F32, B, Si, cfg->out_dim);
    DIT_CHECK(be->ops->download(be, &host_sample, &sample));
    dit_st_write_item item = {.name = "sample", .tensor = &host_sample};
    DIT_CHECK(dit_st_write(a->output, &item, 1, &diag));

    if (!a->quiet) {
        double gflop = dit_flux_forward_flops(cfg, B, St, Si) / 1e9;
        printf("model: %s (%d double + %d single blocks, %d heads x %d, %.1f MiB of weights, "
               "loaded in %.0f ms)\n",
               a->model, cfg->num_layers, cfg->num_single_layers, cfg->num_attention_heads,
               cfg->attention_head_dim, (double)dit_flux_weight_bytes(model) / 1048576.0, t_load);
        printf("forward: batch %lld, %lld text + %lld image tokens, %s backend: %.2f ms "
               "(%.3f GFLOP, %.1f GFLOP/s)%s\n",
               (long long)B, (long long)St, (long long)Si, be->ops->name, best, gflop,
               gflop / (best / 1e3), a->repeat > 1 ? ", best of repeats" : "");
        printf("activation memory: %.2f MiB\n", (double)dit_arena_high_water(arena) / 1048576.0);
        printf("wrote %s: sample (%lld, %lld, %d) f32\n", a->output, (long long)B, (long long)Si,
               cfg->out_dim);
        print_stats("sample", out_host, n_out);
    }
    if (a->compare)
        DIT_CHECK(compare_sample(a->compare, out_host, &host_sample, &diag));

cleanup:
    if (st != DIT_OK)
        fprintf(stderr, "ditrun forward: %s\n", dit_diag_msg(&diag));
    free(out_host);
    free(hs.data);
    free(ehs.data);
    free(pooled.data);
    free(ts.data);
    free(img.data);
    free(txt.data);
    free(gd.data);
    dit_arena_destroy(arena);
    if (be) {
        dit_backend_free(be, dev_in);
        dit_backend_free(be, dev_out);
    }
    dit_st_set_close(in_set);
    dit_flux_destroy(model);
    dit_backend_destroy(be);
    return st == DIT_OK ? 0 : 1;
}

static int cmd_forward(int argc, char **argv)
{
    forward_args a = {.backend = DIT_BACKEND_CPU, .threads = 0, .repeat = 1};
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},   {"inputs", required_argument, NULL, 'i'},
        {"output", required_argument, NULL, 'o'},  {"backend", required_argument, NULL, 'b'},
        {"threads", required_argument, NULL, 't'}, {"repeat", required_argument, NULL, 'r'},
        {"quiet", no_argument, NULL, 'q'},         {"help", no_argument, NULL, 'h'},
        {"compare", required_argument, NULL, 'c'},
        {NULL, 0, NULL, 0},
    };
    long v;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":m:i:o:b:t:r:c:qh", opts, NULL)) != -1) {
        switch (c) {
        case 'm':
            a.model = optarg;
            break;
        case 'i':
            a.inputs = optarg;
            break;
        case 'o':
            a.output = optarg;
            break;
        case 'b':
            if (dit_backend_kind_parse(optarg, &a.backend) != DIT_OK)
                return usage_error(forward_usage, "unknown backend '%s' (cpu or cuda)", optarg);
            break;
        case 't':
            if (!parse_int(optarg, 1, 4096, &v))
                return usage_error(forward_usage, "--threads wants a number from 1 to 4096, not '%s'",
                                   optarg);
            a.threads = (int)v;
            break;
        case 'r':
            if (!parse_int(optarg, 1, 100000, &v))
                return usage_error(forward_usage, "--repeat wants a positive number, not '%s'",
                                   optarg);
            a.repeat = (int)v;
            break;
        case 'c':
            a.compare = optarg;
            break;
        case 'q':
            a.quiet = true;
            break;
        case 'h':
            fputs(forward_usage, stdout);
            return 0;
        case ':':
            return usage_error(forward_usage, "option %s needs a value", argv[optind - 1]);
        default:
            return usage_error(forward_usage, "unknown option '%s'", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return usage_error(forward_usage, "unexpected argument '%s'", argv[optind]);
    if (!a.model)
        return usage_error(forward_usage, "%s", "--model is required");
    if (!a.inputs)
        return usage_error(forward_usage, "%s", "--inputs is required");
    if (!a.output)
        return usage_error(forward_usage, "%s", "--output is required");
    return run_forward(&a);
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return usage_error(main_usage, "%s", "a command is required");
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        fputs(main_usage, stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("ditrun %s (backends: cpu%s)\n", DIT_VERSION,
               dit_backend_available(DIT_BACKEND_CUDA) ? ", cuda" : "");
        return 0;
    }
    if (strcmp(cmd, "forward") == 0)
        return cmd_forward(argc - 1, argv + 1);
    return usage_error(main_usage, "unknown command '%s'", cmd);
}
