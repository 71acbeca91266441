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
  // n floats each: momentum, residual, the candidate (statistic).
  float *dM = nullptr, *dE = nullptr, *dStat = nullptr;
  // n floats: the fp32 master weights (mixed precision; allocated while the optimizer has them).
  float* dMaster = nullptr;
  // n payload elements of payEsz bytes each (the payload type's size: 4 for fp32, 2 for
  // bf16/fp16; reallocated when a loaded checkpoint changes the payload type): the packed
  // payload in sorted order, the exchange's send and receive buffers.
  void *dPaySorted = nullptr, *dSend = nullptr, *dRecv = nullptr;
  size_t payEsz = 0;
  // (Re)allocates the three payload buffers for n elements of esz bytes. The stream must be
  // idle (the caller synchronises it first when buffers exist).
  Status AllocPayload(uint64_t n, size_t esz);
  // n positions each: the mask in mask order, sorted, and the two permutations between them.
  uint64_t *dMaskOrder = nullptr, *dSorted = nullptr, *dPerm = nullptr, *dInv = nullptr;
  uint64_t *dTop = nullptr, *dCounts = nullptr;  // top-k output (owned size), its counts
  double* dSq = nullptr;                         // nranks partial squared norms
  size_t countsCap = 0;
  // Host side (pinned where the runtime gives it): the uploads and the selected positions.
  std::vector<uint64_t> hMaskOrder, hSorted, hPerm, hInv;
  uint64_t* hTop = nullptr;         // pinned, owned size
  double* hSq = nullptr;            // pinned, nranks
  uint32_t* dFlag = nullptr;        // the non-finite check's result (device, one word)
  uint32_t* hFlag = nullptr;        // its pinned copy
  device::Event selDone = nullptr;  // recorded after the copy of the selected positions
  bool selPending = false;          // a selection waits to be handed to the mask sync
  uint64_t selCount = 0;
  // Sharded ownership: the (theta', m') pairs, 2n floats each (allocated at the first sharded
  // step): this rank's, and every rank's after the all-gather (mask order).
  float *dPairsSend = nullptr, *dPairsAll = nullptr;
  // "segment_rms": the staying sums' blocks (stayCap each).
  double* dStaySum = nullptr;
  uint64_t* dStayCnt = nullptr;
  size_t stayCap = 0;
  ~DeviceState();
};

}  // namespace scape

#endif  // SCAPE_PLUGIN_OPTIM_OPTIM_DEVICE_H_
