// Contract: the two fused element-wise kernels of a SCAPE step, and the squared norm of the
// recovered gradient (design brief section 2, steps 3, 5, 7, 8, 9, 10).
//
// Common rules (CPU here, CUDA in kernels/cuda/scape_kernels.cuh, same contract):
// - Masks are sorted, strictly increasing local indices into the flat buffer of n elements
//   (uint32_t or uint64_t). Every mask is validated (O(k), before anything is written):
//   an unsorted, duplicated or out-of-range index gives kInvalidArgument and no output (the
//   overloads taking a CheckedMaskView were given a view validated once, by CheckMaskView,
//   and validate only what the token does not vouch for). (The
//   CUDA wrappers cannot validate device data without a synchronisation; there the mask is a
//   precondition, see scape_kernels.cuh.)
// - Payloads are packed in mask order, element type scapeFloat32, scapeBfloat16 or
//   scapeFloat16 (kUnsupported for others). fp32 -> bf16/fp16 rounds to nearest even
//   (kernels/cpu/dtype.h); bf16/fp16 -> fp32 is exact.
// - Arithmetic is fp32 with the operation order written in each contract, every operation
//   rounded separately (no FMA contraction: this file is built with -ffp-contract=off and the
//   CUDA kernels use __fmul_rn/__fadd_rn/__fdiv_rn/__fsqrt_rn). Results are therefore bit for
//   bit identical for any thread count and between the CPU and the CUDA implementation; this
//   is what lets every rank hold identical m and theta.
// - n == 0 (and k == 0) are valid; pointers may then be null. Pointers of a non-empty range
//   must be non-null (kInvalidArgument).
// - max_threads: 0 = std::thread::hardware_concurrency(); inputs below 512 Ki elements run on
//   the calling thread. Nothing is allocated apart from thread stacks (and, for
//   RecoveredGradSqNorm, ceil(k/256) doubles of partial sums).
#ifndef SCAPE_KERNELS_CPU_SCAPE_STEP_H_
#define SCAPE_KERNELS_CPU_SCAPE_STEP_H_

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernel_status.h"
#include "scape/scape.h"

namespace scape {
namespace kernels {

// Bytes of one payload element (4, 2, 2), or 0 for an unsupported payload type.
size_t PayloadElementSize(scapeDataType_t type);

// ---------------------------------------------------------------------------------------------
// 1. Candidate, pack and residual (fused, one pass over m, g, e).
//
//   c[i]       = ((beta1 * m[i]) + ((1 - beta1) * g[i])) + e[i]   ((1 - beta1) rounded to fp32
//                                                                  once, then this order)
//   payload[j] = convert(c[mask[j]])                  for j < k
//   e[i]       = c[i]                                 if i is not in the mask
//   e[i]       = +0.0f                                if i = mask[j] and keep_rounding is false
//   e[i]       = c[i] - float(payload[j])             if i = mask[j] and keep_rounding is true:
//                                                     the rounding error, as the view kernel's
//                                                     residual (CandidatePackResidualView below;
//                                                     +0.0f for fp32, and +0.0f when the
//                                                     payload value is not finite)
//   c_out[i]   = c[i]                                 if c_out != nullptr (for the top-k of the
//                                                     next mask; may be skipped)
// With keep_rounding and c_out = the candidate at every position, the results are the view
// kernel's at a sorted mask (one run), bit for bit; the device step relies on it.
// grad_scale: the gradient's weight is ((1 - beta1) * grad_scale) rounded to fp32 once (the
// optimizer's local clipping, scapeOptimClipNormLocal; 1.0f gives the bits above exactly);
// kInvalidArgument unless 0 < grad_scale <= 1.
// Aliasing: m and g may be the same buffer. c_out may be nullptr, m or g (each element is read
// before it is written) but must not overlap e or payload otherwise. e must not overlap m, g or
// payload. The mask must not overlap any output.
// Errors: kInvalidArgument (null pointer, k > n, mask not strictly increasing or >= n),
// kUnsupported (payload type). Nothing is written on error.
// ---------------------------------------------------------------------------------------------
KernelStatus CandidatePackResidual(const float* m, const float* g, float* e, size_t n, float beta1,
                                   const uint32_t* mask, size_t k, scapeDataType_t payload_type,
                                   void* payload, float* c_out, int max_threads = 0,
                                   bool keep_rounding = false, float grad_scale = 1.0f);
KernelStatus CandidatePackResidual(const float* m, const float* g, float* e, size_t n, float beta1,
                                   const uint64_t* mask, size_t k, scapeDataType_t payload_type,
                                   void* payload, float* c_out, int max_threads = 0,
                                   bool keep_rounding = false, float grad_scale = 1.0f);

// ---------------------------------------------------------------------------------------------
// 4. Unpack and AdamS update (fused).
// ---------------------------------------------------------------------------------------------

// Mixed precision: the update kernels that write theta (UnpackAdamSUpdate,
// UnpackAdamSUpdateView, UnpackPairsDecayView) take an optional ModelCopy. theta is then the
// fp32 master weight, and the same pass also stores copy[i] = convert(theta[i]) (round to
// nearest even, kernels/cpu/dtype.h; the value theta[i] holds after the call) at EVERY
// position i < n: inside the mask, outside it, and with decay == 1 (where theta keeps its bits
// and only the copy is written). So the copy equals the rounded master after every call, what
// ever it held before. copy == nullptr: no copy (the fp32 form, unchanged).
// Errors: kUnsupported (type not scapeBfloat16 / scapeFloat16), kInvalidArgument (copy->p null
// with n > 0). The copy must not overlap any other buffer of the call.
struct ModelCopy {
  void* p = nullptr;                     // n elements of `type`
  scapeDataType_t type = scapeBfloat16;  // scapeBfloat16 or scapeFloat16
};

// Which bias correction the update applies (prior-art.md, "The optimizer").
enum class BiasCorrection : int {
  kNone = 0,            // the AdamS paper form (DEFAULT): no correction
  kAdamSReference = 1,  // pku-huzhang/AdamS code: m_t and m_{t-1} (inside v) / (1 - b1^t)
  kScapeArtifact = 2,   // SCAPE artifact: m_t / (1 - b1^t), v / (1 - b2^t)
};

struct AdamSParams {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;          // outside the square root
  float weight_decay = 0.1f;  // decoupled: theta *= (1 - lr*wd) on every coordinate
  // Global-norm clipping: the recovered gradient is multiplied by clip_scale (the caller
  // computes min(1, max_norm / (sqrt(RecoveredGradSqNorm summed over all owners) + 1e-6))).
  float clip_scale = 1.0f;
  // With clip_scale != 1 and clip_momentum true (default), the momentum is rebuilt from the
  // clipped gradient, m_t = b1*m_{t-1} + (1-b1)*clip*g^, as if the gradient had been clipped
  // before the momentum update (standard clipping semantics). With false, m_t stays the
  // reduced payload and only the denominator sees the clipped gradient. With clip_scale == 1
  // m_t is the payload value bit for bit either way.
  bool clip_momentum = true;
  BiasCorrection bias_correction = BiasCorrection::kNone;
  int64_t step = 1;  // t >= 1; used only by the bias corrections
  // Entering-coordinate rule "segment_rms" (issue 23; docs/ALGORITHM.md 4.12). Off (the paper's
  // form for every coordinate) while enter_vs is nullptr. Else, at a masked position i with
  // m_{t-1}[i] == 0 (an entering coordinate: m is 0 outside the previous mask) inside segment s
  // (enter_offsets[s] <= i < enter_offsets[s+1]) whose enter_vs[s] is finite and > 0, the
  // denominator is built from enter_vs[s], the segment's mean square of the recovered gradient
  // over its staying coordinates (StayingGradSqBlocks, SegmentEnterVs), instead of from g^:
  //   v   = (clip*clip) * enter_vs[s]
  //   u   = (lr*(mn*mscale)) / (sqrt(v*vscale) + eps), clamped to [-cap_lr, cap_lr] with
  //         cap_lr = lr*enter_cap (fp32)
  //   theta[i] = (theta[i]*decay) - u
  // (gh, g and mn as in the paper's form). Other coordinates, and segments whose enter_vs is
  // not finite and > 0 (no staying coordinate), use the paper's form. Host memory: the flat and
  // view kernels read it directly; the device runtime uploads it.
  const uint64_t* enter_offsets = nullptr;  // enter_nseg + 1 positions, non-decreasing
  const float* enter_vs = nullptr;          // enter_nseg values
  size_t enter_nseg = 0;
  float enter_cap = 100.0f;  // kEnterCap: |u| <= enter_cap * lr; finite, > 0
  // With the entering rule on, momentum factor masking (issue 30; docs/ALGORITHM.md 4.14):
  // the momentum an entering coordinate keeps is clamped after its update,
  //   m[i] = min(max(mn, -bound), bound),  bound = omb1 * sqrt(v)   (fp32, v as above)
  // (the update itself uses mn unclamped). Coordinates under the paper's form keep mn.
  bool enter_momentum_cap = false;
};

// The cap of an entering coordinate's update under "segment_rms", in units of lr.
constexpr float kEnterCap = 100.0f;

// The fp32 constants both implementations use, derived once on the host (in double, rounded to
// fp32). Exposed so the CUDA wrapper and the tests use exactly the same bits.
struct AdamSScalars {
  float b1, omb1;  // beta1, 1 - beta1
  float b2, omb2;  // beta2, 1 - beta2
  float eps, lr;
  float decay;           // 1 - lr*wd
  float clip;            // clip_scale
  float mscale;          // multiplies m_t            (1 or 1/(1-b1^t))
  float pscale;          // multiplies m_{t-1} in v   (1 or 1/(1-b1^t))
  float vscale;          // multiplies v              (1 or 1/(1-b2^t))
  int rebuild_momentum;  // clip_momentum && clip != 1
  float clip2;           // clip*clip            ("segment_rms" only)
  float cap_lr;          // lr*enter_cap         ("segment_rms" only)
  int enter_mcap;        // enter_momentum_cap   ("segment_rms" only)
};

// kInvalidArgument: a non-finite parameter, beta1 or beta2 outside [0, 1), lr < 0, eps < 0,
// clip_scale <= 0, an unknown bias_correction, or step < 1 with a bias correction.
KernelStatus MakeAdamSScalars(const AdamSParams& p, AdamSScalars* out);

// For every j < k, with i = mask[j], mp = m[i] (m_{t-1}), mt = convert(payload[j]):
//   gh   = (mt - (b1*mp)) / omb1                   recovered gradient g^
//   g    = gh * clip
//   mn   = rebuild_momentum ? ((b1*mp) + (omb1*g)) : mt
//   mpc  = mp * pscale
//   v    = (b2*(mpc*mpc)) + (omb2*(g*g))
//   den  = sqrt(v * vscale) + eps
//   theta[i] = (theta[i]*decay) - ((lr*(mn*mscale)) / den)
//   m[i] = mn
// and for every i not in the mask: theta[i] = theta[i]*decay (skipped when decay == 1, which
// leaves the same bits), m[i] = +0.0f.
// Aliasing: theta, m, payload and mask must not overlap.
// Errors: kInvalidArgument (null pointer, k > n, bad mask, bad parameters), kUnsupported.
// copy: optional 16-bit model copy of theta (ModelCopy above).
KernelStatus UnpackAdamSUpdate(const void* payload, scapeDataType_t payload_type,
                               const uint32_t* mask, size_t k, float* theta, float* m, size_t n,
                               const AdamSParams& params, int max_threads = 0,
                               const ModelCopy* copy = nullptr);
KernelStatus UnpackAdamSUpdate(const void* payload, scapeDataType_t payload_type,
                               const uint64_t* mask, size_t k, float* theta, float* m, size_t n,
                               const AdamSParams& params, int max_threads = 0,
                               const ModelCopy* copy = nullptr);

// ---------------------------------------------------------------------------------------------
// Squared L2 norm of the recovered gradient at the mask (for global-norm clipping); must run
// before UnpackAdamSUpdate, which overwrites m_{t-1}.
//   *sq_norm = sum over j < k of (double)gh_j * (double)gh_j, gh_j as in UnpackAdamSUpdate
// (before clipping). Summation order is fixed (the "blocked order" below), so the result is the
// same bits for any thread count and on CUDA:
//   level 0 values are the k squares; each level sums consecutive blocks of 256 values
//   sequentially in double (left to right) into one value per block; levels repeat until one
//   value is left (k == 0 gives 0.0).
// Errors: kInvalidArgument (null pointer, k > n, bad mask, beta1 not in [0,1)), kUnsupported.
// ---------------------------------------------------------------------------------------------
KernelStatus RecoveredGradSqNorm(const void* payload, scapeDataType_t payload_type,
                                 const uint32_t* mask, size_t k, const float* m, size_t n,
                                 float beta1, double* sq_norm, int max_threads = 0);
KernelStatus RecoveredGradSqNorm(const void* payload, scapeDataType_t payload_type,
                                 const uint64_t* mask, size_t k, const float* m, size_t n,
                                 float beta1, double* sq_norm, int max_threads = 0);

// Block size of the blocked summation order above.
constexpr size_t kSqNormBlock = 256;

// Squared L2 norm of a rank's own gradient (the optimizer's local clipping,
// scapeOptimClipNormLocal): *sq_norm = the sum over i < n of (double)g_i * (double)g_i, g of
// `type` (scapeFloat32, scapeBfloat16 or scapeFloat16, widened exactly), in the blocked order
// above: the same bits for any thread count and on CUDA (n == 0 gives 0.0).
// Errors: kInvalidArgument (null pointer), kUnsupported (type).
KernelStatus GradSqNorm(const void* g, scapeDataType_t type, size_t n, double* sq_norm,
                        int max_threads = 0);

// ---------------------------------------------------------------------------------------------
// The staying coordinates' gradient scale per segment ("segment_rms", AdamSParams.enter_vs).
//
// For every block b < nb, slots [bounds[b], bounds[b+1]) of the payload (bounds non-decreasing,
// each block at most kSqNormBlock slots; slot j at position idx[j], mp_j = m[idx[j]], gh_j as
// in RecoveredGradSqNorm):
//   sums[b]   = the sum, left to right in double starting from +0.0, of
//               (mp_j != 0 ? (double)gh_j * (double)gh_j : +0.0)
//   counts[b] = the number of j with mp_j != 0 (a staying coordinate: m is 0 outside the
//               previous mask)
// The caller cuts each piece (a segment's part inside one owner block) into blocks of
// kSqNormBlock slots from its start (StayingBlockBounds) and reduces a piece's block sums with
// BlockedSum: the piece's sum in RecoveredGradSqNorm's blocked order, the same bits on any
// thread count, on CUDA and on any rank. idx may be in any order (mask order); the slots of
// [bounds[0], bounds[nb]) must be < the payload's length, idx[j] < n.
// Errors: kInvalidArgument (null pointer, a block over kSqNormBlock or descending, idx >= n,
// beta1 not in [0,1)), kUnsupported (payload type).
KernelStatus StayingGradSqBlocks(const void* payload, scapeDataType_t payload_type,
                                 const uint64_t* idx, const float* m, size_t n, float beta1,
                                 const uint64_t* bounds, size_t nb, double* sums, uint64_t* counts,
                                 int max_threads = 0);

// Writes the end slot of each block of the piece [jb, je) to out[0 .. StayingBlockCount(je-jb)):
// min(je, jb + (i+1)*kSqNormBlock). Pieces laid end to end after a first bound jb give the
// `bounds` of StayingGradSqBlocks. Returns the number of blocks written.
size_t StayingBlockBounds(uint64_t jb, uint64_t je, uint64_t* out);
// Number of blocks StayingBlockBounds makes of a piece of `len` slots.
inline size_t StayingBlockCount(uint64_t len) {
  return static_cast<size_t>((len + kSqNormBlock - 1) / kSqNormBlock);
}

// RecoveredGradSqNorm's blocked order applied to `count` values (level 0 given): consecutive
// blocks of kSqNormBlock summed left to right, levels repeated until one value is left (0.0 for
// count 0). Overwrites v.
double BlockedSum(double* v, size_t count);

// The per-segment value of AdamSParams.enter_vs from a segment's staying sum and count: the
// mean square (float)(sum / count) when count > 0 and it is finite and > 0, else -1.0f (the
// paper's form for that segment's entering coordinates).
float SegmentEnterVs(double sum, uint64_t count);

// Validates a sorted mask: strictly increasing, every index < n. O(k).
bool MaskIsValid(const uint32_t* mask, size_t k, size_t n);
bool MaskIsValid(const uint64_t* mask, size_t k, size_t n);

// ---------------------------------------------------------------------------------------------
// Masks in any owner order (the optimizer's fused passes, plugin/optim).
//
// An agreed mask lists its positions in mask order: by owner rank, then by index. With shard
// ownership that is increasing order; with segment ownership the owners' blocks interleave in
// index space. A MaskView describes either without copying the mask: `runs` tile [0, n) in
// increasing order (run r is [begin, end), the next run begins where it ends), and the mask
// entries inside run r are idx[jb, je), strictly increasing and inside [begin, end). Entry j's
// payload slot is j (mask order). A sorted mask is one run {0, n, 0, k}. Runs with the
// kRunOwned flag are this rank's owned part (the candidate pass writes the statistic there).
// ---------------------------------------------------------------------------------------------
struct MaskRun {
  uint64_t begin, end;  // positions
  uint64_t jb, je;      // mask entries
  uint32_t flags;       // kRunOwned | kRunDense
};
constexpr uint32_t kRunOwned = 1, kRunDense = 2;

struct MaskView {
  const uint64_t* idx = nullptr;  // k entries, mask order
  size_t k = 0;
  const MaskRun* runs = nullptr;
  size_t nruns = 0;
};

// Validates a view over n positions: the runs tile [0, n); every entry lies in its run, runs'
// entries are strictly increasing, and the runs' entry ranges partition [0, k) (any order of
// runs is allowed for the entries: mask order may differ from position order). O(k + nruns).
bool MaskViewIsValid(const MaskView& v, size_t n);

// A MaskView validated once, for a caller that passes the same view to several kernels (the
// optimizer's step validates each mask view once per step instead of once per kernel call).
// Only CheckMaskView makes a valid one; the kernels taking a CheckedMaskView skip their own
// O(k) validation of it (they still check its n, the pointers and that two views' runs match).
// A default-constructed token is not valid and is refused (kInvalidArgument).
// The token vouches for the view's arrays (idx and runs) as they were when checked: the caller
// must not change them, or free them, while it uses the token.
class CheckedMaskView {
 public:
  CheckedMaskView() = default;
  const MaskView& view() const { return v_; }
  size_t n() const { return n_; }
  bool valid() const { return valid_; }

 private:
  friend bool CheckMaskView(const MaskView& v, size_t n, CheckedMaskView* out);
  MaskView v_;
  size_t n_ = 0;
  bool valid_ = false;
};

// Validates v over n positions (MaskViewIsValid) and, when valid, makes *out its token and
// returns true; else returns false and *out is an invalid token.
bool CheckMaskView(const MaskView& v, size_t n, CheckedMaskView* out);

// Candidate, pack and residual at a view, with error feedback (design brief section 7):
//   c[i]       = ((b1*m[i]) + ((1-b1)*g[i])) + e[i]      (as CandidatePackResidual)
//   payload[j] = convert(c[idx[j]])
//   e[i]       = c[i]                                     outside the mask
//   e[i]       = c[i] - float(payload[j])                 inside the mask (the rounding error;
//                                                        +0.0f for fp32, and +0.0f when the
//                                                        payload value is not finite)
//   stat[i]    = c[i]                                     for i in runs flagged kRunOwned
//                                                        (stat may be nullptr: not written)
// Aliasing: no buffer may overlap another. Errors: kInvalidArgument (null pointer, bad view,
// beta1 outside [0, 1)), kUnsupported (payload type). Nothing is written on error.
//
// support (optional): a view with the same runs (begin, end) whose entries include every
// position where m is not +0.0f (the mask the momentum was left on by the last update). Then m
// is read only at the support's and the mask's entries (c = (0 + (1-b1)*g) + e elsewhere, the
// same bits as with m = +0), which saves a quarter of the pass's memory traffic.
KernelStatus CandidatePackResidualView(const float* m, const float* g, float* e, size_t n,
                                       float beta1, const MaskView& mask,
                                       scapeDataType_t payload_type, void* payload, float* stat,
                                       int max_threads = 0, const MaskView* support = nullptr);

// m[i] = +0.0f for every entry i of `support` that is not an entry of `mask` (both views with
// the same runs). With UnpackAdamSUpdateView(..., keep_m_outside = true) this leaves m zero
// outside the mask while touching only the two masks' positions. kInvalidArgument for views
// that do not match.
KernelStatus ZeroOutsideMask(float* m, size_t n, const MaskView& support, const MaskView& mask);

// UnpackAdamSUpdate at a view: the same arithmetic for every entry j (payload slot j at
// position idx[j]), decay and m = 0 outside the mask.
// keep_m_outside: m is not written outside the mask (the caller zeroes what is left of the
// previous mask with ZeroOutsideMask), which saves reading and writing m on every position.
// copy: optional 16-bit model copy of theta (ModelCopy above).
KernelStatus UnpackAdamSUpdateView(const void* payload, scapeDataType_t payload_type,
                                   const MaskView& mask, float* theta, float* m, size_t n,
                                   const AdamSParams& params, int max_threads = 0,
                                   bool keep_m_outside = false, const ModelCopy* copy = nullptr);

// The AdamS update of k sorted positions without touching theta or m (the sharded owner's
// part): for j < k, with i = idx[j], mp = m[i], th = theta[i] and mt = convert(payload[j]),
// computes (theta', m') exactly as UnpackAdamSUpdate would write them and stores
// pairs[2j] = theta', pairs[2j+1] = m'. Errors as UnpackAdamSUpdate.
KernelStatus AdamSUpdatePairs(const void* payload, scapeDataType_t payload_type,
                              const uint64_t* idx, size_t k, const float* theta, const float* m,
                              size_t n, const AdamSParams& params, float* pairs,
                              int max_threads = 0);

// Unpack of gathered (theta', m') pairs at a view: theta[idx[j]] = pairs[2j],
// m[idx[j]] = pairs[2j+1]; outside the mask theta *= decay (skipped when decay == 1) and
// m = +0.0f, with decay = 1 - lr*wd from `params` as in UnpackAdamSUpdate. copy: optional
// 16-bit model copy of theta (ModelCopy above).
KernelStatus UnpackPairsDecayView(const float* pairs, const MaskView& mask, float* theta, float* m,
                                  size_t n, const AdamSParams& params, int max_threads = 0,
                                  bool keep_m_outside = false, const ModelCopy* copy = nullptr);

// ---------------------------------------------------------------------------------------------
// Packed momentum (the optimizer's state, issue 24): m is +0 outside the mask of the last step
// and stored only at that mask's entries, in its mask order (m[j] is m at position idx[j]).
// The step reads m_{t-1} at two masks: the candidate pass at the old mask's entries and the
// new mask's, the norm and the update at the new mask's. MomentumGather gives m_{t-1} at the
// new mask (+0 at entering positions); the kernels below are the ones above with m read (and
// written) in mask order instead of at positions, the same arithmetic bit for bit.
// ---------------------------------------------------------------------------------------------

// m_to[j] = m_from[j'] where from.idx[j'] == to.idx[j], else +0.0f (both views with the same
// runs; a merge of the two sorted entry lists of every run). kInvalidArgument: a null pointer
// of a non-empty view, a bad view, runs that differ.
KernelStatus MomentumGather(const MaskView& from, const float* m_from, const MaskView& to,
                            float* m_to, size_t n, int max_threads = 0);

// CandidatePackResidualView with a support, m packed: m at mask entry j is m_mask[j], at
// support entry j' m_support[j'], +0 elsewhere. (The support's entries that are also mask
// entries are read from m_mask: both hold m_{t-1} there.)
KernelStatus CandidatePackResidualPacked(const float* m_mask, const MaskView& support,
                                         const float* m_support, const float* g, float* e, size_t n,
                                         float beta1, const MaskView& mask,
                                         scapeDataType_t payload_type, void* payload, float* stat,
                                         int max_threads = 0);

// MomentumGather and CandidatePackResidualPacked in one pass (the optimizer's candidate phase):
// m_mask[j] = m_{t-1} at mask entry j as MomentumGather(support, m_support, mask, m_mask)
// writes it (+0.0f at entering entries), and the candidate outputs of
// CandidatePackResidualPacked(m_mask, support, m_support, ...) with it, the same bits. When the
// mask did not move (support and mask the same view: same idx, k and runs arrays) m_mask must
// be m_support and is read, not written. Otherwise m_mask (mask.k floats) must not overlap
// m_support or any other buffer.
// Errors: kInvalidArgument (an invalid token or one for another n, runs that differ, a null
// pointer of a non-empty range, beta1 outside [0, 1), m_mask != m_support for the same view),
// kUnsupported (payload type). Nothing is written on error.
// grad_scale: as CandidatePackResidual's (the gradient weighted by (1 - beta1) * grad_scale).
KernelStatus CandidateGatherPacked(const CheckedMaskView& support, const float* m_support,
                                   const float* g, float* e, size_t n, float beta1,
                                   const CheckedMaskView& mask, float* m_mask,
                                   scapeDataType_t payload_type, void* payload, float* stat,
                                   int max_threads = 0, float grad_scale = 1.0f);

// RecoveredGradSqNorm with m_{t-1} of entry j at m[j] (k values, mask order).
KernelStatus RecoveredGradSqNormPacked(const void* payload, scapeDataType_t payload_type,
                                       const float* m, size_t k, float beta1, double* sq_norm,
                                       int max_threads = 0);

// StayingGradSqBlocks with m_{t-1} of slot j at m[j].
KernelStatus StayingGradSqBlocksPacked(const void* payload, scapeDataType_t payload_type,
                                       const float* m, float beta1, const uint64_t* bounds,
                                       size_t nb, double* sums, uint64_t* counts,
                                       int max_threads = 0);

// UnpackAdamSUpdateView(keep_m_outside = true) with m packed: m[j] holds m_{t-1} at mask entry
// j on entry and m_t on return (mask.k floats); nothing is written outside the mask but the
// decay of theta (and the copy). The masked points are computed in batches over contiguous
// scratch, so the arithmetic vectorises; the bits are UnpackAdamSUpdateView's.
KernelStatus UnpackAdamSUpdatePacked(const void* payload, scapeDataType_t payload_type,
                                     const MaskView& mask, float* theta, float* m, size_t n,
                                     const AdamSParams& params, int max_threads = 0,
                                     const ModelCopy* copy = nullptr);
// The same at a view validated once (CheckedMaskView; kInvalidArgument for an invalid token or
// one for another n).
KernelStatus UnpackAdamSUpdatePacked(const void* payload, scapeDataType_t payload_type,
                                     const CheckedMaskView& mask, float* theta, float* m, size_t n,
                                     const AdamSParams& params, int max_threads = 0,
                                     const ModelCopy* copy = nullptr);

// AdamSUpdatePairs with m_{t-1} of entry j at m[j] (k values).
KernelStatus AdamSUpdatePairsPacked(const void* payload, scapeDataType_t payload_type,
                                    const uint64_t* idx, size_t k, const float* theta,
                                    const float* m, size_t n, const AdamSParams& params,
                                    float* pairs, int max_threads = 0);

// UnpackPairsDecayView(keep_m_outside = true) with m packed: m[j] = pairs[2j+1] (mask.k floats).
KernelStatus UnpackPairsDecayPacked(const float* pairs, const MaskView& mask, float* theta,
                                    float* m, size_t n, const AdamSParams& params,
                                    int max_threads = 0, const ModelCopy* copy = nullptr);
// The same at a view validated once (CheckedMaskView, as UnpackAdamSUpdatePacked).
KernelStatus UnpackPairsDecayPacked(const float* pairs, const CheckedMaskView& mask, float* theta,
                                    float* m, size_t n, const AdamSParams& params,
                                    int max_threads = 0, const ModelCopy* copy = nullptr);

// ---------------------------------------------------------------------------------------------
// Dense baselines (scape-perf --mode step): one fused pass over n.
//   AdamS: mp = m[i]; mn = (b1*mp) + (omb1*g[i]); v = (b2*(mp*mp)) + (omb2*(g*g));
//          theta = (theta*decay) - ((lr*mn) / (sqrt(v) + eps)); m = mn      (no correction)
//   AdamW: mn as above; vn = (b2*v[i]) + (omb2*(g*g));
//          theta = (theta*decay) - ((lr*mn) / (sqrt(vn) + eps)); m = mn; v = vn
// ---------------------------------------------------------------------------------------------
KernelStatus DenseAdamSStep(const float* g, float* theta, float* m, size_t n,
                            const AdamSParams& params, int max_threads = 0);
KernelStatus DenseAdamWStep(const float* g, float* theta, float* m, float* v, size_t n,
                            const AdamSParams& params, int max_threads = 0);

}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CPU_SCAPE_STEP_H_
