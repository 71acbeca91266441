// A fake libnccl.so for the NCCL-backend tests: the NCCL 2.x C entry points the backend
// resolves, with NCCL's ABI (enums as int, ncclComm_t and cudaStream_t as pointers). Each
// collective records its arguments (fakeNcclLastCall) and, as a 1-rank NCCL would, copies
// send to receive. A "communicator" is a FakeNcclComm the test makes. Built in three flavours:
// complete, without ncclAllGather (FAKE_NCCL_NO_ALLGATHER), and reporting an old version
// (FAKE_NCCL_VERSION).
#include <cstddef>
#include <cstring>

#ifndef FAKE_NCCL_VERSION
#define FAKE_NCCL_VERSION 22809
#endif

extern "C" {

struct FakeNcclComm {
  int nranks;
  int rank;
  int failWith;    // returned by the next collective (0: success)
  int asyncError;  // reported by ncclCommGetAsyncError
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

static FakeNcclCall g_last;

__attribute__((visibility("default"))) const FakeNcclCall* fakeNcclLastCall() { return &g_last; }

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
    default:
      return 0;
  }
}

static int Record(const char* fn, const void* s, void* r, size_t n, int dt, int op, int root,
                  void* comm, void* stream, size_t recvElems) {
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
  auto* c = static_cast<FakeNcclComm*>(comm);
  if (c->failWith) return c->failWith;
  if (s && r && s != r) std::memcpy(r, s, recvElems * Size(dt));
  return 0;
}

__attribute__((visibility("default"))) int ncclGetVersion(int* v) {
  *v = FAKE_NCCL_VERSION;
  return 0;
}
__attribute__((visibility("default"))) const char* ncclGetErrorString(int r) {
  return r == 0 ? "no error" : "fake NCCL error string";
}
__attribute__((visibility("default"))) const char* ncclGetLastError(void* comm) {
  auto* c = static_cast<FakeNcclComm*>(comm);
  return c && c->failWith ? "fake NCCL: the last call failed on purpose" : "";
}
__attribute__((visibility("default"))) int ncclCommCount(void* comm, int* n) {
  *n = static_cast<FakeNcclComm*>(comm)->nranks;
  return 0;
}
__attribute__((visibility("default"))) int ncclCommUserRank(void* comm, int* r) {
  *r = static_cast<FakeNcclComm*>(comm)->rank;
  return 0;
}
__attribute__((visibility("default"))) int ncclCommGetAsyncError(void* comm, int* e) {
  *e = static_cast<FakeNcclComm*>(comm)->asyncError;
  return 0;
}
__attribute__((visibility("default"))) int ncclAllReduce(const void* s, void* r, size_t n, int dt,
                                                         int op, void* comm, void* stream) {
  return Record("ncclAllReduce", s, r, n, dt, op, -1, comm, stream, n);
}
__attribute__((visibility("default"))) int ncclReduceScatter(const void* s, void* r, size_t n,
                                                             int dt, int op, void* comm,
                                                             void* stream) {
  return Record("ncclReduceScatter", s, r, n, dt, op, -1, comm, stream, n);
}
#ifndef FAKE_NCCL_NO_ALLGATHER
__attribute__((visibility("default"))) int ncclAllGather(const void* s, void* r, size_t n, int dt,
                                                         void* comm, void* stream) {
  return Record("ncclAllGather", s, r, n, dt, -1, -1, comm, stream, n);
}
#endif
__attribute__((visibility("default"))) int ncclBroadcast(const void* s, void* r, size_t n, int dt,
                                                         int root, void* comm, void* stream) {
  return Record("ncclBroadcast", s, r, n, dt, -1, root, comm, stream, n);
}

}  // extern "C"
