/* ditrun: runs the worker's compute code without the daemon.
 *
 *   ditrun forward  --model DIR --inputs IN.safetensors --output OUT.safetensors
 *   ditrun generate --model PIPELINE_DIR --prompt TEXT -o out.png|out.mp4
 *
 * With --world-size N > 1 it creates a shared-memory mesh, starts N rank
 * processes of itself (the same code a daemon worker runs), and reports rank
 * 0's result; any failing rank fails the run with that rank's message. It is
 * the tool for tests, benchmarks and debugging. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/shm/comm_shm.h"
#include "backend/cpu/cpu_backend.h"
#include "core/cli_util.h"
#include "core/options.h"
#include "tools/ditrun.h"

static const char *const exit_help =
    "Parallelism: --world-size, --ring, --ulysses and --tp have the meaning of diffusers'\n"
    "ContextParallelConfig / TensorParallelConfig (R x U x T must equal N; CP and TP\n"
    "combine); --cfg-parallel runs the two halves of a CFG batch on two groups of\n"
    "R x U x T ranks (2 x R x U x T must equal N). Ranks are separate processes\n"
    "meeting in shared memory.\n"
    "\n"
    "Exit status: 0 on success, 1 when the model or inputs cannot be used or a rank\n"
    "fails, 2 on bad command-line arguments, an invalid request or parallel layout.\n";

static const char *const forward_usage =
    "usage: ditrun forward --model DIR --inputs IN.safetensors --output OUT.safetensors\n"
    "                      [--backend cpu|cuda] [--threads N] [--repeat N]\n"
    "                      [--compare FILE] [--lora PATH[:SCALE]]... [--fuse-lora]\n"
    "                      [--quiet] [parallel options]\n"
    "\n"
    "Runs one transformer forward pass (FluxTransformer2DModel or WanTransformer3DModel,\n"
    "by config.json's _class_name), as diffusers' model(...) would. --inputs holds the\n"
    "forward arguments, named as diffusers names them, in f32, bf16 or f16.\n"
    "FLUX: hidden_states (B, S_img, in_channels), encoder_hidden_states (B, S_txt,\n"
    "joint_attention_dim), pooled_projections (B, pooled_projection_dim), timestep (B),\n"
    "img_ids (S_img, n_axes), txt_ids (S_txt, n_axes), and guidance (B) when the config\n"
    "has guidance_embeds; --output holds 'sample' (B, S_img, out_dim) in f32.\n"
    "Wan: hidden_states (B, in_channels, F, H, W), timestep (B), encoder_hidden_states\n"
    "(B, S_txt, text_dim); --output holds 'sample' (B, out_channels, F, H, W) in f32.\n";

static const char *const generate_usage =
    "usage: ditrun generate --model PIPELINE_DIR --prompt TEXT --output OUT\n"
    "                       [--prompt-2 TEXT] [--negative-prompt TEXT]\n"
    "                       [--negative-prompt-2 TEXT] [--width W] [--height H]\n"
    "                       [--frames F] [--fps N] [--steps N] [--guidance G]\n"
    "                       [--true-cfg S] [--seed N] [--max-sequence-length N]\n"
    "                       [--latents FILE] [--output-latents FILE]\n"
    "                       [--backend cpu|cuda] [--threads N] [--quiet]\n"
    "                       [--lora PATH[:SCALE]]... [--fuse-lora]\n"
    "                       [--member 'KEY=VALUE;...']... [parallel options]\n"
    "\n"
    "Text to image (FluxPipeline) or text to video (WanPipeline) with a diffusers\n"
    "pipeline folder, as pipe(prompt, ...) would. Sizes, frames, steps, guidance and\n"
    "text length default to the pipeline's own defaults (FLUX: 1024x1024, 28 steps,\n"
    "guidance 3.5; Wan 2.1: 832x480, 81 frames at 16 fps, 50 steps, guidance 5).\n"
    "--output by extension: .png (an image, or one frame), .mp4 (H.264 video),\n"
    ".safetensors (the decoded f32 values: 'image' (3, H, W) or 'video' (3, F, H, W)).\n"
    "Longer prompts are truncated to the tokenizers' limits (--max-sequence-length\n"
    "T5/UMT5 tokens), as diffusers does. A progress line per step (with steps/s and\n"
    "the time left) and the VAE decode are shown when stderr is a terminal.\n"
    "\n"
    "Batching: each --member 'prompt=a cat;seed=3;guidance=4' adds a request that\n"
    "runs in the same transformer forwards as the others (as ditd --max-batch does):\n"
    "the command line's request with those fields changed (';' separates fields, so\n"
    "a prompt cannot hold one). Member k writes FILE_k.ext (and --output-latents\n"
    "LAT_k.safetensors); leave=K makes member k leave the batch after step K.\n";

static const char *const main_usage =
    "usage: ditrun <command> [options]\n"
    "\n"
    "Commands:\n"
    "  forward    one transformer forward pass from a safetensors file of inputs\n"
    "  generate   text to image (FluxPipeline) or video (WanPipeline): PNG, MP4, f32\n"
    "\n"
    "Options:\n"
    "  --help      show this help (ditrun <command> --help for a command's options)\n"
    "  --version   print the version, the backends built in and the cpu kernel sets\n";

static int usage_error(const char *usage, const char *fmt, const char *arg)
{
    fprintf(stderr, "ditrun: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n\n%s", usage);
    return DITRUN_EXIT_USAGE;
}

/* The command line as the tables fill it, before it becomes ditrun_args. */
typedef struct raw_args {
    const char *model, *inputs, *output, *backend, *compare, *mesh_shm;
    const char *prompt, *prompt_2, *neg, *neg_2, *latents, *output_latents;
    long long threads, repeat, world, ring, ulysses, tp, comm_timeout, mesh_rank;
    long long width, height, frames, fps, steps, max_seq, num_images;
    double guidance, true_cfg;
    uint64_t seed;
    bool quiet, uany, rany, unany, nofp32, cfgpar, fuse_lora, cfg_two_pass;
    const char *lora[DITRUN_MAX_LORA];
    int n_lora;
    bool lora_overflow;
    const char *member[DITRUN_MAX_MEMBERS];
    int n_member;
} raw_args;

static int set_member(void *target, const char *val, char *err, size_t cap)
{
    raw_args *r = target;
    if (r->n_member == DITRUN_MAX_MEMBERS) {
        snprintf(err, cap, "takes at most %d members", DITRUN_MAX_MEMBERS);
        return -1;
    }
    ditrun_member scratch;
    if (ditrun_member_parse(val, &scratch, err, cap) != 0)
        return -1;
    r->member[r->n_member++] = val;
    return 0;
}

static int set_lora(void *target, const char *val, char *err, size_t cap)
{
    raw_args *r = target;
    if (r->n_lora == DITRUN_MAX_LORA) {
        snprintf(err, cap, "takes at most %d adapters", DITRUN_MAX_LORA);
        return -1;
    }
    if (*val == '\0') {
        snprintf(err, cap, "wants PATH[:SCALE], not ''");
        return -1;
    }
    r->lora[r->n_lora++] = val;
    return 0;
}

/* PATH[:SCALE]: a suffix after the last ':' that reads as a finite number
 * is the scale (1 without one). */
static void split_lora(const char *spec, char *path, size_t cap, float *scale)
{
    snprintf(path, cap, "%s", spec);
    *scale = 1.0f;
    char *colon = strrchr(path, ':');
    if (!colon || colon == path)
        return;
    char *end;
    const double v = strtod(colon + 1, &end);
    if (colon[1] != '\0' && *end == '\0' && isfinite(v)) {
        *scale = (float)v;
        *colon = '\0';
    }
}

static int set_seed(void *target, const char *val, char *err, size_t cap)
{
    char *end;
    errno = 0;
    const unsigned long long v = strtoull(val, &end, 10);
    if (*val == '-' || *val == '\0' || *end != '\0' || errno) {
        snprintf(err, cap, "wants a non-negative integer, not '%s'", val);
        return -1;
    }
    ((raw_args *)target)->seed = (uint64_t)v;
    return 0;
}

/* A finite number; its range is the pipeline's to check (with its own
 * message). */
static int set_number(double *out, const char *val, char *err, size_t cap)
{
    char *end;
    const double v = strtod(val, &end);
    if (*val == '\0' || *end != '\0' || !isfinite(v)) {
        snprintf(err, cap, "wants a number, not '%s'", val);
        return -1;
    }
    *out = v;
    return 0;
}

static int set_guidance(void *target, const char *val, char *err, size_t cap)
{
    return set_number(&((raw_args *)target)->guidance, val, err, cap);
}

static int set_true_cfg(void *target, const char *val, char *err, size_t cap)
{
    return set_number(&((raw_args *)target)->true_cfg, val, err, cap);
}

#define ROFF(f) offsetof(raw_args, f)
#define R_STR(name, sh, arg, help, f)                                                              \
    {                                                                                              \
        name, sh, DIT_OPT_STRING, NULL, arg, help, NULL, ROFF(f), 0, 0, NULL, false                \
    }
#define R_INT(name, sh, def, arg, help, f, lo, hi)                                                 \
    {                                                                                              \
        name, sh, DIT_OPT_INT, def, arg, help, NULL, ROFF(f), lo, hi, NULL, false                  \
    }
#define R_FLAG(name, sh, help, f)                                                                  \
    {                                                                                              \
        name, sh, DIT_OPT_FLAG, NULL, NULL, help, NULL, ROFF(f), 0, 0, NULL, false                 \
    }

/* Sizes, steps and the T5 length are only "integers" here (-1000000 to
 * 1000000), degrees likewise (-1000 to 1000): the pipeline and the layout
 * check their ranges, with messages that explain the rule. */
#define COMMON_OPTS(model_help, output_help)                                                       \
    R_STR("model", 'm', "DIR", model_help, model),                                                 \
        R_STR("output", 'o', "FILE", output_help, output), {"backend",                             \
                                                            'b',                                   \
                                                            DIT_OPT_STRING,                        \
                                                            "cpu",                                 \
                                                            "cpu|cuda",                            \
                                                            "compute backend",                     \
                                                            NULL,                                  \
                                                            ROFF(backend),                         \
                                                            0,                                     \
                                                            0,                                     \
                                                            NULL,                                  \
                                                            false},                                \
        R_INT("threads", 't', NULL, "N",                                                           \
              "cpu threads per rank (default: online cores / world size)", threads, 1, 4096),      \
        R_FLAG("quiet", 'q', "print nothing on success", quiet)

#define PARALLEL_OPTS                                                                              \
    R_INT("world-size", 0, "1", "N", "number of rank processes", world, 1, DIT_SHM_MAX_RANKS),     \
        R_INT("ring", 0, "1", "R", "ring_degree: ring attention over R sequence chunks", ring,     \
              -1000, 1000),                                                                        \
        R_INT("ulysses", 0, "1", "U", "ulysses_degree: all-to-all between sequence and heads",     \
              ulysses, -1000, 1000),                                                               \
        R_INT("tp", 0, "1", "T", "tp_degree: tensor parallelism over heads and MLP columns", tp,   \
              -1000, 1000),                                                                        \
        R_FLAG("ulysses-anything", 0,                                                              \
               "uneven sequence chunks and heads not divisible by U (R = 1)", uany),               \
        R_FLAG("ring-anything", 0, "uneven sequence chunks (U = 1)", rany),                        \
        R_FLAG("cfg-parallel", 0,                                                                  \
               "cfg_degree 2: the conditional and unconditional halves of a CFG batch on two "     \
               "groups of N/2 ranks",                                                              \
               cfgpar),                                                                            \
        R_FLAG("unified-anything", 0, "uneven chunks and heads with R > 1 and U > 1", unany),      \
        R_FLAG("no-fp32-merge", 0,                                                                 \
               "convert_to_fp32=False: merge ring partials in the activation dtype (the cpu "      \
               "backend computes in f32 either way)",                                              \
               nofp32),                                                                            \
        R_INT("comm-timeout", 0, "60", "S", "seconds a rank waits for its peers before failing",   \
              comm_timeout, 1, 86400), /* Set by the launcher for the rank processes it starts. */ \
        {"mesh-rank",     0,  DIT_OPT_INT,           "-1", "R", "this process's rank", NULL,       \
         ROFF(mesh_rank), -1, DIT_SHM_MAX_RANKS - 1, NULL, true},                                  \
    {                                                                                              \
        "mesh-shm", 0, DIT_OPT_STRING, NULL, "NAME", "the mesh's segment", NULL, ROFF(mesh_shm),   \
            0, 0, NULL, true                                                                       \
    }

#define LORA_OPT                                                                                   \
    {"lora",                                                                                       \
     0,                                                                                            \
     DIT_OPT_CUSTOM,                                                                               \
     NULL,                                                                                         \
     "PATH[:SCALE]",                                                                               \
     "a LoRA adapter (diffusers/PEFT or kohya safetensors) for the transformer, times "            \
     "SCALE (default 1); repeat for several",                                                      \
     NULL,                                                                                         \
     0,                                                                                            \
     0,                                                                                            \
     0,                                                                                            \
     set_lora,                                                                                     \
     false},                                                                                       \
        R_FLAG("fuse-lora", 0,                                                                     \
               "merge the --lora adapters into the weights at load (full speed; the base weights " \
               "are rewritten for this run)",                                                      \
               fuse_lora)

#define FORWARD_OPTS                                                                               \
    R_STR("inputs", 'i', "FILE", "safetensors with the forward arguments (see above)", inputs),    \
        R_INT("repeat", 'r', "1", "N", "run the forward N times and report the fastest", repeat,   \
              1, 100000),                                                                          \
        R_STR(                                                                                     \
            "compare", 'c', "FILE",                                                                \
            "also compare 'sample' with the tensor of that name in FILE (e.g. diffusers' output) " \
            "and print the difference",                                                            \
            compare)

#define GENERATE_OPTS                                                                              \
    R_STR("prompt", 0, "TEXT", "the prompt (CLIP, and T5 unless --prompt-2); may be empty",        \
          prompt),                                                                                 \
        R_STR("prompt-2", 0, "TEXT", "a different prompt for T5", prompt_2),                       \
        R_STR("negative-prompt", 0, "TEXT",                                                        \
              "with --true-cfg above 1: true classifier-free guidance (both sides in one batch-2 " \
              "transformer pass per step; either one alone has no effect, and ditrun warns)",      \
              neg),                                                                                \
        R_STR("negative-prompt-2", 0, "TEXT", "a different negative prompt for T5", neg_2),        \
        R_INT("width", 0, NULL, "W", "pixels, a multiple of 16 (default: the pipeline's)", width,  \
              -1000000, 1000000),                                                                  \
        R_INT("height", 0, NULL, "H", "pixels, a multiple of 16 (default: the pipeline's)",        \
              height, -1000000, 1000000),                                                          \
        R_INT("frames", 0, NULL, "F",                                                              \
              "video frames, 4 k + 1 for Wan (default: the pipeline's, 1 for images)", frames,     \
              -1000000, 1000000),                                                                  \
        R_INT("fps", 0, NULL, "N", "video frames per second, 1 to 240 (default: the pipeline's)",  \
              fps, -1000000, 1000000),                                                             \
        R_INT("steps", 0, NULL, "N", "denoising steps, 1 to 1000 (default: the pipeline's)",       \
              steps, -1000000, 1000000),                                                           \
        {"guidance",                                                                               \
         0,                                                                                        \
         DIT_OPT_CUSTOM,                                                                           \
         NULL,                                                                                     \
         "G",                                                                                      \
         "FLUX: distilled guidance scale; Wan: classifier-free guidance above 1 (default: the "    \
         "pipeline's)",                                                                            \
         NULL,                                                                                     \
         0,                                                                                        \
         0,                                                                                        \
         0,                                                                                        \
         set_guidance,                                                                             \
         false},                                                                                   \
        {"true-cfg", 0, DIT_OPT_CUSTOM, "1",  "S", "true CFG scale (1: off)", NULL, 0,             \
         0,          0, set_true_cfg,   false},                                                    \
        {"seed",                                                                                   \
         0,                                                                                        \
         DIT_OPT_CUSTOM,                                                                           \
         "0",                                                                                      \
         "N",                                                                                      \
         "noise seed; the same seed gives the same noise as "                                      \
         "torch.Generator('cpu').manual_seed(N) "                                                  \
         "in diffusers",                                                                           \
         NULL,                                                                                     \
         0,                                                                                        \
         0,                                                                                        \
         0,                                                                                        \
         set_seed,                                                                                 \
         false},                                                                                   \
        R_INT("max-sequence-length", 0, NULL, "N", "T5 / UMT5 tokens, 1 to 512 (default 512)",     \
              max_seq, -1000000, 1000000),                                                         \
        R_STR("latents", 0, "FILE",                                                                \
              "initial latents (tensor 'latents': FLUX (1, tokens, 4C) packed, Wan (1, C, F', "    \
              "H/8, W/8)) instead of noise from the seed",                                         \
              latents),                                                                            \
        R_STR("output-latents", 0, "FILE", "also write the final latents (tensor 'latents')",      \
              output_latents),                                                                     \
        R_FLAG("cfg-two-pass", 0,                                                                  \
               "CFG as two transformer passes per step (conditional, unconditional) instead of "   \
               "one of batch 2",                                                                   \
               cfg_two_pass),                                                                      \
        R_INT("num-images", 0, "1", "N",                                                           \
              "images (videos) from one batched generation, as diffusers' num_images_per_prompt; " \
              "N > 1 writes FILE_0.png .. (safetensors: one stacked tensor)",                      \
              num_images, 1, DIT_GEN_MAX_IMAGES),                                                  \
    {                                                                                              \
        "member", 0, DIT_OPT_CUSTOM, NULL, "'KEY=V;..'",                                           \
            "a batch member: this request with KEY=VALUE fields changed (prompt, prompt_2, "       \
            "negative_prompt, negative_prompt_2, seed, guidance, true_cfg, num_images; leave=K "   \
            "makes it leave after step K); repeat for each member. All members run in the same "   \
            "forwards; member k writes FILE_k.ext (FILE_k_j.ext for its images)",                  \
            NULL, 0, 0, 0, set_member, false                                                       \
    }

static const dit_option forward_opts[] = {
    COMMON_OPTS("a diffusers transformer folder: config.json and "
                "diffusion_pytorch_model.safetensors (or a sharded index)",
                "safetensors to write; it holds 'sample'"),
    FORWARD_OPTS,
    LORA_OPT,
    PARALLEL_OPTS,
};
static const dit_option forward_only[] = {FORWARD_OPTS};

static const dit_option generate_opts[] = {
    COMMON_OPTS("pipeline folder: model_index.json, transformer/, vae/, text_encoder/, "
                "text_encoder_2/, tokenizer/, tokenizer_2/, scheduler/",
                "the file to write: .png, .mp4 or .safetensors"),
    GENERATE_OPTS,
    LORA_OPT,
    PARALLEL_OPTS,
};
static const dit_option generate_only[] = {GENERATE_OPTS};

static int parse(ditrun_args *a, int argc, char **argv)
{
    const bool fwd = a->cmd == DITRUN_FORWARD;
    const char *usage = fwd ? forward_usage : generate_usage;
    const dit_options table = {
        .prog = fwd ? "ditrun forward" : "ditrun generate",
        .usage = usage,
        .epilog = exit_help,
        .opts = fwd ? forward_opts : generate_opts,
        .n_opts = fwd ? sizeof forward_opts / sizeof *forward_opts
                      : sizeof generate_opts / sizeof *generate_opts,
        .foreign = fwd ? generate_only : forward_only,
        .n_foreign = fwd ? sizeof generate_only / sizeof *generate_only
                         : sizeof forward_only / sizeof *forward_only,
    };
    raw_args r;
    memset(&r, 0, sizeof r);
    /* Unset: the pipeline's defaults (no value the parser produces). */
    r.guidance = NAN;
    r.width = r.height = r.frames = r.fps = r.steps = r.max_seq = LLONG_MIN;
    const int rc = dit_options_parse(&table, &r, argc, argv, NULL);
    if (rc == 1)
        return -1; /* --help */
    if (rc != 0)
        return DITRUN_EXIT_USAGE;
    if (dit_backend_kind_parse(r.backend, &a->backend) != DIT_OK)
        return usage_error(usage, "unknown backend '%s' (cpu or cuda)", r.backend);
    a->model = r.model;
    a->inputs = r.inputs;
    a->output = r.output;
    a->compare = r.compare;
    a->threads = (int)r.threads;
    a->repeat = (int)r.repeat;
    a->quiet = r.quiet;
    a->pc = dit_parallel_config_single();
    a->pc.world_size = (int)r.world;
    a->pc.ring_degree = (int)r.ring;
    a->pc.ulysses_degree = (int)r.ulysses;
    a->pc.tp_degree = (int)r.tp;
    a->pc.cfg_degree = r.cfgpar ? 2 : 1;
    a->pc.ulysses_anything = r.uany;
    a->pc.ring_anything = r.rany;
    a->pc.unified_anything = r.unany;
    a->pc.fp32_merge = !r.nofp32;
    a->comm_timeout = (double)r.comm_timeout;
    a->mesh_rank = (int)r.mesh_rank;
    a->mesh_shm = r.mesh_shm;
    for (int i = 0; i < r.n_lora; i++)
        split_lora(r.lora[i], a->lora_path[i], sizeof a->lora_path[i], &a->lora_scale[i]);
    a->n_lora = r.n_lora;
    a->fuse_lora = r.fuse_lora;
    if (a->fuse_lora && a->n_lora == 0)
        return usage_error(usage, "%s", "--fuse-lora needs at least one --lora");
    a->gen.prompt = r.prompt;
    a->gen.prompt_2 = r.prompt_2;
    a->gen.negative_prompt = r.neg;
    a->gen.negative_prompt_2 = r.neg_2;
    /* The request's 0 means "the pipeline's default"; on the command line
     * that is leaving the flag out, and an explicit 0 is refused. */
    const struct {
        const char *flag;
        long long v;
        int *out;
    } sizes[] = {{"--width", r.width, &a->gen.width},
                 {"--height", r.height, &a->gen.height},
                 {"--frames", r.frames, &a->gen.frames},
                 {"--fps", r.fps, &a->gen.fps},
                 {"--steps", r.steps, &a->gen.steps},
                 {"--max-sequence-length", r.max_seq, &a->gen.max_sequence_length}};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        if (sizes[i].v == 0)
            return usage_error(usage,
                               "%s 0: give a positive value, or leave the flag out for the "
                               "pipeline's default",
                               sizes[i].flag);
        *sizes[i].out = sizes[i].v == LLONG_MIN ? 0 : (int)sizes[i].v;
    }
    a->gen.guidance_scale = (float)r.guidance;
    a->gen.true_cfg_scale = (float)r.true_cfg;
    a->gen.cfg_two_pass = r.cfg_two_pass;
    a->gen.num_images = (int)r.num_images;
    a->gen.seed = r.seed;
    a->latents_path = r.latents;
    a->output_latents = r.output_latents;
    for (int i = 0; i < r.n_member; i++) {
        char err[256];
        if (ditrun_member_parse(r.member[i], &a->members[i], err, sizeof err) != 0)
            return usage_error(usage, "--member: %s", err);
    }
    a->n_members = r.n_member;
    if (a->n_members > 0 && a->latents_path)
        return usage_error(usage, "%s", "--latents does not combine with --member");
    if (!a->model)
        return usage_error(usage, "%s", "--model is required");
    if (a->cmd == DITRUN_FORWARD && !a->inputs)
        return usage_error(usage, "%s", "--inputs is required");
    if (a->cmd == DITRUN_GENERATE && !a->gen.prompt)
        return usage_error(usage, "%s", "--prompt is required (it may be empty: --prompt '')");
    if (!a->output)
        return usage_error(usage, "%s", "--output is required");
    if (a->mesh_rank >= 0 && !a->mesh_shm)
        return usage_error(usage, "%s", "--mesh-rank needs --mesh-shm");
    return 0;
}

static int run(ditrun_cmd cmd, int argc, char **argv)
{
    ditrun_args a;
    memset(&a, 0, sizeof a);
    a.cmd = cmd;
    /* The defaults are in the option tables, but for generate's request
     * fields: those are the pipeline's (ditrun_generate_prepare). */
    int rc = parse(&a, argc, argv);
    if (rc != 0)
        return rc < 0 ? 0 : rc;
    if (a.mesh_rank >= 0)
        return cmd == DITRUN_FORWARD ? ditrun_forward_rank(&a, a.mesh_rank)
                                     : ditrun_generate_rank(&a, a.mesh_rank);
    /* A run can take minutes: learn first that its results can be written. */
    const char *outs[2] = {a.output, a.output_latents};
    for (int i = 0; i < 2; i++) {
        char err[600];
        if (outs[i] && dit_check_output_path(outs[i], err, sizeof err) != 0) {
            fprintf(stderr, "ditrun %s: %s\n", cmd == DITRUN_FORWARD ? "forward" : "generate", err);
            return 1;
        }
    }
    if (cmd == DITRUN_GENERATE && (rc = ditrun_generate_prepare(&a)) != 0)
        return rc;
    rc = ditrun_validate(&a);
    if (rc != 0)
        return rc;
    if (a.pc.world_size == 1)
        return cmd == DITRUN_FORWARD ? ditrun_forward_rank(&a, 0) : ditrun_generate_rank(&a, 0);
    return ditrun_launch(&a, argc, argv);
}

/* Whether the command line asks for help or the version, when no BLAS runs
 * and OpenBLAS's kernels do not matter. Any such argument counts (a prompt
 * that is literally "-h" too): a false yes costs only the kernel check. */
static bool help_only(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0 ||
            strcmp(argv[i], "help") == 0 || strcmp(argv[i], "--version") == 0)
            return true;
    return false;
}

int main(int argc, char **argv)
{
    if (!help_only(argc, argv))
        dit_cpu_blas_core_fix(argv, true);
    if (argc < 2)
        return usage_error(main_usage, "%s", "a command is required");
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        fputs(main_usage, stdout);
        return 0;
    }
    if (strcmp(cmd, "--version") == 0) {
        char sets[128];
        dit_cpu_kernels_describe(sets, sizeof sets);
        const char *pick = NULL;
        dit_diag diag = {0};
        dit_status st = dit_cpu_kernels_pick(getenv("DIT_CPU_KERNELS"), dit_cpu_kernels_cpu_level(),
                                             &pick, &diag);
        printf("ditrun %s (backends: cpu%s)\ncpu kernels: %s (sets built: %s)\n", DIT_VERSION,
               dit_backend_available(DIT_BACKEND_CUDA) ? ", cuda" : "",
               st == DIT_OK ? pick : dit_diag_msg(&diag), sets);
        return 0;
    }
    if (strcmp(cmd, "forward") == 0)
        return run(DITRUN_FORWARD, argc - 1, argv + 1);
    if (strcmp(cmd, "generate") == 0)
        return run(DITRUN_GENERATE, argc - 1, argv + 1);
    return usage_error(main_usage, "unknown command '%s'", cmd);
}
