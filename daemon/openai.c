#include "openai.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/utf8.h"
#include "serve/request.h"

/* s was cut to its first len bytes: drops a UTF-8 sequence the cut left
 * incomplete at its end (its lead byte and up to 2 continuation bytes). */
static void cut_at_char(char *s, size_t len)
{
    size_t i = len;
    while (i > 0 && len - i < 3 && ((unsigned char)s[i - 1] & 0xc0) == 0x80)
        i--;
    if (i > 0 && (unsigned char)s[i - 1] >= 0xc0 && dit_utf8_len(s + i - 1, len - i + 1) == 0)
        s[i - 1] = '\0';
}

bool dit_openai_fail(dit_openai_error *e, unsigned status, const char *param, const char *code,
                     const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    e->status = status;
    e->param = param;
    e->code = code;
    const int n = vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof e->msg)
        cut_at_char(e->msg, sizeof e->msg - 1);
    return false;
}

void dit_openai_copy_text(char *dst, size_t cap, const char *src)
{
    const size_t n = strlen(src);
    const size_t len = n < cap ? n : cap - 1;
    memcpy(dst, src, len);
    dst[len] = '\0';
    if (len < n)
        cut_at_char(dst, len);
}

const char *dit_openai_echo_name(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (n >= 64 || !(isalnum((unsigned char)s[n]) || s[n] == '_'))
            return "(a field with an unusual name)";
    return n ? s : "(an empty name)";
}

/* The most values a body may hold, counted as the '{', '[' and ',' outside
 * its strings. A request needs about a hundred (every field, eight adapters);
 * cJSON builds the whole tree before the fields are read, about 40 bytes of
 * heap per byte of a body of small values, so without a bound a 1 MiB body
 * costs 40 MiB on each of the connections at once. */
enum { BODY_MAX_VALUES = 1024 };

/* The body must be UTF-8, hold no \u0000 escape (a C string would end
 * there) and at most BODY_MAX_VALUES values. */
static const char *body_problem(const char *b, size_t n)
{
    bool in_string = false;
    int values = 0;
    for (size_t i = 0; i < n;) {
        const unsigned char c = (unsigned char)b[i];
        if (c == 0)
            return "the body holds a NUL byte";
        if (c == '\\' && i + 1 < n) {
            if (b[i + 1] == 'u' && i + 5 < n && memcmp(b + i + 2, "0000", 4) == 0)
                return "strings may not hold \\u0000";
            i += 2;
            continue;
        }
        if (c == '"')
            in_string = !in_string;
        else if (!in_string && (c == '{' || c == '[' || c == ',') && ++values > BODY_MAX_VALUES)
            return "the body holds more than 1024 JSON values";
        const size_t l = dit_utf8_len(b + i, n - i);
        if (!l)
            return "the body is not UTF-8";
        i += l;
    }
    return NULL;
}

/* The body as a JSON object; NULL with e filled. */
static cJSON *parse_object(const char *body, size_t len, dit_openai_error *e)
{
    const char *problem = body_problem(body, len);
    if (problem) {
        dit_openai_fail(e, 400, NULL, "invalid_json", "%s", problem);
        return NULL;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!root) {
        dit_openai_fail(e, 400, NULL, "invalid_json", "the body is not valid JSON");
        return NULL;
    }
    /* Nothing but whitespace may follow the value. */
    while (end < body + len && (*end == ' ' || *end == '\t' || *end == '\r' || *end == '\n'))
        end++;
    if (end != body + len) {
        dit_openai_fail(e, 400, NULL, "invalid_json", "the body holds more after its JSON value");
        cJSON_Delete(root);
        return NULL;
    }
    if (!cJSON_IsObject(root)) {
        dit_openai_fail(e, 400, NULL, "invalid_json", "the body must be a JSON object");
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

static bool get_int(const cJSON *v, const char *name, double lo, double hi, double *out,
                    dit_openai_error *e)
{
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble != floor(v->valuedouble))
        return dit_openai_fail(e, 400, name, "invalid_type", "'%s' must be an integer", name);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return dit_openai_fail(e, 400, name, "invalid_value", "'%s' must be from %.0f to %.0f",
                               name, lo, hi);
    *out = v->valuedouble;
    return true;
}

static bool get_number(const cJSON *v, const char *name, double lo, double hi, double *out,
                       dit_openai_error *e)
{
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return dit_openai_fail(e, 400, name, "invalid_type", "'%s' must be a number", name);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return dit_openai_fail(e, 400, name, "invalid_value", "'%s' must be from %g to %g", name,
                               lo, hi);
    *out = v->valuedouble;
    return true;
}

static bool get_string(const cJSON *v, const char *name, size_t max, const char **out,
                       dit_openai_error *e)
{
    if (!cJSON_IsString(v) || !v->valuestring)
        return dit_openai_fail(e, 400, name, "invalid_type", "'%s' must be a string", name);
    if (strlen(v->valuestring) > max)
        return dit_openai_fail(e, 400, name, "invalid_value", "'%s' is longer than %zu bytes", name,
                               max);
    if (!dit_utf8_valid(v->valuestring, strlen(v->valuestring)))
        return dit_openai_fail(e, 400, name, "invalid_value", "'%s' is not UTF-8", name);
    *out = v->valuestring;
    return true;
}

/* "WxH" with plain decimal sides (at most 6 digits each, each at least 1). */
static bool parse_size(const char *s, int *w, int *h)
{
    long v[2] = {0, 0};
    const char *p = s;
    for (int k = 0; k < 2; k++) {
        int digits = 0;
        while (*p >= '0' && *p <= '9' && digits < 6) {
            v[k] = v[k] * 10 + (*p++ - '0');
            digits++;
        }
        if (!digits || v[k] < 1)
            return false;
        if (k == 0 && *p++ != 'x')
            return false;
    }
    if (*p)
        return false;
    *w = (int)v[0];
    *h = (int)v[1];
    return true;
}

/* "loras": [{"name": NAME, "scale": SCALE}, ...], GenerateRequest.loras'
 * rules (scale defaults to 1). */
typedef struct lora_specs {
    struct {
        char name[DIT_REQUEST_MAX_LORA_NAME_BYTES + 1];
        float scale;
    } s[DIT_REQUEST_MAX_LORAS];
    int n;
} lora_specs;

static bool parse_loras(const cJSON *f, lora_specs *out, dit_openai_error *e)
{
    out->n = 0;
    if (!cJSON_IsArray(f))
        return dit_openai_fail(e, 400, "loras", "invalid_type",
                               "'loras' must be an array of {\"name\": NAME, \"scale\": SCALE}");
    for (const cJSON *it = f->child; it; it = it->next) {
        if (out->n == DIT_REQUEST_MAX_LORAS)
            return dit_openai_fail(e, 400, "loras", "invalid_value",
                                   "'loras' takes at most %d adapters", DIT_REQUEST_MAX_LORAS);
        if (!cJSON_IsObject(it))
            return dit_openai_fail(e, 400, "loras", "invalid_type",
                                   "'loras' items must be {\"name\": NAME, \"scale\": SCALE}");
        const char *name = NULL;
        double scale = 1;
        bool has_scale = false;
        for (const cJSON *x = it->child; x; x = x->next) {
            const bool is_name = strcmp(x->string, "name") == 0;
            if ((is_name && name) || (!is_name && has_scale && strcmp(x->string, "scale") == 0))
                return dit_openai_fail(e, 400, is_name ? "loras.name" : "loras.scale",
                                       "duplicate_parameter", "a 'loras' item gives '%s' twice",
                                       x->string);
            if (is_name) {
                if (!get_string(x, "loras.name", DIT_REQUEST_MAX_LORA_NAME_BYTES, &name, e))
                    return false;
            } else if (strcmp(x->string, "scale") == 0) {
                if (!get_number(x, "loras.scale", -DIT_REQUEST_MAX_LORA_SCALE,
                                DIT_REQUEST_MAX_LORA_SCALE, &scale, e))
                    return false;
                has_scale = true;
            } else {
                return dit_openai_fail(e, 400, "loras", "unknown_parameter",
                                       "unknown field '%s' in a 'loras' item (name, scale)",
                                       dit_openai_echo_name(x->string));
            }
        }
        if (!name || !dit_request_lora_name_ok(name))
            return dit_openai_fail(
                e, 400, "loras.name", "invalid_value",
                "'loras' names must be 1 to %d bytes of [A-Za-z0-9._-] without \"..\"",
                DIT_REQUEST_MAX_LORA_NAME_BYTES);
        for (int i = 0; i < out->n; i++)
            if (strcmp(out->s[i].name, name) == 0)
                return dit_openai_fail(e, 400, "loras", "invalid_value", "'loras' names '%s' twice",
                                       name);
        snprintf(out->s[out->n].name, sizeof out->s[out->n].name, "%s", name);
        out->s[out->n++].scale = (float)scale;
    }
    return true;
}

/* What both endpoints put into a GenerateRequest. NAN: not given. */
typedef struct fields {
    const char *model, *prompt, *neg;
    int width, height;
    double steps, priority, guidance, true_cfg;
    uint64_t seed;
    lora_specs loras;
} fields;

static char *dup_or_null(const char *s)
{
    return s ? strdup(s) : NULL;
}

static Google__Protobuf__FloatValue *float_value(double v, bool *oom)
{
    if (isnan(v))
        return NULL;
    Google__Protobuf__FloatValue *f = malloc(sizeof *f);
    if (!f) {
        *oom = true;
        return NULL;
    }
    google__protobuf__float_value__init(f);
    f->value = (float)v;
    return f;
}

/* The request the fields describe; NULL when out of memory. */
static Ditserve__V1__GenerateRequest *new_request(const fields *f)
{
    Ditserve__V1__GenerateRequest *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    ditserve__v1__generate_request__init(r);
    bool oom = false;
    r->model = dup_or_null(f->model ? f->model : "");
    r->prompt = dup_or_null(f->prompt);
    r->negative_prompt = dup_or_null(f->neg ? f->neg : "");
    r->width = f->width;
    r->height = f->height;
    r->num_inference_steps = (int32_t)f->steps;
    r->priority = (int32_t)f->priority;
    r->seed = malloc(sizeof *r->seed);
    if (r->seed) {
        google__protobuf__uint64_value__init(r->seed);
        r->seed->value = f->seed;
    }
    r->guidance_scale = float_value(f->guidance, &oom);
    r->true_cfg_scale = float_value(f->true_cfg, &oom);
    if (f->loras.n > 0 && !oom) {
        r->loras = calloc((size_t)f->loras.n, sizeof *r->loras);
        for (int i = 0; r->loras && i < f->loras.n && !oom; i++) {
            Ditserve__V1__LoraUse *u = malloc(sizeof *u);
            char *name = strdup(f->loras.s[i].name);
            if (!u || !name) {
                free(u);
                free(name);
                oom = true;
                break;
            }
            ditserve__v1__lora_use__init(u);
            u->name = name;
            u->scale = f->loras.s[i].scale;
            r->loras[r->n_loras++] = u;
        }
        oom = oom || !r->loras;
    }
    if (oom || !r->model || !r->prompt || !r->negative_prompt || !r->seed) {
        ditserve__v1__generate_request__free_unpacked(r, NULL);
        return NULL;
    }
    return r;
}

/* Fields both endpoints read the same way; false with e filled when k is
 * one of them and its value is refused. *known false: k is not one. */
static bool common_field(const char *k, const cJSON *f, const cJSON *num, fields *out, bool *known,
                         dit_openai_error *e)
{
    *known = true;
    if (strcmp(k, "model") == 0)
        return get_string(f, "model", 256, &out->model, e);
    if (strcmp(k, "prompt") == 0)
        return get_string(f, "prompt", DIT_REQUEST_MAX_PROMPT_BYTES, &out->prompt, e);
    if (strcmp(k, "negative_prompt") == 0)
        return get_string(f, "negative_prompt", DIT_REQUEST_MAX_PROMPT_BYTES, &out->neg, e);
    if (strcmp(k, "num_inference_steps") == 0)
        return get_int(num, "num_inference_steps", 1, 1000, &out->steps, e);
    if (strcmp(k, "guidance_scale") == 0)
        return get_number(num, "guidance_scale", 0, 100, &out->guidance, e);
    if (strcmp(k, "priority") == 0)
        return get_int(num, "priority", -DIT_REQUEST_MAX_PRIORITY, DIT_REQUEST_MAX_PRIORITY,
                       &out->priority, e);
    if (strcmp(k, "user") == 0) {
        const char *u = NULL; /* accepted, unused */
        return get_string(f, "user", 256, &u, e);
    }
    *known = false;
    return true;
}

/* k's index in known (n of them), or n. */
static unsigned field_index(const char *k, const char *const *known, unsigned n)
{
    unsigned i = 0;
    while (i < n && strcmp(k, known[i]) != 0)
        i++;
    return i;
}

static bool parse_images_object(const dit_openai_defaults *d, const cJSON *root,
                                uint64_t random_seed, dit_openai_images *out, dit_openai_error *e)
{
    fields fl = {.guidance = NAN, .true_cfg = NAN};
    double n = 1, seed = -1;
    bool stream = false;
    static const char *const known[] = {"model",
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
                                        "loras"};
    const unsigned n_known = sizeof known / sizeof *known;
    unsigned seen = 0;
    for (const cJSON *f = root->child; f; f = f->next) {
        const char *k = f->string;
        const unsigned i = field_index(k, known, n_known);
        if (i < n_known) {
            if (seen & (1u << i))
                return dit_openai_fail(e, 400, known[i], "duplicate_parameter",
                                       "'%s' is given twice", known[i]);
            seen |= 1u << i;
        }
        bool common = false;
        if (!common_field(k, f, f, &fl, &common, e))
            return false;
        if (common)
            continue;
        if (strcmp(k, "n") == 0) {
            if (!get_int(f, "n", 1, DIT_OPENAI_MAX_N, &n, e)) {
                if (strcmp(e->code, "invalid_value") == 0 && f->valuedouble > DIT_OPENAI_MAX_N)
                    dit_openai_fail(e, 400, "n", "invalid_value",
                                    "'n' must be from 1 to %d: the n images are made as one batch "
                                    "(num_images, as diffusers' num_images_per_prompt), at most %d",
                                    DIT_OPENAI_MAX_N, DIT_OPENAI_MAX_N);
                return false;
            }
        } else if (strcmp(k, "size") == 0) {
            const char *sz = NULL;
            if (!get_string(f, "size", 32, &sz, e))
                return false;
            if (strcmp(sz, "auto") == 0) {
                fl.width = d->width;
                fl.height = d->height;
            } else if (!parse_size(sz, &fl.width, &fl.height)) {
                return dit_openai_fail(
                    e, 400, "size", "invalid_value",
                    "'size' must be \"WIDTHxHEIGHT\" (e.g. \"1024x1024\") or \"auto\"");
            }
        } else if (strcmp(k, "response_format") == 0) {
            const char *rf = NULL;
            if (!get_string(f, "response_format", 32, &rf, e))
                return false;
            if (strcmp(rf, "b64_json") != 0)
                return dit_openai_fail(
                    e, 400, "response_format", "invalid_value",
                    "only response_format \"b64_json\" is served (no image URLs)");
        } else if (strcmp(k, "output_format") == 0) {
            const char *of = NULL;
            if (!get_string(f, "output_format", 32, &of, e))
                return false;
            if (strcmp(of, "png") != 0)
                return dit_openai_fail(e, 400, "output_format", "invalid_value",
                                       "only output_format \"png\" is served");
        } else if (strcmp(k, "stream") == 0) {
            if (!cJSON_IsBool(f))
                return dit_openai_fail(e, 400, "stream", "invalid_type",
                                       "'stream' must be true or false");
            stream = cJSON_IsTrue(f);
        } else if (strcmp(k, "partial_images") == 0) {
            double pi;
            if (!get_int(f, "partial_images", 0, 0, &pi, e))
                return strcmp(e->code, "invalid_value") != 0
                           ? false /* not an integer: get_int's invalid_type stands */
                           : dit_openai_fail(e, 400, "partial_images", "invalid_value",
                                             "partial images are not served; progress events "
                                             "come with stream: true");
        } else if (strcmp(k, "seed") == 0) {
            if (!get_int(f, "seed", 0, (double)(DIT_OPENAI_IMAGES_SEED_SPAN - 1), &seed, e))
                return false;
        } else if (strcmp(k, "true_cfg_scale") == 0) {
            if (!get_number(f, "true_cfg_scale", 0, 100, &fl.true_cfg, e))
                return false;
        } else if (strcmp(k, "loras") == 0) {
            if (!parse_loras(f, &fl.loras, e))
                return false;
        } else {
            return dit_openai_fail(e, 400, NULL, "unknown_parameter", "unknown field '%s'",
                                   dit_openai_echo_name(k));
        }
    }
    if (!fl.prompt)
        return dit_openai_fail(e, 400, "prompt", "missing_required_parameter",
                               "'prompt' is required");
    fl.seed = seed < 0 ? random_seed % DIT_OPENAI_IMAGES_SEED_SPAN : (uint64_t)seed;
    Ditserve__V1__GenerateRequest *r = new_request(&fl);
    if (!r)
        return dit_openai_fail(e, 500, NULL, "internal_error", "out of memory");
    /* An image, also from a video model (one frame of its clip). */
    r->output_format = DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_PNG;
    r->num_frames = 1;
    r->num_images = (int32_t)n;
    out->req = r;
    out->n = (int)n;
    out->stream = stream;
    return true;
}

bool dit_openai_parse_images(const dit_openai_defaults *d, const char *body, size_t len,
                             uint64_t random_seed, dit_openai_images *out, dit_openai_error *e)
{
    memset(out, 0, sizeof *out);
    cJSON *root = parse_object(body, len, e);
    if (!root)
        return false;
    const bool ok = parse_images_object(d, root, random_seed, out, e);
    cJSON_Delete(root);
    return ok;
}

void dit_openai_images_clear(dit_openai_images *im)
{
    if (im->req)
        ditserve__v1__generate_request__free_unpacked(im->req, NULL);
    memset(im, 0, sizeof *im);
}

/* A number from a form field's text (strictly: what strtod reads whole,
 * finite) into *tmp; JSON numbers pass through. */
static const cJSON *form_number(const cJSON *v, bool form, cJSON *tmp)
{
    if (!form || !cJSON_IsString(v))
        return v;
    const char *s = v->valuestring;
    char *end = NULL;
    errno = 0;
    const double d = strtod(s, &end);
    if (!*s || isspace((unsigned char)*s) || *end || errno || !isfinite(d))
        return v; /* get_int / get_number say it is no number */
    memset(tmp, 0, sizeof *tmp);
    tmp->type = cJSON_Number;
    tmp->valuedouble = d;
    tmp->valueint = 0;
    return tmp;
}

/* OpenAI's `seconds` ("4"; a JSON number is taken too): a plain positive
 * decimal. */
static bool parse_seconds(const cJSON *v, double *out, dit_openai_error *e)
{
    double d = NAN;
    if (cJSON_IsNumber(v)) {
        d = v->valuedouble;
    } else if (cJSON_IsString(v) && strlen(v->valuestring) <= 16) {
        const char *s = v->valuestring;
        size_t digits = 0, dots = 0;
        for (const char *p = s; *p; p++) {
            if (*p >= '0' && *p <= '9')
                digits++;
            else if (*p == '.')
                dots++;
            else
                digits = 0, dots = 2; /* anything else: not a plain decimal */
        }
        if (digits > 0 && dots <= 1)
            d = strtod(s, NULL);
    }
    if (!isfinite(d) || !(d > 0) || d > DIT_OPENAI_MAX_SECONDS)
        return dit_openai_fail(
            e, 400, "seconds", "invalid_value",
            "'seconds' must be a decimal number of seconds above 0 and at most %d "
            "(e.g. \"4\")",
            DIT_OPENAI_MAX_SECONDS);
    *out = d;
    return true;
}

bool dit_openai_parse_video(const dit_openai_defaults *d, const cJSON *root, bool form,
                            uint64_t random_seed, dit_openai_video *out, dit_openai_error *e)
{
    memset(out, 0, sizeof *out);
    if (!cJSON_IsObject(root))
        return dit_openai_fail(e, 400, NULL, "invalid_json", "the body must be a JSON object");
    fields fl = {.width = d->width, .height = d->height, .guidance = NAN, .true_cfg = NAN};
    double seconds = NAN, seed = -1, fps = 0, frames = 0;
    static const char *const known[] = {
        "model",    "prompt", "negative_prompt",     "seconds",
        "size",     "seed",   "num_inference_steps", "guidance_scale",
        "priority", "fps",    "num_frames",          "user",
        "loras"};
    const unsigned n_known = sizeof known / sizeof *known;
    unsigned seen = 0;
    for (const cJSON *f = root->child; f; f = f->next) {
        const char *k = f->string;
        cJSON tmp;
        const cJSON *num = form_number(f, form, &tmp);
        const unsigned i = field_index(k, known, n_known);
        if (i == n_known) {
            if (strcmp(k, "input_reference") == 0)
                return dit_openai_fail(
                    e, 400, "input_reference", "unsupported_parameter",
                    "input_reference is not served: the model makes video from text "
                    "alone");
            return dit_openai_fail(e, 400, NULL, "unknown_parameter", "unknown field '%s'",
                                   dit_openai_echo_name(k));
        }
        if (seen & (1u << i))
            return dit_openai_fail(e, 400, known[i], "duplicate_parameter", "'%s' is given twice",
                                   known[i]);
        seen |= 1u << i;
        bool common = false;
        if (!common_field(k, f, num, &fl, &common, e))
            return false;
        if (common)
            continue;
        if (strcmp(k, "seconds") == 0) {
            if (!parse_seconds(f, &seconds, e))
                return false;
        } else if (strcmp(k, "size") == 0) {
            const char *sz = NULL;
            if (!get_string(f, "size", 32, &sz, e))
                return false;
            if (strcmp(sz, "auto") != 0 && !parse_size(sz, &fl.width, &fl.height))
                return dit_openai_fail(
                    e, 400, "size", "invalid_value",
                    "'size' must be \"WIDTHxHEIGHT\" (e.g. \"832x480\") or \"auto\"");
        } else if (strcmp(k, "seed") == 0) {
            if (!get_int(num, "seed", 0, (double)(DIT_OPENAI_MAX_SEED - 1), &seed, e))
                return false;
        } else if (strcmp(k, "fps") == 0) {
            if (!get_int(num, "fps", 1, 240, &fps, e))
                return false;
        } else if (strcmp(k, "num_frames") == 0) {
            if (!get_int(num, "num_frames", 1, DIT_OPENAI_MAX_FRAMES, &frames, e))
                return false;
        } else { /* loras; a form field holds the array as JSON text */
            /* The form's text is checked as a body is: no \u0000, UTF-8,
             * nothing after the array. */
            const bool text = form && cJSON_IsString(f);
            const size_t tl = text ? strlen(f->valuestring) : 0;
            if (text && (tl > 8192 || body_problem(f->valuestring, tl)))
                return dit_openai_fail(e, 400, "loras", "invalid_json",
                                       "'loras' must be a JSON array of {\"name\": NAME, "
                                       "\"scale\": SCALE}, UTF-8, without \\u0000");
            cJSON *parsed = text ? cJSON_ParseWithOpts(f->valuestring, NULL, 1) : NULL;
            if (text && !parsed)
                return dit_openai_fail(e, 400, "loras", "invalid_json",
                                       "'loras' is not one JSON array (nothing may follow it)");
            const bool ok = parse_loras(parsed ? parsed : f, &fl.loras, e);
            cJSON_Delete(parsed);
            if (!ok)
                return false;
        }
    }
    if (!fl.prompt)
        return dit_openai_fail(e, 400, "prompt", "missing_required_parameter",
                               "'prompt' is required");
    if (!isnan(seconds) && frames > 0)
        return dit_openai_fail(e, 400, "seconds", "invalid_value",
                               "give 'seconds' or 'num_frames', not both");
    const int rate = fps > 0 ? (int)fps : d->fps;
    int n_frames = frames > 0 ? (int)frames : d->num_frames;
    if (!isnan(seconds)) {
        /* The frame count the model allows (step * k + 1, k >= 1) nearest
         * to seconds * fps. */
        const int step = d->frame_step > 0 ? d->frame_step : 1;
        long k = lround((seconds * rate - 1) / step);
        k = k < 1 ? 1 : k;
        if (k > (DIT_OPENAI_MAX_FRAMES - 1) / step)
            return dit_openai_fail(e, 400, "seconds", "invalid_value",
                                   "'seconds' at %d fps asks for more than %d frames", rate,
                                   DIT_OPENAI_MAX_FRAMES);
        n_frames = (int)(k * step + 1);
    }
    fl.seed = seed < 0 ? random_seed % DIT_OPENAI_MAX_SEED : (uint64_t)seed;
    const char *model_name = d->model_name ? d->model_name : "";
    out->model = strdup(fl.model && *fl.model ? fl.model : model_name);
    out->prompt = strdup(fl.prompt);
    out->req = new_request(&fl);
    if (!out->req || !out->model || !out->prompt) {
        dit_openai_video_clear(out);
        return dit_openai_fail(e, 500, NULL, "internal_error", "out of memory");
    }
    out->req->output_format = DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_MP4;
    out->req->num_frames = n_frames;
    out->req->fps = rate;
    out->width = fl.width;
    out->height = fl.height;
    out->num_frames = n_frames;
    out->fps = rate;
    out->seed = fl.seed;
    return true;
}

bool dit_openai_parse_video_json(const dit_openai_defaults *d, const char *body, size_t len,
                                 uint64_t random_seed, dit_openai_video *out, dit_openai_error *e)
{
    memset(out, 0, sizeof *out);
    cJSON *root = parse_object(body, len, e);
    if (!root)
        return false;
    const bool ok = dit_openai_parse_video(d, root, false, random_seed, out, e);
    cJSON_Delete(root);
    return ok;
}

void dit_openai_video_clear(dit_openai_video *v)
{
    if (v->req)
        ditserve__v1__generate_request__free_unpacked(v->req, NULL);
    free(v->model);
    free(v->prompt);
    memset(v, 0, sizeof *v);
}
