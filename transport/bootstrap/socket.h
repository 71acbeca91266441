// Small TCP socket layer for the bootstrap: every blocking step has a deadline.
#ifndef SCAPE_TRANSPORT_BOOTSTRAP_SOCKET_H_
#define SCAPE_TRANSPORT_BOOTSTRAP_SOCKET_H_

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/clock.h"
#include "base/status.h"

namespace scape {
namespace bootstrap {

// An IPv4 or IPv6 socket address.
struct SockAddr {
  sockaddr_storage ss{};
  socklen_t len = 0;
  std::string ToString() const;
  uint16_t port() const;
  void set_port(uint16_t p);
};

// Address of interface `ifname` (IPv4 preferred). If ifname is empty: the first interface that
// is up and not loopback, else loopback. *chosen receives the interface name.
Status InterfaceAddress(const std::string& ifname, SockAddr* out, std::string* chosen);
// Resolves "host" (name or literal) to an address with the given port.
Status ResolveHost(const std::string& host, uint16_t port, SockAddr* out);
// True if `addr` belongs to the loopback range (127.0.0.0/8 or ::1).
bool IsLoopback(const SockAddr& addr);

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { Close(); }
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) {
      Close();
      fd_ = o.fd_;
      o.fd_ = -1;
    }
    return *this;
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void Close();

  // Listens on `addr` (port 0: any free port; the bound address is written back).
  static Status Listen(SockAddr* addr, Socket* out);
  // Connects, retrying refused connections until the deadline (the listener may start late).
  static Status Connect(const SockAddr& addr, const Deadline& dl, Socket* out);
  // Accepts one connection; returns a Timeout status if none arrives before `dl`.
  Status Accept(const Deadline& dl, Socket* out) const;

  Status SendAll(const void* buf, size_t len, const Deadline& dl) const;
  Status RecvAll(void* buf, size_t len, const Deadline& dl) const;

 private:
  int fd_ = -1;
};

}  // namespace bootstrap
}  // namespace scape

#endif  // SCAPE_TRANSPORT_BOOTSTRAP_SOCKET_H_
