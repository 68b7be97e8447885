#include "parallel/mesh.h"

#include <stdlib.h>
#include <string.h>

struct dit_mesh {
    dit_parallel_config pc;
    dit_comm *world;
    dit_comm *tp, *ulysses, *ring, *cp, *cfg;
    int tp_rank, ulysses_rank, ring_rank, cp_rank, cfg_rank;
};

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
    const int inner = R * U * T; /* ranks of one CFG group */
    const int rank = dit_comm_rank(world);
    const int g = rank / inner, in = rank % inner;
    m->cfg_rank = g;
    m->tp_rank = in % T;
    m->cp_rank = in / T;
    m->ulysses_rank = m->cp_rank % U;
    m->ring_rank = m->cp_rank / U;
    /* Every split is collective over the world, so every rank makes all
     * five, taking part with color -1 in the ones it does not need. Colors
     * name a group uniquely: the CFG group times the group count within it,
     * plus the group's index there. */
    DIT_CHECK(
        world->ops->split(world, T > 1 ? g * R * U + m->cp_rank : -1, m->tp_rank, &m->tp, diag));
    DIT_CHECK(world->ops->split(world, U > 1 ? g * R * T + m->ring_rank * T + m->tp_rank : -1,
                                m->ulysses_rank, &m->ulysses, diag));
    DIT_CHECK(world->ops->split(world, R > 1 ? g * U * T + m->ulysses_rank * T + m->tp_rank : -1,
                                m->ring_rank, &m->ring, diag));
    DIT_CHECK(
        world->ops->split(world, R * U > 1 ? g * T + m->tp_rank : -1, m->cp_rank, &m->cp, diag));
    DIT_CHECK(world->ops->split(world, pc->cfg_degree > 1 ? in : -1, g, &m->cfg, diag));
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
    dit_comm_destroy(m->cfg);
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

dit_comm *dit_mesh_cfg(const dit_mesh *m)
{
    return m->cfg;
}

int dit_mesh_cfg_rank(const dit_mesh *m)
{
    return m->cfg_rank;
}

int dit_mesh_cfg_size(const dit_mesh *m)
{
    return m->pc.cfg_degree;
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
