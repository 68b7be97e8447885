/* The HTTP API's request bodies as a web client can send them: the input's
 * first byte picks the endpoint (bit 0: POST /v1/images/generations or
 * POST /v1/videos; bit 1, for videos: the body's fields sent as a form, each
 * value as its text, which is how OpenAI's client sends videos.create), the
 * rest is the JSON body, read as ditd's connection threads read it
 * (daemon/openai.c), then checked as the server checks what it admits,
 * against the demo FLUX pipeline (images) and the demo Wan pipeline (both).
 *
 * Properties: a refusal is a 400 with a known code, a message of printable
 * ASCII (nothing of the client's but names fit to echo) and a known or no
 * param, and returns nothing; an accepted body gives a request with every
 * field in its documented range, strings valid UTF-8 within their limits,
 * adapters named as GenerateRequest.loras allows, and, for a video, a
 * description equal to its request; the random value only fills in a
 * missing seed; the same request comes back when it is written out as a
 * canonical body and read again; what validates against a pipeline
 * resolves. */
#include <math.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/utf8.h"
#include "fuzz.h"
#include "fuzz_json.h"
#include "openai.h"
#include "serve/request.h"

#define FLUX 0
#define WAN 1

typedef struct openai_ctx {
    dit_pipeline_info info[2];
    dit_openai_defaults images, video;
} openai_ctx;

static void teardown(void *p)
{
    free(p);
}

static void *setup(const char *root)
{
    openai_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    static const char *const dirs[2] = {"demo", "wan_demo"};
    for (int i = 0; i < 2; i++) {
        char path[4096];
        dit_diag d;
        dit_diag_clear(&d);
        snprintf(path, sizeof path, "%s/tests/data/%s", root, dirs[i]);
        if (dit_pipeline_probe(path, &c->info[i], &d) != DIT_OK) {
            fprintf(stderr, "fuzz_openai: %s\n", dit_diag_msg(&d));
            free(c);
            return NULL;
        }
    }
    /* As ditd fills them for each demo (its default size, frames, rate). */
    c->images = (dit_openai_defaults){.model_name = "demo", .width = 256, .height = 256};
    c->video = (dit_openai_defaults){.model_name = "wan_demo",
                                     .width = 64,
                                     .height = 64,
                                     .num_frames = 17,
                                     .fps = 16,
                                     .frame_step = 4};
    return c;
}

static void check_error(const dit_openai_error *e)
{
    static const char *const codes[] = {"invalid_json",
                                        "invalid_type",
                                        "invalid_value",
                                        "duplicate_parameter",
                                        "unknown_parameter",
                                        "unsupported_parameter",
                                        "missing_required_parameter"};
    static const char *const params[] = {"model",
                                         "prompt",
                                         "negative_prompt",
                                         "n",
                                         "size",
                                         "response_format",
                                         "output_format",
                                         "stream",
                                         "partial_images",
                                         "user",
                                         "seed",
                                         "num_inference_steps",
                                         "guidance_scale",
                                         "true_cfg_scale",
                                         "priority",
                                         "loras",
                                         "loras.name",
                                         "loras.scale",
                                         "seconds",
                                         "fps",
                                         "num_frames",
                                         "input_reference"};
    DIT_FUZZ_REQUIRE(e->status == 400, "a refusal with status %u (%s)", e->status, e->msg);
    bool known = false;
    for (size_t i = 0; e->code && i < sizeof codes / sizeof *codes; i++)
        known = known || strcmp(e->code, codes[i]) == 0;
    DIT_FUZZ_REQUIRE(known, "a refusal with code %s", e->code ? e->code : "(none)");
    known = e->param == NULL;
    for (size_t i = 0; e->param && i < sizeof params / sizeof *params; i++)
        known = known || strcmp(e->param, params[i]) == 0;
    DIT_FUZZ_REQUIRE(known, "a refusal naming param '%s'", e->param);
    DIT_FUZZ_REQUIRE(e->msg[0] != 0, "a refusal without a message");
    for (const char *p = e->msg; *p; p++)
        DIT_FUZZ_REQUIRE(*p >= 0x20 && *p < 0x7f, "a refusal's message holds byte 0x%02x",
                         (unsigned char)*p);
}

static void check_string(const char *s, size_t max, const char *what)
{
    DIT_FUZZ_REQUIRE(s != NULL, "no %s", what);
    const size_t n = strlen(s);
    DIT_FUZZ_REQUIRE(n <= max, "%s of %zu bytes", what, n);
    DIT_FUZZ_REQUIRE(dit_utf8_valid(s, n), "%s is not UTF-8", what);
}

static void check_request(const Ditserve__V1__GenerateRequest *r)
{
    check_string(r->model, 256, "model");
    check_string(r->prompt, DIT_REQUEST_MAX_PROMPT_BYTES, "prompt");
    check_string(r->negative_prompt, DIT_REQUEST_MAX_PROMPT_BYTES, "negative_prompt");
    DIT_FUZZ_REQUIRE((r->width == 0) == (r->height == 0) && r->width >= 0 && r->width <= 999999 &&
                         r->height >= 0 && r->height <= 999999,
                     "size %dx%d", r->width, r->height);
    DIT_FUZZ_REQUIRE(r->num_inference_steps >= 0 && r->num_inference_steps <= 1000, "%d steps",
                     r->num_inference_steps);
    DIT_FUZZ_REQUIRE(r->priority >= -DIT_REQUEST_MAX_PRIORITY &&
                         r->priority <= DIT_REQUEST_MAX_PRIORITY,
                     "priority %d", r->priority);
    DIT_FUZZ_REQUIRE(r->seed != NULL, "no seed");
    const Google__Protobuf__FloatValue *scales[2] = {r->guidance_scale, r->true_cfg_scale};
    for (int i = 0; i < 2; i++)
        DIT_FUZZ_REQUIRE(!scales[i] || (scales[i]->value >= 0 && scales[i]->value <= 100),
                         "scale %d is %g", i, scales[i] ? (double)scales[i]->value : 0.0);
    DIT_FUZZ_REQUIRE(r->n_loras <= DIT_REQUEST_MAX_LORAS, "%zu adapters", r->n_loras);
    for (size_t i = 0; i < r->n_loras; i++) {
        const Ditserve__V1__LoraUse *u = r->loras[i];
        DIT_FUZZ_REQUIRE(dit_request_lora_name_ok(u->name), "adapter %zu's name", i);
        DIT_FUZZ_REQUIRE(fabsf(u->scale) <= DIT_REQUEST_MAX_LORA_SCALE, "adapter scale %g",
                         (double)u->scale);
        for (size_t j = 0; j < i; j++)
            DIT_FUZZ_REQUIRE(strcmp(u->name, r->loras[j]->name) != 0, "adapter named twice");
    }
}

/* The request's bytes, packed (the caller frees). */
static uint8_t *packed(const Ditserve__V1__GenerateRequest *r, size_t *n)
{
    *n = ditserve__v1__generate_request__get_packed_size(r);
    uint8_t *b = malloc(*n ? *n : 1);
    DIT_FUZZ_REQUIRE(b, "out of memory");
    ditserve__v1__generate_request__pack(r, b);
    return b;
}

static void require_same(const Ditserve__V1__GenerateRequest *a,
                         const Ditserve__V1__GenerateRequest *b, const char *what)
{
    size_t na, nb;
    uint8_t *pa = packed(a, &na), *pb = packed(b, &nb);
    DIT_FUZZ_REQUIRE(na == nb && memcmp(pa, pb, na) == 0, "%s: another request", what);
    free(pa);
    free(pb);
}

/* What validates also resolves, with a message for what does not. */
static void against(const dit_pipeline_info *info, const Ditserve__V1__GenerateRequest *r)
{
    dit_diag d;
    dit_diag_clear(&d);
    if (dit_request_validate(r, info, &d) != DIT_OK) {
        DIT_FUZZ_REQUIRE(d.msg[0] != 0, "a refusal without a message");
        return;
    }
    dit_request res;
    memset(&res, 0, sizeof res);
    DIT_FUZZ_REQUIRE(dit_request_resolve(r, info, 7, &res, &d) == DIT_OK,
                     "validated but not resolved: %s", dit_diag_msg(&d));
    DIT_FUZZ_REQUIRE(res.seed_set && res.gp.seed == r->seed->value, "the seed was not kept");
    dit_request_free(&res);
}

/* A field's number: a JSON number, or in a form the number its text is. */
static double number_of(const cJSON *f, bool form)
{
    if (cJSON_IsNumber(f))
        return f->valuedouble;
    DIT_FUZZ_REQUIRE(form && cJSON_IsString(f), "'%s' is no number but was taken", f->string);
    return strtod(f->valuestring, NULL);
}

/* Every field the body gives has its value in the request, unchanged. */
static void expect_fields(const cJSON *root, bool form, const dit_openai_defaults *d,
                          const Ditserve__V1__GenerateRequest *r)
{
    DIT_FUZZ_REQUIRE(cJSON_IsObject(root), "an accepted body is no object");
    for (const cJSON *f = root->child; f; f = f->next) {
        const char *k = f->string;
        if (!strcmp(k, "prompt") || !strcmp(k, "negative_prompt") || !strcmp(k, "model")) {
            const char *got = !strcmp(k, "prompt")  ? r->prompt
                              : !strcmp(k, "model") ? r->model
                                                    : r->negative_prompt;
            DIT_FUZZ_REQUIRE(strcmp(f->valuestring, got) == 0, "'%s' changed", k);
        } else if (!strcmp(k, "num_inference_steps")) {
            DIT_FUZZ_REQUIRE(number_of(f, form) == r->num_inference_steps, "steps changed");
        } else if (!strcmp(k, "priority")) {
            DIT_FUZZ_REQUIRE(number_of(f, form) == r->priority, "priority changed");
        } else if (!strcmp(k, "seed")) {
            DIT_FUZZ_REQUIRE(number_of(f, form) == (double)r->seed->value, "seed changed");
        } else if (!strcmp(k, "fps")) {
            DIT_FUZZ_REQUIRE(number_of(f, form) == r->fps, "fps changed");
        } else if (!strcmp(k, "num_frames")) {
            DIT_FUZZ_REQUIRE(number_of(f, form) == r->num_frames, "num_frames changed");
        } else if (!strcmp(k, "n")) {
            DIT_FUZZ_REQUIRE(number_of(f, form) == r->num_images, "n changed");
        } else if (!strcmp(k, "guidance_scale") || !strcmp(k, "true_cfg_scale")) {
            const Google__Protobuf__FloatValue *v =
                k[0] == 'g' ? r->guidance_scale : r->true_cfg_scale;
            DIT_FUZZ_REQUIRE(v && (float)number_of(f, form) == v->value, "'%s' changed", k);
        } else if (!strcmp(k, "size")) {
            int w = d->width, h = d->height;
            if (strcmp(f->valuestring, "auto") != 0)
                DIT_FUZZ_REQUIRE(sscanf(f->valuestring, "%dx%d", &w, &h) == 2, "size taken");
            DIT_FUZZ_REQUIRE(w == r->width && h == r->height, "size changed");
        } else if (!strcmp(k, "loras")) {
            cJSON *text = form ? cJSON_Parse(f->valuestring) : NULL;
            const cJSON *a = form ? text : f;
            size_t i = 0;
            for (const cJSON *it = a ? a->child : NULL; it; it = it->next, i++) {
                DIT_FUZZ_REQUIRE(i < r->n_loras, "an adapter was dropped");
                const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
                const cJSON *scale = cJSON_GetObjectItemCaseSensitive(it, "scale");
                DIT_FUZZ_REQUIRE(strcmp(name->valuestring, r->loras[i]->name) == 0 &&
                                     (scale ? (float)scale->valuedouble : 1.0f) ==
                                         r->loras[i]->scale,
                                 "adapter %zu changed", i);
            }
            DIT_FUZZ_REQUIRE(i == r->n_loras, "an adapter was added");
            cJSON_Delete(text);
        }
    }
}

static void add_scale(cJSON *o, const char *name, const Google__Protobuf__FloatValue *v)
{
    if (v)
        cJSON_AddNumberToObject(o, name, v->value);
}

/* The request written out as the body that asks for exactly it. */
static char *canonical(const Ditserve__V1__GenerateRequest *r, bool video, int n, bool stream)
{
    cJSON *o = cJSON_CreateObject();
    char size[32];
    cJSON_AddStringToObject(o, "model", r->model);
    cJSON_AddStringToObject(o, "prompt", r->prompt);
    cJSON_AddStringToObject(o, "negative_prompt", r->negative_prompt);
    if (r->width > 0) {
        snprintf(size, sizeof size, "%dx%d", r->width, r->height);
        cJSON_AddStringToObject(o, "size", size);
    }
    /* As ditd writes seeds: cJSON prints a double to 15 digits when that
     * reads back within its rounding, which changes integers near 2^53. */
    char seed[24];
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)r->seed->value);
    cJSON_AddRawToObject(o, "seed", seed);
    if (r->num_inference_steps > 0)
        cJSON_AddNumberToObject(o, "num_inference_steps", r->num_inference_steps);
    add_scale(o, "guidance_scale", r->guidance_scale);
    add_scale(o, "true_cfg_scale", r->true_cfg_scale);
    cJSON_AddNumberToObject(o, "priority", r->priority);
    if (video) {
        cJSON_AddNumberToObject(o, "fps", r->fps);
        cJSON_AddNumberToObject(o, "num_frames", r->num_frames);
    } else {
        cJSON_AddNumberToObject(o, "n", n);
        cJSON_AddBoolToObject(o, "stream", stream);
    }
    if (r->n_loras > 0) {
        cJSON *a = cJSON_AddArrayToObject(o, "loras");
        for (size_t i = 0; i < r->n_loras; i++) {
            cJSON *u = cJSON_CreateObject();
            cJSON_AddStringToObject(u, "name", r->loras[i]->name);
            cJSON_AddNumberToObject(u, "scale", r->loras[i]->scale);
            cJSON_AddItemToArray(a, u);
        }
    }
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    DIT_FUZZ_REQUIRE(s, "out of memory");
    return s;
}

/* The JSON object with every value as a form field holds it: strings as
 * they are, anything else as its JSON text. NULL when body is no object. */
static cJSON *as_form(const char *body, size_t len)
{
    cJSON *root = cJSON_ParseWithLength(body, len);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return NULL;
    }
    cJSON *form = cJSON_CreateObject();
    for (const cJSON *f = root->child; f && form; f = f->next) {
        char *text = cJSON_IsString(f) ? NULL : cJSON_PrintUnformatted(f);
        cJSON *v = cJSON_CreateString(text ? text : f->valuestring ? f->valuestring : "");
        free(text);
        DIT_FUZZ_REQUIRE(v, "out of memory");
        cJSON_AddItemToObject(form, f->string, v);
    }
    cJSON_Delete(root);
    return form;
}

static int run_images(openai_ctx *c, const char *body, size_t len)
{
    dit_openai_images im, again;
    dit_openai_error e = {0};
    if (!dit_openai_parse_images(&c->images, body, len, 12345, &im, &e)) {
        check_error(&e);
        DIT_FUZZ_REQUIRE(im.req == NULL, "a refusal returned a request");
        return -1;
    }
    const Ditserve__V1__GenerateRequest *r = im.req;
    check_request(r);
    DIT_FUZZ_REQUIRE(im.n >= 1 && im.n <= DIT_OPENAI_MAX_N && r->num_images == im.n, "n = %d",
                     im.n);
    DIT_FUZZ_REQUIRE(r->num_frames == 1 && r->fps == 0 &&
                         r->output_format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_PNG,
                     "not one PNG image");
    DIT_FUZZ_REQUIRE(r->seed->value < DIT_OPENAI_IMAGES_SEED_SPAN, "seed %llu",
                     (unsigned long long)r->seed->value);
    cJSON *root = cJSON_ParseWithLength(body, len);
    expect_fields(root, false, &c->images, r);
    cJSON_Delete(root);

    /* Another random value: at most the seed changes. */
    DIT_FUZZ_REQUIRE(dit_openai_parse_images(&c->images, body, len, 999, &again, &e),
                     "accepted once, refused the second time: %s", e.msg);
    const uint64_t seed = again.req->seed->value;
    again.req->seed->value = r->seed->value;
    require_same(r, again.req, "read again with another random value");
    DIT_FUZZ_REQUIRE(seed == r->seed->value || (seed == 999 && r->seed->value == 12345),
                     "the random value changed more than a missing seed");
    dit_openai_images_clear(&again);

    char *text = canonical(r, false, im.n, im.stream);
    DIT_FUZZ_REQUIRE(dit_openai_parse_images(&c->images, text, strlen(text), 1, &again, &e),
                     "its canonical body is refused: %s (%s)", e.msg, text);
    require_same(r, again.req, "its canonical body");
    DIT_FUZZ_REQUIRE(again.n == im.n && again.stream == im.stream, "n or stream changed");
    dit_openai_images_clear(&again);
    free(text);

    against(&c->info[FLUX], r);
    against(&c->info[WAN], r);
    dit_openai_images_clear(&im);
    return 0;
}

static int run_video(openai_ctx *c, const char *body, size_t len, bool form)
{
    dit_openai_video v, again;
    dit_openai_error e = {0};
    cJSON *fields = NULL;
    bool ok;
    if (form) {
        if (!(fields = as_form(body, len)))
            return -1;
        ok = dit_openai_parse_video(&c->video, fields, true, 12345, &v, &e);
    } else {
        ok = dit_openai_parse_video_json(&c->video, body, len, 12345, &v, &e);
    }
    if (!ok) {
        check_error(&e);
        DIT_FUZZ_REQUIRE(v.req == NULL && v.model == NULL && v.prompt == NULL,
                         "a refusal returned a job");
        cJSON_Delete(fields);
        return -1;
    }
    const Ditserve__V1__GenerateRequest *r = v.req;
    check_request(r);
    DIT_FUZZ_REQUIRE(r->output_format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_MP4 &&
                         r->num_images == 0 && !r->true_cfg_scale,
                     "not one MP4 video");
    DIT_FUZZ_REQUIRE(r->fps >= 1 && r->fps <= 240, "%d fps", r->fps);
    DIT_FUZZ_REQUIRE(r->num_frames >= 1 && r->num_frames <= DIT_OPENAI_MAX_FRAMES, "%d frames",
                     r->num_frames);
    DIT_FUZZ_REQUIRE(r->seed->value < DIT_OPENAI_MAX_SEED, "seed %llu",
                     (unsigned long long)r->seed->value);
    DIT_FUZZ_REQUIRE(v.width == r->width && v.height == r->height && v.width > 0 &&
                         v.num_frames == r->num_frames && v.fps == r->fps &&
                         v.seed == r->seed->value && strcmp(v.prompt, r->prompt) == 0,
                     "the Video object describes another request");
    DIT_FUZZ_REQUIRE(strcmp(v.model, r->model[0] ? r->model : c->video.model_name) == 0,
                     "the Video object's model is %s", v.model);
    cJSON *root = form ? NULL : cJSON_ParseWithLength(body, len);
    expect_fields(form ? fields : root, form, &c->video, r);
    cJSON_Delete(root);

    ok = form ? dit_openai_parse_video(&c->video, fields, true, 999, &again, &e)
              : dit_openai_parse_video_json(&c->video, body, len, 999, &again, &e);
    DIT_FUZZ_REQUIRE(ok, "accepted once, refused the second time: %s", e.msg);
    const uint64_t seed = again.req->seed->value;
    again.req->seed->value = r->seed->value;
    require_same(r, again.req, "read again with another random value");
    DIT_FUZZ_REQUIRE(seed == r->seed->value || (seed == 999 && r->seed->value == 12345),
                     "the random value changed more than a missing seed");
    dit_openai_video_clear(&again);

    char *text = canonical(r, true, 0, false);
    DIT_FUZZ_REQUIRE(dit_openai_parse_video_json(&c->video, text, strlen(text), 1, &again, &e),
                     "its canonical body is refused: %s (%s)", e.msg, text);
    require_same(r, again.req, "its canonical body");
    dit_openai_video_clear(&again);
    free(text);

    against(&c->info[WAN], r);
    dit_openai_video_clear(&v);
    cJSON_Delete(fields);
    return 0;
}

static int run(void *p, const uint8_t *data, size_t size)
{
    if (size < 1)
        return -1;
    const char *body = (const char *)data + 1;
    if (!(data[0] & 1))
        return run_images(p, body, size - 1);
    return run_video(p, body, size - 1, data[0] & 2);
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
    .name = "openai", .setup = setup, .run = run, .teardown = teardown, .mutate = mutate};
