/* A program outside the SCAPE tree: built against an installed SCAPE through find_package(scape)
 * or pkg-config (tests/packaging/run_packaging_test.sh). It checks that the header it compiled
 * against and the library it loaded agree on the version, then runs a one-rank all-reduce over
 * loopback. Prints "consumer ok <version>" on success. */
#include <scape/scape.h>
#include <stdio.h>
#include <string.h>

#define CHECK(call)                                                                              \
  do {                                                                                           \
    scapeResult_t r_ = (call);                                                                   \
    if (r_ != scapeSuccess) {                                                                    \
      fprintf(stderr, "%s: %s (%s)\n", #call, scapeGetErrorString(r_), scapeGetLastError(NULL)); \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)

int main(void) {
  int version = 0;
  CHECK(scapeGetVersion(&version));
  if (version != SCAPE_VERSION_CODE) {
    fprintf(stderr, "header says %d, library says %d\n", SCAPE_VERSION_CODE, version);
    return 1;
  }
  char expect[32];
  snprintf(expect, sizeof(expect), "%d.%d.%d", SCAPE_MAJOR, SCAPE_MINOR, SCAPE_PATCH);
  if (strcmp(expect, SCAPE_VERSION_STRING) != 0) {
    fprintf(stderr, "SCAPE_VERSION_STRING %s != %s\n", SCAPE_VERSION_STRING, expect);
    return 1;
  }

  scapeUniqueId id;
  CHECK(scapeGetUniqueId(&id));
  scapeConfig_t cfg = SCAPE_CONFIG_INITIALIZER;
  cfg.timeoutMs = 20000;
  scapeComm_t comm = NULL;
  CHECK(scapeCommInitRankConfig(&comm, 1, id, 0, &cfg));
  float x[5] = {1.f, 2.f, 3.f, 4.f, 5.f};
  CHECK(scapeAllReduce(x, x, 5, scapeFloat32, scapeSum, NULL, comm, NULL));
  CHECK(scapeCommDestroy(comm));
  if (x[4] != 5.f) {
    fprintf(stderr, "one-rank sum changed the data: %g\n", (double)x[4]);
    return 1;
  }
  printf("consumer ok %s\n", SCAPE_VERSION_STRING);
  return 0;
}
