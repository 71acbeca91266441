// Monotonic time and deadlines.
#ifndef SCAPE_BASE_CLOCK_H_
#define SCAPE_BASE_CLOCK_H_

#include <chrono>
#include <cstdint>

namespace scape {

using Clock = std::chrono::steady_clock;

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// A point in time after which a wait gives up.
class Deadline {
 public:
  static Deadline AfterMs(int64_t ms) { return Deadline(NowNs() + ms * 1000000); }
  explicit Deadline(int64_t atNs) : atNs_(atNs) {}
  bool Expired() const { return NowNs() >= atNs_; }
  int64_t RemainingMs() const {
    int64_t r = (atNs_ - NowNs()) / 1000000;
    return r < 0 ? 0 : r;
  }

 private:
  int64_t atNs_;
};

}  // namespace scape

#endif  // SCAPE_BASE_CLOCK_H_
