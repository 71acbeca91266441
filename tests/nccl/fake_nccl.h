// A fake NCCL for the net plugin tests: loads libnccl-net-scape.so exactly as NCCL 2.28 does
// (dlopen RTLD_NOW|RTLD_LOCAL, dlsym ncclNetPlugin_vN), captures what the plugin logs through
// the logger it was given, and drives connections and transfers the way NCCL's proxy threads
// do (connect/accept and isend/irecv retried while they return NULL, test polled).
//
// Processes: every test body that loads the plugin runs in a forked child (RunProcs), never in
// the gtest process itself, so a process never forks after UCX has started threads. RunProcs
// has a watchdog that kills every child that outlives it. Every wait has a deadline.
#ifndef SCAPE_TESTS_NCCL_FAKE_NCCL_H_
#define SCAPE_TESTS_NCCL_FAKE_NCCL_H_

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "plugin/nccl/net_abi.h"

namespace fake_nccl {

// ---- loading ----------------------------------------------------------------------------------
struct Plugin {
  void* lib = nullptr;
  ncclNet_v11_t* v11 = nullptr;
  ncclNet_v10_t* v10 = nullptr;
  ncclNet_v9_t* v9 = nullptr;
  ncclNet_v8_t* v8 = nullptr;
};
// dlopen + dlsym of every version. False (with the reason) on failure.
bool LoadPlugin(Plugin* p, std::string* err);

// ---- logging ----------------------------------------------------------------------------------
struct LogLine {
  int level;
  unsigned long flags;
  std::string text;
  std::string file;  // the source location the plugin passed
  int line = 0;
};
// The logger handed to init: records every line (and echoes WARNs to stderr).
void Logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
            const char* fmt, ...);
std::vector<LogLine> Logs();
void ClearLogs();
// True if a line of `level` whose text contains every needle was logged.
bool Logged(int level, const std::vector<std::string>& needles);

// ---- processes --------------------------------------------------------------------------------
// Runs each body in its own forked child; a body returns true on success (a failed gtest
// expectation in the child also counts as failure). Kills all children after watchdogMs.
// Returns true if every child exited 0; *report describes what happened otherwise.
bool RunProcs(const std::vector<std::function<bool()>>& bodies, int watchdogMs,
              std::string* report);

// In a child: skip LeakSanitizer's check at the end of this body (for the pre-v11 ABIs, whose
// shared context cannot be finalized and so lives until the process exits).
void SkipLeakCheck();

// A one-way byte channel between processes (a pipe made before fork).
class Pipe {
 public:
  Pipe();
  ~Pipe();
  bool Write(const void* buf, size_t len, int timeoutMs) const;
  bool Read(void* buf, size_t len, int timeoutMs) const;
  bool WriteU64(uint64_t v, int timeoutMs = 30000) const { return Write(&v, sizeof(v), timeoutMs); }
  bool ReadU64(uint64_t* v, int timeoutMs = 30000) const { return Read(v, sizeof(*v), timeoutMs); }

 private:
  int fd_[2];
};

// ---- driving the plugin as NCCL's proxy does ---------------------------------------------------
constexpr int kTimedOut = -1;  // returned instead of an ncclResult_t when a deadline passes

// init with the capturing logger, NULL profiler, commId and traffic class.
ncclResult_t InitCtx(const ncclNet_v11_t* net, void** ctx, uint64_t commId = 0x1234);

// A loaded plugin with one initialised v11 context (what each test process starts with).
struct Env {
  Plugin p;
  void* ctx = nullptr;
  const ncclNet_v11_t* net = nullptr;
  // Loads the plugin and initialises the context; a gtest failure with the reason if not.
  bool Up() {
    std::string err;
    if (!LoadPlugin(&p, &err)) {
      ADD_FAILURE() << err;
      return false;
    }
    net = p.v11;
    ncclResult_t r = InitCtx(net, &ctx);
    if (r != ncclSuccess || !ctx) {
      ADD_FAILURE() << "init returned " << r;
      return false;
    }
    return true;
  }
  bool Down() { return net->finalize(ctx) == ncclSuccess; }
  // Device 0's maxRecvs (1 if the query fails).
  int MaxRecvs() {
    ncclNetProperties_v11_t pr;
    return net->getProperties(0, &pr) == ncclSuccess ? pr.maxRecvs : 1;
  }
};
// connect until *sendComm != NULL, an error, or the deadline.
int PollConnect(const ncclNet_v11_t* net, void* ctx, int dev, void* handle, void** sendComm,
                int timeoutMs = 20000);
// accept until *recvComm != NULL, an error, or the deadline.
int PollAccept(const ncclNet_v11_t* net, void* listenComm, void** recvComm, int timeoutMs = 20000);
// In one process: connect and accept interleaved on one thread (like one proxy thread).
int PollConnectAccept(const ncclNet_v11_t* net, void* ctx, int dev, void* handle, void* listenComm,
                      void** sendComm, void** recvComm, int timeoutMs = 20000);
// isend/irecv retried while the request comes back NULL.
int PostSend(const ncclNet_v11_t* net, void* comm, void* data, size_t size, int tag, void* mh,
             void** req, int timeoutMs = 20000);
int PostRecv(const ncclNet_v11_t* net, void* comm, int n, void** data, size_t* sizes, int* tags,
             void** mhs, void** req, int timeoutMs = 20000);
// test until done, an error, or the deadline. sizes may be NULL.
int WaitReq(const ncclNet_v11_t* net, void* req, int* sizes, int timeoutMs = 20000);

// ---- data -------------------------------------------------------------------------------------
void Fill(void* buf, size_t len, uint64_t seed);
// Index of the first byte that differs from Fill(seed), or len if all match.
size_t FirstMismatch(const void* buf, size_t len, uint64_t seed);

// Open file descriptors of this process; heap bytes in use (mallinfo2).
int CountFds();
size_t HeapInUse();

}  // namespace fake_nccl

// Checks for bodies that return bool (ASSERT_* cannot return a value).
#define REQUIRE(cond)                            \
  do {                                           \
    if (!(cond)) {                               \
      ADD_FAILURE() << "REQUIRE failed: " #cond; \
      return false;                              \
    }                                            \
  } while (0)
#define REQUIRE_EQ(a, b)                                               \
  do {                                                                 \
    auto _a = (a);                                                     \
    auto _b = (b);                                                     \
    if (!(_a == _b)) {                                                 \
      ADD_FAILURE() << #a " = " << _a << ", expected " #b " = " << _b; \
      return false;                                                    \
    }                                                                  \
  } while (0)
#define REQUIRE_OK(expr) REQUIRE_EQ(static_cast<int>(expr), static_cast<int>(ncclSuccess))
// Runs bodies in child processes under a watchdog and fails the test if any child failed.
#define RUN_PROCS(watchdogMs, ...)                                        \
  do {                                                                    \
    std::string _rep;                                                     \
    bool _ok = ::fake_nccl::RunProcs({__VA_ARGS__}, (watchdogMs), &_rep); \
    EXPECT_TRUE(_ok) << _rep;                                             \
  } while (0)

#endif  // SCAPE_TESTS_NCCL_FAKE_NCCL_H_
