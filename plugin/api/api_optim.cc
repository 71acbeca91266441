// SCAPE API entry points of the SCAPE-AdamS optimizer (plugin/optim): argument checks, error
// strings, and the guarantee that no exception crosses into the caller. A call that fails its
// checks changes nothing.
#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/dtypes.h"
#include "plugin/api/api_internal.h"
#include "plugin/device/runtime.h"
#include "plugin/mask/mask.h"
#include "plugin/optim/optim.h"

struct scapeOptim {
  // In the handle registry from creation to destruction (api_internal.h), so that a destroyed
  // or foreign handle is refused by every entry point before anything is read through it.
  scapeOptim() { scape::api::RegisterHandle(this, scape::api::HandleKind::kOptim); }
  ~scapeOptim() { scape::api::UnregisterHandle(this); }
  static void* operator new(size_t n) { return ::operator new(n); }  // pairs with the delete
  static void operator delete(void* p) {
    scape::api::QuarantineFree(p, scape::api::HandleKind::kOptim);
  }
  std::unique_ptr<scape::Optimizer> impl;
  scapeComm* comm = nullptr;
  scapeMask* mask = nullptr;  // registered in comm->masks; destroyed with the optimizer
};

namespace {

using scape::Status;
using scape::StrFormat;
using scape::api::CheckComm;
using scape::api::Guard;

bool OptimLive(scapeOptim* o) {
  return scape::api::HandleLive(o, scape::api::HandleKind::kOptim) && o->impl;
}

// Looked up in the registry before anything is read through the handle.
scapeComm* CommOf(scapeOptim* o) { return OptimLive(o) ? o->comm : nullptr; }

Status CheckOptim(scapeOptim* o) {
  if (!o) return scape::InvalidArgument("optim is NULL");
  if (!OptimLive(o))
    return scape::InvalidArgument(
        "optim is not a live optimizer (destroyed, its communicator was aborted, or not made "
        "by scapeOptimCreate)");
  return Status::Ok();
}

bool Misaligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) != 0; }

Status ResolveConfig(const scapeOptimConfig_t* c, scape::OptimLayout* layout,
                     scape::OptimHyper* hyper) {
  if (!c) return scape::InvalidArgument("config is NULL");
  if (c->size != sizeof(scapeOptimConfig_t) || c->magic != SCAPE_OPTIM_CONFIG_MAGIC)
    return scape::InvalidArgument(
        StrFormat("config (size %zu, magic %#x) was not initialised with "
                  "scapeOptimConfigInit (size %zu, magic %#x)",
                  c->size, c->magic, sizeof(scapeOptimConfig_t), SCAPE_OPTIM_CONFIG_MAGIC));
  if (c->n == 0 || c->n >= (uint64_t{1} << 40))
    return scape::InvalidArgument(StrFormat("config->n = %llu: expected 0 < n < 2^40",
                                            static_cast<unsigned long long>(c->n)));
  if (c->nsegments < 1)
    return scape::InvalidArgument(StrFormat("config->nsegments = %d: expected >= 1", c->nsegments));
  if (!c->segOffsets) return scape::InvalidArgument("config->segOffsets is NULL");
  const uint64_t* o = c->segOffsets;
  if (o[0] != 0)
    return scape::InvalidArgument(
        StrFormat("config->segOffsets[0] = %llu: segments must start at 0",
                  static_cast<unsigned long long>(o[0])));
  for (int s = 0; s < c->nsegments; ++s)
    if (o[s + 1] < o[s])
      return scape::InvalidArgument(StrFormat(
          "config->segOffsets[%d] = %llu is below segOffsets[%d] = %llu: segments overlap "
          "(offsets must be non-decreasing)",
          s + 1, static_cast<unsigned long long>(o[s + 1]), s,
          static_cast<unsigned long long>(o[s])));
  if (o[c->nsegments] != c->n)
    return scape::InvalidArgument(StrFormat(
        "config->segOffsets[%d] = %llu: the segments cover "
        "[0, %llu), not the n = %llu parameters",
        c->nsegments, static_cast<unsigned long long>(o[c->nsegments]),
        static_cast<unsigned long long>(o[c->nsegments]), static_cast<unsigned long long>(c->n)));
  if (c->ownership < 0 || c->ownership >= scapeNumOptimOwnerships)
    return scape::InvalidArgument(
        StrFormat("config->ownership = %d: expected a "
                  "scapeOptimOwnership_t (0..%d)",
                  c->ownership, scapeNumOptimOwnerships - 1));
  if (c->maskOwnership < -1 || c->maskOwnership >= scapeNumOwnerships)
    return scape::InvalidArgument(
        StrFormat("config->maskOwnership = %d: expected -1 or a "
                  "scapeOwnership_t (0..%d)",
                  c->maskOwnership, scapeNumOwnerships - 1));
  if (c->maskEncoding < 0 || c->maskEncoding >= scapeNumMaskEncodings)
    return scape::InvalidArgument(
        StrFormat("config->maskEncoding = %d: expected a "
                  "scapeMaskEncoding_t (0..%d)",
                  c->maskEncoding, scapeNumMaskEncodings - 1));
  if (c->nonFinite < 0 || c->nonFinite >= scapeNumOptimNonFinite)
    return scape::InvalidArgument(
        StrFormat("config->nonFinite = %d: expected a scapeOptimNonFinite_t (0..%d)", c->nonFinite,
                  scapeNumOptimNonFinite - 1));
  scape::OptimHyper h;
  h.lr = c->lr;
  h.beta1 = c->beta1;
  h.beta2 = c->beta2;
  h.eps = c->eps;
  h.weightDecay = c->weightDecay;
  h.maxGradNorm = c->maxGradNorm;
  h.bias = c->biasCorrection;
  h.density = c->density;
  h.warmupSteps = c->warmupSteps;
  h.payload = c->payloadType;
  h.entering = c->entering;
  h.clipNorm = c->clipNorm;
  h.schedule = c->densitySchedule;
  SCAPE_RETURN_IF_ERROR(scape::ValidateHyper(h).Prepend("config"));
  layout->n = c->n;
  layout->offsets.assign(o, o + c->nsegments + 1);
  layout->dense.assign(static_cast<size_t>(c->nsegments), 0);
  if (c->denseFlags)
    for (int s = 0; s < c->nsegments; ++s)
      layout->dense[static_cast<size_t>(s)] = c->denseFlags[s] != 0;
  layout->ownership = static_cast<scapeOptimOwnership_t>(c->ownership);
  layout->maskOwnership = c->maskOwnership >= 0 ? static_cast<scapeOwnership_t>(c->maskOwnership)
                          : layout->ownership == scapeOptimSharded ? scapeOwnershipShards
                                                                   : scapeOwnershipSegments;
  layout->encoding = static_cast<scapeMaskEncoding_t>(c->maskEncoding);
  layout->nonFinite = static_cast<scapeOptimNonFinite_t>(c->nonFinite);
  *hyper = h;
  return Status::Ok();
}

}  // namespace

namespace scape {
namespace api {

// Frees an optimizer whose communicator is being torn down by scapeCommAbort (which frees the
// optimizer's mask with the communicator's other masks).
void DeleteOptimOnAbort(scapeOptim* o) {
  if (!o) return;
  o->impl.reset();
  delete o;
}

}  // namespace api
}  // namespace scape

extern "C" {

SCAPE_API scapeResult_t scapeOptimConfigInit(scapeOptimConfig_t* c) {
  return Guard(nullptr, "scapeOptimConfigInit", [&]() -> Status {
    if (!c) return scape::InvalidArgument("config is NULL");
    std::memset(c, 0, sizeof(*c));
    c->size = sizeof(*c);
    c->magic = SCAPE_OPTIM_CONFIG_MAGIC;
    c->ownership = scapeOptimReplicated;
    c->maskOwnership = -1;
    c->lr = 1e-3f;
    c->beta1 = 0.9f;
    c->beta2 = 0.95f;
    c->eps = 1e-8f;
    c->weightDecay = 0.0f;
    c->maxGradNorm = 0.0f;
    c->biasCorrection = scapeBiasCorrectionNone;
    c->density = 0.01;
    c->warmupSteps = 0;
    c->payloadType = scapeFloat32;
    c->maskEncoding = scapeMaskEncodingAuto;
    c->nonFinite = scapeOptimNonFiniteSkip;
    c->entering = scapeOptimEnteringPayload;
    c->clipNorm = scapeOptimClipNormRecovered;
    c->densitySchedule = scapeDensityGeometric;
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeOptimScheduleForBudget(int schedule, double density,
                                                    double averageDensity, int64_t totalSteps,
                                                    int64_t* warmupSteps) {
  return Guard(nullptr, "scapeOptimScheduleForBudget", [&]() -> Status {
    return scape::ScheduleForBudget(schedule, density, averageDensity, totalSteps, warmupSteps);
  });
}

SCAPE_API scapeResult_t scapeOptimCreate(scapeOptim_t* optim, const scapeOptimConfig_t* config,
                                         scapeComm_t comm) {
  return Guard(comm, "scapeOptimCreate", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckComm(comm));
    if (!optim) return scape::InvalidArgument("optim is NULL");
    scape::OptimLayout layout;
    scape::OptimHyper hyper;
    SCAPE_RETURN_IF_ERROR(ResolveConfig(config, &layout, &hyper));
    if (!comm->impl->error().ok()) return comm->impl->error();
    std::unique_ptr<scape::Mask> mimpl;
    SCAPE_RETURN_IF_ERROR(scape::Mask::Create(comm->impl.get(), layout.n, layout.offsets,
                                              layout.dense, layout.maskOwnership, layout.encoding,
                                              &mimpl));
    std::unique_ptr<scape::Optimizer> impl;  // destroyed before mimpl if anything below fails
    SCAPE_RETURN_IF_ERROR(
        scape::Optimizer::Create(comm->impl.get(), mimpl.get(), layout, hyper, &impl));
    auto o = std::make_unique<scapeOptim>();
    // The handle takes the mask (the optimizer keeps pointing at the same scape::Mask).
    o->mask = new scapeMask{std::move(mimpl), comm};
    o->impl = std::move(impl);
    o->comm = comm;
    comm->masks.insert(o->mask);
    comm->optims.insert(o.get());
    *optim = o.release();
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeOptimDestroy(scapeOptim_t optim) {
  if (!optim) return scapeSuccess;
  scapeComm* comm = CommOf(optim);
  scapeResult_t r = Guard(comm, "scapeOptimDestroy", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckOptim(optim));
    optim->impl.reset();  // waits for its sync in flight
    comm->masks.erase(optim->mask);
    comm->optims.erase(optim);
    delete optim->mask;
    optim->mask = nullptr;
    return Status::Ok();
  });
  if (r == scapeSuccess) delete optim;
  return r;
}

SCAPE_API scapeResult_t scapeOptimSetLr(scapeOptim_t optim, float lr) {
  return Guard(CommOf(optim), "scapeOptimSetLr", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckOptim(optim));
    return optim->impl->SetLr(lr);
  });
}

}  // extern "C"

namespace {

// A setter of per-step hyperparameters: the optimizer's current ones, `edit`ed, validated
// together (so lr * weightDecay < 1 holds for the pair in force), then in force from the next
// step. A refused value changes nothing.
template <typename F>
scapeResult_t SetHyperparams(scapeOptim_t optim, const char* fn, F&& edit) {
  return Guard(CommOf(optim), fn, [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckOptim(optim));
    scape::OptimHyper h = optim->impl->hyper();
    edit(&h);
    return optim->impl->SetHyper(h);
  });
}

}  // namespace

extern "C" {

SCAPE_API scapeResult_t scapeOptimSetHyperparams(scapeOptim_t optim, float lr, float beta1,
                                                 float beta2, float eps, float weightDecay) {
  return SetHyperparams(optim, "scapeOptimSetHyperparams", [&](scape::OptimHyper* h) {
    h->lr = lr;
    h->beta1 = beta1;
    h->beta2 = beta2;
    h->eps = eps;
    h->weightDecay = weightDecay;
  });
}

SCAPE_API scapeResult_t scapeOptimSetBeta1(scapeOptim_t optim, float beta1) {
  return SetHyperparams(optim, "scapeOptimSetBeta1",
                        [&](scape::OptimHyper* h) { h->beta1 = beta1; });
}

SCAPE_API scapeResult_t scapeOptimSetBeta2(scapeOptim_t optim, float beta2) {
  return SetHyperparams(optim, "scapeOptimSetBeta2",
                        [&](scape::OptimHyper* h) { h->beta2 = beta2; });
}

SCAPE_API scapeResult_t scapeOptimSetEps(scapeOptim_t optim, float eps) {
  return SetHyperparams(optim, "scapeOptimSetEps", [&](scape::OptimHyper* h) { h->eps = eps; });
}

SCAPE_API scapeResult_t scapeOptimSetWeightDecay(scapeOptim_t optim, float weightDecay) {
  return SetHyperparams(optim, "scapeOptimSetWeightDecay",
                        [&](scape::OptimHyper* h) { h->weightDecay = weightDecay; });
}

}  // extern "C"

namespace {

// params and grads both host memory or both device (or managed) memory; *device: which.
Status CheckSameMemory(int rank, const void* params, const void* grads, bool* device) {
  scape::device::Runtime* rt = scape::device::GetRuntime();
  const scape::device::PtrKind kp = rt->Kind(params), kg = rt->Kind(grads);
  const bool dp = kp != scape::device::PtrKind::kHost, dg = kg != scape::device::PtrKind::kHost;
  if (dp != dg)
    return scape::InvalidArgument(
        StrFormat("rank %d: params is %s but grads is %s: both must be host memory or both "
                  "device memory",
                  rank, scape::device::PtrKindName(kp), scape::device::PtrKindName(kg)));
  *device = dp;
  return Status::Ok();
}

// The checks every step form makes; *device: the buffers are device (or managed) memory.
Status CheckStepArgs(scapeOptim_t optim, float* params, const float* grads, uint64_t count,
                     bool* device) {
  SCAPE_RETURN_IF_ERROR(CheckOptim(optim));
  const int rank = optim->comm->impl->rank();
  const uint64_t n = optim->impl->n();
  if (count != n)
    return scape::InvalidArgument(StrFormat(
        "rank %d: count = %llu differs from the layout's "
        "n = %llu",
        rank, static_cast<unsigned long long>(count), static_cast<unsigned long long>(n)));
  if (!params) return scape::InvalidArgument(StrFormat("rank %d: params is NULL", rank));
  if (!grads) return scape::InvalidArgument(StrFormat("rank %d: grads is NULL", rank));
  if (Misaligned(params))
    return scape::InvalidArgument(
        StrFormat("rank %d: params = %p is not 4-byte aligned", rank, static_cast<void*>(params)));
  if (Misaligned(grads))
    return scape::InvalidArgument(StrFormat("rank %d: grads = %p is not 4-byte aligned", rank,
                                            static_cast<const void*>(grads)));
  const uintptr_t p = reinterpret_cast<uintptr_t>(params), g = reinterpret_cast<uintptr_t>(grads);
  if (p < g + 4 * n && g < p + 4 * n)
    return scape::InvalidArgument(StrFormat("rank %d: params and grads overlap", rank));
  return CheckSameMemory(rank, params, grads, device);
}

Status DeviceStep(scapeOptim_t optim, float* params, const float* grads, void* stream) {
  scapeComm* comm = optim->comm;
  // The packed exchange runs where the communicator moves device memory: NCCL for an
  // NCCL-backend communicator (the mask's sync stays on its host communicator), else the UCX
  // staged path (the communicator's data path routes it).
  return optim->impl->StepDevice(params, grads, stream,
                                 comm->data ? comm->data->device() : nullptr);
}

}  // namespace

extern "C" {

SCAPE_API scapeResult_t scapeOptimStep(scapeOptim_t optim, float* params, const float* grads,
                                       uint64_t count) {
  return Guard(CommOf(optim), "scapeOptimStep", [&]() -> Status {
    bool device = false;
    SCAPE_RETURN_IF_ERROR(CheckStepArgs(optim, params, grads, count, &device));
    // Device buffers: scapeOptimStepStream on the default stream.
    if (device) return DeviceStep(optim, params, grads, nullptr);
    return optim->impl->Step(params, grads);
  });
}

SCAPE_API scapeResult_t scapeOptimStepStream(scapeOptim_t optim, float* params, const float* grads,
                                             uint64_t count, void* stream) {
  return Guard(CommOf(optim), "scapeOptimStepStream", [&]() -> Status {
    bool device = false;
    SCAPE_RETURN_IF_ERROR(CheckStepArgs(optim, params, grads, count, &device));
    if (device) return DeviceStep(optim, params, grads, stream);
    if (stream)
      return scape::InvalidArgument(
          StrFormat("rank %d: stream = %p with host params and grads: a stream orders device "
                    "work only (pass device buffers, or call scapeOptimStep for host buffers)",
                    optim->comm->impl->rank(), stream));
    return optim->impl->Step(params, grads);
  });
}

}  // extern "C"

namespace {

const char* TypeName(int t) {
  return scape::dtypes::Row(t) ? scape::dtypes::Name(t) : "unsupported";
}

// The checks of scapeOptimStepMixed (CheckStepArgs with per-buffer element types).
Status CheckMixedStepArgs(scapeOptim_t optim, void* params, int paramType, const void* grads,
                          int gradType, uint64_t count, bool* device) {
  SCAPE_RETURN_IF_ERROR(CheckOptim(optim));
  const int rank = optim->comm->impl->rank();
  const uint64_t n = optim->impl->n();
  auto okType = [](int t) { return t == scapeFloat32 || t == scapeBfloat16 || t == scapeFloat16; };
  if (!okType(paramType))
    return scape::InvalidArgument(
        StrFormat("rank %d: paramType = %d: expected scapeFloat32, scapeBfloat16 or scapeFloat16",
                  rank, paramType));
  if (!okType(gradType))
    return scape::InvalidArgument(
        StrFormat("rank %d: gradType = %d: expected scapeFloat32, scapeBfloat16 or scapeFloat16",
                  rank, gradType));
  if (count != n)
    return scape::InvalidArgument(
        StrFormat("rank %d: count = %llu differs from the layout's n = %llu", rank,
                  static_cast<unsigned long long>(count), static_cast<unsigned long long>(n)));
  if (!params) return scape::InvalidArgument(StrFormat("rank %d: params is NULL", rank));
  if (!grads) return scape::InvalidArgument(StrFormat("rank %d: grads is NULL", rank));
  const size_t pe = scapeTypeSize(static_cast<scapeDataType_t>(paramType));
  const size_t ge = scapeTypeSize(static_cast<scapeDataType_t>(gradType));
  const uintptr_t p = reinterpret_cast<uintptr_t>(params), g = reinterpret_cast<uintptr_t>(grads);
  if (p % pe != 0)
    return scape::InvalidArgument(StrFormat("rank %d: params = %p is not %zu-byte aligned (%s)",
                                            rank, params, pe, TypeName(paramType)));
  if (g % ge != 0)
    return scape::InvalidArgument(StrFormat("rank %d: grads = %p is not %zu-byte aligned (%s)",
                                            rank, grads, ge, TypeName(gradType)));
  if (p < g + ge * n && g < p + pe * n)
    return scape::InvalidArgument(StrFormat("rank %d: params and grads overlap", rank));
  return CheckSameMemory(rank, params, grads, device);
}

}  // namespace

extern "C" {

SCAPE_API scapeResult_t scapeOptimStepMixed(scapeOptim_t optim, void* params,
                                            scapeDataType_t paramType, const void* grads,
                                            scapeDataType_t gradType, uint64_t count,
                                            void* stream) {
  return Guard(CommOf(optim), "scapeOptimStepMixed", [&]() -> Status {
    bool device = false;
    SCAPE_RETURN_IF_ERROR(CheckMixedStepArgs(optim, params, static_cast<int>(paramType), grads,
                                             static_cast<int>(gradType), count, &device));
    if (device) {
      return optim->impl->StepDeviceMixed(
          params, paramType, grads, gradType, stream,
          optim->comm->data ? optim->comm->data->device() : nullptr);
    }
    if (stream)
      return scape::InvalidArgument(
          StrFormat("rank %d: stream = %p with host params and grads: a stream orders device "
                    "work only (pass NULL for host buffers)",
                    optim->comm->impl->rank(), stream));
    return optim->impl->StepMixed(params, paramType, grads, gradType);
  });
}

SCAPE_API scapeResult_t scapeOptimStepJoint(const scapeOptimStepArgs_t* steps, int count,
                                            void* stream) {
  scapeComm* comm = steps && count >= 1 ? CommOf(steps[0].optim) : nullptr;
  return Guard(comm, "scapeOptimStepJoint", [&]() -> Status {
    if (!steps) return scape::InvalidArgument("steps is NULL");
    if (count < 1) return scape::InvalidArgument(StrFormat("count = %d: expected >= 1", count));
    std::vector<scape::Optimizer::JointMember> members(static_cast<size_t>(count));
    bool device = false;
    for (int i = 0; i < count; ++i) {
      const scapeOptimStepArgs_t& a = steps[i];
      bool dev = false;
      SCAPE_RETURN_IF_ERROR(CheckMixedStepArgs(a.optim, a.params, static_cast<int>(a.paramType),
                                               a.grads, static_cast<int>(a.gradType), a.count, &dev)
                                .Prepend(StrFormat("steps[%d]", i)));
      const int rank = a.optim->comm->impl->rank();
      if (i == 0) device = dev;
      const scape::OptimHyper& h0 = steps[0].optim->impl->hyper();
      const scape::OptimHyper& h = a.optim->impl->hyper();
      if (a.optim->comm != steps[0].optim->comm)
        return scape::InvalidArgument(StrFormat(
            "rank %d: steps[%d].optim was made on another communicator than steps[0].optim", rank,
            i));
      for (int j = 0; j < i; ++j)
        if (steps[j].optim == a.optim)
          return scape::InvalidArgument(StrFormat(
              "rank %d: steps[%d].optim is steps[%d].optim: an optimizer steps once", rank, i, j));
      if (h.maxGradNorm != h0.maxGradNorm)
        return scape::InvalidArgument(StrFormat(
            "rank %d: steps[%d].optim has maxGradNorm = %g, steps[0].optim %g: a joint "
            "step clips to one global norm (make every member's maxGradNorm the same)",
            rank, i, static_cast<double>(h.maxGradNorm), static_cast<double>(h0.maxGradNorm)));
      if ((h.clipNorm == scapeOptimClipNormLocal) != (h0.clipNorm == scapeOptimClipNormLocal) &&
          h.maxGradNorm > 0.0f)
        return scape::InvalidArgument(StrFormat(
            "rank %d: steps[%d].optim has clipNorm = %d, steps[0].optim %d: a joint step clips "
            "each rank's gradients locally in every member or in none (make every member's "
            "clipNorm scapeOptimClipNormLocal, or none)",
            rank, i, h.clipNorm, h0.clipNorm));
      if (a.optim->impl->NonFinite() != steps[0].optim->impl->NonFinite())
        return scape::InvalidArgument(StrFormat(
            "rank %d: steps[%d].optim has another nonFinite than steps[0].optim: a joint step "
            "skips as one (make every member's nonFinite the same)",
            rank, i));
      if (dev != device)
        return scape::InvalidArgument(
            StrFormat("rank %d: steps[%d] has %s buffers, steps[0] %s: a joint step runs on host "
                      "memory or on device memory",
                      rank, i, dev ? "device" : "host", device ? "device" : "host"));
      members[static_cast<size_t>(i)] = {a.optim->impl.get(), a.params, a.paramType, a.grads,
                                         a.gradType};
    }
    if (!device && stream)
      return scape::InvalidArgument(
          StrFormat("rank %d: stream = %p with host params and grads: a stream orders device "
                    "work only (pass NULL for host buffers)",
                    steps[0].optim->comm->impl->rank(), stream));
    scapeComm* c = steps[0].optim->comm;
    return scape::Optimizer::StepJoint(members.data(), members.size(), device, stream,
                                       device && c->data ? c->data->device() : nullptr);
  });
}

SCAPE_API scapeResult_t scapeOptimGetInfo(scapeOptim_t optim, scapeOptimInfo_t* info) {
  return Guard(CommOf(optim), "scapeOptimGetInfo", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckOptim(optim));
    if (!info) return scape::InvalidArgument("info is NULL");
    // Versioned (scape.h): the caller's struct holds info->size bytes; fill no more.
    constexpr size_t kHeader = offsetof(scapeOptimInfo_t, magic) + sizeof(unsigned);
    if (info->magic != SCAPE_OPTIM_INFO_MAGIC || info->size < kHeader)
      return scape::InvalidArgument(StrFormat(
          "info (size %zu, magic %#x) was not initialised with SCAPE_OPTIM_INFO_INITIALIZER "
          "(size >= %zu, this library's %zu; magic %#x)",
          info->size, info->magic, kHeader, sizeof(scapeOptimInfo_t), SCAPE_OPTIM_INFO_MAGIC));
    scapeOptimInfo_t full;
    optim->impl->GetInfo(&full);
    const size_t n = info->size < sizeof(full) ? info->size : sizeof(full);
    full.size = n;
    full.magic = SCAPE_OPTIM_INFO_MAGIC;
    std::memcpy(info, &full, n);
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeOptimGetMask(scapeOptim_t optim, scapeMask_t* mask) {
  return Guard(CommOf(optim), "scapeOptimGetMask", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckOptim(optim));
    if (!mask) return scape::InvalidArgument("mask is NULL");
    *mask = optim->mask;
    return Status::Ok();
  });
}

SCAPE_API scapeResult_t scapeOptimCheckpointSize(scapeOptim_t optim, size_t* bytes) {
  return Guard(CommOf(optim), "scapeOptimCheckpointSize", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckOptim(optim));
    if (!bytes) return scape::InvalidArgument("bytes is NULL");
    return optim->impl->CheckpointSize(bytes);
  });
}

SCAPE_API scapeResult_t scapeOptimSave(scapeOptim_t optim, void* buf, size_t capacity,
                                       size_t* written) {
  return Guard(CommOf(optim), "scapeOptimSave", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckOptim(optim));
    if (!buf) return scape::InvalidArgument("buf is NULL");
    if (!written) return scape::InvalidArgument("written is NULL");
    return optim->impl->Save(buf, capacity, written);
  });
}

SCAPE_API scapeResult_t scapeOptimLoad(scapeOptim_t optim, const void* buf, size_t size) {
  return Guard(CommOf(optim), "scapeOptimLoad", [&]() -> Status {
    SCAPE_RETURN_IF_ERROR(CheckOptim(optim));
    // A NULL buffer still takes part in the ranks' agreement (as a refused checkpoint), so the
    // other ranks fail at once instead of waiting for the timeout.
    return optim->impl->Load(buf, size);
  });
}

}  // extern "C"
