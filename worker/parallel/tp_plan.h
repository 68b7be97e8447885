/* A model's tensor-parallel plan as data, read by generic code: module-name
 * patterns mapped to how a linear's weights are split over the tp group
 * (diffusers' `_tp_plan`), and the slicing of each style into a weight plan
 * (loader/weights.h), so a model's loader names its linears and shapes and
 * never computes a slice itself.
 *
 * Styles, for rank r of T, a linear y = x W^T + b with W (N, K):
 *   REPLICATE       W and b whole.
 *   COLWISE         rows [r N/T, (r+1) N/T) of W and b: this rank's output
 *                   features, no communication.
 *   COLWISE_GATHER  as COLWISE, and the forward all-gathers the (B, N)
 *                   output (for small per-sample linears whose weights are
 *                   large, such as FLUX's AdaLN modulations: memory falls as
 *                   1/T where diffusers replicates them).
 *   ROWWISE         columns [r K/T, (r+1) K/T) of W (this rank's input
 *                   features); the forward all-reduces the sum; the bias
 *                   is added once, by rank 0.
 *   PACKED_ROWS     ROWWISE within each of several packed input blocks
 *                   (their widths given by the model: FLUX's single-block
 *                   proj_out over cat([attention, mlp])), each block into
 *                   its own destination; the bias with block 0 on rank 0.
 *
 * Patterns are dotted module names where `*` stands for one component
 * ("transformer_blocks.*.attn.to_q"); the first matching rule wins; a
 * module no rule matches is replicated.
 *
 * Owner: plans are static tables; a weight plan belongs to its loader. */
#ifndef DIT_PARALLEL_TP_PLAN_H
#define DIT_PARALLEL_TP_PLAN_H

#include <stdbool.h>
#include <stdint.h>

#include "core/tensor.h"
#include "loader/weights.h"

typedef enum dit_tp_style {
    DIT_TP_REPLICATE,
    DIT_TP_COLWISE,
    DIT_TP_COLWISE_GATHER,
    DIT_TP_ROWWISE,
    DIT_TP_PACKED_ROWS,
} dit_tp_style;

typedef struct dit_tp_rule {
    const char *pattern;
    dit_tp_style style;
} dit_tp_rule;

struct dit_lora_sites;
struct dit_lora_op;

/* A plan and this rank's place in the tp group. With `sites` set, every
 * linear added through it is also recorded there as a LoRA target
 * (parallel/lora.h), with the same slicing. */
typedef struct dit_tp_plan {
    const dit_tp_rule *rules;
    int n_rules;
    int tp_degree, tp_rank;
    struct dit_lora_sites *sites; /* NULL: record nothing */
} dit_tp_plan;

/* A linear as this rank holds it. */
typedef struct dit_linear {
    dit_tensor w; /* (N_local, K_local) */
    dit_tensor b; /* (N_local), valid when has_b */
    bool has_b;
    /* Adapter products added to its output (parallel/lora.h); NULL when
     * none is attached. */
    const struct dit_lora_op *lora;
} dit_linear;

bool dit_tp_pattern_match(const char *pattern, const char *module);
dit_tp_style dit_tp_plan_style(const dit_tp_plan *tp, const char *module);

/* Reserves L and adds the pieces of module.weight (N, K) and module.bias (N)
 * this rank keeps, by the module's style (COLWISE, COLWISE_GATHER, ROWWISE
 * or REPLICATE). A PACKED_ROWS module here marks the plan bad. */
void dit_tp_add_linear(dit_weight_plan *wp, const dit_tp_plan *tp, const char *module, int64_t N,
                       int64_t K, dit_linear *L);

/* Several column-split modules of input width K stacked into one
 * destination in order (fused projections such as [q; k; v]): reserves L
 * with the sum of their local rows. Each module must be COLWISE. */
void dit_tp_add_fused(dit_weight_plan *wp, const dit_tp_plan *tp, const char *const *modules,
                      const int64_t *N, int n_modules, int64_t K, dit_linear *L);

/* A PACKED_ROWS module (output N, input the packed blocks widths[]): block
 * i's local columns into *L[i]. */
void dit_tp_add_packed(dit_weight_plan *wp, const dit_tp_plan *tp, const char *module, int64_t N,
                       const int64_t *widths, int n_blocks, dit_linear *const *L);

#endif
