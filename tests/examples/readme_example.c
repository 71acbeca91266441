/* The README's example, compiled as C and run by ctest (one rank here; the same code runs on
 * any number of ranks given the id). */
#include <scape/scape.h>
#include <stdio.h>
#include <stdlib.h>

static int check(scapeResult_t r, scapeComm_t comm, const char* what) {
  if (r == scapeSuccess) return 0;
  fprintf(stderr, "%s: %s: %s\n", what, scapeGetErrorString(r), scapeGetLastError(comm));
  return 1;
}

/* One data-parallel step: dense all-reduce, then the SCAPE values-only exchange. */
static int train_step(scapeComm_t comm, float* grads, const float* stat, size_t n) {
  /* Dense, in place, averaged over ranks. mask NULL = dense; stream NULL = host memory. */
  if (check(scapeAllReduce(grads, grads, n, scapeFloat32, scapeAvg, NULL, comm, NULL), comm,
            "allreduce"))
    return 1;

  /* SCAPE: one agreed mask over the flat buffer (two segments, shards owned per rank). */
  uint64_t offsets[3] = {0, n / 2, n};
  scapeMask_t mask;
  if (check(scapeMaskCreate(&mask, n, 2, offsets, NULL, scapeOwnershipShards, scapeMaskEncodingAuto,
                            comm),
            comm, "mask create"))
    return 1;
  /* Each rank picks the top 1% of its own part; the all-gather runs in the background. */
  scapeMaskSelectNextTopk(mask, stat, 0.01);
  scapeMaskSyncStart(mask);
  /* ... forward and backward of the next step would run here ... */
  if (check(scapeMaskSyncWait(mask), comm, "mask sync")) return 1;
  scapeMaskAdvance(mask); /* the mask chosen at step t is used at step t + 1 */
  /* Only the masked positions move: values only, no indices. */
  if (check(scapeAllReduce(grads, grads, n, scapeFloat32, scapeAvg, mask, comm, NULL), comm,
            "masked allreduce"))
    return 1;
  uint64_t k = 0;
  scapeMaskGetCount(mask, &k);
  printf("masked all-reduce moved %llu of %zu values\n", (unsigned long long)k, n);
  scapeMaskDestroy(mask);
  return 0;
}

int main(void) {
  /* Rank 0 makes the id and hands it to the others (MPI_Bcast, a file, torch's store, ...);
   * with a launcher, scapeCommInitFromEnv(&comm, NULL) needs no id at all. */
  scapeUniqueId id;
  if (check(scapeGetUniqueId(&id), NULL, "unique id")) return 1;
  scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
  cfg.timeoutMs = 30000; /* fail instead of hanging on a dead peer */
  scapeComm_t comm;
  if (check(scapeCommInitRankConfig(&comm, /*nranks=*/1, id, /*rank=*/0, &cfg), NULL, "init"))
    return 1;
  size_t n = 100000;
  float* grads = malloc(n * sizeof(float));
  float* stat = malloc(n * sizeof(float));
  for (size_t i = 0; i < n; ++i) {
    grads[i] = (float)(i % 7);
    stat[i] = (float)((i * 2654435761u) % 1000);
  }
  int rc = train_step(comm, grads, stat, n);
  if (rc)
    scapeCommAbort(comm); /* tells the peers at once */
  else
    scapeCommDestroy(comm);
  free(grads);
  free(stat);
  return rc;
}
