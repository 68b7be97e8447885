/* ditrun generate: prompt in, image or video out, through a whole pipeline
 * (FluxPipeline, WanPipeline). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "media/mp4.h"
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
            fputs("\ndecoding (VAE)...\n", stderr);
        fflush(stderr);
    }
    return DIT_OK;
}

typedef enum output_kind {
    OUT_PNG,
    OUT_MP4,
    OUT_SAFETENSORS,
    OUT_UNKNOWN,
} output_kind;

static bool has_suffix(const char *s, const char *suffix)
{
    const size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcasecmp(s + n - k, suffix) == 0;
}

static output_kind output_kind_of(const char *path)
{
    if (has_suffix(path, ".png"))
        return OUT_PNG;
    if (has_suffix(path, ".mp4"))
        return OUT_MP4;
    if (has_suffix(path, ".safetensors"))
        return OUT_SAFETENSORS;
    return OUT_UNKNOWN;
}

int ditrun_member_parse(const char *spec, ditrun_member *m, char *err, size_t cap)
{
    memset(m, 0, sizeof *m);
    m->guidance = m->true_cfg = NAN;
    if (strlen(spec) >= sizeof m->text) {
        snprintf(err, cap, "a member spec is at most %zu bytes", sizeof m->text - 1);
        return -1;
    }
    snprintf(m->text, sizeof m->text, "%s", spec);
    char *save = NULL;
    for (char *f = strtok_r(m->text, ";", &save); f; f = strtok_r(NULL, ";", &save)) {
        char *eq = strchr(f, '=');
        if (!eq) {
            snprintf(err, cap, "'%s' is not KEY=VALUE", f);
            return -1;
        }
        *eq = '\0';
        const char *k = f, *v = eq + 1;
        char *end = NULL;
        if (strcmp(k, "prompt") == 0) {
            m->prompt = v;
        } else if (strcmp(k, "prompt_2") == 0) {
            m->prompt_2 = v;
        } else if (strcmp(k, "negative_prompt") == 0) {
            m->negative_prompt = v;
        } else if (strcmp(k, "negative_prompt_2") == 0) {
            m->negative_prompt_2 = v;
        } else if (strcmp(k, "seed") == 0) {
            const unsigned long long x = strtoull(v, &end, 10);
            if (*v == '\0' || *v == '-' || *end != '\0')
                goto bad;
            m->seed = (uint64_t)x;
            m->has_seed = true;
        } else if (strcmp(k, "guidance") == 0 || strcmp(k, "true_cfg") == 0) {
            const double x = strtod(v, &end);
            if (*v == '\0' || *end != '\0' || !isfinite(x))
                goto bad;
            *(k[0] == 'g' ? &m->guidance : &m->true_cfg) = (float)x;
        } else if (strcmp(k, "num_images") == 0 || strcmp(k, "leave") == 0) {
            const long x = strtol(v, &end, 10);
            if (*v == '\0' || *end != '\0' || x < 1 || (k[0] == 'n' && x > DIT_GEN_MAX_IMAGES) ||
                x > 1000)
                goto bad;
            *(k[0] == 'n' ? &m->num_images : &m->leave) = (int)x;
        } else {
            snprintf(err, cap,
                     "unknown key '%s' (prompt, prompt_2, negative_prompt, negative_prompt_2, "
                     "seed, guidance, true_cfg, num_images, leave)",
                     k);
            return -1;
        }
        continue;
    bad:
        snprintf(err, cap, "%s=%s is not a valid value", k, v);
        return -1;
    }
    return 0;
}

/* The request of member k: the command line's with the member's fields. */
static dit_gen_params member_params(const ditrun_args *a, int k)
{
    const ditrun_member *m = &a->members[k];
    dit_gen_params gp = a->gen;
    if (m->prompt)
        gp.prompt = m->prompt;
    if (m->prompt_2)
        gp.prompt_2 = m->prompt_2;
    if (m->negative_prompt)
        gp.negative_prompt = m->negative_prompt;
    if (m->negative_prompt_2)
        gp.negative_prompt_2 = m->negative_prompt_2;
    if (m->has_seed)
        gp.seed = m->seed;
    if (!isnan(m->guidance))
        gp.guidance_scale = m->guidance;
    if (!isnan(m->true_cfg))
        gp.true_cfg_scale = m->true_cfg;
    if (m->num_images)
        gp.num_images = m->num_images;
    return gp;
}

int ditrun_generate_prepare(ditrun_args *a)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    dit_pipeline_info info;
    if (dit_pipeline_probe(a->model, &info, &diag) != DIT_OK) {
        fprintf(stderr, "ditrun generate: %s\n", dit_diag_msg(&diag));
        return 1;
    }
    dit_gen_apply_defaults(&info, &a->gen);
    char warning[256];
    const dit_gen_field_names names = {"--negative-prompt", "--true-cfg", "--guidance"};
    if (!a->quiet && dit_gen_warning(&info, &a->gen, &names, warning, sizeof warning))
        fprintf(stderr, "ditrun generate: warning: %s\n", warning);
    const output_kind k = output_kind_of(a->output);
    if (k == OUT_UNKNOWN) {
        fprintf(stderr,
                "ditrun generate: --output %s: name it .png (an image), .mp4 (a video) or "
                ".safetensors (the decoded f32 values)\n",
                a->output);
        return DITRUN_EXIT_USAGE;
    }
    if (k == OUT_PNG && a->gen.frames > 1) {
        fprintf(stderr,
                "ditrun generate: --output %s: a PNG holds one image, and this is a %d-frame "
                "video; write .mp4 or .safetensors (or ask for --frames 1)\n",
                a->output, a->gen.frames);
        return DITRUN_EXIT_USAGE;
    }
    if (k == OUT_MP4 && info.frame_step == 0) {
        fprintf(stderr,
                "ditrun generate: --output %s: %s makes images; write .png or .safetensors\n",
                a->output, info.class_name);
        return DITRUN_EXIT_USAGE;
    }
    return 0;
}

/* Reads 'latents' in the request's shape from a safetensors file as f32. */
static dit_status read_latents(const char *path, int ndim, const int64_t *shape, float **out,
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
    bool same = e->view.ndim == ndim;
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        same = same && e->view.ne[i] == shape[i];
        n *= shape[i];
    }
    if (!same) {
        char got[64], want[96] = "(";
        dit_tensor_shape_str(&e->view, got, sizeof got);
        for (int i = 0; i < ndim; i++)
            snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", i ? ", " : "",
                     (long long)shape[i]);
        snprintf(want + strlen(want), sizeof want - strlen(want), ")");
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                          "%s: 'latents' is %s; this request needs latents %s", path, got, want);
        goto cleanup;
    }
    *out = malloc(sizeof(float) * (size_t)n);
    if (!*out) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    dit_convert_to_f32(*out, e->view.data, e->view.dtype, (size_t)n);
cleanup:
    dit_st_file_close(f);
    return st;
}

/* Writes image m of the result in the output's format; *bytes_out: the
 * file's size. */
static dit_status write_image(const char *path, const dit_gen_params *gp, const dit_gen_result *res,
                              int m, size_t *bytes_out, dit_diag *diag)
{
    dit_gen_result one = *res;
    one.num_images = 1;
    one.image =
        res->image + (size_t)m * 3 * (size_t)res->frames * (size_t)res->height * (size_t)res->width;
    res = &one;
    dit_status st = DIT_OK;
    uint8_t *bytes = NULL;
    size_t len = 0;
    switch (output_kind_of(path)) {
    case OUT_PNG:
        DIT_CHECK(dit_png_encode_rgb(res->image, res->height, res->width, &bytes, &len, diag));
        DIT_CHECK(dit_png_write_file(path, bytes, len, diag));
        break;
    case OUT_MP4:
        DIT_CHECK(dit_mp4_encode(res->image, res->frames, res->height, res->width, gp->fps, &bytes,
                                 &len, diag));
        DIT_CHECK(dit_png_write_file(path, bytes, len, diag)); /* an atomic write of any bytes */
        break;
    case OUT_SAFETENSORS: {
        const bool video = res->frames > 1 || gp->frames > 1;
        const int64_t vs[4] = {3, res->frames, res->height, res->width};
        const int64_t is[3] = {3, res->height, res->width};
        const dit_tensor t = video ? dit_tensor_make(res->image, DIT_F32, 4, vs)
                                   : dit_tensor_make(res->image, DIT_F32, 3, is);
        dit_st_write_item item = {.name = video ? "video" : "image", .tensor = &t};
        DIT_CHECK(dit_st_write(path, &item, 1, diag));
        len = dit_tensor_nbytes(&t);
        break;
    }
    default:
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: unknown output format", path);
    }
    *bytes_out = len;
cleanup:
    free(bytes);
    return st;
}

/* FILE.ext -> FILE_m.ext (the extension from the last dot after the last
 * slash). */
static void indexed_path(const char *path, int m, char *out, size_t cap)
{
    const char *slash = strrchr(path, '/');
    const char *dot = strrchr(path, '.');
    if (!dot || (slash && dot < slash))
        dot = path + strlen(path);
    snprintf(out, cap, "%.*s_%d%s", (int)(dot - path), path, m, dot);
}

/* The result's images: one file as before for one image; for n, one stacked
 * (n, 3, [F,] H, W) tensor in a .safetensors, else FILE_0.ext .. FILE_{n-1}.ext.
 * *bytes_out: the bytes written in all. */
static dit_status write_output(const char *path, const dit_gen_params *gp,
                               const dit_gen_result *res, size_t *bytes_out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    const int n = res->num_images > 1 ? res->num_images : 1;
    if (n == 1)
        return write_image(path, gp, res, 0, bytes_out, diag);
    *bytes_out = 0;
    if (output_kind_of(path) == OUT_SAFETENSORS) {
        const bool video = res->frames > 1 || gp->frames > 1;
        const int64_t vs[5] = {n, 3, res->frames, res->height, res->width};
        const int64_t is[4] = {n, 3, res->height, res->width};
        const dit_tensor t = video ? dit_tensor_make(res->image, DIT_F32, 5, vs)
                                   : dit_tensor_make(res->image, DIT_F32, 4, is);
        dit_st_write_item item = {.name = video ? "video" : "image", .tensor = &t};
        DIT_CHECK(dit_st_write(path, &item, 1, diag));
        *bytes_out = dit_tensor_nbytes(&t);
        return DIT_OK;
    }
    for (int m = 0; m < n; m++) {
        char one[4096];
        size_t len = 0;
        indexed_path(path, m, one, sizeof one);
        DIT_CHECK(write_image(one, gp, res, m, &len, diag));
        *bytes_out += len;
    }
cleanup:
    return st;
}

typedef struct batch_progress {
    progress_state ps;
    const ditrun_args *a;
} batch_progress;

/* Progress, and leave=K: member k leaves after step K on every rank. */
static dit_status batch_step(void *ctx, int step, int total, double elapsed_ms, bool *active)
{
    const batch_progress *bp = ctx;
    for (int k = 0; k < bp->a->n_members; k++)
        if (bp->a->members[k].leave == step)
            active[k] = false;
    return show_progress((void *)&bp->ps, step, total, elapsed_ms);
}

/* --member: the batch in the same forwards, member k's outputs in
 * FILE_k.ext and LATENTS_k.safetensors (rank 0). */
static dit_status generate_batch(const ditrun_args *a, dit_pipeline *pipe, const dit_denoiser *den,
                                 bool lead, dit_diag *diag)
{
    dit_status st = DIT_OK;
    const int n = a->n_members;
    const dit_pipeline_info *info = dit_pipeline_get_info(pipe);
    dit_gen_params gps[DITRUN_MAX_MEMBERS];
    dit_gen_result res[DITRUN_MAX_MEMBERS];
    dit_status mst[DITRUN_MAX_MEMBERS];
    dit_gen_decode decode[DITRUN_MAX_MEMBERS]; /* rank 0 decodes and writes every image */
    memset(res, 0, sizeof res);
    for (int k = 0; k < n; k++) {
        decode[k] = lead ? DIT_GEN_DECODE_ALL : 0;
        gps[k] = member_params(a, k);
        dit_gen_apply_defaults(info, &gps[k]);
    }
    batch_progress bp = {.ps = {.show = lead && !a->quiet && isatty(STDERR_FILENO)}, .a = a};
    DIT_CHECK(
        dit_pipeline_generate_batch(pipe, den, n, gps, decode, batch_step, &bp, res, mst, diag));
    if (!lead)
        goto cleanup;
    double denoise_ms = 0, step_min = 0, step_max = 0;
    for (int k = 0; k < n; k++) {
        char path[4096];
        size_t len = 0;
        if (mst[k] != DIT_OK) {
            if (!a->quiet)
                printf("member %d: left the batch after step %d (%s)\n", k, a->members[k].leave,
                       dit_status_str(mst[k]));
            continue;
        }
        if (a->output_latents) {
            indexed_path(a->output_latents, k, path, sizeof path);
            dit_tensor lt =
                dit_tensor_make(res[k].latents, DIT_F32, res[k].latents_ndim, res[k].latents_shape);
            dit_st_write_item item = {.name = "latents", .tensor = &lt};
            DIT_CHECK(dit_st_write(path, &item, 1, diag));
        }
        indexed_path(a->output, k, path, sizeof path);
        DIT_CHECK(write_output(path, &gps[k], &res[k], &len, diag));
        denoise_ms = res[k].denoise_ms;
        step_min = res[k].step_ms_min;
        step_max = res[k].step_ms_max;
        /* Several images are written as PATH_0.ext .. (write_output). */
        char first[4096], last[4096];
        indexed_path(path, 0, first, sizeof first);
        indexed_path(path, res[k].num_images - 1, last, sizeof last);
        if (!a->quiet)
            printf("member %d: %d image%s, seed %llu, guidance %.2f, true cfg %.2f: wrote %s%s%s "
                   "(%zu bytes; text encoders %.1f ms, VAE %.1f ms)\n",
                   k, res[k].num_images, res[k].num_images > 1 ? "s" : "",
                   (unsigned long long)gps[k].seed, gps[k].guidance_scale, gps[k].true_cfg_scale,
                   res[k].num_images > 1 ? first : path, res[k].num_images > 1 ? " .. " : "",
                   res[k].num_images > 1 ? last : "", len, res[k].encode_ms, res[k].vae_ms);
    }
    if (!a->quiet)
        printf("batch of %d: %dx%d, %d steps, denoising %.1f ms (%.1f to %.1f ms per step)\n", n,
               gps[0].width, gps[0].height, gps[0].steps, denoise_ms, step_min, step_max);
cleanup:
    for (int k = 0; k < n; k++)
        dit_gen_result_free(&res[k]);
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
    dit_lora *loras[DITRUN_MAX_LORA] = {0};
    size_t out_len = 0;
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
    DIT_CHECK(ditrun_attach_loras(a, be, dit_model_lora_sites(dit_pipeline_transformer(pipe)),
                                  loras, &diag));

    dit_gen_params gp = a->gen;
    dit_gen_apply_defaults(info, &gp);
    if (a->latents_path) {
        /* The shape depends on the sizes: check them first. */
        DIT_CHECK(dit_gen_check(info, &gp, &diag));
        int64_t shape[5];
        const int nd = dit_gen_latents_shape(info, &gp, shape);
        shape[0] = dit_gen_num_images(&gp);
        DIT_CHECK(read_latents(a->latents_path, nd, shape, &latents, &diag));
        gp.latents = latents;
    }
    DIT_CHECK(dit_runner_create(be, dit_pipeline_transformer(pipe), mesh, &runner, &diag));
    ditrun_fault fault;
    if (ditrun_fault_for_rank(rank, &fault))
        dit_runner_set_block_callback(runner, ditrun_fault_block, &fault);

    progress_state ps = {.show = lead && !a->quiet && isatty(STDERR_FILENO)};
    const dit_denoiser den = dit_runner_denoiser(runner);
    if (a->n_members > 0) {
        DIT_CHECK(generate_batch(a, pipe, &den, lead, &diag));
        goto cleanup;
    }
    DIT_CHECK(dit_pipeline_generate(pipe, &den, &gp, lead, show_progress, &ps, &res, &diag));
    if (!lead)
        goto cleanup;

    if (a->output_latents) {
        dit_tensor lt = dit_tensor_make(res.latents, DIT_F32, res.latents_ndim, res.latents_shape);
        dit_st_write_item item = {.name = "latents", .tensor = &lt};
        DIT_CHECK(dit_st_write(a->output_latents, &item, 1, &diag));
    }
    t0 = ditrun_now_ms();
    DIT_CHECK(write_output(a->output, &gp, &res, &out_len, &diag));
    const double t_out = ditrun_now_ms() - t0;
    if (!a->quiet) {
        const dit_model *tm = dit_pipeline_transformer(pipe);
        const dit_model_summary sum = tm->cls->summary(dit_model_config(tm));
        printf("pipeline: %s (transformer %s, hidden %d; loaded in %.0f ms)\n", a->model,
               sum.blocks, info->transformer.inner_dim, t_load);
        for (int i = 0; i < a->n_lora; i++)
            printf("lora: %s x %g (%d modules)\n", a->lora_path[i], (double)a->lora_scale[i],
                   dit_lora_get_info(loras[i]).n_modules);
        if (multi)
            printf("mesh: %d ranks = %sring %d x ulysses %d x tp %d\n", a->pc.world_size,
                   a->pc.cfg_degree > 1 ? "cfg 2 x " : "", a->pc.ring_degree, a->pc.ulysses_degree,
                   a->pc.tp_degree);
        char frames[48] = "";
        if (res.frames > 1)
            snprintf(frames, sizeof frames, ", %d frames at %d fps", res.frames, gp.fps);
        printf("generated %dx%d%s, %d steps, seed %llu, guidance %.2f%s%s\n", res.width, res.height,
               frames, gp.steps, (unsigned long long)gp.seed, gp.guidance_scale,
               gp.latents ? ", initial latents from file" : "",
               res.prompt_truncated ? "; the prompt was truncated to the tokenizers' limit" : "");
        printf("time: tokenize %.1f ms, text encoders %.1f ms, denoising %.1f ms (%.1f to %.1f "
               "ms per step), VAE decode %.1f ms, writing %.1f ms\n",
               res.tokenize_ms, res.encode_ms, res.denoise_ms, res.step_ms_min, res.step_ms_max,
               res.vae_ms, t_out);
        char what[4200];
        if (res.num_images > 1 && output_kind_of(a->output) != OUT_SAFETENSORS) {
            char first[2048], last[2048];
            indexed_path(a->output, 0, first, sizeof first);
            indexed_path(a->output, res.num_images - 1, last, sizeof last);
            snprintf(what, sizeof what, "%d images, %s .. %s", res.num_images, first, last);
        } else {
            snprintf(what, sizeof what, "%s", a->output);
        }
        printf("wrote %s (%zu bytes)%s%s\n", what, out_len, a->output_latents ? " and " : "",
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
    free(latents);
    dit_gen_result_free(&res);
    dit_runner_destroy(runner);
    dit_pipeline_free(pipe);
    for (int i = 0; i < DITRUN_MAX_LORA; i++)
        dit_lora_destroy(loras[i]);
    dit_backend_destroy(be);
    dit_mesh_destroy(mesh);
    dit_comm_destroy(world);
    return st == DIT_OK ? 0 : 1;
}
