#include "base/log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <strings.h>

#include "base/param.h"

namespace scape {
namespace {

std::atomic<LogSink> g_sink{nullptr};

LogLevel ParseLevel() {
  const std::string v = ParamString("SCAPE_DEBUG");
  if (v.empty() || strcasecmp(v.c_str(), "WARN") == 0) return LogLevel::kWarn;
  if (strcasecmp(v.c_str(), "INFO") == 0) return LogLevel::kInfo;
  if (strcasecmp(v.c_str(), "TRACE") == 0) return LogLevel::kTrace;
  if (strcasecmp(v.c_str(), "NONE") == 0) return LogLevel::kNone;
  return LogLevel::kWarn;
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
