"""Glue for training frameworks: Hugging Face Trainer (:mod:`scape.integrations.hf`),
accelerate and plain loops (this module). See docs/frameworks.md, "Hugging Face Trainer,
accelerate and plain loops".

:class:`scape.optim.ScapeAdamS` owns the data-parallel exchange, so a framework around it must
not average gradients itself. The helpers here do the three things every route needs:

- :func:`ensure_process_group`: the torch process group frameworks expect (gloo, from the
  launcher's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as ``python -m scape.launch`` and
  torchrun set them); the SCAPE communicator rendezvouses beside it at MASTER_PORT + 1.
- :func:`keep_gradients_local`: a DistributedDataParallel wrapper (accelerate and Trainer add
  one) keeps each rank's own gradients: a communication hook that sends nothing replaces its
  gradient all-reduce.
- :func:`distributed_sampler`: each rank reads its own shard of the data, with or without a
  torch process group.

None of this imports transformers or accelerate.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch

__all__ = ["ensure_process_group", "keep_gradients_local", "local_gradients_hook",
           "distributed_sampler", "communicator", "skip_bool_buffers_in_ddp"]


def ensure_process_group(backend: str = "gloo", timeout_s: float = 1800.0) -> bool:
    """Creates torch's default process group from the launcher's environment (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT: ``python -m scape.launch``, torchrun) when none
    exists and WORLD_SIZE > 1. Returns True when it created one. The group carries only what
    the framework itself sends (its logging, its barriers, the sampler's agreement); gradients
    go through ScapeAdamS. Rendezvous at MASTER_ADDR:MASTER_PORT (the SCAPE communicator uses
    MASTER_PORT + 1)."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return False
    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if k not in os.environ:
            raise RuntimeError(f"ensure_process_group: {k} is not set; start the ranks with "
                               f"`python3 -m scape.launch -n N script.py` or torchrun")
    dist.init_process_group(backend, init_method="env://", rank=int(os.environ["RANK"]),
                            world_size=size, timeout=timedelta(seconds=timeout_s))
    return True


def communicator(timeout_ms: Optional[int] = None) -> Any:
    """The SCAPE communicator of the launcher's ranks (:meth:`scape.Communicator.from_env`)."""
    from ..comm import Communicator

    if timeout_ms is None and os.environ.get("SCAPE_TIMEOUT_MS"):
        timeout_ms = int(os.environ["SCAPE_TIMEOUT_MS"])
    return Communicator.from_env(timeout_ms=timeout_ms)


def local_gradients_hook(state, bucket):  # no annotations: DDP checks them
    """A DistributedDataParallel communication hook that sends nothing: each rank's bucket
    keeps this rank's own gradients (not averaged, not divided), which ScapeAdamS exchanges
    sparsely in its step. ``state`` may be a dict whose ``"calls"`` and ``"bytes"`` count the
    buckets and bytes that were kept local."""
    buf = bucket.buffer()
    if isinstance(state, dict):
        state["calls"] = state.get("calls", 0) + 1
        state["bytes"] = state.get("bytes", 0) + buf.numel() * buf.element_size()
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def keep_gradients_local(model: Any) -> Any:
    """Stops a DistributedDataParallel wrapper (``torch.nn.parallel.DistributedDataParallel``,
    as accelerate's ``prepare`` and Trainer make on several ranks) from all-reducing gradients:
    registers :func:`local_gradients_hook` (no dense all-reduce, no division: backward leaves
    this rank's gradients in the optimizer's flat buffer). Call it once, after wrapping and
    before the first backward. A model that is not DDP-wrapped is returned unchanged. Returns
    the model; ``model._scape_local_grads`` counts the buckets kept local."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        if getattr(model, "_scape_local_grads", None) is None:
            model._scape_local_grads = {"calls": 0, "bytes": 0}
            model.register_comm_hook(model._scape_local_grads, local_gradients_hook)
    return model


def skip_bool_buffers_in_ddp(module: Any) -> Any:
    """Tells DistributedDataParallel not to broadcast the module's bool buffers (e.g. GPT-2's
    causal masks, constant): gloo on torch 1.x has no bool type, so wrapping such a model
    fails with "Invalid scalar type". Call it on the unwrapped module before DDP wraps it
    (:class:`scape.integrations.hf.ScapeTrainer` does). Returns `module`."""
    from torch.nn.parallel import DistributedDataParallel

    names = [n for n, b in module.named_buffers() if b.dtype == torch.bool]
    if names:
        old = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, sorted(set(old) | set(names)))
    return module


def distributed_sampler(dataset: Any, comm: Any = None, *, shuffle: bool = True, seed: int = 0,
                        drop_last: bool = False) -> "torch.utils.data.DistributedSampler":
    """A ``torch.utils.data.DistributedSampler`` giving this rank its shard of `dataset`,
    without a torch process group: rank and size come from `comm` (a
    :class:`scape.Communicator`) or else the launcher's RANK / WORLD_SIZE. Call
    ``sampler.set_epoch(epoch)`` every epoch, as with torch's."""
    from torch.utils.data import DistributedSampler

    if comm is not None:
        rank, size = comm.rank, comm.size
    else:
        rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=shuffle,
                              seed=seed, drop_last=drop_last)
