#include "base/log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <strings.h>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "base/param.h"

namespace scape {
namespace {

std::atomic<LogSink> g_sink{nullptr};

LogLevel ParseLevel() {
  // The choices are declared in LogLevel's order. A malformed level cannot be returned as an
  // error from here: it logs at the default level and says so once.
  int level = static_cast<int>(LogLevel::kWarn);
  Status st = ParamGetChoice("SCAPE_DEBUG", &level);
  if (!st.ok()) std::fprintf(stderr, "SCAPE WARN %s; logging at WARN\n", st.message().c_str());
  return static_cast<LogLevel>(level);
}

}  // namespace

LogLevel CurrentLogLevel() {
  static const LogLevel level = ParseLevel();
  return level;
}

void SetLogSink(LogSink sink) { g_sink.store(sink); }

void LogMessage(LogLevel level, const char* file, int line, const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (LogSink sink = g_sink.load()) {
    sink(level, file, line, msg);
    return;
  }
  static const char* names[] = {"NONE", "WARN", "INFO", "TRACE"};
  char host[64] = "?";
  gethostname(host, sizeof(host) - 1);
  const char* base = std::strrchr(file, '/');
  std::fprintf(stderr, "%s:%d:%ld SCAPE %s %s:%d %s\n", host, static_cast<int>(getpid()),
               static_cast<long>(syscall(SYS_gettid)), names[static_cast<int>(level)],
               base ? base + 1 : file, line, msg);
}

}  // namespace scape
