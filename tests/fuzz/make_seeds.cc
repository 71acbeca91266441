// Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/): valid inputs of
// every format, so that the fuzzers start past the magics and checksums. Run by run.sh when a
// corpus directory is missing; the committed corpora were made by it.
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/mask_codec.h"
#include "plugin/nccl/ucx_engine.h"
#include "scape/scape.h"
#include "transport/bootstrap/bootstrap.h"

namespace {

std::string g_dir;

void Put(const std::string& target, const std::string& name, const std::vector<uint8_t>& b) {
  std::string d = g_dir + "/" + target;
  mkdir(d.c_str(), 0755);
  std::string p = d + "/" + name;
  FILE* f = std::fopen(p.c_str(), "wb");
  if (!f) {
    std::perror(p.c_str());
    return;
  }
  std::fwrite(b.data(), 1, b.size(), f);
  std::fclose(f);
}

template <typename T>
void Add(std::vector<uint8_t>* v, const T& x) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&x);
  v->insert(v->end(), p, p + sizeof(T));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  g_dir = argv[1];
  mkdir(g_dir.c_str(), 0755);
  using namespace scape;
  // Bootstrap hello: the fuzz target's secret (0xa5 ^ i).
  bootstrap::Secret secret{};
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = static_cast<uint8_t>(0xa5 ^ i);
  for (uint32_t blobLen : {1u, 7u, 300u}) {
    for (uint8_t step : {0, 1, 13}) {
      std::vector<uint8_t> v{step};
      Add(&v, bootstrap::MakeHello(secret, 1, 4, blobLen, 42, 5000, 1234));
      for (uint32_t i = 0; i < blobLen; ++i) v.push_back(static_cast<uint8_t>(i));
      Put("fuzz_bootstrap_hello", "hello_" + std::to_string(blobLen) + "_" + std::to_string(step),
          v);
    }
  }
  // Bootstrap reply: success with a table, and errors.
  for (int nranks : {1, 3, 8}) {
    std::vector<bootstrap::PeerEntry> t(static_cast<size_t>(nranks));
    for (int r = 0; r < nranks; ++r) {
      t[static_cast<size_t>(r)].hostHash = static_cast<uint64_t>(r) * 77;
      t[static_cast<size_t>(r)].pid = static_cast<uint32_t>(100 + r);
      t[static_cast<size_t>(r)].blob.assign(static_cast<size_t>(5 + r), static_cast<uint8_t>(r));
    }
    std::vector<uint8_t> v{static_cast<uint8_t>(nranks - 1), 5};
    std::vector<uint8_t> rep = bootstrap::EncodeReply(Status::Ok(), nranks, &t);
    v.insert(v.end(), rep.begin(), rep.end());
    Put("fuzz_bootstrap_reply", "ok_" + std::to_string(nranks), v);
  }
  {
    std::vector<uint8_t> v{2, 0};
    std::vector<uint8_t> rep =
        bootstrap::EncodeReply(InvalidUsage("two processes claim rank 1"), 3, nullptr);
    v.insert(v.end(), rep.begin(), rep.end());
    Put("fuzz_bootstrap_reply", "error", v);
  }
  // Unique ids, IPv4 and IPv6.
  for (const char* host : {"127.0.0.1", "::1"}) {
    bootstrap::RootAddress root;
    if (!bootstrap::ResolveHost(host, 29500, &root.addr).ok()) continue;
    root.secret = secret;
    scapeUniqueId id;
    bootstrap::EncodeUniqueId(root, &id);
    Put("fuzz_unique_id", std::string("id_") + (host[0] == ':' ? "v6" : "v4"),
        std::vector<uint8_t>(id.internal, id.internal + sizeof(id.internal)));
  }
  // Masks: every codec over a few (n, k), with nRaw odd (use the header's n), and the
  // library's 32-bit index part for the mask target's layout (n = 1000).
  for (uint64_t n : {uint64_t{1}, uint64_t{64}, uint64_t{1000}, uint64_t{5000}}) {
    std::vector<uint64_t> idx;
    for (uint64_t i = 0; i < n; i += 1 + (i % 7)) idx.push_back(i);
    for (kernels::MaskEncoding e :
         {kernels::MaskEncoding::kBitmap, kernels::MaskEncoding::kEliasFano,
          kernels::MaskEncoding::kDeltaVarint}) {
      std::vector<uint8_t> buf(1 << 16);
      size_t w = 0;
      if (kernels::MaskEncode(e, idx.data(), idx.size(), n, buf.data(), buf.size(), &w) !=
          kernels::KernelStatus::kOk)
        continue;
      std::vector<uint8_t> v;
      Add(&v, uint32_t{1});
      v.insert(v.end(), buf.begin(), buf.begin() + static_cast<long>(w));
      Put("fuzz_mask_decode",
          "enc" + std::to_string(static_cast<int>(e)) + "_n" + std::to_string(n), v);
    }
  }
  {
    std::vector<uint8_t> v;
    Add(&v, uint32_t{1});
    std::vector<uint8_t> hdr(kernels::kMaskHeaderBytes, 0);
    hdr[0] = 4;  // the library's 32-bit index encoding
    const uint64_t n = 1000, k = 5;
    std::memcpy(&hdr[8], &n, 8);
    std::memcpy(&hdr[16], &k, 8);
    v.insert(v.end(), hdr.begin(), hdr.end());
    for (uint32_t i : {0u, 9u, 10u, 400u, 999u}) Add(&v, i);
    Put("fuzz_mask_decode", "indices32_n1000", v);
  }
  // NCCL listen handle: a real one.
  {
    ucxnet::Options o;
    ucxnet::DeviceRoute route;
    route.oobIfname = "lo";
    route.ucxNetDevices = "lo";
    ucxnet::NetContext* ctx = nullptr;
    if (ucxnet::NewNetContext(o, 0, route, &ctx).ok()) {
      std::vector<uint8_t> h(ucxnet::kHandleBytes, 0);
      ucxnet::ListenComm* lc = nullptr;
      if (ucxnet::Listen(ctx, 0, route, h.data(), &lc).ok()) {
        Put("fuzz_nccl_handle", "listen_v4", h);
        ucxnet::CloseListen(lc);
      }
      ucxnet::DeleteNetContext(ctx);
    } else {
      std::fprintf(stderr, "make_seeds: no UCX context; no NCCL handle seed\n");
    }
  }
  // Optimizer checkpoint: the fuzz target's configuration, saved fresh.
  {
    scapeUniqueId id;
    scapeComm_t comm = nullptr;
    scapeOptim_t optim = nullptr;
    scapeOptimConfig_t cfg;
    static const uint64_t offs[] = {0, 64, 100, 1000};
    static const uint8_t dense[] = {1, 0, 0};
    if (scapeGetUniqueId(&id) == scapeSuccess &&
        scapeCommInitRank(&comm, 1, id, 0) == scapeSuccess &&
        scapeOptimConfigInit(&cfg) == scapeSuccess) {
      cfg.n = 1000;
      cfg.nsegments = 3;
      cfg.segOffsets = offs;
      cfg.denseFlags = dense;
      size_t bytes = 0, written = 0;
      if (scapeOptimCreate(&optim, &cfg, comm) == scapeSuccess &&
          scapeOptimCheckpointSize(optim, &bytes) == scapeSuccess) {
        std::vector<uint8_t> buf(bytes);
        if (scapeOptimSave(optim, buf.data(), buf.size(), &written) == scapeSuccess) {
          buf.resize(written);
          Put("fuzz_optim_checkpoint", "fresh", buf);
        }
        scapeOptimDestroy(optim);
      }
      scapeCommDestroy(comm);
    } else {
      std::fprintf(stderr, "make_seeds: no communicator; no checkpoint seed: %s\n",
                   scapeGetLastError(nullptr));
    }
  }
  return 0;
}
