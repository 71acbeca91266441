// Loads the shipped libnccl-net-scape.so exactly as NCCL would (dlopen with RTLD_NOW), and
// checks that it exports the public API and nothing else.
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <set>
#include <string>
#include <vector>

#include "scape/scape.h"

namespace {

// Names of the defined, globally visible symbols in the .dynsym of an ELF64 file.
std::vector<std::string> ExportedSymbols(const char* path) {
  std::vector<std::string> out;
  int fd = open(path, O_RDONLY);
  if (fd < 0) return out;
  struct stat st;
  fstat(fd, &st);
  void* map = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) return out;
  const char* base = static_cast<const char*>(map);
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(base);
  const auto* sh = reinterpret_cast<const Elf64_Shdr*>(base + eh->e_shoff);
  for (int i = 0; i < eh->e_shnum; ++i) {
    if (sh[i].sh_type != SHT_DYNSYM) continue;
    const char* strtab = base + sh[sh[i].sh_link].sh_offset;
    const auto* sym = reinterpret_cast<const Elf64_Sym*>(base + sh[i].sh_offset);
    const size_t n = sh[i].sh_size / sizeof(Elf64_Sym);
    for (size_t k = 1; k < n; ++k) {
      const int bind = ELF64_ST_BIND(sym[k].st_info);
      if (sym[k].st_shndx == SHN_UNDEF || (bind != STB_GLOBAL && bind != STB_WEAK)) continue;
      if (ELF64_ST_VISIBILITY(sym[k].st_other) != STV_DEFAULT) continue;
      out.emplace_back(strtab + sym[k].st_name);
    }
  }
  munmap(map, static_cast<size_t>(st.st_size));
  return out;
}

TEST(SharedLibrary, LoadsWithRtldNowAndExportsOnlyTheApi) {
  void* h = dlopen(SCAPE_SO_PATH, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr) << dlerror();
  for (const char* fn : {"scapeGetErrorString",
                         "scapeGetVersion",
                         "scapeGetUniqueId",
                         "scapeCommInitRank",
                         "scapeCommInitRankConfig",
                         "scapeCommInitFromEnv",
                         "scapeCommDestroy",
                         "scapeCommAbort",
                         "scapeCommCount",
                         "scapeCommUserRank",
                         "scapeGetLastError",
                         "scapeCommGetAsyncError",
                         "scapeAllReduce",
                         "scapeAllReduceAsync",
                         "scapeReduceScatter",
                         "scapeReduceScatterAsync",
                         "scapeAllGather",
                         "scapeAllGatherAsync",
                         "scapeBroadcast",
                         "scapeBroadcastAsync",
                         "scapeBarrier",
                         "scapeBarrierAsync",
                         "scapeTest",
                         "scapeWait",
                         "scapeTypeSize"})
    EXPECT_NE(dlsym(h, fn), nullptr) << fn << " is not exported";
  auto getVersion = reinterpret_cast<scapeResult_t (*)(int*)>(dlsym(h, "scapeGetVersion"));
  ASSERT_NE(getVersion, nullptr);
  int v = 0;
  EXPECT_EQ(getVersion(&v), scapeSuccess);
  EXPECT_EQ(v, SCAPE_VERSION_CODE);

  std::vector<std::string> syms = ExportedSymbols(SCAPE_SO_PATH);
  ASSERT_FALSE(syms.empty()) << "could not read the dynamic symbol table";
  for (const std::string& s : syms)
    EXPECT_TRUE(s.rfind("scape", 0) == 0 || s.rfind("ncclNetPlugin_v", 0) == 0)
        << "unexpected exported symbol: " << s;
  // Internal C++ symbols must stay hidden.
  EXPECT_EQ(dlsym(h,
                  "_ZN5scape4Comm6CreateEiiRKNS_9bootstrap11RootAddressERKNS_"
                  "10CommConfigEPSt10unique_ptrIS0_St14default_deleteIS0_EE"),
            nullptr);
  // No dlclose: unloading UCX's libraries drops pointers to their global configuration, which
  // LeakSanitizer would then report as UCX's leaks (NCCL keeps its net plugin loaded too).
}

std::string ReadLink(const std::string& link) {
  char target[256] = {0};
  ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string();
}

// SCAPE_SO_PATH is libnccl-net-scape.so, the name NCCL dlopens for NCCL_NET_PLUGIN=scape: a
// link to the SONAME file, a link to the versioned file.
TEST(SharedLibrary, VersionedNamesChainToTheLibrary) {
  const std::string path = SCAPE_SO_PATH;
  const std::string dir = path.substr(0, path.rfind('/'));
  ASSERT_EQ(path.substr(path.rfind('/') + 1), "libnccl-net-scape.so");
  const std::string soname = "libnccl-net-scape.so." + std::to_string(SCAPE_MAJOR);
  const std::string real =
      soname + "." + std::to_string(SCAPE_MINOR) + "." + std::to_string(SCAPE_PATCH);
  EXPECT_EQ(ReadLink(path), soname);
  EXPECT_EQ(ReadLink(dir + "/" + soname), real);
  struct stat st;
  ASSERT_EQ(lstat((dir + "/" + real).c_str(), &st), 0) << real;
  EXPECT_TRUE(S_ISREG(st.st_mode)) << real << " is not a regular file";
}

TEST(SharedLibrary, NcclNetSymlinkSitsBesideIt) {
  std::string path = SCAPE_SO_PATH;
  std::string link = path.substr(0, path.rfind('/')) + "/libnccl-net.so";
  EXPECT_EQ(ReadLink(link), "libnccl-net-scape.so." + std::to_string(SCAPE_MAJOR)) << link;
  void* h = dlopen(link.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr) << dlerror();
  EXPECT_NE(dlsym(h, "ncclNetPlugin_v11"), nullptr);
}

}  // namespace
