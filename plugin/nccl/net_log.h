// Logging of the NCCL net plugin. Loaded by NCCL, lines go through the logger NCCL passes to
// init (WARN with all subsystem flags, INFO and TRACE with the NET flag; NCCL_DEBUG and
// NCCL_DEBUG_SUBSYS decide what is shown). Used standalone (no logger given), lines go to
// stderr through the project's logger, filtered by SCAPE_DEBUG.
#ifndef SCAPE_PLUGIN_NCCL_NET_LOG_H_
#define SCAPE_PLUGIN_NCCL_NET_LOG_H_

#include "plugin/nccl/net_abi.h"

namespace scape {
namespace nccl {

// Installs NCCL's logger (ignored if null). Also forwards the project's own log lines to it.
void SetNcclLogger(ncclDebugLogger_t logger);
void NetLog(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
            const char* fmt, ...) __attribute__((format(printf, 5, 6)));

}  // namespace nccl
}  // namespace scape

#define NET_WARN(...) \
  ::scape::nccl::NetLog(NCCL_LOG_WARN, NCCL_ALL, __FILE__, __LINE__, __VA_ARGS__)
#define NET_INFO(flags, ...) \
  ::scape::nccl::NetLog(NCCL_LOG_INFO, (flags), __FILE__, __LINE__, __VA_ARGS__)
#define NET_TRACE(...) \
  ::scape::nccl::NetLog(NCCL_LOG_TRACE, NCCL_NET, __FILE__, __LINE__, __VA_ARGS__)

#endif  // SCAPE_PLUGIN_NCCL_NET_LOG_H_
