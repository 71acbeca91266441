// The optimizer step's kernel dispatch (issue 24 item 4). The SCAPE-AdamS step is written once,
// in optim_step.cc (Optimizer::RunStep): its phases, the non-finite agreement, the routing of
// its collectives, the norm and clipping, the sharded pairs, the byte accounting. What it does
// per element it asks of a StepKernels, the way CUB's dispatch layer hands one algorithm to
// the kernels of a device:
//   HostKernels (optim.cc): host memory, kernels/cpu, the communicator's collectives; the
//     momentum packed at the mask (m_), moved to the new mask inside the candidate pass;
//   DeviceKernels (optim_device.cc): device memory, the stream-ordered ops of the device runtime
//     (plugin/device/runtime.h: kernels/cuda, or the fake runtime in tests), the collectives on
//     the communicator's device backend (plugin/backend) on the caller's stream; the momentum
//     packed at the mask in position order, rebuilt densely in the statistic's buffer during
//     the step.
// Both compute the same bits (the device kernels' contracts say so op by op; the tests compare
// host and device steps bit for bit).
#ifndef SCAPE_PLUGIN_OPTIM_STEP_KERNELS_H_
#define SCAPE_PLUGIN_OPTIM_STEP_KERNELS_H_

#include <cstdint>
#include <memory>

#include "base/status.h"
#include "kernels/cpu/scape_step.h"
#include "plugin/coll/coll.h"
#include "plugin/optim/optim.h"

namespace scape {

class Optimizer::StepKernels {
 public:
  virtual ~StepKernels() = default;

  // Before anything of the step is looked at: the state is where these kernels work (the host
  // step brings a device state back; the device step allocates and uploads it at its first
  // step, and finishes the previous step's selection).
  virtual Status Begin() = 0;
  // This rank's gradients: *bad when one is inf or NaN; *first and *value say where and what
  // when the kernels know (UINT64_MAX otherwise). A host wait on a device.
  virtual Status FindNonFinite(bool* bad, uint64_t* first, float* value) = 0;
  // Around the mask's advance: the momentum's mask bookkeeping of the packed host state.
  virtual void BeforeAdvance() {}
  virtual void AdvanceFailed() {}
  // The step ends (error or skip) after the mask advanced and before the update.
  virtual void EndedWithoutUpdate() {}
  // The current mask (runs_ built) in the form the kernels take, and payload buffers for k
  // values to send and recvElems to receive (k replicated, this rank's kr sharded).
  virtual Status PrepareMask(uint64_t k, uint64_t recvElems, bool sharded) = 0;
  // This rank's gradients' squared L2 norm (kernels' GradSqNorm, the local clipping's norm), on
  // the host when this returns (a host wait on a device).
  virtual Status LocalGradSqNorm(double* out) = 0;
  // Candidate + pack + residual (error feedback) + the statistic of the owned part, from
  // m_{t-1}, the gradients (weighted by Optimizer::gradScale_) and the residual, into Send()
  // (k values, mask order).
  virtual Status Candidate() = 0;
  // Selects the next mask from the statistic (Mask::SelectNextTopk's segments and options)
  // and starts its sync (now, or when the stream has reached the selection).
  virtual Status SelectNext(double density) = 0;
  // The payload before and after the exchange; the sharded (theta', m') pairs.
  virtual void* Send() = 0;
  virtual void* Recv() = 0;
  virtual float* PairsSend() = 0;  // 2 kr floats
  virtual float* PairsAll() = 0;   // 2 k floats, mask order
  // A scaled payload type (kernels/dtypes.h, the scale rule; Send() and Recv() hold fp32 then):
  // ScaledAmax puts the largest |Send()[j]|, j < k, into one float in the kernels' memory
  // (*amax: the step's max all-reduce runs on it in place); Quantize converts Send()'s k values
  // into *wireSend (k elements of `wire`) with the scale of that agreed amax, the rounding error
  // going back into the residual at the mask (error feedback), and gives a wire receive buffer
  // of recvElems (*wireRecv); Dequantize converts its first `count` values into Recv().
  virtual Status ScaledAmax(uint64_t k, float** amax) = 0;
  virtual Status Quantize(scapeDataType_t wire, uint64_t k, uint64_t recvElems, void** wireSend,
                          void** wireRecv) = 0;
  virtual Status Dequantize(scapeDataType_t wire, uint64_t count) = 0;
  // Runs one of the step's collectives on those buffers (host memory: the communicator;
  // device memory: its device backend, on the step's stream).
  virtual Status Exchange(const coll::CollArgs& a) = 0;
  // Whether the gradient norm is computed when neither clipping nor anything else needs it
  // (the host: always, it is cheap; the device: no, it would be a host wait).
  virtual bool NormAlways() const = 0;
  // Squared norms of the recovered gradient (blocked order, RecoveredGradSqNorm) of `count`
  // received values from slot `recvSlot` of Recv(), whose mask entries start at `maskSlot`:
  // one per block, on the host when this returns (a host wait on a device).
  struct NormBlock {
    uint64_t recvSlot, maskSlot, count;
  };
  virtual Status NormPartials(const NormBlock* blocks, size_t nblocks, double* out) = 0;
  // "segment_rms": the staying block sums of Recv() (slot 0 is mask slot slot0) into
  // staySum_ / stayCnt_ with the bounds of StayingPlan(slot0, ...) (a host wait on a device).
  virtual Status StayingBlocks(uint64_t slot0) = 0;
  // Replicated: unpack + AdamS update of every masked position (and the decay outside).
  virtual Status Update(const kernels::AdamSParams& ap) = 0;
  // Sharded: the update of this rank's kr masked positions (mask slots from offr; Recv() holds
  // their reduced payload) into PairsSend(); then, after the pairs' all-gather, the unpack of
  // PairsAll() (and the decay outside the mask).
  virtual Status UpdatePairs(const kernels::AdamSParams& ap, uint64_t offr, uint64_t kr) = 0;
  virtual Status UnpackPairs(const kernels::AdamSParams& ap) = 0;
  // After the update: the momentum m_t lives on the current mask.
  virtual Status Finish() = 0;
};

// One step in progress (optim_step.cc): the kernels it runs on and what the step's first half
// (RunFront: up to the gradient norm) leaves for its second (RunBack: clipping, the update).
// RunStep runs both halves at once; a joint step (scapeOptimStepJoint) runs every member's
// first half, then every member's second half with one norm over all of them. A run destroyed
// after the mask advanced but before its update ends without update (the momentum stays where
// it was, StepKernels::EndedWithoutUpdate), and takes the step form's settings (the 16-bit copy,
// the device gradients' type) off the optimizer.
class Optimizer::StepRun {
 public:
  StepRun(Optimizer* o, std::unique_ptr<StepKernels> k) : o(o), K(std::move(k)) {}
  ~StepRun() {
    if (advanced && !updated) K->EndedWithoutUpdate();
    o->copy_ = nullptr;
    o->devGradType_ = scapeFloat32;
  }
  StepRun(const StepRun&) = delete;
  StepRun& operator=(const StepRun&) = delete;

  Optimizer* o;
  std::unique_ptr<StepKernels> K;
  kernels::ModelCopy copy;  // the 16-bit params the update also writes (o->copy_ points here)
  // RunFront's results.
  bool skipped = false;   // skipped at the non-finite agreement: nothing changed
  bool advanced = false;  // the mask advanced: the step ends in RunBack or without update
  bool updated = false;
  bool agree = false, sharded = false, norm = false, normGathered = false;
  uint64_t k = 0, kr = 0, offr = 0;
  uint64_t stayBytes = 0;  // sharded "segment_rms": the piece sums' share of the all-gather
  double sq = 0.0;         // with norm: the squared L2 norm of g^ (partials in rank order)
  double clipSq = 0.0;     // the squared norm clipping compares with (scapeOptimClipNorm_t)
  bool local = false;      // clipNorm = local: localSq is this rank's gradient norm squared
  double localSq = 0.0;
  double localSeconds = 0.0;
};

}  // namespace scape

#endif  // SCAPE_PLUGIN_OPTIM_STEP_KERNELS_H_
