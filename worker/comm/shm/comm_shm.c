/* Shared-memory comm backend. See comm_shm.h for the model.
 *
 * Segment layout (one POSIX shm object):
 *   [header: magic, sizes, abort flag, failed rank, pids, group table]
 *   [rank 0: slot A | slot B | slot P] [rank 1: A | B | P] ...
 * Slot A stages a rank's input to a collective, slot B holds the slice of an
 * all-reduce it summed, slot P carries point-to-point exchanges (so one can
 * stay open while other collectives run).
 *
 * Every collective is a sequence of rounds "write my part, barrier, read,
 * barrier". The trailing barrier guarantees nobody still reads a slot when
 * its owner writes the next round. */
#include "comm/shm/comm_shm.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SHM_MAGIC 0x3130484d53544944ull /* "DITSHM01" */
#define SHM_MAX_GROUPS 256
#define SHM_DEFAULT_TIMEOUT_S 60.0
/* Polls before sleeping in the kernel: short, because ranks often share
 * cores and a spinning waiter takes time from the rank it waits for. */
#define SHM_SPIN 200
#define SHM_SLEEP_NS 20000000L  /* futex sleep slice: 20 ms */
#define SHM_LIVENESS_PERIOD 0.1 /* seconds between checks that peers live */

typedef struct shm_group {
    _Atomic uint32_t count; /* arrivals at the current barrier */
    _Atomic uint32_t gen;   /* completed barriers */
    int32_t size;
    int32_t members[DIT_SHM_MAX_RANKS];          /* group rank -> world rank */
    _Atomic uint32_t arrived[DIT_SHM_MAX_RANKS]; /* gen + 1 once arrived */
} shm_group;

typedef struct shm_header {
    uint64_t magic;
    int32_t world_size;
    int32_t pad;
    uint64_t slot_bytes;
    uint64_t data_offset;
    uint64_t total_bytes;
    _Atomic int32_t abort;
    _Atomic int32_t failed_rank;
    _Atomic int32_t pids[DIT_SHM_MAX_RANKS];
    _Atomic uint64_t p2p_bytes[DIT_SHM_MAX_RANKS]; /* size of the open exchange */
    _Atomic uint32_t next_group;
    shm_group groups[SHM_MAX_GROUPS];
} shm_header;

/* A mapping shared by a rank's world group and its sub-groups. */
typedef struct shm_map {
    void *base;
    size_t size;
    int refs;
} shm_map;

typedef struct shm_comm {
    dit_comm base; /* must stay first */
    shm_map *map;
    shm_header *hdr;
    int gid;
    int world_rank;
    int members[DIT_SHM_MAX_RANKS];
    double timeout_s;
} shm_comm;

struct dit_shm_segment {
    char name[64];
    void *base;
    size_t size;
    /* The segment's descriptor, flock'ed while its name exists: another
     * process's dit_shm_reclaim_stale can tell a live creator from a gone
     * one by the lock, in any pid namespace (the pid in the name means
     * nothing in another one). -1 once the name is gone. */
    int lock_fd;
};

enum slot_kind { SLOT_A = 0, SLOT_B = 1, SLOT_P = 2 };

static const dit_comm_ops shm_ops;

/* ------------------------------------------------------------------------ */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val, long ns)
{
    struct timespec ts = {.tv_sec = 0, .tv_nsec = ns};
    /* Shared (not PRIVATE) futex: the word lives in memory mapped by several
     * processes. EAGAIN (value changed), EINTR and ETIMEDOUT all just mean
     * "look again". */
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static char *slot(const shm_comm *c, int group_rank, enum slot_kind kind)
{
    const int w = c->members[group_rank];
    return (char *)c->map->base + c->hdr->data_offset +
           ((size_t)w * 3 + (size_t)kind) * c->hdr->slot_bytes;
}

/* A process that exited (or is a zombie waiting to be reaped) is dead. */
static bool pid_dead(pid_t pid)
{
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return true;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return true;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *rp = strrchr(buf, ')');
    return rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X');
}

static void wake_everyone(shm_header *h)
{
    uint32_t n = atomic_load(&h->next_group);
    for (uint32_t g = 0; g < n && g < SHM_MAX_GROUPS; g++)
        futex_wake_all(&h->groups[g].gen);
}

static void mark_failed(shm_header *h, int world_rank)
{
    int32_t expect = -1;
    atomic_compare_exchange_strong(&h->failed_rank, &expect, world_rank);
    atomic_store(&h->abort, 1);
    wake_everyone(h);
}

static dit_status aborted(const shm_comm *c, dit_diag *diag)
{
    int fr = atomic_load(&c->hdr->failed_rank);
    if (fr >= 0)
        return dit_diag_set(diag, DIT_ERR_PEER, "mesh aborted because rank %d failed", fr);
    return dit_diag_set(diag, DIT_ERR_PEER, "mesh aborted");
}

/* Waits until the group's barrier generation moves past `gen`. */
static dit_status wait_barrier(shm_comm *c, shm_group *g, uint32_t gen, dit_diag *diag)
{
    shm_header *h = c->hdr;
    for (int i = 0; i < SHM_SPIN; i++) {
        if (atomic_load(&g->gen) != gen)
            return DIT_OK;
        cpu_relax();
    }
    const double start = now_s();
    double next_check = start + SHM_LIVENESS_PERIOD;
    while (atomic_load(&g->gen) == gen) {
        if (atomic_load(&h->abort))
            return aborted(c, diag);
        futex_wait(&g->gen, gen, SHM_SLEEP_NS);
        if (atomic_load(&g->gen) != gen)
            break;
        /* Abort first: after a failure, peers that got their error and
         * exited normally would otherwise look like the dead rank. */
        if (atomic_load(&h->abort))
            return aborted(c, diag);
        const double t = now_s();
        if (t >= next_check) {
            next_check = t + SHM_LIVENESS_PERIOD;
            for (int m = 0; m < g->size; m++) {
                /* Arrived members too: one that died between its arrival
                 * and the generation's step (the last to arrive) would
                 * otherwise hold the others until the timeout. */
                const int w = g->members[m];
                const pid_t pid = atomic_load(&h->pids[w]);
                if (pid <= 0)
                    continue;
                if (pid_dead(pid)) {
                    if (atomic_load(&h->failed_rank) >= 0)
                        return aborted(c, diag);
                    mark_failed(h, w);
                    return dit_diag_set(diag, DIT_ERR_PEER,
                                        "peer rank %d (pid %d) exited during a collective", w,
                                        (int)pid);
                }
            }
        }
        if (t - start > c->timeout_s) {
            if (atomic_load(&g->gen) != gen)
                break; /* it completed just now: no timeout */
            char late[256] = "";
            size_t used = 0;
            int first_late = -1;
            for (int m = 0; m < g->size && used < sizeof late - 8; m++) {
                if (atomic_load(&g->arrived[m]) == gen + 1)
                    continue;
                if (first_late < 0)
                    first_late = g->members[m];
                used += (size_t)snprintf(late + used, sizeof late - used, "%s%d", used ? ", " : "",
                                         g->members[m]);
            }
            mark_failed(h, first_late);
            return dit_diag_set(diag, DIT_ERR_TIMEOUT,
                                "timed out after %.1f s waiting for rank(s) %s", c->timeout_s,
                                late);
        }
    }
    return atomic_load(&h->abort) ? aborted(c, diag) : DIT_OK;
}

static dit_status barrier(shm_comm *c, dit_diag *diag)
{
    if (atomic_load(&c->hdr->abort))
        return aborted(c, diag);
    if (c->base.size == 1)
        return DIT_OK;
    shm_group *g = &c->hdr->groups[c->gid];
    const uint32_t gen = atomic_load(&g->gen);
    atomic_store(&g->arrived[c->base.rank], gen + 1);
    if (atomic_fetch_add(&g->count, 1) + 1 == (uint32_t)c->base.size) {
        atomic_store(&g->count, 0);
        atomic_fetch_add(&g->gen, 1);
        futex_wake_all(&g->gen);
        return DIT_OK;
    }
    return wait_barrier(c, g, gen, diag);
}

static size_t min_sz(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* Bytes of a per-rank count left at offset `off`, capped at `cap`. */
static size_t left(size_t count, size_t off, size_t cap)
{
    return count > off ? min_sz(count - off, cap) : 0;
}

/* ------------------------------------------------------------------------ */
/* Collectives                                                               */

static dit_status shm_barrier(dit_comm *base, dit_diag *diag)
{
    return barrier((shm_comm *)base, diag);
}

static dit_status shm_all_gather_v(dit_comm *base, const void *send, void *recv,
                                   const size_t *counts, dit_diag *diag)
{
    shm_comm *c = (shm_comm *)base;
    /* Every op fails fast on a broken mesh, one with nothing to move (and
     * so no barrier) too. */
    if (atomic_load(&c->hdr->abort))
        return aborted(c, diag);
    const int P = base->size, me = base->rank;
    const size_t cap = c->hdr->slot_bytes;
    size_t max = 0, displ[DIT_SHM_MAX_RANKS];
    for (int r = 0; r < P; r++) {
        displ[r] = r ? displ[r - 1] + counts[r - 1] : 0;
        max = counts[r] > max ? counts[r] : max;
    }
    dit_status st = DIT_OK;
    for (size_t off = 0; off < max; off += cap) {
        memcpy(slot(c, me, SLOT_A), (const char *)send + off, left(counts[me], off, cap));
        if ((st = barrier(c, diag)) != DIT_OK)
            return st;
        for (int r = 0; r < P; r++)
            memcpy((char *)recv + displ[r] + off, slot(c, r, SLOT_A), left(counts[r], off, cap));
        if ((st = barrier(c, diag)) != DIT_OK)
            return st;
    }
    return st;
}

static dit_status shm_all_gather(dit_comm *base, const void *send, size_t bytes, void *recv,
                                 dit_diag *diag)
{
    size_t counts[DIT_SHM_MAX_RANKS] = {0};
    for (int r = 0; r < base->size; r++)
        counts[r] = bytes;
    return shm_all_gather_v(base, send, recv, counts, diag);
}

static dit_status shm_all_to_all_v(dit_comm *base, const void *send, const size_t *send_counts,
                                   void *recv, const size_t *recv_counts, dit_diag *diag)
{
    shm_comm *c = (shm_comm *)base;
    const int P = base->size, me = base->rank;
    const size_t cap = c->hdr->slot_bytes / (size_t)P;
    if (cap == 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "shm slot of %zu bytes is too small for %d ranks",
                            (size_t)c->hdr->slot_bytes, P);
    size_t sd[DIT_SHM_MAX_RANKS], rd[DIT_SHM_MAX_RANKS];
    uint64_t my_max = 0, all_max[DIT_SHM_MAX_RANKS];
    for (int r = 0; r < P; r++) {
        sd[r] = r ? sd[r - 1] + send_counts[r - 1] : 0;
        rd[r] = r ? rd[r - 1] + recv_counts[r - 1] : 0;
        my_max = send_counts[r] > my_max ? send_counts[r] : my_max;
    }
    /* Every rank must run the same number of rounds: agree on the largest
     * block anyone sends. */
    dit_status st = shm_all_gather(base, &my_max, sizeof my_max, all_max, diag);
    if (st != DIT_OK)
        return st;
    uint64_t max = 0;
    for (int r = 0; r < P; r++)
        max = all_max[r] > max ? all_max[r] : max;
    for (size_t off = 0; off < max; off += cap) {
        char *mine = slot(c, me, SLOT_A);
        for (int j = 0; j < P; j++)
            memcpy(mine + (size_t)j * cap, (const char *)send + sd[j] + off,
                   left(send_counts[j], off, cap));
        if ((st = barrier(c, diag)) != DIT_OK)
            return st;
        for (int i = 0; i < P; i++)
            memcpy((char *)recv + rd[i] + off, slot(c, i, SLOT_A) + (size_t)me * cap,
                   left(recv_counts[i], off, cap));
        if ((st = barrier(c, diag)) != DIT_OK)
            return st;
    }
    return st;
}

static dit_status shm_all_to_all(dit_comm *base, const void *send, size_t bytes, void *recv,
                                 dit_diag *diag)
{
    size_t counts[DIT_SHM_MAX_RANKS] = {0};
    for (int r = 0; r < base->size; r++)
        counts[r] = bytes;
    return shm_all_to_all_v(base, send, counts, recv, counts, diag);
}

static dit_status shm_all_reduce_sum(dit_comm *base, void *buf, size_t count, dit_dtype dtype,
                                     dit_diag *diag)
{
    shm_comm *c = (shm_comm *)base;
    if (atomic_load(&c->hdr->abort))
        return aborted(c, diag);
    if (dtype != DIT_F32)
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED, "shm all-reduce sums f32 only, not %s",
                            dit_dtype_name(dtype));
    const int P = base->size, me = base->rank;
    if (P == 1)
        return barrier(c, diag);
    const size_t cap = c->hdr->slot_bytes / sizeof(float);
    float *data = buf;
    dit_status st = DIT_OK;
    for (size_t off = 0; off < count; off += cap) {
        const size_t n = min_sz(cap, count - off);
        memcpy(slot(c, me, SLOT_A), data + off, n * sizeof(float));
        if ((st = barrier(c, diag)) != DIT_OK)
            return st;
        /* Reduce-scatter: this rank sums its slice over all ranks, always in
         * rank order, so every rank ends up with the same bits. */
        const size_t lo = n * (size_t)me / (size_t)P, hi = n * (size_t)(me + 1) / (size_t)P;
        float *out = (float *)slot(c, me, SLOT_B);
        const float *first = (const float *)slot(c, 0, SLOT_A);
        memcpy(out, first + lo, (hi - lo) * sizeof(float));
        for (int r = 1; r < P; r++) {
            const float *in = (const float *)slot(c, r, SLOT_A) + lo;
            for (size_t e = 0; e < hi - lo; e++)
                out[e] += in[e];
        }
        if ((st = barrier(c, diag)) != DIT_OK)
            return st;
        for (int r = 0; r < P; r++) {
            const size_t rlo = n * (size_t)r / (size_t)P, rhi = n * (size_t)(r + 1) / (size_t)P;
            memcpy(data + off + rlo, slot(c, r, SLOT_B), (rhi - rlo) * sizeof(float));
        }
        if ((st = barrier(c, diag)) != DIT_OK)
            return st;
    }
    return st;
}

static dit_status shm_broadcast(dit_comm *base, void *buf, size_t bytes, int root, dit_diag *diag)
{
    shm_comm *c = (shm_comm *)base;
    if (atomic_load(&c->hdr->abort))
        return aborted(c, diag);
    if (root < 0 || root >= base->size)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "broadcast root %d outside group of %d",
                            root, base->size);
    const size_t cap = c->hdr->slot_bytes;
    dit_status st = DIT_OK;
    for (size_t off = 0; off < bytes; off += cap) {
        const size_t n = min_sz(cap, bytes - off);
        if (base->rank == root)
            memcpy(slot(c, root, SLOT_A), (char *)buf + off, n);
        if ((st = barrier(c, diag)) != DIT_OK)
            return st;
        if (base->rank != root)
            memcpy((char *)buf + off, slot(c, root, SLOT_A), n);
        if ((st = barrier(c, diag)) != DIT_OK)
            return st;
    }
    return st;
}

/* start only records the exchange; wait moves the data. Staging at start
 * would let an exchange open on one group overwrite the slot of another
 * group's open exchange on the same rank; doing it inside wait, which is
 * collective over its group, keeps every group's traffic apart. On the CPU
 * the copy costs the same wherever it happens. */
static dit_status shm_sendrecv_start(dit_comm *base, const void *send, size_t send_bytes, int dst,
                                     void *recv, size_t recv_bytes, int src, dit_comm_request *req,
                                     dit_diag *diag)
{
    shm_comm *c = (shm_comm *)base;
    if (dst < 0 || dst >= base->size || src < 0 || src >= base->size)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "sendrecv peers %d/%d outside group of %d",
                            dst, src, base->size);
    if (atomic_load(&c->hdr->abort))
        return aborted(c, diag);
    memset(req, 0, sizeof *req);
    req->active = 1;
    req->send = send;
    req->send_bytes = send_bytes;
    req->dst = dst;
    req->recv = recv;
    req->recv_bytes = recv_bytes;
    req->src = src;
    return DIT_OK;
}

static dit_status shm_sendrecv_wait(dit_comm *base, dit_comm_request *req, dit_diag *diag)
{
    shm_comm *c = (shm_comm *)base;
    if (!req->active)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "sendrecv_wait without sendrecv_start");
    req->active = 0;
    const size_t cap = c->hdr->slot_bytes;
    atomic_store(&c->hdr->p2p_bytes[c->world_rank], (uint64_t)req->send_bytes);
    memcpy(slot(c, base->rank, SLOT_P), req->send, min_sz(req->send_bytes, cap));
    dit_status st = barrier(c, diag);
    if (st != DIT_OK)
        return st;
    /* Everybody's size is visible now: agree on the number of rounds. */
    uint64_t max = 0;
    for (int r = 0; r < base->size; r++) {
        uint64_t b = atomic_load(&c->hdr->p2p_bytes[c->members[r]]);
        max = b > max ? b : max;
    }
    const uint64_t sent = atomic_load(&c->hdr->p2p_bytes[c->members[req->src]]);
    /* A size mismatch is reported after the rounds finish, so the peers are
     * not left waiting and a later peer failure keeps its own message. */
    const bool mismatch = sent != req->recv_bytes;
    /* At least one round, even when nothing moves: its trailing barrier keeps
     * everyone's p2p_bytes readable until all ranks have read them. */
    for (size_t off = 0; off < max || off == 0; off += cap) {
        if (off > 0) {
            memcpy(slot(c, base->rank, SLOT_P), (const char *)req->send + off,
                   left(req->send_bytes, off, cap));
            if ((st = barrier(c, diag)) != DIT_OK)
                return st;
        }
        if (!mismatch)
            memcpy((char *)req->recv + off, slot(c, req->src, SLOT_P), left(sent, off, cap));
        if ((st = barrier(c, diag)) != DIT_OK)
            return st;
    }
    if (mismatch)
        return dit_diag_set(
            diag, DIT_ERR_INVALID_ARG, "sendrecv: rank %d sent %llu bytes but rank %d expected %zu",
            c->members[req->src], (unsigned long long)sent, c->world_rank, req->recv_bytes);
    return DIT_OK;
}

static dit_status shm_split(dit_comm *base, int color, int key, dit_comm **out, dit_diag *diag)
{
    shm_comm *c = (shm_comm *)base;
    const int P = base->size;
    typedef struct rec {
        int32_t color, key, rank, gid;
    } rec;
    rec mine = {color, key, base->rank, -1}, all[DIT_SHM_MAX_RANKS];
    *out = NULL;
    dit_status st = shm_all_gather(base, &mine, sizeof mine, all, diag);
    if (st != DIT_OK)
        return st;
    /* Members of my color, ordered by (key, parent rank): insertion sort. */
    int members[DIT_SHM_MAX_RANKS], n = 0, my_index = -1;
    for (int r = 0; r < P; r++) {
        if (color < 0 || all[r].color != color)
            continue;
        int i = n++;
        while (i > 0 && (all[members[i - 1]].key > all[r].key ||
                         (all[members[i - 1]].key == all[r].key && members[i - 1] > r))) {
            members[i] = members[i - 1];
            i--;
        }
        members[i] = r;
    }
    for (int i = 0; i < n; i++)
        if (members[i] == base->rank)
            my_index = i;
    /* The first member allocates the group's barrier and publishes its id. */
    int32_t gid = -1;
    if (color >= 0 && my_index == 0) {
        uint32_t id = atomic_fetch_add(&c->hdr->next_group, 1);
        if (id < SHM_MAX_GROUPS) {
            shm_group *g = &c->hdr->groups[id];
            atomic_store(&g->count, 0);
            atomic_store(&g->gen, 0);
            g->size = n;
            for (int i = 0; i < n; i++) {
                g->members[i] = c->members[members[i]];
                atomic_store(&g->arrived[i], 0);
            }
            gid = (int32_t)id;
        }
    }
    int32_t gids[DIT_SHM_MAX_RANKS];
    if ((st = shm_all_gather(base, &gid, sizeof gid, gids, diag)) != DIT_OK)
        return st;
    if (color < 0)
        return DIT_OK;
    gid = gids[members[0]];
    if (gid < 0)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "shm segment has no room for more than %d groups",
                            SHM_MAX_GROUPS);
    shm_comm *sub = calloc(1, sizeof *sub);
    if (!sub)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    sub->base.ops = &shm_ops;
    sub->base.rank = my_index;
    sub->base.size = n;
    sub->map = c->map;
    sub->map->refs++;
    sub->hdr = c->hdr;
    sub->gid = gid;
    sub->world_rank = c->world_rank;
    sub->timeout_s = c->timeout_s;
    for (int i = 0; i < n; i++)
        sub->members[i] = c->members[members[i]];
    *out = &sub->base;
    return DIT_OK;
}

static void shm_abort(dit_comm *base)
{
    shm_comm *c = (shm_comm *)base;
    mark_failed(c->hdr, c->world_rank);
}

static void shm_destroy(dit_comm *base)
{
    shm_comm *c = (shm_comm *)base;
    if (--c->map->refs == 0) {
        munmap(c->map->base, c->map->size);
        free(c->map);
    }
    free(c);
}

static const dit_comm_ops shm_ops = {
    .name = "shm",
    .destroy = shm_destroy,
    .all_reduce_sum = shm_all_reduce_sum,
    .all_gather = shm_all_gather,
    .all_gather_v = shm_all_gather_v,
    .all_to_all = shm_all_to_all,
    .all_to_all_v = shm_all_to_all_v,
    .sendrecv_start = shm_sendrecv_start,
    .sendrecv_wait = shm_sendrecv_wait,
    .broadcast = shm_broadcast,
    .barrier = shm_barrier,
    .split = shm_split,
    .abort = shm_abort,
};

/* ------------------------------------------------------------------------ */
/* Segment lifecycle                                                         */

void dit_shm_make_name(dit_shm_config *cfg)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(cfg->name, sizeof cfg->name, "/dit-%d-%lx", (int)getpid(),
             (unsigned long)(ts.tv_nsec ^ (ts.tv_sec << 20)));
}

static size_t segment_size(int world, size_t slot_bytes, size_t *data_offset)
{
    const size_t page = 4096;
    *data_offset = (sizeof(shm_header) + page - 1) / page * page;
    return *data_offset + (size_t)world * 3 * slot_bytes;
}

static size_t config_slot(const dit_shm_config *cfg)
{
    size_t s = cfg->slot_bytes ? cfg->slot_bytes : DIT_SHM_DEFAULT_SLOT_BYTES;
    return (s + 63) / 64 * 64; /* keep every slot cache-line aligned */
}

dit_status dit_shm_segment_create(const dit_shm_config *cfg, dit_shm_segment **out, dit_diag *diag)
{
    if (cfg->world_size < 1 || cfg->world_size > DIT_SHM_MAX_RANKS)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "shm: world size %d outside 1..%d",
                            cfg->world_size, DIT_SHM_MAX_RANKS);
    const size_t slot_bytes = config_slot(cfg);
    size_t data_offset;
    const size_t size = segment_size(cfg->world_size, slot_bytes, &data_offset);
    dit_shm_segment *seg = calloc(1, sizeof *seg);
    if (!seg)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
    snprintf(seg->name, sizeof seg->name, "%s", cfg->name);
    seg->lock_fd = -1;
    int fd = shm_open(cfg->name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) != 0) {
        close(fd);
        shm_unlink(cfg->name);
        fd = -1;
    }
    if (fd < 0) {
        dit_status st =
            dit_diag_set(diag, DIT_ERR_IO, "shm_open(%s): %s", cfg->name, strerror(errno));
        free(seg);
        return st;
    }
    if (ftruncate(fd, (off_t)size) != 0) {
        dit_status st = dit_diag_set(diag, DIT_ERR_IO, "shm %s: cannot size to %zu bytes: %s",
                                     cfg->name, size, strerror(errno));
        close(fd);
        shm_unlink(cfg->name);
        free(seg);
        return st;
    }
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        dit_status st =
            dit_diag_set(diag, DIT_ERR_IO, "shm %s: mmap: %s", cfg->name, strerror(errno));
        close(fd);
        shm_unlink(cfg->name);
        free(seg);
        return st;
    }
    seg->lock_fd = fd; /* (FD_CLOEXEC: shm_open sets it) */
    shm_header *h = base;
    h->world_size = cfg->world_size;
    h->slot_bytes = slot_bytes;
    h->data_offset = data_offset;
    h->total_bytes = size;
    atomic_store(&h->failed_rank, -1);
    h->groups[0].size = cfg->world_size;
    for (int r = 0; r < cfg->world_size; r++)
        h->groups[0].members[r] = r;
    atomic_store(&h->next_group, 1);
    atomic_thread_fence(memory_order_seq_cst);
    h->magic = SHM_MAGIC;
    seg->base = base;
    seg->size = size;
    *out = seg;
    return DIT_OK;
}

void dit_shm_segment_abort(dit_shm_segment *seg, int failed_rank)
{
    if (seg)
        mark_failed(seg->base, failed_rank);
}

int dit_shm_segment_failed_rank(const dit_shm_segment *seg)
{
    return atomic_load(&((shm_header *)seg->base)->failed_rank);
}

void dit_shm_segment_destroy(dit_shm_segment *seg)
{
    if (!seg)
        return;
    munmap(seg->base, seg->size);
    dit_shm_segment_unlink(seg);
    free(seg);
}

void dit_shm_segment_unlink(dit_shm_segment *seg)
{
    if (!seg || seg->name[0] == '\0')
        return;
    shm_unlink(seg->name);
    seg->name[0] = '\0';
    if (seg->lock_fd >= 0)
        close(seg->lock_fd);
    seg->lock_fd = -1;
}

int dit_shm_reclaim_stale(void)
{
    DIR *dir = opendir("/dev/shm");
    if (!dir)
        return 0;
    int removed = 0;
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        long pid;
        char *end;
        if (strncmp(e->d_name, "dit-", 4) != 0)
            continue;
        pid = strtol(e->d_name + 4, &end, 10);
        if (end == e->d_name + 4 || *end != '-' || pid <= 0 || pid > INT_MAX)
            continue;
        /* Only when the creator is gone (not merely another user's): no
         * such pid here, and nobody holds the segment's lock (a creator in
         * another pid namespace, whose pid means nothing here, does). */
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue;
        struct stat sb;
        if (fstatat(dirfd(dir), e->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(sb.st_mode) ||
            sb.st_uid != geteuid())
            continue;
        char name[300];
        snprintf(name, sizeof name, "/%s", e->d_name);
        const int fd = shm_open(name, O_RDWR | O_NOFOLLOW, 0);
        if (fd < 0)
            continue;
        if (flock(fd, LOCK_EX | LOCK_NB) == 0 && shm_unlink(name) == 0)
            removed++;
        close(fd);
    }
    closedir(dir);
    return removed;
}

dit_status dit_shm_comm_join(const dit_shm_config *cfg, int rank, dit_comm **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    shm_map *map = NULL;
    shm_comm *c = NULL;
    void *base = MAP_FAILED;
    size_t size = 0;
    int fd = shm_open(cfg->name, O_RDWR, 0);
    if (fd < 0)
        return dit_diag_set(diag, DIT_ERR_IO, "rank %d: cannot open shm segment %s: %s", rank,
                            cfg->name, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (size_t)sb.st_size < sizeof(shm_header)) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT, "rank %d: shm segment %s is too small", rank,
                          cfg->name);
        goto cleanup;
    }
    size = (size_t)sb.st_size;
    base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        st = dit_diag_set(diag, DIT_ERR_IO, "rank %d: mmap of %s: %s", rank, cfg->name,
                          strerror(errno));
        goto cleanup;
    }
    shm_header *h = base;
    if (h->magic != SHM_MAGIC || h->world_size != cfg->world_size || h->total_bytes != size) {
        st = dit_diag_set(diag, DIT_ERR_FORMAT,
                          "rank %d: shm segment %s is not a ditserve mesh of %d ranks", rank,
                          cfg->name, cfg->world_size);
        goto cleanup;
    }
    if (rank < 0 || rank >= h->world_size) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "rank %d outside world of %d", rank,
                          h->world_size);
        goto cleanup;
    }
    int32_t expect = 0;
    if (!atomic_compare_exchange_strong(&h->pids[rank], &expect, (int32_t)getpid())) {
        st = dit_diag_set(diag, DIT_ERR_INVALID_ARG, "rank %d joined %s twice", rank, cfg->name);
        goto cleanup;
    }
    map = calloc(1, sizeof *map);
    c = calloc(1, sizeof *c);
    if (!map || !c) {
        st = dit_diag_set(diag, DIT_ERR_NOMEM, "out of memory");
        goto cleanup;
    }
    map->base = base;
    map->size = size;
    map->refs = 1;
    c->base.ops = &shm_ops;
    c->base.rank = rank;
    c->base.size = h->world_size;
    c->map = map;
    c->hdr = h;
    c->gid = 0;
    c->world_rank = rank;
    c->timeout_s = cfg->timeout_s > 0 ? cfg->timeout_s : SHM_DEFAULT_TIMEOUT_S;
    for (int r = 0; r < h->world_size; r++)
        c->members[r] = r;
    /* Everyone joined before anyone uses the mesh. */
    st = barrier(c, diag);
    if (st != DIT_OK) {
        dit_diag_prefix(diag, "joining the mesh: ");
        goto cleanup;
    }
    *out = &c->base;
    c = NULL;
    map = NULL;
    base = MAP_FAILED;
cleanup:
    close(fd);
    free(c);
    free(map);
    if (base != MAP_FAILED)
        munmap(base, size);
    return st;
}
