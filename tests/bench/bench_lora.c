/* LoRA adapter costs (parallel/lora.h), on random weights made here:
 *
 *   bench_lora [--rank 16] [--heads 8] [--double 4] [--single 8]
 *              [--img-tokens 1024] [--txt-tokens 128] [--threads N]
 *              [--iters 5] [--backend cpu|cuda] [--no-load]
 *
 * 1. Forward cost of an unfused adapter: a FLUX-shaped random model (the
 *    mid-size config of bench_flux_forward by default; head dim 128) with a
 *    rank-r adapter on every attention and feed-forward linear, timed in the
 *    same run without the adapter, with it attached, and without it again
 *    (forwards alternate; medians of wall and of process CPU time: with
 *    --threads 1 the latter holds still on a shared machine).
 *    Then the adapter merged into the weights (dit_lora_fuse): its time, and
 *    a forward after it.
 * 2. Load time for FLUX.1-dev dimensions (19 + 38 blocks, hidden 3072, FFN
 *    12288): a rank-r diffusers/PEFT file (bf16, as trainers save them) on
 *    the same linears, written to a temporary file, then dit_lora_load
 *    against FLUX.1-dev's LoRA sites (recorded here without any base
 *    weights: the loader only needs names, shapes and destinations);
 *    median of 3. Also the memory it holds, against the formula
 *    sum over modules of r (K + N) x (bytes of the backend's weight dtype).
 *
 * Prints "key: value" lines. */
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/arena.h"
#include "backend/backend.h"
#include "loader/safetensors.h"
#include "models/flux/flux.h"
#include "parallel/lora.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* CPU time of the whole process: with one thread, the work of a pass even
 * when other programs share the cores (wall time then wanders). */
static double cpu_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The attention and feed-forward linears of a FLUX model: name, N, K. */
typedef struct module {
    char name[96];
    int64_t N, K;
} module;

static int flux_modules(const dit_flux_config *c, module **out)
{
    static const char *const dbl[][2] = {
        {"attn.to_q", "CC"},
        {"attn.to_k", "CC"},
        {"attn.to_v", "CC"},
        {"attn.add_q_proj", "CC"},
        {"attn.add_k_proj", "CC"},
        {"attn.add_v_proj", "CC"},
        {"attn.to_out.0", "CC"},
        {"attn.to_add_out", "CC"},
        {"ff.net.0.proj", "FC"},
        {"ff.net.2", "CF"},
        {"ff_context.net.0.proj", "FC"},
        {"ff_context.net.2", "CF"},
    };
    static const char *const sgl[][2] = {
        {"attn.to_q", "CC"}, {"attn.to_k", "CC"}, {"attn.to_v", "CC"},
        {"proj_mlp", "FC"},  {"proj_out", "CX"},
    };
    const int nd = (int)(sizeof dbl / sizeof dbl[0]), ns = (int)(sizeof sgl / sizeof sgl[0]);
    const int n = c->num_layers * nd + c->num_single_layers * ns;
    module *m = calloc((size_t)n, sizeof *m);
    if (!m)
        return -1;
    const int64_t C = c->inner_dim, F = c->mlp_dim;
    int k = 0;
    for (int i = 0; i < c->num_layers; i++)
        for (int j = 0; j < nd; j++, k++) {
            snprintf(m[k].name, sizeof m[k].name, "transformer_blocks.%d.%s", i, dbl[j][0]);
            m[k].N = dbl[j][1][0] == 'C' ? C : F;
            m[k].K = dbl[j][1][1] == 'C' ? C : F;
        }
    for (int i = 0; i < c->num_single_layers; i++)
        for (int j = 0; j < ns; j++, k++) {
            snprintf(m[k].name, sizeof m[k].name, "single_transformer_blocks.%d.%s", i, sgl[j][0]);
            m[k].N = sgl[j][1][0] == 'C' ? C : F;
            m[k].K = sgl[j][1][1] == 'C' ? C : sgl[j][1][1] == 'F' ? F : C + F;
        }
    *out = m;
    return n;
}

/* Writes a rank-r PEFT file (dtype dt) for `mods` with small random values. */
static dit_status write_adapter(const char *path, const module *mods, int n, int64_t r,
                                dit_dtype dt, dit_diag *diag)
{
    dit_status st = DIT_OK;
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += (size_t)(r * (mods[i].K + mods[i].N));
    const size_t esz = dit_dtype_size(dt);
    unsigned char *buf = malloc(total * esz);
    float *row = malloc(16384 * sizeof *row);
    dit_tensor *t = calloc((size_t)(2 * n), sizeof *t);
    dit_st_write_item *items = calloc((size_t)(2 * n), sizeof *items);
    char(*names)[128] = calloc((size_t)(2 * n), sizeof *names);
    if (!buf || !row || !t || !items || !names) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    uint64_t s = 99;
    size_t off = 0;
    for (int i = 0; i < n; i++)
        for (int ab = 0; ab < 2; ab++) {
            const int64_t n0 = ab ? mods[i].N : r, n1 = ab ? r : mods[i].K;
            const float amp = ab ? 0.01f : 0.02f;
            for (int64_t x = 0; x < n0; x++) {
                for (int64_t y = 0; y < n1; y++) {
                    s = s * 6364136223846793005ull + 1442695040888963407ull;
                    row[y] = amp * (float)((double)(s >> 11) * 0x1.0p-53 * 2.0 - 1.0);
                }
                dit_convert_from_f32(buf + (off + (size_t)(x * n1)) * esz, dt, row, (size_t)n1);
            }
            const int k = 2 * i + ab;
            snprintf(names[k], sizeof names[k], "transformer.%s.lora_%c.weight", mods[i].name,
                     ab ? 'B' : 'A');
            t[k] = dit_tensor_2d(buf + off * esz, dt, n0, n1);
            items[k] = (dit_st_write_item){.name = names[k], .tensor = &t[k]};
            off += (size_t)(n0 * n1);
        }
    st = dit_st_write(path, items, (size_t)(2 * n), diag);
cleanup:
    free(buf);
    free(row);
    free(t);
    free(items);
    free(names);
    return st;
}

typedef struct opts {
    int64_t rank;
    long img, txt, threads, iters;
    bool load;
    dit_backend_kind kind;
    dit_flux_config cfg;
} opts;

static dit_status bench_forward(const opts *o, dit_backend *be, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_flux *m = NULL;
    dit_arena *arena = NULL;
    dit_lora *lora = NULL;
    module *mods = NULL;
    void *dev = NULL;
    float *host = NULL, *ids = NULL;
    double *times = NULL;
    char path[64];
    snprintf(path, sizeof path, "/tmp/bench_lora_fwd_%d.safetensors", (int)getpid());
    DIT_CHECK(dit_flux_create_random(be, &o->cfg, NULL, 1234, &m, diag));
    const dit_flux_config cfg = *dit_flux_config_of(m);
    const int nm = flux_modules(&cfg, &mods);
    if (nm < 0) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    DIT_CHECK(write_adapter(path, mods, nm, o->rank, DIT_BF16, diag));
    DIT_CHECK(dit_lora_load(be, dit_flux_lora_sites(m), path, 0, &lora, diag));

    const long img = o->img, txt = o->txt;
    const size_t n_hs = (size_t)(img * cfg.in_channels),
                 n_ehs = (size_t)(txt * cfg.joint_attention_dim);
    const size_t n_pool = (size_t)cfg.pooled_projection_dim, n_out = (size_t)(img * cfg.out_dim);
    const size_t n_all = n_hs + n_ehs + n_pool + n_out;
    host = malloc(n_all * sizeof *host);
    ids = calloc((size_t)(img + txt) * (size_t)cfg.n_axes, sizeof *ids);
    times = malloc(6 * (size_t)o->iters * sizeof *times);
    if (!host || !ids || !times) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    DIT_CHECK(dit_backend_alloc(be, n_all * sizeof(float), &dev));
    uint64_t s = 42;
    for (size_t i = 0; i < n_all; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        host[i] = (float)((double)(s >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    }
    for (long i = 0; i < img; i++)
        ids[(size_t)(txt + i) * (size_t)cfg.n_axes + (size_t)cfg.n_axes - 1] = (float)i;
    dit_tensor h_all = dit_tensor_1d(host, DIT_F32, (int64_t)n_all);
    dit_tensor d_all = dit_tensor_1d(dev, DIT_F32, (int64_t)n_all);
    DIT_CHECK(be->ops->upload(be, &d_all, &h_all));
    float *d = dev;
    const float tsteps[2] = {0.5f, 3.5f};
    dit_flux_inputs in = {
        .hidden_states = dit_tensor_3d(d, DIT_F32, 1, img, cfg.in_channels),
        .encoder_hidden_states = dit_tensor_3d(d + n_hs, DIT_F32, 1, txt, cfg.joint_attention_dim),
        .pooled_projections =
            dit_tensor_2d(d + n_hs + n_ehs, DIT_F32, 1, cfg.pooled_projection_dim),
        .timestep = tsteps,
        .guidance = cfg.guidance_embeds ? tsteps + 1 : NULL,
        .txt_ids = ids,
        .img_ids = ids + (size_t)txt * (size_t)cfg.n_axes,
    };
    dit_tensor out = dit_tensor_3d(d + n_hs + n_ehs + n_pool, DIT_F32, 1, img, cfg.out_dim);
    DIT_CHECK(dit_arena_create(be, 0, &arena));
    dit_lora_sites *sites = dit_flux_lora_sites(m);
    const dit_lora_use use = {.lora = lora, .scale = 1.0f};
    /* Warm-up of both variants, then alternate: base, adapter, base. */
    for (int w = 0; w < 2; w++) {
        if (w)
            DIT_CHECK(dit_lora_attach(sites, &use, 1, diag));
        DIT_CHECK(dit_flux_forward(m, arena, &in, &out, diag));
        DIT_CHECK(be->ops->sync(be));
        dit_arena_reset(arena);
        dit_lora_detach(sites);
    }
    for (long i = 0; i < o->iters; i++)
        for (int v = 0; v < 3; v++) {
            if (v == 1)
                DIT_CHECK(dit_lora_attach(sites, &use, 1, diag));
            const double t0 = now_ms(), c0 = cpu_ms();
            DIT_CHECK(dit_flux_forward(m, arena, &in, &out, diag));
            DIT_CHECK(be->ops->sync(be));
            times[(size_t)v * (size_t)o->iters + (size_t)i] = now_ms() - t0;
            times[(size_t)(3 + v) * (size_t)o->iters + (size_t)i] = cpu_ms() - c0;
            dit_arena_reset(arena);
            dit_lora_detach(sites);
        }
    const double base = median(times, (int)o->iters);
    const double with = median(times + o->iters, (int)o->iters);
    const double again = median(times + 2 * o->iters, (int)o->iters);
    const double cbase = median(times + 3 * o->iters, (int)o->iters);
    const double cwith = median(times + 4 * o->iters, (int)o->iters);
    const double cagain = median(times + 5 * o->iters, (int)o->iters);
    const dit_lora_info li = dit_lora_get_info(lora);
    const double fl = dit_flux_forward_flops(&cfg, 1, txt, img);
    double lfl = 0.0;
    for (int i = 0; i < nm; i++) {
        /* Double blocks: text-stream modules see the text rows, the others
         * the image rows; single blocks see both. */
        const bool dbl = strncmp(mods[i].name, "transformer_blocks.", 19) == 0;
        const bool text = strstr(mods[i].name, "add_") || strstr(mods[i].name, "ff_context");
        const long rows = !dbl ? img + txt : text ? txt : img;
        lfl += 2.0 * (double)rows * (double)o->rank * (double)(mods[i].K + mods[i].N);
    }
    printf("forward_config: %d double + %d single blocks, %d heads x %d (hidden %d, ffn %d), %ld "
           "image + %ld text tokens, %s backend\n",
           cfg.num_layers, cfg.num_single_layers, cfg.num_attention_heads, cfg.attention_head_dim,
           cfg.inner_dim, cfg.mlp_dim, img, txt, be->ops->name);
    printf("adapter: rank %lld on %d linears, %.1f MiB on the backend\n", (long long)o->rank,
           li.n_modules, (double)li.bytes / 1048576.0);
    printf("forward_base_ms: %.2f\nforward_lora_ms: %.2f\nforward_base_again_ms: %.2f\n", base,
           with, again);
    printf("forward_base_cpu_ms: %.2f\nforward_lora_cpu_ms: %.2f\nforward_base_again_cpu_ms: "
           "%.2f\n",
           cbase, cwith, cagain);
    /* Merged into the weights instead: the time to fuse, and a forward. */
    double t0 = now_ms();
    DIT_CHECK(dit_lora_fuse(sites, lora, 1.0f, diag));
    const double t_fuse = now_ms() - t0;
    double fused[16];
    const int nf = o->iters < 16 ? (int)o->iters : 16;
    for (int i = 0; i < nf; i++) {
        t0 = now_ms();
        DIT_CHECK(dit_flux_forward(m, arena, &in, &out, diag));
        DIT_CHECK(be->ops->sync(be));
        fused[i] = now_ms() - t0;
        dit_arena_reset(arena);
    }
    printf("fuse_ms: %.1f\nforward_fused_ms: %.2f\n", t_fuse, median(fused, nf));
    printf("lora_overhead: %.1f %% wall, %.1f %% cpu time (adapter GEMMs are %.2f %% of the "
           "forward's FLOPs)\n",
           100.0 * (with - 0.5 * (base + again)) / (0.5 * (base + again)),
           100.0 * (cwith - 0.5 * (cbase + cagain)) / (0.5 * (cbase + cagain)), 100.0 * lfl / fl);
cleanup:
    unlink(path);
    dit_lora_destroy(lora);
    dit_arena_destroy(arena);
    dit_backend_free(be, dev);
    dit_flux_destroy(m);
    free(mods);
    free(host);
    free(ids);
    free(times);
    return st;
}

static dit_status bench_load(const opts *o, dit_backend *be, dit_diag *diag)
{
    dit_status st = DIT_OK;
    module *mods = NULL;
    dit_linear *dst = NULL;
    dit_lora_sites *sites = NULL;
    char path[64];
    snprintf(path, sizeof path, "/tmp/bench_lora_dev_%d.safetensors", (int)getpid());
    const dit_flux_config cfg = dit_flux_config_flux1_dev();
    const int nm = flux_modules(&cfg, &mods);
    dst = calloc((size_t)(nm > 0 ? nm : 1), sizeof *dst);
    if (nm < 0 || !dst) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    DIT_CHECK(dit_lora_sites_create(dit_flux_lora_kohya, &sites, diag));
    size_t formula = 0;
    for (int i = 0; i < nm; i++) {
        dit_lora_sites_add(sites, mods[i].name, mods[i].N, mods[i].K, &dst[i], 0, 0, mods[i].N, 0,
                           mods[i].K);
        formula += (size_t)(o->rank * (mods[i].K + mods[i].N));
    }
    double t0 = now_ms();
    DIT_CHECK(write_adapter(path, mods, nm, o->rank, DIT_BF16, diag));
    const double t_write = now_ms() - t0;
    double times[3];
    size_t bytes = 0;
    int n_mod = 0;
    for (int i = 0; i < 3; i++) {
        dit_lora *l = NULL;
        t0 = now_ms();
        DIT_CHECK(dit_lora_load(be, sites, path, 0, &l, diag));
        times[i] = now_ms() - t0;
        bytes = dit_lora_get_info(l).bytes;
        n_mod = dit_lora_get_info(l).n_modules;
        dit_lora_destroy(l);
    }
    printf("load_config: FLUX.1-dev (%d double + %d single blocks, hidden %d, ffn %d), rank %lld "
           "on %d linears, bf16 file of %.1f MiB (written in %.0f ms)\n",
           cfg.num_layers, cfg.num_single_layers, cfg.inner_dim, cfg.mlp_dim, (long long)o->rank,
           n_mod, (double)(formula * 2) / 1048576.0, t_write);
    printf("load_ms: %.1f (median of 3, %s backend, weights stored as %s)\n", median(times, 3),
           be->ops->name, dit_dtype_name(be->ops->weight_dtype));
    printf("adapter_mib: %.2f measured, %.2f by the formula r (K + N) x %zu bytes summed over "
           "modules\n",
           (double)bytes / 1048576.0,
           (double)formula * (double)dit_dtype_size(be->ops->weight_dtype) / 1048576.0,
           dit_dtype_size(be->ops->weight_dtype));
cleanup:
    unlink(path);
    dit_lora_sites_destroy(sites);
    free(dst);
    free(mods);
    return st;
}

int main(int argc, char **argv)
{
    dit_cpu_blas_core_fix(argv, true);
    opts o = {.rank = 16, .img = 1024, .txt = 128, .iters = 5, .load = true};
    o.cfg = dit_flux_config_flux1_dev();
    o.cfg.num_attention_heads = 8;
    o.cfg.num_layers = 4;
    o.cfg.num_single_layers = 8;
    static const struct option lo[] = {
        {"rank", required_argument, NULL, 'r'},
        {"heads", required_argument, NULL, 'H'},
        {"double", required_argument, NULL, 'd'},
        {"single", required_argument, NULL, 's'},
        {"img-tokens", required_argument, NULL, 'i'},
        {"txt-tokens", required_argument, NULL, 't'},
        {"threads", required_argument, NULL, 'j'},
        {"iters", required_argument, NULL, 'n'},
        {"backend", required_argument, NULL, 'B'},
        {"no-load", no_argument, NULL, 'L'},
        {NULL, 0, NULL, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'r':
            o.rank = atol(optarg);
            break;
        case 'H':
            o.cfg.num_attention_heads = atoi(optarg);
            break;
        case 'd':
            o.cfg.num_layers = atoi(optarg);
            break;
        case 's':
            o.cfg.num_single_layers = atoi(optarg);
            break;
        case 'i':
            o.img = atol(optarg);
            break;
        case 't':
            o.txt = atol(optarg);
            break;
        case 'j':
            o.threads = atol(optarg);
            break;
        case 'n':
            o.iters = atol(optarg);
            break;
        case 'L':
            o.load = false;
            break;
        case 'B':
            if (dit_backend_kind_parse(optarg, &o.kind) != DIT_OK) {
                fprintf(stderr, "unknown backend %s\n", optarg);
                return 2;
            }
            break;
        default:
            fprintf(stderr, "usage: see the comment at the top of bench_lora.c\n");
            return 2;
        }
    }
    if (o.rank < 1 || o.img < 1 || o.txt < 1 || o.iters < 1) {
        fprintf(stderr, "bad sizes\n");
        return 2;
    }
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_backend *be = NULL;
    dit_backend_config bc = {.kind = o.kind, .n_threads = (int)o.threads};
    dit_status st = dit_backend_create(&bc, &be, &diag);
    if (st == DIT_OK)
        st = bench_forward(&o, be, &diag);
    if (st == DIT_OK && o.load)
        st = bench_load(&o, be, &diag);
    if (st != DIT_OK)
        fprintf(stderr, "bench_lora: %s\n", dit_diag_msg(&diag));
    dit_backend_destroy(be);
    return st == DIT_OK ? 0 : 1;
}
