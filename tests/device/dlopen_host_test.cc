// The shipped libnccl-net-scape.so, loaded with dlopen (RTLD_NOW, as NCCL loads its net plugin
// and as a Python binding would), runs a host collective, in the CUDA build too, on a machine
// without a GPU driver: the CUDA runtime inside it is static and loads the driver only when
// asked, and NCCL is loaded only by scapeCommInitNccl.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "scape/scape.h"

namespace {

template <typename F>
F Sym(void* h, const char* name) {
  void* p = dlsym(h, name);
  EXPECT_NE(p, nullptr) << name << " is not exported";
  return reinterpret_cast<F>(p);
}

TEST(ShippedLibrary, LoadsAndRunsAHostCollectiveWithoutADriver) {
  void* h = dlopen(SCAPE_SO_PATH, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr) << dlerror();
  auto support = Sym<scapeResult_t (*)(int*, int*)>(h, "scapeGetDeviceSupport");
  auto getId = Sym<scapeResult_t (*)(scapeUniqueId*)>(h, "scapeGetUniqueId");
  auto init = Sym<scapeResult_t (*)(scapeComm_t*, int, scapeUniqueId, int)>(h, "scapeCommInitRank");
  auto allReduce = Sym<scapeResult_t (*)(const void*, void*, size_t, scapeDataType_t, scapeRedOp_t,
                                         scapeMask_t, scapeComm_t, void*)>(h, "scapeAllReduce");
  auto destroy = Sym<scapeResult_t (*)(scapeComm_t)>(h, "scapeCommDestroy");
  auto lastError = Sym<const char* (*)(scapeComm_t)>(h, "scapeGetLastError");
  auto initNccl =
      Sym<scapeResult_t (*)(scapeComm_t*, void*, const scapeConfig_t*)>(h, "scapeCommInitNccl");
  auto initNcclRank =
      Sym<scapeResult_t (*)(scapeComm_t*, int, scapeUniqueId, int, const scapeConfig_t*)>(
          h, "scapeCommInitNcclRank");
  auto initNcclEnv =
      Sym<scapeResult_t (*)(scapeComm_t*, const scapeConfig_t*)>(h, "scapeCommInitNcclFromEnv");
  ASSERT_FALSE(::testing::Test::HasFailure());

  int built = -1, avail = -1;
  ASSERT_EQ(support(&built, &avail), scapeSuccess);
  EXPECT_EQ(built, SCAPE_EXPECT_CUDA) << "scapeGetDeviceSupport disagrees with the build";
  std::printf("library built with CUDA: %d, device available: %d\n", built, avail);

  scapeUniqueId id;
  ASSERT_EQ(getId(&id), scapeSuccess) << lastError(nullptr);
  scapeComm_t comm = nullptr;
  ASSERT_EQ(init(&comm, 1, id, 0), scapeSuccess) << lastError(nullptr);
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.25f;
  std::vector<float> y(x.size(), -1.f);
  ASSERT_EQ(allReduce(x.data(), y.data(), x.size(), scapeFloat32, scapeSum, nullptr, comm, nullptr),
            scapeSuccess)
      << lastError(comm);
  EXPECT_EQ(x, y);
  if (!avail) {
    // No driver: a stream cannot be honoured, and the message says what to do.
    int notAStream = 0;
    EXPECT_EQ(
        allReduce(x.data(), y.data(), x.size(), scapeFloat32, scapeSum, nullptr, comm, &notAStream),
        scapeUnsupported);
    EXPECT_NE(std::string(lastError(comm)).find("stream = NULL"), std::string::npos)
        << lastError(comm);
  }
  EXPECT_EQ(destroy(comm), scapeSuccess);

  // NCCL is loaded only when asked for, and its absence is a clear error.
  setenv("SCAPE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
  int fake = 0;
  scapeComm_t nc = nullptr;
  EXPECT_EQ(initNccl(&nc, &fake, nullptr), scapeUnsupported);
  EXPECT_NE(std::string(lastError(nullptr)).find("/nonexistent/libnccl.so.2"), std::string::npos)
      << lastError(nullptr);
  // The same for the communicators the library makes its NCCL communicator for: named, and
  // before any host communicator is joined (so a 2-rank call returns at once here).
  EXPECT_EQ(initNcclRank(&nc, 2, id, 1, nullptr), scapeUnsupported);
  EXPECT_NE(std::string(lastError(nullptr)).find("/nonexistent/libnccl.so.2"), std::string::npos)
      << lastError(nullptr);
  EXPECT_EQ(initNcclEnv(nullptr, nullptr), scapeInvalidArgument);
  EXPECT_EQ(nc, nullptr);
  unsetenv("SCAPE_NCCL_LIBRARY");
  // No dlclose (UCX must stay loaded, as in tests/dlopen_test.cc).
}

}  // namespace
