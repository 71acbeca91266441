// Logging. Level from SCAPE_DEBUG (WARN by default; INFO, TRACE, NONE). Level is checked before
// any formatting. Lines go to stderr as "host:pid:tid SCAPE LEVEL message"; the NCCL plugin
// installs NCCL's logger with SetLogSink so lines reach NCCL_DEBUG output instead.
#ifndef SCAPE_BASE_LOG_H_
#define SCAPE_BASE_LOG_H_

namespace scape {

enum class LogLevel : int { kNone = 0, kWarn = 1, kInfo = 2, kTrace = 3 };

LogLevel CurrentLogLevel();
void LogMessage(LogLevel level, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 4, 5)));

// A sink receives already formatted lines (used by the NCCL plugin to forward to NCCL).
using LogSink = void (*)(LogLevel level, const char* file, int line, const char* msg);
void SetLogSink(LogSink sink);

}  // namespace scape

#define SCAPE_LOG(lvl, ...)                                                    \
  do {                                                                         \
    if (static_cast<int>(::scape::CurrentLogLevel()) >= static_cast<int>(lvl)) \
      ::scape::LogMessage(lvl, __FILE__, __LINE__, __VA_ARGS__);               \
  } while (0)
#define SCAPE_WARN(...) SCAPE_LOG(::scape::LogLevel::kWarn, __VA_ARGS__)
#define SCAPE_INFO(...) SCAPE_LOG(::scape::LogLevel::kInfo, __VA_ARGS__)
#define SCAPE_TRACE(...) SCAPE_LOG(::scape::LogLevel::kTrace, __VA_ARGS__)

#endif  // SCAPE_BASE_LOG_H_
