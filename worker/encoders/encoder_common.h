/* What the text encoders (clip_text.c: CLIPTextModel; t5_common.c for
 * T5EncoderModel and UMT5EncoderModel) share beyond the weight loader
 * (loader/weights.h): transformers' activation names, ReLU through the host
 * for backends without it, the check that a checkpoint holds nothing but
 * the model's parameters (less the names a model ignores), the check that
 * the backend has the ops a model needs, and the token-id range check of a
 * forward call.
 *
 * Errors name the file and tensor, or the caller's `what` ("clip text
 * forward"), as the encoders always have.
 *
 * Owner: stateless; the backend functions run on the thread that owns the
 * backend. */
#ifndef DIT_ENCODERS_ENCODER_COMMON_H
#define DIT_ENCODERS_ENCODER_COMMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "core/status.h"
#include "core/tensor.h"
#include "loader/safetensors.h"
#include "loader/weights.h"

/* transformers' ACT2FN name -> the backend activation. The tanh-form GELUs
 * (gelu_new, gelu_pytorch_tanh, gelu_fast, gelu_accurate) are the same
 * function written with different constants; they agree to f32 rounding.
 * "relu" has no backend activation: *act = DIT_ACT_NONE and *relu = true,
 * for dit_encoder_relu_on_host after the linear. false for a name not
 * supported. */
bool dit_encoder_parse_act(const char *name, dit_act *act, bool *relu);

/* In-place ReLU of the backend tensor t (contiguous f32) through the host:
 * download, max(x, 0) with NaN kept (torch.relu), upload. */
dit_status dit_encoder_relu_on_host(dit_backend *be, const dit_tensor *t);

/* Every tensor of `set` must be a parameter in `l` (a checkpoint for another
 * config would otherwise half-load), be named in extra[0..n_extra) (NULL
 * entries allowed: tensors consumed outside the list or known to be
 * ignorable), or start with `skip_prefix` (NULL: none). DIT_ERR_FORMAT
 * naming the file, the tensor and `model` ("CLIPTextModel") otherwise. */
dit_status dit_encoder_check_unexpected(const dit_st_set *set, const dit_weight_list *l,
                                        const char *skip_prefix, const char *const *extra,
                                        size_t n_extra, const char *model, dit_diag *diag);

/* One backend op an encoder needs: whether the backend has it, and its
 * name for the error. DIT_ENCODER_OP(ops, field) fills both from a
 * dit_backend_ops field. */
typedef struct dit_encoder_op {
    bool present;
    const char *name;
} dit_encoder_op;
#define DIT_ENCODER_OP(ops, field) ((dit_encoder_op){(ops)->field != NULL, #field})

/* DIT_ERR_UNSUPPORTED naming the first of need[0..n) that `be` lacks and
 * `model` ("CLIPTextModel"): "backend 'cpu' has no fill op, which ... needs". */
dit_status dit_encoder_check_ops(const dit_backend *be, const dit_encoder_op *need, size_t n,
                                 const char *model, dit_diag *diag);

/* ids: host (B, S); each must lie in [0, vocab). DIT_ERR_INVALID_ARG naming
 * the first one outside and its position, prefixed by `what`. */
dit_status dit_encoder_check_ids(const int32_t *ids, int64_t B, int64_t S, int64_t vocab,
                                 const char *what, dit_diag *diag);

#endif
