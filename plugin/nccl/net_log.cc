#include "plugin/nccl/net_log.h"

#include <atomic>
#include <cstdarg>
#include <cstdio>

#include "base/log.h"

namespace scape {
namespace nccl {
namespace {

std::atomic<ncclDebugLogger_t> g_logger{nullptr};

// Forwards the project's own (SCAPE_WARN/INFO) lines to NCCL's logger.
void Sink(LogLevel level, const char* file, int line, const char* msg) {
  ncclDebugLogger_t log = g_logger.load();
  if (!log) return;
  switch (level) {
    case LogLevel::kWarn:
      log(NCCL_LOG_WARN, NCCL_ALL, file, line, "NET/SCAPE : %s", msg);
      break;
    case LogLevel::kInfo:
      log(NCCL_LOG_INFO, NCCL_NET, file, line, "NET/SCAPE : %s", msg);
      break;
    case LogLevel::kTrace:
      log(NCCL_LOG_TRACE, NCCL_NET, file, line, "NET/SCAPE : %s", msg);
      break;
    default:
      break;
  }
}

}  // namespace

void SetNcclLogger(ncclDebugLogger_t logger) {
  if (!logger) return;
  g_logger.store(logger);
  SetLogSink(&Sink);
}

void NetLog(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
            const char* fmt, ...) {
  ncclDebugLogger_t log = g_logger.load();
  LogLevel mine = level == NCCL_LOG_WARN   ? LogLevel::kWarn
                  : level == NCCL_LOG_INFO ? LogLevel::kInfo
                                           : LogLevel::kTrace;
  // Standalone: filter before formatting. With NCCL, NCCL filters (it knows NCCL_DEBUG).
  if (!log && static_cast<int>(CurrentLogLevel()) < static_cast<int>(mine)) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (log) {
    log(level, flags, file, line, "NET/SCAPE : %s", msg);
    return;
  }
  LogMessage(mine, file, line, "NET/SCAPE : %s", msg);
}

}  // namespace nccl
}  // namespace scape
