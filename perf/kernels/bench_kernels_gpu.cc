// Times every CUDA kernel against the device's measured copy bandwidth (cudaMemcpy D2D, bytes
// counted as read + write) and prints one table. Run by perf/gpu/gpu_check.sh on a GPU machine.
//
//   scape_kernels_gpu_bench [n_elements (default 67108864)] [iterations (default 20)]
//
// Columns: time per call (mean of `iterations` after 3 warm-ups, CUDA events), the bytes the
// kernel must move, the bandwidth that implies, and x_copy = time / (bytes / copy bandwidth),
// i.e. how far from a memcpy of the same bytes (1.0 = as fast as a copy).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/mask_codec.h"
#include "kernels/cpu/topk.h"
#include "kernels/cuda/scape_kernels.cuh"

namespace {

using namespace scape::kernels;  // NOLINT
namespace kc = scape::kernels::cuda;

bool Ok(KernelStatus s, const char* what) {
  if (s != KernelStatus::kOk) {
    std::fprintf(stderr, "%s: %s (%s)\n", what, KernelStatusString(s), kc::LastCudaError());
    return false;
  }
  return true;
}

void Must(KernelStatus s, const char* what) {
  if (!Ok(s, what)) std::exit(1);
}

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) {
    if (!Ok(kc::DeviceMalloc(&p, bytes), "cudaMalloc")) std::exit(1);
  }
  ~Dev() { (void)kc::DeviceFree(p); }  // nothing to do about a failed free at exit
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Mean milliseconds per call of fn over iters calls (after 3 warm-ups).
double TimeMs(int iters, const std::function<KernelStatus()>& fn) {
  for (int i = 0; i < 3; ++i) {
    if (!Ok(fn(), "warm-up")) std::exit(1);
  }
  void *a, *b;
  Must(kc::EventCreate(&a), "EventCreate");
  Must(kc::EventCreate(&b), "EventCreate");
  Must(kc::EventRecord(a, nullptr), "EventRecord");
  for (int i = 0; i < iters; ++i) {
    if (!Ok(fn(), "timed call")) std::exit(1);
  }
  Must(kc::EventRecord(b, nullptr), "EventRecord");
  float ms = 0;
  if (!Ok(kc::EventElapsedMs(a, b, &ms), "event timing")) std::exit(1);
  Must(kc::EventDestroy(a), "EventDestroy");
  Must(kc::EventDestroy(b), "EventDestroy");
  return ms / iters;
}

}  // namespace

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (size_t{64} << 20);
  const int iters = argc > 2 ? std::atoi(argv[2]) : 20;
  if (kc::DeviceCount() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  std::printf(
      "device: %s, n = %zu fp32 elements, density 0.01 (gather/scatter: 0.01, 0.1, 1.0), %d timed "
      "calls each\n",
      kc::DeviceName(), n, iters);

  // Host data.
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> h(n);
  for (auto& v : h) v = nd(rng);
  std::vector<uint32_t> mask;
  std::bernoulli_distribution pick(0.01);
  for (size_t i = 0; i < n; ++i) {
    if (pick(rng)) mask.push_back(static_cast<uint32_t>(i));
  }
  const size_t k = mask.size();

  Dev a(n * 4), b(n * 4), c(n * 4), d(n * 4), dmask(k * 4), payload(k * 4), sq(8);
  Must(kc::CopyToDevice(a.p, h.data(), n * 4), "CopyToDevice");
  Must(kc::CopyToDevice(b.p, h.data(), n * 4), "CopyToDevice");
  Must(kc::CopyToDevice(c.p, h.data(), n * 4), "CopyToDevice");
  Must(kc::CopyToDevice(dmask.p, mask.data(), k * 4), "CopyToDevice");
  Must(kc::DeviceMemset(payload.p, 0, k * 4, nullptr), "DeviceMemset");
  Must(kc::StreamSynchronize(nullptr), "StreamSynchronize");

  const double copy_ms =
      TimeMs(iters, [&] { return kc::CopyDeviceToDevice(d.p, a.p, n * 4, nullptr); });
  const double copy_bw = 2.0 * n * 4 / (copy_ms * 1e-3);  // bytes/s, read + write

  struct Row {
    std::string name;
    double ms, bytes;
  };
  std::vector<Row> rows;
  rows.push_back({"cudaMemcpy D2D (limit)", copy_ms, 2.0 * n * 4});

  rows.push_back({"candidate+pack+residual fp32",
                  TimeMs(iters,
                         [&] {
                           return kc::CandidatePackResidualCuda(
                               a.as<float>(), b.as<float>(), c.as<float>(), n, 0.9f,
                               dmask.as<uint32_t>(), k, scapeFloat32, payload.p, nullptr, nullptr);
                         }),
                  16.0 * n + 8.0 * k});
  rows.push_back({"candidate+pack+residual bf16 +c",
                  TimeMs(iters,
                         [&] {
                           return kc::CandidatePackResidualCuda(
                               a.as<float>(), b.as<float>(), c.as<float>(), n, 0.9f,
                               dmask.as<uint32_t>(), k, scapeBfloat16, payload.p, d.as<float>(),
                               nullptr);
                         }),
                  20.0 * n + 6.0 * k});
  AdamSParams p;
  rows.push_back({"unpack+AdamS update fp32",
                  TimeMs(iters,
                         [&] {
                           return kc::UnpackAdamSUpdateCuda(payload.p, scapeFloat32,
                                                            dmask.as<uint32_t>(), k, d.as<float>(),
                                                            c.as<float>(), n, p, nullptr);
                         }),
                  12.0 * n + 12.0 * k});
  {
    size_t tb = 0;
    Must(
        kc::RecoveredGradSqNormCuda(payload.p, scapeFloat32, dmask.as<uint32_t>(), k, c.as<float>(),
                                    n, 0.9f, sq.as<double>(), nullptr, &tb, nullptr),
        "RecoveredGradSqNormCuda");
    Dev temp(tb);
    rows.push_back({"recovered-gradient sq norm",
                    TimeMs(iters,
                           [&] {
                             return kc::RecoveredGradSqNormCuda(
                                 payload.p, scapeFloat32, dmask.as<uint32_t>(), k, c.as<float>(), n,
                                 0.9f, sq.as<double>(), temp.p, &tb, nullptr);
                           }),
                    12.0 * k});
  }
  // Gather (the pack of a masked collective) and scatter (its unpack) of fp32 at sorted masks of
  // density 0.01, 0.1 and 1.0. Bytes: the index (8 per element), the packed side (4) and the
  // dense side in whole 32-byte sectors (every sector holding a masked element, counted
  // exactly): the least DRAM traffic any gather/scatter must cause, so x_copy compares the kernel
  // with a copy of that traffic (target: x_copy <= 1/0.7). At density 1.0 that is 16 bytes per
  // element; at 0.01 nearly every element costs its own sector. The scatter also counts a
  // 32-byte read of every partially written sector: HBM with ECC cannot write part of a sector,
  // so the memory system reads it, merges and writes it back (read-modify-write); a scatter at
  // density 0.01 or 0.1 therefore moves about twice the gather's dense-side bytes, and at
  // density 1.0 (whole sectors) the same. Before this the scatter was charged the gather's
  // bytes, i.e. less than the hardware must move.
  for (double density : {0.01, 0.1, 1.0}) {
    std::vector<uint64_t> gidx;
    std::bernoulli_distribution gpick(density);
    for (size_t i = 0; i < n; ++i) {
      if (density >= 1.0 || gpick(rng)) gidx.push_back(i);
    }
    const size_t gk = gidx.size();
    // sectors: 32-byte sectors of the dense side holding a masked element; partial: those of
    // them with fewer than 8 masked fp32 elements (the scatter writes only part of them).
    uint64_t sectors = 0, partial = 0, last = ~uint64_t{0}, in_sector = 0;
    for (uint64_t i : gidx) {
      if (i * 4 / 32 != last) {
        if (last != ~uint64_t{0} && in_sector < 8) ++partial;
        ++sectors;
        in_sector = 0;
      }
      ++in_sector;
      last = i * 4 / 32;
    }
    if (last != ~uint64_t{0} && in_sector < 8) ++partial;
    Dev didx(gk * 8 + 8), packed(gk * 4 + 4);
    Must(kc::CopyToDevice(didx.p, gidx.data(), gk * 8), "CopyToDevice");
    const double bytes = 12.0 * gk + 32.0 * sectors;
    // The scatter writes part of a partial sector: DRAM (ECC-protected HBM, 32-byte sector
    // granularity) must read the sector, merge and write it back, so each partial sector moves
    // 32 bytes each way; whole sectors are only written. The gather only reads its sectors.
    const double scatter_bytes = bytes + 32.0 * partial;
    char label[64];
    std::snprintf(label, sizeof label, "gather fp32 d=%g", density);
    rows.push_back({label,
                    TimeMs(iters,
                           [&] {
                             return kc::GatherByIndexCuda(a.p, didx.as<uint64_t>(), gk, 4, packed.p,
                                                          nullptr);
                           }),
                    bytes});
    std::snprintf(label, sizeof label, "scatter fp32 d=%g", density);
    rows.push_back({label,
                    TimeMs(iters,
                           [&] {
                             return kc::ScatterByIndexCuda(packed.p, didx.as<uint64_t>(), gk, 4,
                                                           d.p, nullptr);
                           }),
                    scatter_bytes});
  }
  // Top-k: one segment, and 1024 equal segments; exact and sampled.
  for (size_t nseg : {size_t{1}, size_t{1024}}) {
    std::vector<uint64_t> off(nseg + 1), kk(nseg), oo(nseg + 1);
    for (size_t s = 0; s <= nseg; ++s) off[s] = n / nseg * s;
    Must(TopkKFromDensity(off.data(), nseg, 0.01, kk.data()), "TopkKFromDensity");
    std::vector<uint64_t> cap(kk);
    for (auto& x : cap) x *= 2;
    TopkOutOffsets(cap.data(), nseg, oo.data());
    Dev doff((nseg + 1) * 8), dk(nseg * 8), doo((nseg + 1) * 8), dout(oo.back() * 4 + 4),
        dcounts(nseg * 8);
    Must(kc::CopyToDevice(doff.p, off.data(), off.size() * 8), "CopyToDevice");
    Must(kc::CopyToDevice(dk.p, kk.data(), kk.size() * 8), "CopyToDevice");
    Must(kc::CopyToDevice(doo.p, oo.data(), oo.size() * 8), "CopyToDevice");
    kc::TopkCudaSegments cs;
    cs.d_offsets = doff.as<uint64_t>();
    cs.d_k = dk.as<uint64_t>();
    cs.d_out_offsets = doo.as<uint64_t>();
    cs.nseg = nseg;
    cs.max_elements = off.back() - off.front();
    for (int sampled = 0; sampled < 2; ++sampled) {
      TopkOptions opt;
      opt.mode = sampled ? TopkMode::kSampled : TopkMode::kExact;
      size_t tb = 0;
      Must(kc::TopkAbsCuda(a.as<float>(), cs, opt, dout.as<uint32_t>(), dcounts.as<uint64_t>(),
                           nullptr, &tb, nullptr),
           "TopkAbsCuda");
      Dev temp(tb);
      const double ms = TimeMs(iters, [&] {
        return kc::TopkAbsCuda(a.as<float>(), cs, opt, dout.as<uint32_t>(), dcounts.as<uint64_t>(),
                               temp.p, &tb, nullptr);
      });
      rows.push_back({std::string("top-k ") + (sampled ? "sampled " : "exact ") +
                          std::to_string(nseg) + " seg",
                      ms, 4.0 * n});
    }
  }
  // Codecs on the 1% mask.
  {
    const uint64_t nw = BitmapWords(n);
    Dev words(nw * 8), out(k * 4 + 4), cnt(8), st(4);
    rows.push_back({"indices -> bitmap",
                    TimeMs(iters,
                           [&] {
                             return kc::IndicesToBitmapCuda(dmask.as<uint32_t>(), k, n,
                                                            words.as<uint64_t>(), nullptr);
                           }),
                    4.0 * k + 8.0 * nw});
    size_t tb = 0;
    Must(kc::BitmapToIndicesCuda(words.as<uint64_t>(), n, out.as<uint32_t>(), k, cnt.as<uint64_t>(),
                                 st.as<uint32_t>(), nullptr, &tb, nullptr),
         "BitmapToIndicesCuda");
    Dev temp(tb);
    rows.push_back({"bitmap -> indices",
                    TimeMs(iters,
                           [&] {
                             return kc::BitmapToIndicesCuda(
                                 words.as<uint64_t>(), n, out.as<uint32_t>(), k, cnt.as<uint64_t>(),
                                 st.as<uint32_t>(), temp.p, &tb, nullptr);
                           }),
                    4.0 * k + 8.0 * nw});
    const uint64_t ef = EliasFanoEncodedBytes(n, k);
    Dev buf(ef);
    size_t written = 0;
    rows.push_back({"Elias-Fano encode",
                    TimeMs(iters,
                           [&] {
                             return kc::EliasFanoEncodeCuda(dmask.as<uint32_t>(), k, n,
                                                            buf.as<uint8_t>(), ef, &written,
                                                            nullptr);
                           }),
                    4.0 * k + ef});
    size_t tb2 = 0;
    Must(kc::EliasFanoDecodeCuda(buf.as<uint8_t>(), ef, n, out.as<uint32_t>(), k,
                                 cnt.as<uint64_t>(), st.as<uint32_t>(), nullptr, &tb2, nullptr),
         "EliasFanoDecodeCuda");
    Dev temp2(tb2);
    rows.push_back({"Elias-Fano decode (validating)",
                    TimeMs(iters,
                           [&] {
                             return kc::EliasFanoDecodeCuda(
                                 buf.as<uint8_t>(), ef, n, out.as<uint32_t>(), k,
                                 cnt.as<uint64_t>(), st.as<uint32_t>(), temp2.p, &tb2, nullptr);
                           }),
                    4.0 * k + ef});
    uint32_t status = 1;
    Must(kc::CopyToHost(&status, st.p, 4), "CopyToHost");
    if (status != 0) std::printf("WARNING: Elias-Fano decode status %u\n", status);
  }

  std::printf("\n%-34s %10s %12s %10s %8s\n", "kernel", "ms/call", "bytes(MB)", "GB/s", "x_copy");
  for (const Row& r : rows) {
    const double gbps = r.bytes / (r.ms * 1e-3) / 1e9;
    const double x = r.ms / (r.bytes / copy_bw * 1e3);
    std::printf("%-34s %10.4f %12.1f %10.1f %8.2f\n", r.name.c_str(), r.ms, r.bytes / 1e6, gbps, x);
  }
  std::printf("\ncopy bandwidth (read + write): %.1f GB/s\n", copy_bw / 1e9);
  return 0;
}
