/* LoRA adapters applied unfused: a linear y = act(x W^T + b) with adapters
 * attached computes
 *
 *     y = act(x W^T + b + sum_i scale_i (x A_i^T) B_i^T)
 *
 * so the base weights are never rewritten and each generation may attach a
 * different set. Nothing changes for a linear with no adapter attached: it
 * runs the very same backend call as before.
 *
 * Three objects:
 *   dit_lora_sites  a model's linears that adapters may target, as this rank
 *                   holds them (module name, whole shape, the rows and
 *                   columns this rank keeps, the device linear and the rows
 *                   of it the module fills when fused). The tensor-parallel
 *                   loader records them (parallel/tp_plan.h), so an adapter
 *                   is sharded exactly as its base weight: a column-split
 *                   module keeps its rows of B, a row-split one its columns
 *                   of A (the all-reduce after it sums the partial
 *                   products), a packed one each block's columns of A.
 *   dit_lora        one adapter file loaded for one model on this rank:
 *                   its A and B slices in backend memory, the file's own
 *                   scaling (alpha / rank) folded into B, the A's of the
 *                   modules that land in one linear stacked (one GEMM reads
 *                   the input for all of them). Load it once, attach it to
 *                   many generations.
 *   attachment      dit_lora_attach(sites, {adapter, scale}...) points the
 *                   model's linears at the adapters until dit_lora_detach.
 *
 * File formats (what diffusers' load_lora_weights accepts for these keys):
 *   diffusers / PEFT  "[transformer.]<module>.lora_A.weight" (r, K) and
 *                     ".lora_B.weight" (N, r); an optional "<module>.alpha"
 *                     scales by alpha / r, else the scaling is 1.
 *   kohya             "lora_unet_<name>.lora_down.weight" (r, K),
 *                     ".lora_up.weight" (N, r), ".alpha" (alpha / r; without
 *                     it 1). <name> is mapped to modules by the model's own
 *                     table (dit_lora_kohya_fn); a name that maps to several
 *                     modules (FLUX's fused qkv) shares `down` and splits
 *                     `up` by rows in the modules' widths.
 * Any other key, a module the model lacks, a shape that does not fit it or
 * A and B of different ranks refuse the whole file, naming the key.
 *
 * Owner: sites belong to their model (the thread that loaded it); an
 * adapter to the thread that loaded it and must outlive every attachment of
 * it; attach, detach and forwards run on the model's thread. */
#ifndef DIT_PARALLEL_LORA_H
#define DIT_PARALLEL_LORA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/arena.h"
#include "backend/backend.h"
#include "core/file_id.h"
#include "core/status.h"
#include "core/tensor.h"
#include "parallel/tp_plan.h"

typedef struct dit_lora_sites dit_lora_sites;
typedef struct dit_lora dit_lora;

/* A module a kohya name stands for; swap_halves exchanges the two halves of
 * `up`'s rows (BFL's (shift, scale) against diffusers' (scale, shift));
 * no_alpha ignores the file's alpha (diffusers ignores it there). */
typedef struct dit_lora_kohya_target {
    char module[128];
    bool swap_halves;
    bool no_alpha;
} dit_lora_kohya_target;

/* The modules kohya `name` (without "lora_unet_") stands for, in the order
 * their rows are stacked in `up`; returns how many (at most max), 0 when
 * the name means nothing to the model. */
typedef int (*dit_lora_kohya_fn)(const char *name, dit_lora_kohya_target *out, int max);

/* One link of the list of adapter products a linear adds (opaque). */
typedef struct dit_lora_op dit_lora_op;

dit_status dit_lora_sites_create(dit_lora_kohya_fn kohya, dit_lora_sites **out, dit_diag *diag);
/* Detaches first. NULL-safe. */
void dit_lora_sites_destroy(dit_lora_sites *s);

/* Records that rows [n0, n0 + nl) and columns [k0, k0 + kl) of module
 * (whole weight (N, K)) land in dst's rows [row0, row0 + nl). A module may
 * be recorded more than once (packed blocks). Out of memory is remembered
 * and reported by the next load. */
void dit_lora_sites_add(dit_lora_sites *s, const char *module, int64_t N, int64_t K,
                        dit_linear *dst, int64_t row0, int64_t n0, int64_t nl, int64_t k0,
                        int64_t kl);

/* Number of recorded sites (pieces). */
size_t dit_lora_sites_count(const dit_lora_sites *s);

/* Whether any adapter is attached (models then take their plain f32 path
 * and run eagerly, without CUDA graphs). */
bool dit_lora_sites_active(const dit_lora_sites *s);

/* Loads the adapter file `path` for the model whose sites are `sites`,
 * this rank's slices into `be`'s memory. The file is read into host memory
 * first, so that what happens to it meanwhile cannot fault the process; a
 * file of more than max_file_bytes (when nonzero) is DIT_ERR_UNSUPPORTED
 * unread. Alphas, scalings and weights must be finite, and a module's rank
 * at most min(N, K). */
dit_status dit_lora_load(dit_backend *be, const dit_lora_sites *sites, const char *path,
                         uint64_t max_file_bytes, dit_lora **out, dit_diag *diag);
void dit_lora_destroy(dit_lora *l);

typedef struct dit_lora_info {
    int n_modules; /* modules of the model the adapter changes */
    int max_rank;
    size_t bytes;     /* backend memory this rank holds for it */
    dit_file_id file; /* the file as it was when read (core/file_id.h) */
} dit_lora_info;

dit_lora_info dit_lora_get_info(const dit_lora *l);

/* An adapter and the weight that multiplies its whole change (diffusers'
 * set_adapters weight). */
typedef struct dit_lora_use {
    const dit_lora *lora;
    float scale;
} dit_lora_use;

/* Attaches these adapters (replacing any attached set); uses with scale 0
 * are skipped (the base output exactly). Each adapter must have been loaded
 * for these sites. */
dit_status dit_lora_attach(dit_lora_sites *sites, const dit_lora_use *uses, int n_uses,
                           dit_diag *diag);
/* Back to the base model. NULL-safe. */
void dit_lora_detach(dit_lora_sites *sites);

/* Merges scale times adapter `l` into the model's weights for good:
 * W += scale B A for each of its modules (on the host in f32, then stored
 * back in the backend's weight dtype), so later forwards run at the base
 * model's speed with no adapter attached. This is the one call that
 * rewrites base weights: reload the model to undo it (subtracting would not
 * give the bf16 weights back). Nothing may be attached while fusing; `l`
 * may be destroyed afterwards. */
dit_status dit_lora_fuse(dit_lora_sites *sites, const dit_lora *l, float scale, dit_diag *diag);

/* y = act(x W^T + b + sum scale (x A^T) B^T) + beta y for L and the
 * adapters attached to it, with the backend linear's shapes: x (B, M, K) or
 * (M, K), y (B, M, N) or (M, N). With none attached this is exactly
 * be->ops->linear. Scratch (B, M, r) from `arena`, released before
 * returning. */
dit_status dit_lora_linear(dit_backend *be, dit_arena *arena, const dit_tensor *y,
                           const dit_tensor *x, const dit_linear *L, dit_act act, float beta);

#endif
