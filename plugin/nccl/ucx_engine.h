// The UCX engine behind the NCCL net plugin (plugin/nccl/): connection setup over an
// out-of-band TCP socket (net_connect.cc), UCP tagged transfers, requests, memory handles
// (ucx_engine.cc), over the UCX layer it shares with the library's transport
// (transport/ucx/ucx_layer.h: contexts, workers, endpoints, failure reports, the UCX 1.13 rule).
// It knows nothing of NCCL's types; plugin/nccl/net_v11.cc checks NCCL's arguments and
// translates Status codes.
//
// Objects and ownership:
// - NetContext: one per plugin init (one per NCCL communicator). Owns one UCP worker per
//   device it used (created on first use; device 0's at creation, to fail early). UCP contexts
//   are per device and shared by every NetContext of the process.
// - ListenComm / SendComm / RecvComm: created by Listen / Connect / Accept, freed by the Close
//   functions. A comm keeps its worker alive, so a comm may outlive its NetContext.
// - MemRegion: RegMr / DeregMr. Request: Isend / Irecv, released by the Test that reports it
//   done.
// Every object starts with a magic value; the As* functions check it before a pointer that came
// back from the caller is used (a best-effort check against stale or foreign pointers).
//
// Connection protocol (nothing from the network is trusted; every read is size-checked):
// - Listen opens a TCP listener and writes a 128-byte handle: magic, version, the listener's
//   socket address, a random listen id, a host id, a checksum, and scratch space where Connect
//   keeps its retry state (a token naming its state machine, never a raw pointer).
// - Connect (non-blocking; *out stays null until done): TCP connect, send a hello (magic,
//   version, listen id), read the reply (status, receive-comm id, UCX worker address), create the
//   UCP endpoint, then (when the endpoint asks for failure reports: the hello's handshake
//   flag) send one synchronous 8-byte UCX handshake message (tag: 0 in the comm-id
//   half, the receive-comm id below; payload: derived from the listen id and comm id). Accept
//   (non-blocking): take connections, read hellos, refuse a wrong listen id, create the receive
//   comm, post the handshake receive, send the reply, and wait for the handshake. The handshake
//   makes UCX finish its wire-up (REQ/REP) while both sides are alive, before either comm is
//   handed out: UCX 1.13 aborts when a wire-up reply meets a dead peer (issue 15, defect 9).
//   Both give up after Options::timeoutMs (or as soon as the setup connection breaks).
// - The TCP connection stays open for the life of the comm pair as a liveness channel: when it
//   breaks, requests still pending a grace period later fail with scapeRemoteError.
// - Data: UCP tagged messages; tag = (receive-comm id << 32) | NCCL tag. UCX matches messages
//   with the same tag in order, which is NCCL's "match in posting order" per sender tag.
// - Peers on the same host use UCP_ERR_HANDLING_MODE_NONE so UCX 1.13 may use shared memory;
//   other peers use UCP_ERR_HANDLING_MODE_PEER.
//
// Thread safety: every call is safe from any thread. All calls on comms of one worker are
// serialised by that worker's mutex.
//
// Known limitation (issue 44 item 6, not fixed): the comms of one device share that device's
// UCP worker. Closing a receive comm cancels its receives still in flight and waits for them
// at most kCancelWaitNs (1 s, DrainRequests); a receive UCX has not ended by then is released
// to UCX (ucp_request_free: freed when it completes) and the comm is freed. Its buffer is
// NCCL's, which NCCL may free or reuse once closeRecv returns; a later progress of the shared
// worker (by another comm of the device) can still complete that receive into it (only a
// receive whose cancel UCX did not honour within 1 s: a rendezvous already under way with a
// peer that stopped mid-transfer). A worker per receive comm would bound it to the comm's own
// lifetime at the cost of a worker (threads, memory) per connection; the device script does
// not exercise it.
#ifndef SCAPE_PLUGIN_NCCL_UCX_ENGINE_H_
#define SCAPE_PLUGIN_NCCL_UCX_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/param.h"
#include "base/status.h"

namespace scape {
namespace ucxnet {

constexpr int kMaxRecvs = 8;                              // buffers in one grouped receive
constexpr int kRecvRequests = 32;                         // requests in flight per receive comm
constexpr int kSendRequests = kRecvRequests * kMaxRecvs;  // ... per send comm
constexpr size_t kHandleBytes = 128;

enum class MemType { kHost, kCuda };

// How one plugin device reaches the network.
struct DeviceRoute {
  std::string ucxNetDevices;  // UCX NET_DEVICES for this device ("" = UCX's default)
  int rails = 1;              // > 1 for a device merged from several NICs
  std::string oobIfname;      // interface of the out-of-band TCP listener ("" = first up
                              // non-loopback interface, else loopback)
};

struct Options {
  std::string tls;                    // UCX TLS ("" = UCX's default)
  bool setNetDevices = true;          // false when the user set UCX_NET_DEVICES: leave it alone
  int timeoutMs = kDefaultTimeoutMs;  // connection setup deadline; bound on the flush at close
  int peerGraceMs = 1000;             // a pending request fails this long after the peer is gone
};

struct NetContext;
struct ListenComm;
struct SendComm;
struct RecvComm;
struct MemRegion;
struct Request;

// Creates a context and device `dev0`'s worker (fails if UCX cannot start on that device).
// `options.tls` and `options.setNetDevices` are fixed by the first call in the process (UCP
// contexts are shared); the timeouts are the context's own.
Status NewNetContext(const Options& options, int dev0, const DeviceRoute& route0, NetContext** out);
// Frees the context and abandons its unfinished Connects. Comms stay valid.
void DeleteNetContext(NetContext* ctx);
// True if the UCP context of device `dev` (created by NewNetContext or a Listen/Connect on it)
// can move CUDA memory.
bool CudaSupported(const NetContext* ctx, int dev);
// UCX's version string, for logs.
const char* UcxVersion();

Status Listen(NetContext* ctx, int dev, const DeviceRoute& route, void* handle, ListenComm** out);
// Non-blocking: *out stays null until the connection is ready (call again with the same
// handle). On error the handle's retry state is cleared.
Status Connect(NetContext* ctx, int dev, const DeviceRoute& route, void* handle, SendComm** out);
// Non-blocking: *out stays null until a sender has connected. `note` (optional) receives the
// reason when a bad incoming connection was dropped (the listener keeps listening).
Status Accept(ListenComm* lc, RecvComm** out, std::string* note);
void CloseListen(ListenComm* lc);
// Closing with requests in flight cancels them; their buffers are not touched afterwards.
Status CloseSend(SendComm* sc);
Status CloseRecv(RecvComm* rc);

// The checks Connect runs on a 128-byte listen handle that came from the peer (magic, version,
// checksum, address family and length, port), without connecting: for tests and fuzzing.
// *peer (optional) receives the listener's address as text.
Status ValidateConnectHandle(const void* handle, std::string* peer);

// Memory handles (comm is a SendComm or RecvComm).
Status RegMr(void* comm, void* data, size_t size, MemType type, MemRegion** out);
Status DeregMr(void* comm, MemRegion* mr);

// Non-blocking posts; *req == nullptr (and Ok) means "no free request slot, try again".
Status Isend(SendComm* sc, const void* data, size_t size, int tag, const MemRegion* mr,
             Request** req);
Status Irecv(RecvComm* rc, int n, void* const* data, const size_t* sizes, const int* tags,
             MemRegion* const* mrs, Request** req);
// Progresses the comm's worker. When *done, the request is released and sizes[0..n) (for a
// send: sizes[0]) hold the transferred sizes; *n (optional) gets n. A failed transfer returns
// its error; when the peer is gone the request stays pending (freed by the comm's Close).
Status Test(Request* req, bool* done, size_t* sizes, int* n);
// Number of requests in flight on a comm, and a description of its peer (for logs).
int RequestsInFlight(void* comm);
std::string CommInfo(void* comm);

// Live-object registry: every object handed out (contexts, comms, memory regions, request
// slots, and the shims' own contexts) is registered while it exists, and the As* checks look a
// pointer up before reading through it, so a stale pointer (a second deregMr, close or
// finalize) is refused without touching freed memory.
void RegisterLive(const void* p);
void UnregisterLive(const void* p);
bool IsLive(const void* p);

// Pointer checks for values handed back by the caller (null if not a live object of the type).
NetContext* AsNetContext(void* p);
ListenComm* AsListenComm(void* p);
SendComm* AsSendComm(void* p);
RecvComm* AsRecvComm(void* p);
MemRegion* AsMemRegion(void* p);
Request* AsRequest(void* p);
// Bounds of a region (for argument checks).
void MemRegionBounds(const MemRegion* mr, uintptr_t* base, size_t* len, MemType* type);

}  // namespace ucxnet
}  // namespace scape

#endif  // SCAPE_PLUGIN_NCCL_UCX_ENGINE_H_
