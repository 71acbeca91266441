// The device runtime seen by the device backends (plugin/backend): pointer kinds, pinned host
// memory, stream-ordered copies, events and host functions on a stream. Three implementations:
//   - the CUDA runtime (runtime_cuda.cc, builds with CUDA; cudart is linked statically and
//     loads libcuda at run time, so a machine with no driver gets "no device", not a failed
//     load);
//   - "none" (runtime_none.cc, every build): every pointer is host memory and no stream exists;
//   - a CPU fake (tests/device/fake_device.h): memcpy on per-stream worker threads, so the
//     staging pipeline and the stream-ordering bookkeeping run, and are tested, without a GPU.
// No CUDA header is needed to use this interface: streams and events are opaque pointers.
#ifndef SCAPE_PLUGIN_DEVICE_RUNTIME_H_
#define SCAPE_PLUGIN_DEVICE_RUNTIME_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "base/status.h"
#include "kernels/cpu/scape_step.h"
#include "kernels/cpu/topk.h"
#include "scape/scape.h"

namespace scape {
namespace device {

enum class PtrKind {
  kHost,     // pageable or page-locked host memory (cudaMemoryTypeHost / Unregistered)
  kDevice,   // device memory (cudaMemoryTypeDevice)
  kManaged,  // managed memory: treated as device memory (staged, stream-ordered)
};
const char* PtrKindName(PtrKind k);

using Stream = void*;  // a cudaStream_t (NULL: the default stream)
using Event = void*;   // a cudaEvent_t
using HostFn = void (*)(void* arg);
class TempSource;

class Runtime {
 public:
  virtual ~Runtime() = default;
  virtual const char* Name() const = 0;
  // True when device memory can exist (a driver and at least one device).
  virtual bool Available() = 0;
  // Where `p` lives. Never fails: anything the runtime does not know is host memory.
  virtual PtrKind Kind(const void* p) = 0;

  // Page-locked host memory for staging (cudaHostAlloc).
  virtual Status HostAlloc(size_t bytes, void** p) = 0;
  virtual void HostFree(void* p) = 0;
  // Stream-ordered copy; the direction follows from the pointers (cudaMemcpyDefault).
  virtual Status CopyAsync(void* dst, const void* src, size_t bytes, Stream s) = 0;
  // A host-to-device copy of a host table whose source may be pageable, without a host wait:
  // `src` is copied into page-locked memory the runtime owns (reused once the stream has run
  // the copy) before the copy is enqueued, so the caller may reuse `src` at once and the copy
  // never makes the host wait for the stream (cudaMemcpyAsync from pageable memory may). The
  // default is CopyAsync (a runtime without page-locked memory of its own).
  virtual Status UploadStaged(void* dDst, const void* src, size_t bytes, Stream s);
  // The current device's compute capability, major * 10 + minor (90: sm_90); 0 when unknown
  // (no device). The default is 0.
  virtual int ComputeCapability() { return 0; }
  // A process-unique id of the stream `s` names now (cudaStreamGetId): unlike the handle, never
  // reused for a stream created after `s` was destroyed. False (and *id = 0) when the runtime
  // cannot tell (the default; CUDA before 12.0).
  // True while `s` is capturing into a CUDA graph (cudaStreamIsCapturing); the default false.
  virtual bool StreamCapturing(Stream /*s*/) { return false; }
  virtual bool StreamId(Stream /*s*/, uint64_t* id) {
    *id = 0;
    return false;
  }
  // Events: recorded on a stream, queried from any thread.
  virtual Status EventCreate(Event* e) = 0;
  virtual void EventDestroy(Event e) = 0;
  virtual Status EventRecord(Event e, Stream s) = 0;
  // *done = the work before the record has finished. An error is a failed stream.
  virtual Status EventQuery(Event e, bool* done) = 0;
  // Runs fn(arg) on a runtime thread once the stream reaches it; the stream waits for fn to
  // return (cudaLaunchHostFunc). fn must not call the runtime.
  virtual Status LaunchHostFunc(Stream s, HostFn fn, void* arg) = 0;
  virtual Status StreamSynchronize(Stream s) = 0;
  // *done = the work queued on `s` so far has finished (cudaStreamQuery); never blocks. An
  // error is a failed stream. The default synchronises the stream (a runtime without a
  // query), so *done is then always true.
  virtual Status StreamQuery(Stream s, bool* done);
  // Work enqueued on `s` after this call waits (on the device, no host wait) until the work
  // before the last record of `e` has finished (cudaStreamWaitEvent); `e` may be destroyed
  // once this returns. The default waits on the host (polling EventQuery).
  virtual Status StreamWaitEvent(Stream s, Event e);
  // Work enqueued on `s` after this waits, on the device (no host thread, no host function),
  // until the 32-bit word at `flag` reaches `value`: (int32_t)(*flag - value) >= 0, the cyclic
  // comparison of cuStreamWaitValue32's GEQ. `flag` lies in HostAlloc memory and the host
  // writes it (a release store) to let the stream go on: the staging pipeline's stream waits
  // for the host exchange this way, so no host function ever blocks (CUDA runs every host
  // function of a context on one thread). The default says scapeUnsupported.
  virtual Status StreamWaitValue(Stream s, const uint32_t* flag, uint32_t value);
  // A new stream that does not synchronise with the default stream (cudaStreamCreateWithFlags
  // cudaStreamNonBlocking), and its release (after the work on it has finished). The defaults
  // say scapeUnsupported / do nothing (the "none" runtime has no streams).
  virtual Status StreamCreate(Stream* s);
  virtual void StreamDestroy(Stream s);
  // The calling thread's current device, and setting it on another thread (the staging
  // worker queries events of the device the call was made on).
  virtual int GetDevice() { return 0; }
  virtual void SetDevice(int) {}

  // ---- device memory and the device forms of the kernel contracts (kernels/cpu/*.h) --------
  // The CUDA runtime launches the kernels of kernels/cuda/ (the same bits as the CPU kernels,
  // scape_kernels.cuh); the CPU fake of the tests runs the CPU kernels on its stream threads.
  // Every op but DeviceAlloc/DeviceFree is stream-ordered: it is enqueued on `s` and returns at
  // once; the returned Status covers host-checkable arguments and launch errors, and errors
  // found while the op runs surface as a failed stream (EventQuery / StreamSynchronize).
  // Pointers named d* are device memory; masks are uint64_t positions in device memory.
  // The defaults say scapeUnsupported (the "none" runtime has no device).
  virtual Status DeviceAlloc(size_t bytes, void** d);  // cudaMalloc (0 bytes: a valid pointer)
  virtual void DeviceFree(void* d);                    // cudaFree; NULL is a no-op
  // An op's per-call temporary when no TempSource is in scope (OpTemp below): stream-ordered
  // where the runtime can (cudaMallocAsync / cudaFreeAsync). The defaults: DeviceAlloc, and a
  // host wait for the stream before DeviceFree (a driver allocation per call).
  virtual Status DeviceAllocAsync(size_t bytes, Stream s, void** d);
  virtual void DeviceFreeAsync(void* d, Stream s);
  // The calling thread's TempSource for ops on this runtime (ScopedTempSource), else nullptr.
  // Kept in the runtime object, not in a thread_local of this library, so that a runtime
  // built into another binary (the tests' fake, installed into the shared library) sees the
  // library's scopes.
  TempSource* CurrentTempSource();
  virtual Status Memset(void* d, int value, size_t bytes, Stream s);
  // kernels/cpu/gather.h: dPacked[i] = dDense[dIdx[i]], and its inverse, esz in {1, 2, 4, 8}.
  virtual Status Gather(const void* dDense, const uint64_t* dIdx, size_t k, size_t esz,
                        void* dPacked, Stream s);
  virtual Status Scatter(const void* dPacked, const uint64_t* dIdx, size_t k, size_t esz,
                         void* dDense, Stream s);
  // kernels/cpu/topk.h TopkAbs (exact or sampled): the segment table is host memory (the
  // runtime uploads what it needs); dOut holds out_offsets[nseg] positions, dCounts nseg counts.
  virtual Status TopkAbs(const float* dX, const kernels::TopkSegments& segments,
                         const kernels::TopkOptions& options, uint64_t* dOut, uint64_t* dCounts,
                         Stream s);
  // kernels/cpu/scape_step.h (dMask strictly increasing, k <= n), in the optimizer step's form
  // (the kernel's keep_rounding): the residual inside the mask is the rounding error
  // c - float(payload) (+0 for fp32 and when the payload value is not finite), what the host
  // optimizer step's view kernel leaves there.
  // dCOut may be dM (in place: each element's m is read before its c is written), as the
  // optimizer step does with its statistic buffer. gradScale: the kernel's grad_scale (the
  // gradient weighted by (1 - beta1) * gradScale; the optimizer's local clipping).
  virtual Status CandidatePackResidual(const float* dM, const float* dG, float* dE, size_t n,
                                       float beta1, const uint64_t* dMask, size_t k,
                                       scapeDataType_t payloadType, void* dPayload, float* dCOut,
                                       Stream s, float gradScale = 1.0f);
  virtual Status UnpackAdamSUpdate(const void* dPayload, scapeDataType_t payloadType,
                                   const uint64_t* dMask, size_t k, float* dTheta, float* dM,
                                   size_t n, const kernels::AdamSParams& params, Stream s);
  // Mixed precision (scapeOptimStepMixed). CandidatePackResidualGrad: CandidatePackResidual with
  // gradients dG of gradType (scapeFloat32, scapeBfloat16 or scapeFloat16, widened exactly:
  // the same bits as the fp32 form on the widened values). UnpackAdamSUpdateCopy:
  // UnpackAdamSUpdate that also writes the 16-bit model copy dCopy (copyType scapeBfloat16 or
  // scapeFloat16) of theta at every position in the same pass (kernels::ModelCopy). The
  // defaults forward an fp32 gradType to CandidatePackResidual and say scapeUnsupported
  // otherwise.
  virtual Status CandidatePackResidualGrad(const float* dM, const void* dG,
                                           scapeDataType_t gradType, float* dE, size_t n,
                                           float beta1, const uint64_t* dMask, size_t k,
                                           scapeDataType_t payloadType, void* dPayload,
                                           float* dCOut, Stream s, float gradScale = 1.0f);
  virtual Status UnpackAdamSUpdateCopy(const void* dPayload, scapeDataType_t payloadType,
                                       const uint64_t* dMask, size_t k, float* dTheta, float* dM,
                                       size_t n, const kernels::AdamSParams& params, void* dCopy,
                                       scapeDataType_t copyType, Stream s);
  // The sharded step's two halves (the owner updates its masked positions, the (theta', m')
  // pairs are all-gathered, every rank unpacks them). AdamSUpdatePairs: kernels/cpu/scape_step.h
  // AdamSUpdatePairs on device memory: for j < k, i = dIdx[j] (distinct, < n, any order),
  // computes (theta', m') exactly as UnpackAdamSUpdate would write them at i
  // (m_{t-1} = dM[i], dense m; payload value j) and stores dPairs[2j] = theta',
  // dPairs[2j+1] = m' (2k floats). dTheta and dM are only read. params.enter_offsets /
  // enter_vs ("segment_rms") are host memory (the runtime uploads them), as for
  // UnpackAdamSUpdate.
  virtual Status AdamSUpdatePairs(const void* dPayload, scapeDataType_t payloadType,
                                  const uint64_t* dIdx, size_t k, const float* dTheta,
                                  const float* dM, size_t n, const kernels::AdamSParams& params,
                                  float* dPairs, Stream s);
  // UnpackPairsDecay: kernels/cpu/scape_step.h UnpackPairsDecayView on device memory at a sorted
  // mask (dMask strictly increasing, k <= n; dPairs in that order, 2k floats):
  // dTheta[dMask[j]] = dPairs[2j], dM[dMask[j]] = dPairs[2j+1]; outside the mask
  // dTheta *= decay (decay = 1 - lr*wd from params; untouched when decay == 1) and dM = +0.
  // dCopy (nullptr: none) is the 16-bit model copy of theta (copyType scapeBfloat16 or
  // scapeFloat16; ignored without dCopy), written at EVERY position in the same pass, as
  // UnpackAdamSUpdateCopy does. params' enter table is not used.
  virtual Status UnpackPairsDecay(const float* dPairs, const uint64_t* dMask, size_t k,
                                  float* dTheta, float* dM, size_t n,
                                  const kernels::AdamSParams& params, void* dCopy,
                                  scapeDataType_t copyType, Stream s);
  // *dSqNorm (device, one double) = RecoveredGradSqNorm's result, the same bits.
  virtual Status RecoveredGradSqNorm(const void* dPayload, scapeDataType_t payloadType,
                                     const uint64_t* dMask, size_t k, const float* dM, size_t n,
                                     float beta1, double* dSqNorm, Stream s);
  // *dSqNorm (device, one double) = kernels/cpu/scape_step.h GradSqNorm of dG[0, n) of gradType
  // (scapeFloat32, scapeBfloat16 or scapeFloat16), the same bits (the local clipping's norm).
  virtual Status GradSqNorm(const void* dG, scapeDataType_t gradType, size_t n, double* dSqNorm,
                            Stream s);
  // kernels/cpu/finite.h in the device form: *dFlag (device, one uint32) = 1 when dX[0, n)
  // holds an inf or NaN, else 0 (the optimizer's non-finite check of device gradients).
  // type: scapeFloat32, scapeBfloat16 or scapeFloat16 (n elements of that type).
  virtual Status AnyNonFinite(const void* dX, size_t n, scapeDataType_t type, uint32_t* dFlag,
                              Stream s);
  // kernels/cpu/scaled.h in the device form (a scaled payload type, kernels/dtypes.h), the same
  // bits: *dAmax (device, one float) = max |dX[j]|; dX -> dQ with the scale of *dAmax (read on
  // the device) and the rounding error into dResidual at dPos (both null: none); dQ -> dOut.
  virtual Status PayloadAmax(const float* dX, size_t k, float* dAmax, Stream s);
  virtual Status QuantizeScaled(const float* dX, size_t k, scapeDataType_t type, const float* dAmax,
                                int nranks, void* dQ, const uint64_t* dPos, float* dResidual,
                                Stream s);
  virtual Status DequantizeScaled(const void* dQ, size_t k, scapeDataType_t type,
                                  const float* dAmax, int nranks, float* dOut, Stream s);
  // kernels/cpu/scape_step.h StayingGradSqBlocks ("segment_rms"): `bounds` (nb + 1 slots) is
  // host memory (the runtime uploads it); dSums and dCounts receive nb values each, the same
  // bits. The params.enter_offsets / enter_vs of UnpackAdamSUpdate, UnpackAdamSUpdateCopy and
  // AdamSUpdatePairs are host memory too.
  virtual Status StayingGradSqBlocks(const void* dPayload, scapeDataType_t payloadType,
                                     const uint64_t* dIdx, const float* dM, size_t n, float beta1,
                                     const uint64_t* bounds, size_t nb, double* dSums,
                                     uint64_t* dCounts, Stream s);

 private:
  friend class ScopedTempSource;
  std::mutex tempMu_;
  std::vector<std::pair<std::thread::id, TempSource*>> tempScopes_;  // innermost last
};

// ---- where the device ops' per-call temporaries come from --------------------------------
// Some ops need device memory for the length of one launch (the top-k's segment table and
// scratch, the norm's partial sums, the uploaded "segment_rms" tables). They take it through
// OpTemp, from the calling thread's TempSource (per runtime): the communicator's DevicePool
// (device_pool.h), which the library's device paths (the device backend's top-k, the device
// optimizer step) put in scope around their ops, so the memory is kept between steps and, with a
// scapeConfig_t.deviceAllocator, comes from the caller's allocator. With no source in scope
// (a runtime op called outside a communicator: tests, benchmarks) the runtime's
// DeviceAllocAsync / DeviceFreeAsync serve it.
class TempSource {
 public:
  virtual ~TempSource() = default;
  // Device memory of at least `bytes` for work about to be enqueued on `s`.
  virtual Status TempAlloc(size_t bytes, Stream s, void** d) = 0;
  // Back from TempAlloc once the work that uses `d` has been enqueued on `s` (stream-ordered:
  // the source may hand it to later work on `s` at once).
  virtual void TempFree(void* d, Stream s) = 0;
};

// The calling thread's TempSource for ops on `rt` while this lives (scopes nest; the innermost
// wins).
class ScopedTempSource {
 public:
  ScopedTempSource(Runtime* rt, TempSource* src);
  ~ScopedTempSource();
  ScopedTempSource(const ScopedTempSource&) = delete;
  ScopedTempSource& operator=(const ScopedTempSource&) = delete;

 private:
  Runtime* rt_;
};

// One op's temporary: from the thread's TempSource, else the runtime's DeviceAllocAsync;
// handed back on the op's stream when this goes (after the op's launches are enqueued, error
// paths included).
class OpTemp {
 public:
  OpTemp(Runtime* rt, Stream s) : rt_(rt), s_(s), src_(rt->CurrentTempSource()) {}
  ~OpTemp() { Release(); }
  OpTemp(const OpTemp&) = delete;
  OpTemp& operator=(const OpTemp&) = delete;
  // `op` names the op in the error. One allocation per OpTemp (a second one releases the first).
  Status Alloc(const char* op, size_t bytes, void** d);
  void Release();

 private:
  Runtime* rt_;
  Stream s_;
  TempSource* src_;
  void* d_ = nullptr;
};

// A host wait with a deadline: waits (polling rt->StreamQuery) for the work queued on `s` so
// far, at most timeoutMs (the communicator's timeout). scapeTimeout naming `what` after that
// (the work stays queued: what it uses must not be freed), the stream's error if it failed.
// Every host wait of a call that has a communicator's deadline uses it, never an unbounded
// StreamSynchronize.
Status StreamWaitFor(Runtime* rt, Stream s, int timeoutMs, const char* what);

// Host <-> device copies that a host wait with a deadline finishes (issue 44): a copy into or
// out of pageable host memory (a std::vector) makes cudaMemcpyAsync itself wait for the stream
// to drain, with no deadline, and a source or destination that goes out of scope while the copy
// is still queued is a use after free. HostStaging routes each copy through a page-locked
// buffer of its own (HostAlloc): Download / Upload queue the copies on `s` (an upload's bytes
// are copied into its buffer at once, so the caller's source may change), Wait waits for them
// with StreamWaitFor and then copies the downloads to their destinations. On a timeout (or any
// error after a copy was queued) the destinations are left as they were and the page-locked
// buffers are leaked with a warning (the stream may still write into or read from them), never
// freed under a queued copy. Not thread-safe; one stream.
class HostStaging {
 public:
  HostStaging(Runtime* rt, Stream s) : rt_(rt), s_(s) {}
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;
  // Queues a copy of `bytes` from `src` (device) to host `dst` (written by Wait).
  Status Download(void* dst, const void* src, size_t bytes);
  // Queues a copy of `bytes` from host `src` (copied now) to `dst` (device).
  Status Upload(void* dst, const void* src, size_t bytes);
  // Waits (at most timeoutMs) for every copy queued so far, then fills the downloads'
  // destinations. scapeTimeout naming `what` on the deadline.
  Status Wait(int timeoutMs, const char* what);

 private:
  struct Buf {
    void* pinned;
    void* dst;  // download destination, nullptr for an upload
    size_t bytes;
  };
  Status Stage(size_t bytes, void** pinned);
  Runtime* rt_;
  Stream s_;
  std::vector<Buf> bufs_;
  bool queued_ = false;  // a copy was queued and not yet waited for
};

// One download through HostStaging, waited for at once.
Status DownloadWithin(Runtime* rt, void* dst, const void* src, size_t bytes, Stream s,
                      int timeoutMs, const char* what);

// The process's runtime: the CUDA runtime in CUDA builds, else "none".
Runtime* GetRuntime();
// Tests: replaces the runtime (nullptr restores the default). Returns the previous one. Only
// while no device operation is in flight.
Runtime* SetRuntimeForTesting(Runtime* rt);

// The built-in runtimes (used by GetRuntime; exposed for tests).
Runtime* NoneRuntime();
Runtime* CudaRuntime();  // nullptr in builds without CUDA

}  // namespace device
}  // namespace scape

#endif  // SCAPE_PLUGIN_DEVICE_RUNTIME_H_
