// The device step's state (optim_device.cc): the optimizer's per-element state and scratch in
// device memory, owned by Optimizer::dev_ once the optimizer has stepped on the device.
#ifndef SCAPE_PLUGIN_OPTIM_OPTIM_DEVICE_H_
#define SCAPE_PLUGIN_OPTIM_OPTIM_DEVICE_H_

#include <cstdint>
#include <vector>

#include "plugin/device/runtime.h"
#include "plugin/optim/optim.h"

namespace scape {

struct Optimizer::DeviceState {
  device::Runtime* rt = nullptr;
  void* stream = nullptr;  // the stream of the last device step
  // n floats each: the residual; the candidate (statistic), which is also the step's dense
  // momentum scratch (m_{t-1} before the candidate pass, which overwrites it in place with the
  // statistic; m_{t-1} at the mask again after the top-k, m_t after the update).
  float *dE = nullptr, *dStat = nullptr;
  // The momentum, packed (issue 24): kMom values at the positions dMomIdx (strictly increasing:
  // the mask of the last update, sorted), +0 elsewhere; momCap entries each (FitMom).
  float* dMp = nullptr;
  uint64_t* dMomIdx = nullptr;
  uint64_t kMom = 0, momCap = 0;
  // Room for km packed momentum values (the contents are not kept: the caller writes them);
  // replaced buffers retire like Fit's.
  Status FitMom(uint64_t km);
  // n floats: the fp32 master weights (mixed precision; allocated while the optimizer has them).
  float* dMaster = nullptr;
  // The mask-sized scratch, `cap` mask entries each (Fit): the packed payload in sorted order,
  // the exchange's send and receive buffers (payEsz bytes per element: the payload type's
  // size), the mask in mask order; the mask sorted and the two permutations between the orders
  // (allocated only once a mask's two orders differ); the sharded (theta', m') pairs, 2 floats
  // per entry each (allocated at the first sharded step).
  void *dPaySorted = nullptr, *dSend = nullptr, *dRecv = nullptr;
  size_t payEsz = 0;
  uint64_t *dMaskOrder = nullptr, *dSorted = nullptr, *dPerm = nullptr, *dInv = nullptr;
  float *dPairsSend = nullptr, *dPairsAll = nullptr;
  float* dMNew = nullptr;  // m_{t-1} at the current mask (sorted order), cap floats
  uint64_t cap = 0;
  // Makes the scratch fit a mask of k entries with esz-byte payloads (perm: the permutations
  // are needed; pairs: the pair buffers). Reallocates only when k outgrows the capacity, falls
  // below a quarter of it (the density schedule shrinks the mask: step 0's mask is full), or
  // the payload type changed (the old buffers retire, see below). Else nothing: no allocation
  // on a step's path once the density has settled.
  Status Fit(uint64_t k, size_t esz, bool perm, bool pairs);
  // Buffers a refit replaced, freed once `retiredAt` (recorded on the stream at the refit) has
  // completed: queued work may still use them, and no step waits for it.
  std::vector<void*> retired;
  device::Event retiredAt = nullptr;
  void SweepRetired();
  void Retire(void* p);
  Status RecordRetire();
  // The device bytes of the scratch above and of the top-k output (scapeOptimInfo_t).
  uint64_t ScratchBytes() const;
  uint64_t IndexBytes() const;
  // The top-k output: topCap positions on the device and pinned on the host (FitTop: as Fit,
  // for `total` selected positions; the host copy is idle when it is called).
  Status FitTop(uint64_t total);
  uint64_t topCap = 0;
  uint64_t *dTop = nullptr, *dCounts = nullptr;  // top-k output (topCap), its counts
  double* dSq = nullptr;                         // nranks partial squared norms
  size_t countsCap = 0;
  // Host side (pinned where the runtime gives it): the uploads and the selected positions.
  std::vector<uint64_t> hMaskOrder, hSorted, hPerm, hInv;
  uint64_t* hTop = nullptr;         // pinned, topCap
  double* hSq = nullptr;            // pinned, nranks
  uint32_t* dFlag = nullptr;        // the non-finite check's result (device, one word)
  uint32_t* hFlag = nullptr;        // its pinned copy
  device::Event selDone = nullptr;  // recorded after the copy of the selected positions
  bool selPending = false;          // a selection waits to be handed to the mask sync
  uint64_t selCount = 0;
  // "segment_rms": the staying sums' blocks (stayCap each).
  double* dStaySum = nullptr;
  uint64_t* dStayCnt = nullptr;
  size_t stayCap = 0;
  ~DeviceState();
};

}  // namespace scape

#endif  // SCAPE_PLUGIN_OPTIM_OPTIM_DEVICE_H_
