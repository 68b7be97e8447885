/* A transformer's config.json, which comes with a model folder from
 * anywhere: the input's first byte picks the demo FLUX or the demo Wan
 * transformer, the rest is the config.json put next to that transformer's
 * real weights (a link) in a scratch folder. The folder is read as a worker
 * reads it: the class from _class_name, the config, the class's summary,
 * parallel needs and TP plan, then the whole model loaded on the CPU
 * backend.
 *
 * Properties: a config or model that does not load says why; a config that
 * loads describes a model with heads, widths and block counts in range; a
 * model that loads from it describes itself as that config did. */
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "fuzz.h"
#include "fuzz_json.h"
#include "models/model.h"

typedef struct config_ctx {
    char dir[256], config_path[300], weights_path[300];
    char weights[2][4096]; /* the demo transformers' safetensors */
    dit_backend *be;
} config_ctx;

static void teardown(void *p)
{
    config_ctx *c = p;
    unlink(c->config_path);
    unlink(c->weights_path);
    rmdir(c->dir);
    dit_backend_destroy(c->be);
    free(c);
}

static void *setup(const char *root)
{
    config_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    snprintf(c->weights[0], sizeof c->weights[0],
             "%s/tests/data/demo/transformer/diffusion_pytorch_model.safetensors", root);
    snprintf(c->weights[1], sizeof c->weights[1],
             "%s/tests/data/wan_demo/transformer/diffusion_pytorch_model.safetensors", root);
    dit_diag d;
    dit_diag_clear(&d);
    const dit_backend_config bc = {.kind = DIT_BACKEND_CPU, .n_threads = 1};
    if (access(c->weights[0], R_OK) != 0 || access(c->weights[1], R_OK) != 0 ||
        dit_fuzz_scratch(c->dir, sizeof c->dir, "cfg", true) < 0 ||
        dit_backend_create(&bc, &c->be, &d) != DIT_OK) {
        fprintf(stderr, "fuzz_config: no demo transformers under %s, or no folder or backend: %s\n",
                root, d.msg);
        free(c);
        return NULL;
    }
    snprintf(c->config_path, sizeof c->config_path, "%s/config.json", c->dir);
    snprintf(c->weights_path, sizeof c->weights_path, "%s/diffusion_pytorch_model.safetensors",
             c->dir);
    return c;
}

static int run(void *p, const uint8_t *data, size_t size)
{
    config_ctx *c = p;
    if (size < 1)
        return -1;
    FILE *f = fopen(c->config_path, "wb");
    bool ok = f && fwrite(data + 1, 1, size - 1, f) == size - 1;
    if (f && fclose(f) != 0)
        ok = false;
    unlink(c->weights_path);
    if (!ok || symlink(c->weights[data[0] & 1], c->weights_path) != 0)
        DIT_FUZZ_FAIL("cannot write the model folder %s", c->dir);

    dit_diag d;
    dit_diag_clear(&d);
    const dit_model_class *cls = NULL;
    void *cfg = NULL;
    if (dit_model_config_load(c->dir, &cls, &cfg, &d) != DIT_OK) {
        DIT_FUZZ_REQUIRE(d.msg[0], "a config refused without a message");
        return -1;
    }
    const dit_model_summary sum = cls->summary(cfg);
    DIT_FUZZ_REQUIRE(sum.num_blocks >= 0 && sum.num_heads >= 1 && sum.head_dim >= 1 &&
                         memchr(sum.blocks, 0, sizeof sum.blocks),
                     "summary: %d blocks, %d heads of %d", sum.num_blocks, sum.num_heads,
                     sum.head_dim);
    const dit_parallel_req req = cls->parallel_req(cfg);
    DIT_FUZZ_REQUIRE(req.num_heads == sum.num_heads, "parallel_req: %d heads, summary %d",
                     req.num_heads, sum.num_heads);
    DIT_FUZZ_REQUIRE(req.n_widths >= 0 && req.n_widths <= DIT_PARALLEL_MAX_WIDTHS &&
                         req.n_seqs >= 0 && req.n_seqs <= DIT_PARALLEL_MAX_SEQS,
                     "parallel_req: %d widths, %d sequences", req.n_widths, req.n_seqs);
    for (int i = 0; i < req.n_widths; i++)
        DIT_FUZZ_REQUIRE(req.widths[i] >= 1, "width %d is %d", i, req.widths[i]);

    dit_model *m = NULL;
    dit_diag_clear(&d);
    if (dit_model_load(c->be, c->dir, NULL, &m, &d) != DIT_OK) {
        DIT_FUZZ_REQUIRE(d.msg[0], "a model refused without a message");
    } else {
        DIT_FUZZ_REQUIRE(m->cls == cls, "loaded as another class");
        const dit_model_summary got = cls->summary(dit_model_config(m));
        DIT_FUZZ_REQUIRE(got.num_blocks == sum.num_blocks && got.num_heads == sum.num_heads &&
                             got.head_dim == sum.head_dim && !strcmp(got.blocks, sum.blocks),
                         "the loaded model's config differs from the one read");
        DIT_FUZZ_REQUIRE(cls->weight_bytes(m->impl) > 0, "a model of no weights");
        dit_model_destroy(m);
    }
    free(cfg);
    return 0;
}

static size_t mutate(void *ctx, uint8_t *data, size_t size, size_t max_size, uint64_t seed)
{
    (void)ctx;
    if (size < 2 || max_size < 2)
        return 0;
    size_t n = dit_fuzz_json_mutate(data + 1, size - 1, max_size - 1, seed);
    return n ? n + 1 : 0;
}

const dit_fuzz_target dit_fuzz_target_def = {
    .name = "config", .setup = setup, .run = run, .teardown = teardown, .mutate = mutate};
