"""Shared by perf/gpu/gpu_train.py and perf/gpu/gpu_step.py (one process per rank, started by
``python3 -m scape.launch``): the process's device, torch.distributed groups, the SCAPE
communicator, checksums of parameters compared across ranks, and feature probes of the
installed ``scape`` (the names of docs/api_contract come from several changes; a probe says
which are there instead of failing half-way through a run on a lent GPU).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist


@dataclass
class Ctx:
    rank: int
    size: int
    device: torch.device
    meta: Any            # a gloo group for small host-side collectives (hashes, timings)
    backend: str         # the SCAPE communicator's backend: "ucx" or "nccl"


def setup(device: str, backend: str, fake_hosts: bool) -> Ctx:
    """Joins torch.distributed (NCCL on a GPU, gloo on the CPU) from the launcher's variables.
    With `fake_hosts`, every rank gets its own NCCL_HOSTID (before NCCL starts), so NCCL sees
    one host per rank and must take the network path, i.e. this library's net plugin, even
    though all ranks share one GPU (as perf/gpu/gpu_check.sh does)."""
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if fake_hosts:
        os.environ["NCCL_HOSTID"] = f"scape-fake-node-{rank}"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no GPU")
        # Every rank on the one GPU (or GPU_TRAIN_DEVICE): the ranks share it.
        torch.cuda.set_device(int(os.environ.get("GPU_TRAIN_DEVICE", "0")))
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", rank=rank, world_size=size)
        meta = dist.new_group(backend="gloo")
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=size)
        meta = dist.group.WORLD
    return Ctx(rank, size, dev, meta, backend)


def make_comm(ctx: Ctx) -> Any:
    """The SCAPE communicator from the launcher's variables. backend "nccl": the library makes
    its own NCCL communicator (scape.Communicator.from_env(backend="nccl"), helper pydev's
    change); "ucx": today's path."""
    import scape

    if ctx.backend == "ucx":
        return scape.Communicator.from_env(timeout_ms=120000)
    return scape.Communicator.from_env(backend=ctx.backend, timeout_ms=120000)


def accepts(fn: Any, kwarg: str) -> bool:
    """Whether callable `fn` takes keyword `kwarg` (feature probe of the installed scape)."""
    try:
        return kwarg in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def sync(ctx: Ctx) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def gather(ctx: Ctx, obj: Any) -> List[Any]:
    out: List[Any] = [None] * ctx.size
    dist.all_gather_object(out, obj, group=ctx.meta)
    return out


def allsum(ctx: Ctx, values: List[float]) -> List[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=ctx.meta)
    return [float(v) for v in t]


def barrier(ctx: Ctx) -> None:
    sync(ctx)
    dist.barrier(group=ctx.meta)


def tensors_sha256(tensors: List[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes (copied to the host), in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: hash the bits
            t = t.view(torch.int16)
        h.update(t.cpu().numpy().tobytes())
    return h.hexdigest()


_WEIGHTS: Dict[Any, torch.Tensor] = {}


def device_checksum(tensors: List[torch.Tensor], chunk: int = 1 << 24) -> str:
    """A position-weighted checksum of the tensors' bits, computed where they live (the step
    benchmark's 1 GiB buffers stay on the GPU): sum over i of bits[i] * w[i mod chunk] in
    int64 (wrapping), with fixed odd weights. Equal bits give equal sums; a single changed or
    moved value changes it. Not a cryptographic hash: it compares ranks, not adversaries."""
    total = None
    for t in tensors:
        t = t.detach().contiguous().reshape(-1)
        bits = {4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]
        b = t.view(bits)
        key = (b.device, chunk)
        if key not in _WEIGHTS:
            g = torch.Generator().manual_seed(0x5CA9E)
            w = torch.randint(1, 1 << 30, (chunk,), generator=g, dtype=torch.int64) * 2 + 1
            _WEIGHTS[key] = w.to(b.device)
        w = _WEIGHTS[key]
        for a in range(0, b.numel(), chunk):
            part = b[a:a + chunk].to(torch.int64)
            s = (part * w[:part.numel()]).sum()
            total = s if total is None else total + s
    return f"{int(total) & ((1 << 64) - 1):016x}" if total is not None else "0" * 16


def write_jsonl(path: str, record: Dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def env_facts(ctx: Ctx) -> Dict[str, Any]:
    import platform

    import scape

    facts: Dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "scape": getattr(scape, "__version__", "?"), "scape_file": scape.__file__,
        "scape_library": scape.library_path(), "world_size": ctx.size,
        "device": str(ctx.device), "scape_backend": ctx.backend,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if ctx.device.type == "cuda":
        p = torch.cuda.get_device_properties(ctx.device)
        facts["gpu"] = p.name
        facts["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        try:
            v = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - informational only
            facts["nccl"] = "?"
    return facts


def now() -> float:
    return time.perf_counter()


def median(xs: List[float]) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
