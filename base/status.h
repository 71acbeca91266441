// One internal status type for every layer below the API boundary. A Status carries a
// scapeResult_t and, on failure, a message that says what was wrong. Success allocates nothing.
#ifndef SCAPE_BASE_STATUS_H_
#define SCAPE_BASE_STATUS_H_

#include <string>
#include <utility>

#include "scape/scape.h"

namespace scape {

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(scapeResult_t code, std::string msg) : code_(code), msg_(std::move(msg)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == scapeSuccess; }
  scapeResult_t code() const { return code_; }
  const std::string& message() const { return msg_; }

  // Prefixes the message with context while unwinding ("allreduce: " + "recv from rank 2: ...").
  Status& Prepend(const std::string& ctx) {
    msg_ = ctx + ": " + msg_;
    return *this;
  }

 private:
  scapeResult_t code_ = scapeSuccess;
  std::string msg_;
};

// printf-style message builder for error paths.
std::string StrFormat(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

inline Status InvalidArgument(std::string m) { return Status(scapeInvalidArgument, std::move(m)); }
inline Status InvalidUsage(std::string m) { return Status(scapeInvalidUsage, std::move(m)); }
inline Status SystemError(std::string m) { return Status(scapeSystemError, std::move(m)); }
inline Status RemoteError(std::string m) { return Status(scapeRemoteError, std::move(m)); }
inline Status TimeoutError(std::string m) { return Status(scapeTimeout, std::move(m)); }
inline Status Unsupported(std::string m) { return Status(scapeUnsupported, std::move(m)); }
inline Status InternalError(std::string m) { return Status(scapeInternalError, std::move(m)); }
// errno-based system error: "<what>: <strerror(err)>".
Status ErrnoError(const std::string& what, int err);

}  // namespace scape

// Propagate a failed Status to the caller.
#define SCAPE_RETURN_IF_ERROR(expr) \
  do {                              \
    ::scape::Status _st = (expr);   \
    if (!_st.ok()) return _st;      \
  } while (0)

#endif  // SCAPE_BASE_STATUS_H_
