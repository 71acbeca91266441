// The knob table (base/param.cc), scapeConfig_t's size/version handling and the version the
// library reports.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstddef>
#include <cstring>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "base/param.h"
#include "plugin/core/comm.h"
#include "scape/scape.h"

namespace {

using scape::ParamInfo;
using scape::ParamType;

bool Contains(const std::string& s, const std::string& sub) {
  return s.find(sub) != std::string::npos;
}

// Sets (or, with nullptr, unsets) a variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

std::vector<std::string> Choices(const ParamInfo& p) {
  std::vector<std::string> out;
  std::string all = p.choices ? p.choices : "";
  size_t b = 0;
  while (b <= all.size()) {
    size_t e = all.find(',', b);
    if (e == std::string::npos) e = all.size();
    out.push_back(all.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

TEST(ParamTable, EveryEntryIsWellFormed) {
  std::set<std::string> names;
  int n = 0;
  for (const ParamInfo* p = scape::ParamTable(); p->name; ++p, ++n) {
    SCOPED_TRACE(p->name);
    EXPECT_EQ(std::strncmp(p->name, "SCAPE_", 6), 0);
    EXPECT_TRUE(names.insert(p->name).second) << "declared twice";
    ASSERT_NE(p->defaultValue, nullptr);
    ASSERT_NE(p->doc, nullptr);
    EXPECT_GT(std::strlen(p->doc), 10u);
    EXPECT_EQ(std::strchr(p->doc, '|'), nullptr) << "a '|' would split the README's table row";
    EXPECT_EQ(std::strchr(p->doc, '\n'), nullptr);
    EXPECT_EQ(scape::FindParam(p->name), p);
    if (p->type == ParamType::kInt) {
      EXPECT_LE(p->minValue, p->maxValue);
      ScopedEnv unset(p->name, nullptr);
      int64_t v = -1;
      ASSERT_TRUE(scape::ParamGetInt(p->name, &v).ok())
          << "default does not parse or is out of range";
      EXPECT_EQ(std::to_string(v), p->defaultValue);
    } else if (p->type == ParamType::kChoice) {
      ASSERT_NE(p->choices, nullptr);
      ScopedEnv unset(p->name, nullptr);
      int idx = -1;
      ASSERT_TRUE(scape::ParamGetChoice(p->name, &idx).ok()) << "default is not one of the choices";
      EXPECT_EQ(Choices(*p)[static_cast<size_t>(idx)], p->defaultValue);
    }
  }
  EXPECT_GE(n, 13);
  EXPECT_EQ(scape::FindParam("SCAPE_NO_SUCH_KNOB"), nullptr);
}

TEST(ParamTable, CodeConstantsAreTheTableDefaults) {
  ScopedEnv unset("SCAPE_TIMEOUT_MS", nullptr);
  int64_t t = 0;
  ASSERT_TRUE(scape::ParamGetInt("SCAPE_TIMEOUT_MS", &t).ok());
  EXPECT_EQ(t, scape::kDefaultTimeoutMs);
  EXPECT_EQ(scape::CommConfig().timeoutMs, scape::kDefaultTimeoutMs);
  // The choice knobs map onto enums by position.
  const ParamInfo* progress = scape::FindParam("SCAPE_PROGRESS");
  ASSERT_NE(progress, nullptr);
  const std::vector<std::string> modes = Choices(*progress);
  ASSERT_EQ(modes.size(), static_cast<size_t>(scapeNumProgressModes));
  EXPECT_EQ(modes[scapeProgressAuto], "auto");
  EXPECT_EQ(modes[scapeProgressSpin], "spin");
  EXPECT_EQ(modes[scapeProgressYield], "yield");
  EXPECT_EQ(modes[scapeProgressBlocking], "blocking");
}

TEST(ParamTable, IntegersAreParsedAndRangeChecked) {
  int64_t v = 0;
  {
    ScopedEnv e("SCAPE_CHUNK_BYTES", "65536");
    ASSERT_TRUE(scape::ParamGetInt("SCAPE_CHUNK_BYTES", &v).ok());
    EXPECT_EQ(v, 65536);
    EXPECT_TRUE(scape::ParamIsSet("SCAPE_CHUNK_BYTES"));
  }
  {
    ScopedEnv e("SCAPE_CHUNK_BYTES", "");  // empty is unset
    ASSERT_TRUE(scape::ParamGetInt("SCAPE_CHUNK_BYTES", &v).ok());
    EXPECT_EQ(v, 2097152);
    EXPECT_FALSE(scape::ParamIsSet("SCAPE_CHUNK_BYTES"));
  }
  for (const char* bad : {"soon", "12ms", "4095", "-1", "99999999999999999999999", " "}) {
    SCOPED_TRACE(bad);
    ScopedEnv e("SCAPE_CHUNK_BYTES", bad);
    v = 7;
    scape::Status st = scape::ParamGetInt("SCAPE_CHUNK_BYTES", &v);
    EXPECT_EQ(st.code(), scapeInvalidUsage);
    EXPECT_TRUE(Contains(st.message(), "SCAPE_CHUNK_BYTES='")) << st.message();
    EXPECT_TRUE(Contains(st.message(), "4096..1073741824")) << st.message();
    EXPECT_EQ(v, 7) << "output written on error";
  }
  {
    ScopedEnv e("SCAPE_TIMEOUT_MS", "0x10");
    ASSERT_TRUE(scape::ParamGetInt("SCAPE_TIMEOUT_MS", &v).ok());
    EXPECT_EQ(v, 16);
  }
  // Asking for a string knob as an integer is the caller's bug, not the user's.
  EXPECT_EQ(scape::ParamGetInt("SCAPE_UCX_TLS", &v).code(), scapeInternalError);
}

TEST(ParamTable, ChoicesAreCaseInsensitiveAndCheckedInOnePlace) {
  int idx = -1;
  {
    ScopedEnv e("SCAPE_ALLREDUCE_ALGO", "RD");
    ASSERT_TRUE(scape::ParamGetChoice("SCAPE_ALLREDUCE_ALGO", &idx).ok());
    EXPECT_EQ(idx, 2);
  }
  {
    ScopedEnv e("SCAPE_ALLREDUCE_ALGO", "rin");  // a prefix is not a choice
    scape::Status st = scape::ParamGetChoice("SCAPE_ALLREDUCE_ALGO", &idx);
    EXPECT_EQ(st.code(), scapeInvalidUsage);
    EXPECT_TRUE(Contains(st.message(), "SCAPE_ALLREDUCE_ALGO='rin': expected one of auto,ring,rd"))
        << st.message();
  }
  // The communicator and the NCCL plugin both read SCAPE_TIMEOUT_MS through the table, so a
  // malformed value is the same error for both (the plugin's test checks its side).
  ScopedEnv e("SCAPE_TIMEOUT_MS", "soon");
  scape::CommConfig cfg;
  scape::Status st = scape::ResolveConfig(nullptr, &cfg);
  EXPECT_EQ(st.code(), scapeInvalidUsage);
  EXPECT_TRUE(Contains(st.message(), "SCAPE_TIMEOUT_MS='soon'")) << st.message();
}

TEST(ParamTable, StringsAndExternals) {
  {
    ScopedEnv e("SCAPE_BOOTSTRAP_ADDR", "host:1234");
    EXPECT_EQ(scape::ParamString("SCAPE_BOOTSTRAP_ADDR"), "host:1234");
    EXPECT_STREQ(scape::ParamCString("SCAPE_BOOTSTRAP_ADDR"), "host:1234");
  }
  {
    ScopedEnv e("SCAPE_BOOTSTRAP_ADDR", nullptr);
    EXPECT_EQ(scape::ParamString("SCAPE_BOOTSTRAP_ADDR"), "");
    EXPECT_EQ(scape::ParamCString("SCAPE_BOOTSTRAP_ADDR"), nullptr);
    ScopedEnv p("SCAPE_PROGRESS", nullptr);
    EXPECT_STREQ(scape::ParamCString("SCAPE_PROGRESS"), "auto");
  }
  {
    ScopedEnv e("UCX_NET_DEVICES", "");
    EXPECT_EQ(scape::ParamExternal("UCX_NET_DEVICES"), nullptr);
  }
  ScopedEnv e("UCX_NET_DEVICES", "lo");
  EXPECT_STREQ(scape::ParamExternal("UCX_NET_DEVICES"), "lo");
}

TEST(ParamTable, MarkdownHasOneRowPerKnob) {
  const std::string md = scape::ParamTableMarkdown();
  int rows = 0, knobs = 0;
  for (size_t i = 0; (i = md.find("\n|", i)) != std::string::npos; ++i) ++rows;
  for (const ParamInfo* p = scape::ParamTable(); p->name; ++p) {
    ++knobs;
    EXPECT_TRUE(Contains(md, std::string("| `") + p->name + "` | ")) << p->name;
  }
  EXPECT_EQ(rows, knobs + 1);  // the separator row, then one per knob
  EXPECT_TRUE(Contains(md, "| `SCAPE_TIMEOUT_MS` | 120000 | "));
}

// scape.h documents scapeConfig_t's fields with their variables and defaults: those defaults
// must be the table's.
TEST(ParamTable, PublicHeaderStatesTheTableDefaults) {
  std::ifstream in(SCAPE_TEST_SOURCE_DIR "/include/scape/scape.h");
  ASSERT_TRUE(in.good());
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) {
    // " * | timeoutMs    | SCAPE_TIMEOUT_MS     | 120000 (ms ...)  |"
    std::vector<std::string> cols;
    for (size_t b = line.find('|'); b != std::string::npos;) {
      size_t e = line.find('|', b + 1);
      if (e == std::string::npos) break;
      std::string c = line.substr(b + 1, e - b - 1);
      c.erase(0, c.find_first_not_of(' '));
      c.erase(c.find_last_not_of(' ') + 1);
      cols.push_back(c);
      b = e;
    }
    if (cols.size() < 3 || cols[1].rfind("SCAPE_", 0) != 0) continue;
    const ParamInfo* p = scape::FindParam(cols[1].c_str());
    ASSERT_NE(p, nullptr) << "scape.h documents an undeclared knob: " << cols[1];
    ++rows;
    if (*p->defaultValue) {
      EXPECT_EQ(cols[2].rfind(p->defaultValue, 0), 0u)
          << "scape.h says " << cols[1] << " defaults to '" << cols[2] << "', the table says '"
          << p->defaultValue << "'";
    }
  }
  EXPECT_GE(rows, 3) << "scape.h's scapeConfig_t table was not found";
}

// ---- scapeConfig_t: size and version ----------------------------------------------------------

// A caller's struct in a buffer whose bytes past `size` are garbage: the library must read only
// the fields inside `size` (reading progressMode would see 0xABABABAB and fail; reading netIf
// would dereference a wild pointer).
struct OldConfig {
  alignas(scapeConfig_t) unsigned char bytes[sizeof(scapeConfig_t) + 64];
  scapeConfig_t* cfg() { return reinterpret_cast<scapeConfig_t*>(bytes); }
  explicit OldConfig(size_t size) {
    std::memset(bytes, 0xAB, sizeof(bytes));
    scapeConfig_t init = SCAPE_CONFIG_INITIALIZER;
    std::memcpy(bytes, &init, size);
    cfg()->size = size;
  }
};

constexpr size_t kHeaderBytes = offsetof(scapeConfig_t, version) + sizeof(unsigned);
constexpr size_t kUpToTimeout = offsetof(scapeConfig_t, timeoutMs) + sizeof(int);

TEST(Config, OlderSmallerStructsReadOnlyTheirFields) {
  ScopedEnv t("SCAPE_TIMEOUT_MS", "4321");
  ScopedEnv p("SCAPE_PROGRESS", "yield");
  ScopedEnv i("SCAPE_SOCKET_IFNAME", "lo");
  {
    OldConfig old(kUpToTimeout);
    old.cfg()->timeoutMs = 777;
    scape::CommConfig c;
    scape::Status st = scape::ResolveConfig(old.cfg(), &c);
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(c.timeoutMs, 777);                // inside size: the caller's
    EXPECT_EQ(c.progress, scapeProgressYield);  // past size: the environment's
    EXPECT_EQ(c.netIf, "lo");
  }
  {
    OldConfig old(kHeaderBytes);  // a header only: everything from the environment
    scape::CommConfig c;
    scape::Status st = scape::ResolveConfig(old.cfg(), &c);
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(c.timeoutMs, 4321);
    EXPECT_EQ(c.progress, scapeProgressYield);
  }
  {
    OldConfig full(sizeof(scapeConfig_t));
    full.cfg()->timeoutMs = 99;
    full.cfg()->progressMode = scapeProgressSpin;
    full.cfg()->netIf = "eth7";
    scape::CommConfig c;
    scape::Status st = scape::ResolveConfig(full.cfg(), &c);
    ASSERT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(c.timeoutMs, 99);
    EXPECT_EQ(c.progress, scapeProgressSpin);
    EXPECT_EQ(c.netIf, "eth7");
  }
  {
    // The same garbage inside the size is read, and rejected.
    OldConfig old(kUpToTimeout + sizeof(int));
    std::memset(&old.cfg()->progressMode, 0xAB, sizeof(int));
    scape::CommConfig c;
    scape::Status st = scape::ResolveConfig(old.cfg(), &c);
    EXPECT_EQ(st.code(), scapeInvalidArgument);
    EXPECT_TRUE(Contains(st.message(), "progressMode")) << st.message();
  }
}

TEST(Config, BadHeaderOrNewerStructIsRefused) {
  scape::CommConfig c;
  {
    OldConfig tiny(sizeof(size_t));  // not even the magic
    scape::Status st = scape::ResolveConfig(tiny.cfg(), &c);
    EXPECT_EQ(st.code(), scapeInvalidArgument);
    EXPECT_TRUE(Contains(st.message(), "SCAPE_CONFIG_INITIALIZER")) << st.message();
  }
  {
    OldConfig bad(sizeof(scapeConfig_t));
    bad.cfg()->magic = 0x1234;
    EXPECT_EQ(scape::ResolveConfig(bad.cfg(), &c).code(), scapeInvalidArgument);
  }
  {
    // From a later release with more fields: this library cannot honour what it does not know.
    OldConfig newer(sizeof(scapeConfig_t));
    newer.cfg()->size = sizeof(scapeConfig_t) + 16;
    newer.cfg()->version = SCAPE_VERSION_CODE + 1;
    scape::Status st = scape::ResolveConfig(newer.cfg(), &c);
    EXPECT_EQ(st.code(), scapeUnsupported);
    EXPECT_TRUE(Contains(st.message(), "version code")) << st.message();
  }
  {
    OldConfig otherMajor(sizeof(scapeConfig_t));
    otherMajor.cfg()->version = SCAPE_VERSION_CODE + 10000;
    EXPECT_EQ(scape::ResolveConfig(otherMajor.cfg(), &c).code(), scapeUnsupported);
  }
}

TEST(Config, OlderStructThroughThePublicApi) {
  scapeUniqueId id;
  ASSERT_EQ(scapeGetUniqueId(&id), scapeSuccess);
  OldConfig old(kUpToTimeout);
  old.cfg()->timeoutMs = 30000;
  scapeComm_t comm = nullptr;
  ASSERT_EQ(scapeCommInitRankConfig(&comm, 1, id, 0, old.cfg()), scapeSuccess)
      << scapeGetLastError(nullptr);
  float x[3] = {1.f, 2.f, 3.f};
  EXPECT_EQ(scapeAllReduce(x, x, 3, scapeFloat32, scapeSum, nullptr, comm, nullptr), scapeSuccess)
      << scapeGetLastError(comm);
  EXPECT_EQ(x[2], 3.f);
  EXPECT_EQ(scapeCommDestroy(comm), scapeSuccess);
}

// ---- version -----------------------------------------------------------------------------------

TEST(Version, HeaderLibraryAndCMakeProjectAgree) {
  int v = -1;
  ASSERT_EQ(scapeGetVersion(&v), scapeSuccess);
  EXPECT_EQ(v, SCAPE_VERSION_CODE);
  EXPECT_EQ(v, SCAPE_MAJOR * 10000 + SCAPE_MINOR * 100 + SCAPE_PATCH);
  // SCAPE_TEST_PROJECT_VERSION is CMake's project(VERSION), passed by tests/CMakeLists.txt.
  EXPECT_STREQ(SCAPE_VERSION_STRING, SCAPE_TEST_PROJECT_VERSION);
  EXPECT_EQ(scapeGetVersion(nullptr), scapeInvalidArgument);
}

}  // namespace
