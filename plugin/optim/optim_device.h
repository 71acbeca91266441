// The device step's state (optim_device.cc): the optimizer's per-element state and scratch in
// device memory, owned by Optimizer::dev_ once the optimizer has stepped on the device.
#ifndef SCAPE_PLUGIN_OPTIM_OPTIM_DEVICE_H_
#define SCAPE_PLUGIN_OPTIM_OPTIM_DEVICE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "plugin/device/device_pool.h"
#include "plugin/device/runtime.h"
#include "plugin/optim/optim.h"

namespace scape {

struct Optimizer::DeviceState {
  device::Runtime* rt = nullptr;
  void* stream = nullptr;  // the stream of the last device step
  // The communicator's device pool (plugin/device/device_pool.h), shared with its device
  // backend (Backend::SharedPool): the step's temporaries and the packed momentum are
  // blocks of it, so that every device temporary of the library is allocated, retired and torn
  // down by one pool. Shared, because this state may outlive the backend (scapeCommAbort
  // releases the communicator's device side before it frees the optimizers): the blocks go
  // back to a live pool, which the last owner frees.
  std::shared_ptr<device::DevicePool> pool;
  // n floats: the residual (this rank's own; state).
  float* dE = nullptr;
  // The momentum, packed (issue 24): kMom values at the positions dMomIdx (strictly increasing:
  // the mask of the last update, sorted), +0 elsewhere; one pool block `mom` of momCap entries
  // (FitMom: room for km values, the contents not kept; a refit drops the old block to the
  // pool, which frees it once the stream has passed).
  device::DevicePool::Block mom;
  float* dMp = nullptr;
  uint64_t* dMomIdx = nullptr;
  uint64_t kMom = 0, momCap = 0;
  Status FitMom(uint64_t km);
  // n floats: the fp32 master weights (mixed precision; allocated while the optimizer has them).
  float* dMaster = nullptr;
  // The step's scratch, one pool block `scratch` (Fit): the statistic (n floats), which is also
  // the step's dense momentum (m_{t-1} before the candidate pass, which overwrites it in place
  // with the statistic; m_{t-1} at the mask again after the top-k; m_t after the update); and,
  // `cap` mask entries each: the packed payload in sorted order, the exchange's send and receive
  // buffers (payEsz bytes per element: the payload type's size), m_{t-1} at the mask, the mask
  // in mask order; the mask sorted and the two permutations between the orders (once a mask's
  // two orders differ); the sharded (theta', m') pairs, 2 floats per entry each.
  device::DevicePool::Block scratch;
  float* dStat = nullptr;
  void *dPaySorted = nullptr, *dSend = nullptr, *dRecv = nullptr;
  size_t payEsz = 0;
  // A scaled payload type (kernels/dtypes.h): the wire buffers (wireEsz bytes per entry; 0: no
  // scaled type, none) and the agreed largest |value| (one float).
  void *dWireSend = nullptr, *dWireRecv = nullptr;
  float* dAmax = nullptr;
  size_t wireEsz = 0;
  float* dMNew = nullptr;
  uint64_t *dMaskOrder = nullptr, *dSorted = nullptr, *dPerm = nullptr, *dInv = nullptr;
  float *dPairsSend = nullptr, *dPairsAll = nullptr;
  uint64_t cap = 0, statN = 0;
  bool hasPerm = false, hasPairs = false;
  // dStat holds the packed momentum densely (+0 elsewhere): set after an update, cleared when
  // a candidate pass, a new block or a new momentum (DevicePush) overwrites it.
  bool statIsMomentum = false;
  // Makes the scratch fit n parameters and a mask of k entries with esz-byte payloads (perm:
  // the permutations are needed; pairs: the pair buffers). A new block only when k outgrows
  // the capacity, falls below a quarter of it (the density schedule shrinks the mask: step 0's
  // mask is full), the payload type changed or a part is missing; the old block is dropped to
  // the pool (freed once the stream has passed it, no host wait). Else nothing: no allocation
  // on a step's path once the density has settled. wireEsz: a scaled payload's element size
  // (0: not scaled).
  Status Fit(uint64_t n, uint64_t k, size_t esz, size_t wireEsz, bool perm, bool pairs);
  // The device bytes of the scratch and top-k blocks, less the index buffers (scapeOptimInfo_t:
  // scratchBytes), and of the index buffers (maskStateBytes).
  uint64_t ScratchBytes() const;
  uint64_t IndexBytes() const;
  // The top-k output: a pool block of topCap positions on the device, topCap pinned on the host
  // (FitTop: as Fit, for `total` selected positions; both are idle when it is called).
  Status FitTop(uint64_t total);
  device::DevicePool::Block top;
  uint64_t topCap = 0;
  uint64_t *dTop = nullptr, *dCounts = nullptr;  // top-k output (in `top`), its counts
  double* dSq = nullptr;                         // nranks partial squared norms
  size_t countsCap = 0;
  // Host side: the selected positions and results (pinned). The mask's uploads come from a
  // host array made at each step and held by the pool until they have run (PrepareMask).
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
  // Their pinned copy (sums then counts, 16 bytes a block, hStayCap bytes), kept between steps
  // (a cudaHostAlloc / cudaFreeHost per step would cost a device-wide synchronisation); given up
  // (leaked) when a wait for its copies timed out, since they may still write it.
  void* hStay = nullptr;
  size_t hStayCap = 0;
  // The state's other device buffers (dE, dMaster, dSq, dFlag, dCounts, dStaySum, dStayCnt):
  // pool blocks as well (exact size, held while the state lives or until Unhold), so that with
  // the caller's allocator (scapeConfig_t.deviceAllocator) every device buffer comes from it.
  std::vector<device::DevicePool::Block> held;
  Status Hold(size_t bytes, void** p);
  void Unhold(void* p);  // NULL: nothing; else the block goes back once the stream has passed
  ~DeviceState();
};

}  // namespace scape

#endif  // SCAPE_PLUGIN_OPTIM_OPTIM_DEVICE_H_
