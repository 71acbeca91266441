// Pure schedule math for the collective algorithms: no network, no state, unit-tested on its
// own (tests/schedule_test.cc).
#ifndef SCAPE_PLUGIN_COLL_SCHEDULE_H_
#define SCAPE_PLUGIN_COLL_SCHEDULE_H_

#include <cstddef>
#include <cstdint>

namespace scape {
namespace coll {

inline int Mod(int64_t a, int p) { return static_cast<int>(((a % p) + p) % p); }

// Balanced split of `count` elements into `parts` blocks: the first count % parts blocks get
// one element more. Offset of block i, for 0 <= i <= parts.
inline size_t BlockOffset(size_t count, int parts, int i) {
  const size_t p = static_cast<size_t>(parts), q = count / p, r = count % p;
  const size_t ui = static_cast<size_t>(i);
  return ui * q + (ui < r ? ui : r);
}
inline size_t BlockLength(size_t count, int parts, int i) {
  return BlockOffset(count, parts, i + 1) - BlockOffset(count, parts, i);
}

// Chunk c of nchunks of a block of `len` elements: [ChunkBegin(c), ChunkBegin(c + 1)).
inline size_t ChunkBegin(size_t len, size_t nchunks, size_t c) {
  return static_cast<size_t>((static_cast<unsigned __int128>(len) * c) / nchunks);
}

// The chunk when SCAPE_CHUNK_BYTES is left unset (size-aware): at most chunkBytes (its default,
// 2 MiB), but a block smaller than kAutoRingChunks such chunks is cut into about kAutoRingChunks
// chunks of at least kAutoChunkFloorBytes, so that an all-reduce of a few hundred kB to a few MB
// is pipelined too. With one 2 MiB chunk per block, a 3.3 MB all-reduce on 2 ranks ran at 1.5x
// its wire time on a rate-limited link (1.1x in 256 KiB chunks), and SCAPE 0.1's 390-550 kB
// payload at 1.25-1.35x (1.1x in 64 KiB chunks); on loopback 64 KiB chunks were as fast or
// faster from 256 kB to 4 MB (perf/RESULTS_cluster.md). Set, the variable's value is every
// chunk's size, as before.
constexpr size_t kAutoRingChunks = 8;
constexpr size_t kAutoChunkFloorBytes = size_t{64} << 10;
inline size_t AutoChunkBytes(size_t maxBlockBytes, size_t chunkBytes) {
  size_t c = maxBlockBytes / kAutoRingChunks + (maxBlockBytes % kAutoRingChunks ? 1 : 0);
  if (c < kAutoChunkFloorBytes) c = kAutoChunkFloorBytes;
  return c < chunkBytes ? c : chunkBytes;
}

// Number of pipeline chunks for blocks of at most maxBlockBytes: enough to keep each chunk
// near chunkBytes, but few enough that (steps * chunks) fits the 16-bit step field of a tag.
inline size_t RingChunks(size_t maxBlockBytes, size_t chunkBytes, int steps) {
  size_t n = chunkBytes ? (maxBlockBytes + chunkBytes - 1) / chunkBytes : 1;
  const size_t cap = steps > 0 ? (size_t{1} << 16) / static_cast<size_t>(steps) : 1;
  if (n > cap) n = cap;
  return n ? n : 1;
}

// Ring all-reduce as reduce-scatter then all-gather, 2(P-1) steps. At step t rank r:
//   reduce-scatter (t < P-1): sends block (r-t-1), receives block (r-t-2) and reduces it;
//   all-gather (u = t-(P-1)): sends block (r-u), receives block (r-u-1) as final.
// After the reduce-scatter, rank r holds the fully reduced block r.
inline int RingSendBlock(int rank, int p, int t) {
  return t < p - 1 ? Mod(int64_t{rank} - t - 1, p) : Mod(int64_t{rank} - (t - (p - 1)), p);
}
inline int RingRecvBlock(int rank, int p, int t) {
  return t < p - 1 ? Mod(int64_t{rank} - t - 2, p) : Mod(int64_t{rank} - (t - (p - 1)) - 1, p);
}

// Recursive doubling over a non-power-of-two P: the first 2*rem ranks pair up (even ranks fold
// into the odd rank above them), leaving pof2 participants.
struct RdLayout {
  int pof2;  // largest power of two <= P
  int rem;   // P - pof2
};
inline RdLayout MakeRdLayout(int p) {
  int pof2 = 1;
  while (pof2 * 2 <= p) pof2 *= 2;
  return RdLayout{pof2, p - pof2};
}
// Virtual rank of a participant, or -1 for a rank that folds its data into rank + 1.
inline int RdVirtualRank(const RdLayout& l, int rank) {
  if (rank < 2 * l.rem) return (rank % 2 == 1) ? rank / 2 : -1;
  return rank - l.rem;
}
inline int RdRealRank(const RdLayout& l, int vrank) {
  return vrank < l.rem ? vrank * 2 + 1 : vrank + l.rem;
}

}  // namespace coll
}  // namespace scape

#endif  // SCAPE_PLUGIN_COLL_SCHEDULE_H_
