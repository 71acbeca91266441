// Reads a launcher's environment (torchrun, Open MPI, PMI, Slurm) into what the bootstrap needs:
// rank, size, the root's host:port and the shared secret. Pure: takes a lookup function, so
// tests can feed it any environment.
#ifndef SCAPE_TRANSPORT_BOOTSTRAP_LAUNCHER_ENV_H_
#define SCAPE_TRANSPORT_BOOTSTRAP_LAUNCHER_ENV_H_

#include <functional>
#include <string>

#include "base/status.h"
#include "transport/bootstrap/bootstrap.h"

namespace scape {
namespace bootstrap {

struct LauncherInfo {
  std::string launcher;  // "torchrun", "openmpi", "pmi", "slurm"
  int rank = -1;
  int nranks = 0;
  std::string rootHost;
  uint16_t rootPort = 0;
  Secret secret{};
  bool secretFromEnv = false;
};

using EnvLookup = std::function<const char*(const char*)>;

Status ReadLauncherEnv(const EnvLookup& env, LauncherInfo* out);

// First host of a Slurm node list ("node[03-05,7],other" -> "node03").
std::string FirstSlurmHost(const std::string& nodelist);

}  // namespace bootstrap
}  // namespace scape

#endif  // SCAPE_TRANSPORT_BOOTSTRAP_LAUNCHER_ENV_H_
