// Generic sparse all-reduce of (index, value) lists, with no agreed mask: the all-gather
// method, and recursive doubling with SparCML's switch to dense once the union is dense enough.
#ifndef SCAPE_PLUGIN_COLL_SPARSE_H_
#define SCAPE_PLUGIN_COLL_SPARSE_H_

#include <cstdint>
#include <vector>

#include "plugin/coll/coll.h"
#include "scape/scape.h"

namespace scape {
namespace coll {

struct SparseResult {
  uint64_t n = 0;
  bool dense = false;
  std::vector<uint64_t> idx;  // sparse form
  std::vector<char> vals;     // sparse: nnz values; dense: n values
  uint64_t bytesSent = 0;

  size_t Nnz() const;
  void ToDense(void* out, size_t esz) const;
  void ToList(uint64_t* idxOut, void* valsOut, size_t esz) const;
};

// Collective over comm; arguments validated by the caller (sorted distinct indices < n).
Status SparseAllReduce(Runner* comm, const uint64_t* idx, const void* vals, size_t nnz, uint64_t n,
                       scapeDataType_t dtype, scapeRedOp_t op, scapeSparseAlgo_t algo,
                       SparseResult* out);

}  // namespace coll
}  // namespace scape

#endif  // SCAPE_PLUGIN_COLL_SPARSE_H_
