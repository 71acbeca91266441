#include "transport/ucx/ucx_context.h"

#include <cstring>
#include <memory>

namespace scape {
namespace transport {

Status CreateUcpContext(const UcpContextOptions& opts, ucp_context_h* out, bool* cudaMemory) {
  // Creating a context fails only for local reasons (no device, bad settings, no memory), so
  // every failure here is a system error; peer failures are mapped where they happen.
  auto err = [](const std::string& what, ucs_status_t s) {
    return SystemError(what + ": " + ucs_status_string(s));
  };
  ucp_config_t* raw = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &raw);
  if (s != UCS_OK) return err("ucp_config_read", s);
  std::unique_ptr<ucp_config_t, void (*)(ucp_config_t*)> config(raw, ucp_config_release);
  for (const auto& kv : opts.settings) {
    if (kv.second.empty()) continue;
    ucs_status_t ms = ucp_config_modify(config.get(), kv.first.c_str(), kv.second.c_str());
    if (ms != UCS_OK)
      return err(std::string(ms == UCS_ERR_NO_ELEM ? "unknown UCX setting " : "bad UCX setting ") +
                     kv.first + "=" + kv.second,
                 ms);
  }
  ucp_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | (opts.wakeup ? UCP_FEATURE_WAKEUP : 0);
  params.mt_workers_shared = opts.sharedByThreads ? 1 : 0;
  if (opts.name) {
    params.field_mask |= UCP_PARAM_FIELD_NAME;
    params.name = opts.name;
  }
  ucp_context_h ctx = nullptr;
  s = ucp_init(&params, config.get(), &ctx);
  if (s != UCS_OK) return err("ucp_init", s);
  bool cuda = false;
  ucp_context_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(ctx, &attr) == UCS_OK)
    cuda = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  *out = ctx;
  if (cudaMemory) *cudaMemory = cuda;
  return Status::Ok();
}

}  // namespace transport
}  // namespace scape
