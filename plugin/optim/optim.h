// The SCAPE-AdamS optimizer step (issue 11): the whole step on host or device memory (one
// algorithm, optim_step.cc, over the kernels of step_kernels.h), built on the agreed mask
// (plugin/mask), the collectives of the communicator (plugin/core, plugin/coll) and, for a
// device step, the communicator's device backend (plugin/backend).
// Internal; the public handle (struct scapeOptim) wraps it in plugin/api/api_optim.cc, which
// validates every argument before calling in.
#ifndef SCAPE_PLUGIN_OPTIM_OPTIM_H_
#define SCAPE_PLUGIN_OPTIM_OPTIM_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "base/status.h"
#include "kernels/cpu/scape_step.h"
#include "plugin/coll/coll.h"
#include "plugin/core/comm.h"
#include "plugin/mask/mask.h"
#include "scape/scape.h"

namespace scape {
namespace backend {
class Backend;
}

// Hyperparameters that a checkpoint carries and scapeOptimSetLr changes.
struct OptimHyper {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weightDecay = 0.0f;
  float maxGradNorm = 0.0f;
  // Plain ints until ValidateHyper has checked them (callers may pass any int; an out-of-range
  // enum value is not representable): a scapeBiasCorrection_t and a scapeDataType_t.
  int bias = scapeBiasCorrectionNone;
  double density = 0.01;
  int64_t warmupSteps = 0;
  int payload = scapeFloat32;
  int entering = scapeOptimEnteringPayload;    // a scapeOptimEntering_t (issue 23)
  int clipNorm = scapeOptimClipNormRecovered;  // a scapeOptimClipNorm_t (issue 30)
  int schedule = scapeDensityGeometric;        // a scapeDensitySchedule_t (issue 42)
};

// The density schedule (scape.h, scapeDensitySchedule_t): rho(t) of step t for target density
// `density`, warm-up length `warmupSteps` and shape `schedule` (validated values). A function
// of the step alone, so the host and the device step, and a resumed run, read the same bits.
double ScheduleDensity(int schedule, double density, int64_t warmupSteps, int64_t t);
// scapeOptimScheduleForBudget: the longest warm-up whose average density over totalSteps
// steps is at most averageDensity; the message names the argument that is out of range.
Status ScheduleForBudget(int schedule, double density, double averageDensity, int64_t totalSteps,
                         int64_t* warmupSteps);

// Checks every hyperparameter; the message names the field ("beta1 = 1: expected ...").
Status ValidateHyper(const OptimHyper& h);
// The kernels' bias correction for a scapeBiasCorrection_t (host and device steps).
kernels::BiasCorrection KernelBias(scapeBiasCorrection_t b);

// A resolved, validated configuration.
struct OptimLayout {
  uint64_t n = 0;
  std::vector<uint64_t> offsets;  // nsegments + 1
  std::vector<uint8_t> dense;     // nsegments (0/1)
  scapeOptimOwnership_t ownership = scapeOptimReplicated;
  scapeOwnership_t maskOwnership = scapeOwnershipSegments;
  scapeMaskEncoding_t encoding = scapeMaskEncodingAuto;
  scapeOptimNonFinite_t nonFinite = scapeOptimNonFiniteSkip;
};

class Optimizer {
 public:
  // Collective. `mask` was created on `comm` with the layout (dense flags, mask ownership and
  // encoding) and outlives the optimizer. Agrees on the configuration across ranks and on the
  // full mask for step 0.
  static Status Create(Comm* comm, Mask* mask, const OptimLayout& layout, const OptimHyper& hyper,
                       std::unique_ptr<Optimizer>* out);
  ~Optimizer();

  uint64_t n() const { return layout_.n; }
  Status SetLr(float lr);
  // The hyperparameters in force; SetHyper replaces the per-step ones (lr, beta1, beta2, eps,
  // weight decay; the caller leaves the others as hyper() has them) after ValidateHyper.
  const OptimHyper& hyper() const { return hyper_; }
  scapeOptimNonFinite_t NonFinite() const { return layout_.nonFinite; }
  Status SetHyper(const OptimHyper& h);
  // The step is one algorithm (RunStep, optim_step.cc) over two kernel sets (step_kernels.h):
  // Step runs it on host memory, StepDevice on device memory.
  // theta and g: n floats each, validated by the caller.
  Status Step(float* theta, const float* g);
  // The device step (optim_device.cc): dTheta and dG are n floats of device memory, validated
  // by the caller; the work is enqueued on `stream`. `exchange` is the communicator's device
  // backend (plugin/backend: UCX staged or NCCL), which runs the step's payload collectives on
  // device buffers, stream-ordered.
  Status StepDevice(float* dTheta, const float* dG, void* stream, backend::Backend* exchange);
  bool OnDevice() const { return dev_ != nullptr; }
  // Mixed precision (scapeOptimStepMixed): params are n elements of paramType (scapeBfloat16 or
  // scapeFloat16; the optimizer holds fp32 master weights, initialised from params at the
  // first mixed step, and the update writes the master and params in the same pass), grads n
  // elements of gradType (fp32, bf16 or fp16; widened exactly). Host memory.
  Status StepMixed(void* params, scapeDataType_t paramType, const void* grads,
                   scapeDataType_t gradType);
  // The same on device memory (optim_device.cc), enqueued on `stream`.
  Status StepDeviceMixed(void* dParams, scapeDataType_t paramType, const void* dG,
                         scapeDataType_t gradType, void* stream, backend::Backend* exchange);
  // One step of several optimizers of the same communicator as one (scapeOptimStepJoint):
  // every member's step up to its gradient norm, then one norm over all members (their squared
  // norms added in member order) for clipping, then every member's update. A step skipped for
  // non-finite values by one member is skipped by all. Every member has the same maxGradNorm
  // and nonFinite (checked by the caller). params / grads / types as for StepMixed (fp32
  // params and grads: the plain step); `device` for device memory on `stream`.
  struct JointMember {
    Optimizer* opt = nullptr;
    void* params = nullptr;
    scapeDataType_t paramType = scapeFloat32;
    const void* grads = nullptr;
    scapeDataType_t gradType = scapeFloat32;
  };
  static Status StepJoint(const JointMember* members, size_t count, bool device, void* stream,
                          backend::Backend* exchange);
  // The 16-bit type the master weights shadow; scapeFloat32 while there are none.
  scapeDataType_t MasterType() const { return masterType_; }
  void GetInfo(scapeOptimInfo_t* info) const;

  Status CheckpointSize(size_t* bytes);
  Status Save(void* buf, size_t capacity, size_t* written);
  // Collective.
  Status Load(const void* buf, size_t size);

 private:
  Optimizer() = default;
  // The step's kernel dispatch (step_kernels.h) and its two kernel sets (HostKernels in
  // optim.cc, DeviceKernels in optim_device.cc); RunStep is the step (optim_step.cc).
  class StepKernels;
  class StepRun;
  struct HostKernels;
  struct DeviceKernels;
  // The step forms' first part (checks, 16-bit conversions, the kernels; no collective yet):
  // a run for RunStep, or for RunFront and RunBack.
  Status PrepareHost(float* theta, const float* g, std::unique_ptr<StepRun>* run);
  Status PrepareMixed(void* params, scapeDataType_t paramType, const void* grads,
                      scapeDataType_t gradType, std::unique_ptr<StepRun>* run);
  Status PrepareDevice(float* dTheta, const float* dG, void* stream, backend::Backend* exchange,
                       std::unique_ptr<StepRun>* run);
  Status PrepareDeviceMixed(void* dParams, scapeDataType_t paramType, const void* dG,
                            scapeDataType_t gradType, void* stream, backend::Backend* exchange,
                            std::unique_ptr<StepRun>* run);
  Status PrepareMember(const JointMember& m, bool device, void* stream, backend::Backend* exchange,
                       std::unique_ptr<StepRun>* run);
  // The step (optim_step.cc): RunAgree, RunFront up to the gradient norm, RunBack from the clipping
  // on with `clipNorm`, the norm compared with maxGradNorm (the run's own, or a joint step's);
  // RunStep both.
  Status RunStep(StepRun& run);
  Status RunAgree(StepRun& run);  // up to the non-finite agreement (run.skipped)
  // clipNorm = local: this rank's gradient norm squared (run.localSq), before RunFront; then
  // SetLocalClip with it (a joint step: with the sum over its members) sets gradScale_.
  Status RunLocalNorm(StepRun& run);
  void SetLocalClip(double sq);
  Status RunFront(StepRun& run);
  Status RunBack(StepRun& run, double clipNorm, bool haveNorm);
  double Density(int64_t t) const;  // scheduled density of step t
  Status CheckMaskUse() const;
  void BuildRuns();
  // Start of a step (host or device): waits for the mask sync of the previous step, makes its
  // mask current (counting its bytes) and rebuilds the runs.
  Status AdvanceToAgreedMask();
  kernels::MaskView View() const;
  Status SyncOwnPart(const uint64_t* idx, size_t k);  // set + sync + wait (collective)
  // Where a checkpoint's parts lie (byte offsets; optim_checkpoint.cc describes the formats).
  struct CheckpointParts {
    uint32_t version = 0;
    size_t mom = 0, residual = 0, master = 0, momIdx = 0, idx = 0;
    uint64_t km = 0;   // version 4: the momentum's values
    bool own = false;  // version 4: the momentum has positions of its own
  };
  Status ValidateCheckpoint(const uint8_t* b, size_t size, OptimHyper* hyper, int64_t* step,
                            bool* hasNext, uint64_t* kc, uint64_t* kn, scapeDataType_t* masterType,
                            CheckpointParts* parts) const;
  Status ValidateOwnIndices(const uint8_t* p, uint64_t k, const char* what) const;
  uint64_t LayoutFingerprint() const;
  // Non-finite gradients (issue 24 item 9). AgreeFinite: collective, before any state change
  // of a step; `bad`: this rank's gradients hold a non-finite value (the first at `first`, of
  // value `value`). Fails (nothing changed) when the ranks' per-step hyperparameters differ or,
  // with nonFinite = Error, when any rank's gradients are not finite; *skip: some rank's are
  // (the step is counted as skipped). SkipAfterExchange: the reduced payload was not finite
  // although every rank's gradients were (see scape.h); the update is left out.
  Status AgreeFinite(bool bad, uint64_t first, float value, bool* skip);
  Status SkipAfterExchange();
  void MarkSkipped();
  int64_t skipped_ = 0;  // steps skipped for non-finite gradients (not checkpointed)
  // Device state (optim_device.cc). Finish: the host part of the last device step that waits
  // for the device (the selected positions; the mask sync start). ToHost: waits for the
  // device work, copies m and e back into m_, e_ and frees the device state.
  struct DeviceState;
  Status DeviceFinishSelect();
  Status DevicePull();  // finish, wait, copy the device m and e into m_, e_ (state stays)
  Status DevicePush();  // copy m_, e_ to the device state and wait
  Status DeviceToHost();
  void DeviceRelease();
  std::unique_ptr<DeviceState> dev_;

  Comm* comm_ = nullptr;
  Mask* mask_ = nullptr;
  int rank_ = 0, nranks_ = 1, threads_ = 1;
  OptimLayout layout_;
  OptimHyper hyper_;

  // e_: the residual, n floats (this rank's own error: never sharded). m_: the momentum,
  // identical on every rank (every rank's candidate pass reads it at every masked position, so
  // it is not sharded either), packed (issue 24): +0 outside the mask of the last step and
  // stored only at that mask's entries, in its mask order (m_[j] is m at momentum mask entry
  // j). The momentum mask is the current mask, or momIdx_ / momRuns_ while momOwn_ (a step
  // skipped after the mask advanced, or a loaded checkpoint whose momentum is not on its
  // current mask): then its entries are in any run order, as a MaskView allows.
  std::vector<float> m_, e_;
  bool momOwn_ = false;
  std::vector<uint64_t> momIdx_;
  std::vector<kernels::MaskRun> momRuns_;
  // During a host step: the mask the momentum was on when the mask advanced (held so that the
  // candidate pass and a skip can still read it), its runs, and m_{t-1} at the new mask.
  std::shared_ptr<const std::vector<uint64_t>> oldHold_;
  std::vector<kernels::MaskRun> oldRuns_;
  std::vector<float> mPrev_;
  kernels::MaskView MomentumView() const;  // where m_ lives (the current mask unless momOwn_)
  // Ends a host step that did not update: the momentum stays on the mask it was on.
  void KeepOldMomentumMask();
  // The momentum from its dense form (n floats, +0 outside its mask: the device state coming
  // back, checkpoints of versions 1-3): keeps every non-zero value (by its bits), so the
  // momentum moves on the current mask unless values lie outside it.
  void PackMomentum(const float* dense);
  // Mixed precision: fp32 master weights (n floats, identical on every rank) of the 16-bit
  // params of type masterType_ (scapeFloat32: none, master_ empty). copy_: the 16-bit copy the
  // step in progress writes beside theta (nullptr: none); gWide_: 16-bit grads widened.
  scapeDataType_t masterType_ = scapeFloat32;
  std::vector<float> master_;
  const kernels::ModelCopy* copy_ = nullptr;
  std::vector<float> gWide_;
  scapeDataType_t devGradType_ = scapeFloat32;  // the device step in progress: dG's type
  Status CheckMixedTypes(scapeDataType_t paramType, scapeDataType_t gradType) const;
  std::unique_ptr<float[]> stat_;  // n floats; only this rank's owned part is ever touched
  uint64_t ownedSize_ = 0, denseCount_ = 0;
  std::vector<char> send_, recv_;  // payload before / after the exchange
  // A scaled payload type (kernels/dtypes.h): the values on the wire (send_ / recv_ hold fp32)
  // and the agreed largest |value| the scale comes from.
  std::vector<char> wireSend_, wireRecv_;
  float amax_ = 0.0f;
  // The payload type the step kernels see: hyper_.payload, or fp32 for a scaled type (converted
  // around the exchange, optim_step.cc).
  scapeDataType_t KernelPayload() const;
  std::vector<float> pairsSend_, pairsAll_;  // sharded: updated (theta, m) pairs
  std::vector<kernels::MaskRun> runs_;       // the current mask as a view (BuildRuns)
  std::vector<uint64_t> denseInMask_;        // per rank: dense positions in its block
  // "segment_rms" (scapeOptimEnteringSegmentRms, docs/ALGORITHM.md 4.12): the staying sums of
  // the runs (pieces) selected by `owned` (true: this rank's; false: all), each piece's blocked
  // sum in position order of runs_, into pieceSum_/pieceCnt_ (indexed like runs_), payload
  // slot 0 being mask slot `slot0`. In three parts, the kernels' StayingBlocks in between: the
  // block bounds of the selected pieces (stayOrder_, stayFirst_, stayBounds_; staySum_/stayCnt_
  // sized), the blocks' sums, and the pieces' sums from the blocks' sums.
  Status StayingPlan(uint64_t slot0, bool owned);
  void StayingFinish();
  void EnterVsFromPieces();  // enterVs_ per segment from pieceSum_/pieceCnt_ (position order)
  std::vector<size_t> stayOrder_, stayFirst_;
  // "segment_rms", with or without momentum factor masking (scapeOptimEnteringSegmentRmsMasked)
  bool SegmentRms() const { return hyper_.entering != scapeOptimEnteringPayload; }
  bool ClipStaying() const { return hyper_.clipNorm == scapeOptimClipNormStaying; }
  bool ClipLocal() const {
    return hyper_.clipNorm == scapeOptimClipNormLocal && hyper_.maxGradNorm > 0.0f;
  }
  // The staying sums (pieceSum_) are needed by segment_rms and by the staying clip norm.
  bool NeedStaying() const { return SegmentRms() || (ClipStaying() && hyper_.maxGradNorm > 0.0f); }
  std::vector<double> pieceSum_;
  std::vector<uint64_t> pieceCnt_;
  std::vector<uint64_t> stayBounds_, stayCnt_;
  std::vector<double> staySum_;
  std::vector<int64_t> normMsg_, normAll_;  // sharded: the norm all-gather with the piece sums
  std::vector<float> enterVs_;              // per segment (AdamSParams.enter_vs)

  int64_t step_ = 0;      // steps completed
  bool pending_ = false;  // a sync of the next mask was started by the last step
  uint64_t gen_ = 0;      // mask generation after our last SyncStart / Advance

  // Last step's figures (scapeOptimInfo_t).
  uint64_t maskBytes_ = 0, payloadBytes_ = 0, denseBytes_ = 0;
  uint64_t controlBytes_ = 0;  // the step's small control exchanges (scapeOptimInfo_t)
  double gradNorm_ = 0.0;
  float clipScale_ = 1.0f;
  // clipNorm = local: the weight of this rank's gradient in this step's candidate (1: none) and
  // the norm it came from.
  float gradScale_ = 1.0f;
  double localNorm_ = 0.0;
  double phase_[scapeOptimNumPhases] = {};
  double maskWait_ = 0.0;  // scapeOptimInfo_t.maskWaitSeconds (AdvanceToAgreedMask)
};

}  // namespace scape

#endif  // SCAPE_PLUGIN_OPTIM_OPTIM_H_
