// Contract: the CUDA implementations of the kernel contracts in kernels/cpu/*.h.
//
// This is a PLAIN C++ header (no CUDA headers needed): .cc files include it and link
// scape_core; only builds with SCAPE_HAVE_CUDA compile the definitions (kernels/cuda/*.cu).
//
// Rules for every function here:
// - Device pointers are marked d_; every kernel is enqueued on `stream` and returns without
//   synchronising (stream-ordered). The KernelStatus covers host-checkable arguments and launch
//   errors (kCudaError); errors found on the device are reported through device-side outputs
//   named in each contract.
// - No hidden allocation: functions that need scratch memory take (d_temp, temp_bytes) in the
//   CUB style: with d_temp == nullptr they only store the required size in *temp_bytes and
//   return kOk; otherwise *temp_bytes must be at least that (kBufferTooSmall).
// - Results equal the CPU implementation's bit for bit (same operation order, explicit
//   round-to-nearest intrinsics, no FMA contraction; top-k selects the same unique set).
// - Device-side preconditions the host cannot check without a synchronisation (sorted masks,
//   ascending segment offsets, k <= len) are documented per function; violating them gives
//   unspecified values but never an access outside the documented buffers.
#ifndef SCAPE_KERNELS_CUDA_SCAPE_KERNELS_CUH_
#define SCAPE_KERNELS_CUDA_SCAPE_KERNELS_CUH_

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernel_status.h"
#include "kernels/cpu/scape_step.h"
#include "kernels/cpu/topk.h"
#include "scape/scape.h"

// Same declaration as the CUDA runtime's (a repeated identical typedef is legal C++).
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace scape {
namespace kernels {
namespace cuda {

// ---- runtime helpers (so that tests and callers need no CUDA headers) -----------------------

// Number of usable devices; 0 when the driver is missing or reports none (never fails).
int DeviceCount();
// Name of the current device ("" if none).
const char* DeviceName();
KernelStatus DeviceMalloc(void** d_ptr, size_t bytes);
KernelStatus DeviceFree(void* d_ptr);
// Blocking copies (host memory may be pageable).
KernelStatus CopyToDevice(void* d_dst, const void* src, size_t bytes);
KernelStatus CopyToHost(void* dst, const void* d_src, size_t bytes);
// Stream-ordered device-to-device copy and memset.
KernelStatus CopyDeviceToDevice(void* d_dst, const void* d_src, size_t bytes, cudaStream_t stream);
KernelStatus DeviceMemset(void* d_ptr, int value, size_t bytes, cudaStream_t stream);
KernelStatus StreamSynchronize(cudaStream_t stream);
// Enqueued on `stream`: one thread that spins (with __nanosleep) until the 32-bit word at
// `h_flag` reaches `value`, (int32_t)(*flag - value) >= 0 (cyclic, as cuStreamWaitValue32's
// GEQ), so that the stream waits on the device for a host signal. h_flag is page-locked host
// memory (cudaHostAlloc: mapped under unified addressing), written by the host.
KernelStatus WaitHostFlagCuda(const uint32_t* h_flag, uint32_t value, cudaStream_t stream);
// Timing with CUDA events: an opaque event handle.
KernelStatus EventCreate(void** event);
KernelStatus EventRecord(void* event, cudaStream_t stream);
KernelStatus EventElapsedMs(void* start, void* stop, float* ms);  // synchronises on stop
KernelStatus EventDestroy(void* event);
// The last CUDA error string (clears it).
const char* LastCudaError();

// ---- 1. candidate, pack, residual (scape_step.h) ---------------------------------------------
// Same contract as CandidatePackResidual, keep_rounding and grad_scale included (false: +0
// inside the mask; true: the rounding error c - float(payload), the view kernel's residual). Device
// preconditions: d_mask strictly increasing; entries >= n are ignored (no write). k > n is
// kInvalidArgument (host check).
KernelStatus CandidatePackResidualCuda(const float* d_m, const float* d_g, float* d_e, size_t n,
                                       float beta1, const uint32_t* d_mask, size_t k,
                                       scapeDataType_t payload_type, void* d_payload,
                                       float* d_c_out, cudaStream_t stream,
                                       bool keep_rounding = false, float grad_scale = 1.0f);
KernelStatus CandidatePackResidualCuda(const float* d_m, const float* d_g, float* d_e, size_t n,
                                       float beta1, const uint64_t* d_mask, size_t k,
                                       scapeDataType_t payload_type, void* d_payload,
                                       float* d_c_out, cudaStream_t stream,
                                       bool keep_rounding = false, float grad_scale = 1.0f);

// ---- 4. unpack + AdamS update, squared norm (scape_step.h) -----------------------------------
// Same contract as UnpackAdamSUpdate (parameters validated on the host by MakeAdamSScalars);
// params.enter_offsets and params.enter_vs ("segment_rms") are DEVICE pointers here.
KernelStatus UnpackAdamSUpdateCuda(const void* d_payload, scapeDataType_t payload_type,
                                   const uint32_t* d_mask, size_t k, float* d_theta, float* d_m,
                                   size_t n, const AdamSParams& params, cudaStream_t stream);
KernelStatus UnpackAdamSUpdateCuda(const void* d_payload, scapeDataType_t payload_type,
                                   const uint64_t* d_mask, size_t k, float* d_theta, float* d_m,
                                   size_t n, const AdamSParams& params, cudaStream_t stream);

// Mixed precision (kernels/cpu/scape_step.h, ModelCopy). The candidate with gradients of
// grad_type (fp32, bf16 or fp16), widened exactly as they are read: the same bits as the fp32
// form on the widened gradients. The update that also stores the 16-bit copy of theta at every
// element in the same pass (copy.type bf16 or fp16, else kUnsupported).
KernelStatus CandidatePackResidualGradCuda(const float* d_m, const void* d_g,
                                           scapeDataType_t grad_type, float* d_e, size_t n,
                                           float beta1, const uint64_t* d_mask, size_t k,
                                           scapeDataType_t payload_type, void* d_payload,
                                           float* d_c_out, cudaStream_t stream,
                                           bool keep_rounding = false, float grad_scale = 1.0f);
KernelStatus UnpackAdamSUpdateCopyCuda(const void* d_payload, scapeDataType_t payload_type,
                                       const uint64_t* d_mask, size_t k, float* d_theta, float* d_m,
                                       size_t n, const AdamSParams& params, const ModelCopy& copy,
                                       cudaStream_t stream);
// The sharded step's halves (kernels/cpu/scape_step.h), the same bits as the CPU kernels.
// AdamSUpdatePairsCuda: AdamSUpdatePairs (dense m: m_{t-1} = d_m[d_idx[j]]); d_idx holds k
// distinct positions in any order (device precondition; an entry >= n is skipped, its pair not
// written); params.enter_offsets / enter_vs are DEVICE pointers, as for UnpackAdamSUpdateCuda.
// UnpackPairsDecayCuda: UnpackPairsDecayView at a sorted mask (one run; device precondition:
// d_mask strictly increasing), m written outside the mask (+0); copy: optional 16-bit model
// copy (nullptr: none; type bf16 or fp16, else kUnsupported). The enter table is not used.
KernelStatus AdamSUpdatePairsCuda(const void* d_payload, scapeDataType_t payload_type,
                                  const uint64_t* d_idx, size_t k, const float* d_theta,
                                  const float* d_m, size_t n, const AdamSParams& params,
                                  float* d_pairs, cudaStream_t stream);
KernelStatus UnpackPairsDecayCuda(const float* d_pairs, const uint64_t* d_mask, size_t k,
                                  float* d_theta, float* d_m, size_t n, const AdamSParams& params,
                                  const ModelCopy* copy, cudaStream_t stream);
// Same contract and the same bits as StayingGradSqBlocks ("segment_rms"); every pointer is
// device memory (d_bounds: nb + 1 slots, validated by the caller). Device preconditions: blocks
// of at most kSqNormBlock slots; an index >= n counts as not staying.
KernelStatus StayingGradSqBlocksCuda(const void* d_payload, scapeDataType_t payload_type,
                                     const uint64_t* d_idx, const float* d_m, size_t n, float beta1,
                                     const uint64_t* d_bounds, size_t nb, double* d_sums,
                                     uint64_t* d_counts, cudaStream_t stream);

// Same contract and the same bits as RecoveredGradSqNorm; the result goes to *d_sq_norm
// (device). Temp storage: about k/256 doubles.
KernelStatus RecoveredGradSqNormCuda(const void* d_payload, scapeDataType_t payload_type,
                                     const uint32_t* d_mask, size_t k, const float* d_m, size_t n,
                                     float beta1, double* d_sq_norm, void* d_temp,
                                     size_t* temp_bytes, cudaStream_t stream);
KernelStatus RecoveredGradSqNormCuda(const void* d_payload, scapeDataType_t payload_type,
                                     const uint64_t* d_mask, size_t k, const float* d_m, size_t n,
                                     float beta1, double* d_sq_norm, void* d_temp,
                                     size_t* temp_bytes, cudaStream_t stream);
// Same contract and the same bits as GradSqNorm (a rank's own gradient of grad_type: fp32,
// bf16 or fp16); the result goes to *d_sq_norm (device). Temp storage as above, n for k.
KernelStatus GradSqNormCuda(const void* d_g, scapeDataType_t grad_type, size_t n, double* d_sq_norm,
                            void* d_temp, size_t* temp_bytes, cudaStream_t stream);

// ---- 2. top-k per segment (topk.h) -----------------------------------------------------------
// Segment table in device memory (the layout is static: upload it once).
struct TopkCudaSegments {
  const uint64_t* d_offsets = nullptr;      // nseg + 1, ascending
  const uint64_t* d_k = nullptr;            // nseg, k[s] <= len_s
  const uint64_t* d_out_offsets = nullptr;  // nseg + 1, ascending
  size_t nseg = 0;
  // Host-side upper bound of offsets[nseg] - offsets[0] (sizes the temp storage).
  uint64_t max_elements = 0;
};
// Same contract and the same selected sets as TopkAbs (exact or sampled, options.max_threads
// ignored). d_counts (nseg) is required in both modes. Device preconditions: offsets and
// out_offsets ascending, positions < 2^32 for uint32_t output, total length <= max_elements.
// Violations never cause out-of-bounds accesses: k > len is clamped to len, a capacity below
// k truncates (in index order), and a segment table with descending offsets or more elements
// than max_elements selects nothing and sets d_counts[s] = UINT64_MAX for every segment.
// Algorithm: exact = radix select on the key bits (11 + 11 + 9 bits): a histogram pass over x
// for the high 11 bits, one pass copying the keys of the threshold bin to a candidate buffer
// (and counting the keys above it per tile), the two low digits histogrammed over the
// candidates only, per-tile counts from the candidates, a per-segment scan and an ordered write
// pass: three reads of x. Segments whose threshold bin does not fit the buffer (heavy ties)
// run the low digits and a counting pass over x instead. Sampled = one block per segment
// selects the threshold among the samples in shared memory, then a counting pass, the scan
// and the write pass. No sort; temp storage about nseg * 8 KiB (exact) + 24 bytes per 8192
// elements + (exact) 1 byte per element (the candidate buffer: max_elements / 8 + 4096
// entries of 8 bytes).
KernelStatus TopkAbsCuda(const float* d_x, const TopkCudaSegments& segments,
                         const TopkOptions& options, uint32_t* d_out, uint64_t* d_counts,
                         void* d_temp, size_t* temp_bytes, cudaStream_t stream);
KernelStatus TopkAbsCuda(const float* d_x, const TopkCudaSegments& segments,
                         const TopkOptions& options, uint64_t* d_out, uint64_t* d_counts,
                         void* d_temp, size_t* temp_bytes, cudaStream_t stream);

// ---- gather / scatter by index (gather.h) ---------------------------------------------------
// Same contract as GatherByIndex / ScatterByIndex: d_packed[i] = d_dense[d_idx[i]] and its
// inverse for i < k, elements of esz bytes moved as raw bits, d_idx in any order. esz must be
// 1, 2, 4 or 8 (kInvalidArgument otherwise; the CPU kernel's memcpy fallback has no CUDA form);
// the pointers must be aligned to esz (d_idx to 8). k == 0 launches nothing. Device
// preconditions: every d_idx[i] is inside d_dense; for the scatter, duplicate indices leave one
// of their values (which one is unspecified, unlike the CPU's last-wins order).
// One thread per element, kUnroll = 4 elements in flight per thread, grid-stride (gather.cu).
KernelStatus GatherByIndexCuda(const void* d_dense, const uint64_t* d_idx, size_t k, size_t esz,
                               void* d_packed, cudaStream_t stream);
KernelStatus ScatterByIndexCuda(const void* d_packed, const uint64_t* d_idx, size_t k, size_t esz,
                                void* d_dense, cudaStream_t stream);

// ---- 3. mask codecs (mask_codec.h) -----------------------------------------------------------
// Index (of the indices read or written) is uint32_t or uint64_t: mask_codec.cu instantiates
// each of these for both.
// Writes all BitmapWords(n) words of d_words. Device precondition: d_idx strictly increasing
// (entries >= n are ignored).
template <typename Index>
KernelStatus IndicesToBitmapCuda(const Index* d_idx, size_t k, uint64_t n, uint64_t* d_words,
                                 cudaStream_t stream);

// Sorted indices of the set bits of d_words (BitmapWords(n) words) into d_out[0, capacity).
// Device outputs: *d_count = number of set bits below n; *d_status = 0 (kOk),
// kCorrupt (non-zero padding bits; they are ignored) or kBufferTooSmall (more than capacity
// set bits; the first capacity are written). Status values are KernelStatus codes.
template <typename Index>
KernelStatus BitmapToIndicesCuda(const uint64_t* d_words, uint64_t n, Index* d_out, size_t capacity,
                                 uint64_t* d_count, uint32_t* d_status, void* d_temp,
                                 size_t* temp_bytes, cudaStream_t stream);

// Elias-Fano encoding (the encoded-mask format of mask_codec.h, encoding 2; the same bytes as
// MaskEncode). *written (host) = EliasFanoEncodedBytes(n, k), known without the data;
// kBufferTooSmall if capacity is smaller. d_buf must be 8-byte aligned. Device precondition:
// d_idx strictly increasing and < n.
template <typename Index>
KernelStatus EliasFanoEncodeCuda(const Index* d_idx, size_t k, uint64_t n, uint8_t* d_buf,
                                 size_t capacity, size_t* written, cudaStream_t stream);

// Elias-Fano decoding with the full validation of MaskDecode (encoding 2 only), on the device:
// d_buf (8-byte aligned) holds `size` bytes. Device outputs: *d_status = a KernelStatus code
// (kOk, kTruncated, kCorrupt, kBufferTooSmall) and, on kOk, *d_count = k and d_out[0, k) the
// indices. Never reads outside [d_buf, d_buf + size) or writes outside d_out[0, capacity).
template <typename Index>
KernelStatus EliasFanoDecodeCuda(const uint8_t* d_buf, size_t size, uint64_t expected_n,
                                 Index* d_out, size_t capacity, uint64_t* d_count,
                                 uint32_t* d_status, void* d_temp, size_t* temp_bytes,
                                 cudaStream_t stream);

}  // namespace cuda
}  // namespace kernels
}  // namespace scape

#endif  // SCAPE_KERNELS_CUDA_SCAPE_KERNELS_CUH_
