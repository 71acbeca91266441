// The one place where the API layer hands a validated collective to the communicator: every
// entry point (dense in api.cc, masked in api_mask.cc, the optimizer in api_optim.cc) ends here,
// so a payload crosses from the API layer into plugin/core exactly once.
#include <functional>
#include <memory>
#include <utility>

#include "plugin/api/api_internal.h"

namespace scape {
namespace api {

Status SubmitOrRun(scapeComm* comm, const coll::CollArgs& a, scapeRequest_t* request,
                   std::function<void()> onDone) {
  std::shared_ptr<PendingOp> op;
  SCAPE_RETURN_IF_ERROR(comm->impl->Submit(a, &op, std::move(onDone)));
  if (!request) return comm->impl->Wait(op.get());
  auto* req = new scapeRequest{comm, op};
  comm->requests.insert(req);
  *request = req;
  return Status::Ok();
}

}  // namespace api
}  // namespace scape
