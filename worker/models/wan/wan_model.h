/* WanTransformer3DModel as a model class (models/model.h): its config,
 * parallel requirements, context-parallel plan and the forward over named
 * tensors, on top of wan.h.
 *
 * Owner: a static table. */
#ifndef DIT_MODELS_WAN_WAN_MODEL_H
#define DIT_MODELS_WAN_WAN_MODEL_H

#include "models/model.h"

extern const dit_model_class dit_wan_model_class;

#endif
