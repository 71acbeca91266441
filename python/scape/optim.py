"""``ScapeAdamS``: the library's SCAPE-AdamS step as a ``torch.optim.Optimizer``.

The optimizer owns the data-parallel gradient exchange: do **not** all-reduce gradients
yourself (no DistributedDataParallel, no ``all_reduce`` of ``.grad``). Each rank runs forward
and backward on its own data, then ``optimizer.step()`` averages what must be averaged (the
new momentum at the agreed mask, values only) and updates the parameters identically on every
rank. See docs/python.md and docs/frameworks.md.
"""
from __future__ import annotations

import ctypes
import warnings
from ctypes import (POINTER, Structure, byref, c_double, c_float, c_int, c_int64, c_size_t,
                    c_uint, c_uint8, c_uint64, c_void_p)
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch

from . import _lib
from .comm import Communicator
from .errors import SUCCESS, InvalidUsageError, bad_arg
from .types import DataType, MaskEncoding, Ownership, to_enum

__all__ = ["ScapeAdamS", "StepInfo", "dense_by_default"]

OPTIM_CONFIG_MAGIC = 0x5CA90
NUM_PHASES = 7
PHASES = ("sync_wait", "candidate", "select", "exchange", "norm", "update", "gather")
BIAS_CORRECTIONS = {"none": 0, "adams": 1, "artifact": 2}
NONFINITE = {"skip": 0, "error": 1, "ignore": 2}  # scapeOptimNonFinite_t
ENTERINGS = {"payload": 0, "segment_rms": 1, "segment_rms_masked": 2}  # scapeOptimEntering_t
CLIP_NORMS = {"recovered": 0, "staying": 1, "local": 2}  # scapeOptimClipNorm_t
DENSITY_SCHEDULES = {"geometric": 0, "linear": 1}  # scapeDensitySchedule_t


class _OptimConfig(Structure):
    _fields_ = [
        ("size", c_size_t), ("magic", c_uint), ("n", c_uint64), ("nsegments", c_int),
        ("segOffsets", POINTER(c_uint64)), ("denseFlags", POINTER(c_uint8)),
        ("ownership", c_int), ("maskOwnership", c_int), ("lr", c_float), ("beta1", c_float),
        ("beta2", c_float), ("eps", c_float), ("weightDecay", c_float),
        ("maxGradNorm", c_float), ("biasCorrection", c_int), ("density", c_double),
        ("warmupSteps", c_int64), ("payloadType", c_int), ("maskEncoding", c_int),
        ("nonFinite", c_int),
        ("entering", c_int), ("clipNorm", c_int), ("densitySchedule", c_int),
    ]


class _OptimInfo(Structure):  # scapeOptimInfo_t, versioned by size (SCAPE_OPTIM_INFO_INITIALIZER)
    MAGIC = 0x5CA91  # SCAPE_OPTIM_INFO_MAGIC
    _fields_ = [
        ("size", c_size_t), ("magic", c_uint),
        ("step", c_int64), ("density", c_double), ("nextDensity", c_double),
        ("maskCount", c_uint64), ("denseCount", c_uint64), ("maskBytes", c_uint64),
        ("payloadBytes", c_uint64), ("denseBytes", c_uint64), ("gradNorm", c_double),
        ("clipScale", c_float), ("stateBytes", c_uint64), ("maskStateBytes", c_uint64),
        ("scratchBytes", c_uint64), ("phaseSeconds", c_double * NUM_PHASES),
        # appended fields (scape.h keeps the order)
        ("controlBytes", c_uint64), ("skippedSteps", c_int64), ("maskWaitSeconds", c_double),
    ]

    def __init__(self, *args, **kw):
        # What SCAPE_OPTIM_INFO_INITIALIZER sets: the library fills at most `size` bytes.
        super().__init__(*args, **kw)
        if not self.size:
            self.size = ctypes.sizeof(_OptimInfo)
        if not self.magic:
            self.magic = _OptimInfo.MAGIC


class _StepArgs(Structure):  # scapeOptimStepArgs_t
    _fields_ = [("optim", c_void_p), ("params", c_void_p), ("paramType", c_int),
                ("grads", c_void_p), ("gradType", c_int), ("count", c_uint64)]


_declared = False


def _L() -> ctypes.CDLL:
    global _declared
    L = _lib.lib()
    if not _declared:
        missing = [f for f in ("scapeOptimConfigInit", "scapeOptimCreate", "scapeOptimStep",
                               "scapeOptimSave", "scapeOptimLoad") if not _lib.has_symbol(f)]
        if missing:
            raise InvalidUsageError(f"the loaded library ({_lib.library_path()}) has no "
                                    f"optimizer step ({', '.join(missing)} missing): rebuild it",
                                    function="ScapeAdamS")
        p = c_void_p

        def d(name, *argtypes):
            f = getattr(L, name)
            f.restype = c_int
            f.argtypes = list(argtypes)

        d("scapeOptimConfigInit", POINTER(_OptimConfig))
        d("scapeOptimCreate", POINTER(p), POINTER(_OptimConfig), p)
        d("scapeOptimDestroy", p)
        d("scapeOptimSetLr", p, c_float)
        if _lib.has_symbol("scapeOptimSetHyperparams"):
            d("scapeOptimSetHyperparams", p, c_float, c_float, c_float, c_float, c_float)
        d("scapeOptimStep", p, p, p, c_uint64)
        d("scapeOptimGetInfo", p, POINTER(_OptimInfo))
        d("scapeOptimGetMask", p, POINTER(p))
        d("scapeOptimCheckpointSize", p, POINTER(c_size_t))
        d("scapeOptimSave", p, p, c_size_t, POINTER(c_size_t))
        d("scapeOptimLoad", p, p, c_size_t)
        if _lib.has_symbol("scapeOptimStepMixed"):
            d("scapeOptimStepMixed", p, p, c_int, p, c_int, c_uint64, p)
        if _lib.has_symbol("scapeOptimStepJoint"):
            d("scapeOptimStepJoint", POINTER(_StepArgs), c_int, p)
        if _lib.has_symbol("scapeGetDeviceSupport"):
            d("scapeGetDeviceSupport", POINTER(c_int), POINTER(c_int))
        if _lib.has_symbol("scapeOptimScheduleForBudget"):
            d("scapeOptimScheduleForBudget", c_int, c_double, c_double, c_int64,
              POINTER(c_int64))
        _declared = True
    return L


def _f32(x: float) -> float:
    return c_float(x).value


def _step_hyper(group: Dict[str, Any]) -> tuple:
    """A group's per-step hyperparameters (lr, beta1, beta2, eps, weight_decay) as the fp32
    values the library holds, checked with the library's rules (the error names the key)."""
    try:
        lr = float(group["lr"])
    except (TypeError, ValueError):
        raise bad_arg("lr", f"expected a float, got {group['lr']!r}") from None
    if not (lr >= 0.0 and lr != float("inf")):
        raise bad_arg("lr", f"must be finite and >= 0, got {group['lr']!r}")
    betas = group["betas"]
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise bad_arg("betas", f"expected two floats, got {betas!r}") from None
    if not (0.0 <= _f32(b1) < 1.0 and 0.0 <= _f32(b2) < 1.0):
        raise bad_arg("betas", f"expected two values in [0, 1), got {betas!r}")
    out = [lr, b1, b2]
    for k in ("eps", "weight_decay"):
        try:
            v = float(group[k])
        except (TypeError, ValueError):
            raise bad_arg(k, f"expected a float, got {group[k]!r}") from None
        if not (v >= 0.0 and v != float("inf")):
            raise bad_arg(k, f"must be finite and >= 0, got {group[k]!r}")
        out.append(v)
    return tuple(_f32(v) for v in out)


# -- mixed precision and device tensors ------------------------------------------------------

# torch dtype of the parameters -> the library's scapeDataType_t
_PARAM_TYPES = {torch.float32: int(DataType.FLOAT32), torch.bfloat16: int(DataType.BFLOAT16),
                torch.float16: int(DataType.FLOAT16)}

# Checkpoint layout (plugin/optim/optim_checkpoint.cc): a header whose u32 at byte 8 is the
# format version and at byte 12 its own size (144 bytes up to version 3, 160 in version 4), and
# whose u16 at byte 108 is the type the master weights shadow (0: none). Versions 1-3: momentum
# and residual (n f32 each), then the n f32 master weights when there are masters; version 4
# (packed momentum): the residual (n f32), then the masters, then the momentum at the mask.
_CK_MIN_HEADER = 144  # every version so far


def _checkpoint_masters(blob: torch.Tensor, n: int) -> Optional[torch.Tensor]:
    """The fp32 master weights inside a library checkpoint (a copy), or None without masters."""
    if blob.numel() < _CK_MIN_HEADER:
        return None
    b = blob.detach().cpu().contiguous()
    version = int(b[8:12].view(torch.int32)[0])
    header = int(b[12:16].view(torch.int32)[0])
    mt = int(b[108:110].view(torch.int16)[0])
    lo = header + (4 if version >= 4 else 8) * n
    if mt == 0 or header < _CK_MIN_HEADER or b.numel() < lo + 4 * n:
        return None
    return b[lo:lo + 4 * n].clone().view(torch.float32)


def _checkpoint_state(blob: torch.Tensor, n: int,
                      mask_indices: Callable[[], Any]) -> Dict[str, Any]:
    """Dense CPU copies of what a library checkpoint holds (docs/FORMATS.md section 6): the
    step counter, the momentum (``exp_avg``, n fp32, 0 outside the mask), the error-feedback
    residual (n fp32) and the fp32 master weights (or None). ``mask_indices()`` gives the
    optimizer's current mask positions in mask order, where a version-4 checkpoint keeps the
    momentum without positions of its own."""
    b = blob.detach().cpu().contiguous()
    out: Dict[str, Any] = {"step": 0, "exp_avg": torch.zeros(n), "residual": torch.zeros(n),
                           "master": None}
    if b.numel() < _CK_MIN_HEADER:
        return out
    i64 = lambda off: int(b[off:off + 8].view(torch.int64)[0])  # noqa: E731
    f32 = lambda off, k: b[off:off + 4 * k].view(torch.float32).clone()  # noqa: E731
    version = int(b[8:12].view(torch.int32)[0])
    header = int(b[12:16].view(torch.int32)[0])
    out["step"] = i64(56)
    masters = int(b[108:110].view(torch.int16)[0]) != 0
    if version < 4:  # dense momentum, then the residual, then the masters
        out["exp_avg"] = f32(header, n)
        out["residual"] = f32(header + 4 * n, n)
        if masters:
            out["master"] = f32(header + 8 * n, n)
        return out
    out["residual"] = f32(header, n)
    off = header + 4 * n
    if masters:
        out["master"] = f32(off, n)
        off += 4 * n
    km, own = i64(144), i64(152)
    values = f32(off, km)
    if own:
        pos = b[off + 4 * km:off + 12 * km].clone().view(torch.int64)
    else:
        import numpy as np

        pos = torch.from_numpy(np.asarray(mask_indices(), dtype=np.int64))
    if km and pos.numel() == km:
        out["exp_avg"][pos] = values
    return out


class _StateView:
    """``optimizer.state``: a read-only mapping from each parameter to a dict of CPU tensors
    (see :attr:`ScapeAdamS.state`). Built on access from the library checkpoint of the
    parameter's group, cached until the group's state changes.

    Read-only means no assignment may change the state (it lives in the library; restore it
    with :meth:`ScapeAdamS.load_state_dict`). An assignment that changes nothing is accepted
    and ignored: ``state[p] = v`` where `v` is a mapping with exactly the keys of
    ``state[p]`` and equal values. Tensors are compared on the CPU (same shape and dtype,
    ``torch.equal``), so a copy of the state moved to another device with equal values counts
    as nothing changed: frameworks that move every optimizer's state to the training device
    and back (PyTorch Lightning's ``_optimizers_to_device`` in its strategies' setup and
    teardown: ``optimizer.state[p] = moved``) work unchanged. Anything else (another key set,
    a different value, a tensor of another dtype or shape, a key that is not a parameter of
    this optimizer) raises ``TypeError`` naming what differs; ``del state[p]`` always
    raises."""

    def __init__(self, opt: "ScapeAdamS") -> None:
        self._opt = opt
        self._cache: Dict[int, Any] = {}
        self._index: Optional[tuple] = None

    def _where(self, p: Any):
        groups = self._opt._groups
        if self._index is None or self._index[0] != len(groups):
            self._index = (len(groups), {id(q): (g, i) for g in groups
                                         for i, q in enumerate(g.params)})
        return self._index[1].get(id(p), (None, -1))

    def _group_state(self, g: "_Group") -> Dict[str, Any]:
        if g.handle is None:
            return {"step": 0, "exp_avg": torch.zeros(g.n), "residual": torch.zeros(g.n),
                    "master": None}
        info = g.info()
        # the state changes only in a step (completed or skipped) and in load_state_dict
        key = (info["step"], info["skipped_steps"], self._opt._loads)
        hit = self._cache.get(id(g))
        if hit is not None and hit[0] == key:
            return hit[1]
        st = _checkpoint_state(g.save(), g.n, g.mask_indices)
        self._cache[id(g)] = (key, st)
        return st

    def __getitem__(self, p: Any) -> Dict[str, Any]:
        import types

        g, i = self._where(p)
        if g is None:
            raise KeyError("not a parameter of this optimizer")
        st = self._group_state(g)
        a, b = g.offsets[i], g.offsets[i + 1]
        shape = g.params[i].shape
        out = {"step": torch.tensor(float(st["step"])),
               "exp_avg": st["exp_avg"][a:b].view(shape),
               "residual": st["residual"][a:b].view(shape)}
        if st["master"] is not None:
            out["master_param"] = st["master"][a:b].view(shape)
        return types.MappingProxyType(out)  # type: ignore[return-value]

    def get(self, p: Any, default: Any = None) -> Any:
        return self[p] if p in self else default

    def __contains__(self, p: Any) -> bool:
        return self._where(p)[0] is not None

    def __iter__(self):
        for g in self._opt._groups:
            yield from g.params

    def keys(self):
        return list(iter(self))

    def items(self):
        return [(p, self[p]) for p in self]

    def values(self):
        return [self[p] for p in self]

    def __len__(self) -> int:
        return sum(len(g.params) for g in self._opt._groups)

    def __setitem__(self, p: Any, v: Any) -> None:
        from collections.abc import Mapping

        ro = ("ScapeAdamS.state is read-only: the state lives in the library (use "
              "load_state_dict to restore it); an assignment is accepted only when it changes "
              "nothing")
        if p not in self:
            raise TypeError(f"{ro}, and the key is not a parameter of this optimizer")
        if not isinstance(v, Mapping):
            raise TypeError(f"{ro}: state[p] must stay a mapping with the keys "
                            f"{sorted(self[p])}, got {type(v).__name__}")
        cur = self[p]
        if set(v.keys()) != set(cur.keys()):
            raise TypeError(f"{ro}: the new value has the keys {sorted(map(str, v.keys()))}, "
                            f"state[p] has {sorted(cur.keys())}")
        for k, a in cur.items():
            b = v[k]
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                        and a.shape == b.shape and a.dtype == b.dtype
                        and torch.equal(a.detach().cpu(), b.detach().cpu()))
            else:
                same = bool(a == b)
            if not same:
                what = (f"{b.dtype} {tuple(b.shape)} on {b.device}"
                        if isinstance(b, torch.Tensor) else type(b).__name__)
                raise TypeError(f"{ro}: state[p][{k!r}] would change (new value: {what}; "
                                f"equal values of the same dtype and shape, on any device, "
                                f"are accepted)")
        # equal on the CPU: nothing changes (a device move of equal values included)

    def __delitem__(self, p: Any) -> None:
        raise TypeError("ScapeAdamS.state is read-only: the state lives in the library and "
                        "every parameter keeps its entry; del optimizer.state[p] is refused "
                        "(use load_state_dict to restore a state)")

    def __repr__(self) -> str:
        return f"<ScapeAdamS state of {len(self)} parameters (read-only)>"


def _cuda_built() -> bool:
    L = _L()
    if not _lib.has_symbol("scapeGetDeviceSupport"):
        return False
    built, avail = c_int(0), c_int(0)
    if L.scapeGetDeviceSupport(byref(built), byref(avail)) != SUCCESS:
        return False
    return bool(built.value)


def _group_grad_dtype(param_dtype: torch.dtype, grad_dtype: Any) -> torch.dtype:
    """The flat gradient's dtype: the parameters' (None), or float32 for 16-bit parameters."""
    if grad_dtype is None or grad_dtype == param_dtype:
        return param_dtype
    if grad_dtype == torch.float32 and param_dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    raise bad_arg("grad_dtype", f"{grad_dtype!r} with {param_dtype} parameters: expected None "
                                f"(the parameters' dtype) or torch.float32 for bfloat16/float16 "
                                f"parameters")


def _group_placement(params: List[torch.Tensor], master_weights: Optional[bool]):
    """(device, dtype, masters) of a group's parameters; raises naming the argument for mixed
    devices or dtypes, unsupported dtypes, and master_weights that cannot apply."""
    if not params:
        return torch.device("cpu"), torch.float32, False
    dev, dt = params[0].device, params[0].dtype
    for p in params[1:]:
        if p.device != dev:
            raise bad_arg("params", f"a parameter group mixes devices ({dev} and {p.device}): "
                                    f"put each device's parameters in their own group",
                          type_error=True)
        if p.dtype != dt:
            raise bad_arg("params", f"a parameter group mixes dtypes ({dt} and {p.dtype}): "
                                    f"put each dtype's parameters in their own group",
                          type_error=True)
    if dev.type not in ("cpu", "cuda"):
        raise bad_arg("params", f"ScapeAdamS needs CPU or CUDA parameters, got {dev}",
                      type_error=True)
    if dt not in _PARAM_TYPES:
        raise bad_arg("params", f"ScapeAdamS needs float32, bfloat16 or float16 parameters, "
                                f"got {dt} on {dev}", type_error=True)
    if dev.type == "cuda" and not _cuda_built():
        raise bad_arg("params", f"parameters on {dev}, but the loaded library "
                                f"({_lib.library_path()}) was built without CUDA",
                      type_error=True)
    sixteen = dt != torch.float32
    if master_weights is None:
        masters = sixteen
    elif bool(master_weights) and not sixteen:
        raise bad_arg("master_weights", "True with float32 parameters: fp32 parameters are "
                                        "their own master weights (use None or False)")
    elif not bool(master_weights) and sixteen:
        raise bad_arg("master_weights", f"False with {dt} parameters: the update needs fp32 "
                                        f"master weights for 16-bit parameters (use None or "
                                        f"True)")
    else:
        masters = bool(master_weights)
    return dev, dt, masters


class StepInfo(dict):
    """What one parameter group's optimizer did in the last step (``scapeOptimGetInfo``), as a
    dict with keys: step, density, next_density, mask_count, dense_count, mask_bytes,
    payload_bytes, dense_bytes, control_bytes (the sharded step's all-gather of the norm
    partials), bytes_sent (the sum of the four), grad_norm, clip_scale, state_bytes,
    mask_state_bytes, scratch_bytes, phase_seconds (a dict by phase name), skipped_steps (steps
    skipped for non-finite gradients since construction; a skipped step leaves ``step``),
    mask_wait_seconds (of phase_seconds["sync_wait"], the time the step blocked on the previous
    step's mask sync: the part of the sync not hidden behind the work between the steps)."""


def dense_by_default(param: torch.Tensor) -> bool:
    """The default rule for always-dense tensors: 1-D (and 0-D) parameters, i.e. norms and
    biases, as the SCAPE authors' artifact does by name (layernorm / rmsnorm / bias)."""
    return param.dim() <= 1


class _Group:
    """The library optimizer of one parameter group, its flat parameter and gradient buffers,
    and the views the group's parameters and gradients are."""

    def __init__(self, opt: "ScapeAdamS", group: Dict[str, Any]) -> None:
        self.params: List[torch.Tensor] = list(group["params"])
        self.handle: Optional[int] = None
        self.comm = opt._comm
        self.index = len(opt._groups)  # this group's position in param_groups (for messages)
        self.siblings = opt._groups  # every group (the list grows with add_param_group)
        sizes = [p.numel() for p in self.params]
        self.n = int(sum(sizes))
        self.offsets = [0]
        for s in sizes:
            self.offsets.append(self.offsets[-1] + s)
        rule = opt._dense_rule
        gd = group.get("dense")
        self.dense = [bool(gd) if gd is not None else bool(rule(p)) for p in self.params]
        self.device, self.dtype, self.masters = _group_placement(self.params,
                                                                 group.get("master_weights"))
        self.grad_dtype = _group_grad_dtype(self.dtype, group.get("grad_dtype"))
        # fp32 gradients of 16-bit parameters: Megatron-LM's main_grad (torch keeps p.grad in
        # the parameter's dtype, so they cannot be p.grad views)
        self.main_grad = self.grad_dtype != self.dtype
        self.flat = torch.empty(self.n, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros(self.n, dtype=self.grad_dtype, device=self.device)
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            self.flat[a:b].copy_(p.detach().reshape(-1))
        if opt._broadcast and self.n:
            self._broadcast_flat()
        with torch.no_grad():
            for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
                p.data = self.flat[a:b].view_as(p)
                if self.main_grad:
                    p.grad = None
                    p.main_grad = self.grad[a:b].view_as(p)
                else:
                    p.grad = self.grad[a:b].view_as(p)
        self.fixed = {k: group[k] for k in ScapeAdamS._FIXED if k in group}
        self.lr = float(group["lr"])
        # the per-step hyperparameters in force in the library, as fp32 (see set_hyper)
        self.hyper = _step_hyper(group)
        if self.n:
            self._create(group)

    def _create(self, group: Dict[str, Any]) -> None:
        L = _L()
        cfg = _OptimConfig()
        self._check(L.scapeOptimConfigInit(byref(cfg)), "scapeOptimConfigInit")
        self._offs = (c_uint64 * len(self.offsets))(*self.offsets)
        self._flags = (c_uint8 * len(self.dense))(*[1 if d else 0 for d in self.dense])
        b1, b2 = group["betas"]
        cfg.n = self.n
        cfg.nsegments = len(self.params)
        cfg.segOffsets = ctypes.cast(self._offs, POINTER(c_uint64))
        cfg.denseFlags = ctypes.cast(self._flags, POINTER(c_uint8))
        cfg.ownership = 1 if group["sharded"] else 0
        mo = group["mask_ownership"]
        cfg.maskOwnership = -1 if mo is None else int(mo)
        cfg.lr = float(group["lr"])
        cfg.beta1, cfg.beta2 = float(b1), float(b2)
        cfg.eps = float(group["eps"])
        cfg.weightDecay = float(group["weight_decay"])
        cfg.maxGradNorm = float(group["max_grad_norm"] or 0.0)
        cfg.biasCorrection = BIAS_CORRECTIONS[group["bias_correction"]]
        cfg.density = float(group["density"])
        cfg.warmupSteps = int(group["warmup_steps"])
        cfg.payloadType = int(group["payload_dtype"])
        cfg.maskEncoding = int(group["mask_encoding"])
        cfg.nonFinite = NONFINITE[group["nonfinite"]]
        cfg.entering = ENTERINGS[group["entering"]]
        cfg.clipNorm = CLIP_NORMS[group["clip_norm"]]
        cfg.densitySchedule = DENSITY_SCHEDULES[group["density_schedule"]]
        h = c_void_p()
        self._check(L.scapeOptimCreate(byref(h), byref(cfg),
                                       self.comm._check_alive("scapeOptimCreate")),
                    "scapeOptimCreate")
        self.handle = h.value
        # the communicator destroys (or, on abort, forgets) it before itself
        self.comm._masks.add(self)

    def _broadcast_flat(self) -> None:
        """Rank 0's initial parameters to every rank. Non-CPU-fp32 buffers travel as a CPU fp32
        copy (16-bit values widen and narrow back exactly); once, at construction."""
        if self.device.type == "cpu" and self.dtype == torch.float32:
            self.comm.broadcast(self.flat, root=0)
            return
        tmp = self.flat.detach().to(device="cpu", dtype=torch.float32)
        self.comm.broadcast(tmp, root=0)
        self.flat.copy_(tmp)

    def _sync_main_grads(self) -> None:
        """grad_dtype=float32 with 16-bit parameters: ``p.main_grad`` are fp32 views into the
        flat gradient; a ``p.grad`` that autograd left (in the parameter's dtype) is added into
        ``p.main_grad`` (exactly: widening is exact) and set to None."""
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            if p.data_ptr() != self.flat[a:b].data_ptr() or p.data.shape != p.shape:
                self.flat[a:b].copy_(p.detach().reshape(-1))
                p.data = self.flat[a:b].view_as(p)
            mg = getattr(p, "main_grad", None)
            view = self.grad[a:b]
            if mg is None or mg.data_ptr() != view.data_ptr() or mg.shape != p.shape:
                if mg is not None:
                    view.copy_(mg.reshape(-1))
                p.main_grad = view.view_as(p)
            if p.grad is not None:
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                view.add_(g.reshape(-1).to(self.grad_dtype))
                p.grad = None

    def _lib_step(self, L: ctypes.CDLL) -> int:
        """The library step on the flat buffers: scapeOptimStep for CPU fp32 parameters,
        scapeOptimStepMixed otherwise (16-bit parameters with fp32 masters held by the library;
        CUDA buffers on the current stream of their device, enqueued without a host wait)."""
        if self.device.type == "cpu" and self.dtype == torch.float32:
            return L.scapeOptimStep(self.handle, self.flat.data_ptr(), self.grad.data_ptr(),
                                    self.n)
        if not _lib.has_symbol("scapeOptimStepMixed"):
            raise InvalidUsageError(f"the loaded library ({_lib.library_path()}) has no "
                                    f"scapeOptimStepMixed: rebuild it", function="ScapeAdamS")
        t, gt = _PARAM_TYPES[self.dtype], _PARAM_TYPES[self.grad_dtype]
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                stream = torch.cuda.current_stream(self.device).cuda_stream
                return L.scapeOptimStepMixed(self.handle, self.flat.data_ptr(), t,
                                             self.grad.data_ptr(), gt, self.n, stream or None)
        return L.scapeOptimStepMixed(self.handle, self.flat.data_ptr(), t, self.grad.data_ptr(),
                                     gt, self.n, None)

    def master_weights(self) -> Optional[torch.Tensor]:
        """A CPU fp32 copy of the group's master weights (None without masters or before the
        first step). Reads the library checkpoint: a host wait for device state."""
        if self.handle is None or not self.masters:
            return None
        return _checkpoint_masters(self.save(), self.n)

    def _forget(self) -> None:  # the communicator was aborted: the library freed it
        self.handle = None

    def _check(self, code: int, fn: str) -> None:
        if code != SUCCESS:
            raise self.comm._error(code, fn)

    def set_hyper(self, hyper: tuple) -> None:
        """Pushes (lr, beta1, beta2, eps, weight_decay) to the library when any differs from
        what is in force (one local call, scapeOptimSetHyperparams)."""
        if self.handle is None or hyper == self.hyper:
            return
        L = _L()
        if not _lib.has_symbol("scapeOptimSetHyperparams"):  # an older library: lr only
            if self.hyper is not None and hyper[1:] != self.hyper[1:]:
                raise InvalidUsageError(f"the loaded library ({_lib.library_path()}) can only "
                                        f"change lr between steps: rebuild it",
                                        function="ScapeAdamS.step")
            return  # step() sets lr
        self._check(L.scapeOptimSetHyperparams(self.handle, *hyper), "scapeOptimSetHyperparams")
        self.hyper = hyper
        self.lr = hyper[0]

    def check_placement(self) -> None:
        """Raises naming the parameter when one no longer has the dtype or device its group was
        built with (``model.double()``, ``model.to(...)`` after the optimizer): copying it back
        would silently undo the conversion."""
        for i, p in enumerate(self.params):
            if p.dtype != self.dtype or p.device != self.device:
                raise bad_arg("params", f"param group {self.index}, parameter {i} (shape "
                                        f"{tuple(p.shape)}) is now {p.dtype} on {p.device}, "
                                        f"but ScapeAdamS holds it as {self.dtype} on "
                                        f"{self.device}: convert the model (model.double(), "
                                        f"model.to(...)) before building the optimizer",
                              type_error=True)

    def mask_indices(self) -> Any:
        """The current mask's positions in mask order (numpy uint64; local)."""
        import numpy as np

        L = _lib.lib()
        m, k = c_void_p(), c_uint64()
        self._check(_L().scapeOptimGetMask(self.handle, byref(m)), "scapeOptimGetMask")
        self._check(L.scapeMaskGetCount(m, byref(k)), "scapeMaskGetCount")
        out = np.empty(k.value, dtype=np.uint64)
        if k.value:
            self._check(L.scapeMaskGetIndices(m, out.ctypes.data_as(POINTER(c_uint64)),
                                              k.value), "scapeMaskGetIndices")
        return out

    def sync_views(self) -> None:
        """Re-points parameters and gradients that user code replaced (``p.grad = None``,
        ``p.data = ...``) at the flat buffers, copying their values in (a None gradient is
        zero). A parameter whose dtype or device changed is an error (:meth:`check_placement`):
        the first group checks every group, so that a step raises before any group steps."""
        for g in (self.siblings if self.index == 0 else [self]):
            g.check_placement()
        if self.main_grad:
            return self._sync_main_grads()
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            if p.data_ptr() != self.flat[a:b].data_ptr() or p.data.shape != p.shape:
                self.flat[a:b].copy_(p.detach().reshape(-1))
                p.data = self.flat[a:b].view_as(p)
            g = p.grad
            if g is None:
                self.grad[a:b].zero_()
                p.grad = self.grad[a:b].view_as(p)
            elif g.data_ptr() != self.grad[a:b].data_ptr() or g.shape != p.shape:
                if g.is_sparse:
                    g = g.to_dense()
                self.grad[a:b].copy_(g.reshape(-1))
                p.grad = self.grad[a:b].view_as(p)

    def set_lr(self, lr: float) -> None:
        if self.handle is not None and lr != self.lr:
            self._check(_L().scapeOptimSetLr(self.handle, float(lr)), "scapeOptimSetLr")
            self.lr = lr

    def step(self, lr: float) -> None:
        if self.handle is None:
            return
        L = _L()
        self.set_lr(lr)
        self.comm._check_alive("scapeOptimStep")
        self._check(self._lib_step(L), "scapeOptimStep" if self.dtype == torch.float32 and
                    self.device.type == "cpu" else "scapeOptimStepMixed")

    def step_args(self) -> "_StepArgs":
        """This group as a member of a joint step (scapeOptimStepArgs_t)."""
        return _StepArgs(self.handle, self.flat.data_ptr(), int(_PARAM_TYPES[self.dtype]),
                         self.grad.data_ptr(), int(_PARAM_TYPES[self.grad_dtype]), self.n)

    def info(self) -> StepInfo:
        if self.handle is None:
            return StepInfo(step=0, bytes_sent=0, mask_bytes=0, payload_bytes=0,
                            dense_bytes=0, control_bytes=0, density=1.0, next_density=1.0,
                            mask_count=0, skipped_steps=0)
        i = _OptimInfo()
        self._check(_L().scapeOptimGetInfo(self.handle, byref(i)), "scapeOptimGetInfo")
        return StepInfo(
            step=int(i.step), density=float(i.density), next_density=float(i.nextDensity),
            mask_count=int(i.maskCount), dense_count=int(i.denseCount),
            mask_bytes=int(i.maskBytes), payload_bytes=int(i.payloadBytes),
            dense_bytes=int(i.denseBytes), control_bytes=int(i.controlBytes),
            bytes_sent=int(i.maskBytes + i.payloadBytes + i.denseBytes + i.controlBytes),
            grad_norm=float(i.gradNorm), clip_scale=float(i.clipScale),
            state_bytes=int(i.stateBytes), mask_state_bytes=int(i.maskStateBytes),
            scratch_bytes=int(i.scratchBytes), skipped_steps=int(i.skippedSteps),
            phase_seconds={PHASES[k]: float(i.phaseSeconds[k]) for k in range(NUM_PHASES)},
            mask_wait_seconds=float(i.maskWaitSeconds))

    def save(self) -> torch.Tensor:
        if self.handle is None:
            return torch.zeros(0, dtype=torch.uint8)
        L = _L()
        size = c_size_t()
        self._check(L.scapeOptimCheckpointSize(self.handle, byref(size)),
                    "scapeOptimCheckpointSize")
        buf = torch.empty(size.value, dtype=torch.uint8)
        written = c_size_t()
        self._check(L.scapeOptimSave(self.handle, buf.data_ptr(), size.value, byref(written)),
                    "scapeOptimSave")
        return buf[:written.value].clone()

    def load(self, blob: torch.Tensor, lr: float) -> None:
        if self.handle is None:
            return
        blob = blob.detach().to(torch.uint8).contiguous()
        self._check(_L().scapeOptimLoad(self.handle, blob.data_ptr() if blob.numel() else None,
                                        blob.numel()), "scapeOptimLoad")
        # the checkpoint's hyperparameters are now in force; make the group's lr the one used
        self._check(_L().scapeOptimSetLr(self.handle, float(lr)), "scapeOptimSetLr")
        self.lr = lr
        self.hyper = None  # unknown: the next step pushes the group's values

    def destroy(self) -> None:
        if self.handle is not None:
            h, self.handle = self.handle, None
            self.comm._masks.discard(self)
            if self.comm.alive:
                self._check(_L().scapeOptimDestroy(h), "scapeOptimDestroy")


class ScapeAdamS(torch.optim.Optimizer):
    r"""SCAPE-AdamS: AdamS whose first moment is exchanged sparsely through agreed masks.

    Every step runs, inside the library (``scapeOptimStep``): the wait for the mask chosen
    last step, the candidate ``c = b1*m + (1-b1)*g + e`` with error feedback ``e``, the top-k
    selection of the next mask on this rank's owned part (synchronised in the background), one
    values-only average of the payload, gradient recovery, optional global-norm clipping and
    the AdamS update with decoupled weight decay. Parameters end every step bit-identical on
    every rank. At ``density=1`` it is dense AdamS.

    Each parameter group's parameters are flattened into one buffer of their dtype on their
    device: after construction
    ``p.data`` and ``p.grad`` are views into it, so backward writes gradients straight into
    the buffer the library reads (no copy per step). Keep them that way: ``zero_grad()`` zeroes
    the buffer; ``zero_grad(set_to_none=True)`` sets ``p.grad`` to None (a None gradient steps
    as zero); a parameter or gradient that user code replaces is copied back in at the next
    step. A parameter whose dtype or device changed after construction is an error at the
    next step; a parameter given twice is refused.

    ``optimizer.state[p]`` is torch's per-parameter state, read-only: ``step``, ``exp_avg``
    (momentum, dense, 0 outside the mask), ``residual`` (this rank's error feedback) and, with
    master weights, ``master_param``, as CPU copies decoded from the library checkpoint.
    :meth:`consolidate_state_dict` lets one rank save every rank's state (Hugging Face
    Trainer's single ``optimizer.pt``).

    Args:
        params: parameters or parameter groups (dicts), as for any torch optimizer. CPU or
            CUDA tensors of float32, bfloat16 or float16; every parameter of a group on the
            same device with the same dtype (else ``InvalidArgumentError`` naming ``params``).
            A group may set any keyword below except ``comm``. CUDA parameters: the step is
            enqueued on ``torch.cuda.current_stream(device)`` (``scapeOptimStepMixed`` with
            that stream) and returns without a host synchronisation, except where the C API
            waits (scape.h: the first step of 16-bit parameters copies them to the host once to
            make the masters; ``max_grad_norm > 0`` waits for the norm; the next mask's
            positions). Gradients have the parameters' dtype (torch's rule), or fp32 with
            ``grad_dtype``.
        comm: the :class:`scape.Communicator` of the data-parallel ranks.
        lr: learning rate; read from each param group at every step, so LR schedulers and
            manual changes of ``group["lr"]`` take effect.
        betas: (b1, b2), default (0.9, 0.95).
        eps: added outside the square root.
        weight_decay: decoupled (``theta *= 1 - lr*wd`` on every coordinate).
        density: target fraction of each sparse tensor exchanged per step (0 < density <= 1).
        warmup_steps: density warm-up from 1.0 to ``density`` over this many steps, in the
            shape ``density_schedule`` (0: fixed density from step 1; step 0 is always dense;
            1 is the same as 0). The density of step t is rho(t) = 1 at t = 0, the ramp for
            0 < t < W, ``density`` from W on (scape.h: scapeDensitySchedule_t). The default
            0 is what the issue-42 study found best at 0.01 (a 100-step ramp cost 0.3 nats
            there; at 0.1 a ramp over 70% of the run helped): docs/ALGORITHM.md 4.10a.
        warmup_fraction: the same warm-up over this fraction of ``total_steps`` (the authors'
            artifact ramps over the first 10% of training): ``warmup_steps`` becomes
            ``round(warmup_fraction * total_steps)``. A float in [0, 1]; needs
            ``total_steps`` and excludes a non-zero ``warmup_steps``. Kept in checkpoints as
            the step count it resolves to.
        total_steps: the planned number of optimizer steps, for ``warmup_fraction`` and
            ``density_budget`` (Hugging Face's ``ScapeTrainer`` passes its ``max_steps``). An
            int > 0.
        density_schedule: the warm-up's shape: ``"geometric"`` (default), rho(t) =
            density^(t/W), the authors' ramp; or ``"linear"``, rho(t) = 1 - (1 - density) t/W,
            which stays dense longer and sends more bytes for the same W. Kept in checkpoints.
        density_budget: the byte-budget form: the average density over ``total_steps`` (step 0
            and the warm-up included; a float in (0, 1]), from which ``warmup_steps`` follows:
            the longest warm-up of this shape whose average is at most the budget
            (``scapeOptimScheduleForBudget``). The payload a run sends is about the budget
            times the sparse parameters times ``total_steps`` values, so a total of B payload
            bytes is ``density_budget = B / (total_steps * sparse_params * value_bytes)``.
            Needs ``total_steps``; excludes ``warmup_fraction`` and a different non-zero
            ``warmup_steps``; below what a fixed density sends it is refused (the message says
            the floor).
        max_grad_norm: clip the recovered (averaged) gradient to this global L2 norm over
            every parameter group and rank (0: off), as ``torch.nn.utils.clip_grad_norm_`` over
            all parameters does (the groups step together, ``scapeOptimStepJoint``); the
            pre-clip norm of the last step is :attr:`grad_norm`. One value for every group (a
            group that sets another is refused). Do not clip raw gradients yourself.
        bias_correction: "none" (the AdamS paper, default), "adams" or "artifact".
        payload_dtype: dtype of the exchanged values: torch.float32, torch.bfloat16,
            torch.float16, or the 8-bit floats "e4m3" / "e5m2" (torch.float8_e4m3fn /
            torch.float8_e5m2 where torch has them), which move with one shared power-of-two
            scale per step agreed by every rank (one extra 4-byte all-reduce). The rounding
            error goes to the residual (error feedback).
        sharded: ZeRO-1 style: each rank updates only the masked positions it owns, then the
            updated values are all-gathered (same bits as replicated).
        mask_encoding: "auto", "bitmap", "indices", "elias_fano" or "delta_varint".
        mask_ownership: how mask selection is partitioned between ranks: None (default:
            "segments" replicated, "shards" sharded), "segments" or "shards". Sharded and
            replicated state give the same bits when this is the same.
        dense: None (default: 1-D parameters are always dense, see
            :func:`dense_by_default`), a callable ``param -> bool``, or a collection of the
            parameters to keep dense (all others sparse). A group's ``"dense": True/False``
            overrides it for that group.
        broadcast_parameters: broadcast rank 0's initial parameters to every rank at
            construction (default True), so all ranks start identical.
        nonfinite: what a step does when some rank's gradients (of any group: one value for
            every group) hold an inf or NaN: "skip"
            (default, as Megatron-LM and DeepSpeed do: every rank skips the step, nothing of
            the parameters or the optimizer state changes, ``info()[i]["skipped_steps"]``
            counts it), "error" (every rank raises ``scape.InvalidArgumentError`` naming the
            rank; nothing changes) or "ignore" (no check: a non-finite gradient reaches the
            parameters; saves one read of the gradients and an 8-byte all-gather per step).
        master_weights: None (default: fp32 master weights for bfloat16/float16 parameters,
            none for float32), True (16-bit parameters only) or False (float32 only). With
            masters the library holds an fp32 copy of the parameters (4 more bytes per
            parameter), runs the update on it, and writes the 16-bit parameters, rounded to
            nearest even, in the same pass (Megatron-LM's mixed-precision optimizer, DeepSpeed's
            bf16 optimizer). The masters start from the parameters at the first step and are
            in :meth:`state_dict`.
        grad_dtype: None (default: gradients in the parameters' dtype, ``p.grad`` views into
            the flat gradient) or torch.float32 with bfloat16/float16 parameters: fp32
            gradients as Megatron-LM's ``main_grad``: ``p.main_grad`` are fp32 views into the
            flat gradient (accumulate into them, e.g. from backward hooks); a ``p.grad`` that
            autograd leaves is added into ``p.main_grad`` (exactly) at the next ``step()`` or
            ``zero_grad()`` and set to None. ``zero_grad()`` zeroes ``main_grad``.
        entering: the AdamS denominator of a coordinate entering the mask (its previous
            momentum is 0): "payload" (the paper's form, default: it moves
            ``lr*(1-b1)/sqrt(1-b2)`` whatever residual it carries) or "segment_rms" (from the
            mean square of the recovered gradient over the coordinates of the same tensor that
            stay in the mask, so the residual moves it in proportion; capped at 100 lr; issue
            23, docs/ALGORITHM.md section 4.13) or "segment_rms_masked" ("segment_rms" with
            Deep Gradient Compression's momentum factor masking adapted to AdamS: the momentum
            the entering coordinate keeps is clamped to one step's worth at its tensor's scale,
            ``|m| <= (1-b1)*sqrt(v)``, because the entering update already delivered its
            residual; issue 30, docs/ALGORITHM.md section 4.14).
        clip_norm: which coordinates ``max_grad_norm`` measures (the factor always scales the
            whole recovered gradient): "recovered" (default: every masked coordinate, as
            ``clip_grad_norm_`` over the averaged gradient) or "staying" (only the coordinates
            that stay in the mask, previous momentum non-zero: an entering coordinate's
            accumulated residual does not shrink what the exchange delivers; issue 30,
            docs/ALGORITHM.md section 4.7) or "local" (Deep Gradient Compression's local
            clipping: each rank clips its own gradient, over all groups, to ``max_grad_norm``
            before it enters the residual and the exchange, and the recovered gradient is not
            clipped; no wire bytes. ``info()``'s ``grad_norm`` and ``clip_scale`` are then this
            rank's).

    One library optimizer (and one exchange per step) is created per parameter group, so
    groups may differ in every hyperparameter but ``max_grad_norm`` and ``nonfinite``, which
    act on all groups at once: the groups step together (one global gradient norm, one skip
    decision). ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` are read from each param group at every step, as torch optimizers do, so
    schedulers that change them work (``OneCycleLR`` with ``cycle_momentum=True`` cycles
    beta1); every rank must set the same values. The other keywords are fixed at construction
    (changing one raises at the next step).

    Mixed precision with ``torch.cuda.amp.GradScaler``: ``scaler.scale(loss).backward()``,
    ``scaler.step(optimizer)``, ``scaler.update()``. ``scaler.step`` unscales the gradients in
    place through ``param_groups`` (they are views into the flat buffer the library reads) and
    calls ``step()`` only when they are finite on this rank; see docs/python.md for the rule
    every rank must follow.
    """

    # torch's GradScaler hands itself to step() (grad_scaler=...) instead of skipping the call
    # on the ranks that found an inf: see _amp_skip.
    _step_supports_amp_scaling = True

    _FIXED = ("density", "warmup_steps", "warmup_fraction", "total_steps", "max_grad_norm",
              "bias_correction", "payload_dtype", "sharded", "mask_ownership", "mask_encoding",
              "dense", "nonfinite", "master_weights", "grad_dtype", "entering", "clip_norm",
              "density_schedule", "density_budget")

    def __init__(self, params: Iterable[Any], comm: Communicator, lr: float = 1e-3,
                 betas: Sequence[float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, density: float = 0.01, warmup_steps: int = 0,
                 max_grad_norm: float = 0.0, bias_correction: str = "none",
                 payload_dtype: Union[torch.dtype, str] = torch.float32, sharded: bool = False,
                 mask_encoding: Union[MaskEncoding, str, int] = "auto",
                 mask_ownership: Union[None, Ownership, str, int] = None,
                 dense: Union[None, Callable[[torch.Tensor], bool], Iterable[torch.Tensor]] = None,
                 broadcast_parameters: bool = True, nonfinite: str = "skip",
                 master_weights: Optional[bool] = None,
                 grad_dtype: Optional[torch.dtype] = None, entering: str = "payload",
                 clip_norm: str = "recovered", warmup_fraction: Optional[float] = None,
                 total_steps: Optional[int] = None, density_schedule: str = "geometric",
                 density_budget: Optional[float] = None) -> None:
        if not isinstance(comm, Communicator):
            raise bad_arg("comm", f"expected a scape.Communicator, got {type(comm).__name__}",
                          type_error=True)
        self._comm = comm
        self._broadcast = bool(broadcast_parameters)
        if dense is None:
            self._dense_rule: Callable[[torch.Tensor], bool] = dense_by_default
        elif callable(dense):
            self._dense_rule = dense
        else:
            ids = {id(p) for p in dense}
            self._dense_rule = lambda p: id(p) in ids
        self._groups: List[_Group] = []
        self._ready = False
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        density=density, warmup_steps=warmup_steps, max_grad_norm=max_grad_norm,
                        bias_correction=bias_correction, payload_dtype=payload_dtype,
                        sharded=sharded, mask_encoding=mask_encoding,
                        mask_ownership=mask_ownership, dense=None, nonfinite=nonfinite,
                        master_weights=master_weights, grad_dtype=grad_dtype, entering=entering,
                        clip_norm=clip_norm, warmup_fraction=warmup_fraction,
                        total_steps=total_steps, density_schedule=density_schedule,
                        density_budget=density_budget)
        super().__init__(params, defaults)
        self._loads = 0  # load_state_dict calls (the state view's cache key)
        self._consolidated: Optional[Dict[str, Any]] = None  # consolidate_state_dict's result
        # torch's per-parameter dict, read-only here: the state lives in the library
        self.state = _StateView(self)  # type: ignore[assignment]
        self._ready = True
        #: The L2 norm of the recovered gradient over every group and rank before clipping, in
        #: the last step (what torch.nn.utils.clip_grad_norm_ returns, for the averaged
        #: gradient): a float, NaN for a skipped step, None before the first step and for CUDA
        #: parameters without clipping (not computed: it would cost a host wait).
        self.grad_norm: Optional[float] = None
        #: The factor max_grad_norm applied to that gradient in the last step (1.0: none).
        self.clip_scale: float = 1.0
        for g in self.param_groups:
            self._groups.append(_Group(self, g))
        self._check_joint()

    # -- groups --------------------------------------------------------------------------

    @staticmethod
    def _normalise(group: Dict[str, Any]) -> None:
        if len({id(p) for p in group["params"]}) != len(group["params"]):
            # torch only warns here; a parameter cannot be two views of one flat buffer
            raise bad_arg("params", "some parameters appear more than once in a parameter "
                                    "group")
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise bad_arg("params", f"expected tensors, got {type(p).__name__}",
                              type_error=True)
            if p.device.type not in ("cpu", "cuda") or p.dtype not in _PARAM_TYPES:
                raise bad_arg("params", f"ScapeAdamS needs CPU or CUDA float32, bfloat16 or "
                                        f"float16 parameters, got {p.dtype} on {p.device}",
                              type_error=True)
            if p.is_sparse:
                raise bad_arg("params", "sparse parameters are not supported", type_error=True)
        try:
            lr = float(group["lr"])
        except (TypeError, ValueError):
            raise bad_arg("lr", f"expected a float, got {group['lr']!r}") from None
        if not lr >= 0.0 or lr != lr:
            raise bad_arg("lr", f"must be >= 0, got {group['lr']!r}")
        betas = group["betas"]
        if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise bad_arg("betas", f"expected two values in [0, 1), got {betas!r}")
        group["betas"] = (float(betas[0]), float(betas[1]))
        for k in ("eps", "weight_decay", "max_grad_norm"):
            v = group[k]
            if v is None and k == "max_grad_norm":
                group[k] = 0.0
                continue
            if not float(v) >= 0.0:
                raise bad_arg(k, f"must be >= 0, got {v!r}")
        d = float(group["density"])
        if not 0.0 < d <= 1.0:
            raise bad_arg("density", f"must be in (0, 1], got {group['density']!r}")
        w = group["warmup_steps"]
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise bad_arg("warmup_steps", f"expected an int >= 0, got {w!r}")
        total = group.get("total_steps")
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or
                                  total <= 0):
            raise bad_arg("total_steps", f"expected None or an int > 0, got {total!r}")
        frac = group.get("warmup_fraction")
        if frac is not None:
            try:
                f = float(frac)
            except (TypeError, ValueError):
                raise bad_arg("warmup_fraction", f"expected a float in [0, 1], got "
                                                 f"{frac!r}") from None
            if not 0.0 <= f <= 1.0:
                raise bad_arg("warmup_fraction", f"expected a float in [0, 1], got {frac!r}")
            if total is None:
                raise bad_arg("total_steps", "warmup_fraction needs total_steps (the planned "
                                             "number of optimizer steps)")
            if w and w != int(round(f * total)):
                raise bad_arg("warmup_steps", f"give warmup_steps or warmup_fraction, not both "
                                              f"(got {w} and {frac!r})")
            group["warmup_steps"] = int(round(f * total))
        ds = group.get("density_schedule", "geometric")
        if not isinstance(ds, str) or ds.lower() not in DENSITY_SCHEDULES:
            raise bad_arg("density_schedule", f"{ds!r} is not one of "
                                              f"{', '.join(DENSITY_SCHEDULES)}")
        group["density_schedule"] = ds = ds.lower()
        budget = group.get("density_budget")
        if budget is not None:
            try:
                bf = float(budget)
            except (TypeError, ValueError):
                raise bad_arg("density_budget", f"expected None or a float in (0, 1] (the "
                                                f"average density over total_steps), got "
                                                f"{budget!r}") from None
            if isinstance(budget, bool) or not 0.0 < bf <= 1.0:
                raise bad_arg("density_budget", f"expected None or a float in (0, 1] (the "
                                                f"average density over total_steps), got "
                                                f"{budget!r}")
            if total is None:
                raise bad_arg("total_steps", "density_budget needs total_steps (the planned "
                                             "number of optimizer steps)")
            if frac is not None:
                raise bad_arg("density_budget", "give density_budget or warmup_fraction, not "
                                                "both")
            L = _L()
            if not _lib.has_symbol("scapeOptimScheduleForBudget"):
                raise InvalidUsageError(f"the loaded library ({_lib.library_path()}) has no "
                                        f"scapeOptimScheduleForBudget: rebuild it",
                                        function="ScapeAdamS")
            out = c_int64()
            rc = L.scapeOptimScheduleForBudget(DENSITY_SCHEDULES[ds], d, bf, int(total),
                                               byref(out))
            if rc != 0:
                msg = _lib.last_error(None)
                raise bad_arg("density_budget", f"{bf!r} for density {d!r} over {total} steps: "
                                                f"{msg}")
            if w and w != out.value:
                raise bad_arg("warmup_steps", f"give warmup_steps or density_budget, not both "
                                              f"(got {w}; the budget gives {out.value})")
            group["warmup_steps"] = int(out.value)
        bc = str(group["bias_correction"]).lower()
        if bc not in BIAS_CORRECTIONS:
            raise bad_arg("bias_correction", f"{group['bias_correction']!r} is not one of "
                                             f"{', '.join(BIAS_CORRECTIONS)}")
        group["bias_correction"] = bc
        en = str(group.get("entering", "payload")).lower()
        if en not in ENTERINGS:
            raise bad_arg("entering", f"{group.get('entering')!r} is not one of "
                                      f"{', '.join(ENTERINGS)}")
        group["entering"] = en
        cn = str(group.get("clip_norm", "recovered")).lower()
        if cn not in CLIP_NORMS:
            raise bad_arg("clip_norm", f"{group.get('clip_norm')!r} is not one of "
                                       f"{', '.join(CLIP_NORMS)}")
        group["clip_norm"] = cn
        pd = group["payload_dtype"]
        names = {}
        for t in DataType:
            if t.is_payload:
                names.update({t.label: t, t.short: t})
                if hasattr(torch, t.label):
                    names[getattr(torch, t.label)] = t
        if isinstance(pd, DataType) and pd.is_payload:
            group["payload_dtype"] = pd
        elif isinstance(pd, str) and pd.lower() in names:
            group["payload_dtype"] = names[pd.lower()]
        elif not isinstance(pd, str) and pd in names:
            group["payload_dtype"] = names[pd]
        else:
            raise bad_arg("payload_dtype", f"{pd!r} is not float32, bfloat16, float16, "
                                           f"e4m3 or e5m2")
        group["mask_encoding"] = to_enum(MaskEncoding, group["mask_encoding"], "mask_encoding")
        nf = group["nonfinite"]
        if not isinstance(nf, str) or nf.lower() not in NONFINITE:
            raise bad_arg("nonfinite", f"{nf!r} is not 'skip', 'error' or 'ignore'")
        group["nonfinite"] = nf.lower()
        group["sharded"] = bool(group["sharded"])
        if group["mask_ownership"] is not None:
            group["mask_ownership"] = to_enum(Ownership, group["mask_ownership"],
                                              "mask_ownership")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a group (collective after construction: every rank must add the same group,
        which creates its library optimizer)."""
        super().add_param_group(param_group)
        try:
            self._normalise(self.param_groups[-1])
            if len(self.param_groups) > 1:
                self._check_joint()  # before the group's library optimizer exists
        except Exception:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            raise
        if self._ready:
            self._groups.append(_Group(self, self.param_groups[-1]))
            self._check_joint()  # the device, known once the group is built

    # -- the step ------------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeroes the flat gradient buffers (one fill per group); the gradients stay views into
        the buffer the library reads (no copy at the next step).

        ``set_to_none=True`` does what torch does: every ``p.grad`` becomes None (backward then
        allocates new gradients); the next :meth:`step` treats a None gradient as zero and
        copies the others into the flat buffer, re-pointing ``p.grad`` at it (one copy of the
        gradients per step). With ``grad_dtype=torch.float32`` ``p.main_grad`` is zeroed
        either way."""
        if set_to_none:
            for g in self._groups:
                if g.main_grad:
                    g.grad.zero_()
                for p in g.params:
                    p.grad = None
            return
        for g in self._groups:
            if g.main_grad:  # grad_dtype=float32: autograd's p.grad is dropped, not added
                for p in g.params:
                    p.grad = None
            g.grad.zero_()
            g.sync_views()

    def _amp_skip(self, scaler: Any) -> bool:
        """``GradScaler.step(optimizer)``: unscales the gradients (unless ``unscale_`` was
        called already), agrees over the communicator whether any rank found an inf or NaN
        (one all-reduce of one float), and records the agreed answer as this rank's
        ``found_inf`` so that ``scaler.update()`` moves the scale identically on every rank.
        True: every rank skips this step (GradScaler's rule, made collective)."""
        states = getattr(scaler, "_per_optimizer_states", None)
        if states is None or not hasattr(scaler, "unscale_"):
            raise bad_arg("grad_scaler", f"expected a torch GradScaler, got "
                                         f"{type(scaler).__name__}", type_error=True)
        st = states[id(self)]
        if not st["found_inf_per_device"]:
            scaler.unscale_(self)
        found = st["found_inf_per_device"]
        local = any(float(t.sum()) != 0.0 for t in found.values())
        flag = torch.tensor([1.0 if local else 0.0], dtype=torch.float32)
        self._comm.all_reduce(flag, op="max")
        agreed = float(flag[0]) != 0.0
        for t in found.values():
            t.fill_(1.0 if agreed else 0.0)
        return agreed

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None,
             grad_scaler: Any = None) -> Optional[float]:
        """One SCAPE-AdamS step over every group (collective: every rank calls it). Reads each
        group's current ``lr``, ``betas``, ``eps`` and ``weight_decay``. Returns the closure's
        loss, if a closure was given. ``grad_scaler`` is passed by ``GradScaler.step`` (do not
        pass it yourself): the step is then skipped on every rank when any rank's unscaled
        gradients are not finite."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scaler is not None and self._amp_skip(grad_scaler):
            return loss
        if self._groups and all(g.handle is None for g in self._groups):
            self._comm._check_alive("ScapeAdamS.step")  # an aborted communicator says so
            raise InvalidUsageError("ScapeAdamS.step: this optimizer was destroyed (destroy(), "
                                    "or its communicator was aborted): its library state is "
                                    "gone, so a step would change nothing; build a new one")
        for pg, g in zip(self.param_groups, self._groups):
            for k, v in g.fixed.items():
                if pg.get(k) != v:
                    raise bad_arg(k, f"changed from {v!r} to {pg.get(k)!r} after construction; "
                                     f"only lr, betas, eps and weight_decay may change (the "
                                     f"library optimizer's layout and schedule are fixed)")
            hyper = _step_hyper(pg)
            g.set_hyper(hyper)
            g.set_lr(hyper[0])
            g.sync_views()
        live = [g for g in self._groups if g.handle is not None]
        if len(live) > 1 and _lib.has_symbol("scapeOptimStepJoint"):
            # One step of every group: one global norm for max_grad_norm, one skip decision.
            self._comm._check_alive("scapeOptimStepJoint")
            args = (_StepArgs * len(live))(*[g.step_args() for g in live])
            stream = None
            dev = live[0].device
            if dev.type == "cuda":
                with torch.cuda.device(dev):
                    stream = torch.cuda.current_stream(dev).cuda_stream or None
            code = _L().scapeOptimStepJoint(args, len(live), stream)
            if code != SUCCESS:
                raise self._comm._error(code, "scapeOptimStepJoint")
        else:
            for g in live:
                g.step(g.lr)
        self.grad_norm, self.clip_scale = None, 1.0
        if live:
            i = live[0].info()
            if not (live[0].device.type == "cuda" and not self.defaults["max_grad_norm"]):
                self.grad_norm = i["grad_norm"]
            self.clip_scale = i["clip_scale"]
        return loss

    def _check_joint(self) -> None:
        """Every group shares max_grad_norm and nonfinite (one global norm and one skip decision
        over all groups, scapeOptimStepJoint) and, with more than one group, the device."""
        ref = self.param_groups[0]
        for k in ("max_grad_norm", "nonfinite"):
            for i, pg in enumerate(self.param_groups[1:], 1):
                if pg[k] != ref[k]:
                    raise bad_arg(k, f"param group {i} has {k}={pg[k]!r}, group 0 {ref[k]!r}: "
                                     f"{k} applies to every group at once (one global gradient "
                                     f"norm over all groups, as torch.nn.utils.clip_grad_norm_; "
                                     f"one skip decision); set it once, in the constructor")
        devs = {g.device for g in getattr(self, "_groups", []) if g.n}
        if len(devs) > 1:
            raise bad_arg("params", f"parameter groups on several devices ({sorted(map(str, devs))}"
                                    f"): one step clips and skips every group together, so all "
                                    f"groups must be on one device")

    # -- introspection -------------------------------------------------------------------

    @property
    def comm(self) -> Communicator:
        return self._comm

    def info(self) -> List[StepInfo]:
        """One :class:`StepInfo` per parameter group: what its last step did."""
        return [g.info() for g in self._groups]

    def bytes_sent(self) -> int:
        """Bytes this rank sent in the last step, all groups (mask + payload + dense +
        control)."""
        return sum(i["bytes_sent"] for i in self.info())

    def flat_parameters(self) -> List[torch.Tensor]:
        """The flat parameter buffer of each group, in the parameters' dtype and on their
        device (the parameters are views into it)."""
        return [g.flat for g in self._groups]

    def parameter_hash(self) -> str:
        """SHA-256 of every group's flat parameters (compare it across ranks)."""
        import hashlib

        h = hashlib.sha256()
        for g in self._groups:
            f = g.flat.detach().cpu()
            if f.dtype != torch.float32:
                f = f.view(torch.int16)  # the 16-bit values' bits
            h.update(f.numpy().tobytes())
        return h.hexdigest()

    def master_weights(self) -> List[Optional[torch.Tensor]]:
        """Per group: a CPU fp32 copy of the master weights the library holds (flat, in the
        order of the group's parameters), or None for a group without masters (float32
        parameters) or before its first step. The group's 16-bit parameters are these rounded
        to nearest even after every step."""
        return [g.master_weights() for g in self._groups]

    # -- checkpoints ---------------------------------------------------------------------

    def consolidate_state_dict(self, to: Optional[int] = 0) -> None:
        """Collects every rank's optimizer state on rank `to` (collective: every rank calls
        it), as ``torch.distributed.optim.ZeroRedundancyOptimizer.consolidate_state_dict``
        does: the next :meth:`state_dict` on rank `to` then holds every rank's library
        checkpoints (``state_dict()["scape"]["ranks"]``, rank -> one uint8 tensor per group),
        so one file saved by one rank resumes every rank (:meth:`load_state_dict` on each rank
        takes its own part). The error-feedback residuals (and the mask parts) differ per rank,
        so a single rank's state cannot resume the others. One all-gather of the sizes and
        one of the checkpoints (padded to the largest) over the communicator, per group; the
        other ranks' :meth:`state_dict` stays per-rank. A step (or a load) after this call
        makes the consolidated state stale: :meth:`state_dict` then warns and returns rank
        `to`'s own state. ``to=None``: every rank gets the consolidated state (a saver per
        node)."""
        if to is not None and (isinstance(to, bool) or not isinstance(to, int)
                               or not 0 <= to < self._comm.size):
            raise bad_arg("to", f"{to!r} is not a rank of the communicator "
                                f"(0..{self._comm.size - 1})")
        size = self._comm.size
        mine = [g.save() for g in self._groups]
        parts: Dict[int, List[torch.Tensor]] = {r: [] for r in range(size)}
        for blob in mine:
            lens = torch.zeros(size, dtype=torch.int64)
            self._comm.all_gather(torch.tensor([blob.numel()], dtype=torch.int64), lens)
            words = (int(lens.max()) + 3) // 4
            pad = torch.zeros(4 * max(words, 1), dtype=torch.uint8)
            pad[:blob.numel()] = blob
            every = torch.zeros(size * pad.numel(), dtype=torch.uint8)
            self._comm.all_gather(pad.view(torch.int32), every.view(torch.int32))
            if to is None or self._comm.rank == to:
                for r in range(size):
                    k = int(lens[r])
                    parts[r].append(every[r * pad.numel():r * pad.numel() + k].clone())
        self._consolidated = ({"to": to, "mine": mine, "ranks": parts, "loads": self._loads}
                              if to is None or self._comm.rank == to else None)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's optimizer state: the param groups (hyperparameters, as torch does) and,
        per group, the library checkpoint (momentum, residual, masks, step counter,
        hyperparameters, and the fp32 master weights of 16-bit parameters; versioned and
        checksummed) as a uint8 tensor. ``state_dict()["scape"]["master_weights"]`` shows the
        masters (a CPU fp32 tensor per group, None without): a copy of what the checkpoint
        holds, which is what :meth:`load_state_dict` restores. Parameters are not included:
        save the model's state_dict as usual. Each rank saves its own, unless
        :meth:`consolidate_state_dict` was called just before: then rank `to`'s state_dict
        also holds every rank's part (``["scape"]["ranks"]``) and resumes every rank.
        Local (no communication); ``["state"]`` is empty (see :attr:`state`)."""
        view, self.state = self.state, {}  # torch packs self.state: the blobs hold it all
        try:
            sd = super().state_dict()
        finally:
            self.state = view
        blobs = [g.save() for g in self._groups]
        sd["scape"] = {
            "format": 1, "rank": self._comm.rank, "size": self._comm.size,
            "checkpoints": blobs,
            "master_weights": [_checkpoint_masters(b, g.n) if g.masters else None
                               for b, g in zip(blobs, self._groups)],
        }
        c = self._consolidated
        if c is not None:
            fresh = (c["loads"] == self._loads and len(c["mine"]) == len(blobs)
                     and all(torch.equal(a, b) for a, b in zip(c["mine"], blobs)))
            if fresh:
                sd["scape"]["ranks"] = c["ranks"]
            else:
                warnings.warn("ScapeAdamS.state_dict: the state consolidated by "
                              "consolidate_state_dict() is stale (a step or a load since): "
                              "returning this rank's state only; call "
                              "consolidate_state_dict() on every rank right before saving")
                self._consolidated = None
        for pg in sd["param_groups"]:
            pg["payload_dtype"] = int(pg["payload_dtype"])
            pg["mask_encoding"] = int(pg["mask_encoding"])
            if pg.get("mask_ownership") is not None:
                pg["mask_ownership"] = int(pg["mask_ownership"])
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores a state saved by :meth:`state_dict`: either on the same rank of a run with
        the same rank count and layout, or a consolidated one (:meth:`consolidate_state_dict`)
        that every rank loads, each taking its own part. Collective (every rank calls it). The
        ranks first agree on whether every rank has its part (one all-reduce of one float per
        rank): a consolidated state_dict that lacks some rank's part is refused on every rank
        with an ``InvalidArgumentError`` naming the rank(s), and nothing changes. Then the
        library validates every rank's checkpoint and the ranks agree before anything changes:
        if any is bad, every rank raises and nothing is changed."""
        sc = state_dict.get("scape") if isinstance(state_dict, dict) else None
        if not isinstance(sc, dict) or "checkpoints" not in sc:
            raise bad_arg("state_dict", "not a ScapeAdamS state_dict (no 'scape' entry)")
        size, rank = self._comm.size, self._comm.rank
        lacking = torch.zeros(size, dtype=torch.float32)
        ranks = sc.get("ranks")
        if ranks is not None:
            for r in range(size):
                if r not in ranks or len(ranks[r]) != len(sc["checkpoints"]):
                    lacking[r] = 1.0
        elif sc.get("rank", rank) != rank or sc.get("size", size) != size:
            # another rank's own state (e.g. rank 0's file loaded on every rank)
            lacking[rank] = 1.0
        self._comm.all_reduce(lacking, op="max")
        if float(lacking.sum()) != 0.0:
            who = [r for r in range(size) if float(lacking[r]) != 0.0]
            held = (f"the parts of ranks {sorted(ranks)}" if ranks is not None else
                    f"the own state of rank {sc.get('rank')} of {sc.get('size')}")
            raise bad_arg("state_dict", f"lacks the optimizer state of rank"
                                        f"{'s' if len(who) > 1 else ''} "
                                        f"{', '.join(map(str, who))} (of {size}; it holds "
                                        f"{held}): a state_dict saved by one rank resumes "
                                        f"every rank only when consolidate_state_dict() was "
                                        f"called on every rank before it was saved")
        if ranks is not None:
            sc = dict(sc, checkpoints=ranks[rank], rank=rank)
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups) or len(sc["checkpoints"]) != len(self._groups):
            raise bad_arg("state_dict", f"has {len(groups)} param groups, this optimizer "
                                        f"{len(self.param_groups)}")
        for i, (saved, pg) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(pg["params"]):
                raise bad_arg("state_dict", f"param group {i} has {len(saved['params'])} "
                                            f"parameters, this optimizer {len(pg['params'])}")
        if sc.get("size") != self._comm.size or sc.get("rank") != self._comm.rank:
            # still let the library decide (it refuses on every rank together), but say why
            warnings.warn(f"state_dict was saved by rank {sc.get('rank')} of {sc.get('size')}, "
                          f"loading on rank {self._comm.rank} of {self._comm.size}")
        self._loads += 1
        for saved, pg, g, blob in zip(groups, self.param_groups, self._groups,
                                      sc["checkpoints"]):
            g.load(blob, float(saved["lr"]))
        for saved, pg in zip(groups, self.param_groups):
            for k, v in saved.items():
                if k == "params":
                    continue
                if k == "payload_dtype":
                    v = DataType(v)
                elif k == "mask_encoding":
                    v = MaskEncoding(v)
                elif k == "mask_ownership" and v is not None:
                    v = Ownership(v)
                elif k == "betas":
                    v = tuple(v)
                pg[k] = v
        for pg, g in zip(self.param_groups, self._groups):
            g.fixed = {k: pg[k] for k in self._FIXED if k in pg}
            g.lr = float(pg["lr"])

    # -- lifetime ------------------------------------------------------------------------

    def destroy(self) -> None:
        """Frees the library optimizers (before destroying the communicator). The parameters
        stay valid (they keep the flat buffers alive)."""
        for g in self._groups:
            g.destroy()

    def __del__(self) -> None:
        # Only the object that made the library optimizers frees them: a framework's wrapper
        # may be an instance of a ScapeAdamS subclass that forwards its attributes to the real
        # optimizer (Lightning's LightningOptimizer does), and dropping the wrapper must not
        # free the live optimizer's state.
        if "_groups" not in self.__dict__:
            return
        try:
            self.destroy()
        except Exception:
            pass

    def __setstate__(self, state: Dict[str, Any]) -> None:
        raise InvalidUsageError("a ScapeAdamS cannot be unpickled; build a new one and call "
                                "load_state_dict", function="ScapeAdamS")
