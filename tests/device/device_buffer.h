// A device buffer of a test runtime (the fake device's memory is host-addressable), filled from
// and read back to host vectors. Shared by the device-op tests.
#ifndef SCAPE_TESTS_DEVICE_DEVICE_BUFFER_H_
#define SCAPE_TESTS_DEVICE_DEVICE_BUFFER_H_

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "base/status.h"
#include "plugin/device/runtime.h"

// A Status-returning call that must succeed (the message on failure).
#define ASSERT_ST_OK(expr)                                   \
  do {                                                       \
    const ::scape::Status st_ = (expr);                      \
    ASSERT_TRUE(st_.ok()) << #expr << ": " << st_.message(); \
  } while (0)

namespace fake_device {

class Dev {
 public:
  // Fresh memory (the fake fills it with garbage bytes, as cudaMalloc leaves it undefined).
  Dev(scape::device::Runtime* rt, size_t bytes) : rt_(rt) {
    scape::Status st = rt_->DeviceAlloc(bytes, &p_);
    EXPECT_TRUE(st.ok()) << st.message();
  }
  template <typename T>
  Dev(scape::device::Runtime* rt, const std::vector<T>& v) : Dev(rt, v.size() * sizeof(T)) {
    if (!v.empty()) std::memcpy(p_, v.data(), v.size() * sizeof(T));
  }
  ~Dev() { rt_->DeviceFree(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }
  template <typename T>
  std::vector<T> Read(size_t count) const {
    std::vector<T> v(count);
    if (count) std::memcpy(v.data(), p_, count * sizeof(T));
    return v;
  }

 private:
  scape::device::Runtime* rt_;
  void* p_ = nullptr;
};

}  // namespace fake_device

#endif  // SCAPE_TESTS_DEVICE_DEVICE_BUFFER_H_
