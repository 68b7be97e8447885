/* ditrun: runs the worker's compute code without the daemon.
 *
 *   ditrun forward --model DIR --inputs IN.safetensors --output OUT.safetensors
 *                  [--world-size N --ring R --ulysses U --tp T ...]
 *
 * With --world-size N > 1 it creates a shared-memory mesh, starts N rank
 * processes of itself (the same code a daemon worker runs), and reports rank
 * 0's result; any failing rank fails the run with that rank's message. It is
 * the tool for tests, benchmarks and debugging. */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend/backend.h"
#include "comm/shm/comm_shm.h"
#include "loader/safetensors.h"
#include "model/flux.h"
#include "parallel/mesh.h"
#include "runtime/inputs.h"
#include "runtime/runner.h"

extern char **environ;

#define EXIT_USAGE 2

static const char *const forward_usage =
    "usage: ditrun forward --model DIR --inputs IN.safetensors --output OUT.safetensors\n"
    "                      [--backend cpu|cuda] [--threads N] [--repeat N]\n"
    "                      [--compare FILE] [--quiet]\n"
    "                      [--world-size N] [--ring R] [--ulysses U] [--tp T]\n"
    "                      [--ulysses-anything | --ring-anything | --unified-anything]\n"
    "                      [--no-fp32-merge] [--comm-timeout SECONDS]\n"
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
    "  --threads N     cpu threads per rank (default: online cores / world size)\n"
    "  --repeat N      run the forward N times and report the fastest (default 1)\n"
    "  --compare FILE  also compare 'sample' with the tensor of that name in FILE\n"
    "                  (e.g. diffusers' output) and print the difference\n"
    "  --quiet         print nothing on success\n"
    "\n"
    "Parallelism (the meaning of diffusers' ContextParallelConfig / TensorParallelConfig;\n"
    "ranks are separate processes meeting in shared memory):\n"
    "  --world-size N       number of rank processes (default 1)\n"
    "  --ring R             ring_degree: ring attention over R sequence chunks\n"
    "  --ulysses U          ulysses_degree: all-to-all between sequence and heads\n"
    "  --tp T               tp_degree: tensor parallelism over heads and MLP columns\n"
    "                       R x U x T must equal N; CP and TP combine\n"
    "  --ulysses-anything   uneven sequence chunks and heads not divisible by U (R = 1)\n"
    "  --ring-anything      uneven sequence chunks (U = 1)\n"
    "  --unified-anything   uneven chunks and heads with R > 1 and U > 1\n"
    "  --no-fp32-merge      convert_to_fp32=False: merge ring partials in the activation\n"
    "                       dtype (the cpu backend computes in f32 either way)\n"
    "  --comm-timeout S     seconds a rank waits for its peers before failing (default 60)\n"
    "\n"
    "Exit status: 0 on success, 1 when the model or inputs cannot be used or a rank\n"
    "fails, 2 on bad command-line arguments or an invalid parallel layout.\n";

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
    dit_parallel_config pc;
    double comm_timeout;
    /* Set in rank processes only (internal flags from the launcher). */
    int mesh_rank;
    const char *mesh_shm;
} forward_args;

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

/* Test aid: DIT_FAULT_KILL_RANK=r and DIT_FAULT_KILL_BLOCK=k make rank r
 * kill itself with SIGKILL after transformer block k, to prove that the other
 * ranks fail fast instead of hanging. */
typedef struct fault_plan {
    int rank, block;
} fault_plan;

static dit_status fault_block(void *ctx, int block, dit_diag *diag)
{
    (void)diag;
    const fault_plan *fp = ctx;
    if (block == fp->block)
        raise(SIGKILL);
    return DIT_OK;
}

/* The work of one rank (or of the only process when world size is 1). */
static int run_rank(const forward_args *a, int rank)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_status st = DIT_OK;
    dit_comm *world = NULL;
    dit_mesh *mesh = NULL;
    dit_backend *be = NULL;
    dit_flux *model = NULL;
    dit_runner *runner = NULL;
    dit_input_file *inputs = NULL;
    float *out = NULL;
    const bool multi = a->pc.world_size > 1;
    const bool speak = rank == 0 && !a->quiet;

    if (multi) {
        dit_shm_config sc = {.world_size = a->pc.world_size, .timeout_s = a->comm_timeout};
        snprintf(sc.name, sizeof sc.name, "%s", a->mesh_shm);
        DIT_CHECK(dit_shm_comm_join(&sc, rank, &world, &diag));
        DIT_CHECK(dit_mesh_create(&a->pc, world, &mesh, &diag));
    }
    dit_backend_config bcfg = {.kind = a->backend, .n_threads = a->threads, .device = 0};
    DIT_CHECK(dit_backend_create(&bcfg, &be, &diag));
    dit_flux_shard shard = {.tp_degree = a->pc.tp_degree,
                            .tp_rank = mesh ? dit_mesh_tp_rank(mesh) : 0};
    double t0 = now_ms();
    DIT_CHECK(dit_flux_load(be, a->model, &shard, &model, &diag));
    double t_load = now_ms() - t0;
    const dit_flux_config *cfg = dit_flux_config_of(model);
    DIT_CHECK(dit_input_file_load(a->inputs, cfg, &inputs, &diag));
    const dit_forward_inputs *in = dit_input_file_inputs(inputs);
    DIT_CHECK(dit_runner_create(be, model, mesh, &runner, &diag));

    fault_plan fp = {-1, -1};
    const char *fr = getenv("DIT_FAULT_KILL_RANK"), *fb = getenv("DIT_FAULT_KILL_BLOCK");
    if (fr && fb && atoi(fr) == rank) {
        fp.rank = rank;
        fp.block = atoi(fb);
        dit_runner_set_block_callback(runner, fault_block, &fp);
    }

    const size_t n_out = (size_t)(in->batch * in->img_tokens * cfg->out_dim);
    out = malloc((n_out ? n_out : 1) * sizeof *out);
    if (!out) {
        st = dit_diag_set(&diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    double best = INFINITY;
    for (int r = 0; r < a->repeat; r++) {
        if (world)
            DIT_CHECK(world->ops->barrier(world, &diag));
        double t1 = now_ms();
        DIT_CHECK(dit_runner_forward(runner, in, out, &diag));
        double dt = now_ms() - t1;
        best = dt < best ? dt : best;
    }
    if (rank != 0)
        goto cleanup;

    dit_tensor host_sample = dit_tensor_3d(out, DIT_F32, in->batch, in->img_tokens, cfg->out_dim);
    dit_st_write_item item = {.name = "sample", .tensor = &host_sample};
    DIT_CHECK(dit_st_write(a->output, &item, 1, &diag));
    if (speak) {
        double gflop = dit_flux_forward_flops(cfg, in->batch, in->txt_tokens, in->img_tokens) / 1e9;
        dit_runner_stats rs = dit_runner_get_stats(runner);
        printf("model: %s (%d double + %d single blocks, %d heads x %d, %.1f MiB of weights%s, "
               "loaded in %.0f ms)\n",
               a->model, cfg->num_layers, cfg->num_single_layers, cfg->num_attention_heads,
               cfg->attention_head_dim, (double)dit_flux_weight_bytes(model) / 1048576.0,
               multi ? " on rank 0" : "", t_load);
        if (multi)
            printf("mesh: %d ranks = ring %d x ulysses %d x tp %d%s; rank 0 sent %.3f MiB "
                   "(attention) + %.3f MiB (output gather), all-reduced %.3f MiB per %s\n",
                   a->pc.world_size, a->pc.ring_degree, a->pc.ulysses_degree, a->pc.tp_degree,
                   a->pc.ulysses_anything  ? ", ulysses_anything"
                   : a->pc.ring_anything   ? ", ring_anything"
                   : a->pc.unified_anything ? ", unified_anything"
                                           : "",
                   (double)rs.attention_bytes_sent / 1048576.0 / a->repeat,
                   (double)rs.gather_bytes / 1048576.0 / a->repeat,
                   (double)rs.tp_bytes_reduced / 1048576.0 / a->repeat, "forward");
        printf("forward: batch %lld, %lld text + %lld image tokens, %s backend: %.2f ms "
               "(%.3f GFLOP, %.1f GFLOP/s)%s\n",
               (long long)in->batch, (long long)in->txt_tokens, (long long)in->img_tokens,
               be->ops->name, best, gflop, gflop / (best / 1e3),
               a->repeat > 1 ? ", best of repeats" : "");
        printf("activation memory: %.2f MiB%s\n", (double)rs.activation_bytes / 1048576.0,
               multi ? " on rank 0" : "");
        printf("wrote %s: sample (%lld, %lld, %d) f32\n", a->output, (long long)in->batch,
               (long long)in->img_tokens, cfg->out_dim);
        print_stats("sample", out, n_out);
    }
    if (a->compare)
        DIT_CHECK(compare_sample(a->compare, out, &host_sample, &diag));

cleanup:
    if (st != DIT_OK) {
        if (multi)
            fprintf(stderr, "ditrun forward: rank %d: %s\n", rank, dit_diag_msg(&diag));
        else
            fprintf(stderr, "ditrun forward: %s\n", dit_diag_msg(&diag));
        /* Tell the peers at once rather than letting them time out. */
        if (world)
            world->ops->abort(world);
    }
    free(out);
    dit_input_file_free(inputs);
    dit_runner_destroy(runner);
    dit_flux_destroy(model);
    dit_backend_destroy(be);
    dit_mesh_destroy(mesh);
    dit_comm_destroy(world);
    return st == DIT_OK ? 0 : 1;
}

/* Checks the layout against the model and the inputs before any process
 * starts, so configuration mistakes are usage errors (exit 2). */
static int validate_launch(const forward_args *a)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_parallel_validate(&a->pc, &diag) != DIT_OK) {
        fprintf(stderr, "ditrun forward: %s\n", dit_diag_msg(&diag));
        return EXIT_USAGE;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", a->model);
    dit_flux_config cfg;
    int64_t B, Si, St;
    if (dit_flux_config_load(path, &cfg, &diag) != DIT_OK ||
        dit_input_file_peek(a->inputs, &B, &Si, &St, &diag) != DIT_OK) {
        fprintf(stderr, "ditrun forward: %s\n", dit_diag_msg(&diag));
        return 1;
    }
    if (dit_parallel_validate_model(&a->pc, &cfg, Si, St, &diag) != DIT_OK) {
        fprintf(stderr, "ditrun forward: %s\n", dit_diag_msg(&diag));
        return EXIT_USAGE;
    }
    return 0;
}

static void describe_exit(int status, char *buf, size_t cap)
{
    if (WIFEXITED(status))
        snprintf(buf, cap, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(buf, cap, "was killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
    else
        snprintf(buf, cap, "stopped (status %d)", status);
}

/* Starts one process per rank and supervises them. */
static int launch(const forward_args *a, int argc, char **argv)
{
    int rc = validate_launch(a);
    if (rc != 0)
        return rc;
    const int N = a->pc.world_size;
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_shm_config sc = {.world_size = N, .timeout_s = a->comm_timeout};
    dit_shm_make_name(&sc);
    dit_shm_segment *seg = NULL;
    if (dit_shm_segment_create(&sc, &seg, &diag) != DIT_OK) {
        fprintf(stderr, "ditrun forward: %s\n", dit_diag_msg(&diag));
        return 1;
    }
    pid_t pids[DIT_SHM_MAX_RANKS] = {0};
    char rank_buf[DIT_SHM_MAX_RANKS][16], threads_buf[16];
    /* argv of a rank: ours, plus the internal rank flags, plus a thread
     * count that shares the cores. */
    char **cargv = calloc((size_t)argc + 8, sizeof *cargv);
    if (!cargv) {
        dit_shm_segment_destroy(seg);
        return 1;
    }
    int threads = a->threads;
    if (threads == 0) {
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        threads = ncpu > N ? (int)(ncpu / N) : 1;
    }
    snprintf(threads_buf, sizeof threads_buf, "%d", threads);
    int started = 0;
    for (int r = 0; r < N; r++) {
        int k = 0;
        cargv[k++] = "ditrun"; /* argv here starts at the command name */
        for (int i = 0; i < argc; i++)
            cargv[k++] = argv[i];
        snprintf(rank_buf[r], sizeof rank_buf[r], "%d", r);
        cargv[k++] = "--mesh-rank";
        cargv[k++] = rank_buf[r];
        cargv[k++] = "--mesh-shm";
        cargv[k++] = sc.name;
        cargv[k++] = "--threads";
        cargv[k++] = threads_buf;
        cargv[k] = NULL;
        int err = posix_spawn(&pids[r], "/proc/self/exe", NULL, NULL, cargv, environ);
        if (err != 0) {
            fprintf(stderr, "ditrun forward: cannot start rank %d: %s\n", r, strerror(err));
            dit_shm_segment_abort(seg, r);
            break;
        }
        started++;
    }
    free(cargv);

    int first_failed = -1, first_status = 0, alive = started;
    while (alive > 0) {
        int status;
        pid_t pid = waitpid(-1, &status, 0);
        if (pid < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        int r = -1;
        for (int i = 0; i < started; i++)
            if (pids[i] == pid)
                r = i;
        if (r < 0)
            continue;
        alive--;
        if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
            if (first_failed < 0) {
                first_failed = r;
                first_status = status;
            }
            /* A dead rank cannot say so itself: abort the mesh for it. */
            dit_shm_segment_abort(seg, r);
        }
    }
    rc = 0;
    if (started < N) {
        rc = 1;
    } else if (first_failed >= 0) {
        int culprit = dit_shm_segment_failed_rank(seg);
        if (culprit < 0)
            culprit = first_failed;
        char how[96];
        describe_exit(first_status, how, sizeof how);
        if (culprit == first_failed)
            fprintf(stderr, "ditrun forward: rank %d failed: it %s\n", culprit, how);
        else
            fprintf(stderr, "ditrun forward: rank %d failed first; rank %d %s\n", culprit,
                    first_failed, how);
        rc = 1;
    }
    dit_shm_segment_destroy(seg);
    return rc;
}

static int cmd_forward(int argc, char **argv)
{
    forward_args a = {.backend = DIT_BACKEND_CPU, .threads = 0, .repeat = 1, .mesh_rank = -1};
    a.pc = dit_parallel_config_single();
    enum {
        OPT_WORLD = 256, OPT_RING, OPT_ULYSSES, OPT_TP, OPT_UANY, OPT_RANY, OPT_UNANY, OPT_NOFP32,
        OPT_TIMEOUT, OPT_MESH_RANK, OPT_MESH_SHM,
    };
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},
        {"inputs", required_argument, NULL, 'i'},
        {"output", required_argument, NULL, 'o'},
        {"backend", required_argument, NULL, 'b'},
        {"threads", required_argument, NULL, 't'},
        {"repeat", required_argument, NULL, 'r'},
        {"compare", required_argument, NULL, 'c'},
        {"quiet", no_argument, NULL, 'q'},
        {"help", no_argument, NULL, 'h'},
        {"world-size", required_argument, NULL, OPT_WORLD},
        {"ring", required_argument, NULL, OPT_RING},
        {"ulysses", required_argument, NULL, OPT_ULYSSES},
        {"tp", required_argument, NULL, OPT_TP},
        {"ulysses-anything", no_argument, NULL, OPT_UANY},
        {"ring-anything", no_argument, NULL, OPT_RANY},
        {"unified-anything", no_argument, NULL, OPT_UNANY},
        {"no-fp32-merge", no_argument, NULL, OPT_NOFP32},
        {"comm-timeout", required_argument, NULL, OPT_TIMEOUT},
        {"mesh-rank", required_argument, NULL, OPT_MESH_RANK},
        {"mesh-shm", required_argument, NULL, OPT_MESH_SHM},
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
        case OPT_WORLD:
            if (!parse_int(optarg, 1, DIT_SHM_MAX_RANKS, &v))
                return usage_error(forward_usage, "--world-size wants a number from 1 to 64, not '%s'",
                                   optarg);
            a.pc.world_size = (int)v;
            break;
        case OPT_RING:
        case OPT_ULYSSES:
        case OPT_TP:
            /* Values below 1 reach the layout validation, whose message
             * explains the rule. */
            if (!parse_int(optarg, -1000, 1000, &v))
                return usage_error(forward_usage, "degrees are integers, not '%s'", optarg);
            if (c == OPT_RING)
                a.pc.ring_degree = (int)v;
            else if (c == OPT_ULYSSES)
                a.pc.ulysses_degree = (int)v;
            else
                a.pc.tp_degree = (int)v;
            break;
        case OPT_UANY:
            a.pc.ulysses_anything = true;
            break;
        case OPT_RANY:
            a.pc.ring_anything = true;
            break;
        case OPT_UNANY:
            a.pc.unified_anything = true;
            break;
        case OPT_NOFP32:
            a.pc.fp32_merge = false;
            break;
        case OPT_TIMEOUT:
            if (!parse_int(optarg, 1, 86400, &v))
                return usage_error(forward_usage, "--comm-timeout wants seconds (1 to 86400), not '%s'",
                                   optarg);
            a.comm_timeout = (double)v;
            break;
        case OPT_MESH_RANK:
            if (!parse_int(optarg, 0, DIT_SHM_MAX_RANKS - 1, &v))
                return usage_error(forward_usage, "bad --mesh-rank '%s'", optarg);
            a.mesh_rank = (int)v;
            break;
        case OPT_MESH_SHM:
            a.mesh_shm = optarg;
            break;
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
    if (a.mesh_rank >= 0) {
        if (!a.mesh_shm)
            return usage_error(forward_usage, "%s", "--mesh-rank needs --mesh-shm");
        return run_rank(&a, a.mesh_rank);
    }
    if (a.pc.world_size == 1) {
        dit_diag diag;
        dit_diag_clear(&diag);
        if (dit_parallel_validate(&a.pc, &diag) != DIT_OK) {
            fprintf(stderr, "ditrun forward: %s\n", dit_diag_msg(&diag));
            return EXIT_USAGE;
        }
        return run_rank(&a, 0);
    }
    return launch(&a, argc, argv);
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
