#include "transport/bootstrap/launcher_env.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace scape {
namespace bootstrap {
namespace {

bool ParseInt(const char* s, long lo, long hi, long* out) {
  if (!s || !*s) return false;
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

uint64_t Fnv(const std::string& s, uint64_t h) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

Status ParseSecret(const std::string& hex, Secret* out) {
  if (hex.size() != 32)
    return InvalidArgument(
        StrFormat("SCAPE_BOOTSTRAP_SECRET has %zu characters, expected 32 hex "
                  "digits",
                  hex.size()));
  for (size_t i = 0; i < 16; ++i) {
    unsigned v = 0;
    for (int k = 0; k < 2; ++k) {
      char c = hex[2 * i + static_cast<size_t>(k)];
      unsigned d;
      if (c >= '0' && c <= '9')
        d = static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f')
        d = static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        d = static_cast<unsigned>(c - 'A' + 10);
      else
        return InvalidArgument("SCAPE_BOOTSTRAP_SECRET: not a hex digit: '" + std::string(1, c) +
                               "'");
      v = v * 16 + d;
    }
    (*out)[i] = static_cast<uint8_t>(v);
  }
  return Status::Ok();
}

}  // namespace

std::string FirstSlurmHost(const std::string& nodelist) {
  size_t comma = nodelist.find(',');
  size_t bracket = nodelist.find('[');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket))
    return nodelist.substr(0, comma);
  std::string prefix = nodelist.substr(0, bracket);
  size_t end = nodelist.find_first_of("-,]", bracket + 1);
  if (end == std::string::npos) return prefix;
  return prefix + nodelist.substr(bracket + 1, end - bracket - 1);
}

Status ReadLauncherEnv(const EnvLookup& env, LauncherInfo* out) {
  LauncherInfo li;
  long rank = -1, size = 0;
  auto pick = [&](const char* name, const char* r, const char* s) {
    if (li.launcher.empty() && env(r) && env(s)) {
      li.launcher = name;
      if (!ParseInt(env(r), 0, kMaxRanks - 1, &rank) || !ParseInt(env(s), 1, kMaxRanks, &size))
        return InvalidArgument(StrFormat("%s=%s / %s=%s: expected 0 <= rank < size <= %d", r,
                                         env(r), s, env(s), kMaxRanks));
    }
    return Status::Ok();
  };
  SCAPE_RETURN_IF_ERROR(pick("torchrun", "RANK", "WORLD_SIZE"));
  SCAPE_RETURN_IF_ERROR(pick("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"));
  SCAPE_RETURN_IF_ERROR(pick("pmi", "PMI_RANK", "PMI_SIZE"));
  SCAPE_RETURN_IF_ERROR(pick("slurm", "SLURM_PROCID", "SLURM_NTASKS"));
  if (li.launcher.empty())
    return InvalidUsage(
        "no launcher environment found: looked for RANK/WORLD_SIZE (torchrun), "
        "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (mpirun), PMI_RANK/PMI_SIZE, "
        "SLURM_PROCID/SLURM_NTASKS (srun)");
  if (rank >= size)
    return InvalidArgument(
        StrFormat("%s: rank %ld is not below the size %ld", li.launcher.c_str(), rank, size));
  li.rank = static_cast<int>(rank);
  li.nranks = static_cast<int>(size);

  // The job's identity: it seeds the default port and the default secret.
  std::string job;
  for (const char* k : {"TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE",
                        "SLURM_JOB_ID", "SLURM_STEP_ID", "MASTER_ADDR", "MASTER_PORT"})
    if (env(k)) job += std::string(k) + "=" + env(k) + ";";

  long port = 0;
  if (const char* a = env("SCAPE_BOOTSTRAP_ADDR")) {
    std::string s = a;
    size_t colon = s.rfind(':');
    if (colon == std::string::npos || !ParseInt(s.c_str() + colon + 1, 1, 65535, &port))
      return InvalidArgument(StrFormat("SCAPE_BOOTSTRAP_ADDR='%s': expected host:port", a));
    li.rootHost = s.substr(0, colon);
    if (li.rootHost.size() > 2 && li.rootHost.front() == '[' && li.rootHost.back() == ']')
      li.rootHost = li.rootHost.substr(1, li.rootHost.size() - 2);
  } else if (env("MASTER_ADDR") && env("MASTER_PORT")) {
    if (!ParseInt(env("MASTER_PORT"), 1, 65534, &port))
      return InvalidArgument(StrFormat("MASTER_PORT='%s': expected 1..65534", env("MASTER_PORT")));
    li.rootHost = env("MASTER_ADDR");
    port += 1;  // torchrun's own store listens on MASTER_PORT
  } else {
    long localSize = 0, nnodes = 0;
    bool oneHost = (ParseInt(env("OMPI_COMM_WORLD_LOCAL_SIZE"), 1, kMaxRanks, &localSize) &&
                    localSize == size) ||
                   (ParseInt(env("SLURM_NNODES"), 1, kMaxRanks, &nnodes) && nnodes == 1);
    if (oneHost) {
      li.rootHost = "127.0.0.1";
    } else if (env("SLURM_STEP_NODELIST") || env("SLURM_JOB_NODELIST")) {
      li.rootHost = FirstSlurmHost(env("SLURM_STEP_NODELIST") ? env("SLURM_STEP_NODELIST")
                                                              : env("SLURM_JOB_NODELIST"));
    } else {
      return InvalidUsage(
          StrFormat("%s: ranks span several hosts and no root address is known: "
                    "set SCAPE_BOOTSTRAP_ADDR=host:port (or MASTER_ADDR and "
                    "MASTER_PORT)",
                    li.launcher.c_str()));
    }
    if (job.empty())
      return InvalidUsage(
          "no job id in the environment to derive a bootstrap port from: set "
          "SCAPE_BOOTSTRAP_ADDR=host:port");
    port = 20000 + static_cast<long>(Fnv(job, 1469598103934665603ull) % 30000);
  }
  li.rootPort = static_cast<uint16_t>(port);

  if (const char* s = env("SCAPE_BOOTSTRAP_SECRET")) {
    SCAPE_RETURN_IF_ERROR(ParseSecret(s, &li.secret));
    li.secretFromEnv = true;
  } else {
    uint64_t a = Fnv(job + li.rootHost + std::to_string(port), 1469598103934665603ull);
    uint64_t b = Fnv(job + "scape-secret", a ^ 0x9e3779b97f4a7c15ull);
    std::memcpy(li.secret.data(), &a, 8);
    std::memcpy(li.secret.data() + 8, &b, 8);
  }
  *out = li;
  return Status::Ok();
}

}  // namespace bootstrap
}  // namespace scape
