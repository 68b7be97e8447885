#include "serve/request.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/tensor.h"
#include "core/utf8.h"

static dit_status check_text(const char *name, const char *s, dit_diag *diag)
{
    if (!s)
        return DIT_OK;
    size_t n = strlen(s);
    if (n > DIT_REQUEST_MAX_PROMPT_BYTES)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s is %zu bytes; at most %d are accepted",
                            name, n, DIT_REQUEST_MAX_PROMPT_BYTES);
    if (!dit_utf8_valid(s, n))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s is not valid UTF-8", name);
    return DIT_OK;
}

bool dit_request_lora_name_ok(const char *name)
{
    if (!name)
        return false;
    size_t n = strnlen(name, DIT_REQUEST_MAX_LORA_NAME_BYTES + 1);
    if (n == 0 || n > DIT_REQUEST_MAX_LORA_NAME_BYTES || strstr(name, ".."))
        return false;
    for (size_t i = 0; i < n; i++) {
        const char c = name[i];
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return false;
    }
    return true;
}

static dit_status check_loras(const Ditserve__V1__GenerateRequest *req, dit_diag *diag)
{
    if (req->n_loras > DIT_REQUEST_MAX_LORAS)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "loras has %zu adapters; at most %d are accepted", req->n_loras,
                            DIT_REQUEST_MAX_LORAS);
    for (size_t i = 0; i < req->n_loras; i++) {
        const Ditserve__V1__LoraUse *u = req->loras[i];
        if (!dit_request_lora_name_ok(u->name))
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "loras[%zu].name must be 1 to %d bytes of [A-Za-z0-9._-] "
                                "without \"..\"",
                                i, DIT_REQUEST_MAX_LORA_NAME_BYTES);
        if (!isfinite(u->scale) || u->scale < -DIT_REQUEST_MAX_LORA_SCALE ||
            u->scale > DIT_REQUEST_MAX_LORA_SCALE)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "loras[%zu].scale must be finite, within [-100, 100]", i);
        for (size_t j = 0; j < i; j++)
            if (strcmp(req->loras[j]->name, u->name) == 0)
                return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                    "loras[%zu] names the same adapter as loras[%zu]; give it "
                                    "once with the sum of the scales",
                                    i, j);
    }
    return DIT_OK;
}

static bool dtype_of(Ditserve__V1__DType d, dit_dtype *out)
{
    switch (d) {
    case DITSERVE__V1__DTYPE__DTYPE_F32:
        *out = DIT_F32;
        return true;
    case DITSERVE__V1__DTYPE__DTYPE_BF16:
        *out = DIT_BF16;
        return true;
    case DITSERVE__V1__DTYPE__DTYPE_F16:
        *out = DIT_F16;
        return true;
    default:
        return false;
    }
}

/* Checks dtype, rank, dims (-1: any, within [1, max_any]) and byte count. */
static dit_status check_tensor(const char *name, const Ditserve__V1__Tensor *t, int ndim,
                               const int64_t *want, int64_t max_any, dit_diag *diag)
{
    dit_dtype dt;
    if (!dtype_of(t->dtype, &dt))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "%s.dtype must be DTYPE_F32, DTYPE_BF16 or DTYPE_F16", name);
    char shape_text[128] = "(";
    size_t used = 1;
    for (int i = 0; i < ndim && used < sizeof shape_text; i++) {
        int n = want[i] < 0
                    ? snprintf(shape_text + used, sizeof shape_text - used, "%sL", i ? ", " : "")
                    : snprintf(shape_text + used, sizeof shape_text - used, "%s%lld", i ? ", " : "",
                               (long long)want[i]);
        used += n > 0 ? (size_t)n : 0;
    }
    if (used < sizeof shape_text)
        snprintf(shape_text + used, sizeof shape_text - used, ")");
    /* Each dim is checked before it is multiplied in, and the product is
     * checked for overflow too: a client picks these numbers. */
    bool ok = t->n_shape == (size_t)ndim;
    int64_t numel = 1;
    for (int i = 0; ok && i < ndim; i++) {
        const int64_t d = t->shape[i];
        ok = (want[i] < 0 ? (d >= 1 && d <= max_any) : d == want[i]) &&
             !__builtin_mul_overflow(numel, d, &numel);
    }
    if (!ok)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s must have shape %s for this model%s",
                            name, shape_text, max_any > 0 ? " (L from 1 to 4096)" : "");
    size_t bytes;
    if (__builtin_mul_overflow((size_t)numel, dit_dtype_size(dt), &bytes))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "%s: shape %s in %s is too large", name,
                            shape_text, dit_dtype_name(dt));
    if (t->data.len != bytes)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "%s holds %zu bytes; shape %s in %s needs %zu", name, t->data.len,
                            shape_text, dit_dtype_name(dt), bytes);
    /* NaN or infinity would run through the whole pipeline (and into
     * approximations that assume finite inputs): refuse it here. */
    const size_t n = (size_t)numel;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *e = t->data.data + i * dit_dtype_size(dt);
        bool finite;
        if (dt == DIT_F32) {
            uint32_t u;
            memcpy(&u, e, 4);
            finite = (u & 0x7f800000u) != 0x7f800000u;
        } else if (dt == DIT_BF16) {
            uint16_t u;
            memcpy(&u, e, 2);
            finite = (u & 0x7f80u) != 0x7f80u;
        } else { /* f16 */
            uint16_t u;
            memcpy(&u, e, 2);
            finite = (u & 0x7c00u) != 0x7c00u;
        }
        if (!finite)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "%s holds a NaN or infinity at element %zu; only finite values "
                                "are accepted",
                                name, i);
    }
    return DIT_OK;
}

/* Fills gp from req with defaults; pointers to caller tensors are set to
 * their raw bytes (presence only) and replaced by f32 copies in resolve. */
/* The request as pipeline parameters; fields the request leaves unset take
 * the pipeline's defaults (probe). info NULL leaves them 0 (for readers of
 * the prompts and scales only). */
static void fill_params(const Ditserve__V1__GenerateRequest *req, const dit_pipeline_info *info,
                        dit_gen_params *gp)
{
    memset(gp, 0, sizeof *gp);
    gp->prompt = req->prompt ? req->prompt : "";
    gp->prompt_2 = req->prompt_2 && req->prompt_2[0] ? req->prompt_2 : NULL;
    gp->negative_prompt =
        req->negative_prompt && req->negative_prompt[0] ? req->negative_prompt : NULL;
    gp->negative_prompt_2 =
        req->negative_prompt_2 && req->negative_prompt_2[0] ? req->negative_prompt_2 : NULL;
    gp->width = req->width ? req->width : info ? info->default_width : 0;
    gp->height = req->height ? req->height : info ? info->default_height : 0;
    gp->frames = req->num_frames ? req->num_frames : info ? info->default_frames : 0;
    gp->fps = req->fps ? req->fps : info ? info->default_fps : 0;
    gp->steps = req->num_inference_steps ? req->num_inference_steps
                : info                   ? info->default_steps
                                         : 0;
    gp->guidance_scale = req->guidance_scale ? req->guidance_scale->value
                         : info              ? info->default_guidance
                                             : 0.0f;
    gp->true_cfg_scale = req->true_cfg_scale ? req->true_cfg_scale->value : 1.0f;
    gp->seed = req->seed ? req->seed->value : 0;
    gp->max_sequence_length = req->max_sequence_length;
    gp->num_images = req->num_images;
    if (req->prompt_embeds) {
        gp->prompt_embeds = (const float *)req->prompt_embeds->data.data;
        gp->prompt_embeds_len = req->prompt_embeds->n_shape == 3 ? req->prompt_embeds->shape[1] : 0;
    }
    if (req->pooled_prompt_embeds)
        gp->pooled_prompt_embeds = (const float *)req->pooled_prompt_embeds->data.data;
    if (req->negative_prompt_embeds) {
        gp->negative_prompt_embeds = (const float *)req->negative_prompt_embeds->data.data;
        gp->negative_prompt_embeds_len =
            req->negative_prompt_embeds->n_shape == 3 ? req->negative_prompt_embeds->shape[1] : 0;
    }
    if (req->negative_pooled_prompt_embeds)
        gp->negative_pooled_prompt_embeds =
            (const float *)req->negative_pooled_prompt_embeds->data.data;
    if (req->latents)
        gp->latents = (const float *)req->latents->data.data;
}

int dit_request_output_format(const Ditserve__V1__GenerateRequest *req,
                              const dit_pipeline_info *info)
{
    if (req->output_format != DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_UNSPECIFIED)
        return req->output_format;
    return info->frame_step > 0 ? DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_MP4
                                : DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_PNG;
}

dit_status dit_request_validate(const Ditserve__V1__GenerateRequest *req,
                                const dit_pipeline_info *info, dit_diag *diag)
{
    dit_status st;
    const char *names[4] = {"prompt", "prompt_2", "negative_prompt", "negative_prompt_2"};
    const char *texts[4] = {req->prompt, req->prompt_2, req->negative_prompt,
                            req->negative_prompt_2};
    for (int i = 0; i < 4; i++)
        if ((st = check_text(names[i], texts[i], diag)) != DIT_OK)
            return st;
    /* request_id is echoed in every event: a client's protobuf library
     * refuses a stream whose strings are not UTF-8. */
    if (req->request_id && strlen(req->request_id) > DIT_REQUEST_MAX_ID_BYTES)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "request_id is %zu bytes; at most %d are "
                            "accepted",
                            strlen(req->request_id), DIT_REQUEST_MAX_ID_BYTES);
    if (req->request_id && !dit_utf8_valid(req->request_id, strlen(req->request_id)))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "request_id is not valid UTF-8");
    if (req->priority < -DIT_REQUEST_MAX_PRIORITY || req->priority > DIT_REQUEST_MAX_PRIORITY)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "priority %d: it must be from %d to %d",
                            (int)req->priority, -DIT_REQUEST_MAX_PRIORITY,
                            DIT_REQUEST_MAX_PRIORITY);
    if ((st = check_loras(req, diag)) != DIT_OK)
        return st;
    if (req->output_format != DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_UNSPECIFIED &&
        req->output_format != DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_PNG &&
        req->output_format != DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_RAW_TENSOR &&
        req->output_format != DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_MP4)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "output_format %d is not OUTPUT_FORMAT_PNG, OUTPUT_FORMAT_MP4 or "
                            "OUTPUT_FORMAT_RAW_TENSOR",
                            (int)req->output_format);
    dit_gen_params gp;
    fill_params(req, info, &gp);
    const bool video = info->frame_step > 0;
    if (req->output_format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_MP4 && !video)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "output_format OUTPUT_FORMAT_MP4: %s makes images; ask for "
                            "OUTPUT_FORMAT_PNG or OUTPUT_FORMAT_RAW_TENSOR",
                            info->class_name);
    if (req->output_format == DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_PNG && video &&
        gp.frames != 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "output_format OUTPUT_FORMAT_PNG holds one image and this request is "
                            "a %d-frame video: ask for OUTPUT_FORMAT_MP4 (the default for "
                            "video) or OUTPUT_FORMAT_RAW_TENSOR, or num_frames 1",
                            gp.frames);
    const dit_transformer_info *fc = &info->transformer;
    if (req->prompt_embeds) {
        const int64_t s[3] = {1, -1, fc->joint_attention_dim};
        if ((st = check_tensor("prompt_embeds", req->prompt_embeds, 3, s, 4096, diag)) != DIT_OK)
            return st;
    }
    if ((req->pooled_prompt_embeds || req->negative_pooled_prompt_embeds) &&
        fc->pooled_projection_dim == 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "%s has no pooled text embeddings: send prompt_embeds (and "
                            "negative_prompt_embeds) alone",
                            info->class_name);
    if (req->pooled_prompt_embeds) {
        const int64_t s[2] = {1, fc->pooled_projection_dim};
        if ((st = check_tensor("pooled_prompt_embeds", req->pooled_prompt_embeds, 2, s, 0, diag)) !=
            DIT_OK)
            return st;
    }
    if (req->negative_prompt_embeds) {
        const int64_t s[3] = {1, gp.prompt_embeds_len > 0 ? gp.prompt_embeds_len : -1,
                              fc->joint_attention_dim};
        if ((st = check_tensor("negative_prompt_embeds", req->negative_prompt_embeds, 3, s, 4096,
                               diag)) != DIT_OK)
            return st;
    }
    if (req->negative_pooled_prompt_embeds) {
        const int64_t s[2] = {1, fc->pooled_projection_dim};
        if ((st = check_tensor("negative_pooled_prompt_embeds", req->negative_pooled_prompt_embeds,
                               2, s, 0, diag)) != DIT_OK)
            return st;
    }
    /* The size rules come before the latents' shape, which depends on them. */
    if ((st = dit_gen_check(info, &gp, diag)) != DIT_OK)
        return st;
    if (req->latents) {
        int64_t s[5];
        const int nd = dit_gen_latents_shape(info, &gp, s);
        s[0] = dit_gen_num_images(&gp);
        if ((st = check_tensor("latents", req->latents, nd, s, 0, diag)) != DIT_OK)
            return st;
    }
    return DIT_OK;
}

dit_status dit_request_validate_mesh(const Ditserve__V1__GenerateRequest *req,
                                     const dit_pipeline_info *info, const dit_parallel_config *pc,
                                     dit_diag *diag)
{
    if (pc->world_size <= 1)
        return DIT_OK;
    dit_gen_params gp;
    fill_params(req, info, &gp);
    return dit_gen_check_mesh(info, &gp, pc, diag);
}

void dit_request_mesh_advice(const Ditserve__V1__GenerateRequest *req,
                             const dit_pipeline_info *info, const dit_parallel_config *pc,
                             char *buf, size_t cap)
{
    dit_diag diag;
    dit_diag_clear(&diag);
    if (dit_request_validate_mesh(req, info, pc, &diag) == DIT_OK) {
        snprintf(buf, cap, "%s", "");
        return;
    }
    dit_gen_params gp;
    fill_params(req, info, &gp);
    if (!dit_gen_mesh_advice(info, &gp, pc, buf, cap))
        snprintf(buf, cap, "%s", dit_diag_msg(&diag));
}

bool dit_request_warning(const Ditserve__V1__GenerateRequest *req, const dit_pipeline_info *info,
                         char *buf, size_t cap)
{
    dit_gen_params gp;
    fill_params(req, info, &gp);
    const dit_gen_field_names names = {"negative_prompt", "true_cfg_scale", "guidance_scale"};
    return dit_gen_warning(info, &gp, &names, buf, cap);
}

static dit_status to_f32(const Ditserve__V1__Tensor *t, float **out, dit_diag *diag)
{
    if (!t)
        return DIT_OK;
    dit_dtype dt = DIT_F32;
    dtype_of(t->dtype, &dt);
    const size_t n = t->data.len / dit_dtype_size(dt);
    *out = malloc((n ? n : 1) * sizeof(float));
    if (!*out)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory for request tensors");
    dit_convert_to_f32(*out, t->data.data, dt, n);
    return DIT_OK;
}

dit_status dit_request_resolve(const Ditserve__V1__GenerateRequest *req,
                               const dit_pipeline_info *info, uint64_t seed_fallback,
                               dit_request *out, dit_diag *diag)
{
    memset(out, 0, sizeof *out);
    dit_status st = dit_request_validate(req, info, diag);
    if (st != DIT_OK)
        return st;
    fill_params(req, info, &out->gp);
    out->seed_set = req->seed != NULL;
    if (!out->seed_set)
        out->gp.seed = seed_fallback;
    out->output_format = dit_request_output_format(req, info);
    DIT_CHECK(to_f32(req->prompt_embeds, &out->prompt_embeds, diag));
    DIT_CHECK(to_f32(req->pooled_prompt_embeds, &out->pooled_prompt_embeds, diag));
    DIT_CHECK(to_f32(req->negative_prompt_embeds, &out->negative_prompt_embeds, diag));
    DIT_CHECK(
        to_f32(req->negative_pooled_prompt_embeds, &out->negative_pooled_prompt_embeds, diag));
    DIT_CHECK(to_f32(req->latents, &out->latents, diag));
    out->gp.prompt_embeds = out->prompt_embeds;
    out->gp.pooled_prompt_embeds = out->pooled_prompt_embeds;
    out->gp.negative_prompt_embeds = out->negative_prompt_embeds;
    out->gp.negative_pooled_prompt_embeds = out->negative_pooled_prompt_embeds;
    out->gp.latents = out->latents;
    return DIT_OK;
cleanup:
    dit_request_free(out);
    return st;
}

void dit_request_free(dit_request *r)
{
    if (!r)
        return;
    free(r->prompt_embeds);
    free(r->pooled_prompt_embeds);
    free(r->negative_prompt_embeds);
    free(r->negative_pooled_prompt_embeds);
    free(r->latents);
    memset(r, 0, sizeof *r);
}

/* A base-128 varint at *p (below end); false when it runs off the end or
 * past 64 bits. */
static bool read_varint(const uint8_t **p, const uint8_t *end, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        const uint8_t b = *(*p)++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return true;
        }
    }
    return false;
}

static dit_status check_strings(const ProtobufCMessageDescriptor *desc, const uint8_t *p,
                                const uint8_t *end, int depth, dit_diag *diag)
{
    /* Deeper than any ditserve message nests; protobuf-c has already
     * unpacked these bytes, so this only bounds the recursion. */
    if (depth > 16)
        return DIT_OK;
    while (p < end) {
        uint64_t key, n;
        if (!read_varint(&p, end, &key))
            return DIT_OK;
        switch (key & 7) {
        case 0:
            if (!read_varint(&p, end, &n))
                return DIT_OK;
            break;
        case 1:
            p += (size_t)(end - p) < 8 ? (size_t)(end - p) : 8;
            break;
        case 5:
            p += (size_t)(end - p) < 4 ? (size_t)(end - p) : 4;
            break;
        case 2: {
            if (!read_varint(&p, end, &n) || n > (uint64_t)(end - p))
                return DIT_OK;
            const ProtobufCFieldDescriptor *f =
                key >> 3 <= UINT32_MAX
                    ? protobuf_c_message_descriptor_get_field(desc, (unsigned)(key >> 3))
                    : NULL;
            if (f && f->type == PROTOBUF_C_TYPE_STRING && memchr(p, 0, (size_t)n))
                return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                    "%s holds a NUL byte; strings may not contain NUL", f->name);
            if (f && f->type == PROTOBUF_C_TYPE_MESSAGE) {
                dit_status st = check_strings(f->descriptor, p, p + n, depth + 1, diag);
                if (st != DIT_OK)
                    return st;
            }
            p += n;
            break;
        }
        default: /* groups: not in these messages, and unpack skipped them */
            return DIT_OK;
        }
    }
    return DIT_OK;
}

dit_status dit_request_check_strings(const ProtobufCMessageDescriptor *desc, const uint8_t *buf,
                                     size_t len, dit_diag *diag)
{
    return check_strings(desc, buf, buf + len, 0, diag);
}

static bool same_str(const char *a, const char *b)
{
    return strcmp(a ? a : "", b ? b : "") == 0;
}

bool dit_request_batchable(const Ditserve__V1__GenerateRequest *a,
                           const Ditserve__V1__GenerateRequest *b, const dit_pipeline_info *info)
{
    /* Not the model name: admission holds every request to the one model
     * served, named or left empty (ditd's model_ok). */
    if (a->n_loras != b->n_loras)
        return false;
    for (size_t i = 0; i < a->n_loras; i++)
        if (!same_str(a->loras[i]->name, b->loras[i]->name) ||
            a->loras[i]->scale != b->loras[i]->scale)
            return false;
    dit_gen_params x, y;
    fill_params(a, info, &x);
    fill_params(b, info, &y);
    return dit_gen_batch_compatible(info, &x, &y);
}

void dit_request_strip_unknown(ProtobufCMessage *m)
{
    if (!m)
        return;
    for (unsigned i = 0; i < m->n_unknown_fields; i++)
        free(m->unknown_fields[i].data);
    free(m->unknown_fields);
    m->unknown_fields = NULL;
    m->n_unknown_fields = 0;
    const ProtobufCMessageDescriptor *d = m->descriptor;
    char *base = (char *)m;
    for (unsigned f = 0; f < d->n_fields; f++) {
        const ProtobufCFieldDescriptor *fd = &d->fields[f];
        if (fd->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            const size_t n = *(const size_t *)(base + fd->quantifier_offset);
            ProtobufCMessage **items = *(ProtobufCMessage ***)(base + fd->offset);
            for (size_t k = 0; k < n; k++)
                dit_request_strip_unknown(items[k]);
            continue;
        }
        if ((fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(base + fd->quantifier_offset) != fd->id)
            continue; /* another member of the oneof holds the storage */
        dit_request_strip_unknown(*(ProtobufCMessage **)(base + fd->offset));
    }
}
