// fatbin_check FILE SM [SM...]
//
// Verifies that every object in FILE (an ELF object, executable, shared library, or an ar
// archive of ELF objects such as libscape_core.a) that carries CUDA device code has machine
// code (a cubin, not only PTX) for each listed SM architecture, e.g. "80 90". Reads the
// `.nv_fatbin` ELF section and walks the fatbin container headers (the layout cuobjdump reads:
// a 16-byte container header with magic 0xBA55ED50, then entries whose header holds the kind
// at offset 0 (1 = PTX, 2 = ELF cubin), the header size at 4, the payload size at 8 and the SM
// number at 28). Exit status 0 when every requirement holds, 1 otherwise, 2 on a read error.
// Requirements: "NN" = machine code (cubin) for sm_NN; "ptxNN" = PTX for compute_NN (the
// forward-compatible code a newer GPU JIT-compiles); "containers=N" = at least N fatbin
// containers in all (one per compiled .cu file: a linked library whose kernels were dropped
// by the linker has fewer).
// Everything is bounds-checked: a malformed file is reported, never crashes the checker.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace {

struct Bytes {
  const uint8_t* p;
  size_t n;
  bool Has(size_t off, size_t len) const { return off <= n && len <= n - off; }
  template <typename T>
  bool Get(size_t off, T* v) const {
    if (!Has(off, sizeof(T))) return false;
    std::memcpy(v, p + off, sizeof(T));
    return true;
  }
};

struct Entry {
  int kind;  // 1 PTX, 2 cubin
  uint32_t arch;
};

// Parses the concatenated fatbin containers of a .nv_fatbin section.
bool ParseFatbin(Bytes s, std::vector<Entry>* out, std::string* err, int* ncontainers) {
  size_t p = 0;
  int containers = 0;
  while (p + 16 <= s.n) {
    uint32_t magic = 0;
    s.Get(p, &magic);
    if (magic != 0xBA55ED50u) {
      p += 8;  // containers are 8-byte aligned; skip padding
      continue;
    }
    uint16_t hsize = 0;
    uint64_t fat = 0;
    s.Get(p + 6, &hsize);
    s.Get(p + 8, &fat);
    if (hsize < 16 || !s.Has(p, hsize) || fat > s.n - p - hsize) {
      *err = "fatbin container header out of bounds";
      return false;
    }
    size_t e = p + hsize;
    const size_t end = p + hsize + static_cast<size_t>(fat);
    while (e + 32 <= end) {
      uint16_t kind = 0;
      uint32_t eh = 0, arch = 0;
      uint64_t payload = 0;
      s.Get(e, &kind);
      s.Get(e + 4, &eh);
      s.Get(e + 8, &payload);
      s.Get(e + 28, &arch);
      if (eh < 32 || eh > end - e || payload > end - e - eh) {
        *err = "fatbin entry out of bounds";
        return false;
      }
      out->push_back({kind, arch});
      e += eh + static_cast<size_t>(payload);
    }
    ++containers;
    p = end;
  }
  *ncontainers = containers;
  if (containers == 0) {
    *err = "no fatbin container in .nv_fatbin";
    return false;
  }
  return true;
}

// Finds the .nv_fatbin section of an ELF64 little-endian image. Returns false if absent.
bool FindFatbinSection(Bytes elf, Bytes* sec, std::string* err) {
  if (!elf.Has(0, 64) || std::memcmp(elf.p,
                                     "\x7f"
                                     "ELF",
                                     4) != 0) {
    *err = "not an ELF file";
    return false;
  }
  if (elf.p[4] != 2 || elf.p[5] != 1) {
    *err = "not ELF64 little-endian";
    return false;
  }
  uint64_t shoff = 0;
  uint16_t shentsize = 0, shnum = 0, shstrndx = 0;
  elf.Get(0x28, &shoff);
  elf.Get(0x3A, &shentsize);
  elf.Get(0x3C, &shnum);
  elf.Get(0x3E, &shstrndx);
  if (shentsize < 64 || shstrndx >= shnum || !elf.Has(shoff, size_t{shentsize} * shnum)) {
    *err = "bad section header table";
    return false;
  }
  auto sh = [&](size_t i, size_t field, uint64_t* v) {
    return elf.Get(shoff + i * shentsize + field, v);
  };
  uint64_t str_off = 0, str_size = 0;
  sh(shstrndx, 0x18, &str_off);
  sh(shstrndx, 0x20, &str_size);
  if (!elf.Has(str_off, str_size)) {
    *err = "bad section name table";
    return false;
  }
  for (size_t i = 0; i < shnum; ++i) {
    uint32_t name = 0, type = 0;
    elf.Get(shoff + i * shentsize, &name);
    elf.Get(shoff + i * shentsize + 4, &type);
    uint64_t off = 0, size = 0;
    sh(i, 0x18, &off);
    sh(i, 0x20, &size);
    const char want[] = ".nv_fatbin";
    if (name < str_size && str_size - name > sizeof(want) - 1 &&
        std::memcmp(elf.p + str_off + name, want, sizeof(want)) == 0) {
      if (type == 8 /* SHT_NOBITS */ || !elf.Has(off, size)) {
        *err = ".nv_fatbin has no contents";
        return false;
      }
      *sec = Bytes{elf.p + off, size};
      return true;
    }
  }
  return false;
}

int g_objects_with_device_code = 0;
int g_containers = 0;
bool g_ok = true;
std::set<uint32_t> g_want_ptx;

void CheckElf(const std::string& name, Bytes elf, const std::set<uint32_t>& want) {
  Bytes sec{nullptr, 0};
  std::string err;
  if (!FindFatbinSection(elf, &sec, &err)) {
    if (!err.empty()) {
      std::printf("%s: %s\n", name.c_str(), err.c_str());
      g_ok = false;
    }
    return;
  }
  std::vector<Entry> entries;
  int containers = 0;
  const bool parsed = ParseFatbin(sec, &entries, &err, &containers);
  g_containers += containers;
  if (!parsed) {
    std::printf("%s: %s\n", name.c_str(), err.c_str());
    g_ok = false;
    return;
  }
  ++g_objects_with_device_code;
  std::set<uint32_t> sass, ptx;
  for (const Entry& e : entries) (e.kind == 2 ? sass : ptx).insert(e.arch);
  std::string line = name + ":";
  for (uint32_t a : sass) line += " sm_" + std::to_string(a);
  for (uint32_t a : ptx) line += " compute_" + std::to_string(a) + "(ptx)";
  for (uint32_t a : want) {
    if (!sass.count(a)) {
      line += "  MISSING sm_" + std::to_string(a);
      g_ok = false;
    }
  }
  for (uint32_t a : g_want_ptx) {
    if (!ptx.count(a)) {
      line += "  MISSING compute_" + std::to_string(a) + "(ptx)";
      g_ok = false;
    }
  }
  std::printf("%s\n", line.c_str());
}

void CheckArchive(Bytes ar, const std::set<uint32_t>& want) {
  size_t p = 8;
  std::string long_names;
  while (p + 60 <= ar.n) {
    const char* h = reinterpret_cast<const char*>(ar.p + p);
    if (h[58] != '`' || h[59] != '\n') {
      std::printf("archive: bad member header at %zu\n", p);
      g_ok = false;
      return;
    }
    std::string name(h, 16);
    const uint64_t size = std::strtoull(std::string(h + 48, 10).c_str(), nullptr, 10);
    p += 60;
    if (size > ar.n - p) {
      std::printf("archive: member %s out of bounds\n", name.c_str());
      g_ok = false;
      return;
    }
    Bytes member{ar.p + p, static_cast<size_t>(size)};
    if (name.rfind("//", 0) == 0) {
      long_names.assign(reinterpret_cast<const char*>(member.p), member.n);
    } else if (name[0] == '/' && name[1] >= '0' && name[1] <= '9') {
      const size_t off = std::strtoull(name.c_str() + 1, nullptr, 10);
      std::string n2 = off < long_names.size() ? long_names.substr(off) : "?";
      n2 = n2.substr(0, n2.find('/'));
      CheckElf(n2, member, want);
    } else if (name[0] != '/') {
      CheckElf(name.substr(0, name.find('/')), member, want);
    }
    p += static_cast<size_t>(size) + (size & 1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s FILE SM [SM...]   (e.g. libscape_core.a 80 90)\n", argv[0]);
    return 2;
  }
  std::ifstream f(argv[1], std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot open %s\n", argv[1]);
    return 2;
  }
  std::vector<uint8_t> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::set<uint32_t> want;
  int min_containers = 0;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("ptx", 0) == 0)
      g_want_ptx.insert(static_cast<uint32_t>(std::strtoul(a.c_str() + 3, nullptr, 10)));
    else if (a.rfind("containers=", 0) == 0)
      min_containers = std::atoi(a.c_str() + 11);
    else
      want.insert(static_cast<uint32_t>(std::strtoul(a.c_str(), nullptr, 10)));
  }
  Bytes all{data.data(), data.size()};
  if (data.size() >= 8 && std::memcmp(data.data(), "!<arch>\n", 8) == 0) {
    CheckArchive(all, want);
  } else {
    CheckElf(argv[1], all, want);
  }
  if (g_objects_with_device_code == 0) {
    std::printf("%s: no object with CUDA device code (.nv_fatbin) found\n", argv[1]);
    return 1;
  }
  if (g_containers < min_containers) {
    std::printf("%d fatbin container(s), expected at least %d: kernels are missing\n", g_containers,
                min_containers);
    g_ok = false;
  }
  std::printf("%d object(s) with device code, %d fatbin container(s): %s\n",
              g_objects_with_device_code, g_containers,
              g_ok ? "all required SM architectures present" : "FAILED");
  return g_ok ? 0 : 1;
}
