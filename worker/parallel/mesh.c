#include "parallel/mesh.h"

#include <stdlib.h>
#include <string.h>

struct dit_mesh {
    dit_parallel_config pc;
    dit_comm *world;
    dit_comm *tp, *ulysses, *ring, *cp;
    int tp_rank, ulysses_rank, ring_rank, cp_rank;
};

dit_parallel_config dit_parallel_config_single(void)
{
    dit_parallel_config pc;
    memset(&pc, 0, sizeof pc);
    pc.world_size = 1;
    pc.ring_degree = 1;
    pc.ulysses_degree = 1;
    pc.tp_degree = 1;
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
    if (R < 1 || U < 1 || T < 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "ring_degree (%d), ulysses_degree (%d) and tp_degree (%d) must all be "
                            ">= 1",
                            R, U, T);
    if (pc->world_size < 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "world size must be >= 1, not %d",
                            pc->world_size);
    if (pc->world_size > 1 && R == 1 && U == 1 && T == 1)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "world size %d but every degree is 1: either ring_degree or "
                            "ulysses_degree must be greater than 1 for context parallelism, or "
                            "tp_degree for tensor parallelism",
                            pc->world_size);
    if ((long)R * U * T != pc->world_size)
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

dit_status dit_parallel_validate_model(const dit_parallel_config *pc, const dit_flux_config *mc,
                                       int64_t img_tokens, int64_t txt_tokens, dit_diag *diag)
{
    const int U = pc->ulysses_degree, T = pc->tp_degree;
    const int C = pc->ring_degree * U;
    const int H = mc->num_attention_heads;
    if (H % T != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "num_attention_heads (%d) must be divisible by tp_degree (%d)", H, T);
    if (mc->mlp_dim % T != 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "the FFN width (%d) must be divisible by tp_degree (%d)", mc->mlp_dim,
                            T);
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
    if (C > 1 && !dit_parallel_uneven(pc)) {
        const char *hint = pc->ring_degree > 1 && U > 1 ? "unified_anything"
                           : U > 1                      ? "ulysses_anything"
                                                        : "ring_anything";
        if (img_tokens % C != 0)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "the %lld image tokens are not divisible by the context-parallel "
                                "size %d (ring %d x ulysses %d); %s splits them unevenly",
                                (long long)img_tokens, C, pc->ring_degree, U, hint);
        if (txt_tokens % C != 0)
            return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                                "the %lld text tokens are not divisible by the context-parallel "
                                "size %d (ring %d x ulysses %d); %s splits them unevenly",
                                (long long)txt_tokens, C, pc->ring_degree, U, hint);
    }
    return DIT_OK;
}

void dit_partition(int64_t n, int k, int i, int64_t *offset, int64_t *len)
{
    const int64_t base = n / k, extra = n % k;
    *len = base + (i < extra ? 1 : 0);
    *offset = (int64_t)i * base + (i < extra ? i : extra);
}

dit_status dit_mesh_create(const dit_parallel_config *pc, dit_comm *world, dit_mesh **out,
                           dit_diag *diag)
{
    dit_status st = dit_parallel_validate(pc, diag);
    if (st != DIT_OK)
        return st;
    if (dit_comm_size(world) != pc->world_size)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "mesh of %d ranks on a world of %d",
                            pc->world_size, dit_comm_size(world));
    dit_mesh *m = calloc(1, sizeof *m);
    if (!m)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    m->pc = *pc;
    m->world = world;
    const int U = pc->ulysses_degree, T = pc->tp_degree, R = pc->ring_degree;
    const int rank = dit_comm_rank(world);
    m->tp_rank = rank % T;
    m->cp_rank = rank / T;
    m->ulysses_rank = m->cp_rank % U;
    m->ring_rank = m->cp_rank / U;
    /* Every split is collective over the world, so every rank makes all
     * four, taking part with color -1 in the ones it does not need. */
    DIT_CHECK(world->ops->split(world, T > 1 ? m->cp_rank : -1, m->tp_rank, &m->tp, diag));
    DIT_CHECK(world->ops->split(world, U > 1 ? m->ring_rank * T + m->tp_rank : -1,
                                m->ulysses_rank, &m->ulysses, diag));
    DIT_CHECK(world->ops->split(world, R > 1 ? m->ulysses_rank * T + m->tp_rank : -1,
                                m->ring_rank, &m->ring, diag));
    DIT_CHECK(world->ops->split(world, R * U > 1 ? m->tp_rank : -1, m->cp_rank, &m->cp, diag));
    *out = m;
    return DIT_OK;
cleanup:
    dit_mesh_destroy(m);
    return st;
}

void dit_mesh_destroy(dit_mesh *m)
{
    if (!m)
        return;
    dit_comm_destroy(m->cp);
    dit_comm_destroy(m->ring);
    dit_comm_destroy(m->ulysses);
    dit_comm_destroy(m->tp);
    free(m);
}

const dit_parallel_config *dit_mesh_config(const dit_mesh *m)
{
    return &m->pc;
}

dit_comm *dit_mesh_world(const dit_mesh *m)
{
    return m->world;
}

dit_comm *dit_mesh_tp(const dit_mesh *m)
{
    return m->tp;
}

dit_comm *dit_mesh_ulysses(const dit_mesh *m)
{
    return m->ulysses;
}

dit_comm *dit_mesh_ring(const dit_mesh *m)
{
    return m->ring;
}

dit_comm *dit_mesh_cp(const dit_mesh *m)
{
    return m->cp;
}

int dit_mesh_tp_rank(const dit_mesh *m)
{
    return m->tp_rank;
}

int dit_mesh_ulysses_rank(const dit_mesh *m)
{
    return m->ulysses_rank;
}

int dit_mesh_ring_rank(const dit_mesh *m)
{
    return m->ring_rank;
}

int dit_mesh_cp_rank(const dit_mesh *m)
{
    return m->cp_rank;
}

int dit_mesh_cp_size(const dit_mesh *m)
{
    return m->pc.ring_degree * m->pc.ulysses_degree;
}
