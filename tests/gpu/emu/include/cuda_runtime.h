/* The CUDA runtime API as the cuda backend's sources use it, for their host
 * build on the SIMT emulator (tests/gpu/emu/README.md): declarations with
 * the toolkit's names and meanings, implemented in emu_runtime.cc. Device
 * memory is host memory that the runtime tracks, a stream is a queue that
 * runs at the points where a GPU's work would be known to be done, and a
 * kernel launch runs the kernel's own source on the emulator. Only what the
 * backend and the NCCL comm backend call is here. The API itself is C (the
 * comm backend and the GPU suite's C tests include it); kernel launches and
 * what the emulator adds are C++. */
#ifndef DIT_EMU_CUDA_RUNTIME_H
#define DIT_EMU_CUDA_RUNTIME_H

#ifdef __cplusplus
#include <cstddef>
#include <cstdint>
#include <functional>

#include "simt_emu.h"
#define DIT_EMU_C_BEGIN extern "C" {
#define DIT_EMU_C_END }
#define DIT_EMU_NULL_DEFAULT = nullptr
#else
#include <stddef.h>
#include <stdint.h>
#define DIT_EMU_C_BEGIN
#define DIT_EMU_C_END
#define DIT_EMU_NULL_DEFAULT
#endif

typedef enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInsufficientDriver = 35,
    cudaErrorDevicesUnavailable = 46,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureUnjoined = 904,
    cudaErrorStreamCaptureImplicit = 906,
    cudaErrorUnknown = 999,
} cudaError_t;
typedef enum cudaError_t cudaError;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
} cudaMemcpyKind;

typedef enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2,
} cudaStreamCaptureMode;

typedef enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8
} cudaFuncAttribute;
typedef enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 } cudaDeviceAttr;

#define cudaStreamDefault 0x00u
#define cudaStreamNonBlocking 0x01u
#define cudaEventDefault 0x00u
#define cudaEventDisableTiming 0x02u

typedef struct emu_stream *cudaStream_t;
typedef struct emu_event *cudaEvent_t;
typedef struct emu_graph *cudaGraph_t;
typedef struct emu_graph_exec *cudaGraphExec_t;
#define CUDART_CB
typedef void (*cudaHostFn_t)(void *user_data);

typedef struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    size_t sharedMemPerBlockOptin;
    int multiProcessorCount;
    int major, minor;
    int warpSize;
    int maxThreadsPerBlock;
} cudaDeviceProp;

DIT_EMU_C_BEGIN
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorName(cudaError_t e);
const char *cudaGetErrorString(cudaError_t e);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream DIT_EMU_NULL_DEFAULT);
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream DIT_EMU_NULL_DEFAULT);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes,
                            cudaStream_t stream DIT_EMU_NULL_DEFAULT);

cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned flags, int priority);
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t ev, unsigned flags);
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void *user_data);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);

cudaError_t cudaEventCreate(cudaEvent_t *ev);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *ev, unsigned flags);
cudaError_t cudaEventQuery(cudaEvent_t ev);
cudaError_t cudaEventDestroy(cudaEvent_t ev);
cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t s DIT_EMU_NULL_DEFAULT);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);
DIT_EMU_C_END

#ifdef __cplusplus

/* ---- What the emulated runtime adds (not CUDA API) ------------------------ */

namespace emurt
{
/* Checks a launch's geometry and shared memory against the device's limits
 * (and what cudaFuncSetAttribute allowed kernel `fn`); false, with the
 * sticky error set as the runtime would, when the launch must fail. */
bool launch_ok(const void *fn, dim3 grid, dim3 block, size_t smem);
/* Queues op on stream s (or records it into the graph being captured). */
cudaError_t submit(cudaStream_t s, std::function<void()> op);
/* The emulator's settings for the next launch (DIT_EMU_COPIES=issue|wait,
 * DIT_EMU_SCHED=rr|warp, a seed counted up per launch). */
emu::copies copies_mode();
emu::schedule schedule_mode();
uint64_t next_seed();
cudaError_t set_func_smem(const void *fn, int bytes);
/* True when [p, p + bytes) lies in one device allocation. */
bool is_device(const void *p, size_t bytes);
/* Runs what stream s has queued, now (the emulated NCCL's collectives run
 * as they are issued: see nccl_emu.cc). */
void run_now(cudaStream_t s);
} /* namespace emurt */

template <typename T> cudaError_t cudaFuncSetAttribute(T *fn, cudaFuncAttribute attr, int value)
{
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize)
        return cudaErrorInvalidValue;
    return emurt::set_func_smem(reinterpret_cast<const void *>(fn), value);
}

/* A kernel and its arguments, converted to its parameter types at the
 * launch (as a <<< >>> launch evaluates them then): binding through a call
 * with the kernel's own parameter list gives the same conversions. */
template <typename... P> struct emu_binder {
    void (*k)(P...);
    std::function<void()> operator()(P... p) const
    {
        void (*kk)(P...) = k;
        return [=]() { kk(p...); };
    }
};
template <typename... P> static inline emu_binder<P...> emu_bind(void (*k)(P...))
{
    return emu_binder<P...>{k};
}

/* In the including translation unit, which owns the kernel's emulation. */
static inline void emu_launch(const void *fn, dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, std::function<void()> body)
{
    if (!emurt::launch_ok(fn, grid, block, smem))
        return;
    emurt::submit(stream, [=]() {
        emu::launch(grid, block, smem, emurt::copies_mode(), emurt::schedule_mode(),
                    emurt::next_seed(), body);
    });
}

#define DIT_CUDA_LAUNCH(k, grid, block, smem, stream, ...)                                         \
    emu_launch(reinterpret_cast<const void *>(k), dim3(grid), dim3(block), (size_t)(smem),         \
               (stream), emu_bind(k)(__VA_ARGS__))

#endif /* __cplusplus */

#endif
