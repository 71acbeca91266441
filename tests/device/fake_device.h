// A CPU fake of the device runtime (plugin/device/runtime.h) for tests without a GPU:
// "device memory" is host memory that the fake hands out and recognises by address; every
// stream is a thread that runs its queue in order (copies are memcpy, optionally slowed down,
// host functions run on the stream's thread and hold it while they run), events complete
// when the stream reaches them. So the library's staging pipeline and its stream ordering
// run for real; only the bytes never leave host memory. A stream's queue can be bounded
// (FakeStream::SetQueueDepth), as a real stream's is.
//
// The device ops (Memset, Gather, Scatter, TopkAbs, CandidatePackResidual, UnpackAdamSUpdate,
// AdamSUpdatePairs, UnpackPairsDecay, RecoveredGradSqNorm, ...) run the CPU kernels of kernels/cpu/
// on the stream's thread, in order with the copies and host functions queued there. What the host
// can check (null pointers, k > n, element sizes, payload types, parameters, the top-k segment
// table, and that every d* range lies inside ONE live device allocation and is aligned) returns an
// error at once. What only the data can show (an index outside the dense buffer, an unsorted mask,
// a freed buffer) fails the op on the stream thread: the stream becomes "failed", a sticky error
// that EventQuery (for events recorded on it) and StreamSynchronize return from then on, with a
// message naming the op, as CUDA reports a kernel fault. Later device ops on a failed stream
// are skipped (copies, host functions and events still run, so nothing that waits on them
// hangs); ClearStreamError resets a stream for the next test.
//
// Strict where CUDA is (issue 31), so that code which works only by the fake's leniency fails
// here, not on a GPU:
//   - host functions: one host-function thread for all streams of the runtime (CUDA runs a
//     context's host functions on one thread: a host function that blocks holds up every
//     other stream's); a runtime call made inside a host function is refused with
//     scapeInvalidUsage (void calls do nothing) and counted (callsInHostFn);
//   - the legacy default stream (NULL, one per device): work queued there waits for the work
//     queued before on every blocking stream of its device (NewStream(true)), and a blocking
//     stream's work waits for the default stream's; non-blocking streams (NewStream(),
//     StreamCreate) synchronise with neither;
//   - pageable memory (host memory not from HostAlloc) in CopyAsync: a copy into it returns
//     once the copy has completed (it waits for the stream); a copy from it runs when the
//     stream reaches it and fails the stream if the source changed after the call returned
//     (CUDA may copy then; a freed source is a use after free under ASan);
//   - handles: StreamCreate and EventCreate hand out the handle of a destroyed stream or
//     event first, for a new one; a destroyed event's handle is an error until reused;
//   - devices: kDevices devices, a current device per thread (SetDevice / GetDevice); device
//     memory and streams belong to the device current at their creation, and a device op
//     given memory of another device fails (as a kernel without peer access would).
// Not modelled: device memory returned to the driver by a pool with a release threshold
// (DeviceAlloc / DeviceFree and their counters are the allocator work's hook).
#ifndef SCAPE_TESTS_DEVICE_FAKE_DEVICE_H_
#define SCAPE_TESTS_DEVICE_FAKE_DEVICE_H_

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "plugin/device/runtime.h"

namespace fake_device {

class FakeStream {
 public:
  // A stream of `device`; blocking: synchronises with the legacy default stream (see above).
  explicit FakeStream(int device = 0, bool blocking = false);
  ~FakeStream();  // runs what is queued, then stops
  int device() const { return device_; }
  bool blocking() const { return blocking_; }
  // Unique in the process (never reused, unlike handles): the fake's StreamId.
  uint64_t id() const { return id_; }
  // Queues fn. With a queue depth set (SetQueueDepth), blocks while that many entries are
  // queued and not yet run, as a CUDA stream's bounded queue of pending work blocks the
  // enqueueing call.
  void Push(std::function<void()> fn);
  // Every stream's queue depth (0: unbounded, the default). Tests set it to catch code that
  // needs the stream to move before its enqueueing call returns.
  static void SetQueueDepth(size_t depth);
  // Waits until everything queued so far has run (false after timeoutMs).
  bool Sync(int timeoutMs = 30000);
  // Everything queued so far has run (no wait).
  bool Idle();
  // Entries queued so far, and a wait (no deadline: the stream threads' own ordering) until
  // that many have run.
  uint64_t Pushed();
  void WaitRan(uint64_t n);
  // The sticky error of the stream (the first one set; Ok while none).
  void SetError(const scape::Status& st);
  scape::Status Error();
  void ClearError();

 private:
  void Main();
  const int device_;
  const bool blocking_;
  const uint64_t id_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  uint64_t pushed_ = 0, ran_ = 0;
  bool stop_ = false;
  scape::Status error_;
  std::thread th_;
};

// A gate: a host function queued on a stream that holds the stream until Open().
class Gate {
 public:
  void Open();
  void Wait();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

class FakeRuntime final : public scape::device::Runtime {
 public:
  FakeRuntime();
  ~FakeRuntime() override;
  const char* Name() const override { return "fake"; }
  bool Available() override { return true; }
  scape::device::PtrKind Kind(const void* p) override;
  scape::Status HostAlloc(size_t bytes, void** p) override;
  void HostFree(void* p) override;
  scape::Status CopyAsync(void* dst, const void* src, size_t bytes,
                          scape::device::Stream s) override;
  // The source is copied at the call (as the CUDA runtime's page-locked uploads); counted.
  scape::Status UploadStaged(void* dDst, const void* src, size_t bytes,
                             scape::device::Stream s) override;
  scape::Status EventCreate(scape::device::Event* e) override;
  void EventDestroy(scape::device::Event e) override;
  scape::Status EventRecord(scape::device::Event e, scape::device::Stream s) override;
  scape::Status EventQuery(scape::device::Event e, bool* done) override;
  scape::Status LaunchHostFunc(scape::device::Stream s, scape::device::HostFn fn,
                               void* arg) override;
  scape::Status StreamSynchronize(scape::device::Stream s) override;
  // The FakeStream's id: a handle reused for a new stream gets a new id.
  bool StreamId(scape::device::Stream s, uint64_t* id) override;
  // Done when everything queued on the stream so far has run; its sticky error once failed.
  scape::Status StreamQuery(scape::device::Stream s, bool* done) override;
  // A new stream (owned by the runtime; counted). Its handle is not the FakeStream: like a CUDA
  // runtime, the fake hands the handle of a destroyed stream to the next StreamCreate, for a new
  // stream (a new queue and thread, not ordered after the old one's work, which StreamDestroy
  // lets finish). StreamOf maps a handle to its current stream.
  scape::Status StreamCreate(scape::device::Stream* s) override;
  void StreamDestroy(scape::device::Stream s) override;
  // Work queued on s after this waits until e's last record has been reached (counted).
  scape::Status StreamWaitEvent(scape::device::Stream s, scape::device::Event e) override;
  // The stream's thread waits (no host function) until the flag word, which must be
  // HostAlloc memory, reaches value; a wait still not released after 60 s fails the stream.
  scape::Status StreamWaitValue(scape::device::Stream s, const uint32_t* flag,
                                uint32_t value) override;
  // The calling thread's current device, [0, kDevices).
  static constexpr int kDevices = 2;
  int GetDevice() override;
  void SetDevice(int device) override;

  // Device memory and the device kernel ops (see the top of this file).
  // DeviceAlloc fills the new memory with 0xA5 bytes (cudaMalloc does not zero it either).
  // DeviceFree frees at once (unlike cudaFree it does not wait for the device; it waits only
  // for device ops running at that moment), so ops still queued on it fail their stream.
  scape::Status DeviceAlloc(size_t bytes, void** d) override;
  void DeviceFree(void* p) override;
  // An op's temporary outside any TempSource (runtime.h OpTemp): a driver allocation (counted
  // in deviceAllocs and tempAllocs), freed in stream order (cudaFreeAsync with the pool's
  // release threshold at 0). TopkAbs and RecoveredGradSqNorm take one (OpTemp), as their CUDA
  // forms do, and check on the stream that it is still allocated.
  scape::Status DeviceAllocAsync(size_t bytes, scape::device::Stream s, void** d) override;
  void DeviceFreeAsync(void* d, scape::device::Stream s) override;
  scape::Status Memset(void* d, int value, size_t bytes, scape::device::Stream s) override;
  scape::Status Gather(const void* dDense, const uint64_t* dIdx, size_t k, size_t esz,
                       void* dPacked, scape::device::Stream s) override;
  scape::Status Scatter(const void* dPacked, const uint64_t* dIdx, size_t k, size_t esz,
                        void* dDense, scape::device::Stream s) override;
  scape::Status TopkAbs(const float* dX, const scape::kernels::TopkSegments& segments,
                        const scape::kernels::TopkOptions& options, uint64_t* dOut,
                        uint64_t* dCounts, scape::device::Stream s) override;
  scape::Status CandidatePackResidual(const float* dM, const float* dG, float* dE, size_t n,
                                      float beta1, const uint64_t* dMask, size_t k,
                                      scapeDataType_t payloadType, void* dPayload, float* dCOut,
                                      scape::device::Stream s, float gradScale) override;
  scape::Status UnpackAdamSUpdate(const void* dPayload, scapeDataType_t payloadType,
                                  const uint64_t* dMask, size_t k, float* dTheta, float* dM,
                                  size_t n, const scape::kernels::AdamSParams& params,
                                  scape::device::Stream s) override;
  scape::Status CandidatePackResidualGrad(const float* dM, const void* dG, scapeDataType_t gradType,
                                          float* dE, size_t n, float beta1, const uint64_t* dMask,
                                          size_t k, scapeDataType_t payloadType, void* dPayload,
                                          float* dCOut, scape::device::Stream s,
                                          float gradScale) override;
  scape::Status UnpackAdamSUpdateCopy(const void* dPayload, scapeDataType_t payloadType,
                                      const uint64_t* dMask, size_t k, float* dTheta, float* dM,
                                      size_t n, const scape::kernels::AdamSParams& params,
                                      void* dCopy, scapeDataType_t copyType,
                                      scape::device::Stream s) override;
  scape::Status AdamSUpdatePairs(const void* dPayload, scapeDataType_t payloadType,
                                 const uint64_t* dIdx, size_t k, const float* dTheta,
                                 const float* dM, size_t n,
                                 const scape::kernels::AdamSParams& params, float* dPairs,
                                 scape::device::Stream s) override;
  scape::Status UnpackPairsDecay(const float* dPairs, const uint64_t* dMask, size_t k,
                                 float* dTheta, float* dM, size_t n,
                                 const scape::kernels::AdamSParams& params, void* dCopy,
                                 scapeDataType_t copyType, scape::device::Stream s) override;
  scape::Status RecoveredGradSqNorm(const void* dPayload, scapeDataType_t payloadType,
                                    const uint64_t* dMask, size_t k, const float* dM, size_t n,
                                    float beta1, double* dSqNorm, scape::device::Stream s) override;
  scape::Status GradSqNorm(const void* dG, scapeDataType_t gradType, size_t n, double* dSqNorm,
                           scape::device::Stream s) override;
  scape::Status PayloadAmax(const float* dX, size_t k, float* dAmax,
                            scape::device::Stream s) override;
  scape::Status QuantizeScaled(const float* dX, size_t k, scapeDataType_t type, const float* dAmax,
                               int nranks, void* dQ, const uint64_t* dPos, float* dResidual,
                               scape::device::Stream s) override;
  scape::Status DequantizeScaled(const void* dQ, size_t k, scapeDataType_t type, const float* dAmax,
                                 int nranks, float* dOut, scape::device::Stream s) override;
  scape::Status AnyNonFinite(const void* dX, size_t n, scapeDataType_t type, uint32_t* dFlag,
                             scape::device::Stream s) override;
  scape::Status StayingGradSqBlocks(const void* dPayload, scapeDataType_t payloadType,
                                    const uint64_t* dIdx, const float* dM, size_t n, float beta1,
                                    const uint64_t* bounds, size_t nb, double* dSums,
                                    uint64_t* dCounts, scape::device::Stream s) override;

  // "Device" memory, zero-filled (the tests' own helper; DeviceFree releases it too).
  void* DeviceMalloc(size_t bytes);
  // Bytes of device memory allocated and not freed (DeviceAlloc / DeviceMalloc).
  uint64_t LiveBytes();
  // A new stream of the current device (owned by the runtime); NULL is the legacy default
  // stream. blocking: it synchronises with the legacy default stream (a stream created
  // without cudaStreamNonBlocking); the default is non-blocking, as StreamCreate's.
  scape::device::Stream NewStream(bool blocking = false);
  // Queues fn on stream s in stream order (the legacy default stream's rules included): for
  // tests' and fake NCCL's own work on a stream.
  void Submit(scape::device::Stream s, std::function<void()> fn);
  FakeStream* StreamOf(scape::device::Stream s);
  // Queues a gate on stream s: the stream holds there until gate->Open().
  void HoldStream(scape::device::Stream s, Gate* gate);
  // Once: the next device op named `op` (its Enqueue name, e.g. "StayingGradSqBlocks") queues
  // `gate` right behind it on its stream, so a test can hold a stream in the middle of a call.
  void HoldAfterNextOp(const char* op, Gate* gate);
  // The compute capability the fake reports (ComputeCapability): 90 (an H100) unless a test
  // sets another.
  std::atomic<int> computeCapability{90};
  int ComputeCapability() override { return computeCapability.load(); }
  // The stream a test says is capturing into a CUDA graph (StreamCapturing; none by default).
  std::atomic<scape::device::Stream> capturing{nullptr};
  bool StreamCapturing(scape::device::Stream s) override {
    return s != nullptr && s == capturing.load();
  }
  // The stream's sticky error (Ok while it has not failed), and its reset.
  scape::Status StreamError(scape::device::Stream s);
  void ClearStreamError(scape::device::Stream s);

  // What the library did.
  std::atomic<uint64_t> d2hCopies{0}, h2dCopies{0}, otherCopies{0}, copiedBytes{0};
  std::atomic<uint64_t> hostFuncs{0}, pinnedAllocs{0}, pinnedLive{0}, syncs{0};
  // Slows every copy down by this many microseconds (to make overlap and ordering visible).
  std::atomic<int> copyDelayUs{0};
  // Device ops: queued on a stream (kernelLaunches = all of them, memsets included), failed on
  // the stream thread, skipped because their stream had failed; device allocations.
  std::atomic<uint64_t> kernelLaunches{0}, memsets{0}, gathers{0}, scatters{0}, topks{0};
  std::atomic<uint64_t> candidates{0}, updates{0}, norms{0}, failedOps{0}, skippedOps{0};
  std::atomic<uint64_t> stayingSums{0}, enteringUpdates{0};  // "segment_rms" ops
  std::atomic<uint64_t> localNorms{0};                       // GradSqNorm (clipNorm = local)
  std::atomic<uint64_t> pairUpdates{0}, pairUnpacks{0};      // the sharded step's halves
  // deviceAllocs: driver-level allocations (DeviceAlloc, DeviceAllocAsync, DeviceMalloc);
  // tempAllocs: those of them that were an op's temporary with no TempSource in scope.
  std::atomic<uint64_t> deviceAllocs{0}, deviceLive{0}, tempAllocs{0};
  std::atomic<uint64_t> streamsCreated{0}, streamsLive{0}, streamWaits{0}, valueWaits{0};
  // Runtime calls refused inside a host function; copies into pageable memory that waited.
  std::atomic<uint64_t> callsInHostFn{0}, pageableSyncCopies{0};
  // Copies from pageable memory to the device (CopyAsync), and UploadStaged's.
  std::atomic<uint64_t> pageableUploads{0}, stagedUploads{0};
  // Fault injection: the next failNextOps device ops fail on their stream instead of running
  // (as a kernel fault would), so callers' error paths can be tested.
  std::atomic<int> failNextOps{0};
  // Threads the CPU kernels may use (their results do not depend on it).
  std::atomic<int> kernelThreads{1};

 private:
  // Queues a device op on s: fn runs on the stream thread (unless the stream has failed), holds
  // the memory lock shared (so DeviceFree cannot free under it), and a non-ok Status fails the
  // stream with "fake device: <op>: <message>".
  void Enqueue(scape::device::Stream s, const char* op, std::function<scape::Status()> fn);
  // Ok if [p, p + bytes) lies inside one live device allocation (bytes == 0: always). align:
  // p must be a multiple of it.
  scape::Status CheckRange(const char* op, const char* arg, const void* p, size_t bytes,
                           size_t align = 1);
  // The live allocation holding p: its base and size (false if none).
  bool Extent(const void* p, uintptr_t* base, size_t* bytes);
  void* Register(void* p, size_t bytes);
  // Ok outside a host function; inside one, scapeInvalidUsage naming `call` (counted).
  scape::Status Refuse(const char* call);
  bool Pinned(const void* p, size_t bytes);
  void Submit(FakeStream* st, std::function<void()> fn);
  void RunOnHostFnThread(scape::device::HostFn fn, void* arg);
  void HostFnMain();
  struct FakeEvent;
  std::shared_ptr<FakeEvent> EventOf(scape::device::Event e);
  void* NewHandleLocked(std::vector<void*>* freeList);

  std::shared_mutex memMu_;  // exclusive in DeviceFree, shared while a device op runs
  std::mutex holdMu_;        // HoldAfterNextOp
  std::string holdOp_;
  Gate* holdGate_ = nullptr;
  std::mutex mu_;
  std::map<uintptr_t, size_t> device_;  // base -> bytes
  std::vector<std::unique_ptr<FakeStream>> streams_;
  // StreamCreate's handles: live ones and the stream each names, free ones (reused first).
  std::map<scape::device::Stream, FakeStream*> handles_;
  std::vector<void*> freeHandles_;
  std::vector<std::unique_ptr<char>> handleMem_;
  std::unique_ptr<FakeStream> defaults_[kDevices];  // the legacy default stream of each device
  std::map<uintptr_t, int> deviceTag_;              // device allocation base -> its device
  std::map<uintptr_t, size_t> pinned_;              // HostAlloc base -> bytes
  std::map<scape::device::Event, std::shared_ptr<FakeEvent>> events_;
  std::vector<void*> freeEvents_;
  std::mutex orderMu_;  // Submit: the legacy default stream's snapshot and the push, together
  // The one host-function thread.
  std::mutex hfMu_;
  std::condition_variable hfCv_;
  std::deque<std::function<void()>> hfQ_;
  bool hfStop_ = false;
  std::thread hfThread_;
};

// The process's fake runtime, made and installed as the device runtime at the first call
// (SetRuntimeForTesting) and leaked: it must outlive the communicators, which tests destroy
// after their bodies. Call it in a rank process only: the parent must not start the fake's
// stream threads before it forks.
FakeRuntime& InstalledFake();

}  // namespace fake_device

#endif  // SCAPE_TESTS_DEVICE_FAKE_DEVICE_H_
