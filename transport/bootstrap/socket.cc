#include "transport/bootstrap/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace scape {
namespace bootstrap {

std::string SockAddr::ToString() const {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return StrFormat("%s:%u", host, ntohs(a->sin_port));
  }
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return StrFormat("[%s]:%u", host, ntohs(a->sin6_port));
  }
  return "<unknown address>";
}

uint16_t SockAddr::port() const {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

void SockAddr::set_port(uint16_t p) {
  if (ss.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&ss)->sin_port = htons(p);
  if (ss.ss_family == AF_INET6) reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = htons(p);
}

bool IsLoopback(const SockAddr& addr) {
  if (addr.ss.ss_family == AF_INET) {
    uint32_t a = ntohl(reinterpret_cast<const sockaddr_in*>(&addr.ss)->sin_addr.s_addr);
    return (a >> 24) == 127;
  }
  if (addr.ss.ss_family == AF_INET6)
    return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(&addr.ss)->sin6_addr);
  return false;
}

Status InterfaceAddress(const std::string& ifname, SockAddr* out, std::string* chosen) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return ErrnoError("getifaddrs", errno);
  // Two passes: IPv4 first, then IPv6 (link-local IPv6 is skipped: it needs a scope id).
  const ifaddrs* best = nullptr;
  for (int family : {AF_INET, AF_INET6}) {
    for (const ifaddrs* i = list; i && !best; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != family) continue;
      if (!(i->ifa_flags & IFF_UP)) continue;
      if (family == AF_INET6 &&
          IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr))
        continue;
      if (!ifname.empty()) {
        if (ifname == i->ifa_name) best = i;
      } else if (!(i->ifa_flags & IFF_LOOPBACK) && std::strncmp(i->ifa_name, "docker", 6) != 0) {
        best = i;
      }
    }
    if (best) break;
  }
  if (!best && ifname.empty()) {  // nothing but loopback: use it
    for (const ifaddrs* i = list; i && !best; i = i->ifa_next)
      if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_LOOPBACK))
        best = i;
  }
  if (!best) {
    freeifaddrs(list);
    return SystemError(ifname.empty()
                           ? std::string("no network interface is up")
                           : StrFormat("network interface '%s' (SCAPE_SOCKET_IFNAME) not found, "
                                       "not up, or without an address",
                                       ifname.c_str()));
  }
  out->len = best->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  std::memset(&out->ss, 0, sizeof(out->ss));
  std::memcpy(&out->ss, best->ifa_addr, out->len);
  out->set_port(0);
  if (chosen) *chosen = best->ifa_name;
  freeifaddrs(list);
  return Status::Ok();
}

Status ResolveHost(const std::string& host, uint16_t port, SockAddr* out) {
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res)
    return SystemError(StrFormat("cannot resolve host '%s': %s", host.c_str(), gai_strerror(rc)));
  const addrinfo* pick = res;
  for (const addrinfo* a = res; a; a = a->ai_next)
    if (a->ai_family == AF_INET) {
      pick = a;
      break;
    }
  std::memset(&out->ss, 0, sizeof(out->ss));
  std::memcpy(&out->ss, pick->ai_addr, pick->ai_addrlen);
  out->len = static_cast<socklen_t>(pick->ai_addrlen);
  out->set_port(port);
  freeaddrinfo(res);
  return Status::Ok();
}

void Socket::Close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

static Status SetNonBlocking(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return ErrnoError("fcntl", errno);
  return Status::Ok();
}

static int PollMs(const Deadline& dl) {
  int64_t r = dl.RemainingMs();
  return static_cast<int>(r > 1000 ? 1000 : (r < 1 ? 1 : r));
}

Status Socket::Listen(SockAddr* addr, Socket* out) {
  Socket s(::socket(addr->ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) return ErrnoError("socket", errno);
  int one = 1;
  setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(s.fd(), reinterpret_cast<sockaddr*>(&addr->ss), addr->len) != 0)
    return ErrnoError("bind " + addr->ToString(), errno);
  if (::listen(s.fd(), 1024) != 0) return ErrnoError("listen", errno);
  socklen_t len = sizeof(addr->ss);
  if (getsockname(s.fd(), reinterpret_cast<sockaddr*>(&addr->ss), &len) != 0)
    return ErrnoError("getsockname", errno);
  addr->len = len;
  SCAPE_RETURN_IF_ERROR(SetNonBlocking(s.fd()));
  *out = std::move(s);
  return Status::Ok();
}

Status Socket::Connect(const SockAddr& addr, const Deadline& dl, Socket* out) {
  int lastErr = 0;
  int backoffMs = 5;
  while (!dl.Expired()) {
    Socket s(::socket(addr.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!s.valid()) return ErrnoError("socket", errno);
    SCAPE_RETURN_IF_ERROR(SetNonBlocking(s.fd()));
    int rc = ::connect(s.fd(), reinterpret_cast<const sockaddr*>(&addr.ss), addr.len);
    if (rc != 0 && errno == EINPROGRESS) {
      struct pollfd p = {s.fd(), POLLOUT, 0};
      int pr = poll(&p, 1, static_cast<int>(dl.RemainingMs() + 1));
      if (pr > 0) {
        int err = 0;
        socklen_t el = sizeof(err);
        getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &el);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        rc = -1;
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0) {
      int one = 1;
      setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      *out = std::move(s);
      return Status::Ok();
    }
    lastErr = errno;
    if (lastErr != ECONNREFUSED && lastErr != ETIMEDOUT && lastErr != ECONNRESET &&
        lastErr != EAGAIN)
      return ErrnoError("connect to " + addr.ToString(), lastErr);
    usleep(static_cast<useconds_t>(backoffMs) * 1000);
    if (backoffMs < 200) backoffMs *= 2;
  }
  return TimeoutError(
      StrFormat("could not connect to the bootstrap root at %s before the "
                "timeout (last error: %s)",
                addr.ToString().c_str(), std::strerror(lastErr)));
}

Status Socket::Accept(const Deadline& dl, Socket* out) const {
  while (true) {
    int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      *out = Socket(fd);
      return Status::Ok();
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return ErrnoError("accept", errno);
    if (dl.Expired()) return TimeoutError("no connection before the deadline");
    struct pollfd p = {fd_, POLLIN, 0};
    poll(&p, 1, PollMs(dl));
  }
}

Status Socket::SendAll(const void* buf, size_t len, const Deadline& dl) const {
  const char* p = static_cast<const char*>(buf);
  while (len > 0) {
    ssize_t n = ::send(fd_, p, len, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      return ErrnoError("send", errno);
    if (dl.Expired()) return TimeoutError("send timed out");
    struct pollfd pf = {fd_, POLLOUT, 0};
    poll(&pf, 1, PollMs(dl));
  }
  return Status::Ok();
}

Status Socket::RecvAll(void* buf, size_t len, const Deadline& dl) const {
  char* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t n = ::recv(fd_, p, len, 0);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return RemoteError("connection closed by peer");
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return ErrnoError("recv", errno);
    if (dl.Expired()) return TimeoutError("receive timed out");
    struct pollfd pf = {fd_, POLLIN, 0};
    poll(&pf, 1, PollMs(dl));
  }
  return Status::Ok();
}

}  // namespace bootstrap
}  // namespace scape
