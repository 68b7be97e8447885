/* ditrun forward: one transformer forward pass from a file of inputs. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "loader/safetensors.h"
#include "models/model.h"
#include "runtime/inputs.h"
#include "runtime/runner.h"
#include "tools/ditrun.h"

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
    printf("%s: mean %.6f, std %.6f, min %.6f, max %.6f\n", name, mean, sqrt(var > 0 ? var : 0), mn,
           mx);
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

int ditrun_forward_rank(const ditrun_args *a, int rank)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_status st = DIT_OK;
    dit_comm *world = NULL;
    dit_mesh *mesh = NULL;
    dit_backend *be = NULL;
    dit_model *model = NULL;
    dit_runner *runner = NULL;
    dit_input_file *inputs = NULL;
    dit_lora *loras[DITRUN_MAX_LORA] = {0};
    float *out = NULL;
    const bool multi = a->pc.world_size > 1;
    const bool speak = rank == 0 && !a->quiet;

    if (multi)
        DIT_CHECK(ditrun_join_mesh(a, rank, &world, &mesh, &diag));
    dit_backend_config bcfg = {.kind = a->backend, .n_threads = a->threads, .device = 0};
    DIT_CHECK(dit_backend_create(&bcfg, &be, &diag));
    dit_shard shard = {.tp_degree = a->pc.tp_degree, .tp_rank = mesh ? dit_mesh_tp_rank(mesh) : 0};
    double t0 = ditrun_now_ms();
    DIT_CHECK(dit_model_load(be, a->model, &shard, &model, &diag));
    double t_load = ditrun_now_ms() - t0;
    t0 = ditrun_now_ms();
    DIT_CHECK(ditrun_attach_loras(a, be, dit_model_lora_sites(model), loras, &diag));
    const double t_lora = ditrun_now_ms() - t0;
    const dit_model_class *cls = model->cls;
    const void *cfg = dit_model_config(model);
    DIT_CHECK(dit_input_file_load(a->inputs, cls, cfg, &inputs, &diag));
    const dit_named_tensors *in = dit_input_file_inputs(inputs);
    DIT_CHECK(dit_runner_create(be, model, mesh, &runner, &diag));
    ditrun_fault fault;
    if (ditrun_fault_for_rank(rank, &fault))
        dit_runner_set_block_callback(runner, ditrun_fault_block, &fault);

    dit_tensor host_sample;
    DIT_CHECK(cls->output_shape(cfg, in, &host_sample, &diag));
    const size_t n_out = (size_t)dit_tensor_numel(&host_sample);
    out = malloc((n_out ? n_out : 1) * sizeof *out);
    if (!out) {
        st = dit_diag_set(&diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    host_sample.data = out;
    double best = INFINITY;
    for (int r = 0; r < a->repeat; r++) {
        if (world)
            DIT_CHECK(world->ops->barrier(world, &diag));
        double t1 = ditrun_now_ms();
        DIT_CHECK(dit_runner_forward(runner, in, &host_sample, &diag));
        double dt = ditrun_now_ms() - t1;
        best = dt < best ? dt : best;
    }
    if (rank != 0)
        goto cleanup;

    dit_st_write_item item = {.name = "sample", .tensor = &host_sample};
    DIT_CHECK(dit_st_write(a->output, &item, 1, &diag));
    if (speak) {
        double gflop = cls->forward_flops(cfg, in) / 1e9;
        dit_runner_stats rs = dit_runner_get_stats(runner);
        dit_model_summary sum = cls->summary(cfg);
        printf("model: %s (%s, %d heads x %d, %.1f MiB of weights%s, loaded in %.0f ms)\n",
               a->model, sum.blocks, sum.num_heads, sum.head_dim,
               (double)cls->weight_bytes(model->impl) / 1048576.0, multi ? " on rank 0" : "",
               t_load);
        for (int i = 0; i < a->n_lora; i++) {
            const dit_lora_info li = dit_lora_get_info(loras[i]);
            printf("lora: %s x %g (%d modules, rank up to %d, %.3f MiB%s; all loaded in %.0f "
                   "ms)\n",
                   a->lora_path[i], (double)a->lora_scale[i], li.n_modules, li.max_rank,
                   (double)li.bytes / 1048576.0, multi ? " on rank 0" : "", t_lora);
        }
        if (multi)
            printf("mesh: %d ranks = %sring %d x ulysses %d x tp %d%s; rank 0 sent %.3f MiB "
                   "(attention) + %.3f MiB (output gather), all-reduced %.3f MiB per forward\n",
                   a->pc.world_size, a->pc.cfg_degree > 1 ? "cfg 2 x " : "", a->pc.ring_degree,
                   a->pc.ulysses_degree, a->pc.tp_degree,
                   a->pc.ulysses_anything   ? ", ulysses_anything"
                   : a->pc.ring_anything    ? ", ring_anything"
                   : a->pc.unified_anything ? ", unified_anything"
                                            : "",
                   (double)rs.attention_bytes_sent / 1048576.0 / a->repeat,
                   (double)rs.gather_bytes / 1048576.0 / a->repeat,
                   (double)rs.tp_bytes_reduced / 1048576.0 / a->repeat);
        if (multi && a->pc.cfg_degree > 1)
            printf("cfg: rank 0 exchanged %llu bytes of output per forward (%s)\n",
                   (unsigned long long)(rs.cfg_bytes_gathered / (uint64_t)a->repeat),
                   rs.cfg_bytes_gathered ? "each group ran half of the batch"
                                         : "odd batch: both groups ran all of it");
        /* The sequences the context-parallel plan splits, last first (text
         * before image for FLUX, the order attention sees them). */
        const dit_parallel_req req = cls->parallel_req(cfg);
        int64_t lens[DIT_PARALLEL_MAX_SEQS];
        char seqs[256] = "";
        DIT_CHECK(dit_input_file_peek(a->inputs, cls, cfg, lens, &diag));
        for (int i = req.n_seqs - 1; i >= 0; i--)
            snprintf(seqs + strlen(seqs), sizeof seqs - strlen(seqs), "%s%lld %s",
                     i == req.n_seqs - 1 ? "" : " + ", (long long)lens[i], req.seq_names[i]);
        printf("forward: batch %lld, %s, %s backend: %.2f ms (%.3f GFLOP, %.1f GFLOP/s)%s\n",
               (long long)host_sample.ne[0], seqs, be->ops->name, best, gflop, gflop / (best / 1e3),
               a->repeat > 1 ? ", best of repeats" : "");
        printf("activation memory: %.2f MiB%s\n", (double)rs.activation_bytes / 1048576.0,
               multi ? " on rank 0" : "");
        char shape[96];
        dit_tensor_shape_str(&host_sample, shape, sizeof shape);
        printf("wrote %s: sample %s\n", a->output, shape);
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
        if (world)
            world->ops->abort(world);
    }
    free(out);
    dit_input_file_free(inputs);
    dit_runner_destroy(runner);
    dit_model_destroy(model);
    for (int i = 0; i < DITRUN_MAX_LORA; i++)
        dit_lora_destroy(loras[i]);
    dit_backend_destroy(be);
    dit_mesh_destroy(mesh);
    dit_comm_destroy(world);
    return st == DIT_OK ? 0 : 1;
}
