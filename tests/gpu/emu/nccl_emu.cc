/* An emulated NCCL for the cuda backend built for the SIMT emulator (see
 * include/nccl.h and README.md here): a mesh's ranks are processes, each with
 * an emulated device, and what NCCL would move between their GPUs moves
 * through files in a directory they share.
 *
 * Transport. A communicator is a directory (the unique id names it; split
 * children are subdirectories). Every operation is point-to-point messages:
 * the k-th message from rank s to rank d is the file m-<s>-<d>-<k>, written
 * under a temporary name and renamed into place, so a reader sees it whole
 * or not at all; the reader waits for it, reads it and removes it. Each
 * starts with the sender's call and size: a receiver in another call (ranks
 * out of step, which real NCCL turns into a hang or mixed data) fails with
 * ncclInvalidUsage naming both. Since
 * every rank issues the same operations in the same order (as NCCL
 * requires), counting messages per pair is enough to match them. A send
 * never waits, so no order of sends and receives can deadlock: a group
 * (ncclGroupStart/End) posts all its sends before any receive.
 *
 * Collectives in those terms: an all-reduce sends a rank's buffer to every
 * other rank and sums the n buffers in rank order, in f32 for f32, bf16 and
 * f16, so that every rank holds the same bits; an all-gather sends to every
 * other rank; a broadcast sends from the root.
 *
 * Streams. An operation is queued on its stream like any other work and
 * that stream is run at once (emurt::run_now): the emulator runs a stream
 * only when the host waits for it, and a rank that never waited would keep
 * its sends from its peers. Between two ranks the effect is a GPU that runs
 * ahead of its host, which one may.
 *
 * Failure. A receive waits until the message is there, the sending process
 * has exited (ncclRemoteError), the communicator is aborted, or
 * DIT_EMU_NCCL_TIMEOUT_S (default 120 s) passes (ncclSystemError). The error
 * is the communicator's async error from then on and its later operations
 * do nothing, as a real one's would after its kernels failed. Calls return
 * ncclSuccess or the error at once, never ncclInProgress (which a
 * non-blocking communicator may, not must, return).
 *
 * The directory: DIT_EMU_NCCL_DIR, else /dev/shm, else /tmp; the last rank
 * to finalize or abort removes it (a killed rank's leaves it behind). */
#include <nccl.h>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <vector>

struct emu_nccl_comm {
    std::string dir;
    int rank = 0, n = 1;
    std::vector<pid_t> pids;                   /* of every rank */
    std::vector<unsigned long long> sent, got; /* messages per peer */
    int splits = 0;
    ncclResult_t async = ncclSuccess;
    double timeout_s = 120.0;
};

namespace
{

/* One step of an operation: post (a send) or take (a receive, with what to
 * do with the bytes received). */
struct step {
    emu_nccl_comm *c;
    int peer;
    const void *src; /* post: the bytes to send */
    size_t bytes;
    void *dst;        /* take: where they land */
    const char *what; /* the call, which both ends must have made */
};

/* Every message starts with what its sender was doing, so that ranks out of
 * step (one in an all-reduce, its peer in a broadcast of the same size) are
 * an error naming both, where real NCCL would hang or mix the data. */
struct msg_header {
    char what[24];
    uint64_t bytes;
};

struct op {
    emu_nccl_comm *c;
    cudaStream_t stream;
    std::vector<step> posts, takes;
    std::function<void()> after; /* runs once the takes have landed (a sum) */
};

struct state {
    int group_depth = 0;
    std::vector<op> pending;
    std::string last_error;
    unsigned long long ids = 0;
};

state &st()
{
    static state s;
    return s;
}

ncclResult_t set_error(ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
ncclResult_t set_error(ncclResult_t r, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    st().last_error = buf;
    fprintf(stderr, "nccl_emu: %s\n", buf);
    return r;
}

double now_s()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void backoff(unsigned iter)
{
    struct timespec ts = {0, (long)(iter < 20 ? 20000 : 1000000)}; /* 20 us, then 1 ms */
    nanosleep(&ts, nullptr);
}

std::string base_dir()
{
    const char *d = getenv("DIT_EMU_NCCL_DIR");
    if (d && d[0])
        return d;
    struct stat sb;
    return stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) ? "/dev/shm" : "/tmp";
}

double timeout_s()
{
    const char *t = getenv("DIT_EMU_NCCL_TIMEOUT_S");
    const double v = t ? atof(t) : 0.0;
    return v > 0.0 ? v : 120.0;
}

/* Whether process pid has exited (gone, or a zombie nobody reaped yet). */
bool exited(pid_t pid)
{
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return true;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    return p && p[1] == ' ' && p[2] == 'Z';
}

void remove_tree(const std::string &path)
{
    DIR *d = opendir(path.c_str());
    if (d) {
        while (struct dirent *e = readdir(d)) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                continue;
            const std::string p = path + "/" + e->d_name;
            struct stat sb;
            if (lstat(p.c_str(), &sb) == 0 && S_ISDIR(sb.st_mode))
                remove_tree(p);
            else
                unlink(p.c_str());
        }
        closedir(d);
    }
    rmdir(path.c_str());
}

bool write_all(int fd, const void *data, size_t bytes)
{
    const unsigned char *p = (const unsigned char *)data;
    size_t done = 0;
    while (done < bytes) {
        const ssize_t w = write(fd, p + done, bytes - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return false;
        done += (size_t)w;
    }
    return true;
}

bool read_all(int fd, void *data, size_t bytes)
{
    unsigned char *p = (unsigned char *)data;
    size_t done = 0;
    while (done < bytes) {
        const ssize_t r = read(fd, p + done, bytes - done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return false;
        done += (size_t)r;
    }
    return true;
}

/* head (may be NULL) then data, under a temporary name renamed into place. */
bool write_file(const std::string &path, const msg_header *head, const void *data, size_t bytes)
{
    const std::string tmp = path + ".part";
    const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return false;
    const bool ok = (!head || write_all(fd, head, sizeof *head)) && write_all(fd, data, bytes);
    close(fd);
    if (!ok) {
        unlink(tmp.c_str());
        return false;
    }
    return rename(tmp.c_str(), path.c_str()) == 0;
}

std::string msg_path(const emu_nccl_comm *c, int from, int to, unsigned long long k)
{
    char name[96];
    snprintf(name, sizeof name, "/m-%d-%d-%llu", from, to, k);
    return c->dir + name;
}

/* The communicator's error, recorded once. */
void fail(emu_nccl_comm *c, ncclResult_t r, const char *what)
{
    if (c->async == ncclSuccess)
        c->async = set_error(r, "rank %d of %d: %s", c->rank, c->n, what);
}

void post(const step &s)
{
    emu_nccl_comm *c = s.c;
    if (c->async != ncclSuccess)
        return;
    const std::string p = msg_path(c, c->rank, s.peer, c->sent[s.peer]++);
    msg_header h;
    memset(&h, 0, sizeof h);
    snprintf(h.what, sizeof h.what, "%s", s.what);
    h.bytes = s.bytes;
    if (!write_file(p, &h, s.src, s.bytes)) {
        char why[600];
        snprintf(why, sizeof why, "cannot write %s: %s", p.c_str(), strerror(errno));
        fail(c, ncclSystemError, why);
    }
}

void take(const step &s)
{
    emu_nccl_comm *c = s.c;
    if (c->async != ncclSuccess)
        return;
    const std::string p = msg_path(c, s.peer, c->rank, c->got[s.peer]++);
    const double deadline = now_s() + c->timeout_s;
    char why[700];
    for (unsigned iter = 0;; ++iter) {
        const int fd = open(p.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            msg_header h;
            memset(&h, 0, sizeof h);
            const bool head = read_all(fd, &h, sizeof h);
            h.what[sizeof h.what - 1] = '\0';
            const bool same = head && h.bytes == s.bytes && strcmp(h.what, s.what) == 0;
            const bool got = same && read_all(fd, s.dst, s.bytes);
            close(fd);
            unlink(p.c_str());
            if (!got) {
                snprintf(why, sizeof why,
                         "out of step with rank %d: this rank's %s waits for %zu bytes, rank %d "
                         "sent %llu in its %s",
                         s.peer, s.what, s.bytes, s.peer, (unsigned long long)h.bytes,
                         head ? h.what : "(unreadable message)");
                fail(c, ncclInvalidUsage, why);
            }
            return;
        }
        if (iter % 64 == 63 && exited(c->pids[s.peer])) {
            snprintf(why, sizeof why,
                     "rank %d (pid %d) exited before sending what this rank waits for", s.peer,
                     (int)c->pids[s.peer]);
            fail(c, ncclRemoteError, why);
            return;
        }
        if (now_s() > deadline) {
            snprintf(why, sizeof why, "nothing from rank %d within %.0f s (DIT_EMU_NCCL_TIMEOUT_S)",
                     s.peer, c->timeout_s);
            fail(c, ncclSystemError, why);
            return;
        }
        backoff(iter);
    }
}

void run(op &o)
{
    for (const step &s : o.posts)
        post(s);
    for (const step &s : o.takes)
        take(s);
    if (o.after && o.c->async == ncclSuccess)
        o.after();
}

/* Inside a group, keeps the op for ncclGroupEnd; else queues it on its
 * stream and runs that stream now. */
ncclResult_t enqueue(op o)
{
    if (st().group_depth > 0) {
        st().pending.push_back(std::move(o));
        return ncclSuccess;
    }
    auto shared = std::make_shared<op>(std::move(o));
    emurt::submit(shared->stream, [shared]() { run(*shared); });
    emurt::run_now(shared->stream);
    return ncclSuccess;
}

size_t type_size(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8:
    case ncclUint8:
        return 1;
    case ncclFloat16:
    case ncclBfloat16:
        return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
        return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
        return 8;
    }
    return 0;
}

float load(const void *p, size_t i, ncclDataType_t t)
{
    if (t == ncclFloat32)
        return ((const float *)p)[i];
    if (t == ncclBfloat16) {
        const uint32_t b = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &b, sizeof f);
        return f;
    }
    return (float)((const _Float16 *)p)[i];
}

void store(void *p, size_t i, ncclDataType_t t, float v)
{
    if (t == ncclFloat32) {
        ((float *)p)[i] = v;
    } else if (t == ncclBfloat16) {
        uint32_t b;
        memcpy(&b, &v, sizeof b);
        if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu)) /* NaN stays NaN */
            b |= 0x00400000u;
        else
            b += 0x7fffu + ((b >> 16) & 1u); /* round to nearest even */
        ((uint16_t *)p)[i] = (uint16_t)(b >> 16);
    } else {
        ((_Float16 *)p)[i] = (_Float16)v;
    }
}

/* Checks shared by the operations: a live communicator, a rank in it, and
 * [p, p + bytes) inside one device allocation. */
ncclResult_t check_comm(const emu_nccl_comm *c, const char *fn)
{
    if (!c)
        return set_error(ncclInvalidArgument, "%s: NULL communicator", fn);
    return c->async;
}

ncclResult_t check_buf(const void *p, size_t bytes, const char *fn, const char *which)
{
    if (bytes == 0)
        return ncclSuccess;
    if (!p || !emurt::is_device(p, bytes))
        return set_error(ncclInvalidArgument,
                         "%s: %s %p (%zu bytes) is not inside one device allocation", fn, which, p,
                         bytes);
    return ncclSuccess;
}

ncclResult_t check_peer(const emu_nccl_comm *c, int peer, const char *fn)
{
    if (peer < 0 || peer >= c->n)
        return set_error(ncclInvalidArgument, "%s: peer %d is not in a group of %d", fn, peer,
                         c->n);
    return ncclSuccess;
}

#define NCCL_TRY(call)                                                                             \
    do {                                                                                           \
        const ncclResult_t r_ = (call);                                                            \
        if (r_ != ncclSuccess)                                                                     \
            return r_;                                                                             \
    } while (0)

/* Makes the communicator `dir` of n ranks with the given pids. */
emu_nccl_comm *make_comm(const std::string &dir, int rank, int n, std::vector<pid_t> pids)
{
    emu_nccl_comm *c = new emu_nccl_comm;
    c->dir = dir;
    c->rank = rank;
    c->n = n;
    c->pids = std::move(pids);
    c->sent.assign((size_t)n, 0);
    c->got.assign((size_t)n, 0);
    c->timeout_s = timeout_s();
    return c;
}

/* A rank that finalizes or aborts leaves left-<rank> in the directory,
 * without waiting for anybody; whoever then finds every rank gone (left, or
 * exited) removes the directory. */
void leave(emu_nccl_comm *c)
{
    char name[64];
    snprintf(name, sizeof name, "/left-%d", c->rank);
    const unsigned char one = 1;
    (void)write_file(c->dir + name, nullptr, &one, 1);
    for (int r = 0; r < c->n; ++r) {
        snprintf(name, sizeof name, "/left-%d", r);
        struct stat sb;
        if (stat((c->dir + name).c_str(), &sb) != 0 && !exited(c->pids[(size_t)r]))
            return;
    }
    remove_tree(c->dir);
}

} /* namespace */

extern "C" {

ncclResult_t ncclGetVersion(int *version)
{
    if (!version)
        return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess:
        return "no error";
    case ncclUnhandledCudaError:
        return "unhandled cuda error";
    case ncclSystemError:
        return "unhandled system error";
    case ncclInternalError:
        return "internal error";
    case ncclInvalidArgument:
        return "invalid argument";
    case ncclInvalidUsage:
        return "invalid usage";
    case ncclRemoteError:
        return "remote process exited or there was a network error";
    case ncclInProgress:
        return "NCCL operation in progress";
    }
    return "unknown result code";
}

const char *ncclGetLastError(ncclComm_t)
{
    return st().last_error.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id)
{
    if (!id)
        return set_error(ncclInvalidArgument, "ncclGetUniqueId: NULL id");
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    memset(id, 0, sizeof *id);
    const int n = snprintf(id->internal, sizeof id->internal, "%s/ditemu-nccl-%d-%lld-%llu",
                           base_dir().c_str(), (int)getpid(),
                           (long long)ts.tv_sec * 1000000000ll + ts.tv_nsec, ++st().ids);
    if (n <= 0 || (size_t)n >= sizeof id->internal)
        return set_error(ncclSystemError, "ncclGetUniqueId: the directory name is too long");
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *)
{
    if (!comm)
        return set_error(ncclInvalidArgument, "ncclCommInitRankConfig: NULL comm");
    *comm = nullptr;
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return set_error(ncclInvalidArgument, "ncclCommInitRankConfig: rank %d of %d", rank,
                         nranks);
    if (!memchr(id.internal, '\0', sizeof id.internal) || id.internal[0] != '/')
        return set_error(ncclInvalidArgument, "ncclCommInitRankConfig: not an emulated id");
    const std::string dir = id.internal;
    if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
        return set_error(ncclSystemError, "ncclCommInitRankConfig: mkdir %s: %s", dir.c_str(),
                         strerror(errno));
    /* Rendezvous: each rank leaves its pid and device in rank-<r> and waits
     * for all. */
    char name[64];
    snprintf(name, sizeof name, "/rank-%d", rank);
    int dev = 0;
    (void)cudaGetDevice(&dev); /* a communicator belongs to the current device */
    const int me[2] = {(int)getpid(), dev};
    if (!write_file(dir + name, nullptr, me, sizeof me))
        return set_error(ncclSystemError, "ncclCommInitRankConfig: cannot write in %s: %s",
                         dir.c_str(), strerror(errno));
    std::vector<pid_t> pids((size_t)nranks, 0);
    std::vector<int> devs((size_t)nranks, -1);
    const double deadline = now_s() + timeout_s();
    for (int r = 0; r < nranks; ++r) {
        snprintf(name, sizeof name, "/rank-%d", r);
        for (unsigned iter = 0;; ++iter) {
            const int fd = open((dir + name).c_str(), O_RDONLY | O_CLOEXEC);
            if (fd >= 0) {
                int info[2];
                const bool got = read_all(fd, info, sizeof info);
                close(fd);
                if (got) {
                    pids[(size_t)r] = (pid_t)info[0];
                    devs[(size_t)r] = info[1];
                    break;
                }
            }
            if (now_s() > deadline)
                return set_error(ncclSystemError,
                                 "ncclCommInitRankConfig: rank %d of %d never arrived in %s", r,
                                 nranks, dir.c_str());
            backoff(iter);
        }
    }
    /* As NCCL (2.5 and later): two ranks of one communicator on one GPU is
     * invalid usage, found by every rank. */
    for (int r = 0; r < nranks; ++r)
        if (r != rank && devs[(size_t)r] == dev)
            return set_error(ncclInvalidUsage,
                             "ncclCommInitRankConfig: duplicate GPU: rank %d and rank %d both on "
                             "device %d",
                             rank, r, dev);
    *comm = make_comm(dir, rank, nranks, std::move(pids));
    /* Every rank has read every pid before rank 0's first message to it is
     * read; the rank files go with the directory. */
    return ncclSuccess;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *)
{
    NCCL_TRY(check_comm(comm, "ncclCommSplit"));
    if (!newcomm)
        return set_error(ncclInvalidArgument, "ncclCommSplit: NULL newcomm");
    *newcomm = nullptr;
    if (st().group_depth > 0)
        return set_error(ncclInvalidUsage, "ncclCommSplit inside a group");
    emu_nccl_comm *c = comm;
    /* Everybody's (color, key), over the parent, in stream-less order. */
    const int mine[2] = {color, key};
    std::vector<int> all((size_t)c->n * 2);
    for (int r = 0; r < c->n; ++r)
        if (r != c->rank)
            post(step{c, r, mine, sizeof mine, nullptr, "ncclCommSplit"});
    for (int r = 0; r < c->n; ++r) {
        if (r == c->rank)
            memcpy(&all[(size_t)r * 2], mine, sizeof mine);
        else
            take(step{c, r, nullptr, sizeof mine, &all[(size_t)r * 2], "ncclCommSplit"});
    }
    const int k = c->splits++;
    if (c->async != ncclSuccess)
        return c->async;
    if (color < 0)
        return ncclSuccess;
    std::vector<int> members;
    for (int r = 0; r < c->n; ++r)
        if (all[(size_t)r * 2] == color)
            members.push_back(r);
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return all[(size_t)a * 2 + 1] < all[(size_t)b * 2 + 1]; });
    char sub[64];
    snprintf(sub, sizeof sub, "/split-%d-color-%d", k, color);
    const std::string dir = c->dir + sub;
    if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
        return set_error(ncclSystemError, "ncclCommSplit: mkdir %s: %s", dir.c_str(),
                         strerror(errno));
    std::vector<pid_t> pids;
    int rank = -1;
    for (size_t i = 0; i < members.size(); ++i) {
        pids.push_back(c->pids[(size_t)members[i]]);
        if (members[i] == c->rank)
            rank = (int)i;
    }
    *newcomm = make_comm(dir, rank, (int)members.size(), std::move(pids));
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm)
{
    NCCL_TRY(check_comm(comm, "ncclCommFinalize"));
    leave(comm);
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    if (comm)
        leave(comm);
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async_error)
{
    if (!comm || !async_error)
        return set_error(ncclInvalidArgument, "ncclCommGetAsyncError: NULL argument");
    *async_error = comm->async;
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count)
{
    if (!comm || !count)
        return set_error(ncclInvalidArgument, "ncclCommCount: NULL argument");
    *count = comm->n;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank)
{
    if (!comm || !rank)
        return set_error(ncclInvalidArgument, "ncclCommUserRank: NULL argument");
    *rank = comm->rank;
    return ncclSuccess;
}

ncclResult_t ncclGroupStart(void)
{
    st().group_depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void)
{
    if (st().group_depth == 0)
        return set_error(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--st().group_depth > 0)
        return ncclSuccess;
    std::vector<op> ops;
    ops.swap(st().pending);
    /* One op whose posts are every op's posts, then every op's takes: no
     * receive of the group waits before all of its sends are out. */
    if (ops.empty())
        return ncclSuccess;
    op all;
    all.c = ops[0].c;
    all.stream = ops[0].stream;
    std::vector<std::function<void()>> afters;
    for (op &o : ops) {
        if (o.stream != all.stream)
            return set_error(ncclInvalidUsage, "a group across several streams (not emulated)");
        all.posts.insert(all.posts.end(), o.posts.begin(), o.posts.end());
        all.takes.insert(all.takes.end(), o.takes.begin(), o.takes.end());
        if (o.after)
            afters.push_back(std::move(o.after));
    }
    all.after = [afters]() {
        for (const auto &f : afters)
            f();
    };
    return enqueue(std::move(all));
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t redop, ncclComm_t comm,
                           cudaStream_t stream)
{
    NCCL_TRY(check_comm(comm, "ncclAllReduce"));
    if (redop != ncclSum ||
        (datatype != ncclFloat32 && datatype != ncclBfloat16 && datatype != ncclFloat16))
        return set_error(ncclInvalidArgument,
                         "ncclAllReduce: only sums of f32, bf16 and f16 are emulated");
    const size_t bytes = count * type_size(datatype);
    NCCL_TRY(check_buf(sendbuff, bytes, "ncclAllReduce", "sendbuff"));
    NCCL_TRY(check_buf(recvbuff, bytes, "ncclAllReduce", "recvbuff"));
    emu_nccl_comm *c = comm;
    op o;
    o.c = c;
    o.stream = stream;
    /* The scratch buffers live in the op, whose closure owns it. */
    auto bufs = std::make_shared<std::vector<std::vector<unsigned char>>>((size_t)c->n);
    for (int r = 0; r < c->n; ++r) {
        (*bufs)[(size_t)r].resize(bytes);
        if (r != c->rank) {
            o.posts.push_back(step{c, r, sendbuff, bytes, nullptr, "ncclAllReduce"});
            o.takes.push_back(
                step{c, r, nullptr, bytes, (*bufs)[(size_t)r].data(), "ncclAllReduce"});
        }
    }
    const int me = c->rank, n = c->n;
    o.after = [bufs, sendbuff, recvbuff, count, datatype, me, n]() {
        for (size_t i = 0; i < count; ++i) {
            float acc = 0.0f;
            for (int r = 0; r < n; ++r)
                acc += r == me ? load(sendbuff, i, datatype)
                               : load((*bufs)[(size_t)r].data(), i, datatype);
            store(recvbuff, i, datatype, acc);
        }
    };
    return enqueue(std::move(o));
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
    NCCL_TRY(check_comm(comm, "ncclAllGather"));
    const size_t bytes = sendcount * type_size(datatype);
    emu_nccl_comm *c = comm;
    NCCL_TRY(check_buf(sendbuff, bytes, "ncclAllGather", "sendbuff"));
    NCCL_TRY(check_buf(recvbuff, bytes * (size_t)c->n, "ncclAllGather", "recvbuff"));
    op o;
    o.c = c;
    o.stream = stream;
    unsigned char *out = (unsigned char *)recvbuff;
    for (int r = 0; r < c->n; ++r)
        if (r != c->rank) {
            o.posts.push_back(step{c, r, sendbuff, bytes, nullptr, "ncclAllGather"});
            o.takes.push_back(step{c, r, nullptr, bytes, out + (size_t)r * bytes, "ncclAllGather"});
        }
    unsigned char *own = out + (size_t)c->rank * bytes;
    o.after = [own, sendbuff, bytes]() {
        if (own != sendbuff)
            memmove(own, sendbuff, bytes);
    };
    return enqueue(std::move(o));
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream)
{
    NCCL_TRY(check_comm(comm, "ncclBroadcast"));
    NCCL_TRY(check_peer(comm, root, "ncclBroadcast"));
    const size_t bytes = count * type_size(datatype);
    emu_nccl_comm *c = comm;
    if (c->rank == root)
        NCCL_TRY(check_buf(sendbuff, bytes, "ncclBroadcast", "sendbuff"));
    NCCL_TRY(check_buf(recvbuff, bytes, "ncclBroadcast", "recvbuff"));
    op o;
    o.c = c;
    o.stream = stream;
    if (c->rank == root) {
        for (int r = 0; r < c->n; ++r)
            if (r != root)
                o.posts.push_back(step{c, r, sendbuff, bytes, nullptr, "ncclBroadcast"});
        o.after = [sendbuff, recvbuff, bytes]() {
            if (recvbuff != sendbuff)
                memmove(recvbuff, sendbuff, bytes);
        };
    } else {
        o.takes.push_back(step{c, root, nullptr, bytes, recvbuff, "ncclBroadcast"});
    }
    return enqueue(std::move(o));
}

/* A send (recv NULL) or a receive (send NULL) of one buffer. */
static ncclResult_t p2p(const void *send, void *recv, size_t count, ncclDataType_t datatype,
                        int peer, ncclComm_t comm, cudaStream_t stream, const char *fn)
{
    NCCL_TRY(check_comm(comm, fn));
    NCCL_TRY(check_peer(comm, peer, fn));
    const size_t bytes = count * type_size(datatype);
    NCCL_TRY(check_buf(send ? send : recv, bytes, fn, send ? "sendbuff" : "recvbuff"));
    op o;
    o.c = comm;
    o.stream = stream;
    /* A send matches a receive: both are point to point. */
    (send ? o.posts : o.takes).push_back(step{comm, peer, send, bytes, recv, "ncclSend/Recv"});
    return enqueue(std::move(o));
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream)
{
    return p2p(sendbuff, nullptr, count, datatype, peer, comm, stream, "ncclSend");
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream)
{
    return p2p(nullptr, recvbuff, count, datatype, peer, comm, stream, "ncclRecv");
}

} /* extern "C" */
