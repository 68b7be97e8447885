/* Parallel-mode benchmark on CPU ranks: for each layout, time per forward,
 * bytes each rank sends per forward (measured, next to the formula), and the
 * weight memory per rank. Random weights (each rank makes only its own
 * tensor-parallel slice), one shm mesh per layout, ranks are forked
 * processes.
 *
 *   bench_parallel [--heads 8] [--head-dim 64] [--double 2] [--single 4]
 *                  [--img-tokens 1024] [--txt-tokens 128] [--iters 3]
 *                  [--threads N (per rank, default cores / ranks)]
 *
 * On a machine with fewer cores than ranks the times measure scheduling as
 * much as the algorithms; the byte counts do not depend on the machine. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend/cpu/cpu_backend.h"
#include "comm/shm/comm_shm.h"
#include "models/flux/flux.h"
#include "models/flux/flux_model.h"
#include "parallel/mesh.h"
#include "runtime/runner.h"

typedef struct layout {
    const char *name;
    int world, R, U, T;
} layout;

static const layout layouts[] = {
    {"single rank", 1, 1, 1, 1},
    {"ring 2", 2, 2, 1, 1},
    {"ulysses 2", 2, 1, 2, 1},
    {"tp 2", 2, 1, 1, 2},
    {"ring 4", 4, 4, 1, 1},
    {"ulysses 4", 4, 1, 4, 1},
    {"ring 2 x ulysses 2", 4, 2, 2, 1},
    {"tp 4", 4, 1, 1, 4},
    {"tp 2 x ulysses 2", 4, 1, 2, 2},
    {"tp 2 x ring 2", 4, 2, 1, 2},
};

/* What rank 0 reports back through a shared page. */
typedef struct result {
    int ok;
    double ms;
    double attn_mib, tp_mib, gather_mib, weights_mib, act_mib;
    char err[256];
} result;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

typedef struct bench_cfg {
    dit_flux_config mc;
    int64_t img, txt;
    int iters, threads;
} bench_cfg;

static int rank_main(const bench_cfg *bc, const layout *lo, const char *shm, int rank, result *res)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_status st = DIT_OK;
    dit_comm *world = NULL;
    dit_mesh *mesh = NULL;
    dit_backend *be = NULL;
    dit_flux *m = NULL;
    dit_model *model = NULL;
    dit_runner *runner = NULL;
    float *buf = NULL;
    dit_parallel_config pc = dit_parallel_config_single();
    pc.world_size = lo->world;
    pc.ring_degree = lo->R;
    pc.ulysses_degree = lo->U;
    pc.tp_degree = lo->T;
    if (lo->world > 1) {
        dit_shm_config sc = {.world_size = lo->world, .timeout_s = 600};
        snprintf(sc.name, sizeof sc.name, "%s", shm);
        DIT_CHECK(dit_shm_comm_join(&sc, rank, &world, &diag));
        DIT_CHECK(dit_mesh_create(&pc, world, &mesh, &diag));
    }
    dit_backend_config bcfg = {.kind = DIT_BACKEND_CPU, .n_threads = bc->threads};
    DIT_CHECK(dit_backend_create(&bcfg, &be, &diag));
    dit_flux_shard shard = {.tp_degree = lo->T, .tp_rank = mesh ? dit_mesh_tp_rank(mesh) : 0};
    DIT_CHECK(dit_flux_create_random(be, &bc->mc, &shard, 7, &m, &diag));
    const dit_flux_config *c = &bc->mc;
    st = dit_model_wrap(&dit_flux_model_class, m, &model, &diag);
    m = NULL;
    DIT_CHECK(st);
    DIT_CHECK(dit_runner_create(be, model, mesh, &runner, &diag));

    const int64_t B = 1, Si = bc->img, St = bc->txt;
    const size_t n_hs = (size_t)(B * Si * c->in_channels),
                 n_ehs = (size_t)(B * St * c->joint_attention_dim);
    const size_t n_pool = (size_t)(B * c->pooled_projection_dim),
                 n_ids = (size_t)((Si + St) * c->n_axes);
    const size_t n_out = (size_t)(B * Si * c->out_dim);
    const size_t n_all = n_hs + n_ehs + n_pool + n_ids + 2 + n_out;
    buf = calloc(n_all, sizeof *buf);
    if (!buf) {
        st = dit_diag_set(&diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    uint64_t s = 99;
    for (size_t i = 0; i < n_hs + n_ehs + n_pool; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        buf[i] = (float)((double)(s >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    }
    float *ids = buf + n_hs + n_ehs + n_pool, *ts = ids + n_ids, *out = ts + 2;
    const int64_t side = (int64_t)sqrt((double)Si);
    for (int64_t i = 0; i < Si; i++) {
        ids[(St + i) * c->n_axes + c->n_axes - 1] = (float)(i % side);
        if (c->n_axes > 1)
            ids[(St + i) * c->n_axes + c->n_axes - 2] = (float)(i / side);
    }
    ts[0] = 0.5f;
    ts[1] = 3.5f;
    dit_named_tensors in = {0};
    {
        const int64_t sh_hs[3] = {B, Si, c->in_channels},
                      sh_ehs[3] = {B, St, c->joint_attention_dim};
        const int64_t sh_pool[2] = {B, c->pooled_projection_dim}, sh_b[1] = {B};
        const int64_t sh_txt[2] = {St, c->n_axes}, sh_img[2] = {Si, c->n_axes};
        const dit_tensor t_hs = dit_tensor_make(buf, DIT_F32, 3, sh_hs);
        const dit_tensor t_ehs = dit_tensor_make(buf + n_hs, DIT_F32, 3, sh_ehs);
        const dit_tensor t_pool = dit_tensor_make(buf + n_hs + n_ehs, DIT_F32, 2, sh_pool);
        const dit_tensor t_t = dit_tensor_make(ts, DIT_F32, 1, sh_b);
        const dit_tensor t_g = dit_tensor_make(ts + 1, DIT_F32, 1, sh_b);
        const dit_tensor t_txt = dit_tensor_make(ids, DIT_F32, 2, sh_txt);
        const dit_tensor t_img = dit_tensor_make(ids + St * c->n_axes, DIT_F32, 2, sh_img);
        dit_named_tensors_set(&in, "hidden_states", &t_hs);
        dit_named_tensors_set(&in, "encoder_hidden_states", &t_ehs);
        dit_named_tensors_set(&in, "pooled_projections", &t_pool);
        dit_named_tensors_set(&in, "timestep", &t_t);
        if (c->guidance_embeds)
            dit_named_tensors_set(&in, "guidance", &t_g);
        dit_named_tensors_set(&in, "txt_ids", &t_txt);
        dit_named_tensors_set(&in, "img_ids", &t_img);
    }
    const int64_t sh_out[3] = {B, Si, c->out_dim};
    const dit_tensor t_out = dit_tensor_make(out, DIT_F32, 3, sh_out);
    DIT_CHECK(dit_runner_forward(runner, &in, &t_out, &diag)); /* warm-up */
    dit_runner_stats s0 = dit_runner_get_stats(runner);
    double best = INFINITY;
    for (int i = 0; i < bc->iters; i++) {
        if (world)
            DIT_CHECK(world->ops->barrier(world, &diag));
        double t0 = now_ms();
        DIT_CHECK(dit_runner_forward(runner, &in, &t_out, &diag));
        double dt = now_ms() - t0;
        best = dt < best ? dt : best;
    }
    if (rank == 0) {
        dit_runner_stats s1 = dit_runner_get_stats(runner);
        const double mib = 1048576.0 * bc->iters;
        res->ms = best;
        res->attn_mib = (double)(s1.attention_bytes_sent - s0.attention_bytes_sent) / mib;
        res->tp_mib = (double)(s1.tp_bytes_reduced - s0.tp_bytes_reduced) / mib;
        res->gather_mib = (double)(s1.gather_bytes - s0.gather_bytes) / mib;
        res->weights_mib = (double)dit_flux_weight_bytes(model->impl) / 1048576.0;
        res->act_mib = (double)s1.activation_bytes / 1048576.0;
        res->ok = 1;
    }
cleanup:
    if (st != DIT_OK && rank == 0)
        snprintf(res->err, sizeof res->err, "%s", dit_diag_msg(&diag));
    if (st != DIT_OK && world)
        world->ops->abort(world);
    free(buf);
    dit_runner_destroy(runner);
    dit_model_destroy(model);
    dit_flux_destroy(m);
    dit_backend_destroy(be);
    dit_mesh_destroy(mesh);
    dit_comm_destroy(world);
    return st == DIT_OK ? 0 : 1;
}

/* Bytes a rank sends per forward by the algorithms' formulas (even splits). */
static void formulas(const bench_cfg *bc, const layout *lo, double *attn_mib, double *tp_mib)
{
    const dit_flux_config *c = &bc->mc;
    const double layers = c->num_layers + c->num_single_layers;
    const double S = (double)(bc->img + bc->txt), C = lo->R * lo->U;
    const double Hl = (double)c->num_attention_heads / lo->T, D = c->attention_head_dim;
    const double f = 4.0; /* bytes per f32 */
    /* Ulysses: q, k, v out and the attention output back, each keeping 1/U. */
    double uly = lo->U > 1 ? 4.0 * (S / C) * Hl * D * f * (lo->U - 1) / lo->U : 0.0;
    /* Ring: R - 1 hops of a K + V chunk of the group's sequence, after
     * Ulysses has left Hl / U heads per rank. */
    double ring = lo->R > 1 ? (lo->R - 1) * 2.0 * (S / lo->R) * (Hl / lo->U) * D * f : 0.0;
    *attn_mib = layers * (uly + ring) / 1048576.0;
    /* Data entering all-reduces: 2 per double block, 1 per single block, each
     * (S / C) x hidden. */
    *tp_mib = lo->T > 1 ? (2.0 * c->num_layers + c->num_single_layers) * (S / C) * c->inner_dim *
                              f / 1048576.0
                        : 0.0;
}

int main(int argc, char **argv)
{
    dit_cpu_blas_core_fix(argv, true);
    bench_cfg bc = {.img = 1024, .txt = 128, .iters = 3, .threads = 0};
    bc.mc = dit_flux_config_flux1_dev();
    bc.mc.num_attention_heads = 8;
    bc.mc.attention_head_dim = 64;
    bc.mc.n_axes = 3;
    bc.mc.axes_dims_rope[0] = 16;
    bc.mc.axes_dims_rope[1] = 24;
    bc.mc.axes_dims_rope[2] = 24;
    bc.mc.num_layers = 2;
    bc.mc.num_single_layers = 4;
    static const struct option opts[] = {
        {"heads", required_argument, NULL, 'H'},
        {"head-dim", required_argument, NULL, 'D'},
        {"double", required_argument, NULL, 'd'},
        {"single", required_argument, NULL, 's'},
        {"img-tokens", required_argument, NULL, 'i'},
        {"txt-tokens", required_argument, NULL, 't'},
        {"iters", required_argument, NULL, 'n'},
        {"threads", required_argument, NULL, 'j'},
        {NULL, 0, NULL, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        long v = strtol(optarg, NULL, 10);
        switch (c) {
        case 'H':
            bc.mc.num_attention_heads = (int)v;
            break;
        case 'D':
            bc.mc.attention_head_dim = (int)v;
            bc.mc.n_axes = 1;
            bc.mc.axes_dims_rope[0] = (int)v;
            break;
        case 'd':
            bc.mc.num_layers = (int)v;
            break;
        case 's':
            bc.mc.num_single_layers = (int)v;
            break;
        case 'i':
            bc.img = v;
            break;
        case 't':
            bc.txt = v;
            break;
        case 'n':
            bc.iters = (int)v;
            break;
        case 'j':
            bc.threads = (int)v;
            break;
        default:
            fprintf(stderr, "usage: see the comment at the top of bench_parallel.c\n");
            return 2;
        }
    }
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_flux_config_finish(&bc.mc, "benchmark config", &diag) != DIT_OK || bc.iters < 1) {
        fprintf(stderr, "%s\n", dit_diag_msg(&diag));
        return 2;
    }
    const long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    printf("config: %d double + %d single blocks, %d heads x %d (hidden %d), %lld image + %lld "
           "text tokens, f32, %ld cores\n",
           bc.mc.num_layers, bc.mc.num_single_layers, bc.mc.num_attention_heads,
           bc.mc.attention_head_dim, bc.mc.inner_dim, (long long)bc.img, (long long)bc.txt, ncpu);
    printf("%-20s %5s %10s %22s %22s %10s %10s\n", "mode", "ranks", "ms/fwd",
           "attn MiB/rank (formula)", "tp-ar MiB/rank (form.)", "gather MiB", "weights MiB");
    result *res =
        mmap(NULL, sizeof(result), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (res == MAP_FAILED)
        return 1;
    int failures = 0;
    for (size_t li = 0; li < sizeof layouts / sizeof *layouts; li++) {
        const layout *lo = &layouts[li];
        memset(res, 0, sizeof *res);
        bench_cfg rbc = bc;
        if (rbc.threads == 0)
            rbc.threads = ncpu > lo->world ? (int)(ncpu / lo->world) : 1;
        dit_shm_config sc = {.world_size = lo->world, .timeout_s = 600};
        dit_shm_make_name(&sc);
        dit_shm_segment *seg = NULL;
        if (lo->world > 1 && dit_shm_segment_create(&sc, &seg, &diag) != DIT_OK) {
            fprintf(stderr, "%s\n", dit_diag_msg(&diag));
            return 1;
        }
        pid_t pids[64];
        for (int r = 0; r < lo->world; r++) {
            pids[r] = fork();
            if (pids[r] == 0)
                _exit(rank_main(&rbc, lo, sc.name, r, res));
        }
        int bad = 0;
        for (int r = 0; r < lo->world; r++) {
            int status;
            waitpid(pids[r], &status, 0);
            bad |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        }
        dit_shm_segment_destroy(seg);
        if (bad || !res->ok) {
            printf("%-20s failed: %s\n", lo->name, res->err);
            failures++;
            continue;
        }
        double fa, ft;
        formulas(&bc, lo, &fa, &ft);
        char attn[48], tp[48];
        snprintf(attn, sizeof attn, "%.2f (%.2f)", res->attn_mib, fa);
        snprintf(tp, sizeof tp, "%.2f (%.2f)", res->tp_mib, ft);
        printf("%-20s %5d %10.1f %22s %22s %10.2f %10.1f\n", lo->name, lo->world, res->ms, attn, tp,
               res->gather_mib, res->weights_mib);
        fflush(stdout);
    }
    munmap(res, sizeof *res);
    return failures ? 1 : 0;
}
