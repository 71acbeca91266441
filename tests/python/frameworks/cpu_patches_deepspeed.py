"""CPU-only patch for DeepSpeed 0.16.4 on this machine (Debian's torch 1.13 CPU, gloo), applied
by the test harness through run_patched.py, never by scape.integrations.deepspeed or the example.

DeepSpeed picks its CPU accelerator by itself and falls back to gloo, but its torch backend
first tries to build (JIT, with a C++ compiler and ninja) the shared-memory all-reduce op
``deepspeed_shm_comm`` for intra-node CPU collectives, which is not built here
(DS_BUILD_OPS=0) and cannot be built in the test's time. Marking the op incompatible makes the
backend skip it; nothing of the gradient path uses it (the engine's gradient all-reduce is off
with ScapeAdamS, and the dense baseline's all-reduce goes through gloo). On a GPU cluster the
accelerator is CUDA, the backend NCCL, and the op is never looked at.
"""
import deepspeed.ops

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

# gloo on torch 1.x has no bfloat16 ("Invalid scalar type"), and the engine broadcasts rank 0's
# parameters at initialize: a bfloat16 model (examples/deepspeed_scape.py --bf16, ScapeAdamS's
# fp32 masters) would fail there. A broadcast moves bits only, so a bfloat16 tensor goes as
# float16 of the same bits. NCCL (a GPU cluster) and torch 2.x's gloo take bfloat16 as it is.
import torch  # noqa: E402
import torch.distributed  # noqa: E402

if int(torch.__version__.split(".")[0]) < 2:
    _broadcast = torch.distributed.broadcast

    def _broadcast_bf16_as_bits(tensor, *args, **kwargs):
        if tensor.dtype == torch.bfloat16 and torch.distributed.get_backend(
                kwargs.get("group")) == "gloo":
            return _broadcast(tensor.view(torch.float16), *args, **kwargs)
        return _broadcast(tensor, *args, **kwargs)

    torch.distributed.broadcast = _broadcast_bf16_as_bits
