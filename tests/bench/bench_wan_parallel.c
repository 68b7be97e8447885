/* Context-parallel traffic of WanTransformer3DModel: the bytes each rank
 * sends per forward, measured on a small model through the real runner on
 * CPU ranks (forked processes on one shm mesh) and compared with the
 * formula, exactly; then the same formula for Wan 2.1 14B at 480x832, 81
 * frames, under the layouts of 8 GPUs.
 *
 *   bench_wan_parallel --model DIR --inputs FILE
 *                      [--layouts ring8,ulysses8,ring2xulysses4] [--threads 1]
 *
 * DIR is a WanTransformer3DModel folder whose heads and video tokens the
 * layouts divide evenly (tests/bench/wan_cp_bytes.sh makes one with 8 heads
 * and 128 tokens); FILE its ditrun forward inputs. A layout is ringR,
 * ulyssesU or ringRxulyssesU. Exit status 1 when a rank fails or any rank's
 * count differs from the formula.
 *
 * Formula, per forward, batch B, S video tokens, H heads of D, L layers,
 * C = R U context ranks, f32 on the wire (the context-parallel hook keeps
 * q, k, v in f32 on every backend). Only self-attention communicates: the
 * text is replicated and cross-attention stays local. Per layer and rank:
 *   Ulysses all-to-alls: q, k, v out and the output back, keeping 1/U:
 *       4 B (S/C) H D 4 (U-1)/U
 *   ring: R-1 hops of this ring rank's K and V chunk, after Ulysses has
 *       left H/U heads: 2 B (S/R) (H/U) D 4
 * plus the output gather at the end, once: B (S/C) out_dim 4. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/cpu/cpu_backend.h"
#include "comm/shm/comm_shm.h"
#include "models/model.h"
#include "models/wan/wan_config.h"
#include "models/wan/wan_model.h"
#include "parallel/mesh.h"
#include "runtime/inputs.h"
#include "runtime/runner.h"

enum { MAX_LAYOUTS = 16, MAX_RANKS = 64 };

typedef struct layout {
    char name[48];
    int R, U;
} layout;

/* What every rank reports back through a shared page. */
typedef struct result {
    int ok[MAX_RANKS];
    uint64_t attn[MAX_RANKS], gather[MAX_RANKS];
    char err[256];
} result;

typedef struct shape {
    double B, S, H, D, L, out_dim;
} shape;

static double attn_formula(const shape *s, int R, int U)
{
    const double C = (double)R * U, f = 4.0;
    const double uly = U > 1 ? 4.0 * s->B * (s->S / C) * s->H * s->D * f * (U - 1) / U : 0.0;
    const double ring = R > 1 ? (R - 1) * 2.0 * s->B * (s->S / R) * (s->H / U) * s->D * f : 0.0;
    return s->L * (uly + ring);
}

static double gather_formula(const shape *s, int R, int U)
{
    return R * U > 1 ? s->B * (s->S / (R * U)) * s->out_dim * 4.0 : 0.0;
}

static int parse_layout(const char *tok, layout *lo)
{
    int r = 1, u = 1, n = 0;
    if (sscanf(tok, "ring%dxulysses%d%n", &r, &u, &n) == 2 && tok[n] == '\0')
        ;
    else if (r = 1, u = 1, sscanf(tok, "ring%d%n", &r, &n) == 1 && tok[n] == '\0')
        ;
    else if (r = 1, u = 1, sscanf(tok, "ulysses%d%n", &u, &n) == 1 && tok[n] == '\0')
        ;
    else
        return -1;
    if (r < 1 || u < 1 || r * u < 2 || r * u > MAX_RANKS)
        return -1;
    lo->R = r;
    lo->U = u;
    if (r > 1 && u > 1)
        snprintf(lo->name, sizeof lo->name, "ring %d x ulysses %d", r, u);
    else if (r > 1)
        snprintf(lo->name, sizeof lo->name, "ring %d", r);
    else
        snprintf(lo->name, sizeof lo->name, "ulysses %d", u);
    return 0;
}

static int rank_main(const char *model_dir, const char *inputs, const layout *lo, int threads,
                     const char *shm, int rank, result *res)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_status st = DIT_OK;
    dit_comm *world = NULL;
    dit_mesh *mesh = NULL;
    dit_backend *be = NULL;
    dit_model *model = NULL;
    dit_runner *runner = NULL;
    dit_input_file *in = NULL;
    float *out = NULL;
    const int W = lo->R * lo->U;
    dit_parallel_config pc = dit_parallel_config_single();
    pc.world_size = W;
    pc.ring_degree = lo->R;
    pc.ulysses_degree = lo->U;
    dit_shm_config sc = {.world_size = W, .timeout_s = 600};
    snprintf(sc.name, sizeof sc.name, "%s", shm);
    DIT_CHECK(dit_shm_comm_join(&sc, rank, &world, &diag));
    DIT_CHECK(dit_mesh_create(&pc, world, &mesh, &diag));
    dit_backend_config bcfg = {.kind = DIT_BACKEND_CPU, .n_threads = threads};
    DIT_CHECK(dit_backend_create(&bcfg, &be, &diag));
    dit_shard shard = {.tp_degree = 1, .tp_rank = 0};
    DIT_CHECK(dit_model_load(be, model_dir, &shard, &model, &diag));
    const dit_model_class *cls = model->cls;
    const void *cfg = dit_model_config(model);
    DIT_CHECK(dit_input_file_load(inputs, cls, cfg, &in, &diag));
    DIT_CHECK(dit_runner_create(be, model, mesh, &runner, &diag));
    dit_tensor sample;
    DIT_CHECK(cls->output_shape(cfg, dit_input_file_inputs(in), &sample, &diag));
    const size_t n = (size_t)dit_tensor_numel(&sample);
    out = malloc((n ? n : 1) * sizeof *out);
    if (!out) {
        st = dit_diag_set(&diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    sample.data = out;
    DIT_CHECK(dit_runner_forward(runner, dit_input_file_inputs(in), &sample, &diag));
    dit_runner_stats rs = dit_runner_get_stats(runner);
    res->attn[rank] = rs.attention_bytes_sent;
    res->gather[rank] = rs.gather_bytes;
    res->ok[rank] = 1;
cleanup:
    if (st != DIT_OK && rank == 0)
        snprintf(res->err, sizeof res->err, "%s", dit_diag_msg(&diag));
    if (st != DIT_OK && world)
        world->ops->abort(world);
    free(out);
    dit_input_file_free(in);
    dit_runner_destroy(runner);
    dit_model_destroy(model);
    dit_backend_destroy(be);
    dit_mesh_destroy(mesh);
    dit_comm_destroy(world);
    return st == DIT_OK ? 0 : 1;
}

/* The small model's shape, read in this process (B and S from the inputs). */
static dit_status read_shape(const char *model_dir, const char *inputs, shape *s, dit_diag *diag)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", model_dir);
    dit_wan_config c;
    dit_status st = dit_wan_config_load(path, &c, diag);
    if (st != DIT_OK)
        return st;
    dit_input_file *in = NULL;
    st = dit_input_file_load(inputs, &dit_wan_model_class, &c, &in, diag);
    if (st != DIT_OK)
        return st;
    const dit_tensor *hs = dit_named_tensors_get(dit_input_file_inputs(in), "hidden_states");
    if (!hs || hs->ndim != 5) {
        dit_input_file_free(in);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: no 5-D hidden_states", inputs);
    }
    s->B = (double)hs->ne[0];
    s->S = (double)(hs->ne[2] / c.patch_size[0] * (hs->ne[3] / c.patch_size[1]) *
                    (hs->ne[4] / c.patch_size[2]));
    s->H = c.num_attention_heads;
    s->D = c.attention_head_dim;
    s->L = c.num_layers;
    s->out_dim = c.out_dim;
    dit_input_file_free(in);
    return DIT_OK;
}

static void print_big(const layout *los, int n_lo)
{
    /* Wan 2.1 T2V 14B: 40 layers, 40 heads x 128, out 16 channels, patch
     * (1, 2, 2); 81 frames at 480 x 832 -> latent 21 x 60 x 104 -> 21 x 30
     * x 52 = 32760 video tokens; 512 text tokens (replicated, not sent). */
    const shape big = {.B = 1, .S = 21.0 * 30 * 52, .H = 40, .D = 128, .L = 40, .out_dim = 64};
    printf("\nWan 2.1 T2V 14B, 480x832, 81 frames (latent 21x60x104, %.0f video tokens), batch 1, "
           "f32 on the wire, by the formula:\n",
           big.S);
    printf("%-22s %5s %20s %12s %16s %18s\n", "mode", "ranks", "attention B/rank", "GiB/rank",
           "gather MiB/rank", "GiB/rank/video*");
    for (int i = 0; i < n_lo; i++) {
        const double a = attn_formula(&big, los[i].R, los[i].U);
        const double g = gather_formula(&big, los[i].R, los[i].U);
        /* 50 steps with classifier-free guidance: 100 forwards. */
        printf("%-22s %5d %20.0f %12.2f %16.2f %18.1f\n", los[i].name, los[i].R * los[i].U, a,
               a / 1073741824.0, g / 1048576.0, 100.0 * (a + g) / 1073741824.0);
    }
    printf("* a video: 50 steps with classifier-free guidance = 100 forwards\n");
}

int main(int argc, char **argv)
{
    dit_cpu_blas_core_fix(argv, true);
    const char *model_dir = NULL, *inputs = NULL;
    char layouts_arg[256] = "ring8,ulysses8,ring2xulysses4";
    int threads = 1;
    static const struct option opts[] = {
        {"model", required_argument, NULL, 'm'},
        {"inputs", required_argument, NULL, 'i'},
        {"layouts", required_argument, NULL, 'l'},
        {"threads", required_argument, NULL, 'j'},
        {NULL, 0, NULL, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm':
            model_dir = optarg;
            break;
        case 'i':
            inputs = optarg;
            break;
        case 'l':
            snprintf(layouts_arg, sizeof layouts_arg, "%s", optarg);
            break;
        case 'j':
            threads = atoi(optarg);
            break;
        default:
            fprintf(stderr, "usage: see the comment at the top of bench_wan_parallel.c\n");
            return 2;
        }
    }
    layout los[MAX_LAYOUTS];
    int n_lo = 0;
    for (char *save = NULL, *tok = strtok_r(layouts_arg, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (n_lo == MAX_LAYOUTS || parse_layout(tok, &los[n_lo]) != 0) {
            fprintf(stderr,
                    "bench_wan_parallel: bad layout '%s' (ringR, ulyssesU, ringRxulyssesU)\n", tok);
            return 2;
        }
        n_lo++;
    }
    if (!model_dir || !inputs || n_lo == 0 || threads < 1) {
        fprintf(stderr, "usage: bench_wan_parallel --model DIR --inputs FILE [--layouts L,...] "
                        "[--threads N]\n");
        return 2;
    }
    dit_diag diag;
    dit_diag_clear(&diag);
    shape sm = {0};
    if (read_shape(model_dir, inputs, &sm, &diag) != DIT_OK) {
        fprintf(stderr, "bench_wan_parallel: %s\n", dit_diag_msg(&diag));
        return 1;
    }
    printf("measured: %s, %.0f layers, %.0f heads x %.0f, batch %.0f, %.0f video tokens, "
           "one forward per layout, %d thread(s) per rank\n",
           model_dir, sm.L, sm.H, sm.D, sm.B, sm.S, threads);
    printf("%-22s %5s %26s %16s %14s %12s\n", "mode", "ranks", "attention B/rank (min-max)",
           "formula", "gather B/rank", "formula");
    result *res =
        mmap(NULL, sizeof(result), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (res == MAP_FAILED)
        return 1;
    int failures = 0;
    for (int li = 0; li < n_lo; li++) {
        const layout *lo = &los[li];
        const int W = lo->R * lo->U;
        memset(res, 0, sizeof *res);
        dit_shm_config sc = {.world_size = W, .timeout_s = 600};
        dit_shm_make_name(&sc);
        dit_shm_segment *seg = NULL;
        if (dit_shm_segment_create(&sc, &seg, &diag) != DIT_OK) {
            fprintf(stderr, "%s\n", dit_diag_msg(&diag));
            return 1;
        }
        pid_t pids[MAX_RANKS];
        for (int r = 0; r < W; r++) {
            pids[r] = fork();
            if (pids[r] == 0)
                _exit(rank_main(model_dir, inputs, lo, threads, sc.name, r, res));
        }
        int bad = 0;
        for (int r = 0; r < W; r++) {
            int status;
            waitpid(pids[r], &status, 0);
            bad |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0) || !res->ok[r];
        }
        dit_shm_segment_destroy(seg);
        if (bad) {
            printf("%-22s failed: %s\n", lo->name, res->err);
            failures++;
            continue;
        }
        uint64_t amin = res->attn[0], amax = res->attn[0], gmin = res->gather[0],
                 gmax = res->gather[0];
        for (int r = 1; r < W; r++) {
            amin = res->attn[r] < amin ? res->attn[r] : amin;
            amax = res->attn[r] > amax ? res->attn[r] : amax;
            gmin = res->gather[r] < gmin ? res->gather[r] : gmin;
            gmax = res->gather[r] > gmax ? res->gather[r] : gmax;
        }
        const double fa = attn_formula(&sm, lo->R, lo->U), fg = gather_formula(&sm, lo->R, lo->U);
        const int exact =
            (double)amin == fa && (double)amax == fa && (double)gmin == fg && (double)gmax == fg;
        char meas[64], gmeas[40];
        snprintf(meas, sizeof meas, "%llu-%llu", (unsigned long long)amin,
                 (unsigned long long)amax);
        snprintf(gmeas, sizeof gmeas, "%llu", (unsigned long long)gmax);
        printf("%-22s %5d %26s %16.0f %14s %12.0f  %s\n", lo->name, W, meas, fa, gmeas, fg,
               exact ? "equal" : "DIFFERENT");
        fflush(stdout);
        failures += !exact;
    }
    munmap(res, sizeof *res);
    print_big(los, n_lo);
    return failures ? 1 : 0;
}
