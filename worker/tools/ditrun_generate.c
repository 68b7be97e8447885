/* ditrun generate: prompt in, PNG out, through the whole FluxPipeline. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "media/png.h"
#include "loader/safetensors.h"
#include "pipelines/pipeline.h"
#include "runtime/runner.h"
#include "tools/ditrun.h"

typedef struct progress_state {
    bool show;
} progress_state;

static dit_status show_progress(void *ctx, int step, int total, double elapsed_ms)
{
    const progress_state *ps = ctx;
    if (ps->show) {
        const double rate = elapsed_ms > 0 ? step / (elapsed_ms / 1e3) : 0;
        fprintf(stderr, "\r\033[Kstep %d/%d  %.1f s", step, total, elapsed_ms / 1e3);
        /* Slow steps read better as seconds per step. */
        if (rate >= 1.0)
            fprintf(stderr, "  %.2f steps/s, ETA %.1f s", rate, (total - step) / rate);
        else if (rate > 0)
            fprintf(stderr, "  %.2f s/step, ETA %.1f s", 1.0 / rate, (total - step) / rate);
        /* The pipeline decodes right after the last step's callback. */
        if (step == total)
            fputs("\ndecoding the image (VAE)...\n", stderr);
        fflush(stderr);
    }
    return DIT_OK;
}

/* Reads 'latents' (1, tokens, dim) from a safetensors file as f32. */
static dit_status read_latents(const char *path, int64_t tokens, int64_t dim, float **out,
                               dit_diag *diag)
{
    dit_st_file *f = NULL;
    dit_status st = dit_st_file_open(path, &f, diag);
    if (st != DIT_OK)
        return st;
    const dit_st_entry *e = dit_st_file_find(f, "latents");
    if (!e) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: no tensor named 'latents'", path);
        goto cleanup;
    }
    if (e->view.ndim != 3 || e->view.ne[0] != 1 || e->view.ne[1] != tokens ||
        e->view.ne[2] != dim) {
        char got[64];
        dit_tensor_shape_str(&e->view, got, sizeof got);
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                          "%s: 'latents' is %s; this size needs packed latents (1, %lld, %lld)",
                          path, got, (long long)tokens, (long long)dim);
        goto cleanup;
    }
    *out = malloc(sizeof(float) * (size_t)(tokens * dim));
    if (!*out) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    dit_convert_to_f32(*out, e->view.data, e->view.dtype, (size_t)(tokens * dim));
cleanup:
    dit_st_file_close(f);
    return st;
}

int ditrun_generate_rank(const ditrun_args *a, int rank)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_status st = DIT_OK;
    dit_comm *world = NULL;
    dit_mesh *mesh = NULL;
    dit_backend *be = NULL;
    dit_pipeline *pipe = NULL;
    dit_runner *runner = NULL;
    float *latents = NULL;
    uint8_t *png = NULL;
    size_t png_len = 0;
    dit_gen_result res;
    memset(&res, 0, sizeof res);
    const bool multi = a->pc.world_size > 1;
    const bool lead = rank == 0;

    if (multi)
        DIT_CHECK(ditrun_join_mesh(a, rank, &world, &mesh, &diag));
    dit_backend_config bcfg = {.kind = a->backend, .n_threads = a->threads, .device = 0};
    DIT_CHECK(dit_backend_create(&bcfg, &be, &diag));
    dit_shard shard = {.tp_degree = a->pc.tp_degree, .tp_rank = mesh ? dit_mesh_tp_rank(mesh) : 0};
    double t0 = ditrun_now_ms();
    DIT_CHECK(dit_pipeline_load(be, a->model, &shard, lead, &pipe, &diag));
    const double t_load = ditrun_now_ms() - t0;
    const dit_pipeline_info *info = dit_pipeline_get_info(pipe);

    dit_gen_params gp = a->gen;
    if (a->latents_path) {
        const int s = info->size_multiple;
        const int64_t tokens = (int64_t)(gp.height / s) * (gp.width / s);
        DIT_CHECK(read_latents(a->latents_path, tokens, info->latent_dim, &latents, &diag));
        gp.latents = latents;
    }
    DIT_CHECK(dit_runner_create(be, dit_pipeline_transformer(pipe), mesh, &runner, &diag));
    ditrun_fault fault;
    if (ditrun_fault_for_rank(rank, &fault))
        dit_runner_set_block_callback(runner, ditrun_fault_block, &fault);

    progress_state ps = {.show = lead && !a->quiet && isatty(STDERR_FILENO)};
    const dit_denoiser den = dit_runner_denoiser(runner);
    DIT_CHECK(dit_pipeline_generate(pipe, &den, &gp, lead, show_progress, &ps, &res, &diag));
    if (!lead)
        goto cleanup;

    if (a->output_latents) {
        dit_tensor lt = dit_tensor_3d(res.latents, DIT_F32, 1, res.latent_tokens, res.latent_dim);
        dit_st_write_item item = {.name = "latents", .tensor = &lt};
        DIT_CHECK(dit_st_write(a->output_latents, &item, 1, &diag));
    }
    t0 = ditrun_now_ms();
    DIT_CHECK(dit_png_encode_rgb(res.image, res.height, res.width, &png, &png_len, &diag));
    const double t_png = ditrun_now_ms() - t0;
    DIT_CHECK(dit_png_write_file(a->output, png, png_len, &diag));
    if (!a->quiet) {
        const dit_model *tm = dit_pipeline_transformer(pipe);
        const dit_model_summary sum = tm->cls->summary(dit_model_config(tm));
        printf("pipeline: %s (transformer %s, hidden %d; loaded in %.0f ms)\n", a->model,
               sum.blocks, info->transformer.inner_dim, t_load);
        if (multi)
            printf("mesh: %d ranks = ring %d x ulysses %d x tp %d\n", a->pc.world_size,
                   a->pc.ring_degree, a->pc.ulysses_degree, a->pc.tp_degree);
        printf("generated %dx%d, %d steps, seed %llu, guidance %.2f%s%s\n", res.width, res.height,
               gp.steps, (unsigned long long)gp.seed, gp.guidance_scale,
               gp.latents ? ", initial latents from file" : "",
               res.prompt_truncated ? "; the prompt was truncated to the tokenizers' limit" : "");
        printf("time: tokenize %.1f ms, text encoders %.1f ms, denoising %.1f ms (%.1f to %.1f "
               "ms per step), VAE decode %.1f ms, PNG %.1f ms\n",
               res.tokenize_ms, res.encode_ms, res.denoise_ms, res.step_ms_min, res.step_ms_max,
               res.vae_ms, t_png);
        printf("wrote %s (%zu bytes)%s%s\n", a->output, png_len, a->output_latents ? " and " : "",
               a->output_latents ? a->output_latents : "");
    }
cleanup:
    if (st != DIT_OK) {
        if (multi)
            fprintf(stderr, "ditrun generate: rank %d: %s\n", rank, dit_diag_msg(&diag));
        else
            fprintf(stderr, "ditrun generate: %s\n", dit_diag_msg(&diag));
        if (world)
            world->ops->abort(world);
    }
    free(png);
    free(latents);
    dit_gen_result_free(&res);
    dit_runner_destroy(runner);
    dit_pipeline_free(pipe);
    dit_backend_destroy(be);
    dit_mesh_destroy(mesh);
    dit_comm_destroy(world);
    return st == DIT_OK ? 0 : 1;
}
