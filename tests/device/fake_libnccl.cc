// A fake libnccl.so for the NCCL-backend tests: the NCCL 2.x C entry points the backend
// resolves, with NCCL's ABI (enums as int, ncclComm_t and cudaStream_t as pointers). Each
// collective records its arguments (fakeNcclLastCall). A "communicator" is a FakeNcclComm the
// test makes, in one of two modes:
//   - shared == NULL (one process): as a 1-rank NCCL would, send is copied to receive at
//     once; the dispatch tests check which call was made with which arguments.
//   - shared != NULL: ranks are processes (forked by the test harness) that meet in a
//     shared-memory segment made by fakeNcclSharedCreate before the fork, and the collectives
//     really move data: each rank copies its contribution into its slot, all ranks meet at a
//     barrier (with a deadline: a rank that never comes sets asyncError to ncclRemoteError
//     instead of hanging), each computes its result from all slots (reductions in rank order),
//     and all meet again before the slots are reused. The work runs where fakeNcclSetEnqueue
//     says (the tests queue it on the fake device's stream, so it runs in stream order with
//     the copies and kernels around it), else at once. ncclGroupStart/End defer the calls made
//     between them to the end of the group, in order (every rank issues the same sequence).
// Communicators can also be made by ncclGetUniqueId + ncclCommInitRank (see the end of this
// file) and ended by ncclCommDestroy / ncclCommAbort. An ended communicator is poisoned rather
// than freed (real NCCL frees it: any later use is a use after free): every later call on it,
// collectives, queries and a second destroy / abort alike, returns ncclInvalidUsage without
// touching it and is counted (fakeNcclCallsOnEndedComms), and work of it still queued on a
// stream is skipped.
// Built in five flavours: complete, without the init entry points (FAKE_NCCL_NO_INIT), without
// ncclAllGather (FAKE_NCCL_NO_ALLGATHER), without ncclReduce and the group calls
// (FAKE_NCCL_NO_GROUP), and reporting an old version (FAKE_NCCL_VERSION).
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <set>
#include <vector>

#include "tests/fp8_ref.h"

#ifndef FAKE_NCCL_VERSION
#define FAKE_NCCL_VERSION 22809
#endif

#define FAKE_API __attribute__((visibility("default")))

extern "C" {

struct FakeNcclShared {
  std::atomic<uint64_t> arrived;  // barrier arrivals so far (monotonic)
  uint64_t slotBytes;
  int nranks;
  int pad;
  // followed by nranks slots of slotBytes
};

struct FakeNcclComm {
  int nranks;
  int rank;
  int failWith;            // returned by the next collective (0: success)
  int asyncError;          // reported by ncclCommGetAsyncError
  FakeNcclShared* shared;  // NULL: one process (see above)
  uint64_t barriers;       // this rank's barriers so far
  int barrierTimeoutMs;    // 0: 20000
  int ops;                 // collectives run on the shared segment so far
};

struct FakeNcclCall {
  char fn[32];
  const void* send;
  void* recv;
  size_t count;
  int dtype;
  int op;  // -1 where the call has none
  int root;
  void* comm;
  void* stream;
  int calls;  // total collectives so far
};

typedef void (*FakeNcclFn)(void*);
typedef void (*FakeNcclEnqueue)(void* stream, FakeNcclFn fn, void* arg);

static FakeNcclCall g_last;
static FakeNcclEnqueue g_enqueue = nullptr;

// Communicators ended by ncclCommDestroy / ncclCommAbort (kept, poisoned: see the top), and the
// calls made on them since.
static std::mutex g_endedMu;
static std::set<const void*> g_ended;
static std::atomic<int> g_callsOnEnded{0};

// True (and the call is counted) when `comm` was ended: the caller returns ncclInvalidUsage.
static bool Ended(const void* comm) {
  std::lock_guard<std::mutex> lk(g_endedMu);
  if (g_ended.count(comm) == 0) return false;
  ++g_callsOnEnded;
  return true;
}

FAKE_API int fakeNcclCallsOnEndedComms() { return g_callsOnEnded.load(); }

// Calls in progress per communicator (a collective from its entry to its return), and the
// communicators ended (ncclCommDestroy / ncclCommAbort) while a call on them was in progress:
// real NCCL frees the communicator under that call. FAKE_NCCL_CALL_US=u makes every collective
// take u microseconds inside the call (read at each call), so that a test can end a
// communicator while another thread is inside NCCL with it.
static std::map<const void*, int> g_inCall;  // under g_endedMu
static std::atomic<int> g_endedDuringCall{0};
FAKE_API int fakeNcclEndedDuringCall() { return g_endedDuringCall.load(); }

struct InCall {
  explicit InCall(const void* c) : comm(c) {
    std::lock_guard<std::mutex> lk(g_endedMu);
    ++g_inCall[comm];
  }
  ~InCall() {
    std::lock_guard<std::mutex> lk(g_endedMu);
    if (--g_inCall[comm] == 0) g_inCall.erase(comm);
  }
  const void* comm;
};

static void CallDelay() {
  const char* e = getenv("FAKE_NCCL_CALL_US");
  const long us = e && *e ? atol(e) : 0;
  if (us <= 0) return;
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, nullptr);
}
FAKE_API const FakeNcclCall* fakeNcclLastCall() { return &g_last; }
FAKE_API void fakeNcclSetEnqueue(FakeNcclEnqueue e) { g_enqueue = e; }

// Loaded after the dry run's fake CUDA runtime (perf/gpu/fake_cudart.cc: the library dlopens
// NCCL, RTLD_LOCAL, so the runtime's load-time fakeNcclSetEnqueue did not find this one): the
// work goes on its streams all the same, as real NCCL's goes on the caller's stream. Elsewhere
// (no such runtime in the process) nothing changes: the tests set the hook themselves.
__attribute__((constructor)) static void FindFakeRuntime() {
  if (g_enqueue) return;
  auto e = reinterpret_cast<FakeNcclEnqueue>(dlsym(RTLD_DEFAULT, "fakeCudartNcclEnqueue"));
  if (e) g_enqueue = e;
}

// A shared segment for nranks processes (inherited across fork), slotBytes per rank.
FAKE_API FakeNcclShared* fakeNcclSharedCreate(int nranks, size_t slotBytes) {
  const size_t bytes = sizeof(FakeNcclShared) + static_cast<size_t>(nranks) * slotBytes;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  auto* s = new (p) FakeNcclShared();
  s->arrived.store(0);
  s->slotBytes = slotBytes;
  s->nranks = nranks;
  return s;
}

static size_t Size(int dt) {
  switch (dt) {
    case 0:
    case 1:
      return 1;
    case 2:
    case 3:
    case 7:
      return 4;
    case 4:
    case 5:
    case 8:
      return 8;
    case 6:
    case 9:
      return 2;
    case 10:  // ncclFloat8e4m3
    case 11:  // ncclFloat8e5m2
      return 1;
    default:
      return 0;
  }
}

enum Kind { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kReduce };

struct Op {
  Kind kind;
  const void* send;
  void* recv;
  size_t count;
  int dtype, op, root;
  FakeNcclComm* comm;
  void* stream;
};

static char* Slot(FakeNcclShared* s, int r) {
  return reinterpret_cast<char*>(s + 1) + static_cast<size_t>(r) * s->slotBytes;
}

static bool EndedQuiet(const void* comm) {  // as Ended, not counted (the fake's own check)
  std::lock_guard<std::mutex> lk(g_endedMu);
  return g_ended.count(comm) != 0;
}

// False at the deadline, or once the communicator is ended: as ncclCommAbort ends this rank's
// kernels in flight, a collective of an ended communicator waiting here for a rank whose part
// was skipped (queued behind the abort there) stops waiting instead of holding its stream.
static bool Barrier(FakeNcclComm* c) {
  const uint64_t target = ++c->barriers * static_cast<uint64_t>(c->nranks);
  c->shared->arrived.fetch_add(1);
  const int ms = c->barrierTimeoutMs > 0 ? c->barrierTimeoutMs : 20000;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (c->shared->arrived.load() < target) {
    if (EndedQuiet(c)) return false;
    struct timespec ts = {0, 20000}, now;
    nanosleep(&ts, nullptr);
    clock_gettime(CLOCK_MONOTONIC, &now);
    if ((now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000 > ms) return false;
  }
  return true;
}

static float Bf16ToF(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t FToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even (finite values)
  return static_cast<uint16_t>(u >> 16);
}

}  // extern "C"

template <typename T>
static T Combine(T a, T b, int op) {
  switch (op) {
    case 2:
      return a > b ? a : b;
    case 3:
      return a < b ? a : b;
    default:
      return a + b;  // sum, avg
  }
}

// dst[i] = op over ranks r (in rank order) of slot r at element offset `off`.
template <typename T>
static void ReduceSlots(FakeNcclShared* s, int p, size_t off, size_t n, int op, T* dst) {
  for (size_t i = 0; i < n; ++i) {
    T acc;
    std::memcpy(&acc, Slot(s, 0) + (off + i) * sizeof(T), sizeof(T));
    for (int r = 1; r < p; ++r) {
      T x;
      std::memcpy(&x, Slot(s, r) + (off + i) * sizeof(T), sizeof(T));
      acc = Combine(acc, x, op);
    }
    if (op == 4) acc = static_cast<T>(acc / static_cast<T>(p));
    std::memcpy(dst + i, &acc, sizeof(T));
  }
}

extern "C" {

static bool Reduce(FakeNcclShared* s, int p, size_t off, size_t n, int dt, int op, void* dst) {
  switch (dt) {
    case 2:
      ReduceSlots(s, p, off, n, op, static_cast<int32_t*>(dst));
      return true;
    case 4:
      ReduceSlots(s, p, off, n, op, static_cast<int64_t*>(dst));
      return true;
    case 7:
      ReduceSlots(s, p, off, n, op, static_cast<float*>(dst));
      return true;
    case 9:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, Slot(s, 0) + (off + i) * 2, 2);
        float acc = Bf16ToF(h);
        for (int r = 1; r < p; ++r) {
          std::memcpy(&h, Slot(s, r) + (off + i) * 2, 2);
          acc = Combine(acc, Bf16ToF(h), op);
        }
        if (op == 4) acc /= static_cast<float>(p);
        h = FToBf16(acc);
        std::memcpy(static_cast<char*>(dst) + i * 2, &h, 2);
      }
      return true;
    case 10:
    case 11: {
      // The 8-bit floats (NCCL >= 2.24): summed in fp32 in rank order, rounded once to nearest
      // even (tests/fp8_ref.h, written from the formats, not the library's conversions).
      const scape::testing::Fp8Format& f = dt == 10 ? scape::testing::kE4m3 : scape::testing::kE5m2;
      auto load = [&f](uint8_t c) { return static_cast<float>(scape::testing::Fp8Value(f, c)); };
      for (size_t i = 0; i < n; ++i) {
        float acc = load(static_cast<uint8_t>(Slot(s, 0)[off + i]));
        for (int r = 1; r < p; ++r)
          acc = Combine(acc, load(static_cast<uint8_t>(Slot(s, r)[off + i])), op);
        if (op == 4) acc /= static_cast<float>(p);
        static_cast<uint8_t*>(dst)[i] = scape::testing::Fp8Round(f, acc);
      }
      return true;
    }
    default:
      return false;  // float16: not reduced by this fake
  }
}

static void RunShared(void* arg) {
  Op* o = static_cast<Op*>(arg);
  FakeNcclComm* c = o->comm;
  {
    std::lock_guard<std::mutex> lk(g_endedMu);
    if (g_ended.count(c)) {  // queued before the communicator was ended: never runs
      delete o;
      return;
    }
  }
  FakeNcclShared* s = c->shared;
  const int p = c->nranks, me = c->rank;
  const size_t esz = Size(o->dtype);
  size_t sendBytes = o->count * esz;
  if (o->kind == kReduceScatter) sendBytes *= static_cast<size_t>(p);
  const bool sends = o->kind != kBroadcast || me == o->root;
  if (c->asyncError == 0 && sendBytes > s->slotBytes) c->asyncError = 4;  // a test's mistake
  if (c->asyncError != 0) {
    delete o;
    return;
  }
  ++c->ops;
  if (sends && sendBytes) std::memcpy(Slot(s, me), o->send, sendBytes);
  if (!Barrier(c)) {
    c->asyncError = 6;
    delete o;
    return;
  }
  const size_t bytes = o->count * esz;
  bool ok = true;
  switch (o->kind) {
    case kAllReduce:
      ok = Reduce(s, p, 0, o->count, o->dtype, o->op, o->recv);
      break;
    case kReduceScatter:
      ok = Reduce(s, p, static_cast<size_t>(me) * o->count, o->count, o->dtype, o->op, o->recv);
      break;
    case kReduce:
      if (me == o->root) ok = Reduce(s, p, 0, o->count, o->dtype, o->op, o->recv);
      break;
    case kAllGather:
      for (int r = 0; r < p; ++r)
        std::memcpy(static_cast<char*>(o->recv) + static_cast<size_t>(r) * bytes, Slot(s, r),
                    bytes);
      break;
    case kBroadcast:
      if (bytes) std::memcpy(o->recv, Slot(s, o->root), bytes);
      break;
  }
  if (!ok) c->asyncError = 4;
  if (!Barrier(c)) c->asyncError = 6;
  delete o;
}

static int g_groupDepth = 0;
static std::vector<Op*> g_group;

static void Issue(Op* o) {
  if (g_enqueue)
    g_enqueue(o->stream, RunShared, o);
  else
    RunShared(o);
}

static int Record(Kind kind, const char* fn, const void* s, void* r, size_t n, int dt, int op,
                  int root, void* comm, void* stream, size_t recvElems) {
  InCall inCall(comm);
  CallDelay();
  std::memset(g_last.fn, 0, sizeof(g_last.fn));
  std::strncpy(g_last.fn, fn, sizeof(g_last.fn) - 1);
  g_last.send = s;
  g_last.recv = r;
  g_last.count = n;
  g_last.dtype = dt;
  g_last.op = op;
  g_last.root = root;
  g_last.comm = comm;
  g_last.stream = stream;
  ++g_last.calls;
  if (Ended(comm)) return 5;  // ncclInvalidUsage
  auto* c = static_cast<FakeNcclComm*>(comm);
  if (c->failWith) return c->failWith;
  if (!c->shared) {
    if (s && r && s != r) std::memcpy(r, s, recvElems * Size(dt));
    return 0;
  }
  Op* o = new Op{kind, s, r, n, dt, op, root, c, stream};
  if (g_groupDepth > 0)
    g_group.push_back(o);
  else
    Issue(o);
  return 0;
}

FAKE_API int ncclGetVersion(int* v) {
  *v = FAKE_NCCL_VERSION;
  return 0;
}
FAKE_API const char* ncclGetErrorString(int r) {
  return r == 0 ? "no error" : "fake NCCL error string";
}
FAKE_API const char* ncclGetLastError(void* comm) {
  if (Ended(comm)) return "fake NCCL: the communicator was destroyed or aborted";
  auto* c = static_cast<FakeNcclComm*>(comm);
  return c && c->failWith ? "fake NCCL: the last call failed on purpose" : "";
}
FAKE_API int ncclCommCount(void* comm, int* n) {
  if (Ended(comm)) return 5;
  *n = static_cast<FakeNcclComm*>(comm)->nranks;
  return 0;
}
FAKE_API int ncclCommUserRank(void* comm, int* r) {
  if (Ended(comm)) return 5;
  *r = static_cast<FakeNcclComm*>(comm)->rank;
  return 0;
}
FAKE_API int ncclCommGetAsyncError(void* comm, int* e) {
  if (Ended(comm)) return 5;
  *e = static_cast<FakeNcclComm*>(comm)->asyncError;
  return 0;
}
FAKE_API int ncclAllReduce(const void* s, void* r, size_t n, int dt, int op, void* comm,
                           void* stream) {
  return Record(kAllReduce, "ncclAllReduce", s, r, n, dt, op, -1, comm, stream, n);
}
FAKE_API int ncclReduceScatter(const void* s, void* r, size_t n, int dt, int op, void* comm,
                               void* stream) {
  return Record(kReduceScatter, "ncclReduceScatter", s, r, n, dt, op, -1, comm, stream, n);
}
#ifndef FAKE_NCCL_NO_ALLGATHER
FAKE_API int ncclAllGather(const void* s, void* r, size_t n, int dt, void* comm, void* stream) {
  return Record(kAllGather, "ncclAllGather", s, r, n, dt, -1, -1, comm, stream, n);
}
#endif
FAKE_API int ncclBroadcast(const void* s, void* r, size_t n, int dt, int root, void* comm,
                           void* stream) {
  return Record(kBroadcast, "ncclBroadcast", s, r, n, dt, -1, root, comm, stream, n);
}
#ifndef FAKE_NCCL_NO_GROUP
FAKE_API int ncclReduce(const void* s, void* r, size_t n, int dt, int op, int root, void* comm,
                        void* stream) {
  return Record(kReduce, "ncclReduce", s, r, n, dt, op, root, comm, stream, n);
}
FAKE_API int ncclGroupStart() {
  ++g_groupDepth;
  return 0;
}
FAKE_API int ncclGroupEnd() {
  if (g_groupDepth == 0) return 5;  // ncclInvalidUsage
  if (--g_groupDepth == 0) {
    std::vector<Op*> ops;
    ops.swap(g_group);
    for (Op* o : ops) Issue(o);
  }
  return 0;
}
#endif

#ifndef FAKE_NCCL_NO_INIT
// ---- communicators the library makes (scapeCommInitNcclRank / FromEnv) ----------------------
// An id names a POSIX shared-memory segment that ncclGetUniqueId creates (room for
// kFakeMaxRanks slots of kFakeSlotBytes); ncclCommInitRank maps it, makes a FakeNcclComm over
// it in the shared mode above and meets the other ranks at a barrier (with a deadline), after
// which rank 0 unlinks the name. So ranks that are separate processes (forked, or started by
// Python) really exchange data, as with fakeNcclSharedCreate. Test controls, read from the
// environment at ncclCommInitRank: FAKE_NCCL_INIT_FAIL_RANK=r makes rank r's call fail at once
// (ncclSystemError, without meeting the others; it unlinks the segment so that no name is left
// behind); FAKE_NCCL_NO_INIT_UNIQUE_ID=1 makes ncclGetUniqueId fail. Counters: fakeNcclCommsLive
// (made and not yet destroyed/aborted), fakeNcclCommsDestroyed, fakeNcclCommsAborted,
// fakeNcclLastInitNranks.
static const int kFakeMaxRanks = 8;
// 16 MiB a rank (the segment is sparse: only what the collectives write takes memory); the
// dry run's teardown check all-reduces 262147 floats (1 MiB + 12 bytes) on such communicators.
static const size_t kFakeSlotBytes = size_t{16} << 20;
static const char kFakeIdMagic[] = "fake-nccl-id";

struct FakeUniqueId {
  char internal[128];
};

static std::atomic<int> g_live{0}, g_destroyed{0}, g_aborted{0}, g_lastInitNranks{0};

FAKE_API int fakeNcclCommsLive() { return g_live.load(); }
FAKE_API int fakeNcclCommsDestroyed() { return g_destroyed.load(); }
FAKE_API int fakeNcclCommsAborted() { return g_aborted.load(); }
FAKE_API int fakeNcclLastInitNranks() { return g_lastInitNranks.load(); }

static size_t SegmentBytes() {
  return sizeof(FakeNcclShared) + static_cast<size_t>(kFakeMaxRanks) * kFakeSlotBytes;
}

FAKE_API int ncclGetUniqueId(FakeUniqueId* id) {
  const char* no = getenv("FAKE_NCCL_NO_INIT_UNIQUE_ID");
  if (no && *no == '1') return 2;  // ncclSystemError
  static std::atomic<unsigned> seq{0};
  std::memset(id, 0, sizeof(*id));
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  char name[64];
  snprintf(name, sizeof(name), "/fakenccl-%d-%u-%ld", static_cast<int>(getpid()), seq++,
           static_cast<long>(t.tv_nsec));
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return 2;
  if (ftruncate(fd, static_cast<off_t>(SegmentBytes())) != 0) {
    close(fd);
    shm_unlink(name);
    return 2;
  }
  void* p = mmap(nullptr, SegmentBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name);
    return 2;
  }
  auto* sh = new (p) FakeNcclShared();
  sh->arrived.store(0);
  sh->slotBytes = kFakeSlotBytes;
  sh->nranks = 0;
  munmap(p, SegmentBytes());
  std::memcpy(id->internal, kFakeIdMagic, sizeof(kFakeIdMagic));
  std::strncpy(id->internal + 16, name, 100);
  return 0;
}

FAKE_API int ncclCommInitRank(void** comm, int nranks, FakeUniqueId id, int rank) {
  if (!comm || nranks < 1 || nranks > kFakeMaxRanks || rank < 0 || rank >= nranks) return 4;
  if (std::memcmp(id.internal, kFakeIdMagic, sizeof(kFakeIdMagic)) != 0) return 4;
  char name[101];
  std::memcpy(name, id.internal + 16, 100);
  name[100] = 0;
  const char* fail = getenv("FAKE_NCCL_INIT_FAIL_RANK");
  if (fail && *fail && atoi(fail) == rank) {
    shm_unlink(name);  // nothing is left behind in /dev/shm by the ranks that wait for it
    return 2;
  }
  int fd = shm_open(name, O_RDWR, 0600);
  if (fd < 0) return 2;
  void* p = mmap(nullptr, SegmentBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return 2;
  auto* sh = static_cast<FakeNcclShared*>(p);
  sh->nranks = nranks;
  auto* c = new FakeNcclComm{nranks, rank, 0, 0, sh, 0, 20000, 0};
  const bool met = Barrier(c);  // every rank has mapped the segment
  if (rank == 0) shm_unlink(name);
  if (!met) {
    munmap(p, SegmentBytes());
    delete c;
    return 6;  // ncclRemoteError
  }
  g_lastInitNranks.store(nranks);
  ++g_live;
  *comm = c;
  return 0;
}

static int EndComm(void* comm, std::atomic<int>* counter) {
  auto* c = static_cast<FakeNcclComm*>(comm);
  if (!c) return 4;
  if (Ended(c)) return 5;  // ended twice
  {
    // Poisoned, not freed (the struct and its segment stay: g_ended keeps them reachable).
    std::lock_guard<std::mutex> lk(g_endedMu);
    g_ended.insert(c);
    auto it = g_inCall.find(c);
    if (it != g_inCall.end() && it->second > 0) ++g_endedDuringCall;
  }
  --g_live;
  ++*counter;
  return 0;
}

FAKE_API int ncclCommDestroy(void* comm) { return EndComm(comm, &g_destroyed); }
FAKE_API int ncclCommAbort(void* comm) { return EndComm(comm, &g_aborted); }
#endif  // FAKE_NCCL_NO_INIT

}  // extern "C"
