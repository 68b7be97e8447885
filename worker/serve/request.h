/* A ditserve.v1.GenerateRequest turned into pipeline parameters: defaults
 * applied from the pipeline's probe (FluxPipeline: 1024x1024, 28 steps,
 * guidance 3.5, ...), every field range-checked, tensors checked against
 * the pipeline (dtype, shape, byte count) and converted to f32. The
 * daemon validates with it when a request arrives; the workers resolve
 * with it when the job runs, so both read the request the same way.
 *
 * Owner: the caller of dit_request_resolve owns the result. */
#ifndef DIT_SERVE_REQUEST_H
#define DIT_SERVE_REQUEST_H

#include <stdbool.h>

#include "ditserve_v1_generation.pb-c.h"
#include "parallel/mesh.h"
#include "pipelines/probe.h"

/* FluxPipeline's defaults; requests take the probe's (dit_pipeline_info),
 * the same for FluxPipeline. Kept for the coordinator's job descriptions. */
#define DIT_REQUEST_DEFAULT_SIZE 1024
#define DIT_REQUEST_DEFAULT_STEPS 28
#define DIT_REQUEST_DEFAULT_GUIDANCE 3.5f
#define DIT_REQUEST_MAX_PROMPT_BYTES 65536
#define DIT_REQUEST_MAX_ID_BYTES 128
#define DIT_REQUEST_MAX_LORAS 8
#define DIT_REQUEST_MAX_LORA_NAME_BYTES 128
#define DIT_REQUEST_MAX_LORA_SCALE 100.0f
/* |priority| at most this: the daemon's own jobs (LoRA loads, warm-ups)
 * run above every request's. */
#define DIT_REQUEST_MAX_PRIORITY 1000000

typedef struct dit_request {
    dit_gen_params gp; /* points into this struct's own storage */
    int output_format; /* DITSERVE__V1__OUTPUT_FORMAT__OUTPUT_FORMAT_PNG, _MP4 or _RAW_TENSOR */
    bool seed_set;     /* the request chose the seed */
    float *prompt_embeds, *pooled_prompt_embeds;
    float *negative_prompt_embeds, *negative_pooled_prompt_embeds;
    float *latents;
} dit_request;

/* The output format a (validated) request gets: the one it asks for, or
 * for UNSPECIFIED the pipeline's: PNG for images, MP4 for video. */
int dit_request_output_format(const Ditserve__V1__GenerateRequest *req,
                              const dit_pipeline_info *info);

/* Whether `name` is an adapter name a request may use: 1 to
 * DIT_REQUEST_MAX_LORA_NAME_BYTES bytes of [A-Za-z0-9._-], without "..". */
bool dit_request_lora_name_ok(const char *name);

/* Checks everything without allocating; the message says which field is
 * wrong and what would be right. */
dit_status dit_request_validate(const Ditserve__V1__GenerateRequest *req,
                                const dit_pipeline_info *info, dit_diag *diag);

/* The mesh's rules for this request's token counts (image tokens from the
 * size, text tokens from prompt_embeds or max_sequence_length): plain
 * context-parallel modes need counts divisible by the CP size. Call after
 * dit_request_validate. */
dit_status dit_request_validate_mesh(const Ditserve__V1__GenerateRequest *req,
                                     const dit_pipeline_info *info, const dit_parallel_config *pc,
                                     dit_diag *diag);

/* What the client can change when dit_request_validate_mesh refuses the
 * request: for image tokens the mesh cannot split evenly, the nearest
 * widths and heights that it can; for text tokens, the nearest
 * max_sequence_length (or prompt_embeds length). Written to buf for the
 * client, in terms of request fields; the operator's remedy (an "anything"
 * mode) stays in dit_request_validate_mesh's message, for the log. Rules a
 * request cannot change (heads per rank) get that message as it is. */
void dit_request_mesh_advice(const Ditserve__V1__GenerateRequest *req,
                             const dit_pipeline_info *info, const dit_parallel_config *pc,
                             char *buf, size_t cap);

/* A request field that has no effect (FLUX: a negative prompt without
 * true_cfg_scale above 1, or the reverse; Wan: a negative prompt without
 * guidance_scale above 1), as diffusers warns about it: true and the
 * warning in buf, or false. */
bool dit_request_warning(const Ditserve__V1__GenerateRequest *req, const dit_pipeline_info *info,
                         char *buf, size_t cap);

/* Validates, then fills *out (tensors converted to f32). seed_fallback is
 * used when the request has no seed. */
dit_status dit_request_resolve(const Ditserve__V1__GenerateRequest *req,
                               const dit_pipeline_info *info, uint64_t seed_fallback,
                               dit_request *out, dit_diag *diag);

void dit_request_free(dit_request *r);

/* Whether two validated requests may run as one batch (ditd --max-batch):
 * the same LoRA adapters with the same scales in the
 * same order, and dit_gen_batch_compatible on their parameters (size,
 * frames, steps, text length, CFG on or off). Prompts, seeds, guidance,
 * latents, num_images, fps, output format, priority and ids are each
 * member's own. The model name is not compared: a daemon serves one model,
 * and a request names it or leaves it empty. */
bool dit_request_batchable(const Ditserve__V1__GenerateRequest *a,
                           const Ditserve__V1__GenerateRequest *b, const dit_pipeline_info *info);

/* Frees the fields of an unpacked message (nested messages included) that
 * its type does not define: a newer client's fields mean nothing here, and
 * kept they would be packed again into every worker's job (a client could
 * pad a request with --max-message-bytes of them). */
void dit_request_strip_unknown(ProtobufCMessage *m);

/* Refuses an encoded message (buf, len bytes; desc its type) with a NUL byte
 * in any string field, nested messages included. protobuf-c hands strings
 * over NUL-terminated, so such a field would otherwise be read cut short
 * ("demo\0x" read as "demo"). Call on the bytes that unpacked. */
dit_status dit_request_check_strings(const ProtobufCMessageDescriptor *desc, const uint8_t *buf,
                                     size_t len, dit_diag *diag);

#endif
