"""CPU-only patches for megatron-core 0.8.0 on this machine (Debian's torch 1.13 without CUDA),
imported by run_patched.py before examples/megatron_core_scape.py runs. Neither the example
nor scape.integrations.megatron carries them: on a GPU node megatron-core runs as it is.

What megatron-core 0.8.0 does that a CPU-only torch cannot:

1. ``DotProductAttention.forward`` runs its attention dropout inside
   ``tensor_parallel.get_cuda_rng_tracker().fork()`` whenever sequence parallelism is off,
   and ``CudaRNGStatesTracker.fork`` reads and sets the CUDA generator's state
   (``torch.cuda.get_rng_state``), and raises when no state was added (adding one,
   ``model_parallel_cuda_manual_seed``, needs CUDA too). Patched: without CUDA, ``fork``
   runs the block on torch's default (CPU) generator.
2. ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()`` (used by the
   tensor-parallel linear layers' all-gather buffers, allocated even at TP = 1 by some paths).
   Patched: without CUDA, the buffer is a CPU tensor.
3. ``ParamAndGradBuffer.__init__`` (megatron.core.distributed.param_and_grad_buffer, behind
   Megatron's ``DistributedDataParallel``) allocates its flat gradient buffer on
   ``torch.cuda.current_device()``. Only the example's dense baseline (Megatron's own DDP
   gradient all-reduce, ``--dense-baseline``) builds one. Patched: without CUDA, that module's
   ``torch`` is a view of torch whose ``cuda.current_device()`` is "cpu" (everything else is
   torch's own).
4. ``forward_backward_no_pipelining`` (megatron.core.pipeline_parallel.schedules, what
   ``get_forward_backward_func()`` returns at PP = 1) counts tokens in
   ``torch.zeros([], dtype=torch.int, device="cuda")``. Patched: without CUDA, that module's
   ``torch`` is a view of torch whose ``zeros`` makes a CPU tensor where "cuda" was asked.

Each patch applies only when ``torch.cuda.is_available()`` is False, and checks that the
function it replaces still exists (so a megatron-core that moved it fails here, loudly).
"""
from __future__ import annotations

import contextlib
import operator
from functools import reduce

import torch


def _apply() -> None:
    if torch.cuda.is_available():
        return
    from megatron.core import utils
    from megatron.core.tensor_parallel import random as mrandom

    tracker = getattr(mrandom, "CudaRNGStatesTracker", None)
    if tracker is None or not hasattr(tracker, "fork"):
        raise RuntimeError("cpu_patches_megatron: megatron.core.tensor_parallel.random."
                           "CudaRNGStatesTracker.fork not found (megatron-core changed): "
                           "update this patch")

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        yield  # no CUDA generator to switch to: the block draws from the CPU generator

    tracker.fork = fork

    buf = getattr(utils, "GlobalMemoryBuffer", None)
    if buf is None or not hasattr(buf, "get_tensor"):
        raise RuntimeError("cpu_patches_megatron: megatron.core.utils.GlobalMemoryBuffer."
                           "get_tensor not found (megatron-core changed): update this patch")

    def get_tensor(self, tensor_shape, dtype, name):
        need = reduce(operator.mul, tensor_shape, 1)
        have = self.buffer.get((name, dtype))
        if have is None or have.numel() < need:
            self.buffer[(name, dtype)] = torch.empty(need, dtype=dtype, requires_grad=False)
        return self.buffer[(name, dtype)][0:need].view(*tensor_shape)

    buf.get_tensor = get_tensor

    from megatron.core.distributed import param_and_grad_buffer as pgb

    if getattr(pgb, "torch", None) is not torch:
        raise RuntimeError("cpu_patches_megatron: megatron.core.distributed."
                           "param_and_grad_buffer no longer imports torch as `torch` "
                           "(megatron-core changed): update this patch")

    class _CpuCuda:
        """torch.cuda, except that the current device is the CPU."""

        @staticmethod
        def current_device():
            return "cpu"

        def __getattr__(self, name):
            return getattr(torch.cuda, name)

    pgb.torch = _torch_view(cuda=_CpuCuda())

    from megatron.core.pipeline_parallel import schedules

    if getattr(schedules, "torch", None) is not torch:
        raise RuntimeError("cpu_patches_megatron: megatron.core.pipeline_parallel.schedules "
                           "no longer imports torch as `torch` (megatron-core changed): "
                           "update this patch")

    def zeros(*size, **kw):
        if str(kw.get("device", "")).startswith("cuda"):
            kw["device"] = "cpu"
        return torch.zeros(*size, **kw)

    schedules.torch = _torch_view(zeros=zeros)


def _torch_view(**overrides):
    """A module that is torch except for `overrides` (for one megatron module's `torch`)."""
    import types

    view = types.ModuleType("torch")
    view.__dict__["__getattr__"] = lambda name: getattr(torch, name)
    for k, v in overrides.items():
        setattr(view, k, v)
    return view


_apply()
