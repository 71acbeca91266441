// The one place where the API layer hands a validated collective to the communicator's data
// path: every collective entry point (dense in api.cc, masked and packed in api_mask.cc) ends
// here, and the data path (plugin/backend) takes it to plugin/core or a device backend, so a
// payload leaves the API layer once. (The optimizer step is not a collective call: api_optim.cc
// hands the whole step to plugin/optim, with the data path's device backend for a device step.)
#include <functional>
#include <memory>
#include <utility>

#include "plugin/api/api_internal.h"
#include "plugin/backend/masked.h"

namespace scape {
namespace api {

void NewRequest(scapeComm* comm, std::shared_ptr<PendingOp> op, scapeRequest_t* request) {
  auto* req = new scapeRequest{comm, std::move(op)};
  comm->requests.insert(req);
  *request = req;
}

Status SubmitOrRun(scapeComm* comm, const coll::CollArgs& a, scapeRequest_t* request,
                   std::function<void()> onDone) {
  std::shared_ptr<PendingOp> op;
  SCAPE_RETURN_IF_ERROR(
      comm->data->host()->Run(a, nullptr, request ? &op : nullptr, std::move(onDone)));
  if (request) NewRequest(comm, std::move(op), request);
  return Status::Ok();
}

Status RouteAndRun(scapeComm* comm, const coll::CollArgs& a, scapeMask* mask, void* stream,
                   scapeRequest_t* request) {
  backend::Backend* b = nullptr;
  SCAPE_RETURN_IF_ERROR(comm->data->Route(a, &b));
  std::shared_ptr<PendingOp> op;
  std::shared_ptr<PendingOp>* async = request ? &op : nullptr;
  if (mask) {
    SCAPE_RETURN_IF_ERROR(backend::MaskedAllReduce(*b, *mask->impl, a, stream, async));
  } else {
    SCAPE_RETURN_IF_ERROR(b->Admit(a, stream, async != nullptr));
    SCAPE_RETURN_IF_ERROR(b->Run(a, stream, async));
  }
  if (request) NewRequest(comm, std::move(op), request);
  return Status::Ok();
}

void ReleaseData(scapeComm* comm) {
  if (!comm->data) return;
  comm->data->Release(comm->impl ? comm->impl->config().timeoutMs : kDefaultTimeoutMs);
}

}  // namespace api
}  // namespace scape
