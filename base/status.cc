#include "base/status.h"

#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace scape {

std::string StrFormat(const char* fmt, ...) {
  char small[512];
  va_list ap;
  va_start(ap, fmt);
  int n = std::vsnprintf(small, sizeof(small), fmt, ap);
  va_end(ap);
  if (n < 0) return std::string(fmt);
  if (static_cast<size_t>(n) < sizeof(small)) return std::string(small, static_cast<size_t>(n));
  std::string out(static_cast<size_t>(n) + 1, '\0');
  va_start(ap, fmt);
  std::vsnprintf(&out[0], out.size(), fmt, ap);
  va_end(ap);
  out.resize(static_cast<size_t>(n));
  return out;
}

Status ErrnoError(const std::string& what, int err) {
  char buf[128];
  // GNU strerror_r returns a char* that may or may not point into buf.
  const char* s = strerror_r(err, buf, sizeof(buf));
  return SystemError(what + ": " + s);
}

}  // namespace scape
