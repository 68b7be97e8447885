/* ditrun: runs the worker's compute code without the daemon.
 *
 *   ditrun forward  --model DIR --inputs IN.safetensors --output OUT.safetensors
 *   ditrun generate --model PIPELINE_DIR --prompt TEXT -o out.png
 *
 * With --world-size N > 1 it creates a shared-memory mesh, starts N rank
 * processes of itself (the same code a daemon worker runs), and reports rank
 * 0's result; any failing rank fails the run with that rank's message. It is
 * the tool for tests, benchmarks and debugging. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/shm/comm_shm.h"
#include "core/cli_util.h"
#include "tools/ditrun.h"

#define PARALLEL_HELP                                                                          \
    "Parallelism (the meaning of diffusers' ContextParallelConfig / TensorParallelConfig;\n"   \
    "ranks are separate processes meeting in shared memory):\n"                                \
    "  --world-size N       number of rank processes (default 1)\n"                            \
    "  --ring R             ring_degree: ring attention over R sequence chunks\n"              \
    "  --ulysses U          ulysses_degree: all-to-all between sequence and heads\n"           \
    "  --tp T               tp_degree: tensor parallelism over heads and MLP columns\n"        \
    "                       R x U x T must equal N; CP and TP combine\n"                       \
    "  --ulysses-anything   uneven sequence chunks and heads not divisible by U (R = 1)\n"     \
    "  --ring-anything      uneven sequence chunks (U = 1)\n"                                  \
    "  --unified-anything   uneven chunks and heads with R > 1 and U > 1\n"                    \
    "  --no-fp32-merge      convert_to_fp32=False: merge ring partials in the activation\n"    \
    "                       dtype (the cpu backend computes in f32 either way)\n"              \
    "  --comm-timeout S     seconds a rank waits for its peers before failing (default 60)\n"  \
    "\n"                                                                                       \
    "Exit status: 0 on success, 1 when the model or inputs cannot be used or a rank\n"         \
    "fails, 2 on bad command-line arguments, an invalid request or parallel layout.\n"

static const char *const forward_usage =
    "usage: ditrun forward --model DIR --inputs IN.safetensors --output OUT.safetensors\n"
    "                      [--backend cpu|cuda] [--threads N] [--repeat N]\n"
    "                      [--compare FILE] [--quiet] [parallel options]\n"
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
    "\n" PARALLEL_HELP;

static const char *const generate_usage =
    "usage: ditrun generate --model PIPELINE_DIR --prompt TEXT --output OUT.png\n"
    "                       [--prompt-2 TEXT] [--negative-prompt TEXT]\n"
    "                       [--negative-prompt-2 TEXT] [--width W] [--height H]\n"
    "                       [--steps N] [--guidance G] [--true-cfg S] [--seed N]\n"
    "                       [--max-sequence-length N] [--latents FILE]\n"
    "                       [--output-latents FILE] [--backend cpu|cuda] [--threads N]\n"
    "                       [--quiet] [parallel options]\n"
    "\n"
    "Text to image with a diffusers FluxPipeline folder, as pipe(prompt, ...) would.\n"
    "\n"
    "  --model DIR          pipeline folder: model_index.json, transformer/, vae/,\n"
    "                       text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/,\n"
    "                       scheduler/\n"
    "  --prompt TEXT        the prompt (CLIP, and T5 unless --prompt-2); may be empty.\n"
    "                       Longer prompts are truncated to 77 CLIP tokens and\n"
    "                       --max-sequence-length T5 tokens, as diffusers does\n"
    "  --prompt-2 TEXT      a different prompt for T5\n"
    "  --negative-prompt T  with --true-cfg above 1: true classifier-free guidance\n"
    "                       (two transformer passes per step; either one alone has no\n"
    "                       effect, and ditrun warns)\n"
    "  --width W, --height H  pixels, multiples of 16 for FLUX's VAE (default 1024)\n"
    "  --steps N            denoising steps, 1 to 1000 (default 28)\n"
    "  --guidance G         distilled guidance scale for guidance-embedding models\n"
    "                       (default 3.5)\n"
    "  --true-cfg S         true CFG scale (default 1: off)\n"
    "  --seed N             noise seed; the same seed gives the same noise as\n"
    "                       torch.Generator('cpu').manual_seed(N) in diffusers (default 0)\n"
    "  --max-sequence-length N  T5 tokens, 1 to 512 (default 512)\n"
    "  --latents FILE       initial packed latents (tensor 'latents', (1, tokens, 4C))\n"
    "                       instead of noise from the seed\n"
    "  --output-latents F   also write the final latents (tensor 'latents')\n"
    "  --output FILE, -o    the PNG to write\n"
    "  --backend, --threads, --quiet as for forward; a progress line per step (with\n"
    "                       steps/s and the time left) and the VAE decode are shown\n"
    "                       when stderr is a terminal\n"
    "\n" PARALLEL_HELP;

static const char *const main_usage =
    "usage: ditrun <command> [options]\n"
    "\n"
    "Commands:\n"
    "  forward    one transformer forward pass from a safetensors file of inputs\n"
    "  generate   text to image with a FluxPipeline folder, written as PNG\n"
    "\n"
    "Options:\n"
    "  --help      show this help (ditrun <command> --help for a command's options)\n"
    "  --version   print the version and the backends built in\n";

static int usage_error(const char *usage, const char *fmt, const char *arg)
{
    fprintf(stderr, "ditrun: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n\n%s", usage);
    return DITRUN_EXIT_USAGE;
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

static bool parse_float(const char *s, float *out)
{
    char *end;
    double v = strtod(s, &end);
    if (*s == '\0' || *end != '\0' || !isfinite(v))
        return false;
    *out = (float)v;
    return true;
}

static bool parse_u64(const char *s, uint64_t *out)
{
    char *end;
    if (*s == '-' || *s == '\0')
        return false;
    unsigned long long v = strtoull(s, &end, 10);
    if (*end != '\0')
        return false;
    *out = (uint64_t)v;
    return true;
}

enum {
    OPT_WORLD = 256, OPT_RING, OPT_ULYSSES, OPT_TP, OPT_UANY, OPT_RANY, OPT_UNANY, OPT_NOFP32,
    OPT_TIMEOUT, OPT_MESH_RANK, OPT_MESH_SHM, OPT_PROMPT, OPT_PROMPT2, OPT_NEG, OPT_NEG2,
    OPT_WIDTH, OPT_HEIGHT, OPT_STEPS, OPT_GUIDANCE, OPT_CFG, OPT_SEED, OPT_MAXSEQ, OPT_LATENTS,
    OPT_OUT_LATENTS,
};

static int parse(ditrun_args *a, int argc, char **argv)
{
    const char *usage = a->cmd == DITRUN_FORWARD ? forward_usage : generate_usage;
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
        {"prompt", required_argument, NULL, OPT_PROMPT},
        {"prompt-2", required_argument, NULL, OPT_PROMPT2},
        {"negative-prompt", required_argument, NULL, OPT_NEG},
        {"negative-prompt-2", required_argument, NULL, OPT_NEG2},
        {"width", required_argument, NULL, OPT_WIDTH},
        {"height", required_argument, NULL, OPT_HEIGHT},
        {"steps", required_argument, NULL, OPT_STEPS},
        {"guidance", required_argument, NULL, OPT_GUIDANCE},
        {"true-cfg", required_argument, NULL, OPT_CFG},
        {"seed", required_argument, NULL, OPT_SEED},
        {"max-sequence-length", required_argument, NULL, OPT_MAXSEQ},
        {"latents", required_argument, NULL, OPT_LATENTS},
        {"output-latents", required_argument, NULL, OPT_OUT_LATENTS},
        {NULL, 0, NULL, 0},
    };
    long v;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":m:i:o:b:t:r:c:qh", opts, NULL)) != -1) {
        const bool fwd = a->cmd == DITRUN_FORWARD;
        /* Options that belong to the other command are usage errors. */
        const bool gen_only = c >= OPT_PROMPT;
        const bool fwd_only = c == 'i' || c == 'c' || c == 'r';
        if ((fwd && gen_only) || (!fwd && fwd_only))
            return usage_error(usage, "option '%s' does not apply to this command",
                               argv[optind - 1]);
        switch (c) {
        case 'm':
            a->model = optarg;
            break;
        case 'i':
            a->inputs = optarg;
            break;
        case 'o':
            a->output = optarg;
            break;
        case 'b':
            if (dit_backend_kind_parse(optarg, &a->backend) != DIT_OK)
                return usage_error(usage, "unknown backend '%s' (cpu or cuda)", optarg);
            break;
        case 't':
            if (!parse_int(optarg, 1, 4096, &v))
                return usage_error(usage, "--threads wants a number from 1 to 4096, not '%s'", optarg);
            a->threads = (int)v;
            break;
        case 'r':
            if (!parse_int(optarg, 1, 100000, &v))
                return usage_error(usage, "--repeat wants a positive number, not '%s'", optarg);
            a->repeat = (int)v;
            break;
        case 'c':
            a->compare = optarg;
            break;
        case 'q':
            a->quiet = true;
            break;
        case 'h':
            fputs(usage, stdout);
            return -1;
        case OPT_WORLD:
            if (!parse_int(optarg, 1, DIT_SHM_MAX_RANKS, &v))
                return usage_error(usage, "--world-size wants a number from 1 to 64, not '%s'", optarg);
            a->pc.world_size = (int)v;
            break;
        case OPT_RING:
        case OPT_ULYSSES:
        case OPT_TP:
            /* Values below 1 reach the layout validation, whose message
             * explains the rule. */
            if (!parse_int(optarg, -1000, 1000, &v))
                return usage_error(usage, "degrees are integers, not '%s'", optarg);
            if (c == OPT_RING)
                a->pc.ring_degree = (int)v;
            else if (c == OPT_ULYSSES)
                a->pc.ulysses_degree = (int)v;
            else
                a->pc.tp_degree = (int)v;
            break;
        case OPT_UANY:
            a->pc.ulysses_anything = true;
            break;
        case OPT_RANY:
            a->pc.ring_anything = true;
            break;
        case OPT_UNANY:
            a->pc.unified_anything = true;
            break;
        case OPT_NOFP32:
            a->pc.fp32_merge = false;
            break;
        case OPT_TIMEOUT:
            if (!parse_int(optarg, 1, 86400, &v))
                return usage_error(usage, "--comm-timeout wants seconds (1 to 86400), not '%s'", optarg);
            a->comm_timeout = (double)v;
            break;
        case OPT_MESH_RANK:
            if (!parse_int(optarg, 0, DIT_SHM_MAX_RANKS - 1, &v))
                return usage_error(usage, "bad --mesh-rank '%s'", optarg);
            a->mesh_rank = (int)v;
            break;
        case OPT_MESH_SHM:
            a->mesh_shm = optarg;
            break;
        case OPT_PROMPT:
            a->gen.prompt = optarg;
            break;
        case OPT_PROMPT2:
            a->gen.prompt_2 = optarg;
            break;
        case OPT_NEG:
            a->gen.negative_prompt = optarg;
            break;
        case OPT_NEG2:
            a->gen.negative_prompt_2 = optarg;
            break;
        case OPT_WIDTH:
        case OPT_HEIGHT:
        case OPT_STEPS:
        case OPT_MAXSEQ:
            /* Range checks with the pipeline's own messages come later; here
             * only "is it a number". */
            if (!parse_int(optarg, -1000000, 1000000, &v))
                return usage_error(usage, "expected an integer, not '%s'", optarg);
            if (c == OPT_WIDTH)
                a->gen.width = (int)v;
            else if (c == OPT_HEIGHT)
                a->gen.height = (int)v;
            else if (c == OPT_STEPS)
                a->gen.steps = (int)v;
            else
                a->gen.max_sequence_length = (int)v;
            break;
        case OPT_GUIDANCE:
            if (!parse_float(optarg, &a->gen.guidance_scale))
                return usage_error(usage, "--guidance wants a number, not '%s'", optarg);
            break;
        case OPT_CFG:
            if (!parse_float(optarg, &a->gen.true_cfg_scale))
                return usage_error(usage, "--true-cfg wants a number, not '%s'", optarg);
            break;
        case OPT_SEED:
            if (!parse_u64(optarg, &a->gen.seed))
                return usage_error(usage, "--seed wants a non-negative integer, not '%s'", optarg);
            break;
        case OPT_LATENTS:
            a->latents_path = optarg;
            break;
        case OPT_OUT_LATENTS:
            a->output_latents = optarg;
            break;
        case ':':
            return usage_error(usage, "option %s needs a value", argv[optind - 1]);
        default: {
            const char *text = argv[optind - 1];
            const char *near = strncmp(text, "--", 2) == 0 ? dit_suggest_option(text, opts) : NULL;
            if (near) {
                fprintf(stderr, "ditrun: unknown option '%s'; did you mean '--%s'?\n\n%s", text,
                        near, usage);
                return DITRUN_EXIT_USAGE;
            }
            return usage_error(usage, "unknown option '%s'", text);
        }
        }
    }
    if (optind < argc)
        return usage_error(usage, "unexpected argument '%s'", argv[optind]);
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
    a.backend = DIT_BACKEND_CPU;
    a.repeat = 1;
    a.mesh_rank = -1;
    a.pc = dit_parallel_config_single();
    /* diffusers' FluxPipeline defaults */
    a.gen.width = 1024;
    a.gen.height = 1024;
    a.gen.steps = 28;
    a.gen.guidance_scale = 3.5f;
    a.gen.true_cfg_scale = 1.0f;
    a.gen.max_sequence_length = 512;
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
    char warning[200];
    if (cmd == DITRUN_GENERATE && !a.quiet &&
        dit_gen_true_cfg_warning(&a.gen, "--negative-prompt", "--true-cfg", warning,
                                 sizeof warning))
        fprintf(stderr, "ditrun generate: warning: %s\n", warning);
    rc = ditrun_validate(&a);
    if (rc != 0)
        return rc;
    if (a.pc.world_size == 1)
        return cmd == DITRUN_FORWARD ? ditrun_forward_rank(&a, 0) : ditrun_generate_rank(&a, 0);
    return ditrun_launch(&a, argc, argv);
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
        return run(DITRUN_FORWARD, argc - 1, argv + 1);
    if (strcmp(cmd, "generate") == 0)
        return run(DITRUN_GENERATE, argc - 1, argv + 1);
    return usage_error(main_usage, "unknown command '%s'", cmd);
}
