// CUDA mask codecs (contract: kernels/cpu/mask_codec.h and kernels/cuda/scape_kernels.cuh):
// raw bitmap <-> sorted indices, and the Elias-Fano encoded-mask format (encode, and decode
// with the full validation of the CPU decoder). Same bytes and indices as the CPU code.
#include <cuda_runtime.h>

#include "kernels/cpu/mask_codec.h"
#include "kernels/cuda/device_common.cuh"
#include "kernels/cuda/scape_kernels.cuh"

namespace scape {
namespace kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kScanThreads = 1024;
using ull = unsigned long long;

__device__ __forceinline__ void SetStatus(uint32_t* status, KernelStatus s) {
  atomicCAS(status, 0u, static_cast<uint32_t>(s));
}

// ---- indices -> bitmap ---------------------------------------------------------------------

template <typename Index>
__global__ void ScatterBitsKernel(const Index* idx, uint64_t k, uint64_t n, uint64_t* words) {
  for (uint64_t j = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint64_t p = static_cast<uint64_t>(idx[j]);
    if (p < n) atomicOr(reinterpret_cast<ull*>(words + (p >> 6)), 1ull << (p & 63));
  }
}

// ---- bitmap -> indices (one 64-bit word per thread) -----------------------------------------

// The word's bits below n; flags non-zero padding.
__device__ __forceinline__ uint64_t LoadMaskedWord(const uint64_t* words, uint64_t nwords,
                                                   uint64_t n, uint64_t w, uint32_t* status) {
  if (w >= nwords) return 0;
  uint64_t bits = words[w];
  if (w == nwords - 1 && (n & 63) != 0) {
    const uint64_t pad = bits >> (n & 63);
    if (pad != 0) SetStatus(status, KernelStatus::kCorrupt);
    bits &= (uint64_t{1} << (n & 63)) - 1;
  }
  return bits;
}

__global__ void __launch_bounds__(kThreads)
    BitmapCountKernel(const uint64_t* words, uint64_t nwords, uint64_t n, uint64_t* block_counts,
                      uint32_t* status) {
  __shared__ uint64_t ws[32];
  const uint64_t w = blockIdx.x * static_cast<uint64_t>(kThreads) + threadIdx.x;
  const uint64_t bits = LoadMaskedWord(words, nwords, n, w, status);
  const uint64_t total = dev::BlockSum(static_cast<uint64_t>(__popcll(bits)), ws);
  if (threadIdx.x == 0) block_counts[blockIdx.x] = total;
}

// One block: exclusive scan of counts[0, nblocks) into offsets; *total_out = the sum.
__global__ void __launch_bounds__(kScanThreads)
    ScanCountsKernel(const uint64_t* counts, uint64_t nblocks, uint64_t* offsets,
                     uint64_t* total_out) {
  __shared__ uint64_t ws[32];
  uint64_t carry = 0;
  for (uint64_t base = 0; base < nblocks; base += blockDim.x) {
    const uint64_t b = base + threadIdx.x;
    const uint64_t v = b < nblocks ? counts[b] : 0;
    uint64_t tot;
    const uint64_t x = dev::BlockExclusiveSum(v, ws, &tot);
    if (b < nblocks) offsets[b] = carry + x;
    carry += tot;
  }
  if (threadIdx.x == 0) *total_out = carry;
}

__global__ void BitmapCapacityKernel(const uint64_t* total, uint64_t capacity, uint64_t* count,
                                     uint32_t* status) {
  *count = *total;
  if (*total > capacity) SetStatus(status, KernelStatus::kBufferTooSmall);
}

template <typename Index>
__global__ void __launch_bounds__(kThreads)
    BitmapExpandKernel(const uint64_t* words, uint64_t nwords, uint64_t n,
                       const uint64_t* block_offsets, Index* out, uint64_t capacity,
                       uint32_t* status) {
  __shared__ uint64_t ws[32];
  const uint64_t w = blockIdx.x * static_cast<uint64_t>(kThreads) + threadIdx.x;
  // Padding was already reported by the count pass; do not report twice.
  uint64_t bits = w < nwords ? words[w] : 0;
  if (w == nwords - 1 && (n & 63) != 0) bits &= (uint64_t{1} << (n & 63)) - 1;
  uint64_t tot;
  uint64_t rank = block_offsets[blockIdx.x] +
                  dev::BlockExclusiveSum(static_cast<uint64_t>(__popcll(bits)), ws, &tot);
  (void)status;
  while (bits != 0) {
    const int b = __ffsll(static_cast<long long>(bits)) - 1;
    bits &= bits - 1;
    if (rank < capacity) out[rank] = static_cast<Index>(w * 64 + static_cast<uint64_t>(b));
    ++rank;
  }
}

// ---- Elias-Fano ----------------------------------------------------------------------------

struct EfInfo {
  uint64_t n, k, low_words, high_words, high_bits, max_high;
  int l;
};

__global__ void EfHeaderKernel(uint64_t* buf, uint64_t n, uint64_t k, int l) {
  buf[0] = 2ull | (static_cast<uint64_t>(l) << 8);
  buf[1] = n;
  buf[2] = k;
}

template <typename Index>
__global__ void EfEncodeKernel(const Index* idx, uint64_t k, int l, uint64_t* low, uint64_t* high,
                               uint64_t high_bits) {
  const uint64_t lmask = l == 0 ? 0 : (l >= 64 ? ~0ull : (1ull << l) - 1);
  for (uint64_t j = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; j < k;
       j += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint64_t v = static_cast<uint64_t>(idx[j]);
    if (l > 0) {
      const uint64_t lv = v & lmask;
      const uint64_t bit = j * static_cast<uint64_t>(l);
      const uint64_t w = bit >> 6;
      const int o = static_cast<int>(bit & 63);
      atomicOr(reinterpret_cast<ull*>(low + w), lv << o);
      if (o + l > 64) atomicOr(reinterpret_cast<ull*>(low + w + 1), lv >> (64 - o));
    }
    const uint64_t pos = (v >> l) + j;
    if (pos < high_bits) atomicOr(reinterpret_cast<ull*>(high + (pos >> 6)), 1ull << (pos & 63));
  }
}

__device__ __forceinline__ int EfLowBitsDev(uint64_t n, uint64_t k) {
  if (k == 0 || n < k) return 0;
  return 63 - __clzll(static_cast<long long>(n / k));
}

// One thread: validates the header, the exact size, the capacity and the padding bits.
__global__ void EfDecodeHeaderKernel(const uint64_t* buf, uint64_t size, uint64_t expected_n,
                                     uint64_t capacity, EfInfo* info, uint32_t* status) {
  auto fail = [&](KernelStatus s) { *status = static_cast<uint32_t>(s); };
  if (size < kMaskHeaderBytes) return fail(KernelStatus::kTruncated);
  const uint64_t w0 = buf[0], n = buf[1], k = buf[2];
  if ((w0 & 0xff) != 2 || (w0 >> 16) != 0 || k > n) return fail(KernelStatus::kCorrupt);
  const int l = EfLowBitsDev(n, k);
  if (static_cast<int>((w0 >> 8) & 0xff) != l) return fail(KernelStatus::kCorrupt);
  if (n != expected_n) return fail(KernelStatus::kCorrupt);
  const uint64_t body_bits = (size - kMaskHeaderBytes) * 8;
  EfInfo f;
  f.n = n;
  f.k = k;
  f.l = l;
  f.max_high = k == 0 ? 0 : (n - 1) >> l;
  // Bounds that keep the arithmetic below from overflowing: the high part alone needs k + 1
  // + max_high bits.
  if (k > body_bits || f.max_high > body_bits) return fail(KernelStatus::kTruncated);
  const uint64_t low_bits = k * static_cast<uint64_t>(l);  // <= n (k * 2^l <= n)
  f.high_bits = k == 0 ? 0 : k + f.max_high + 1;
  f.low_words = (low_bits + 63) / 64;
  f.high_words = (f.high_bits + 63) / 64;
  const uint64_t need = (f.low_words + f.high_words) * 8;
  if (size - kMaskHeaderBytes < need) return fail(KernelStatus::kTruncated);
  if (size - kMaskHeaderBytes > need) return fail(KernelStatus::kCorrupt);
  if (k > capacity) return fail(KernelStatus::kBufferTooSmall);
  const uint64_t* low = buf + 3;
  const uint64_t* high = low + f.low_words;
  if ((low_bits & 63) != 0 && (low[f.low_words - 1] >> (low_bits & 63)) != 0) {
    return fail(KernelStatus::kCorrupt);
  }
  if ((f.high_bits & 63) != 0 && (high[f.high_words - 1] >> (f.high_bits & 63)) != 0) {
    return fail(KernelStatus::kCorrupt);
  }
  *info = f;
  *status = 0;
}

__global__ void __launch_bounds__(kThreads)
    EfPopcountKernel(const uint64_t* buf, const EfInfo* info, const uint32_t* status,
                     uint64_t* block_counts) {
  __shared__ uint64_t ws[32];
  if (*status != 0) return;
  const uint64_t* high = buf + 3 + info->low_words;
  const uint64_t w = blockIdx.x * static_cast<uint64_t>(kThreads) + threadIdx.x;
  const uint64_t bits = w < info->high_words ? high[w] : 0;
  const uint64_t total = dev::BlockSum(static_cast<uint64_t>(__popcll(bits)), ws);
  if (threadIdx.x == 0) block_counts[blockIdx.x] = total;
}

__global__ void EfCheckCountKernel(const uint64_t* total, const EfInfo* info, uint32_t* status) {
  if (*status == 0 && *total != info->k) *status = static_cast<uint32_t>(KernelStatus::kCorrupt);
}

template <typename Index>
__global__ void __launch_bounds__(kThreads)
    EfExpandKernel(const uint64_t* buf, const EfInfo* info, const uint64_t* block_offsets,
                   Index* out, uint32_t* status) {
  __shared__ uint64_t ws[32];
  if (*status != 0) return;
  const EfInfo f = *info;
  const uint64_t* low = buf + 3;
  const uint64_t* high = low + f.low_words;
  const uint64_t w = blockIdx.x * static_cast<uint64_t>(kThreads) + threadIdx.x;
  uint64_t bits = w < f.high_words ? high[w] : 0;
  uint64_t tot;
  uint64_t c = block_offsets[blockIdx.x] +
               dev::BlockExclusiveSum(static_cast<uint64_t>(__popcll(bits)), ws, &tot);
  const uint64_t lmask = f.l == 0 ? 0 : (1ull << f.l) - 1;
  while (bits != 0) {
    const uint64_t pos = w * 64 + static_cast<uint64_t>(__ffsll(static_cast<long long>(bits)) - 1);
    bits &= bits - 1;
    if (c >= f.k) {
      SetStatus(status, KernelStatus::kCorrupt);
      return;
    }
    const uint64_t hi = pos - c;
    if (hi > f.max_high) {
      SetStatus(status, KernelStatus::kCorrupt);
      return;
    }
    uint64_t lv = 0;
    if (f.l > 0) {
      const uint64_t bit = c * static_cast<uint64_t>(f.l);
      const uint64_t lw = bit >> 6;
      const int o = static_cast<int>(bit & 63);
      lv = low[lw] >> o;
      if (o + f.l > 64) lv |= low[lw + 1] << (64 - o);
      lv &= lmask;
    }
    const uint64_t v = (hi << f.l) | lv;
    if (v >= f.n) {
      SetStatus(status, KernelStatus::kCorrupt);
      return;
    }
    out[c] = static_cast<Index>(v);
    ++c;
  }
}

template <typename Index>
__global__ void EfMonotoneKernel(const Index* out, const EfInfo* info, uint32_t* status) {
  if (*status != 0) return;
  const uint64_t k = info->k;
  for (uint64_t c = 1 + blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; c < k;
       c += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    if (out[c] <= out[c - 1]) SetStatus(status, KernelStatus::kCorrupt);
  }
}

__global__ void EfFinishKernel(const EfInfo* info, const uint32_t* status, uint64_t* count) {
  if (*status == 0) *count = info->k;
}

// ---- host wrappers -------------------------------------------------------------------------

template <typename Index>
KernelStatus IndicesToBitmapImpl(const Index* idx, size_t k, uint64_t n, uint64_t* words,
                                 cudaStream_t stream) {
  const uint64_t nwords = BitmapWords(n);
  if (k > n || (nwords > 0 && words == nullptr) || (k > 0 && idx == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  if (nwords == 0) return KernelStatus::kOk;
  SCAPE_CUDA_CALL(cudaMemsetAsync(words, 0, nwords * 8, stream));
  if (k == 0) return KernelStatus::kOk;
  ScatterBitsKernel<<<dev::GridFor(k, kThreads, 65535), kThreads, 0, stream>>>(idx, k, n, words);
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

template <typename Index>
KernelStatus BitmapToIndicesImpl(const uint64_t* words, uint64_t n, Index* out, size_t capacity,
                                 uint64_t* count, uint32_t* status, void* d_temp,
                                 size_t* temp_bytes, cudaStream_t stream) {
  if (temp_bytes == nullptr) return KernelStatus::kInvalidArgument;
  const uint64_t nwords = BitmapWords(n);
  const uint64_t nblocks = nwords == 0 ? 1 : (nwords + kThreads - 1) / kThreads;
  const size_t counts_bytes = dev::AlignUp(nblocks * 8);
  const size_t need = 2 * counts_bytes + 256;
  if (d_temp == nullptr) {
    *temp_bytes = need;
    return KernelStatus::kOk;
  }
  if (*temp_bytes < need) return KernelStatus::kBufferTooSmall;
  if (count == nullptr || status == nullptr || (nwords > 0 && words == nullptr) ||
      (capacity > 0 && out == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  if (sizeof(Index) == 4 && n > (uint64_t{1} << 32)) return KernelStatus::kInvalidArgument;
  if (nblocks >= (uint64_t{1} << 31)) return KernelStatus::kInvalidArgument;
  uint64_t* block_counts = static_cast<uint64_t*>(d_temp);
  uint64_t* block_offsets = reinterpret_cast<uint64_t*>(static_cast<char*>(d_temp) + counts_bytes);
  uint64_t* total = reinterpret_cast<uint64_t*>(static_cast<char*>(d_temp) + 2 * counts_bytes);
  SCAPE_CUDA_CALL(cudaMemsetAsync(status, 0, sizeof(uint32_t), stream));
  const unsigned grid = static_cast<unsigned>(nblocks);
  BitmapCountKernel<<<grid, kThreads, 0, stream>>>(words, nwords, n, block_counts, status);
  SCAPE_CUDA_LAUNCH_CHECK();
  ScanCountsKernel<<<1, kScanThreads, 0, stream>>>(block_counts, nblocks, block_offsets, total);
  SCAPE_CUDA_LAUNCH_CHECK();
  BitmapCapacityKernel<<<1, 1, 0, stream>>>(total, capacity, count, status);
  SCAPE_CUDA_LAUNCH_CHECK();
  BitmapExpandKernel<Index>
      <<<grid, kThreads, 0, stream>>>(words, nwords, n, block_offsets, out, capacity, status);
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

template <typename Index>
KernelStatus EfEncodeImpl(const Index* idx, size_t k, uint64_t n, uint8_t* buf, size_t capacity,
                          size_t* written, cudaStream_t stream) {
  if (written == nullptr || k > n) return KernelStatus::kInvalidArgument;
  const uint64_t size = EliasFanoEncodedBytes(n, k);
  if (size > capacity) return KernelStatus::kBufferTooSmall;
  if (buf == nullptr || (reinterpret_cast<uintptr_t>(buf) & 7) != 0 || (k > 0 && idx == nullptr)) {
    return KernelStatus::kInvalidArgument;
  }
  const int l = EliasFanoLowBits(n, k);
  const uint64_t low_words = (static_cast<uint64_t>(k) * static_cast<uint64_t>(l) + 63) / 64;
  const uint64_t high_bits = k == 0 ? 0 : k + ((n - 1) >> l) + 1;
  uint64_t* words = reinterpret_cast<uint64_t*>(buf);
  EfHeaderKernel<<<1, 1, 0, stream>>>(words, n, k, l);
  SCAPE_CUDA_LAUNCH_CHECK();
  const uint64_t body = size - kMaskHeaderBytes;
  if (body > 0) SCAPE_CUDA_CALL(cudaMemsetAsync(words + 3, 0, body, stream));
  if (k > 0) {
    EfEncodeKernel<<<dev::GridFor(k, kThreads, 65535), kThreads, 0, stream>>>(
        idx, k, l, words + 3, words + 3 + low_words, high_bits);
    SCAPE_CUDA_LAUNCH_CHECK();
  }
  *written = static_cast<size_t>(size);
  return KernelStatus::kOk;
}

template <typename Index>
KernelStatus EfDecodeImpl(const uint8_t* buf, size_t size, uint64_t expected_n, Index* out,
                          size_t capacity, uint64_t* count, uint32_t* status, void* d_temp,
                          size_t* temp_bytes, cudaStream_t stream) {
  if (temp_bytes == nullptr) return KernelStatus::kInvalidArgument;
  // Every kernel after the header check reads at most the body words that exist.
  const uint64_t body_words = size > kMaskHeaderBytes ? (size - kMaskHeaderBytes) / 8 : 0;
  const uint64_t nblocks = body_words / kThreads + 1;
  const size_t counts_bytes = dev::AlignUp(nblocks * 8);
  const size_t need = 2 * counts_bytes + dev::AlignUp(sizeof(EfInfo)) + 256;
  if (d_temp == nullptr) {
    *temp_bytes = need;
    return KernelStatus::kOk;
  }
  if (*temp_bytes < need) return KernelStatus::kBufferTooSmall;
  if (count == nullptr || status == nullptr || (size > 0 && buf == nullptr) ||
      (capacity > 0 && out == nullptr) || (reinterpret_cast<uintptr_t>(buf) & 7) != 0) {
    return KernelStatus::kInvalidArgument;
  }
  if (sizeof(Index) == 4 && expected_n > (uint64_t{1} << 32)) {
    return KernelStatus::kInvalidArgument;
  }
  if (nblocks >= (uint64_t{1} << 31)) return KernelStatus::kInvalidArgument;
  char* t = static_cast<char*>(d_temp);
  uint64_t* block_counts = reinterpret_cast<uint64_t*>(t);
  uint64_t* block_offsets = reinterpret_cast<uint64_t*>(t + counts_bytes);
  EfInfo* info = reinterpret_cast<EfInfo*>(t + 2 * counts_bytes);
  uint64_t* total =
      reinterpret_cast<uint64_t*>(t + 2 * counts_bytes + dev::AlignUp(sizeof(EfInfo)));
  const uint64_t* words = reinterpret_cast<const uint64_t*>(buf);
  EfDecodeHeaderKernel<<<1, 1, 0, stream>>>(words, size, expected_n, capacity, info, status);
  SCAPE_CUDA_LAUNCH_CHECK();
  const unsigned grid = static_cast<unsigned>(nblocks);
  EfPopcountKernel<<<grid, kThreads, 0, stream>>>(words, info, status, block_counts);
  SCAPE_CUDA_LAUNCH_CHECK();
  ScanCountsKernel<<<1, kScanThreads, 0, stream>>>(block_counts, nblocks, block_offsets, total);
  SCAPE_CUDA_LAUNCH_CHECK();
  EfCheckCountKernel<<<1, 1, 0, stream>>>(total, info, status);
  SCAPE_CUDA_LAUNCH_CHECK();
  EfExpandKernel<Index><<<grid, kThreads, 0, stream>>>(words, info, block_offsets, out, status);
  SCAPE_CUDA_LAUNCH_CHECK();
  EfMonotoneKernel<Index>
      <<<dev::GridFor(capacity, kThreads, 65535), kThreads, 0, stream>>>(out, info, status);
  SCAPE_CUDA_LAUNCH_CHECK();
  EfFinishKernel<<<1, 1, 0, stream>>>(info, status, count);
  SCAPE_CUDA_LAUNCH_CHECK();
  return KernelStatus::kOk;
}

}  // namespace

template <typename Index>
KernelStatus IndicesToBitmapCuda(const Index* d_idx, size_t k, uint64_t n, uint64_t* d_words,
                                 cudaStream_t stream) {
  return IndicesToBitmapImpl(d_idx, k, n, d_words, stream);
}

template <typename Index>
KernelStatus BitmapToIndicesCuda(const uint64_t* d_words, uint64_t n, Index* d_out, size_t capacity,
                                 uint64_t* d_count, uint32_t* d_status, void* d_temp,
                                 size_t* temp_bytes, cudaStream_t stream) {
  return BitmapToIndicesImpl(d_words, n, d_out, capacity, d_count, d_status, d_temp, temp_bytes,
                             stream);
}

template <typename Index>
KernelStatus EliasFanoEncodeCuda(const Index* d_idx, size_t k, uint64_t n, uint8_t* d_buf,
                                 size_t capacity, size_t* written, cudaStream_t stream) {
  return EfEncodeImpl(d_idx, k, n, d_buf, capacity, written, stream);
}

template <typename Index>
KernelStatus EliasFanoDecodeCuda(const uint8_t* d_buf, size_t size, uint64_t expected_n,
                                 Index* d_out, size_t capacity, uint64_t* d_count,
                                 uint32_t* d_status, void* d_temp, size_t* temp_bytes,
                                 cudaStream_t stream) {
  return EfDecodeImpl(d_buf, size, expected_n, d_out, capacity, d_count, d_status, d_temp,
                      temp_bytes, stream);
}

// Each entry point for the two index widths of scape_kernels.cuh.
template KernelStatus IndicesToBitmapCuda(const uint32_t*, size_t, uint64_t, uint64_t*,
                                          cudaStream_t);
template KernelStatus IndicesToBitmapCuda(const uint64_t*, size_t, uint64_t, uint64_t*,
                                          cudaStream_t);
template KernelStatus BitmapToIndicesCuda(const uint64_t*, uint64_t, uint32_t*, size_t, uint64_t*,
                                          uint32_t*, void*, size_t*, cudaStream_t);
template KernelStatus BitmapToIndicesCuda(const uint64_t*, uint64_t, uint64_t*, size_t, uint64_t*,
                                          uint32_t*, void*, size_t*, cudaStream_t);
template KernelStatus EliasFanoEncodeCuda(const uint32_t*, size_t, uint64_t, uint8_t*, size_t,
                                          size_t*, cudaStream_t);
template KernelStatus EliasFanoEncodeCuda(const uint64_t*, size_t, uint64_t, uint8_t*, size_t,
                                          size_t*, cudaStream_t);
template KernelStatus EliasFanoDecodeCuda(const uint8_t*, size_t, uint64_t, uint32_t*, size_t,
                                          uint64_t*, uint32_t*, void*, size_t*, cudaStream_t);
template KernelStatus EliasFanoDecodeCuda(const uint8_t*, size_t, uint64_t, uint64_t*, size_t,
                                          uint64_t*, uint32_t*, void*, size_t*, cudaStream_t);

}  // namespace cuda
}  // namespace kernels
}  // namespace scape
