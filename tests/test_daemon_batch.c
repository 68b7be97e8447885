/* Which requests may share a batched generation (ditd --max-batch):
 * dit_request_batchable on the demo FLUX and Wan pipelines' probes. Shape,
 * steps, frames, text length, CFG on or off and the adapters must agree;
 * prompts, seeds, guidance, image counts and formats need not. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pipelines/probe.h"
#include "serve/request.h"

static dit_pipeline_info flux, wan;

static void probe(const char *name, dit_pipeline_info *out)
{
    const char *root = getenv("DIT_SOURCE_ROOT");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/tests/data/%s", root ? root : ".", name);
    dit_diag diag;
    dit_diag_clear(&diag);
    ck_assert_msg(dit_pipeline_probe(dir, out, &diag) == DIT_OK, "%s", dit_diag_msg(&diag));
}

static void setup(void)
{
    probe("demo", &flux);
    probe("wan_demo", &wan);
}

/* A request with the wrapper fields it needs, on the stack. */
typedef struct req {
    Ditserve__V1__GenerateRequest r;
    Google__Protobuf__FloatValue guidance, true_cfg;
    Google__Protobuf__UInt64Value seed;
    Ditserve__V1__LoraUse lora[2];
    Ditserve__V1__LoraUse *lora_ptrs[2];
} req;

static void req_init(req *q, const char *prompt, uint64_t seed)
{
    memset(q, 0, sizeof *q);
    ditserve__v1__generate_request__init(&q->r);
    google__protobuf__float_value__init(&q->guidance);
    google__protobuf__float_value__init(&q->true_cfg);
    google__protobuf__uint64_value__init(&q->seed);
    q->r.prompt = (char *)prompt;
    q->r.width = 64;
    q->r.height = 64;
    q->r.num_inference_steps = 4;
    q->seed.value = seed;
    q->r.seed = &q->seed;
    for (int i = 0; i < 2; i++) {
        ditserve__v1__lora_use__init(&q->lora[i]);
        q->lora_ptrs[i] = &q->lora[i];
    }
}

static void set_guidance(req *q, float g)
{
    q->guidance.value = g;
    q->r.guidance_scale = &q->guidance;
}

static void set_true_cfg(req *q, const char *negative, float scale)
{
    q->r.negative_prompt = (char *)negative;
    q->true_cfg.value = scale;
    q->r.true_cfg_scale = &q->true_cfg;
}

static void set_loras(req *q, int n, const char *a, float sa, const char *b, float sb)
{
    q->lora[0].name = (char *)a;
    q->lora[0].scale = sa;
    q->lora[1].name = (char *)b;
    q->lora[1].scale = sb;
    q->r.loras = q->lora_ptrs;
    q->r.n_loras = (size_t)n;
}

static bool both_ways(const req *a, const req *b, const dit_pipeline_info *info)
{
    const bool x = dit_request_batchable(&a->r, &b->r, info);
    ck_assert_int_eq(x, dit_request_batchable(&b->r, &a->r, info));
    return x;
}

START_TEST(members_keep_their_own_prompt_seed_guidance_and_counts)
{
    req a, b;
    req_init(&a, "a red fox", 1);
    req_init(&b, "", 2);
    set_guidance(&b, 7.0f);
    b.r.num_images = 3;
    b.r.output_format = DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR;
    b.r.prompt_2 = "a second prompt";
    b.r.priority = 9;
    b.r.request_id = "other";
    ck_assert(both_ways(&a, &b, &flux));
}
END_TEST

START_TEST(shape_steps_and_text_length_must_agree)
{
    req a, b;
    req_init(&a, "x", 1);
    req_init(&b, "x", 1);
    b.r.width = 96;
    ck_assert(!both_ways(&a, &b, &flux));
    req_init(&b, "x", 1);
    b.r.height = 128;
    ck_assert(!both_ways(&a, &b, &flux));
    req_init(&b, "x", 1);
    b.r.num_inference_steps = 5;
    ck_assert(!both_ways(&a, &b, &flux));
    req_init(&b, "x", 1);
    b.r.max_sequence_length = 64;
    ck_assert(!both_ways(&a, &b, &flux));
}
END_TEST

START_TEST(defaults_count_as_the_values_they_stand_for)
{
    req a, b;
    req_init(&a, "x", 1);
    req_init(&b, "x", 2);
    a.r.width = a.r.height = 0;
    a.r.num_inference_steps = 0;
    b.r.width = flux.default_width;
    b.r.height = flux.default_height;
    b.r.num_inference_steps = flux.default_steps;
    b.r.max_sequence_length = flux.default_max_sequence_length;
    /* No model name stands for the served one, the only one admission
     * lets through. */
    a.r.model = "";
    b.r.model = "demo";
    ck_assert(both_ways(&a, &b, &flux));
}
END_TEST

START_TEST(flux_true_cfg_on_and_off_do_not_mix)
{
    req a, b;
    req_init(&a, "x", 1);
    req_init(&b, "y", 2);
    set_true_cfg(&b, "blurry", 4.0f);
    ck_assert(!both_ways(&a, &b, &flux));
    /* Both with true CFG, their own scales and negative prompts. */
    set_true_cfg(&a, "dark", 2.0f);
    ck_assert(both_ways(&a, &b, &flux));
    /* A negative prompt without a scale above 1 is no CFG (diffusers
     * warns and ignores it): it batches with plain requests. */
    req c;
    req_init(&c, "z", 3);
    set_true_cfg(&a, "dark", 1.0f);
    ck_assert(both_ways(&a, &c, &flux));
}
END_TEST

START_TEST(wan_cfg_follows_guidance_above_one)
{
    req a, b;
    req_init(&a, "x", 1);
    req_init(&b, "y", 2);
    a.r.width = b.r.width = 64;
    a.r.height = b.r.height = 48;
    a.r.num_frames = b.r.num_frames = 5;
    set_guidance(&a, 5.0f);
    set_guidance(&b, 1.0f);
    ck_assert(!both_ways(&a, &b, &wan));
    set_guidance(&b, 3.0f);
    b.r.fps = 8;
    ck_assert(both_ways(&a, &b, &wan));
    b.r.num_frames = 9;
    ck_assert(!both_ways(&a, &b, &wan));
}
END_TEST

START_TEST(adapters_must_be_the_same_set_in_the_same_order)
{
    req a, b;
    req_init(&a, "x", 1);
    req_init(&b, "y", 2);
    set_loras(&a, 2, "style", 0.5f, "detail", 1.0f);
    set_loras(&b, 2, "style", 0.5f, "detail", 1.0f);
    ck_assert(both_ways(&a, &b, &flux));
    set_loras(&b, 2, "style", 0.75f, "detail", 1.0f);
    ck_assert(!both_ways(&a, &b, &flux));
    set_loras(&b, 2, "detail", 1.0f, "style", 0.5f);
    ck_assert(!both_ways(&a, &b, &flux));
    set_loras(&b, 1, "style", 0.5f, NULL, 0);
    ck_assert(!both_ways(&a, &b, &flux));
}
END_TEST

/* Appends a length-delimited field (number, bytes) to buf at *len. */
static void put_field(uint8_t *buf, size_t *len, uint32_t number, const uint8_t *data, size_t n)
{
    uint64_t v = (uint64_t)number << 3 | 2;
    for (int k = 0; k < 2; k++) {
        do {
            buf[(*len)++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
            v >>= 7;
        } while (v);
        v = n;
    }
    memcpy(buf + *len, data, n);
    *len += n;
}

/* Fields a newer client might send (at the top and inside a LoraUse) are
 * dropped, so the request packs again to exactly the bytes it would have
 * without them: nothing of theirs goes on to the workers. */
START_TEST(unknown_fields_are_dropped_at_every_depth)
{
    Ditserve__V1__LoraUse lu = DITSERVE__V1__LORA_USE__INIT, *lup = &lu;
    lu.name = "style";
    lu.scale = 0.5f;
    Ditserve__V1__GenerateRequest r0 = DITSERVE__V1__GENERATE_REQUEST__INIT;
    r0.prompt = "a lighthouse";
    r0.width = r0.height = 64;
    r0.n_loras = 1;
    r0.loras = &lup;
    static uint8_t clean[1024], dirty[16384], lu_dirty[256], junk[8192];
    const size_t clean_len = ditserve__v1__generate_request__pack(&r0, clean);
    /* The same request, its LoraUse carrying field 1000 and the request
     * field 999 (8 KiB). */
    r0.n_loras = 0;
    size_t dirty_len = ditserve__v1__generate_request__pack(&r0, dirty);
    size_t lu_len = ditserve__v1__lora_use__pack(&lu, lu_dirty);
    put_field(lu_dirty, &lu_len, 1000, (const uint8_t *)"newer", 5);
    put_field(dirty, &dirty_len, 23, lu_dirty, lu_len);
    memset(junk, 'j', sizeof junk);
    put_field(dirty, &dirty_len, 999, junk, sizeof junk);
    Ditserve__V1__GenerateRequest *r =
        ditserve__v1__generate_request__unpack(NULL, dirty_len, dirty);
    ck_assert_ptr_nonnull(r);
    ck_assert_int_eq(r->n_loras, 1);
    ck_assert_uint_eq(r->base.n_unknown_fields, 1);
    ck_assert_uint_eq(r->loras[0]->base.n_unknown_fields, 1);
    ck_assert_uint_gt(ditserve__v1__generate_request__get_packed_size(r), clean_len + sizeof junk);
    dit_request_strip_unknown(&r->base);
    ck_assert_uint_eq(r->base.n_unknown_fields, 0);
    ck_assert_uint_eq(r->loras[0]->base.n_unknown_fields, 0);
    uint8_t again[1024];
    ck_assert_uint_eq(ditserve__v1__generate_request__get_packed_size(r), clean_len);
    ck_assert_uint_eq(ditserve__v1__generate_request__pack(r, again), clean_len);
    ck_assert(memcmp(again, clean, clean_len) == 0);
    ditserve__v1__generate_request__free_unpacked(r, NULL);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("daemon_batch");
    TCase *tc = tcase_create("batchable");
    tcase_add_checked_fixture(tc, setup, NULL);
    tcase_add_test(tc, members_keep_their_own_prompt_seed_guidance_and_counts);
    tcase_add_test(tc, shape_steps_and_text_length_must_agree);
    tcase_add_test(tc, defaults_count_as_the_values_they_stand_for);
    tcase_add_test(tc, flux_true_cfg_on_and_off_do_not_mix);
    tcase_add_test(tc, wan_cfg_follows_guidance_above_one);
    tcase_add_test(tc, adapters_must_be_the_same_set_in_the_same_order);
    suite_add_tcase(s, tc);
    TCase *wire = tcase_create("wire");
    tcase_add_test(wire, unknown_fields_are_dropped_at_every_depth);
    suite_add_tcase(s, wire);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_NORMAL);
    const int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
