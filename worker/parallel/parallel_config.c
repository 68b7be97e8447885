/* The parallel layout's rules, apart from the mesh itself: nothing here
 * talks to a comm, so the coordinator validates with it without linking
 * the compute layers. */
#include <stdlib.h>
#include <string.h>

#include "parallel/mesh.h"

dit_parallel_config dit_parallel_config_single(void)
{
    dit_parallel_config pc;
    memset(&pc, 0, sizeof pc);
    pc.world_size = 1;
    pc.ring_degree = 1;
    pc.ulysses_degree = 1;
    pc.tp_degree = 1;
    pc.cfg_degree = 1;
    pc.fp32_merge = true;
    return pc;
}

bool dit_parallel_uneven(const dit_parallel_config *pc)
{
    return pc->ulysses_anything || pc->ring_anything || pc->unified_anything;
}

dit_status dit_parallel_validate(const dit_parallel_config *pc, dit_diag *diag)
{
    const int R = pc->ring_degree, U = pc->ulysses_degree, T = pc->tp_degree;
    const int G = pc->cfg_degree;
    if (R < 1 || U < 1 || T < 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "ring_degree (%d), ulysses_degree (%d) and tp_degree (%d) must all be "
                            ">= 1",
                            R, U, T);
    if (pc->world_size < 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "world size must be >= 1, not %d",
                            pc->world_size);
    if (G != 1 && G != 2)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "cfg_degree must be 1 or 2 (the conditional and unconditional halves "
                            "of a CFG batch), not %d",
                            G);
    if (pc->world_size > 1 && R == 1 && U == 1 && T == 1 && G == 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "world size %d but every degree is 1: either ring_degree or "
                            "ulysses_degree must be greater than 1 for context parallelism, or "
                            "tp_degree for tensor parallelism, or cfg_degree 2 for CFG parallelism",
                            pc->world_size);
    if (G > 1 && (long)G * R * U * T != pc->world_size)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "cfg_degree (%d) x ring_degree (%d) x ulysses_degree (%d) x tp_degree "
                            "(%d) = %ld must equal the world size (%d)",
                            G, R, U, T, (long)G * R * U * T, pc->world_size);
    if (G == 1 && (long)R * U * T != pc->world_size)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "ring_degree (%d) x ulysses_degree (%d) x tp_degree (%d) = %ld must "
                            "equal the world size (%d)",
                            R, U, T, (long)R * U * T, pc->world_size);
    if (pc->ulysses_anything && pc->ring_anything)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "ulysses_anything and ring_anything cannot both be enabled (use "
                            "unified_anything for uneven splits with ring x ulysses)");
    if ((pc->ulysses_anything || pc->ring_anything) && pc->unified_anything)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "unified_anything already covers ulysses_anything and ring_anything; "
                            "enable only one anything mode");
    if (pc->ulysses_anything) {
        if (U == 1)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "ulysses_degree must be greater than 1 for ulysses_anything");
        if (R > 1)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "ulysses_anything cannot be enabled when ring_degree > 1 (use "
                                "unified_anything for ring x ulysses)");
    }
    if (pc->ring_anything) {
        if (R == 1)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "ring_degree must be greater than 1 for ring_anything");
        if (U > 1)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "ring_anything cannot be enabled when ulysses_degree > 1 (use "
                                "unified_anything for ring x ulysses)");
    }
    if (pc->unified_anything && (R == 1 || U == 1))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "unified_anything needs ring_degree > 1 and ulysses_degree > 1 (use "
                            "ring_anything or ulysses_anything for one of them)");
    return DIT_OK;
}

dit_status dit_parallel_validate_model(const dit_parallel_config *pc, const dit_parallel_req *req,
                                       const int64_t *seq_lens, dit_diag *diag)
{
    const int U = pc->ulysses_degree, T = pc->tp_degree;
    const int C = pc->ring_degree * U;
    const int H = req->num_heads;
    if (H % T != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "num_attention_heads (%d) must be divisible by tp_degree (%d)", H, T);
    for (int i = 0; i < req->n_widths; i++)
        if (req->widths[i] % T != 0)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "%s (%d) must be divisible by tp_degree (%d)", req->width_names[i],
                                req->widths[i], T);
    if (C > 1 && req->n_seqs == 0)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "this model's context-parallel plan splits no sequence: ring_degree "
                            "and ulysses_degree must be 1");
    const bool uneven_heads = pc->ulysses_anything || pc->unified_anything;
    if (!uneven_heads && (H / T) % U != 0) {
        if (T > 1)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "the %d heads per tensor-parallel rank (num_attention_heads %d / "
                                "tp_degree %d) must be divisible by ulysses_degree (%d); "
                                "ulysses_anything allows uneven heads",
                                H / T, H, T, U);
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "num_attention_heads (%d) must be divisible by ulysses_degree (%d); "
                            "ulysses_anything allows uneven heads",
                            H, U);
    }
    if (seq_lens && C > 1 && !dit_parallel_uneven(pc)) {
        const char *hint = pc->ring_degree > 1 && U > 1 ? "unified_anything"
                           : U > 1                      ? "ulysses_anything"
                                                        : "ring_anything";
        for (int i = 0; i < req->n_seqs; i++)
            if (seq_lens[i] % C != 0)
                return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                    "the %lld %s are not divisible by the context-parallel "
                                    "size %d (ring %d x ulysses %d); %s splits them unevenly",
                                    (long long)seq_lens[i], req->seq_names[i], C, pc->ring_degree,
                                    U, hint);
    }
    return DIT_OK;
}

void dit_partition(int64_t n, int k, int i, int64_t *offset, int64_t *len)
{
    const int64_t base = n / k, extra = n % k;
    *len = base + (i < extra ? 1 : 0);
    *offset = (int64_t)i * base + (i < extra ? i : extra);
}
