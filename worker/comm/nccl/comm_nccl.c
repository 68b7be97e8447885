/* The NCCL comm backend (see comm_nccl.h and comm.h).
 *
 * Streams and events. Every op is enqueued on the compute stream (`stream`)
 * so that it is ordered with the kernels around it. The one exception is
 * sendrecv, whose point is to overlap with compute: sendrecv_start records
 * `ev_ready` on the compute stream, makes the private high-priority `side`
 * stream wait for it, enqueues the send/recv pair on `side` and records
 * `ev_done` there; sendrecv_wait makes the compute stream wait for `ev_done`.
 * Nothing blocks the host. A collective issued while an exchange is open is
 * ordered after the exchange (NCCL serialises the kernels of one
 * communicator anyway; saying so explicitly keeps it independent of that).
 *
 * Non-blocking NCCL. The communicator is created with config.blocking = 0, so
 * no NCCL call can block the host indefinitely: init, split, finalize and
 * every launch return ncclInProgress while NCCL works in a background thread
 * (a launch may wait there for peers, for example to connect on first use).
 * After each call we poll ncclCommGetAsyncError until it leaves
 * ncclInProgress; NCCL forbids the next call on the communicator before that,
 * and polling to ncclSuccess is also what joins NCCL's background thread.
 * Every poll has the group's timeout.
 *
 * Errors. ncclResult_t and cudaError_t become a dit_status in nccl_check and
 * cuda_check, nowhere else. Any failure after argument validation leaves the
 * group broken: the NCCL communicator is aborted at once (so that its kernels
 * stop and its resources are released) and every later op fails fast with
 * DIT_ERR_PEER, repeating the first failure's message. An NCCL error on a
 * group is DIT_ERR_PEER itself (DIT_ERR_DEVICE for a CUDA one), whatever
 * NCCL's code: the mesh is what failed, not the request. A group that failed
 * half way through a collective is out of step with its peers anyway; comm.h
 * asks the caller to destroy it. Argument errors found before anything was
 * enqueued leave the group as it was.
 *
 * Not thread-safe (comm.h); no global mutable state. */
#include "comm/nccl/comm_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <sched.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ncclCommSplit and the config struct with `blocking` appeared in 2.18;
 * ncclCommFinalize and non-blocking communicators in 2.14. */
#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "the nccl comm backend needs NCCL 2.18 or newer"
#endif

_Static_assert(DIT_NCCL_ID_BYTES == NCCL_UNIQUE_ID_BYTES,
               "DIT_NCCL_ID_BYTES != NCCL_UNIQUE_ID_BYTES");
_Static_assert(sizeof(ncclUniqueId) == NCCL_UNIQUE_ID_BYTES, "unexpected ncclUniqueId layout");

#define DIT_NCCL_DEFAULT_TIMEOUT_S 60.0

typedef struct dit_nccl_comm {
    dit_comm base; /* must stay first: dit_comm * <-> dit_nccl_comm * */

    ncclComm_t nccl; /* NULL once aborted or destroyed */
    int device;
    double timeout_s;

    cudaStream_t stream;  /* compute stream; every op but sendrecv goes here */
    bool own_stream;      /* created by us (cfg->stream was NULL); split
                             children share the parent's and never own it */
    cudaStream_t side;    /* sendrecv runs here, overlapping compute */
    cudaEvent_t ev_ready; /* compute stream reached sendrecv_start */
    cudaEvent_t ev_done;  /* the open (or last) exchange finished */
    float *barrier_buf;   /* one device float for barrier's all-reduce */

    uint64_t last_seq; /* sequence number of the last exchange started */
    uint64_t open_seq; /* the exchange that is open, 0 when none */

    bool broken;
    char broken_msg[DIT_DIAG_MAX]; /* why, for the fail-fast errors that follow */

    /* The family: the group made by dit_nccl_comm_create (root == NULL) and
     * the groups split from it or from its children (root set, linked from
     * the root's `members` through `next`), so that a host wait on the
     * shared compute stream can check and abort all of them: a kernel stuck
     * on a dead peer belongs to whichever group launched it. Children are
     * destroyed before their parent (comm.h), so the links stay valid. */
    struct dit_nccl_comm *root;
    struct dit_nccl_comm *members; /* root only */
    struct dit_nccl_comm *next;
} dit_nccl_comm;

static const dit_comm_ops nccl_ops;

static dit_nccl_comm *nccl_of(dit_comm *c)
{
    return (dit_nccl_comm *)c;
}

/* ---- time ---------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Waits between polls: yield for the first few (launches usually finish in
 * tens of microseconds), then sleep 1 us doubling up to 1 ms, so that a long
 * wait for a slow peer costs little CPU while a short one adds little
 * latency. */
static void poll_backoff(unsigned iter)
{
    if (iter < 32) {
        sched_yield();
        return;
    }
    unsigned shift = iter - 32 < 10 ? iter - 32 : 10;
    struct timespec ts = {0, (long)(1000u << shift)}; /* 1 us .. ~1 ms */
    nanosleep(&ts, NULL);
}

/* ---- errors -------------------------------------------------------------- */

static const char *nccl_result_name(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess:
        return "ncclSuccess";
    case ncclUnhandledCudaError:
        return "ncclUnhandledCudaError";
    case ncclSystemError:
        return "ncclSystemError";
    case ncclInternalError:
        return "ncclInternalError";
    case ncclInvalidArgument:
        return "ncclInvalidArgument";
    case ncclInvalidUsage:
        return "ncclInvalidUsage";
    case ncclRemoteError:
        return "ncclRemoteError";
    case ncclInProgress:
        return "ncclInProgress";
    default:
        return "unknown ncclResult_t";
    }
}

/* Aborts the NCCL communicator (if any) and marks the group broken with
 * `msg` as the reason, unless it already is. ncclCommAbort blocks, but only
 * until NCCL's own threads have stopped: it sets the abort flag that its
 * kernels and bootstrap loops poll, so it does not wait for peers. */
static void nccl_break(dit_nccl_comm *c, const char *msg)
{
    if (!c->broken) {
        c->broken = true;
        snprintf(c->broken_msg, sizeof c->broken_msg, "%s", msg);
    }
    if (c->nccl) {
        (void)ncclCommAbort(c->nccl);
        c->nccl = NULL;
    }
}

/* Records a failure of group `c` (NULL before there is one): formats the
 * message once, with the rank in front, breaks the group and sets diag. */
static dit_status nccl_fail(dit_nccl_comm *c, dit_status st, dit_diag *diag, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static dit_status nccl_fail(dit_nccl_comm *c, dit_status st, dit_diag *diag, const char *fmt, ...)
{
    char detail[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);

    char msg[DIT_DIAG_MAX];
    if (c && c->base.size > 0)
        snprintf(msg, sizeof msg, "nccl rank %d of %d: %s", c->base.rank, c->base.size, detail);
    else
        snprintf(msg, sizeof msg, "nccl: %s", detail);
    if (c)
        nccl_break(c, detail); /* the rank is added again when it is shown */
    return dit_diag_set(diag, st, "%s", msg);
}

/* The one place an ncclResult_t becomes a dit_status. */
static dit_status nccl_check(dit_nccl_comm *c, ncclResult_t r, const char *what, dit_diag *diag)
{
    if (r == ncclSuccess)
        return DIT_OK;
    dit_status st;
    switch (r) {
    case ncclUnhandledCudaError:
        st = DIT_ERR_DEVICE;
        break;
    case ncclSystemError: /* sockets, shared memory: the link to a peer */
    case ncclRemoteError: /* a peer exited or the network failed */
        st = DIT_ERR_PEER;
        break;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
        st = DIT_ERR_INVALID_ARG;
        break;
    default: /* ncclInternalError, a stray ncclInProgress, newer codes */
        st = DIT_ERR_INTERNAL;
        break;
    }
    /* On a group, any failure breaks it (nccl_fail), and its peers are out
     * of step with it: whatever NCCL's reason, the caller must rebuild the
     * mesh, which DIT_ERR_PEER says (a worker treats it as fatal to the
     * mesh, the client is not told its request was bad). A CUDA error keeps
     * DIT_ERR_DEVICE, which is fatal as well. */
    if (c && st != DIT_ERR_DEVICE)
        st = DIT_ERR_PEER;
    /* The comm argument of ncclGetLastError is unused (the text is
     * per-thread); it may be unrelated to this call, so it is labelled. */
    const char *last = ncclGetLastError(c ? c->nccl : NULL);
    bool has_last = last && last[0] != '\0';
    return nccl_fail(c, st, diag, "%s failed: %s (%s)%s%s", what, ncclGetErrorString(r),
                     nccl_result_name(r), has_last ? "; last NCCL error: " : "",
                     has_last ? last : "");
}

/* The one place a cudaError_t becomes a dit_status. */
static dit_status cuda_check(dit_nccl_comm *c, cudaError_t e, const char *what, dit_diag *diag)
{
    if (e == cudaSuccess)
        return DIT_OK;
    /* Clear the runtime's last-error slot so that an unrelated later call
     * does not report this one again (sticky errors stay regardless). */
    (void)cudaGetLastError();
    dit_status st;
    const char *hint = "";
    switch (e) {
    case cudaErrorMemoryAllocation:
        st = DIT_ERR_NOMEM;
        break;
    case cudaErrorInvalidDevice:
        st = DIT_ERR_INVALID_ARG;
        break;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
        st = DIT_ERR_DEVICE;
        hint = " (no usable GPU or CUDA driver on this machine)";
        break;
    default:
        st = DIT_ERR_DEVICE;
        break;
    }
    return nccl_fail(c, st, diag, "%s failed: %s (%s)%s", what, cudaGetErrorString(e),
                     cudaGetErrorName(e), hint);
}

/* Polls the communicator until the last call's background work is done. */
static dit_status nccl_wait_ready(dit_nccl_comm *c, const char *what, dit_diag *diag)
{
    if (!c->nccl)
        return nccl_fail(c, DIT_ERR_INTERNAL, diag, "%s: NCCL returned no communicator", what);
    double deadline = now_s() + c->timeout_s;
    for (unsigned iter = 0;; ++iter) {
        ncclResult_t async = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(c->nccl, &async);
        if (r != ncclSuccess)
            return nccl_check(c, r, "ncclCommGetAsyncError", diag);
        if (async == ncclSuccess)
            return DIT_OK;
        if (async != ncclInProgress)
            return nccl_check(c, async, what, diag);
        if (now_s() > deadline)
            return nccl_fail(c, DIT_ERR_TIMEOUT, diag,
                             "%s did not complete within %.1f s: a peer is missing, stalled or "
                             "dead; communicator aborted",
                             what, c->timeout_s);
        poll_backoff(iter);
    }
}

/* After an NCCL call on a non-blocking communicator: ncclInProgress means
 * "accepted, still working"; anything else but success is a failure. */
static dit_status nccl_launched(dit_nccl_comm *c, ncclResult_t r, const char *what, dit_diag *diag)
{
    if (r != ncclSuccess && r != ncclInProgress)
        return nccl_check(c, r, what, diag);
    return nccl_wait_ready(c, what, diag);
}

/* Ends a group opened with ncclGroupStart. ncclGroupEnd must be called even
 * when a call inside the group failed (NCCL's group depth is per thread);
 * the first failure is the one reported. */
static dit_status nccl_group_end(dit_nccl_comm *c, ncclResult_t first, const char *what,
                                 dit_diag *diag)
{
    ncclResult_t r = ncclGroupEnd();
    if (first != ncclSuccess)
        return nccl_check(c, first, what, diag);
    return nccl_launched(c, r, what, diag);
}

/* Fail fast on a broken group, without touching NCCL. */
static dit_status nccl_usable(const dit_nccl_comm *c, const char *what, dit_diag *diag)
{
    if (!c->broken)
        return DIT_OK;
    return dit_diag_set(diag, DIT_ERR_PEER,
                        "nccl rank %d of %d: %s: the group is unusable after an earlier failure "
                        "(%s); destroy it",
                        c->base.rank, c->base.size, what, c->broken_msg);
}

static dit_status bad_arg(const dit_nccl_comm *c, const char *what, const char *why, dit_diag *diag)
{
    return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "nccl rank %d of %d: %s: %s", c->base.rank,
                        c->base.size, what, why);
}

/* Orders the next op on the compute stream after an open exchange. */
static dit_status order_after_exchange(dit_nccl_comm *c, dit_diag *diag)
{
    if (c->open_seq == 0)
        return DIT_OK;
    return cuda_check(c, cudaStreamWaitEvent(c->stream, c->ev_done, 0),
                      "cudaStreamWaitEvent(compute stream, open exchange)", diag);
}

/* ---- setup and teardown -------------------------------------------------- */

/* Creates what every group needs besides the communicator: the side stream,
 * the two events and the barrier's float. The current device must be
 * c->device. */
static dit_status nccl_make_resources(dit_nccl_comm *c, dit_diag *diag)
{
    dit_status st = DIT_OK;
    int least = 0, greatest = 0;
    DIT_CHECK(cuda_check(c, cudaDeviceGetStreamPriorityRange(&least, &greatest),
                         "cudaDeviceGetStreamPriorityRange", diag));
    /* High priority: the exchange's kernels get SMs ahead of the compute
     * kernels they overlap, so the ring is not starved by attention.
     * Non-blocking: no implicit sync with the legacy default stream. */
    DIT_CHECK(cuda_check(c, cudaStreamCreateWithPriority(&c->side, cudaStreamNonBlocking, greatest),
                         "cudaStreamCreateWithPriority", diag));
    DIT_CHECK(cuda_check(c, cudaEventCreateWithFlags(&c->ev_ready, cudaEventDisableTiming),
                         "cudaEventCreateWithFlags", diag));
    DIT_CHECK(cuda_check(c, cudaEventCreateWithFlags(&c->ev_done, cudaEventDisableTiming),
                         "cudaEventCreateWithFlags", diag));
    DIT_CHECK(
        cuda_check(c, cudaMalloc((void **)&c->barrier_buf, sizeof(float)), "cudaMalloc", diag));
    /* Zero it in stream order; 0 + 0 stays 0, so it never needs resetting. */
    DIT_CHECK(cuda_check(c, cudaMemsetAsync(c->barrier_buf, 0, sizeof(float), c->stream),
                         "cudaMemsetAsync", diag));
cleanup:
    return st;
}

/* Tears down the communicator and frees everything; used by destroy and by
 * failed create/split. A healthy communicator is finalized (flushes its
 * pending work, polled with the timeout) then destroyed; a broken one, or one
 * whose finalize fails or times out, is aborted. */
static void nccl_release(dit_nccl_comm *c)
{
    if (!c)
        return;
    if (c->root) {
        for (dit_nccl_comm **pp = &c->root->members; *pp; pp = &(*pp)->next) {
            if (*pp == c) {
                *pp = c->next;
                break;
            }
        }
        c->root = NULL;
    }
    if (c->nccl && !c->broken) {
        if (nccl_launched(c, ncclCommFinalize(c->nccl), "ncclCommFinalize", NULL) == DIT_OK) {
            (void)ncclCommDestroy(c->nccl);
            c->nccl = NULL;
        }
    }
    if (c->nccl) { /* broken, or finalize failed without aborting */
        (void)ncclCommAbort(c->nccl);
        c->nccl = NULL;
    }

    /* CUDA objects belong to c->device; switch to it for the frees and put
     * the caller's device back afterwards. */
    int saved = -1;
    if (cudaGetDevice(&saved) != cudaSuccess)
        saved = -1;
    if (saved >= 0 && saved != c->device)
        (void)cudaSetDevice(c->device);
    /* The events and streams may still have work pending; CUDA releases
     * them once it completes. cudaFree waits for the device. */
    if (c->barrier_buf)
        (void)cudaFree(c->barrier_buf);
    if (c->ev_done)
        (void)cudaEventDestroy(c->ev_done);
    if (c->ev_ready)
        (void)cudaEventDestroy(c->ev_ready);
    if (c->side)
        (void)cudaStreamDestroy(c->side);
    if (c->own_stream && c->stream)
        (void)cudaStreamDestroy(c->stream);
    if (saved >= 0 && saved != c->device)
        (void)cudaSetDevice(saved);
    (void)cudaGetLastError();
    free(c);
}

dit_status dit_nccl_unique_id(unsigned char out[DIT_NCCL_ID_BYTES], dit_diag *diag)
{
    if (!out)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "nccl: unique id: NULL output");
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    dit_status st = nccl_check(NULL, ncclGetUniqueId(&id), "ncclGetUniqueId", diag);
    if (st == DIT_OK)
        memcpy(out, id.internal, DIT_NCCL_ID_BYTES);
    return st;
}

dit_status dit_nccl_comm_create(const dit_nccl_config *cfg, dit_comm **out, dit_diag *diag)
{
    dit_status st = DIT_OK;
    dit_nccl_comm *c = NULL;

    if (!out)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "nccl: create: NULL output");
    *out = NULL;
    if (!cfg)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "nccl: create: NULL config");
    if (cfg->world_size < 1 || cfg->rank < 0 || cfg->rank >= cfg->world_size)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG,
                            "nccl: create: rank %d is not in a group of %d", cfg->rank,
                            cfg->world_size);
    if (cfg->device < 0)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "nccl: create: device %d is negative",
                            cfg->device);
    if (!(cfg->timeout_s >= 0.0))
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "nccl: create: timeout %g s is negative",
                            cfg->timeout_s);

    c = calloc(1, sizeof *c);
    if (!c)
        return dit_diag_set(diag, DIT_ERR_NOMEM, "nccl: create: out of memory");
    c->base.ops = &nccl_ops;
    c->base.rank = cfg->rank;
    c->base.size = cfg->world_size;
    c->device = cfg->device;
    c->timeout_s = cfg->timeout_s > 0.0 ? cfg->timeout_s : DIT_NCCL_DEFAULT_TIMEOUT_S;

    /* NCCL binds a communicator to the current device at init; the compute
     * backend runs on the same device from this thread. */
    {
        char what[64];
        snprintf(what, sizeof what, "cudaSetDevice(%d)", cfg->device);
        DIT_CHECK(cuda_check(c, cudaSetDevice(cfg->device), what, diag));
    }
    if (cfg->stream) {
        c->stream = (cudaStream_t)cfg->stream;
    } else {
        /* A default-flag stream, so that work the caller puts on the legacy
         * default stream stays ordered with ours. */
        DIT_CHECK(cuda_check(c, cudaStreamCreateWithFlags(&c->stream, cudaStreamDefault),
                             "cudaStreamCreateWithFlags", diag));
        c->own_stream = true;
    }
    DIT_CHECK(nccl_make_resources(c, diag));

    ncclUniqueId id;
    memcpy(id.internal, cfg->id, DIT_NCCL_ID_BYTES);
    ncclConfig_t ncfg = NCCL_CONFIG_INITIALIZER;
    ncfg.blocking = 0; /* so that a missing peer cannot hang this thread */
    DIT_CHECK(nccl_launched(c,
                            ncclCommInitRankConfig(&c->nccl, cfg->world_size, id, cfg->rank, &ncfg),
                            "ncclCommInitRankConfig", diag));

    *out = &c->base;
    c = NULL;

cleanup:
    if (c) {
        c->broken = true; /* abort, do not finalize, a half-made group */
        nccl_release(c);
    }
    return st;
}

/* ---- ops ----------------------------------------------------------------- */

static void nccl_destroy(dit_comm *base)
{
    nccl_release(nccl_of(base));
}

static void nccl_abort(dit_comm *base)
{
    nccl_break(nccl_of(base), "aborted by its owner");
}

static dit_status nccl_dtype(const dit_nccl_comm *c, dit_dtype dt, ncclDataType_t *out,
                             dit_diag *diag)
{
    switch (dt) {
    case DIT_F32:
        *out = ncclFloat32;
        return DIT_OK;
    case DIT_BF16:
        *out = ncclBfloat16;
        return DIT_OK;
    case DIT_F16:
        *out = ncclFloat16;
        return DIT_OK;
    default:
        return dit_diag_set(diag, DIT_ERR_UNSUPPORTED,
                            "nccl rank %d of %d: all_reduce_sum: dtype %d is not supported",
                            c->base.rank, c->base.size, (int)dt);
    }
}

static dit_status nccl_all_reduce_sum(dit_comm *base, void *buf, size_t count, dit_dtype dtype,
                                      dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of(base);
    dit_status st = DIT_OK;
    ncclDataType_t type = ncclFloat32;

    DIT_CHECK(nccl_usable(c, "all_reduce_sum", diag));
    DIT_CHECK(nccl_dtype(c, dtype, &type, diag));
    if (count == 0) /* every rank passes the same count, so all skip */
        goto cleanup;
    if (!buf) {
        st = bad_arg(c, "all_reduce_sum", "NULL buffer", diag);
        goto cleanup;
    }
    DIT_CHECK(order_after_exchange(c, diag));
    DIT_CHECK(nccl_launched(c, ncclAllReduce(buf, buf, count, type, ncclSum, c->nccl, c->stream),
                            "ncclAllReduce", diag));
cleanup:
    return st;
}

static dit_status nccl_all_gather(dit_comm *base, const void *send, size_t bytes, void *recv,
                                  dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of(base);
    dit_status st = DIT_OK;

    DIT_CHECK(nccl_usable(c, "all_gather", diag));
    if (bytes == 0)
        goto cleanup;
    if (!send || !recv) {
        st = bad_arg(c, "all_gather", "NULL buffer", diag);
        goto cleanup;
    }
    DIT_CHECK(order_after_exchange(c, diag));
    DIT_CHECK(nccl_launched(c, ncclAllGather(send, recv, bytes, ncclUint8, c->nccl, c->stream),
                            "ncclAllGather", diag));
cleanup:
    return st;
}

/* Uneven all-gather as one group of broadcasts, one per rank with a
 * non-empty block, each from that rank's send buffer into its slot of the
 * packed recv buffer (the root's copy lands in its own slot too). Equal
 * counts take ncclAllGather, which is faster. */
static dit_status nccl_all_gather_v(dit_comm *base, const void *send, void *recv,
                                    const size_t *counts, dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of(base);
    dit_status st = DIT_OK;
    const int n = c->base.size;

    DIT_CHECK(nccl_usable(c, "all_gather_v", diag));
    if (!counts) {
        st = bad_arg(c, "all_gather_v", "NULL counts", diag);
        goto cleanup;
    }
    size_t total = 0;
    bool even = true;
    for (int r = 0; r < n; ++r) {
        total += counts[r];
        even = even && counts[r] == counts[0];
    }
    if (total == 0)
        goto cleanup;
    if (!recv || (counts[c->base.rank] > 0 && !send)) {
        st = bad_arg(c, "all_gather_v", "NULL buffer", diag);
        goto cleanup;
    }
    DIT_CHECK(order_after_exchange(c, diag));
    if (even) {
        DIT_CHECK(nccl_launched(c,
                                ncclAllGather(send, recv, counts[0], ncclUint8, c->nccl, c->stream),
                                "ncclAllGather (all_gather_v)", diag));
        goto cleanup;
    }

    ncclResult_t r0 = ncclGroupStart();
    if (r0 != ncclSuccess) {
        st = nccl_check(c, r0, "ncclGroupStart", diag);
        goto cleanup;
    }
    ncclResult_t first = ncclSuccess;
    size_t off = 0;
    for (int r = 0; r < n && first == ncclSuccess; ++r) {
        if (counts[r] > 0) {
            unsigned char *slot = (unsigned char *)recv + off;
            /* sendbuff is read on the root only. */
            const void *src = r == c->base.rank ? send : slot;
            first = ncclBroadcast(src, slot, counts[r], ncclUint8, r, c->nccl, c->stream);
        }
        off += counts[r];
    }
    DIT_CHECK(nccl_group_end(c, first, "ncclBroadcast group (all_gather_v)", diag));
cleanup:
    return st;
}

static dit_status nccl_all_to_all(dit_comm *base, const void *send, size_t bytes, void *recv,
                                  dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of(base);
    dit_status st = DIT_OK;
    const int n = c->base.size;

    DIT_CHECK(nccl_usable(c, "all_to_all", diag));
    if (bytes == 0)
        goto cleanup;
    if (!send || !recv) {
        st = bad_arg(c, "all_to_all", "NULL buffer", diag);
        goto cleanup;
    }
    DIT_CHECK(order_after_exchange(c, diag));

    ncclResult_t r0 = ncclGroupStart();
    if (r0 != ncclSuccess) {
        st = nccl_check(c, r0, "ncclGroupStart", diag);
        goto cleanup;
    }
    /* Sends and receives of one group progress together, so the order in
     * which they are posted cannot deadlock. The block for ourselves goes
     * through NCCL too (a local copy inside its kernel). */
    ncclResult_t first = ncclSuccess;
    for (int j = 0; j < n && first == ncclSuccess; ++j) {
        first = ncclSend((const unsigned char *)send + (size_t)j * bytes, bytes, ncclUint8, j,
                         c->nccl, c->stream);
        if (first == ncclSuccess)
            first = ncclRecv((unsigned char *)recv + (size_t)j * bytes, bytes, ncclUint8, j,
                             c->nccl, c->stream);
    }
    DIT_CHECK(nccl_group_end(c, first, "ncclSend/ncclRecv group (all_to_all)", diag));
cleanup:
    return st;
}

static dit_status nccl_all_to_all_v(dit_comm *base, const void *send, const size_t *send_counts,
                                    void *recv, const size_t *recv_counts, dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of(base);
    dit_status st = DIT_OK;
    const int n = c->base.size;

    DIT_CHECK(nccl_usable(c, "all_to_all_v", diag));
    if (!send_counts || !recv_counts) {
        st = bad_arg(c, "all_to_all_v", "NULL counts", diag);
        goto cleanup;
    }
    size_t send_total = 0, recv_total = 0;
    for (int j = 0; j < n; ++j) {
        send_total += send_counts[j];
        recv_total += recv_counts[j];
    }
    if ((send_total > 0 && !send) || (recv_total > 0 && !recv)) {
        st = bad_arg(c, "all_to_all_v", "NULL buffer", diag);
        goto cleanup;
    }
    /* Nothing to or from this rank: no peer posts anything for us either
     * (counts match across ranks, comm.h), so there is nothing to enqueue. */
    if (send_total == 0 && recv_total == 0)
        goto cleanup;
    DIT_CHECK(order_after_exchange(c, diag));

    ncclResult_t r0 = ncclGroupStart();
    if (r0 != ncclSuccess) {
        st = nccl_check(c, r0, "ncclGroupStart", diag);
        goto cleanup;
    }
    /* Zero-byte blocks are skipped on both ends: send_counts[j] on this rank
     * is recv_counts[rank] on rank j, so both sides skip the same pair. */
    ncclResult_t first = ncclSuccess;
    size_t soff = 0, roff = 0;
    for (int j = 0; j < n && first == ncclSuccess; ++j) {
        if (send_counts[j] > 0)
            first = ncclSend((const unsigned char *)send + soff, send_counts[j], ncclUint8, j,
                             c->nccl, c->stream);
        if (first == ncclSuccess && recv_counts[j] > 0)
            first = ncclRecv((unsigned char *)recv + roff, recv_counts[j], ncclUint8, j, c->nccl,
                             c->stream);
        soff += send_counts[j];
        roff += recv_counts[j];
    }
    DIT_CHECK(nccl_group_end(c, first, "ncclSend/ncclRecv group (all_to_all_v)", diag));
cleanup:
    return st;
}

static dit_status nccl_sendrecv_start(dit_comm *base, const void *send, size_t send_bytes, int dst,
                                      void *recv, size_t recv_bytes, int src, dit_comm_request *req,
                                      dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of(base);
    dit_status st = DIT_OK;
    const int n = c->base.size;

    if (req)
        req->active = 0;
    DIT_CHECK(nccl_usable(c, "sendrecv_start", diag));
    if (!req) {
        st = bad_arg(c, "sendrecv_start", "NULL request", diag);
        goto cleanup;
    }
    if (c->open_seq != 0) {
        st = bad_arg(c, "sendrecv_start", "an exchange is already open on this group", diag);
        goto cleanup;
    }
    if (dst < 0 || dst >= n || src < 0 || src >= n) {
        char why[96];
        snprintf(why, sizeof why, "peer out of range (dst %d, src %d, group of %d)", dst, src, n);
        st = bad_arg(c, "sendrecv_start", why, diag);
        goto cleanup;
    }
    if ((send_bytes > 0 && !send) || (recv_bytes > 0 && !recv)) {
        st = bad_arg(c, "sendrecv_start", "NULL buffer", diag);
        goto cleanup;
    }

    /* The side stream starts where the compute stream is now: the data to
     * send has been produced, the receive buffer is free. */
    DIT_CHECK(cuda_check(c, cudaEventRecord(c->ev_ready, c->stream),
                         "cudaEventRecord(compute stream)", diag));
    DIT_CHECK(cuda_check(c, cudaStreamWaitEvent(c->side, c->ev_ready, 0),
                         "cudaStreamWaitEvent(side stream)", diag));

    ncclResult_t r0 = ncclGroupStart();
    if (r0 != ncclSuccess) {
        st = nccl_check(c, r0, "ncclGroupStart", diag);
        goto cleanup;
    }
    /* One group, so the send and the receive progress together (a ring
     * where everybody sends first would otherwise deadlock). Zero-byte
     * halves are skipped; the peer's matching half is zero-byte as well. */
    ncclResult_t first = ncclSuccess;
    if (send_bytes > 0)
        first = ncclSend(send, send_bytes, ncclUint8, dst, c->nccl, c->side);
    if (first == ncclSuccess && recv_bytes > 0)
        first = ncclRecv(recv, recv_bytes, ncclUint8, src, c->nccl, c->side);
    DIT_CHECK(nccl_group_end(c, first, "ncclSend/ncclRecv group (sendrecv)", diag));
    DIT_CHECK(
        cuda_check(c, cudaEventRecord(c->ev_done, c->side), "cudaEventRecord(side stream)", diag));

    c->open_seq = ++c->last_seq;
    req->active = 1;
    req->send = send;
    req->send_bytes = send_bytes;
    req->dst = dst;
    req->recv = recv;
    req->recv_bytes = recv_bytes;
    req->src = src;
    req->seq = c->open_seq;
cleanup:
    return st;
}

static dit_status nccl_sendrecv_wait(dit_comm *base, dit_comm_request *req, dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of(base);
    dit_status st = DIT_OK;

    if (!req || !req->active) {
        st = bad_arg(c, "sendrecv_wait", "no exchange was started with this request", diag);
        goto cleanup;
    }
    req->active = 0;
    if (req->seq != c->open_seq) {
        st = bad_arg(c, "sendrecv_wait", "the request is not the group's open exchange", diag);
        goto cleanup;
    }
    c->open_seq = 0;
    DIT_CHECK(nccl_usable(c, "sendrecv_wait", diag));
    /* The compute stream continues once the exchange is done; the host does
     * not wait. */
    DIT_CHECK(cuda_check(c, cudaStreamWaitEvent(c->stream, c->ev_done, 0),
                         "cudaStreamWaitEvent(compute stream)", diag));
    /* A cheap look for errors NCCL has noticed meanwhile (a peer's
     * connection dropped), so that they surface here and not only at the
     * next barrier. */
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c->nccl, &async);
    if (r != ncclSuccess) {
        st = nccl_check(c, r, "ncclCommGetAsyncError", diag);
        goto cleanup;
    }
    if (async != ncclSuccess && async != ncclInProgress)
        st = nccl_check(c, async, "sendrecv", diag);
cleanup:
    return st;
}

static dit_status nccl_broadcast(dit_comm *base, void *buf, size_t bytes, int root, dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of(base);
    dit_status st = DIT_OK;

    DIT_CHECK(nccl_usable(c, "broadcast", diag));
    if (root < 0 || root >= c->base.size) {
        st = bad_arg(c, "broadcast", "root out of range", diag);
        goto cleanup;
    }
    if (bytes == 0)
        goto cleanup;
    if (!buf) {
        st = bad_arg(c, "broadcast", "NULL buffer", diag);
        goto cleanup;
    }
    DIT_CHECK(order_after_exchange(c, diag));
    DIT_CHECK(nccl_launched(c, ncclBroadcast(buf, buf, bytes, ncclUint8, root, c->nccl, c->stream),
                            "ncclBroadcast", diag));
cleanup:
    return st;
}

/* A one-float all-reduce, then a host wait for the compute stream. The wait
 * polls the stream and NCCL's error state instead of calling
 * cudaStreamSynchronize, which would hang forever on a dead peer; on timeout
 * the communicator is aborted, which makes its kernels exit. */
static dit_status nccl_barrier(dit_comm *base, dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of(base);
    dit_status st = DIT_OK;

    DIT_CHECK(nccl_usable(c, "barrier", diag));
    DIT_CHECK(order_after_exchange(c, diag));
    DIT_CHECK(nccl_launched(
        c,
        ncclAllReduce(c->barrier_buf, c->barrier_buf, 1, ncclFloat32, ncclSum, c->nccl, c->stream),
        "ncclAllReduce (barrier)", diag));

    double deadline = now_s() + c->timeout_s;
    for (unsigned iter = 0;; ++iter) {
        cudaError_t q = cudaStreamQuery(c->stream);
        if (q == cudaSuccess)
            break;
        if (q != cudaErrorNotReady) {
            st = cuda_check(c, q, "cudaStreamQuery (barrier)", diag);
            goto cleanup;
        }
        ncclResult_t async = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(c->nccl, &async);
        if (r != ncclSuccess) {
            st = nccl_check(c, r, "ncclCommGetAsyncError", diag);
            goto cleanup;
        }
        if (async != ncclSuccess && async != ncclInProgress) {
            st = nccl_check(c, async, "barrier", diag);
            goto cleanup;
        }
        if (now_s() > deadline) {
            st = nccl_fail(c, DIT_ERR_TIMEOUT, diag,
                           "barrier did not complete within %.1f s (work queued before it "
                           "included): a peer is stalled or dead; communicator aborted",
                           c->timeout_s);
            goto cleanup;
        }
        poll_backoff(iter);
    }
cleanup:
    return st;
}

/* ncclCommSplit on the non-blocking parent: NCCL runs the split in a
 * background job tied to the parent, so the parent is polled, and the child
 * handle is written by that job when it ends. It is written into the
 * heap-allocated child struct, never into a stack variable, and we return
 * only after the job has ended (polled to completion, or joined by
 * ncclCommAbort on the parent). */
static dit_status nccl_split(dit_comm *base, int color, int key, dit_comm **out, dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of(base);
    dit_nccl_comm *child = NULL;
    dit_status st = DIT_OK;
    int saved_dev = -1;

    if (out)
        *out = NULL;
    DIT_CHECK(nccl_usable(c, "split", diag));
    if (!out) {
        st = bad_arg(c, "split", "NULL output", diag);
        goto cleanup;
    }

    child = calloc(1, sizeof *child);
    if (!child) {
        st = nccl_fail(c, DIT_ERR_NOMEM, diag, "split: out of memory");
        goto cleanup;
    }
    child->base.ops = &nccl_ops;
    child->base.rank = c->base.rank; /* until NCCL says; used in messages */
    child->base.size = c->base.size;
    child->device = c->device;
    child->timeout_s = c->timeout_s;
    child->stream = c->stream; /* shared, owned by the parent */
    child->own_stream = false;

    DIT_CHECK(cuda_check(c, cudaGetDevice(&saved_dev), "cudaGetDevice", diag));
    if (saved_dev != c->device)
        DIT_CHECK(cuda_check(c, cudaSetDevice(c->device), "cudaSetDevice", diag));
    /* Allocate before the collective split, so that no failure can come
     * between NCCL creating the child and our returning it. */
    if (color >= 0) {
        st = nccl_make_resources(child, diag);
        if (st != DIT_OK) {
            nccl_break(c, child->broken_msg); /* the peers are in the split */
            goto cleanup;
        }
    }

    ncclConfig_t ncfg = NCCL_CONFIG_INITIALIZER;
    ncfg.blocking = 0;
    ncclResult_t r =
        ncclCommSplit(c->nccl, color >= 0 ? color : NCCL_SPLIT_NOCOLOR, key, &child->nccl, &ncfg);
    DIT_CHECK(nccl_launched(c, r, "ncclCommSplit", diag));

    if (color < 0) /* took part, joins no group */
        goto cleanup;
    /* A failure of the child is a failure of the split, and so of the
     * parent: it would be out of step with the peers' children. */
    st = nccl_wait_ready(child, "ncclCommSplit (new group)", diag);
    if (st != DIT_OK) {
        nccl_break(c, child->broken_msg);
        goto cleanup;
    }
    int rank = -1, size = 0;
    ncclResult_t rr = ncclCommUserRank(child->nccl, &rank);
    ncclResult_t rc = ncclCommCount(child->nccl, &size);
    if (rr != ncclSuccess || rc != ncclSuccess) {
        st = nccl_check(c, rr != ncclSuccess ? rr : rc, "ncclCommUserRank/ncclCommCount", diag);
        goto cleanup;
    }
    child->base.rank = rank;
    child->base.size = size;
    child->root = c->root ? c->root : c;
    child->next = child->root->members;
    child->root->members = child;
    *out = &child->base;
    child = NULL;

cleanup:
    if (child) {
        /* A failed split broke the parent (joining NCCL's job), so nothing
         * writes child->nccl any more; a NOCOLOR split left it NULL. */
        child->broken = true;
        nccl_release(child);
    }
    if (saved_dev >= 0 && saved_dev != c->device)
        (void)cudaSetDevice(saved_dev);
    return st;
}

/* ---- host waits on the compute stream ------------------------------------ */

/* Aborts every group of c's family that is not broken yet, with `why`. */
static void family_break(dit_nccl_comm *root, const char *why)
{
    nccl_break(root, why);
    for (dit_nccl_comm *m = root->members; m; m = m->next)
        nccl_break(m, why);
}

/* One group: DIT_OK when healthy or still working. */
static dit_status member_check(dit_nccl_comm *c, dit_diag *diag)
{
    if (c->broken)
        return nccl_usable(c, "waiting for the compute stream", diag);
    if (!c->nccl)
        return DIT_OK;
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c->nccl, &async);
    if (r != ncclSuccess)
        return nccl_check(c, r, "ncclCommGetAsyncError", diag);
    if (async != ncclSuccess && async != ncclInProgress)
        return nccl_check(c, async, "NCCL work on the compute stream", diag);
    return DIT_OK;
}

dit_status dit_nccl_wait_check(void *comm, double waited_s, dit_diag *diag)
{
    dit_nccl_comm *c = nccl_of((dit_comm *)comm);
    if (!c || c->base.ops != &nccl_ops)
        return dit_diag_set(diag, DIT_ERR_INVALID_ARG, "nccl: wait check: not an nccl group");
    dit_nccl_comm *root = c->root ? c->root : c;
    dit_status st = member_check(root, diag);
    for (dit_nccl_comm *m = root->members; st == DIT_OK && m; m = m->next)
        st = member_check(m, diag);
    if (st == DIT_OK && waited_s > root->timeout_s)
        st = nccl_fail(root, DIT_ERR_TIMEOUT, diag,
                       "the compute stream did not drain within %.1f s while it carries NCCL "
                       "work: a peer is stalled or dead; communicators aborted",
                       root->timeout_s);
    if (st != DIT_OK)
        family_break(root,
                     dit_diag_msg(diag)[0] ? dit_diag_msg(diag) : "a group of the family failed");
    return st;
}

static const dit_comm_ops nccl_ops = {
    .name = "nccl",
    .destroy = nccl_destroy,
    .all_reduce_sum = nccl_all_reduce_sum,
    .all_gather = nccl_all_gather,
    .all_gather_v = nccl_all_gather_v,
    .all_to_all = nccl_all_to_all,
    .all_to_all_v = nccl_all_to_all_v,
    .sendrecv_start = nccl_sendrecv_start,
    .sendrecv_wait = nccl_sendrecv_wait,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .split = nccl_split,
    .abort = nccl_abort,
};
