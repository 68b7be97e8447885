/* The emulated CUDA runtime and cuBLASLt behind tests/gpu/emu/include (see
 * README.md there). Process-wide state (a driver's), used from one host
 * thread at a time, as the cuda backend is. DIT_EMU_DEVICE_COUNT devices
 * (default 1), all the same one: a mesh's ranks are processes, each with a
 * device of its own. With DIT_EMU_EXCLUSIVE_DIR set, devices are in
 * exclusive-process compute mode across the processes that share that
 * directory: cudaSetDevice of a device another live process holds fails
 * with cudaErrorDevicesUnavailable (what two meshes given one GPU get).
 *
 * What it checks, beyond running the work:
 *  - every device pointer a copy, memset or GEMM is given lies, with its
 *    whole extent, inside one cudaMalloc'ed block, and host pointers are
 *    not device memory;
 *  - stream order: work runs only when the host would know it done
 *    (cudaStreamSynchronize, a cudaStreamQuery that reports it, a pageable
 *    copy, cudaFree), so a host read of pinned memory before a wait sees
 *    stale bytes, as it could on a GPU;
 *  - graph capture: what a capture records runs on each launch of the
 *    graph, with the arguments of capture time; a wait, a query or a
 *    pageable copy on a capturing stream invalidates the capture;
 *  - launch limits (grid and block sizes, dynamic shared memory against
 *    48 KiB or what cudaFuncSetAttribute raised it to, at most the
 *    device's opt-in maximum): a bad launch sets the sticky error that
 *    cudaGetLastError returns, and does not run;
 *  - cuBLASLt: layouts consistent with the operation and the result,
 *    leading dimensions, types, and operand alignment against what the
 *    heuristic was told. The product of the bf16 operands is summed in f32
 *    (OpenBLAS), then alpha, beta C, the epilogue (bias, GELU) and D's
 *    type, in that order.
 * Problems are printed to stderr with what was asked.
 *
 * A device fault on demand: with DIT_EMU_FAULT_FILE set, the first stream
 * synchronisation or query after that file appears fails with
 * cudaErrorIllegalAddress (what a kernel's bad access gives on a GPU), and
 * so does every later one, and cudaGetLastError keeps returning it: the
 * context is broken, as a real one stays after such a fault. */
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cblas.h>
#include <cublasLt.h>
#include <cuda_runtime.h>

struct emu_stream {
    std::deque<std::function<void()>> queue;
    bool capturing = false;
    bool invalidated = false;
    std::vector<std::function<void()>> captured;
};

struct emu_event {
    bool done = false; /* its last record has run */
    double t_ms = 0.0;
    emu_stream *stream = nullptr;   /* where its last record was queued */
    uint64_t recorded = 0, ran = 0; /* records queued, and the last that ran */
};

struct emu_graph {
    std::vector<std::function<void()>> ops;
};

struct emu_graph_exec {
    std::shared_ptr<const std::vector<std::function<void()>>> ops;
};

namespace
{

struct alloc_info {
    size_t bytes;
    bool device; /* false: pinned host memory (cudaMallocHost) */
};

/* Device limits: an H100/H200-class device (sm_90). */
const size_t SMEM_DEFAULT = 48 * 1024, SMEM_OPTIN = 232448;
const int SM_COUNT = 132;

struct runtime {
    std::map<uintptr_t, alloc_info> allocs;
    size_t device_bytes = 0, device_total = 0;
    cudaError_t sticky = cudaSuccess;
    std::map<const void *, size_t> func_smem;
    std::set<emu_stream *> streams;
    emu_stream null_stream;
    uint64_t seed = 1;
    emu::copies copies = emu::COPY_AT_ISSUE;
    emu::schedule sched = emu::SCHED_ROUND_ROBIN;
    int device_count = 1, device = 0;
    std::set<int> held;               /* devices this process holds (exclusive mode) */
    const char *fault_file = nullptr; /* DIT_EMU_FAULT_FILE */
    bool faulted = false;
    bool configured = false;
};

runtime &rt()
{
    static runtime r;
    if (!r.configured) {
        r.configured = true;
        const char *c = getenv("DIT_EMU_COPIES"), *s = getenv("DIT_EMU_SCHED"),
                   *m = getenv("DIT_EMU_DEVICE_MIB");
        if (c && strcmp(c, "wait") == 0)
            r.copies = emu::COPY_AT_WAIT;
        if (s && strcmp(s, "warp") == 0)
            r.sched = emu::SCHED_WARP_GREEDY;
        const long mib = m ? atol(m) : 0;
        const char *nd = getenv("DIT_EMU_DEVICE_COUNT");
        const long ndev = nd ? atol(nd) : 1;
        r.device_count = ndev >= 1 && ndev <= 64 ? (int)ndev : 1;
        r.device_total = (size_t)(mib > 0 ? mib : 8192) << 20;
        r.streams.insert(&r.null_stream);
        const char *ff = getenv("DIT_EMU_FAULT_FILE");
        r.fault_file = ff && ff[0] ? ff : nullptr;
    }
    return r;
}

/* Whether the emulated device has faulted (DIT_EMU_FAULT_FILE): checked
 * where a GPU reports a kernel's fault, at a synchronisation. */
bool device_faulted()
{
    runtime &r = rt();
    if (!r.faulted && r.fault_file && access(r.fault_file, F_OK) == 0) {
        r.faulted = true;
        fprintf(stderr, "emu_runtime: a device fault, as %s asks\n", r.fault_file);
    }
    if (r.faulted)
        r.sticky = cudaErrorIllegalAddress;
    return r.faulted;
}

emu_stream *stream_of(cudaStream_t s)
{
    return s ? s : &rt().null_stream;
}

void complain(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void complain(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("emu_runtime: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

cudaError_t fail(cudaError_t e)
{
    rt().sticky = e;
    return e;
}

/* The allocation holding [p, p + bytes), or NULL. */
const alloc_info *find(const void *p, size_t bytes)
{
    runtime &r = rt();
    const uintptr_t a = (uintptr_t)p;
    auto it = r.allocs.upper_bound(a);
    if (it == r.allocs.begin())
        return nullptr;
    --it;
    if (a - it->first + bytes > it->second.bytes)
        return nullptr;
    return &it->second;
}

bool overlaps_device(const void *p, size_t bytes)
{
    runtime &r = rt();
    const uintptr_t a = (uintptr_t)p;
    for (const auto &kv : r.allocs)
        if (kv.second.device && a < kv.first + kv.second.bytes && kv.first < a + bytes)
            return true;
    return false;
}

/* One op at a time from the front, so that an op may itself run another
 * stream up to an event (cudaStreamWaitEvent) or this one further. */
void flush(emu_stream *s)
{
    while (!s->queue.empty()) {
        std::function<void()> op = std::move(s->queue.front());
        s->queue.pop_front();
        op();
    }
}

/* Runs stream s until record number `rec` of ev has run. */
void run_until(emu_event *ev, emu_stream *s, uint64_t rec)
{
    while (ev->ran < rec && s && !s->queue.empty()) {
        std::function<void()> op = std::move(s->queue.front());
        s->queue.pop_front();
        op();
    }
}

void flush_all()
{
    for (emu_stream *s : rt().streams)
        flush(s);
}

/* A call that a capturing stream cannot take: the capture is spoiled. */
cudaError_t capture_breaks(emu_stream *s, const char *what)
{
    complain("%s on a stream that is capturing a graph: the capture is invalidated", what);
    s->invalidated = true;
    return fail(cudaErrorStreamCaptureUnsupported);
}

double now_ms()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

} /* namespace */

/* ---- emurt ---------------------------------------------------------------- */

namespace emurt
{

bool launch_ok(const void *fn, dim3 g, dim3 b, size_t smem)
{
    runtime &r = rt();
    const uint64_t threads = (uint64_t)b.x * b.y * b.z;
    if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535 || g.z > 65535 ||
        threads == 0 || threads > 1024 || b.x > 1024 || b.y > 1024 || b.z > 64) {
        complain("kernel launch with grid (%u, %u, %u) and block (%u, %u, %u): outside the "
                 "device's limits",
                 g.x, g.y, g.z, b.x, b.y, b.z);
        fail(cudaErrorInvalidConfiguration);
        return false;
    }
    auto it = r.func_smem.find(fn);
    const size_t cap = it == r.func_smem.end() ? SMEM_DEFAULT : it->second;
    if (smem > cap) {
        complain("kernel launch with %zu bytes of dynamic shared memory; the kernel may have "
                 "%zu (cudaFuncSetAttribute raises it up to %zu)",
                 smem, cap, SMEM_OPTIN);
        fail(cudaErrorInvalidValue);
        return false;
    }
    return true;
}

cudaError_t submit(cudaStream_t st, std::function<void()> op)
{
    emu_stream *s = stream_of(st);
    if (s->capturing)
        s->captured.push_back(std::move(op));
    else
        s->queue.push_back(std::move(op));
    return cudaSuccess;
}

emu::copies copies_mode()
{
    return rt().copies;
}

emu::schedule schedule_mode()
{
    return rt().sched;
}

uint64_t next_seed()
{
    return rt().seed++;
}

cudaError_t set_func_smem(const void *fn, int bytes)
{
    if (bytes < 0 || (size_t)bytes > SMEM_OPTIN) {
        complain("cudaFuncSetAttribute: %d bytes of dynamic shared memory; the device allows %zu",
                 bytes, SMEM_OPTIN);
        return fail(cudaErrorInvalidValue);
    }
    rt().func_smem[fn] = (size_t)bytes > SMEM_DEFAULT ? (size_t)bytes : SMEM_DEFAULT;
    return cudaSuccess;
}

bool is_device(const void *p, size_t bytes)
{
    const alloc_info *a = find(p, bytes);
    return a && a->device;
}

void run_now(cudaStream_t st)
{
    flush(stream_of(st));
}

} /* namespace emurt */

/* ---- device and errors ---------------------------------------------------- */

static bool device_ok(int device)
{
    return device >= 0 && device < rt().device_count;
}

/* Exclusive-process mode (DIT_EMU_EXCLUSIVE_DIR): <dir>/device-<d> holds
 * the pid of the process using device d; a dead holder's claim lapses. */
static bool claim_device(int device)
{
    const char *dir = getenv("DIT_EMU_EXCLUSIVE_DIR");
    if (!dir || !dir[0] || rt().held.count(device))
        return true;
    char path[600], tmp[640];
    snprintf(path, sizeof path, "%s/device-%d", dir, device);
    snprintf(tmp, sizeof tmp, "%s.%d", path, (int)getpid());
    const pid_t me = getpid();
    for (int attempt = 0; attempt < 2; attempt++) {
        /* A link of a file holding our pid: atomic, and whole when seen. */
        const int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0)
            return false;
        const bool wrote = write(fd, &me, sizeof me) == (ssize_t)sizeof me;
        close(fd);
        const bool linked = wrote && link(tmp, path) == 0;
        unlink(tmp);
        if (linked) {
            rt().held.insert(device);
            return true;
        }
        pid_t holder = 0;
        const int rd = open(path, O_RDONLY | O_CLOEXEC);
        if (rd >= 0) {
            if (read(rd, &holder, sizeof holder) != (ssize_t)sizeof holder)
                holder = 0;
            close(rd);
        }
        if (holder > 0 && holder != me && kill(holder, 0) == 0) {
            complain("cudaSetDevice(%d): the device is in exclusive-process mode and process "
                     "%d holds it",
                     device, (int)holder);
            return false;
        }
        unlink(path); /* a dead holder's (or our own earlier) claim */
    }
    return false;
}

cudaError_t cudaGetDeviceCount(int *n)
{
    *n = rt().device_count;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    if (!device_ok(device))
        return fail(cudaErrorInvalidDevice);
    if (!claim_device(device))
        return fail(cudaErrorDevicesUnavailable);
    rt().device = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
    if (!device)
        return fail(cudaErrorInvalidValue);
    *device = rt().device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device)
{
    if (!device_ok(device))
        return fail(cudaErrorInvalidDevice);
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "SIMT emulator (sm_90 limits)");
    p->totalGlobalMem = rt().device_total;
    p->sharedMemPerBlock = SMEM_DEFAULT;
    p->sharedMemPerBlockOptin = SMEM_OPTIN;
    p->multiProcessorCount = SM_COUNT;
    p->major = 9;
    p->minor = 0;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device)
{
    if (!device_ok(device))
        return fail(cudaErrorInvalidDevice);
    if (attr != cudaDevAttrMaxSharedMemoryPerBlockOptin)
        return fail(cudaErrorInvalidValue);
    *value = (int)SMEM_OPTIN;
    return cudaSuccess;
}

cudaError_t cudaGetLastError(void)
{
    const cudaError_t e = rt().sticky;
    if (!rt().faulted) /* a fault's error is sticky */
        rt().sticky = cudaSuccess;
    return e;
}

const char *cudaGetErrorName(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "cudaSuccess";
    case cudaErrorInvalidValue:
        return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
        return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
        return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer:
        return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidDevice:
        return "cudaErrorInvalidDevice";
    case cudaErrorDevicesUnavailable:
        return "cudaErrorDevicesUnavailable";
    case cudaErrorNotReady:
        return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
        return "cudaErrorIllegalAddress";
    case cudaErrorStreamCaptureUnsupported:
        return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
        return "cudaErrorStreamCaptureInvalidated";
    default:
        return "cudaErrorUnknown";
    }
}

const char *cudaGetErrorString(cudaError_t e)
{
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInvalidConfiguration:
        return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer:
        return "invalid device pointer";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    case cudaErrorDevicesUnavailable:
        return "CUDA-capable device(s) is/are busy or unavailable";
    case cudaErrorNotReady:
        return "device not ready";
    case cudaErrorIllegalAddress:
        return "an illegal memory access was encountered";
    case cudaErrorStreamCaptureUnsupported:
        return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
        return "operation failed due to a previous error during capture";
    default:
        return "unknown error";
    }
}

/* ---- memory --------------------------------------------------------------- */

static cudaError_t do_alloc(void **p, size_t bytes, bool device)
{
    runtime &r = rt();
    if (device && r.device_bytes + bytes > r.device_total)
        return fail(cudaErrorMemoryAllocation);
    void *q = nullptr;
    /* cudaMalloc's 256-byte alignment; the exact size, so that
     * AddressSanitizer sees a kernel reading past the end. */
    if (posix_memalign(&q, 256, bytes ? bytes : 1) != 0)
        return fail(cudaErrorMemoryAllocation);
    /* Fresh device memory holds whatever was there: a NaN pattern. */
    memset(q, 0xff, bytes);
    r.allocs[(uintptr_t)q] = alloc_info{bytes, device};
    if (device)
        r.device_bytes += bytes;
    *p = q;
    return cudaSuccess;
}

static cudaError_t do_free(void *p, bool device, const char *fn)
{
    if (!p)
        return cudaSuccess;
    runtime &r = rt();
    auto it = r.allocs.find((uintptr_t)p);
    if (it == r.allocs.end() || it->second.device != device) {
        complain("%s(%p): not the start of a block from %s", fn, p,
                 device ? "cudaMalloc" : "cudaMallocHost");
        return fail(cudaErrorInvalidValue);
    }
    /* Freeing waits for the device, as cudaFree does. */
    flush_all();
    if (device)
        r.device_bytes -= it->second.bytes;
    r.allocs.erase(it);
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMalloc(void **p, size_t bytes)
{
    return do_alloc(p, bytes, true);
}

cudaError_t cudaFree(void *p)
{
    return do_free(p, true, "cudaFree");
}

cudaError_t cudaMallocHost(void **p, size_t bytes)
{
    return do_alloc(p, bytes, false);
}

cudaError_t cudaFreeHost(void *p)
{
    return do_free(p, false, "cudaFreeHost");
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    *total_bytes = rt().device_total;
    *free_bytes = rt().device_total - rt().device_bytes;
    return cudaSuccess;
}

/* Checks one side of a copy: device memory for a device side, memory that
 * is not the device's for a host side (pinned or not). */
static bool side_ok(const void *p, size_t bytes, bool device, const char *fn, const char *which)
{
    if (bytes == 0)
        return true;
    if (device) {
        if (emurt::is_device(p, bytes))
            return true;
        complain("%s: %s %p (%zu bytes) is not inside one device allocation", fn, which, p, bytes);
        return false;
    }
    if (!overlaps_device(p, bytes))
        return true;
    complain("%s: %s %p (%zu bytes) is device memory where host memory was meant", fn, which, p,
             bytes);
    return false;
}

static bool pinned(const void *p, size_t bytes)
{
    const alloc_info *a = find(p, bytes);
    return a && !a->device;
}

/* Queues a copy when it is device to device or its host side is pinned;
 * otherwise it is a pageable copy, which waits for the stream and happens
 * in the call. */
static cudaError_t copy_or_queue(emu_stream *s, bool host_side_pinned, bool device_only,
                                 std::function<void()> op, const char *fn)
{
    if (device_only || host_side_pinned) {
        emurt::submit(s == &rt().null_stream ? nullptr : s, std::move(op));
        return cudaSuccess;
    }
    if (s->capturing)
        return capture_breaks(s, fn);
    flush(s);
    op();
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t st)
{
    const char *fn = "cudaMemcpyAsync";
    emu_stream *s = stream_of(st);
    bool ok;
    bool host_pinned = false;
    switch (kind) {
    case cudaMemcpyHostToDevice:
        ok = side_ok(dst, bytes, true, fn, "destination") &&
             side_ok(src, bytes, false, fn, "source");
        host_pinned = pinned(src, bytes);
        break;
    case cudaMemcpyDeviceToHost:
        ok = side_ok(dst, bytes, false, fn, "destination") &&
             side_ok(src, bytes, true, fn, "source");
        host_pinned = pinned(dst, bytes);
        break;
    case cudaMemcpyDeviceToDevice:
        ok =
            side_ok(dst, bytes, true, fn, "destination") && side_ok(src, bytes, true, fn, "source");
        break;
    default:
        complain("%s: copy kind %d is not one the backend should use", fn, (int)kind);
        ok = false;
    }
    if (!ok)
        return fail(cudaErrorInvalidValue);
    if (bytes == 0)
        return cudaSuccess;
    return copy_or_queue(
        s, host_pinned, kind == cudaMemcpyDeviceToDevice, [=]() { memmove(dst, src, bytes); }, fn);
}

cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind, cudaStream_t st)
{
    const char *fn = "cudaMemcpy2DAsync";
    if (width > dpitch || width > spitch) {
        complain("%s: width %zu wider than a pitch (%zu, %zu)", fn, width, dpitch, spitch);
        return fail(cudaErrorInvalidValue);
    }
    if (width == 0 || height == 0)
        return cudaSuccess;
    const size_t dext = dpitch * (height - 1) + width, sext = spitch * (height - 1) + width;
    const bool dd = kind != cudaMemcpyDeviceToHost, sd = kind != cudaMemcpyHostToDevice;
    if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToHost &&
        kind != cudaMemcpyDeviceToDevice) {
        complain("%s: copy kind %d is not one the backend should use", fn, (int)kind);
        return fail(cudaErrorInvalidValue);
    }
    if (!side_ok(dst, dext, dd, fn, "destination") || !side_ok(src, sext, sd, fn, "source"))
        return fail(cudaErrorInvalidValue);
    const bool host_pinned = kind == cudaMemcpyHostToDevice   ? pinned(src, sext)
                             : kind == cudaMemcpyDeviceToHost ? pinned(dst, dext)
                                                              : false;
    return copy_or_queue(
        stream_of(st), host_pinned, kind == cudaMemcpyDeviceToDevice,
        [=]() {
            for (size_t r = 0; r < height; r++)
                memmove((char *)dst + r * dpitch, (const char *)src + r * spitch, width);
        },
        fn);
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t st)
{
    if (!side_ok(p, bytes, true, "cudaMemsetAsync", "destination"))
        return fail(cudaErrorInvalidValue);
    if (bytes == 0)
        return cudaSuccess;
    return emurt::submit(st, [=]() { memset(p, value, bytes); });
}

/* ---- streams and graphs --------------------------------------------------- */

cudaError_t cudaStreamCreate(cudaStream_t *s)
{
    *s = new emu_stream;
    rt().streams.insert(*s);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned)
{
    return cudaStreamCreate(s);
}

/* Priorities order nothing here: one queue runs at a time. */
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned, int)
{
    return cudaStreamCreate(s);
}

cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest)
{
    *least = 0;
    *greatest = -5;
    return cudaSuccess;
}

/* The wait runs where it stands in s: it runs the recording stream up to
 * ev's record as of this call (queued before the wait was, so it is there
 * to be run; a later record of ev does not move it). */
cudaError_t cudaStreamWaitEvent(cudaStream_t st, cudaEvent_t ev, unsigned)
{
    if (!ev)
        return fail(cudaErrorInvalidValue);
    if (!ev->stream || ev->stream == stream_of(st))
        return cudaSuccess; /* never recorded, or stream order already */
    emu_stream *from = ev->stream;
    const uint64_t rec = ev->recorded;
    return emurt::submit(st, [ev, from, rec]() { run_until(ev, from, rec); });
}

cudaError_t cudaLaunchHostFunc(cudaStream_t st, cudaHostFn_t fn, void *user_data)
{
    if (!fn)
        return fail(cudaErrorInvalidValue);
    return emurt::submit(st, [fn, user_data]() { fn(user_data); });
}

cudaError_t cudaStreamDestroy(cudaStream_t s)
{
    if (!s || !rt().streams.count(s))
        return fail(cudaErrorInvalidValue);
    /* Work queued on a destroyed stream still completes. */
    flush(s);
    rt().streams.erase(s);
    delete s;
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t st)
{
    emu_stream *s = stream_of(st);
    if (s->capturing)
        return capture_breaks(s, "cudaStreamSynchronize");
    flush(s);
    return device_faulted() ? cudaErrorIllegalAddress : cudaSuccess;
}

/* Work in the queue is "running": the first query runs it and says not
 * ready, the next says done. */
cudaError_t cudaStreamQuery(cudaStream_t st)
{
    emu_stream *s = stream_of(st);
    if (s->capturing)
        return capture_breaks(s, "cudaStreamQuery");
    if (device_faulted())
        return cudaErrorIllegalAddress;
    if (s->queue.empty())
        return cudaSuccess;
    flush(s);
    return cudaErrorNotReady;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t st, cudaStreamCaptureMode mode)
{
    emu_stream *s = stream_of(st);
    if (!st || s->capturing || mode != cudaStreamCaptureModeRelaxed) {
        complain("cudaStreamBeginCapture: %s", !st            ? "the legacy default stream"
                                               : s->capturing ? "already capturing"
                                                              : "a mode other than relaxed");
        return fail(cudaErrorInvalidValue);
    }
    s->capturing = true;
    s->invalidated = false;
    s->captured.clear();
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t st, cudaGraph_t *graph)
{
    emu_stream *s = stream_of(st);
    *graph = nullptr;
    if (!s->capturing)
        return fail(cudaErrorInvalidValue);
    s->capturing = false;
    if (s->invalidated) {
        s->captured.clear();
        return fail(cudaErrorStreamCaptureInvalidated);
    }
    emu_graph *g = new emu_graph;
    g->ops.swap(s->captured);
    *graph = g;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long)
{
    if (!graph)
        return fail(cudaErrorInvalidValue);
    emu_graph_exec *x = new emu_graph_exec;
    x->ops = std::make_shared<const std::vector<std::function<void()>>>(graph->ops);
    *exec = x;
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t st)
{
    if (!exec)
        return fail(cudaErrorInvalidValue);
    std::shared_ptr<const std::vector<std::function<void()>>> ops = exec->ops;
    return emurt::submit(st, [ops]() {
        for (const auto &op : *ops)
            op();
    });
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph)
{
    delete graph;
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec)
{
    delete exec;
    return cudaSuccess;
}

/* ---- events --------------------------------------------------------------- */

cudaError_t cudaEventCreate(cudaEvent_t *ev)
{
    *ev = new emu_event;
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned)
{
    return cudaEventCreate(ev);
}

/* As cudaStreamQuery: pending work up to the record runs at the first
 * query, which says not ready. */
cudaError_t cudaEventQuery(cudaEvent_t ev)
{
    if (!ev)
        return fail(cudaErrorInvalidValue);
    if (ev->done || !ev->stream)
        return cudaSuccess;
    run_until(ev, ev->stream, ev->recorded);
    return cudaErrorNotReady;
}

cudaError_t cudaEventDestroy(cudaEvent_t ev)
{
    flush_all(); /* a queued record must not outlive its event */
    delete ev;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t st)
{
    if (!ev)
        return fail(cudaErrorInvalidValue);
    ev->done = false;
    ev->stream = stream_of(st);
    const uint64_t rec = ++ev->recorded;
    return emurt::submit(st, [ev, rec]() {
        ev->ran = rec;
        ev->done = rec == ev->recorded;
        ev->t_ms = now_ms();
    });
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b)
{
    if (!a || !b)
        return fail(cudaErrorInvalidValue);
    if (!a->done || !b->done)
        return cudaErrorNotReady;
    *ms = (float)(b->t_ms - a->t_ms);
    return cudaSuccess;
}

/* ---- cuBLASLt ------------------------------------------------------------- */

struct emu_lt {
    int unused;
};

struct emu_lt_desc {
    cublasComputeType_t compute;
    cudaDataType_t scale;
    cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
    const void *bias = nullptr;
    int bias_type = -1; /* -1: D's type */
};

struct emu_lt_layout {
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld;
};

struct emu_lt_pref {
    uint64_t ws_max = 0;
    uint32_t align[4] = {256, 256, 256, 256}; /* A, B, C, D */
};

const char *cublasGetStatusString(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS:
        return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_INVALID_VALUE:
        return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_NOT_SUPPORTED:
        return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
        return "CUBLAS_STATUS_INTERNAL_ERROR";
    }
}

cublasStatus_t cublasLtCreate(cublasLtHandle_t *h)
{
    *h = new emu_lt;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t h)
{
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute,
                                        cudaDataType_t scale)
{
    *d = new emu_lt_desc;
    (*d)->compute = compute;
    (*d)->scale = scale;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d)
{
    delete d;
    return CUBLAS_STATUS_SUCCESS;
}

template <typename T> static cublasStatus_t get_attr(T *out, const void *buf, size_t bytes)
{
    if (bytes != sizeof(T))
        return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(out, buf, sizeof(T));
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr, const void *buf,
                                              size_t bytes)
{
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
        return get_attr(&d->ta, buf, bytes);
    case CUBLASLT_MATMUL_DESC_TRANSB:
        return get_attr(&d->tb, buf, bytes);
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
        return get_attr(&d->epi, buf, bytes);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
        return get_attr(&d->bias, buf, bytes);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: {
        cudaDataType_t t = CUDA_R_32F;
        const cublasStatus_t s = get_attr(&t, buf, bytes);
        if (s == CUBLAS_STATUS_SUCCESS)
            d->bias_type = (int)t;
        return s;
    }
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType_t type,
                                          uint64_t rows, uint64_t cols, int64_t ld)
{
    *l = new emu_lt_layout{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l)
{
    delete l;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p)
{
    *p = new emu_lt_pref;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p)
{
    delete p;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void *buf, size_t bytes)
{
    switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
        return get_attr(&p->ws_max, buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
        return get_attr(&p->align[0], buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
        return get_attr(&p->align[1], buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
        return get_attr(&p->align[2], buf, bytes);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
        return get_attr(&p->align[3], buf, bytes);
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}

static size_t type_size(cudaDataType_t t)
{
    return t == CUDA_R_32F ? 4 : 2;
}

/* The operation's m, n, k from the layouts, or INVALID_VALUE with why. */
static cublasStatus_t lt_shape(const emu_lt_desc *d, const emu_lt_layout *a, const emu_lt_layout *b,
                               const emu_lt_layout *c, const emu_lt_layout *dl, uint64_t *m,
                               uint64_t *n, uint64_t *k)
{
    if (d->compute != CUBLAS_COMPUTE_32F || d->scale != CUDA_R_32F) {
        complain("cublasLt: compute type %d with scale type %d (the backend asks 32F, 32F)",
                 (int)d->compute, (int)d->scale);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (a->type != CUDA_R_16BF || b->type != CUDA_R_16BF ||
        (c->type != CUDA_R_32F && c->type != CUDA_R_16BF) || dl->type != c->type) {
        complain("cublasLt: types A %d B %d C %d D %d: A and B bf16, C and D alike, f32 or bf16",
                 (int)a->type, (int)b->type, (int)c->type, (int)dl->type);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    *m = c->rows;
    *n = c->cols;
    const uint64_t am = d->ta == CUBLAS_OP_N ? a->rows : a->cols;
    *k = d->ta == CUBLAS_OP_N ? a->cols : a->rows;
    const uint64_t bk = d->tb == CUBLAS_OP_N ? b->rows : b->cols;
    const uint64_t bn = d->tb == CUBLAS_OP_N ? b->cols : b->rows;
    const emu_lt_layout *ls[4] = {a, b, c, dl};
    for (int i = 0; i < 4; i++)
        if (ls[i]->ld < (int64_t)ls[i]->rows || ls[i]->ld < 1) {
            complain("cublasLt: a layout of %llu x %llu has ld %lld (column-major: ld >= rows)",
                     (unsigned long long)ls[i]->rows, (unsigned long long)ls[i]->cols,
                     (long long)ls[i]->ld);
            return CUBLAS_STATUS_INVALID_VALUE;
        }
    if (am != *m || bn != *n || bk != *k || dl->rows != c->rows || dl->cols != c->cols) {
        complain("cublasLt: op(A) is %llu x %llu, op(B) %llu x %llu, C %llu x %llu, D %llu x %llu: "
                 "they do not make one product",
                 (unsigned long long)am, (unsigned long long)*k, (unsigned long long)bk,
                 (unsigned long long)bn, (unsigned long long)c->rows, (unsigned long long)c->cols,
                 (unsigned long long)dl->rows, (unsigned long long)dl->cols);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    const int bt = d->bias_type < 0 ? (int)dl->type : d->bias_type;
    if ((d->epi & CUBLASLT_EPILOGUE_BIAS) && bt != (int)dl->type) {
        /* The backend's reading of cublasLt.h: the bias in D's type only. */
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dl,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t *results, int *found)
{
    *found = 0;
    if (requested < 1)
        return CUBLAS_STATUS_INVALID_VALUE;
    uint64_t m, n, k;
    const cublasStatus_t s = lt_shape(d, a, b, c, dl, &m, &n, &k);
    if (s != CUBLAS_STATUS_SUCCESS)
        return s;
    memset(&results[0], 0, sizeof results[0]);
    /* The algorithm remembers the alignments it was chosen for. */
    for (int i = 0; i < 4; i++)
        results[0].algo.data[i] = pref->align[i];
    results[0].algo.data[4] = 0x454d55; /* "EMU": set by this heuristic */
    results[0].state = CUBLAS_STATUS_SUCCESS;
    results[0].wavesCount = 1.0f;
    *found = 1;
    return CUBLAS_STATUS_SUCCESS;
}

static float load_t(const void *p, cudaDataType_t t, uint64_t i)
{
    if (t == CUDA_R_32F)
        return ((const float *)p)[i];
    return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}

static bool operand_ok(const void *p, const emu_lt_layout *l, const char *which)
{
    const size_t bytes =
        (size_t)((l->cols ? l->cols - 1 : 0) * (uint64_t)l->ld + l->rows) * type_size(l->type);
    if (l->rows == 0 || l->cols == 0 || emurt::is_device(p, bytes))
        return true;
    complain("cublasLtMatmul: %s %p (%llu x %llu, ld %lld: %zu bytes) is not inside one device "
             "allocation",
             which, p, (unsigned long long)l->rows, (unsigned long long)l->cols, (long long)l->ld,
             bytes);
    return false;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t d, const void *alpha,
                              const void *A, cublasLtMatrixLayout_t a, const void *B,
                              cublasLtMatrixLayout_t b, const void *beta, const void *C,
                              cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t dl,
                              const cublasLtMatmulAlgo_t *algo, void *ws, size_t ws_bytes,
                              cudaStream_t stream)
{
    uint64_t m, n, k;
    cublasStatus_t s = lt_shape(d, a, b, c, dl, &m, &n, &k);
    if (s != CUBLAS_STATUS_SUCCESS)
        return s;
    if (!algo || algo->data[4] != 0x454d55) {
        complain("cublasLtMatmul: an algorithm the heuristic did not give");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    const void *ptrs[4] = {A, B, C, D};
    for (int i = 0; i < 4; i++)
        if ((uintptr_t)ptrs[i] % algo->data[i] != 0) {
            complain("cublasLtMatmul: operand %c at %p is not aligned to the %llu bytes its "
                     "algorithm was chosen for",
                     "ABCD"[i], ptrs[i], (unsigned long long)algo -> data[i]);
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
    const float al = *(const float *)alpha, be = *(const float *)beta;
    if (!operand_ok(A, a, "A") || !operand_ok(B, b, "B") || !operand_ok(D, dl, "D") ||
        (be != 0.0f && !operand_ok(C, c, "C")))
        return CUBLAS_STATUS_INVALID_VALUE;
    const bool has_bias = (d->epi & CUBLASLT_EPILOGUE_BIAS) != 0;
    const bool gelu = (d->epi & CUBLASLT_EPILOGUE_GELU) != 0;
    const bool relu = d->epi == CUBLASLT_EPILOGUE_RELU || d->epi == CUBLASLT_EPILOGUE_RELU_BIAS;
    const size_t bsz = type_size(dl->type);
    if (has_bias && (!d->bias || !emurt::is_device(d->bias, m * bsz))) {
        complain("cublasLtMatmul: the bias %p (%llu values) is not inside one device allocation",
                 d->bias, (unsigned long long)m);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (ws_bytes && !emurt::is_device(ws, ws_bytes)) {
        complain("cublasLtMatmul: the workspace %p (%zu bytes) is not device memory", ws, ws_bytes);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    const emu_lt_layout la = *a, lb = *b, lc = *c, ld = *dl;
    const cublasOperation_t ta = d->ta, tb = d->tb;
    const void *bias = has_bias ? d->bias : nullptr;
    emurt::submit(stream, [=]() {
        /* op(A) as m rows of k and op(B) as n rows of k, dense, so the dot
         * products read memory in order. */
        std::vector<float> pa(m * k), pb(n * k);
        for (uint64_t i = 0; i < m; i++)
            for (uint64_t p = 0; p < k; p++)
                pa[i * k + p] =
                    load_t(A, la.type,
                           ta == CUBLAS_OP_N ? i + p * (uint64_t)la.ld : p + i * (uint64_t)la.ld);
        for (uint64_t j = 0; j < n; j++)
            for (uint64_t p = 0; p < k; p++)
                pb[j * k + p] =
                    load_t(B, lb.type,
                           tb == CUBLAS_OP_N ? p + j * (uint64_t)lb.ld : j + p * (uint64_t)lb.ld);
        /* P = op(A) op(B) as n rows of m (column-major m x n), summed in
         * f32 as the tensor cores do. */
        std::vector<float> prod(m * n);
        if (k > 0)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n, (int)m, (int)k, 1.0f,
                        pb.data(), (int)k, pa.data(), (int)k, 0.0f, prod.data(), (int)m);
        std::vector<float> col(m);
        for (uint64_t j = 0; j < n; j++) {
            for (uint64_t i = 0; i < m; i++) {
                float v = al * prod[j * m + i];
                /* C is read before D is written: they may be one matrix. */
                if (be != 0.0f)
                    v += be * load_t(C, lc.type, i + j * (uint64_t)lc.ld);
                col[i] = v;
            }
            for (uint64_t i = 0; i < m; i++) {
                float v = col[i];
                if (bias)
                    v += load_t(bias, ld.type, i);
                if (gelu)
                    v = 0.5f * v *
                        (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
                if (relu)
                    v = v > 0.0f ? v : 0.0f;
                const uint64_t di = i + j * (uint64_t)ld.ld;
                if (ld.type == CUDA_R_32F)
                    ((float *)D)[di] = v;
                else
                    ((__nv_bfloat16 *)D)[di] = __float2bfloat16_rn(v);
            }
        }
    });
    return CUBLAS_STATUS_SUCCESS;
}
