// One type system on the host and the device (issue 44 item 4): the CUDA kernels' conversions
// (kernels/cuda/device_common.cuh) are kernels/dtypes.h's own SCAPE_HD functions, so they give
// the host's bits for every value, NaN payloads included, and the kernels' payload dispatch is
// dtypes.h's one switch (an 8-bit or unknown type is refused, never taken as fp16). Compiled by
// nvcc and run on the host (no GPU needed): before the fix device_common.cuh had __device__-only
// copies (an fp16 NaN always 0x7e00) and a second numbering of the types (VisitKind: any other
// value ran as fp16), and this file did not compile. The kernels' NaN bits on a GPU are the
// device script's check (perf/gpu).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/device_common.cuh"
#include "kernels/dtypes.h"

namespace {

namespace dev = scape::kernels::cuda::dev;
namespace dt = scape::dtypes;

// The same functions, not copies.
static_assert(&dev::FloatToFp16 == &dt::FloatToFp16, "device fp16 conversion is dtypes.h's");
static_assert(&dev::Fp16ToFloat == &dt::Fp16ToFloat, "device fp16 widening is dtypes.h's");
static_assert(&dev::FloatToBf16 == &dt::FloatToBf16, "device bf16 conversion is dtypes.h's");
static_assert(&dev::Bf16ToFloat == &dt::Bf16ToFloat, "device bf16 widening is dtypes.h's");

float Bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DeviceTypes, Fp16NaNKeepsItsPayloadAsOnTheHost) {
  // Quiet and signalling NaNs of both signs with payloads in the bits fp16 keeps.
  const uint32_t nans[] = {0x7fc00000u, 0x7fa02000u, 0x7f802000u, 0xffc12000u,
                           0x7fffe000u, 0xff9fe000u, 0x7f800001u, 0x7fffffffu};
  for (uint32_t u : nans) {
    const uint16_t h = dev::FloatToFp16(Bits(u));
    const uint16_t want =
        static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
    EXPECT_EQ(h, want) << std::hex << u;
    EXPECT_EQ(h, dt::FloatToFp16(Bits(u))) << std::hex << u;
  }
  // And every fp32 bit pattern on a stride (all classes: zero, subnormal, normal, inf, NaN).
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 7919) {
    const float f = Bits(static_cast<uint32_t>(u));
    ASSERT_EQ(dev::FloatToFp16(f), dt::FloatToFp16(f)) << std::hex << u;
    ASSERT_EQ(dev::FloatToBf16(f), dt::FloatToBf16(f)) << std::hex << u;
  }
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = dev::Fp16ToFloat(static_cast<uint16_t>(h));
    const float b = dt::Fp16ToFloat(static_cast<uint16_t>(h));
    ASSERT_EQ(std::memcmp(&a, &b, 4), 0) << std::hex << h;
  }
}

TEST(DeviceTypes, PayloadDispatchIsDtypesOneSwitch) {
  int seen = 0;
  EXPECT_TRUE(dev::VisitPayloadType(
      scapeFloat16, [&](auto t) { seen = std::is_same<decltype(t), dt::F16T>::value ? 16 : -1; }));
  EXPECT_EQ(seen, 16);
  EXPECT_TRUE(dev::VisitPayloadType(
      scapeBfloat16, [&](auto t) { seen = std::is_same<decltype(t), dt::Bf16T>::value ? 8 : -1; }));
  EXPECT_EQ(seen, 8);
  EXPECT_TRUE(
      dev::VisitPayloadType(scapeFloat32, [&](auto t) { seen = dev::kIsF32<decltype(t)>; }));
  EXPECT_EQ(seen, 1);
  // The scaled 8-bit types, the integers and values that are no type are refused.
  for (int t : {static_cast<int>(scapeFloat8E4M3), static_cast<int>(scapeFloat8E5M2),
                static_cast<int>(scapeInt32), -1, 99}) {
    seen = 0;
    EXPECT_FALSE(dev::VisitPayloadType(t, [&](auto) { seen = 1; })) << t;
    EXPECT_EQ(seen, 0) << t;
  }
}

}  // namespace
