/* GenerateRequest messages as a gRPC client can send them: the input is the
 * message's bytes, read as ditd's Generate handler reads them (protobuf-c
 * unpack, the NUL-in-strings check), then validated and resolved as the
 * daemon and the workers do, against the demo FLUX pipeline and the demo
 * Wan pipeline (probed from tests/data, configs only), each on one rank and
 * on a ring-2 mesh.
 *
 * Properties: a message that validates also resolves (what the daemon
 * admits, a worker runs) with the sizes and counts in range; one refused
 * has a message; the mesh's refusal comes with advice; the warning and
 * advice buffers hold a terminated string; a request batches with itself;
 * the output format is one of the three. */
#include <math.h>
#include <string.h>

#include "fuzz.h"
#include "fuzz_proto.h"
#include "parallel/mesh.h"
#include "serve/request.h"

#define N_PIPES 2

typedef struct request_ctx {
    dit_pipeline_info info[N_PIPES];
} request_ctx;

static void teardown(void *p)
{
    free(p);
}

static void *setup(const char *root)
{
    request_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    static const char *const dirs[N_PIPES] = {"demo", "wan_demo"};
    for (int i = 0; i < N_PIPES; i++) {
        char path[4096];
        dit_diag d;
        dit_diag_clear(&d);
        snprintf(path, sizeof path, "%s/tests/data/%s", root, dirs[i]);
        if (dit_pipeline_probe(path, &c->info[i], &d) != DIT_OK) {
            fprintf(stderr, "fuzz_request: %s\n", dit_diag_msg(&d));
            free(c);
            return NULL;
        }
    }
    return c;
}

static void check_terminated(const char *buf, size_t cap, const char *what)
{
    DIT_FUZZ_REQUIRE(memchr(buf, 0, cap) != NULL, "%s is not terminated", what);
}

static void against(const dit_pipeline_info *info, const Ditserve__V1__GenerateRequest *r)
{
    dit_diag d;
    dit_diag_clear(&d);
    if (dit_request_validate(r, info, &d) != DIT_OK) {
        DIT_FUZZ_REQUIRE(d.msg[0] != 0, "a refusal without a message");
        return;
    }
    const int fmt = dit_request_output_format(r, info);
    DIT_FUZZ_REQUIRE(fmt == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_PNG ||
                         fmt == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_MP4 ||
                         fmt == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR,
                     "output format %d", fmt);
    DIT_FUZZ_REQUIRE(dit_request_batchable(r, r, info), "a request does not batch with itself");

    char buf[600];
    memset(buf, 'x', sizeof buf);
    if (dit_request_warning(r, info, buf, sizeof buf))
        check_terminated(buf, sizeof buf, "the warning");

    dit_request res;
    memset(&res, 0, sizeof res);
    dit_status st = dit_request_resolve(r, info, 7, &res, &d);
    DIT_FUZZ_REQUIRE(st == DIT_OK, "validated but not resolved: %s", dit_diag_msg(&d));
    const dit_gen_params *gp = &res.gp;
    DIT_FUZZ_REQUIRE(gp->width > 0 && gp->height > 0 && gp->steps >= 1 && gp->steps <= 1000,
                     "resolved to %dx%d, %d steps", gp->width, gp->height, gp->steps);
    DIT_FUZZ_REQUIRE(gp->num_images >= 0 && gp->num_images <= DIT_GEN_MAX_IMAGES,
                     "resolved to %d images", gp->num_images);
    DIT_FUZZ_REQUIRE(isnan(gp->guidance_scale) || isfinite(gp->guidance_scale), "guidance %g",
                     (double)gp->guidance_scale);
    DIT_FUZZ_REQUIRE(isfinite(gp->true_cfg_scale), "true_cfg_scale %g", (double)gp->true_cfg_scale);
    DIT_FUZZ_REQUIRE(res.seed_set == (r->seed != NULL), "seed_set");
    DIT_FUZZ_REQUIRE(r->seed || gp->seed == 7, "the fallback seed was not used");
    dit_request_free(&res);

    /* On one rank and on a ring of two: accepted, or refused with advice. */
    dit_parallel_config pcs[2] = {dit_parallel_config_single(), dit_parallel_config_single()};
    pcs[1].world_size = 2;
    pcs[1].ring_degree = 2;
    for (int i = 0; i < 2; i++) {
        dit_diag_clear(&d);
        if (dit_request_validate_mesh(r, info, &pcs[i], &d) == DIT_OK)
            continue;
        DIT_FUZZ_REQUIRE(i == 1, "one rank refused a validated request: %s", dit_diag_msg(&d));
        memset(buf, 'x', sizeof buf);
        dit_request_mesh_advice(r, info, &pcs[i], buf, sizeof buf);
        check_terminated(buf, sizeof buf, "the mesh's advice");
        DIT_FUZZ_REQUIRE(buf[0] != 0, "the mesh refused without advice (%s)", dit_diag_msg(&d));
    }
}

static int run(void *p, const uint8_t *data, size_t size)
{
    request_ctx *c = p;
    Ditserve__V1__GenerateRequest *r = ditserve__v1__generate_request__unpack(NULL, size, data);
    if (!r)
        return -1;
    dit_diag d;
    dit_diag_clear(&d);
    int keep = 0;
    if (dit_request_check_strings(&ditserve__v1__generate_request__descriptor, data, size, &d) !=
        DIT_OK) {
        DIT_FUZZ_REQUIRE(d.msg[0] != 0, "a NUL refusal without a message");
        keep = -1;
    } else {
        /* As ditd does on arrival: what the API does not define goes, and
         * the request never grows by it. */
        const size_t before = ditserve__v1__generate_request__get_packed_size(r);
        dit_request_strip_unknown(&r->base);
        const size_t after = ditserve__v1__generate_request__get_packed_size(r);
        DIT_FUZZ_REQUIRE(after <= before && r->base.n_unknown_fields == 0,
                         "stripping left %zu bytes of %zu, %u unknown fields", after, before,
                         r->base.n_unknown_fields);
        for (int i = 0; i < N_PIPES; i++)
            against(&c->info[i], r);
    }
    ditserve__v1__generate_request__free_unpacked(r, NULL);
    return keep;
}

static size_t mutate(void *ctx, uint8_t *data, size_t size, size_t max_size, uint64_t seed)
{
    (void)ctx;
    return dit_fuzz_proto_mutate(&ditserve__v1__generate_request__descriptor, data, size, max_size,
                                 seed);
}

const dit_fuzz_target dit_fuzz_target_def = {
    .name = "request", .setup = setup, .run = run, .teardown = teardown, .mutate = mutate};
