/* A host emulator of the CUDA vocabulary the tensor-core attention kernels
 * (worker/backend/cuda/flash_attention.cuh) are written in, so those same
 * kernel sources run on a CPU: one coroutine per CUDA thread, a
 * block at a time, switching only at __syncthreads and at warp-wide
 * instructions (shfl, ldmatrix, mma), which complete when all 32 lanes of
 * the warp have arrived, as on the hardware.
 *
 * What it models, and how:
 *  - __shfl_xor_sync, __shfl_sync: full-warp exchanges.
 *  - mma_bf16_16816, ldsm_x4, ldsm_x4_trans: the fragment layouts stated in
 *    backend/cuda/cuda_mma.cuh (from the PTX ISA). The MMA's products of
 *    bf16 values are exact in f32 and summed in k order, so results agree
 *    with the hardware's to f32 rounding, not bit for bit; two kernels run
 *    here are compared with each other bit for bit.
 *  - cp.async: a copy may land anywhere between its issue and the
 *    thread's cp.async.wait_group; the emulator lands it at one end or the
 *    other (emu_copies), so a kernel that reads a tile before waiting for
 *    it, or overwrites one another warp still reads, gives other numbers in
 *    one of the two modes. wait_group 0 lands only committed groups (a copy
 *    issued after the last commit_group stays in flight). Zero fill when
 *    the source size is 0; a source that is not 16-byte aligned aborts.
 *  - Scheduling (emu_schedule): all threads in turn, shuffled from a seed
 *    every round, or one warp as far as it gets before the next: a missing
 *    barrier or wait shows as different numbers in one of them.
 *  - Checks (abort with a message): ldmatrix rows inside the block's
 *    shared memory and 16-byte aligned, cp.async destinations likewise,
 *    warp instructions reached by all lanes in the same order, copies still
 *    pending when a thread exits, a barrier some threads never reach.
 * Global memory is plain host memory: run under AddressSanitizer to catch
 * reads and writes outside the tensors.
 *
 * Host-only test code: include it before the kernel headers, instead of
 * cuda_mma.cuh and cuda_bf16.h. One emulation at a time per process. */
#ifndef DIT_TESTS_GPU_SIMT_EMU_H
#define DIT_TESTS_GPU_SIMT_EMU_H

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#endif

/* ---- CUDA spellings on the host ------------------------------------------ */

#define __global__
#define __device__
#define __host__
/* A block's static shared arrays: one per kernel instantiation, which every
 * thread of the block being run sees (blocks run one at a time). */
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3() = default;
    dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c)
    {
    }
};
struct uint2 {
    uint32_t x, y;
};
struct float2 {
    float x, y;
};
struct float4 {
    float x, y, z, w;
};
static inline uint2 make_uint2(uint32_t a, uint32_t b)
{
    return uint2{a, b};
}
static inline float2 make_float2(float a, float b)
{
    return float2{a, b};
}

struct __nv_bfloat16 {
    uint16_t bits;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y; /* x in the low half, as in memory */
};

/* Round to nearest even, NaN kept quiet: what __float2bfloat16_rn does. */
static inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40u)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
static inline float __bfloat162float(__nv_bfloat16 h)
{
    const uint32_t u = (uint32_t)h.bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi)
{
    return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}

/* ---- The scheduler -------------------------------------------------------- */

namespace emu
{

/* A coroutine's saved context. On x86-64 a switch saves the callee-saved
 * registers on the stack it leaves and loads them from the one it enters:
 * no system call, where ucontext's swapcontext makes one (sigprocmask) per
 * switch and took most of the emulator's time. Elsewhere, ucontext. */
#if defined(__x86_64__)
struct context {
    void *sp = nullptr;
};

/* Saves into from->sp, resumes at to->sp (System V x86-64: rbx, rbp,
 * r12-r15 are the callee's to keep; the return address is on the stack). */
__attribute__((naked, noinline)) static void context_swap(context *, const context *)
{
    __asm__ volatile("pushq %rbp\n\t"
                     "pushq %rbx\n\t"
                     "pushq %r12\n\t"
                     "pushq %r13\n\t"
                     "pushq %r14\n\t"
                     "pushq %r15\n\t"
                     "movq %rsp, (%rdi)\n\t"
                     "movq (%rsi), %rsp\n\t"
                     "popq %r15\n\t"
                     "popq %r14\n\t"
                     "popq %r13\n\t"
                     "popq %r12\n\t"
                     "popq %rbx\n\t"
                     "popq %rbp\n\t"
                     "ret\n\t");
}

/* A context that starts entry() on the stack [stack, stack + bytes): six
 * zero registers, then entry's address for context_swap's ret, then a zero
 * return address for entry (which never returns), the stack pointer 16-byte
 * aligned at the call as the ABI wants. */
static inline void context_init(context *c, void *stack, size_t bytes, void (*entry)())
{
    uintptr_t top = ((uintptr_t)stack + bytes) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = nullptr;
    *--sp = (void *)entry;
    for (int i = 0; i < 6; i++)
        *--sp = nullptr;
    c->sp = sp;
}
#else
struct context {
    ucontext_t uc;
};

static inline void context_swap(context *from, const context *to)
{
    swapcontext(&from->uc, &to->uc);
}

/* Apart from launch, because getcontext returns twice as far as the
 * compiler knows. */
__attribute__((noinline)) static void context_init(context *c, void *stack, size_t bytes,
                                                   void (*entry)())
{
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = bytes;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
}
#endif

enum copies { COPY_AT_ISSUE, COPY_AT_WAIT };

/* Which thread runs next: every unfinished thread once per round, in an
 * order shuffled each round (the warps advance together), or one warp (in
 * a shuffled order of warps) for as long as it can, the next only when it
 * waits at __syncthreads (the warps drift as far apart as barriers allow). */
enum schedule { SCHED_ROUND_ROBIN, SCHED_WARP_GREEDY };

[[noreturn]] static inline void die(const char *what)
{
    fprintf(stderr, "simt_emu: %s\n", what);
    abort();
}

struct pending_copy {
    void *dst;
    const void *src;
    bool valid;
    bool committed; /* in a group cp.async.commit_group closed */
};

struct thread_ctx {
    context uc;
    dim3 tid;
    unsigned flat = 0;
    bool done = false;
    bool at_barrier = false; /* waiting in __syncthreads for generation bar_wait */
    unsigned bar_wait = 0;
    std::vector<pending_copy> pending;
};

/* A warp instruction's exchange: each lane's operands, then its results. */
struct warp_slot {
    unsigned arrived = 0, gen = 0;
    int op = 0;
    uint32_t in[32][12];
    uint32_t out[32][4];
};

enum op_kind { OP_SHFL = 1, OP_SHFL_IDX, OP_LDSM, OP_LDSM_T, OP_MMA, OP_SYNCWARP };

struct block_state {
    dim3 grid, block, bidx;
    unsigned n = 0;
    std::vector<thread_ctx> th;
    std::vector<std::vector<unsigned char>> stacks;
    std::vector<unsigned char> smem;
    context main_uc;
    unsigned cur = 0;
    unsigned bar_count = 0, bar_gen = 0;
    std::vector<warp_slot> warps;
    copies mode = COPY_AT_ISSUE;
    schedule sched = SCHED_ROUND_ROBIN;
    std::function<void()> body;
    uint64_t events = 0;              /* arrivals and exits: a round without any is a deadlock */
    const void *main_stack = nullptr; /* the scheduler's stack (AddressSanitizer) */
    size_t main_stack_size = 0;
};

/* The block being run (set by launch, read by the kernel-side calls). */
static inline block_state *&running()
{
    static block_state *b = nullptr;
    return b;
}

static inline thread_ctx &self()
{
    block_state *b = running();
    return b->th[b->cur];
}

/* Back to the scheduler until resumed. */
static inline void yield()
{
    block_state *b = running();
    thread_ctx &t = b->th[b->cur];
#ifdef EMU_ASAN
    void *fs = nullptr;
    __sanitizer_start_switch_fiber(&fs, b->main_stack, b->main_stack_size);
#endif
    context_swap(&t.uc, &b->main_uc);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fs, nullptr, nullptr);
#endif
}

static inline void syncthreads()
{
    block_state *b = running();
    const unsigned gen = b->bar_gen;
    b->events++;
    if (++b->bar_count == b->n) {
        b->bar_count = 0;
        b->bar_gen++;
        return;
    }
    thread_ctx &t = b->th[b->cur];
    t.at_barrier = true;
    t.bar_wait = gen;
    while (b->bar_gen == gen)
        yield();
    b->th[b->cur].at_barrier = false;
}

static inline void do_copy(const pending_copy &c)
{
    if (c.valid)
        memcpy(c.dst, c.src, 16);
    else
        memset(c.dst, 0, 16);
}

static inline void check_smem(const void *p, size_t bytes, const char *what)
{
    block_state *b = running();
    const unsigned char *q = (const unsigned char *)p, *s0 = b->smem.data();
    if (q < s0 || q + bytes > s0 + b->smem.size() || ((uintptr_t)(q - s0) % 16) != 0)
        die(what);
}

/* One warp instruction: lane operands in `in`, then compute(slot) once all
 * 32 lanes are there, then this lane's results. */
template <typename F>
static inline void warp_op(int op, const uint32_t *in, int nin, uint32_t *out, int nout, F compute)
{
    block_state *b = running();
    const unsigned lane = b->cur % 32, w = b->cur / 32;
    warp_slot &s = b->warps[w];
    if (s.arrived == 0)
        s.op = op;
    else if (s.op != op)
        die("lanes of a warp reached different warp instructions");
    memcpy(s.in[lane], in, sizeof(uint32_t) * (size_t)nin);
    const unsigned gen = s.gen;
    b->events++;
    if (++s.arrived == 32) {
        compute(s);
        s.arrived = 0;
        s.gen++;
    } else {
        while (s.gen == gen)
            yield();
    }
    memcpy(out, s.out[lane], sizeof(uint32_t) * (size_t)nout);
}

static void thread_entry()
{
    block_state *b = running();
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &b->main_stack, &b->main_stack_size);
#endif
    b->body();
    thread_ctx &t = b->th[b->cur];
    if (!t.pending.empty())
        die("a thread exited with cp.async copies it never waited for (or never committed)");
    t.done = true;
    b->events++;
#ifdef EMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, b->main_stack, b->main_stack_size);
#endif
    context_swap(&t.uc, &b->main_uc);
    die("a finished thread was resumed");
}

/* Runs body (the kernel call) for every thread of every block of `grid`,
 * a block at a time, with smem_bytes of dynamic shared memory (filled with
 * a NaN pattern, so unwritten tiles show). */
static inline void resume(block_state &b, unsigned i)
{
    b.cur = i;
#ifdef EMU_ASAN
    void *fs = nullptr;
    __sanitizer_start_switch_fiber(&fs, b.stacks[i].data(), b.stacks[i].size());
#endif
    context_swap(&b.main_uc, &b.th[i].uc);
#ifdef EMU_ASAN
    __sanitizer_finish_switch_fiber(fs, nullptr, nullptr);
#endif
}

static inline bool runnable(const block_state &b, unsigned i)
{
    const thread_ctx &t = b.th[i];
    return !t.done && !(t.at_barrier && t.bar_wait == b.bar_gen);
}

/* Thread stacks kept from launch to launch (a launch of many small kernels
 * would otherwise spend its time allocating them): one pool for the whole
 * program, an inline function's static being one object however many
 * translation units include this header. */
inline std::vector<std::vector<unsigned char>> &stacks_kept()
{
    static std::vector<std::vector<unsigned char>> pool;
    return pool;
}

static inline void launch(dim3 grid, dim3 block, size_t smem_bytes, copies mode, schedule sched,
                          uint64_t seed, std::function<void()> body)
{
    const size_t stack_bytes = 256 * 1024;
    std::vector<std::vector<unsigned char>> &stack_pool = stacks_kept();
    block_state b;
    b.grid = grid;
    b.block = block;
    b.n = block.x * block.y * block.z;
    if (b.n % 32 != 0)
        die("block size must be a multiple of 32");
    b.mode = mode;
    b.sched = sched;
    b.body = std::move(body);
    b.th.resize(b.n);
    while (stack_pool.size() < b.n)
        stack_pool.emplace_back(stack_bytes);
    b.stacks.swap(stack_pool);
    b.warps.resize(b.n / 32);
    std::mt19937_64 rng(seed);
    std::vector<unsigned> order(b.n), worder(b.n / 32), lanes(32);
    for (unsigned w = 0; w < b.n / 32; w++)
        worder[w] = w;
    for (unsigned l = 0; l < 32; l++)
        lanes[l] = l;
    running() = &b;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                b.bidx = dim3(bx, by, bz);
                b.smem.assign(smem_bytes, 0xff);
                b.bar_count = 0;
                for (unsigned i = 0; i < b.n; i++) {
                    thread_ctx &t = b.th[i];
                    t.flat = i;
                    t.tid = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
                    t.done = false;
                    t.at_barrier = false;
                    t.pending.clear();
                    context_init(&t.uc, b.stacks[i].data(), stack_bytes, thread_entry);
                    order[i] = i;
                }
                std::shuffle(worder.begin(), worder.end(), rng);
                unsigned left = b.n;
                while (left > 0) {
                    const uint64_t events = b.events;
                    if (sched == SCHED_ROUND_ROBIN) {
                        std::shuffle(order.begin(), order.end(), rng);
                    } else {
                        /* The first warp in worder with a thread that can run. */
                        unsigned w = 0, k = 0;
                        for (; k < worder.size(); k++) {
                            w = worder[k];
                            bool any = false;
                            for (unsigned l = 0; l < 32 && !any; l++)
                                any = runnable(b, 32 * w + l);
                            if (any)
                                break;
                        }
                        if (k == worder.size())
                            die("deadlock: no thread can run");
                        std::shuffle(lanes.begin(), lanes.end(), rng);
                        for (unsigned l = 0; l < 32; l++)
                            order[l] = 32 * w + lanes[l];
                    }
                    const unsigned n_run = sched == SCHED_ROUND_ROBIN ? b.n : 32;
                    for (unsigned j = 0; j < n_run; j++) {
                        const unsigned i = order[j];
                        if (b.th[i].done)
                            continue;
                        resume(b, i);
                        if (b.th[i].done)
                            left--;
                    }
                    if (left > 0 && b.events == events)
                        die("deadlock: every thread waits at a barrier or a warp "
                            "instruction that cannot complete");
                }
                if (b.bar_count != 0)
                    die("a __syncthreads that not every thread reached");
            }
    running() = nullptr;
    b.stacks.swap(stack_pool);
}

static inline dim3 thread_idx()
{
    return self().tid;
}
static inline dim3 block_idx()
{
    return running()->bidx;
}
static inline dim3 block_dim()
{
    return running()->block;
}
static inline dim3 grid_dim()
{
    return running()->grid;
}
static inline unsigned char *dyn_smem()
{
    return running()->smem.data();
}

} /* namespace emu */

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::block_idx())
#define blockDim (emu::block_dim())
#define gridDim (emu::grid_dim())
#define __syncthreads() emu::syncthreads()
#define DIT_DYN_SMEM(name) unsigned char *name = emu::dyn_smem()

/* ---- Warp instructions ---------------------------------------------------- */

static inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask)
{
    if (mask != 0xffffffffu)
        emu::die("__shfl_xor_sync with a partial mask");
    uint32_t in[2], out[1];
    memcpy(&in[0], &v, 4);
    in[1] = (uint32_t)lane_mask;
    emu::warp_op(emu::OP_SHFL, in, 2, out, 1, [](emu::warp_slot &s) {
        for (int l = 0; l < 32; l++) {
            if (s.in[l][1] != s.in[0][1])
                emu::die("__shfl_xor_sync lanes disagree on the lane mask");
            s.out[l][0] = s.in[l ^ (int)s.in[l][1]][0];
        }
    });
    float r;
    memcpy(&r, &out[0], 4);
    return r;
}

static inline float __shfl_sync(unsigned mask, float v, int src_lane)
{
    if (mask != 0xffffffffu)
        emu::die("__shfl_sync with a partial mask");
    uint32_t in[2], out[1];
    memcpy(&in[0], &v, 4);
    in[1] = (uint32_t)src_lane;
    emu::warp_op(emu::OP_SHFL_IDX, in, 2, out, 1, [](emu::warp_slot &s) {
        for (int l = 0; l < 32; l++)
            s.out[l][0] = s.in[s.in[l][1] & 31][0];
    });
    float r;
    memcpy(&r, &out[0], 4);
    return r;
}

/* The same exchanges for 64-bit and integer values: word by word. */
static inline double __shfl_xor_sync(unsigned mask, double v, int lane_mask)
{
    uint32_t w[2];
    memcpy(w, &v, 8);
    for (int i = 0; i < 2; i++) {
        float f;
        memcpy(&f, &w[i], 4);
        f = __shfl_xor_sync(mask, f, lane_mask);
        memcpy(&w[i], &f, 4);
    }
    double r;
    memcpy(&r, w, 8);
    return r;
}

static inline int __shfl_xor_sync(unsigned mask, int v, int lane_mask)
{
    float f;
    memcpy(&f, &v, 4);
    f = __shfl_xor_sync(mask, f, lane_mask);
    int r;
    memcpy(&r, &f, 4);
    return r;
}

static inline int __shfl_sync(unsigned mask, int v, int src_lane)
{
    float f;
    memcpy(&f, &v, 4);
    f = __shfl_sync(mask, f, src_lane);
    int r;
    memcpy(&r, &f, 4);
    return r;
}

/* __syncwarp(): all 32 lanes meet, as the full-mask form requires. */
static inline void __syncwarp(unsigned mask = 0xffffffffu)
{
    if (mask != 0xffffffffu)
        emu::die("__syncwarp with a partial mask");
    uint32_t in[1] = {0}, out[1];
    emu::warp_op(emu::OP_SYNCWARP, in, 1, out, 1, [](emu::warp_slot &) {});
}

/* Atomics: the emulated threads of a block take turns on one host thread
 * and blocks run one after the other, so a plain update is atomic. */
static inline float atomicAdd(float *p, float v)
{
    const float old = *p;
    *p = old + v;
    return old;
}

static inline double atomicAdd(double *p, double v)
{
    const double old = *p;
    *p = old + v;
    return old;
}

static inline void emu_ldsm(int op, uint32_t r[4], const __nv_bfloat16 *p)
{
    emu::check_smem(p, 16, "ldmatrix row outside shared memory or not 16-byte aligned");
    uint32_t in[2];
    const uintptr_t a = (uintptr_t)p;
    in[0] = (uint32_t)a;
    in[1] = (uint32_t)(a >> 32);
    const bool trans = op == emu::OP_LDSM_T;
    emu::warp_op(op, in, 2, r, 4, [trans](emu::warp_slot &s) {
        for (int l = 0; l < 32; l++)
            for (int i = 0; i < 4; i++) {
                uint16_t e[2];
                for (int h = 0; h < 2; h++) {
                    /* Tile i's element (row, col); rows come from lanes 8i..8i+7. */
                    const int row = trans ? 2 * (l % 4) + h : l / 4;
                    const int col = trans ? l / 4 : 2 * (l % 4) + h;
                    const int src = 8 * i + row;
                    const uintptr_t base =
                        (uintptr_t)s.in[src][0] | ((uintptr_t)s.in[src][1] << 32);
                    memcpy(&e[h], (const unsigned char *)base + 2 * col, 2);
                }
                s.out[l][i] = (uint32_t)e[0] | ((uint32_t)e[1] << 16);
            }
    });
}

static inline void ldsm_x4(uint32_t r[4], const __nv_bfloat16 *p)
{
    emu_ldsm(emu::OP_LDSM, r, p);
}

static inline void ldsm_x4_trans(uint32_t r[4], const __nv_bfloat16 *p)
{
    emu_ldsm(emu::OP_LDSM_T, r, p);
}

static inline float emu_bf16_lo(uint32_t r)
{
    return __bfloat162float(__nv_bfloat16{(uint16_t)(r & 0xffffu)});
}
static inline float emu_bf16_hi(uint32_t r)
{
    return __bfloat162float(__nv_bfloat16{(uint16_t)(r >> 16)});
}

/* m16n8k16, A row-major, B column-major, f32 accumulators (cuda_mma.cuh
 * has the fragment layout). */
static inline void mma_bf16_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    uint32_t in[10], out[4];
    memcpy(in, a, 16);
    in[4] = b0;
    in[5] = b1;
    memcpy(in + 6, c, 16);
    emu::warp_op(emu::OP_MMA, in, 10, out, 4, [](emu::warp_slot &s) {
        float A[16][16], B[16][8], C[16][8];
        for (int l = 0; l < 32; l++) {
            const int g = l / 4, t = l % 4;
            const uint32_t *r = s.in[l];
            A[g][2 * t] = emu_bf16_lo(r[0]);
            A[g][2 * t + 1] = emu_bf16_hi(r[0]);
            A[g + 8][2 * t] = emu_bf16_lo(r[1]);
            A[g + 8][2 * t + 1] = emu_bf16_hi(r[1]);
            A[g][2 * t + 8] = emu_bf16_lo(r[2]);
            A[g][2 * t + 9] = emu_bf16_hi(r[2]);
            A[g + 8][2 * t + 8] = emu_bf16_lo(r[3]);
            A[g + 8][2 * t + 9] = emu_bf16_hi(r[3]);
            B[2 * t][g] = emu_bf16_lo(r[4]);
            B[2 * t + 1][g] = emu_bf16_hi(r[4]);
            B[2 * t + 8][g] = emu_bf16_lo(r[5]);
            B[2 * t + 9][g] = emu_bf16_hi(r[5]);
            float cv[4];
            memcpy(cv, r + 6, 16);
            C[g][2 * t] = cv[0];
            C[g][2 * t + 1] = cv[1];
            C[g + 8][2 * t] = cv[2];
            C[g + 8][2 * t + 1] = cv[3];
        }
        float Dm[16][8];
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < 8; j++) {
                float acc = 0.0f;
                for (int k = 0; k < 16; k++)
                    acc += A[i][k] * B[k][j];
                Dm[i][j] = C[i][j] + acc;
            }
        for (int l = 0; l < 32; l++) {
            const int g = l / 4, t = l % 4;
            const float d[4] = {Dm[g][2 * t], Dm[g][2 * t + 1], Dm[g + 8][2 * t],
                                Dm[g + 8][2 * t + 1]};
            memcpy(s.out[l], d, 16);
        }
    });
    memcpy(c, out, 16);
}

/* ---- cp.async ------------------------------------------------------------- */

static inline void cp_async16(void *dst, const void *src, bool valid)
{
    emu::check_smem(dst, 16, "cp.async destination outside shared memory or not 16-byte aligned");
    if (valid && ((uintptr_t)src % 16) != 0)
        emu::die("cp.async source not 16-byte aligned");
    const emu::pending_copy c{dst, src, valid, false};
    if (emu::running()->mode == emu::COPY_AT_ISSUE)
        emu::do_copy(c);
    else
        emu::self().pending.push_back(c);
}

/* Closes the thread's group of copies issued since the last commit. */
static inline void cp_async_commit()
{
    for (emu::pending_copy &c : emu::self().pending)
        c.committed = true;
}

/* cp.async.wait_group 0: every committed group lands; copies not yet
 * committed are not waited for (they stay pending, as on the hardware). */
static inline void cp_async_wait_all()
{
    std::vector<emu::pending_copy> &p = emu::self().pending, left;
    for (const emu::pending_copy &c : p) {
        if (c.committed)
            emu::do_copy(c);
        else
            left.push_back(c);
    }
    p.swap(left);
}

#endif
