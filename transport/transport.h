// The endpoint interface every algorithm talks to. One Transport object is one rank's view of
// the network for one communicator: it publishes an opaque address blob, connects to peers from
// theirs, and moves contiguous buffers with tagged, non-blocking sends and receives.
//
// Contract:
// - Isend/Irecv return a Request the caller owns (unique_ptr). The buffer must stay valid and
//   untouched until Test reports the request complete. Destroying an incomplete receive
//   cancels it and returns once the transport no longer writes into its buffer (a copy already
//   under way is waited for, bounded; the "Nothing blocks" rule below has this one exception);
//   destroying an incomplete send is allowed only after CloseAll(force=true) or when the peer
//   has failed (the transport then no longer touches the buffer).
// - Receives match on (tag & tagMask) == (wantedTag & tagMask); messages from one peer with
//   the same tag are matched in the order they were sent. RecvInfo reports the sender's full
//   tag and the received length.
// - Nothing blocks: Test and Progress return at once. WaitForEvent sleeps at most timeoutMs.
// - A peer whose connection fails is reported by PeerFailed; requests to it fail.
// - Not thread-safe: one thread drives a Transport at a time.
#ifndef SCAPE_TRANSPORT_TRANSPORT_H_
#define SCAPE_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/param.h"
#include "base/status.h"

namespace scape {
namespace transport {

struct RecvInfo {
  uint64_t senderTag = 0;
  size_t length = 0;
};

class Request {
 public:
  virtual ~Request() = default;
  int peer() const { return peer_; }
  bool isRecv() const { return isRecv_; }

 protected:
  Request(int peer, bool isRecv) : peer_(peer), isRecv_(isRecv) {}

 private:
  int peer_;
  bool isRecv_;
};

struct TransportOptions {
  int rank = 0;
  int nranks = 1;
  int timeoutMs = kDefaultTimeoutMs;
  bool wakeup = false;     // enable WaitForEvent (blocking progress)
  std::string netDevices;  // UCX NET_DEVICES; empty: UCX default
  std::string tls;         // UCX TLS; empty: UCX default
};

class Transport {
 public:
  virtual ~Transport() = default;

  // Opaque address of this rank, to be handed to peers by the bootstrap.
  virtual const std::vector<uint8_t>& LocalAddress() const = 0;
  // Creates the endpoint to `peer` from the blob it published. Validates the blob's size.
  // `sameHost`: the peer runs on this host. The transport may then use channels (shared
  // memory) that cannot report a peer's death; the caller watches such peers itself
  // (MarkPeerFailed).
  virtual Status Connect(int peer, const uint8_t* blob, size_t len, bool sameHost) = 0;
  // Records that `peer` is gone (found by the caller); its requests fail from now on.
  virtual void MarkPeerFailed(int peer, const std::string& why) = 0;

  virtual Status Isend(int peer, uint64_t tag, const void* buf, size_t len,
                       std::unique_ptr<Request>* req) = 0;
  // `peer` is only used for failure reporting; matching is by tag.
  virtual Status Irecv(int peer, uint64_t tag, uint64_t tagMask, void* buf, size_t len,
                       std::unique_ptr<Request>* req) = 0;

  // *done = true when the request completed; a failed transfer returns its error (with done
  // set). For receives, `info` (optional) gets the sender tag and length.
  virtual Status Test(Request* req, bool* done, RecvInfo* info = nullptr) = 0;

  // Makes progress on all outstanding operations; returns true if anything happened.
  virtual bool Progress() = 0;
  // Sleeps until the network has an event or timeoutMs passes. Returns false if this
  // transport cannot sleep on events (the caller then yields instead).
  virtual bool WaitForEvent(int timeoutMs) = 0;

  // Looks, without receiving it, for a message that arrived with no receive posted for it and
  // whose tag matches (tag & tagMask) == (wantedTag & tagMask); true (with its full tag) if
  // there is one. Used to find peers that run a different collective than this rank.
  virtual bool Probe(uint64_t wantedTag, uint64_t tagMask, uint64_t* senderTag) {
    (void)wantedTag;
    (void)tagMask;
    (void)senderTag;
    return false;
  }

  // True (with a reason) once the connection to `peer` has failed.
  virtual bool PeerFailed(int peer, std::string* why) const = 0;

  // True when Isend / Irecv accept CUDA device memory as well as host memory (UCX built with
  // CUDA support reports it; Debian's UCX does not). The device path then moves device buffers
  // without staging them through host memory wherever no host reduction is needed.
  virtual bool DeviceMemory() const { return false; }

  // Asks the destructor to close the endpoints but leave the network library's worker and
  // context in place (leaked): after a peer on this host died mid-transfer, UCX 1.13 can
  // abort the process while destroying them (arbiter.c: "ucs_arbiter_group_is_empty").
  virtual void LeakOnDestroy() {}

  // Closes every endpoint: flushing (bounded by the timeout) or forcibly (pending sends fail).
  virtual void CloseAll(bool force) = 0;
};

std::unique_ptr<Transport> CreateUcxTransport(const TransportOptions& opts, Status* st);

}  // namespace transport
}  // namespace scape

#endif  // SCAPE_TRANSPORT_TRANSPORT_H_
